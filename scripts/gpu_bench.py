#!/usr/bin/env python3
"""GPU benchmark: the quantized host pools of every registered host format
(INT8, K8V4, INT4, ...: fused Triton and torch paths) against the stock BF16
host pool, side by side in one run, at Qwen3-8B geometry; and the MLA INT8
kernels at DeepSeek geometry ("mla_codec").

Measured, for 4k and 16k tokens (--tokens) and each (layout, page size) config:
  restore  time per layer (host -> device, plus decode for INT8): all layers
           restored back to back on one transfer stream, total / layers
  backup   time of one all-layer backup (device -> host, plus encode)
for these implementations (<fmt> = each registered format, pool from the
--hicache-host-dtype dispatch; fused variants only where the format's kernels
are in this build, `fused_available`):
  <fmt>_fused_direct  the pool's default on CUDA: one Triton launch per backup
                      and per layer, reading/writing pinned host memory (UVA)
  <fmt>_fused_staged  same kernels on device staging + per-run async copies
  <fmt>_torch         the torch path (gather, codec ops, staging, copies)
  bf16_stock_kernel   stock MHATokenToKVPoolHost, io_backend=kernel: SGLang's
                      JIT HiCache kernels (or sgl_kernel where installed);
                      with --stock-jit, where they load (nvcc + tvm-ffi: a
                      compile of minutes, so not in the default short run)
  bf16_triton_copy    stock host buffers, a Triton zero-copy gather/scatter
                      copy with the same structure as the fused INT8 kernels
                      (what io_backend=kernel does, for when its kernels are
                      unavailable)
  bf16_dma            stock layer_first buffers, one cudaMemcpyAsync per layer
                      and K/V over contiguous ranges: the best case of
                      io_backend=direct (layer_first config only)
Host and device indices are contiguous ranges (the best case for BF16 DMA).
Every timed restore is checked bit for bit against the format's reference
encode + decode of the unit (page) the row belongs to.
Also: device copy bandwidth (D2D copy_), pinned PCIe bandwidth, INT8 codec
throughput (encode / decode device->device, all bytes read + written) at the
default tiles (--sweep: a few tile sizes), and every format's fused encode /
decode throughput through its format object (page size 64). INT8's targets
(from its issue) are evaluated at the end, and "figures" sums up what the
README quotes, per format.

Sized for a short GPU slot: each measurement repeats until --iters or its
share of the time budget is spent, sizes left when --budget-s runs out are
marked skipped, and the JSON is rewritten after every size.

Usage (scripts/gpu_check.sh bench runs it):
  python3 scripts/gpu_bench.py --out results.json
  python3 scripts/gpu_bench.py --dry-run --out x.json   # CPU, interpreter, tiny
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import torch  # noqa: E402
from gpu_support import (  # noqa: E402
    QWEN3_8B,
    MissingPackage,
    destroy_host_pool,
    env_summary,
    import_modules_under_test,
    install_gpu_standins,
    make_device_pool,
    make_host_pool,
    make_mla_device_pool,
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
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec  # noqa: E402
from sglang.kernels.ops.kvcache import kv_int8_triton as kt  # noqa: E402
from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk  # noqa: E402
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import (  # noqa: E402
    MLAInt8HostFormat,
)
from sglang.kernels.ops.kvcache import kv_int4_triton as k4  # noqa: E402
from tests.support.int4_reference import (  # noqa: E402
    Host,
    reference_decode,
    reference_records,
)
from sglang.srt.mem_cache.pool_host import mha as stock_mha  # noqa: E402
from sglang.srt.mem_cache.pool_host.host_format import (  # noqa: E402
    host_format_cls,
    host_format_names,
)
from sglang.srt.mem_cache.pool_host.mha import (  # noqa: E402
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)

TARGET_RESTORE = 0.65
TARGET_BACKUP = 0.75
TARGET_CODEC_BW = 0.60


# --------------------------------------------------------------------------
# timing


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
        """Milliseconds of fn() enqueued on a side stream (events), or wall
        clock on CPU. Repeats up to iters times, fewer once the clock's time
        slice is spent (at least once). Returns median/min."""
        for _ in range(warmup):
            self._call(fn)
            self.sync()
        times = []
        stop = time.time() + self.slice_s
        while len(times) < iters and (not times or time.time() < stop):
            self.sync()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(self.stream):
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

    def _call(self, fn):
        if self.cuda:
            with torch.cuda.stream(self.stream):
                fn()
        else:
            fn()


# --------------------------------------------------------------------------
# BF16 zero-copy copy kernel (baseline only)


def _row_copy_src(
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


_ROW_COPY = None


def row_copy(src, src_offs, src_idx, src_s_tok, src_s_layer, dst, dst_offs, dst_idx,
             dst_s_tok, dst_s_layer, n_tok, E, layers, aligned):  # fmt: skip
    global _ROW_COPY
    if _ROW_COPY is None:
        _ROW_COPY = triton.jit(_row_copy_src)
    block_e = min(1024, triton.next_power_of_2(E))
    block_t = max(1, 8192 // block_e)
    grid = (triton.cdiv(n_tok, block_t), triton.cdiv(E, block_e), layers)
    _ROW_COPY[grid](
        src, src_offs, src_idx, src_s_tok, src_s_layer,
        dst, dst_offs, dst_idx, dst_s_tok, dst_s_layer, n_tok,
        E=E, BLOCK_T=block_t, BLOCK_E=block_e, ALIGNED=aligned, num_warps=4,
    )  # fmt: skip


class StockTritonCopy:
    """Backup/restore for the stock pool's k/v host buffers with row_copy."""

    def __init__(self, stock, device):
        self.stock = stock
        self.tables = [
            kt.DeviceLayerTable(stock.device_k_buffers),
            kt.DeviceLayerTable(stock.device_v_buffers),
        ]
        self.zero = torch.zeros(stock.layer_num, dtype=torch.int64, device=device)
        H, D = stock.head_num, stock.head_dim
        self.E = H * D
        assert stock.head_dim == stock.v_head_dim
        self.hosts = [
            stock.k_buffer.view(torch.int16),
            stock.v_buffer.view(torch.int16),
        ]
        if stock.layout == "layer_first":  # [layer, size, H, D]
            self.s_tok, self.s_layer = self.hosts[0].stride(1), self.hosts[0].stride(0)
        elif stock.layout == "page_first":  # [size, layer, H, D]
            self.s_tok, self.s_layer = self.hosts[0].stride(0), self.hosts[0].stride(1)
        else:
            raise ValueError(stock.layout)

    def backup(self, host_idx, dev_idx):
        for table, host in zip(self.tables, self.hosts):
            row_copy(
                table.base, table.offsets, dev_idx, table.stride[0], 0,
                host, self.zero, host_idx, self.s_tok, self.s_layer,
                len(dev_idx), self.E, len(table), table.aligned,
            )  # fmt: skip

    def restore_layer(self, host_idx, dev_idx, layer):
        for table, host in zip(self.tables, self.hosts):
            host_layer = host.select(
                0 if self.stock.layout == "layer_first" else 1, layer
            )
            row_copy(
                host_layer, self.zero[:1], host_idx, self.s_tok, 0,
                table.base, table.offsets[layer : layer + 1], dev_idx,
                table.stride[0], 0, len(dev_idx), self.E, 1, table.aligned,
            )  # fmt: skip


# --------------------------------------------------------------------------
# benchmark pieces


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
        out["h2d_GBps"] = (
            n / clock.run(lambda: d.copy_(h, non_blocking=True), 5)["ms"] / 1e6
        )
        out["d2h_GBps"] = (
            n / clock.run(lambda: h.copy_(d, non_blocking=True), 5)["ms"] / 1e6
        )
        del h, d
    del a, b
    return out


def codec_throughput(clock, device, geo, tokens, dry, copy_gbps, sweep_tiles) -> dict:
    """Encode (all layers) and decode (per layer) device -> device."""
    L, H, D = geo["layer_num"], geo["head_num"], geo["head_dim"]
    dev_pool = make_device_pool(
        layer_num=L, head_num=H, head_dim=D, tokens=tokens, device=device
    )
    for buf in dev_pool.k_buffer + dev_pool.v_buffer:
        buf.normal_()
    k_tab = kt.DeviceLayerTable(dev_pool.k_buffer)
    v_tab = kt.DeviceLayerTable(dev_pool.v_buffer)
    idx = torch.arange(1, tokens + 1, device=device)
    k_rec = torch.empty(tokens + 1, L, 1, H, D, dtype=torch.int8, device=device)
    v_rec = torch.empty_like(k_rec)
    s_rec = torch.empty(tokens + 1, L, 1, 2, H, dtype=torch.float16, device=device)
    kv_bytes = 2 * tokens * L * H * D
    enc_bytes = kv_bytes * 2 + kv_bytes + tokens * L * 2 * H * 2
    dec_layer_bytes = (kv_bytes * 2 + kv_bytes + tokens * L * 2 * H * 2) / L

    sweep = [(kt.ENCODE_TILE, kt.ENCODE_WARPS)]
    if sweep_tiles:
        sweep += [(4096, 4), (8192, 8), (16384, 8), (32768, 8)]
    out = {"tokens": tokens, "layers": L, "encode": [], "decode": []}
    for tile, warps in sweep:

        def enc():
            kt.encode_gather(
                k_tab, v_tab, idx, k_rec, v_rec, s_rec, idx, unit_tokens=1,
                tile=tile, num_warps=warps,
            )  # fmt: skip

        t = clock.run(enc, iters=3 if not dry else 1)
        out["encode"].append(
            {"tile": tile, "num_warps": warps, "ms": t["ms"],
             "GBps": enc_bytes / t["ms"] / 1e6}
        )  # fmt: skip

        def dec():
            for layer in range(L):
                kt.decode_scatter(
                    k_rec[:, layer], v_rec[:, layer], s_rec[:, layer], idx,
                    dev_pool.k_buffer[layer], dev_pool.v_buffer[layer], idx,
                    unit_tokens=1, tile=tile, num_warps=warps,
                )  # fmt: skip

        t = clock.run(dec, iters=3 if not dry else 1)
        out["decode"].append(
            {"tile": tile, "num_warps": warps, "ms_per_layer": t["ms"] / L,
             "GBps": dec_layer_bytes * L / t["ms"] / 1e6}
        )  # fmt: skip
    for name in ("encode", "decode"):
        best = max(out[name], key=lambda r: r["GBps"])
        out[f"{name}_best"] = best
        out[f"{name}_best_fraction_of_copy_bw"] = best["GBps"] / copy_gbps

    # The torch codec on the same device, one layer (K and V), for reference.
    rows_k = dev_pool.k_buffer[0][1 : tokens + 1]
    q = torch.empty_like(rows_k, dtype=torch.int8)
    s = torch.empty(rows_k.shape[:-1], dtype=torch.float16, device=device)
    t = clock.run(lambda: codec.quantize_into(rows_k, q, s), iters=3 if not dry else 1)
    out["torch_quantize_into_GBps"] = (
        (rows_k.numel() * 3 + s.numel() * 2) / t["ms"] / 1e6
    )
    o = torch.empty_like(rows_k)
    t = clock.run(lambda: codec.dequantize_into(q, s, o), iters=3 if not dry else 1)
    out["torch_dequantize_into_GBps"] = (
        (rows_k.numel() * 3 + s.numel() * 2) / t["ms"] / 1e6
    )
    del dev_pool, k_rec, v_rec, s_rec
    return out


# DeepSeek V2/V3 latent widths; fewer layers than the model's 61 (per-layer
# figures do not depend on the count).
MLA_GEOMETRY = dict(layer_num=8, kv_lora_rank=512, qk_rope_head_dim=64)


def mla_codec_throughput(clock, device, tokens, dry, copy_gbps, pcie_gbps) -> dict:
    """kv_mla_int8_triton at DeepSeek geometry: encode (all layers, one
    launch) and decode (per layer) into device records (vs device copy
    bandwidth) and into pinned host records through UVA (the pool's direct
    path, vs PCIe bandwidth); restored rows checked against the torch codec
    on the same device."""
    L = 2 if dry else MLA_GEOMETRY["layer_num"]
    rank, rope = MLA_GEOMETRY["kv_lora_rank"], MLA_GEOMETRY["qk_rope_head_dim"]
    dev_pool = make_mla_device_pool(layer_num=L, tokens=tokens, device=device)
    for buf in dev_pool.kv_buffer:
        buf.normal_()
    table = mk.DeviceLayerTable(dev_pool.kv_buffer)
    idx = torch.arange(1, tokens + 1, device=device)
    fmt = MLAInt8HostFormat((rank + rope,), 1, 1, dev_pool.dtype, rope_dim=rope)
    row_bytes = (rank + rope) * 2
    rec_bytes = fmt.bytes_per_token()
    out = {"tokens": tokens, "layers": L, "geometry": {**MLA_GEOMETRY, "layer_num": L},
           "host_bytes_per_token_layer": rec_bytes,
           "ratio_vs_bf16": row_bytes / rec_bytes, "checks": {}}  # fmt: skip
    places = ("device", "host") if clock.cuda else ("device",)
    iters = 1 if dry else 3
    for where in places:
        records = {}
        for r in fmt.records:
            t = torch.empty((tokens + 1, L, *r.shape), dtype=r.dtype,
                            device=device if where == "device" else "cpu",
                            pin_memory=where == "host" and clock.cuda)  # fmt: skip
            records[r.name] = t
        enc = clock.run(
            lambda: mk.encode_gather([table], idx, records, idx), iters=iters
        )
        restored = torch.empty_like(dev_pool.kv_buffer[0])

        def dec():
            for layer in range(L):
                layer_records = {k: v[:, layer] for k, v in records.items()}
                mk.decode_scatter(layer_records, idx, [restored], idx)

        t = clock.run(dec, iters=iters)
        moved = tokens * L * (row_bytes + rec_bytes)
        ref = torch.empty_like(restored[1 : tokens + 1])
        fmt.decode_into(
            {k: v[1 : tokens + 1, L - 1] for k, v in records.items()}, [ref[:, None]]
        )
        out["checks"][f"{where}_restore_equals_torch_codec"] = same_bits(
            restored[1 : tokens + 1], ref
        )
        bound = copy_gbps if where == "device" else pcie_gbps
        out[where] = {
            "encode_ms": enc["ms"], "encode_GBps": moved / enc["ms"] / 1e6,
            "decode_ms_per_layer": t["ms"] / L,
            "decode_GBps": moved / t["ms"] / 1e6,
            "bound_GBps": bound,
            "note": "bytes of device rows + records per second"
            + ("" if where == "device" else "; the records cross PCIe"),
        }  # fmt: skip
        del records
    del dev_pool
    return out


def format_codec_throughput(clock, device, geo, tokens, dry, copy_gbps) -> dict:
    """Each registered format's fused encode (all layers) and decode (per
    layer) device -> device through its format object, at page size 64 (the
    unit INT4's per-channel keys need), against the device copy bandwidth.
    GB/s counts the device-dtype bytes of K and V, so formats compare."""
    L, H, D = geo["layer_num"], geo["head_num"], geo["head_dim"]
    unit = 64
    tokens = max(unit, tokens // unit * unit)
    dev_pool = make_device_pool(
        layer_num=L, head_num=H, head_dim=D, tokens=tokens + unit, device=device
    )
    for buf in dev_pool.k_buffer + dev_pool.v_buffer:
        buf.normal_()
    tables = (
        kt.DeviceLayerTable(dev_pool.k_buffer),
        kt.DeviceLayerTable(dev_pool.v_buffer),
    )
    dev_idx = torch.arange(unit, tokens + unit, device=device)
    host_idx = torch.arange(0, tokens, device=device)
    kv_bytes = 2 * tokens * L * H * D * dev_pool.k_buffer[0].element_size()
    out = {"tokens": tokens, "unit_tokens": unit, "formats": {}}
    for name in host_format_names():
        fmt = host_format_cls(name)((D, D), H, unit, dev_pool.k_buffer[0].dtype)
        row = out["formats"][name] = {"fused_available": fmt.fused_available(
            torch.device(device))}  # fmt: skip
        if not row["fused_available"]:
            continue
        records = {
            r.name: torch.empty(tokens // unit, L, *r.shape, dtype=r.dtype, device=device)
            for r in fmt.records
        }  # fmt: skip
        try:
            t = clock.run(
                lambda: fmt.encode_gather(tables, dev_idx, records, host_idx),
                iters=3 if not dry else 1,
            )
            row["encode_ms"] = t["ms"]
            row["encode_GBps"] = kv_bytes / t["ms"] / 1e6

            def dec():
                for layer in range(L):
                    fmt.decode_scatter(
                        {n: r[:, layer] for n, r in records.items()}, host_idx,
                        (dev_pool.k_buffer[layer], dev_pool.v_buffer[layer]), dev_idx,
                    )  # fmt: skip

            t = clock.run(dec, iters=3 if not dry else 1)
            row["decode_ms_per_layer"] = t["ms"] / L
            row["decode_GBps"] = kv_bytes / t["ms"] / 1e6
            for op in ("encode", "decode"):
                row[f"{op}_fraction_of_copy_bw"] = row[f"{op}_GBps"] / copy_gbps
        except Exception as e:  # record and go on: one format must not sink the run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
    del dev_pool
    return out


# (format, unit tokens): per-channel keys at page 64, per-token keys at
# layer_first's unit of one token, INT8 keys with INT4 values.
INT4_FORMATS = (("int4", 64), ("int4", 1), ("k8v4", 64))


def int4_codec_throughput(clock, device, geo, tokens, dry, copy_gbps) -> dict:
    """The INT4 / K8V4 kernels: encode (all layers, one launch) and decode
    (one launch per layer) with the records in device memory and, on CUDA,
    in pinned host memory (UVA, what the pools' direct path does). GB/s count
    device KV bytes read or written plus record bytes. Each run's restore of
    a few units is checked against the reference (tests/support/int4_reference.py)."""
    L, H, D = geo["layer_num"], geo["head_num"], geo["head_dim"]
    g = torch.Generator(device=device).manual_seed(1)
    k_src = [
        torch.empty(tokens, H, D, dtype=torch.bfloat16, device=device).normal_(
            generator=g
        )
        for _ in range(L)
    ]
    v_src = [torch.empty_like(t).normal_(generator=g) for t in k_src]
    tables = (k4.DeviceLayerTable(k_src), k4.DeviceLayerTable(v_src))
    k_dst = [torch.empty_like(t) for t in k_src]
    v_dst = [torch.empty_like(t) for t in v_src]
    idx = torch.arange(tokens, device=device)
    kv_bytes = 2 * tokens * L * H * D * 2
    out = {"tokens": tokens, "layers": L, "runs": [], "failed_checks": []}
    iters = 1 if dry else 3
    for fmt, ut in INT4_FORMATS:
        for where in ("device", "pinned") if clock.cuda else ("device",):
            host = Host(fmt, tokens // ut, L, ut, H, D, D)
            for name, buf in host.bufs.items():
                host.bufs[name] = (
                    buf.to(device) if where == "device" else buf.pin_memory()
                )
            rec_bytes = sum(b.numel() * b.element_size() for b in host.bufs.values())

            def enc():
                k4.encode_gather(tables, idx, host.all_layers(), idx)

            def dec():
                for layer in range(L):
                    k4.decode_scatter(
                        host.layer(layer), idx, (k_dst[layer], v_dst[layer]), idx
                    )

            t_enc = clock.run(enc, iters=iters)
            t_dec = clock.run(dec, iters=iters)
            moved = kv_bytes + rec_bytes
            run = {
                "format": fmt, "unit_tokens": ut, "records": where,
                "encode_ms": t_enc["ms"], "encode_GBps": moved / t_enc["ms"] / 1e6,
                "decode_ms_per_layer": t_dec["ms"] / L,
                "decode_GBps": moved / t_dec["ms"] / 1e6,
                "host_bytes_per_token_layer": rec_bytes / tokens / L,
            }  # fmt: skip
            clock.sync()
            units = min(4, tokens // ut)
            probe = {n: b[:units, 0].cpu() for n, b in host.bufs.items()}
            rows = units * ut
            want, _, _ = reference_records(
                fmt,
                k_src[0][:rows].cpu().view(units, ut, H, D),
                v_src[0][:rows].cpu().view(units, ut, H, D),
            )
            k_ref, v_ref = reference_decode(fmt, want, torch.bfloat16)
            run["checks"] = {
                "records_match_reference": all(
                    same_bits(probe[n], want[n]) for n in want
                ),
                "restore_matches_reference": same_bits(
                    k_dst[0][:rows].cpu(), k_ref.reshape(rows, H, D)
                )
                and same_bits(v_dst[0][:rows].cpu(), v_ref.reshape(rows, H, D)),
            }
            out["failed_checks"] += [
                f"{fmt}/p{ut}/{where}: {c}" for c, ok in run["checks"].items() if not ok
            ]
            out["runs"].append(run)
            print(f"[bench] {fmt}/p{ut} records in {where}: encode "
                  f"{run['encode_GBps']:.1f} GB/s, decode {run['decode_GBps']:.1f} "
                  f"GB/s", flush=True)  # fmt: skip

    out["device_copy_GBps"] = copy_gbps
    return out


def build_config(device, geo, layout, page, max_tokens, pin, stock_jit):
    # Device slots: [page, page + max) is the backup source, the next max
    # tokens the restore destination, so restores never overwrite the data.
    dev_pool = make_device_pool(
        layer_num=geo["layer_num"], head_num=geo["head_num"],
        head_dim=geo["head_dim"], page_size=page,
        tokens=2 * max_tokens + page, device=device,
    )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    for buf in dev_pool.k_buffer + dev_pool.v_buffer:
        buf.normal_(generator=g)
    info = dev_pool.get_device_pool_infos()[0].buffer_info
    quantized = {
        name: make_host_pool(
            dev_pool, cls=get_mha_host_pool_cls(info, name), layout=layout,
            host_tokens=max_tokens + page, pin_memory=pin,
        )  # fmt: skip
        for name in host_format_names()
    }
    if not stock_jit:
        stock_mha.can_use_hicache_jit_kernel = lambda **kwargs: False
    t0 = time.time()
    stock = make_host_pool(
        dev_pool, cls=MHATokenToKVPoolHost, layout=layout,
        host_tokens=max_tokens + page, pin_memory=pin,
    )  # fmt: skip
    stock_init_s = time.time() - t0
    return dev_pool, quantized, stock, stock_init_s


def bench_config(
    clock, device, geo, layout, page, token_counts, args, deadline, sink, save
):
    """Measure one (layout, page) config; its record is appended to sink at
    once and save() is called after every size, so a cut run keeps them."""
    dry, pin = args.dry_run, device == "cuda"
    L = geo["layer_num"]
    dev_pool, quantized, stock, stock_init_s = build_config(
        device, geo, layout, page, max(token_counts), pin, args.stock_jit
    )
    stock_sgl = STANDINS.get("sgl_kernel") == "real"
    stock_kernel_ok = bool(getattr(stock, "can_use_jit", False)) or stock_sgl
    out = {
        "layout": layout,
        "page_size": page,
        "stock_pool_init_s": round(stock_init_s, 2),
        "bf16_stock_kernel_available": stock_kernel_ok,
        "bf16_stock_kernel_impl": (
            "jit" if getattr(stock, "can_use_jit", False)
            else "sgl_kernel" if stock_sgl else None
        ),  # fmt: skip
        **{f"{name}_bytes_per_token": pool.get_size_per_token()
           for name, pool in quantized.items()},  # fmt: skip
        "host_pool_classes": {n: type(p).__name__ for n, p in quantized.items()},
        "bf16_bytes_per_token": stock.get_size_per_token(),
        "sizes": [],
    }
    sink.append(out)
    copier = StockTritonCopy(stock, device)
    max_n = max(token_counts)
    for n in token_counts:
        if time.time() > deadline:
            out["sizes"].append({"tokens": n, "skipped": "time budget"})
            continue
        # Contiguous device slots (whole pages) and host slots.
        src = torch.arange(page, page + n, device=device)
        dst = src + max_n
        q_host = torch.arange(0, n)  # CPU, as the controller hands them over
        stock_host_cpu = torch.arange(0, n)
        stock_host_dev = stock_host_cpu.to(device)
        iters = args.iters if n <= 16384 else max(1, args.iters - 1)
        slow_iters = 1 if (n >= 16384 or dry) else 2
        row = {"tokens": n, "restore_ms_per_layer": {}, "backup_ms": {}, "errors": {}}
        checks = row["checks"] = {}
        probe = _probe_rows(n, page, device)

        def timed(name, restore, backup, it=iters, warmup=1):
            """Backup (source range) first, then restore (destination range)."""
            try:
                b = clock.run(backup, iters=it, warmup=warmup)
                row["backup_ms"][name] = b["ms"]
                r = clock.run(
                    lambda: [restore(l) for l in range(L)], iters=it, warmup=warmup
                )
                row["restore_ms_per_layer"][name] = r["ms"] / L
                return True
            except (
                Exception
            ) as e:  # record and go on: one variant must not sink the run
                row["errors"][name] = f"{type(e).__name__}: {e}"[:500]
                traceback.print_exc()
                return False

        # --- every quantized format
        for fmt_name, pool in quantized.items():
            expected = _expected_restore(pool, dev_pool, probe)
            fused_ok = pool.host_format.fused_available(torch.device(device))
            records = {}
            for suffix, fused, access in (
                ("fused_direct", True, "direct"),
                ("fused_staged", True, "staged"),
                ("torch", False, None),
            ):
                name = f"{fmt_name}_{suffix}"
                if fused and not fused_ok:
                    row["errors"][name] = "no fused kernels for this format in this build"
                    continue
                pool.use_fused_kernels = fused
                if access:
                    pool.fused_host_access = access
                _clear_rows(dev_pool, dst[probe - page])
                ok = timed(
                    name,
                    lambda l: pool.load_to_device_per_layer(dev_pool, q_host, dst, l, "kernel"),
                    lambda: pool.backup_from_device_all_layer(dev_pool, q_host, src, "kernel"),
                    it=iters if fused else slow_iters,
                    warmup=1 if fused or n < 16384 else 0,
                )  # fmt: skip
                clock.sync()
                if access == "direct" and pool.fused_host_access != "direct":
                    row["errors"][name] = (
                        "fell back to staged: host memory not device-accessible"
                    )
                if ok:
                    records[name] = _host_sample(pool, n)
                    got = _restored(dev_pool, probe + max_n)
                    checks[f"{name}_restores_reference"] = all(
                        same_bits(a, b) for a, b in zip(got, expected)
                    )
            names = list(records)
            checks[f"{fmt_name}_host_records_identical"] = all(
                all(same_bits(a, b) for a, b in zip(records[names[0]], records[k]))
                for k in names[1:]
            )

        # --- BF16
        source = _restored(dev_pool, probe)
        if stock_kernel_ok:
            write_back_cpu = layout == "page_first" and getattr(
                stock, "can_use_write_back_jit", False
            )
            _clear_rows(dev_pool, dst[probe - page])
            if timed(
                "bf16_stock_kernel",
                lambda l: stock.load_to_device_per_layer(dev_pool, stock_host_dev, dst, l, "kernel"),
                lambda: stock.backup_from_device_all_layer(
                    dev_pool, stock_host_cpu if write_back_cpu else stock_host_dev,
                    src, "kernel"),
            ):  # fmt: skip
                clock.sync()
                checks["bf16_stock_kernel_exact"] = _same(
                    _restored(dev_pool, probe + max_n), source
                )
        _clear_rows(dev_pool, dst[probe - page])
        if timed(
            "bf16_triton_copy",
            lambda l: copier.restore_layer(stock_host_dev, dst, l),
            lambda: copier.backup(stock_host_dev, src),
        ):
            clock.sync()
            checks["bf16_triton_copy_exact"] = _same(
                _restored(dev_pool, probe + max_n), source
            )
        if layout == "layer_first":
            s0, d0 = page, page + max_n
            kb, vb = stock.k_buffer, stock.v_buffer

            def dma_restore(l):
                dev_pool.k_buffer[l][d0 : d0 + n].copy_(kb[l][:n], non_blocking=True)
                dev_pool.v_buffer[l][d0 : d0 + n].copy_(vb[l][:n], non_blocking=True)

            def dma_backup():
                for l in range(L):
                    kb[l][:n].copy_(
                        dev_pool.k_buffer[l][s0 : s0 + n], non_blocking=True
                    )
                    vb[l][:n].copy_(
                        dev_pool.v_buffer[l][s0 : s0 + n], non_blocking=True
                    )

            _clear_rows(dev_pool, dst[probe - page])
            if timed("bf16_dma", dma_restore, dma_backup):
                clock.sync()
                checks["bf16_dma_exact"] = _same(
                    _restored(dev_pool, probe + max_n), source
                )
        clock.sync()

        per_layer_bytes = {
            name: n * pool.get_size_per_token() / L for name, pool in quantized.items()
        }
        per_layer_bytes["bf16"] = n * stock.get_size_per_token() / L
        row["restore_GBps"] = {
            k: per_layer_bytes[k.split("_")[0]] / v / 1e6
            for k, v in row["restore_ms_per_layer"].items()
        }
        row["backup_ms_per_layer"] = {k: v / L for k, v in row["backup_ms"].items()}
        out["sizes"].append(row)
        save()
        print(f"[bench] {layout}/{page} {n:6d} tokens: restore ms/layer "
              f"{ {k: round(v, 4) for k, v in row['restore_ms_per_layer'].items()} } "
              f"backup ms { {k: round(v, 3) for k, v in row['backup_ms'].items()} }",
              flush=True)  # fmt: skip
    for pool in quantized.values():
        destroy_host_pool(pool)
    destroy_host_pool(stock)
    del dev_pool, quantized, stock, copier
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _probe_rows(n, page, device):
    """A few source slots (first, last, spread) whose values the checks follow."""
    pos = torch.unique(torch.cat([torch.arange(min(n, 8)), torch.arange(max(0, n - 8), n),
                                  torch.arange(0, n, max(1, n // 16))]))  # fmt: skip
    return (pos + page).to(device)


def _restored(dev_pool, rows):
    out = []
    for layer in (0, dev_pool.layer_num - 1):
        out.append(dev_pool.k_buffer[layer][rows].cpu())
        out.append(dev_pool.v_buffer[layer][rows].cpu())
    return out


def _expected_restore(pool, dev_pool, rows):
    """What a restore of those rows must produce, in _restored's order: the
    pool's format's reference encode + decode (on the CPU) of the whole unit
    each row belongs to (a page for page-major layouts: INT4's per-channel
    key groups span it). The backup source starts at a page boundary."""
    unit = pool.host_format.unit_tokens
    offset = (rows % unit).cpu()
    unit_rows = (rows - rows % unit)[:, None] + torch.arange(unit, device=rows.device)
    pick = torch.arange(len(rows))
    out = []
    for layer in (0, dev_pool.layer_num - 1):
        sides = [
            buf[layer][unit_rows].cpu()
            for buf in (dev_pool.k_buffer, dev_pool.v_buffer)
        ]
        fmt = pool.host_format
        restored = fmt.decode_reference(fmt.encode_reference(sides), sides[0].dtype)
        out += [side[pick, offset] for side in restored]
    return out


def _clear_rows(dev_pool, rows):
    """Poison the destination probe rows, so a check can't pass on stale data."""
    for layer in (0, dev_pool.layer_num - 1):
        dev_pool.k_buffer[layer][rows] = float("nan")
        dev_pool.v_buffer[layer][rows] = float("nan")


def _same(a_list, b_list):
    return all(same_bits(a, b) for a, b in zip(a_list, b_list))


def _host_sample(pool, n):
    """A few host units' records (all layers) after the last backup."""
    units = torch.arange(0, max(1, n // pool.host_format.unit_tokens))
    pick = torch.unique(
        torch.cat([units[:4], units[-4:], units[:: max(1, len(units) // 16)]])
    )
    return [
        (b[pick] if pool.records.page_major else b[:, pick]).clone() for b in pool.kv_buffer
    ]


def evaluate_targets(configs, codec_out) -> dict:
    restore, backup = [], []
    for cfg in configs:
        for row in cfg["sizes"]:
            if "skipped" in row or row["tokens"] < 4096:
                continue
            bf16 = {
                k: v
                for k, v in row["restore_ms_per_layer"].items()
                if k.startswith("bf16")
            }
            bf16_b = {k: v for k, v in row["backup_ms"].items() if k.startswith("bf16")}
            for metric, table, ref, limit, sink in (
                ("restore", row["restore_ms_per_layer"], bf16, TARGET_RESTORE, restore),
                ("backup", row["backup_ms"], bf16_b, TARGET_BACKUP, backup),
            ):
                if not ref:
                    continue
                best_bf16 = min(ref, key=ref.get)
                for variant in ("int8_fused_direct", "int8_fused_staged"):
                    if variant not in table:
                        continue
                    ratio = table[variant] / ref[best_bf16]
                    sink.append({
                        "config": f"{cfg['layout']}/p{cfg['page_size']}",
                        "tokens": row["tokens"], "int8": variant,
                        "int8_ms": table[variant], "bf16_best": best_bf16,
                        "bf16_ms": ref[best_bf16], "ratio": ratio,
                        "ratios_vs_each_bf16": {k: table[variant] / v for k, v in ref.items()},
                        "pass": ratio <= limit,
                    })  # fmt: skip
    enc = codec_out.get("encode_best_fraction_of_copy_bw")
    dec = codec_out.get("decode_best_fraction_of_copy_bw")

    def verdict(rows, variant):
        sel = [r["pass"] for r in rows if r["int8"] == variant]
        return all(sel) if sel else None

    return {
        "restore_le_%.2f_of_bf16" % TARGET_RESTORE: restore,
        "backup_le_%.2f_of_bf16" % TARGET_BACKUP: backup,
        "summary": {
            "restore_default_direct_pass": verdict(restore, "int8_fused_direct"),
            "restore_staged_pass": verdict(restore, "int8_fused_staged"),
            "backup_default_direct_pass": verdict(backup, "int8_fused_direct"),
            "backup_staged_pass": verdict(backup, "int8_fused_staged"),
            "encode_fraction_of_copy_bw": enc,
            "decode_fraction_of_copy_bw": dec,
            "encode_pass": None if enc is None else enc >= TARGET_CODEC_BW,
            "decode_pass": None if dec is None else dec >= TARGET_CODEC_BW,
        },
    }


def headline_figures(configs, codec_out, bw, codec_formats=None) -> dict:
    """What the README quotes: per config and size, restore and backup ms per
    layer of the default INT8 path and the best BF16 baseline, and the
    codec's GB/s against the device copy's."""
    rows = []
    for cfg in configs:
        for row in cfg["sizes"]:
            if "skipped" in row:
                continue
            entry = {"config": f"{cfg['layout']}/p{cfg['page_size']}",
                     "tokens": row["tokens"]}  # fmt: skip
            for metric, table in (
                ("restore", row["restore_ms_per_layer"]),
                ("backup", row["backup_ms_per_layer"]),
            ):
                bf16 = {k: v for k, v in table.items() if k.startswith("bf16")}
                int8 = table.get("int8_fused_direct")
                best = min(bf16, key=bf16.get) if bf16 else None
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
                    for name in host_format_names()
                }
            rows.append(entry)
    return {
        "transfers": rows,
        "codec_by_format": {
            name: {k: v for k, v in row.items() if k.endswith(("GBps", "bw"))}
            for name, row in (codec_formats or {}).get("formats", {}).items()
        },
        "codec_encode_GBps": (codec_out.get("encode_best") or {}).get("GBps"),
        "codec_decode_GBps": (codec_out.get("decode_best") or {}).get("GBps"),
        "device_copy_GBps": bw.get("device_copy_GBps"),
        "h2d_GBps": bw.get("h2d_GBps"),
        "d2h_GBps": bw.get("d2h_GBps"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--configs", default="page_first:64,layer_first:1",
                        help="layout:page_size,...")  # fmt: skip
    parser.add_argument("--iters", type=int, default=5,
                        help="repeats per measurement at most (fewer past its time slice)")  # fmt: skip
    parser.add_argument("--slice-s", type=float, default=2.0,
                        help="seconds one measurement may repeat for")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="skip what is left after this many seconds")  # fmt: skip
    parser.add_argument("--stock-jit", action="store_true",
                        help="also try SGLang's JIT HiCache kernels (nvcc compile, minutes)")  # fmt: skip
    parser.add_argument("--sweep", action="store_true",
                        help="codec throughput at several tile sizes, not just the defaults")  # fmt: skip
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
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.dry_run:
        geo = dict(layer_num=2, head_num=2, head_dim=64, v_head_dim=64)
        token_counts = [64, 256]
        args.iters = 1
    configs = []
    for item in args.configs.split(","):
        layout, page = item.split(":")
        configs.append((layout, int(page)))

    clock = Clock(device, args.slice_s)
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
        "kernel_defaults": {
            "ENCODE_TILE": kt.ENCODE_TILE, "ENCODE_WARPS": kt.ENCODE_WARPS,
            "DECODE_TILE": kt.DECODE_TILE, "DECODE_WARPS": kt.DECODE_WARPS,
        },  # fmt: skip
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["seconds"] = round(time.time() - started, 1)
        args.out.write_text(json.dumps(result, indent=1, default=str))

    try:
        result["bandwidth"] = bandwidth(clock, device, args.dry_run)
        save()
        copy_gbps = result["bandwidth"]["device_copy_GBps"]
        result["codec"] = codec_throughput(
            clock, device, geo, 256 if args.dry_run else 16384, args.dry_run,
            copy_gbps, args.sweep,
        )  # fmt: skip
        result["codec_formats"] = format_codec_throughput(
            clock, device, geo, 256 if args.dry_run else 16384, args.dry_run,
            copy_gbps,
        )  # fmt: skip
        save()
        pcie = min(
            result["bandwidth"].get(k, copy_gbps) for k in ("h2d_GBps", "d2h_GBps")
        )
        result["mla_codec"] = mla_codec_throughput(
            clock, device, 256 if args.dry_run else 16384, args.dry_run, copy_gbps,
            pcie,
        )  # fmt: skip
        save()
        result["int4_codec"] = int4_codec_throughput(
            clock, device, geo, 256 if args.dry_run else 16384, args.dry_run,
            copy_gbps,
        )  # fmt: skip
        save()
        result["configs"] = []
        for layout, page in configs:
            if time.time() > deadline:
                result["configs"].append({"layout": layout, "page_size": page,
                                          "skipped": "time budget"})  # fmt: skip
                continue
            bench_config(clock, device, geo, layout, page, token_counts, args,
                         deadline, result["configs"], save)  # fmt: skip
            save()
        measured = [c for c in result["configs"] if "sizes" in c]
        result["targets"] = evaluate_targets(measured, result["codec"])
        result["figures"] = headline_figures(
            measured, result["codec"], result["bandwidth"], result["codec_formats"]
        )
        mla = result["mla_codec"]
        # The MLA kernels' throughput, where the records live: device memory
        # (vs device copy bandwidth) and, on CUDA, pinned host memory (vs PCIe).
        result["figures"]["mla"] = {
            f"{where}_{step}_GBps": round(mla[where][f"{step}_GBps"], 2)
            for where in ("device", "host")
            if where in mla
            for step in ("encode", "decode")
        }
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
    ] + [
        f"mla_codec: {name}"
        for name, ok in result["mla_codec"]["checks"].items()
        if not ok
    ] + result["int4_codec"]["failed_checks"]
    save()
    print(json.dumps(result["figures"], indent=1))
    print(json.dumps(result["targets"]["summary"], indent=1))
    if result["failed_checks"]:
        print("gpu_bench: failed checks:", *result["failed_checks"], sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
