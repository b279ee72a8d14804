"""A live patched SGLang server on this CPU machine, for tests and ``make demo``.

One helper starts ``python -m sglang.launch_server`` (or the image's default
command, ``scripts/hiqcache_serve.sh``, with ``MODEL`` set) on 127.0.0.1 and a
free port, with ``SGLANG_USE_CPU_ENGINE=1``, the CPU flags below and
``scripts/rigs/cpu_site`` first on PYTHONPATH (the stand-ins every server
process needs, see its sitecustomize.py). It waits for /health with progress
lines, captures the log to a file and stops the whole process group by pid,
also when start-up or a test fails.

Stable API:

- ``CPU_FLAGS``: the launch flags a CPU server needs here (tuple of str).
- ``hicache_flags(host_dtype=None, ratio=2.0, layout="layer_first",
  io_backend="direct", storage_backend=None, extra=()) -> list[str]``
  (host_dtype None: the stock BF16 pool; layout/io_backend None: flag left
  out, SGLang's default and resolution apply).
- ``LiveServer(args, *, name="server", via="launch_server"|"hiqcache_serve",
  model=None, python=None, sglang_path=..., env=None, log_dir=None
  (default build/live-logs/<name>/, this server's files replaced at start),
  startup_timeout=900.0, progress=print)``; ``model`` defaults to the
  converted SmolLM2 (scripts/rigs/model.py). Use as a context manager or
  call ``start()`` / ``stop()``. Attributes: ``base_url``, ``port``, ``pid``,
  ``log_path``, ``kernel_log_path``, ``startup_seconds``.
  - ``generate(text=None, *, input_ids=None, max_new_tokens=8,
    return_logprob=False, top_logprobs_num=0, timeout=600, **sampling) -> dict``:
    one greedy (temperature 0 unless given) /generate; the reply dict, with
    ``meta_info`` (``cached_tokens``, ``cached_tokens_details``, ``output_ids``...).
  - ``metrics() -> scripts.rigs.prom.Metrics`` (needs ``--enable-metrics``,
    which CPU_FLAGS sets).
  - ``flush_cache()``, ``get(path)``, ``post(path, payload)``.
  - ``log_text()``; ``kernel_calls() -> list[dict]`` (the sgl_kernel stand-in's
    JSON lines: ``{"event": "load"|"call", "pid", "op"?}``).
- ``run_cli(args, *, via=..., model=None, timeout=600, env=None) ->
  subprocess.CompletedProcess``: run the launcher to completion (for flags
  that must fail at start-up); stdout and stderr merged into ``.stdout``.
- ``spec_flags(draft_model, algorithm="STANDALONE", num_steps=2, topk=1,
  draft_tokens=3) -> list[str]`` and ``SPEC_ENV`` (dict): speculative decoding
  on CPU, passed as ``args`` and ``env=``; see spec_flags' docstring.
- ``tp_env(tp) -> dict``: the extra environment of a CPU server started with
  ``--tp tp`` > 1 (SGLANG_CPU_OMP_THREADS_BIND, one core list per rank; the
  groups are gloo on CPU).
- ``cpu_env(sglang_path=PATCHED_PYTHON, kernel_log=None, extra=None) -> dict``:
  the environment for any other SGLang process on CPU (``python -m
  sglang.bench_serving`` imports sglang.srt.configs, so it needs the stand-ins);
  ``OMP_NUM_THREADS=1`` unless the caller's environment or ``extra`` sets it.
- ``free_port() -> int``.
- ``ServerStartError``: raised when the server exits or times out before
  healthy; its message ends with the log tail.

The process handling (start in its own session, wait for /health, stop the
group by pid), ``free_port`` and the HTTP helper are in server_process.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

import pytest

from scripts.rigs.server_process import (  # noqa: F401 (ServerStartError, free_port: API)
    ServerProcess,
    ServerStartError,
    die_with_parent,
    free_port,
    http,
    kill_group,
)
from scripts.rigs import prom

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
# The same tree scripts/rigs/standins.py checks sglang against.
PATCHED_PYTHON = (
    Path(os.environ.get("HIQ_SGLANG_TREE") or REPO_ROOT / "build" / "sglang").resolve()
    / "python"
)
SERVE_SCRIPT = REPO_ROOT / "scripts" / "hiqcache_serve.sh"
KERNEL_LOG_ENV = "HIQ_SGL_KERNEL_LOG"
# pytestmark of every live-server module: each server start costs 40-120 s here.
LIVE_ONLY = pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_SERVER") == "0", reason="HIQ_LIVE_SERVER=0"
)


def to_stderr(line: str) -> None:
    """A LiveServer progress sink that pytest -s shows as the server starts."""
    print(line, file=sys.stderr, flush=True)


# HIQ_LIVE_LOG_ROOT separates concurrent runs (same server names, same files).
LOG_ROOT = Path(
    os.environ.get("HIQ_LIVE_LOG_ROOT") or REPO_ROOT / "build" / "live-logs"
).resolve()


def fresh_dir(name: str) -> Path:
    """An empty log folder under build/ (pytest's tmp: concurrent runs prune
    old basetemps)."""
    root = LOG_ROOT / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


# Why each flag: --device cpu plus SGLANG_USE_CPU_ENGINE=1 (else is_cpu() is
# False and rotary imports vllm); torch_native attention (the x86 default is
# intel_amx, which this CPU's AMX flag selects); pytorch sampling (no
# flashinfer); no CUDA graphs; no warm-up request (it races metrics); a small
# L1 so a handful of long prompts overflow it (--max-total-tokens caps the KV
# pool; the memory fraction only has to cover the weights while other
# processes hold RAM: 0.05 failed at 13 GB free).
CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--enable-metrics",
    "--mem-fraction-static",
    "0.25",
    "--max-total-tokens",
    "4096",
)


def hicache_flags(
    host_dtype: str | None = None,
    *,
    ratio: float = 2.0,
    layout: str | None = "layer_first",
    io_backend: str | None = "direct",
    storage_backend: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """HiCache flags for one arm; host_dtype None keeps the stock BF16 pool,
    layout / io_backend None keep SGLang's defaults (page_first, kernel)."""
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", str(ratio)]
    # None leaves the flag out: SGLang's own default and resolution apply.
    if layout is not None:
        flags += ["--hicache-mem-layout", layout]
    if io_backend is not None:
        flags += ["--hicache-io-backend", io_backend]
    if host_dtype is not None:
        flags += ["--hicache-host-dtype", host_dtype]
    if storage_backend is not None:
        flags += ["--hicache-storage-backend", storage_backend]
    return flags + list(extra)


# Speculative decoding on CPU: the pure-torch sgl_kernel ops and the AMX
# platform override (cpu_site), and one OpenMP thread per process (on the two
# shared cores, spin-waiting OpenMP threads made each small op ~100x slower).
SPEC_ENV = {"HIQ_SGL_KERNEL_TORCH_OPS": "1", "OMP_NUM_THREADS": "1"}


def tp_env(tp: int) -> dict[str, str]:
    """The environment a CPU server with ``--tp tp`` needs: one core list per
    rank in SGLANG_CPU_OMP_THREADS_BIND. Unset, SGLang's CPU start-up asserts
    at most one rank per NUMA node (utils/numa_utils.py init_threads_binding);
    this machine has one. Ranks share cores round-robin."""
    cores = os.cpu_count() or 1
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(tp))}


def spec_flags(
    draft_model: Path | str,
    *,
    algorithm: str = "STANDALONE",
    num_steps: int = 2,
    topk: int = 1,
    draft_tokens: int = 3,
) -> list[str]:
    """Speculative-decoding flags for a CPU server started with SPEC_ENV.
    intel_amx attention, because SGLang's torch_native backend has no draft
    backend (draft_utils.py refuses it); placed after CPU_FLAGS, it wins."""
    return [
        "--attention-backend",
        "intel_amx",
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        str(draft_model),
        "--speculative-num-steps",
        str(num_steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]


def cpu_env(
    sglang_path: Path | None = PATCHED_PYTHON,
    kernel_log: Path | None = None,
    extra: dict | None = None,
) -> dict[str, str]:
    """The environment of a CPU SGLang process: cpu_site first on PYTHONPATH,
    then sglang_path (None: the interpreter's own sglang)."""
    env = dict(os.environ)
    paths = [str(CPU_SITE)]
    if sglang_path is not None:
        paths.append(str(sglang_path))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    # One intra-op thread per process unless the caller set OMP_NUM_THREADS:
    # beside other work, two spin-waiting threads per server on the 2 cores
    # turned a one-minute server run into eleven.
    env.setdefault("OMP_NUM_THREADS", "1")
    # 1 GiB, not upstream's 10 GiB reserve: see cpu_site/sitecustomize.py.
    env.setdefault("HIQ_HOST_MEMORY_RESERVE_BYTES", str(1 << 30))
    if kernel_log is not None:
        env[KERNEL_LOG_ENV] = str(kernel_log)
    # hiqcache_serve.sh runs `python3`: make it this interpreter's venv.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if extra:
        env.update(extra)
    return env


def _command(
    args: Sequence[str], via: str, model: Path | str, python: str, host_port: list
) -> tuple[list[str], dict]:
    if via == "launch_server":
        launcher = [python, "-m", "sglang.launch_server", "--model-path", str(model)]
        return [*launcher, *host_port, *args], {}
    if via == "hiqcache_serve":
        # The image's default command: the model comes from MODEL.
        return ["bash", str(SERVE_SCRIPT), *host_port, *args], {"MODEL": str(model)}
    raise ValueError(f"via={via!r}: pass 'launch_server' or 'hiqcache_serve'")


def _default_model() -> Path:
    from scripts.rigs.model import smollm2_dir

    return smollm2_dir()


def run_cli(
    args: Sequence[str],
    *,
    via: str = "launch_server",
    model: Path | str | None = None,
    python: str | None = None,
    sglang_path: Path | None = PATCHED_PYTHON,
    timeout: float = 600.0,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the launcher to completion (a start-up that must fail)."""
    model = model if model is not None else _default_model()
    host_port = ["--host", "127.0.0.1", "--port", str(free_port())]
    cmd, cmd_env = _command(args, via, model, python or sys.executable, host_port)
    with tempfile.TemporaryDirectory(prefix="hiq-cli-") as tmp:
        full_env = cpu_env(sglang_path, Path(tmp) / "sgl_kernel.jsonl", env)
        full_env.update(cmd_env)
        proc = subprocess.Popen(
            cmd,
            env=full_env,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()
            raise
        finally:
            if proc.poll() is None:
                kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


class LiveServer:
    """One live server; see the module docstring."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        name: str = "server",
        via: str = "launch_server",
        model: Path | str | None = None,
        python: str | None = None,
        sglang_path: Path | None = PATCHED_PYTHON,
        env: dict | None = None,
        log_dir: Path | str | None = None,
        startup_timeout: float = 900.0,
        progress: Callable[[str], None] | None = print,
    ):
        self.args = list(args)
        self.name = name
        self.via = via
        self.model = model
        self.python = python or sys.executable
        self.sglang_path = sglang_path
        self.extra_env = env
        # build/, not pytest's tmp: concurrent pytest runs prune old basetemps.
        self.log_dir = Path(log_dir or LOG_ROOT / name)
        self.startup_timeout = startup_timeout
        self.progress = progress or (lambda line: None)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.log_dir / f"{name}.log"
        self.kernel_log_path = self.log_dir / f"{name}.sgl_kernel.jsonl"
        self.process: ServerProcess | None = None
        self.startup_seconds: float | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LiveServer:
        model = self.model if self.model is not None else _default_model()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in (self.log_path, self.kernel_log_path):
            old.unlink(missing_ok=True)
        host_port = ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd, cmd_env = _command(self.args, self.via, model, self.python, host_port)
        env = cpu_env(self.sglang_path, self.kernel_log_path, self.extra_env)
        env.update(cmd_env)
        start = time.monotonic()
        self.process = ServerProcess(cmd, name=self.name, base_url=self.base_url,
                                     log_path=self.log_path, env=env, cwd=self.log_dir)  # fmt: skip
        self.process.start()
        self.progress(
            f"[{self.name}] starting pid {self.pid} on {self.base_url} "
            f"(40-120 s here), log {self.log_path}"
        )
        try:
            self.process.wait_healthy(self.startup_timeout, self.progress, start)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - start
        self.progress(f"[{self.name}] healthy after {self.startup_seconds:.0f} s")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    # -- requests ---------------------------------------------------------

    def post(self, path: str, payload: dict, timeout: float = 600.0) -> dict:
        return http(self.base_url + path, payload, timeout=timeout)

    def get(self, path: str, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return r.read().decode()

    def generate(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        max_new_tokens: int = 8,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        timeout: float = 600.0,
        **sampling,
    ) -> dict:
        if (text is None) == (input_ids is None):
            raise ValueError("generate: pass exactly one of text= or input_ids=")
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling}
        payload: dict = {"sampling_params": params}
        if text is not None:
            payload["text"] = text
        else:
            payload["input_ids"] = list(input_ids)
        if return_logprob:
            payload["return_logprob"] = True
            payload["top_logprobs_num"] = top_logprobs_num
        return self.post("/generate", payload, timeout=timeout)

    def metrics(self) -> prom.Metrics:
        return prom.parse(self.get("/metrics"))

    def flush_cache(self, wait_s: float = 30.0) -> None:
        """POST /flush_cache until the scheduler is idle. It answers 400 while
        its last batch is still set, which outlives the last response by a
        scheduler step."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                urllib.request.urlopen(
                    urllib.request.Request(
                        self.base_url + "/flush_cache", method="POST"
                    ),
                    timeout=60,
                ).read()
                return
            except urllib.error.HTTPError as e:
                if e.code != 400 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    # -- logs -------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines) if self.process else ""

    def kernel_calls(self) -> list[dict]:
        if not self.kernel_log_path.is_file():
            return []
        with open(self.kernel_log_path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def save_replies(self, seq: dict) -> None:
        """run_sequence's replies beside the server log, for a failure's post-mortem."""
        replies = {
            k: seq[k] for k in ("first", "repeat", "others", "reuse") if k in seq
        }
        (self.log_dir / "replies.json").write_text(json.dumps(replies, indent=1))


# --- what a live server's replies must show -----------------------------------

# A top-1/top-2 logprob gap below this is a near-tie that a cached pass may
# break the other way (its last prompt token is computed alone, not inside
# the prefill); greedy tokens are compared up to the first such tie.
TIE_NATS = 0.1


def model_geometry(model_dir: Path) -> tuple[int, int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"], config["num_key_value_heads"], head_dim


def expected_bytes_per_token(host_dtype: str | None, model_dir: Path) -> int:
    layers, kv_heads, head_dim = model_geometry(model_dir)
    if host_dtype is None:
        return layers * 2 * kv_heads * head_dim * 2  # K and V rows in BF16
    # INT8: one int8 per value plus one FP16 scale per head row, K and V.
    return layers * 2 * kv_heads * (head_dim + 2)


def output_logprobs(reply: dict) -> list[float]:
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


def top2_gap(reply: dict, i: int) -> float:
    tops = reply["meta_info"]["output_top_logprobs"][i]
    return tops[0][0] - tops[1][0]


def agreeing_prefix(ref: dict, other: dict) -> int:
    """How many leading generated tokens two replies share; where they first
    differ, one of them must have been at a near-tie (CPU arithmetic of a
    cached and an uncached pass may round such a tie either way)."""
    pairs = list(zip(ref["output_ids"], other["output_ids"]))
    for i, (a, b) in enumerate(pairs):
        if a != b:
            gaps = (top2_gap(ref, i), top2_gap(other, i))
            assert min(gaps) < TIE_NATS, f"token {i}: {a} != {b}, top-2 gaps {gaps}"
            return i
    return len(pairs)


# Greedy tokens and top logprobs per request of run_sequence.
NEW_TOKENS = 8
TOP_LOGPROBS = 3


def run_sequence(
    server: LiveServer,
    prompts: list[list[int]],
    *,
    new_tokens: int = NEW_TOKENS,
    repeat: bool = True,
) -> dict:
    """A prompt, the same again (device hit; skipped if not repeat), the others
    (L1 overflows), the first once more (host hit), with /metrics between."""

    def gen(ids):
        return server.generate(
            input_ids=ids,
            max_new_tokens=new_tokens,
            return_logprob=True,
            top_logprobs_num=TOP_LOGPROBS,
        )

    a = prompts[0]
    out = {"m0": server.metrics()}
    out["first"] = gen(a)
    if repeat:
        out["repeat"] = gen(a)
        out["m1"] = server.metrics()
    out["others"] = [gen(p) for p in prompts[1:]]
    out["m2"] = server.metrics()
    out["reuse"] = gen(a)
    out["m3"] = server.metrics()
    return out


def details(reply: dict) -> dict:
    return reply["meta_info"].get("cached_tokens_details") or {}


def host_hit_after_overflow(seq: dict, prompt_tokens: int) -> int:
    """Checks that run_sequence's other prompts overflowed L1 and the reuse
    came at least half from the host tier, loaded back; its host tokens."""
    m1, m2, m3 = seq["m1"], seq["m2"], seq["m3"]
    evicted = prom.diff(m2, m1, "sglang:evicted_tokens_total")
    assert evicted > 0, "the other prompts did not overflow L1"
    reuse = details(seq["reuse"])
    host = reuse.get("host", 0)
    assert host >= prompt_tokens // 2, f"reuse not served from host: {reuse}"
    assert prom.diff(m3, m2, "sglang:load_back_tokens_total") >= host
    return host
