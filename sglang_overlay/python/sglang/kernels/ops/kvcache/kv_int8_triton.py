"""Fused Triton kernels for the INT8 host (L2) KV pool (--hicache-host-dtype int8).

encode_gather backs up a transfer in one launch (all layers, K and V: device
rows -> int8 codes + one fp16 scale per head row at the host indices);
decode_scatter restores one layer in one launch. Both run on the caller's
stream, never synchronize with the host, and match kv_int8_codec bit for bit
(docs/kernels.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, available

__all__ = ["DeviceLayerTable", "available", "decode_scatter", "encode_gather"]

# 8192 elements per encode program spilled registers on sm_80-90.
ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
DECODE_WARPS = 4


class Geometry(NamedTuple):
    """The constexprs both kernels take, as one tuple."""

    H: int
    D: tuple[int, int]  # per side
    UT: int
    BLOCK_R: int
    IS_BF16: bool
    COUNT_BAD_IDX: bool  # the keys count bad indices


@hk.kernel_jit()
def _encode_kernel(
    dev,  # per side: (base, token stride, head stride, layer offsets)
    dev_idx_ptr,
    host_idx_ptr,
    counters,  # (nonfinite, amax [table layers, 2], bad indices)
    out,  # per side: (codes, unit, layer, token, head strides)
    scale_out,  # (scales, unit, layer, token, head, side strides)
    n_tok,
    n_host,
    first_layer,  # the tables' layer of record layer 0
    GEO: tl.constexpr,  # Geometry
    ALIGNED: tl.constexpr,
    STATS: tl.constexpr,
):
    # grid: (row blocks, record layers, K|V)
    idx = (dev_idx_ptr, host_idx_ptr, counters[2])
    layer = tl.program_id(1).to(tl.int64)
    table_layer = first_layer + layer
    rows = (tl.program_id(0) * GEO.BLOCK_R, n_tok * GEO.H, n_host)
    for side in tl.static_range(2):
        if tl.program_id(2) == side:
            hk.int8_encode_rows(
                hk.device_rows(dev[side], table_layer, ALIGNED),
                out[side],
                hk.side_record(scale_out, side),
                idx,
                hk.layer_stats(counters, 2 * table_layer + side),
                rows,
                layer,
                GEO.H,
                GEO.D[side],
                GEO.UT,
                GEO.BLOCK_R,
                GEO.IS_BF16,
                STATS,
                GEO.COUNT_BAD_IDX and side == 0,
            )


@hk.kernel_jit()
def _decode_kernel(
    records,  # per side: (codes, unit, layer, token, head strides)
    scale_in,  # (scales, unit, layer, token, head, side strides)
    dev_idx_ptr,
    host_idx_ptr,
    bad_idx_ptr,
    dst,
    n_tok,
    n_host,
    GEO: tl.constexpr,  # Geometry
):
    # grid: (row blocks, K|V); one layer's records (layer stride 0)
    idx = (dev_idx_ptr, host_idx_ptr, bad_idx_ptr)
    rows = (tl.program_id(0) * GEO.BLOCK_R, n_tok * GEO.H, n_host)
    for side in tl.static_range(2):
        if tl.program_id(1) == side:
            hk.int8_decode_rows(
                records[side],
                hk.side_record(scale_in, side),
                dst[side],
                idx,
                rows,
                GEO.H,
                GEO.D[side],
                GEO.UT,
                GEO.BLOCK_R,
                GEO.IS_BF16,
                GEO.COUNT_BAD_IDX and side == 0,
            )


# One layer's record views: no layer dim (stride 0 in the kernels' records).
_LAYER_DIMS = ("unit", "token", "head")


def _shape_args(n_tok, units, heads_dims, unit_tokens, block_r, flags) -> dict:
    """Sizes and the Geometry both kernels take: tokens, host slots, shape and
    flags = (IS_BF16, COUNT_BAD_IDX)."""
    H, DK, DV = heads_dims
    return dict(
        n_tok=n_tok,
        n_host=units * unit_tokens,
        GEO=Geometry(H, (DK, DV), unit_tokens, block_r, *flags),
    )


def _check_records(name, t, dims, dtype, head_num, dim=None) -> None:
    ok = t.dtype == dtype and t.dim() == dims
    if ok and dim is None:
        ok = t.shape[-1] == head_num
    elif ok:
        ok = t.shape[-2:] == (head_num, dim) and t.stride(-1) == 1
    if not ok:
        raise ValueError(
            f"{name}: expected a {dims}-D {dtype} view ending in "
            f"{(head_num, dim) if dim else (head_num,)}, got {t.dtype} "
            f"{tuple(t.shape)} strides {t.stride()}"
        )


def _check_unit_dims(records, lead: tuple[int, ...], scale: torch.Tensor) -> None:
    """Records [units, *lead, ...] and a scale whose side dim holds K and V."""
    for t in records:
        if tuple(t.shape[1 : 1 + len(lead)]) != lead:
            raise ValueError(
                f"records must be [units, {', '.join(map(str, lead))}, ...], "
                f"got {tuple(t.shape)}"
            )
    if scale.shape[-2] != 2:
        raise ValueError(f"scales must be [..., 2, H], got {tuple(scale.shape)}")


def encode_gather(
    k_table: DeviceLayerTable,
    v_table: DeviceLayerTable,
    device_indices: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    scale_out: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    unit_tokens: int,
    counters: hk.KVCounters | None = None,
    first_layer: int = 0,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Backup in one launch: for every layer l of the records and token i,
    quantize the K/V rows table[first_layer + l][device_indices[i]] into the
    records at host_indices[i]:

      k_out     int8 [units, L, unit_tokens, H, Dk]  (any strides, dim contiguous)
      v_out     int8 [units, L, unit_tokens, H, Dv]
      scale_out fp16 [units, L, unit_tokens, 2, H]   (K scales at [..., 0, :])

    with unit = host_indices[i] // unit_tokens (pinned host memory reached
    through UVA, or device staging). counters (hk.KVCounters, each field
    optional): rows stored as non-finite are added to counters.nonfinite;
    counters.amax (fp32 [L, 2]) is raised to the largest amax of each
    layer's finite K and V rows. A host index outside [0, units *
    unit_tokens) writes nothing and its token is counted once in
    counters.bad_indices. Device indices are not range-checked.
    """
    hk.check_kv_tables(k_table, v_table)
    n = int(device_indices.numel())
    if n == 0:
        return
    dev, layers = k_table.device, len(k_table)
    hk.check_indices(device_indices, host_indices, n, dev)
    H, DK, DV = k_table.shape[1], k_table.shape[2], v_table.shape[2]
    _check_records("k_out", k_out, 5, torch.int8, H, DK)
    _check_records("v_out", v_out, 5, torch.int8, H, DV)
    _check_records("scale_out", scale_out, 5, torch.float16, H)
    rec_layers = k_out.shape[1]
    hk.check_layer_range(first_layer, rec_layers, layers)
    _check_unit_dims((k_out, v_out, scale_out), (rec_layers, unit_tokens), scale_out)
    counters = hk.check_counters(counters, layers, 2, dev)

    block_r = hk.block_rows(tile or ENCODE_TILE, max(DK, DV))
    flags = hk.kernel_flags(k_table.dtype, counters.bad_indices)
    s16 = hk.bits16(scale_out)
    args = hk.encode_args(
        {"k": k_table, "v": v_table}, device_indices, host_indices, counters
    )
    _encode_kernel[(triton.cdiv(n * H, block_r), rec_layers, 2)](
        out=tuple(hk.record_arg(t, hk.RECORD_DIMS) for t in (k_out, v_out)),
        scale_out=hk.record_arg(s16, ("unit", "layer", "token", "side", "head")),
        **_shape_args(n, k_out.shape[0], (H, DK, DV), unit_tokens, block_r, flags),
        first_layer=first_layer,
        num_warps=num_warps or ENCODE_WARPS,
        **args,
    )


def decode_scatter(
    k_in: torch.Tensor,
    v_in: torch.Tensor,
    scale_in: torch.Tensor,
    host_indices: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    device_indices: torch.Tensor,
    *,
    unit_tokens: int,
    bad_index_counter: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Restore one layer in one launch: dequantize the records at
    host_indices[i] into k_dst/v_dst[device_indices[i]]:

      k_in     int8 [units, unit_tokens, H, Dk]   (one layer; any strides)
      v_in     int8 [units, unit_tokens, H, Dv]
      scale_in fp16 [units, unit_tokens, 2, H]
      k_dst    bf16/fp16 [size, H, Dk] device layer (v_dst likewise)

    NaN rows restore as NaN; fp16 output saturates at +-65504. A host index
    outside [0, units * unit_tokens) restores nothing (the device rows keep
    their contents) and its token is counted in bad_index_counter if given.
    """
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_dst.device
    hk.check_indices(device_indices, host_indices, n, dev)
    hk.check_device_layers(k_dst, v_dst)
    H, DK, DV = k_dst.shape[1], k_dst.shape[2], v_dst.shape[2]
    _check_records("k_in", k_in, 4, torch.int8, H, DK)
    _check_records("v_in", v_in, 4, torch.int8, H, DV)
    _check_records("scale_in", scale_in, 4, torch.float16, H)
    _check_unit_dims((k_in, v_in, scale_in), (unit_tokens,), scale_in)
    hk.check_counter("bad_index_counter", bad_index_counter, dev)

    block_r = hk.block_rows(tile or DECODE_TILE, max(DK, DV))
    flags = hk.kernel_flags(k_dst.dtype, bad_index_counter)
    s16 = hk.bits16(scale_in)
    args = hk.decode_args(
        {"k": k_dst, "v": v_dst}, device_indices, host_indices, bad_index_counter
    )
    _decode_kernel[(triton.cdiv(n * H, block_r), 2)](
        records=tuple(hk.record_arg(t, _LAYER_DIMS) for t in (k_in, v_in)),
        scale_in=hk.record_arg(s16, ("unit", "token", "side", "head")),
        **_shape_args(n, k_in.shape[0], (H, DK, DV), unit_tokens, block_r, flags),
        num_warps=num_warps or DECODE_WARPS,
        **args,
    )
