"""int4c fused kernels (kv_int4c_triton) under the Triton interpreter, called
directly: every record byte and restored bit against an independent reading
of the spec (tests/support/int4c_spec.py: keys; kv_int4_codec + kv_hadamard:
the rotated values) over unit sizes (16 <= U < 32: one sub-unit; 32-token
sub-units; below 16: per-token keys), 8-bit plan layers (k_lo slots, staged
one-layer backups), BF16/FP16, NaN/Inf, host indices outside the records
and broken runs, bad arguments. Through the format object, against its
reference: tests/test_host_kernels.py."""

from __future__ import annotations

import pytest
import torch

from tests.support import int4c_spec as spec
from tests.support.kernel_cases import fill_rows

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]
BF, FP = torch.bfloat16, torch.float16


def _modules():
    from sglang.kernels.ops.kvcache import host_kv_common as hk
    from sglang.kernels.ops.kvcache import kv_int4c_triton as kc
    from sglang.srt.mem_cache.pool_host import kv_hadamard
    from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec

    return hk, kc, kv_hadamard, codec


def sub_tokens(ut: int) -> int:
    return 32 if ut % 32 == 0 else ut


def key_group(dk: int) -> int:
    return 64 if dk % 64 == 0 else 32 if dk % 32 == 0 else dk


def value_blocks(dv: int) -> tuple[int, int]:
    """(rotation block, group) of the values, as the spec sets them."""
    _, _, kv_hadamard, _ = _modules()
    group = 128 if dv % 128 == 0 else key_group(dv)
    return min(128, kv_hadamard.rotation_block(dv)), group


def host_records(units, layers, ut, H, dk, dv, n_key8) -> dict:
    """Sentinel-filled records, [units, layers, *shape] (k_lo: n_key8 layers)."""
    vg = value_blocks(dv)[1]
    shapes = {"k": ((ut, H, dk // 2), torch.uint8)}
    if ut >= 16:
        shapes["k_range"] = ((H, dk, 2), torch.float16)
        shapes["k_sub"] = ((ut // sub_tokens(ut), H, dk), torch.uint8)
    else:
        shapes["k_meta"] = ((ut, H, dk // key_group(dk), 2), torch.float16)
    shapes["v"] = ((ut, H, dv // 2), torch.uint8)
    shapes["v_meta"] = ((ut, H, dv // vg, 2), torch.float16)
    out = {}
    for name, (shape, dtype) in shapes.items():
        out[name] = torch.empty(units, layers, *shape, dtype=dtype)
    if n_key8:
        out["k_lo"] = torch.empty(units, n_key8, ut, H, dk // 2, dtype=torch.uint8)
    for t in out.values():
        t.view(torch.uint8).fill_(0x5A)
    return out


def expected(k, v, key8: bool):
    """One layer's rows [U, UT, H, D] -> (records [U, *shape], non-finite
    groups, amax (K, V)) by the spec's reading."""
    _, _, kv_hadamard, codec = _modules()
    U, ut, H, dk = k.shape
    dv = v.shape[-1]
    vb, vg = value_blocks(dv)
    rec, bad = {}, 0
    if ut >= 16:
        q, rng, sub, k_bad = spec.encode_keys(k, sub_tokens(ut), key8)
        rec["k"] = spec.pack(q >> 4 if key8 else q)
        if key8:
            rec["k_lo"] = spec.pack(q & 15)
        rec["k_range"], rec["k_sub"] = rng, sub
        kf = k.float()
        k_amax = torch.maximum(kf.amin(1).abs(), kf.amax(1).abs())[~k_bad]
        bad += int(k_bad.sum())
    else:
        kg = key_group(dk)
        groups = k.float().unflatten(-1, (dk // kg, kg))
        q, rec["k_meta"] = codec._encode_groups_reference(
            groups, -1, qmax=255 if key8 else 15
        )
        q = q.flatten(-2)
        rec["k"] = spec.pack(q >> 4 if key8 else q)
        if key8:
            rec["k_lo"] = spec.pack(q & 15)
        k_bad = torch.isnan(rec["k_meta"][..., 0])
        k_amax = groups.abs().amax(-1)[~k_bad]
        bad += int(k_bad.sum())
    vr = kv_hadamard.rotate_reference(v.float(), vb) if vb else v
    rec["v"], rec["v_meta"] = codec.encode_tokens_reference(vr, vg)
    v_bad = torch.isnan(rec["v_meta"][..., 0])
    v_amax = vr.unflatten(-1, (dv // vg, vg)).abs().amax(-1)[~v_bad]
    bad += int(v_bad.sum())
    amax = [float(a.max()) if a.numel() else 0.0 for a in (k_amax, v_amax)]
    return rec, bad, amax


def expected_decode(rec, dtype):
    _, _, kv_hadamard, codec = _modules()
    if "k_range" in rec:
        key8 = "k_lo" in rec
        q = spec.unpack(rec["k"])
        if key8:
            q = (q << 4) | spec.unpack(rec["k_lo"])
        k = spec.decode_keys(q, rec["k_range"], rec["k_sub"], dtype, key8)
    else:
        q = spec.unpack(rec["k"])
        if "k_lo" in rec:
            q = (q << 4) | spec.unpack(rec["k_lo"])
        meta = rec["k_meta"]
        groups = q.unflatten(-1, (meta.shape[-2], -1))
        k = codec._decode_groups_reference(groups, meta, -1, dtype).flatten(-2)
    y = codec.decode_tokens_reference(rec["v"], rec["v_meta"], torch.float32)
    vb = value_blocks(y.shape[-1])[0]
    top = torch.finfo(dtype).max
    v = kv_hadamard.unrotate_reference(y, vb) if vb else y
    return k, v.clamp(-top, top).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN by position."""
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and torch.equal(
        a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]
    )


def raw(t):
    return t.view(torch.int16) if t.element_size() == 2 else t


def rotation(dv, device="cpu"):
    _, _, kv_hadamard, _ = _modules()
    return {
        "rotation_blocks": (0, value_blocks(dv)[0]),
        "rotation_signs": kv_hadamard.rotation_signs(dv, device),
    }


def run_kernels(
    ut, H=2, dims=(64, 64), layers=2, key8=(), dtype=BF, n_units=2, seed=0,
    index_dtype=torch.int64, tile=None,
):  # fmt: skip
    """One backup of shuffled device rows (special rows included) into
    fragmented host units, then a restore per layer into shuffled slots,
    both against the spec's reading."""
    hk, kc, _, _ = _modules()
    dk, dv = dims
    g = torch.Generator().manual_seed(seed)
    n = n_units * ut
    size = n + 8
    sides = []
    for s, d in enumerate(dims):
        side = []
        for i in range(layers):
            x = torch.empty(size, H, d, dtype=dtype)
            fill_rows(
                x, seed * 31 + s * layers + i, torch.randperm(size, generator=g)[:8]
            )
            side.append(x)
        sides.append(side)
    dev = torch.randperm(size, generator=g)[:n]
    units = torch.randperm(2 * n_units + 1, generator=g)[:n_units]
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    out = host_records(2 * n_units + 1, layers, ut, H, dk, dv, len(key8))
    before = {name: t.clone() for name, t in out.items()}
    counters = hk.KVCounters(
        torch.zeros((), dtype=torch.int64), torch.zeros(layers, 2),
        torch.zeros((), dtype=torch.int64),
    )  # fmt: skip
    kc.encode_gather(
        (hk.DeviceLayerTable(sides[0]), hk.DeviceLayerTable(sides[1])),
        dev.to(index_dtype), out, host_idx.to(index_dtype), counters=counters,
        key8_layers=key8, tile=tile, **rotation(dv),
    )  # fmt: skip
    bad_total, amax = 0, torch.zeros(layers, 2)
    others = torch.ones(2 * n_units + 1, dtype=torch.bool)
    others[units] = False
    for layer in range(layers):
        k = sides[0][layer][dev].view(n_units, ut, H, dk)
        v = sides[1][layer][dev].view(n_units, ut, H, dv)
        plan = layer in key8
        want, bad, stats = expected(k, v, plan)
        bad_total += bad
        amax[layer] = torch.tensor(stats)
        one = {n_: t[:, layer] for n_, t in out.items() if n_ != "k_lo"}
        if plan:
            one["k_lo"] = out["k_lo"][:, sorted(key8).index(layer)]
        assert set(one) == set(want)
        for name, rec in want.items():
            assert torch.equal(raw(one[name][units]), raw(rec)), (name, layer)
        for name, t in out.items():
            assert torch.equal(raw(t[others]), raw(before[name][others])), name
        for out_dtype in (BF, FP):
            new_dev = torch.randperm(size, generator=g)[:n]
            dst = [torch.full((size, H, d), 7.0, dtype=out_dtype) for d in dims]
            kc.decode_scatter(
                one, host_idx.to(index_dtype), dst, new_dev.to(index_dtype),
                bad_index_counter=counters.bad_indices, tile=tile, **rotation(dv),
            )  # fmt: skip
            for x, got, ref in zip(
                (k, v),
                dst,
                expected_decode({n_: r[units] for n_, r in one.items()}, out_dtype),
            ):
                assert same_bits(got[new_dev].view(ref.shape), ref), (layer, out_dtype)
                # NaN/Inf never come back finite.
                assert torch.isnan(
                    got[new_dev].view(ref.shape)[~torch.isfinite(x)]
                ).all()
            kept = torch.ones(size, dtype=torch.bool)
            kept[new_dev] = False
            assert all((t[kept].float() == 7.0).all() for t in dst)
    assert int(counters.nonfinite) == bad_total > 0
    assert torch.equal(counters.amax, amax)
    assert int(counters.bad_indices) == 0
    return out


# (unit tokens, heads, dims, plan layers, dtype): one sub-unit of 16, 24 and
# 48 tokens, 32-token sub-units at 32/64/96 (a padded tile), values in one or
# two 128-value rotation blocks, blocks of 32 in groups of 32 (96) and of 16
# in a whole-head group (80), 8-bit keys on some layers, per-token keys (4-
# and 8-bit) below 16 tokens.
GRID = [
    (16, 2, (64, 64), (1,), BF),
    (24, 1, (32, 32), (0,), FP),
    (32, 1, (64, 128), (), BF),
    (48, 1, (32, 96), (1,), BF),
    (64, 2, (64, 64), (0, 1), FP),
    (96, 1, (32, 256), (1,), BF),
    (16, 1, (64, 80), (0,), FP),
    (4, 2, (64, 64), (1,), BF),
    (1, 1, (96, 64), (0,), FP),
]


@pytest.mark.parametrize("ut,H,dims,key8,dtype", GRID)
def test_kernels_match_the_spec(ut, H, dims, key8, dtype):
    run_kernels(ut, H=H, dims=dims, key8=key8, dtype=dtype, seed=ut,
                n_units=2 if ut > 1 else 12)  # fmt: skip


def test_small_tiles_and_int32_indices():
    """Channel blocks of a small tile (several key programs per head) and
    int32 indices give the same bytes."""
    run_kernels(64, H=1, dims=(128, 128), key8=(0,), tile=1024,
                index_dtype=torch.int32, seed=7)  # fmt: skip


def test_staged_one_layer_backup_uses_its_own_slot():
    """A staged backup of one layer (first_layer = 1): k_lo holds that layer
    alone if it is a plan layer, no layer otherwise."""
    hk, kc, _, _ = _modules()
    ut, H, dk, dv, layers = 32, 1, 64, 64, 3
    g = torch.Generator().manual_seed(3)
    sides = [[torch.randn(ut, H, d, generator=g).to(BF) for _ in range(layers)]
             for d in (dk, dv)]  # fmt: skip
    tables = tuple(hk.DeviceLayerTable(s) for s in sides)
    idx = torch.arange(ut)
    for first, key8 in ((1, (1, 2)), (2, (1, 2)), (0, (1, 2))):
        lo_layers = int(first in key8)
        out = host_records(1, 1, ut, H, dk, dv, lo_layers)
        kc.encode_gather(tables, idx, out, idx, first_layer=first, key8_layers=key8,
                         **rotation(dv))  # fmt: skip
        k = sides[0][first].view(1, ut, H, dk)
        want, _, _ = expected(k, sides[1][first].view(1, ut, H, dv), bool(lo_layers))
        assert torch.equal(out["k"][:, 0], want["k"])
        if lo_layers:
            assert torch.equal(out["k_lo"][:, 0], want["k_lo"])
    with pytest.raises(ValueError, match="k_lo holds 0 layers"):
        out = host_records(1, 1, ut, H, dk, dv, 0)
        out["k_lo"] = out["k"][:, :0]
        kc.encode_gather(tables, idx, out, idx, first_layer=1, key8_layers=(1,),
                         **rotation(dv))  # fmt: skip


@pytest.mark.parametrize("ut", (32, 4))
def test_out_of_range_host_indices_are_counted_not_written(ut):
    hk, kc, _, _ = _modules()
    H, d = 1, 64
    g = torch.Generator().manual_seed(ut)
    sides = [[torch.randn(2 * ut, H, d, generator=g).to(BF) for _ in range(2)]
             for _ in range(2)]  # fmt: skip
    tables = tuple(hk.DeviceLayerTable(s) for s in sides)
    host_idx = torch.arange(2 * ut)
    host_idx[ut + 1] = 3 * ut  # past the 3 units
    host_idx[ut + 2] = -1
    out = host_records(3, 2, ut, H, d, d, 1 if ut >= 16 else 0)
    before = {n: t.clone() for n, t in out.items()}
    bad = torch.zeros((), dtype=torch.int64)
    kc.encode_gather(tables, torch.arange(2 * ut), out, host_idx, key8_layers=(1,),
                     counters=hk.KVCounters(bad_indices=bad), **rotation(d))  # fmt: skip
    # Per-channel keys: unit 1's run is broken, none of its keys written.
    assert int(bad) == (ut if ut >= 16 else 2)
    for name, t in out.items():
        assert torch.equal(raw(t[2]), raw(before[name][2])), name  # untouched
        assert not torch.equal(raw(t[0]), raw(before[name][0])), name
    if ut >= 16:
        for name in ("k", "k_range", "k_sub", "k_lo"):
            assert torch.equal(raw(out[name][1]), raw(before[name][1])), name
    bad.zero_()
    dst = [torch.full((2 * ut, H, d), 7.0, dtype=BF) for _ in range(2)]
    one = {n: t[:, 0] for n, t in out.items() if n != "k_lo"}
    kc.decode_scatter(one, host_idx, dst, torch.arange(2 * ut),
                      bad_index_counter=bad, **rotation(d))  # fmt: skip
    assert int(bad) == 2
    assert all((t[ut + 1 : ut + 3] == 7.0).all() for t in dst)
    assert not (dst[0][:ut] == 7.0).any()


def test_bad_arguments_fail_before_launch():
    hk, kc, _, _ = _modules()
    ut, H, d = 32, 1, 64
    sides = [[torch.zeros(ut, H, d, dtype=BF)] for _ in range(2)]
    tables = tuple(hk.DeviceLayerTable(s) for s in sides)
    idx = torch.arange(ut)
    out = host_records(1, 1, ut, H, d, d, 0)
    with pytest.raises(ValueError, match="does not divide the value group"):
        kc.encode_gather(tables, idx, out, idx, rotation_blocks=(0, 128),
                         rotation_signs=rotation(d)["rotation_signs"])  # fmt: skip
    with pytest.raises(ValueError, match="keys are not rotated"):
        kc.encode_gather(tables, idx, out, idx, rotation_blocks=(64, 64),
                         rotation_signs=rotation(d)["rotation_signs"])  # fmt: skip
    with pytest.raises(ValueError, match="whole units"):
        kc.encode_gather(tables, idx[:16], out, idx[:16], **rotation(d))
    broken = dict(out, k_sub=out["k_sub"][..., :-1])
    with pytest.raises(ValueError, match="k_sub"):
        kc.encode_gather(tables, idx, broken, idx, **rotation(d))
    with pytest.raises(ValueError, match="records must be"):
        kc.encode_gather(tables, idx, {**out, "k_scale": out["k"]}, idx, **rotation(d))
