"""The quality tests' inputs: WikiText-2 and the packaged SmolLM2 GGUF, and
the few short windows the CPU tests score (the full-size run is `make
quality`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.quality import harness as hq

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXT_FILE = Path(
    os.environ.get(
        "HIQ_WIKITEXT", REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
    )
)
SMALL = dict(windows=2, prefix_len=128, score_len=64, greedy_tokens=8, seed=1)


def require_inputs():
    missing = []
    if not TEXT_FILE.is_file():
        missing.append(f"WikiText-2 at {TEXT_FILE} (set HIQ_WIKITEXT)")
    try:
        hq.smollm_gguf_path()
    except FileNotFoundError as exc:
        missing.append(str(exc))
    if missing:
        if os.environ.get("CI"):
            pytest.fail("quality test inputs missing in CI: " + "; ".join(missing))
        pytest.skip("; ".join(missing))
