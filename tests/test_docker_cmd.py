"""The image's start-up command without Docker: hiqcache-serve (the Dockerfile's
CMD) with a fake python3 that records its argv, as the base image's entrypoint
runs it; `make image` and scripts/image_cpu_check.sh with fake docker, apt-get."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from scripts.check_docker import instructions

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "hiqcache_serve.sh"

LAUNCH = ["-m", "sglang.launch_server"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-host-dtype", "int8c"]
DEFAULTS = ["--host", "0.0.0.0", "--port", "30000", *HICACHE]

FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$ARGV_FILE"
exit "${FAKE_PYTHON_RC:-0}"
"""


@pytest.fixture
def bin_dir(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    fake = path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    # Installed as the Dockerfile installs it.
    shutil.copy2(SCRIPT, path / "hiqcache-serve")
    return path


def run(bin_dir: Path, argv: list[str], **env: str):
    argv_file = bin_dir.parent / "argv"
    argv_file.unlink(missing_ok=True)
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_FILE": str(argv_file), **env}
    proc = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=30)
    python_argv = argv_file.read_text().splitlines() if argv_file.exists() else None
    return proc, python_argv


def serve(bin_dir: Path, *args: str, **env: str):
    return run(bin_dir, ["bash", str(SCRIPT), *args], **env)


GIVEN = [
    *("--model-path", "/models/m", "--port", "8000", "--hicache-host-dtype", "int8"),
    *("--served-model-name", "a name with spaces"),
]
EQUALS = ["--model=/m", "--host=127.0.0.1", "--port=1", "--enable-hierarchical-cache"]
SAYS_DTYPE = "hiqcache-serve: host KV dtype int8c (HOST_DTYPE, default int8c"
NO_MODEL = ["set MODEL to a model path or Hugging Face id", "--model-path"]
M = ["--model-path", "m"]

# (arguments, environment, exit status, the server's argv or None if it never
# started, what stderr says; None: no host dtype was added, so nothing said)
SERVE_CASES = {
    "defaults": ((), {"MODEL": "Qwen/Qwen3-8B"}, 0,
                 [*LAUNCH, "--model-path", "Qwen/Qwen3-8B", *DEFAULTS], [SAYS_DTYPE]),
    "given-args-win": (GIVEN, {"MODEL": "ignored"}, 0,
                       [*LAUNCH, *GIVEN, "--host", "0.0.0.0", HICACHE[0]], None),
    "equals-forms-and-model-alias": (EQUALS, {}, 0, [*LAUNCH, *EQUALS, *HICACHE[1:]],
                                     [SAYS_DTYPE]),
    **{
        f"HOST_DTYPE={d}": ((), {"MODEL": "m", "HOST_DTYPE": d}, 0,
                            [*LAUNCH, *M, *DEFAULTS[:-1], d],
                            [f"host KV dtype {d} (HOST_DTYPE"])
        for d in ("int8", "k8v4", "auto")
    },
    **{
        f"given-dtype-{i}": (given, {"MODEL": "m", "HOST_DTYPE": "k8v4"}, 0,
                             [*LAUNCH, *M, *given, *DEFAULTS[:-2]], None)
        for i, given in enumerate(
            (["--hicache-host-dtype", "int4"], ["--hicache-host-dtype=int4"])
        )
    },
    "no-model": ((), {}, 2, None, NO_MODEL),
    "empty-model": (["--hicache-host-dtype", "int8"], {"MODEL": ""}, 2, None, []),
    "server-exit-status": ((), {"MODEL": "m", "FAKE_PYTHON_RC": "3"}, 3,
                           [*LAUNCH, *M, *DEFAULTS], [SAYS_DTYPE]),
}  # fmt: skip


@pytest.mark.parametrize("case", SERVE_CASES)
def test_serve_command(bin_dir, case):
    args, env, rc, argv, says = SERVE_CASES[case]
    proc, python_argv = serve(bin_dir, *args, **env)
    assert proc.returncode == rc, proc.stderr
    assert python_argv == argv
    if says is None:
        assert "host KV dtype" not in proc.stderr  # nothing added, nothing said
    for words in says or ():
        assert words in proc.stderr, words


def entrypoint_run(bin_dir: Path, command: list[str], **env: str):
    """What the base image's entrypoint does with a command: exec it."""
    return run(bin_dir, ["bash", "-c", 'exec "$@"', "entrypoint", *command], **env)


def dockerfile_cmd() -> list[str]:
    instrs = instructions(REPO / "Dockerfile")
    assert not [rest for keyword, rest in instrs if keyword == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for keyword, rest in instrs if keyword == "CMD"]
    return cmd


def test_dockerfile_cmd_starts_the_server_and_user_commands_replace_it(bin_dir):
    # The CMD runs from PATH: the repository's script must be executable.
    proc, argv = entrypoint_run(bin_dir, dockerfile_cmd(), MODEL="m")
    assert proc.returncode == 0, proc.stderr
    assert argv == [*LAUNCH, "--model-path", "m", *DEFAULTS]
    # docker run IMAGE python3 -m sglang.launch_server ...: as on lmsysorg/sglang
    command = ["python3", *LAUNCH, "--model-path", "m", "--tp", "2"]
    proc, argv = entrypoint_run(bin_dir, command, MODEL="")
    assert proc.returncode == 0, proc.stderr
    assert argv == command[1:]
    # docker run IMAGE bash -c ...: a shell, no server
    proc, argv = entrypoint_run(bin_dir, ["bash", "-c", "echo shell"], MODEL="m")
    assert (proc.returncode, proc.stdout, argv) == (0, "shell\n", None)


# An absolute interpreter: the tests' PATH holds only the listed tools.
FAKE_TOOL = """#!/bin/bash
echo "${0##*/} $*" >> "$CALLS"
echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2
exit 1
"""


def with_fakes(root: Path, argv: list, fakes=(), real=(), cwd=None):
    """argv with a PATH of `fakes` (record their calls, fail) and `real` tools."""
    bin_dir, calls = root / "bin", root / "calls"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name in fakes:
            (bin_dir / name).write_text(FAKE_TOOL)
            (bin_dir / name).chmod(0o755)
        for name in real:
            (bin_dir / name).symlink_to(shutil.which(name))
    calls.unlink(missing_ok=True)
    env = {"PATH": str(bin_dir), "CALLS": str(calls)}
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    return proc, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("docker", ["no daemon", "not installed"])
def test_make_image_without_a_daemon_names_the_ways_without_one(tmp_path, docker):
    make = [shutil.which("make"), "--no-print-directory", "image"]
    fakes = ("docker",) if docker == "no daemon" else ()
    proc, calls = with_fakes(tmp_path, make, fakes, cwd=REPO)
    assert proc.returncode != 0
    message = proc.stderr.splitlines()[0]
    assert message.startswith(
        "make image: no Docker daemon answers (docker info failed)"
    )
    assert "'make wheel'" in message and "podman build --format docker" in message
    assert "Cannot connect" not in proc.stderr  # Docker's own error stays out
    assert calls == (["docker info"] if docker == "no daemon" else [])


IMAGE_CHECK = REPO / "scripts" / "image_cpu_check.sh"
# What image_cpu_check.sh runs before its prerequisites are met; podman, runc
# and debootstrap are absent, so a host set-up would call the fake apt-get.
IMAGE_CHECK_TOOLS = ("bash", "dirname", "sed", "mkdir", "awk", "tail", "readlink")


def image_check(root: Path, *args: str):
    script = ["bash", str(root / "scripts" / IMAGE_CHECK.name), *args]
    return with_fakes(root, script, ("apt-get",), IMAGE_CHECK_TOOLS)


@pytest.fixture
def image_check_root(tmp_path):
    root = tmp_path / "repo"  # no test venv: the script and sglang.lock
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(IMAGE_CHECK, root / "scripts")
    shutil.copy2(REPO / "sglang.lock", root)
    return root


def test_image_cpu_check_help_and_venv_check_install_nothing(image_check_root):
    proc, calls = image_check(image_check_root, "--help")
    assert (proc.returncode, calls) == (0, []), proc.stderr
    for words in ("--base-version 0.5.22", "make venv", "root", "apt-get installs podman",
                  "/etc/containers/containers.conf"):  # fmt: skip
        assert words in proc.stdout.replace("\n", " "), words
    assert not proc.stdout.startswith("#!")
    proc, calls = image_check(image_check_root)
    assert proc.returncode == 2
    venv = image_check_root / ".venv" / "bin" / "python"
    assert proc.stderr.strip() == (
        f"image_cpu_check: no test venv at {venv}: run 'make venv' first"
    )
    assert calls == []  # apt-get never ran
