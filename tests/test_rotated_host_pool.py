"""The rotated host formats (int4r, k8v4r) through the real patched SGLang
pools and controller on CPU.

The format-independent checks are those test_int4_host_pool runs
(tests/support/int4_pool_checks.py, expected records and rows from each
format's reference encode/decode); what differs (start-up log, NaN spread,
transfer path, capacity) is tested below.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.hicache_harness import (
    Geometry,
    assert_self_check_falls_back,
    make_device_pool,
)
from sglang.srt.mem_cache.pool_host import encoded_fused
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from tests.support.rotated_keys_format import K8V4RotKeysHostFormat
from tests.support.int4_pool_checks import (
    assert_finite_elsewhere,
    restore_nan_key_and_inf_value,
    build,
    bytes_per_token_at_qwen3_8b,
    check_controller_random_operations,
    check_fused_path_writes_the_torch_paths_bytes,
)

ROTATED = {"int4r": "int4", "k8v4r": "k8v4"}  # format -> base format
POOL_CLS = {name: host_pool_cls(name) for name in ROTATED}
IO_BACKENDS = ("kernel", "direct")


# --- what differs from int4/k8v4 (the shared checks: test_int4_host_pool) ----


def test_dispatch_by_host_dtype():
    info = make_device_pool(Geometry(), 16).get_device_pool_infos()[0].buffer_info
    for name, cls in POOL_CLS.items():
        assert get_mha_host_pool_cls(info, name) is cls
        assert cls.host_format_cls.name == name


# --- what differs from int4/k8v4 ---------------------------------------------


@pytest.mark.parametrize(
    "fmt,layout,page_size,dims,texts",
    [
        (
            "int4r",
            "page_first",
            64,
            (64, 64),
            ("keys per channel over 64-token pages", "k in one 64-point block"),
        ),
        (
            "int4r",
            "layer_first",
            64,
            (96, 96),
            ("keys per token in groups of 32 channels", "v in 3 blocks of 32"),
        ),
        ("k8v4r", "page_first", 16, (64, 64), ("keys as int8", "v in one 64-point")),
        ("int4r", "page_first", 16, (72, 72), ("k NOT rotated (head dim 72",)),
    ],
)
def test_startup_log_states_rotation_and_cpu_torch_path(
    fmt, layout, page_size, dims, texts, caplog
):
    # The sglang logger itself: an earlier in-process server tool may have raised its level.
    with caplog.at_level(logging.INFO, logger="sglang"):
        build(fmt, layout, page_size, head_dim=dims[0], v_head_dim=dims[1])
    text = caplog.text
    assert f"stores {fmt.upper()} KV" in text
    assert "Walsh-Hadamard rotation per head (seeded sign flip)" in text
    for part in texts:
        assert part in text
    assert f"{fmt.upper()} host pool transfer path: torch" in text
    warned = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "NOT rotated" in r.getMessage()
    ]
    assert bool(warned) == ("NOT rotated" in text)


@pytest.mark.parametrize("fmt", ROTATED)
def test_fused_kernels_are_selected_where_the_base_kernels_run(fmt, monkeypatch):
    """The rotated formats take the fused path wherever int4/k8v4 would (a
    CUDA transfer device here); the INT8-rotated-keys variant has no kernels
    and says so naming the flag."""
    from sglang.kernels.ops.kvcache import kv_int4_triton

    _, _, pool = build(fmt, "page_first", 16)
    monkeypatch.setattr(kv_int4_triton, "available", lambda device: True)
    assert pool.host_format.fused_rotation
    assert pool.host_format.fused_available(torch.device("cuda"))
    pool._transfer_device = torch.device("cuda")  # only select_transfer reads it
    transfer = encoded_fused.select_transfer(pool)
    assert isinstance(transfer, encoded_fused.FusedTransfer)
    # Not pinned on this CPU pool: staged, the reason int4's pools give too.
    assert (
        pool.transfer_path_reason == "host memory not device-addressable (not pinned)"
    )

    k8rv4r = K8V4RotKeysHostFormat((64, 64), 2, 16, torch.bfloat16)
    assert not k8rv4r.fused_available(torch.device("cuda"))
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype k8rv4r"):
        k8rv4r.encode_gather(None, None, None, None)


FUSED_CASES = [
    ("int4r", "page_first", 16, "direct"),
    ("int4r", "layer_first", 1, "direct"),
    ("int4r", "page_first_direct", 4, "staged"),
    ("k8v4r", "page_first", 16, "staged"),
    ("k8v4r", "layer_first", 2, "direct"),
]


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fmt,layout,page_size,access", FUSED_CASES)
def test_fused_path_writes_the_torch_paths_bytes(fmt, layout, page_size, access):
    """Through the real pool: the fused kernels' host bytes, statistics and
    restored rows equal the torch path's, a NaN key spread over its block."""
    torch_pool, _, restored = check_fused_path_writes_the_torch_paths_bytes(
        fmt, layout, page_size, access
    )
    assert torch_pool.nonfinite_group_count() >= 1
    # Head dim 64 is one block: the NaN key's whole head row restores as NaN.
    assert torch.isnan(restored["fused"][0][1, 1]).all()


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fmt", ROTATED)
def test_self_check_passes_and_catches_wrong_signs(fmt, monkeypatch, caplog):
    """The start-up self-check (the other formats' own) passes on the fused
    path; kernels given another sign vector fail it and the pool falls back
    to the torch path."""
    _, device_pool, pool = build(fmt, "page_first", 16)
    pool.use_fused_kernels = True
    assert encoded_fused.self_check(pool) is True
    assert pool.transfer_path == "fused_direct"

    fmt_obj, real = pool.host_format, pool.host_format._kernel_rotation

    def flipped(device):
        args = real(device)
        return {**args, "rotation_signs": -args["rotation_signs"]}

    monkeypatch.setattr(fmt_obj, "_kernel_rotation", flipped)
    assert_self_check_falls_back(pool, caplog, "differs from the torch reference")


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "fmt,layout,page_size",
    [("int4r", "page_first", 16), ("k8v4r", "layer_first", 2)],
)
def test_controller_random_operations_on_the_fused_path(fmt, layout, page_size):
    """HiCacheController's random writes, loads and evictions with the pool
    on the fused kernels: every restore equals the rotated reference."""
    check_controller_random_operations(fmt, layout, page_size, "kernel", fused=True)


@pytest.mark.parametrize("fmt", ROTATED)
@pytest.mark.parametrize("layout,page_size", (("page_first", 16), ("layer_first", 1)))
def test_nonfinite_kv_restores_as_nan_over_its_block(fmt, layout, page_size):
    """A NaN key and an Inf value: every channel of their rotation block
    restores as NaN, the groups are counted, the amax stays finite, and the
    other heads and tokens restore finite."""

    def counted(pool):
        assert pool.nonfinite_group_count() >= 2

    pool, k1, v0 = restore_nan_key_and_inf_value(fmt, layout, page_size, counted)
    # head dim 64: one 64-point block per head
    assert torch.isnan(k1[1, 1]).all() and torch.isnan(v0[-1, 0]).all()
    per_channel_keys = fmt == "int4r" and page_size >= 16
    k_bad = (slice(0, page_size), 1) if per_channel_keys else (1, 1)
    k1[k_bad] = 0
    v0[-1, 0] = 0
    assert_finite_elsewhere(pool, k1, v0)


@pytest.mark.parametrize("fmt", ROTATED)
def test_storage_tag_differs_from_the_base_format(fmt):
    _, _, pool = build(fmt, "page_first", 16)
    _, _, base = build(ROTATED[fmt], "page_first", 16)
    assert pool.storage_format_tag.startswith(f"{fmt}-")
    assert pool.storage_format_tag != base.storage_format_tag
    assert pool.get_size_per_token() == base.get_size_per_token()


def test_capacity_unchanged_at_qwen3_8b_geometry():
    """Bytes per token of the allocated host buffers, rotated vs base, at
    Qwen3-8B geometry (36 layers, 8 KV heads, head dim 128), page 64 (and 16,
    1). Run with -s for the table (docs/quality-rotated.md)."""
    print("\npage  format  B/token  tokens per host byte vs BF16")
    for page_size in (1, 16, 64):
        per_token = bytes_per_token_at_qwen3_8b(
            ("k8v4", "k8v4r", "int4", "int4r"), page_size
        )
        for name, nbytes in per_token.items():
            ratio = 36 * 2 * 8 * 128 * 2 / nbytes
            print(f"{page_size:>4}  {name:<6}  {nbytes:>7.0f}  {ratio:.3f}x")
        assert per_token["int4r"] == per_token["int4"]
        assert per_token["k8v4r"] == per_token["k8v4"]
        if page_size == 64:
            assert 36 * 2 * 8 * 128 * 2 / per_token["int4r"] >= 3.5
