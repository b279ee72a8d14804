#!/usr/bin/env python3
"""SGLang's pre-commit hooks on the exported HiQCache pull requests (`make pr-check`).

  python -m scripts.pr_gate                        # dist/pr against build/sglang
  python -m scripts.pr_gate --repo DIR --base REV  # a git tree's REV..HEAD changes"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from scripts import overlay
from scripts.overlay import BASELINE_TAG, DEFAULT_TREE, DIST_DIR, ROOT, read_lines

UPSTREAM_LINT = ROOT / "requirements" / "upstream-lint"
HOOK_CONFIG = UPSTREAM_LINT / "pre-commit-config.yaml"
LINT_PINS = ROOT / "requirements" / "test-tools-lint.txt"
# Config files at an SGLang checkout's root, for a scratch tree from the wheel that lacks them.
ROOT_CONFIGS = (".isort.cfg", ".codespellrc")
KERNEL_TEST_DIRS = "test/registered/kernels/{ops,benchmark}/<group>/"


class GateError(Exception):
    """A setup problem, not a hook failure: one clear message, exit status 2."""


git = functools.partial(overlay.git, error=GateError)


@dataclass(frozen=True)
class Hook:
    """One hook: how to run it and which files it takes (pre-commit's `types`)."""

    module: str | None  # `python -m <module>`; None for our local hooks
    types: tuple[str, ...]
    entry_args: tuple[str, ...] = ()


# Each upstream repository's hook definitions (.pre-commit-hooks.yaml at the pinned revs).
HOOKS = {
    "check-symlinks": Hook("pre_commit_hooks.check_symlinks", ("symlink",)),
    "trailing-whitespace": Hook("pre_commit_hooks.trailing_whitespace_fixer", ("text",)),
    "end-of-file-fixer": Hook("pre_commit_hooks.end_of_file_fixer", ("text",)),
    "check-yaml": Hook("pre_commit_hooks.check_yaml", ("yaml",)),
    "check-toml": Hook("pre_commit_hooks.check_toml", ("toml",)),
    "check-ast": Hook("pre_commit_hooks.check_ast", ("python",)),
    # Without a git index every exported file counts as added, so the size limit applies to all.
    "check-added-large-files": Hook(
        "pre_commit_hooks.check_added_large_files", ("file",), ("--enforce-all",)
    ),
    # Outside a merge the hook looks at nothing; a PR must carry no markers.
    "check-merge-conflict": Hook(
        "pre_commit_hooks.check_merge_conflict", ("text",), ("--assume-in-merge",)
    ),
    "check-shebang-scripts-are-executable": Hook(
        "pre_commit_hooks.check_shebang_scripts_are_executable", ("text",)
    ),
    "detect-private-key": Hook("pre_commit_hooks.detect_private_key", ("text",)),
    "debug-statements": Hook("pre_commit_hooks.debug_statement_hook", ("python",)),
    "isort": Hook("isort", ("python",), ("--filter-files",)),
    "ruff": Hook("ruff", ("python",), ("check", "--force-exclude")),
    "ruff-format": Hook("ruff", ("python",), ("format", "--force-exclude")),
    "codespell": Hook("codespell_lib", ("text",)),
    "check-registered-tests": Hook(None, ("python",)),
    "check-no-bare-pytest-main": Hook(None, ("python",)),
}


@dataclass
class Result:
    hook: str
    files: int
    failures: list[str] = field(default_factory=list)


def read_pins(path: Path = LINT_PINS) -> dict[str, str]:
    pins = (line.partition("==") for line in read_lines(path))
    return {name.strip(): version.strip() for name, _, version in pins}


def check_tool_versions() -> None:
    """A gate run with other tool versions than upstream's proves nothing."""
    problems = []
    for name, pinned in read_pins().items():
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found = None
        if found != pinned:
            problems.append(f"{name}=={pinned} (found {found or 'nothing'})")
    if problems:
        raise GateError(
            "the pinned hook tools are not importable from this Python: "
            + ", ".join(problems)
            + ". Run `make pr-check` (installs requirements/test-tools-lint.txt "
            "into build/lint) or put that directory on PYTHONPATH."
        )


def load_hook_config(path: Path = HOOK_CONFIG) -> dict:
    from ruamel.yaml import YAML

    config = YAML(typ="safe").load(path.read_text())
    hook_ids = [hook["id"] for repo in config["repos"] for hook in repo["hooks"]]
    unknown = [hook_id for hook_id in hook_ids if hook_id not in HOOKS]
    if unknown:
        raise GateError(f"{path.name} names hook {unknown[0]!r}, unknown to the gate")
    return config


def scratch_clone(source: Path, rev: str, dest: Path) -> Path:
    """A throwaway checkout of `source` at `rev`; the hooks may rewrite its files."""
    git(dest.parent, "clone", "-q", "--shared", "--no-checkout", str(source.resolve()), dest.name)
    git(dest, "checkout", "-q", "--detach", rev)
    for name in ROOT_CONFIGS:
        if not (dest / name).exists():
            shutil.copy2(UPSTREAM_LINT / name, dest / name)
    return dest


def changed_files(repo: Path, base: str) -> list[str]:
    """Files added, copied, modified or renamed by base..HEAD (deletions need no check)."""
    out = git(repo, "diff", "--name-only", "--no-renames", "--diff-filter=ACMR", base, "HEAD")
    return sorted(line for line in out.splitlines() if line)


SUFFIX_TYPES = {".py": "python", ".pyi": "python", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}


def file_types(path: Path) -> set[str]:
    if path.is_symlink():
        return {"symlink"}
    head = path.read_bytes()[:8192]
    types = {"file", SUFFIX_TYPES.get(path.suffix, "file")}
    if b"\0" not in head:
        types.add("text")
    if re.match(rb"#![^\n]*python", head):
        types.add("python")
    return types


def select_files(repo: Path, files: list[str], config: dict, hook: dict) -> list[str]:
    wanted = set(hook.get("types", HOOKS[hook["id"]].types))
    include = re.compile(hook.get("files", ""))
    excludes = [re.compile(p) for p in (config.get("exclude"), hook.get("exclude")) if p]
    return [
        f
        for f in files
        if include.search(f)
        and not any(p.search(f) for p in excludes)
        and wanted <= file_types(repo / f)
    ]


def is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`, either side of the comparison."""
    if not isinstance(node, ast.Compare) or [type(op) for op in node.ops] != [ast.Eq]:
        return False
    sides = [node.left, *node.comparators]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


def parsed(repo: Path, files: list[str]):
    """(file, module) for each file that parses; check-ast reports the others."""
    for f in files:
        try:
            yield f, ast.parse((repo / f).read_text(), filename=f)
        except SyntaxError:
            pass


def check_no_bare_pytest_main(repo: Path, files: list[str]) -> list[str]:
    """`pytest.main(...)` as a statement of an __main__ block loses its exit code."""
    return [
        f"{f}:{stmt.lineno}: pytest.main(...) in an __main__ block must propagate "
        "its exit code with sys.exit(...)"
        for f, tree in parsed(repo, files)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and is_main_guard(block.test)
        for stmt in block.body
        if isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and ast.unparse(stmt.value.func) == "pytest.main"
    ]


def load_ci_register(repo: Path):
    """The tree's own registry parser, as upstream's hook uses it (no sglang import)."""
    path = repo / "python" / "sglang" / "test" / "ci" / "ci_register.py"
    spec = importlib.util.spec_from_file_location("hiq_gate_ci_register", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def registry_call_lines(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines of the module-level register_*_ci(...) calls, in the parser's order."""
    return [
        stmt.lineno
        for stmt in tree.body
        if isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and ast.unparse(stmt.value.func) in names  # a plain name, not x.name
    ]


def calls_named(tree: ast.AST, name: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
    ]


def defines_testcase(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.ClassDef)
        and any("TestCase" in ast.unparse(base) for base in node.bases)
        for node in ast.walk(tree)
    )


def main_runs_tests(tree: ast.Module) -> bool:
    blocks = [s for s in tree.body if isinstance(s, ast.If) and is_main_guard(s.test)]
    bodies = [ast.unparse(ast.Module(body=block.body, type_ignores=[])) for block in blocks]
    return any("unittest.main" in body or "pytest.main" in body for body in bodies)


def taxonomy_errors(path: str, registries: list, lines: list[int], tree) -> list[str]:
    """Where a registered test lives decides what it may register."""
    parts = path.split("/")[2:]  # after test/registered/
    errors = []
    if parts[0] == "unit":
        for registry, line in zip(registries, lines):
            suite = registry.effective_suite  # a dedicated unit suite has a `unit` word in it
            if registry.backend.name != "CPU" and "unit" not in (suite or "").split("-"):
                errors.append(
                    f"{path}:{line}: unit tests may register only CPU or dedicated unit "
                    f"suites, not {registry.backend.name} suite {suite!r} (GPU tests go under "
                    "test/registered/kernels/ or a topic directory)"
                )
            if registry.est_time > 60:
                errors.append(f"{path}:{line}: unit test est_time must be <= 60 seconds")
        for line in calls_named(tree, "popen_launch_server"):
            errors.append(f"{path}:{line}: unit tests may not launch a server")
    elif parts[0] in ("kernel", "kernels"):
        if not (parts[0] == "kernels" and len(parts) >= 4 and parts[1] in ("ops", "benchmark")):
            errors.append(f"{path}: kernel tests live under {KERNEL_TEST_DIRS}")
    return errors


def check_registered_tests(repo: Path, files: list[str]) -> list[str]:
    ci_register = load_ci_register(repo)
    names = set(ci_register.REGISTER_MAPPING)
    failures = []
    tests = [f for f in files if os.path.basename(f) not in ("conftest.py", "__init__.py")]
    for f, tree in parsed(repo, tests):
        registries, _ = ci_register.ut_parse_one_file(str(repo / f))
        if not registries:
            failures.append(
                f"{f}: missing CI registry call (register_cpu_ci, register_cuda_ci, ...); "
                "manual-only tests belong in test/manual/"
            )
            continue
        failures += taxonomy_errors(f, registries, registry_call_lines(tree, names), tree)
        if defines_testcase(tree) and not main_runs_tests(tree):
            failures.append(
                f"{f}: defines TestCase classes but its __main__ block does not call "
                "unittest.main() or pytest.main(): CI runs `python3 file.py`"
            )
    return failures


LOCAL_HOOKS = {
    "check-registered-tests": check_registered_tests,
    "check-no-bare-pytest-main": check_no_bare_pytest_main,
}


def run_tool(repo: Path, hook_id: str, args: list[str], files: list[str]) -> list[str]:
    """One tool hook on `files`, failures as lines; files it rewrites are restored for the next."""
    before = {f: (repo / f).read_bytes() for f in files}
    hook = HOOKS[hook_id]
    proc = run_module(repo, [hook.module, *hook.entry_args, *args, *files])
    rewritten = [f for f in files if (repo / f).read_bytes() != before[f]]
    failures = []
    if rewritten:
        diff = git(repo, "diff", "--", *rewritten)
        for f in rewritten:
            (repo / f).write_bytes(before[f])
        failures.append(f"the hook rewrites {', '.join(rewritten)}:\n" + indent(diff.rstrip()))
        if hook_id == "ruff":
            failures.append(indent(ruff_findings(repo, args, rewritten)))
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip() or f"exit status {proc.returncode}"
        failures.append(indent(output))
    return failures


def ruff_findings(repo: Path, args: list[str], files: list[str]) -> str:
    """What the ruff hook fixed, as rule, file and line (its --fix run says only how many)."""
    options = [*HOOKS["ruff"].entry_args, "--output-format=concise"]
    options += [a for a in args if a != "--fix"]
    return run_module(repo, ["ruff", *options, *files]).stdout.strip()


def run_module(repo: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`python -m <args>` in the scratch tree, with PYTHONPATH made absolute for it."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    absolute = os.pathsep.join(str(Path(e).resolve()) for e in entries if e)
    return overlay.run([sys.executable, "-m", *args], cwd=repo, PYTHONPATH=absolute)


def indent(text: str, limit: int = 60) -> str:
    lines = text.splitlines()
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more lines)"]
    return "\n".join("    " + line for line in lines)


def run_hooks(repo: Path, files: list[str], config: dict) -> list[Result]:
    results = []
    for repo_entry in config["repos"]:
        for hook in repo_entry["hooks"]:
            selected = select_files(repo, files, config, hook)
            result = Result(hook["id"], len(selected))
            if selected:
                if hook["id"] in LOCAL_HOOKS:
                    result.failures = LOCAL_HOOKS[hook["id"]](repo, selected)
                else:
                    result.failures = run_tool(repo, hook["id"], hook.get("args", []), selected)
            results.append(result)
    return results


def check_range(title: str, work: Path, base: str, config: dict) -> bool:
    """The hooks on the files base..HEAD changes; prints the report, True if all passed."""
    files = changed_files(work, base)
    results = run_hooks(work, files, config)
    print(f"== {title}: {len(files)} changed files")
    for r in results:
        status = "Failed" if r.failures else "Passed" if r.files else "(no files to check) Skipped"
        print(f"{r.hook:.<48}{status}")
        for failure in r.failures:
            print(f"  {failure}")
    return not any(r.failures for r in results)


def check_repo(repo: Path, base: str, config: dict) -> bool:
    """The hooks on base..HEAD of a git tree, run in a scratch clone."""
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_clone(repo, git(repo, "rev-parse", "HEAD").strip(), Path(tmp) / "tree")
        return check_range(f"{repo} {base}..HEAD", work, base, config)


def exported_prs(pr_root: Path) -> list[Path]:
    dirs = [d for d in pr_root.iterdir() if d.is_dir() and re.match(r"^\d+-", d.name)]
    if not dirs:
        raise GateError(f"no exported PRs in {pr_root}: run `make pr` first")
    return sorted(dirs, key=lambda d: int(d.name.split("-", 1)[0]))


def check_exported(pr_root: Path, tree: Path, config: dict) -> bool:
    """Each exported PR applied with `git am` in order on the pristine tree."""
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_clone(tree, BASELINE_TAG, Path(tmp) / "tree")
        for pr_dir in exported_prs(pr_root):
            base = git(work, "rev-parse", "HEAD").strip()
            patches = sorted(str(p) for p in pr_dir.glob("*.patch"))
            if not patches:
                raise GateError(f"{pr_dir} holds no patches")
            git(work, "am", "-q", "--keep-cr", *patches)
            ok &= check_range(f"PR {pr_dir.name}", work, base, config)
    return ok


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except GateError as error:
        print(f"pr_gate: error: {error}", file=sys.stderr)
        return 2


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pr-dir", type=Path, default=DIST_DIR / "pr")
    parser.add_argument("--tree", type=Path, default=DEFAULT_TREE)
    parser.add_argument("--repo", type=Path, help="check REV..HEAD of this git tree instead")
    parser.add_argument("--base", help="with --repo: the revision the changes start from")
    args = parser.parse_args(argv)
    if args.repo is not None and not args.base:
        parser.error("--repo needs --base")
    if args.repo is None and not (args.tree / ".git").exists():
        raise GateError(f"{args.tree} is not an applied tree: run `make apply` first")
    check_tool_versions()
    config = load_hook_config()
    if args.repo is not None:
        ok = check_repo(args.repo, args.base, config)
    else:
        ok = check_exported(args.pr_dir, args.tree, config)
    print("pr_gate: all hooks passed" if ok else "pr_gate: some hooks failed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
