#!/usr/bin/env python3
"""CPU benchmark of every host (L2) format's torch path against a plain copy
(`make bench-codec`; docs/results.md); the fused kernels: scripts/gpu_bench.py."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from scripts.common.cpu_sglang import install_cpu_standins
from scripts.common.host_formats import host_formats

LAYERS, HEADS, HEAD_DIM = 36, 8, 128  # Qwen3-8B KV geometry
DEVICE_DTYPE = torch.bfloat16
PAGE_SIZE = 64
PAGE_SIZES = (1, 16, 64)
TOKEN_COUNTS = (1024, 4096)
WARMUP, REPS = 1, 5
COPY = "bf16 gather + copy (stock host pool)"


def format_classes() -> dict[str, type]:
    """--hicache-host-dtype value -> its format class, for every quantized
    registered format."""
    install_cpu_standins()
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    quantized = [f.host_dtype for f in host_formats() if not f.stock]
    return {name: host_format_cls(name) for name in quantized}


def make_format(cls, unit_tokens: int = PAGE_SIZE):
    return cls((HEAD_DIM, HEAD_DIM), HEADS, unit_tokens, DEVICE_DTYPE)


def median_ms(ops: dict[str, object], reps: int) -> dict[str, tuple[float, float]]:
    """(median, min) ms of each op; reps interleave so load hits every op alike."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(WARMUP + reps):
        for name, fn in ops.items():
            start = time.perf_counter()
            fn()
            if rep >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {n: (statistics.median(t) * 1e3, min(t) * 1e3) for n, t in times.items()}


class DeviceStandIn:
    """A device pool's K and V per layer and random slots a transfer touches."""

    def __init__(self, tokens: int, gen: torch.Generator):
        capacity = 2 * tokens
        # One random layer repeated: the speed doesn't depend on the values,
        # and drawing ~10^9 normals would take longer than the benchmark.
        layer = torch.randn(capacity, HEADS, HEAD_DIM, generator=gen)
        self.kv = layer.to(DEVICE_DTYPE).expand(2, LAYERS, *layer.shape).contiguous()
        self.idx = torch.randperm(capacity, generator=gen)[:tokens]
        self.tokens = tokens


def copy_op(dev: DeviceStandIn):
    stock = torch.empty(2, LAYERS, dev.tokens, HEADS, HEAD_DIM, dtype=DEVICE_DTYPE)

    def copy():
        for kv in range(2):
            for layer in range(LAYERS):
                torch.index_select(dev.kv[kv, layer], 0, dev.idx, out=stock[kv, layer])

    return copy


def format_ops(name: str, fmt, dev: DeviceStandIn) -> tuple[dict, dict]:
    """encode / decode of all layers, with and without the gather / scatter."""
    units = dev.tokens // PAGE_SIZE
    unit_shape = (units, PAGE_SIZE, HEADS, HEAD_DIM)
    records = {
        r.name: torch.empty(LAYERS, units, *r.shape, dtype=r.dtype) for r in fmt.records
    }
    per_layer = [{n: t[layer] for n, t in records.items()} for layer in range(LAYERS)]
    # The codec-only input: the token set's rows, already gathered.
    gathered = dev.kv[:, :, dev.idx].contiguous()
    staging = [torch.empty(unit_shape, dtype=DEVICE_DTYPE) for _ in range(2)]
    restored = [torch.empty(unit_shape, dtype=DEVICE_DTYPE) for _ in range(2)]
    staging_rows = [t.view(-1, HEADS, HEAD_DIM) for t in staging]
    restored_rows = [t.view(-1, HEADS, HEAD_DIM) for t in restored]
    scatter_into = dev.kv.clone()

    def encode():
        for layer in range(LAYERS):
            rows = [gathered[kv, layer].view(unit_shape) for kv in range(2)]
            fmt.encode_into(rows, per_layer[layer])

    def gather_encode():
        for layer in range(LAYERS):
            for kv in range(2):
                torch.index_select(dev.kv[kv, layer], 0, dev.idx, out=staging_rows[kv])
            fmt.encode_into(staging, per_layer[layer])

    def decode():
        for layer in range(LAYERS):
            fmt.decode_into(per_layer[layer], restored)

    def decode_scatter():
        for layer in range(LAYERS):
            fmt.decode_into(per_layer[layer], restored)
            for kv in range(2):
                scatter_into[kv, layer].index_copy_(0, dev.idx, restored_rows[kv])

    encode()  # records hold real codes before the first decode is timed
    ops = {
        f"{name} encode_into": encode,
        f"{name} gather + encode_into": gather_encode,
        f"{name} decode_into -> bf16": decode,
        f"{name} decode_into + scatter": decode_scatter,
    }
    return ops, {"gathered": gathered, "records": records, "restored": restored}


def bench_throughput(classes, token_counts, reps) -> dict:
    print(
        f"== throughput: {LAYERS} layers x K,V x {HEADS} heads x {HEAD_DIM} dims, "
        f"bf16, page size {PAGE_SIZE}, torch threads={torch.get_num_threads()}, "
        f"median of {reps} =="
    )
    header = (
        f"{'tokens':>6}  {'op':<36} {'median ms':>9} {'GB/s':>6} {'x copy':>6}"
        f" {'min ms':>8} {'x copy':>6}"
    )
    print(header, "-" * len(header), sep="\n")
    gen = torch.Generator().manual_seed(0)
    out = {}
    for tokens in token_counts:
        dev = DeviceStandIn(tokens, gen)
        ops = {COPY: copy_op(dev)}
        for name, cls in classes.items():
            ops.update(format_ops(name, make_format(cls), dev)[0])
        results = median_ms(ops, reps)
        nbytes = 2 * LAYERS * tokens * HEADS * HEAD_DIM * 2  # bf16 K and V
        # One baseline for both directions: the stock pool's load (host ->
        # device) is the same gather + copy of bf16 rows as its write-back.
        copy_med, copy_min = results[COPY]
        for op, (med, low) in results.items():
            gbps = nbytes / (med * 1e-3) / 1e9
            print(
                f"{tokens:>6}  {op:<36} {med:>9.1f} {gbps:>6.2f} "
                f"{med / copy_med:>6.2f} {low:>8.1f} {low / copy_min:>6.2f}"
            )
        out[tokens] = results
    print("GB/s: bf16 bytes of the token set's K and V (2*L*tokens*H*D*2) / median.\n")
    return out


def bytes_per_token(classes) -> dict:
    stock = 2 * LAYERS * HEADS * HEAD_DIM * 2
    print(
        f"== host bytes per token, all {LAYERS} layers (tokens per host byte vs "
        "bf16 in brackets) =="
    )
    print(f"{'format':<7}" + "".join(f" {'page ' + str(p):>20}" for p in PAGE_SIZES))
    print(f"{'bf16':<7}" + "".join(f" {stock:>11,} (1.000x)" for _ in PAGE_SIZES))
    table = {}
    for name, cls in classes.items():
        row = table[name] = {
            p: LAYERS * cls.bytes_per_token_for((HEAD_DIM, HEAD_DIM), HEADS, p)
            for p in PAGE_SIZES
        }
        print(
            f"{name:<7}"
            + "".join(f" {row[p]:>11,.0f} ({stock / row[p]:.3f}x)" for p in PAGE_SIZES)
        )
    print()
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m scripts.bench.codec",
        description=__doc__.split("\n\n")[0],
        epilog=(
            "`make bench-codec` passes BENCH_ARGS (default: --threads 1, about 4 "
            "minutes on the shared 2-core VM; with two threads beside other work it "
            "did not finish in 15). --tokens 512 --reps 3 --threads 1: about 20 s."
        ),
    )
    p.add_argument(
        "--tokens",
        default=",".join(map(str, TOKEN_COUNTS)),
        help="comma list of token counts, each a multiple of the page size 64; the "
        "time grows with their sum (default: %(default)s)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=REPS,
        help=f"timed repetitions per op after {WARMUP} warm-up; the median and min "
        "are reported (default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's, one per core); 1 keeps "
        "the run fast beside other work, where spin-waiting threads stall",
    )
    args = p.parse_args(argv)
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: pass 1 or more")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads {args.threads}: pass 1 or more")
        torch.set_num_threads(args.threads)
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    bad = [t for t in token_counts if t <= 0 or t % PAGE_SIZE]
    if bad:
        raise SystemExit(f"--tokens: {bad} are not positive multiples of {PAGE_SIZE}")
    classes = format_classes()
    print(f"formats: {', '.join(f'{n} ({c.__module__})' for n, c in classes.items())}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    start = time.perf_counter()
    result = {"bytes_per_token": bytes_per_token(classes)}
    result["throughput"] = bench_throughput(classes, token_counts, args.reps)
    print(
        f"total {time.perf_counter() - start:.1f} s; load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (other work on the machine inflates the times)"
    )
    return result


if __name__ == "__main__":
    main()
