#!/usr/bin/env python3
"""CPU benchmark of the INT8 KV codec (pool_host/kv_int8_codec.py).

1. Throughput of the fast path (quantize_into / dequantize_into) at Qwen3-8B
   KV geometry (36 layers, 8 KV heads x 128 dims, bf16), against a plain BF16
   gather + copy of the same tokens, which is what the stock host pool does.
   Every op covers all (K|V, layer) slabs of the token set, one call per slab,
   as the layer_first host layout stores them ([2, layers, tokens, heads, dim]).
2. Bytes per token, stock BF16 host pool vs INT8 + FP16 scales.
3. The measurement behind FP16 (not BF16) scales: relative error of the same
   round-up format with either scale dtype, on gaussian and heavy-tailed data.

Run: PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.bench.codec
(`make bench-codec`). Uses torch's default thread count; < 1 minute.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch


def load_codec():
    """Load kv_int8_codec.py from the sglang on the path (the patched tree)
    without running sglang's package __init__s: they pull in the whole server
    (and torchvision), which a CPU-only venv can't import and the codec,
    which needs only torch, doesn't use."""
    sglang_spec = importlib.util.find_spec("sglang")
    path = Path(sglang_spec.origin).parent / "srt/mem_cache/pool_host/kv_int8_codec.py"
    spec = importlib.util.spec_from_file_location("kv_int8_codec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


codec, CODEC_PATH = load_codec()

LAYERS, HEADS, HEAD_DIM = 36, 8, 128  # Qwen3-8B KV geometry
TOKEN_COUNTS = (1024, 4096)
WARMUP, REPS = 1, 5
COPY = "bf16 gather + copy (stock host pool)"
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def median_ms(ops: dict[str, object]) -> dict[str, tuple[float, float]]:
    """(median, min) wall time in ms of each op. Reps are interleaved (A, B,
    C, A, B, C, ...) so that load from elsewhere on the machine hits every op
    alike and the ratios stay meaningful."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(WARMUP + REPS):
        for name, fn in ops.items():
            start = time.perf_counter()
            fn()
            if rep >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {
        name: (statistics.median(t) * 1e3, min(t) * 1e3) for name, t in times.items()
    }


def bench_tokens(tokens: int, gen: torch.Generator) -> dict[str, tuple[float, float]]:
    """Time the stock copy and the codec ops for one token count."""
    # Device-pool stand-in with spare capacity; tokens picked at random
    # indices, as a write-back of scattered KV slots would.
    capacity = 2 * tokens
    # One random layer repeated: the speed doesn't depend on the values, and
    # drawing ~10^9 normals would take longer than the benchmark itself.
    layer = torch.randn(capacity, HEADS, HEAD_DIM, generator=gen)
    src = layer.to(torch.bfloat16).expand(2, LAYERS, *layer.shape).contiguous()
    idx = torch.randperm(capacity, generator=gen)[:tokens]
    host_idx = torch.randperm(tokens, generator=gen)
    slab = (tokens, HEADS, HEAD_DIM)
    stock = torch.empty(2, LAYERS, *slab, dtype=torch.bfloat16)
    q = torch.empty(2, LAYERS, *slab, dtype=torch.int8)
    scale = torch.empty(2, LAYERS, tokens, HEADS, dtype=codec.SCALE_DTYPE)
    stage = torch.empty(slab, dtype=torch.bfloat16)
    q_stage = torch.empty(slab, dtype=torch.int8)
    s_stage = torch.empty(slab[:-1], dtype=codec.SCALE_DTYPE)
    slabs = [(kv, layer) for kv in range(2) for layer in range(LAYERS)]
    gathered = src[:, :, idx].contiguous()  # codec-only input

    def copy():
        for kv, layer in slabs:
            torch.index_select(src[kv, layer], 0, idx, out=stock[kv, layer])

    def encode():
        for kv, layer in slabs:
            codec.quantize_into(gathered[kv, layer], q[kv, layer], scale[kv, layer])

    def gather_encode():
        for kv, layer in slabs:
            torch.index_select(src[kv, layer], 0, idx, out=stage)
            codec.quantize_into(stage, q[kv, layer], scale[kv, layer])

    def decode():
        for kv, layer in slabs:
            codec.dequantize_into(q[kv, layer], scale[kv, layer], stock[kv, layer])

    def gather_decode():
        for kv, layer in slabs:
            torch.index_select(q[kv, layer], 0, host_idx, out=q_stage)
            torch.index_select(scale[kv, layer], 0, host_idx, out=s_stage)
            codec.dequantize_into(q_stage, s_stage, stock[kv, layer])

    return median_ms(
        {
            COPY: copy,
            "encode: quantize_into": encode,
            "encode: gather + quantize_into": gather_encode,
            "decode: dequantize_into -> bf16": decode,
            "decode: gather int8+scale + dequantize": gather_decode,
        }
    )


def bench_throughput() -> None:
    print(
        f"== throughput: {LAYERS} layers x K,V x {HEADS} heads x {HEAD_DIM} dims, "
        f"bf16, torch threads={torch.get_num_threads()}, median of {REPS} =="
    )
    header = (
        f"{'tokens':>6}  {'op':<40} {'median ms':>9} {'GB/s':>6} {'x copy':>6}"
        f" {'min ms':>8} {'x copy':>6}"
    )
    print(header)
    print("-" * len(header))
    gen = torch.Generator().manual_seed(0)
    for tokens in TOKEN_COUNTS:
        results = bench_tokens(tokens, gen)
        nbytes = 2 * LAYERS * tokens * HEADS * HEAD_DIM * 2  # bf16 K and V
        # One baseline for both directions: the stock pool's load (host ->
        # device) is the same gather + copy of bf16 rows as its write-back.
        copy_med, copy_min = results[COPY]
        for name, (med, low) in results.items():
            gbps = nbytes / (med * 1e-3) / 1e9
            print(
                f"{tokens:>6}  {name:<40} {med:>9.1f} {gbps:>6.2f} "
                f"{med / copy_med:>6.2f} {low:>8.1f} {low / copy_min:>6.2f}"
            )
    print("GB/s: bf16 bytes of the token set's K and V (2*L*tokens*H*D*2) / median.")
    print()


def bytes_per_token() -> None:
    stock = 2 * LAYERS * HEADS * HEAD_DIM * 2
    int8 = 2 * LAYERS * HEADS * HEAD_DIM + 2 * LAYERS * HEADS * 2
    print("== host bytes per token ==")
    print(f"stock bf16 (2*L*H*D*2):            {stock}")
    print(f"int8 + fp16 scales (2*L*H*D + 2*L*H*2): {int8}")
    print(f"ratio int8/stock: {int8 / stock:.4f}  ({stock / int8:.3f}x more tokens)")
    print()


def quantize_with_scale_dtype(
    x: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's format with a choice of scale dtype (same round-up rule)."""
    xf = x.to(torch.float32)
    s32 = xf.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    s = s32.to(scale_dtype)
    next_up = (s.view(torch.int16) + 1).view(scale_dtype)
    s = torch.where(s.to(torch.float32) < s32, next_up, s)
    q = torch.round(xf / s.to(torch.float32).unsqueeze(-1)).clamp(-127, 127)
    return q.to(torch.int8), s


def scale_dtype_errors() -> None:
    rows = 65536
    gen = torch.Generator().manual_seed(1)
    data = {
        "gaussian": torch.randn(rows, HEAD_DIM, generator=gen),
        # Student-t, 3 dof: z / sqrt(chi2_3 / 3)
        "student-t(3)": torch.randn(rows, HEAD_DIM, generator=gen)
        / (torch.randn(rows, HEAD_DIM, 3, generator=gen).square().mean(-1).sqrt()),
    }
    print(
        f"== scale dtype: error of the same round-up format, {rows} bf16 rows x "
        f"{HEAD_DIM} =="
    )
    print("rel = ||x - x^|| / ||x|| per row; step = max|x - x^| / (amax/127)")
    header = (
        f"{'data':<13} {'scale':<5} {'out':<5} {'mean rel':>10} {'max rel':>10} "
        f"{'mean s/(amax/127)-1':>20} {'max step':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, x32 in data.items():
        x = x32.to(torch.bfloat16)
        xd = x.double()
        amax = xd.abs().amax(-1)
        for scale_dtype in (torch.float16, torch.bfloat16):
            q, s = quantize_with_scale_dtype(x, scale_dtype)
            if scale_dtype == codec.SCALE_DTYPE:  # it is the codec's format
                rq, rs = codec.quantize_reference(x)
                assert torch.equal(q, rq) and torch.equal(s, rs)
            excess = (s.double() / (amax / 127) - 1).mean().item()
            for out in (torch.bfloat16, torch.float32):
                xh = (q.to(torch.float32) * s.to(torch.float32).unsqueeze(-1)).to(out)
                err = (xd - xh.double()).abs()
                rel = err.norm(dim=-1) / xd.norm(dim=-1)
                step = (err.amax(-1) / (amax / 127)).max().item()
                print(
                    f"{name:<13} {SHORT[scale_dtype]:<5} {SHORT[out]:<5} "
                    f"{rel.mean().item():>10.3e} {rel.max().item():>10.3e} "
                    f"{excess:>20.2e} {step:>9.4f}"
                )
    print()


def main() -> None:
    print(f"codec: {CODEC_PATH}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    start = time.perf_counter()
    bytes_per_token()
    scale_dtype_errors()
    bench_throughput()
    print(
        f"total {time.perf_counter() - start:.1f} s; load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (other work on the machine inflates the times)"
    )


if __name__ == "__main__":
    main()
