"""Fused Triton kernels for the MLA INT8 host (L2) KV pool (--hicache-host-dtype int8).

An MLA device row is [kv_lora_rank latent | rope]. Records per token and layer:
"kv" int8 [1, kv_lora_rank], "scale" fp16 [1, kv_lora_rank / T] (one per tile
of T values, T read off the shapes), "rope" copied bit for bit. Each latent
tile is coded as one INT8 head row (host_kv_common.int8_encode_rows), so the
bits match kv_mla_int8_codec (docs/kernels.md). encode_gather: one launch per
backup (all layers); decode_scatter: one launch per layer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, available

__all__ = ["DeviceLayerTable", "available", "decode_scatter", "encode_gather"]

RECORD_NAMES = ("kv", "scale", "rope")

# The latent programs are the INT8 row code on tiles; the INT8 tile sizes
# (compile-checked on sm_80-90) apply as they are.
ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
DECODE_WARPS = 4


class Geometry(NamedTuple):
    """The constexprs both kernels take, as one tuple."""

    NT: int  # latent tiles of T values
    T: int
    P: int  # RoPE width
    UT: int
    BLOCKS: tuple[int, int]  # (BLOCK_R tiles, BLOCK_T tokens) per program
    IS_BF16: bool
    COUNT_BAD_IDX: bool


@triton.jit
def _rope_slots(n_tok, idx, n_host, GEO: tl.constexpr):
    """This program's BLOCK_T tokens (GEO.BLOCKS[1]): device index, host unit,
    token-in-unit, the RoPE lanes (P wide, padded) and their mask."""
    tok = tl.program_id(0) * GEO.BLOCKS[1] + tl.arange(0, GEO.BLOCKS[1])
    didx, hidx, hmask = hk.token_slots(tok, tok < n_tok, idx, n_host)
    unit, within = hk.unit_slots(hidx, GEO.UT)
    d = tl.arange(0, hk.pow2(GEO.P))
    return didx, unit, within, d, hmask[:, None] & (d < GEO.P)[None, :]


@hk.kernel_jit()
def _mla_encode_kernel(
    dev,  # kv: ((base, token stride, head stride, layer offsets),)
    dev_idx_ptr,
    host_idx_ptr,
    counters,  # (nonfinite, amax [table layers, 1], bad indices)
    out,  # kv, scale, rope records: (pointer, unit, layer, token strides, 0)
    n_tok,
    n_host,
    first_layer,  # the table's layer of record layer 0
    GEO: tl.constexpr,  # Geometry
    ALIGNED: tl.constexpr,
    STATS: tl.constexpr,
):
    # grid: (row blocks, record layers, latent|rope)
    idx = (dev_idx_ptr, host_idx_ptr, counters[2])
    layer = tl.program_id(1).to(tl.int64)
    src = hk.device_rows(dev[0], first_layer + layer, ALIGNED)
    kv, scale, rope = out[0], out[1], out[2]
    if tl.program_id(2) == 0:
        # Tiles as heads: "head" stride T in the device row and the record,
        # the scale's tile stride 1.
        hk.int8_encode_rows(
            (src[0], src[1], src[2], GEO.T),
            (kv[0], kv[1], kv[2], kv[3], GEO.T),
            (scale[0], scale[1], scale[2], scale[3], 1),
            idx,
            hk.layer_stats(counters, first_layer + layer),
            (tl.program_id(0) * GEO.BLOCKS[0], n_tok * GEO.NT, n_host),
            layer,
            GEO.NT,
            GEO.T,
            GEO.UT,
            GEO.BLOCKS[0],
            GEO.IS_BF16,
            STATS,
            GEO.COUNT_BAD_IDX,
        )
    else:
        didx, unit, within, d, m2 = _rope_slots(n_tok, idx, n_host, GEO)
        row = src[1] + GEO.NT * GEO.T + didx * src[2]
        bits = tl.load(src[0] + (row[:, None] + d[None, :]), mask=m2, other=0)
        dst = hk.record_offset(rope, unit, layer, within, 0)
        tl.store(rope[0] + (dst[:, None] + d[None, :]), bits, mask=m2)
        if STATS[0]:
            # A RoPE row holding NaN/Inf (all exponent bits set) counts once.
            if GEO.IS_BF16:
                special = ((bits.to(tl.int32) & 0x7F80) == 0x7F80) & m2
            else:
                special = ((bits.to(tl.int32) & 0x7C00) == 0x7C00) & m2
            hk.count_flags(counters[0], tl.max(special.to(tl.int32), axis=1) > 0)


@hk.kernel_jit()
def _mla_decode_kernel(
    records,  # kv, scale, rope: (pointer, unit, 0, token strides, 0)
    dev_idx_ptr,
    host_idx_ptr,
    bad_idx_ptr,
    dst,
    n_tok,
    n_host,
    GEO: tl.constexpr,  # Geometry
):
    # grid: (row blocks, latent|rope); one layer's records (layer stride 0)
    idx = (dev_idx_ptr, host_idx_ptr, bad_idx_ptr)
    kv, scale, rope = records[0], records[1], records[2]
    y = dst[0]
    if tl.program_id(1) == 0:
        hk.int8_decode_rows(
            (kv[0], kv[1], 0, kv[3], GEO.T),
            (scale[0], scale[1], 0, scale[3], 1),
            (y[0], y[1], GEO.T),
            idx,
            (tl.program_id(0) * GEO.BLOCKS[0], n_tok * GEO.NT, n_host),
            GEO.NT,
            GEO.T,
            GEO.UT,
            GEO.BLOCKS[0],
            GEO.IS_BF16,
            GEO.COUNT_BAD_IDX,
        )
    else:
        didx, unit, within, d, m2 = _rope_slots(n_tok, idx, n_host, GEO)
        src = hk.record_offset(rope, unit, 0, within, 0)
        bits = tl.load(rope[0] + (src[:, None] + d[None, :]), mask=m2, other=0)
        row = GEO.NT * GEO.T + didx * y[1]
        tl.store(y[0] + (row[:, None] + d[None, :]), bits, mask=m2)


def _record_geometry(records: Mapping[str, torch.Tensor], dims: int) -> SimpleNamespace:
    """Tiles (NT of T values), RoPE width P and unit tokens, from the records."""
    missing = set(RECORD_NAMES) - set(records)
    if missing:
        raise ValueError(f"MLA INT8 records need {RECORD_NAMES}, missing {missing}")
    kv, scale, rope = (records[name] for name in RECORD_NAMES)
    for name, t, dtype in (("kv", kv, torch.int8), ("scale", scale, torch.float16)):
        if t.dtype != dtype:
            raise ValueError(f"record {name} must be {dtype}, got {t.dtype}")
    if rope.element_size() != 2:
        raise ValueError(f"record rope must be a 16-bit dtype, got {rope.dtype}")
    lead = kv.shape[:-1]
    for name, t in (("kv", kv), ("scale", scale), ("rope", rope)):
        if t.dim() != dims or t.shape[:-1] != lead or t.shape[-2] != 1:
            raise ValueError(
                f"record {name} must be a {dims}-D view [..., unit_tokens, 1, n] "
                f"like kv {tuple(kv.shape)}, got {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"record {name} must be contiguous in its last dim")
    rank, n_tiles = kv.shape[-1], scale.shape[-1]
    if n_tiles == 0 or rank % n_tiles:
        raise ValueError(
            f"kv_lora_rank {rank} is not a whole number of scale tiles ({n_tiles})"
        )
    return SimpleNamespace(
        NT=n_tiles, T=rank // n_tiles, P=rope.shape[-1], UT=kv.shape[-3], rank=rank
    )


def _check_device_row(geo: SimpleNamespace, shape, dtype, rope_dtype) -> None:
    if dtype not in hk.DEVICE_DTYPES:
        raise TypeError(f"device KV must be bf16/fp16, got {dtype}")
    if rope_dtype not in (torch.int16, dtype):
        raise ValueError(
            f"record rope must be {dtype} (or its int16 bits), got {rope_dtype}"
        )
    if shape[1] != 1 or shape[2] != geo.rank + geo.P:
        raise ValueError(
            f"device MLA KV must be [size, 1, {geo.rank} + {geo.P}] for these "
            f"records, got {tuple(shape)}"
        )


def _blocks(tile: int, geo: SimpleNamespace) -> tuple[int, int]:
    """(BLOCK_R tiles, BLOCK_T tokens) per program; BLOCK_T covers BLOCK_R."""
    block_r = hk.block_rows(tile, geo.T)
    return block_r, hk.pow2(triton.cdiv(block_r, geo.NT))


def _tile_args(geo: SimpleNamespace, n: int, units: int, blocks, flags) -> dict:
    """Sizes and the Geometry both kernels take (tiles, RoPE width, blocks and
    flags = (IS_BF16, COUNT_BAD_IDX))."""
    return dict(
        n_tok=n,
        n_host=units * geo.UT,
        GEO=Geometry(geo.NT, geo.T, geo.P, geo.UT, blocks, *flags),
    )


def encode_gather(
    tables: Sequence[DeviceLayerTable],
    device_indices: torch.Tensor,
    out: Mapping[str, torch.Tensor],
    host_indices: torch.Tensor,
    *,
    counters: hk.KVCounters | None = None,
    first_layer: int = 0,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Backup in one launch: for every layer l of the records and token i,
    encode the device row tables[0][first_layer + l][device_indices[i]]
    ([kv_lora_rank | rope], bf16/fp16) into the records at host_indices[i]:

      out["kv"]     int8 [units, L, unit_tokens, 1, kv_lora_rank]
      out["scale"]  fp16 [units, L, unit_tokens, 1, kv_lora_rank / T]
      out["rope"]   16-bit [units, L, unit_tokens, 1, rope_dim]

    (any strides, last dim contiguous; unit = host_index // unit_tokens).
    counters (hk.KVCounters, each field optional): latent tiles stored
    non-finite and RoPE rows holding NaN/Inf are added to counters.nonfinite,
    as the codec's encode_into counts them; counters.amax (fp32 [L, 1]) is
    raised to each layer's largest finite tile amax. A host index outside
    [0, units * unit_tokens) writes nothing and its token is counted once in
    counters.bad_indices. Device indices are not range-checked.
    """
    if len(tables) != 1:
        raise ValueError(f"MLA encodes one side ('kv'), got {len(tables)} tables")
    (table,) = tables
    geo = _record_geometry(out, 5)
    _check_device_row(geo, table.shape, table.dtype, out["rope"].dtype)
    layers = out["kv"].shape[1]
    hk.check_layer_range(first_layer, layers, len(table))
    for name in RECORD_NAMES:
        if out[name].shape[1] != layers:
            raise ValueError(
                f"record {name} must be [units, {layers}, ...], "
                f"got {tuple(out[name].shape)}"
            )
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = table.device
    hk.check_indices(device_indices, host_indices, n, dev)
    counters = hk.check_counters(counters, len(table), 1, dev)

    blocks = _blocks(tile or ENCODE_TILE, geo)
    flags = hk.kernel_flags(table.dtype, counters.bad_indices)
    views = (out["kv"], hk.bits16(out["scale"]), hk.bits16(out["rope"]))
    args = hk.encode_args({"kv": table}, device_indices, host_indices, counters)
    _mla_encode_kernel[(triton.cdiv(n * geo.NT, blocks[0]), layers, 2)](
        # [..., token, 1, n]: no head dim (the kernel puts in the tile's).
        out=tuple(hk.record_arg(t, ("unit", "layer", "token")) for t in views),
        **_tile_args(geo, n, views[0].shape[0], blocks, flags),
        first_layer=first_layer,
        num_warps=num_warps or ENCODE_WARPS,
        **args,
    )


def decode_scatter(
    records: Mapping[str, torch.Tensor],
    host_indices: torch.Tensor,
    dst: Sequence[torch.Tensor],
    device_indices: torch.Tensor,
    *,
    bad_index_counter: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Restore one layer in one launch: decode the records at host_indices[i]
    (one layer's views: kv int8 [units, unit_tokens, 1, kv_lora_rank], scale
    fp16 [units, unit_tokens, 1, kv_lora_rank / T], rope 16-bit [units,
    unit_tokens, 1, rope_dim]) into dst[0][device_indices[i]], the device
    layer [size, 1, kv_lora_rank + rope_dim] (bf16/fp16, last dim contiguous).

    NaN tiles restore as NaN, fp16 output saturates at +-65504, RoPE bits are
    copied. A host index outside [0, units * unit_tokens) restores nothing
    (the device row keeps its contents) and its token is counted in
    bad_index_counter if given.
    """
    if len(dst) != 1:
        raise ValueError(f"MLA restores one side ('kv'), got {len(dst)} tensors")
    (y,) = dst
    geo = _record_geometry(records, 4)
    if y.dim() != 3 or y.stride(2) != 1:
        raise ValueError(
            f"device MLA KV must be [size, 1, dim] with dim contiguous, got "
            f"{tuple(y.shape)} strides {y.stride()}"
        )
    _check_device_row(geo, y.shape, y.dtype, records["rope"].dtype)
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = y.device
    hk.check_indices(device_indices, host_indices, n, dev)
    hk.check_counter("bad_index_counter", bad_index_counter, dev)

    blocks = _blocks(tile or DECODE_TILE, geo)
    flags = hk.kernel_flags(y.dtype, bad_index_counter)
    views = (records["kv"], hk.bits16(records["scale"]), hk.bits16(records["rope"]))
    args = hk.decode_args({"kv": y}, device_indices, host_indices, bad_index_counter)
    _mla_decode_kernel[(triton.cdiv(n * geo.NT, blocks[0]), 2)](
        records=tuple(hk.record_arg(t, ("unit", "token")) for t in views),
        **_tile_args(geo, n, views[0].shape[0], blocks, flags),
        num_warps=num_warps or DECODE_WARPS,
        **args,
    )
