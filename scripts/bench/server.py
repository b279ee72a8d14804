#!/usr/bin/env python3
"""Serving benchmark on a GPU: the stock SGLang server against the HiQCache one.

Starts the stock server and the patched server (`--hicache-host-dtype int8`)
with the same model, the same host budget (`--hicache-size`) and the same L1
cap (`--max-total-tokens`), runs SGLang's own serving benchmark
(`python -m sglang.benchmark.serving`, formerly `sglang.bench_serving`) with
`--dataset-name generated-shared-prefix` on the `make demo` workload, and
repeats that in pairs. Each repeat uses its own dataset seed, shared by both
arms, and alternates which arm goes first. Every run gets a fresh server
(cold cache) unless `--reuse-servers`.

Reported per arm: L2 capacity in tokens (read from each server's
`sglang:hicache_host_total_tokens` metric, or its startup log), cache-hit
rate (bench_serving's `--cache-report`: cached prompt tokens / prompt
tokens), TTFT mean / p50 / p99 and throughput, as means with 95% confidence
intervals (Student t over the repeats), plus the paired difference and ratio
of every arm against the first.

    # Docker (images: lmsysorg/sglang:v0.5.23-cu130 and `make image`)
    python3 -m scripts.bench.server --model Qwen/Qwen3-8B --repeats 5

    # Local installs: a stock sglang 0.5.23 and one with the HiQCache wheel
    python3 -m scripts.bench.server --mode local --model Qwen/Qwen3-8B \\
        --stock-python /opt/stock/bin/python --patched-python /opt/hiq/bin/python

Stdlib only, so it runs outside the SGLang environments it starts.
Results: results/bench_server.json, server and benchmark logs beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from scripts.common.server import (
    ServerError,
    ServerProcess,
    http,
    metric,
    parse_prometheus,
)

STOCK_IMAGE = "lmsysorg/sglang:v0.5.23-cu130"
PATCHED_IMAGE = "hiqcache/sglang:0.5.23-hiq"
BENCH_MODULE = "sglang.benchmark.serving"

# Arms: (server flavour, --hicache-host-dtype or None for the stock server).
ARMS = {
    "stock": ("stock", None, "bf16"),
    "auto": ("patched", "auto", "bf16 (patched)"),
    "int8": ("patched", "int8", "int8"),
}

# (key, header, unit, higher is better)
METRICS = [
    ("l2_tokens", "L2 capacity", "tokens", True),
    ("hit_rate_pct", "cache-hit rate", "%", True),
    ("mean_ttft_ms", "TTFT mean", "ms", False),
    ("median_ttft_ms", "TTFT p50", "ms", False),
    ("p99_ttft_ms", "TTFT p99", "ms", False),
    ("output_throughput", "output throughput", "tok/s", True),
    ("total_throughput", "total throughput", "tok/s", True),
    ("request_throughput", "request throughput", "req/s", True),
]

# Two-sided 95% Student t quantiles by degrees of freedom.
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365,
    8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145,
    15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056,
    27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000,
    120: 1.980,
}  # fmt: skip


def t975(df: int) -> float:
    if df <= 0:
        return math.nan
    if df in _T975:
        return _T975[df]
    for bound in (40, 60, 120):
        if df < bound:
            return _T975[bound]  # conservative: the next tabulated df below
    return 1.960


@dataclass
class Interval:
    n: int
    mean: float
    sd: float
    half_width: float  # 95% CI is mean +- half_width (nan for n < 2)

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def to_json(self) -> dict:
        return {
            "n": self.n,
            "mean": self.mean,
            "sd": self.sd,
            "ci95": [self.low, self.high],
        }


def mean_ci(values: list[float]) -> Interval:
    values = [v for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan)
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(n, mean, math.nan, math.nan)
    sd = statistics.stdev(values)
    return Interval(n, mean, sd, t975(n - 1) * sd / math.sqrt(n))


# --------------------------------------------------------------------------
# Configuration and commands
# --------------------------------------------------------------------------


@dataclass
class Config:
    model: str
    mode: str = "docker"
    arms: list[str] = field(default_factory=lambda: ["stock", "int8"])
    repeats: int = 5
    seed: int = 42
    hicache_size: float = 8
    max_total_tokens: int = 16384
    groups: int = 32
    prompts_per_group: int = 4
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    concurrency: int = 8
    warmup_requests: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    gpus: list[str] = field(default_factory=lambda: ["0"])
    stock_image: str = STOCK_IMAGE
    patched_image: str = PATCHED_IMAGE
    stock_python: str = "python3"
    patched_python: str = "python3"
    stock_cmd: Optional[str] = None
    patched_cmd: Optional[str] = None
    bench_cmd: Optional[str] = None
    server_args: list[str] = field(default_factory=list)
    bench_args: list[str] = field(default_factory=list)
    hf_cache: str = str(Path.home() / ".cache" / "huggingface")
    ready_timeout: float = 1800
    bench_timeout: float = 3600
    reuse_servers: bool = False
    out: Path = Path("results/bench_server.json")
    dry_run: bool = False


def server_args(cfg: Config, arm: str) -> list[str]:
    """launch_server arguments shared by every arm, plus the arm's flag."""
    _, host_dtype, _ = ARMS[arm]
    args = [
        "--enable-hierarchical-cache",
        "--hicache-size", f"{cfg.hicache_size:g}",
        "--max-total-tokens", str(cfg.max_total_tokens),
        "--enable-metrics",
    ]  # fmt: skip
    if host_dtype is not None:
        args += ["--hicache-host-dtype", host_dtype]
    return args + list(cfg.server_args)


def server_command(
    cfg: Config, arm: str, port: int, gpu: str, name: str
) -> tuple[list[str], dict]:
    """(argv, extra environment) that starts `arm`'s server on `port`."""
    flavour, _, _ = ARMS[arm]
    extra = server_args(cfg, arm)
    template = cfg.stock_cmd if flavour == "stock" else cfg.patched_cmd
    if template:
        text = template.format(
            port=port, model=cfg.model, host=cfg.host, gpu=gpu,
            server_args=shlex.join(extra), name=name,
        )  # fmt: skip
        return shlex.split(text), {}
    launch = [
        "-m", "sglang.launch_server",
        "--model-path", cfg.model,
        "--host", cfg.host,
        "--port", str(port),
        *extra,
    ]  # fmt: skip
    if cfg.mode == "docker":
        image = cfg.stock_image if flavour == "stock" else cfg.patched_image
        return [
            "docker", "run", "--rm", "--name", name,
            "--gpus", f"device={gpu}", "--shm-size", "32g", "--ipc", "host",
            "--network", "host",
            "-v", f"{cfg.hf_cache}:/root/.cache/huggingface",
            *(["-e", "HF_TOKEN"] if os.environ.get("HF_TOKEN") else []),
            "--entrypoint", "python3", image, *launch,
        ], {}  # fmt: skip
    python = cfg.stock_python if flavour == "stock" else cfg.patched_python
    return [python, *launch], {"CUDA_VISIBLE_DEVICES": gpu}


def bench_args(cfg: Config, port: int, seed: int, output_file: Path) -> list[str]:
    """SGLang's serving benchmark on the `make demo` workload."""
    return [
        "--backend", "sglang",
        "--base-url", f"http://{cfg.host}:{port}",
        "--model", cfg.model,
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(cfg.groups),
        "--gsp-prompts-per-group", str(cfg.prompts_per_group),
        "--gsp-system-prompt-len", str(cfg.system_prompt_len),
        "--gsp-question-len", str(cfg.question_len),
        "--gsp-output-len", str(cfg.output_len),
        "--max-concurrency", str(cfg.concurrency),
        "--seed", str(seed),
        "--warmup-requests", str(cfg.warmup_requests),
        # Warm-up requests share the dataset's prefixes: start each run cold.
        "--flush-cache",
        "--cache-report",
        "--disable-tqdm",
        "--output-file", str(output_file),
        *cfg.bench_args,
    ]  # fmt: skip


def bench_command(cfg: Config, args: list[str], out_dir: Path) -> list[str]:
    if cfg.bench_cmd:
        return shlex.split(
            cfg.bench_cmd.format(bench_args=shlex.join(args), out_dir=out_dir)
        )
    if cfg.mode == "docker":
        return [
            "docker", "run", "--rm", "--network", "host",
            "-v", f"{out_dir}:{out_dir}",
            "-v", f"{cfg.hf_cache}:/root/.cache/huggingface",
            *(["-e", "HF_TOKEN"] if os.environ.get("HF_TOKEN") else []),
            "--entrypoint", "python3", cfg.stock_image, "-m", BENCH_MODULE, *args,
        ]  # fmt: skip
    return [cfg.stock_python, "-m", BENCH_MODULE, *args]


# --------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------


def _get(url: str, timeout: float = 10):
    """A GET's reply, or None when the server does not answer it."""
    try:
        return http(url, timeout=timeout)
    except ServerError:
        return None


class Server(ServerProcess):
    """One server process this script started, and only that one."""

    def __init__(
        self, cfg: Config, arm: str, port: int, gpu: str, log_dir: Path, tag: str
    ):
        self.cfg, self.arm, self.port = cfg, arm, port
        name = f"hiq-bench-{arm}-{os.getpid()}-{tag}"
        argv, env = server_command(cfg, arm, port, gpu, name)
        super().__init__(argv, name=name, base_url=f"http://{cfg.host}:{port}",
                         log_path=log_dir / f"server-{arm}-{tag}.log",
                         env={**os.environ, **env})  # fmt: skip

    def stop(self) -> None:
        template = (
            self.cfg.stock_cmd if ARMS[self.arm][0] == "stock" else self.cfg.patched_cmd
        )
        if (
            self.proc is not None
            and self.proc.poll() is None
            and self.cfg.mode == "docker"
            and not template
        ):
            # The container outlives a killed `docker run` client.
            subprocess.run(["docker", "stop", "-t", "30", self.name],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        super().stop(grace=60)


_LOG_CAPACITY = re.compile(r"Allocating kv hierarchical KV host pool: (\d+) tokens")
_LOG_BYTES_PER_TOKEN = re.compile(r"stores INT8 KV: (\d+) B/token")


def read_l2_capacity(server: Server) -> tuple[Optional[int], str]:
    """The server's host (L2) pool size in tokens: its HiCache metric, or
    the pool's startup log line."""
    text = _get(server.base_url + "/metrics")
    if isinstance(text, str):
        value = metric(
            parse_prometheus(text), "sglang:hicache_host_total_tokens", "max"
        )
        if value:
            return int(value), "metrics"
    match = _LOG_CAPACITY.findall(server.log_text())
    if match:
        return int(match[-1]), "log"
    return None, "unavailable"


def read_server_info(server: Server) -> dict:
    info = _get(server.base_url + "/server_info")
    if not isinstance(info, dict):
        info = _get(server.base_url + "/get_server_info")
    if not isinstance(info, dict):
        return {}
    keep = (
        "version", "model_path", "hicache_size", "hicache_ratio",
        "hicache_host_dtype", "hicache_mem_layout", "hicache_io_backend",
        "hicache_write_policy", "max_total_tokens", "page_size", "kv_cache_dtype",
    )  # fmt: skip
    out = {k: info[k] for k in keep if k in info}
    states = info.get("internal_states") or []
    if states and isinstance(states[0], dict):
        for k in ("max_total_num_tokens",):
            if k in states[0]:
                out[k] = states[0][k]
    return out


def check_arm(arm: str, info: dict) -> None:
    """Refuse to benchmark a server that is not the arm it claims to be."""
    _, host_dtype, _ = ARMS[arm]
    got = info.get("hicache_host_dtype")
    if host_dtype is None and got not in (None, "auto"):
        raise RuntimeError(f"stock server reports --hicache-host-dtype {got!r}")
    if host_dtype is not None and got != host_dtype:
        raise RuntimeError(
            f"{arm} server reports --hicache-host-dtype {got!r}, expected "
            f"{host_dtype!r}: is the patched image/installation in use?"
        )


# --------------------------------------------------------------------------
# Benchmark runs
# --------------------------------------------------------------------------


def parse_bench_output(path: Path) -> dict:
    """Metrics from bench_serving's JSONL output (the last record)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"{path}: no benchmark result")
    result = json.loads(lines[-1])
    out = {key: result.get(key) for key, *_ in METRICS if key in result}
    report = result.get("cache_report") or {}
    if report:
        out["hit_rate_pct"] = report.get("cache_hit_rate_pct")
        out["prompt_tokens"] = report.get("total_prompt_tokens")
        out["cached_tokens"] = report.get("total_cached_tokens")
        out["device_cached_tokens"] = report.get("device_cached_tokens")
        out["host_cached_tokens"] = report.get("host_cached_tokens")
    for key in ("completed", "duration", "total_input_tokens", "total_output_tokens"):
        if key in result:
            out[key] = result[key]
    return out


def run_bench(cfg: Config, server: Server, seed: int, run_dir: Path, tag: str) -> dict:
    output_file = run_dir / f"bench-{server.arm}-{tag}.jsonl"
    output_file.unlink(missing_ok=True)
    argv = bench_command(cfg, bench_args(cfg, server.port, seed, output_file), run_dir)
    log_path = run_dir / f"bench-{server.arm}-{tag}.log"
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, timeout=cfg.bench_timeout
        )
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(
            f"benchmark for {server.arm} failed ({proc.returncode}):\n{tail}"
        )
    return parse_bench_output(output_file)


def run_all(cfg: Config) -> dict:
    run_dir = cfg.out.parent / cfg.out.stem
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    ports = {arm: cfg.port + i for i, arm in enumerate(cfg.arms)}
    gpus = {arm: cfg.gpus[i % len(cfg.gpus)] for i, arm in enumerate(cfg.arms)}
    runs: list[dict] = []
    servers_info: dict[str, dict] = {}
    live: dict[str, Server] = {}

    def start(arm: str, tag: str) -> Server:
        server = Server(cfg, arm, ports[arm], gpus[arm], run_dir, tag)
        print(f"  start {arm}: {shlex.join(server.argv)}", flush=True)
        server.start()
        live[arm] = server
        server.wait_healthy(cfg.ready_timeout)
        info = read_server_info(server)
        check_arm(arm, info)
        servers_info.setdefault(arm, info)
        return server

    def stop(arm: str) -> None:
        server = live.pop(arm, None)
        if server is not None:
            server.stop()

    try:
        if cfg.reuse_servers:
            for arm in cfg.arms:
                start(arm, "shared")
        for rep in range(cfg.repeats):
            seed = cfg.seed + rep
            order = cfg.arms if rep % 2 == 0 else list(reversed(cfg.arms))
            for arm in order:
                tag = f"r{rep}"
                print(f"repeat {rep + 1}/{cfg.repeats}, seed {seed}: {arm}", flush=True)
                server = live[arm] if cfg.reuse_servers else start(arm, tag)
                metrics = run_bench(cfg, server, seed, run_dir, tag)
                tokens, source = read_l2_capacity(server)
                metrics["l2_tokens"] = tokens
                metrics["l2_tokens_source"] = source
                bpt = _LOG_BYTES_PER_TOKEN.findall(server.log_text())
                if bpt:
                    metrics["host_bytes_per_token"] = int(bpt[-1])
                runs.append(
                    {"repeat": rep, "seed": seed, "arm": arm, "metrics": metrics}
                )
                if not cfg.reuse_servers:
                    stop(arm)
    finally:
        for arm in list(live):
            stop(arm)
    return {"runs": runs, "servers": servers_info}


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------


def summarize(runs: list[dict], arms: list[str]) -> dict:
    by_arm: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    for run in runs:
        by_arm[run["arm"]][run["repeat"]] = run["metrics"]
    summary = {"arms": {}, "paired": {}}
    for arm in arms:
        summary["arms"][arm] = {
            key: mean_ci([m.get(key) for m in by_arm[arm].values()]).to_json()
            for key, *_ in METRICS
        }
    base = arms[0]
    for arm in arms[1:]:
        reps = sorted(set(by_arm[arm]) & set(by_arm[base]))
        paired = {}
        for key, *_ in METRICS:
            pairs = [(by_arm[arm][r].get(key), by_arm[base][r].get(key)) for r in reps]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            diffs = [a - b for a, b in pairs]
            ratios = [a / b for a, b in pairs if b]
            paired[key] = {
                "difference": mean_ci(diffs).to_json(),
                "ratio": mean_ci(ratios).to_json(),
            }
        summary["paired"][f"{arm}-vs-{base}"] = paired
    return summary


def _fmt(iv: dict, digits: int) -> str:
    mean, (lo, hi) = iv["mean"], iv["ci95"]
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    if isinstance(lo, float) and math.isnan(lo):
        return f"{mean:,.{digits}f}"
    return f"{mean:,.{digits}f} ± {(hi - lo) / 2:,.{digits}f}"


def format_table(summary: dict, arms: list[str]) -> str:
    base = arms[0]
    headers = ["metric"] + [ARMS[a][2] for a in arms]
    headers += [f"{ARMS[a][2]} / {ARMS[base][2]} (paired)" for a in arms[1:]]
    rows = []
    for key, title, unit, _ in METRICS:
        digits = 0 if key == "l2_tokens" else 1 if unit in ("%", "ms") else 2
        row = [f"{title} ({unit})"]
        row += [_fmt(summary["arms"][a][key], digits) for a in arms]
        for a in arms[1:]:
            p = summary["paired"][f"{a}-vs-{base}"][key]
            ratio = p["ratio"]
            if key == "hit_rate_pct":
                d = p["difference"]
                row.append(
                    "n/a"
                    if d["n"] == 0
                    else f"{d['mean']:+.1f} pts [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]"
                )
            elif ratio["n"] == 0:
                row.append("n/a")
            elif math.isnan(ratio["ci95"][0]):
                row.append(f"{ratio['mean']:.3f}x")
            else:
                row.append(
                    f"{ratio['mean']:.3f}x [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]"
                )
        rows.append(row)
    widths = [
        max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(
        prog="python3 -m scripts.bench.server",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--model",
        required=True,
        help="model path or Hugging Face id (e.g. Qwen/Qwen3-8B)",
    )
    p.add_argument("--mode", choices=["docker", "local"], default="docker")
    p.add_argument(
        "--arms",
        default="stock,int8",
        help="comma-separated, first is the baseline: stock (stock server), "
        "auto (patched, --hicache-host-dtype auto), int8 (patched, int8)",
    )
    p.add_argument("--repeats", type=int, default=5, help="paired repeats")
    p.add_argument(
        "--seed",
        type=int,
        default=42,
        help="dataset seed of the first repeat (bench_serving's default; "
        "make demo replays the same seeds)",
    )
    p.add_argument("--hicache-size", type=float, default=8, help="host budget, GB")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="L1 cap, tokens")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--prompts-per-group", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=30000, help="first arm's port; later arms count up"
    )
    p.add_argument("--gpus", default="0", help="GPU ids; arms take them in turn")
    p.add_argument("--stock-image", default=STOCK_IMAGE)
    p.add_argument("--patched-image", default=PATCHED_IMAGE)
    p.add_argument(
        "--stock-python",
        default="python3",
        help="local mode: stock sglang's interpreter",
    )
    p.add_argument(
        "--patched-python",
        default="python3",
        help="local mode: patched sglang's interpreter",
    )
    p.add_argument(
        "--stock-cmd",
        help="server command template instead of docker/local: "
        "{port} {model} {host} {gpu} {server_args} {name}",
    )
    p.add_argument("--patched-cmd", help="as --stock-cmd, for the patched server")
    p.add_argument(
        "--bench-cmd", help="benchmark command template: {bench_args} {out_dir}"
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        dest="server_args",
        help="extra launch_server arguments (shell-split, repeatable)",
    )
    p.add_argument(
        "--bench-arg",
        action="append",
        default=[],
        dest="bench_args",
        help="extra benchmark arguments (shell-split, repeatable)",
    )
    p.add_argument("--hf-cache", default=str(Path.home() / ".cache" / "huggingface"))
    p.add_argument("--ready-timeout", type=float, default=1800)
    p.add_argument("--bench-timeout", type=float, default=3600)
    p.add_argument(
        "--reuse-servers",
        action="store_true",
        help="start each arm once and keep both up (needs room for both, "
        "e.g. --gpus 0,1); each run still flushes the cache first",
    )
    p.add_argument("--out", type=Path, default=Path("results/bench_server.json"))
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    a = p.parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown or len(arms) < 2:
        p.error(f"--arms needs two or more of {', '.join(ARMS)}; got {a.arms!r}")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    split = lambda items: [tok for item in items for tok in shlex.split(item)]  # noqa: E731
    # Every flag is the Config field of its name; these four are parsed here.
    values = {f.name: getattr(a, f.name) for f in fields(Config)}
    values.update(
        arms=arms,
        gpus=[g.strip() for g in a.gpus.split(",") if g.strip()],
        server_args=split(a.server_args),
        bench_args=split(a.bench_args),
    )
    return Config(**values)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    run_dir = (cfg.out.parent / cfg.out.stem).resolve()
    if cfg.dry_run:
        for i, arm in enumerate(cfg.arms):
            argv_, env = server_command(
                cfg, arm, cfg.port + i, cfg.gpus[i % len(cfg.gpus)], f"hiq-bench-{arm}"
            )
            prefix = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"server {arm}: {prefix + ' ' if prefix else ''}{shlex.join(argv_)}")
        args = bench_args(cfg, cfg.port, cfg.seed, run_dir / "bench.jsonl")
        print(f"benchmark: {shlex.join(bench_command(cfg, args, run_dir))}")
        return 0
    t0 = time.monotonic()
    print(
        f"{len(cfg.arms)} arms x {cfg.repeats} repeats on {cfg.model} "
        f"(--hicache-size {cfg.hicache_size:g}, --max-total-tokens {cfg.max_total_tokens})"
    )
    result = run_all(cfg)
    summary = summarize(result["runs"], cfg.arms)
    table = format_table(summary, cfg.arms)
    print()
    print(table)
    print(
        "\nmean ± 95% CI half-width over repeats (Student t); paired columns: "
        "mean of per-repeat ratios [95% CI], hit rate as a difference in points"
    )
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()}
    cfg.out.write_text(
        json.dumps(
            {
                "config": config,
                "command": shlex.join([sys.executable, *sys.argv]),
                "servers": result["servers"],
                "runs": result["runs"],
                "summary": summary,
                "table": table,
                "seconds": time.monotonic() - t0,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {cfg.out} (logs in {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
