"""Kernel round trips for any host format (tests/test_host_kernels.py and the
per-kernel tests): device rows, the transfer, and the checks against the
format's reference (tests/support/int4_reference.Host)."""

from __future__ import annotations

import importlib

import torch

from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, KVCounters
from tests.support.codec_inputs import DTYPES
from tests.support.fp8_reference import (
    FP8,
    assert_canonical_nan,
    assert_restored,
    random_finite_fp8,
)
from tests.support.int4_reference import Host, assert_same_records

NAN, INF = float("nan"), float("inf")


def fill_rows(x: torch.Tensor, seed: int, special_rows: torch.Tensor | None):
    """Random rows (odd rows mix magnitudes channel by channel, so a
    butterfly's fp32 sums round); NaN/Inf/huge/zero/-0/constant/tiny groups in
    the special rows (8 device slots) if given."""
    g = torch.Generator().manual_seed(seed)
    n, H, D = x.shape
    mags = 2.0 ** torch.randint(-12, 8, (n, H, 1), generator=g).double()
    mixed = 2.0 ** torch.randint(-16, 8, (n, H, D), generator=g).double()
    mags = torch.where(torch.arange(n)[:, None, None] % 2 == 1, mixed, mags)
    vals = torch.randn(n, H, D, generator=g, dtype=torch.float64) * mags
    vals[:, :, 3] *= 20  # an outlier channel, as keys have
    vals[:, :, 1] = 0.0  # a zero channel (QK-normed keys' zero gains)
    x.copy_(vals.to(x.dtype))
    if special_rows is None:
        return
    r = special_rows.tolist()
    x[r[1], 0, 5] = NAN
    x[r[2], H - 1, D - 1] = INF
    x[r[3], 0, 0] = -INF
    x[r[4], 0] = 0.0
    x[r[5], 0] = -0.0
    x[r[6], 0] = 1.5  # constant group: m rounds to the value, s to the floor
    x[r[7], 0, : D // 2] = 7e4 if x.dtype == torch.bfloat16 else 6.5e4  # huge
    x[r[0], H - 1] = 2.0**-20  # tiny: fp16 subnormal m and s


def device_layer(size, H, D, dtype, seed, special_rows):
    """A device layer of fill_rows' rows; FP8 as SGLang holds it (its values
    rounded to FP8, NaN/Inf kept), every other row uniformly random finite
    FP8 bytes."""
    if dtype not in FP8:
        x = torch.empty(size, H, D, dtype=dtype)
        fill_rows(x, seed, special_rows)
        return x
    x = torch.empty(size, H, D)
    fill_rows(x, seed, special_rows)
    x = x.to(dtype)
    keep = torch.ones(size, dtype=torch.bool)
    if special_rows is not None:
        keep[special_rows] = False
    odd = keep & (torch.arange(size) % 2 == 1)
    gen = torch.Generator().manual_seed(seed)
    x.view(torch.uint8)[odd] = random_finite_fp8(
        (int(odd.sum()), H, D), dtype, gen
    ).view(torch.uint8)
    return x


def sentinel_layer(size, H, D, dtype) -> torch.Tensor:
    """A device layer of 7.0 (the restore must leave other slots alone)."""
    return torch.full((size, H, D), 7.0).to(dtype)


def big_tiles(monkeypatch):
    """Fewer, larger programs (the interpreter's cost is per program); a
    tile= argument still picks small ones."""
    for module, tile in (("kv_int4_triton", 16384), ("kv_int8_triton", 65536),
                         ("kv_int8c_triton", 16384), ("kv_mla_int8_triton", 65536),
                         ("kv_int4c_triton", 16384)):  # fmt: skip
        m = importlib.import_module(f"sglang.kernels.ops.kvcache.{module}")
        monkeypatch.setattr(m, "ENCODE_TILE", tile)
        monkeypatch.setattr(m, "DECODE_TILE", tile)


def run_case(
    fmt, *, ut, H=2, dims=(64, 64), layers=2, n_units=3, dtype=torch.bfloat16,
    layer_first=False, index_dtype=torch.int64, specials=True, token_shuffle=False,
    tile=None, seed=0, rows=None, geometry=None,
):  # fmt: skip
    """encode_gather of shuffled device rows (rows: one layer's per side, else
    random with special ones) into fragmented host units, a decode_scatter per
    layer into shuffled slots, against the reference; (format, host, count)."""
    kind = "mla" if fmt.startswith("mla-") else "mha"
    g = torch.Generator().manual_seed(seed)
    size = 2 * n_units * ut + 8
    n = n_units * ut
    dev = torch.randperm(size, generator=g)[:n]
    if rows is not None:
        layers, specials = 1, False
        sides = [[torch.full((size, H, d), 5.0).to(dtype)] for d in dims]
        for side, x in zip(sides, rows):
            side[0][dev] = x
    else:
        sides = [
            [
                device_layer(
                    size, H, d, dtype, seed * 31 + s * layers + i,
                    dev[(torch.arange(8) * 7 + s * layers + i) % n] if specials else None,
                )
                for i in range(layers)
            ]
            for s, d in enumerate(dims)
        ]  # fmt: skip
    host_units = 2 * n_units + 1
    units = torch.randperm(host_units, generator=g)[:n_units]  # gaps, jumps
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    if token_shuffle:  # per-token formats take any token order
        host_idx = host_idx[torch.randperm(n, generator=g)]
    host = Host(fmt.removeprefix("mla-"), host_units, layers, ut, H, *dims,
                layer_first=layer_first, kind=kind, dtype=dtype,
                geometry=geometry)  # fmt: skip
    want = host.clone()
    f = host.format(dtype)
    counter = torch.zeros((), dtype=torch.int64)
    bad_idx = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros(layers, len(dims))
    f.encode_gather(
        [DeviceLayerTable(layers_) for layers_ in sides], dev.to(index_dtype),
        host.all_layers(), host_idx.to(index_dtype),
        counters=KVCounters(counter, amax, bad_idx), tile=tile,
    )  # fmt: skip

    # Expected: the reference per unit of the transfer's rows.
    order = torch.argsort(host_idx)  # tokens sorted by host slot
    sorted_units = host_idx[order].view(n_units, ut)[:, 0] // ut
    want_bad, want_amax = want.fill_reference(sides, dev[order], sorted_units)
    assert_same_records(host, want)
    assert int(counter) == want_bad and int(bad_idx) == 0
    assert torch.equal(amax, want_amax)
    if specials:
        assert want_bad > 0

    # Restore every layer into other slots, shuffled; untouched slots keep 7.
    # FP8 records restore to that FP8 dtype, as the pools restore them; MLA
    # keeps its RoPE in the device dtype.
    out_dtypes = (dtype,) if dtype in FP8 or kind == "mla" else DTYPES
    for out_dtype in out_dtypes:
        new_dev = torch.randperm(size, generator=g)[:n]
        for layer in range(layers):
            dst = [sentinel_layer(size, H, d, out_dtype) for d in dims]
            f.decode_scatter(
                host.layer(layer), host_idx.to(index_dtype), dst,
                new_dev.to(index_dtype), bad_index_counter=bad_idx, tile=tile,
            )  # fmt: skip
            records = {name: r[sorted_units] for name, r in host.layer(layer).items()}
            restored = new_dev[order]
            lat = getattr(f, "latent_dim", None)
            for s, (d, out, ref) in enumerate(
                zip(dims, dst, host.decode(records, out_dtype, layer))
            ):
                assert_restored(out[restored], ref.reshape(n, H, d))
                if fmt in ("int4", "int4c") or (fmt == "k8v4" and s == 1):
                    assert_canonical_nan(out)
                # NaN and Inf never come back finite (MLA's RoPE: verbatim).
                bad_in = ~torch.isfinite(sides[s][layer][dev[order]][..., :lat].float())
                assert torch.isnan(out[restored][..., :lat][bad_in].float()).all()
                untouched = torch.ones(size, dtype=torch.bool)
                untouched[new_dev] = False
                assert (out[untouched].float() == 7.0).all()
    assert int(bad_idx) == 0
    return f, host, int(counter)
