"""SGLang's HiCache code on a CPU-only machine, with scripts/rigs' stand-ins."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CPU_STANDIN_NAMES = (
    "torchvision import stub (scripts.rigs.standins.install_torchvision_stub)",
    "pure-torch transfer_kv_direct for pool_host.mha (stock direct io backend)",
    "no-op _cuda_host_register (pin_memory=False)",
)


def install_cpu_standins() -> list[str]:
    """Install scripts/rigs/standins.py's stand-ins (idempotent); must run before
    sglang is imported. Returns their names for the tools' reports."""
    from scripts.rigs import standins

    standins.install_torchvision_stub()
    standins.install_sglang_standins()
    return list(CPU_STANDIN_NAMES)
