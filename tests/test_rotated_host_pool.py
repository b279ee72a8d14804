"""The rotated host formats (int4r, k8v4r) through the real patched SGLang pools and
controller on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from scripts.rigs.hicache_harness import (
    assert_self_check_falls_back,
)
from sglang.srt.mem_cache.pool_host import encoded_fused
from tests.support.int4_pool_checks import (
    build,
)

ROTATED = {"int4r": "int4", "k8v4r": "k8v4"}  # format -> base format
IO_BACKENDS = ("kernel", "direct")


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
    """The rotated formats take the fused path wherever int4/k8v4 would (a CUDA transfer
    device here, its self-check taken as passed)."""
    import dataclasses

    from sglang.kernels.ops.kvcache import kv_int4_triton

    _, _, pool = build(fmt, "page_first", 16)
    monkeypatch.setattr(kv_int4_triton, "available", lambda device: True)
    assert pool.host_format.fused_available(torch.device("cuda"))
    on_cuda = dataclasses.replace(pool.transfer_context, device=torch.device("cuda"))
    transfer, why = encoded_fused.choose_transfer(on_cuda, False, None, check=False)
    assert isinstance(transfer, encoded_fused.FusedTransfer)
    # Not pinned on this CPU pool: staged, the reason int4's pools give too.
    assert (transfer.path, why) == (
        "fused_staged",
        "host memory not device-addressable (not pinned)",
    )


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fmt", ROTATED)
def test_self_check_passes_and_catches_wrong_signs(fmt, monkeypatch, caplog):
    """The start-up self-check (the other formats' own) passes on the fused path;
    kernels given another sign vector fail it and the pool falls back to the torch
    path."""
    _, device_pool, pool = build(fmt, "page_first", 16, fused_transfer="direct")
    assert pool.transfer_path == "fused_direct"
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None

    fmt_cls = type(pool.host_format)
    real = fmt_cls._kernel_rotation

    def flipped(self, device):
        args = real(self, device)
        return {**args, "rotation_signs": -args["rotation_signs"]}

    monkeypatch.setattr(fmt_cls, "_kernel_rotation", flipped)
    assert_self_check_falls_back(pool, caplog, "differs from the torch reference")
