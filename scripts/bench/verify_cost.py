#!/usr/bin/env python3
"""CPU cost of the sampled restore check (SGLANG_HICACHE_VERIFY_SAMPLE_RATE):
an encoded host pool's backup timed with the check off, at the default rate
and at every page, side by side on one pool (docs/operations.md).

    PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.bench.verify_cost
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scripts.common.cpu_sglang import install_cpu_standins

LAYERS, HEADS, HEAD_DIM, PAGE = 36, 8, 128, 64  # Qwen3-8B KV geometry, page 64


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int8,int4,int4r")
    parser.add_argument("--tokens", type=int, default=512, help="per backup")
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)

    install_cpu_standins()
    torch.set_num_threads(1)
    from sglang.srt.mem_cache.pool_host.backup_verify import BackupVerifier
    from scripts.rigs.hicache_harness import Geometry, fill_random, make_rig

    geo = Geometry(LAYERS, HEADS, HEAD_DIM, page_size=PAGE)
    print(
        f"backup of {args.tokens} tokens ({args.tokens // PAGE} pages of {PAGE}), "
        f"{LAYERS} layers x {HEADS} heads x {HEAD_DIM}, bf16, page_first, torch "
        f"path, 1 thread; median of {args.reps} interleaved reps"
    )
    print("| format | off ms | rate 0.001 ms | rate 1 ms | check per page ms |")
    print("|---|---:|---:|---:|---:|")
    for name in args.formats.split(","):
        rig = make_rig(geo, device_tokens=2 * args.tokens, host_tokens=2 * args.tokens,
                       layout="page_first", host_dtype=name)  # fmt: skip
        pool = rig.host_pool
        dev = rig.allocator.alloc(args.tokens)
        fill_random(rig.device_pool, dev)
        host = pool.alloc(args.tokens)
        verifiers = {
            "off": None,
            "0.001": BackupVerifier(pool.transfer_context, pool.page_size, 0.001),
            "1": BackupVerifier(pool.transfer_context, pool.page_size, 1.0),
        }
        times = {key: [] for key in verifiers}
        for rep in range(args.reps + 1):
            for key, verifier in verifiers.items():
                pool.backup_verifier = verifier
                start = time.perf_counter()
                pool.backup_from_device_all_layer(rig.device_pool, host, dev, "direct")
                if rep:
                    times[key].append((time.perf_counter() - start) * 1e3)
                if verifier is not None:
                    verifier.drain()
        ms = {key: statistics.median(t) for key, t in times.items()}
        pages = args.tokens // PAGE
        per_page = (ms["1"] - ms["off"]) / pages
        print(
            f"| {name} | {ms['off']:.1f} | {ms['0.001']:.1f} | {ms['1']:.1f} | "
            f"{per_page:.2f} (sampled {verifiers['0.001'].pages_checked} of "
            f"{pages * (args.reps + 1)} pages at 0.001) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
