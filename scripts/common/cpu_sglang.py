"""SGLang's HiCache code on a CPU-only machine: the stand-ins it needs.

The stand-ins live in tests/cpu_standins.py (never in the product); every CPU
tool installs them through `install_cpu_standins` before importing sglang.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"

CPU_STANDIN_NAMES = (
    "torchvision import stub (cpu_standins.install_torchvision_stub)",
    "pure-torch transfer_kv_direct for pool_host.mha (stock direct io backend)",
    "no-op _cuda_host_register (pin_memory=False)",
)


def install_cpu_standins() -> list[str]:
    """Install tests/cpu_standins.py's stand-ins (idempotent); must run before
    sglang is imported. Returns their names for the tools' reports."""
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    import cpu_standins

    cpu_standins.install_torchvision_stub()
    cpu_standins.install_sglang_standins()
    return list(CPU_STANDIN_NAMES)
