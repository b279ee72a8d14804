"""Fused Triton kernels for the INT4 and K8V4 host (L2) KV formats
(--hicache-host-dtype int4 / k8v4).

Like kv_int8_triton (whose docstring explains the shared techniques), two
kernels replace the pool's torch path on CUDA:

  encode_gather   backup, ONE launch per transfer (all layers, keys and
                  values): device rows -> 4-bit (or 8-bit) codes + fp16
                  metadata at the host indices
  decode_scatter  restore, ONE launch per layer: records -> device rows

Both run on the caller's current stream and never synchronize with the host.

Format (the shared host-format spec, kv_int4_codec). Every group x of
values is coded asymmetrically: q in 0..15, x^ = m + q * s, (s, m) fp16,
two codes per byte, the even channel in the low nibble. Values are grouped
per token and head in channel groups of G; keys either the same way
("per-token") or, when a unit holds enough tokens, per channel over the
unit's tokens ("per-channel"). K8V4 stores the keys as the INT8 format does
and is computed here by kv_int8_triton's own row function.

Bit-exactness (the arithmetic of kv_int8_triton: div_rn, rint from floor,
fp16 round-up of the scale, bf16 RNE by integer ops, NaN by x != x, no
@jit library reductions), per group:

  * lo = min x, hi = max x in fp32 (exact); padded lanes take +-inf so they
    never win. m16 = fp16(lo) (RNE), stored as +0 when it is a zero: IEEE
    min(-0, +0) may be either, and the sign changes no restored value. The
    group is non-finite when it holds a NaN (x != x, since Triton's min/max
    need not propagate NaN) or when m16 or the scale is not finite (which
    covers +-Inf: lo = -inf gives m16 = -inf, hi = +inf an infinite scale).
  * s32 = div_rn(hi - m, 15), floored at finfo(fp32).tiny; s16 = fp16(s32)
    RNE, +1 on the bit pattern if fp32(s16) < s32 (so q never exceeds 15
    by more than rounding), raised to at least 2**-24 as INT8 does.
  * q = clamp(rint(div_rn(x - m, s)), 0, 15); x - m rounds once in fp32.
  * Non-finite groups store (s, m) = (0x7E00, 0x7E00), q = 0, and are added
    to the non-finite counter (one atomic per program, when non-zero).
  * Decode: y = m + q * s in fp32 (q * s is exact, so an FMA rounds the
    same), saturated to +-65504 for fp16 (bf16's range is never reached:
    |y| < 16 * 65504), then rounded once into the device dtype. NaN groups
    restore as the canonical NaN of the dtype (fp16 0x7E00, bf16 0x7FC0),
    what torch writes, so every restored bit is reproducible.

Programs. A per-token group is a row of G channels; a program takes
BLOCK_R such rows (tokens x heads x groups, flattened), loaded as
[BLOCK_R, G/2, 2] channel pairs so packing is a reduction over the last
axis. A per-channel key group spans the UT tokens of a unit, so a program
owns (run, head, channel block): HiCache moves whole pages, and the
transfer's tokens [j * UT, (j + 1) * UT) are one host unit in order (the
host wrapper requires n % UT == 0; the kernel checks the run). One launch
covers both sides: programs [0, n_k_progs) encode keys, the rest values.

Host layout, indices and statistics as kv_int8_triton: records are views
whose strides describe the layout ([unit, layer, ...] for encode,
[unit, ...] of one layer for decode; layer_first passes unit = token), all
offsets int64, a host index outside the records is neither read nor
written and its token is counted once in bad_index_counter. For
per-channel keys a run whose indices are not one whole in-range unit in
order writes no keys; its in-range tokens are counted there too (the
out-of-range ones already are), so the counter is the number of tokens
whose records were not fully written. nonfinite_counter counts groups;
scale_amax [layers, 2] is raised to max(|lo|, |hi|) of the finite groups.

Kernels are built lazily (TRITON_INTERPRET is read at first use); the INT8
helpers come from kv_int8_triton's build in the same mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Mapping, Sequence

import torch

from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.kernels.ops.kvcache.kv_int8_triton import (
    DeviceLayerTable,
    available,
    interpreting,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - sglang always ships triton
    triton = tl = None

__all__ = [
    "DeviceLayerTable",
    "available",
    "decode_scatter",
    "encode_gather",
    "interpreting",
    "reset_kernels",
]

ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
DECODE_WARPS = 4

# KEY_MODE constexpr values.
KEYS_INT8 = 0  # k8v4: kv_int8_codec rows
KEYS_PER_TOKEN = 1  # int4, channel groups per token and head
KEYS_PER_CHANNEL = 2  # int4, one group per channel over a unit's tokens


# ----------------------------------------------------------------------------
# kernel sources (plain functions; _build() jit-compiles them on first use)


def _rint_src(v):
    """Round half to even, from floor (kv_int8_triton's docstring)."""
    t = tl.floor(v)
    f = v - t
    t_odd = (t - 2.0 * tl.floor(t * 0.5)) != 0.0
    up = (f > 0.5) | ((f == 0.5) & t_odd)
    return t + up.to(tl.float32)


def _group_params_src(lo, hi, has_nan):
    """(s, m) of groups with extremes lo, hi: fp16 bit patterns (NaN for
    non-finite groups), their fp32 values, and the non-finite flag."""
    # A zero m is stored as +0: min(-0, +0) may return either zero.
    m_bits = lo.to(tl.float16).to(tl.int16, bitcast=True)
    m_bits = tl.where(m_bits == -32768, 0, m_bits).to(tl.int16)
    m = m_bits.to(tl.float16, bitcast=True).to(tl.float32)
    s32 = tl.math.div_rn(hi - m, 15.0)
    s32 = tl.maximum(s32, 1.1754943508222875e-38)
    s_bits = s32.to(tl.float16).to(tl.int16, bitcast=True)
    below = s_bits.to(tl.float16, bitcast=True).to(tl.float32) < s32
    s_bits = tl.maximum(s_bits + below.to(tl.int16), 1).to(tl.int16)
    s = s_bits.to(tl.float16, bitcast=True).to(tl.float32)
    # An Inf in the group makes m (lo = -inf) or s (hi = +inf) infinite.
    bad = has_nan | (tl.abs(m) > 65504.0) | (s != s) | (s > 65504.0)
    s_bits = tl.where(bad, 0x7E00, s_bits).to(tl.int16)  # torch's fp16 NaN
    m_bits = tl.where(bad, 0x7E00, m_bits).to(tl.int16)
    return s_bits, m_bits, s, m, bad


def _codes_src(x, s, m, bad):
    """4-bit codes (int32) of x given broadcastable (s, m, bad)."""
    r = _rint(tl.math.div_rn(x - m, s))
    r = tl.minimum(tl.maximum(r, 0.0), 15.0)
    return tl.where(bad, 0.0, r).to(tl.int32)


def _to_device_bits_src(y, IS_BF16: tl.constexpr):
    """fp32 values -> 16-bit patterns of the device dtype, rounded once."""
    if IS_BF16:
        u = y.to(tl.uint32, bitcast=True)
        rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        out = tl.where(y != y, 0x7FC0, rounded).to(tl.int16)  # torch's bf16 NaN
    else:
        # Test NaN first: min/max need not propagate it.
        is_nan = y != y
        y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
        out = y.to(tl.float16).to(tl.int16, bitcast=True)
        out = tl.where(is_nan, 0x7E00, out).to(tl.int16)  # torch's fp16 NaN
    return out


def _encode_groups_src(
    x_base,
    layer_off,
    dev_idx_ptr,
    d_st,
    d_sh,
    host_idx_ptr,
    q_base,
    q_su,
    q_sl,
    q_st,
    q_sh,
    m_base,
    m_su,
    m_sl,
    m_st,
    m_sh,
    m_sg,
    m_sp,
    layer,
    row0,
    n_rows,
    n_host,
    counter_ptr,
    amax_ptr,
    bad_idx_ptr,
    H: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,
    G2_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT: tl.constexpr,
    AMAX: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    """Per-token groups: rows (token, head, group) of G channels."""
    rows = row0 + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    tok = rows // (H * NG)
    head = ((rows // NG) % H).to(tl.int64)
    grp = (rows % NG).to(tl.int64)
    j = tl.arange(0, G2_PAD)
    e = tl.arange(0, 2)

    didx = tl.load(dev_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    hidx = tl.load(host_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    hmask = rmask & (hidx >= 0) & (hidx < n_host)
    if COUNT_BAD_IDX:
        # Once per token: its first row, in layer 0.
        dropped = rmask & ~hmask & (head == 0) & (grp == 0) & (layer == 0)
        n_dropped = tl.reduce(dropped.to(tl.int64), 0, _sum_combine)
        tl.atomic_add(bad_idx_ptr, n_dropped, mask=n_dropped > 0)
    lane = j < G // 2
    inside = lane[None, :, None] & (e < 2)[None, None, :]
    c = 2 * j[:, None] + e[None, :]
    m3 = hmask[:, None, None] & inside
    src = layer_off + didx * d_st + head * d_sh + grp * G
    bits = tl.load(x_base + (src[:, None, None] + c[None, :, :]), mask=m3, other=0)
    x = _to_fp32(bits, IS_BF16)

    lo = tl.reduce(tl.where(inside, x, float("inf")), 2, _min_combine)
    lo = tl.reduce(lo, 1, _min_combine)
    hi = tl.reduce(tl.where(inside, x, float("-inf")), 2, _max_combine)
    hi = tl.reduce(hi, 1, _max_combine)
    has_nan = tl.reduce((x != x).to(tl.int32), 2, _max_combine)
    has_nan = tl.reduce(has_nan, 1, _max_combine) > 0
    s_bits, m_bits, s, m, bad = _group_params(lo, hi, has_nan)
    q = _codes(x, s[:, None, None], m[:, None, None], bad[:, None, None])
    packed = tl.reduce(q << (4 * e)[None, None, :], 2, _sum_combine)

    unit = hidx // UT
    within = hidx % UT
    q_row = unit * q_su + layer * q_sl + within * q_st + head * q_sh + grp * (G // 2)
    qmask = hmask[:, None] & lane[None, :]
    tl.store(q_base + (q_row[:, None] + j[None, :]), packed.to(tl.uint8), mask=qmask)
    m_off = unit * m_su + layer * m_sl + within * m_st + head * m_sh + grp * m_sg
    tl.store(m_base + m_off, s_bits, mask=hmask)
    tl.store(m_base + m_off + m_sp, m_bits, mask=hmask)
    if COUNT:
        n_bad = tl.reduce((bad & hmask).to(tl.int64), 0, _sum_combine)
        tl.atomic_add(counter_ptr, n_bad, mask=n_bad > 0)
    if AMAX:
        good = hmask & ~bad
        amax = tl.maximum(tl.abs(lo), tl.abs(hi))
        block_amax = tl.reduce(tl.where(good, amax, 0.0), 0, _max_combine)
        amax_bits = block_amax.to(tl.int32, bitcast=True)
        tl.atomic_max(amax_ptr, amax_bits, mask=amax_bits > 0)


def _encode_channels_src(
    x_base,
    layer_off,
    dev_idx_ptr,
    d_st,
    d_sh,
    host_idx_ptr,
    q_base,
    q_su,
    q_sl,
    q_st,
    q_sh,
    m_base,
    m_su,
    m_sl,
    m_sh,
    m_sc,
    m_sp,
    layer,
    pid,
    n_host,
    counter_ptr,
    amax_ptr,
    bad_idx_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    CB2: tl.constexpr,
    NCB: tl.constexpr,
    UT: tl.constexpr,
    UT_PAD: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT: tl.constexpr,
    AMAX: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    """Per-channel groups over one run of UT tokens (one host unit), for one
    head and CB2 channel pairs."""
    run = pid // (H * NCB)
    head = ((pid // NCB) % H).to(tl.int64)
    cb = pid % NCB
    t = tl.arange(0, UT_PAD)
    tmask = t < UT
    tok = run.to(tl.int64) * UT + t

    didx = tl.load(dev_idx_ptr + tok, mask=tmask, other=0).to(tl.int64)
    hidx = tl.load(host_idx_ptr + tok, mask=tmask, other=0).to(tl.int64)
    first = tl.load(host_idx_ptr + run.to(tl.int64) * UT).to(tl.int64)
    out_of_order = tl.reduce(
        (tmask & (hidx != first + t)).to(tl.int32), 0, _max_combine
    )
    run_ok = (first >= 0) & (first < n_host) & (first % UT == 0) & (out_of_order == 0)
    if COUNT_BAD_IDX:
        # The out-of-range tokens are counted by the value programs.
        in_range = tmask & (hidx >= 0) & (hidx < n_host)
        skipped = in_range & ~run_ok & (head == 0) & (cb == 0) & (layer == 0)
        n_skipped = tl.reduce(skipped.to(tl.int64), 0, _sum_combine)
        tl.atomic_add(bad_idx_ptr, n_skipped, mask=n_skipped > 0)
    j = cb * CB2 + tl.arange(0, CB2)
    e = tl.arange(0, 2)
    c = 2 * j[:, None] + e[None, :]
    cmask = c < D
    tvalid = tmask[:, None, None] & (c >= 0)[None, :, :]
    m3 = (tmask & run_ok)[:, None, None] & cmask[None, :, :]
    src = layer_off + didx * d_st + head * d_sh
    bits = tl.load(x_base + (src[:, None, None] + c[None, :, :]), mask=m3, other=0)
    x = _to_fp32(bits, IS_BF16)

    lo = tl.reduce(tl.where(tvalid, x, float("inf")), 0, _min_combine)
    hi = tl.reduce(tl.where(tvalid, x, float("-inf")), 0, _max_combine)
    has_nan = tl.reduce((x != x).to(tl.int32), 0, _max_combine) > 0
    s_bits, m_bits, s, m, bad = _group_params(lo, hi, has_nan)
    q = _codes(x, s[None, :, :], m[None, :, :], bad[None, :, :])
    packed = tl.reduce(q << (4 * e)[None, None, :], 2, _sum_combine)

    unit = first // UT
    q_row = unit * q_su + layer * q_sl + t * q_st + head * q_sh
    qmask = (tmask & run_ok)[:, None] & (j < D // 2)[None, :]
    tl.store(q_base + (q_row[:, None] + j[None, :]), packed.to(tl.uint8), mask=qmask)
    m_off = unit * m_su + layer * m_sl + head * m_sh + c * m_sc
    wmask = cmask & run_ok
    tl.store(m_base + m_off, s_bits, mask=wmask)
    tl.store(m_base + m_off + m_sp, m_bits, mask=wmask)
    if COUNT:
        n_bad = tl.reduce((bad & wmask).to(tl.int64), 1, _sum_combine)
        n_bad = tl.reduce(n_bad, 0, _sum_combine)
        tl.atomic_add(counter_ptr, n_bad, mask=n_bad > 0)
    if AMAX:
        amax = tl.where(wmask & ~bad, tl.maximum(tl.abs(lo), tl.abs(hi)), 0.0)
        block_amax = tl.reduce(tl.reduce(amax, 1, _max_combine), 0, _max_combine)
        amax_bits = block_amax.to(tl.int32, bitcast=True)
        tl.atomic_max(amax_ptr, amax_bits, mask=amax_bits > 0)


def _encode_kernel_src(
    k_base,
    v_base,
    k_offs,
    v_offs,
    dev_idx_ptr,
    host_idx_ptr,
    kq,
    km,
    vq,
    vm,
    counter_ptr,
    amax_ptr,
    bad_idx_ptr,
    n_tok,
    n_host,
    n_k_progs,
    dk_st,
    dk_sh,
    dv_st,
    dv_sh,
    kq_su,
    kq_sl,
    kq_st,
    kq_sh,
    km_su,
    km_sl,
    km_st,
    km_sh,
    km_sg,
    km_sp,
    vq_su,
    vq_sl,
    vq_st,
    vq_sh,
    vm_su,
    vm_sl,
    vm_st,
    vm_sh,
    vm_sg,
    vm_sp,
    H: tl.constexpr,
    DK: tl.constexpr,
    DK_PAD: tl.constexpr,
    KEY_MODE: tl.constexpr,
    GK: tl.constexpr,
    GK2_PAD: tl.constexpr,
    K_BLOCK: tl.constexpr,
    K_NCB: tl.constexpr,
    DV: tl.constexpr,
    GV: tl.constexpr,
    GV2_PAD: tl.constexpr,
    V_BLOCK_R: tl.constexpr,
    UT: tl.constexpr,
    UT_PAD: tl.constexpr,
    IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    COUNT: tl.constexpr,
    AMAX: tl.constexpr,
    K_COUNT_BAD_IDX: tl.constexpr,
    V_COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (key programs + value programs, layers)
    pid = tl.program_id(0)
    layer_idx = tl.program_id(1)
    layer = layer_idx.to(tl.int64)
    if pid < n_k_progs:
        off = tl.load(k_offs + layer_idx)
        if ALIGNED:
            off = tl.multiple_of(off, 16)
        if KEY_MODE == 0:
            _int8_encode_rows(
                k_base, off, dev_idx_ptr, dk_st, dk_sh, host_idx_ptr,
                kq, kq_su, kq_sl, kq_st, kq_sh,
                km, km_su, km_sl, km_st, km_sh,
                layer, pid * K_BLOCK, n_tok * H, n_host, counter_ptr,
                amax_ptr + 2 * layer, bad_idx_ptr,
                H, DK, DK_PAD, UT, K_BLOCK, IS_BF16, COUNT, AMAX, K_COUNT_BAD_IDX,
            )  # fmt: skip
        elif KEY_MODE == 1:
            _encode_groups(
                k_base, off, dev_idx_ptr, dk_st, dk_sh, host_idx_ptr,
                kq, kq_su, kq_sl, kq_st, kq_sh,
                km, km_su, km_sl, km_st, km_sh, km_sg, km_sp,
                layer, pid * K_BLOCK, n_tok * (H * (DK // GK)), n_host, counter_ptr,
                amax_ptr + 2 * layer, bad_idx_ptr,
                H, DK // GK, GK, GK2_PAD, UT, K_BLOCK, IS_BF16, COUNT, AMAX,
                K_COUNT_BAD_IDX,
            )  # fmt: skip
        else:
            _encode_channels(
                k_base, off, dev_idx_ptr, dk_st, dk_sh, host_idx_ptr,
                kq, kq_su, kq_sl, kq_st, kq_sh,
                km, km_su, km_sl, km_sh, km_sg, km_sp,
                layer, pid, n_host, counter_ptr, amax_ptr + 2 * layer, bad_idx_ptr,
                H, DK, K_BLOCK, K_NCB, UT, UT_PAD, IS_BF16, COUNT, AMAX,
                K_COUNT_BAD_IDX,
            )  # fmt: skip
    else:
        off = tl.load(v_offs + layer_idx)
        if ALIGNED:
            off = tl.multiple_of(off, 16)
        _encode_groups(
            v_base, off, dev_idx_ptr, dv_st, dv_sh, host_idx_ptr,
            vq, vq_su, vq_sl, vq_st, vq_sh,
            vm, vm_su, vm_sl, vm_st, vm_sh, vm_sg, vm_sp,
            layer, (pid - n_k_progs) * V_BLOCK_R, n_tok * (H * (DV // GV)), n_host,
            counter_ptr, amax_ptr + 2 * layer + 1, bad_idx_ptr,
            H, DV // GV, GV, GV2_PAD, UT, V_BLOCK_R, IS_BF16, COUNT, AMAX,
            V_COUNT_BAD_IDX,
        )  # fmt: skip


def _decode_groups_src(
    q_base,
    q_su,
    q_st,
    q_sh,
    m_base,
    m_su,
    m_st,
    m_sh,
    m_sg,
    m_sp,
    host_idx_ptr,
    y_base,
    y_st,
    y_sh,
    dev_idx_ptr,
    row0,
    n_rows,
    n_host,
    bad_idx_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    D2_PAD: tl.constexpr,
    G: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    """Rows (token, head) of D channels; channel c's (s, m) sit at group
    c // G (per-channel keys: G = 1 and no token stride)."""
    rows = row0 + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    tok = rows // H
    head = (rows % H).to(tl.int64)
    j = tl.arange(0, D2_PAD)
    e = tl.arange(0, 2)

    hidx = tl.load(host_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    didx = tl.load(dev_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    hmask = rmask & (hidx >= 0) & (hidx < n_host)
    if COUNT_BAD_IDX:
        dropped = rmask & ~hmask & (head == 0)
        n_dropped = tl.reduce(dropped.to(tl.int64), 0, _sum_combine)
        tl.atomic_add(bad_idx_ptr, n_dropped, mask=n_dropped > 0)
    unit = hidx // UT
    within = hidx % UT
    lane = j < D // 2
    q_row = unit * q_su + within * q_st + head * q_sh
    packed = tl.load(
        q_base + (q_row[:, None] + j[None, :]),
        mask=hmask[:, None] & lane[None, :],
        other=0,
    ).to(tl.int32)
    q = (packed[:, :, None] >> (4 * e)[None, None, :]) & 15
    c = 2 * j[:, None] + e[None, :]
    m3 = hmask[:, None, None] & (lane[:, None] & (e < 2)[None, :])[None, :, :]
    m_off = (unit * m_su + within * m_st + head * m_sh)[:, None, None] + (
        (c // G) * m_sg
    )[None, :, :]
    s = tl.load(m_base + m_off, mask=m3, other=0)
    m = tl.load(m_base + (m_off + m_sp), mask=m3, other=0)
    s = s.to(tl.float16, bitcast=True).to(tl.float32)
    m = m.to(tl.float16, bitcast=True).to(tl.float32)
    out = _to_device_bits(m + q.to(tl.float32) * s, IS_BF16)
    y_row = didx * y_st + head * y_sh
    tl.store(y_base + (y_row[:, None, None] + c[None, :, :]), out, mask=m3)


def _decode_kernel_src(
    kq,
    km,
    vq,
    vm,
    host_idx_ptr,
    k_dst,
    v_dst,
    dev_idx_ptr,
    bad_idx_ptr,
    n_tok,
    n_host,
    n_k_progs,
    kq_su,
    kq_st,
    kq_sh,
    km_su,
    km_st,
    km_sh,
    km_sg,
    km_sp,
    vq_su,
    vq_st,
    vq_sh,
    vm_su,
    vm_st,
    vm_sh,
    vm_sg,
    vm_sp,
    yk_st,
    yk_sh,
    yv_st,
    yv_sh,
    H: tl.constexpr,
    DK: tl.constexpr,
    DK_PAD: tl.constexpr,
    KEY_MODE: tl.constexpr,
    GK: tl.constexpr,
    K_BLOCK_R: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    GV: tl.constexpr,
    V_BLOCK_R: tl.constexpr,
    UT: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (key programs + value programs,)
    pid = tl.program_id(0)
    if pid < n_k_progs:
        if KEY_MODE == 0:
            _int8_decode_rows(
                kq, kq_su, kq_st, kq_sh, km, km_su, km_st, km_sh, host_idx_ptr,
                k_dst, yk_st, yk_sh, dev_idx_ptr, pid * K_BLOCK_R, n_tok * H,
                n_host, bad_idx_ptr, H, DK, DK_PAD, UT, K_BLOCK_R, IS_BF16,
                COUNT_BAD_IDX,
            )  # fmt: skip
        else:
            _decode_groups(
                kq, kq_su, kq_st, kq_sh, km, km_su, km_st, km_sh, km_sg, km_sp,
                host_idx_ptr, k_dst, yk_st, yk_sh, dev_idx_ptr, pid * K_BLOCK_R,
                n_tok * H, n_host, bad_idx_ptr,
                H, DK, DK_PAD // 2, GK, UT, K_BLOCK_R, IS_BF16, COUNT_BAD_IDX,
            )  # fmt: skip
    else:
        _decode_groups(
            vq, vq_su, vq_st, vq_sh, vm, vm_su, vm_st, vm_sh, vm_sg, vm_sp,
            host_idx_ptr, v_dst, yv_st, yv_sh, dev_idx_ptr,
            (pid - n_k_progs) * V_BLOCK_R, n_tok * H, n_host, bad_idx_ptr,
            H, DV, DV_PAD // 2, GV, UT, V_BLOCK_R, IS_BF16, False,
        )  # fmt: skip


# The kernels call the helpers by these global names; _build() binds them.
_to_fp32 = None
_int8_encode_rows = None
_int8_decode_rows = None
_max_combine = None
_min_combine = None
_sum_combine = None
_rint = None
_group_params = None
_codes = None
_to_device_bits = None
_encode_groups = None
_encode_channels = None
_decode_groups = None
_KERNELS: SimpleNamespace | None = None

# Per-transfer sizes and bookkeeping pointers pick no kernel variant
# (kv_int8_triton.ENCODE_PER_TRANSFER_ARGS explains why).
ENCODE_PER_TRANSFER_ARGS = ("n_tok", "n_host", "n_k_progs")
ENCODE_BOOKKEEPING_POINTERS = kt.ENCODE_BOOKKEEPING_POINTERS
DECODE_PER_TRANSFER_ARGS = ("n_tok", "n_host", "n_k_progs")
DECODE_BOOKKEEPING_POINTERS = kt.DECODE_BOOKKEEPING_POINTERS


def _min_src(a, b):
    return tl.minimum(a, b)


def _build() -> SimpleNamespace:
    global _KERNELS, _to_fp32, _int8_encode_rows, _int8_decode_rows
    global _max_combine, _min_combine, _sum_combine, _rint, _group_params
    global _codes, _to_device_bits, _encode_groups, _encode_channels
    global _decode_groups
    interpret = interpreting()
    if _KERNELS is not None and _KERNELS.interpret == interpret:
        return _KERNELS
    if triton is None:
        raise RuntimeError("the INT4/K8V4 host pools' fused kernels need triton")
    # The INT8 helpers, built in the current mode (kv_int8_triton._build).
    kt._build()
    _to_fp32 = kt._to_fp32
    _int8_encode_rows = kt._encode_rows
    _int8_decode_rows = kt._decode_rows
    _max_combine = kt._max_combine
    _sum_combine = kt._sum_combine
    _min_combine = getattr(tl.standard, "_elementwise_min", None) or triton.jit(
        _min_src
    )
    _rint = triton.jit(_rint_src)
    _group_params = triton.jit(_group_params_src)
    _codes = triton.jit(_codes_src)
    _to_device_bits = triton.jit(_to_device_bits_src)
    _encode_groups = triton.jit(_encode_groups_src)
    _encode_channels = triton.jit(_encode_channels_src)
    _decode_groups = triton.jit(_decode_groups_src)
    _KERNELS = SimpleNamespace(
        interpret=interpret,
        encode=triton.jit(
            _encode_kernel_src,
            do_not_specialize=ENCODE_PER_TRANSFER_ARGS,
            do_not_specialize_on_alignment=ENCODE_BOOKKEEPING_POINTERS,
        ),
        decode=triton.jit(
            _decode_kernel_src,
            do_not_specialize=DECODE_PER_TRANSFER_ARGS,
            do_not_specialize_on_alignment=DECODE_BOOKKEEPING_POINTERS,
        ),
    )
    return _KERNELS


def reset_kernels() -> None:
    """Forget built kernels (the next call rebuilds, re-reading TRITON_INTERPRET)."""
    global _KERNELS
    _KERNELS = None


# ----------------------------------------------------------------------------
# host-side wrappers


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


_pow2, _cdiv = kt._pow2, kt._cdiv


def _rows_per_program(tile: int, width: int) -> int:
    return kt._block_rows(tile, _pow2(width))


def _check_tables(tables) -> tuple[DeviceLayerTable, DeviceLayerTable]:
    if len(tables) != 2:
        raise ValueError(f"expected the K and V layer tables, got {len(tables)}")
    k_table, v_table = tables
    if len(k_table) != len(v_table):
        raise ValueError("K and V tables differ in layer count")
    if k_table.shape[1] != v_table.shape[1] or k_table.dtype != v_table.dtype:
        raise ValueError("K and V tables differ in head count or dtype")
    return k_table, v_table


def _check_amax(scale_amax, layers: int, dev) -> None:
    if scale_amax is not None and (
        scale_amax.dtype != torch.float32
        or tuple(scale_amax.shape) != (layers, 2)
        or not scale_amax.is_contiguous()
        or scale_amax.device != dev
    ):
        raise ValueError(
            f"scale_amax must be contiguous float32 [{layers}, 2] on {dev}, got "
            f"{scale_amax.dtype} {tuple(scale_amax.shape)} on {scale_amax.device}"
        )


def encode_gather(
    tables: Sequence[DeviceLayerTable],
    device_indices: torch.Tensor,
    out: Mapping[str, torch.Tensor],
    host_indices: torch.Tensor,
    *,
    nonfinite_counter: torch.Tensor | None = None,
    scale_amax: torch.Tensor | None = None,
    bad_index_counter: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Backup in one launch: encode the K/V rows tables[s][l][device_indices[i]]
    of every layer l into the records at host_indices[i].

    tables = (k_table, v_table); out = the format's records as
    [units, L, *record.shape] views (any strides, last dim contiguous):

      int4   k uint8 [U, L, UT, H, Dk/2]
             k_meta fp16 [U, L, H, Dk, 2] (per-channel keys) or
                         [U, L, UT, H, Dk/Gk, 2] (per-token keys)
      k8v4   k int8 [U, L, UT, H, Dk], k_scale fp16 [U, L, UT, H]
      both   v uint8 [U, L, UT, H, Dv/2], v_meta fp16 [U, L, UT, H, Dv/Gv, 2]

    UT (unit_tokens), the key grouping and the group sizes are read from the
    views. Per-channel keys need whole units: the transfer's tokens
    [j * UT, (j + 1) * UT) go to one host unit in order (as HiCache moves
    pages); a run that isn't writes no keys and is counted (module
    docstring). Groups stored as non-finite are added to nonfinite_counter
    (0-dim int64); scale_amax (fp32 [L, 2]: K, V) is raised to the largest
    max(|lo|, |hi|) of the finite groups; tokens whose records were not
    written because of their host index are added to bad_index_counter.
    Device indices are not range-checked.
    """
    k_table, v_table = _check_tables(tables)
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_table.device
    kt._check_index("device_indices", device_indices, n, dev)
    kt._check_index("host_indices", host_indices, n, dev)
    layers, H = len(k_table), k_table.shape[1]
    keys, values = _format_records(out, 3, H, k_table.shape[2], v_table.shape[2])
    units, rec_layers, ut = keys.codes.shape[:3]
    if rec_layers != layers:
        raise ValueError(f"records hold {rec_layers} layers, the tables {layers}")
    if keys.mode == KEYS_PER_CHANNEL and n % ut:
        raise ValueError(
            f"per-channel keys encode whole units: {n} tokens is not a "
            f"multiple of unit_tokens={ut}"
        )
    kt._check_counter("nonfinite_counter", nonfinite_counter, dev)
    kt._check_counter("bad_index_counter", bad_index_counter, dev)
    _check_amax(scale_amax, layers, dev)

    tile = tile or ENCODE_TILE
    dk = keys.dim
    if keys.mode == KEYS_PER_CHANNEL:
        ut_pad = _pow2(ut)
        pairs = max(1, min(_pow2(dk) // 2, _pow2(tile) // (2 * ut_pad)))
        k_ncb = _cdiv(dk // 2, pairs)
        k_block, n_k_progs = pairs, (n // ut) * H * k_ncb
    else:
        ut_pad, k_ncb = 1, 1
        k_width = dk if keys.mode == KEYS_INT8 else keys.group
        k_block = _rows_per_program(tile, k_width)
        n_k_progs = _cdiv(n * H * (dk // k_width), k_block)
    v_block = _rows_per_program(tile, values.group)
    n_v_progs = _cdiv(n * H * (values.dim // values.group), v_block)
    kernels = _build()
    kernels.encode[(n_k_progs + n_v_progs, layers)](
        k_table.base, v_table.base, k_table.offsets, v_table.offsets,
        device_indices, host_indices,
        keys.codes, keys.meta, values.codes, values.meta,
        kt._or_dummy(nonfinite_counter, k_table.offsets),
        kt._or_dummy(scale_amax, k_table.offsets, torch.int32),
        kt._or_dummy(bad_index_counter, k_table.offsets),
        n, units * ut, n_k_progs,
        k_table.stride[0], k_table.stride[1], v_table.stride[0], v_table.stride[1],
        *keys.code_strides, *keys.meta_strides,
        *values.code_strides, *values.meta_strides,
        H=H, DK=dk, DK_PAD=_pow2(dk), KEY_MODE=keys.mode, GK=keys.group,
        GK2_PAD=_pow2(keys.group) // 2 if keys.group > 1 else 1,
        K_BLOCK=k_block, K_NCB=k_ncb, DV=values.dim, GV=values.group,
        GV2_PAD=_pow2(values.group) // 2, V_BLOCK_R=v_block, UT=ut, UT_PAD=ut_pad,
        IS_BF16=k_table.dtype == torch.bfloat16,
        ALIGNED=k_table.aligned and v_table.aligned,
        COUNT=nonfinite_counter is not None, AMAX=scale_amax is not None,
        K_COUNT_BAD_IDX=bad_index_counter is not None
        and keys.mode != KEYS_PER_TOKEN,
        V_COUNT_BAD_IDX=bad_index_counter is not None and keys.mode != KEYS_INT8,
        num_warps=num_warps or ENCODE_WARPS,
    )  # fmt: skip


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
    device layers, dim contiguous. fp16 output saturates at +-65504;
    non-finite groups restore as NaN. A host index outside the records
    restores nothing (the device rows keep their contents) and its token is
    counted in bad_index_counter if given.
    """
    if len(dst) != 2:
        raise ValueError(f"expected the K and V device layers, got {len(dst)}")
    k_dst, v_dst = dst
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_dst.device
    kt._check_index("device_indices", device_indices, n, dev)
    kt._check_index("host_indices", host_indices, n, dev)
    if k_dst.dtype not in kt._DEVICE_DTYPES or v_dst.dtype != k_dst.dtype:
        raise TypeError(f"device KV must be bf16/fp16, got {k_dst.dtype}/{v_dst.dtype}")
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"{name} must be [size, heads, dim], dim contiguous")
    if v_dst.shape[1] != k_dst.shape[1]:
        raise ValueError("K and V device layers differ in head count")
    H = k_dst.shape[1]
    keys, values = _format_records(records, 2, H, k_dst.shape[2], v_dst.shape[2])
    units, ut = keys.codes.shape[:2]
    kt._check_counter("bad_index_counter", bad_index_counter, dev)

    tile = tile or DECODE_TILE
    dk, dv = keys.dim, values.dim
    k_block = _rows_per_program(tile, dk)
    v_block = _rows_per_program(tile, dv)
    n_k_progs = _cdiv(n * H, k_block)
    n_v_progs = _cdiv(n * H, v_block)
    kernels = _build()
    kernels.decode[(n_k_progs + n_v_progs,)](
        keys.codes, keys.meta, values.codes, values.meta, host_indices,
        kt._bits16(k_dst), kt._bits16(v_dst), device_indices,
        kt._or_dummy(bad_index_counter, device_indices),
        n, units * ut, n_k_progs,
        *keys.code_strides, *keys.meta_strides,
        *values.code_strides, *values.meta_strides,
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1),
        H=H, DK=dk, DK_PAD=_pow2(dk), KEY_MODE=keys.mode, GK=keys.group,
        K_BLOCK_R=k_block, DV=dv, DV_PAD=_pow2(dv), GV=values.group,
        V_BLOCK_R=v_block, UT=ut, IS_BF16=k_dst.dtype == torch.bfloat16,
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps or DECODE_WARPS,
    )  # fmt: skip
