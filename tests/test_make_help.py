"""`make help` and the README tell an operator, per target, what it costs here
and what it needs: time, the venv, the Debian packages, ../shared, torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    # The README's times are make help's: one figure per target, said twice.
    helped = dict(re.findall(r"^make (\S+)\s+(~\d+ min)", make_help(), re.M))
    for target in ("test", "test-fast", "demo", "quality"):
        said = re.search(rf"make {target} # (~\d+ min)", quick)
        assert said and said[1] == helped[target], (target, said, helped.get(target))


def test_fast_tier_runs_one_head_geometry():
    """make test-fast: every file it names exists (codecs, interpreted kernels,
    conformance, start-up refusals); with HIQ_FAST=1 a kernel's pool grid keeps
    one head geometry and every layout x page size, the conformance suite one
    geometry."""
    from scripts.rigs.hicache_harness import KERNEL_POOL_CASES

    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "test-fast"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    command = " ".join(dry.stdout.replace("\\\n", " ").split())
    run = command[command.index("HIQ_FAST=1 ") :].split()
    files = [word for word in run if word.startswith("tests/")]
    assert all((REPO / f).is_file() for f in files), files
    for kind in ("_codec.py", "_triton.py", "test_conformance.py", "test_startup.py"):
        assert any(f.endswith(kind) for f in files), kind
    pool, geometry = (
        "tests/test_kv_int8_triton.py::test_pool_fused_matches_torch_path",
        "tests/test_conformance.py::test_geometry_round_trip",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", pool, geometry],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HIQ_FAST": "1"},
    )
    ids = [line.partition("[")[2] for line in proc.stdout.splitlines() if "[" in line]
    assert ids, proc.stdout[-2000:] + proc.stderr[-2000:]
    pool_ids = {i.rsplit("-", 1)[0] for i in ids if "geometry" in i}
    pairs = {f"{layout}-{page}" for layout, page, _ in KERNEL_POOL_CASES}
    assert pool_ids == pairs
    assert len([i for i in ids if "geometry" in i]) == len(pairs)
    conformance = {re.search(r"\(\d+(, \d+)*\)", i)[0] for i in ids if "(" in i}
    assert len(conformance) == 1
