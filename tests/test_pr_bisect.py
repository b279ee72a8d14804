"""Release check (HIQ_PR_BISECT=1, ~4 min): the exported PRs are bisectable. Each
PR `git am`s onto the pin after the ones before; every commit byte-compiles, and
at each PR's end every module it adds or edits imports, every upstream-style
unit test so far passes on CPU (tests/upstream_unit_runner.py), and start-up
with each declared SGLANG_HICACHE_* variable imports nothing a later PR ships
(tests/support/pr_probe.py)."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "sglang"
IDENTITY = {
    "GIT_AUTHOR_NAME": "Bisect Test",
    "GIT_AUTHOR_EMAIL": "bisect@localhost",
    "GIT_COMMITTER_NAME": "Bisect Test",
    "GIT_COMMITTER_EMAIL": "bisect@localhost",
}


def git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), *args], check=True, capture_output=True, text=True,
        env={**os.environ, **IDENTITY},
    ).stdout  # fmt: skip


ENVIRON = "python/sglang/srt/environ.py"


def declared_variables(environ_diff: str) -> list[str]:
    """The SGLANG_HICACHE_* variables the PRs so far add to Envs."""
    return re.findall(r"(?m)^\+\s+(SGLANG_HICACHE_\w+) = Env", environ_diff)


def touched_modules(paths: list[str]) -> list[str]:
    """Dotted names of the modules under python/ among these tree paths."""
    return [
        p.removeprefix("python/").removesuffix(".py").replace("/", ".")
        for p in paths
        if p.startswith("python/") and p.endswith(".py")
    ]


@pytest.mark.skipif(
    os.environ.get("HIQ_PR_BISECT") != "1", reason="release check: HIQ_PR_BISECT=1"
)
def test_each_pr_applies_alone_on_the_pin_and_passes_its_unit_tests(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "overlay.py"), "pr"],
        check=True, cwd=REPO, capture_output=True, env={**os.environ, **IDENTITY},
    )  # fmt: skip
    pr_dirs = sorted(
        (REPO / "dist" / "pr").iterdir(), key=lambda p: int(p.name.split("-")[0])
    )
    assert len(pr_dirs) >= 2
    work = tmp_path / "pristine"
    git(tmp_path, "clone", "-q", "--shared", "--no-checkout", str(TREE), str(work))
    git(work, "checkout", "-q", "--detach", "hiq-baseline")
    base = git(work, "rev-parse", "HEAD").strip()
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
        added = git(
            work, "diff", "--name-only", "--diff-filter=A", base, "HEAD"
        ).split()
        tests = [work / p for p in added if p.startswith("test/registered/")]
        assert tests, f"{pr_dir.name}: the PRs so far add no unit test"
        touched = git(work, "diff", "--name-only", "--diff-filter=AM", start, "HEAD")
        modules = touched_modules(touched.split())
        assert modules, f"{pr_dir.name}: touches no Python module"
        runner = ["-m", "tests.upstream_unit_runner", "--import", *modules, "--"]
        proc = subprocess.run(
            [sys.executable, *runner, *map(str, tests)],
            cwd=REPO, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(work / "python"), "HIQ_SGLANG_TREE": str(work)},
        )  # fmt: skip
        assert proc.returncode == 0, (
            f"{pr_dir.name}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        )
        declared = declared_variables(git(work, "diff", base, "HEAD", "--", ENVIRON))
        if not declared:
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "tests.support.pr_probe", *declared],
            cwd=REPO, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(work / "python"), "HIQ_SGLANG_TREE": str(work)},
        )  # fmt: skip
        assert proc.returncode == 0, (
            f"{pr_dir.name} start-up probe:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        )
