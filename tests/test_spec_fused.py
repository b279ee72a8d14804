"""Packed MTP draft layers through the fused transfer kernels (Triton interpreter): the
draft layers, appended to the target's layer table, encode in the target's launch and
a draft load decodes into the draft pool, bit for bit the torch path's."""

from __future__ import annotations

import pytest
import torch
from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    fill_random,
    make_device_pool,
    make_host_pool,
)

from sglang.srt.mem_cache.pool_host import encoded_fused
from tests.support.conformance import bits, rows_at
from tests.support.hybrid_rigs import wipe_kv
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]
DEVICE_TOKENS = 64


def packed_pool(geo, host_dtype, layout, drafts, mode):
    target = make_device_pool(geo, DEVICE_TOKENS)
    draft_geo = type(geo)(**{**geo.__dict__, "layer_num": 1})
    draft_pools = [make_device_pool(draft_geo, DEVICE_TOKENS) for _ in range(drafts)]
    kind = "mla" if isinstance(geo, MLAGeometry) else "mha"
    pool = make_host_pool(
        target,
        host_tokens=8 * geo.page_size * 4,
        layout=layout,
        host_pool_cls=host_pool_cls(host_dtype, kind),
        draft_buffer_infos=tuple(
            d.get_device_pool_infos()[0].buffer_info for d in draft_pools
        ),
        fused_transfer=mode,
    )
    assert pool.transfer_path == ("torch" if mode is None else f"fused_{mode}")
    return target, draft_pools, pool


def round_trip(geo, host_dtype, layout, mode, drafts=2):
    """Back up target + drafts and restore every layer into fresh slots; returns the
    host records and the restored device rows per pool."""
    target, draft_pools, pool = packed_pool(geo, host_dtype, layout, drafts, mode)
    pools = [target, *draft_pools]
    n = 3 * geo.page_size
    src = torch.arange(geo.page_size, geo.page_size + n)
    for seed, p in enumerate(pools):
        fill_random(p, src, seed=seed)
    # Host units out of order (a backward jump).
    host = torch.cat([torch.arange(4 * geo.page_size, 5 * geo.page_size),
                      torch.arange(0, 2 * geo.page_size)])  # fmt: skip
    pool.backup_from_device_all_layer(target, host, src, "kernel")
    records = {k: v.clone() for k, v in pool.host_records.items()}
    dst = torch.arange(DEVICE_TOKENS - n, DEVICE_TOKENS)
    for p in pools:
        wipe_kv(p, dst)
    for layer in range(pool.target_layer_num):
        pool.load_to_device_per_layer(target, host, dst, layer, "kernel")
    for depth, p in enumerate(draft_pools):
        pool.load_to_device_per_layer(
            p, host, dst, pool.target_layer_num + depth, "kernel", is_draft=True
        )
    return records, [sum(rows_at(p, dst), []) for p in pools]


def assert_same(got, ref):
    (g_rec, g_rows), (r_rec, r_rows) = got, ref
    assert g_rec.keys() == r_rec.keys()
    for name in r_rec:
        assert torch.equal(bits(g_rec[name]), bits(r_rec[name])), name
    for p, (g_pool, r_pool) in enumerate(zip(g_rows, r_rows)):
        for i, (g, r) in enumerate(zip(g_pool, r_pool)):
            assert torch.equal(bits(g), bits(r)), (
                "target" if p == 0 else f"draft{p - 1}",
                i,
            )
            assert not torch.isnan(g).any()


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize(
    "host_dtype,layout,page_size",
    [
        ("int8", "page_first", 4),
        ("int8", "layer_first", 1),
        ("int4", "page_first_direct", 16),
        ("k8v4", "page_first", 4),
    ],
)
def test_packed_draft_fused_matches_torch_mha(host_dtype, layout, page_size, mode):
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=page_size)
    ref = round_trip(geo, host_dtype, layout, None)
    assert_same(round_trip(geo, host_dtype, layout, mode), ref)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("layout,page_size", [("page_first", 2), ("layer_first", 1)])
def test_packed_draft_fused_matches_torch_mla(layout, page_size, mode):
    geo = MLAGeometry(layer_num=2, page_size=page_size)
    ref = round_trip(geo, "int8", layout, None, drafts=1)
    assert_same(round_trip(geo, "int8", layout, mode, drafts=1), ref)


@pytest.mark.parametrize(
    "geo,host_dtype",
    [
        (Geometry(layer_num=2, head_num=2, head_dim=64, page_size=4), "int8"),
        (Geometry(layer_num=2, head_num=2, head_dim=64, page_size=16), "k8v4"),
        (MLAGeometry(layer_num=2, page_size=2), "int8"),
    ],
    ids=["int8", "k8v4", "mla-int8"],
)
def test_start_up_self_check_covers_the_draft_layers(geo, host_dtype):
    """The start-up self-check (run whenever the pool chooses a fused path) restores
    every layer, the drafts included, so the fused path stays selected."""
    _, _, pool = packed_pool(geo, host_dtype, "page_first", 1, "direct")
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    assert pool.transfer_path == "fused_direct"
