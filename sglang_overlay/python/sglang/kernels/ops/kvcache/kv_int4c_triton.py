"""Fused Triton kernels for the int4c host (L2) KV format
(--hicache-host-dtype int4c).

encode_gather backs up a transfer in one launch (all layers, keys and values:
device rows -> codes + fp16 metadata at the host indices); decode_scatter
restores one layer in one launch. Keys of a unit of at least 16 tokens are
coded per channel over the unit with two-level metadata: an fp16 (L, R) per
channel and unit, and per sub-unit of S tokens 4-bit bounds (a, b) of the
sub-range L + R * [a, b] / 16 that 16 (or, on the plan's 8-bit layers, 256)
levels span; smaller units code keys as int4's per-token groups. Values are
rotated in blocks of their group (kv_hadamard_triton) and coded as int4's
per-token groups (kv_int4_triton). Bits match kv_int4c_codec
(docs/kernels.md#int4c).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_hadamard_triton as hr
from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, available

__all__ = ["DeviceLayerTable", "available", "decode_scatter", "encode_gather"]

ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
# Sub-unit keys hold (L, R, a, b) per element: 4 warps spilled 44-304 B on
# sm_86 (head dims 256 and 80); 8 halve the lanes per thread.
DECODE_WARPS = 8

# KEY_MODE constexpr values.
KEYS_PER_TOKEN = 0  # units below 16 tokens: int4's per-token key groups
KEYS_SUB_UNITS = 1  # per channel over the unit, (a, b) per sub-unit

FP16_NAN = tl.constexpr(0x7E00)  # torch's fp16 NaN, as the reference stores it


class Geometry(NamedTuple):
    """The constexprs both kernels take, as one tuple."""

    H: int
    D: tuple[int, int]  # per side (K, V)
    KEY_MODE: int
    S: int  # tokens per key sub-unit (per-token keys: 0)
    G: tuple[int, int]  # per-token group per side (sub-unit keys: 1)
    UT: int
    IS_BF16: bool
    ROT_B: int  # the values' rotation block (0: not rotated)
    PLAN: bool  # encode: the records hold k_lo; decode: this layer's do


# --- device functions ----------------------------------------------------------


@triton.jit
def _unit_range(lo, hi, has_nan):
    """Per channel-unit (L, R): L = lo rounded down to fp16, R = hi - L
    rounded up to fp16 (>= 0): their fp16 bit patterns (NaN for non-finite
    channel-units), fp32 values and the non-finite flag."""
    l_bits = lo.to(tl.float16).to(tl.int16, bitcast=True)
    L = l_bits.to(tl.float16, bitcast=True).to(tl.float32)
    # One fp16 step towards -inf where RNE went up (the zeros step to -2**-24).
    down = tl.where(L > 0.0, l_bits - 1, tl.where(L == 0.0, -32767, l_bits + 1))
    l_bits = tl.where(L > lo, down, l_bits).to(tl.int16)
    # Zeros are stored as +0: min(-0, +0) may return either.
    l_bits = tl.where(l_bits == -32768, 0, l_bits).to(tl.int16)
    L = l_bits.to(tl.float16, bitcast=True).to(tl.float32)
    r32 = hi - L
    r_bits = r32.to(tl.float16).to(tl.int16, bitcast=True)
    below = r_bits.to(tl.float16, bitcast=True).to(tl.float32) < r32
    r_bits = (r_bits + below.to(tl.int16)).to(tl.int16)
    r_bits = tl.where(r_bits == -32768, 0, r_bits).to(tl.int16)  # -0 - +0
    R = r_bits.to(tl.float16, bitcast=True).to(tl.float32)
    bad = has_nan | (tl.abs(L) > 65504.0) | (R != R) | (R > 65504.0)
    l_bits = tl.where(bad, FP16_NAN, l_bits).to(tl.int16)
    r_bits = tl.where(bad, FP16_NAN, r_bits).to(tl.int16)
    return l_bits, r_bits, L, R, bad


@triton.jit
def _sub_grid(L, R, a, b):
    """A sub-unit's grid origin L + R * a / 16 and width w = R * (b - a)
    (both products exact: 11 x 5 bits, so an FMA rounds the same)."""
    return L + R * a * 0.0625, R * (b - a)


@triton.jit
def _encode_keys(
    src,
    q,
    q_lo,
    rng,
    sub,
    idx,
    stats,
    n_host,
    layer,
    slot,
    H: tl.constexpr,
    D: tl.constexpr,
    CB2: tl.constexpr,
    NCB: tl.constexpr,
    UT: tl.constexpr,
    S: tl.constexpr,
    IS_BF16: tl.constexpr,
    STATS: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    PLAN: tl.constexpr,
):
    """Keys of one run of UT tokens (one host unit), one head and CB2 channel
    pairs (the program id picks them): per channel the unit's (L, R), per
    sub-unit of S tokens its (a, b), per token 4-bit codes, or 8-bit ones
    split into k and k_lo where slot >= 0 (the layer's k_lo slot)."""
    UT_PAD: tl.constexpr = hk.pow2(UT)
    # S < UT is a power of two dividing UT, so sub-units tile the padded run.
    S_PAD: tl.constexpr = UT_PAD if S == UT else S
    NSUB: tl.constexpr = UT // S
    NSUB_PAD: tl.constexpr = UT_PAD // S_PAD
    pid = tl.program_id(0)
    head = ((pid // NCB) % H).to(tl.int64)
    cb = pid % NCB
    once = (head == 0) & (cb == 0) & (layer == 0)
    t, tmask, didx, run_ok, unit = k4.unit_run(
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
    x = hk.to_fp32(bits, IS_BF16)

    low = tl.where(tvalid, x, float("inf"))
    high = tl.where(tvalid, x, float("-inf"))
    lo = tl.min(low, axis=0)
    hi = tl.max(high, axis=0)
    has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
    l_bits, r_bits, L, R, bad = _unit_range(lo, hi, has_nan)

    # Per sub-unit: [NSUB_PAD, CB2, 2] bounds a < b in sixteenths of R.
    lo_j = tl.min(tl.reshape(low, [NSUB_PAD, S_PAD, CB2, 2]), axis=1)
    hi_j = tl.max(tl.reshape(high, [NSUB_PAD, S_PAD, CB2, 2]), axis=1)
    L3, R3 = L[None, :, :], R[None, :, :]
    coded = (R3 > 0.0) & ~bad[None, :, :]
    a = tl.floor(tl.math.div_rn(lo_j - L3, R3) * 16.0)
    a = tl.where(coded, tl.minimum(tl.maximum(a, 0.0), 15.0), 0.0)
    # ceil as -floor(-v): libdevice ceil compiles to an FTZ cvt.rpi, floor's
    # cvt.rmi is the one FTZ rounding the compile check allows (exact here).
    b = -tl.floor(-(tl.math.div_rn(hi_j - L3, R3) * 16.0))
    b = tl.where(coded, tl.minimum(tl.maximum(b, a + 1.0), 16.0), 1.0)

    key8 = slot >= 0
    levels = tl.where(key8, 255.0, 15.0)
    sub_lo, w = _sub_grid(L3, R3, a, b)
    sub_lo = sub_lo[:, None, :, :]
    step = tl.math.div_rn(w, 16.0 * levels)[:, None, :, :]
    x4 = tl.reshape(x, [NSUB_PAD, S_PAD, CB2, 2])
    r = hk.rint(tl.math.div_rn(x4 - sub_lo, step))
    r = tl.minimum(tl.maximum(r, 0.0), levels)
    r = tl.where(coded[:, None, :, :], r, 0.0)
    codes = tl.reshape(r.to(tl.int32), [UT_PAD, CB2, 2])

    q_row = hk.record_offset(q, unit, layer, t, head)
    qmask = (tmask & run_ok)[:, None] & (j < D // 2)[None, :]
    high4 = tl.where(key8, codes >> 4, codes)
    packed = tl.sum(high4 << (4 * e)[None, None, :], axis=2)
    tl.store(q[0] + (q_row[:, None] + j[None, :]), packed.to(tl.uint8), mask=qmask)
    if PLAN:
        lo_row = hk.record_offset(q_lo, unit, tl.maximum(slot, 0), t, head)
        packed = tl.sum((codes & 15) << (4 * e)[None, None, :], axis=2)
        lo_off = lo_row[:, None] + j[None, :]
        tl.store(q_lo[0] + lo_off, packed.to(tl.uint8), mask=qmask & key8)
    wmask = cmask & run_ok
    r_off = hk.record_offset(rng, unit, layer, 0, head) + c * rng[5]
    tl.store(rng[0] + r_off, l_bits, mask=wmask)
    tl.store(rng[0] + r_off + rng[6], r_bits, mask=wmask)
    sub_byte = (a.to(tl.int32) | ((b.to(tl.int32) - 1) << 4)).to(tl.uint8)
    jsub = tl.arange(0, NSUB_PAD)
    s_row = hk.record_offset(sub, unit, layer, jsub, head)
    s_off = s_row[:, None, None] + c[None, :, :]
    tl.store(sub[0] + s_off, sub_byte, mask=(jsub < NSUB)[:, None, None] & wmask)
    amax = tl.where(wmask & ~bad, tl.maximum(tl.abs(lo), tl.abs(hi)), 0.0)
    n_bad = tl.sum((bad & wmask).to(tl.int64), axis=1)
    hk.count_stats(stats, n_bad, tl.max(amax, axis=1), STATS)


@triton.jit
def _decode_keys(
    q,
    q_lo,
    rng,
    sub,
    dst,
    idx,
    rows,
    H: tl.constexpr,
    D: tl.constexpr,
    UT: tl.constexpr,
    S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    KEY8: tl.constexpr,
):
    """Key rows (token, head) of D channels: x^ = sub_lo + (q * w) / N from
    the channel's (L, R) and the token's sub-unit (a, b), N = 16 * 15 (KEY8:
    16 * 255, k the codes' high nibbles, k_lo the low ones). q * w is exact,
    so no FMA contraction can change a bit."""
    D2_PAD: tl.constexpr = hk.pow2(D) // 2
    head, didx, hidx, hmask = hk.row_slots(
        rows[0], rows[1], idx, rows[2], True, H, BLOCK_R, COUNT_BAD_IDX
    )
    j = tl.arange(0, D2_PAD)
    e = tl.arange(0, 2)
    lane = j < D // 2
    c = 2 * j[:, None] + e[None, :]
    m2 = hmask[:, None] & lane[None, :]
    m3 = hmask[:, None, None] & (lane[:, None] & (e < 2)[None, :])[None, :, :]
    unit, within = hk.unit_slots(hidx, UT)
    codes = k4.nibbles(q[0], hk.record_offset(q, unit, 0, within, head), j, m2)
    if KEY8:
        lo_row = hk.record_offset(q_lo, unit, 0, within, head)
        codes = (codes << 4) | k4.nibbles(q_lo[0], lo_row, j, m2)
    r_row = hk.record_offset(rng, unit, 0, 0, head)
    r_off = r_row[:, None, None] + (c * rng[5])[None, :, :]
    L = tl.load(rng[0] + r_off, mask=m3, other=0)
    R = tl.load(rng[0] + (r_off + rng[6]), mask=m3, other=0)
    L = L.to(tl.float16, bitcast=True).to(tl.float32)
    R = R.to(tl.float16, bitcast=True).to(tl.float32)
    s_row = hk.record_offset(sub, unit, 0, within // S, head)
    ab = tl.load(sub[0] + (s_row[:, None, None] + c[None, :, :]), mask=m3, other=0)
    ab = ab.to(tl.int32)
    a = (ab & 15).to(tl.float32)
    b = ((ab >> 4) + 1).to(tl.float32)
    sub_lo, w = _sub_grid(L, R, a, b)
    y = sub_lo + tl.math.div_rn(codes.to(tl.float32) * w, 16.0 * (255 if KEY8 else 15))
    out = k4._to_device_bits(y, IS_BF16, hk.FP8_NONE)
    y_row = didx * dst[1] + head * dst[2]
    tl.store(dst[0] + (y_row[:, None, None] + c[None, :, :]), out, mask=m3)


@hk.kernel_jit(unaligned=["sign_ptr", "slot_ptr"])
def _encode_kernel(
    dev,  # per side: (base, token stride, head stride, layer offsets)
    dev_idx_ptr,
    host_idx_ptr,
    counters,  # (nonfinite, amax [table layers, 2], bad indices)
    sign_ptr,
    slot_ptr,  # int32 [record layers]: the layer's k_lo slot, -1: 4-bit keys
    codes,  # (k, k_lo, v): (codes, unit, layer, token, head strides)
    meta,  # (k_range | k_meta, k_sub, v_meta): unit, layer, token, head, ...
    n_tok,
    n_host,
    n_k_progs,
    first_layer,  # the tables' layer of record layer 0
    GEO: tl.constexpr,  # Geometry
    BLOCKS: tl.constexpr,  # per side: rows, or channel pairs for sub-unit keys
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
                slot = tl.full([], -1, tl.int32)
                if GEO.PLAN:
                    slot = tl.load(slot_ptr + layer)
                _encode_keys(
                    src, codes[0], codes[1], meta[0], meta[1], idx, stats, n_host,
                    layer, slot, GEO.H, GEO.D[0], BLOCKS[0], K_NCB, GEO.UT, GEO.S,
                    GEO.IS_BF16, STATS, COUNT_BAD_IDX[0], GEO.PLAN,
                )  # fmt: skip
            else:
                groups = GEO.D[side] // GEO.G[side]
                row0 = (pid - side * n_k_progs) * BLOCKS[side]
                rows = (row0, n_tok * (GEO.H * groups), n_host)
                # Per-token keys of a plan layer: 8 bits, split into k, k_lo.
                key8 = False
                if side == 0 and GEO.PLAN:
                    slot = tl.load(slot_ptr + layer)
                    key8 = slot >= 0
                    if key8:
                        k4._encode_groups(
                            src, codes[0], meta[0], idx, stats, rows, layer,
                            sign_ptr, GEO.H, groups, GEO.G[0], GEO.UT, BLOCKS[0],
                            GEO.IS_BF16, hk.FP8_NONE, STATS, COUNT_BAD_IDX[0], 0,
                            8, (codes[1], slot),
                        )  # fmt: skip
                if not key8:
                    k4._encode_groups(
                        src, codes[2 * side], meta[2 * side], idx, stats, rows,
                        layer, sign_ptr, GEO.H, groups, GEO.G[side], GEO.UT,
                        BLOCKS[side], GEO.IS_BF16, hk.FP8_NONE, STATS,
                        COUNT_BAD_IDX[side], GEO.ROT_B * side,
                    )  # fmt: skip


@hk.kernel_jit(unaligned=["sign_ptr"])
def _decode_kernel(
    codes,  # (k, k_lo, v): (codes, unit, 0, token, head strides)
    meta,  # as _encode_kernel's, layer stride 0
    dev_idx_ptr,
    host_idx_ptr,
    bad_idx_ptr,
    dst,  # per side: (element patterns, token stride, head stride)
    sign_ptr,
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
            rows = ((pid - side * n_k_progs) * BLOCKS[side], n_tok * GEO.H, n_host)
            if side == 0 and GEO.KEY_MODE == 1:
                _decode_keys(
                    codes[0], codes[1], meta[0], meta[1], dst[0], idx, rows,
                    GEO.H, GEO.D[0], GEO.UT, GEO.S, BLOCKS[0], GEO.IS_BF16,
                    COUNT_BAD_IDX, GEO.PLAN,
                )  # fmt: skip
            elif side == 0 and GEO.PLAN:
                # Per-token 8-bit keys: high nibbles in k, low ones in k_lo.
                k4._decode_groups(
                    codes[0], meta[0], dst[0], idx, rows, sign_ptr, GEO.H,
                    GEO.D[0], GEO.G[0], GEO.UT, BLOCKS[0], GEO.IS_BF16,
                    hk.FP8_NONE, COUNT_BAD_IDX, 0, 8, codes[1],
                )  # fmt: skip
            else:
                k4._decode_groups(
                    codes[2 * side], meta[2 * side], dst[side], idx, rows,
                    sign_ptr, GEO.H, GEO.D[side], GEO.G[side], GEO.UT,
                    BLOCKS[side], GEO.IS_BF16, hk.FP8_NONE,
                    COUNT_BAD_IDX and side == 0, GEO.ROT_B * side,
                )  # fmt: skip


# ----------------------------------------------------------------------------
# host-side wrappers

# The records' leading dims: encode views have a layer dim, decode views not.
_LEAD_DIMS = {3: ("unit", "layer", "token"), 2: ("unit", "token")}


def _fail(name: str, t: torch.Tensor, expected: str) -> None:
    raise ValueError(
        f"{name}: expected {expected}, got {t.dtype} {tuple(t.shape)} "
        f"strides {t.stride()}"
    )


def _checked(name, t, dtype, shape) -> torch.Tensor:
    """t, if it is `dtype` of `shape` with its last dim contiguous."""
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.stride(-1) != 1:
        _fail(name, t, f"{dtype} {tuple(shape)}, last dim contiguous")
    return t


class _Records(NamedTuple):
    """The records as the kernels take them (hk.record_arg tuples): codes
    (k, k_lo, v) and metadata (k_range | k_meta, k_sub, v_meta); a record
    not stored repeats another (never touched)."""

    key_mode: int
    sub_tokens: int
    groups: tuple[int, int]
    plan: bool
    codes: tuple
    meta: tuple


def _parse(records, lead: int, heads: int, dk: int, dv: int) -> _Records:
    """Parse the records (lead 3: [unit, layer, token] views for encode, 2:
    [unit, token] for decode); the key mode follows from the names."""
    names = set(records)
    sub_unit = {"k", "k_range", "k_sub", "v", "v_meta"}
    per_token = {"k", "k_meta", "v", "v_meta"}
    if names - {"k_lo"} not in (sub_unit, per_token):
        raise ValueError(
            "records must be k, k_range, k_sub, v, v_meta or k, k_meta, v, "
            f"v_meta (units below 16 tokens), + k_lo on 8-bit key layers; got "
            f"{sorted(names)}"
        )
    if dk % 2 or dv % 2:
        raise ValueError(f"int4c records need even head dims, got {dk}, {dv}")
    lead_dims = _LEAD_DIMS[lead]
    k = records["k"]
    if k.dim() != lead + 2:
        _fail("k", k, f"a {lead + 2}-D uint8 view")
    outer = tuple(k.shape[:lead])  # units[, layers], unit tokens
    k = _checked("k", k, torch.uint8, (*outer, heads, dk // 2))
    v = _checked("v", records["v"], torch.uint8, (*outer, heads, dv // 2))
    v_meta = records["v_meta"]
    vg = dv // v_meta.shape[-2] if v_meta.dim() == lead + 3 else 0
    if not vg or dv % vg or vg % 2:
        _fail("v_meta", v_meta, f"float16 [*{outer}, {heads}, groups, 2]")
    v_meta = _checked("v_meta", v_meta, torch.float16, (*outer, heads, dv // vg, 2))
    v_meta = hk.record_arg(
        v_meta.view(torch.int16), (*lead_dims, "head", "group", "param")
    )
    head_dims = (*lead_dims, "head")
    k_arg, v_arg = hk.record_arg(k, head_dims), hk.record_arg(v, head_dims)
    plan = "k_lo" in records
    lo_arg = k_arg
    if plan:
        k_lo = records["k_lo"]
        if k_lo.dim() != lead + 2:
            _fail("k_lo", k_lo, f"a {lead + 2}-D uint8 view")
        shape = (k.shape[0], *k_lo.shape[1 : lead - 1], *k.shape[lead - 1 :])
        lo_arg = hk.record_arg(_checked("k_lo", k_lo, torch.uint8, shape), head_dims)
    if "k_meta" in records:
        k_meta = records["k_meta"]
        kg = dk // k_meta.shape[-2] if k_meta.dim() == lead + 3 else 0
        if not kg or dk % kg or kg % 2:
            _fail("k_meta", k_meta, f"float16 [*{outer}, {heads}, groups, 2]")
        shape = (*outer, heads, dk // kg, 2)
        k_meta = _checked("k_meta", k_meta, torch.float16, shape).view(torch.int16)
        k_meta = hk.record_arg(k_meta, (*lead_dims, "head", "group", "param"))
        return _Records(
            KEYS_PER_TOKEN, 0, (kg, vg), plan, (k_arg, lo_arg, v_arg),
            (k_meta, k_meta, v_meta),
        )  # fmt: skip
    ut = outer[-1]
    rng = records["k_range"]
    rng = _checked("k_range", rng, torch.float16, (*outer[:-1], heads, dk, 2))
    rs = rng.view(torch.int16).stride()
    # No token dim: a channel's (L, R) holds for the unit's tokens.
    rng_arg = hk.record_arg(
        rng.view(torch.int16),
        (*lead_dims, "head", "channel", "param"),
        (*rs[: lead - 1], 0, *rs[lead - 1 :]),
    )
    sub = records["k_sub"]
    n_sub = sub.shape[lead - 1] if sub.dim() == lead + 2 else 0
    if not n_sub or ut % n_sub:
        _fail("k_sub", sub, f"uint8 [*{outer[:-1]}, sub-units, {heads}, {dk}]")
    sub = _checked("k_sub", sub, torch.uint8, (*outer[:-1], n_sub, heads, dk))
    s_tok = ut // n_sub
    if s_tok != ut and s_tok & (s_tok - 1):
        raise ValueError(f"k_sub: sub-units of {s_tok} tokens are not a power of two")
    sub_arg = hk.record_arg(sub, head_dims)
    return _Records(
        KEYS_SUB_UNITS, s_tok, (1, vg), plan, (k_arg, lo_arg, v_arg),
        (rng_arg, sub_arg, v_meta),
    )  # fmt: skip


def _check_rotation(dv: int, vg: int, blocks, signs, device) -> int:
    """The values' rotation block (0: not rotated), whole blocks inside each
    value group; int4c never rotates keys."""
    kb, vb = (int(b) for b in blocks)
    if kb:
        raise ValueError("k: int4c's keys are not rotated (rotation_blocks[0] = 0)")
    if vb and vg % vb:
        raise ValueError(f"v: rotation block {vb} does not divide the value group {vg}")
    hr.check_rotation("v", dv, vb, signs, device)
    return vb


_SLOT_MAPS: dict = {}


def _slot_map(key8_layers, first_layer: int, rec_layers: int, lo_layers, device):
    """int32 [rec_layers]: each record layer's slot in k_lo's layer dim (the
    plan's layers from first_layer on, in order), -1 for 4-bit keys; cached,
    so a backup copies nothing to the device after the first."""
    plan = tuple(sorted(int(x) for x in key8_layers))
    key = (plan, first_layer, rec_layers, str(device))
    if key not in _SLOT_MAPS:
        slots, n = [], 0
        for layer in range(first_layer, first_layer + rec_layers):
            slots.append(n if layer in plan else -1)
            n += layer in plan
        _SLOT_MAPS[key] = (torch.tensor(slots, dtype=torch.int32).to(device), n)
    slot_map, n = _SLOT_MAPS[key]
    if lo_layers != n:
        raise ValueError(
            f"k_lo holds {lo_layers} layers; key8_layers {list(plan)} put {n} "
            f"in record layers {first_layer}..{first_layer + rec_layers - 1}"
        )
    return slot_map


def encode_gather(
    tables: Sequence[DeviceLayerTable],
    device_indices: torch.Tensor,
    out: Mapping[str, torch.Tensor],
    host_indices: torch.Tensor,
    *,
    counters: hk.KVCounters | None = None,
    first_layer: int = 0,
    key8_layers: Sequence[int] = (),
    rotation_blocks: tuple[int, int] = (0, 0),
    rotation_signs: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Backup in one launch: encode the K/V rows
    tables[s][first_layer + l][device_indices[i]] of every layer l of the
    records into the records at host_indices[i].

    tables = (k_table, v_table), bf16/fp16; out = the format's records as
    [units, L, *record.shape] views (last dim contiguous):

      keys, units >= 16 tokens  k uint8 [U, L, UT, H, Dk/2],
                                k_range fp16 [U, L, H, Dk, 2] (L, R),
                                k_sub uint8 [U, L, UT/S, H, Dk] (a | (b-1) << 4),
                                k_lo uint8 [U, L8, UT, H, Dk/2] (plan layers)
      keys, units < 16 tokens   k uint8 [U, L, UT, H, Dk/2],
                                k_meta fp16 [U, L, UT, H, Dk/Gk, 2]
      values                    v uint8 [U, L, UT, H, Dv/2],
                                v_meta fp16 [U, L, UT, H, Dv/Gv, 2]

    key8_layers: the table layers whose keys are 8-bit (the format's plan);
    k_lo's L8 layers are those among the record layers, in order.
    rotation_blocks = (0, Gv) and rotation_signs (kv_hadamard.rotation_signs)
    rotate the values in blocks of their group before coding them.

    Keys per channel need whole units in order, as kv_int4_triton's do: a run
    that isn't writes no keys and its in-range tokens are counted in
    counters.bad_indices with those of out-of-range host indices. Groups
    (key channel-units, value groups) stored as non-finite are added to
    counters.nonfinite; counters.amax (fp32 [L, 2]) is raised to the largest
    magnitude of the finite groups.
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
    dk, dv = k_table.shape[2], v_table.shape[2]
    rec = _parse(out, 3, heads, dk, dv)
    units, rec_layers, ut = out["k"].shape[:3]
    hk.check_layer_range(first_layer, rec_layers, layers)
    if rec.key_mode == KEYS_SUB_UNITS and n % ut:
        raise ValueError(
            f"per-channel keys encode whole units: {n} tokens is not a "
            f"multiple of unit_tokens={ut}"
        )
    counters = hk.check_counters(counters, layers, 2, dev)
    vb = _check_rotation(dv, rec.groups[1], rotation_blocks, rotation_signs, dev)
    if rec.plan:
        lo_layers = out["k_lo"].shape[1]
        slot_map = _slot_map(key8_layers, first_layer, rec_layers, lo_layers, dev)
    else:
        slot_map = device_indices  # never read

    tile = tile or ENCODE_TILE
    if rec.key_mode == KEYS_SUB_UNITS:
        pairs = max(1, min(hk.pow2(dk) // 2, hk.pow2(tile) // (2 * hk.pow2(ut))))
        k_ncb = triton.cdiv(dk // 2, pairs)
        k_block, n_k_progs = pairs, (n // ut) * heads * k_ncb
    else:
        k_ncb, kg = 1, rec.groups[0]
        k_block = hk.block_rows(tile, kg)
        n_k_progs = triton.cdiv(n * heads * (dk // kg), k_block)
    vg = rec.groups[1]
    # Rotation blocks sit inside a group's row.
    v_block = hk.block_rows(tile, vg)
    n_v_progs = triton.cdiv(n * heads * (dv // vg), v_block)
    args = hk.encode_args(
        {"k": k_table, "v": v_table}, device_indices, host_indices, counters
    )
    count_bad = counters.bad_indices is not None
    _encode_kernel[(n_k_progs + n_v_progs, rec_layers)](
        sign_ptr=out["k"] if rotation_signs is None else rotation_signs,
        slot_ptr=slot_map,
        codes=rec.codes,
        meta=rec.meta,
        n_tok=n,
        n_host=units * ut,
        n_k_progs=n_k_progs,
        first_layer=first_layer,
        GEO=_geometry(rec, heads, dk, dv, ut, vb, k_table.dtype),
        BLOCKS=(k_block, v_block),
        K_NCB=k_ncb,
        # Per-channel keys count the in-range tokens of broken runs, values
        # the out-of-range ones; with per-token keys the values count them all.
        COUNT_BAD_IDX=(count_bad and rec.key_mode == KEYS_SUB_UNITS, count_bad),
        num_warps=num_warps or ENCODE_WARPS,
        **args,
    )


def _geometry(rec: _Records, heads, dk, dv, ut, vb, dtype) -> Geometry:
    return Geometry(
        heads,
        (dk, dv),
        rec.key_mode,
        rec.sub_tokens,
        rec.groups,
        ut,
        dtype == torch.bfloat16,
        vb,
        rec.plan,
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

    records: that layer's records as [units, *record.shape] views (as
    encode_gather's without the layer dim; k_lo only on an 8-bit key layer);
    dst: bf16/fp16 [size, H, D] device layers, dim contiguous. fp16 output
    saturates at its largest finite value; non-finite groups restore as NaN.
    A host index outside the records restores nothing and its token is
    counted in bad_index_counter if given. rotation_blocks / rotation_signs:
    as encode_gather's; values are unrotated after decoding.
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
    heads, dk, dv = k_dst.shape[1], k_dst.shape[2], v_dst.shape[2]
    rec = _parse(records, 2, heads, dk, dv)
    units, ut = records["k"].shape[:2]
    hk.check_counter("bad_index_counter", bad_index_counter, dev)
    vb = _check_rotation(dv, rec.groups[1], rotation_blocks, rotation_signs, dev)

    tile = tile or DECODE_TILE
    k_block = hk.block_rows(tile, dk)
    v_block = hk.block_rows(tile, dv)
    n_k_progs = triton.cdiv(n * heads, k_block)
    args = hk.decode_args(
        {"k": k_dst, "v": v_dst}, device_indices, host_indices, bad_index_counter
    )
    _decode_kernel[(n_k_progs + triton.cdiv(n * heads, v_block),)](
        codes=rec.codes,
        meta=rec.meta,
        sign_ptr=records["k"] if rotation_signs is None else rotation_signs,
        n_tok=n,
        n_host=units * ut,
        n_k_progs=n_k_progs,
        GEO=_geometry(rec, heads, dk, dv, ut, vb, k_dst.dtype),
        BLOCKS=(k_block, v_block),
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps or DECODE_WARPS,
        **args,
    )
