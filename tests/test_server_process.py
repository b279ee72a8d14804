"""The processes tests start (live servers, the Mooncake master) die with the
process that started them: a pytest killed mid-run leaves none behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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
