"""Fused MLA INT8 kernels (kv_mla_int8_triton) under the Triton interpreter against
MLAInt8HostFormat's reference: edge and random tiles, RoPE specials, bad host indices,
launch counts, bad arguments, and the pool's fused paths == its torch path."""

from __future__ import annotations

import pytest
import torch
from scripts.rigs import hicache_harness as hh
from tests.support.kernel_cases import run_case
from tests.support.codec_inputs import (
    DTYPES,
    LOG2_RANGE,
    assert_same_bits,
    edge_inputs,
    make_rows,
)

from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat

# DeepSeek V2/V3, Kimi K2: kv_lora_rank 512, qk_rope_head_dim 64, tiles of 128.
RANK, ROPE, TILE = 512, 64, 128
NAN, INF = float("nan"), float("inf")
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]


def host_records(units, layers, dtype, unit_tokens=1):
    """Sentinel-filled page-major host records [units, L, unit_tokens, 1, n]."""
    shapes = {
        "kv": (torch.int8, RANK, 55),
        "scale": (torch.float16, RANK // TILE, 3.0),
        "rope": (dtype, ROPE, -9.0),
    }
    return {
        name: torch.full((units, layers, unit_tokens, 1, width), fill, dtype=dt)
        for name, (dt, width, fill) in shapes.items()
    }


def encode(layers, dev, host, views) -> KVCounters:
    zero = torch.zeros((), dtype=torch.int64)
    counters = KVCounters(zero.clone(), torch.zeros(len(layers), 1), zero.clone())
    mk.encode_gather([mk.DeviceLayerTable(layers)], dev, views, host, counters=counters)
    return counters


def layer_views(views, layer):
    return {name: v[:, layer] for name, v in views.items()}


def check_tokens(rows, layer, views, host, unit_tokens):
    """Records at host == the reference encoding of rows [n, 1, W] in every byte."""
    fmt = MLAInt8HostFormat((rows.shape[-1],), 1, 1, rows.dtype, rope_dim=ROPE)
    for name, expected in fmt.encode_reference([rows[:, None]]).items():
        got = views[name][host // unit_tokens, layer, host % unit_tokens]
        assert got.dtype == expected.dtype
        assert torch.equal(got.view(torch.int8), expected[:, 0].view(torch.int8)), name


def random_layers(n_layers, size, dtype, seed, rank=RANK, rope=ROPE):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 1, rank + rope, generator=g) * 2.0 ** (i - 1)).to(dtype)
        for i in range(n_layers)
    ]


# --- value coverage ----------------------------------------------------------


def tokens_from_tiles(tiles: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """tiles [n * RANK / TILE, TILE] -> device rows [n, 1, RANK + ROPE]."""
    latent = tiles.reshape(-1, 1, RANK)
    return torch.cat([latent, rope.reshape(latent.shape[0], 1, ROPE)], dim=-1)


def round_trip_rows(rows: torch.Tensor, tile=None) -> int:
    """rows [n, 1, W] (one layer, units of one token) through both kernels at
    shuffled slots: the reference's bytes, bits and statistics; returns the
    non-finite count."""
    _, _, nonfinite = run_case(
        "mla-int8", ut=1, H=1, dims=(rows.shape[-1],), n_units=rows.shape[0],
        dtype=rows.dtype, rows=[rows], tile=tile,
    )  # fmt: skip
    return nonfinite


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_tiles_and_rope_specials(dtype):
    """kv_int8_codec's edge rows (zeros, -0, subnormals, ties, dtype max, past
    the fp16-scale guard, NaN/Inf, spikes) as latent tiles, next to finite
    tiles; NaN/Inf/-0/subnormal RoPE values copied bit for bit."""
    (edge,) = [x for x in edge_inputs() if x.dtype == dtype]
    tiles = edge.repeat(1, TILE // edge.shape[1])  # [15, 128]
    g = torch.Generator().manual_seed(1)
    filler = torch.randn(tiles.shape[0] * 3, TILE, generator=g).to(dtype)
    mixed = torch.cat([tiles, filler]).reshape(4, -1, TILE).transpose(0, 1)
    rope = torch.randn(mixed.shape[0], ROPE, generator=g).to(dtype)
    rope[0, :4] = torch.tensor([NAN, INF, -INF, -0.0])
    rope[1, 0] = torch.finfo(dtype).smallest_normal / 4
    rope[2, :2] = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max])
    rows = tokens_from_tiles(mixed.reshape(-1, TILE), rope)
    # NaN/Inf/over-range edge tiles (bf16: its max and 127 * 65504 too) and
    # the RoPE row with NaN/Inf (the one at +-max is finite).
    assert round_trip_rows(rows) == (6 if dtype == torch.float16 else 8) + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_tiles_across_magnitudes(dtype):
    """Gaussian, heavy-tailed, spiky and zero tiles from the dtype's
    subnormals to past the scale guard; default and small program tiles."""
    lo, hi = LOG2_RANGE[dtype]
    mags = [lo + (hi - lo) * i / 23 for i in range(24)]
    tiles = make_rows(7, (96, TILE), dtype, ["gauss", "heavy", "spike", "zero"], mags)
    rope = make_rows(8, (24, ROPE), dtype, ["gauss", "heavy"], mags)
    rows = tokens_from_tiles(tiles, rope)
    round_trip_rows(rows)
    # tile 256: 2 latent tiles per program, RoPE programs of one token.
    round_trip_rows(rows[:5], tile=256)


# --- addressing (round trips: tests/test_host_kernels.py) ---------------------


@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_out_of_range_host_indices_are_counted_and_skipped(index_dtype):
    """Host indices < 0 or >= units * unit_tokens write nothing, restore
    nothing, and count once per token (not per layer or tile)."""
    unit_tokens, units, n_layers = 4, 3, 2
    layers = random_layers(n_layers, 10, torch.float16, seed=3)
    dev = torch.tensor([1, 2, 3, 4, 5], dtype=index_dtype)
    host = torch.tensor([0, -1, 12, 5, 40], dtype=index_dtype)
    ok = torch.tensor([True, False, False, True, False])
    views = host_records(units, n_layers, torch.float16, unit_tokens)
    stats = encode(layers, dev, host, views)
    assert int(stats.bad_indices) == 3
    good = host[ok].long()
    for layer in range(n_layers):
        check_tokens(layers[layer][dev[ok].long()], layer, views, good, unit_tokens)
    written = torch.zeros(units * unit_tokens, dtype=torch.bool)
    written[good] = True
    flat_kv = views["kv"].transpose(1, 2).reshape(units * unit_tokens, n_layers, -1)
    assert (flat_kv[~written] == 55).all()
    dst = torch.full_like(layers[0], -7.0)
    bad = torch.zeros((), dtype=torch.int64)
    mk.decode_scatter(layer_views(views, 1), host, [dst], dev, bad_index_counter=bad)
    assert int(bad) == 3
    restored = torch.zeros(10, dtype=torch.bool)
    restored[dev[ok].long()] = True
    assert (dst[~restored] == -7.0).all() and torch.isfinite(dst[restored]).all()


def test_one_launch_per_backup_and_per_layer_restore(monkeypatch):
    launches = {"encode": [], "decode": []}
    for name in launches:
        real = getattr(mk, f"_mla_{name}_kernel")

        class Counting:
            def __getitem__(self, grid, _real=real, _name=name):
                launches[_name].append(grid)
                return _real[grid]

        monkeypatch.setattr(mk, f"_mla_{name}_kernel", Counting())
    layers = random_layers(4, 40, torch.bfloat16, seed=0)
    views = host_records(40, 4, torch.bfloat16)
    idx = torch.arange(33)
    encode(layers, idx, idx, views)
    for layer in range(4):
        mk.decode_scatter(layer_views(views, layer), idx, [layers[layer]], idx)
    assert [g[1:] for g in launches["encode"]] == [(4, 2)]
    assert len(launches["decode"]) == 4


# --- bad arguments -----------------------------------------------------------


def test_bad_arguments_raise_and_write_nothing():
    layers = random_layers(2, 8, torch.bfloat16, seed=0)
    table = mk.DeviceLayerTable(layers)
    idx = torch.arange(4)

    def views_with(**changes):
        return {**host_records(4, 2, torch.bfloat16), **changes}

    def enc(views, tables=(table,), **kw):
        mk.encode_gather(list(tables), idx, views, idx, **kw)

    base = views_with()
    cases = [
        (dict(tables=(table, table)), "one side"),
        (dict(views=views_with(kv=base["kv"].view(torch.uint8))), "record kv"),
        (dict(views=views_with(rope=base["rope"].half())), "record rope"),
        (dict(views=views_with(scale=base["scale"][..., :3])), "whole number"),
        (dict(views=views_with(kv=base["kv"][..., :256])), "device MLA KV"),
        (dict(views=views_with(rope=base["rope"][:, :1])), "record rope"),
        (dict(views={k: v for k, v in base.items() if k != "rope"}), "missing"),
        (dict(counters=KVCounters(amax=torch.zeros(2, 2))), "counters.amax"),
        (
            dict(counters=KVCounters(torch.zeros(1, dtype=torch.int64))),
            "counters.nonfinite",
        ),
    ]
    for kwargs, match in cases:
        views = kwargs.pop("views", base)
        with pytest.raises((ValueError, TypeError), match=match):
            enc(views, **kwargs)
    assert (base["kv"] == 55).all()
    with pytest.raises(ValueError, match="one side"):
        mk.decode_scatter(layer_views(base, 0), idx, layers, idx)
    with pytest.raises(ValueError, match="rope must be"):
        mk.decode_scatter(layer_views(base, 0), idx, [layers[0].half()], idx)
    with pytest.raises(ValueError, match="host_indices"):
        mk.decode_scatter(layer_views(base, 0), idx[:3], [layers[0]], idx)
    # An empty transfer is a no-op.
    mk.encode_gather([table], idx[:0], base, idx[:0])
    assert (base["kv"] == 55).all()


# --- through the MLA INT8 host pool: fused paths == torch path ------------------


@pytest.fixture
def big_tiles(monkeypatch):
    """Fewer, larger programs: the interpreter's cost is per program (the
    kernel-level tests above cover the default and small tiles)."""
    monkeypatch.setattr(mk, "ENCODE_TILE", 65536)
    monkeypatch.setattr(mk, "DECODE_TILE", 65536)


def poisoned_fill(device_pool, dev):
    """Random latent rows, a NaN tile, an Inf RoPE value, an over-range tile."""
    hh.fill_random(device_pool, dev, seed=device_pool.page_size)
    device_pool.kv_buffer[0][dev[1], 0, 300] = NAN
    device_pool.kv_buffer[-1][dev[-1], 0, RANK + 3] = INF
    device_pool.kv_buffer[-1][dev[0], 0, :TILE] = 1e7  # past the fp16-scale guard


def pool_round_trip(layout, page_size, dtype, mode, layers=2):
    """Backup then per-layer restore through SGLang's MLA device pool and the
    MLA INT8 host pool at DeepSeek geometry; mode None = the torch path, else
    the fused kernels with that host access. Host pages out of order with a
    gap, shuffled device pages. Returns (host records, device buffers,
    non-finite count, amax by layer)."""
    geo = hh.MLAGeometry(layer_num=layers, dtype=dtype, page_size=page_size)
    device_pool = hh.make_device_pool(geo, device_tokens=8 * page_size)
    pool = hh.make_host_pool(
        device_pool, host_tokens=8 * page_size, layout=layout, host_dtype="int8",
        fused_transfer=mode,
    )  # fmt: skip
    # None: the CPU default, the torch path.
    assert pool.transfer_path == ("torch" if mode is None else f"fused_{mode}")
    g = torch.Generator().manual_seed(page_size)
    dev = (torch.randperm(6, generator=g)[:3] + 1)[:, None] * page_size
    dev = (dev + torch.arange(page_size)).flatten()
    poisoned_fill(device_pool, dev)
    host_all = pool.alloc(5 * page_size)
    host = torch.cat([host_all[3 * page_size :], host_all[:page_size]])  # a gap
    for t in pool.host_records.values():
        t.view(torch.int8).fill_(77)
    pool.backup_from_device_all_layer(device_pool, host, dev, "kernel")
    records = {name: t.clone() for name, t in pool.host_records.items()}
    new_dev = (torch.randperm(6, generator=g)[:3] + 1)[:, None] * page_size
    new_dev = (new_dev + torch.arange(page_size)).flatten()
    for layer in range(layers):
        device_pool.kv_buffer[layer].fill_(-7.0)
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "kernel")
    device = [b.clone() for b in device_pool.kv_buffer]
    return records, device, pool.nonfinite_group_count(), pool.scale_amax_by_layer()


def assert_same_round_trip(got, ref):
    for name, t in ref[0].items():
        assert torch.equal(got[0][name].view(torch.int8), t.view(torch.int8)), name
    for a, b in zip(got[1], ref[1]):
        assert_same_bits(a, b)
    assert got[2] == ref[2] == 3  # the NaN tile, the Inf RoPE row, the 1e7 tile
    assert torch.equal(got[3], ref[3])


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("layout", ("page_first", "page_first_direct", "layer_first"))
@pytest.mark.parametrize("page_size", (1, 16, 64))
@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_fused_paths_equal_the_torch_path(layout, page_size, dtype):
    """The pool's own launch sites (direct: host records; staged: its
    staging buffers, one layer per launch) write the torch path's host bytes,
    restore its device bits and keep its statistics."""
    ref = pool_round_trip(layout, page_size, dtype, None)
    for mode in ("direct", "staged"):
        assert_same_round_trip(pool_round_trip(layout, page_size, dtype, mode), ref)


@pytest.mark.usefixtures("big_tiles")
def test_pool_one_launch_per_backup_and_per_layer_restore(monkeypatch):
    launches = {"encode_gather": 0, "decode_scatter": 0}
    for name in launches:
        real = getattr(mk, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            launches[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mk, name, counted)
    pool_round_trip("page_first", 4, torch.bfloat16, "direct", layers=3)
    assert launches == {"encode_gather": 1, "decode_scatter": 3}
