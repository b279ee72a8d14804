"""INT4 and K8V4 host pools (host_pool_cls("int4"/"k8v4"), pool_host/mha_encoded.py) through the real patched
SGLang code on CPU: the dispatch, every layout, page size and io backend,
BF16/FP16 device KV, the real controller, L3 page I/O and the capacity the
allocated buffers give against BF16.

Expected values come from kv_int4_codec's reference functions on the rows
the test wrote, grouped into host units (a page, or a token for layer_first)
by the test itself.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.support.hicache_harness import (
    Geometry,
    fill_random,
    finish_transfers,
    make_device_pool,
    make_host_pool,
    make_rig,
)
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES, StoragePageRefused
from sglang.srt.mem_cache.pool_host.mha import (
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

MHATokenToKVPoolINT4Host = host_pool_cls("int4")
MHATokenToKVPoolK8V4Host = host_pool_cls("k8v4")

FORMATS = ("int4", "k8v4")
LAYOUTS = ("page_first", "page_first_direct", "layer_first")
POOL_CLS = {"int4": MHATokenToKVPoolINT4Host, "k8v4": MHATokenToKVPoolK8V4Host}
ENCODE = {"int4": codec.int4_encode_reference, "k8v4": codec.k8v4_encode_reference}
DECODE = {"int4": codec.int4_decode_reference, "k8v4": codec.k8v4_decode_reference}
RECORDS = {
    "int4": ("k", "k_meta", "v", "v_meta"),
    "k8v4": ("k", "k_scale", "v", "v_meta"),
}


def unit_tokens(layout: str, page_size: int) -> int:
    return 1 if layout == "layer_first" else page_size


def as_units(rows: torch.Tensor, ut: int) -> torch.Tensor:
    """[tokens, H, D] rows written in host-unit order -> [units, ut, H, D]."""
    return rows.view(rows.shape[0] // ut, ut, *rows.shape[1:])


def expected_records(fmt, k_rows, v_rows, ut):
    return ENCODE[fmt](as_units(k_rows, ut), as_units(v_rows, ut))


def expected_restore(fmt, k_rows, v_rows, ut):
    records = expected_records(fmt, k_rows, v_rows, ut)
    k, v = DECODE[fmt](records, k_rows.dtype)
    return k.flatten(0, 1), v.flatten(0, 1), records


def host_unit_records(pool, layout, layer, units):
    """Each record of `units` of `layer`, read from the documented layout:
    page-major (units, layers, *shape), layer_first (layers, units, *shape)."""
    out = {}
    for name, buf in pool.host_records.items():
        out[name] = buf[units, layer] if layout != "layer_first" else buf[layer, units]
    return out


def pages(page_ids, page_size):
    page_ids = torch.as_tensor(page_ids)
    return (page_ids[:, None] * page_size + torch.arange(page_size)).flatten()


def fill_spread(device_pool, indices, seed):
    """Random K/V with a per-channel scale spread (key outliers sit in fixed
    channels) and a far-from-zero offset on some heads."""
    written = fill_random(device_pool, indices, seed)
    for layer, (k_rows, v_rows) in enumerate(written):
        gain = torch.ones(k_rows.shape[-1])
        gain[::7] = 20.0
        k_rows = (k_rows.float() * gain).to(k_rows.dtype)
        v_rows = (v_rows.float() + 3.0).to(v_rows.dtype)
        device_pool.k_buffer[layer][indices] = k_rows
        device_pool.v_buffer[layer][indices] = v_rows
        written[layer] = (k_rows, v_rows)
    return written


def build(fmt, layout, page_size, dtype=torch.bfloat16, head_dim=64, v_head_dim=None):
    geo = Geometry(
        layer_num=2,
        head_num=2,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        page_size=page_size,
    )
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pool = make_host_pool(
        device_pool, host_tokens=16 * page_size, layout=layout, host_dtype=fmt
    )
    return geo, device_pool, pool


# --- dispatch ---------------------------------------------------------------


def test_dispatch_by_host_dtype():
    info = make_device_pool(Geometry(), 16).get_device_pool_infos()[0].buffer_info
    assert get_mha_host_pool_cls(info, "int4") is MHATokenToKVPoolINT4Host
    assert get_mha_host_pool_cls(info, "k8v4") is MHATokenToKVPoolK8V4Host
    assert get_mha_host_pool_cls(info, "auto") is MHATokenToKVPoolHost
    assert MHATokenToKVPoolINT4Host.host_format_cls.name == "int4"
    assert MHATokenToKVPoolK8V4Host.host_format_cls.name == "k8v4"


# --- geometry refusals (the round trips: tests/test_conformance.py) ----------


def test_odd_head_dim_fails_naming_the_flag():
    geo = Geometry(head_dim=63)
    device_pool = make_device_pool(geo, 16)
    for fmt in FORMATS:
        with pytest.raises(NotImplementedError, match="--hicache-host-dtype"):
            make_host_pool(device_pool, host_tokens=16, host_dtype=fmt)


def test_transfer_larger_than_staging_is_chunked(monkeypatch):
    from sglang.srt.mem_cache.pool_host import encoded

    monkeypatch.setattr(encoded, "STAGING_TOKENS", 32)
    geo, device_pool, pool = build("int4", "page_first", 16)
    dev, host = pages([1, 2, 3, 4, 5], 16), pages([9, 3, 4, 0, 7], 16)
    written = fill_spread(device_pool, dev, seed=5)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    new_dev = pages([10, 11, 12, 13, 14], 16)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
    for layer, (k_rows, v_rows) in enumerate(written):
        k_want, v_want, _ = expected_restore("int4", k_rows, v_rows, 16)
        assert torch.equal(device_pool.k_buffer[layer][new_dev], k_want)
        assert torch.equal(device_pool.v_buffer[layer][new_dev], v_want)


# --- start-up log, NaN policy, bad indices --------------------------------


@pytest.mark.parametrize(
    "fmt,layout,page_size,keys",
    [
        ("int4", "page_first", 64, "keys per channel over 64-token pages"),
        ("int4", "page_first_direct", 16, "keys per channel over 16-token pages"),
        ("int4", "page_first", 1, "keys per token in groups of 64 channels"),
        ("int4", "layer_first", 64, "keys per token in groups of 64 channels"),
        ("k8v4", "page_first", 64, "keys as int8 per token and head"),
    ],
)
def test_startup_log_states_format_and_key_grouping(
    fmt, layout, page_size, keys, caplog
):
    # The sglang logger itself: an earlier in-process server tool may have raised its level.
    with caplog.at_level(logging.INFO, logger="sglang"):
        build(fmt, layout, page_size)
    text = caplog.text
    assert f"stores {fmt.upper()} KV" in text
    assert keys in text
    assert "values per token in groups of 64 channels" in text
    assert "transfer path: torch" in text


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout,page_size", (("page_first", 16), ("layer_first", 1)))
def test_nonfinite_kv_restores_as_nan_and_is_counted(fmt, layout, page_size):
    geo, device_pool, pool = build(fmt, layout, page_size)
    dev, host = pages([1, 2], page_size), pages([3, 4], page_size)
    fill_spread(device_pool, dev, seed=9)
    k_tok, v_tok = dev[1], dev[-1]
    device_pool.k_buffer[1][k_tok, 1, 5] = float("nan")
    device_pool.v_buffer[0][v_tok, 0, 40] = float("inf")
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    assert pool.nonfinite_group_count() == 2
    new_dev = pages([6, 7], page_size)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
    k1 = device_pool.k_buffer[1][new_dev]
    v0 = device_pool.v_buffer[0][new_dev]
    if fmt == "int4" and page_size >= codec.K_CHANNEL_MIN_TOKENS:
        k_bad = (slice(0, page_size), 1, 5)  # channel 5 over the first page
    elif fmt == "int4":
        k_bad = (1, 1, slice(0, 64))  # the token's 64-channel group
    else:
        k_bad = (1, 1, slice(None))  # the INT8 key row
    v_bad = (-1, 0, slice(0, 64))
    assert torch.isnan(k1[k_bad]).all() and torch.isnan(v0[v_bad]).all()
    k1[k_bad] = 0
    v0[v_bad] = 0
    assert torch.isfinite(k1).all() and torch.isfinite(v0).all()
    amax = pool.scale_amax_by_layer()
    assert amax.shape == (2, 2) and torch.isfinite(amax).all() and (amax > 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_host_indices_rejected_and_nothing_moves(fmt, layout):
    geo, device_pool, pool = build(fmt, layout, 16)
    dev = pages([1], 16)
    fill_spread(device_pool, dev, seed=1)
    host_before = {n: b.clone() for n, b in pool.host_records.items()}
    dev_before = [b.clone() for b in device_pool.k_buffer + device_pool.v_buffer]
    for bad in (pages([pool.size // 16], 16), pages([0], 16) - 16):
        with pytest.raises(IndexError, match=f"--hicache-host-dtype {fmt}"):
            pool.backup_from_device_all_layer(device_pool, bad, dev, "direct")
        with pytest.raises(IndexError, match="out of range"):
            pool.load_to_device_per_layer(device_pool, bad, dev, 0, "direct")
    for name, before in host_before.items():
        assert torch.equal(
            pool.host_records[name].view(torch.uint8), before.view(torch.uint8)
        )
    for a, b in zip(dev_before, device_pool.k_buffer + device_pool.v_buffer):
        assert torch.equal(a, b)


def test_unsupported_io_backend_fails_naming_the_flag():
    _, device_pool, pool = build("int4", "page_first", 16)
    with pytest.raises(ValueError, match="--hicache-io-backend"):
        pool.backup_from_device_all_layer(
            device_pool, pages([0], 16), pages([1], 16), "kernel_ascend"
        )


# --- the real controller: write -> evict -> load ----------------------------


@pytest.mark.parametrize(
    "fmt,layout,page_size,io_backend",
    [
        ("int4", "page_first", 16, "kernel"),
        ("int4", "layer_first", 1, "direct"),
        ("int4", "page_first_direct", 1, "direct"),
        ("k8v4", "page_first", 16, "direct"),
        ("k8v4", "layer_first", 2, "kernel"),
    ],
)
def test_controller_random_operations(fmt, layout, page_size, io_backend):
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=page_size)
    rig = make_rig(
        geo,
        device_tokens=32 * page_size,
        host_tokens=48 * page_size,
        layout=layout,
        io_backend=io_backend,
        host_dtype=fmt,
    )
    assert type(rig.host_pool) is POOL_CLS[fmt]
    ctl, dev_pool, alloc = rig.controller, rig.device_pool, rig.allocator
    ut = unit_tokens(layout, page_size)
    rng = random.Random(7 + page_size)
    gen = torch.Generator().manual_seed(8)
    backed_up, resident, ops = [], [], 0
    for step in range(300):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 3) * page_size
            dev = alloc.alloc(n)
            if dev is None:
                continue
            expected = []
            for layer in range(geo.layer_num):
                k = (
                    torch.randn((n, 2, 64), generator=gen)
                    * rng.choice((1e-3, 1.0, 50.0))
                ).to(geo.dtype)
                v = torch.randn((n, 2, 64), generator=gen).to(geo.dtype)
                dev_pool.k_buffer[layer][dev] = k
                dev_pool.v_buffer[layer][dev] = v
                expected.append(expected_restore(fmt, k, v, ut)[:2])
            host = ctl.write(dev)
            finish_transfers(ctl)
            for layer in range(geo.layer_num):
                dev_pool.k_buffer[layer][dev] = float("nan")
                dev_pool.v_buffer[layer][dev] = float("nan")
            alloc.free(dev)
            if host is not None:
                backed_up.append((host, expected))
            ops += 1
        elif op < 0.75 and backed_up:
            host, expected = rng.choice(backed_up)
            dev = ctl.load(host)
            if dev is None:
                continue
            ctl.start_loading()
            finish_transfers(ctl)
            for layer, (k, v) in enumerate(expected):
                assert torch.equal(dev_pool.k_buffer[layer][dev], k), step
                assert torch.equal(dev_pool.v_buffer[layer][dev], v), step
            resident.append((dev, expected))
            ops += 1
        elif op < 0.9 and backed_up:
            host, _ = backed_up.pop(rng.randrange(len(backed_up)))
            ctl.evict_host(host)
            ops += 1
        elif resident:
            dev, _ = resident.pop(rng.randrange(len(resident)))
            alloc.free(dev)
            ops += 1
    assert ops > 150
    for dev, expected in resident:
        for layer, (k, v) in enumerate(expected):
            assert torch.equal(dev_pool.k_buffer[layer][dev], k)
            assert torch.equal(dev_pool.v_buffer[layer][dev], v)
    held = sum(len(h) for h, _ in backed_up)
    assert rig.host_pool.available_size() == rig.host_pool.size - held


# --- L3 page I/O --------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "layout,page_size",
    (("page_first", 16), ("page_first_direct", 64), ("layer_first", 16)),
)
def test_storage_pages_round_trip(fmt, layout, page_size):
    """A page read with get_data_page and written into another pool with
    set_from_flat_data_page restores the same values; short pages are refused."""
    geo, device_pool, pool = build(fmt, layout, page_size)
    other = make_host_pool(
        device_pool, host_tokens=16 * page_size, layout=layout, host_dtype=fmt
    )
    dev, host = pages([1, 2], page_size), pages([3, 5], page_size)
    written = fill_spread(device_pool, dev, seed=4)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    flat = [pool.get_data_page(int(i)) for i in host[::page_size]]
    per_token = pool.get_size_per_token()
    for page in flat:
        # The page's records, then its seal (page_integrity).
        assert page.dtype == torch.uint8
        assert page.numel() == per_token * page_size + SEAL_BYTES
    target = pages([0, 7], page_size)
    for index, page in zip(target[::page_size].tolist(), flat):
        other.set_from_flat_data_page(index, page)
    with pytest.raises(StoragePageRefused, match="size"):
        other.set_from_flat_data_page(0, flat[0][:-1])
    new_dev = pages([9, 10], page_size)
    for layer in range(geo.layer_num):
        other.load_to_device_per_layer(device_pool, target, new_dev, layer, "direct")
    ut = unit_tokens(layout, page_size)
    for layer, (k_rows, v_rows) in enumerate(written):
        k_want, v_want, _ = expected_restore(fmt, k_rows, v_rows, ut)
        assert torch.equal(device_pool.k_buffer[layer][new_dev], k_want)
        assert torch.equal(device_pool.v_buffer[layer][new_dev], v_want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_copy_page_buffers_cover_the_page(fmt):
    """get_page_buffer_meta: two objects per page ([k, k_meta], [v, v_meta]),
    whose bytes, read from the pointers, are the page's records exactly once."""
    _, device_pool, pool = build(fmt, "page_first", 16)
    dev, host = pages([1, 2], 16), pages([4, 6], 16)
    fill_spread(device_pool, dev, seed=3)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    ptrs, sizes = pool.get_page_buffer_meta(host)
    assert pool.storage_buffers_per_object == 3  # two record pieces and a seal
    assert len(ptrs) == len(sizes) == 2 * 2 * 3  # pages x objects x buffers
    names = RECORDS[fmt]
    for p, page in enumerate((4, 6)):
        piece = slice(6 * p, 6 * p + 6)
        got = [_bytes_at(ptr, size) for ptr, size in zip(ptrs[piece], sizes[piece])]
        # object order: k, k_meta (k_scale), seal | v, v_meta, seal
        records, seals = got[0:2] + got[3:5], (got[2], got[5])
        want = [pool.host_records[n][page].reshape(-1).view(torch.uint8) for n in names]
        for g, w in zip(records, want):
            assert torch.equal(g, w)
        assert all(len(seal) == SEAL_BYTES for seal in seals)
        assert sum(sizes[piece]) == pool.get_size_per_token() * 16 + 2 * SEAL_BYTES
    assert "kchannel" in pool.storage_format_tag or fmt == "k8v4"


def _bytes_at(ptr: int, size: int) -> torch.Tensor:
    import ctypes

    return torch.frombuffer(
        (ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8
    ).clone()


def test_layer_first_refuses_zero_copy_pages():
    _, _, pool = build("int4", "layer_first", 16)
    with pytest.raises(ValueError, match="page_first"):
        pool.get_page_buffer_meta(pages([0], 16))


# --- capacity ------------------------------------------------------------------


def allocated_bytes(pool) -> int:
    if hasattr(pool, "host_records"):
        return sum(b.numel() * b.element_size() for b in pool.host_records.values())
    return pool.kv_buffer.numel() * pool.kv_buffer.element_size()


def test_capacity_table_at_qwen3_8b_geometry():
    """Host tokens per allocated host byte against BF16, through the real
    dispatch, at Qwen3-8B geometry (36 layers, 8 KV heads, head dim 128).
    Run with -s to see the table (README, Capacity)."""
    budget_gb = 0.02
    rows, ratio = [], {}
    for page_size in (1, 16, 64):
        geo = Geometry(layer_num=36, head_num=8, head_dim=128, page_size=page_size)
        device_pool = make_device_pool(geo, device_tokens=2 * page_size)
        per_byte = {}
        for host_dtype in ("auto", "int8", "k8v4", "int4"):
            pool = make_host_pool(
                device_pool,
                host_size_gb=budget_gb,
                layout="page_first",
                host_dtype=host_dtype,
            )
            nbytes = allocated_bytes(pool)
            assert nbytes == pool.size * pool.get_size_per_token()
            per_byte[host_dtype] = pool.size / nbytes
            rows.append((page_size, host_dtype, nbytes / pool.size / 36))
        for host_dtype in ("int8", "k8v4", "int4"):
            ratio[host_dtype, page_size] = per_byte[host_dtype] / per_byte["auto"]
    print("\npage  format  B/token/layer  tokens per host byte vs BF16")
    for page_size, host_dtype, per_token in rows:
        name = "bf16" if host_dtype == "auto" else host_dtype
        r = 1.0 if host_dtype == "auto" else ratio[host_dtype, page_size]
        print(f"{page_size:>4}  {name:<6}  {per_token:>13.0f}  {r:.3f}x")
    # Spec figures (H=8, D=128): int8 2080 B, k8v4 1024+16+512+64 B, int4
    # 1152 B at page 64 and page 1 (per-token keys), 1344 B at page 16.
    assert ratio["int4", 64] >= 3.5
    assert ratio["int4", 64] == pytest.approx(4096 / 1152)
    assert ratio["int4", 16] == pytest.approx(4096 / 1344)
    assert ratio["int4", 1] == pytest.approx(4096 / 1152)
    for page_size in (1, 16, 64):
        assert ratio["int8", page_size] == pytest.approx(4096 / 2080)
        assert ratio["k8v4", page_size] == pytest.approx(4096 / 1616)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "layout,page_size", (("page_first", 64), ("page_first", 16), ("layer_first", 64))
)
def test_auto_size_ratio_matches_the_pool(fmt, layout, page_size):
    """host_bytes_per_device_byte (what auto-sizing asks) agrees with what a
    pool of that page size and layout allocates."""
    geo = Geometry(layer_num=4, head_num=8, head_dim=128, page_size=page_size)
    device_pool = make_device_pool(geo, device_tokens=2 * page_size)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    cls = get_mha_host_pool_cls(info, fmt)
    pool = make_host_pool(
        device_pool, host_tokens=4 * page_size, layout=layout, host_dtype=fmt
    )
    device_bytes = 4 * 8 * 256 * 2
    assert cls.host_bytes_per_device_byte(info, page_size=page_size, layout=layout) == (
        pytest.approx(pool.get_size_per_token() / device_bytes)
    )


# --- fused kernels (where this build has them) --------------------------------


@pytest.fixture
def int4_kernels_interpreted():
    """The int4/k8v4 kernels under Triton's interpreter (tests/conftest.py),
    so no GPU is needed; skipped where this build lacks them."""
    k4 = pytest.importorskip(
        "sglang.kernels.ops.kvcache.kv_int4_triton",
        reason="the int4/k8v4 fused kernels are not in this build",
    )
    if not k4.available("cpu"):
        pytest.skip("the fused kernels were built for the GPU, not interpreted")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("int4_kernels_interpreted")
@pytest.mark.parametrize(
    "fmt,layout,page_size,access",
    [
        ("int4", "page_first", 16, "direct"),
        ("int4", "layer_first", 1, "direct"),
        ("int4", "page_first_direct", 4, "staged"),
        ("k8v4", "page_first", 16, "staged"),
        ("k8v4", "layer_first", 2, "direct"),
    ],
)
def test_fused_path_writes_the_torch_paths_bytes(fmt, layout, page_size, access):
    """The format forwards encode_gather/decode_scatter to the kernels; their
    host bytes, restored rows and statistics equal the torch path's."""
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=page_size)
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pools = {}
    for path in ("torch", "fused"):
        pool = make_host_pool(
            device_pool, host_tokens=8 * page_size, layout=layout, host_dtype=fmt
        )
        assert pool.host_format.fused_available(torch.device("cpu"))
        if path == "fused":
            pool.use_fused_kernels = True
            pool.fused_host_access = access
        pools[path] = pool
    dev, host = pages([1, 2, 3], page_size), pages([5, 0, 3], page_size)
    fill_spread(device_pool, dev, seed=12)
    device_pool.k_buffer[0][dev[1], 1, 3] = float("nan")
    for pool in pools.values():
        pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    torch_pool, fused_pool = pools["torch"], pools["fused"]
    assert fused_pool.transfer_path == f"fused_{access}"
    for name, buf in torch_pool.host_records.items():
        assert torch.equal(
            fused_pool.host_records[name].view(torch.uint8), buf.view(torch.uint8)
        ), name
    assert fused_pool.nonfinite_group_count() == torch_pool.nonfinite_group_count() == 1
    assert torch.equal(
        fused_pool.scale_amax_by_layer(), torch_pool.scale_amax_by_layer()
    )
    restored = {}
    for path, pool in pools.items():
        new_dev = pages([8, 10, 9], page_size)
        for layer in range(geo.layer_num):
            device_pool.k_buffer[layer][new_dev] = 0
            device_pool.v_buffer[layer][new_dev] = 0
            pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
        restored[path] = [
            b[new_dev].clone() for b in device_pool.k_buffer + device_pool.v_buffer
        ]
    for a, b in zip(restored["torch"], restored["fused"]):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(
            a.nan_to_num(0).view(torch.int16), b.nan_to_num(0).view(torch.int16)
        )
