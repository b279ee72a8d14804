"""One SGLang server process: start, wait for /health, HTTP, stop by pid
(stdlib only; scripts/rigs/server.py's LiveServer builds on it)."""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence


class ServerError(RuntimeError):
    pass


class ServerStartError(ServerError):
    """The server exited or timed out before it was healthy; the message ends
    with its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, payload=None, timeout: float = 600.0):
    """GET (payload None) or POST JSON; the parsed JSON reply, or its text."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode("utf-8", "replace")
            ctype = resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url}: HTTP {exc.code}: {exc.read()[:2000]!r}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"{url}: {getattr(exc, 'reason', exc)}") from exc
    if "json" in ctype or body[:1] in "{[":
        return json.loads(body) if body.strip() else {}
    return body


def die_with_parent() -> None:
    """Popen's preexec_fn: SIGKILL the child when the process that started it
    dies, so a killed pytest leaves no server behind (SGLang ties its own
    scheduler and detokenizer to the server the same way)."""
    parent = os.getppid()
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL) != 0:
        os._exit(127)  # PR_SET_PDEATHSIG failed: never run untied
    if os.getppid() != parent:
        os._exit(127)  # the parent died before the tie


def kill_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM then SIGKILL the server's process group (it was started as a
    session leader, so the group is its own, never the caller's)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
    # The leader exited; children it left in the group still go.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ServerProcess:
    """A server command run in its own session, its output in `log_path`."""

    def __init__(self, argv: Sequence[str], *, name: str, base_url: str,
                 log_path: Path, env: dict | None = None, cwd=None):  # fmt: skip
        self.argv, self.name, self.base_url = list(argv), name, base_url.rstrip("/")
        self.log_path, self.env, self.cwd = Path(log_path), env, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as log:
            log.write("$ " + shlex.join(self.argv) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent,
            )  # fmt: skip

    def wait_healthy(self, timeout: float, progress: Callable[[str], None] | None = None,
                     start: float | None = None) -> None:  # fmt: skip
        """Poll /health every second; progress gets a log line every 15 s."""
        start = time.monotonic() if start is None else start
        next_note = start + 15
        while True:
            if self.proc.poll() is not None:
                raise self._start_error(
                    f"exited with {self.proc.returncode} before it was healthy"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            now = time.monotonic()
            if now - start > timeout:
                raise self._start_error(f"not healthy after {timeout:.0f} s")
            if progress is not None and now >= next_note:
                progress(f"[{self.name}] {now - start:.0f} s: {self.log_tail(1).strip()[:120]}")  # fmt: skip
                next_note = now + 15
            time.sleep(1.0)

    def _start_error(self, what: str) -> ServerStartError:
        tail = self.log_tail()
        return ServerStartError(f"{self.name} {what}; log {self.log_path}:\n{tail}")

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is not None:
            kill_group(self.proc, grace)
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        except FileNotFoundError:
            return ""
