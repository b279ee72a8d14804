"""`make venv` never deletes a venv it did not make, and installs torch from
TORCH_INDEX when given: real `make` with a fake PYTHON (records its calls, makes
`-m venv` folders, prints a wheel path) and a temporary VENV."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/bin/sh
echo "$0 $*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
elif [ "$1" = "scripts/overlay.py" ]; then
    echo /nowhere/sglang.whl
fi
"""


@pytest.fixture
def fake(tmp_path):
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return python


def make_venv(tmp_path, fake, venv: Path, *extra: str):
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        ["make", "--no-print-directory", "venv", f"VENV={venv}", f"PYTHON={fake}",
         *extra],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "FAKE_LOG": str(log)},
    )  # fmt: skip
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def existing_venv(path: Path, fake: Path, marker: str | None = None) -> Path:
    """A venv with a user's file in it and a stamp older than every pin."""
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_bytes(fake.read_bytes())
    (path / "bin" / "python").chmod(0o755)
    (path / "users-file").write_text("keep me")
    (path / ".stamp").touch()
    os.utime(path / ".stamp", (0, 0))
    if marker is not None:
        (path / ".hiqcache-made-by").write_text(marker + "\n")
    return path


def test_an_existing_venv_not_made_here_is_installed_into_and_kept(tmp_path, fake):
    venv = existing_venv(tmp_path / "users-venv", fake)
    proc, calls = make_venv(tmp_path, fake, venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (venv / "users-file").read_text() == "keep me"
    assert f"VENV={venv} was not made by this checkout" in proc.stdout
    assert not any(" -m venv " in c for c in calls)
    pip = [c for c in calls if c.startswith(f"{venv}/bin/python -m pip install")]
    assert len(pip) == 2 and "torch==2.13.0" in pip[0]
    assert (venv / ".stamp").stat().st_mtime > 0
    assert not (venv / ".hiqcache-made-by").exists()
    # One made by another checkout is kept too.
    venv = existing_venv(tmp_path / "other", fake, marker=str(tmp_path / "clone"))
    proc, _ = make_venv(tmp_path, fake, venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (venv / "users-file").exists()


def test_its_own_venv_is_rebuilt_when_a_pin_changes(tmp_path, fake):
    venv = tmp_path / "own"
    proc, calls = make_venv(tmp_path, fake, venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls[0] == f"{fake} -m venv {venv}"
    assert (venv / ".hiqcache-made-by").read_text() == f"{REPO}\n"
    (venv / "users-file").write_text("scratch")
    os.utime(venv / ".stamp", (0, 0))
    proc, calls = make_venv(tmp_path, fake, venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls[0] == f"{fake} -m venv {venv}"
    assert not (venv / "users-file").exists()


def test_a_folder_that_is_no_venv_is_refused_naming_the_variable(tmp_path, fake):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "users-file").write_text("keep me")
    proc, calls = make_venv(tmp_path, fake, folder)
    assert proc.returncode != 0
    assert f"VENV={folder} exists but has no bin/python" in proc.stderr
    assert (folder / "users-file").exists() and calls == []


def test_torch_index_goes_to_the_torch_install_alone(tmp_path, fake):
    """Without it, make says what PyPI's torch is."""
    proc, calls = make_venv(tmp_path, fake, tmp_path / "pypi")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from PyPI on Linux that is the CUDA build" in proc.stdout
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in proc.stdout
    assert not any("--index-url" in c for c in calls)
    url = "https://download.pytorch.org/whl/cpu"
    proc, calls = make_venv(tmp_path, fake, tmp_path / "v", f"TORCH_INDEX={url}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torch, rest = [c for c in calls if " -m pip install " in c]
    assert f"--index-url {url} torch==2.13.0" in torch
    assert "--index-url" not in rest and "-r requirements/cpu-test.txt" in rest
    assert "CUDA build" not in proc.stdout
