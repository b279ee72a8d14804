"""Fused Triton kernels for the int8c host (L2) KV format
(--hicache-host-dtype int8c).

encode_gather backs up a transfer in one launch (all layers, keys and values:
device rows -> 8-bit codes + fp16 metadata at the host indices);
decode_scatter restores one layer in one launch. Keys of a unit of at least
64 tokens are coded per channel over the unit's tokens (x^ = m + q * s, q in
0..255: kv_int4_triton's channel groups with 8-bit codes, one a byte); keys
of smaller units per token in groups of 32 channels, and values per head row,
as INT8 rows (host_kv_common.int8_encode_rows: a group is a row of a "virtual
head" 32 channels wide). Bits match kv_int8c_codec (docs/kernels.md).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, available

__all__ = ["DeviceLayerTable", "available", "decode_scatter", "encode_gather"]

ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
DECODE_WARPS = 4

# KEY_MODE constexpr values.
KEYS_PER_TOKEN = 0  # INT8 rows of KEY_GROUP channels per token and head
KEYS_PER_CHANNEL = 1  # one 8-bit group per channel over a unit's tokens


class Geometry(NamedTuple):
    """The constexprs both kernels take, as one tuple."""

    H: int
    D: tuple[int, int]  # per side (K, V)
    W: tuple[int, int]  # INT8 row width per side (keys per token: their group)
    KEY_MODE: int
    UT: int
    IS_BF16: bool


@hk.kernel_jit()
def _encode_kernel(
    dev,  # per side: (base, token stride, row stride, layer offsets)
    dev_idx_ptr,
    host_idx_ptr,
    counters,  # (nonfinite, amax [table layers, 2], bad indices)
    codes,  # per side: (codes, unit, layer, token, row strides)
    meta,  # K: (meta, unit, layer, token, row[, channel, param] strides); V: scales
    n_tok,
    n_host,
    n_k_progs,
    first_layer,  # the tables' layer of record layer 0
    GEO: tl.constexpr,  # Geometry
    BLOCKS: tl.constexpr,  # per side: rows, or channel pairs for per-channel keys
    K_NCB: tl.constexpr,
    ALIGNED: tl.constexpr,
    STATS: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,  # per side
):
    # grid: (key programs + value programs, record layers)
    idx = (dev_idx_ptr, host_idx_ptr, counters[2])
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    table_layer = first_layer + layer
    prog_side = (pid >= n_k_progs).to(tl.int32)
    for side in tl.static_range(2):
        if prog_side == side:
            src = hk.device_rows(dev[side], table_layer, ALIGNED)
            stats = hk.layer_stats(counters, 2 * table_layer + side)
            if side == 0 and GEO.KEY_MODE == 1:
                k4._encode_channels(
                    src, codes[0], meta[0], idx, stats, n_host, layer, codes[0][0],
                    GEO.H, GEO.D[0], BLOCKS[0], K_NCB, GEO.UT, GEO.IS_BF16,
                    hk.FP8_NONE, STATS, COUNT_BAD_IDX[0], 0, 8,
                )  # fmt: skip
            else:
                rows_per_tok = GEO.H * (GEO.D[side] // GEO.W[side])
                row0 = (pid - side * n_k_progs) * BLOCKS[side]
                hk.int8_encode_rows(
                    src, codes[side], meta[side], idx, stats,
                    (row0, n_tok * rows_per_tok, n_host), layer, rows_per_tok,
                    GEO.W[side], GEO.UT, BLOCKS[side], GEO.IS_BF16, STATS,
                    COUNT_BAD_IDX[side],
                )  # fmt: skip


@hk.kernel_jit()
def _decode_kernel(
    codes,  # per side: (codes, unit, 0, token, row strides)
    meta,  # as _encode_kernel's, layer stride 0
    dev_idx_ptr,
    host_idx_ptr,
    bad_idx_ptr,
    dst,  # per side: (element patterns, token stride, row stride)
    n_tok,
    n_host,
    n_k_progs,
    GEO: tl.constexpr,  # Geometry
    BLOCKS: tl.constexpr,  # per side
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (key programs + value programs,); one layer's records; the keys
    # count bad indices
    idx = (dev_idx_ptr, host_idx_ptr, bad_idx_ptr)
    pid = tl.program_id(0)
    prog_side = (pid >= n_k_progs).to(tl.int32)
    for side in tl.static_range(2):
        if prog_side == side:
            row0 = (pid - side * n_k_progs) * BLOCKS[side]
            if side == 0 and GEO.KEY_MODE == 1:
                k4._decode_groups(
                    codes[0], meta[0], dst[0], idx, (row0, n_tok * GEO.H, n_host),
                    codes[0][0], GEO.H, GEO.D[0], 1, GEO.UT, BLOCKS[0],
                    GEO.IS_BF16, hk.FP8_NONE, COUNT_BAD_IDX, 0, 8,
                )  # fmt: skip
            else:
                rows_per_tok = GEO.H * (GEO.D[side] // GEO.W[side])
                hk.int8_decode_rows(
                    codes[side], meta[side], dst[side], idx,
                    (row0, n_tok * rows_per_tok, n_host), rows_per_tok,
                    GEO.W[side], GEO.UT, BLOCKS[side], GEO.IS_BF16,
                    COUNT_BAD_IDX and side == 0,
                )  # fmt: skip


# ----------------------------------------------------------------------------
# host-side wrappers


class _Side(NamedTuple):
    """One side's records as the kernels address them: rows of `width`
    channels (a key group or a head), their codes and metadata views."""

    mode: int
    dim: int
    width: int
    codes: tuple
    meta: tuple


def _fail(name: str, t: torch.Tensor, expected: str) -> None:
    raise ValueError(
        f"{name}: expected {expected}, got {t.dtype} {tuple(t.shape)} "
        f"strides {t.stride()}"
    )


# The records' leading dims: encode views have a layer dim, decode views not.
_LEAD_DIMS = {3: ("unit", "layer", "token"), 2: ("unit", "token")}


def _rows_view(name, t, dtype, lead: int, heads: int, dim: int, width: int):
    """hk.record_arg of [*lead, heads, dim] codes read as rows of `width`:
    heads must be dim apart."""
    ok = (
        t.dtype == dtype
        and t.dim() == lead + 2
        and tuple(t.shape[-2:]) == (heads, dim)
        and t.stride(-1) == 1
        and (width == dim or t.stride(-2) == dim)
    )
    if not ok:
        _fail(name, t, f"a {lead + 2}-D {dtype} view ending in {(heads, dim)}")
    row = t.stride(-2) if width == dim else width
    return hk.record_arg(t, (*_LEAD_DIMS[lead], "head"), (*t.stride()[:lead], row))


def _scales_view(name, t, lead: int, shape, per_head: int | None = None):
    """hk.record_arg of fp16 scales of `shape` as int16 patterns, one scale
    per row of codes: [*lead, heads] (one per head), or [*lead, heads,
    per_head] (one per key group, per_head contiguous to a head)."""
    if t.dtype != torch.float16 or tuple(t.shape) != tuple(shape):
        _fail(name, t, f"float16 {tuple(shape)}")
    bits = t.view(torch.int16)
    if per_head is None:
        row = bits.stride(-1)
    elif bits.stride(-1) == 1 and (per_head == 1 or bits.stride(-2) == per_head):
        row = 1
    else:
        _fail(name, t, f"rows of {per_head} contiguous scales")
    return hk.record_arg(
        bits, (*_LEAD_DIMS[lead], "head"), (*bits.stride()[:lead], row)
    )


def _sides(records, lead: int, heads: int, dk: int, dv: int) -> tuple[_Side, _Side]:
    """Parse the records (lead 3: [unit, layer, token] for encode, 2: [unit,
    token] for decode); the key mode follows from the key metadata's name."""
    names = set(records)
    if names not in ({"k", "k_meta", "v", "v_scale"}, {"k", "k_scale", "v", "v_scale"}):
        raise ValueError(
            f"records must be k, k_meta|k_scale, v, v_scale, got {sorted(names)}"
        )
    v = records["v"]
    values = _Side(
        KEYS_PER_TOKEN,
        dv,
        dv,
        _rows_view("v", v, torch.int8, lead, heads, dv, dv),
        _scales_view("v_scale", records["v_scale"], lead, v.shape[:-1]),
    )
    k = records["k"]
    if "k_meta" in records:
        codes = _rows_view("k", k, torch.uint8, lead, heads, dk, dk)
        meta = records["k_meta"]
        if meta.dtype != torch.float16 or tuple(meta.shape) != (
            *k.shape[: lead - 1],
            heads,
            dk,
            2,
        ):
            _fail("k_meta", meta, f"per-channel [..., {heads}, {dk}, 2]")
        bits = meta.view(torch.int16)
        ms = bits.stride()
        # No token dim: each channel's (s, m) holds for the unit's tokens.
        meta_arg = hk.record_arg(
            bits,
            (*_LEAD_DIMS[lead], "head", "group", "param"),
            (*ms[: lead - 1], 0, *ms[lead - 1 :]),
        )
        keys = _Side(KEYS_PER_CHANNEL, dk, dk, codes, meta_arg)
    else:
        scale = records["k_scale"]
        groups = scale.shape[-1] if scale.dim() == lead + 2 else 0
        if groups == 0 or dk % groups:
            _fail("k_scale", scale, f"[..., {heads}, groups dividing {dk}]")
        width = dk // groups
        codes = _rows_view("k", k, torch.int8, lead, heads, dk, width)
        shape = (*k.shape[:-1], groups)
        meta_arg = _scales_view("k_scale", scale, lead, shape, groups)
        keys = _Side(KEYS_PER_TOKEN, dk, width, codes, meta_arg)
    if k.shape[:lead] != v.shape[:lead]:
        raise ValueError(
            f"k and v records differ in units/layers/tokens: "
            f"{tuple(k.shape)} vs {tuple(v.shape)}"
        )
    return keys, values


def _device_rows(side: _Side, stride) -> tuple[int, int]:
    """(token stride, row stride) of a side's device rows: rows of a key
    group are `width` apart inside a head, so heads must be dim apart."""
    if side.width == side.dim:
        return stride[0], stride[1]
    if stride[1] != side.dim:
        raise ValueError(
            f"device KV heads must be contiguous ({side.dim} apart) for "
            f"per-token key groups, got strides {tuple(stride)}"
        )
    return stride[0], side.width


def _geometry(keys: _Side, values: _Side, heads: int, ut: int, dtype) -> Geometry:
    return Geometry(
        heads,
        (keys.dim, values.dim),
        (keys.width, values.width),
        keys.mode,
        ut,
        dtype == torch.bfloat16,
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
    """Backup in one launch: encode the K/V rows
    tables[s][first_layer + l][device_indices[i]] of every layer l of the
    records into the records at host_indices[i].

    tables = (k_table, v_table), bf16/fp16; out = the format's records as
    [units, L, *record.shape] views (last dim contiguous):

      keys per channel  k uint8 [U, L, UT, H, Dk], k_meta fp16 [U, L, H, Dk, 2]
      keys per token    k int8 [U, L, UT, H, Dk], k_scale fp16 [U, L, UT, H, Dk/G]
      values            v int8 [U, L, UT, H, Dv], v_scale fp16 [U, L, UT, H]

    Per-channel keys need whole units in order, as kv_int4_triton's do: a run
    that isn't writes no keys and its in-range tokens are counted in
    counters.bad_indices with those of out-of-range host indices. Groups
    stored as non-finite are added to counters.nonfinite; counters.amax (fp32
    [L, 2]) is raised to the largest magnitude of the finite groups.
    """
    if len(tables) != 2:
        raise ValueError(f"expected the K and V layer tables, got {len(tables)}")
    k_table, v_table = tables
    hk.check_kv_tables(k_table, v_table)
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_table.device
    hk.check_indices(device_indices, host_indices, n, dev)
    layers, heads = len(k_table), k_table.shape[1]
    keys, values = _sides(out, 3, heads, k_table.shape[2], v_table.shape[2])
    units, rec_layers, ut = out["k"].shape[:3]
    hk.check_layer_range(first_layer, rec_layers, layers)
    if keys.mode == KEYS_PER_CHANNEL and n % ut:
        raise ValueError(
            f"per-channel keys encode whole units: {n} tokens is not a "
            f"multiple of unit_tokens={ut}"
        )
    counters = hk.check_counters(counters, layers, 2, dev)

    tile = tile or ENCODE_TILE
    if keys.mode == KEYS_PER_CHANNEL:
        dk = keys.dim
        pairs = max(1, min(hk.pow2(dk) // 2, hk.pow2(tile) // (2 * hk.pow2(ut))))
        k_ncb = triton.cdiv(dk // 2, pairs)
        k_block, n_k_progs = pairs, (n // ut) * heads * k_ncb
    else:
        k_ncb = 1
        k_block = hk.block_rows(tile, keys.width)
        n_k_progs = triton.cdiv(n * heads * (keys.dim // keys.width), k_block)
    v_block = hk.block_rows(tile, values.width)
    n_v_progs = triton.cdiv(n * heads, v_block)
    args = hk.encode_args(
        {"k": k_table, "v": v_table}, device_indices, host_indices, counters
    )
    args["dev"] = tuple(
        (t.base, *_device_rows(side, t.stride), t.offsets)
        for t, side in ((k_table, keys), (v_table, values))
    )
    count_bad = counters.bad_indices is not None
    _encode_kernel[(n_k_progs + n_v_progs, rec_layers)](
        codes=(keys.codes, values.codes),
        meta=(keys.meta, values.meta),
        n_tok=n,
        n_host=units * ut,
        n_k_progs=n_k_progs,
        first_layer=first_layer,
        GEO=_geometry(keys, values, heads, ut, k_table.dtype),
        BLOCKS=(k_block, v_block),
        K_NCB=k_ncb,
        # Per-channel keys count the in-range tokens of broken runs, values
        # the out-of-range ones; per-token keys count them all.
        COUNT_BAD_IDX=(count_bad, count_bad and keys.mode == KEYS_PER_CHANNEL),
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
    into dst[0] (K) and dst[1] (V) rows device_indices[i].

    records: one layer's records as [units, *record.shape] views (as
    encode_gather's without the layer dim); dst: bf16/fp16 [size, H, D]
    device layers, dim contiguous. fp16 output saturates at its largest finite
    value; non-finite groups restore as NaN. A host index outside the records
    restores nothing and its token is counted in bad_index_counter if given.
    """
    if len(dst) != 2:
        raise ValueError(f"expected the K and V device layers, got {len(dst)}")
    k_dst, v_dst = dst
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_dst.device
    hk.check_indices(device_indices, host_indices, n, dev)
    hk.check_device_layers(k_dst, v_dst)
    heads = k_dst.shape[1]
    keys, values = _sides(records, 2, heads, k_dst.shape[2], v_dst.shape[2])
    units, ut = records["k"].shape[:2]
    hk.check_counter("bad_index_counter", bad_index_counter, dev)

    tile = tile or DECODE_TILE
    k_block = hk.block_rows(tile, keys.width)
    v_block = hk.block_rows(tile, values.width)
    k_rows = n * heads * (keys.dim // keys.width)
    n_k_progs = triton.cdiv(k_rows, k_block)
    args = hk.decode_args(
        {"k": k_dst, "v": v_dst}, device_indices, host_indices, bad_index_counter
    )
    args["dst"] = tuple(
        (hk.element_bits(t), *_device_rows(side, t.stride()))
        for t, side in ((k_dst, keys), (v_dst, values))
    )
    _decode_kernel[(n_k_progs + triton.cdiv(n * heads, v_block),)](
        codes=(keys.codes, values.codes),
        meta=(keys.meta, values.meta),
        n_tok=n,
        n_host=units * ut,
        n_k_progs=n_k_progs,
        GEO=_geometry(keys, values, heads, ut, k_dst.dtype),
        BLOCKS=(k_block, v_block),
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps or DECODE_WARPS,
        **args,
    )
