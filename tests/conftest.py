"""Shared fixtures: CPU stand-ins, installed once before sglang is imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.support.standins import install_torchvision_stub  # noqa: E402

install_torchvision_stub()
if os.environ.get("HIQ_PIPELINE_ONLY") != "1":
    from tests.support.standins import install_sglang_standins  # noqa: E402

    install_sglang_standins()


@pytest.fixture(scope="module")
def triton_interpreter():
    """Build the fused host-pool kernels (INT8, INT4/K8V4) under Triton's
    interpreter for one test module (modules opt in with usefixtures), so no
    GPU is needed."""
    from sglang.kernels.ops.kvcache import kv_int4_triton as k4
    from sglang.kernels.ops.kvcache import kv_int8_triton as kt

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        kt.reset_kernels()
        k4.reset_kernels()
        yield
    kt.reset_kernels()
    k4.reset_kernels()
