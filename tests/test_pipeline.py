"""scripts/overlay.py end to end in throwaway project copies: one session project
applies the real series, then refreshes two probe patches and one probe overlay
file; tests that change a build tree work on a copy, read-only ones on a link."""

from __future__ import annotations

import base64
import hashlib
import os
import py_compile
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.overlay import OVERLAY_SUBJECT, read_lock

REPO = Path(__file__).resolve().parents[1]
WHEEL_CACHE = REPO / "build" / "wheels"
PY_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"

MHA = "python/sglang/srt/mem_cache/pool_host/mha.py"
VERSION_PY = "python/sglang/version.py"
NEW_FILE = "python/sglang/srt/mem_cache/hiq_pipeline_probe.py"
MHA_LINE = "HIQ_PIPELINE_PROBE_MHA = 1\n"
VERSION_LINE = "HIQ_PIPELINE_PROBE_VERSION = 1\n"
NEW_TEXT = '"""Overlay file made by tests/test_pipeline.py."""\n\nPROBE = "new file"\n'
SUBJECT_MHA = "Pipeline probe: mha marker"
SUBJECT_VERSION = "Pipeline probe: version marker"
GIT_ENV = {
    f"GIT_{role}_{key}": value
    for role in ("AUTHOR", "COMMITTER")
    for key, value in (("NAME", "Pipeline Test"), ("EMAIL", "pipeline@localhost"))
}
# git's detached auto-gc would repack a session tree while a test copies it.
NO_GC = dict(GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0="gc.auto", GIT_CONFIG_VALUE_0="0")
EXPORT_AUTHOR = {
    "GIT_AUTHOR_NAME": "Export Author",
    "GIT_AUTHOR_EMAIL": "export@example.org",
    "GIT_AUTHOR_DATE": "2026-03-04T05:06:07+00:00",
}

LOCK = read_lock(REPO / "sglang.lock")
VERSION = LOCK["SGLANG_VERSION"]
HIQ_VERSION = f"{VERSION}+{LOCK['HIQ_LOCAL_VERSION']}"
WHEEL_NAME = LOCK[f"SGLANG_WHEEL_{PY_TAG.upper()}"]
WHEEL_SHA = LOCK[f"SGLANG_WHEEL_{PY_TAG.upper()}_SHA256"]
STRIPPED_ENV = ("FORCE", "MSG", "SGLANG_SOURCE", "HIQ_WHEEL_CACHE", "PYTHONPATH")


def overlay_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
    return {**env, "HIQ_WHEEL_CACHE": str(WHEEL_CACHE), **NO_GC, **extra}


def overlay(project: Path, *args: str, ok: bool = True, **env: str) -> str:
    """Run scripts/overlay.py in `project`; stdout + stderr. ok=False expects failure."""
    proc = subprocess.run(
        [sys.executable, "scripts/overlay.py", *args],
        cwd=project,
        capture_output=True,
        text=True,
        env=overlay_env(**env),
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    if (proc.returncode == 0) != ok:
        pytest.fail(f"overlay.py {' '.join(args)} exit {proc.returncode}:\n{output}")
    return output


def git(tree: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV, **NO_GC}
    proc = subprocess.run(
        ["git", "-C", str(tree), *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, f"git {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def series(project: Path) -> list[str]:
    path = project / "patches" / "series"
    lines = path.read_text().splitlines() if path.exists() else []
    return [s for s in (line.split("#", 1)[0].strip() for line in lines) if s]


def touched_files(project: Path) -> list[str]:
    """Upstream paths (python/sglang/...) the series edits."""
    texts = [(project / "patches" / name).read_text() for name in series(project)]
    return sorted(
        {p for t in texts for p in re.findall(r"(?m)^diff --git a/(\S+) b/", t)}
    )


def overlay_files(project: Path) -> dict[str, bytes]:
    root = project / "sglang_overlay"
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root.rglob("*") if root.exists() else ())
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def copy_inputs(dst: Path) -> Path:
    """A fresh project: the repository's overlay inputs, no build tree."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    dst.mkdir(parents=True)
    shutil.copy2(REPO / "sglang.lock", dst / "sglang.lock")
    (dst / "patches").mkdir()
    for name in ("scripts", "patches", "sglang_overlay", "docs"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, dst / name, ignore=ignore, dirs_exist_ok=True)
    return dst


def copy_project(src: Path, dst: Path, tree: bool = True) -> Path:
    """A copy of a session project; tree=False leaves out build/ (and dist/)."""
    if tree:
        subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    else:
        ignore = shutil.ignore_patterns("build", "dist")
        shutil.copytree(src, dst, symlinks=True, ignore=ignore)
    return dst


def link_project(src: Path, dst: Path) -> Path:
    """Own inputs, the session's build tree shared: for commands that only read it."""
    copy_project(src, dst, tree=False)
    (dst / "build").mkdir()
    (dst / "build" / "sglang").symlink_to(src / "build" / "sglang")
    return dst


def rebuild_in_temp_index(tree: Path, patches: list[Path], overlay_root, index) -> str:
    """git tree of hiq-baseline + overlay files + patches, built in a scratch index."""
    env = {**os.environ, **GIT_ENV, **NO_GC, "GIT_INDEX_FILE": str(index)}

    def run(*args: str, data: bytes | None = None) -> str:
        cmd = ["git", "-C", str(tree), *args]
        proc = subprocess.run(cmd, input=data, capture_output=True, env=env)
        assert proc.returncode == 0, f"git {' '.join(args)}:\n{proc.stderr.decode()}"
        return proc.stdout.decode()

    run("read-tree", "hiq-baseline")
    for path in sorted(overlay_root.rglob("*") if overlay_root else []):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            blob = run("hash-object", "-w", "--stdin", data=path.read_bytes()).strip()
            mode = "100755" if os.access(path, os.X_OK) else "100644"
            rel = path.relative_to(overlay_root).as_posix()
            run("update-index", "--add", "--cacheinfo", f"{mode},{blob},{rel}")
    for patch in patches:
        run("apply", "--cached", str(patch))
    return run("write-tree").strip()


def head(project: Path, rev: str = "HEAD") -> str:
    return git(project / "build" / "sglang", "rev-parse", rev).strip()


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def state(path: Path) -> dict[str, str | None] | None:
    """Every path under `path` (or the file): sha256 of a file, None for a folder."""
    if not path.exists():
        return None
    paths = [path] if path.is_file() else path.rglob("*")
    return {
        p.relative_to(path).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        )
        for p in paths
    }


def probe_patch(subject: str, path: str, hunk: str) -> str:
    """A git format-patch file of one hunk on `path`."""
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: Pipeline Test <pipeline@localhost>\n"
        "Date: Thu, 1 Jan 2026 00:00:00 +0000\n"
        f"Subject: [PATCH] Pipeline probe: {subject}\n\n---\n"
        f"diff --git a/{path} b/{path}\n{hunk}-- \n2.39.5\n\n"
    )


def add_patch(project: Path, name: str, text: str) -> None:
    (project / "patches" / name).write_text(text)
    append(project / "patches" / "series", name + "\n")


@dataclass
class Project:
    path: Path
    base_series: list[str]  # the repository's own patches, before the probes
    base_head: str  # the build tree's HEAD with just those applied
    edited_tree: str  # git tree of the hand-edited build tree, before refresh
    final_head: str  # HEAD after the probes were refreshed

    @property
    def tree(self) -> Path:
        return self.path / "build" / "sglang"


@pytest.fixture(scope="session")
def patched(tmp_path_factory):
    """A clean clone's `fetch` and `apply`, then two probe patches and one probe
    overlay file added through refresh."""
    project = copy_inputs(tmp_path_factory.mktemp("patched") / "project")
    out = overlay(project, "fetch")
    assert Path(out.strip().splitlines()[-1]) == WHEEL_CACHE / WHEEL_NAME
    assert f"= SGLang {VERSION} (wheel)" in overlay(project, "apply")
    base_series, base_head = series(project), head(project)
    tree = project / "build" / "sglang"
    append(tree / MHA, MHA_LINE)
    (tree / NEW_FILE).write_text(NEW_TEXT)
    overlay(project, "refresh", "-m", SUBJECT_MHA)
    append(tree / VERSION_PY, VERSION_LINE)
    git(tree, "add", "-A")
    edited_tree = git(tree, "write-tree").strip()
    overlay(project, "refresh", "-m", SUBJECT_VERSION)
    final_head = head(project)
    assert final_head != base_head
    yield Project(project, base_series, base_head, edited_tree, final_head)
    # Tests share this tree read-only (link_project): it must be as they found it.
    assert head(project) == final_head and git(tree, "status", "--porcelain") == ""


def test_apply_and_refresh_build_the_tree_the_series_rebuilds(patched, tmp_path):
    """apply: baseline (the wheel), overlay commit, one commit per patch; refresh
    writes patches and overlay files that alone rebuild the hand-edited tree."""
    project, tree, names = patched.path, patched.tree, series(patched.path)
    wheel = WHEEL_CACHE / WHEEL_NAME
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == WHEEL_SHA
    assert len(names) == len(patched.base_series) + 2
    assert git(tree, "tag", "-l").split() == ["hiq-baseline", "hiq-overlay"]
    baseline_msg = git(tree, "log", "-1", "--format=%B", "hiq-baseline")
    assert WHEEL_NAME in baseline_msg and WHEEL_SHA in baseline_msg
    root = git(tree, "rev-list", "--max-parents=0", "HEAD").strip()
    assert root == head(patched.path, "hiq-baseline")
    with zipfile.ZipFile(wheel) as zf:  # the baseline is the wheel, byte for byte
        for rel in (MHA, VERSION_PY):
            upstream = zf.read(rel.removeprefix("python/"))
            assert git(tree, "show", f"hiq-baseline:{rel}").encode() == upstream
    log = git(tree, "log", "--format=%s", "hiq-baseline..hiq-overlay").splitlines()
    assert log == [OVERLAY_SUBJECT]
    log = git(tree, "log", "--reverse", "--format=%s", "hiq-overlay..HEAD")
    assert len(log.splitlines()) == len(names)
    assert log.splitlines()[-2:] == [SUBJECT_MHA, SUBJECT_VERSION]
    assert git(tree, "status", "--porcelain") == ""
    assert names[: len(patched.base_series)] == patched.base_series
    mha_patch, version_patch = names[-2:]
    assert mha_patch.endswith("-Pipeline-probe-mha-marker.patch")
    assert version_patch.endswith("-Pipeline-probe-version-marker.patch")
    mha_text = (project / "patches" / mha_patch).read_text()
    assert f"diff --git a/{MHA} b/{MHA}" in mha_text and f"+{MHA_LINE}" in mha_text
    assert f"+{VERSION_LINE}" in (project / "patches" / version_patch).read_text()
    for name in names:  # new files never go into patches
        text = (project / "patches" / name).read_text()
        assert "new file mode" not in text and NEW_FILE not in text, name
    patches = sorted(p.name for p in (project / "patches").glob("*.patch"))
    assert patches == sorted(names)
    assert overlay_files(project)[NEW_FILE] == NEW_TEXT.encode()
    # The hand-edited tree (the probe lines and file), and patches/ + overlay alone
    # rebuild it on the baseline.
    assert head(project, "HEAD^{tree}") == patched.edited_tree
    patches = [project / "patches" / name for name in names]
    overlay_root = project / "sglang_overlay"
    rebuilt = rebuild_in_temp_index(tree, patches, overlay_root, tmp_path / "i")
    assert rebuilt == patched.edited_tree
    out = overlay(copy_project(project, tmp_path / "p", tree=False), "check")
    assert f"{len(names)} patches apply cleanly to SGLang {VERSION}" in out
    assert f"{len(overlay_files(project))} overlay files" in out


def test_apply_rebuilds_when_needed_and_refuses_what_would_be_lost(patched, tmp_path):
    """Up to date: a no-op; unrefreshed edits: refused, FORCE=1 discards them; a
    conflicting patch: a clean baseline, recovered by removing it; a new file:
    refreshed with no subject (patches untouched); a changed patch: rebuilt."""
    project = copy_project(patched.path, tmp_path / "project")
    tree, before = project / "build" / "sglang", head(project)
    assert "is up to date" in overlay(project, "apply")
    assert head(project) == before
    append(tree / MHA, "STRAY_EDIT = 1\n")
    (tree / "python/sglang/stray_new_file.py").write_text("STRAY = 1\n")
    for attempt in ("uncommitted", "committed"):
        if attempt == "committed":
            git(tree, "add", "-A")
            git(tree, "commit", "-q", "-m", "stray commit")
        out = overlay(project, "apply", ok=False)
        assert "make refresh" in out and "FORCE=1" in out, attempt
        assert (tree / MHA).read_text().endswith("STRAY_EDIT = 1\n"), "edit was lost"
    overlay(project, "apply", FORCE="1")
    assert (tree / MHA).read_text().endswith(MHA_LINE)
    assert not (tree / "python/sglang/stray_new_file.py").exists()
    assert head(project) == patched.final_head
    assert git(tree, "status", "--porcelain") == ""
    original = (project / "patches" / "series").read_text()
    add_patch(project, "9999-conflict.patch", conflicting_patch(project))
    out = overlay(project, "apply", ok=False)
    assert "patch 9999-conflict.patch does not apply" in out
    assert f"failing file {MHA}" in out
    assert head(project) == head(project, "hiq-baseline")
    assert git(tree, "status", "--porcelain") == ""
    (project / "patches" / "9999-conflict.patch").unlink()
    (project / "patches" / "series").write_text(original)
    overlay(project, "apply")
    assert head(project) == patched.final_head
    # A new file alone is refreshed without a subject, into sglang_overlay/ only.
    other = NEW_FILE.replace("hiq_pipeline_probe", "hiq_pipeline_probe_2")
    (tree / other).write_text(NEW_TEXT)
    patches = {n: (project / "patches" / n).read_text() for n in series(project)}
    assert "refreshed" in overlay(project, "refresh")
    assert overlay_files(project)[other] == NEW_TEXT.encode()
    assert overlay_files(project)[NEW_FILE] == NEW_TEXT.encode()
    assert {
        n: (project / "patches" / n).read_text() for n in series(project)
    } == patches
    assert (tree / other).read_text() == NEW_TEXT
    assert "is up to date" in overlay(project, "apply")
    patch = next((project / "patches").glob("*-Pipeline-probe-mha-marker.patch"))
    assert f"+{MHA_LINE}" in patch.read_text()
    patch.write_text(patch.read_text().replace(f"+{MHA_LINE}", "+PROBE_MHA = 2\n"))
    out = overlay(project, "apply")
    assert "up to date" not in out and f"= SGLang {VERSION} (wheel)" in out
    mha = (tree / MHA).read_text()
    assert mha.endswith("PROBE_MHA = 2\n") and head(project) != before
    assert "is up to date" in overlay(project, "apply")


# Refusals: a setup breaks a project copy and returns (command, the words the
# failure names, the path that must stay as it was, environment).


def conflicting_patch(project: Path) -> str:
    """A patch whose removed line is not in upstream mha.py."""
    first = (project / "build" / "sglang" / MHA).read_text().splitlines()[0]
    hunk = f"--- a/{MHA}\n+++ b/{MHA}\n@@ -1,1 +1,1 @@\n"
    return probe_patch("conflict", MHA, f"{hunk}-{first}  # not upstream\n+{first}\n")


def fuzz_probe_patch(stock_version_py: str) -> str:
    """Rewrites line 15 of upstream version.py, three lines of context each side."""
    lines = stock_version_py.splitlines()
    before, old, after = lines[11:14], lines[14], lines[15:18]
    assert old.strip().startswith("#"), old
    body = "".join(f" {line}\n" for line in before) + f"-{old}\n+{old} (probe)\n"
    body += "".join(f" {line}\n" for line in after)
    hunk = f"--- a/{VERSION_PY}\n+++ b/{VERSION_PY}\n@@ -12,7 +12,7 @@\n{body}"
    return probe_patch("fuzz", VERSION_PY, hunk)


def stock_package(project: Path, target: Path, version: str = VERSION) -> Path:
    """The files `install` needs from a stock sglang, out of the pinned wheel."""
    wanted = {"sglang/version.py", "sglang/_version.py"}
    wanted |= {rel.removeprefix("python/") for rel in touched_files(project)}
    with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
        for name in sorted(wanted):
            zf.extract(name, target)
    if version != VERSION:
        path = target / "sglang" / "_version.py"
        assert f"'{VERSION}'" in path.read_text()
        path.write_text(path.read_text().replace(f"'{VERSION}'", f"'{version}'"))
    return target


def lock_sha_wrong(p, tmp, command):
    lock = p / "sglang.lock"
    lock.write_text(lock.read_text().replace(WHEEL_SHA, "0" * 64))
    expect = ["sha256 mismatch", WHEEL_NAME, "0" * 64, WHEEL_SHA]
    return (command,), expect, p / "build" / "sglang", {}


def wheel_tampered(p, tmp):
    (tmp / "wheels").mkdir()
    tampered = tmp / "wheels" / WHEEL_NAME
    tampered.write_bytes((WHEEL_CACHE / WHEEL_NAME).read_bytes() + b"tampered")
    actual = hashlib.sha256(tampered.read_bytes()).hexdigest()
    env = {"HIQ_WHEEL_CACHE": str(tmp / "wheels")}
    return ("apply",), ["sha256 mismatch", WHEEL_SHA, actual], p / "build/sglang", env


def patch_conflict(p, tmp):
    add_patch(p, "9999-conflict.patch", conflicting_patch(p))
    expect = ["patch 9999-conflict.patch does not apply", f"failing file {MHA}"]
    return ("check",), expect, p / "build" / "sglang" / MHA, {}


NEW_FILE_HUNK = """\
new file mode 100644
index 0000000..d3a0ef8
--- /dev/null
+++ b/python/sglang/srt/hiq_in_a_patch.py
@@ -0,0 +1 @@
+X = 1
"""


def series_inconsistent(p, tmp, case):
    name = f"9999-{case}.patch"
    if case == "missing":
        append(p / "patches" / "series", name + "\n")
        why = f"patches/series lists {name}, which does not exist"
    elif case == "unlisted":
        shutil.copy2(p / "patches" / series(p)[-1], p / "patches" / name)
        why = f"patches/{name} is not listed in patches/series"
    else:
        new = "python/sglang/srt/hiq_in_a_patch.py"
        add_patch(p, name, probe_patch("new file in a patch", new, NEW_FILE_HUNK))
        why = f"{name} creates {new}: new files belong in sglang_overlay/"
    return ("check",), ["patch series is inconsistent", why], p / "patches", {}


def pr_patch_undeclared(p, tmp):
    declare_prs(p)
    toml = p / "docs" / "prs.toml"
    toml.write_text(toml.read_text().replace("*-Pipeline-probe-*", "*-probe-mha-*"))
    why = f"patch {series(p)[-1]} belongs to no PR; it must belong to exactly one"
    return ("pr",), [why], p / "dist" / "pr", EXPORT_AUTHOR


def pr_no_author(p, tmp):
    declare_prs(p)
    env = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    why = "set git config user.name and user.email, or GIT_AUTHOR_NAME"
    return ("pr",), [why], p / "dist" / "pr", env


def install_other_version(p, tmp):
    site = stock_package(p, tmp / "site", version="0.5.22")
    why = f"installed sglang is 0.5.22, the patches are for {VERSION}"
    return ("install", "--target", str(site)), [why], site, {}


def install_no_package(p, tmp):
    args = ("install", "--target", str(tmp / "empty"))
    return args, ["no sglang package under"], tmp / "empty", {}


def install_needs_fuzz(p, tmp):
    site = stock_package(p, tmp / "site")
    version_py = site / VERSION_PY.removeprefix("python/")
    name = "9999-Pipeline-probe-fuzz.patch"
    add_patch(p, name, fuzz_probe_patch(version_py.read_text()))
    # The hunk's context shifted: a line inserted after its first context line.
    lines = version_py.read_text().splitlines(keepends=True)
    version_py.write_text("".join(lines[:12] + ["# not upstream\n"] + lines[12:]))
    # Plain `patch` would take it (fuzz 1), so only the strictness refuses it.
    shutil.copytree(site, tmp / "scratch" / "python")
    plain = subprocess.run(
        ["patch", "-p1", "--batch", "--forward", "--dry-run", "-d",
         str(tmp / "scratch"), "-i", str(p / "patches" / name)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert plain.returncode == 0 and "with fuzz 1" in plain.stdout, plain.stdout
    expect = [f"patch {name} does not apply exactly (no fuzz)", "nothing was installed"]
    return ("install", "--target", str(site)), [*expect, "FAILED"], site, {}


REFUSALS = {
    "fetch-lock-sha": (lambda p, t: lock_sha_wrong(p, t, "fetch"), False),
    "apply-lock-sha": (lambda p, t: lock_sha_wrong(p, t, "apply"), False),
    "apply-tampered-wheel": (wheel_tampered, False),
    "check-conflict": (patch_conflict, True),
    **{
        f"check-{case}": (lambda p, t, c=case: series_inconsistent(p, t, c), False)
        for case in ("missing", "unlisted", "new-file")
    },
    "pr-undeclared-patch": (pr_patch_undeclared, "link"),
    "pr-no-author": (pr_no_author, "link"),
    "install-other-version": (install_other_version, False),
    "install-no-package": (install_no_package, False),
    "install-needs-fuzz": (install_needs_fuzz, False),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_name_the_cause_and_change_nothing(patched, tmp_path, case):
    setup, tree = REFUSALS[case]
    dst = tmp_path / "project"
    if tree == "link":
        project = link_project(patched.path, dst)
    else:
        project = copy_project(patched.path, dst, tree=tree)
    args, expect, watch, env = setup(project, tmp_path)
    before = state(watch)
    out = overlay(project, *args, ok=False, **env)
    for words in expect:
        assert words in out, (words, out)
    assert state(watch) == before


# --------------------------------------------------------------------------
# wheel, pr, install


def test_wheel_carries_the_series_and_installs(patched, tmp_path):
    project = link_project(patched.path, tmp_path / "project")
    out = overlay(project, "wheel")
    wheels = list((project / "dist").glob(f"sglang-{HIQ_VERSION}-{PY_TAG}-*.whl"))
    assert len(wheels) == 1, out
    wheel = wheels[0]
    assert wheel.name == WHEEL_NAME.replace(f"-{VERSION}-", f"-{HIQ_VERSION}-")
    info = f"sglang-{HIQ_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        for rel in touched_files(project):
            assert (
                zf.read(rel.removeprefix("python/"))
                == (patched.tree / rel).read_bytes()
            ), rel
        for rel, data in overlay_files(project).items():
            if rel.startswith("python/"):
                assert zf.read(rel.removeprefix("python/")) == data, rel
            else:  # upstream-style tests stay out of the package
                assert not any(n.endswith(rel) for n in zf.namelist()), rel
        metadata = zf.read(f"{info}/METADATA").decode()
        assert re.search(rf"(?m)^Version: {re.escape(HIQ_VERSION)}$", metadata)
        assert not any(
            n.startswith(f"sglang-{VERSION}.dist-info/") for n in zf.namelist()
        )
        # RECORD hashes the patched bytes, so installers accept the file.
        sha = hashlib.sha256(zf.read(MHA.removeprefix("python/"))).digest()
        digest = base64.urlsafe_b64encode(sha).rstrip(b"=").decode()
        record = zf.read(f"{info}/RECORD").decode()
        assert f"{MHA.removeprefix('python/')},sha256={digest}," in record
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(site), str(wheel)],
        check=True, env=overlay_env(),
    )  # fmt: skip
    assert (site / MHA.removeprefix("python/")).read_text().endswith(MHA_LINE)
    assert (
        (site / VERSION_PY.removeprefix("python/")).read_text().endswith(VERSION_LINE)
    )
    assert (site / NEW_FILE.removeprefix("python/")).read_text() == NEW_TEXT
    assert (site / info / "METADATA").exists()


def declare_prs(project: Path) -> None:
    """Two PRs: the repository's own series and overlay, then the probes on top."""
    base = series(project)[:-2]
    (project / "docs" / "prs.toml").write_text(
        '[[pr]]\nnumber = 1\nname = "base"\ntitle = "Probe base PR"\n'
        f"patches = {base!r}\noverlay = {sorted(overlay_files(REPO))!r}\n"
        'overlay_subject = "Pipeline probe: base overlay"\n'
        'tests_subject = "Pipeline probe: base tests"\n\n'
        '[[pr]]\nnumber = 2\nname = "probes"\ntitle = "Probe PR on top"\n'
        f'patches = ["*-Pipeline-probe-*"]\noverlay = ["{NEW_FILE}"]\n'
        'overlay_subject = "Pipeline probe: new file"\n'
        'overlay_body = "Why the probe file exists."\n\n'
        f'[pr.justify]\n"{MHA}" = "Marks mha.py for the pipeline test."\n'
    )


def test_pr_exports_each_declared_pr_with_its_author_and_description(patched, tmp_path):
    project = link_project(patched.path, tmp_path / "project")
    declare_prs(project)
    out = overlay(project, "pr", **EXPORT_AUTHOR)
    pr_root = project / "dist" / "pr"
    assert sorted(p.name for p in pr_root.iterdir()) == ["1-base", "2-probes"]
    first = sorted((pr_root / "1-base").glob("*.patch"))
    second = sorted((pr_root / "2-probes").glob("*.patch"))
    # New modules, then the patches, then the tests they carry.
    repo_overlay = list(overlay_files(REPO))
    modules = any(not p.startswith("test/") for p in repo_overlay)
    tests = any(p.startswith("test/") for p in repo_overlay)
    assert len(first) == modules + len(patched.base_series) + tests
    assert [p.name.split("-", 1)[1] for p in second] == [
        "Pipeline-probe-new-file.patch",
        "Pipeline-probe-mha-marker.patch",
        "Pipeline-probe-version-marker.patch",
    ]
    assert "exported PR 2-probes: 3 commits" in out
    for patch in first + second:
        header = patch.read_text().split("\n---\n", 1)[0]
        assert "From: Export Author <export@example.org>" in header, patch.name
        assert "Date: Wed, 4 Mar 2026 05:06:07 +0000" in header, patch.name
    assert "Why the probe file exists." in second[0].read_text()

    description = (pr_root / "2-probes" / "PR_DESCRIPTION.md").read_text()
    assert description.startswith("# Probe PR on top\n")
    headings = re.findall(r"(?m)^## (.+)$", description)
    for section in ("Motivation", "Modifications", "Accuracy Tests",
                    "Speed Tests and Profiling", "Checklist"):  # fmt: skip
        assert section in headings, section
    assert f"Base: `{LOCK['SGLANG_GIT_TAG']}` + PR 1-base." in description
    assert f"| `{MHA}` | +1 / -0 | Marks mha.py for the pipeline test. |" in description
    assert f"| `{VERSION_PY}` | +1 / -0 | **not justified yet**" in description
    assert f"PR 2-probes edits {VERSION_PY}; docs/prs.toml says not why" in out
    assert f"- `{NEW_FILE}` (3 lines)" in description
    assert "{{" not in description and "<!--" not in description.split("\n", 1)[0]
    # PR 1 alone on the pin gives the repository's series; PR 2 on top, the rest.
    alone = rebuild_in_temp_index(patched.tree, first, None, tmp_path / "index1")
    assert alone == head(patched.path, f"{patched.base_head}^{{tree}}")
    both = rebuild_in_temp_index(patched.tree, first + second, None, tmp_path / "i2")
    assert both == head(patched.path, "HEAD^{tree}")


def test_install_and_uninstall_have_their_own_help():
    helps = {
        "install": "patch an installed SGLang in place",
        "uninstall": "undo install: the stock files back",
    }
    for command, words in helps.items():
        out = overlay(REPO, command, "--help")
        assert f"usage: overlay.py {command} [-h] --target TARGET" in out
        assert words in out and "the folder holding the sglang package" in out


def test_install_patches_once_repatches_after_a_reinstall_and_uninstall_restores(
    patched, tmp_path
):
    """install judges the package by its files, not its marker, and uninstall
    takes back every byte, on the whole stock package from the pinned wheel."""
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    site, n_patches = tmp_path / "site", len(series(project))
    touched = [rel.removeprefix("python/") for rel in touched_files(project)]
    added = {  # overlay files under python/, by their path in an installed site
        rel.removeprefix("python/"): data
        for rel, data in overlay_files(project).items()
        if rel.startswith("python/")
    }

    def reinstall_stock():
        # As `pip install --force-reinstall`: the wheel's files written over the
        # package; files the wheel does not have (overlay files, marker) stay.
        with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
            for member in zf.infolist():
                if member.filename.startswith("sglang/") and not member.is_dir():
                    zf.extract(member, site)

    def install(*expect: str) -> str:
        out = overlay(project, "install", "--target", str(site))
        assert all(words in out for words in expect), out
        for rel in touched:
            expected = (patched.tree / "python" / rel).read_bytes()
            assert (site / rel).read_bytes() == expected, rel
        for rel, data in added.items():
            assert (site / rel).read_bytes() == data, rel
        # Upstream-style tests are not installed into the package.
        for rel in set(overlay_files(project)) - {f"python/{r}" for r in added}:
            assert not (site / rel).exists(), rel
        assert (site / "sglang" / ".hiqcache-applied").exists()
        return out

    reinstall_stock()
    stock = state(site)
    install(f"{n_patches} patches")
    patched_state = state(site)
    once = f"already carries this series ({len(touched)} patched files"
    install(once)
    assert state(site) == patched_state
    # The server imported an overlay module: its bytecode is ours to remove too.
    module = next(rel for rel in added if rel.endswith(".py"))
    py_compile.compile(str(site / module), doraise=True)

    reinstall_stock()
    assert all(state(site)[rel] == stock[rel] for rel in touched)
    assert all((site / rel).exists() for rel in added)
    assert (site / "sglang" / ".hiqcache-applied").exists()
    assert "already carries" not in install(f"{n_patches} patches")
    install(once)

    # A line the series added, edited by hand: uninstall cannot tell what stock
    # was, and changes nothing.
    edited = site / touched[0]
    with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
        stock_lines = set(zf.read(touched[0]).splitlines())
    patched_bytes = edited.read_bytes()
    lines = patched_bytes.splitlines(keepends=True)
    at = next(
        i for i, line in enumerate(lines) if line.rstrip(b"\n") not in stock_lines
    )
    lines[at] = b"# edited\n"
    edited.write_bytes(b"".join(lines))
    before = state(site)
    out = overlay(project, "uninstall", "--target", str(site), ok=False)
    assert f"pip install --force-reinstall --no-deps sglang=={VERSION}, then" in out
    assert state(site) == before
    edited.write_bytes(patched_bytes)

    out = overlay(project, "uninstall", "--target", str(site))
    restored = f"{len(touched)} patched files restored to stock, {len(added)} overlay"
    assert restored in out
    assert state(site) == stock  # every path and byte as the wheel left them
    out = overlay(project, "uninstall", "--target", str(site))
    assert "is stock SGLang; nothing to uninstall" in out
    assert state(site) == stock


# --------------------------------------------------------------------------
# Docker


def check_docker(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scripts.check_docker", "--root", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dockerfile_matches_the_lock_and_overlay_script():
    proc = check_docker(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "name, old, new, expected",
    [
        ("Dockerfile", f"v{VERSION}-", "v0.0.1-", "but sglang.lock pins"),
        ("Dockerfile", "overlay.py install --target", "overlay.py apply --target",
         "expected `/opt/"),
        ("Dockerfile", "COPY patches/", "# COPY patches/",
         "reads patches, which the Dockerfile does not COPY"),
        ("Dockerfile", 'CMD ["hiqcache-serve"]', 'ENTRYPOINT ["hiqcache-serve"]\nCMD []',
         "ENTRYPOINT replaces the base image's"),
        ("Dockerfile", 'CMD ["hiqcache-serve"]', "CMD hiqcache-serve",
         "CMD must be in exec (JSON) form"),
        ("Dockerfile", 'CMD ["hiqcache-serve"]', 'CMD ["hiq-serve"]',
         "which no COPY installs"),
        ("Dockerfile", "COPY --chmod=755 scripts/", "COPY scripts/",
         "must set --chmod=755"),
        ("Dockerfile", "scripts/hiqcache_serve.sh", "scripts/missing.sh",
         "not a repository file"),
        (".dockerignore", "\n.venv\n", "\n", ".dockerignore must exclude .venv"),
        (".dockerignore", "\nbuild\n", "\nbuild/sglang\n",
         ".dockerignore must exclude build"),
        (".dockerignore", "\n.git\n", "\n.git\npatches/\n",
         "the Dockerfile COPYs patches/, but .dockerignore excludes patches"),
        (".dockerignore", "\n.git\n", "\n.git\nscripts/*.sh\n",
         "excludes scripts/hiqcache_serve.sh"),
        (".dockerignore", "\n.git\n", "\n.git\nscripts\n!scripts/overlay.py\n",
         "excludes scripts/hiqcache_serve.sh"),
        (".dockerignore", None, None, ".dockerignore is missing"),
    ],
)  # fmt: skip
def test_docker_check_catches_drift(tmp_path, name, old, new, expected):
    """A copy of what check_docker reads passes; one edit makes it fail."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for rel in ("sglang.lock", "Dockerfile", ".dockerignore", "scripts/overlay.py",
                "scripts/hiqcache_serve.sh"):  # fmt: skip
        shutil.copy2(REPO / rel, root / rel)
    assert check_docker(root).returncode == 0
    text = (root / name).read_text()
    if old is None:
        (root / name).unlink()
    else:
        assert old in text
        (root / name).write_text(text.replace(old, new, 1))
    proc = check_docker(root)
    assert proc.returncode != 0 and expected in proc.stderr
