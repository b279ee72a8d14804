"""The encoded host pools' bytes are what tests/hash_grid_reference.json
recorded: host buffers, L3 pages, zero-copy pieces, statistics, storage tags
and bytes per token over formats x layouts x geometries x dtypes x page sizes
x transfer paths (tests/support/hash_grid.py; rewrite the reference only for
an intended byte change, with a new storage_format_tag)."""

from __future__ import annotations

import os
import subprocess
import sys

from scripts.rigs.standins import REPO_ROOT

REFERENCE = REPO_ROOT / "tests" / "hash_grid_reference.json"


def test_pool_bytes_match_the_recorded_grid():
    # Its own interpreter: the fused cases need TRITON_INTERPRET before triton loads.
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.hash_grid", "--check", str(REFERENCE)],
        cwd=REPO_ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = [line for line in run.stdout.splitlines() if line]
    assert run.returncode == 0, "\n".join(summary[-40:]) + run.stderr[-2000:]
    assert summary[-1].startswith("648/648 cases identical"), summary[-1]
