#!/usr/bin/env python3
"""HiQCache overlay tool: the pinned SGLang tree, our patch series on top.

Every target and the Docker image go through it (docs/development.md)."""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK_FILE = ROOT / "sglang.lock"
PATCH_DIR = ROOT / "patches"
SERIES_FILE = PATCH_DIR / "series"
OVERLAY_DIR = ROOT / "sglang_overlay"
BUILD_DIR = ROOT / "build"
DEFAULT_TREE = BUILD_DIR / "sglang"
WHEEL_CACHE = Path(os.environ.get("HIQ_WHEEL_CACHE", BUILD_DIR / "wheels"))
DIST_DIR = ROOT / "dist"

BASELINE_TAG = "hiq-baseline"
OVERLAY_TAG = "hiq-overlay"
STATE_FILE = Path(".git", "hiq-state.json")  # relative to the tree
# Fixed identity and dates keep the build tree's commits reproducible.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "HiQCache",
    "GIT_AUTHOR_EMAIL": "hiqcache@localhost",
    "GIT_COMMITTER_NAME": "HiQCache",
    "GIT_COMMITTER_EMAIL": "hiqcache@localhost",
}
FIXED_DATE = "2026-01-01T00:00:00+00:00"
FIXED_DATES = {"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE}
# Subject of the commit that adds sglang_overlay/ (first commit of `make pr`).
OVERLAY_SUBJECT = "HiCache: add the quantized host KV pool modules and their unit tests"
# Compiled extensions and caches ride along in the tree (so it imports) but are not sources.
TREE_EXCLUDES = ("*.so", "__pycache__/", "*.pyc", ".pytest_cache/")
# Patches as `make refresh` and `make pr` write them: no hashes or version that would churn.
FORMAT_PATCH = ("format-patch", "-q", "--zero-commit", "--no-signature")


class OverlayError(SystemExit):
    """A user-facing failure: printed as one clear message, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"overlay: error: {message}")


def read_lock(path: Path = LOCK_FILE) -> dict[str, str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    pairs = (line.partition("=") for line in lines if line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, _, value in pairs}


def read_lines(path: Path) -> list[str]:
    """The non-blank lines of `path`, `#` comments removed."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def run(cmd: list[str], cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """`cmd` with its output captured as text, `env` on top of this environment."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **env})


def git(tree: Path, *args: str, check: bool = True, env_extra=None, error=OverlayError) -> str:
    proc = run(["git", "-C", str(tree), *args], **{**GIT_IDENTITY, **(env_extra or {})})
    if check and proc.returncode != 0:
        raise error(f"git {' '.join(args)} failed in {tree}:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def read_series() -> list[str]:
    return read_lines(SERIES_FILE) if SERIES_FILE.exists() else []


def overlay_files() -> list[Path]:
    """Overlay files as paths relative to the overlay root (python/sglang/...)."""
    if not OVERLAY_DIR.exists():
        return []
    return sorted(
        p.relative_to(OVERLAY_DIR)
        for p in OVERLAY_DIR.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def inputs_digest(source: str) -> str:
    """Hash of everything that decides the applied tree."""
    digest = hashlib.sha256(source.encode())
    paths = [LOCK_FILE, SERIES_FILE] if SERIES_FILE.exists() else [LOCK_FILE]
    paths += sorted(PATCH_DIR.glob("*.patch"))
    paths += [OVERLAY_DIR / rel for rel in overlay_files()]
    for path in paths:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def patch_touched_files(patch: Path) -> list[tuple[str, bool]]:
    """(upstream path, creates_file) for each file a git patch touches."""
    touched = []
    for line in patch.read_text(errors="replace").splitlines():
        if match := re.match(r"^diff --git a/(\S+) b/(\S+)$", line):
            touched.append((match.group(1), False))
        elif touched and line.startswith("new file mode"):
            touched[-1] = (touched[-1][0], True)
    return touched


def series_touched_files() -> set[str]:
    """Every upstream path a patch of the series touches."""
    return {path for name in read_series() for path, _ in patch_touched_files(PATCH_DIR / name)}


def wheel_for_python(lock: dict[str, str], python_tag: str | None) -> tuple[str, str]:
    tag = python_tag or f"{sys.version_info.major}{sys.version_info.minor}"
    key = f"SGLANG_WHEEL_CP{tag}"
    if key not in lock:
        known = sorted(k[len("SGLANG_WHEEL_CP") :] for k in lock if k.endswith("_SHA256"))
        raise OverlayError(
            f"sglang.lock pins no wheel for Python cp{tag} (pinned: "
            f"{', '.join('cp' + k.split('_')[0] for k in known)}); pass --python-tag"
        )
    return lock[key], lock[f"{key}_SHA256"]


def verify_sha(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise OverlayError(
            f"sha256 mismatch for {path.name}: sglang.lock pins {expected}, "
            f"the file has {actual}. Refusing to apply on a different SGLang "
            f"(delete {path} to download it again)."
        )


def fetch(python_tag: str | None = None) -> Path:
    lock = read_lock()
    name, expected = wheel_for_python(lock, python_tag)
    path = WHEEL_CACHE / name
    if not path.exists():
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        tag = name.split("-")[2][2:]  # cp311 -> 311
        platform = name.rsplit("-", 1)[1].removesuffix(".whl")
        with tempfile.TemporaryDirectory(dir=WHEEL_CACHE) as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--only-binary=:all:", "--python-version", tag,
                "--implementation", "cp", "--platform", platform,
                "--dest", tmp, f"sglang=={lock['SGLANG_VERSION']}",
            ]  # fmt: skip
            proc = run(cmd)
            got = Path(tmp) / name
            if proc.returncode != 0 or not got.exists():
                raise OverlayError(f"could not download {name}:\n{proc.stdout}{proc.stderr}")
            verify_sha(got, expected)
            got.replace(path)
    verify_sha(path, expected)
    return path


def _write_excludes(tree: Path) -> None:
    exclude = tree / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("".join(f"{pattern}\n" for pattern in TREE_EXCLUDES))


def _baseline_from_wheel(tree: Path, wheel: Path, lock: dict[str, str]) -> None:
    target = tree / "python"
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.infolist():
            if member.filename.startswith("sglang/") and not member.is_dir():
                zf.extract(member, target)
    git(tree, "init", "-q", "-b", "main")
    _write_excludes(tree)
    git(tree, "add", "-A")
    message = f"SGLang {lock['SGLANG_VERSION']} python tree from {wheel.name}\n\n"
    git(tree, "commit", "-q", "-m", f"{message}sha256 {sha256_of(wheel)}", env_extra=FIXED_DATES)
    git(tree, "tag", BASELINE_TAG)


def _baseline_from_git(tree: Path, lock: dict[str, str]) -> None:
    # For users with GitHub access; the patches use the same upstream paths.
    tag, url = lock["SGLANG_GIT_TAG"], lock["SGLANG_GIT_URL"]
    proc = run(["git", "clone", "-q", "--depth", "1", "--branch", tag, url, str(tree)])
    if proc.returncode != 0:
        raise OverlayError(f"git clone of {tag} failed:\n{proc.stderr}")
    _write_excludes(tree)
    git(tree, "tag", BASELINE_TAG)


def _failing_file(output: str) -> str:
    for pattern in (
        r"error: patch failed: (\S+?):\d+",
        r"error: (\S+): does not exist in index",
        r"error: (\S+): No such file or directory",
        r"error: (\S+): already exists",
    ):
        match = re.search(pattern, output)
        if match:
            return match.group(1)
    return "(see git output below)"


def _copy_overlay(tree: Path) -> list[str]:
    baseline = set(git(tree, "ls-tree", "-r", "--name-only", BASELINE_TAG).split())
    copied = [rel.as_posix() for rel in overlay_files()]
    for rel in copied:
        if rel in baseline:
            raise OverlayError(
                f"sglang_overlay/{rel} exists upstream: edits to upstream "
                "files belong in patches/ (make refresh puts them there)"
            )
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(OVERLAY_DIR / rel, tree / rel)
    return copied


def _apply_series(tree: Path) -> None:
    for name in read_series():
        patch = PATCH_DIR / name
        if not patch.exists():
            raise OverlayError(f"patches/series lists {name}, which does not exist")
        am = ["am", "-q", "--keep-cr", "--committer-date-is-author-date", str(patch)]
        proc = run(["git", "-C", str(tree), *am], **GIT_IDENTITY)
        if proc.returncode != 0:
            output = proc.stdout + proc.stderr
            git(tree, "am", "--abort", check=False)
            raise OverlayError(
                f"patch {name} does not apply: failing file "
                f"{_failing_file(output)}\n{output.strip()}"
            )


def apply(source: str | None = None, tree: Path = DEFAULT_TREE, force: bool = False) -> Path:
    source = source or os.environ.get("SGLANG_SOURCE", "wheel")
    if source not in ("wheel", "git"):
        raise OverlayError(f"SGLANG_SOURCE must be 'wheel' or 'git', got {source!r}")
    lock = read_lock()
    wheel = fetch() if source == "wheel" else None
    digest = inputs_digest(source)

    if tree.exists():
        if not (tree / ".git").exists() or not git(tree, "tag", "-l", BASELINE_TAG).strip():
            raise OverlayError(f"{tree} exists but is not a tree made by this tool; remove it")
        state_path = tree / STATE_FILE
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        head = git(tree, "rev-parse", "HEAD").strip()
        expected_head = state.get("head") or git(tree, "rev-parse", BASELINE_TAG).strip()
        edited = head != expected_head or git(tree, "status", "--porcelain").strip() != ""
        if edited and not force:
            raise OverlayError(
                f"{tree} has edits that are not in patches/ or sglang_overlay/: "
                "run `make refresh` to keep them, or `make apply FORCE=1` to discard them"
            )
        if not edited and state.get("inputs") == digest:
            print(f"overlay: {tree} is up to date")
            return tree
        if state.get("source", source) != source:
            raise OverlayError(
                f"{tree} was built from SGLANG_SOURCE={state['source']}; remove it to switch"
            )
        git(tree, "reset", "-q", "--hard", BASELINE_TAG)
        git(tree, "clean", "-q", "-fd")
        state_path.unlink(missing_ok=True)
        git(tree, "tag", "-d", OVERLAY_TAG, check=False)
    else:
        tree.parent.mkdir(parents=True, exist_ok=True)
        if source == "wheel":
            _baseline_from_wheel(tree, wheel, lock)
        else:
            _baseline_from_git(tree, lock)

    try:
        copied = _copy_overlay(tree)
        if copied:
            git(tree, "add", "--", *copied)
            git(tree, "commit", "-q", "-m", OVERLAY_SUBJECT, env_extra=FIXED_DATES)
        git(tree, "tag", "-f", OVERLAY_TAG)
        _apply_series(tree)
    except OverlayError:
        # Leave a usable tree: the pristine baseline, ready for the next apply.
        git(tree, "reset", "-q", "--hard", BASELINE_TAG, check=False)
        git(tree, "clean", "-q", "-fd", check=False)
        raise
    state = {"inputs": digest, "head": git(tree, "rev-parse", "HEAD").strip(), "source": source}
    (tree / STATE_FILE).write_text(json.dumps(state, indent=1))
    print(
        f"overlay: {tree} = SGLang {lock['SGLANG_VERSION']} ({source}) + "
        f"{len(copied)} overlay files + {len(read_series())} patches"
    )
    return tree


def check_series() -> None:
    """Refuse a patches/series that disagrees with the files in patches/."""
    series = read_series()
    on_disk = sorted(p.name for p in PATCH_DIR.glob("*.patch"))
    problems = []
    for index, name in enumerate(series):
        if name in series[:index]:
            problems.append(f"patches/series lists {name} twice")
        if name not in on_disk:
            problems.append(f"patches/series lists {name}, which does not exist")
    problems += [f"patches/{n} is not listed in patches/series" for n in on_disk if n not in series]
    for name in (n for n in series if n in on_disk):
        for path, creates in patch_touched_files(PATCH_DIR / name):
            if not path.startswith("python/sglang/"):
                problems.append(f"{name} touches {path}, outside python/sglang/")
            if creates:
                problems.append(f"{name} creates {path}: new files belong in sglang_overlay/")
    if problems:
        raise OverlayError("patch series is inconsistent:\n  " + "\n  ".join(problems))


def check() -> None:
    check_series()
    with zipfile.ZipFile(fetch()) as zf:
        upstream = {"python/" + n for n in zf.namelist() if n.startswith("sglang/")}
        for rel in overlay_files():
            if rel.as_posix() in upstream:
                raise OverlayError(
                    f"sglang_overlay/{rel.as_posix()} exists upstream: "
                    "edits to upstream files belong in patches/"
                )
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            git(work, "init", "-q")
            for path in sorted(series_touched_files()):
                if path not in upstream:
                    raise OverlayError(f"a patch edits {path}, which SGLang does not have")
                (work / path).parent.mkdir(parents=True, exist_ok=True)
                (work / path).write_bytes(zf.read(path.removeprefix("python/")))
            for name in read_series():
                patch = str(PATCH_DIR / name)
                proc = run(["git", "-C", tmp, "apply", "--whitespace=nowarn", patch])
                if proc.returncode != 0:
                    raise OverlayError(
                        f"patch {name} does not apply: failing file "
                        f"{_failing_file(proc.stderr)}\n{proc.stderr.strip()}"
                    )
    print(
        f"overlay: {len(read_series())} patches apply cleanly to SGLang "
        f"{read_lock()['SGLANG_VERSION']}; {len(overlay_files())} overlay files"
    )


def refresh(tree: Path = DEFAULT_TREE, message: str | None = None) -> None:
    if not (tree / ".git").exists() or not git(tree, "tag", "-l", OVERLAY_TAG).strip():
        raise OverlayError(f"{tree} is not an applied tree: run `make apply` first")
    baseline_files = set(git(tree, "ls-tree", "-r", "--name-only", BASELINE_TAG).split())
    patch_commits = git(tree, "rev-list", f"{OVERLAY_TAG}..HEAD").split()

    if git(tree, "status", "--porcelain").strip():  # uncommitted edits
        git(tree, "add", "-A")
        staged = git(tree, "diff", "--cached", "--name-only", "HEAD").split()
        pending_upstream = baseline_files.intersection(staged)
        if message:
            git(tree, "commit", "-q", "-m", message)
        elif pending_upstream and not patch_commits:
            raise OverlayError(
                "uncommitted edits to upstream files and no patch to fold them into: "
                'pass MSG="subject" (make refresh MSG=...) to start a new patch'
            )
        elif patch_commits:
            # quilt semantics: edits refresh the topmost patch
            git(tree, "commit", "-q", "--amend", "--no-edit")
        else:
            # Only overlay files changed; they leave the patch range below.
            git(tree, "commit", "-q", "-m", "HiQCache: overlay edits")
    snapshot = git(tree, "rev-parse", "HEAD^{tree}").strip()
    git(tree, "update-ref", "refs/hiq/refresh-backup", "HEAD")

    # Overlay: every file that upstream does not have.
    head_files = set(git(tree, "ls-tree", "-r", "--name-only", "HEAD").split())
    new_files = sorted(head_files - baseline_files)
    if OVERLAY_DIR.exists():
        shutil.rmtree(OVERLAY_DIR)
    show = ["git", "-C", str(tree), "show"]
    for rel in new_files:
        dst = OVERLAY_DIR / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        blob = subprocess.run([*show, f"HEAD:{rel}"], capture_output=True, check=True).stdout
        dst.write_bytes(blob)

    # Patches: commits after the overlay tag, restricted to upstream files.
    PATCH_DIR.mkdir(exist_ok=True)
    for old in PATCH_DIR.glob("*.patch"):
        old.unlink()
    excludes = [f":(exclude){rel}" for rel in new_files]
    if git(tree, "rev-list", f"{OVERLAY_TAG}..HEAD").split():
        patches = f"{OVERLAY_TAG}..HEAD"
        git(tree, *FORMAT_PATCH, "--no-stat", "-o", str(PATCH_DIR), patches, "--", ".", *excludes)
    names = sorted(p.name for p in PATCH_DIR.glob("*.patch"))
    SERIES_FILE.write_text(
        "# Applied in this order by scripts/overlay.py; regenerated by `make refresh`.\n"
        + "".join(f"{name}\n" for name in names)
    )

    # Round trip: rebuilding the tree from what we wrote must give the same sources.
    apply(tree=tree, force=True)
    rebuilt = git(tree, "rev-parse", "HEAD^{tree}").strip()
    if rebuilt != snapshot:
        raise OverlayError(
            "refresh did not round-trip: the rebuilt tree differs from the edited one. "
            "Your edits are kept at refs/hiq/refresh-backup in build/sglang."
        )
    print(f"overlay: refreshed {len(names)} patches and {len(new_files)} overlay files")


def build_wheel(tree: Path = DEFAULT_TREE, python_tag: str | None = None) -> Path:
    lock = read_lock()
    apply(tree=tree)
    pinned = fetch(python_tag)
    pin = lock["SGLANG_VERSION"]
    version = f"{pin}+{lock['HIQ_LOCAL_VERSION']}"
    changed = git(tree, "diff", "--name-status", "--no-renames", BASELINE_TAG, "HEAD")
    DIST_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "wheel", "unpack", "-d", tmp, str(pinned)], check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        unpacked = Path(tmp) / f"sglang-{pin}"
        for line in changed.splitlines():
            status, path = line.split("\t")
            if not path.startswith("python/"):
                continue  # upstream-style tests are not part of the package
            inner = path.removeprefix("python/")
            if status == "D":
                (unpacked / inner).unlink()
            else:
                (unpacked / inner).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / path, unpacked / inner)
        old_info = unpacked / f"sglang-{pin}.dist-info"
        metadata = old_info / "METADATA"
        metadata.write_text(
            re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata.read_text(), count=1)
        )
        old_info.rename(unpacked / f"sglang-{version}.dist-info")
        renamed = unpacked.rename(Path(tmp) / f"sglang-{version}")
        out = subprocess.run(
            [sys.executable, "-m", "wheel", "pack", "-d", str(DIST_DIR), str(renamed)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    built = DIST_DIR / pinned.name.replace(f"sglang-{pin}-", f"sglang-{version}-")
    if not built.exists():
        raise OverlayError(f"wheel pack did not produce {built.name}:\n{out.stdout}{out.stderr}")
    print(f"overlay: built {built}")
    return built


PR_DECLARATION = ROOT / "docs" / "prs.toml"
PR_DESCRIPTION_SOURCE = ROOT / "docs" / "PR_DESCRIPTION.md"
# Upstream's pull request template, in its order; the description source must carry each one.
PR_TEMPLATE_SECTIONS = (
    "Motivation",
    "Modifications",
    "Accuracy Tests",
    "Speed Tests and Profiling",
    "Checklist",
)
PR_BLOCK = re.compile(r"<!-- pr: ([a-z0-9,\s-]+) -->\n(.*?)<!-- /pr -->\n?", re.S)
PR_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
NOT_JUSTIFIED = "**not justified yet**: add a line to docs/prs.toml"
# Keys of a [[pr]] entry: the required ones, then the texts that default to "".
PR_REQUIRED = ("number", "name", "title", "patches", "overlay")
PR_TEXTS = ("overlay_subject", "overlay_body", "tests_subject", "tests_body")


@dataclass
class PullRequest:
    number: int
    name: str
    title: str
    overlay_subject: str
    overlay_body: str
    tests_subject: str
    tests_body: str
    patches: list[str]  # names in patches/series, in series order
    overlay: list[Path]  # paths under sglang_overlay/
    justify: dict[str, str]  # upstream path -> why the PR edits it

    @property
    def dir_name(self) -> str:
        return f"{self.number}-{self.name}"


def _matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)


def read_pr_declaration(path: Path = PR_DECLARATION) -> list[PullRequest]:
    """The PRs of docs/prs.toml; every patch and overlay file in exactly one."""
    shown = path.relative_to(ROOT)
    if not path.exists():
        raise OverlayError(f"{shown} is missing: it declares what `make pr` exports")
    try:
        entries = tomllib.loads(path.read_text()).get("pr", [])
    except tomllib.TOMLDecodeError as error:
        raise OverlayError(f"{shown}: {error}") from None
    if not entries:
        raise OverlayError(f"{shown} declares no [[pr]]")
    series = read_series()
    overlay = [rel.as_posix() for rel in overlay_files()]
    prs, problems = [], []
    for index, entry in enumerate(entries, start=1):
        missing = [k for k in PR_REQUIRED if k not in entry]
        if missing:
            raise OverlayError(f"[[pr]] number {index} lacks {', '.join(missing)}")
        if entry["number"] != index:
            problems.append(f"PR {entry['name']!r} has number {entry['number']}, expected {index}")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", entry["name"]):
            problems.append(f"PR name {entry['name']!r}: use lower-case letters, digits and '-'")
        prs.append(
            PullRequest(
                **{key: entry[key] for key in ("number", "name", "title")},
                **{key: entry.get(key, "") for key in PR_TEXTS},
                patches=[n for n in series if _matches(n, entry["patches"])],
                overlay=[Path(p) for p in overlay if _matches(p, entry["overlay"])],
                justify=dict(entry.get("justify", {})),
            )
        )
    for kind, items, owned in (
        ("patch", series, lambda pr: pr.patches),
        ("overlay file", overlay, lambda pr: [p.as_posix() for p in pr.overlay]),
    ):
        for item in items:
            owners = [pr.name for pr in prs if item in owned(pr)]
            if len(owners) != 1:
                where = ", ".join(owners) if owners else "no PR"
                problems.append(f"{kind} {item} belongs to {where}; it must belong to exactly one")
    for pr in prs:
        if any(rel.parts[0] != "test" for rel in pr.overlay) and not pr.overlay_subject:
            problems.append(f"PR {pr.name} adds overlay modules but declares no overlay_subject")
        if any(rel.parts[0] == "test" for rel in pr.overlay) and not pr.tests_subject:
            problems.append(f"PR {pr.name} adds overlay tests but declares no tests_subject")
    if problems:
        raise OverlayError(f"{shown} does not match the series:\n  " + "\n  ".join(problems))
    return prs


def export_identity() -> dict[str, str]:
    """Author and committer of the exported commits: GIT_AUTHOR_* or git config, now."""

    def config(key: str) -> str:
        return git(ROOT, "config", key, check=False).strip()

    name = os.environ.get("GIT_AUTHOR_NAME") or config("user.name")
    email = os.environ.get("GIT_AUTHOR_EMAIL") or config("user.email")
    if not name or not email:
        raise OverlayError(
            "the exported commits need an author: set git config user.name and "
            "user.email, or GIT_AUTHOR_NAME and GIT_AUTHOR_EMAIL"
        )
    date = os.environ.get("GIT_AUTHOR_DATE") or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    author = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date}
    committer = {key.replace("AUTHOR", "COMMITTER"): value for key, value in author.items()}
    return author | {key: os.environ.get(key) or value for key, value in committer.items()}


def _upstream_subject(message: str) -> str:
    """`HiCache: do x` (our series) as upstream's `[HiCache] Do x`."""
    subject, _, rest = message.partition("\n")
    subject = re.sub(r"^HiCache: (.)", lambda m: f"[HiCache] {m.group(1).upper()}", subject)
    return subject + ("\n" + rest if rest else "\n")


def _commit_files(work: Path, files: list[Path], subject: str, body: str, identity) -> None:
    """One commit of overlay `files` (none: no commit), the message `subject` and `body`."""
    if not files:
        return
    for rel in files:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(OVERLAY_DIR / rel, work / rel)
    git(work, "add", "--", *[rel.as_posix() for rel in files])
    message = subject + (f"\n\n{body.strip()}\n" if body.strip() else "")
    git(work, "commit", "-q", "-m", message, env_extra=identity)


def _commit_pr(work: Path, pr: PullRequest, identity: dict[str, str]) -> None:
    """The PR's new modules, patches, then tests, so each commit passes the tests it carries."""
    author = f"--author={identity['GIT_AUTHOR_NAME']} <{identity['GIT_AUTHOR_EMAIL']}>"
    date = f"--date={identity['GIT_AUTHOR_DATE']}"
    modules = [rel for rel in pr.overlay if rel.parts[0] != "test"]
    _commit_files(work, modules, pr.overlay_subject, pr.overlay_body, identity)
    for name in pr.patches:
        patch = str(PATCH_DIR / name)
        proc = run(["git", "-C", str(work), "am", "-q", "--keep-cr", patch], **identity)
        if proc.returncode != 0:
            raise OverlayError(
                f"PR {pr.dir_name}: patch {name} does not apply on "
                f"v{read_lock()['SGLANG_VERSION']} "
                f"plus the PRs before it (check the order in docs/prs.toml):\n"
                f"{(proc.stdout + proc.stderr).strip()}"
            )
        message = _upstream_subject(git(work, "log", "-1", "--format=%B"))
        git(work, "commit", "-q", "--amend", "-m", message, author, date, env_extra=identity)
    tests = [rel for rel in pr.overlay if rel.parts[0] == "test"]
    _commit_files(work, tests, pr.tests_subject, pr.tests_body, identity)


def _numstat(work: Path, base: str, diff_filter: str) -> list[list[str]]:
    """(added, removed, path) of each file base..HEAD adds (A) or modifies (M)."""
    numstat = git(work, "diff", "--numstat", f"--diff-filter={diff_filter}", base, "HEAD")
    return [line.split("\t") for line in numstat.splitlines()]


def _upstream_edits(work: Path, base: str, pr: PullRequest) -> str:
    """Markdown table of the existing upstream files the PR edits; warns of unjustified ones."""
    rows = []
    for added, removed, path in _numstat(work, base, "M"):
        why = pr.justify.get(path)
        if why is None:
            print(f"overlay: warning: PR {pr.dir_name} edits {path}; docs/prs.toml says not why")
        cell = (why or NOT_JUSTIFIED).replace("|", "\\|")
        rows.append(f"| `{path}` | +{added} / -{removed} | {cell} |")
    if not rows:
        return "None: this PR only adds files."
    table = "| existing upstream file | lines | why it is edited |\n|---|---:|---|\n"
    return table + "\n".join(rows)


def render_description(pr: PullRequest, values: dict, source: Path = PR_DESCRIPTION_SOURCE) -> str:
    """The PR's description from the one source: shared text, its own blocks, values."""
    text = source.read_text()
    text = re.sub(r"\A<!--.*?-->\n+", "", text, flags=re.S)  # the source's own notes

    def keep_block(match: re.Match) -> str:
        names = {name.strip() for name in match.group(1).split(",")}
        return match.group(2) if pr.name in names else ""

    text = PR_BLOCK.sub(keep_block, text)
    unknown = sorted(set(PR_PLACEHOLDER.findall(text)) - set(values))
    if unknown:
        raise OverlayError(f"{source.name} uses unknown placeholders: {', '.join(unknown)}")
    text = PR_PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
    headings = re.findall(r"(?m)^## (.+?)\s*$", text)
    missing = [s for s in PR_TEMPLATE_SECTIONS if s not in headings]
    if missing:
        raise OverlayError(
            f"{source.name} lacks upstream's template sections for PR {pr.name}: "
            + ", ".join(missing)
        )
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def export_pr(tree: Path = DEFAULT_TREE) -> Path:
    """Each PR of docs/prs.toml, on v<pin> + the PRs before it, in dist/pr/<number>-<name>/."""
    lock = read_lock()
    apply(tree=tree)
    prs = read_pr_declaration()
    identity = export_identity()
    out_root = DIST_DIR / "pr"
    if out_root.exists():
        shutil.rmtree(out_root)
    out_root.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "export"
        git(Path(tmp), "clone", "-q", "--shared", "--no-checkout", str(tree.resolve()), "export")
        git(work, "checkout", "-q", "--detach", BASELINE_TAG)
        bases = [f"`{lock['SGLANG_GIT_TAG']}`"]
        for pr in prs:
            start = git(work, "rev-parse", "HEAD").strip()
            _commit_pr(work, pr, identity)
            out_dir = out_root / pr.dir_name
            git(work, *FORMAT_PATCH, "-o", str(out_dir), f"{start}..HEAD")
            added = _numstat(work, start, "A")
            new_files = "\n".join(f"- `{path}` ({lines} lines)" for lines, _, path in added)
            values = {
                "title": pr.title,
                "base": " + ".join(bases),
                "commits": git(work, "log", "--reverse", "--format=- %s", f"{start}..HEAD").strip(),
                "new_files": new_files or "None.",
                "upstream_edits": _upstream_edits(work, start, pr),
                "diffstat": git(work, "diff", "--stat", start, "HEAD").rstrip(),
            }
            (out_dir / "PR_DESCRIPTION.md").write_text(render_description(pr, values))
            bases.append(f"PR {pr.dir_name}")
            count = len(list(out_dir.glob("*.patch")))
            changed = _numstat(work, start, "AM")
            size = sum(int(a) + int(r) for a, r, _ in changed if a != "-")
            print(
                f"overlay: exported PR {pr.dir_name}: {count} commits, {size} lines "
                f"changed in {len(changed)} files, and PR_DESCRIPTION.md"
            )
        exported = git(work, "rev-parse", "HEAD^{tree}").strip()
    if exported != git(tree, "rev-parse", "HEAD^{tree}").strip():
        raise OverlayError(
            f"the exported PRs together do not rebuild {tree}: check docs/prs.toml"
        )
    print(f"overlay: exported {len(prs)} PRs to {out_root}")
    return out_root


# In the installed package: {"series": inputs digest, "files": [overlay files]}.
INSTALL_MARKER = ".hiqcache-applied"


def _installed_package(target: Path) -> Path:
    """target/sglang, refused unless it is the pinned version."""
    lock = read_lock()
    package = target / "sglang"
    version_file = package / "version.py"
    if not version_file.exists():
        raise OverlayError(f"no sglang package under {target}")
    # The literal is in _version.py (setuptools-scm); the ^ skips version.py's indented fallback.
    texts = (
        p.read_text() for p in (package / "_version.py", version_file) if p.exists()
    )
    found = (
        re.search(r"(?m)^__version__\s*=\s*(?:\w+\s*=\s*)*['\"]([^'\"]+)", t)
        for t in texts
    )
    installed = next((match.group(1) for match in found if match), "unknown")
    if installed != lock["SGLANG_VERSION"]:
        raise OverlayError(
            f"installed sglang is {installed}, the patches are for {lock['SGLANG_VERSION']}"
        )
    return package


def _read_marker(marker: Path) -> dict | None:
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        record = None
    # A marker from before the file list was recorded holds the digest alone.
    return record if isinstance(record, dict) else {"series": text, "files": []}


def _patch_series(
    files: dict[str, bytes], reverse: bool = False
) -> tuple[dict | None, str, str]:
    """`files` ({upstream path: bytes}) after the whole series, or with `reverse`
    before it; (None, which patch failed and its output) where one does not apply."""
    # --fuzz=0: context other than the pin's is another SGLang (as for git am).
    options = [
        "-p1",
        "--batch",
        "--forward",
        "--fuzz=0",
        "--no-backup-if-mismatch",
        "-r",
        "-",
    ]
    names = read_series()
    with tempfile.TemporaryDirectory() as tmp:
        for path, data in files.items():
            (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / path).write_bytes(data)
        for name in reversed(names) if reverse else names:
            cmd = ["patch", *options, *(["-R"] if reverse else []), "-d", tmp]
            proc = run([*cmd, "-i", str(PATCH_DIR / name)])
            if proc.returncode != 0:
                output = (proc.stdout + proc.stderr).strip()
                return None, f"patch {name} does not apply exactly (no fuzz)", output
        return {path: (Path(tmp) / path).read_bytes() for path in files}, "", ""


def _series_state(target: Path) -> tuple[str, dict, dict, str]:
    """("stock" | "patched" | "neither", stock bytes, patched bytes, why) of the
    files the series touches under `target`, judged by their content."""
    current = {
        path: (target / path.removeprefix("python/")).read_bytes()
        for path in sorted(series_touched_files())
    }
    patched, failed, output = _patch_series(current)
    if patched is not None:
        return "stock", current, patched, ""
    stock = _patch_series(current, reverse=True)[0]
    # Taken back and applied again, the files must come out byte for byte.
    if stock is not None and _patch_series(stock)[0] == current:
        return "patched", stock, current, ""
    return "neither", {}, {}, f"{failed} to {target}\n{output}"


def _overlay_destinations(target: Path) -> dict[Path, Path]:
    """{installed path: overlay source} of the package's overlay files (not test/)."""
    package_files = [rel for rel in overlay_files() if rel.parts[0] == "python"]
    return {
        target / rel.relative_to("python"): OVERLAY_DIR / rel for rel in package_files
    }


def _remove_overlay_files(package: Path, paths: set[Path]) -> int:
    """Remove `paths`, their bytecode and the folders that leaves empty."""
    removed = 0
    for path in sorted(paths):
        if path.is_file():
            path.unlink()
            removed += 1
        for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
            pyc.unlink()
        for folder in (path.parent / "__pycache__", *path.parents):
            if folder == package or package not in folder.parents:
                break
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    return removed


def install(target: Path) -> None:
    """Apply overlay + series to an installed sglang package under `target` (-p2)."""
    package = _installed_package(target)
    check_series()
    marker = package / INSTALL_MARKER
    record = _read_marker(marker)
    placed = _overlay_destinations(target)
    files = sorted(dst.relative_to(target).as_posix() for dst in placed)
    new_record = {"series": inputs_digest("install"), "files": files}
    state, _, patched, why = _series_state(target)
    if state == "patched" and all(_same_bytes(dst, src) for dst, src in placed.items()):
        if record != new_record:  # the content is this series'; so is the marker now
            stale = {target / rel for rel in record["files"]} if record else set()
            _remove_overlay_files(package, stale - set(placed))
            marker.write_text(json.dumps(new_record, indent=1) + "\n")
        print(
            f"overlay: {package} already carries this series "
            f"({len(patched)} patched files and {len(placed)} overlay files verified)"
        )
        return
    if state == "patched":
        raise OverlayError(
            f"{package} has this series' patches but not its overlay files: run "
            f"`overlay.py uninstall --target {target}`, then install again"
        )
    if state == "neither":
        version = read_lock()["SGLANG_VERSION"]
        another = (
            f" ({package} carries another HiQCache series: pip install "
            f"--force-reinstall --no-deps sglang=={version} first)"
        )
        head, _, output = why.partition("\n")
        raise OverlayError(
            f"{head}; nothing was installed{another if record else ''}:\n{output}"
        )
    # Stock files: a fresh package, or one reinstalled over an earlier install,
    # whose overlay files are left behind and ours to replace.
    ours = (
        ({target / rel for rel in record["files"]} | set(placed)) if record else set()
    )
    for dst in placed:
        if dst.exists() and dst not in ours:
            raise OverlayError(f"{dst} already exists; refusing to overwrite it")
    for path, data in patched.items():
        (target / path.removeprefix("python/")).write_bytes(data)
    for dst, src in placed.items():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    _remove_overlay_files(package, ours - set(placed))  # an earlier series' own files
    marker.write_text(json.dumps(new_record, indent=1) + "\n")
    print(
        f"overlay: installed {len(placed)} overlay files and "
        f"{len(read_series())} patches into {package}"
    )


def _same_bytes(path: Path, source: Path) -> bool:
    return path.is_file() and path.read_bytes() == source.read_bytes()


def uninstall(target: Path) -> None:
    """Undo `install`: the stock files back, every overlay file and the marker gone."""
    package = _installed_package(target)
    check_series()
    marker = package / INSTALL_MARKER
    record = _read_marker(marker)
    state, stock, _, _ = _series_state(target)
    if state == "neither":
        version = read_lock()["SGLANG_VERSION"]
        raise OverlayError(
            f"the files this series patches in {package} are neither stock SGLang "
            f"{version} nor patched by it (another series, or edited); nothing was "
            f"changed: pip install --force-reinstall --no-deps sglang=={version}, then "
            "uninstall again to remove the overlay files"
        )
    if state == "patched":
        for path, data in stock.items():
            (target / path.removeprefix("python/")).write_bytes(data)
    ours = set(_overlay_destinations(target))
    ours |= {target / rel for rel in record["files"]} if record else set()
    removed = _remove_overlay_files(package, ours)
    marker.unlink(missing_ok=True)
    if state == "stock" and not removed and record is None:
        print(f"overlay: {package} is stock SGLang; nothing to uninstall")
        return
    restored = len(stock) if state == "patched" else 0
    print(
        f"overlay: uninstalled from {package}: {restored} patched files restored "
        f"to stock, {removed} overlay files removed"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "fetch": lambda args: print(fetch(args.python_tag)),
        "apply": lambda args: apply(args.source, args.tree, args.force),
        "check": lambda args: check(),
        "refresh": lambda args: refresh(args.tree, args.message),
        "wheel": lambda args: build_wheel(args.tree, args.python_tag),
        "pr": lambda args: export_pr(args.tree),
        "install": lambda args: install(args.target),
        "uninstall": lambda args: uninstall(args.target),
    }
    helps = {
        "fetch": "download the pinned SGLang wheel (sha256 checked); print its path",
        "apply": "build the tree: pinned SGLang + sglang_overlay/ + patches/",
        "check": "patches/series and patches/ agree and every patch applies to the pin",
        "refresh": "regenerate patches/ and sglang_overlay/ from the tree's commits",
        "wheel": "build the patched wheel sglang-<pin>+hiq.N into dist/",
        "pr": "export the series as upstream PRs into dist/pr/",
        "install": "patch an installed SGLang in place (checked by content; again "
        "after pip reinstalls it)",
        "uninstall": "undo install: the stock files back, every overlay file removed",
    }
    p = {
        name: sub.add_parser(name, help=helps[name], description=helps[name])
        for name in commands
    }
    p["fetch"].add_argument("--python-tag", help="e.g. 312; default: the running Python")
    p["apply"].add_argument("--source", choices=("wheel", "git"))
    for name in ("apply", "refresh", "wheel", "pr"):
        p[name].add_argument("--tree", type=Path, default=DEFAULT_TREE)
    p["apply"].add_argument("--force", action="store_true", default=os.environ.get("FORCE") == "1")
    p["refresh"].add_argument("--message", "-m", default=os.environ.get("MSG") or None)
    p["wheel"].add_argument("--python-tag")
    for name in ("install", "uninstall"):
        p[name].add_argument(
            "--target", type=Path, required=True,
            help="the folder holding the sglang package (its site-packages)",
        )  # fmt: skip
    args = parser.parse_args(argv)
    commands[args.command](args)


if __name__ == "__main__":
    main()
