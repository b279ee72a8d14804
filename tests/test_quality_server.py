"""Plumbing of the server-mode quality check (scripts/quality/server.py)
against fake SGLang servers on 127.0.0.1: it reads restore activity from
/metrics before comparing, refuses to compare when nothing came back from L2,
and compares logprobs and greedy outputs window by window. Real numbers need
two GPU servers; these tests only prove the plumbing."""

from __future__ import annotations

import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


from scripts.quality import server as qs

VOCAB = 500


class FakeSGLang:
    """Just enough of SGLang's HTTP API: /server_info, /tokenize, /generate
    (input/top/output logprobs, cached_tokens_details), /metrics."""

    def __init__(
        self,
        *,
        noise=0.0,
        restores=True,
        details=True,
        metrics=True,
        l1=300,
        model_path="fake/model",
        kv_cache_dtype="auto",
    ):
        self.noise, self.restores, self.details = noise, restores, details
        self.model_path, self.kv_cache_dtype = model_path, kv_cache_dtype
        self.expose_metrics, self.l1 = metrics, l1
        self.load_back = 0
        self.host_hits = 0
        self.backup = 0
        self.requests = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body, ctype="application/json"):
                data = (
                    body.encode()
                    if isinstance(body, str)
                    else json.dumps(body).encode()
                )
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/server_info":
                    self._send(fake.server_info())
                elif self.path == "/metrics":
                    self._send(fake.metrics_text(), "text/plain; version=0.0.4")
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    toks = [sum(map(ord, w)) % VOCAB for w in body["prompt"].split()]
                    self._send(
                        {"tokens": toks, "count": len(toks), "max_model_len": 8192}
                    )
                elif self.path == "/generate":
                    self._send(fake.generate(body))
                else:
                    self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def server_info(self):
        return {
            "enable_hierarchical_cache": True,
            "hicache_host_dtype": "int8" if self.noise else "auto",
            "model_path": self.model_path,
            "kv_cache_dtype": self.kv_cache_dtype,
            "internal_states": [{"max_total_num_tokens": self.l1}],
        }

    def metrics_text(self):
        if not self.expose_metrics:
            return '# HELP sglang:num_running_reqs x\nsglang:num_running_reqs{tp_rank="0"} 0.0\n'
        lines = [
            "# HELP sglang:load_back_tokens_total tokens loaded back",
            "# TYPE sglang:load_back_tokens_total counter",
        ]
        for rank in (0, 1):  # every TP rank reports the same logical count
            lines.append(
                f'sglang:load_back_tokens_total{{model_name="fake",tp_rank="{rank}",pool="kv"}} '
                f"{float(self.load_back)}"
            )
        lines += [
            'sglang:load_back_tokens_created{model_name="fake",tp_rank="0",pool="kv"} 1.7e9',
            f'sglang:cached_tokens_total{{model_name="fake",cache_source="host"}} {float(self.host_hits)}',
            'sglang:cached_tokens_total{model_name="fake",cache_source="device"} 7.0',
            f'sglang:hicache_backup_tokens_total{{model_name="fake",tp_rank="0",pool="kv"}} {float(self.backup)}',
        ]
        return "\n".join(lines) + "\n"

    def lp(self, ids, j):
        base = -0.5 * (1 + (ids[j - 1] * 31 + ids[j]) % 7)
        return base + self.noise * math.sin(j)

    def generate(self, body):
        ids = body["input_ids"]
        max_new = body["sampling_params"]["max_new_tokens"]
        self.requests.append(body)
        meta = {"cached_tokens": 0}
        with self.lock:
            self.backup += len(ids)
        if body.get("return_logprob"):
            start = body["logprob_start_len"]
            restored = start if self.restores else 0
            with self.lock:
                self.load_back += restored
                self.host_hits += restored
            meta["cached_tokens"] = restored
            if self.details:
                meta["cached_tokens_details"] = {"device": 0, "host": restored}
            meta["input_token_logprobs"] = [
                [None if j == start else self.lp(ids, j), ids[j], None]
                for j in range(start, len(ids))
            ]
            meta["input_top_logprobs"] = [
                (
                    None
                    if j == start
                    else [
                        [
                            -0.1,
                            (ids[j - 1] * 31 + (self.noise > 0 and j % 5 == 0)) % VOCAB,
                            None,
                        ]
                    ]
                )
                for j in range(start, len(ids))
            ]
        out, t = [], ids[-1]
        for k in range(max_new):
            t = (t * 17 + 3 + (1 if self.noise and k >= max_new - 2 else 0)) % VOCAB
            out.append(t)
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.2, t, None] for t in out]
        return {"text": "", "output_ids": out, "meta_info": meta}


@pytest.fixture
def text_file(tmp_path):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)]
    path = tmp_path / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return path


def argv(stock, patched, text_file, out_dir, *extra):
    return [
        "--stock",
        stock.url,
        "--patched",
        patched.url,
        "--text-file",
        str(text_file),
        "--windows",
        "3",
        "--prefix-len",
        "32",
        "--score-len",
        "16",
        "--greedy-tokens",
        "8",
        "--filler-len",
        "64",
        "--concurrency",
        "2",
        "--out-dir",
        str(out_dir),
        *extra,
    ]


def test_compares_patched_with_stock_after_checking_restores(text_file, tmp_path):
    with FakeSGLang() as stock, FakeSGLang(noise=0.01) as patched:
        rc = qs.main(
            argv(stock, patched, text_file, tmp_path, "--lm-eval-tasks", "hellaswag"),
            log=lambda s: None,
        )
        assert rc == 0
        # Warm-up (prefix + 1), filler (>= 1.5 x L1 = 450 tokens), measurement.
        for srv in (stock, patched):
            warm = [r for r in srv.requests if not r.get("return_logprob")]
            assert sum(len(r["input_ids"]) for r in warm) >= 3 * 33 + 450
            measured = [r for r in srv.requests if r.get("return_logprob")]
            assert len(measured) == 3
            assert all(
                r["logprob_start_len"] == 32 and len(r["input_ids"]) == 49
                for r in measured
            )
    report = json.loads((tmp_path / "quality_server.json").read_text())
    for name in ("stock", "patched"):
        assert report["servers"][name]["restore_delta"]["load_back_tokens"] == 3 * 32
        assert report["servers"][name]["per_window_host_tokens"] == [32, 32, 32]
    c = report["comparison"]
    assert c["windows_compared"] == 3 and c["scored_tokens"] == 3 * 16
    assert 0 < abs(c["ppl_rel_delta"]) < 0.01
    assert 0 < c["max_abs_dlogprob"] <= 0.01
    assert 0.7 < c["top1_agree"] < 1.0
    assert c["greedy_agree"] == pytest.approx(6 / 8)
    assert "local-completions" in report["lm_eval_commands"][0]
    assert f"base_url={patched.url}/v1/completions" in report["lm_eval_commands"][1]
    assert "| PPL stock |" in (tmp_path / "quality_server.md").read_text()


def test_identical_servers_compare_exactly(text_file, tmp_path):
    with FakeSGLang() as a, FakeSGLang() as b:
        assert qs.main(argv(a, b, text_file, tmp_path), log=lambda s: None) == 0
    c = json.loads((tmp_path / "quality_server.json").read_text())["comparison"]
    assert c["ppl_rel_delta"] == 0 and c["max_abs_dlogprob"] == 0
    assert c["top1_agree"] == 1.0 and c["greedy_agree"] == 1.0


def test_refuses_to_compare_without_l2_restores(text_file, tmp_path, capsys):
    with FakeSGLang() as stock, FakeSGLang(noise=0.01, restores=False) as patched:
        assert (
            qs.main(argv(stock, patched, text_file, tmp_path), log=lambda s: None) == 2
        )
    assert "did not grow" in capsys.readouterr().err
    assert not (tmp_path / "quality_server.json").exists()


def test_refuses_without_restore_metrics(text_file, tmp_path, capsys):
    with FakeSGLang(metrics=False) as stock, FakeSGLang() as patched:
        assert (
            qs.main(argv(stock, patched, text_file, tmp_path), log=lambda s: None) == 2
        )
    assert "--enable-metrics" in capsys.readouterr().err


def test_windows_not_restored_on_both_are_skipped():
    def win(host):
        return {
            "input_token_logprobs": [[None, 1, None], [-1.0, 2, None]],
            "input_top_ids": [None, 2],
            "output_ids": [3, 4],
            "host_tokens": host,
        }

    stock = {"windows": [win(32), win(0), win(None)]}
    patched = {"windows": [win(32), win(32), win(32)]}
    c = qs.compare(stock, patched, 32)
    assert c["windows_compared"] == 2 and c["windows_skipped_not_restored"] == [1]
    with pytest.raises(qs.NoServerRestoreError):
        qs.compare({"windows": [win(0)]}, {"windows": [win(32)]}, 32)


def test_prometheus_parsing():
    text = "\n".join(
        [
            "# HELP sglang:load_back_tokens_total x",
            'sglang:load_back_tokens_total{pool="kv",tp_rank="0"} 10.0',
            'sglang:load_back_tokens_total{pool="kv",tp_rank="1"} 10.0',
            'sglang:load_back_tokens_total{pool="swa",tp_rank="0"} 99.0',
            'sglang:cached_tokens_total{cache_source="host",note="a \\"q\\" b"} 5 1700000000000',
            'sglang:cached_tokens_total{cache_source="host",note="other"} 2',
            "sglang:gen_throughput 3.5",
            "garbage line",
        ]
    )
    s = qs.parse_prometheus(text)
    assert qs.metric(s, "sglang:load_back_tokens_total", "max", pool="kv") == 10.0
    assert qs.metric(s, "sglang:load_back_tokens_total", pool="kv") == 20.0
    assert qs.metric(s, "sglang:cached_tokens_total", cache_source="host") == 7.0
    assert qs.metric(s, "sglang:gen_throughput") == 3.5
    assert qs.metric(s, "sglang:nope") is None
    assert any(lab.get("note") == 'a "q" b' for _, lab, _ in s)


def test_lm_eval_command_line():
    cmd = qs.lm_eval_command(
        qs.Server("patched", "http://h:30001/"),
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-8B",
        "hellaswag,arc_easy",
        "results",
        4,
        100,
    )
    assert cmd[:3] == ["lm_eval", "--model", "local-completions"]
    args = cmd[cmd.index("--model_args") + 1]
    assert "base_url=http://h:30001/v1/completions" in args
    assert "model=Qwen/Qwen3-8B" in args and "tokenizer=Qwen/Qwen3-8B" in args
    assert cmd[cmd.index("--limit") + 1] == "100"
    assert cmd[cmd.index("--output_path") + 1] == "results/lm_eval_patched"


# --- MLA: DeepSeek-V2-Lite preset ---------------------------------------------

V2_LITE = "/models/deepseek-ai/DeepSeek-V2-Lite/"


def test_deepseek_v2_lite_launch_commands_parse_as_server_args():
    """The printed commands are valid sglang.launch_server arguments (the
    patched tree's parser, which has --hicache-host-dtype), BF16 KV on both,
    INT8 L2 only on the patched server."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    lines = []
    argv_ = ["--model-preset", "deepseek-v2-lite", "--launch-commands",
             "--patched", "http://127.0.0.1:31001"]  # fmt: skip
    assert qs.main(argv_, log=lines.append) == 0
    cmds = {line.split("\n")[0][2:]: line.split("\n")[1].split() for line in lines}
    parsed = {}
    for name, cmd in cmds.items():
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        parsed[name] = parser.parse_args(cmd[3:])
    stock, patched = parsed["stock"], parsed["patched"]
    assert stock.model_path == patched.model_path == "deepseek-ai/DeepSeek-V2-Lite"
    assert stock.kv_cache_dtype == patched.kv_cache_dtype == "bf16"
    assert stock.enable_hierarchical_cache and patched.enable_hierarchical_cache
    assert stock.hicache_host_dtype == "auto" and patched.hicache_host_dtype == "int8"
    assert (stock.port, patched.port) == (30000, 31001)
    assert patched.hicache_mem_layout == "page_first"
    assert patched.hicache_io_backend == "kernel"
    with pytest.raises(SystemExit):
        qs.parse_args(["--launch-commands"])  # which model?


def test_deepseek_v2_lite_preset_checks_both_servers(text_file, tmp_path, capsys):
    with (
        FakeSGLang(model_path=V2_LITE, kv_cache_dtype="bf16") as stock,
        FakeSGLang(noise=0.01, model_path=V2_LITE) as patched,
    ):
        args = argv(stock, patched, text_file, tmp_path, "--model-preset",
                    "deepseek-v2-lite")  # fmt: skip
        assert qs.main(args, log=lambda s: None) == 0
    assert (tmp_path / "quality_server.json").exists()


INT8 = {"noise": 0.01}  # the fake reports --hicache-host-dtype int8 when noisy


@pytest.mark.parametrize(
    "stock_kw,patched_kw,message",
    [
        ({}, INT8, "not deepseek-v2-lite"),
        ({"model_path": V2_LITE},
         {**INT8, "model_path": V2_LITE, "kv_cache_dtype": "fp8_e4m3"},
         "--kv-cache-dtype bf16"),
        ({**INT8, "model_path": V2_LITE}, {**INT8, "model_path": V2_LITE},
         "stock server stores int8"),
        ({"model_path": V2_LITE}, {"model_path": V2_LITE},
         "without --hicache-host-dtype int8"),
    ],
)  # fmt: skip
def test_preset_mismatch_fails_before_measuring(
    text_file, tmp_path, capsys, stock_kw, patched_kw, message
):
    with FakeSGLang(**stock_kw) as stock, FakeSGLang(**patched_kw) as patched:
        args = argv(stock, patched, text_file, tmp_path, "--model-preset",
                    "deepseek-v2-lite")  # fmt: skip
        assert qs.main(args, log=lambda s: None) == 2
        assert not stock.requests and not patched.requests  # nothing measured
    assert message in capsys.readouterr().err
    assert not (tmp_path / "quality_server.json").exists()
