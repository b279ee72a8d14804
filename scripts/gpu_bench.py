#!/usr/bin/env python3
"""GPU benchmark: every registered host format's pools and kernels against the
stock BF16 host pool (docs/development.md, "GPU check")."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:
    # Before triton is imported (by sglang): run every kernel interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HIQ_GPU_TEST_DEVICE", "cpu")

import torch  # noqa: E402
from scripts.rigs.gpu import (  # noqa: E402
    QWEN3_8B,
    MissingPackage,
    destroy_host_pool,
    env_summary,
    import_modules_under_test,
    install_gpu_standins,
    make_device_pool,
    make_host_pool,
    missing_packages,
    same_bits,
)


def _require_packages() -> None:
    """One line naming what is missing, instead of an import traceback."""
    missing = missing_packages()
    try:
        if not missing:
            import_modules_under_test()
    except MissingPackage as e:
        missing = [str(e)]
    if missing:
        print(f"gpu_bench: missing packages: {', '.join(missing)}", file=sys.stderr)
        sys.exit(3)


_require_packages()
STANDINS = install_gpu_standins()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable  # noqa: E402
from sglang.srt.mem_cache.pool_host import mha as stock_mha  # noqa: E402
from sglang.srt.mem_cache.pool_host.host_format import (  # noqa: E402
    HOST_DTYPES,
    host_format_cls,
)
from sglang.srt.mem_cache.pool_host.mha import (  # noqa: E402
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)

TARGET_RESTORE = 0.65
TARGET_BACKUP = 0.75
TARGET_CODEC_BW = 0.60
CONFIGS = (("page_first", 64), ("layer_first", 1))  # (layout, page size)
# The stock host buffers' (token dim, layer dim): [layer, size, H, D] on
# layer_first, [size, layer, H, D] on page_first.
HOST_DIMS = {"layer_first": (1, 0), "page_first": (0, 1)}


class Clock:
    def __init__(self, device: str, slice_s: float = 2.0):
        self.cuda = device == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda else None
        # Wall time one measurement may take before it stops repeating.
        self.slice_s = slice_s

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn, iters: int, warmup: int = 1) -> dict:
        """Median / min ms of fn() (CUDA events on a side stream, else wall clock)."""
        # Warm-ups compile kernels on the GPU; the dry run's interpreter has none.
        for _ in range(warmup if self.cuda else 0):
            with self._side():
                fn()
            self.sync()
        times = []
        stop = time.time() + self.slice_s
        while len(times) < iters and (not times or time.time() < stop):
            self.sync()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                with self._side():
                    start.record()
                    fn()
                    end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return {"ms": statistics.median(times), "min_ms": min(times), "n": len(times)}

    def _side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()


@triton.jit
def _row_copy_kernel(
    src,
    src_offs,
    src_idx,
    src_s_tok,
    src_s_layer,
    dst,
    dst_offs,
    dst_idx,
    dst_s_tok,
    dst_s_layer,
    n_tok,
    E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    layer = tl.program_id(2)
    tmask = t < n_tok
    m = tmask[:, None] & (e < E)[None, :]
    si = tl.load(src_idx + t, mask=tmask, other=0).to(tl.int64)
    di = tl.load(dst_idx + t, mask=tmask, other=0).to(tl.int64)
    so = tl.load(src_offs + layer)
    do = tl.load(dst_offs + layer)
    if ALIGNED:  # layer offsets are multiples of 16 elements: vector accesses
        so = tl.multiple_of(so, 16)
        do = tl.multiple_of(do, 16)
    so += layer.to(tl.int64) * src_s_layer
    do += layer.to(tl.int64) * dst_s_layer
    vals = tl.load(src + (so + si * src_s_tok)[:, None] + e[None, :], mask=m)
    tl.store(dst + (do + di * dst_s_tok)[:, None] + e[None, :], vals, mask=m)


def row_copy(src, src_offs, src_idx, src_s_tok, src_s_layer, dst, dst_offs, dst_idx,
             dst_s_tok, dst_s_layer, n_tok, E, layers, aligned):  # fmt: skip
    block_e = min(1024, triton.next_power_of_2(E))
    block_t = max(1, 8192 // block_e)
    grid = (triton.cdiv(n_tok, block_t), triton.cdiv(E, block_e), layers)
    _row_copy_kernel[grid](
        src, src_offs, src_idx, src_s_tok, src_s_layer,
        dst, dst_offs, dst_idx, dst_s_tok, dst_s_layer, n_tok,
        E=E, BLOCK_T=block_t, BLOCK_E=block_e, ALIGNED=aligned, num_warps=4,
    )  # fmt: skip


class StockTritonCopy:
    """Backup/restore for the stock pool's k/v host buffers with row_copy."""

    def __init__(self, stock, device):
        self.stock = stock
        self.tables = [
            DeviceLayerTable(stock.device_k_buffers),
            DeviceLayerTable(stock.device_v_buffers),
        ]
        self.zero = torch.zeros(stock.layer_num, dtype=torch.int64, device=device)
        self.E = stock.head_num * stock.head_dim
        assert stock.head_dim == stock.v_head_dim
        self.hosts = [b.view(torch.int16) for b in (stock.k_buffer, stock.v_buffer)]
        tok, self.layer_dim = HOST_DIMS[stock.layout]
        self.s_tok, self.s_layer = map(self.hosts[0].stride, (tok, self.layer_dim))

    def backup(self, host_idx, dev_idx):
        for table, host in zip(self.tables, self.hosts):
            row_copy(
                table.base, table.offsets, dev_idx, table.stride[0], 0,
                host, self.zero, host_idx, self.s_tok, self.s_layer,
                len(dev_idx), self.E, len(table), table.aligned,
            )  # fmt: skip

    def restore_layer(self, host_idx, dev_idx, layer):
        for table, host in zip(self.tables, self.hosts):
            row_copy(
                host.select(self.layer_dim, layer), self.zero[:1], host_idx,
                self.s_tok, 0, table.base, table.offsets[layer : layer + 1],
                dev_idx, table.stride[0], 0, len(dev_idx), self.E, 1, table.aligned,
            )  # fmt: skip


def bandwidth(clock, device, dry) -> dict:
    out = {}
    n = (1 << 24) if dry else (1 << 30)  # bytes
    a = torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    t = clock.run(lambda: b.copy_(a), iters=5)
    out["device_copy_GBps"] = 2 * n / t["ms"] / 1e6
    out["device_copy_note"] = "D2D copy_, bytes read + written per second"
    if clock.cuda:
        h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d = torch.empty(n, dtype=torch.uint8, device=device)
        for key, dst, src in (("h2d_GBps", d, h), ("d2h_GBps", h, d)):
            t = clock.run(lambda: dst.copy_(src, non_blocking=True), 5)
            out[key] = n / t["ms"] / 1e6
        del h, d
    return out


# DeepSeek V2/V3 latent widths (512 + 64 RoPE, one head); fewer layers than
# the model's 61 (per-layer figures do not depend on the count).
MLA_GEOMETRY = dict(layer_num=8, kv_lora_rank=512, qk_rope_head_dim=64)
# Units per model kind: page 64 (INT4's per-channel keys) and layer_first's
# one token for MHA; the MLA pool's one token.
CODEC_UNITS = {"mha": (64, 1), "mla": (1,)}


def _codec_geometry(kind, geo, dry):
    """(layers, head_num, per-side widths) of a kind's codec benchmark."""
    if kind == "mla":
        width = MLA_GEOMETRY["kv_lora_rank"] + MLA_GEOMETRY["qk_rope_head_dim"]
        return (2 if dry else MLA_GEOMETRY["layer_num"]), 1, (width,)
    return geo["layer_num"], geo["head_num"], (geo["head_dim"], geo["v_head_dim"])


def _codec_run(clock, fmt, src, dst, L, tokens, where, iters) -> dict:
    """One format's fused encode and decode, checked against its reference codec."""
    device = src[0][0].device
    ut = fmt.unit_tokens
    records = {
        r.name: torch.empty((tokens // ut, L, *r.shape), dtype=r.dtype,
                            device=device if where == "device" else "cpu",
                            pin_memory=where == "pinned")
        for r in fmt.records
    }  # fmt: skip
    tables = [DeviceLayerTable(side) for side in src]
    idx = torch.arange(tokens, device=device)

    def dec():
        for layer in range(L):
            fmt.decode_scatter({n: r[:, layer] for n, r in records.items()}, idx,
                               [side[layer] for side in dst], idx)  # fmt: skip

    t_enc = clock.run(lambda: fmt.encode_gather(tables, idx, records, idx), iters=iters)
    t_dec = clock.run(dec, iters=iters)
    clock.sync()
    kv_bytes = sum(t.numel() * t.element_size() for side in src for t in side)
    rec_bytes = sum(r.numel() * r.element_size() for r in records.values())
    moved = kv_bytes + rec_bytes
    run = {
        "format": fmt.name, "unit_tokens": ut, "records": where,
        "encode_ms": t_enc["ms"], "encode_GBps": moved / t_enc["ms"] / 1e6,
        "decode_ms_per_layer": t_dec["ms"] / L,
        "decode_GBps": moved / t_dec["ms"] / 1e6,
        "host_bytes_per_token_layer": fmt.bytes_per_token(),
        "ratio_vs_device": kv_bytes / rec_bytes,
        "checks": {"records_match_reference": True, "restore_matches_reference": True},
    }  # fmt: skip
    units = min(4, tokens // ut)
    for layer in (0, L - 1):
        rows = [s[layer][: units * ut].cpu().view(units, ut, *s[layer].shape[1:]) for s in src]  # fmt: skip
        want = fmt.encode_reference(rows)
        got = [d[layer][: units * ut].cpu().view_as(r) for d, r in zip(dst, rows)]
        recs = [records[n][:units, layer].cpu() for n in want]
        run["checks"]["records_match_reference"] &= _same(recs, want.values())
        ref = fmt.decode_reference(want, rows[0].dtype)
        run["checks"]["restore_matches_reference"] &= _same(got, ref)
    return run


def codec_throughput(clock, device, geo, tokens, dry, copy_gbps, pcie_gbps) -> dict:
    """Every registered format per model kind and unit: fused encode / decode GB/s."""
    out = {"tokens": tokens, "device_copy_GBps": copy_gbps, "pcie_GBps": pcie_gbps,
           "mla_geometry": MLA_GEOMETRY, "runs": [], "skipped": [], "failed_checks": []}  # fmt: skip
    places = ("device", "pinned") if clock.cuda else ("device",)
    iters = 1 if dry else 3
    g = torch.Generator(device=device).manual_seed(1)
    for kind, units in CODEC_UNITS.items():
        L, H, dims = _codec_geometry(kind, geo, dry)
        src = [[torch.empty(tokens, H, d, dtype=torch.bfloat16, device=device).normal_(generator=g)
                for _ in range(L)] for d in dims]  # fmt: skip
        dst = [[torch.empty_like(t) for t in side] for side in src]
        for name, entry in HOST_DTYPES.items():
            if getattr(entry, f"{kind}_format") is None:
                continue
            for ut in units:
                what = f"{name}/{kind}/p{ut}"
                try:
                    fmt = host_format_cls(name, kind)(dims, H, ut, torch.bfloat16)
                except NotImplementedError as e:  # a geometry the format refuses
                    out["skipped"].append(f"{what}: {e}")
                    continue
                if not fmt.fused_available(torch.device(device)):
                    out["skipped"].append(f"{what}: no fused kernels in this build")
                    continue
                for where in places:
                    # Record and go on: one format must not sink the run.
                    try:
                        run = _codec_run(clock, fmt, src, dst, L, tokens, where, iters)
                    except Exception as e:
                        out["failed_checks"].append(
                            f"{what}/{where}: {type(e).__name__}: {e}"[:500]
                        )
                        traceback.print_exc()
                        continue
                    run["kind"] = kind
                    run["bound_GBps"] = copy_gbps if where == "device" else pcie_gbps
                    out["runs"].append(run)
                    out["failed_checks"] += [f"{what}/{where}: {c}" for c, ok in run["checks"].items() if not ok]  # fmt: skip
                    print(f"[bench] {what} records in {where}: encode {run['encode_GBps']:.1f} "
                          f"GB/s, decode {run['decode_GBps']:.1f} GB/s", flush=True)  # fmt: skip
        del src, dst
    return out


def _codec_row(codec, name, kind="mha", unit=1, where="device"):
    return next((r for r in codec.get("runs", []) if (r["format"], r["kind"], r["unit_tokens"],
                 r["records"]) == (name, kind, unit, where)), {})  # fmt: skip


def bench_config(
    clock, device, geo, layout, page, token_counts, args, deadline, sink, save
):
    """Measure one (layout, page) config; its record is appended to sink at
    once and save() is called after every size, so a cut run keeps them."""
    max_n = max(token_counts)
    # Device slots: [page, page + max_n) is the backup source, the next max_n
    # tokens the restore destination, so restores never overwrite the data.
    dev_pool = make_device_pool(
        layer_num=geo["layer_num"], head_num=geo["head_num"],
        head_dim=geo["head_dim"], page_size=page,
        tokens=2 * max_n + page, device=device,
    )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    for buf in dev_pool.k_buffer + dev_pool.v_buffer:
        buf.normal_(generator=g)
    info = dev_pool.get_device_pool_infos()[0].buffer_info
    host = dict(layout=layout, host_tokens=max_n + page, pin_memory=device == "cuda")
    # Each format's pool on each transfer path, chosen at construction; the
    # path-chosen-by-default pool states bytes per token.
    on_path = {
        name: {
            suffix: make_host_pool(
                dev_pool,
                cls=get_mha_host_pool_cls(info, name),
                fused_transfer=mode,
                **host,
            )  # fmt: skip
            for suffix, mode in FORMAT_PATHS
        }
        for name in HOST_DTYPES
    }
    quantized = {name: pools["torch"] for name, pools in on_path.items()}
    if not args.stock_jit:
        stock_mha.can_use_hicache_jit_kernel = lambda **kwargs: False
    t0 = time.time()
    stock = make_host_pool(dev_pool, cls=MHATokenToKVPoolHost, **host)
    out = _config_record(layout, page, stock, quantized, time.time() - t0)
    sink.append(out)
    copier = StockTritonCopy(stock, device)
    for n in token_counts:
        if time.time() > deadline:
            out["sizes"].append({"tokens": n, "skipped": "time budget"})
            continue
        run = SizeRun(clock, dev_pool, page, max_n, n, args)
        for fmt_name, pools in on_path.items():
            _time_format(run, fmt_name, pools)
        _time_bf16(run, stock, copier, out["bf16_stock_kernel_available"])
        _rates(run.row, quantized, stock)
        out["sizes"].append(run.row)
        save()
        print(
            f"[bench] {layout}/{page} {n:6d} tokens: restore ms/layer "
            f"{ {k: round(v, 4) for k, v in run.row['restore_ms_per_layer'].items()} } "
            f"backup ms { {k: round(v, 3) for k, v in run.row['backup_ms'].items()} }",
            flush=True,
        )
    for pool in (*[p for ps in on_path.values() for p in ps.values()], stock):
        destroy_host_pool(pool)
    del dev_pool, on_path, quantized, stock, copier
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _config_record(layout, page, stock, quantized, stock_init_s) -> dict:
    stock_jit = bool(getattr(stock, "can_use_jit", False))
    stock_sgl = STANDINS.get("sgl_kernel") == "real"
    impl = "jit" if stock_jit else "sgl_kernel" if stock_sgl else None
    return {
        "layout": layout,
        "page_size": page,
        "stock_pool_init_s": round(stock_init_s, 2),
        "bf16_stock_kernel_available": impl is not None,
        "bf16_stock_kernel_impl": impl,
        **{
            f"{n}_bytes_per_token": p.get_size_per_token() for n, p in quantized.items()
        },
        "host_pool_classes": {n: type(p).__name__ for n, p in quantized.items()},
        "bf16_bytes_per_token": stock.get_size_per_token(),
        "sizes": [],
    }


class SizeRun:
    """One token count of one config: its slots, timings and checks (row)."""

    def __init__(self, clock, dev_pool, page, max_n, n, args):
        self.clock, self.dev_pool, self.n = clock, dev_pool, n
        device = dev_pool.k_buffer[0].device
        # Contiguous device slots (whole pages): [page, page + n) is the backup
        # source, the same range shifted by max_n the restore destination.
        self.src = torch.arange(page, page + n, device=device)
        self.dst = self.src + max_n
        self.host = torch.arange(0, n)  # CPU, as the controller hands them over
        self.host_dev = self.host.to(device)
        self.probe = _probe_rows(n, page, device)
        self.dst_probe = self.probe + max_n
        self.iters = args.iters
        self.slow_iters = 1 if (n >= 16384 or args.dry_run) else 2
        tables = ("restore_ms_per_layer", "backup_ms", "errors", "checks")
        self.row = {"tokens": n, **{k: {} for k in tables}}

    def measure(self, name, check, expected, restore, backup, it=None, warmup=1):
        """Time backup (source range), then restore of every layer (destination
        range); if both ran, checks[check] says whether the restored probe
        rows are expected's. Returns whether both ran."""
        row, L, it = self.row, self.dev_pool.layer_num, it or self.iters
        _clear_rows(self.dev_pool, self.dst_probe)
        try:
            t = self.clock.run(backup, iters=it, warmup=warmup)
            row["backup_ms"][name] = t["ms"]
            r = self.clock.run(lambda: [restore(l) for l in range(L)], it, warmup)
        except Exception as e:  # record and go on: one variant must not sink the run
            row["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
            return False
        row["restore_ms_per_layer"][name] = r["ms"] / L
        self.clock.sync()
        row["checks"][check] = _same(_restored(self.dev_pool, self.dst_probe), expected)
        return True


# (variant suffix, the pool's fused_transfer) of each format's paths.
FORMAT_PATHS = (
    ("fused_direct", "direct"),
    ("fused_staged", "staged"),
    ("torch", "off"),
)


def _time_format(run, fmt_name, pools):
    """A format's paths (one pool each), each restore checked against the
    reference codec and the host records compared across the paths."""
    dev, host, errors = run.dev_pool, run.host, run.row["errors"]
    expected = _expected_restore(pools["torch"], dev, run.probe)
    records = {}
    for suffix, _ in FORMAT_PATHS:
        name, pool = f"{fmt_name}_{suffix}", pools[suffix]
        fused = suffix != "torch"
        if pool.transfer_path != suffix:
            errors[name] = (
                f"the pool chose {pool.transfer_path}: {pool.transfer_path_reason}"
            )
            continue
        ok = run.measure(
            name,
            f"{name}_restores_reference",
            expected,
            lambda l: pool.load_to_device_per_layer(dev, host, run.dst, l, "kernel"),
            lambda: pool.backup_from_device_all_layer(dev, host, run.src, "kernel"),
            it=run.iters if fused else run.slow_iters,
            warmup=1 if fused or run.n < 16384 else 0,
        )
        if ok:
            records[name] = _host_sample(pool, run.n)
    names = list(records)
    run.row["checks"][f"{fmt_name}_host_records_identical"] = all(
        _same(records[names[0]], records[k]) for k in names[1:]
    )


def _time_bf16(run, stock, copier, stock_kernel_ok):
    """The BF16 baselines: the stock pool's kernel path where it loaded, the
    Triton copy, and on layer_first one DMA per layer and side."""
    dev, h = run.dev_pool, run.host_dev
    paths = {}
    if stock_kernel_ok:
        write_back_cpu = stock.layout == "page_first" and getattr(
            stock, "can_use_write_back_jit", False
        )
        hb = run.host if write_back_cpu else h
        paths["bf16_stock_kernel"] = (
            lambda l: stock.load_to_device_per_layer(dev, h, run.dst, l, "kernel"),
            lambda: stock.backup_from_device_all_layer(dev, hb, run.src, "kernel"),
        )
    paths["bf16_triton_copy"] = (
        lambda l: copier.restore_layer(h, run.dst, l),
        lambda: copier.backup(h, run.src),
    )
    if stock.layout == "layer_first":
        paths["bf16_dma"] = _dma(run, stock)
    source = _restored(dev, run.probe)
    for name, (restore, backup) in paths.items():
        run.measure(name, f"{name}_exact", source, restore, backup)
    run.clock.sync()


def _dma(run, stock):
    """Restore and backup as cudaMemcpyAsync over contiguous ranges."""
    n, s0, d0 = run.n, int(run.src[0]), int(run.dst[0])
    sides = (
        (run.dev_pool.k_buffer, stock.k_buffer),
        (run.dev_pool.v_buffer, stock.v_buffer),
    )

    def restore(l):
        for dev, host in sides:
            dev[l][d0 : d0 + n].copy_(host[l][:n], non_blocking=True)

    def backup():
        for l in range(run.dev_pool.layer_num):
            for dev, host in sides:
                host[l][:n].copy_(dev[l][s0 : s0 + n], non_blocking=True)

    return restore, backup


def _rates(row, quantized, stock):
    """Restore GB/s and backup ms per layer from the row's timings."""
    L, n = stock.layer_num, row["tokens"]
    per_layer = {name: n * p.get_size_per_token() / L for name, p in quantized.items()}
    per_layer["bf16"] = n * stock.get_size_per_token() / L
    row["restore_GBps"] = {
        k: per_layer[k.split("_")[0]] / v / 1e6
        for k, v in row["restore_ms_per_layer"].items()
    }
    row["backup_ms_per_layer"] = {k: v / L for k, v in row["backup_ms"].items()}


def _probe_rows(n, page, device):
    """A few source slots (first, last, spread) whose values the checks follow."""
    pos = torch.unique(torch.cat([torch.arange(min(n, 8)), torch.arange(max(0, n - 8), n),
                                  torch.arange(0, n, max(1, n // 16))]))  # fmt: skip
    return (pos + page).to(device)


def _end_layers(dev_pool):
    """(K, V) of the first and the last layer: the layers the checks read."""
    ends = (0, dev_pool.layer_num - 1)
    return [(dev_pool.k_buffer[i], dev_pool.v_buffer[i]) for i in ends]


def _restored(dev_pool, rows):
    return [side[rows].cpu() for pair in _end_layers(dev_pool) for side in pair]


def _expected_restore(pool, dev_pool, rows):
    """A restore's expected rows: the reference round trip of each row's whole unit."""
    unit = pool.host_format.unit_tokens
    offset = (rows % unit).cpu()
    unit_rows = (rows - rows % unit)[:, None] + torch.arange(unit, device=rows.device)
    pick = torch.arange(len(rows))
    fmt = pool.host_format
    out = []
    for pair in _end_layers(dev_pool):
        sides = [side[unit_rows].cpu() for side in pair]
        restored = fmt.decode_reference(fmt.encode_reference(sides), sides[0].dtype)
        out += [side[pick, offset] for side in restored]
    return out


def _clear_rows(dev_pool, rows):
    """Poison the destination probe rows, so a check can't pass on stale data."""
    for pair in _end_layers(dev_pool):
        for side in pair:
            side[rows] = float("nan")


def _same(a_list, b_list):
    return all(same_bits(a, b) for a, b in zip(a_list, b_list))


def _host_sample(pool, n):
    """A few host units' records (all layers) after the last backup."""
    units = torch.arange(0, max(1, n // pool.host_format.unit_tokens))
    pick = torch.unique(
        torch.cat([units[:4], units[-4:], units[:: max(1, len(units) // 16)]])
    )
    return [
        (b[pick] if pool.records.page_major else b[:, pick]).clone()
        for b in pool.kv_buffer
    ]


def _measured_sizes(configs):
    """(config label, row) of every measured size."""
    for cfg in configs:
        for row in cfg["sizes"]:
            if "skipped" not in row:
                yield f"{cfg['layout']}/p{cfg['page_size']}", row


def _bf16(table) -> tuple[dict, str | None]:
    """A timing table's BF16 baselines and the fastest of them."""
    bf16 = {k: v for k, v in table.items() if k.startswith("bf16")}
    return bf16, (min(bf16, key=bf16.get) if bf16 else None)


def evaluate_targets(configs, codec_out) -> dict:
    found = {"restore": [], "backup": []}
    limits = {"restore": TARGET_RESTORE, "backup": TARGET_BACKUP}
    for config, row in _measured_sizes(configs):
        if row["tokens"] < 4096:
            continue
        tables = {"restore": row["restore_ms_per_layer"], "backup": row["backup_ms"]}
        for metric, table in tables.items():
            ref, best_bf16 = _bf16(table)
            for variant in ("int8_fused_direct", "int8_fused_staged"):
                if best_bf16 is None or variant not in table:
                    continue
                ms = table[variant]
                ratio = ms / ref[best_bf16]
                entry = {
                    "config": config,
                    "tokens": row["tokens"],
                    "int8": variant,
                    "int8_ms": ms,
                    "bf16_best": best_bf16,
                    "bf16_ms": ref[best_bf16],
                    "ratio": ratio,
                    "ratios_vs_each_bf16": {k: ms / v for k, v in ref.items()},
                    "pass": ratio <= limits[metric],
                }
                found[metric].append(entry)
    int8 = _codec_row(codec_out, "int8")
    copy = codec_out.get("device_copy_GBps")
    enc, dec = (
        int8[f"{k}_GBps"] / copy if int8 and copy else None
        for k in ("encode", "decode")
    )

    def verdict(rows, variant):
        sel = [r["pass"] for r in rows if r["int8"] == variant]
        return all(sel) if sel else None

    summary = {
        f"{metric}_{label}_pass": verdict(found[metric], f"int8_fused_{variant}")
        for metric in found
        for label, variant in (("default_direct", "direct"), ("staged", "staged"))
    }
    return {
        **{f"{m}_le_{limits[m]:.2f}_of_bf16": rows for m, rows in found.items()},
        "summary": {
            **summary,
            "encode_fraction_of_copy_bw": enc,
            "decode_fraction_of_copy_bw": dec,
            "encode_pass": None if enc is None else enc >= TARGET_CODEC_BW,
            "decode_pass": None if dec is None else dec >= TARGET_CODEC_BW,
        },
    }


def headline_figures(configs, codec_out, bw) -> dict:
    """What the README quotes: INT8 and the best BF16 per config, and codec GB/s."""
    rows = []
    for config, row in _measured_sizes(configs):
        entry = {"config": config, "tokens": row["tokens"]}
        for metric, table in (
            ("restore", row["restore_ms_per_layer"]),
            ("backup", row["backup_ms_per_layer"]),
        ):
            bf16, best = _bf16(table)
            int8 = table.get("int8_fused_direct")
            entry[f"{metric}_ms_per_layer_int8"] = int8
            entry[f"{metric}_ms_per_layer_bf16"] = bf16.get(best)
            entry[f"{metric}_bf16_baseline"] = best
            entry[f"{metric}_int8_over_bf16"] = (
                int8 / bf16[best] if int8 is not None and best else None
            )
            # Every format's variants, for the per-format table.
            entry[f"{metric}_ms_per_layer_by_format"] = {
                name: {
                    k.removeprefix(name + "_"): v
                    for k, v in table.items()
                    if k.startswith(name + "_")
                }
                for name in HOST_DTYPES
            }
        rows.append(entry)
    return {
        "transfers": rows,
        # Per format, model kind, unit and where the records live.
        "codec_by_format": {
            f"{r['format']}/{r['kind']}/p{r['unit_tokens']}/{r['records']}": {
                k: v for k, v in r.items() if k.endswith("GBps")
            }
            for r in codec_out.get("runs", [])
        },
        "codec_encode_GBps": _codec_row(codec_out, "int8").get("encode_GBps"),
        "codec_decode_GBps": _codec_row(codec_out, "int8").get("decode_GBps"),
        **{k: bw.get(k) for k in ("device_copy_GBps", "h2d_GBps", "d2h_GBps")},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="skip what is left after this many seconds")  # fmt: skip
    parser.add_argument("--stock-jit", action="store_true",
                        help="also try SGLang's JIT HiCache kernels (nvcc compile, minutes)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, Triton interpreter, tiny sizes: checks the script")  # fmt: skip
    args = parser.parse_args(argv)

    started = time.time()
    deadline = started + args.budget_s
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    geo = dict(QWEN3_8B)
    token_counts = [4096, 16384]
    if args.dry_run:
        geo = dict(layer_num=2, head_num=2, head_dim=64, v_head_dim=64)
        token_counts = [64, 128]  # one page and two of page_first/p64
    # Repeats per measurement at most (fewer past the clock's time slice).
    args.iters = 1 if args.dry_run else 5
    clock = Clock(device)
    result = {
        "env": env_summary(),
        "standins": STANDINS,
        "geometry": geo,
        "dry_run": args.dry_run,
        "bf16_baselines": {
            "bf16_stock_kernel": "stock MHATokenToKVPoolHost, io_backend=kernel, "
            "through SGLang's JIT HiCache kernels (sgl_kernel where installed); "
            "only where they loaded on this machine",
            "bf16_triton_copy": "stock host buffers; Triton zero-copy gather/scatter "
            "copy (same structure as the fused INT8 kernels, no codec): stands in "
            "for io_backend=kernel",
            "bf16_dma": "stock layer_first buffers; one cudaMemcpyAsync per layer "
            "and K/V over contiguous ranges: best case of io_backend=direct",
        },
        "index_pattern": "contiguous host and device ranges (best case for BF16 DMA)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["seconds"] = round(time.time() - started, 1)
        args.out.write_text(json.dumps(result, indent=1, default=str))

    try:
        bw = result["bandwidth"] = bandwidth(clock, device, args.dry_run)
        save()
        copy_gbps = bw["device_copy_GBps"]
        pcie = min(bw.get(k, copy_gbps) for k in ("h2d_GBps", "d2h_GBps"))
        result["codec"] = codec_throughput(
            clock, device, geo, 64 if args.dry_run else 16384, args.dry_run,
            copy_gbps, pcie,
        )  # fmt: skip
        save()
        result["configs"] = []
        for layout, page in CONFIGS:
            if time.time() > deadline:
                result["configs"].append({"layout": layout, "page_size": page,
                                          "skipped": "time budget"})  # fmt: skip
                continue
            bench_config(clock, device, geo, layout, page, token_counts, args,
                         deadline, result["configs"], save)  # fmt: skip
            save()
        measured = [c for c in result["configs"] if "sizes" in c]
        result["targets"] = evaluate_targets(measured, result["codec"])
        result["figures"] = headline_figures(measured, result["codec"], bw)
    except Exception as e:
        result["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"[-4000:]
        save()
        print(result["fatal"], file=sys.stderr)
        return 1
    # A timing is only worth quoting if the same run restored the right bytes.
    result["failed_checks"] = [
        f"{c['layout']}/p{c['page_size']}/{row['tokens']}: {name}"
        for c in measured
        for row in c["sizes"]
        for name, ok in row.get("checks", {}).items()
        if not ok
    ] + [f"codec: {c}" for c in result["codec"]["failed_checks"]]
    save()
    print(json.dumps(result["figures"], indent=1))
    print(json.dumps(result["targets"]["summary"], indent=1))
    if result["failed_checks"]:
        print("gpu_bench: failed checks:", *result["failed_checks"], sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
