"""Fused Triton kernels for the INT4 and K8V4 host (L2) KV formats
(--hicache-host-dtype int4 / k8v4).

encode_gather backs up a transfer in one launch (all layers, keys and values:
device rows -> 4-bit codes, or K8V4's int8 keys, + fp16 metadata at the host
indices); decode_scatter restores one layer in one launch. Groups are coded
asymmetrically (x^ = m + q * s, q in 0..15, two codes a byte), values per
token, keys per token or per channel over a unit's tokens; bits match
kv_int4_codec (docs/kernels.md). The device KV is bf16/fp16 or FP8 (E4M3FN,
E5M2: bytes widened and rounded back by integer operations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_hadamard_triton as hr
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, available

__all__ = ["DeviceLayerTable", "available", "decode_scatter", "encode_gather"]

ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
DECODE_WARPS = 4
# FP8 output's integer rounding spilled 8 B with 4 warps (per-channel keys,
# sm_86 at 4096 elements, sm_90 at 8192); 8 warps halve the lanes per thread.
FP8_DECODE_WARPS = 8

# KEY_MODE constexpr values.
KEYS_INT8 = 0  # k8v4: kv_int8_codec rows
KEYS_PER_TOKEN = 1  # int4, channel groups per token and head
KEYS_PER_CHANNEL = 2  # int4, one group per channel over a unit's tokens


class Geometry(NamedTuple):
    """The constexprs both kernels take, as one tuple."""

    H: int
    D: tuple[int, int]  # per side (K, V), as G, ROT_B, BLOCKS and COUNT_BAD_IDX
    KEY_MODE: int
    G: tuple[int, int]
    UT: int
    IS_BF16: bool
    ROT_B: tuple[int, int]  # 0: not rotated
    FP8: int  # hk.FP8_NONE: 16-bit device KV


@triton.constexpr_function
def qmax(bits: int) -> float:
    """The largest code of an unsigned `bits`-bit group (15.0 for INT4)."""
    return float((1 << int(bits)) - 1)


@triton.jit
def _group_params(lo, hi, has_nan, BITS: tl.constexpr = 4):
    """(s, m) of groups with extremes lo, hi: fp16 bit patterns (NaN for
    non-finite groups), their fp32 values, and the non-finite flag."""
    # A zero m is stored as +0: min(-0, +0) may return either zero.
    m_bits = lo.to(tl.float16).to(tl.int16, bitcast=True)
    m_bits = tl.where(m_bits == -32768, 0, m_bits).to(tl.int16)
    m = m_bits.to(tl.float16, bitcast=True).to(tl.float32)
    s32 = tl.maximum(tl.math.div_rn(hi - m, qmax(BITS)), 1.1754943508222875e-38)
    s_bits, s = hk.fp16_scale_up(s32)
    # An Inf in the group makes m (lo = -inf) or s (hi = +inf) infinite.
    bad = has_nan | (tl.abs(m) > 65504.0) | (s != s) | (s > 65504.0)
    s_bits = tl.where(bad, 0x7E00, s_bits).to(tl.int16)  # torch's fp16 NaN
    m_bits = tl.where(bad, 0x7E00, m_bits).to(tl.int16)
    return s_bits, m_bits, s, m, bad


@triton.jit
def _codes(x, s, m, bad, BITS: tl.constexpr = 4):
    """BITS-bit codes (int32) of x given broadcastable (s, m, bad)."""
    r = hk.rint(tl.math.div_rn(x - m, s))
    r = tl.minimum(tl.maximum(r, 0.0), qmax(BITS))
    return tl.where(bad, 0.0, r).to(tl.int32)


@triton.jit
def _to_device_bits(y, IS_BF16: tl.constexpr, FP8: tl.constexpr):
    """fp32 values -> patterns of the device dtype (16-bit, or FP8 bytes),
    rounded once."""
    if FP8:
        out = hk.fp32_to_fp8_bits(y, FP8)
    elif IS_BF16:
        out = hk.bf16_rne_bits(y)
    else:
        # Test NaN first: min/max need not propagate it.
        is_nan = y != y
        y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
        out = y.to(tl.float16).to(tl.int16, bitcast=True)
        out = tl.where(is_nan, 0x7E00, out).to(tl.int16)  # torch's fp16 NaN
    return out


@triton.jit
def _encode_groups(
    src,
    q,
    meta,
    idx,
    stats,
    rows,
    layer,
    sign_ptr,
    H: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,
    STATS: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    ROT_B: tl.constexpr,
    BITS: tl.constexpr = 4,
    q_lo=None,
):
    """Per-token groups: rows (token, head, group) of G channels; ROT_B > 0
    rotates them first (a block spans ROT_B / G whole rows if ROT_B > G).
    Arguments as hk.int8_encode_rows'; meta's strides go on with the group's
    and the (s, m) parameter's. BITS = 8 splits each code into its high
    nibble (q) and low nibble (q_lo = (record, its layer); int4c's keys)."""
    G2_PAD: tl.constexpr = hk.pow2(G) // 2
    # Once per token: its first row, in layer 0.
    head_grp, didx, hidx, hmask = hk.row_slots(
        rows[0], rows[1], idx, rows[2], layer == 0, H * NG, BLOCK_R, COUNT_BAD_IDX
    )
    head = head_grp // NG
    grp = head_grp % NG
    j = tl.arange(0, G2_PAD)
    e = tl.arange(0, 2)
    lane = j < G // 2
    inside = lane[None, :, None] & (e < 2)[None, None, :]
    c = 2 * j[:, None] + e[None, :]
    m3 = hmask[:, None, None] & inside
    x_row = src[1] + didx * src[2] + head * src[3] + grp * G
    bits = tl.load(src[0] + (x_row[:, None, None] + c[None, :, :]), mask=m3, other=0)
    x = hk.to_fp32(bits, IS_BF16, FP8)
    if ROT_B:
        sign_off = (grp * G)[:, None, None] + c[None, :, :]
        x = hr.rotate(x, tl.load(sign_ptr + sign_off, mask=m3, other=0.0), ROT_B)

    lo = tl.min(tl.min(tl.where(inside, x, float("inf")), axis=2), axis=1)
    hi = tl.max(tl.max(tl.where(inside, x, float("-inf")), axis=2), axis=1)
    has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=2), axis=1) > 0
    s_bits, m_bits, s, m, bad = _group_params(lo, hi, has_nan, BITS)
    codes = _codes(x, s[:, None, None], m[:, None, None], bad[:, None, None], BITS)
    if BITS == 8:
        packed = tl.sum((codes >> 4) << (4 * e)[None, None, :], axis=2)
    else:
        packed = tl.sum(codes << (4 * e)[None, None, :], axis=2)

    unit, within = hk.unit_slots(hidx, UT)
    q_row = hk.record_offset(q, unit, layer, within, head) + grp * (G // 2)
    qmask = hmask[:, None] & lane[None, :]
    tl.store(q[0] + (q_row[:, None] + j[None, :]), packed.to(tl.uint8), mask=qmask)
    if BITS == 8:
        packed = tl.sum((codes & 15) << (4 * e)[None, None, :], axis=2)
        lo_row = hk.record_offset(q_lo[0], unit, q_lo[1], within, head) + grp * (G // 2)
        lo_off = lo_row[:, None] + j[None, :]
        tl.store(q_lo[0][0] + lo_off, packed.to(tl.uint8), mask=qmask)
    m_off = hk.record_offset(meta, unit, layer, within, head) + grp * meta[5]
    tl.store(meta[0] + m_off, s_bits, mask=hmask)
    tl.store(meta[0] + m_off + meta[6], m_bits, mask=hmask)
    amax = tl.where(hmask & ~bad, tl.maximum(tl.abs(lo), tl.abs(hi)), 0.0)
    hk.count_stats(stats, bad & hmask, amax, STATS)


@triton.jit
def unit_run(run, idx, n_host, once, UT: tl.constexpr, COUNT_BAD_IDX: tl.constexpr):
    """The transfer's tokens [run * UT, (run + 1) * UT) as one host unit: the
    token lanes, their mask and device indices, whether they are one whole
    in-range unit in order, and that unit. Where `once` holds, the in-range
    tokens of a broken run are counted (the value programs count the
    out-of-range ones)."""
    UT_PAD: tl.constexpr = hk.pow2(UT)
    t = tl.arange(0, UT_PAD)
    tmask = t < UT
    didx, hidx, in_range = hk.token_slots(run.to(tl.int64) * UT + t, tmask, idx, n_host)
    first = tl.load(idx[1] + run.to(tl.int64) * UT).to(tl.int64)
    out_of_order = tl.max((tmask & (hidx != first + t)).to(tl.int32), axis=0)
    run_ok = (first >= 0) & (first < n_host) & (first % UT == 0) & (out_of_order == 0)
    if COUNT_BAD_IDX:
        hk.count_flags(idx[2], in_range & ~run_ok & once)
    return t, tmask, didx, run_ok, first // UT


@triton.jit
def _encode_channels(
    src,
    q,
    meta,
    idx,
    stats,
    n_host,
    layer,
    sign_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    CB2: tl.constexpr,
    NCB: tl.constexpr,
    UT: tl.constexpr,
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,
    STATS: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    ROT_B: tl.constexpr,
    BITS: tl.constexpr = 4,
):
    """Per-channel groups over one run of UT tokens (one host unit), for one
    head and CB2 channel pairs (whole rotation blocks if ROT_B > 0); the
    program id picks them. meta has no token dim (stride 0); its group
    stride is the channel's. BITS = 8 stores one code a byte (int8c's keys)."""
    pid = tl.program_id(0)
    head = ((pid // NCB) % H).to(tl.int64)
    cb = pid % NCB
    once = (head == 0) & (cb == 0) & (layer == 0)
    t, tmask, didx, run_ok, unit = unit_run(
        pid // (H * NCB), idx, n_host, once, UT, COUNT_BAD_IDX
    )
    j = cb * CB2 + tl.arange(0, CB2)
    e = tl.arange(0, 2)
    c = 2 * j[:, None] + e[None, :]
    cmask = c < D
    tvalid = tmask[:, None, None] & (c >= 0)[None, :, :]
    m3 = (tmask & run_ok)[:, None, None] & cmask[None, :, :]
    x_row = src[1] + didx * src[2] + head * src[3]
    bits = tl.load(src[0] + (x_row[:, None, None] + c[None, :, :]), mask=m3, other=0)
    x = hk.to_fp32(bits, IS_BF16, FP8)
    if ROT_B:
        signs = tl.load(sign_ptr + c, mask=cmask, other=0.0)
        x = hr.rotate(x, signs[None, :, :], ROT_B)

    lo = tl.min(tl.where(tvalid, x, float("inf")), axis=0)
    hi = tl.max(tl.where(tvalid, x, float("-inf")), axis=0)
    has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
    s_bits, m_bits, s, m, bad = _group_params(lo, hi, has_nan, BITS)
    codes = _codes(x, s[None, :, :], m[None, :, :], bad[None, :, :], BITS)

    q_row = hk.record_offset(q, unit, layer, t, head)
    if BITS == 8:
        q_off = q_row[:, None, None] + c[None, :, :]
        tl.store(q[0] + q_off, codes.to(tl.uint8), mask=m3)
    else:
        packed = tl.sum(codes << (4 * e)[None, None, :], axis=2)
        qmask = (tmask & run_ok)[:, None] & (j < D // 2)[None, :]
        q_off = q_row[:, None] + j[None, :]
        tl.store(q[0] + q_off, packed.to(tl.uint8), mask=qmask)
    m_off = hk.record_offset(meta, unit, layer, 0, head) + c * meta[5]
    wmask = cmask & run_ok
    tl.store(meta[0] + m_off, s_bits, mask=wmask)
    tl.store(meta[0] + m_off + meta[6], m_bits, mask=wmask)
    amax = tl.where(wmask & ~bad, tl.maximum(tl.abs(lo), tl.abs(hi)), 0.0)
    n_bad = tl.sum((bad & wmask).to(tl.int64), axis=1)
    hk.count_stats(stats, n_bad, tl.max(amax, axis=1), STATS)


@triton.jit
def nibbles(ptr, row, j, mask):
    """Packed codes: bytes j of each row -> int32 [rows, len(j), 2] codes,
    the even channel's from the low nibble."""
    packed = tl.load(ptr + (row[:, None] + j[None, :]), mask=mask, other=0)
    shift = 4 * tl.arange(0, 2)
    return (packed.to(tl.int32)[:, :, None] >> shift[None, None, :]) & 15


@triton.jit
def _decode_groups(
    q,
    meta,
    dst,
    idx,
    rows,
    sign_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    ROT_B: tl.constexpr,
    BITS: tl.constexpr = 4,
    q_lo=None,
):
    """Rows (token, head) of D channels; channel c's (s, m) sit at group
    c // G (per-channel keys: G = 1 and no token stride). Arguments as
    hk.int8_decode_rows'; meta's as _encode_groups'. BITS = 8 reads one code
    a byte, or with q_lo (a record as q) its high nibble from q and its low
    nibble from q_lo."""
    D2_PAD: tl.constexpr = hk.pow2(D) // 2
    head, didx, hidx, hmask = hk.row_slots(
        rows[0], rows[1], idx, rows[2], True, H, BLOCK_R, COUNT_BAD_IDX
    )
    j = tl.arange(0, D2_PAD)
    e = tl.arange(0, 2)
    lane = j < D // 2
    unit, within = hk.unit_slots(hidx, UT)
    q_row = hk.record_offset(q, unit, 0, within, head)
    c = 2 * j[:, None] + e[None, :]
    m3 = hmask[:, None, None] & (lane[:, None] & (e < 2)[None, :])[None, :, :]
    if BITS == 8 and q_lo is None:
        q_off = q_row[:, None, None] + c[None, :, :]
        codes = tl.load(q[0] + q_off, mask=m3, other=0).to(tl.int32)
    else:
        codes = nibbles(q[0], q_row, j, hmask[:, None] & lane[None, :])
        if BITS == 8:
            lo_row = hk.record_offset(q_lo, unit, 0, within, head)
            lo = nibbles(q_lo[0], lo_row, j, hmask[:, None] & lane[None, :])
            codes = (codes << 4) | lo
    m_row = hk.record_offset(meta, unit, 0, within, head)
    m_off = m_row[:, None, None] + ((c // G) * meta[5])[None, :, :]
    s = tl.load(meta[0] + m_off, mask=m3, other=0)
    m = tl.load(meta[0] + (m_off + meta[6]), mask=m3, other=0)
    s = s.to(tl.float16, bitcast=True).to(tl.float32)
    m = m.to(tl.float16, bitcast=True).to(tl.float32)
    y = m + codes.to(tl.float32) * s
    if ROT_B:
        signs = tl.load(sign_ptr + c, mask=lane[:, None] & (e < 2)[None, :], other=0.0)
        y = hr.unrotate(y, signs[None, :, :], ROT_B)
    out = _to_device_bits(y, IS_BF16, FP8)
    y_row = didx * dst[1] + head * dst[2]
    tl.store(dst[0] + (y_row[:, None, None] + c[None, :, :]), out, mask=m3)


@hk.kernel_jit(unaligned=["sign_ptr"])
def _encode_kernel(
    dev,  # per side: (base, token stride, head stride, layer offsets)
    dev_idx_ptr,
    host_idx_ptr,
    counters,  # (nonfinite, amax [table layers, 2], bad indices)
    sign_ptr,
    codes,  # per side: (codes, unit, layer, token, head strides)
    meta,  # per side: (metadata, unit, layer, token, head, group, param strides)
    n_tok,
    n_host,
    n_k_progs,
    first_layer,  # the tables' layer of record layer 0
    GEO: tl.constexpr,  # Geometry
    BLOCKS: tl.constexpr,  # per side; keys: rows, or channel pairs if per channel
    K_NCB: tl.constexpr,
    ALIGNED: tl.constexpr,
    STATS: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
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
            row0 = (pid - side * n_k_progs) * BLOCKS[side]
            if side == 0 and GEO.KEY_MODE == 0:
                hk.int8_encode_rows(
                    src, codes[0], meta[0], idx, stats, (row0, n_tok * GEO.H, n_host),
                    layer, GEO.H, GEO.D[0], GEO.UT, BLOCKS[0], GEO.IS_BF16,
                    STATS, COUNT_BAD_IDX[0], GEO.FP8,
                )  # fmt: skip
            elif side == 0 and GEO.KEY_MODE == 2:
                _encode_channels(
                    src, codes[0], meta[0], idx, stats, n_host, layer, sign_ptr,
                    GEO.H, GEO.D[0], BLOCKS[0], K_NCB, GEO.UT, GEO.IS_BF16,
                    GEO.FP8, STATS, COUNT_BAD_IDX[0], GEO.ROT_B[0],
                )  # fmt: skip
            else:
                groups = GEO.D[side] // GEO.G[side]
                _encode_groups(
                    src, codes[side], meta[side], idx, stats,
                    (row0, n_tok * (GEO.H * groups), n_host), layer, sign_ptr,
                    GEO.H, groups, GEO.G[side], GEO.UT, BLOCKS[side],
                    GEO.IS_BF16, GEO.FP8, STATS, COUNT_BAD_IDX[side],
                    GEO.ROT_B[side],
                )  # fmt: skip


@hk.kernel_jit(unaligned=["sign_ptr"])
def _decode_kernel(
    codes,  # per side: (codes, unit, 0, token, head strides)
    meta,  # per side: (metadata, unit, 0, token, head, group, param strides)
    dev_idx_ptr,
    host_idx_ptr,
    bad_idx_ptr,
    dst,
    sign_ptr,
    n_tok,
    n_host,
    n_k_progs,
    GEO: tl.constexpr,  # Geometry
    BLOCKS: tl.constexpr,  # per side
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (key programs + value programs,); one layer's records (layer
    # stride 0); the keys count bad indices
    idx = (dev_idx_ptr, host_idx_ptr, bad_idx_ptr)
    pid = tl.program_id(0)
    prog_side = (pid >= n_k_progs).to(tl.int32)
    for side in tl.static_range(2):
        if prog_side == side:
            rows = ((pid - side * n_k_progs) * BLOCKS[side], n_tok * GEO.H, n_host)
            if side == 0 and GEO.KEY_MODE == 0:
                hk.int8_decode_rows(
                    codes[0], meta[0], dst[0], idx, rows,
                    GEO.H, GEO.D[0], GEO.UT, BLOCKS[0], GEO.IS_BF16,
                    COUNT_BAD_IDX, GEO.FP8,
                )  # fmt: skip
            else:
                _decode_groups(
                    codes[side], meta[side], dst[side], idx, rows, sign_ptr,
                    GEO.H, GEO.D[side], GEO.G[side], GEO.UT, BLOCKS[side],
                    GEO.IS_BF16, GEO.FP8, COUNT_BAD_IDX and side == 0,
                    GEO.ROT_B[side],
                )  # fmt: skip


# ----------------------------------------------------------------------------
# host-side wrappers

_CODE_DIMS = ("unit", "layer", "token", "head")
_META_DIMS = ("unit", "layer", "token", "head", "group", "param")


@dataclass(frozen=True)
class _Side:
    """One side's records as the kernels address them: the codes view, the
    metadata as 16-bit patterns, and their element strides (a stride of 0
    where the records have no such dim)."""

    mode: int  # KEY_MODE (values: KEYS_PER_TOKEN)
    dim: int  # channels per head
    group: int  # channels per group (1: per-channel keys)
    codes: torch.Tensor
    meta: torch.Tensor
    code_strides: tuple[int, ...]  # unit, [layer,] token, head
    meta_strides: tuple[int, ...]  # unit, [layer,] token, head, group, s|m

    def records(self, code_dims, meta_dims) -> tuple[tuple, tuple]:
        """This side's codes and metadata as the kernels take them
        (hk.record_arg), the strides named by dim."""
        return (
            hk.record_arg(self.codes, code_dims, self.code_strides),
            hk.record_arg(self.meta, meta_dims, self.meta_strides),
        )


def _fail(name: str, t: torch.Tensor, expected: str) -> None:
    raise ValueError(
        f"{name}: expected {expected}, got {t.dtype} {tuple(t.shape)} "
        f"strides {t.stride()}"
    )


def _codes_view(name, t, dtype, lead: int, head_num: int, width: int):
    """[*lead dims, head_num, width] of dtype, last dim contiguous."""
    ok = (
        t.dtype == dtype
        and t.dim() == lead + 2
        and tuple(t.shape[-2:]) == (head_num, width)
        and t.stride(-1) == 1
    )
    if not ok:
        _fail(name, t, f"a {lead + 2}-D {dtype} view ending in {(head_num, width)}")
    return tuple(t.stride()[:-1])


def _side(records, side: str, lead: int, head_num: int, dim: int) -> _Side:
    """Parse one side's records (lead = 3: [unit, layer, token] for encode,
    2: [unit, token] for decode); the key mode and the group size follow
    from the metadata's shape."""
    codes = records[side]
    if side == "k" and "k_scale" in records:
        strides = _codes_view(side, codes, torch.int8, lead, head_num, dim)
        scale = records["k_scale"]
        if scale.dtype != torch.float16 or tuple(scale.shape) != tuple(
            codes.shape[:-1]
        ):
            _fail("k_scale", scale, f"float16 {tuple(codes.shape[:-1])}")
        meta = scale.view(torch.int16)
        return _Side(KEYS_INT8, dim, dim, codes, meta, strides, (*meta.stride(), 0, 0))
    if dim % 2:
        raise ValueError(f"{side}: INT4 records need an even head dim, got {dim}")
    strides = _codes_view(side, codes, torch.uint8, lead, head_num, dim // 2)
    meta_name = f"{side}_meta"
    meta = records[meta_name]
    if meta.dtype != torch.float16 or meta.shape[-1] != 2:
        _fail(meta_name, meta, "a float16 view ending in (..., 2)")
    meta16 = meta.view(torch.int16)
    ms = meta16.stride()
    if side == "k" and meta.dim() == lead + 2:
        # Per-channel keys: [unit, (layer,) head, dim, 2], no token dim.
        if tuple(meta.shape) != (*codes.shape[: lead - 1], head_num, dim, 2):
            _fail(meta_name, meta, f"per-channel [..., {head_num}, {dim}, 2]")
        meta_strides = (*ms[: lead - 1], 0, *ms[lead - 1 :])
        return _Side(KEYS_PER_CHANNEL, dim, 1, codes, meta16, strides, meta_strides)
    n_groups = meta.shape[-2] if meta.dim() == lead + 3 else 0
    if (
        meta.dim() != lead + 3
        or tuple(meta.shape[:-2]) != tuple(codes.shape[:-1])
        or n_groups == 0
        or dim % n_groups
        or (dim // n_groups) % 2
    ):
        _fail(meta_name, meta, f"[*{tuple(codes.shape[:-1])}, groups, 2]")
    return _Side(
        KEYS_PER_TOKEN, dim, dim // n_groups, codes, meta16, strides, tuple(ms)
    )


def _format_records(records, lead: int, head_num: int, dk: int, dv: int):
    names = set(records)
    if names not in ({"k", "k_meta", "v", "v_meta"}, {"k", "k_scale", "v", "v_meta"}):
        raise ValueError(
            f"records must be k, k_meta, v, v_meta (int4) or k, k_scale, v, "
            f"v_meta (k8v4), got {sorted(names)}"
        )
    keys = _side(records, "k", lead, head_num, dk)
    values = _side(records, "v", lead, head_num, dv)
    for side in (keys, values):
        if side.codes.shape[:lead] != keys.codes.shape[:lead]:
            raise ValueError(
                f"k and v records differ in units/layers/tokens: "
                f"{tuple(keys.codes.shape)} vs {tuple(side.codes.shape)}"
            )
    return keys, values


def _check_tables(tables) -> tuple[DeviceLayerTable, DeviceLayerTable]:
    if len(tables) != 2:
        raise ValueError(f"expected the K and V layer tables, got {len(tables)}")
    hk.check_kv_tables(*tables, fp8=True)
    return tables[0], tables[1]


def _check_rotation(keys: _Side, values: _Side, blocks, signs, device):
    """The (K, V) rotation blocks, checked against the records."""
    kb, vb = (int(b) for b in blocks)
    if kb and keys.mode == KEYS_INT8:
        raise ValueError("k: K8V4's INT8 keys have no rotated kernel variant")
    hr.check_rotation("k", keys.dim, kb, signs, device)
    hr.check_rotation("v", values.dim, vb, signs, device)
    return kb, vb


def _records_args(keys: _Side, values: _Side, dims, rotation_signs) -> dict:
    """Both kernels' record pointers and strides (dims: the codes' and the
    metadata's dim names), and the sign pointer (the codes if unrotated)."""
    (k_codes, k_meta), (v_codes, v_meta) = (s.records(*dims) for s in (keys, values))
    return {
        "sign_ptr": keys.codes if rotation_signs is None else rotation_signs,
        "codes": (k_codes, v_codes),
        "meta": (k_meta, v_meta),
    }


def _geometry_args(keys: _Side, values: _Side, H, ut, rot_blocks, dtype) -> dict:
    """The Geometry both kernels take: heads, widths, key mode, groups, unit
    tokens, the device dtype (bf16, FP8 kind) and the rotation blocks."""
    dims, groups = (keys.dim, values.dim), (keys.group, values.group)
    is_bf16 = dtype == torch.bfloat16
    return {
        "GEO": Geometry(
            H, dims, keys.mode, groups, ut, is_bf16, rot_blocks, hk.fp8_kind(dtype)
        )
    }


def encode_gather(
    tables: Sequence[DeviceLayerTable],
    device_indices: torch.Tensor,
    out: Mapping[str, torch.Tensor],
    host_indices: torch.Tensor,
    *,
    counters: hk.KVCounters | None = None,
    first_layer: int = 0,
    rotation_blocks: tuple[int, int] = (0, 0),
    rotation_signs: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Backup in one launch: encode the K/V rows
    tables[s][first_layer + l][device_indices[i]] of every layer l of the
    records into the records at host_indices[i].

    tables = (k_table, v_table), bf16/fp16 or FP8 (float8 views: the FP8
    values are encoded, widened exactly to fp32); out = the format's records as
    [units, L, *record.shape] views (any strides, last dim contiguous):

      int4   k uint8 [U, L, UT, H, Dk/2]
             k_meta fp16 [U, L, H, Dk, 2] (per-channel keys) or
                         [U, L, UT, H, Dk/Gk, 2] (per-token keys)
      k8v4   k int8 [U, L, UT, H, Dk], k_scale fp16 [U, L, UT, H]
      both   v uint8 [U, L, UT, H, Dv/2], v_meta fp16 [U, L, UT, H, Dv/Gv, 2]

    UT (unit_tokens), the key grouping and the group sizes are read from the
    views. Per-channel keys need whole units: the transfer's tokens
    [j * UT, (j + 1) * UT) go to one host unit in order (as HiCache moves
    pages); a run that isn't writes no keys, and its in-range tokens are
    counted in counters.bad_indices with those of out-of-range host
    indices (counters: hk.KVCounters, each field optional). Groups stored as
    non-finite are added to counters.nonfinite; counters.amax (fp32 [L, 2]:
    K, V) is raised to the largest max(|lo|, |hi|) of the finite groups.
    Device indices are not range-checked.

    rotation_blocks (K, V; 0: not rotated) rotate each head row in blocks of
    that many channels before it is coded (int4r, k8v4r: kv_hadamard's
    rotation, with rotation_signs its fp32 sign per channel); K8V4's INT8
    keys are never rotated.
    """
    k_table, v_table = _check_tables(tables)
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_table.device
    hk.check_indices(device_indices, host_indices, n, dev)
    layers, H = len(k_table), k_table.shape[1]
    keys, values = _format_records(out, 3, H, k_table.shape[2], v_table.shape[2])
    units, rec_layers, ut = keys.codes.shape[:3]
    hk.check_layer_range(first_layer, rec_layers, layers)
    if keys.mode == KEYS_PER_CHANNEL and n % ut:
        raise ValueError(
            f"per-channel keys encode whole units: {n} tokens is not a "
            f"multiple of unit_tokens={ut}"
        )
    counters = hk.check_counters(counters, layers, 2, dev)
    kb, vb = _check_rotation(keys, values, rotation_blocks, rotation_signs, dev)

    tile = tile or ENCODE_TILE
    warps = num_warps or ENCODE_WARPS
    dk = keys.dim
    if keys.mode == KEYS_PER_CHANNEL:
        pairs = max(1, min(hk.pow2(dk) // 2, hk.pow2(tile) // (2 * hk.pow2(ut))))
        if kb > 2 * pairs:
            # A program rotates whole blocks: more lanes, as many per thread.
            warps = num_warps or ENCODE_WARPS * kb // (2 * pairs)
            pairs = kb // 2
        k_ncb = triton.cdiv(dk // 2, pairs)
        k_block, n_k_progs = pairs, (n // ut) * H * k_ncb
    else:
        k_ncb = 1
        k_width = dk if keys.mode == KEYS_INT8 else keys.group
        # A block wider than a group spans that many consecutive rows.
        k_block = max(hk.block_rows(tile, k_width), kb // k_width)
        n_k_progs = triton.cdiv(n * H * (dk // k_width), k_block)
    v_block = max(hk.block_rows(tile, values.group), vb // values.group)
    n_v_progs = triton.cdiv(n * H * (values.dim // values.group), v_block)
    args = hk.encode_args(
        {"k": k_table, "v": v_table}, device_indices, host_indices, counters
    )
    # Keys count bad indices unless values do (per-token keys: same tokens).
    count_bad = counters.bad_indices is not None
    _encode_kernel[(n_k_progs + n_v_progs, rec_layers)](
        **_records_args(keys, values, (_CODE_DIMS, _META_DIMS), rotation_signs),
        **_geometry_args(keys, values, H, ut, (kb, vb), k_table.dtype),
        n_tok=n,
        n_host=units * ut,
        n_k_progs=n_k_progs,
        first_layer=first_layer,
        BLOCKS=(k_block, v_block),
        K_NCB=k_ncb,
        COUNT_BAD_IDX=(
            count_bad and keys.mode != KEYS_PER_TOKEN,
            count_bad and keys.mode != KEYS_INT8,
        ),
        num_warps=warps,
        **args,
    )


def decode_scatter(
    records: Mapping[str, torch.Tensor],
    host_indices: torch.Tensor,
    dst: Sequence[torch.Tensor],
    device_indices: torch.Tensor,
    *,
    bad_index_counter: torch.Tensor | None = None,
    rotation_blocks: tuple[int, int] = (0, 0),
    rotation_signs: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Restore one layer in one launch: decode the records at host_indices[i]
    into dst[0] (K) and dst[1] (V) rows device_indices[i].

    records: one layer's records as [units, *record.shape] views (as
    encode_gather's without the layer dim); dst: bf16/fp16 [size, H, D]
    device layers, dim contiguous, or FP8 (float8 views of SGLang's uint8
    storage). fp16 and FP8 output saturate at the dtype's largest finite
    value; non-finite groups restore as NaN. A host index outside the records
    restores nothing (the device rows keep their contents) and its token is
    counted in bad_index_counter if given. rotation_blocks / rotation_signs:
    as encode_gather's; the rows are unrotated after decoding.
    """
    if len(dst) != 2:
        raise ValueError(f"expected the K and V device layers, got {len(dst)}")
    k_dst, v_dst = dst
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_dst.device
    hk.check_indices(device_indices, host_indices, n, dev)
    hk.check_device_layers(k_dst, v_dst, fp8=True)
    H = k_dst.shape[1]
    keys, values = _format_records(records, 2, H, k_dst.shape[2], v_dst.shape[2])
    units, ut = keys.codes.shape[:2]
    hk.check_counter("bad_index_counter", bad_index_counter, dev)
    kb, vb = _check_rotation(keys, values, rotation_blocks, rotation_signs, dev)

    tile = tile or DECODE_TILE
    dk, dv = keys.dim, values.dim
    k_block = hk.block_rows(tile, dk)
    v_block = hk.block_rows(tile, dv)
    n_k_progs = triton.cdiv(n * H, k_block)
    layer_dims = ("unit", "token", "head")
    args = hk.decode_args(
        {"k": k_dst, "v": v_dst}, device_indices, host_indices, bad_index_counter
    )
    dims = (layer_dims, (*layer_dims, "group", "param"))
    _decode_kernel[(n_k_progs + triton.cdiv(n * H, v_block),)](
        **_records_args(keys, values, dims, rotation_signs),
        **_geometry_args(keys, values, H, ut, (kb, vb), k_dst.dtype),
        n_tok=n,
        n_host=units * ut,
        n_k_progs=n_k_progs,
        BLOCKS=(k_block, v_block),
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps
        or (FP8_DECODE_WARPS if k_dst.dtype in hk.FP8_DTYPES else DECODE_WARPS),
        **args,
    )
