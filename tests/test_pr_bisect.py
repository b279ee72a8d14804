"""Release check (HIQ_PR_BISECT=1, ~4 min): each exported PR `git am`s onto the ones
before; every commit byte-compiles, and at each PR's end its modules import, the unit
tests so far pass (upstream_unit_runner.py) and start-up imports nothing later."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pipeline import GIT_ENV, git

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "sglang"
ENVIRON = "python/sglang/srt/environ.py"


@pytest.mark.skipif(
    os.environ.get("HIQ_PR_BISECT") != "1", reason="release check: HIQ_PR_BISECT=1"
)
def test_each_pr_applies_alone_on_the_pin_and_passes_its_unit_tests(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "overlay.py"), "pr"],
        check=True, cwd=REPO, capture_output=True, env={**os.environ, **GIT_ENV},
    )  # fmt: skip
    pr_dirs = sorted(
        (REPO / "dist" / "pr").iterdir(), key=lambda p: int(p.name.split("-")[0])
    )
    assert len(pr_dirs) >= 2
    work = tmp_path / "pristine"
    git(tmp_path, "clone", "-q", "--shared", "--no-checkout", str(TREE), str(work))
    git(work, "checkout", "-q", "--detach", "hiq-baseline")
    base = git(work, "rev-parse", "HEAD").strip()
    env = {**os.environ, "PYTHONPATH": f"{work}/python", "HIQ_SGLANG_TREE": str(work)}

    def run(pr: str, *args: str) -> None:  # on the PRs so far, in a fresh Python
        cmd = [sys.executable, "-m", *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, f"{pr}:\n{proc.stdout}\n{proc.stderr[-4000:]}"

    for pr_dir in pr_dirs:
        start = git(work, "rev-parse", "HEAD").strip()
        for patch in sorted(pr_dir.glob("*.patch")):
            git(work, "am", "-q", "--keep-cr", str(patch))
            changed = git(
                work, "diff", "--name-only", "--diff-filter=AM", "HEAD~1", "HEAD"
            )
            for rel in changed.split():
                if rel.endswith(".py"):
                    py_compile.compile(str(work / rel), doraise=True)
        added = git(work, "diff", "--name-only", "--diff-filter=A", base, "HEAD")
        tests = [
            str(work / p) for p in added.split() if p.startswith("test/registered/")
        ]
        assert tests, f"{pr_dir.name}: the PRs so far add no unit test"
        touched = git(work, "diff", "--name-only", "--diff-filter=AM", start, "HEAD")
        modules = [
            p.removeprefix("python/").removesuffix(".py").replace("/", ".")
            for p in touched.split()
            if p.startswith("python/") and p.endswith(".py")
        ]
        assert modules, f"{pr_dir.name}: touches no Python module"
        run(
            pr_dir.name,
            "tests.upstream_unit_runner",
            "--import",
            *modules,
            "--",
            *tests,
        )
        # The SGLANG_HICACHE_* variables the PRs so far add to Envs.
        environ = git(work, "diff", base, "HEAD", "--", ENVIRON)
        declared = re.findall(r"(?m)^\+\s+(SGLANG_HICACHE_\w+) = Env", environ)
        if declared:
            run(f"{pr_dir.name} start-up probe", "tests.support.pr_probe", *declared)
