"""The rotated host formats (int4r, k8v4r) beyond the conformance rows: their fused
path's selection and self-check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scripts.rigs.hicache_harness import assert_self_check_falls_back
from sglang.kernels.ops.kvcache import kv_int4_triton
from sglang.srt.mem_cache.pool_host import encoded_fused
from sglang.srt.mem_cache.pool_host.encoded import choose_transfer
from tests.support.int4_pool_checks import build

ROTATED = ("int4r", "k8v4r")


@pytest.mark.parametrize("fmt", ROTATED)
def test_fused_kernels_are_selected_where_the_base_kernels_run(fmt, monkeypatch):
    """The rotated formats take the fused path wherever int4/k8v4 would (a CUDA transfer
    device here, its self-check taken as passed)."""
    _, _, pool = build(fmt, "page_first", 16)
    monkeypatch.setattr(kv_int4_triton, "available", lambda device: True)
    assert pool.host_format.fused_available(torch.device("cuda"))
    on_cuda = dataclasses.replace(pool.transfer_context, device=torch.device("cuda"))
    transfer, why = choose_transfer(on_cuda, False, None, check=False)
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
