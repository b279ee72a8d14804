"""Plumbing of scripts/bench/server.py (the GPU serving benchmark), on CPU.

The servers are a fake SGLang server (stdlib http.server on 127.0.0.1) and
the benchmark a fake bench_serving; both are started through the script's
own command templates, so process handling, readiness, capacity reading,
output parsing, pairing and the confidence intervals are the real code.
The arguments the script passes are checked against the real parsers of
the patched tree: launch_server's ServerArgs and bench_serving's CLI.
"""

from __future__ import annotations

import json
import math
import shlex
import socket
import sys
import types

import pytest


from scripts.bench import server as bs

FAKE_SERVER = r"""
import argparse, http.server, json, sys, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--starts", required=True)
p.add_argument("--claim-dtype", default=None)
p.add_argument("--no-metrics", action="store_true")
p.add_argument("--hicache-size", type=float, default=0)
p.add_argument("--hicache-host-dtype", default=None)
p.add_argument("--max-total-tokens", type=int, default=0)
args, _ = p.parse_known_args()
dtype = args.claim_dtype or args.hicache_host_dtype
bpt = 74880 if dtype == "int8" else 147456
tokens = int(args.hicache_size * 1e9 // bpt) + 1
with open(args.starts, "a") as f:
    f.write(json.dumps({"port": args.port, "argv": sys.argv[1:]}) + "\n")
print(f"Allocating kv hierarchical KV host pool: {tokens} tokens, "
      f"{tokens * bpt / 1e9:.2f} GB host memory.", flush=True)
if dtype == "int8":
    print("HiCache kv host pool stores INT8 KV: 74880 B/token "
          "(torch.bfloat16: 147456 B/token), 1.97x tokens per host byte", flush=True)
time.sleep(0.3)  # not ready at once

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, body="", ctype="application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self._send(200)
        elif self.path == "/server_info":
            info = {"version": "0.5.23", "hicache_size": args.hicache_size,
                    "max_total_tokens": args.max_total_tokens,
                    "internal_states": [{"max_total_num_tokens": args.max_total_tokens}]}
            if dtype is not None:
                info["hicache_host_dtype"] = dtype
            self._send(200, json.dumps(info))
        elif self.path == "/metrics" and not args.no_metrics:
            self._send(200, "# TYPE sglang:hicache_host_total_tokens gauge\n"
                       f'sglang:hicache_host_total_tokens{{model_name="m"}} {tokens}.0\n',
                       "text/plain")
        else:
            self._send(404)

http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
"""

FAKE_BENCH = r"""
import argparse, json, sys, urllib.request
p = argparse.ArgumentParser()
p.add_argument("--base-url", required=True)
p.add_argument("--output-file", required=True)
p.add_argument("--seed", type=int, required=True)
p.add_argument("--gsp-num-groups", type=int, required=True)
p.add_argument("--gsp-prompts-per-group", type=int, required=True)
p.add_argument("--gsp-system-prompt-len", type=int, required=True)
p.add_argument("--gsp-question-len", type=int, required=True)
args, _ = p.parse_known_args()
info = json.load(urllib.request.urlopen(args.base_url + "/server_info"))
int8 = info.get("hicache_host_dtype") == "int8"
n = args.gsp_num_groups * args.gsp_prompts_per_group
prompt = n * (args.gsp_system_prompt_len + args.gsp_question_len)
hit = (70.0 if int8 else 47.0) + args.seed * 0.5
result = {
    "completed": n, "duration": 10.0,
    "mean_ttft_ms": (100.0 if int8 else 150.0) + args.seed,
    "median_ttft_ms": (90.0 if int8 else 140.0) + args.seed,
    "p99_ttft_ms": (300.0 if int8 else 400.0) + 2 * args.seed,
    "output_throughput": (1100.0 if int8 else 1000.0) + 10 * args.seed,
    "total_throughput": 5000.0 + args.seed,
    "request_throughput": 4.0,
    "cache_report": {"total_prompt_tokens": prompt,
                     "total_cached_tokens": int(prompt * hit / 100),
                     "cache_hit_rate_pct": hit,
                     "device_cached_tokens": 1000, "host_cached_tokens": 2000},
    "argv": sys.argv[1:],
}
with open(args.output_file, "a") as f:
    f.write(json.dumps({"earlier": "record"}) + "\n")  # JSONL: the last one counts
    f.write(json.dumps(result) + "\n")
"""


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture()
def fakes(tmp_path):
    server = tmp_path / "fake_server.py"
    bench = tmp_path / "fake_bench.py"
    server.write_text(FAKE_SERVER)
    bench.write_text(FAKE_BENCH)
    return types.SimpleNamespace(
        server=server, bench=bench, starts=tmp_path / "starts.jsonl", dir=tmp_path
    )


def _argv(fakes, port, *, repeats=3, stock_extra="", patched_extra="", extra=()):
    py = shlex.quote(sys.executable)
    server = f"{py} {shlex.quote(str(fakes.server))} --port {{port}} --starts {shlex.quote(str(fakes.starts))}"
    return [
        "--model", "fake/model",
        "--repeats", str(repeats),
        "--seed", "1",
        "--port", str(port),
        "--stock-cmd", f"{server} {stock_extra} {{server_args}}",
        "--patched-cmd", f"{server} {patched_extra} {{server_args}}",
        "--bench-cmd", f"{py} {shlex.quote(str(fakes.bench))} {{bench_args}}",
        "--ready-timeout", "30",
        "--out", str(fakes.dir / "out" / "bench.json"),
        *extra,
    ]  # fmt: skip


def _starts(fakes) -> list[dict]:
    return [json.loads(line) for line in fakes.starts.read_text().splitlines()]


def test_end_to_end_against_fake_servers(fakes):
    port = _free_port_pair()
    assert bs.main(_argv(fakes, port)) == 0
    data = json.loads((fakes.dir / "out" / "bench.json").read_text())
    runs = data["runs"]
    assert len(runs) == 6
    # Paired repeats: one seed per repeat, shared by both arms; the order alternates.
    assert [(r["repeat"], r["arm"], r["seed"]) for r in runs] == [
        (0, "stock", 1), (0, "int8", 1),
        (1, "int8", 2), (1, "stock", 2),
        (2, "stock", 3), (2, "int8", 3),
    ]  # fmt: skip
    # A fresh server per run, with the arm's flag only on the patched one.
    starts = _starts(fakes)
    assert len(starts) == 6
    for start, run in zip(starts, runs):
        has_flag = "--hicache-host-dtype" in start["argv"]
        assert has_flag == (run["arm"] == "int8")
        assert start["port"] == port + (run["arm"] == "int8")
        joined = " ".join(start["argv"])
        assert (
            "--enable-hierarchical-cache --hicache-size 8 --max-total-tokens 16384"
            in joined
        )
    assert not _port_open(port) and not _port_open(port + 1), "servers left running"
    # L2 capacity read from each server's metric; bytes/token from its log.
    for run in runs:
        m = run["metrics"]
        assert m["l2_tokens_source"] == "metrics"
        if run["arm"] == "int8":
            assert m["l2_tokens"] == 106_838 and m["host_bytes_per_token"] == 74880
        else:
            assert m["l2_tokens"] == 54_254 and "host_bytes_per_token" not in m
    # The benchmark ran the make-demo workload through bench_serving's flags.
    argv = None
    for path in (fakes.dir / "out" / "bench").glob("bench-*.jsonl"):
        argv = json.loads(path.read_text().splitlines()[-1])["argv"]
        break
    joined = " ".join(argv)
    for flag in (
        "--dataset-name generated-shared-prefix", "--gsp-num-groups 32",
        "--gsp-prompts-per-group 4", "--gsp-system-prompt-len 2048",
        "--gsp-question-len 128", "--gsp-output-len 256", "--max-concurrency 8",
        "--cache-report", "--flush-cache", "--backend sglang",
    ):  # fmt: skip
        assert flag in joined, flag
    # Statistics: per-arm means with t intervals, paired differences/ratios.
    s = data["summary"]
    hit = s["arms"]["int8"]["hit_rate_pct"]
    assert hit["mean"] == pytest.approx(71.0)  # 70 + 0.5 * mean(1, 2, 3)
    assert hit["ci95"][1] - hit["mean"] == pytest.approx(4.303 * 0.5 / math.sqrt(3))
    paired = s["paired"]["int8-vs-stock"]
    assert paired["hit_rate_pct"]["difference"]["mean"] == pytest.approx(23.0)
    assert paired["hit_rate_pct"]["difference"]["ci95"] == pytest.approx([23.0, 23.0])
    assert paired["l2_tokens"]["ratio"]["mean"] == pytest.approx(106_838 / 54_254)
    assert paired["mean_ttft_ms"]["difference"]["mean"] == pytest.approx(-50.0)
    assert "cache-hit rate (%)" in data["table"]
    assert data["servers"]["int8"]["hicache_host_dtype"] == "int8"


def test_l2_capacity_falls_back_to_the_server_log(fakes):
    port = _free_port_pair()
    argv = _argv(
        fakes, port, repeats=1, stock_extra="--no-metrics", patched_extra="--no-metrics"
    )
    assert bs.main(argv) == 0
    runs = json.loads((fakes.dir / "out" / "bench.json").read_text())["runs"]
    assert {r["metrics"]["l2_tokens_source"] for r in runs} == {"log"}
    assert {r["arm"]: r["metrics"]["l2_tokens"] for r in runs} == {
        "stock": 54_254, "int8": 106_838,
    }  # fmt: skip


def test_refuses_a_server_that_is_not_its_arm(fakes):
    """A stock server answering on the patched arm's port (e.g. the image
    without the series) must stop the benchmark, and no server may be left."""
    port = _free_port_pair()
    argv = _argv(fakes, port, repeats=1, patched_extra="--claim-dtype auto")
    with pytest.raises(RuntimeError, match="expected 'int8'"):
        bs.main(argv)
    assert not _port_open(port) and not _port_open(port + 1)


def test_reuse_servers_starts_each_arm_once(fakes):
    port = _free_port_pair()
    assert bs.main(_argv(fakes, port, repeats=2, extra=["--reuse-servers"])) == 0
    assert len(_starts(fakes)) == 2
    assert not _port_open(port) and not _port_open(port + 1)


def test_mean_ci_is_the_student_t_interval():
    iv = bs.mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert iv.mean == 3.0
    assert iv.sd == pytest.approx(math.sqrt(2.5))
    assert iv.half_width == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    single = bs.mean_ci([7.0])
    assert single.mean == 7.0 and math.isnan(single.half_width)
    assert bs.t975(200) == 1.960 and bs.t975(35) == bs.t975(40)


def test_dry_run_docker_commands(capsys):
    assert bs.main(["--model", "Qwen/Qwen3-8B", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    stock = next(line for line in out if line.startswith("server stock:"))
    patched = next(line for line in out if line.startswith("server int8:"))
    bench = next(line for line in out if line.startswith("benchmark:"))
    assert bs.STOCK_IMAGE in stock and "--hicache-host-dtype" not in stock
    assert bs.PATCHED_IMAGE in patched and "--hicache-host-dtype int8" in patched
    assert "-m sglang.launch_server" in stock and "-m sglang.launch_server" in patched
    assert f"-m {bs.BENCH_MODULE}" in bench


def test_local_mode_uses_each_interpreter():
    cfg = bs.parse_args([
        "--model", "m", "--mode", "local", "--gpus", "3",
        "--stock-python", "/s/python", "--patched-python", "/p/python",
    ])  # fmt: skip
    argv, env = bs.server_command(cfg, "stock", 30000, "3", "n")
    assert argv[:3] == ["/s/python", "-m", "sglang.launch_server"]
    assert env == {"CUDA_VISIBLE_DEVICES": "3"}
    argv, _ = bs.server_command(cfg, "int8", 30001, "3", "n")
    assert argv[0] == "/p/python" and argv[-2:] == ["--hicache-host-dtype", "int8"]


# --------------------------------------------------------------------------
# The arguments against SGLang's real parsers (patched tree)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arm", ["stock", "auto", "int8"])
def test_server_args_parse_with_sglang(arm):
    import argparse

    from sglang.srt.server_args import ServerArgs

    cfg = bs.parse_args(["--model", "Qwen/Qwen3-8B"])
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", cfg.model, *bs.server_args(cfg, arm)])
    assert ns.enable_hierarchical_cache and ns.enable_metrics
    assert ns.hicache_size == 8 and ns.max_total_tokens == 16384
    assert (
        ns.hicache_host_dtype == {"stock": "auto", "auto": "auto", "int8": "int8"}[arm]
    )


def test_bench_args_parse_with_sglang_bench_serving(monkeypatch, tmp_path):
    # `datasets` (Hugging Face) is imported at module level but only used by
    # other datasets; it is not in the CPU test environment.
    if "datasets" not in sys.modules:
        monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
        sys.modules["datasets"].load_dataset = None
    serving = pytest.importorskip("sglang.benchmark.serving")
    captured = {}
    monkeypatch.setattr(
        serving, "run_benchmark", lambda a: captured.setdefault("args", a)
    )
    cfg = bs.parse_args(["--model", "Qwen/Qwen3-8B"])
    # Repeats start at bench_serving's default seed, the demo's first seed.
    assert cfg.seed == 42
    args = bs.bench_args(cfg, 30000, 5, tmp_path / "out.jsonl")
    monkeypatch.setattr(sys, "argv", ["bench_serving", *args])
    serving.cli_main()
    a = captured["args"]
    assert a.dataset_name == "generated-shared-prefix"
    assert (a.gsp_num_groups, a.gsp_prompts_per_group) == (32, 4)
    assert (a.gsp_system_prompt_len, a.gsp_question_len, a.gsp_output_len) == (
        2048,
        128,
        256,
    )
    assert a.max_concurrency == 8 and a.seed == 5
    assert a.cache_report and a.flush_cache and a.backend == "sglang"
    assert a.base_url == "http://127.0.0.1:30000"
