#!/usr/bin/env python3
"""`make demo-l3`: INT8 host pages in a real Mooncake L3 store, on CPU.

Store bytes per token and a shared-prefix hit rate (docs/results.md, "make demo-l3")."""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import tempfile
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

from scripts.common import plot
from scripts.common.cpu_sglang import REPO_ROOT as ROOT
from scripts.common.cpu_sglang import install_cpu_standins
from scripts.demo.report import table

FORMATS = (("bf16", "auto"), ("int8", "int8"))
MB = 1 << 20
# The Mooncake store's native dependencies (readelf -d mooncake/store.so,
# engine.so): soname -> Debian package (scripts/debian_deps.sh).
NATIVE_LIBS = {
    "libibverbs.so.1": "libibverbs1",
    "librdmacm.so.1": "librdmacm1",
    "libnuma.so.1": "libnuma1",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36, help="A: Qwen3-8B geometry")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=512, help="A: tokens written")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--groups", type=int, default=32, help="B: prefix groups")
    p.add_argument("--per-group", type=int, default=4, help="B: requests per group")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--b-layers", type=int, default=2, help="B: layers (A's head_dim)")
    p.add_argument("--b-kv-heads", type=int, default=2)
    p.add_argument("--l2-mb", type=float, default=8, help="B: L2 budget, MB")
    p.add_argument("--l3-mb", default="32,64,96", help="B: L3 store budgets, MB, a,b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "results")
    return p.parse_args(argv)


def missing_native_packages(libs: dict[str, str]) -> list[str]:
    """The Debian packages of the libraries in `libs` that the dynamic loader
    cannot open, checked in milliseconds instead of after SGLang's import."""
    missing = []
    for soname, package in libs.items():
        try:
            ctypes.CDLL(soname)
        except OSError:
            missing.append(package)
    return missing


def check_native_libs(libs: dict[str, str]) -> None:
    """Exits in one line naming the missing packages and the install command."""
    if missing := missing_native_packages(libs):
        sys.exit(
            f"demo-l3: Mooncake needs the Debian packages {' '.join(missing)}; "
            "install them with: sudo bash scripts/debian_deps.sh install"
        )


def setup():
    install_cpu_standins()
    from scripts.rigs import l3_harness as h

    if reason := h.mooncake_unavailable_reason():
        sys.exit(f"demo-l3 needs the Mooncake store: {reason}")
    return h


def bytes_per_token(h, args, workdir: Path) -> dict:
    from scripts.rigs.hicache_harness import Geometry

    geo = Geometry(args.layers, args.kv_heads, args.head_dim, page_size=args.page_size)
    tokens = list(range(args.tokens))
    out = {}
    for label, host_dtype in FORMATS:
        with h.MooncakeMaster(workdir / f"a-{label}.log") as master:
            per_token = geo.layer_num * geo.head_num * geo.head_dim * 4
            segment = max(64 * MB, 2 * args.tokens * per_token)
            config = master.storage_config(segment_bytes=segment)
            sizes = dict(device_tokens=args.tokens, host_tokens=args.tokens)
            l3 = h.make_l3_rig(
                "mooncake", config, host_dtype=host_dtype, geo=geo, **sizes
            )
            before = master.metrics()
            _, _, hashes, stored = h.write_through(l3, tokens)
            after = master.metrics()
            assert stored == len(hashes), "the store refused pages"
            stored_bytes = (
                after["master_allocated_bytes"] - before["master_allocated_bytes"]
            )
            out[label] = {
                "tokens": len(tokens),
                "objects": int(after["master_key_count"] - before["master_key_count"]),
                "store_bytes": int(stored_bytes),
                "bytes_per_token": stored_bytes / len(tokens),
                "host_bytes_per_token": l3.controller.mem_pool_host.get_size_per_token(),
            }
            l3.close()
    return out


def make_requests(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    tokens = lambda n: [rng.randrange(50_000) for _ in range(n)]  # noqa: E731
    requests = []
    for _ in range(args.groups):
        prefix = tokens(args.prefix_len)
        requests += [prefix + tokens(args.question_len) for _ in range(args.per_group)]
    rng.shuffle(requests)
    return requests


class PageLRU:
    """L2 as an LRU of whole pages (page hash -> host indices)."""

    def __init__(self, host_pool):
        self.pool = host_pool
        self.pages: OrderedDict[str, object] = OrderedDict()

    def touch(self, page_hash) -> bool:
        if page_hash in self.pages:
            self.pages.move_to_end(page_hash)
            return True
        return False

    def make_room(self, n: int) -> None:
        while self.pool.available_size() < n and self.pages:
            _, host = self.pages.popitem(last=False)
            self.pool.free(host)

    def add(self, hashes, host, page_size):
        for i, page_hash in enumerate(hashes):
            self.pages[page_hash] = host[i * page_size : (i + 1) * page_size]


def fetch_from_l3(h, ctl, l2: PageLRU, rid, tokens, hashes, first: int, ps: int) -> int:
    """L3 -> L2 for the pages after the first `first`; the tokens delivered."""
    last_hash = hashes[first - 1] if first else None
    op = ctl.prefetch(rid, tokens[first * ps :] + [0], last_hash=last_hash)
    queried = ctl.prefetch_hit_queue.get(timeout=h.STORAGE_WAIT_S)
    assert queried is op
    if not op.storage_hit_count:
        return 0
    l2.make_room(op.storage_hit_count)
    host = ctl.mem_pool_host.alloc(op.storage_hit_count)
    op.host_indices = host
    ctl.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=h.STORAGE_WAIT_S)
        if ack.completed_tokens is not None:
            done = ack.completed_tokens
        if ack.completed_req:
            break
    ctl.mem_pool_host.free(host[done:])
    l2.add(hashes[first : first + done // ps], host[:done], ps)
    return done


def write_new(h, l3, l2: PageLRU, tokens, hashes, seed: int) -> None:
    """New KV for `tokens` (pages `hashes`): device -> L2 -> L3."""
    from scripts.rigs.hicache_harness import fill_random, finish_transfers

    ctl, rig = l3.controller, l3.rig
    dev = rig.allocator.alloc(len(tokens))
    fill_random(rig.device_pool, dev, seed=seed)
    l2.make_room(len(tokens))
    host = ctl.write(dev, node_id=0)
    finish_transfers(ctl)
    l2.add(hashes, host, l3.geo.page_size)
    ctl.write_storage(host, tokens, hash_value=hashes)
    ctl.ack_backup_queue.get(timeout=h.STORAGE_WAIT_S)
    rig.allocator.free(dev)


def hit_rate(h, args, host_dtype: str, l3_bytes: int, requests, workdir: Path) -> dict:
    from scripts.rigs.hicache_harness import Geometry
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ps = args.page_size
    geo = Geometry(args.b_layers, args.b_kv_heads, args.head_dim, page_size=ps)
    longest = max(len(r) for r in requests)
    with h.MooncakeMaster(
        workdir / f"b-{host_dtype}-{l3_bytes}.log",
        extra_args=("--default_kv_lease_ttl=50",),
    ) as master:
        make_rig = partial(h.make_l3_rig, host_dtype=host_dtype, geo=geo)
        store = h.file_storage_config(workdir / "probe")
        probe = make_rig("file", store, device_tokens=ps, host_tokens=ps)
        per_token = probe.controller.mem_pool_host.get_size_per_token()
        probe.close()
        l2_tokens = int(args.l2_mb * MB / per_token) // ps * ps
        l3 = make_rig(
            "mooncake",
            master.storage_config(segment_bytes=l3_bytes),
            device_tokens=longest + ps,
            host_tokens=max(l2_tokens, longest + ps),
            model_name="hiq/demo-l3",
        )
        ctl, l2 = l3.controller, PageLRU(l3.controller.mem_pool_host)
        prompt = l2_hit = l3_hit = 0
        for n, tokens in enumerate(requests):
            tokens = tokens[: len(tokens) // ps * ps]
            hashes = get_storage_hash_str(tokens, None, page_size=ps)
            prompt += len(tokens)
            first = 0
            while first < len(hashes) and l2.touch(hashes[first]):
                first += 1
            l2_hit += first * ps
            done = 0
            if first < len(hashes):
                done = fetch_from_l3(h, ctl, l2, f"q{n}", tokens, hashes, first, ps)
            l3_hit += done
            start = first + done // ps
            if start < len(hashes):
                write_new(h, l3, l2, tokens[start * ps :], hashes[start:], seed=n)
        metrics = master.metrics()
        l3.close()
    return {
        "host_dtype": host_dtype,
        "l3_bytes": l3_bytes,
        "l2_tokens": l2_tokens,
        "prompt_tokens": prompt,
        "l2_hit_tokens": l2_hit,
        "l3_hit_tokens": l3_hit,
        "hit_rate": (l2_hit + l3_hit) / prompt,
        "store_keys_at_end": int(metrics["master_key_count"]),
        "store_evicted_keys": int(metrics.get("master_evicted_key_count", 0)),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    check_native_libs(NATIVE_LIBS)  # before SGLang's import, which takes minutes
    h = setup()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        t0 = time.time()
        a = bytes_per_token(h, args, workdir)
        print(
            f"A) Store bytes per cached token, {args.layers} layers x "
            f"{args.kv_heads} KV heads x head_dim {args.head_dim} "
            f"(Qwen3-8B), {args.tokens} tokens, page {args.page_size}; "
            "read from mooncake_master's master_allocated_bytes"
        )
        keys = ("objects", "store_bytes", "bytes_per_token", "host_bytes_per_token")
        table(
            "{:8}{:>9}{:>14,}{:>10,.0f}{:>14,}",
            "format;objects;store bytes;B/token;host B/token",
            [(label, *(row[k] for k in keys)) for label, row in a.items()],
        )
        ratio = a["bf16"]["bytes_per_token"] / a["int8"]["bytes_per_token"]
        print(f"BF16 / INT8 store bytes per token: {ratio:.3f}x\n")

        requests = make_requests(args)
        budgets = [int(float(x) * MB) for x in args.l3_mb.split(",") if x.strip()]
        b = [
            hit_rate(h, args, host_dtype, budget, requests, workdir) | {"format": label}
            for budget in budgets
            for label, host_dtype in FORMATS
        ]
        unique = args.groups * args.prefix_len + len(requests) * args.question_len
        best = 1 - unique / sum(
            len(r) // args.page_size * args.page_size for r in requests
        )
        print(
            f"B) Hit rate, {len(requests)} requests ({args.groups} groups x "
            f"{args.per_group}, {args.prefix_len}-token prefix + "
            f"{args.question_len}-token question, shuffled), L2 {args.l2_mb:g} MB, "
            f"geometry {args.b_layers} layers x {args.b_kv_heads} KV heads x "
            f"head_dim {args.head_dim}; best possible {100 * best:.1f}%"
        )
        keys = ("l2_tokens", "l2_hit_tokens", "l3_hit_tokens")
        table(
            "{:>6g} {:7}{:>8,}{:>9,}{:>9,}{:>10}{:>9,}",
            "L3 MB;format;L2 tok;L2 hit;L3 hit;hit rate;evicted",
            [
                (r["l3_bytes"] / MB, r["format"], *(r[k] for k in keys))
                + (f"{100 * r['hit_rate']:.1f}%", r["store_evicted_keys"])
                for r in b
            ],
        )
        result = {
            "bytes_per_token": a,
            "ratio": ratio,
            "hit_rate": b,
            "best": best,
            "args": {k: str(v) for k, v in vars(args).items()},
            "seconds": time.time() - t0,
        }
    json_path = args.out / "demo-l3.json"
    json_path.write_text(json.dumps(result, indent=2))
    png_path = args.out / "demo-l3.png"
    plot.plot_l3(result, png_path)
    print(f"\nwrote {json_path} and {png_path} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
