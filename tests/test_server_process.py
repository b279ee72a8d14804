"""The processes tests start (live servers, the Mooncake master) die with the
pytest that started them, and each live server runs one OpenMP thread unless
the caller set OMP_NUM_THREADS (spin-waiting threads slowed a shared machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scripts.rigs.server import LiveServer, ServerStartError, run_cli
from scripts.rigs.standins import REPO_ROOT

PARENT = """
import json, sys, time
from pathlib import Path
from scripts.rigs.server_process import ServerProcess
child = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                      name="sleeper", base_url="http://127.0.0.1:9",
                      log_path=Path(sys.argv[1]))
child.start()
print(json.dumps({"child": child.proc.pid}), flush=True)
time.sleep(600)
"""
# A fake `python` that records the OMP_NUM_THREADS a server got.
FAKE_PYTHON = (
    '#!/bin/sh\necho "${OMP_NUM_THREADS-unset}" > "$HIQ_THREADS_OUT"\nexit 3\n'
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_started_server_dies_with_its_killed_parent(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "sleeper.log")],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = json.loads(parent.stdout.readline())["child"]
    try:
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)  # as pkill -9 of pytest would
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    monkeypatch.setenv("HIQ_THREADS_OUT", str(tmp_path / "threads"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return python


def server_threads(tmp_path, fake_python, env=None) -> str:
    server = LiveServer(
        [],
        name="threads",
        model=tmp_path,
        python=str(fake_python),
        env=env,
        log_dir=tmp_path / "log",
        startup_timeout=30,
        progress=None,
    )
    with pytest.raises(ServerStartError, match="exited with 3"):
        server.start()
    return (tmp_path / "threads").read_text().strip()


def test_live_server_and_cli_get_one_thread_by_default(tmp_path, fake_python):
    assert server_threads(tmp_path, fake_python) == "1"
    result = run_cli([], model=tmp_path, python=str(fake_python), timeout=30)
    assert result.returncode == 3
    assert (tmp_path / "threads").read_text().strip() == "1"


def test_the_callers_thread_count_wins(tmp_path, fake_python, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert server_threads(tmp_path, fake_python) == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert server_threads(tmp_path, fake_python, {"OMP_NUM_THREADS": "3"}) == "3"
