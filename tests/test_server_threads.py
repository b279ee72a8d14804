"""Every live server the tests and `make demo` start runs one OpenMP thread
unless the caller set OMP_NUM_THREADS (spin-waiting threads made a shared
machine ten times slower); a fake `python` records what the server got.
"""

from __future__ import annotations

import pytest

from scripts.rigs.server import LiveServer, ServerStartError, run_cli

FAKE_PYTHON = (
    '#!/bin/sh\necho "${OMP_NUM_THREADS-unset}" > "$HIQ_THREADS_OUT"\nexit 3\n'
)


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    monkeypatch.setenv("HIQ_THREADS_OUT", str(tmp_path / "threads"))
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


def test_live_server_gets_one_thread_by_default(tmp_path, fake_python, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert server_threads(tmp_path, fake_python) == "1"


def test_the_callers_thread_count_wins(tmp_path, fake_python, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert server_threads(tmp_path, fake_python) == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    env = {"OMP_NUM_THREADS": "3"}
    assert server_threads(tmp_path, fake_python, env) == "3"


def test_cli_runs_get_one_thread_too(tmp_path, fake_python, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = run_cli([], model=tmp_path, python=str(fake_python), timeout=30)
    assert result.returncode == 3
    assert (tmp_path / "threads").read_text().strip() == "1"
