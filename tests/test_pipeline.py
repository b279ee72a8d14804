"""The overlay pipeline end to end: scripts/overlay.py run as a subprocess in
throwaway copies of the project, never in this checkout.

Each project copy holds scripts/, sglang.lock, patches/ and sglang_overlay/
(the real series, whatever it is today) plus small synthetic edits made here:
a line appended to an upstream file (mha.py, then version.py) and one new
file, turned into patches and overlay files by `overlay.py refresh`. The
pinned wheel comes from the shared cache build/wheels (HIQ_WHEEL_CACHE).

Nothing here imports sglang. Building a tree from the wheel takes seconds and
copying one (~6k files) about a second, so one project is applied and
refreshed per session; tests that change the build tree work on a copy
(`cp -a`), read-only commands (wheel, pr) on a project whose build/sglang is a
symlink to the session tree, which is checked to be untouched at the end.
"""

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
    "GIT_AUTHOR_NAME": "Pipeline Test",
    "GIT_AUTHOR_EMAIL": "pipeline@localhost",
    "GIT_COMMITTER_NAME": "Pipeline Test",
    "GIT_COMMITTER_EMAIL": "pipeline@localhost",
}
# git's automatic gc runs detached: it would repack a session tree while a
# test copies it, and in the foreground it costs seconds. Off for these trees.
GIT_NO_BACKGROUND_GC = {
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "gc.auto",
    "GIT_CONFIG_VALUE_0": "0",
}


LOCK = read_lock(REPO / "sglang.lock")
VERSION = LOCK["SGLANG_VERSION"]
HIQ_VERSION = f"{VERSION}+{LOCK['HIQ_LOCAL_VERSION']}"
WHEEL_NAME = LOCK[f"SGLANG_WHEEL_{PY_TAG.upper()}"]
WHEEL_SHA = LOCK[f"SGLANG_WHEEL_{PY_TAG.upper()}_SHA256"]


# --------------------------------------------------------------------------
# helpers


def overlay_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FORCE", "MSG", "SGLANG_SOURCE", "HIQ_WHEEL_CACHE", "PYTHONPATH")
    }
    env["HIQ_WHEEL_CACHE"] = str(WHEEL_CACHE)
    env.update(GIT_NO_BACKGROUND_GC)
    env.update(extra)
    return env


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
    if ok and proc.returncode != 0:
        pytest.fail(f"overlay.py {' '.join(args)} failed ({proc.returncode}):\n{output}")
    if not ok and proc.returncode == 0:
        pytest.fail(f"overlay.py {' '.join(args)} succeeded but should fail:\n{output}")
    return output


def git(tree: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(tree), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_ENV, **GIT_NO_BACKGROUND_GC},
    )
    assert proc.returncode == 0, f"git {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def series(project: Path) -> list[str]:
    path = project / "patches" / "series"
    if not path.exists():
        return []
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def touched_files(project: Path) -> list[str]:
    """Upstream paths (python/sglang/...) the series edits."""
    paths = []
    for name in series(project):
        text = (project / "patches" / name).read_text()
        paths += re.findall(r"(?m)^diff --git a/(\S+) b/", text)
    return sorted(set(paths))


def overlay_files(project: Path) -> dict[str, bytes]:
    root = project / "sglang_overlay"
    if not root.exists():
        return {}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def copy_inputs(dst: Path) -> Path:
    """A fresh project: the repository's overlay inputs, no build tree."""
    dst.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "scripts", dst / "scripts", ignore=ignore)
    shutil.copy2(REPO / "sglang.lock", dst / "sglang.lock")
    if (REPO / "patches").exists():
        shutil.copytree(REPO / "patches", dst / "patches", ignore=ignore)
    else:
        (dst / "patches").mkdir()
    if (REPO / "sglang_overlay").exists():
        shutil.copytree(REPO / "sglang_overlay", dst / "sglang_overlay", ignore=ignore)
    shutil.copytree(REPO / "docs", dst / "docs", ignore=ignore)  # what `pr` exports
    return dst


def copy_project(src: Path, dst: Path, tree: bool = True) -> Path:
    """A copy of a session project; tree=False leaves out build/ (and dist/)."""
    if tree:
        subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    else:
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("build", "dist"))
    return dst


def link_project(src: Path, dst: Path) -> Path:
    """Own inputs, the session's build tree shared: for commands that only read it."""
    copy_project(src, dst, tree=False)
    (dst / "build").mkdir()
    (dst / "build" / "sglang").symlink_to(src / "build" / "sglang")
    return dst


def rebuild_in_temp_index(
    tree: Path, patch_files: list[Path], overlay_root: Path | None, index: Path
) -> str:
    """git tree of hiq-baseline + overlay files + patches, built in a scratch index
    of `tree` (objects only; HEAD, the real index and the files stay as they are)."""
    env = {**os.environ, **GIT_ENV, **GIT_NO_BACKGROUND_GC, "GIT_INDEX_FILE": str(index)}

    def run(*args: str, data: bytes | None = None) -> str:
        proc = subprocess.run(
            ["git", "-C", str(tree), *args], input=data, capture_output=True, env=env
        )
        assert proc.returncode == 0, f"git {' '.join(args)}:\n{proc.stderr.decode()}"
        return proc.stdout.decode()

    run("read-tree", "hiq-baseline")
    for path in sorted(overlay_root.rglob("*") if overlay_root else []):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            blob = run("hash-object", "-w", "--stdin", data=path.read_bytes()).strip()
            mode = "100755" if os.access(path, os.X_OK) else "100644"
            rel = path.relative_to(overlay_root).as_posix()
            run("update-index", "--add", "--cacheinfo", f"{mode},{blob},{rel}")
    for patch in patch_files:
        run("apply", "--cached", str(patch))
    return run("write-tree").strip()


def head_tree(project: Path) -> str:
    return git(project / "build" / "sglang", "rev-parse", "HEAD^{tree}").strip()


def head(project: Path) -> str:
    return git(project / "build" / "sglang", "rev-parse", "HEAD").strip()


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


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


# --------------------------------------------------------------------------
# session projects


@pytest.fixture(scope="session")
def wheel_cache(tmp_path_factory) -> Path:
    """`overlay.py fetch`: downloads the pinned wheel on a clean clone, then verifies it."""
    project = copy_inputs(tmp_path_factory.mktemp("fetch") / "project")
    out = overlay(project, "fetch")
    assert Path(out.strip().splitlines()[-1]) == WHEEL_CACHE / WHEEL_NAME
    return WHEEL_CACHE


@pytest.fixture(scope="session")
def patched(wheel_cache, tmp_path_factory):
    """The repository's series applied from the wheel (a clean clone's `apply`),
    then two probe patches and one probe overlay file added through refresh."""
    project = copy_inputs(tmp_path_factory.mktemp("patched") / "project")
    out = overlay(project, "apply")
    assert f"= SGLang {VERSION} (wheel)" in out
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


# --------------------------------------------------------------------------
# fetch and sha256


def test_fetch_verifies_the_pinned_wheel(wheel_cache):
    wheel = wheel_cache / WHEEL_NAME
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == WHEEL_SHA


def test_sha256_mismatch_in_lock_names_both_hashes(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    wrong = "0" * 64
    lock = project / "sglang.lock"
    lock.write_text(lock.read_text().replace(WHEEL_SHA, wrong))
    for command in ("fetch", "apply"):
        out = overlay(project, command, ok=False)
        assert "sha256 mismatch" in out and WHEEL_NAME in out
        assert wrong in out and WHEEL_SHA in out
    assert not (project / "build" / "sglang").exists()


def test_tampered_wheel_in_cache_names_both_hashes(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    cache = tmp_path / "wheels"
    cache.mkdir()
    tampered = cache / WHEEL_NAME
    shutil.copyfile(WHEEL_CACHE / WHEEL_NAME, tampered)
    with open(tampered, "ab") as f:
        f.write(b"tampered")
    actual = hashlib.sha256(tampered.read_bytes()).hexdigest()
    out = overlay(project, "apply", ok=False, HIQ_WHEEL_CACHE=str(cache))
    assert "sha256 mismatch" in out
    assert WHEEL_SHA in out and actual in out
    assert not (project / "build" / "sglang").exists()


# --------------------------------------------------------------------------
# apply


def test_apply_builds_baseline_overlay_commit_and_one_commit_per_patch(patched):
    tree = patched.tree
    names = series(patched.path)
    assert len(names) == len(patched.base_series) + 2
    assert git(tree, "tag", "-l").split() == ["hiq-baseline", "hiq-overlay"]
    baseline_msg = git(tree, "log", "-1", "--format=%B", "hiq-baseline")
    assert WHEEL_NAME in baseline_msg and WHEEL_SHA in baseline_msg
    assert git(tree, "rev-list", "--max-parents=0", "HEAD").strip() == git(
        tree, "rev-parse", "hiq-baseline"
    ).strip()
    # The baseline is the wheel's tree, byte for byte.
    with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
        for rel in (MHA, VERSION_PY):
            upstream = zf.read(rel.removeprefix("python/"))
            assert git(tree, "show", f"hiq-baseline:{rel}").encode() == upstream
    assert git(tree, "log", "--format=%s", "hiq-baseline..hiq-overlay").splitlines() == [
        OVERLAY_SUBJECT
    ]
    subjects = git(tree, "log", "--reverse", "--format=%s", "hiq-overlay..HEAD").splitlines()
    assert len(subjects) == len(names)
    assert subjects[-2:] == [SUBJECT_MHA, SUBJECT_VERSION]
    assert git(tree, "status", "--porcelain") == ""
    assert (tree / MHA).read_text().endswith(MHA_LINE)
    assert (tree / VERSION_PY).read_text().endswith(VERSION_LINE)
    assert (tree / NEW_FILE).read_text() == NEW_TEXT


def test_apply_is_a_no_op_when_up_to_date_and_rebuilds_after_a_patch_changes(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project")
    before = head(project)
    assert "is up to date" in overlay(project, "apply")
    assert head(project) == before

    patch = next((project / "patches").glob("*-Pipeline-probe-mha-marker.patch"))
    text = patch.read_text()
    assert f"+{MHA_LINE}" in text
    patch.write_text(text.replace(f"+{MHA_LINE}", "+HIQ_PIPELINE_PROBE_MHA = 2\n"))
    out = overlay(project, "apply")
    assert "up to date" not in out and f"= SGLang {VERSION} (wheel)" in out
    assert (project / "build" / "sglang" / MHA).read_text().endswith(
        "HIQ_PIPELINE_PROBE_MHA = 2\n"
    )
    assert head(project) != before
    assert "is up to date" in overlay(project, "apply")


def test_apply_refuses_unrefreshed_edits_and_force_discards_them(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project")
    tree = project / "build" / "sglang"
    append(tree / MHA, "STRAY_EDIT = 1\n")
    (tree / "python/sglang/stray_new_file.py").write_text("STRAY = 1\n")
    for attempt in ("uncommitted", "committed"):
        if attempt == "committed":
            git(tree, "add", "-A")
            git(tree, "commit", "-q", "-m", "stray commit")
        out = overlay(project, "apply", ok=False)
        assert "make refresh" in out and "FORCE=1" in out, attempt
        assert (tree / MHA).read_text().endswith("STRAY_EDIT = 1\n"), "edit was destroyed"

    overlay(project, "apply", FORCE="1")
    assert (tree / MHA).read_text().endswith(MHA_LINE)
    assert not (tree / "python/sglang/stray_new_file.py").exists()
    assert head(project) == patched.final_head
    assert git(tree, "status", "--porcelain") == ""


def conflicting_patch(project: Path) -> str:
    """A patch whose removed line is not in upstream mha.py."""
    first_line = (project / "build" / "sglang" / MHA).read_text().splitlines()[0]
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: Pipeline Test <pipeline@localhost>\n"
        "Date: Thu, 1 Jan 2026 00:00:00 +0000\n"
        "Subject: [PATCH] Pipeline probe: conflict\n"
        "\n"
        "---\n"
        f"diff --git a/{MHA} b/{MHA}\n"
        f"--- a/{MHA}\n"
        f"+++ b/{MHA}\n"
        "@@ -1,1 +1,1 @@\n"
        f"-{first_line}  # not what upstream has\n"
        f"+{first_line}  # replaced\n"
        "-- \n"
        "2.39.5\n"
        "\n"
    )


def test_conflicting_patch_names_the_patch_and_the_failing_file(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project")
    name = "9999-Pipeline-probe-conflict.patch"
    (project / "patches" / name).write_text(conflicting_patch(project))
    series_file = project / "patches" / "series"
    original_series = series_file.read_text()
    series_file.write_text(original_series + name + "\n")

    for command in ("apply", "check"):
        out = overlay(project, command, ok=False)
        assert f"patch {name} does not apply" in out, command
        assert f"failing file {MHA}" in out, command
    tree = project / "build" / "sglang"
    # apply left the pristine baseline, clean, ready for the next apply.
    assert head(project) == git(tree, "rev-parse", "hiq-baseline").strip()
    assert git(tree, "status", "--porcelain") == ""

    (project / "patches" / name).unlink()
    series_file.write_text(original_series)
    overlay(project, "apply")
    assert head(project) == patched.final_head


# --------------------------------------------------------------------------
# check


def test_check_passes_on_a_consistent_series(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    out = overlay(project, "check")
    n_overlay = len(overlay_files(project))
    assert f"{len(series(project))} patches apply cleanly to SGLang {VERSION}" in out
    assert f"{n_overlay} overlay files" in out


NEW_FILE_PATCH = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Pipeline Test <pipeline@localhost>
Date: Thu, 1 Jan 2026 00:00:00 +0000
Subject: [PATCH] Pipeline probe: new file in a patch

---
diff --git a/python/sglang/srt/hiq_in_a_patch.py b/python/sglang/srt/hiq_in_a_patch.py
new file mode 100644
index 0000000..d3a0ef8
--- /dev/null
+++ b/python/sglang/srt/hiq_in_a_patch.py
@@ -0,0 +1 @@
+X = 1
-- \n2.39.5

"""


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "patches/series lists 9999-missing.patch, which does not exist"),
        ("unlisted", "patches/9999-unlisted.patch is not listed in patches/series"),
        (
            "new-file",
            "9999-new-file.patch creates python/sglang/srt/hiq_in_a_patch.py: "
            "new files belong in sglang_overlay/",
        ),
    ],
)
def test_check_fails_clearly_on_an_inconsistent_series(patched, tmp_path, case, expected):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    patches = project / "patches"
    name = f"9999-{case}.patch"
    if case == "missing":
        append(patches / "series", name + "\n")
    elif case == "unlisted":
        shutil.copy2(patches / series(project)[-1], patches / name)
    else:
        (patches / name).write_text(NEW_FILE_PATCH)
        append(patches / "series", name + "\n")
    out = overlay(project, "check", ok=False)
    assert "patch series is inconsistent" in out
    assert expected in out


# --------------------------------------------------------------------------
# refresh


def test_refresh_writes_patches_and_overlay_and_round_trips(patched, tmp_path):
    project = patched.path
    names = series(project)
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
    assert sorted(p.name for p in (project / "patches").glob("*.patch")) == sorted(names)
    assert overlay_files(project)[NEW_FILE] == NEW_TEXT.encode()

    # The refreshed tree is exactly what was edited by hand, and
    # patches/ + sglang_overlay/ alone rebuild it on the baseline. (A full
    # re-apply from them: the FORCE and conflict tests end on final_head.)
    assert head_tree(project) == patched.edited_tree
    rebuilt = rebuild_in_temp_index(
        patched.tree,
        [project / "patches" / name for name in names],
        project / "sglang_overlay",
        tmp_path / "index",
    )
    assert rebuilt == patched.edited_tree


def test_refresh_of_a_new_file_alone_needs_no_subject(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project")
    tree = project / "build" / "sglang"
    other = NEW_FILE.replace("hiq_pipeline_probe", "hiq_pipeline_probe_2")
    (tree / other).write_text(NEW_TEXT)
    patches_before = {n: (project / "patches" / n).read_text() for n in series(project)}
    out = overlay(project, "refresh")
    assert "refreshed" in out
    assert overlay_files(project)[other] == NEW_TEXT.encode()
    assert overlay_files(project)[NEW_FILE] == NEW_TEXT.encode()
    assert {n: (project / "patches" / n).read_text() for n in series(project)} == patches_before
    assert (tree / other).read_text() == NEW_TEXT
    assert "is up to date" in overlay(project, "apply")


# --------------------------------------------------------------------------
# wheel, pr, install


def test_wheel_carries_the_series_and_installs(patched, tmp_path):
    project = link_project(patched.path, tmp_path / "project")
    out = overlay(project, "wheel")
    wheels = list((project / "dist").glob(f"sglang-{HIQ_VERSION}-{PY_TAG}-*.whl"))
    assert len(wheels) == 1, out
    wheel = wheels[0]
    assert wheel.name == WHEEL_NAME.replace(f"sglang-{VERSION}-", f"sglang-{HIQ_VERSION}-")
    tree = project / "build" / "sglang"
    info = f"sglang-{HIQ_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        for rel in touched_files(project):
            assert zf.read(rel.removeprefix("python/")) == (tree / rel).read_bytes(), rel
        for rel, data in overlay_files(project).items():
            if rel.startswith("python/"):
                assert zf.read(rel.removeprefix("python/")) == data, rel
            else:  # upstream-style tests stay out of the package
                assert not any(n.endswith(rel) for n in zf.namelist()), rel
        metadata = zf.read(f"{info}/METADATA").decode()
        assert re.search(rf"(?m)^Version: {re.escape(HIQ_VERSION)}$", metadata)
        assert not any(n.startswith(f"sglang-{VERSION}.dist-info/") for n in zf.namelist())
        # RECORD hashes the patched bytes, so installers accept the file.
        mha_bytes = zf.read(MHA.removeprefix("python/"))
        digest = base64.urlsafe_b64encode(hashlib.sha256(mha_bytes).digest()).rstrip(b"=")
        record = zf.read(f"{info}/RECORD").decode()
        assert f"{MHA.removeprefix('python/')},sha256={digest.decode()}," in record

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        check=True, env=overlay_env(),
    )  # fmt: skip
    assert (target / MHA.removeprefix("python/")).read_text().endswith(MHA_LINE)
    assert (target / VERSION_PY.removeprefix("python/")).read_text().endswith(VERSION_LINE)
    assert (target / NEW_FILE.removeprefix("python/")).read_text() == NEW_TEXT
    assert (target / info / "METADATA").exists()


def declare_prs(project: Path, base_series: list[str]) -> None:
    """Two PRs: the repository's own series and overlay, then the probes on top."""
    repo_overlay = sorted(overlay_files(REPO))
    (project / "docs" / "prs.toml").write_text(
        "[[pr]]\nnumber = 1\nname = \"base\"\ntitle = \"Probe base PR\"\n"
        f"patches = {base_series!r}\noverlay = {repo_overlay!r}\n"
        "overlay_subject = \"Pipeline probe: base overlay\"\n"
        "tests_subject = \"Pipeline probe: base tests\"\n\n"
        "[[pr]]\nnumber = 2\nname = \"probes\"\ntitle = \"Probe PR on top\"\n"
        "patches = [\"*-Pipeline-probe-*\"]\n"
        f"overlay = [\"{NEW_FILE}\"]\n"
        "overlay_subject = \"Pipeline probe: new file\"\n"
        "overlay_body = \"Why the probe file exists.\"\n\n"
        f"[pr.justify]\n\"{MHA}\" = \"Marks mha.py for the pipeline test.\"\n"
    )


EXPORT_AUTHOR = {
    "GIT_AUTHOR_NAME": "Export Author",
    "GIT_AUTHOR_EMAIL": "export@example.org",
    "GIT_AUTHOR_DATE": "2026-03-04T05:06:07+00:00",
}


def test_pr_exports_each_declared_pr_with_its_author_and_description(patched, tmp_path):
    project = link_project(patched.path, tmp_path / "project")
    declare_prs(project, patched.base_series)
    out = overlay(project, "pr", **EXPORT_AUTHOR)
    pr_root = project / "dist" / "pr"
    assert sorted(p.name for p in pr_root.iterdir()) == ["1-base", "2-probes"]
    first = sorted((pr_root / "1-base").glob("*.patch"))
    second = sorted((pr_root / "2-probes").glob("*.patch"))
    # New modules, then the patches, then the tests they carry.
    repo_overlay = overlay_files(REPO)
    modules = any(not p.startswith("test/") for p in map(str, repo_overlay))
    tests = any(p.startswith("test/") for p in map(str, repo_overlay))
    assert len(first) == modules + len(patched.base_series) + tests
    assert [p.name.split("-", 1)[1] for p in second] == [
        "Pipeline-probe-new-file.patch",
        "Pipeline-probe-mha-marker.patch",
        "Pipeline-probe-version-marker.patch",
    ]
    assert "exported PR 2-probes: 3 commits" in out
    for patch in first + second:
        head = patch.read_text().split("\n---\n", 1)[0]
        assert "From: Export Author <export@example.org>" in head, patch.name
        assert "Date: Wed, 4 Mar 2026 05:06:07 +0000" in head, patch.name
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
    assert alone == git(patched.tree, "rev-parse", f"{patched.base_head}^{{tree}}").strip()
    both = rebuild_in_temp_index(patched.tree, first + second, None, tmp_path / "index2")
    assert both == head_tree(patched.path)


def test_pr_refuses_an_undeclared_patch_and_a_missing_author(patched, tmp_path):
    project = link_project(patched.path, tmp_path / "project")
    declare_prs(project, patched.base_series)
    declaration = project / "docs" / "prs.toml"
    declaration.write_text(
        declaration.read_text().replace('"*-Pipeline-probe-*"', '"*-Pipeline-probe-mha-*"')
    )
    out = overlay(project, "pr", ok=False, **EXPORT_AUTHOR)
    version_patch = series(project)[-1]
    assert f"patch {version_patch} belongs to no PR; it must belong to exactly one" in out
    assert not (project / "dist" / "pr").exists()

    declare_prs(project, patched.base_series)
    no_identity = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    out = overlay(project, "pr", ok=False, **no_identity)
    assert "set git config user.name and user.email, or GIT_AUTHOR_NAME" in out


def stock_package(project: Path, target: Path, version: str = VERSION) -> Path:
    """The files `install` needs from a stock sglang, out of the pinned wheel."""
    wanted = {"sglang/version.py", "sglang/_version.py"}
    wanted |= {rel.removeprefix("python/") for rel in touched_files(project)}
    with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
        for name in sorted(wanted):
            zf.extract(name, target)
    if version != VERSION:
        path = target / "sglang" / "_version.py"
        text = path.read_text()
        assert f"'{VERSION}'" in text
        path.write_text(text.replace(f"'{VERSION}'", f"'{version}'"))
    return target


def test_install_patches_a_stock_package_in_place_once(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    target = stock_package(project, tmp_path / "site")
    out = overlay(project, "install", "--target", str(target))
    assert f"{len(series(project))} patches" in out
    for rel in touched_files(project):
        assert (target / rel.removeprefix("python/")).read_bytes() == (
            patched.tree / rel
        ).read_bytes(), rel
    for rel, data in overlay_files(project).items():
        if rel.startswith("python/"):
            assert (target / rel.removeprefix("python/")).read_bytes() == data, rel
        else:  # upstream-style tests are not installed into the package
            assert not (target / rel).exists(), rel
    assert (target / "sglang" / ".hiqcache-applied").exists()

    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert "already carries this series" in overlay(project, "install", "--target", str(target))
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before


def test_install_and_uninstall_have_their_own_help():
    helps = {
        "install": "patch an installed SGLang in place",
        "uninstall": "undo install: the stock files back",
    }
    for command, words in helps.items():
        out = overlay(REPO, command, "--help")
        assert f"usage: overlay.py {command} [-h] --target TARGET" in out
        assert words in out and "the folder holding the sglang package" in out


def package_state(site: Path) -> dict[str, str | None]:
    """Every path under `site`: the sha256 of a file, None for a folder."""
    return {
        p.relative_to(site).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        )
        for p in site.rglob("*")
    }


def test_install_repatches_after_a_reinstall_and_uninstall_restores_stock(
    patched, tmp_path
):
    """install judges the package by its files, not its marker, and uninstall
    takes back every byte, on the whole stock package from the pinned wheel."""
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    site = tmp_path / "site"

    def reinstall_stock():
        # As `pip install --force-reinstall`: the wheel's files written over the
        # package; files the wheel does not have (overlay files, marker) stay.
        with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
            for member in zf.infolist():
                if member.filename.startswith("sglang/") and not member.is_dir():
                    zf.extract(member, site)

    def assert_patched():
        for rel in touched:
            expected = (patched.tree / "python" / rel).read_bytes()
            assert (site / rel).read_bytes() == expected, rel
        for rel, data in added.items():
            assert (site / rel).read_bytes() == data, rel

    reinstall_stock()
    stock = package_state(site)
    touched = [rel.removeprefix("python/") for rel in touched_files(project)]
    added = {
        rel.removeprefix("python/"): data
        for rel, data in overlay_files(project).items()
        if rel.startswith("python/")
    }
    marker = site / "sglang" / ".hiqcache-applied"

    overlay(project, "install", "--target", str(site))
    assert_patched()
    # The server imported an overlay module: its bytecode is ours to remove too.
    module = next(rel for rel in added if rel.endswith(".py"))
    py_compile.compile(str(site / module), doraise=True)

    reinstall_stock()
    assert all(package_state(site)[rel] == stock[rel] for rel in touched)
    assert marker.exists() and all((site / rel).exists() for rel in added)
    out = overlay(project, "install", "--target", str(site))
    assert "already carries" not in out and f"{len(series(project))} patches" in out
    assert_patched()
    out = overlay(project, "install", "--target", str(site))
    assert f"already carries this series ({len(touched)} patched files" in out

    # A line the series added, edited by hand: uninstall cannot tell what stock
    # was, and changes nothing.
    edited = site / touched[0]
    with zipfile.ZipFile(WHEEL_CACHE / WHEEL_NAME) as zf:
        stock_lines = set(zf.read(touched[0]).splitlines())
    patched_bytes = edited.read_bytes()
    lines = patched_bytes.splitlines(keepends=True)
    added_at = next(
        i for i, line in enumerate(lines) if line.rstrip(b"\n") not in stock_lines
    )
    lines[added_at] = b"# edited\n"
    edited.write_bytes(b"".join(lines))
    before = package_state(site)
    out = overlay(project, "uninstall", "--target", str(site), ok=False)
    assert f"pip install --force-reinstall --no-deps sglang=={VERSION}, then" in out
    assert package_state(site) == before
    edited.write_bytes(patched_bytes)

    out = overlay(project, "uninstall", "--target", str(site))
    restored = f"{len(touched)} patched files restored to stock, {len(added)} overlay"
    assert restored in out
    assert package_state(site) == stock  # every path and byte as the wheel left them
    out = overlay(project, "uninstall", "--target", str(site))
    assert "is stock SGLang; nothing to uninstall" in out
    assert package_state(site) == stock


def test_install_refuses_another_sglang_version(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    target = stock_package(project, tmp_path / "site", version="0.5.22")
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    out = overlay(project, "install", "--target", str(target), ok=False)
    assert f"installed sglang is 0.5.22, the patches are for {VERSION}" in out
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before

    out = overlay(project, "install", "--target", str(tmp_path / "empty"), ok=False)
    assert "no sglang package under" in out


def fuzz_probe_patch(stock_version_py: str) -> str:
    """A patch that rewrites line 15 of upstream version.py with three lines of
    context on each side."""
    lines = stock_version_py.splitlines()
    before, old, after = lines[11:14], lines[14], lines[15:18]
    assert old.strip().startswith("#"), old
    body = "".join(f" {line}\n" for line in before)
    body += f"-{old}\n+{old} (probe)\n"
    body += "".join(f" {line}\n" for line in after)
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: Pipeline Test <pipeline@localhost>\n"
        "Date: Thu, 1 Jan 2026 00:00:00 +0000\n"
        "Subject: [PATCH] Pipeline probe: fuzz\n\n---\n"
        f"diff --git a/{VERSION_PY} b/{VERSION_PY}\n--- a/{VERSION_PY}\n+++ b/{VERSION_PY}\n"
        f"@@ -12,7 +12,7 @@\n{body}-- \n2.39.5\n\n"
    )


def test_install_refuses_a_patch_that_only_applies_with_fuzz(patched, tmp_path):
    project = copy_project(patched.path, tmp_path / "project", tree=False)
    target = stock_package(project, tmp_path / "site")
    version_py = target / VERSION_PY.removeprefix("python/")
    name = "9999-Pipeline-probe-fuzz.patch"
    patch_file = project / "patches" / name
    patch_file.write_text(fuzz_probe_patch(version_py.read_text()))
    append(project / "patches" / "series", name + "\n")

    # Shift the hunk's context: a line inserted after its first context line.
    lines = version_py.read_text().splitlines(keepends=True)
    version_py.write_text("".join(lines[:12] + ["# a line upstream does not have\n"] + lines[12:]))
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}

    # Plain `patch` would take it (fuzz 1), so only the strictness refuses it.
    scratch = tmp_path / "scratch"
    shutil.copytree(target, scratch / "python")
    plain = subprocess.run(
        ["patch", "-p1", "--batch", "--forward", "--dry-run", "-d", str(scratch), "-i",
         str(patch_file)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert plain.returncode == 0 and "with fuzz 1" in plain.stdout, plain.stdout

    out = overlay(project, "install", "--target", str(target), ok=False)
    assert f"patch {name} does not apply exactly (no fuzz)" in out
    assert "nothing was installed" in out and "FAILED" in out
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before


# --------------------------------------------------------------------------
# Docker


def run_check_docker(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scripts.check_docker", "--root", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dockerfile_matches_the_lock_and_overlay_script():
    proc = run_check_docker(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def docker_root(root: Path) -> Path:
    """What scripts/check_docker.py reads, copied from this checkout."""
    (root / "scripts").mkdir(parents=True)
    for rel in ("sglang.lock", "Dockerfile", ".dockerignore", "scripts/overlay.py",
                "scripts/hiqcache_serve.sh"):  # fmt: skip
        shutil.copy2(REPO / rel, root / rel)
    return root


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (f"v{VERSION}-", "v0.0.1-", "but sglang.lock pins"),
        ("overlay.py install --target", "overlay.py apply --target", "expected `/opt/"),
        ("COPY patches/", "# COPY patches/", "reads patches, which the Dockerfile does not COPY"),
        ('CMD ["hiqcache-serve"]', 'ENTRYPOINT ["hiqcache-serve"]\nCMD []',
         "ENTRYPOINT replaces the base image's"),
        ('CMD ["hiqcache-serve"]', "CMD hiqcache-serve", "CMD must be in exec (JSON) form"),
        ('CMD ["hiqcache-serve"]', 'CMD ["hiq-serve"]', "which no COPY installs"),
        ("COPY --chmod=755 scripts/", "COPY scripts/", "must set --chmod=755"),
        ("scripts/hiqcache_serve.sh", "scripts/missing.sh", "not a repository file"),
    ],
)
def test_docker_check_catches_drift(tmp_path, old, new, expected):
    root = docker_root(tmp_path / "repo")
    dockerfile = (REPO / "Dockerfile").read_text()
    assert run_check_docker(root).returncode == 0  # the copy passes as it is
    assert old in dockerfile
    (root / "Dockerfile").write_text(dockerfile.replace(old, new, 1))
    proc = run_check_docker(root)
    assert proc.returncode != 0
    assert expected in proc.stderr


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("\n.venv\n", "\n", ".dockerignore must exclude .venv"),
        ("\nbuild\n", "\nbuild/sglang\n", ".dockerignore must exclude build"),
        ("\n.git\n", "\n.git\npatches/\n",
         "the Dockerfile COPYs patches/, but .dockerignore excludes patches"),
        ("\n.git\n", "\n.git\nscripts/*.sh\n",
         "excludes scripts/hiqcache_serve.sh"),
        ("\n.git\n", "\n.git\nscripts\n!scripts/overlay.py\n",
         "excludes scripts/hiqcache_serve.sh"),
    ],
)  # fmt: skip
def test_docker_check_keeps_the_context_small_and_complete(tmp_path, old, new, expected):
    root = docker_root(tmp_path / "repo")
    ignore = root / ".dockerignore"
    assert run_check_docker(root).returncode == 0  # the copy passes as it is
    assert old in ignore.read_text()
    ignore.write_text(ignore.read_text().replace(old, new, 1))
    proc = run_check_docker(root)
    assert proc.returncode != 0
    assert expected in proc.stderr
    ignore.unlink()
    assert ".dockerignore is missing" in run_check_docker(root).stderr


def test_make_wheel_builds_the_image_tag_without_the_test_venv():
    proc = subprocess.run(
        ["make", "-n", "wheel", "PYTHON=python3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    # Only the pinned wheel tool, installed on its own; never the venv recipe.
    assert "-m venv" not in proc.stdout and ".stamp" not in proc.stdout
    wheel_pin = next(
        line
        for line in (REPO / "requirements" / "test-tools.txt").read_text().splitlines()
        if line.startswith("wheel==")
    )
    assert "grep -m1 '^wheel==' requirements/test-tools.txt" in proc.stdout, wheel_pin
    host = f"{sys.version_info.major}{sys.version_info.minor}"
    assert f"for tag in {' '.join(sorted({'312', host}))}; do" in proc.stdout
    assert "scripts/overlay.py wheel --python-tag $tag" in proc.stdout


# Requirements files that stay out of the test venv, and who installs them.
OUTSIDE_THE_TEST_VENV = {"quality-gemma.txt": "make quality-gemma (build/)"}


def test_make_venv_installs_every_pinned_requirements_file():
    """The venv recipe installs each requirements/*.txt and rebuilds when one
    changes; a file left out passes here and breaks a clean clone (CI)."""
    proc = subprocess.run(
        ["make", "-n", "-B", "venv", "PYTHON=python3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    installed = set(re.findall(r"-r requirements/(\S+\.txt)", proc.stdout))
    pinned = {p.name for p in (REPO / "requirements").glob("*.txt")}
    assert installed == pinned - set(OUTSIDE_THE_TEST_VENV)
    # The prerequisites: the rule's line and its backslash continuations.
    stamp_rule = re.search(
        r"^\$\(VENV\)/\.stamp:((?:.*\\\n)*.*)$",
        (REPO / "Makefile").read_text(),
        re.M,
    )
    assert stamp_rule, "Makefile has no $(VENV)/.stamp rule"
    assert set(re.findall(r"requirements/(\S+\.txt)", stamp_rule[1])) == installed
