"""INT4 and K8V4 host pools (host_pool_cls("int4"/"k8v4"), pool_host/mha_encoded.py) through the real patched
SGLang code on CPU: the dispatch, every layout, page size and io backend,
BF16/FP16 device KV, the real controller, L3 page I/O and the capacity the
allocated buffers give against BF16.

Expected values come from the format's reference encode/decode on the rows
the test wrote (tests/support/int4_pool_checks.py, which the rotated formats'
tests run too).
"""

from __future__ import annotations

import logging

import pytest
import torch

from scripts.rigs.hicache_harness import Geometry, make_device_pool, make_host_pool
from tests.support.conformance import LAYOUTS
from tests.support.int4_pool_checks import (
    assert_finite_elsewhere,
    restore_nan_key_and_inf_value,
    build,
    bytes_per_token_at_qwen3_8b,
    check_auto_size_ratio_matches_the_pool,
    check_controller_random_operations,
    check_fused_path_writes_the_torch_paths_bytes,
    check_out_of_range_host_indices,
    check_storage_pages_round_trip,
    check_transfer_larger_than_staging_is_chunked,
    check_zero_copy_page_buffers_cover_the_page,
    pages,
)
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host.mha import (
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

MHATokenToKVPoolINT4Host = host_pool_cls("int4")
MHATokenToKVPoolK8V4Host = host_pool_cls("k8v4")

FORMATS = ("int4", "k8v4")
# The checks every 4-bit format passes, its rotated forms (int4r, k8v4r) too.
FAMILY = (*FORMATS, "int4r", "k8v4r")


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


@pytest.mark.parametrize("fmt", ("int4", "int4r"))
def test_transfer_larger_than_staging_is_chunked(fmt, monkeypatch):
    check_transfer_larger_than_staging_is_chunked(fmt, monkeypatch)


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
    def counted(pool):
        assert pool.nonfinite_group_count() == 2

    pool, k1, v0 = restore_nan_key_and_inf_value(fmt, layout, page_size, counted)
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
    assert_finite_elsewhere(pool, k1, v0)


@pytest.mark.parametrize("fmt", FAMILY)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_host_indices_rejected_and_nothing_moves(fmt, layout):
    check_out_of_range_host_indices(fmt, layout)


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
        ("int4r", "page_first", 16, "kernel"),
        ("int4r", "layer_first", 1, "direct"),
        ("int4r", "page_first_direct", 64, "kernel"),
        ("int4r", "page_first", 16, "direct"),
        ("k8v4r", "page_first", 16, "kernel"),
        ("k8v4r", "layer_first", 1, "direct"),
        ("k8v4r", "page_first_direct", 64, "kernel"),
        ("k8v4r", "layer_first", 2, "kernel"),
    ],
)
def test_controller_random_operations(fmt, layout, page_size, io_backend):
    check_controller_random_operations(fmt, layout, page_size, io_backend)


# --- L3 page I/O --------------------------------------------------------------


@pytest.mark.parametrize("fmt", FAMILY)
@pytest.mark.parametrize(
    "layout,page_size",
    (("page_first", 16), ("page_first_direct", 64), ("layer_first", 16)),
)
def test_storage_pages_round_trip(fmt, layout, page_size):
    check_storage_pages_round_trip(fmt, layout, page_size)


@pytest.mark.parametrize("fmt", FAMILY)
def test_zero_copy_page_buffers_cover_the_page(fmt):
    check_zero_copy_page_buffers_cover_the_page(fmt)


def test_layer_first_refuses_zero_copy_pages():
    _, _, pool = build("int4", "layer_first", 16)
    with pytest.raises(ValueError, match="page_first"):
        pool.get_page_buffer_meta(pages([0], 16))


# --- capacity ------------------------------------------------------------------


def test_capacity_table_at_qwen3_8b_geometry():
    """Host tokens per allocated host byte against BF16, through the real
    dispatch, at Qwen3-8B geometry (36 layers, 8 KV heads, head dim 128).
    Run with -s to see the table (README, Capacity)."""
    rows, ratio = [], {}
    for page_size in (1, 16, 64):
        per_token = bytes_per_token_at_qwen3_8b(
            ("auto", "int8", "k8v4", "int4"), page_size
        )
        for host_dtype, nbytes in per_token.items():
            rows.append((page_size, host_dtype, nbytes / 36))
        for host_dtype in ("int8", "k8v4", "int4"):
            ratio[host_dtype, page_size] = per_token["auto"] / per_token[host_dtype]
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


@pytest.mark.parametrize("fmt", FAMILY)
@pytest.mark.parametrize(
    "layout,page_size", (("page_first", 64), ("page_first", 16), ("layer_first", 64))
)
def test_auto_size_ratio_matches_the_pool(fmt, layout, page_size):
    check_auto_size_ratio_matches_the_pool(fmt, layout, page_size)


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
    torch_pool, _, _ = check_fused_path_writes_the_torch_paths_bytes(
        fmt, layout, page_size, access
    )
    assert torch_pool.nonfinite_group_count() == 1
