#!/usr/bin/env python3
"""CPU cost of sealing L3 pages next to the page I/O it guards (--mooncake: a
real mooncake_master, its CRC-64 off and on). Figures: docs/l3-integrity.md."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from scripts.common.cpu_sglang import install_cpu_standins


def best(fn, repeat: int) -> float:
    """Fastest of `repeat` runs, in seconds (the machine is shared)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def mooncake_worker(metadata: str, master: str, nbytes: int, repeat: int) -> None:
    """One client: best put and get of one page object, in µs (stdout)."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    segment = max(4 * nbytes, 64 << 20)
    rc = store.setup("127.0.0.1", metadata, segment, segment, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    page = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    keys = iter(range(10**6))

    def put():
        put.key = f"bench-{next(keys)}"
        if store.put(put.key, page) != 0:
            raise RuntimeError("put failed")

    t_put = best(put, repeat)
    t_get = best(lambda: store.get(put.key), repeat)
    if store.get(put.key) != page:
        raise RuntimeError("get returned other bytes")
    print(f"{t_put * 1e6:.0f} {t_get * 1e6:.0f}")
    store.close()


def mooncake_rows(nbytes: int, repeat: int) -> None:
    from scripts.rigs.l3_harness import MooncakeMaster

    with tempfile.TemporaryDirectory() as tmp:
        master = MooncakeMaster(os.path.join(tmp, "master.log")).start()
        try:
            cfg = master.storage_config()
            print("\n| Mooncake put/get, int8 page | put µs | get µs |")
            print("|---|---:|---:|")
            for checksum, label in (("0", "CRC-64 off"), ("1", "CRC-64 on")):
                out = subprocess.run(
                    [sys.executable, "-m", "scripts.bench.l3_integrity",
                     "--mooncake-worker", cfg["metadata_server"],
                     cfg["master_server_address"], str(nbytes), str(repeat)],
                    env={**os.environ, "MOONCAKE_STORE_CHECKSUM": checksum},
                    capture_output=True, text=True, check=True,
                ).stdout.split()  # fmt: skip
                setting = f"MOONCAKE_STORE_CHECKSUM={checksum} ({label})"
                print(f"| {setting} | {out[-2]} | {out[-1]} |")
        finally:
            master.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="buffer for the GB/s figure")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--mooncake", action="store_true", help="also Mooncake put/get, CRC-64 off/on"
    )
    ap.add_argument("--mooncake-worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mooncake_worker:
        metadata, master, nbytes, repeat = args.mooncake_worker
        mooncake_worker(metadata, master, int(nbytes), int(repeat))
        return

    install_cpu_standins()
    import numpy as np
    import torch
    import xxhash

    from scripts.bench.codec import LAYERS, format_classes, make_format
    from sglang.srt.mem_cache.pool_host import page_integrity as pi
    from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat

    buf = np.random.default_rng(0).integers(0, 256, args.mib << 20, dtype=np.uint8)
    dst = np.empty_like(buf)
    gb = buf.nbytes / 1e9
    t_hash = best(lambda: xxhash.xxh3_64_intdigest(buf), args.repeat)
    t_copy = best(lambda: np.copyto(dst, buf), args.repeat)
    print(
        f"xxh3-64: {gb / t_hash:.1f} GB/s; memcpy: {gb / t_copy:.1f} GB/s "
        f"({args.mib} MiB, one core, best of {args.repeat})\n"
    )

    cases = [
        (name, LAYERS, make_format(cls, args.page_size))
        for name, cls in format_classes().items()
    ]
    # MLA at DeepSeek-V3 geometry (61 layers, latent 512 + RoPE 64).
    mla = MLAInt8HostFormat((576,), 1, args.page_size, torch.bfloat16)
    cases.append(("mla-int8 (DeepSeek-V3)", 61, mla))
    print(
        "| format | page bytes | seal µs | check µs | file write µs | file read µs | seal+check / file I/O |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, n_layers, f in cases:
            nbytes = f.unit_bytes() * n_layers
            page = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
            sealer = pi.PageSealer(f"{name}|bench", (nbytes,), pi.PageIntegrityStats())
            seal = sealer.seal(0, "key", [page])
            reps = 5 * args.repeat  # seal and check take microseconds
            t_seal = best(lambda: sealer.seal(0, "key", [page]), reps)
            t_check = best(lambda: sealer.check(0, "key", [page], seal), reps)
            path = os.path.join(tmp, "page.bin")
            sealed = np.concatenate([page, np.frombuffer(seal, np.uint8)])
            t_write = best(lambda: sealed.tofile(path), args.repeat)
            target = np.empty_like(sealed)

            def read():
                with open(path, "rb", buffering=0) as fh:
                    fh.readinto(memoryview(target))

            t_read = best(read, args.repeat)
            ratio = (t_seal + t_check) / (t_write + t_read)
            print(
                f"| {name} | {nbytes} | {t_seal * 1e6:.0f} | {t_check * 1e6:.0f} "
                f"| {t_write * 1e6:.0f} | {t_read * 1e6:.0f} | {ratio:.0%} |"
            )
            if name == "int8":
                int8_bytes = nbytes + len(seal)
    if args.mooncake:
        mooncake_rows(int8_bytes, args.repeat)


if __name__ == "__main__":
    main()
