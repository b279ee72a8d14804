"""The image's start-up command, without Docker (issue 11).

The Dockerfile keeps the base image's ENTRYPOINT, which runs whatever command
it is given (NVIDIA's entrypoint ends in `exec "$@"`), and its default CMD is
scripts/hiqcache_serve.sh installed as hiqcache-serve. These tests run that
script under bash with a fake python3 on PATH that records its argv, and run
the Dockerfile's CMD the way the entrypoint would.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from scripts.check_docker import instructions

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "hiqcache_serve.sh"

LAUNCH = ["-m", "sglang.launch_server"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-host-dtype", "int8"]
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
    environ = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "ARGV_FILE": str(argv_file),
        **env,
    }
    proc = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=30)
    python_argv = argv_file.read_text().splitlines() if argv_file.exists() else None
    return proc, python_argv


def serve(bin_dir: Path, *args: str, **env: str):
    return run(bin_dir, ["bash", str(SCRIPT), *args], **env)


def test_default_starts_the_server_with_hicache_on(bin_dir):
    proc, argv = serve(bin_dir, MODEL="Qwen/Qwen3-8B")
    assert proc.returncode == 0, proc.stderr
    assert argv == [*LAUNCH, "--model-path", "Qwen/Qwen3-8B", *DEFAULTS]


def test_arguments_pass_through_and_win(bin_dir):
    proc, argv = serve(
        bin_dir,
        "--model-path", "/models/m",
        "--port", "8000",
        "--hicache-host-dtype", "int8",
        "--served-model-name", "a name with spaces",
        MODEL="ignored",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert argv == [
        *LAUNCH,
        "--model-path", "/models/m",
        "--port", "8000",
        "--hicache-host-dtype", "int8",
        "--served-model-name", "a name with spaces",
        "--host", "0.0.0.0",
        "--enable-hierarchical-cache",
    ]  # fmt: skip
    assert "host KV dtype" not in proc.stderr  # nothing added, nothing said


def test_equals_forms_and_the_model_alias_count_as_given(bin_dir):
    proc, argv = serve(
        bin_dir,
        "--model=/m",
        "--host=127.0.0.1",
        "--port=1",
        "--enable-hierarchical-cache",
    )
    assert proc.returncode == 0, proc.stderr
    assert argv == [
        *LAUNCH,
        "--model=/m",
        "--host=127.0.0.1",
        "--port=1",
        "--enable-hierarchical-cache",
        "--hicache-host-dtype",
        "int8",
    ]


def test_host_dtype_defaults_to_int8_and_follows_host_dtype_env(bin_dir):
    proc, argv = serve(bin_dir, MODEL="m")
    assert argv[-2:] == ["--hicache-host-dtype", "int8"]
    assert "hiqcache-serve: host KV dtype int8 (HOST_DTYPE, default int8" in proc.stderr
    for dtype in ("k8v4", "auto"):
        proc, argv = serve(bin_dir, MODEL="m", HOST_DTYPE=dtype)
        assert proc.returncode == 0, proc.stderr
        assert argv == [*LAUNCH, "--model-path", "m", *DEFAULTS[:-1], dtype]
        assert f"host KV dtype {dtype} (HOST_DTYPE" in proc.stderr


def test_given_host_dtype_is_not_duplicated(bin_dir):
    for given in (["--hicache-host-dtype", "int4"], ["--hicache-host-dtype=int4"]):
        proc, argv = serve(bin_dir, *given, MODEL="m", HOST_DTYPE="k8v4")
        assert proc.returncode == 0, proc.stderr
        assert argv == [*LAUNCH, "--model-path", "m", *given, *DEFAULTS[:-2]]
        assert "host KV dtype" not in proc.stderr


def test_no_model_fails_naming_what_to_set(bin_dir):
    proc, argv = serve(bin_dir)
    assert proc.returncode == 2
    assert argv is None  # the server was never started
    assert "set MODEL to a model path or Hugging Face id" in proc.stderr
    assert "--model-path" in proc.stderr
    proc, argv = serve(bin_dir, "--hicache-host-dtype", "int8", MODEL="")
    assert proc.returncode == 2 and argv is None


def test_server_exit_status_is_the_containers(bin_dir):
    proc, argv = serve(bin_dir, MODEL="m", FAKE_PYTHON_RC="3")
    assert proc.returncode == 3
    assert argv[:2] == LAUNCH


def entrypoint_run(bin_dir: Path, command: list[str], **env: str):
    """What the base image's entrypoint does with a command: exec it."""
    return run(bin_dir, ["bash", "-c", 'exec "$@"', "entrypoint", *command], **env)


def dockerfile_cmd() -> list[str]:
    instrs = instructions(REPO / "Dockerfile")
    assert not [rest for keyword, rest in instrs if keyword == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for keyword, rest in instrs if keyword == "CMD"]
    return cmd


def test_dockerfile_cmd_starts_the_server(bin_dir):
    proc, argv = entrypoint_run(bin_dir, dockerfile_cmd(), MODEL="m")
    assert proc.returncode == 0, proc.stderr
    assert argv == [*LAUNCH, "--model-path", "m", *DEFAULTS]


def test_user_commands_replace_the_cmd(bin_dir):
    # docker run IMAGE python3 -m sglang.launch_server ...: as on lmsysorg/sglang
    command = ["python3", *LAUNCH, "--model-path", "m", "--tp", "2"]
    proc, argv = entrypoint_run(bin_dir, command, MODEL="")
    assert proc.returncode == 0, proc.stderr
    assert argv == command[1:]
    # docker run IMAGE bash -c ...: a shell, no server
    proc, argv = entrypoint_run(bin_dir, ["bash", "-c", "echo shell"], MODEL="m")
    assert (proc.returncode, proc.stdout, argv) == (0, "shell\n", None)


def test_script_is_executable_in_the_repository():
    assert os.access(SCRIPT, os.X_OK)
