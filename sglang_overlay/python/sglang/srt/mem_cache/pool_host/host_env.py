# SPDX-License-Identifier: Apache-2.0
"""The environment variables of the encoded host (L2) KV pools, read strictly.

Envs (environ.py) declares them; its readers turn a malformed value into the
default with a Python warning, which would switch the feature off unseen. The
start-up checks (arg_groups/hicache_host_checks.py) and the pools read them
here instead, so a bad value is refused naming the variable. No torch: the
start-up checks import this for every --hicache-host-dtype, auto included.
"""

from __future__ import annotations

import os

FUSED_ENV = "SGLANG_HICACHE_FUSED_TRANSFER"
FUSED_MODES = ("auto", "off", "direct", "staged")
VERIFY_ENV = "SGLANG_HICACHE_VERIFY_SAMPLE_RATE"


def fused_transfer_mode() -> str:
    """SGLANG_HICACHE_FUSED_TRANSFER: auto (unset or empty), off, direct or staged."""
    raw = os.environ.get(FUSED_ENV, "")
    mode = raw.strip().lower() or "auto"
    if mode not in FUSED_MODES:
        raise ValueError(
            f"{FUSED_ENV}={raw!r} is not a transfer path; pass auto (fused "
            "kernels on CUDA, the default), off (torch path), direct or staged, "
            "or unset it."
        )
    return mode


def verify_sample_rate(default: float) -> float:
    """SGLANG_HICACHE_VERIFY_SAMPLE_RATE: the fraction of backed-up pages
    decoded again and checked, in [0, 1]; `default` when unset or empty."""
    raw = os.environ.get(VERIFY_ENV, "")
    if not raw.strip():
        return default
    try:
        rate = float(raw)
    except ValueError:
        rate = float("nan")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(
            f"{VERIFY_ENV}={raw!r} must be a fraction of backed-up pages between "
            f"0 and 1, e.g. {default} (the default) or 0 to turn the "
            "sampled restore check off."
        )
    return rate


def is_set(name: str) -> bool:
    """Whether the variable asks for anything (set and not empty)."""
    return bool(os.environ.get(name, "").strip())
