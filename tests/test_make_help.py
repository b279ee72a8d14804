"""`make help` and the README tell an operator, per target, what it costs here and
what it needs; dry runs of `make test-fast`, `wheel` and `venv`; `make demo-l3`
checks Mooncake's native libraries before it imports SGLang."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from scripts.demo import l3

REPO = Path(__file__).resolve().parents[1]
# Targets with no help line of their own: help itself, the venv (named in
# the header), clean.
UNLISTED = {"help", "venv", "clean"}


def make(*args: str) -> str:
    proc = subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_gives_every_target_its_time_or_machine_and_prerequisites():
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M)
    text = make("help")
    lines = dict(re.findall(r"^make (\S+)\s+(.*)$", text, re.M))
    assert set(lines) == set(phony[1].split()) - UNLISTED
    cost = re.compile(r"^(~?\d+ (s|min)|<1 min|seconds|on a CUDA machine|Docker)")
    for target, line in lines.items():
        assert cost.match(line), f"make {target}: no time: {line}"
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
    helped = dict(re.findall(r"^make (\S+)\s+(~\d+ min)", make("help"), re.M))
    for target in ("test", "test-fast", "demo", "quality"):
        said = re.search(rf"make {target} # (~\d+ min)", quick)
        assert said and said[1] == helped[target], (target, said, helped.get(target))


def test_fast_tier_runs_one_head_geometry():
    """make test-fast: every file it names exists (codecs, interpreted kernels,
    conformance, start-up refusals); with HIQ_FAST=1 a kernel's pool grid keeps
    one head geometry and every layout x page size, the conformance suite one
    geometry."""
    from scripts.rigs.hicache_harness import KERNEL_POOL_CASES

    command = " ".join(make("-n", "test-fast").replace("\\\n", " ").split())
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


def test_make_wheel_builds_the_image_tag_without_the_test_venv():
    out = make("-n", "wheel", "PYTHON=python3")
    # Only the pinned wheel tool, installed on its own; never the venv recipe.
    assert "-m venv" not in out and ".stamp" not in out
    pins = (REPO / "requirements" / "test-tools.txt").read_text().splitlines()
    assert any(line.startswith("wheel==") for line in pins)
    assert "grep -m1 '^wheel==' requirements/test-tools.txt" in out
    host = f"{sys.version_info.major}{sys.version_info.minor}"
    assert f"for tag in {' '.join(sorted({'312', host}))}; do" in out
    assert "scripts/overlay.py wheel --python-tag $tag" in out


# Requirements files that stay out of the test venv (make quality-gemma's).
OUTSIDE_THE_TEST_VENV = {"quality-gemma.txt"}


def test_make_venv_installs_every_pinned_requirements_file():
    """The venv recipe installs each requirements/*.txt and rebuilds when one
    changes; a file left out passes here and breaks a clean clone (CI)."""
    installed = set(
        re.findall(
            r"-r requirements/(\S+\.txt)", make("-n", "-B", "venv", "PYTHON=python3")
        )
    )
    pinned = {p.name for p in (REPO / "requirements").glob("*.txt")}
    assert installed == pinned - OUTSIDE_THE_TEST_VENV
    # The prerequisites: the rule's line and its backslash continuations.
    makefile = (REPO / "Makefile").read_text()
    rule = re.search(r"^\$\(VENV\)/\.stamp:((?:.*\\\n)*.*)$", makefile, re.M)
    assert rule, "Makefile has no $(VENV)/.stamp rule"
    assert set(re.findall(r"requirements/(\S+\.txt)", rule[1])) == installed


# A fresh interpreter: one library made unloadable, and setup() (SGLang's
# import) replaced by an exit that says it was reached.
PROBE = """
import json, sys
from scripts.demo import l3
l3.NATIVE_LIBS["libhiq-absent.so.1"] = "librdmacm1"
l3.setup = lambda: sys.exit("setup reached: SGLang would be imported first")
try:
    l3.main(["--out", sys.argv[1]])
except SystemExit as e:
    print(json.dumps({"exit": str(e.code), "loaded": sorted(
        m for m in ("sglang", "torch", "mooncake") if m in sys.modules)}))
"""


def test_missing_library_fails_in_one_line_before_sglang(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["exit"] == (
        "demo-l3: Mooncake needs the Debian packages librdmacm1; install them "
        "with: sudo bash scripts/debian_deps.sh install"
    )
    assert result["loaded"] == []
    assert not list(tmp_path.iterdir())


def test_native_libs_are_the_ones_debian_deps_installs_and_each_is_tried():
    libs = {"libc.so.6": "libc6", "libhiq-absent.so.1": "hiq-absent"}
    assert l3.missing_native_packages(libs) == ["hiq-absent"]
    script = (REPO / "scripts" / "debian_deps.sh").read_text()
    pairs = re.search(r"for lib in ([^;]+);", script)
    assert pairs, "scripts/debian_deps.sh: no `for lib in pkg:soname ...` loop"
    listed = dict(p.split(":")[::-1] for p in pairs[1].split())
    assert l3.NATIVE_LIBS == listed
