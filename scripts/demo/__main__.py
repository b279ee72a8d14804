#!/usr/bin/env python3
"""`make demo`: same CPU memory, more reuse -- measured on CPU with the real
patched SGLang code (no GPU needed).

A) Same L2 token capacity -> host bytes the real stock and INT8 host pools
   allocate at the model geometry.
B) Same host budget (`--hicache-size` GB) -> L2 tokens each pool holds and the
   cache-hit rate of a shared-prefix workload replayed through SGLang's own
   radix cache + HiCache, plus a sweep of budgets for the plot.

Run from the repository root with the patched tree first on PYTHONPATH:

    PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.demo

It prints the tables and writes results/demo.json and results/demo.png.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import textwrap
import time
from pathlib import Path

from scripts.demo import replay as hr

DEFAULT_SWEEP = (1, 2, 3, 4, 6, 8, 10, 12, 16)
# The prototype's INT8 records (1,152 B per 1,024 payload bytes) and the goal.
PROTOTYPE_RATIO = 1.78
TARGET_RATIO = 1.93


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _parse_budgets(text: str) -> list[float]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if part:
            value = float(part)
            values.append(int(value) if value.is_integer() else value)
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=54_254, help="A: L2 token capacity")
    p.add_argument(
        "--budget", type=float, default=8, help="B: host budget in GB (--hicache-size)"
    )
    p.add_argument(
        "--sweep",
        type=_parse_budgets,
        default=list(DEFAULT_SWEEP),
        help="B: comma-separated host budgets in GB for the curve ('' to skip)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--groups", type=int, default=32, help="--gsp-num-groups")
    p.add_argument("--prompts-per-group", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--l1-tokens", type=int, default=16_384, help="device (L1) KV tokens"
    )
    p.add_argument(
        "--no-output-insert",
        action="store_true",
        help="do not insert output tokens into the tree at finish",
    )
    p.add_argument(
        "--no-commit",
        action="store_true",
        help="A: map the pools lazily instead of faulting their memory in",
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    p.add_argument("--name", default="demo", help="basename of the .json/.png")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    hr.setup_sglang()
    import sglang
    import torch

    geometry = hr.QWEN3_8B
    formats = hr.host_formats()
    base_label = formats[0][0]
    workload = hr.Workload(
        num_groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_prompt_len,
        question_len=args.question_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    serving = hr.Serving(
        l1_tokens=args.l1_tokens,
        concurrency=args.concurrency,
        insert_output=not args.no_output_insert,
    )
    requests = hr.make_workload(workload)
    best = hr.best_possible_hit_rate(requests)
    t_setup = time.perf_counter() - t_start

    print(
        f"HiQCache demo: SGLang {sglang.__version__} + HiQCache patches "
        f"({Path(sglang.__file__).resolve().parent.parent}), CPU only "
        f"({platform.machine()}, torch {torch.__version__})"
    )
    print(f"model geometry: {geometry.describe()}")
    print(
        f"host formats (--hicache-host-dtype): "
        + ", ".join(f"{label} ({dt})" for label, dt in formats)
    )
    print(
        "CPU stand-ins (tests/cpu_standins.py): torchvision stub, pure-torch "
        "transfer_kv_direct, no cudaHostRegister"
    )
    print()

    # ---- A: same L2 capacity -> host bytes ---------------------------------
    t0 = time.perf_counter()
    alloc = [
        hr.allocate_host_pool(
            dt, args.tokens, geometry, commit=not args.no_commit, label=label
        )
        for label, dt in formats
    ]
    t_a = time.perf_counter() - t0
    base = alloc[0]
    print(
        f"A) Same L2 capacity: {args.tokens:,} tokens "
        f"(real host pools, layout page_first; bytes read from the allocated buffers)"
    )
    print(
        f"   {'format':<7} {'host pool class':<26} {'B/token':>9} {'host bytes':>12} "
        f"{'resident':>10} {'vs ' + base.label:>8}"
    )
    for a in alloc:
        resident = _gb(a.resident_bytes) if a.committed else "lazy"
        print(
            f"   {a.label:<7} {a.pool_class:<26} {a.bytes_per_token:>9,} {_gb(a.bytes):>12} "
            f"{resident:>10} {a.bytes / base.bytes:>7.3f}x"
        )
    for a in alloc:
        if a.note:
            print(f"   note ({a.label}): {a.note}")
    print()

    # ---- B: same host budget -> tokens and hit rate ------------------------
    budgets = sorted(set(args.sweep) | {args.budget})
    t0 = time.perf_counter()
    sweep = []
    for gb in budgets:
        row = {"budget_gb": gb, "formats": {}}
        for label, dt in formats:
            cap = hr.capacity_at_budget(dt, gb, geometry, label=label)
            res = hr.replay(
                dt, cap.tokens, workload, serving, label=label, requests=requests
            )
            row["formats"][label] = {"capacity": cap, "replay": res}
        sweep.append(row)
    t_b = time.perf_counter() - t0
    main_row = next(r for r in sweep if r["budget_gb"] == args.budget)

    print(
        f"B) Same host budget: --hicache-size {args.budget:g} (GB), "
        f"capacities from SGLang's build_kv_host_pool at {geometry.name}"
    )
    print(
        f"   workload: generated-shared-prefix, {workload.num_groups} groups x "
        f"{workload.prompts_per_group} prompts = {workload.num_requests} requests, system prompt "
        f"{workload.system_prompt_len:,} + question {workload.question_len} tokens, "
        f"output {workload.output_len} tokens, seed {workload.seed}, shuffled"
    )
    print(
        f"   serving: concurrency {serving.concurrency} (requests in flight), L1 "
        f"{serving.l1_tokens:,} tokens, --hicache-write-policy {serving.write_policy}, "
        f"output tokens {'inserted' if serving.insert_output else 'not inserted'} at finish"
    )
    print(
        f"   replay: SGLang's UnifiedRadixCache + HiCache with L2 pools of exactly these "
        f"token counts, tiny KV rows ({hr.REPLAY_GEOMETRY.layer_num} layers x "
        f"{hr.REPLAY_GEOMETRY.head_num} head x {hr.REPLAY_GEOMETRY.head_dim} dims), "
        f"layout layer_first, io backend direct"
    )
    print(
        f"   {'format':<7} {'L2 tokens':>10} {'vs ' + base_label:>8} {'hit rate':>9} "
        f"{'L1 hits':>9} {'L2 hits':>9} {'prompt tokens':>14}"
    )
    base_tokens = main_row["formats"][base_label]["capacity"].tokens
    for label, _ in formats:
        cap = main_row["formats"][label]["capacity"]
        res = main_row["formats"][label]["replay"]
        print(
            f"   {label:<7} {cap.tokens:>10,} {cap.tokens / base_tokens:>7.3f}x "
            f"{100 * res.hit_rate:>8.1f}% {res.l1_hit_tokens:>9,} {res.l2_hit_tokens:>9,} "
            f"{res.prompt_tokens:>14,}"
        )
    print(
        f"   best possible hit rate for this workload (unbounded cache): {100 * best:.1f}%"
    )
    print()

    if len(sweep) > 1:
        print("   sweep: hit rate (L2 tokens) by host budget")
        header = "   " + f"{'GB':>5}" + "".join(f" {label:>20}" for label, _ in formats)
        print(header)
        for row in sweep:
            cells = ""
            for label, _ in formats:
                cap = row["formats"][label]["capacity"]
                res = row["formats"][label]["replay"]
                cells += f" {100 * res.hit_rate:>8.1f}% ({cap.tokens:>8,})"
            print(f"   {row['budget_gb']:>5g}{cells}")
        print()

    # ---- checks, ratios, notes --------------------------------------------
    checks = []
    for row in sweep:
        b = row["formats"][base_label]
        for label, _ in formats[1:]:
            f = row["formats"][label]
            checks.append(f["capacity"].tokens >= b["capacity"].tokens)
            checks.append(f["replay"].hit_rate >= b["replay"].hit_rate)
    print("   restored KV checked against what was written, at every admission:")
    for label, dt in formats:
        res = main_row["formats"][label]["replay"]
        kind = "bit-exact" if dt == "auto" else "within the INT8 bound"
        print(
            f"     {label}: {res.verified_tokens:,} prefix tokens ({res.verified_restored_tokens:,} "
            f"loaded back from L2), {kind}, max error {100 * res.max_restore_error:.2f}% of row amax"
        )
    notes = textwrap.wrap(
        f"replay model: {hr.MODEL_NOTES}.", width=100, break_on_hyphens=False
    )
    print("\n".join("   " + line for line in notes))
    print()

    summary = {}
    for label, _ in formats[1:]:
        a_ratio = base.bytes / next(a for a in alloc if a.label == label).bytes
        b_ratio = main_row["formats"][label]["capacity"].tokens / base_tokens
        hit_b = main_row["formats"][base_label]["replay"].hit_rate
        hit_f = main_row["formats"][label]["replay"].hit_rate
        summary[label] = dict(
            bytes_ratio=a_ratio,
            tokens_ratio=b_ratio,
            hit_rate=hit_f,
            hit_rate_base=hit_b,
        )
        verdict = "meets" if b_ratio >= TARGET_RATIO else "MISSES"
        print(
            f"{label} vs {base_label}: A) {a_ratio:.3f}x less host memory for "
            f"{args.tokens:,} tokens | B) {b_ratio:.3f}x tokens in {args.budget:g} GB, "
            f"hit rate {100 * hit_f:.1f}% vs {100 * hit_b:.1f}% "
            f"({100 * (hit_f - hit_b):+.1f} points) | target >= {TARGET_RATIO}x "
            f"({verdict}; prototype {PROTOTYPE_RATIO}x)"
        )
    never_worse = all(checks)
    print(
        f"INT8 never holds fewer tokens nor has a lower hit rate at any budget: "
        f"{'yes' if never_worse else 'NO'}"
    )

    # ---- files ---------------------------------------------------------------
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{args.name}.json"
    png_path = args.out / f"{args.name}.png"
    t_total = time.perf_counter() - t_start
    data = {
        "command": " ".join(
            [
                "PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.demo",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "sglang_version": sglang.__version__,
        "geometry": {
            "name": geometry.name,
            "layer_num": geometry.layer_num,
            "head_num": geometry.head_num,
            "head_dim": geometry.head_dim,
            "dtype": str(geometry.dtype),
        },
        "formats": [
            {"label": label, "hicache_host_dtype": dt} for label, dt in formats
        ],
        "experiment_a": [vars(a) for a in alloc],
        "experiment_b": {
            "budget_gb": args.budget,
            "workload": vars(workload)
            | {"bench_serving_args": workload.bench_serving_args()},
            "serving": vars(serving),
            "best_possible_hit_rate": best,
            "replay_model": hr.MODEL_NOTES,
            "sweep": [
                {
                    "budget_gb": row["budget_gb"],
                    "formats": {
                        label: {
                            "capacity": vars(v["capacity"]),
                            "replay": v["replay"].to_json(),
                        }
                        for label, v in row["formats"].items()
                    },
                }
                for row in sweep
            ],
        },
        "summary": summary,
        "int8_never_worse": never_worse,
        "seconds": {
            "setup": t_setup,
            "experiment_a": t_a,
            "experiment_b": t_b,
            "total": t_total,
        },
    }
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    backend = plot_sweep(
        sweep,
        formats,
        best,
        args.budget,
        png_path,
        title=f"{geometry.name}: {workload.num_requests} shared-prefix requests, "
        f"concurrency {serving.concurrency}, L1 {serving.l1_tokens:,} tokens",
    )
    print(
        f"wrote {json_path} and {png_path} ({backend}); "
        f"time: setup {t_setup:.0f}s, A {t_a:.0f}s, B {t_b:.0f}s, total {t_total:.0f}s"
    )
    return 0 if never_worse else 1


# --------------------------------------------------------------------------
# Plot: matplotlib when installed, otherwise Pillow
# --------------------------------------------------------------------------

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]


def _series(sweep, formats):
    xs = [row["budget_gb"] for row in sweep]
    out = []
    for i, (label, _) in enumerate(formats):
        hits = [100 * row["formats"][label]["replay"].hit_rate for row in sweep]
        toks = [row["formats"][label]["capacity"].tokens / 1000 for row in sweep]
        out.append((label, COLORS[i % len(COLORS)], hits, toks))
    return xs, out


def plot_sweep(sweep, formats, best, budget, path: Path, title: str = "") -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_pillow(sweep, formats, best, budget, path, title)
        return "Pillow"
    xs, series = _series(sweep, formats)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, color, hits, toks in series:
        ax1.plot(xs, hits, "o-", color=color, label=label)
        ax2.plot(xs, toks, "o-", color=color, label=label)
    ax1.axhline(100 * best, ls="--", color="gray", label="best possible")
    for ax in (ax1, ax2):
        ax.axvline(budget, ls=":", color="gray")
        ax.set_xlabel("host budget, GB (--hicache-size)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("cache-hit rate, % of prompt tokens")
    ax1.set_ylim(0, 100)
    ax2.set_ylabel("L2 capacity, thousand tokens")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _nice_step(raw: float) -> float:
    """1, 2, 2.5 or 5 times a power of ten, at least `raw`."""
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _plot_pillow(sweep, formats, best, budget, path: Path, title: str) -> None:
    from PIL import Image, ImageDraw, ImageFont

    W, H = 1320, 560
    img = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=15)
        small = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1
        font = small = ImageFont.load_default()
    xs, series = _series(sweep, formats)
    draw.text((W // 2, 14), title, fill="black", font=font, anchor="mt")
    x_max = max(xs) * 1.04
    top_tokens = max(max(s[3]) for s in series)
    step = _nice_step(top_tokens / 5)
    panels = [
        (
            "cache-hit rate, % of prompt tokens",
            0,
            100.0,
            [s[2] for s in series],
            100 * best,
        ),
        (
            "L2 capacity, thousand tokens",
            0,
            step * math.ceil(top_tokens * 1.02 / step),
            [s[3] for s in series],
            None,
        ),
    ]
    for p, (ylabel, y_min, y_max, ys_list, hline) in enumerate(panels):
        left = 90 + p * (W // 2)
        right = left + W // 2 - 130
        top, bottom = 60, H - 70
        sx = lambda x: left + (right - left) * x / x_max  # noqa: E731
        sy = lambda y: bottom - (bottom - top) * (y - y_min) / (
            y_max - y_min
        )  # noqa: E731
        draw.rectangle([left, top, right, bottom], outline="black")
        ticks = round((y_max - y_min) / _nice_step((y_max - y_min) / 5))
        for i in range(ticks + 1):
            y = y_min + (y_max - y_min) * i / ticks
            draw.line([left, sy(y), right, sy(y)], fill="#e6e6e6")
            draw.text(
                (left - 8, sy(y)), f"{y:.0f}", fill="black", font=small, anchor="rm"
            )
        for x in xs:
            draw.line([sx(x), bottom, sx(x), bottom + 5], fill="black")
            draw.text(
                (sx(x), bottom + 8), f"{x:g}", fill="black", font=small, anchor="mt"
            )
        draw.text(
            ((left + right) // 2, bottom + 30),
            "host budget, GB (--hicache-size)",
            fill="black",
            font=font,
            anchor="mt",
        )
        label_img = Image.new("RGBA", (bottom - top, 22), (255, 255, 255, 0))
        ImageDraw.Draw(label_img).text(
            ((bottom - top) // 2, 11), ylabel, fill="black", font=font, anchor="mm"
        )
        label_img = label_img.rotate(90, expand=True)
        img.paste(label_img, (left - 75, top), label_img)
        bx = sx(budget)
        for y in range(top, bottom, 8):
            draw.line([bx, y, bx, y + 3], fill="gray")
        legend = [(label, color) for label, color, _, _ in series]
        if hline is not None:
            for x in range(int(left), int(right), 12):
                draw.line([x, sy(hline), x + 6, sy(hline)], fill="gray", width=2)
            legend.append(("best possible", "gray"))
        for (label, color, _, _), ys in zip(series, ys_list):
            pts = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
            draw.line(pts, fill=color, width=3)
            for x, y in pts:
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        for i, (label, color) in enumerate(legend):
            ly = top + 12 + 20 * i
            draw.line([left + 12, ly, left + 36, ly], fill=color, width=3)
            draw.text((left + 42, ly), label, fill="black", font=small, anchor="lm")
    img.save(path)


if __name__ == "__main__":
    sys.exit(main())
