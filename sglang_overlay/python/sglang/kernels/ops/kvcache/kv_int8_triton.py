"""Fused Triton kernels for the INT8 host (L2) KV pool (--hicache-host-dtype int8).

Two kernels replace the pool's torch path (gather, several codec ops, staging
copies) on CUDA:

  encode_gather   backup, ONE launch per transfer (all layers, K and V):
                  device KV rows [layer][device_indices[i]] -> quantize ->
                  int8 records + fp16 scales at host_indices[i]
  decode_scatter  restore, ONE launch per layer (K and V):
                  records + scales at host_indices[i] -> dequantize ->
                  device rows [device_indices[i]] of that layer

Both are launched on the caller's current stream (HiCache's D2H / H2D
stream), so the layer-done event recorded after a restore still marks fully
restored KV, and nothing here synchronizes with the host.

Format and bit-exactness. The kernels implement kv_int8_codec's format
exactly (same int8 and fp16 bytes on encode, same output bits on decode; NaN
rows decode to NaN, whose payload bits are not part of the contract):

  * Inputs are read as 16-bit patterns. bf16 widens to fp32 by a 16-bit
    shift, fp16 by a conversion; both exact.
  * amax = max |x| over head_dim in fp32 (exact); a NaN anywhere in the row
    is detected separately (x != x), because Triton's max reduction does not
    propagate NaN on every backend. amax is floored at finfo(fp32).tiny.
  * s32 = amax / 127 with tl.math.div_rn (IEEE round-to-nearest division;
    plain `/` on fp32 is an approximate division on CUDA).
  * s16 = fp16(s32) with round-to-nearest-even (`.to(tl.float16)`: LLVM
    fptrunc, cvt.rn.f16.f32, on CUDA; numpy under the interpreter), then +1
    on the int16 bit pattern if fp32(s16) < s32, exactly like the reference.
    The bit pattern is then raised to at least 1 (2**-24): the reference
    always gets >= 1 because s32 > 0; the max() only matters if a
    flush-to-zero backend flushed a subnormal s32, and makes the result
    independent of that.
  * Rows whose scale is not finite (NaN/Inf input, or |x| beyond the fp16
    scale range) store scale bits 0x7E00 (the NaN torch writes) and q = 0,
    and are added to the pool's non-finite counter (one atomic per program,
    only when non-zero).
  * q = clamp(rint(div_rn(x, s)), -127, 127). rint (round half to even) is
    built from floor: t = floor(v), f = v - t, r = t + (f > .5) +
    (f == .5 and t odd). f is exact for |v| >= 1 (Sterbenz) and for
    0 <= v < 1; for -1 < v < -0.5, v's grid is 2**-24 so f = v + 1 is exact
    too, and for -0.5 <= v < 0 f may round but stays >= 0.5, so both
    branches give 0, the correct result. This avoids libdevice rint (not
    available under the interpreter, and subject to libdevice's FTZ
    reflection); FTZ in floor only touches subnormal v, which round to 0
    either way.
  * Decode: fp32(q) * fp32(s) is exact in fp32, then rounds once into the
    device dtype: fp16 by `.to(tl.float16)` (RNE) after saturating at
    +-65504 (NaN kept), as the codec does (LLVM may emit this as an int16
    to fp16 conversion and an RNE fp16 multiply: the same single rounding,
    since the product is exact); bf16 by integer RNE on
    the fp32 bits ((u + 0x7FFF + ((u >> 16) & 1)) >> 16, NaN -> 0x7FC0),
    which is what torch does on CPU and avoids the interpreter's truncating
    fp32->bf16 cast. Results are stored as 16-bit patterns.

Addressing. One kernel serves every pool layout: the host side is described
by element strides passed as arguments,

  encode  k/v out  [unit, layer, token_in_unit, head, dim]   (5-D view)
          scale    [unit, layer, token_in_unit, K|V, head]
  decode  k/v in   [unit, token_in_unit, head, dim]           (one layer)
          scale    [unit, token_in_unit, K|V, head]

with unit = host_index // unit_tokens and token_in_unit = host_index %
unit_tokens (unit_tokens = page_size for page_first/page_first_direct, 1 for
layer_first, whose 5-D view is buffer.transpose(0, 1)). Fragmented host
units and arbitrary (non-contiguous, shuffled) device indices need nothing
special; all offsets are int64. The device pool keeps one tensor per layer;
encode reaches all of them in one launch through a table of element offsets
from layer 0's tensor (DeviceLayerTable), with an alignment hint when every
offset is a multiple of 16 elements (always, for caching-allocator blocks),
so row loads stay vectorized.

Host indices and statistics. Both kernels bound every host index by the
records they were given (0 <= host_index < units * unit_tokens): a row
outside is neither read nor written, and its token is counted in an optional
device counter, so indices already on the device need no host-side check.
Encode optionally raises a [layers, 2] fp32 table to the largest amax of
the finite rows it stored (one int32 atomic max per program: amax >= 0, so
its bit pattern orders like its value). Sizes that change per transfer
(n_rows, n_host) are not specialized on, nor is the alignment of index,
table and counter pointers (see ENCODE_PER_TRANSFER_ARGS).

Host memory. On CUDA the host tensors are pinned (cudaHostRegister) and, with
UVA, device-accessible at the same address: Triton's launcher resolves each
pointer argument through cuPointerGetAttribute(DEVICE_POINTER), so passing
the CPU tensors (or views) themselves makes the kernels read and write host
memory directly over PCIe ("direct": no staging, no extra copy). The pool
can instead point the kernels at its device staging buffers ("staged") and
move records with per-run async copies, as the torch path does; that is the
fallback when the host memory is not pinned. Under TRITON_INTERPRET=1 the
same kernels run on CPU tensors directly (tests compare them with the torch
reference).

Kernels are built lazily, on first use, so TRITON_INTERPRET is read then and
not when sglang (which imports triton early) was imported; reset_kernels()
drops them (tests switch the interpreter on that way). For the same reason
the kernels call no @jit function of triton's standard library (tl.max,
tl.sum), which would have been built in compiled mode: reductions go through
tl.reduce, which the interpreter patches.

Tiles. A program handles BLOCK_R head rows (rows = tokens x heads, flattened)
of D_PAD lanes (next power of two >= head_dim, masked); BLOCK_R = TILE //
D_PAD. TILE and num_warps default to the module-level ENCODE_*/DECODE_*
values and can be passed per call (the GPU benchmark sweeps them).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - sglang always ships triton
    triton = tl = None

# 8192 elements per encode program spilled registers on sm_80-90 once the
# kernel also tracked amax and invalid host indices.
ENCODE_TILE = 4096
ENCODE_WARPS = 4
DECODE_TILE = 8192
DECODE_WARPS = 4

_DEVICE_DTYPES = (torch.bfloat16, torch.float16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels can run for a transfer device: compiled on
    CUDA, or under the Triton interpreter on CPU."""
    device = torch.device(device)
    if triton is None:
        return False
    if device.type == "cuda":
        return torch.version.cuda is not None and torch.cuda.is_available()
    return device.type == "cpu" and interpreting()


# ----------------------------------------------------------------------------
# kernel sources (plain functions; _build() jit-compiles them on first use)


def _to_fp32_src(bits, IS_BF16: tl.constexpr):
    """16-bit patterns of bf16/fp16 values -> exact fp32 values."""
    if IS_BF16:
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    return x


def _encode_rows_src(
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
    s_base,
    s_su,
    s_sl,
    s_st,
    s_sh,
    layer,
    row0,
    n_rows,
    n_host,
    counter_ptr,
    amax_ptr,
    bad_idx_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT: tl.constexpr,
    AMAX: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    rows = row0 + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    tok = rows // H
    head = (rows % H).to(tl.int64)
    d = tl.arange(0, D_PAD)

    didx = tl.load(dev_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    hidx = tl.load(host_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    # A host index outside the records is never written (nor read on the
    # device side): the row is dropped and counted, without a host sync.
    hmask = rmask & (hidx >= 0) & (hidx < n_host)
    m2 = hmask[:, None] & (d < D)[None, :]
    if COUNT_BAD_IDX:
        # Once per token: its first head, in layer 0's K program.
        dropped = rmask & ~hmask & (head == 0) & (layer == 0)
        n_dropped = tl.reduce(dropped.to(tl.int64), 0, _sum_combine)
        tl.atomic_add(bad_idx_ptr, n_dropped, mask=n_dropped > 0)
    src = layer_off + didx * d_st + head * d_sh
    bits = tl.load(x_base + (src[:, None] + d[None, :]), mask=m2, other=0)
    x = _to_fp32(bits, IS_BF16)

    # Scale, as kv_int8_codec._scale_from_amax. Floor: finfo(float32).tiny.
    row_nan = tl.reduce((x != x).to(tl.int32), 1, _max_combine) > 0
    amax_raw = tl.reduce(tl.abs(x), 1, _max_combine)
    amax = tl.maximum(amax_raw, 1.1754943508222875e-38)
    s32 = tl.math.div_rn(amax, 127.0)
    s_bits = s32.to(tl.float16).to(tl.int16, bitcast=True)
    below = s_bits.to(tl.float16, bitcast=True).to(tl.float32) < s32
    s_bits = tl.maximum(s_bits + below.to(tl.int16), 1).to(tl.int16)
    s = s_bits.to(tl.float16, bitcast=True).to(tl.float32)
    bad = row_nan | (s != s) | (s > 65504.0)
    s_bits = tl.where(bad, 0x7E00, s_bits).to(tl.int16)  # torch's fp16 NaN

    # q = clamp(rint(x / s)), rint = round half to even (module docstring).
    v = tl.math.div_rn(x, s[:, None])
    t = tl.floor(v)
    f = v - t
    t_odd = (t - 2.0 * tl.floor(t * 0.5)) != 0.0
    up = (f > 0.5) | ((f == 0.5) & t_odd)
    r = t + up.to(tl.float32)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(bad[:, None], 0.0, r)

    unit = hidx // UT
    within = hidx % UT
    q_row = unit * q_su + layer * q_sl + within * q_st + head * q_sh
    tl.store(q_base + (q_row[:, None] + d[None, :]), r.to(tl.int8), mask=m2)
    s_off = unit * s_su + layer * s_sl + within * s_st + head * s_sh
    tl.store(s_base + s_off, s_bits, mask=hmask)
    if COUNT:
        n_bad = tl.reduce((bad & hmask).to(tl.int64), 0, _sum_combine)
        tl.atomic_add(counter_ptr, n_bad, mask=n_bad > 0)
    if AMAX:
        # amax >= 0, so its fp32 bit pattern orders like the value: an int32
        # atomic max is exact (and needs no float atomics).
        good = hmask & ~bad
        block_amax = tl.reduce(tl.where(good, amax_raw, 0.0), 0, _max_combine)
        amax_bits = block_amax.to(tl.int32, bitcast=True)
        tl.atomic_max(amax_ptr, amax_bits, mask=amax_bits > 0)


def _encode_kernel_src(
    k_base,
    v_base,
    k_offs,
    v_offs,
    dev_idx_ptr,
    host_idx_ptr,
    k_out,
    v_out,
    s_out,
    counter_ptr,
    amax_ptr,
    bad_idx_ptr,
    n_rows,
    n_host,
    dk_st,
    dk_sh,
    dv_st,
    dv_sh,
    k_su,
    k_sl,
    k_st,
    k_sh,
    v_su,
    v_sl,
    v_st,
    v_sh,
    s_su,
    s_sl,
    s_st,
    s_skv,
    s_sh,
    H: tl.constexpr,
    DK: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    COUNT: tl.constexpr,
    AMAX: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (row blocks, layers, K|V)
    row0 = tl.program_id(0) * BLOCK_R
    layer_idx = tl.program_id(1)
    layer = layer_idx.to(tl.int64)
    if tl.program_id(2) == 0:
        off = tl.load(k_offs + layer_idx)
        if ALIGNED:
            off = tl.multiple_of(off, 16)
        _encode_rows(
            k_base, off, dev_idx_ptr, dk_st, dk_sh, host_idx_ptr,
            k_out, k_su, k_sl, k_st, k_sh,
            s_out, s_su, s_sl, s_st, s_sh,
            layer, row0, n_rows, n_host, counter_ptr, amax_ptr + 2 * layer,
            bad_idx_ptr,
            H, DK, DK_PAD, UT, BLOCK_R, IS_BF16, COUNT, AMAX,
            COUNT_BAD_IDX,
        )  # fmt: skip
    else:
        off = tl.load(v_offs + layer_idx)
        if ALIGNED:
            off = tl.multiple_of(off, 16)
        _encode_rows(
            v_base, off, dev_idx_ptr, dv_st, dv_sh, host_idx_ptr,
            v_out, v_su, v_sl, v_st, v_sh,
            s_out + s_skv, s_su, s_sl, s_st, s_sh,
            layer, row0, n_rows, n_host, counter_ptr, amax_ptr + 2 * layer + 1,
            bad_idx_ptr,
            H, DV, DV_PAD, UT, BLOCK_R, IS_BF16, COUNT, AMAX, False,
        )  # fmt: skip


def _decode_rows_src(
    q_base,
    q_su,
    q_st,
    q_sh,
    s_base,
    s_su,
    s_st,
    s_sh,
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
    D_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    rows = row0 + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    tok = rows // H
    head = (rows % H).to(tl.int64)
    d = tl.arange(0, D_PAD)

    hidx = tl.load(host_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    didx = tl.load(dev_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    # Out-of-range host rows are neither read nor restored; counted instead.
    hmask = rmask & (hidx >= 0) & (hidx < n_host)
    m2 = hmask[:, None] & (d < D)[None, :]
    if COUNT_BAD_IDX:
        dropped = rmask & ~hmask & (head == 0)
        n_dropped = tl.reduce(dropped.to(tl.int64), 0, _sum_combine)
        tl.atomic_add(bad_idx_ptr, n_dropped, mask=n_dropped > 0)
    unit = hidx // UT
    within = hidx % UT
    q_row = unit * q_su + within * q_st + head * q_sh
    q = tl.load(q_base + (q_row[:, None] + d[None, :]), mask=m2, other=0)
    s_off = unit * s_su + within * s_st + head * s_sh
    s = tl.load(s_base + s_off, mask=hmask, other=0)
    s = s.to(tl.float16, bitcast=True).to(tl.float32)
    y = q.to(tl.float32) * s[:, None]
    if IS_BF16:
        u = y.to(tl.uint32, bitcast=True)
        rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        out = tl.where(y != y, 0x7FC0, rounded).to(tl.int16)  # torch's bf16 NaN
    else:
        # Saturate to fp16's max finite value (127 * s may round past it);
        # NaN rows stay NaN.
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -65504.0), 65504.0))
        out = y.to(tl.float16).to(tl.int16, bitcast=True)
    y_row = didx * y_st + head * y_sh
    tl.store(y_base + (y_row[:, None] + d[None, :]), out, mask=m2)


def _decode_kernel_src(
    k_in,
    v_in,
    s_in,
    host_idx_ptr,
    k_dst,
    v_dst,
    dev_idx_ptr,
    bad_idx_ptr,
    n_rows,
    n_host,
    k_su,
    k_st,
    k_sh,
    v_su,
    v_st,
    v_sh,
    s_su,
    s_st,
    s_skv,
    s_sh,
    yk_st,
    yk_sh,
    yv_st,
    yv_sh,
    H: tl.constexpr,
    DK: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (row blocks, K|V)
    row0 = tl.program_id(0) * BLOCK_R
    if tl.program_id(1) == 0:
        _decode_rows(
            k_in, k_su, k_st, k_sh, s_in, s_su, s_st, s_sh, host_idx_ptr,
            k_dst, yk_st, yk_sh, dev_idx_ptr, row0, n_rows, n_host, bad_idx_ptr,
            H, DK, DK_PAD, UT, BLOCK_R, IS_BF16, COUNT_BAD_IDX,
        )  # fmt: skip
    else:
        _decode_rows(
            v_in, v_su, v_st, v_sh, s_in + s_skv, s_su, s_st, s_sh, host_idx_ptr,
            v_dst, yv_st, yv_sh, dev_idx_ptr, row0, n_rows, n_host, bad_idx_ptr,
            H, DV, DV_PAD, UT, BLOCK_R, IS_BF16, False,
        )  # fmt: skip


def _max_src(a, b):
    return tl.maximum(a, b)


def _sum_src(a, b):
    return a + b


# The kernels call the helpers by these global names; _build() binds them to
# jit-compiled (or interpreted) versions of the *_src functions.
_to_fp32 = None
_encode_rows = None
_decode_rows = None
_max_combine = None
_sum_combine = None
_KERNELS: SimpleNamespace | None = None

# Triton specializes int arguments equal to 1 or divisible by 16, and pointers
# on 16-byte alignment. Values that change from one transfer to the next must
# not pick a kernel variant, or a serving pool compiles new ones mid-flight in
# the scheduler thread. Index, table and counter pointers are only gathered
# from or hit by atomics, so their alignment buys nothing either (and layer
# slices of the tables and stats shift it). Record and device-row pointers
# and strides stay specialized: they are fixed per pool and layer, and the
# pool's start-up self-check compiles those variants.
ENCODE_PER_TRANSFER_ARGS = ("n_rows", "n_host")
ENCODE_BOOKKEEPING_POINTERS = (
    "k_offs",
    "v_offs",
    "dev_idx_ptr",
    "host_idx_ptr",
    "counter_ptr",
    "amax_ptr",
    "bad_idx_ptr",
)
DECODE_PER_TRANSFER_ARGS = ("n_rows", "n_host")
DECODE_BOOKKEEPING_POINTERS = ("host_idx_ptr", "dev_idx_ptr", "bad_idx_ptr")


def _build() -> SimpleNamespace:
    global _KERNELS, _to_fp32, _encode_rows, _decode_rows, _max_combine, _sum_combine
    interpret = interpreting()
    if _KERNELS is not None and _KERNELS.interpret == interpret:
        return _KERNELS
    if triton is None:
        raise RuntimeError("the INT8 host pool's fused kernels need triton")
    # triton.jit reads TRITON_INTERPRET now and returns an interpreted function
    # under it; helpers must be built in the same mode as the kernels.
    # Reductions use tl.reduce with triton's own combine functions (what
    # tl.max / tl.sum use for fp32 / int64) rather than tl.max / tl.sum: those
    # are @jit library functions, built in whatever mode triton was imported
    # in, while the interpreter recognizes these combine functions and runs
    # them as numpy reductions in either case.
    _max_combine = getattr(tl.standard, "_elementwise_max", None) or triton.jit(
        _max_src
    )
    _sum_combine = getattr(tl.standard, "_sum_combine", None) or triton.jit(_sum_src)
    _to_fp32 = triton.jit(_to_fp32_src)
    _encode_rows = triton.jit(_encode_rows_src)
    _decode_rows = triton.jit(_decode_rows_src)
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


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _block_rows(tile: int, d_pad: int) -> int:
    return max(1, _pow2(tile) // d_pad)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


class DeviceLayerTable:
    """The per-layer device tensors of one component (K or V) as one base
    tensor plus element offsets, so one launch reaches every layer.

    All layers must share dtype, shape and strides ([size, head_num, dim],
    dim contiguous), as SGLang's device pools allocate them. The offsets live
    on the layers' device; build the table once per pool (construction
    copies them there synchronously, so any stream may use it at once)."""

    def __init__(self, layers: Sequence[torch.Tensor]):
        if not layers:
            raise ValueError("DeviceLayerTable needs at least one layer")
        base = layers[0]
        if base.dtype not in _DEVICE_DTYPES:
            raise TypeError(f"device KV must be bf16/fp16, got {base.dtype}")
        if base.dim() != 3 or base.stride(2) != 1:
            raise ValueError(
                f"device KV layers must be [size, heads, dim] with dim "
                f"contiguous, got {tuple(base.shape)} strides {base.stride()}"
            )
        item = base.element_size()
        geometry = (base.dtype, base.shape, base.stride(), base.device)
        offsets = []
        for t in layers:
            if (t.dtype, t.shape, t.stride(), t.device) != geometry:
                raise ValueError("device KV layers differ in dtype/shape/strides")
            delta = t.data_ptr() - base.data_ptr()
            if delta % item:
                raise ValueError("device KV layers are not element-aligned")
            offsets.append(delta // item)
        self.layers = tuple(layers)
        self.base = _bits16(base)
        self.dtype = base.dtype
        self.device = base.device
        self.shape = tuple(base.shape)
        self.stride = base.stride()
        self.aligned = base.data_ptr() % 32 == 0 and all(o % 16 == 0 for o in offsets)
        # A blocking copy: complete before this returns.
        self.offsets = torch.tensor(offsets, dtype=torch.int64).to(base.device)

    def __len__(self) -> int:
        return len(self.layers)

    def select(self, first: int, count: int = 1) -> DeviceLayerTable:
        """The table of layers [first, first + count), sharing this one's memory."""
        sub = object.__new__(DeviceLayerTable)
        sub.__dict__.update(self.__dict__)
        sub.layers = self.layers[first : first + count]
        sub.offsets = self.offsets[first : first + count]
        return sub


def _check_index(name: str, idx: torch.Tensor, n: int, device: torch.device) -> None:
    if idx.dim() != 1 or idx.numel() != n:
        raise ValueError(f"{name} must be 1-D with {n} entries, got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32/int64, got {idx.dtype}")
    if idx.device != device or not idx.is_contiguous():
        raise ValueError(f"{name} must be contiguous on {device}, got {idx.device}")


def _check_counter(name: str, t: torch.Tensor | None, device) -> None:
    if t is not None and (t.dtype != torch.int64 or t.dim() or t.device != device):
        raise ValueError(f"{name} must be a 0-dim int64 tensor on {device}")


def _or_dummy(t, dummy, view_dtype=None):
    """The pointer argument for an optional tensor; a constexpr flag tells the
    kernel whether to touch it (any valid pointer does otherwise)."""
    if t is None:
        return dummy
    return t if view_dtype is None else t.view(view_dtype)


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
    nonfinite_counter: torch.Tensor | None = None,
    scale_amax: torch.Tensor | None = None,
    bad_index_counter: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Backup in one launch: for every layer l of the tables and token i,
    quantize the K/V rows table[l][device_indices[i]] into the records at
    host_indices[i]:

      k_out     int8 [units, L, unit_tokens, H, Dk]  (any strides, dim contiguous)
      v_out     int8 [units, L, unit_tokens, H, Dv]
      scale_out fp16 [units, L, unit_tokens, 2, H]   (K scales at [..., 0, :])

    with unit = host_indices[i] // unit_tokens. The outputs may be pinned
    host memory (CUDA: reached through UVA) or device tensors. Rows stored as
    non-finite are added to nonfinite_counter (0-dim int64 on the transfer
    device) if given; scale_amax (fp32 [L, 2] on the transfer device) is
    raised to the largest amax of the finite rows of each layer's K and V.
    Bit-identical to kv_int8_codec.quantize_reference.

    A host index outside [0, units * unit_tokens) is not written: its token
    is skipped in every layer and counted once in bad_index_counter (0-dim
    int64) if given. Device indices are not range-checked here.
    """
    n = int(device_indices.numel())
    layers = len(k_table)
    if len(v_table) != layers:
        raise ValueError("K and V tables differ in layer count")
    if n == 0:
        return
    dev = k_table.device
    _check_index("device_indices", device_indices, n, dev)
    _check_index("host_indices", host_indices, n, dev)
    H, DK, DV = k_table.shape[1], k_table.shape[2], v_table.shape[2]
    if v_table.shape[1] != H or v_table.dtype != k_table.dtype:
        raise ValueError("K and V tables differ in head count or dtype")
    _check_records("k_out", k_out, 5, torch.int8, H, DK)
    _check_records("v_out", v_out, 5, torch.int8, H, DV)
    _check_records("scale_out", scale_out, 5, torch.float16, H)
    for t in (k_out, v_out, scale_out):
        if t.shape[1] != layers or t.shape[2] != unit_tokens:
            raise ValueError(
                f"records must be [units, {layers}, {unit_tokens}, ...], "
                f"got {tuple(t.shape)}"
            )
    if scale_out.shape[3] != 2:
        raise ValueError(f"scale_out must be [..., 2, H], got {tuple(scale_out.shape)}")
    _check_counter("nonfinite_counter", nonfinite_counter, dev)
    _check_counter("bad_index_counter", bad_index_counter, dev)
    if scale_amax is not None and (
        scale_amax.dtype != torch.float32
        or scale_amax.shape != (layers, 2)
        or not scale_amax.is_contiguous()
        or scale_amax.device != dev
    ):
        raise ValueError(
            f"scale_amax must be contiguous float32 [{layers}, 2] on {dev}, got "
            f"{scale_amax.dtype} {tuple(scale_amax.shape)} on {scale_amax.device}"
        )

    kernels = _build()
    dk_pad, dv_pad = _pow2(DK), _pow2(DV)
    block_r = _block_rows(tile or ENCODE_TILE, max(dk_pad, dv_pad))
    n_rows = n * H
    s16 = _bits16(scale_out)
    kernels.encode[(_cdiv(n_rows, block_r), layers, 2)](
        k_table.base, v_table.base, k_table.offsets, v_table.offsets,
        device_indices, host_indices, k_out, v_out, s16,
        _or_dummy(nonfinite_counter, k_table.offsets),
        _or_dummy(scale_amax, k_table.offsets, torch.int32),
        _or_dummy(bad_index_counter, k_table.offsets),
        n_rows, k_out.shape[0] * unit_tokens,
        k_table.stride[0], k_table.stride[1], v_table.stride[0], v_table.stride[1],
        k_out.stride(0), k_out.stride(1), k_out.stride(2), k_out.stride(3),
        v_out.stride(0), v_out.stride(1), v_out.stride(2), v_out.stride(3),
        s16.stride(0), s16.stride(1), s16.stride(2), s16.stride(3), s16.stride(4),
        H=H, DK=DK, DK_PAD=dk_pad, DV=DV, DV_PAD=dv_pad, UT=unit_tokens,
        BLOCK_R=block_r, IS_BF16=k_table.dtype == torch.bfloat16,
        ALIGNED=k_table.aligned and v_table.aligned,
        COUNT=nonfinite_counter is not None, AMAX=scale_amax is not None,
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps or ENCODE_WARPS,
    )  # fmt: skip


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

    Bit-identical to kv_int8_codec.dequantize_reference (NaN rows: NaN;
    fp16 output saturates at +-65504). A host index outside
    [0, units * unit_tokens) restores nothing: its device rows keep their
    contents, and the token is counted in bad_index_counter if given.
    """
    n = int(device_indices.numel())
    if n == 0:
        return
    dev = k_dst.device
    _check_index("device_indices", device_indices, n, dev)
    _check_index("host_indices", host_indices, n, dev)
    if k_dst.dtype not in _DEVICE_DTYPES or v_dst.dtype != k_dst.dtype:
        raise TypeError(f"device KV must be bf16/fp16, got {k_dst.dtype}/{v_dst.dtype}")
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"{name} must be [size, heads, dim], dim contiguous")
    H, DK, DV = k_dst.shape[1], k_dst.shape[2], v_dst.shape[2]
    _check_records("k_in", k_in, 4, torch.int8, H, DK)
    _check_records("v_in", v_in, 4, torch.int8, H, DV)
    _check_records("scale_in", scale_in, 4, torch.float16, H)
    for t in (k_in, v_in, scale_in):
        if t.shape[1] != unit_tokens:
            raise ValueError(
                f"records must be [units, {unit_tokens}, ...], got {tuple(t.shape)}"
            )
    if scale_in.shape[2] != 2:
        raise ValueError(f"scale_in must be [..., 2, H], got {tuple(scale_in.shape)}")
    _check_counter("bad_index_counter", bad_index_counter, dev)

    kernels = _build()
    dk_pad, dv_pad = _pow2(DK), _pow2(DV)
    block_r = _block_rows(tile or DECODE_TILE, max(dk_pad, dv_pad))
    n_rows = n * H
    s16 = _bits16(scale_in)
    kernels.decode[(_cdiv(n_rows, block_r), 2)](
        k_in, v_in, s16, host_indices, _bits16(k_dst), _bits16(v_dst),
        device_indices, _or_dummy(bad_index_counter, device_indices),
        n_rows, k_in.shape[0] * unit_tokens,
        k_in.stride(0), k_in.stride(1), k_in.stride(2),
        v_in.stride(0), v_in.stride(1), v_in.stride(2),
        s16.stride(0), s16.stride(1), s16.stride(2), s16.stride(3),
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1),
        H=H, DK=DK, DK_PAD=dk_pad, DV=DV, DV_PAD=dv_pad, UT=unit_tokens,
        BLOCK_R=block_r, IS_BF16=k_dst.dtype == torch.bfloat16,
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps or DECODE_WARPS,
    )  # fmt: skip
