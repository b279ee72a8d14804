"""scripts/pr_gate.py: SGLang's pinned pre-commit hooks on exported PRs: small git
trees (tag `base`: the pinned ci_register.py) pass clean files and fail on what
upstream's CI rejects; the real series exported and gated, as `make pr-check`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_pipeline import GIT_ENV, git

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "sglang"
CI_REGISTER = "python/sglang/test/ci/ci_register.py"

MODULE = '''\
"""A module the way upstream formats it."""

import os

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


def pool_class() -> type:
    return MHATokenToKVPool if os.environ and torch else None
'''
# The first-party import is not separated from the third-party one: isort
# (profile black, known_first_party=sglang) puts a blank line between them.
MISSORTED_MODULE = MODULE.replace(
    "import torch\n\nfrom sglang", "import torch\nfrom sglang"
)

UNIT_TEST = '''\
"""A CPU unit test."""

import sys
import unittest

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


class TestProbe(unittest.TestCase):
    def test_truth(self):
        self.assertTrue(pytest)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
'''
CUDA_LINE = (
    'register_cuda_ci(est_time=30, stage="base-a", runner_config="1-gpu-small")\n'
)
CUDA_UNIT_TEST = UNIT_TEST.replace(
    "import register_cpu_ci\n", "import register_cpu_ci, register_cuda_ci\n"
).replace('suite="base-a-test-cpu")\n', 'suite="base-a-test-cpu")\n' + CUDA_LINE)
BARE_PYTEST_MAIN = UNIT_TEST.replace(
    "    sys.exit(pytest.main([__file__]))", "    pytest.main([__file__])"
).replace("import sys\n", "")

UNIT_PATH = "test/registered/unit/mem_cache/test_probe.py"
MODULE_PATH = "python/sglang/srt/mem_cache/gate_probe.py"


@pytest.fixture(scope="module")
def ci_register_source() -> str:
    if not (TREE / ".git").exists():
        pytest.fail(f"{TREE} is missing: run `make apply` first")
    return git(TREE, "show", f"hiq-baseline:{CI_REGISTER}")


def run_gate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scripts.pr_gate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def gate_on(tmp_path: Path, ci_register: str, files: dict[str, str]):
    """The gate on a git tree whose tag `base` holds ci_register.py and whose HEAD
    adds `files`; its output and each hook's Passed / Failed / Skipped."""
    repo = tmp_path / "repo"
    for commit, tree in (("baseline", {CI_REGISTER: ci_register}), ("change", files)):
        for rel, text in tree.items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        if commit == "baseline":
            git(repo, "init", "-q", "-b", "main")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", commit)
    git(repo, "tag", "base", "HEAD~1")
    head = git(repo, "rev-parse", "HEAD")
    proc = run_gate("--repo", str(repo), "--base", "base")
    # The hooks run in a scratch clone: the tree under test is left as it was.
    assert (
        git(repo, "rev-parse", "HEAD") == head
        and git(repo, "status", "--porcelain") == ""
    )
    status = re.finditer(r"(?m)^([a-z-]+)\.{3,}(.+)$", proc.stdout)
    return proc, {m.group(1): m.group(2).split()[-1] for m in status}


RUFF_MODULE = '''\
"""Two findings of upstream's ruff selection."""

from __future__ import annotations

import os


class Table:
    def select(self) -> "Table":
        return self
'''
KERNEL_PATH = "test/registered/kernels/ops/kvcache/test_probe.py"
DEAD_PATH = UNIT_PATH.replace("test_probe", "test_probe_dead")
UNREGISTERED = UNIT_TEST.replace(
    'register_cpu_ci(est_time=10, suite="base-a-test-cpu")\n', ""
)
DEAD = UNIT_TEST.replace("    sys.exit(pytest.main([__file__]))", "    print(sys.argv)")
CUDA_AT = CUDA_UNIT_TEST.splitlines().index(CUDA_LINE.strip()) + 1
BARE_AT = BARE_PYTEST_MAIN.splitlines().index("    pytest.main([__file__])") + 1


HOOKS = (
    "trailing-whitespace", "end-of-file-fixer", "check-ast", "isort", "ruff",
    "ruff-format", "codespell", "check-registered-tests", "check-no-bare-pytest-main",
)  # fmt: skip
# (files, the hook that fails (alone, but for the last row) or None, its report)
GATE_CASES = {
    # Clean files pass every hook.
    "clean": (
        {MODULE_PATH: MODULE, UNIT_PATH: UNIT_TEST},
        None,
        ["pr_gate: all hooks passed"],
    ),
    "isort": (
        {MODULE_PATH: MISSORTED_MODULE},
        "isort",
        # The blank line isort inserts, in the diff.
        [f"the hook rewrites {MODULE_PATH}", "+\n"],
    ),
    "ruff": (
        {MODULE_PATH: RUFF_MODULE},
        "ruff",
        [f"{MODULE_PATH}:5:8: F401", f"{MODULE_PATH}:9:25: UP037"],
    ),
    "cuda-unit-test": (
        {UNIT_PATH: CUDA_UNIT_TEST},
        "check-registered-tests",
        [
            f"{UNIT_PATH}:{CUDA_AT}: unit tests may register only CPU or dedicated "
            "unit suites, not CUDA suite 'base-a-test-1-gpu-small'"
        ],
    ),
    # The same CUDA test is fine among kernel tests.
    "cuda-kernel-test": ({KERNEL_PATH: CUDA_UNIT_TEST}, None, []),
    "bare-pytest-main": (
        {UNIT_PATH: BARE_PYTEST_MAIN},
        "check-no-bare-pytest-main",
        [f"{UNIT_PATH}:{BARE_AT}: pytest.main(...) in an __main__ block"],
    ),
    "unregistered-and-dead": (
        {UNIT_PATH: UNREGISTERED, DEAD_PATH: DEAD},
        "check-registered-tests",
        [
            f"{UNIT_PATH}: missing CI registry call",
            f"{DEAD_PATH}: defines TestCase classes but its __main__ block",
        ],
    ),
}


@pytest.mark.parametrize("case", GATE_CASES)
def test_gate_fails_exactly_the_hook_upstream_ci_would(
    tmp_path, ci_register_source, case
):
    files, hook, expected = GATE_CASES[case]
    proc, status = gate_on(tmp_path, ci_register_source, files)
    assert proc.returncode == (1 if hook else 0), proc.stdout + proc.stderr
    failed = [h for h, s in status.items() if s == "Failed"]
    if case == "unregistered-and-dead":  # other hooks may fail on these files
        assert hook in failed, proc.stdout
    else:
        assert failed == ([hook] if hook else []), proc.stdout
    if not hook:
        assert status["check-registered-tests"] == "Passed"
    if case == "clean":
        assert [status[h] for h in HOOKS] == ["Passed"] * len(HOOKS), proc.stdout
    for words in expected:
        assert words in proc.stdout, words


def test_real_export_justifies_every_edit_and_passes_upstream_hooks(tmp_path):
    """`make pr` then `make pr-check` on the real series: every upstream file a
    PR edits has its reason in docs/prs.toml (else the export warns), and every
    hook passes on every changed file of the export as `git am` applies it."""
    project = tmp_path / "project"
    for name in ("scripts", "patches", "sglang_overlay", "docs", "requirements"):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(REPO / name, project / name, ignore=ignore)
    shutil.copy2(REPO / "sglang.lock", project / "sglang.lock")
    (project / "build").mkdir()
    (project / "build" / "sglang").symlink_to(TREE)
    wheels = os.environ.get("HIQ_WHEEL_CACHE", str(REPO / "build" / "wheels"))
    env = {**os.environ, **GIT_ENV, "HIQ_WHEEL_CACHE": wheels}
    env.pop("PYTHONPATH", None)
    export = subprocess.run(
        [sys.executable, "scripts/overlay.py", "pr"],
        cwd=project, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    prs = tomllib.loads((REPO / "docs" / "prs.toml").read_text())["pr"]
    assert f"exported {len(prs)} PRs" in export.stdout
    assert "warning" not in export.stdout + export.stderr, export.stdout
    proc = run_gate("--pr-dir", str(project / "dist" / "pr"), "--tree", str(TREE))
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr
