"""`make help` and the README tell an operator, per target, what it costs here
and what it needs: time, the venv, the Debian packages, ../shared, torch."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Targets with no help line of their own: help itself, the venv (named in
# the header), clean.
UNLISTED = {"help", "venv", "clean"}


def make_help() -> str:
    proc = subprocess.run(
        ["make", "--no-print-directory", "help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_gives_every_target_its_time_or_machine():
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M)
    targets = set(phony[1].split()) - UNLISTED
    lines = {m[1]: m[2] for m in re.finditer(r"^make (\S+)\s+(.*)$", make_help(), re.M)}
    assert set(lines) == targets
    cost = re.compile(r"^(~?\d+ (s|min)|<1 min|seconds|on a CUDA machine|Docker)")
    for target, line in lines.items():
        assert cost.match(line), f"make {target}: no time: {line}"


def test_help_names_each_prerequisite():
    text = make_help()
    lines = dict(re.findall(r"^make (\S+)\s+(.*)$", text, re.M))
    assert "scripts/debian_deps.sh install" in lines["demo-l3"]
    assert "scripts/debian_deps.sh install" in lines["test"]
    assert "../shared/data/wikitext-2" in lines["quality"]
    assert "[venv]" in lines["demo"] and "[venv]" in lines["bench-codec"]
    assert "~3 GB" in text
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert "the CUDA build (several GB)" in text


def test_readme_quick_start_names_the_prerequisites():
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Quick start")
    quick = " ".join(readme[start : readme.index("\n## ", start + 1)].split())
    for needed in (
        "sudo bash scripts/debian_deps.sh install",
        "../shared/data/wikitext-2/test.txt",
        "TORCH_INDEX=https://download.pytorch.org/whl/cpu",
        "~3 GB",
        "make help",
    ):
        assert needed in quick, needed
    for target, minutes in (("test", 18), ("demo", 14), ("quality", 12)):
        assert re.search(rf"make {target} # ~{minutes} min", quick), target
