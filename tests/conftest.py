"""Shared fixtures: CPU stand-ins, installed once before sglang is imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton decides at import (triton.jit) whether kernels are interpreted: on a
# machine without CUDA the fused host-pool kernels run under its interpreter.
# An explicit TRITON_INTERPRET (the compile check's workers set 0) wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.support.standins import install_torchvision_stub  # noqa: E402

install_torchvision_stub()
if os.environ.get("HIQ_PIPELINE_ONLY") != "1":
    from tests.support.standins import install_sglang_standins  # noqa: E402

    install_sglang_standins()


@pytest.fixture(scope="module")
def triton_interpreter():
    """Modules whose kernels run on CPU tensors opt in with usefixtures: they
    need the kernels built under Triton's interpreter (set above)."""
    from sglang.kernels.ops.kvcache import host_kv_common

    if not host_kv_common.available("cpu"):
        pytest.skip("the fused kernels were built for the GPU, not interpreted")


@pytest.fixture(scope="module", autouse=True)
def _restore_sglang_log_level():
    """The demo and replay tools quiet the sglang logger in-process; later
    modules assert on its INFO/WARNING lines, so each module starts as it was."""
    import logging

    logger = logging.getLogger("sglang")
    level = logger.level
    yield
    logger.setLevel(level)
