"""`make demo` part 1: the patched SGLang server live on this CPU per host format
at one host budget (docs/demo.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from statistics import fmean
from pathlib import Path
from typing import Callable, Optional, Sequence
from unittest import mock

from scripts.demo import workload
from scripts.demo.report import pm, table

# The format whose host tier must hold the working set, and the stock arm.
ANCHOR_FORMAT = "int8"
STOCK_LABEL = "bf16"

M_CACHED = "sglang:cached_tokens_total"
M_LOAD_BACK = "sglang:load_back_tokens_total"
# SeedRun's counter deltas: key -> /metrics counter.
COUNTERS = {
    "prompt_tokens": "sglang:prompt_tokens_total",
    "load_back_tokens": M_LOAD_BACK,
    "evicted_tokens": "sglang:evicted_tokens_total",
    "backup_tokens": "sglang:hicache_backup_tokens_total",
}
SOURCES = ("device", "host", "storage")
PHASE_COLUMNS = ("prompt", *SOURCES, "load_back")  # print_report's, per phase
# The /server_info fields the replay needs.
SERVER_INFO_KEYS = (
    "max_total_num_tokens chunked_prefill_size max_prefill_tokens "
    "disable_overlap_schedule hicache_ratio hicache_host_dtype "
    "hicache_write_policy page_size"
).split()


@dataclass(frozen=True)
class LiveConfig:
    groups: int = 8  # --gsp-num-groups
    prompts_per_group: int = 2
    system_prompt_len: int = 512
    question_len: int = 32
    output_len: int = 8
    concurrency: int = 2  # bench_serving --max-concurrency
    seeds: tuple = (42, 43)  # two paired seeds keep `make demo` under 15 min here
    device_tokens: int = 2048  # --max-total-tokens (L1)
    margin: float = 1.25  # anchor host tokens / working set
    gen_tokens: int = 16  # greedy tokens per reuse, scored for quality

    def workload(self, seed: int) -> workload.Workload:
        sizes = self.system_prompt_len, self.question_len, self.output_len
        return workload.Workload(self.groups, self.prompts_per_group, *sizes, seed)

    def bench_serving_args(self, seed: int, model: Path, port: int, out: Path):
        return [
            "--backend", "sglang",
            "--host", "127.0.0.1", "--port", str(port),
            "--model", str(model), "--tokenizer", str(model),
            *self.workload(seed).bench_serving_args(),
            "--max-concurrency", str(self.concurrency),
            "--cache-report", "--disable-tqdm",
            "--output-file", str(out), "--output-details",
        ]  # fmt: skip


QUICK = LiveConfig(
    groups=4,
    prompts_per_group=2,
    system_prompt_len=320,
    question_len=16,
    output_len=4,
    concurrency=2,
    seeds=(42,),
    device_tokens=768,
    gen_tokens=8,
)


_INT_FLAGS = [f.name for f in fields(LiveConfig) if f.type == "int"]


def add_args(p: argparse.ArgumentParser) -> None:
    d = LiveConfig()
    g = p.add_argument_group("part 1, live server (unset: defaults or --live-quick's)")
    g.add_argument("--live-formats", help="labels; bf16 and int8 always run")
    for name in _INT_FLAGS:
        g.add_argument(
            "--live-" + name.replace("_", "-"), type=int, default=None,
            help=f"default {getattr(d, name)}",
        )  # fmt: skip
    g.add_argument(
        "--live-margin", type=float, default=None,
        help=f"{ANCHOR_FORMAT} host tokens over the working set (default {d.margin})",
    )  # fmt: skip
    g.add_argument("--live-quick", action="store_true", help="a tiny live workload")
    g.add_argument("--live-log-dir", type=Path, help="server logs")


def config_from_args(args) -> LiveConfig:
    base = QUICK if args.live_quick else LiveConfig()
    values = {}
    for name in _INT_FLAGS:
        values[name] = value = getattr(args, f"live_{name}")
        if value is not None and value < 1:
            flag = "--live-" + name.replace("_", "-")
            raise SystemExit(f"{flag} must be at least 1 (got {value})")
    if args.seed != base.seeds[0]:
        values["seeds"] = tuple(args.seed + i for i in range(len(base.seeds)))
    if args.live_margin is not None and args.live_margin <= 1:
        raise SystemExit(
            "--live-margin must be above 1: the int8 host tier must hold the "
            f"whole working set (got {args.live_margin}; pass e.g. 1.25)"
        )
    values["margin"] = args.live_margin
    return replace(base, **{k: v for k, v in values.items() if v is not None})


@dataclass
class SentPrompt:
    group: int
    text: str
    ids: list  # tokenized as the server tokenizes text
    output_len: int


def sent_prompts(config: LiveConfig, seed: int, tokenizer) -> list[SentPrompt]:
    """bench_serving's requests for `seed` in send order (its own generator,
    seeded as it seeds it), tokenized as the server tokenizes `text`."""
    w = config.workload(seed)
    rows = workload.sent_rows(w, tokenizer, input_ids=False)
    return [
        SentPrompt(
            group=slot // w.prompts_per_group,
            text=row.prompt,
            ids=list(tokenizer(row.prompt)["input_ids"]),
            output_len=row.output_len,
        )
        for slot, row in rows
    ]


def reuse_order(prompts: Sequence[SentPrompt]) -> list[SentPrompt]:
    """Each group's last-sent prompt, least recently used group first (the
    order in which an LRU cache lost them)."""
    last = {p.group: (i, p) for i, p in enumerate(prompts)}
    return [p for _, p in sorted(last.values(), key=lambda x: x[0])]


def working_set_tokens(prompts: Sequence[SentPrompt], gen_tokens: int) -> int:
    """Tokens the cache holds if nothing is evicted (shared prefixes count once)."""
    seen = {h for p in prompts for h in workload.prefix_hashes(p.ids)}
    outputs = sum(p.output_len for p in prompts)
    warmup = min(prompts[0].output_len, workload.WARMUP_OUTPUT_CAP)
    reuse = 2 * (gen_tokens + 1) * len(reuse_order(prompts))
    return len(seen) + outputs + warmup + reuse


@dataclass
class ArmSizing:
    label: str
    host_dtype: str
    bytes_per_token: float  # the real host pool's get_size_per_token()
    host_tokens: int  # what the budget buys
    hicache_ratio: float  # host tokens / device tokens, as --hicache-ratio


@dataclass
class Budget:
    bytes: int
    working_set: int
    device_tokens: int
    arms: list  # ArmSizing

    def arm(self, label: str) -> ArmSizing:
        return next(a for a in self.arms if a.label == label)


def choose_budget(formats, bpt: dict, working_set: int, config: LiveConfig) -> Budget:
    """One host byte budget: the anchor holds the working set x margin."""
    anchor_bytes = math.ceil(config.margin * working_set * bpt[ANCHOR_FORMAT])
    arms = []
    for label, dt in formats:
        tokens = int(anchor_bytes // bpt[label])
        # int(device * ratio) is what SGLang allocates: the half token keeps
        # the float product above the integer.
        ratio = (tokens + 0.5) / config.device_tokens
        arms.append(ArmSizing(label, dt, bpt[label], tokens, ratio))
    budget = Budget(anchor_bytes, working_set, config.device_tokens, arms)
    stock = budget.arm(STOCK_LABEL)
    if stock.host_tokens >= working_set:
        raise SystemExit(
            f"live workload too small: bf16's host tier ({stock.host_tokens:,} "
            f"tokens) at the budget would hold the whole working set "
            f"({working_set:,}); lower --live-margin (now {config.margin})"
        )
    if stock.host_tokens <= config.device_tokens:
        raise SystemExit(
            f"bf16's host tier ({stock.host_tokens:,} tokens) would be no larger "
            f"than L1 (--live-device-tokens {config.device_tokens:,}); raise "
            "--live-groups or --live-system-prompt-len, or lower "
            "--live-device-tokens"
        )
    if working_set <= config.device_tokens:
        raise SystemExit(
            f"the working set ({working_set:,} tokens) fits in L1 "
            f"(--live-device-tokens {config.device_tokens:,}): nothing would "
            "reach the host tier; raise --live-groups or lower --live-device-tokens"
        )
    return budget


def _host_gauges(m) -> dict:
    gauge = lambda key: m.value(f"sglang:hicache_host_{key}")  # noqa: E731
    total, bpt = gauge("total_tokens"), gauge("bytes_per_token")
    # The host tier's size in bytes is not exported: it is tokens x bytes/token.
    return {
        "total_tokens": total,
        "total_bytes": total * bpt,
        "used_tokens": gauge("used_tokens"),
        "used_bytes": gauge("used_bytes"),
        "bytes_per_token": bpt,
    }


def _counter_deltas(after, before) -> dict:
    from scripts.rigs.prom import diff

    out = {
        f"cached_{s}": diff(after, before, M_CACHED, cache_source=s) for s in SOURCES
    }
    return out | {key: diff(after, before, name) for key, name in COUNTERS.items()}


def _details(meta: dict) -> dict:
    d = meta.get("cached_tokens_details") or {}
    return {s: int(d.get(s) or 0) for s in SOURCES}


def import_bench_serving():
    """sglang.benchmark.serving, with the real datasets package under it."""
    workload.drop_stand_in_datasets()
    from sglang.benchmark import serving

    return serving


def run_bench_serving(argv: list[str], out: Path, log) -> dict:
    """bench_serving's CLI, in this process; its result line from --output-file."""
    bench = import_bench_serving()
    argv = ["python -m sglang.bench_serving", *argv]
    # Its generator pickles prompts under ~/.cache; keep runs self-contained.
    generator = workload.private_generator(workload.generator_module(), log)
    with mock.patch.object(sys, "argv", argv), generator:
        bench.cli_main()
    return json.loads(out.read_text().splitlines()[-1])


@dataclass
class Reuse:
    group: int
    prompt_tokens: int
    cached: dict  # from the response's cached_tokens_details
    output_ids: list
    ttft_s: float
    # Scoring of the reference (bf16) tokens after the load-back.
    score_ids: list = field(default_factory=list)
    score_logprobs: list = field(default_factory=list)
    score_top1: list = field(default_factory=list)
    score_cached: dict = field(default_factory=dict)


@dataclass
class SeedRun:
    seed: int
    bench: dict  # bench_serving's figures
    bench_counts: dict  # /metrics deltas over the bench_serving run
    reuse: list  # Reuse
    reuse_counts: dict  # /metrics deltas over the reuse phase
    host_after: dict  # host gauges after the seed
    sent_prompt_tokens: list  # the demo's tokenization of what bench_serving sent


def reuse_phase(server, prompts, gen_tokens: int, reference=None) -> list[Reuse]:
    greedy = {"temperature": 0.0, "max_new_tokens": gen_tokens, "ignore_eos": True}
    details = {"return_logprob": True, "return_cached_tokens_details": True}
    out = []
    for i, p in enumerate(reuse_order(prompts)):
        t0 = time.perf_counter()
        payload = {"text": p.text, "sampling_params": greedy, **details}
        r = server.post("/generate", payload)
        meta = r["meta_info"]
        ttft = meta.get("first_token_latency", time.perf_counter() - t0)
        ids = r.get("output_ids") or [x[1] for x in meta["output_token_logprobs"]]
        rec = Reuse(p.group, len(p.ids), _details(meta), list(ids), ttft)
        ref_ids = reference[i].output_ids if reference is not None else rec.output_ids
        score = server.post(
            "/generate",
            {
                "input_ids": p.ids + list(ref_ids),
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
                "logprob_start_len": len(p.ids) - 1,
                "top_logprobs_num": 1,
                **details,
            },
        )
        sm = score["meta_info"]
        # Entry 0 is the prompt's last token; entries 1.. are ref_ids.
        rec.score_ids = list(ref_ids)
        rec.score_logprobs = [x[0] for x in sm["input_token_logprobs"][1:]]
        rec.score_top1 = [x[0][1] for x in sm["input_top_logprobs"][1:]]
        rec.score_cached = _details(sm)
        out.append(rec)
    return out


@dataclass
class ArmResult:
    label: str
    host_dtype: str
    sizing: ArmSizing
    startup_seconds: float
    server_args: list
    log_path: str
    host_start: dict  # host gauges right after start-up
    server_info: dict  # the /server_info fields the replay needs
    seeds: list  # SeedRun
    kernel_calls: list


def run_arm(sizing, config, prompts_by_seed, model, log_dir, reference, say) -> ArmResult:  # fmt: skip
    from scripts.rigs.server import CPU_FLAGS, LiveServer, hicache_flags

    args = list(CPU_FLAGS)
    args[args.index("--max-total-tokens") + 1] = str(config.device_tokens)
    host_dtype = None if sizing.host_dtype == "auto" else sizing.host_dtype
    args += hicache_flags(host_dtype, ratio=round(sizing.hicache_ratio, 6))
    bench_log = open(log_dir / f"{sizing.label}.bench_serving.log", "w")
    with LiveServer(args, name=sizing.label, model=model, log_dir=log_dir, progress=say) as s:  # fmt: skip
        host_start = _host_gauges(s.metrics())
        info = json.loads(s.get("/server_info"))
        info = {k: info.get(k) for k in SERVER_INFO_KEYS}
        seeds = []
        for seed in config.seeds:
            s.flush_cache()
            m0 = s.metrics()
            out = log_dir / f"{sizing.label}.seed{seed}.jsonl"
            t0 = time.perf_counter()
            bench = run_bench_serving(
                config.bench_serving_args(seed, model, s.port, out), out, bench_log
            )
            m1 = s.metrics()
            ref = reference[seed] if reference is not None else None
            reuse = reuse_phase(s, prompts_by_seed[seed], config.gen_tokens, ref)
            m2 = s.metrics()
            run = SeedRun(
                seed=seed,
                bench=_bench_figures(bench),
                bench_counts=_counter_deltas(m1, m0),
                reuse=reuse,
                reuse_counts=_counter_deltas(m2, m1),
                host_after=_host_gauges(m2),
                sent_prompt_tokens=[len(p.ids) for p in prompts_by_seed[seed]],
            )
            seeds.append(run)
            rh = sum(r.cached["host"] for r in reuse)
            say(
                f"[{sizing.label}] seed {seed}: bench_serving + reuse in "
                f"{time.perf_counter() - t0:.0f} s; host hits bench "
                f"{run.bench['cached']['host']:,} tokens, reuse {rh:,}"
            )
        kernel_calls = [c for c in s.kernel_calls() if c.get("event") == "call"]
    bench_log.close()
    return ArmResult(
        label=sizing.label,
        host_dtype=sizing.host_dtype,
        sizing=sizing,
        startup_seconds=s.startup_seconds,
        server_args=args,
        log_path=str(s.log_path),
        host_start=host_start,
        server_info=info,
        seeds=seeds,
        kernel_calls=kernel_calls,
    )


def _bench_figures(result: dict) -> dict:
    report = result.get("cache_report") or {}
    details = result.get("cached_tokens_details") or []
    cached = {s: sum(int((d or {}).get(s) or 0) for d in details) for s in SOURCES}
    return {
        "completed": result["completed"],
        "duration_s": result["duration"],
        "prompt_tokens": report.get(
            "total_prompt_tokens", result["total_input_tokens"]
        ),
        "cached": cached,
        "cached_total": report.get("total_cached_tokens"),
        "mean_ttft_ms": result["mean_ttft_ms"],
        "median_ttft_ms": result["median_ttft_ms"],
        "request_throughput": result["request_throughput"],
        "input_throughput": result["input_throughput"],
        "output_throughput": result["output_throughput"],
        "input_lens": result.get("input_lens", []),
    }


def quality(arm: ArmResult, base: ArmResult) -> dict:
    """Greedy agreement and scored quality of `arm` against the bf16 arm over
    every reused prompt (all seeds)."""
    pairs = [
        (r, b)
        for run, ref in zip(arm.seeds, base.seeds)
        for r, b in zip(run.reuse, ref.reuse)
    ]
    prefix = [len(os.path.commonprefix([r.output_ids, b.output_ids])) for r, b in pairs]
    top1 = sum(t == y for r, b in pairs for t, y in zip(r.score_top1, b.score_ids))
    positions = sum(len(b.score_ids) for _, b in pairs)
    diffs = [
        abs(x - y) for r, b in pairs for x, y in zip(r.score_logprobs, b.score_logprobs)
    ]
    return {
        "prompts": len(pairs),
        "greedy_identical": sum(r.output_ids == b.output_ids for r, b in pairs),
        "greedy_common_prefix_mean": fmean(prefix) if prefix else 0.0,
        "top1_agreement": top1 / positions if positions else float("nan"),
        "positions": positions,
        "mean_abs_logprob_diff": fmean(diffs) if diffs else float("nan"),
        "max_abs_logprob_diff": max(diffs) if diffs else float("nan"),
        "prompts_loaded_back_from_host": sum(r.cached["host"] > 0 for r, _ in pairs),
    }


def select_formats(formats, spec: Optional[str]):
    if not spec:
        return list(formats)
    labels = {x.strip() for x in spec.split(",") if x.strip()}
    known = {label for label, _ in formats}
    if unknown := labels - known:
        raise SystemExit(
            f"--live-formats: unknown {sorted(unknown)}; pass labels from "
            f"{', '.join(sorted(known))}"
        )
    labels |= {STOCK_LABEL, ANCHOR_FORMAT}
    return [(label, dt) for label, dt in formats if label in labels]


@dataclass
class LiveResult:
    config: LiveConfig
    model: str
    geometry: dict
    budget: Budget
    arms: list  # ArmResult
    quality: dict  # label -> quality()
    seconds: float
    log_dir: str
    uptime_before: str
    uptime_after: str
    # Token ids of the prompts per seed (for the replay; not written out).
    prompts: dict = field(default_factory=dict, repr=False)
    agreement: list = field(default_factory=list)

    def arm(self, label: str) -> ArmResult:
        return next(a for a in self.arms if a.label == label)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("prompts")
        return data


def _uptime() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def run(config: LiveConfig, formats, *, log_dir: Optional[Path] = None,
        say: Callable[[str], None] = print) -> LiveResult:  # fmt: skip
    from transformers import AutoTokenizer

    from scripts.demo import pools
    from scripts.rigs.model import MODEL_LABEL, smollm2_dir
    from scripts.rigs.server import model_geometry as kv_geometry

    t_start = time.perf_counter()
    uptime_before = _uptime()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = smollm2_dir()
    import_bench_serving()  # before the generator is imported for the prompts
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = {seed: sent_prompts(config, seed, tokenizer) for seed in config.seeds}
    working_set = max(
        working_set_tokens(p, config.gen_tokens) for p in prompts.values()
    )
    # The model's KV geometry (TP=1), and each format's host bytes per token at
    # the servers' layout from the real pool the --hicache-host-dtype dispatch builds.
    name = json.loads((model / "config.json").read_text()).get("_name_or_path")
    geometry = pools.ModelGeometry(name or model.name, *kv_geometry(model))
    bpt = {
        label: pools.allocate_host_pool(
            dt, 64, geometry, layout="layer_first", page_size=1, commit=False
        ).bytes_per_token
        for label, dt in formats
    }
    budget = choose_budget(formats, bpt, working_set, config)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hiq-demo-live-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(
        f"live: {MODEL_LABEL} on CPU, L1 {config.device_tokens:,} tokens, working "
        f"set {working_set:,} tokens, host budget {budget.bytes / 1e6:.1f} MB "
        f"({ANCHOR_FORMAT} x {config.margin}); {len(formats)} servers one after "
        f"another, logs in {log_dir}"
    )
    arms = []
    reference = None
    for label, _ in formats:
        sizing = budget.arm(label)
        say(
            f"[{label}] --hicache-ratio {sizing.hicache_ratio:.4f} -> "
            f"{sizing.host_tokens:,} host tokens x {sizing.bytes_per_token:,.0f} B"
        )
        arm = run_arm(sizing, config, prompts, model, log_dir, reference, say)
        arms.append(arm)
        if label == STOCK_LABEL:
            reference = {run.seed: run.reuse for run in arm.seeds}
    base = next(a for a in arms if a.label == STOCK_LABEL)
    q = {a.label: quality(a, base) for a in arms if a.label != STOCK_LABEL}
    return LiveResult(
        config=config,
        model=MODEL_LABEL,
        geometry=vars(geometry) | {"dtype": str(geometry.dtype)},
        budget=budget,
        arms=arms,
        quality=q,
        seconds=time.perf_counter() - t_start,
        log_dir=str(log_dir),
        uptime_before=uptime_before,
        uptime_after=_uptime(),
        prompts=prompts,
    )


def arm_totals(arm: ArmResult) -> dict:
    """Per-seed counts of an arm (lists over seeds)."""

    def per_seed(fn):
        return [fn(run) for run in arm.seeds]

    t = {
        "bench_prompt": per_seed(lambda r: r.bench["prompt_tokens"]),
        "bench_load_back": per_seed(lambda r: r.bench_counts["load_back_tokens"]),
        "reuse_prompt": per_seed(lambda r: sum(x.prompt_tokens for x in r.reuse)),
        "reuse_load_back": per_seed(lambda r: r.reuse_counts["load_back_tokens"]),
        "ttft_ms": per_seed(lambda r: r.bench["mean_ttft_ms"]),
        "reuse_ttft_ms": per_seed(lambda r: 1000 * fmean([x.ttft_s for x in r.reuse])),
        "out_tps": per_seed(lambda r: r.bench["output_throughput"]),
    }
    for s in SOURCES:  # per_seed runs at once, so `s` is this iteration's
        t[f"bench_{s}"] = per_seed(lambda r: r.bench["cached"][s])
        t[f"reuse_{s}"] = per_seed(lambda r: sum(x.cached[s] for x in r.reuse))
    return t


def _m(values, digits=0) -> str:
    return f"{fmean(values):,.{digits}f}"


def print_report(res: LiveResult, say: Callable[[str], None] = print) -> None:
    c, b = res.config, res.budget
    say(
        f"1) Live patched SGLang server on CPU ({res.model}, "
        f"{res.geometry['layer_num']} layers x {res.geometry['head_num']} KV heads x "
        f"{res.geometry['head_dim']} dims, BF16), one host budget "
        f"{b.bytes / 1e6:.1f} MB for every format"
    )
    say(
        f"   workload: bench_serving generated-shared-prefix, {c.groups} groups x "
        f"{c.prompts_per_group} prompts, system prompt {c.system_prompt_len} + "
        f"question {c.question_len} tokens, output {c.output_len}, concurrency "
        f"{c.concurrency}, seeds {', '.join(map(str, c.seeds))} (same requests per "
        f"arm); then reuse: each group's last prompt again, least recently used "
        f"first, {c.gen_tokens} greedy tokens"
    )
    say(
        f"   budget: {ANCHOR_FORMAT} holds the working set ({b.working_set:,} "
        f"tokens) x {c.margin}; L1 (--max-total-tokens) {c.device_tokens:,}; "
        "--hicache-mem-layout layer_first, --hicache-io-backend direct"
    )
    rows = []
    for arm in res.arms:
        t, h = arm_totals(arm), arm.host_start
        host = h["total_tokens"], h["total_bytes"] / 1e6, h["bytes_per_token"]
        counts = [_m(t[f"{p}_{k}"]) for p in ("bench", "reuse") for k in PHASE_COLUMNS]
        rows.append((arm.label, arm.sizing.hicache_ratio, *host, *counts))
    table(
        "   {:<7} {:>7.3f} {:>11,.0f} {:>8.1f} {:>7,.0f}"
        + " | {:>13} {:>7} {:>6} {:>5} {:>7}" * 2,
        "format;ratio;host tokens;host MB;B/token;bench: prompt;device;host;stor.;"
        "loaded;reuse: prompt;device;host;stor.;loaded",
        rows,
        say,
    )
    say(
        "   (host tokens/MB/B per token from /metrics at start-up; prompt tokens "
        "served from device/host/storage from the responses' cached_tokens_details, "
        f"mean per seed; loaded = /metrics {M_LOAD_BACK})"
    )
    base_t = arm_totals(res.arm(STOCK_LABEL))
    say(
        "   CPU figures (2-core VM, 135M model; noisy): mean +- sd over seeds, "
        f"paired differences vs {STOCK_LABEL}"
    )
    rows = []
    for arm in res.arms:
        t, q = arm_totals(arm), res.quality.get(arm.label)
        row = [arm.label]
        for key in ("ttft_ms", "reuse_ttft_ms"):
            gaps = pm([x - y for x, y in zip(t[key], base_t[key])], 1, 0)
            row += [pm(t[key], 1, 0), "-" if arm.label == STOCK_LABEL else gaps]
        row.append(pm(t["out_tps"], 1, 1))
        if q:
            greedy = f"{q['greedy_identical']:>6}/{q['prompts']:<6}"
            top1, dlogp = q["top1_agreement"], q["mean_abs_logprob_diff"]
            rows.append(row + [greedy, f"{100 * top1:.1f}%", f"{dlogp:.4f}"])
        else:
            rows.append(row + ["reference", "", ""])
    table(
        "   {:<7} {:>18} {:>16} {:>18} {:>16} {:>14} | {:>13} {:>7} {:>7}",
        "format;bench TTFT ms;vs bf16;reuse TTFT ms;vs bf16;out tok/s;greedy = bf16;"
        "top-1;|dlogp|",
        rows,
        say,
    )
    say(
        f"   quality (reported, not gated): the first {c.gen_tokens} tokens after a "
        "host load-back, scored with return_logprob against bf16's greedy tokens "
        "(top-1 = the arm's argmax is bf16's token; |dlogp| = mean |logprob "
        "difference| of those tokens)"
    )
    for arm in res.arms:
        for run in arm.seeds:
            reuse = sum(x.cached["host"] + x.score_cached["host"] for x in run.reuse)
            resp = run.bench["cached"]["host"] + reuse
            met = run.bench_counts["cached_host"] + run.reuse_counts["cached_host"]
            if resp != met:
                say(
                    f"   WARNING {arm.label} seed {run.seed}: host-served tokens "
                    f"{resp:,} in responses vs {met:,.0f} in /metrics"
                )
    calls = sum(len(a.kernel_calls) for a in res.arms)
    say(
        f"   cross-checks: host-served tokens in responses = /metrics "
        f'{M_CACHED}{{cache_source="host"}} per seed; sgl_kernel stand-in ops '
        f"called: {calls}; servers started in "
        + ", ".join(f"{a.label} {a.startup_seconds:.0f} s" for a in res.arms)
    )
    say(
        f"   part 1 took {res.seconds:.0f} s ({res.uptime_before} before, "
        f"{res.uptime_after} after); logs in {res.log_dir}"
    )
    say("")


def passed(res: LiveResult) -> bool:
    """On reuse every quantized arm hits at least bf16, and int8 has more host hits."""

    def hits(t):
        return fmean([d + h for d, h in zip(t["reuse_device"], t["reuse_host"])])

    base = arm_totals(res.arm(STOCK_LABEL))
    anchor = arm_totals(res.arm(ANCHOR_FORMAT))
    more_host = fmean(anchor["reuse_host"]) > fmean(base["reuse_host"])
    return more_host and all(hits(arm_totals(a)) >= hits(base) for a in res.arms)


def replay_requests(prompts: Sequence[SentPrompt], seed: int) -> list:
    """Part 1's requests as the replay's (outputs: random ids)."""
    sent = Counter()  # prompts sent so far per group
    rows = []
    for p in prompts:
        rows.append((p.group, p.group * 1000 + sent[p.group], p.ids, p.output_len))
        sent[p.group] += 1
    return workload.with_outputs(rows, seed, 49_152)


def replay_agreement(res: LiveResult) -> list[dict]:
    """Part 2's replay on part 1's requests and capacities, next to the live counts."""
    from scripts.demo import replay

    rows = []
    for arm in res.arms:
        info, chunk = arm.server_info, arm.server_info.get("chunked_prefill_size")
        serving = replay.Serving(  # as the live arm's /server_info says it served
            l1_tokens=int(info.get("max_total_num_tokens") or res.config.device_tokens),
            concurrency=res.config.concurrency,
            max_prefill_tokens=int(info.get("max_prefill_tokens") or 16_384),
            chunked_prefill_size=chunk if chunk and chunk > 0 else None,
            overlap_schedule=not info.get("disable_overlap_schedule", False),
            write_policy=info.get("hicache_write_policy") or "write_through",
        )
        host_tokens = int(arm.host_start["total_tokens"]) or arm.sizing.host_tokens
        replayed = []
        for run in arm.seeds:
            requests = replay_requests(res.prompts[run.seed], run.seed)
            args = arm.host_dtype, host_tokens, requests, serving
            replayed.append(replay.replay(*args, seed=run.seed, label=arm.label))
        bench = [run.bench for run in arm.seeds]
        rows.append(
            {
                "label": arm.label,
                "serving": vars(serving),
                "replay_l1": [r.l1_hit_tokens for r in replayed],
                "replay_l2": [r.l2_hit_tokens for r in replayed],
                "replay_prompt": [r.prompt_tokens for r in replayed],
                "live_device": [b["cached"]["device"] for b in bench],
                "live_host": [b["cached"]["host"] for b in bench],
                "live_prompt": [b["prompt_tokens"] for b in bench],
            }
        )
    return rows


def _hit_pct(row: dict, l1: str, l2: str, prompt: str) -> float:
    """Mean over seeds of (l1 + l2) / prompt tokens, in %."""
    return 100 * fmean((a + b) / p for a, b, p in zip(row[l1], row[l2], row[prompt]))


def print_agreement(rows: list[dict], say: Callable[[str], None] = print) -> None:
    say(
        "   replay model (part 2's engine) on part 1's requests at part 1's host "
        "capacities vs the live servers (bench_serving run; mean per seed):"
    )
    rows = [
        (
            r["label"],
            _hit_pct(r, "live_device", "live_host", "live_prompt"),
            _hit_pct(r, "replay_l1", "replay_l2", "replay_prompt"),
            *(_m(r[k]) for k in ("live_device", "replay_l1", "live_host", "replay_l2")),
        )
        for r in rows
    ]
    table(
        "   {:<7} {:>10.1f} {:>7.1f} | {:>11} {:>9} | {:>9} {:>9}",
        "format;hit % live;replay;device live;replay L1;host live;replay L2",
        rows,
        say,
    )


def print_scale_agreement(res: LiveResult, summary: dict, say=print) -> None:
    """One line per quantized format: tokens per host byte live (SmolLM2) and
    at Qwen3-8B scale, and what each part shows for the same budget."""
    base = res.arm(STOCK_LABEL)
    bt = arm_totals(base)
    say("parts 1 and 2:")
    for arm in res.arms:
        if arm.label == STOCK_LABEL or arm.label not in summary:
            continue
        t = arm_totals(arm)
        live_ratio = (
            base.host_start["bytes_per_token"] / arm.host_start["bytes_per_token"]
        )
        s = summary[arm.label]
        say(
            f"   {arm.label}: tokens per host byte vs {STOCK_LABEL} {live_ratio:.3f}x "
            f"live ({res.geometry['head_dim']}-dim heads) and "
            f"{s['tokens_ratio']:.3f}x at Qwen3-8B (128-dim); at one budget the "
            f"live reuse served {_m(t['reuse_host'])} tokens from host vs "
            f"{_m(bt['reuse_host'])} for {STOCK_LABEL}, the replay's hit rate "
            f"{100 * s['hit_rate'][0]:.1f}% vs {100 * s['hit_rate_base'][0]:.1f}%"
        )


def plot(res: LiveResult, path: Path) -> None:
    """Per arm: prompt tokens of the reuse phase served from device, host or
    recomputed (mean per seed), and host tokens at the one budget."""
    from scripts.common import plot

    bars = []
    for arm in res.arms:
        t = {k: fmean(v) for k, v in arm_totals(arm).items()}
        dev, host, total = t["reuse_device"], t["reuse_host"], t["reuse_prompt"]
        parts = [dev, host, max(0.0, total - dev - host)]
        bars.append((arm.label, parts, arm.host_start["total_tokens"]))
    c = res.config
    plot.plot_bars(
        bars,
        ("device (L1)", "host (L2), loaded back", "recomputed"),
        path,
        title=f"live patched SGLang on CPU, {res.model}: one host budget "
        f"{res.budget.bytes / 1e6:.1f} MB, {c.groups} groups x {c.prompts_per_group} "
        f"shared-prefix prompts, L1 {c.device_tokens:,} tokens, {len(c.seeds)} seed(s)",
        ylabel="reused prompt tokens (mean per seed)",
        right_label="host tier, tokens",
    )
