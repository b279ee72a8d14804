"""Every registered host format through its format object, one table: fast path
== reference bit for bit, records, bytes per token, the error bound, NaN/Inf
never restoring finite, statistics, determinism and empty input."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
from tests.support.codec_inputs import DTYPES, UNIT_KINDS, assert_same_bits, make_units
from tests.support.conformance import EXPECT

NAN, INF = float("nan"), float("inf")
# (--hicache-host-dtype, model kind): every MHA format and MLA INT8.
FORMATS = [(name, "mha") for name in EXPECT] + [("int8", "mla")]
# MHA (key dim, value dim): whole groups, uneven K/V, a whole-head group (80),
# no 32-channel group (72), rotation blocks of 64 (192).
MHA_DIMS = [(64, 64), (128, 96), (72, 80), (128, 128), (64, 96), (80, 80), (192, 128)]
MHA_DIMS += [(72, 72), (256, 256)]
# One magnitude (log2) per unit: subnormal-ish to past the fp16 meta range.
MAGS = {
    torch.bfloat16: [-130, -20, -3, 0, 5, 12, 24],
    torch.float16: [-20, -3, 0, 5, 12],
}


def geometries(name, kind, dtype, ut):
    if kind == "mla":  # DeepSeek's 512 + 64 and a one-tile latent
        return [host_format_cls(name, kind)((d,), 1, ut, dtype) for d in (576, 192)]
    cls = host_format_cls(name, kind)
    out = [cls(dims, 2, ut, dtype) for dims in MHA_DIMS]
    if name == "int4c":  # and a plan layer's format (8-bit keys, k_lo)
        out += [cls(dims, 2, ut, dtype, key8_layers=(0,)).for_layer(0)
                for dims in MHA_DIMS[:4]]  # fmt: skip
    return out


def side_rows(fmt, n, seed, mags, kinds=UNIT_KINDS):
    """Per side [n, ut, heads, dim] rows, one magnitude per unit, as a strided
    view (a head and channel slice of a wider buffer)."""
    out = []
    for s, d in enumerate(fmt.dims):
        shape = (fmt.unit_tokens, fmt.head_num, d)
        x = torch.cat(
            [torch.empty(0, *shape, dtype=fmt.device_dtype)]
            + [
                make_units(seed + 7 * s + i, (1, *shape), fmt.device_dtype,
                           list(kinds), [mags[i % len(mags)]])
                for i in range(n)
            ]
        )  # fmt: skip
        wide = torch.full((n, fmt.unit_tokens, fmt.head_num + 1, d + 3), 9.0)
        wide = wide.to(fmt.device_dtype)
        wide[:, :, 1:, 1 : d + 1] = x
        out.append(wide[:, :, 1:, 1 : d + 1])
    return out


def encode_fast(fmt, rows, device="cpu"):
    """encode_into the layer-1 view of [n, 3 layers, *shape] garbage buffers
    (on CUDA: with no host sync); the other layers must keep their bytes."""
    n = rows[0].shape[0]
    bufs = {
        r.name: torch.full((n * 3 * r.nbytes,), 0x5A, dtype=torch.uint8, device=device)
        .view(r.dtype)
        .view(n, 3, *r.shape)
        for r in fmt.records
    }
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        stats = fmt.encode_into(rows, {name: b[:, 1] for name, b in bufs.items()})
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert stats.nonfinite.device.type == device
    for b in bufs.values():
        assert (b[:, 0::2].contiguous().view(torch.uint8) == 0x5A).all()
    return {name: b[:, 1] for name, b in bufs.items()}, stats


def decode_fast(fmt, records, dtype, rows, device="cpu"):
    """decode_into head slices of wider sentinel buffers (as device rows are)."""
    wide = [
        torch.full((*x.shape[:-1], x.shape[-1] + 8), -7.0, dtype=dtype, device=device)
        for x in rows
    ]
    outs = [w[..., 4:-4] for w in wide]
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        fmt.decode_into(records, outs)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    for w in wide:
        assert (w[..., :4] == -7.0).all() and (w[..., -4:] == -7.0).all()
    return outs


def stored_nonfinite(fmt, records) -> int:
    """Groups stored non-finite: NaN scales, (s, m) pairs and int4c's (L, R)
    ranges, MLA RoPE rows holding NaN/Inf."""
    bad = 0
    for name, t in records.items():
        if name.endswith("_meta") or name == "k_range":
            bad += int(torch.isnan(t[..., 0]).sum())
        elif name.endswith("scale"):
            bad += int(torch.isnan(t).sum())
        elif name == "rope":
            bad += int((~torch.isfinite(t.float())).any(-1).sum())
    return bad


def check_round_trip(fmt, rows, *, finite: bool) -> None:
    ref = fmt.encode_reference(rows)
    assert list(ref) == [r.name for r in fmt.records]  # names, L3 byte order
    for r in fmt.records:
        assert ref[r.name].shape == (len(rows[0]), *r.shape)
        assert ref[r.name].dtype == r.dtype
    before = [x.clone() for x in rows]
    out, stats = encode_fast(fmt, rows)
    for x, x0 in zip(rows, before):
        assert not x.is_contiguous() or not x.numel()
        assert_same_bits(x, x0)  # the input is read only
    for name in ref:
        assert_same_bits(out[name], ref[name])
    again, _ = encode_fast(fmt, rows)  # deterministic bytes
    for name in ref:
        assert torch.equal(again[name].view(torch.uint8), out[name].view(torch.uint8))
    assert int(stats.nonfinite) == stored_nonfinite(fmt, ref)
    for dtype in (*DTYPES, torch.float32):  # fp32: what the references compute in
        restored = fmt.decode_reference(ref, dtype)
        for got, want in zip(decode_fast(fmt, out, dtype, rows), restored):
            assert_same_bits(got, want)
    restored = fmt.decode_reference(ref, fmt.device_dtype)
    bounds = fmt.error_bound(ref, restored)
    for side, (x, r, b) in enumerate(zip(rows, restored, bounds)):
        # MLA keeps RoPE verbatim (bound 0); the rest is quantized.
        lat = getattr(fmt, "latent_dim", x.shape[-1])
        assert_same_bits(r[..., lat:], x[..., lat:])
        assert (b[..., lat:][~torch.isnan(x[..., lat:])] == 0).all()
        x, r, b = x[..., :lat], r[..., :lat], b[..., :lat]
        nan = torch.isnan(b)
        assert torch.isnan(r[~torch.isfinite(x)]).all()  # NaN/Inf never finite
        assert torch.equal(torch.isnan(r), nan)
        err = (x.double() - r.double()).abs()
        assert (err[~nan] <= b[~nan].double()).all()
        if finite:
            assert not nan.any()
        if not fmt.rotation_blocks[side]:  # rotated: amax of the rotated rows
            amax = x.double().abs()[~nan].max() if (~nan).any() else 0.0
            assert stats.amax[side].item() == float(amax)
    if finite:
        assert int(stats.nonfinite) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ut", [1, 7, 16, 64, 80])
@pytest.mark.parametrize("name,kind", FORMATS)
def test_fast_path_is_the_reference_within_the_bound(name, kind, ut, dtype):
    for fmt in geometries(name, kind, dtype, ut):
        assert fmt.bytes_per_token() == sum(r.nbytes for r in fmt.records) / ut
        plan = getattr(fmt, "key8_layers", ())  # int4c's plan layer: its bytes
        kw = {"key8_layers": plan} if plan else {}
        assert (
            type(fmt).bytes_per_token_for(fmt.dims, fmt.head_num, ut, dtype, **kw)
            == fmt.bytes_per_token()
        )
        # Every kind of unit across magnitudes, a NaN key and an Inf value.
        rows = side_rows(fmt, len(MAGS[dtype]), 0, MAGS[dtype])
        rows[0][0, 0, 0, 3] = NAN
        rows[-1][-1, ut - 1, -1, 0] = -INF
        check_round_trip(fmt, rows, finite=False)
        assert stored_nonfinite(fmt, fmt.encode_reference(rows)) >= 2
        # Rows inside the fp16 metadata range restore finite, none counted.
        check_round_trip(fmt, side_rows(fmt, 2, 50, [-10, 0, 3]), finite=True)


@pytest.mark.parametrize("name,kind", FORMATS)
@pytest.mark.parametrize("ut", [1, 16, 64])
def test_empty_input(name, kind, ut):
    (fmt, *_) = geometries(name, kind, torch.bfloat16, ut)
    rows = side_rows(fmt, 0, 0, [0])
    out, stats = encode_fast(fmt, rows)
    assert stats.amax.tolist() == [0.0] * len(fmt.sides)
    assert int(stats.nonfinite) == 0
    for name_, t in fmt.encode_reference(rows).items():
        assert t.numel() == 0 and out[name_].shape == t.shape
    assert [o.shape for o in decode_fast(fmt, out, torch.bfloat16, rows)] == [
        x.shape for x in rows
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ut", [1, 16, 64])
@pytest.mark.parametrize("name,kind", FORMATS)
def test_cuda_fast_path_is_the_cpu_reference(name, kind, ut):
    """The torch path on the GPU (true division, half-even rounding, NaN-aware
    reductions, fp16 conversions) writes the CPU reference's bytes and
    restores its bits, without a host sync."""
    for dtype in DTYPES:
        for fmt in geometries(name, kind, dtype, ut):
            rows = side_rows(fmt, len(MAGS[dtype]), 1, MAGS[dtype])
            rows[0][1, 0, 0, 7] = NAN
            ref = fmt.encode_reference(rows)
            out, _ = encode_fast(fmt, [x.cuda() for x in rows], "cuda")
            for name_ in ref:
                assert_same_bits(out[name_].cpu(), ref[name_])
            restored = decode_fast(fmt, out, dtype, rows, "cuda")
            for got, want in zip(restored, fmt.decode_reference(ref, dtype)):
                assert_same_bits(got.cpu(), want)
