"""SGLang's HiCache code on a CPU-only machine, with tests/support's stand-ins."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CPU_STANDIN_NAMES = (
    "torchvision import stub (tests.support.standins.install_torchvision_stub)",
    "pure-torch transfer_kv_direct for pool_host.mha (stock direct io backend)",
    "no-op _cuda_host_register (pin_memory=False)",
)


def install_cpu_standins() -> list[str]:
    """Install tests/support/standins.py's stand-ins (idempotent); must run before
    sglang is imported. Returns their names for the tools' reports."""
    from tests.support import standins

    standins.install_torchvision_stub()
    standins.install_sglang_standins()
    return list(CPU_STANDIN_NAMES)
