#!/usr/bin/env python3
"""Quality of L2-restored KV against two running SGLang servers (GPU users).

Start two servers on the same model, both with metrics and HiCache on, for
instance

  stock:    python3 -m sglang.launch_server --model-path M --port 30000 \\
                --enable-hierarchical-cache --enable-metrics --max-total-tokens 65536
  patched:  (HiQCache image)  ... --port 30001 --enable-hierarchical-cache \\
                --enable-metrics --max-total-tokens 65536 --hicache-host-dtype int8

then run

  python3 -m scripts.quality.server --stock http://127.0.0.1:30000 \\
      --patched http://127.0.0.1:30001 --text-file ../shared/data/wikitext-2/test.txt

The same workload runs on each server in turn: (1) every measured prefix
(WikiText windows, tokenized by the server's /tokenize) is prefilled once and
written through to L2; (2) filler prompts of random real tokens, more than the
server's L1 (`max_total_num_tokens` from /server_info, times --evict-factor),
push those prefixes out of L1; (3) each window is sent again as prefix +
continuation with return_logprob from the continuation on and a greedy
generation, so its prefix has to come back from L2. Before any comparison the
script reads each server's /metrics: `sglang:load_back_tokens_total{pool="kv"}`
must have grown during step 3 on both servers, or nothing is compared (exit 2).
Per window, `meta_info.cached_tokens_details.host` says how many prompt tokens
came from L2; windows that were not restored on both servers are left out and
counted.

Compared (patched vs stock; the stock server restores BF16 exactly): the
continuation's perplexity and its relative delta, top-1 agreement of the
prompt positions, max and mean |delta logprob| of the actual tokens, and greedy
token agreement. Two stock servers give the noise floor of batching and
kernels; run the script with --patched pointing at a second stock server.

Task accuracy: --lm-eval-tasks prints (and --run-lm-eval runs) one
lm-evaluation-harness `local-completions` command per server. Keep L1 small
(--max-total-tokens) so that the few-shot prefixes really cycle through L2.

MLA models (DeepSeek-V2-Lite). `--model-preset deepseek-v2-lite
--launch-commands` prints both servers' launch commands (BF16 latent KV,
which --hicache-host-dtype int8 needs for MLA: FP8 KV is refused at start-up)
and exits; `--model-preset deepseek-v2-lite` on a measuring run first checks
that both servers serve that model with non-FP8 KV and that only the patched
one stores INT8 in L2 (exit 2 naming the mismatch otherwise). No MLA
checkpoint is available offline here, so this has only been run against the
fake server.

Standard library only (no torch). Tested against a fake server in
tests/test_quality_server.py; it cannot run on a machine without GPU servers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scripts.common.server import ServerError, http, metric, parse_prometheus

RESTORE_METRIC = "sglang:load_back_tokens_total"  # labels: pool="kv", per rank
HOST_HIT_METRIC = "sglang:cached_tokens_total"  # labels: cache_source="host"
BACKUP_METRIC = "sglang:hicache_backup_tokens_total"  # labels: pool="kv"


class ServerSetupError(ServerError):
    """The servers do not run the configuration the run was asked to compare."""


@dataclass(frozen=True)
class ModelPreset:
    """What a model needs on both servers, and what the patched one adds."""

    model_path: str
    server_flags: tuple[str, ...]
    patched_flags: tuple[str, ...]


# Both servers keep the latent KV in BF16 (the checkpoint's dtype; the INT8
# MLA host pool refuses FP8 KV) and use a host layout and io backend the MLA
# INT8 pool supports. 27 layers x (512 latent + 64 RoPE): 31,104 B per token
# in L1 and the stock L2, 17,496 B in the INT8 L2.
MODEL_PRESETS = {
    "deepseek-v2-lite": ModelPreset(
        model_path="deepseek-ai/DeepSeek-V2-Lite",
        server_flags=(
            "--trust-remote-code",
            "--kv-cache-dtype",
            "bf16",
            "--enable-hierarchical-cache",
            "--hicache-mem-layout",
            "page_first",
            "--hicache-io-backend",
            "kernel",
            "--enable-metrics",
            "--max-total-tokens",
            "65536",
        ),
        patched_flags=("--hicache-host-dtype", "int8"),
    ),
}


def launch_commands(preset: ModelPreset, stock_port: int, patched_port: int):
    """(stock, patched) sglang.launch_server command lines for a preset."""
    base = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        preset.model_path,
        *preset.server_flags,
    ]
    return (
        base + ["--port", str(stock_port)],
        base + ["--port", str(patched_port), *preset.patched_flags],
    )


def check_preset(preset: ModelPreset, infos: dict) -> None:
    """Raise ServerSetupError unless both servers serve the preset's model with
    non-FP8 KV and only the patched one stores INT8 in L2."""
    problems = []
    model = preset.model_path.rsplit("/", 1)[-1].lower()
    for name, info in infos.items():
        path = str(info.get("model_path") or "")
        if not path.rstrip("/").lower().endswith(model):
            problems.append(f"{name} serves {path or 'an unknown model'}, not {model}")
        kv = str(info.get("kv_cache_dtype") or "auto")
        if kv.startswith(("fp8", "fp4")):
            problems.append(f"{name} keeps {kv} KV (pass --kv-cache-dtype bf16)")
        if not info.get("enable_hierarchical_cache"):
            problems.append(f"{name} runs without --enable-hierarchical-cache")
    if infos["patched"].get("hicache_host_dtype") != "int8":
        problems.append("patched server runs without --hicache-host-dtype int8")
    if infos["stock"].get("hicache_host_dtype") not in (None, "auto"):
        problems.append(
            f"stock server stores {infos['stock']['hicache_host_dtype']} in L2"
        )
    if problems:
        raise ServerSetupError("; ".join(problems))


class NoServerRestoreError(ServerError):
    """A server showed no L2 load-back during the measurement phase."""


def restore_counters(samples) -> dict:
    return {
        "load_back_tokens": metric(samples, RESTORE_METRIC, "max", pool="kv"),
        "host_hit_tokens": metric(samples, HOST_HIT_METRIC, cache_source="host"),
        "backup_tokens": metric(samples, BACKUP_METRIC, "max", pool="kv"),
    }


def find_key(obj, key):
    """First value of `key` anywhere in nested dicts/lists (server_info)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


class Server:
    def __init__(self, name: str, url: str, timeout: float = 600.0):
        self.name, self.url, self.timeout = name, url.rstrip("/"), timeout

    def get(self, path):
        return http(self.url + path, timeout=self.timeout)

    def post(self, path, payload):
        return http(self.url + path, payload, timeout=self.timeout)

    def info(self) -> dict:
        try:
            info = self.get("/server_info")
        except ServerError:
            info = self.get("/get_server_info")
        keys = (
            "max_total_num_tokens",
            "enable_hierarchical_cache",
            "hicache_host_dtype",
            "hicache_ratio",
            "hicache_size",
            "hicache_mem_layout",
            "hicache_io_backend",
            "hicache_write_policy",
            "page_size",
            "kv_cache_dtype",
            "model_path",
            "enable_metrics",
            "version",
        )
        return {k: find_key(info, k) for k in keys}

    def metrics(self) -> list:
        text = self.get("/metrics")
        if not isinstance(text, str):
            raise ServerError(f"{self.url}/metrics did not return Prometheus text")
        return parse_prometheus(text)

    def tokenize(self, text: str) -> list[int]:
        out = self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return list(out["tokens"])

    def generate(self, input_ids, max_new_tokens: int, **extra) -> dict:
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            **extra,
        }
        return self.post("/generate", payload)


# ---------------------------------------------------------------------------
# workload


def pick_windows(n_tokens: int, window_len: int, count: int, seed: int) -> list[int]:
    """Start offsets of `count` non-overlapping windows, drawn with `seed` from
    the aligned slots [k*window_len, (k+1)*window_len) of the token stream
    (the CPU harness, scripts/quality/harness.py, uses the same rule)."""
    slots = n_tokens // window_len
    if slots < count:
        raise ValueError(
            f"the text has {n_tokens} tokens: room for {slots} windows of "
            f"{window_len}, {count} requested"
        )
    chosen = sorted(random.Random(seed).sample(range(slots), count))
    return [k * window_len for k in chosen]


def filler_prompts(
    pool: list[int], total: int, length: int, seed: int
) -> list[list[int]]:
    """Prompts of random real tokens (distinct prefixes), `total` tokens in all."""
    rng = random.Random(seed)
    count = max(1, math.ceil(total / length))
    return [rng.choices(pool, k=length) for _ in range(count)]


def _ids_of(entries) -> list:
    return [e[1] if e is not None else None for e in entries or []]


def run_server(server: Server, windows, fillers, args, log=print) -> dict:
    """Warm, evict, measure on one server; metrics around the measurement."""
    P = args.prefix_len

    def send(prompts, max_new):
        with ThreadPoolExecutor(args.concurrency) as pool:
            return list(pool.map(lambda ids: server.generate(ids, max_new), prompts))

    t0 = time.perf_counter()
    before = restore_counters(server.metrics())
    send([w[: P + 1] for w in windows], 1)  # prefill + write-through to L2
    send(fillers, 1)  # push the prefixes out of L1
    evicted = restore_counters(server.metrics())
    outs = []
    for w in windows:  # one at a time: each restore is its own load-back
        outs.append(
            server.generate(
                w,
                args.greedy_tokens,
                return_logprob=True,
                logprob_start_len=P,
                top_logprobs_num=1,
            )
        )
    after = restore_counters(server.metrics())
    delta = {
        k: (
            (after[k] - evicted[k])
            if after[k] is not None and evicted[k] is not None
            else None
        )
        for k in after
    }
    if delta["load_back_tokens"] is None:
        raise NoServerRestoreError(
            f"{server.name} ({server.url}): /metrics has no {RESTORE_METRIC}; "
            "start the server with --enable-metrics and --enable-hierarchical-cache"
        )
    if delta["load_back_tokens"] <= 0:
        raise NoServerRestoreError(
            f"{server.name} ({server.url}): {RESTORE_METRIC} did not grow while the "
            f"windows were measured (nothing came back from L2); make L1 smaller "
            f"(--max-total-tokens) or raise --evict-factor. Refusing to compare."
        )
    per_window = []
    for out in outs:
        meta = out.get("meta_info", {})
        details = meta.get("cached_tokens_details") or {}
        out_lp = meta.get("output_token_logprobs")
        per_window.append(
            {
                "input_token_logprobs": meta.get("input_token_logprobs") or [],
                "input_top_ids": [
                    (top[0][1] if top else None)
                    for top in (meta.get("input_top_logprobs") or [])
                ],
                "output_ids": (
                    _ids_of(out_lp) if out_lp else list(out.get("output_ids") or [])
                ),
                "cached_tokens": meta.get("cached_tokens"),
                "host_tokens": details.get("host") if details else None,
            }
        )
    log(
        f"{server.name}: load-back {delta['load_back_tokens']:.0f} tokens, "
        f"host hits {delta['host_hit_tokens']}, {time.perf_counter() - t0:.1f}s"
    )
    return {
        "counters_before": before,
        "counters_after_evict": evicted,
        "counters_after": after,
        "restore_delta": delta,
        "windows": per_window,
    }


def compare(stock: dict, patched: dict, prefix_len: int) -> dict:
    """Patched vs stock on the windows both servers restored from L2."""
    used, skipped = [], []
    for i, (a, b) in enumerate(zip(stock["windows"], patched["windows"])):
        ha, hb = a["host_tokens"], b["host_tokens"]
        # Without per-request details, the metrics delta vouches for the run.
        if (ha is not None and ha <= 0) or (hb is not None and hb <= 0):
            skipped.append(i)
        else:
            used.append(i)
    if not used:
        raise NoServerRestoreError(
            "no window was restored from L2 on both servers "
            "(cached_tokens_details.host == 0); refusing to compare"
        )
    nll_a, nll_b, dlp, top1 = [], [], [], []
    greedy_match, greedy_total, greedy_same = 0, 0, 0
    for i in used:
        a, b = stock["windows"][i], patched["windows"][i]
        for ea, eb in zip(a["input_token_logprobs"], b["input_token_logprobs"]):
            if ea is None or eb is None or ea[0] is None or eb[0] is None:
                continue
            if ea[1] != eb[1]:
                raise ServerError(f"window {i}: servers scored different tokens")
            nll_a.append(-ea[0])
            nll_b.append(-eb[0])
            dlp.append(abs(ea[0] - eb[0]))
        for ta, tb in zip(a["input_top_ids"], b["input_top_ids"]):
            if ta is not None and tb is not None:
                top1.append(ta == tb)
        oa, ob = a["output_ids"], b["output_ids"]
        n = min(len(oa), len(ob))
        match = sum(x == y for x, y in zip(oa[:n], ob[:n]))
        greedy_match += match
        greedy_total += n
        greedy_same += int(n > 0 and match == n and len(oa) == len(ob))
    if not nll_a:
        raise ServerError("no scored tokens came back (return_logprob ignored?)")
    ppl_a = math.exp(sum(nll_a) / len(nll_a))
    ppl_b = math.exp(sum(nll_b) / len(nll_b))
    return {
        "windows_compared": len(used),
        "windows_skipped_not_restored": skipped,
        "scored_tokens": len(nll_a),
        "ppl_stock": ppl_a,
        "ppl_patched": ppl_b,
        "ppl_rel_delta": ppl_b / ppl_a - 1,
        "top1_agree": sum(top1) / len(top1) if top1 else None,
        "max_abs_dlogprob": max(dlp),
        "mean_abs_dlogprob": sum(dlp) / len(dlp),
        "greedy_tokens": greedy_total,
        "greedy_agree": greedy_match / greedy_total if greedy_total else None,
        "greedy_identical_windows": greedy_same,
        "host_tokens_stock": sum(stock["windows"][i]["host_tokens"] or 0 for i in used),
        "host_tokens_patched": sum(
            patched["windows"][i]["host_tokens"] or 0 for i in used
        ),
    }


# ---------------------------------------------------------------------------
# lm-evaluation-harness hand-off


def lm_eval_command(
    server: Server,
    model_name: str,
    tokenizer: str | None,
    tasks: str,
    out_dir: str,
    num_concurrent: int = 8,
    limit: int | None = None,
) -> list[str]:
    model_args = [
        f"model={model_name}",
        f"base_url={server.url}/v1/completions",
        f"num_concurrent={num_concurrent}",
        "max_retries=3",
        "tokenized_requests=False",
    ]
    if tokenizer:
        model_args.append(f"tokenizer={tokenizer}")
    cmd = [
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        ",".join(model_args),
        "--tasks",
        tasks,
        "--batch_size",
        "1",
        "--output_path",
        f"{out_dir}/lm_eval_{server.name}",
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    return cmd


# ---------------------------------------------------------------------------
# main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python3 -m scripts.quality.server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--stock", help="base URL of the stock SGLang server")
    p.add_argument("--patched", help="base URL of the HiQCache server")
    p.add_argument("--text-file")
    p.add_argument(
        "--model-preset",
        choices=sorted(MODEL_PRESETS),
        default=None,
        help="check both servers against this model's settings before measuring",
    )
    p.add_argument(
        "--launch-commands",
        action="store_true",
        help="print the --model-preset's two server launch commands and exit "
        "(ports from --stock/--patched, else 30000/30001)",
    )
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--score-len", type=int, default=512)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--evict-tokens",
        type=int,
        default=None,
        help="filler tokens to push through L1 (default: max_total_num_tokens x --evict-factor)",
    )
    p.add_argument("--evict-factor", type=float, default=1.5)
    p.add_argument("--filler-len", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out-dir", default="results")
    p.add_argument("--name", default="quality_server")
    p.add_argument("--lm-eval-tasks", default=None, help="e.g. hellaswag,arc_easy")
    p.add_argument("--lm-eval-limit", type=int, default=None)
    p.add_argument(
        "--run-lm-eval", action="store_true", help="run the lm_eval commands"
    )
    args = p.parse_args(argv)
    if args.launch_commands:
        if args.model_preset is None:
            p.error("--launch-commands needs --model-preset")
        return args
    missing = [f"--{k.replace('_', '-')}" for k in ("stock", "patched", "text_file")
               if getattr(args, k) is None]  # fmt: skip
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def _port(url: str | None, default: int) -> int:
    match = re.search(r":(\d+)/?$", url or "")
    return int(match.group(1)) if match else default


def markdown(report: dict) -> str:
    c, cfg = report["comparison"], report["config"]
    rows = [
        "# HiQCache restored-KV quality, server mode (patched vs stock)",
        "",
        f"- {c['windows_compared']} windows compared ({len(c['windows_skipped_not_restored'])} "
        f"skipped: not restored on both), {cfg['prefix_len']} prefix + {cfg['score_len']} "
        f"scored tokens, greedy {cfg['greedy_tokens']}, seed {cfg['seed']}",
    ]
    for name in ("stock", "patched"):
        s = report["servers"][name]
        rows.append(
            f"- {name} {s['url']}: host dtype {s['info'].get('hicache_host_dtype')}, "
            f"L1 {s['info'].get('max_total_num_tokens')} tokens, load-back during measurement "
            f"{s['restore_delta']['load_back_tokens']:.0f} tokens"
        )

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.2f}%"

    rows += [
        "",
        "| PPL stock | PPL patched | PPL delta | top-1 agree | max abs dlogprob "
        "| mean abs dlogprob | greedy agree |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {c['ppl_stock']:.4f} | {c['ppl_patched']:.4f} | {100 * c['ppl_rel_delta']:+.4f}% "
        f"| {pct(c['top1_agree'])} "
        f"| {c['max_abs_dlogprob']:.3e} | {c['mean_abs_dlogprob']:.3e} "
        f"| {pct(c['greedy_agree'])} |",
        "",
    ]
    for cmd in report.get("lm_eval_commands", []):
        rows.append(f"    {cmd}")
    return "\n".join(rows) + "\n"


def main(argv=None, log=print) -> int:
    args = parse_args(argv)
    preset = MODEL_PRESETS.get(args.model_preset)
    if args.launch_commands:
        for name, cmd in zip(
            ("stock", "patched"),
            launch_commands(
                preset, _port(args.stock, 30000), _port(args.patched, 30001)
            ),
        ):
            log(f"# {name}\n{shlex.join(cmd)}")
        return 0
    stock = Server("stock", args.stock, args.timeout)
    patched = Server("patched", args.patched, args.timeout)
    try:
        infos = {s.name: s.info() for s in (stock, patched)}
        if preset is not None:
            check_preset(preset, infos)
        text = Path(args.text_file).read_text(encoding="utf-8")
        ids = stock.tokenize(text)
        window_len = args.prefix_len + args.score_len + 1
        starts = pick_windows(len(ids), window_len, args.windows, args.seed)
        windows = [ids[s : s + window_len] for s in starts]
        l1 = infos["stock"]["max_total_num_tokens"] or 0
        l1 = max(l1, infos["patched"]["max_total_num_tokens"] or 0)
        evict = args.evict_tokens or int(l1 * args.evict_factor)
        if evict <= 0:
            raise ServerError(
                "L1 size unknown (/server_info max_total_num_tokens); pass --evict-tokens"
            )
        fillers = filler_prompts(ids, evict, args.filler_len, args.seed + 1)
        log(
            f"{len(windows)} windows, {len(fillers)} filler prompts ({evict} tokens) per server"
        )
        results = {
            s.name: run_server(s, windows, fillers, args, log) for s in (stock, patched)
        }
        comparison = compare(results["stock"], results["patched"], args.prefix_len)
    except (NoServerRestoreError, ServerSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {
        "kind": "hiqcache-quality-server",
        "config": {k: v for k, v in vars(args).items()},
        "windows": starts,
        "text": {"path": args.text_file, "tokens": len(ids)},
        "servers": {
            name: {
                "url": srv.url,
                "info": infos[name],
                "restore_delta": results[name]["restore_delta"],
                "counters_after": results[name]["counters_after"],
                "per_window_host_tokens": [
                    w["host_tokens"] for w in results[name]["windows"]
                ],
            }
            for name, srv in (("stock", stock), ("patched", patched))
        },
        "comparison": comparison,
    }
    if args.lm_eval_tasks:
        model_name = infos["stock"].get("model_path") or "default"
        cmds = [
            lm_eval_command(
                s,
                model_name,
                model_name,
                args.lm_eval_tasks,
                args.out_dir,
                args.concurrency,
                args.lm_eval_limit,
            )
            for s in (stock, patched)
        ]
        report["lm_eval_commands"] = [shlex.join(c) for c in cmds]
        if args.run_lm_eval:
            if shutil.which("lm_eval") is None:
                print(
                    "error: lm_eval not installed (pip install lm-eval)",
                    file=sys.stderr,
                )
                return 1
            for s, cmd in zip((stock, patched), cmds):
                m0 = restore_counters(s.metrics())
                subprocess.run(cmd, check=True)
                m1 = restore_counters(s.metrics())
                report.setdefault("lm_eval_load_back_tokens", {})[s.name] = (
                    m1["load_back_tokens"] or 0
                ) - (m0["load_back_tokens"] or 0)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    (out / f"{args.name}.md").write_text(md)
    log(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
