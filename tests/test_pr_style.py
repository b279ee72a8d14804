"""The exported PR passes upstream SGLang's pre-commit formatters and spell
check (black 24.10, isort 5.13 with the black profile, codespell 2.4) on
everything it adds: the overlay files and the lines the patches add."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OVERLAY_PY = sorted(str(p) for p in (ROOT / "sglang_overlay").rglob("*.py"))


def run(tool, *args):
    return subprocess.run(
        [str(BIN / tool), *args], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.skipif(not OVERLAY_PY, reason="no overlay files")
def test_overlay_is_black_and_isort_clean():
    black = run("black", "--check", "--quiet", *OVERLAY_PY)
    assert black.returncode == 0, black.stderr
    isort = run("isort", "--profile", "black", "--check-only", *OVERLAY_PY)
    assert isort.returncode == 0, isort.stdout + isort.stderr


def test_added_lines_pass_codespell(tmp_path):
    added = []
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        added += [
            line[1:]
            for line in patch.read_text().splitlines()
            if line.startswith("+") and not line.startswith("+++")
        ]
    text = tmp_path / "added_lines.txt"
    text.write_text("\n".join(added) + "\n")
    result = run("codespell", str(text), *OVERLAY_PY, "docs/PR_DESCRIPTION.md")
    assert result.returncode == 0, result.stdout
