"""Shared pieces of the host (L2) KV cache kernels: the device layer table, the
argument checks and the INT8 row code that the INT8 format, K8V4 keys and MLA
latent tiles all use. Why each step is bit-exact: docs/kernels.md."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

DEVICE_DTYPES = (torch.bfloat16, torch.float16)
# FP8 device KV, passed as float8 views of the device pool's uint8 storage;
# only kernels that take the FP8 constexpr (int4/k8v4) accept it.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# FP8 constexpr values: 0 means a 16-bit device dtype (IS_BF16 says which).
FP8_NONE, FP8_E4M3, FP8_E5M2 = 0, 1, 2

# Triton specializes pointers on 16-byte alignment; index, table and counter
# pointers are only gathered from or hit by atomics, so they must pick no
# kernel variant (a serving pool would compile mid-flight).
BOOKKEEPING_POINTERS = ["dev_idx_ptr", "host_idx_ptr", "bad_idx_ptr"]
STATS_POINTERS = ["nonfinite_ptr", "amax_ptr"]


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels can run for a transfer device: compiled on
    CUDA, or on CPU when Triton's interpreter built them (TRITON_INTERPRET=1
    before triton was imported)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.version.cuda is not None and torch.cuda.is_available()
    return device.type == "cpu" and isinstance(int8_encode_rows, InterpretedFunction)


# --- device functions ---------------------------------------------------------


@triton.jit
def to_fp32(bits, IS_BF16: tl.constexpr, FP8: tl.constexpr = 0):
    """Device element patterns -> exact fp32 values: 16-bit bf16/fp16
    patterns, or FP8 bytes (FP8 = 1: E4M3FN, 2: E5M2)."""
    if FP8 == 1:
        x = fp8_to_fp32(bits, 3, 7, False)
    elif FP8 == 2:
        x = fp8_to_fp32(bits, 2, 15, True)
    elif IS_BF16:
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def fp8_to_fp32(bits, MBITS: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr):
    """FP8 bytes (MBITS mantissa bits, exponent bias BIAS) -> exact fp32, by
    integer operations only (no fp8 type: sm_80/86 and the interpreter have
    none). HAS_INF: E5M2's all-ones exponent is Inf/NaN; E4M3FN has only NaN,
    at magnitude 0x7F (docs/kernels.md#fp8-device-kv-int4-k8v4)."""
    b = bits.to(tl.uint32) & 0xFF
    mag = b & 0x7F
    e = mag >> MBITS
    m = mag & ((1 << MBITS) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))
    # A subnormal m * 2**(1 - BIAS - MBITS), normalized: sh = floor(log2 m).
    sh = (m >= 2).to(tl.uint32) + (m >= 4).to(tl.uint32)
    sub = ((sh + (128 - BIAS - MBITS)) << 23) | ((m << (23 - sh)) & 0x7FFFFF)
    u = tl.where(e == 0, tl.where(m == 0, 0, sub), normal)
    if HAS_INF:
        top = e == (0xFF >> (MBITS + 1))
        u = tl.where(top, tl.where(m == 0, 0x7F800000, 0x7FC00000), u)
    else:
        u = tl.where(mag == 0x7F, 0x7FC00000, u)
    u = u | ((b & 0x80) << 24)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_fp8_bits(y, FP8: tl.constexpr):
    """fp32 -> FP8 bytes (FP8 = 1: E4M3FN, 2: E5M2) as the torch path makes
    them: clamped to the largest finite value, rounded to nearest even
    (subnormals too), NaN -> 0x7F."""
    if FP8 == 1:
        out = _fp32_to_fp8(y, 3, 7, 0x43E00000, 512.0)  # 448; 2**9
    else:
        out = _fp32_to_fp8(y, 2, 15, 0x47600000, 65536.0)  # 57344; 2**16
    return out


@triton.jit
def _fp32_to_fp8(
    y,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    TOP_BITS: tl.constexpr,
    SUB_SCALE: tl.constexpr,
):
    """Round |y| (saturated at the fp32 bits TOP_BITS of the largest finite
    value) to nearest even into MBITS mantissa bits; SUB_SCALE is one over
    the smallest subnormal (docs/kernels.md#fp8-device-kv-int4-k8v4)."""
    # Test NaN first: the integer clamp below would saturate it.
    is_nan = y != y
    u = y.to(tl.uint32, bitcast=True)
    a = tl.minimum(u & 0x7FFFFFFF, TOP_BITS)
    # Normal: drop 23 - MBITS bits with the ties-to-even bias, then rebias.
    lsb = (a >> (23 - MBITS)) & 1
    normal = (a + ((1 << (22 - MBITS)) - 1) + lsb) >> (23 - MBITS)
    normal -= (127 - BIAS) << MBITS
    # Subnormal: |y| in units of the smallest subnormal (an exact power-of-two
    # scaling), rounded half to even; reaching 2**MBITS is the smallest normal.
    sub = rint(a.to(tl.float32, bitcast=True) * SUB_SCALE).to(tl.uint32)
    mag = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    out = mag | ((u >> 24) & 0x80)
    return tl.where(is_nan, 0x7F, out).to(tl.uint8)


@triton.jit
def rint(v):
    """Round half to even, from floor (docs/kernels.md#rounding)."""
    t = tl.floor(v)
    f = v - t
    t_odd = (t - 2.0 * tl.floor(t * 0.5)) != 0.0
    up = (f > 0.5) | ((f == 0.5) & t_odd)
    return t + up.to(tl.float32)


@triton.jit
def fp16_scale_up(s32):
    """The smallest fp16 scale >= s32 (and >= 2**-24): bits and fp32 value."""
    s_bits = s32.to(tl.float16).to(tl.int16, bitcast=True)
    below = s_bits.to(tl.float16, bitcast=True).to(tl.float32) < s32
    s_bits = tl.maximum(s_bits + below.to(tl.int16), 1).to(tl.int16)
    return s_bits, s_bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def count_flags(counter_ptr, flags):
    """Add the number of set 1-D flags to a device counter (one atomic)."""
    n = tl.sum(flags.to(tl.int64), axis=0)
    tl.atomic_add(counter_ptr, n, mask=n > 0)


@triton.jit
def raise_amax(amax_ptr, amax):
    """Raise an fp32 statistic to max(amax) (>= 0, so its bits order like it)."""
    amax_bits = tl.max(amax, axis=0).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr, amax_bits, mask=amax_bits > 0)


@triton.jit
def bf16_rne_bits(y):
    """fp32 -> bf16 bit patterns, round to nearest even; NaN -> torch's 0x7FC0."""
    u = y.to(tl.uint32, bitcast=True)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return tl.where(y != y, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def host_rows(host_idx_ptr, tok, mask, n_host):
    """The tokens' host indices and their in-range mask."""
    hidx = tl.load(host_idx_ptr + tok, mask=mask, other=0).to(tl.int64)
    return hidx, mask & (hidx >= 0) & (hidx < n_host)


@triton.jit
def unit_slots(hidx, UT: tl.constexpr):
    """Host unit and token-in-unit of host indices. Called next to the record
    accesses: two int64 vectors held across the row math spill registers."""
    return hidx // UT, hidx % UT


@triton.jit
def row_slots(
    row0,
    n_rows,
    dev_idx_ptr,
    host_idx_ptr,
    n_host,
    H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """For BLOCK_R (token, head) rows: mask, head, device and host index, and
    whether the host index is inside the records."""
    rows = row0 + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    tok = rows // H
    didx = tl.load(dev_idx_ptr + tok, mask=rmask, other=0).to(tl.int64)
    hidx, hmask = host_rows(host_idx_ptr, tok, rmask, n_host)
    return rmask, (rows % H).to(tl.int64), didx, hidx, hmask


@triton.jit
def int8_encode_rows(
    x_base,
    layer_off,
    dev_idx_ptr,
    dev_stride_token,
    dev_stride_head,
    host_idx_ptr,
    q_base,
    q_stride_unit,
    q_stride_layer,
    q_stride_token,
    q_stride_head,
    s_base,
    s_stride_unit,
    s_stride_layer,
    s_stride_token,
    s_stride_head,
    layer,
    row0,
    n_rows,
    n_host,
    nonfinite_ptr,
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
    FP8: tl.constexpr = 0,
):
    """BLOCK_R rows of D values -> int8 codes + one fp16 scale per row."""
    rmask, head, didx, hidx, hmask = row_slots(
        row0, n_rows, dev_idx_ptr, host_idx_ptr, n_host, H, BLOCK_R
    )
    d = tl.arange(0, D_PAD)
    m2 = hmask[:, None] & (d < D)[None, :]
    if COUNT_BAD_IDX:
        # Once per token: its first head, in layer 0.
        count_flags(bad_idx_ptr, rmask & ~hmask & (head == 0) & (layer == 0))
    src = layer_off + didx * dev_stride_token + head * dev_stride_head
    x = to_fp32(
        tl.load(x_base + (src[:, None] + d[None, :]), mask=m2, other=0), IS_BF16, FP8
    )

    row_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax_raw = tl.max(tl.abs(x), axis=1)
    s32 = tl.math.div_rn(tl.maximum(amax_raw, 1.1754943508222875e-38), 127.0)
    s_bits, s = fp16_scale_up(s32)
    bad = row_nan | (s != s) | (s > 65504.0)
    s_bits = tl.where(bad, 0x7E00, s_bits).to(tl.int16)  # torch's fp16 NaN

    r = rint(tl.math.div_rn(x, s[:, None]))
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(bad[:, None], 0.0, r)

    unit, within = unit_slots(hidx, UT)
    q_row = (
        unit * q_stride_unit
        + layer * q_stride_layer
        + within * q_stride_token
        + head * q_stride_head
    )
    tl.store(q_base + (q_row[:, None] + d[None, :]), r.to(tl.int8), mask=m2)
    s_off = (
        unit * s_stride_unit
        + layer * s_stride_layer
        + within * s_stride_token
        + head * s_stride_head
    )
    tl.store(s_base + s_off, s_bits, mask=hmask)
    if COUNT:
        count_flags(nonfinite_ptr, bad & hmask)
    if AMAX:
        raise_amax(amax_ptr, tl.where(hmask & ~bad, amax_raw, 0.0))


@triton.jit
def int8_decode_rows(
    q_base,
    q_stride_unit,
    q_stride_token,
    q_stride_head,
    s_base,
    s_stride_unit,
    s_stride_token,
    s_stride_head,
    host_idx_ptr,
    y_base,
    y_stride_token,
    y_stride_head,
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
    FP8: tl.constexpr = 0,
):
    """BLOCK_R rows of int8 codes and scales -> device rows."""
    rmask, head, didx, hidx, hmask = row_slots(
        row0, n_rows, dev_idx_ptr, host_idx_ptr, n_host, H, BLOCK_R
    )
    d = tl.arange(0, D_PAD)
    m2 = hmask[:, None] & (d < D)[None, :]
    if COUNT_BAD_IDX:
        count_flags(bad_idx_ptr, rmask & ~hmask & (head == 0))
    unit, within = unit_slots(hidx, UT)
    s_off = unit * s_stride_unit + within * s_stride_token + head * s_stride_head
    s = tl.load(s_base + s_off, mask=hmask, other=0)
    q_row = unit * q_stride_unit + within * q_stride_token + head * q_stride_head
    q = tl.load(q_base + (q_row[:, None] + d[None, :]), mask=m2, other=0)
    y = q.to(tl.float32) * s.to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    if FP8:
        out = fp32_to_fp8_bits(y, FP8)
    elif IS_BF16:
        out = bf16_rne_bits(y)
    else:
        # Saturate to fp16's max finite value; NaN rows stay NaN.
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -65504.0), 65504.0))
        out = y.to(tl.float16).to(tl.int16, bitcast=True)
    y_row = didx * y_stride_token + head * y_stride_head
    tl.store(y_base + (y_row[:, None] + d[None, :]), out, mask=m2)


# --- host-side helpers --------------------------------------------------------


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block_rows(tile: int, width: int) -> int:
    """Rows of `width` lanes (padded to a power of two) in a program of `tile`."""
    return max(1, pow2(tile) // pow2(width))


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def element_bits(t: torch.Tensor) -> torch.Tensor:
    """Device KV as the kernels address it: 16-bit patterns, or FP8 bytes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else bits16(t)


def fp8_kind(dtype: torch.dtype) -> int:
    """The kernels' FP8 constexpr for a device dtype (FP8_NONE if 16-bit)."""
    if dtype in FP8_DTYPES:
        return FP8_E4M3 if dtype == torch.float8_e4m3fn else FP8_E5M2
    return FP8_NONE


def fp8_args(dtype: torch.dtype) -> dict:
    """The FP8 constexpr of kernels that read FP8 device KV (int4/k8v4)."""
    return {"FP8": fp8_kind(dtype)}


def _or_dummy(t, dummy, view_dtype=None):
    """The pointer argument for an optional tensor; a constexpr flag tells the
    kernel whether to touch it."""
    if t is None:
        return dummy
    return t if view_dtype is None else t.view(view_dtype)


def stride_args(name: str, t: torch.Tensor, dims: Sequence[str]) -> dict[str, int]:
    """{name}_stride_{dim} kernel arguments of t's leading dims."""
    return {f"{name}_stride_{dim}": t.stride(i) for i, dim in enumerate(dims)}


def encode_args(
    tables: dict[str, DeviceLayerTable],
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    nonfinite_counter: torch.Tensor | None,
    scale_amax: torch.Tensor | None,
    bad_index_counter: torch.Tensor | None,
) -> dict:
    """The arguments every encode kernel takes, by the kernels' names: each
    side's layer table, the indices and the statistics with their flags."""
    first = next(iter(tables.values()))
    args = bad_index_args(bad_index_counter, first.offsets)
    args.update(
        dev_idx_ptr=device_indices,
        host_idx_ptr=host_indices,
        nonfinite_ptr=_or_dummy(nonfinite_counter, first.offsets),
        amax_ptr=_or_dummy(scale_amax, first.offsets, torch.int32),
        IS_BF16=first.dtype == torch.bfloat16,
        ALIGNED=all(t.aligned for t in tables.values()),
        COUNT=nonfinite_counter is not None,
        AMAX=scale_amax is not None,
    )
    for side, table in tables.items():
        args[f"{side}_base"] = table.base
        args[f"{side}_offs"] = table.offsets
        args[f"{side}_dev_stride_token"] = table.stride[0]
        args[f"{side}_dev_stride_head"] = table.stride[1]
    return args


def decode_args(
    dst: dict[str, torch.Tensor],
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    bad_index_counter: torch.Tensor | None,
) -> dict:
    """The arguments every decode kernel takes: each side's device layer (as
    16-bit patterns), the indices and the bad-index counter with its flag."""
    args = bad_index_args(bad_index_counter, device_indices)
    args.update(dev_idx_ptr=device_indices, host_idx_ptr=host_indices)
    args["IS_BF16"] = next(iter(dst.values())).dtype == torch.bfloat16
    for side, t in dst.items():
        args[f"{side}_dst"] = element_bits(t)
        args[f"{side}_dst_stride_token"] = t.stride(0)
        args[f"{side}_dst_stride_head"] = t.stride(1)
    return args


def bad_index_args(bad_index_counter: torch.Tensor | None, dummy) -> dict:
    return dict(
        bad_idx_ptr=_or_dummy(bad_index_counter, dummy),
        COUNT_BAD_IDX=bad_index_counter is not None,
    )


class DeviceLayerTable:
    """The per-layer device tensors of one component (K, V or MLA's kv) as one
    base tensor plus element offsets, so one launch reaches every layer.

    All layers share dtype, shape and strides ([size, heads, dim], dim
    contiguous), as SGLang's device pools allocate them; FP8 KV comes as
    float8 views of SGLang's uint8 storage (uint8 alone does not say which
    FP8). Build it once per pool: the offsets are copied to the layers'
    device synchronously."""

    def __init__(self, layers: Sequence[torch.Tensor]):
        if not layers:
            raise ValueError("DeviceLayerTable needs at least one layer")
        base = layers[0]
        if base.dtype not in DEVICE_DTYPES + FP8_DTYPES:
            raise TypeError(
                f"device KV must be bf16/fp16, or FP8 as a float8 view, got "
                f"{base.dtype}"
            )
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
        self.base = element_bits(base)
        self.dtype = base.dtype
        self.device = base.device
        self.shape = tuple(base.shape)
        self.stride = base.stride()
        # 16-element offsets let row loads stay vectorized (tl.multiple_of).
        self.aligned = base.data_ptr() % (16 * item) == 0 and all(
            o % 16 == 0 for o in offsets
        )
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


def _device_dtypes(fp8: bool) -> tuple[torch.dtype, ...]:
    return DEVICE_DTYPES + FP8_DTYPES if fp8 else DEVICE_DTYPES


def check_kv_tables(
    k_table: DeviceLayerTable, v_table: DeviceLayerTable, fp8: bool = False
) -> None:
    """K and V tables of one pool; FP8 ones only for kernels that read FP8."""
    if len(k_table) != len(v_table):
        raise ValueError("K and V tables differ in layer count")
    if k_table.shape[1] != v_table.shape[1] or k_table.dtype != v_table.dtype:
        raise ValueError("K and V tables differ in head count or dtype")
    if k_table.dtype not in _device_dtypes(fp8):
        raise TypeError(f"device KV must be bf16/fp16, got {k_table.dtype}")


def check_device_layers(
    k_dst: torch.Tensor, v_dst: torch.Tensor, fp8: bool = False
) -> None:
    """The K and V device layers a restore writes: bf16/fp16 [size, H, dim]
    (or FP8 float8 views, where the kernels write FP8)."""
    if k_dst.dtype not in _device_dtypes(fp8) or v_dst.dtype != k_dst.dtype:
        kinds = "bf16/fp16/FP8" if fp8 else "bf16/fp16"
        raise TypeError(f"device KV must be {kinds}, got {k_dst.dtype}/{v_dst.dtype}")
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"{name} must be [size, heads, dim], dim contiguous")
    if v_dst.shape[1] != k_dst.shape[1]:
        raise ValueError("K and V device layers differ in head count")


def check_indices(device_indices, host_indices, n: int, device) -> None:
    for name, idx in (
        ("device_indices", device_indices),
        ("host_indices", host_indices),
    ):
        if idx.dim() != 1 or idx.numel() != n:
            raise ValueError(
                f"{name} must be 1-D with {n} entries, got {tuple(idx.shape)}"
            )
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64, got {idx.dtype}")
        if idx.device != device or not idx.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {device}, got {idx.device}")


def check_counter(name: str, t: torch.Tensor | None, device) -> None:
    if t is not None and (t.dtype != torch.int64 or t.dim() or t.device != device):
        raise ValueError(f"{name} must be a 0-dim int64 tensor on {device}")


def check_amax(
    scale_amax: torch.Tensor | None, layers: int, sides: int, device
) -> None:
    """scale_amax, if given: contiguous fp32 [layers, sides] on the device."""
    if scale_amax is not None and (
        scale_amax.dtype != torch.float32
        or tuple(scale_amax.shape) != (layers, sides)
        or not scale_amax.is_contiguous()
        or scale_amax.device != device
    ):
        raise ValueError(
            f"scale_amax must be contiguous float32 [{layers}, {sides}] on {device}, "
            f"got {scale_amax.dtype} {tuple(scale_amax.shape)} on {scale_amax.device}"
        )
