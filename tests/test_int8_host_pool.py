"""MHATokenToKVPoolINT8Host: the real patched SGLang host pool on CPU.

The round trips every format shares (layouts, page sizes, io backends, copy
paths, unordered host slots, L3) are in tests/test_conformance.py; here:
INT8's full layout x page size x geometry grid (the fused kernels' grid),
chunking through staging, the NaN policy, capacity, dispatch, refusals.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from tests.support.conformance import GEOMETRIES, LAYOUTS, heads_geometry
from scripts.rigs.hicache_harness import (
    Geometry,
    fill_random,
    make_device_pool,
    make_host_pool,
)
from tests.support.int8_pool_checks import (
    MHATokenToKVPoolINT8Host,
    device_alloc,
    expected_restore,
    int8_pool,
    unit_tokens,
)


def round_trip(geo, layout, use_run_copies, io_backend="direct", n_pages=3):
    device_pool = make_device_pool(geo, device_tokens=16 * geo.page_size)
    pool = int8_pool(device_pool, layout, 16 * geo.page_size, use_run_copies)
    dev = device_alloc(n_pages, geo.page_size, shuffle_seed=0)
    written = fill_random(device_pool, dev, seed=geo.head_num)
    # Fragmented host placement: skip one page so runs break.
    host_all = pool.alloc(pool.size - pool.page_size)
    host = torch.cat([host_all[: geo.page_size], host_all[2 * geo.page_size :]])
    host = host[: len(dev)]
    host_before = [b.clone() for b in pool.kv_buffer]

    pool.backup_from_device_all_layer(device_pool, host, dev, io_backend)

    # Only the written host units changed: a unit is a page for the page
    # layouts and a token for layer_first (worked out here, not by the pool).
    units = torch.unique(host // unit_tokens(layout, geo.page_size))
    for before, after in zip(host_before, pool.kv_buffer):
        mask = torch.ones(after.shape[1 if layout == "layer_first" else 0], dtype=bool)
        mask[units] = False
        if layout == "layer_first":
            assert torch.equal(before[:, mask], after[:, mask])
        else:
            assert torch.equal(before[mask], after[mask])

    # Restore into other device slots; sentinels elsewhere must survive.
    for layer in range(geo.layer_num):
        device_pool.k_buffer[layer].fill_(7.0)
        device_pool.v_buffer[layer].fill_(7.0)
    new_dev = device_alloc(n_pages, geo.page_size, first_page=8, shuffle_seed=1)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, io_backend)
    return device_pool, written, new_dev


@pytest.mark.parametrize(
    "layout,page_size,geometry",
    [
        (layout, page_size, geometry)
        for layout, page_size in itertools.product(LAYOUTS, (1, 16, 64))
        for geometry in (GEOMETRIES if page_size == 16 else GEOMETRIES[:3])
    ],
)
def test_backup_load_restores_reference_values(layout, page_size, geometry):
    geo = heads_geometry(geometry, page_size)
    device_pool, written, new_dev = round_trip(geo, layout, use_run_copies=False)
    untouched = torch.ones(device_pool.size + page_size, dtype=bool)
    untouched[new_dev] = False
    for layer, (k_rows, v_rows) in enumerate(written):
        for buf, rows in (
            (device_pool.k_buffer[layer], k_rows),
            (device_pool.v_buffer[layer], v_rows),
        ):
            restored = buf[new_dev]
            assert torch.equal(restored, expected_restore(rows))
            _, scale = codec.quantize_reference(rows)
            err = (restored.float() - rows.float()).abs()
            assert (err <= codec.error_bound(scale, restored)).all()
            assert (buf[untouched] == 7.0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", (1, 16, 64))
def test_capacity_is_byte_budget_over_encoded_size(layout, page_size):
    # Qwen3-8B geometry at TP=1: 36 layers, 8 KV heads, 128 dims.
    geo = Geometry(layer_num=36, head_num=8, head_dim=128, page_size=page_size)
    device_pool = make_device_pool(geo, device_tokens=2 * page_size)
    budget_gb = 0.25
    stock = make_host_pool(
        device_pool, host_size_gb=budget_gb, layout="page_first_direct"
    )
    pool = make_host_pool(
        device_pool,
        host_size_gb=budget_gb,
        layout=layout,
        host_pool_cls=MHATokenToKVPoolINT8Host,
    )
    per_token = 36 * 8 * (128 + 128 + 2 * 2)
    assert pool.get_size_per_token() == per_token == pool.size_per_token
    # HostKVCache sizing: whole pages of the budget plus one padding page.
    expected_pages = int(budget_gb * 1e9 // per_token) // page_size + 1
    assert pool.size == expected_pages * page_size
    allocated = sum(b.numel() * b.element_size() for b in pool.kv_buffer)
    assert allocated == pool.size * per_token  # no padding anywhere
    stock_bytes = stock.kv_buffer.numel() * stock.kv_buffer.element_size()
    ratio = (pool.size / allocated) / (stock.size / stock_bytes)
    assert ratio >= 1.93
    assert pool.size / stock.size >= 1.93


@pytest.mark.parametrize("layout", ("page_head", "page_unified"))
def test_unsupported_layout_fails_naming_the_flag(layout):
    device_pool = make_device_pool(Geometry(), 16)
    with pytest.raises(NotImplementedError, match="--hicache-mem-layout"):
        int8_pool(device_pool, layout, 16)


def test_quantized_device_kv_fails_naming_the_flag():
    device_pool = make_device_pool(Geometry(dtype=torch.float8_e4m3fn), 16)
    with pytest.raises(NotImplementedError) as error:
        int8_pool(device_pool, "page_first", 16)
    # The value to pass, a real --kv-cache-dtype choice; not the storage dtype.
    message = str(error.value)
    assert "Pass --kv-cache-dtype bf16" in message
    assert "quantized (FP8/FP4)" in message
    assert "uint8" not in message and "fp16" not in message


def test_auto_sizing_counts_encoded_host_bytes(monkeypatch):
    """--hicache-host-memory-fraction sizing (no ratio/size given) budgets the
    host bytes the INT8 pool will really take, so the same memory buys ~2x."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import hicache_auto_size

    device_pool = make_device_pool(Geometry(layer_num=4, head_num=8, head_dim=128), 64)
    params = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: device_pool),
        req_to_token_pool=None,
        mtp_draft_device_pools=(),
        page_size=16,
    )
    estimates = {}
    for host_dtype in ("auto", "int8"):
        monkeypatch.setattr(
            hicache_auto_size,
            "get_memory",
            lambda: SimpleNamespace(
                hicache_host_dtype=host_dtype, hicache_mem_layout="page_first"
            ),
        )
        estimates[host_dtype] = hicache_auto_size._estimate_hicache_bytes(params, None)
    assert estimates["auto"] / estimates["int8"] == pytest.approx(256 / 130, rel=1e-6)
