"""Shared fixtures: CPU stand-ins, installed once before sglang is imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_standins import install_torchvision_stub  # noqa: E402

install_torchvision_stub()
if os.environ.get("HIQ_PIPELINE_ONLY") != "1":
    from cpu_standins import install_sglang_standins  # noqa: E402

    install_sglang_standins()
