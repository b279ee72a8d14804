"""Shared pieces of the host (L2) KV cache kernels: the device layer table, the
argument checks, the kernels' prologue steps (index loads and checks, layer
offsets, record offsets, counters) and the INT8 row code that the INT8 format,
K8V4 keys and MLA latent tiles all use. Why each step is bit-exact:
docs/kernels.md."""

from __future__ import annotations

from typing import NamedTuple, Sequence

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

# Per-transfer sizes pick no kernel variant (Triton specializes ints == 1 or
# divisible by 16); nor do the index pointers, slices at any offset (pointers
# are specialized on 16-byte alignment): a serving pool would compile
# mid-flight. They stay separate arguments: a tuple's elements are specialized
# whatever its do_not_specialize_on_alignment says. The encode kernels' layer
# offsets and counters are tuple elements, so they must be whole (aligned)
# tensors: check_counters refuses others (tests/test_int8_kernel_variants.py).
SIZES = ["n_tok", "n_host", "n_k_progs", "first_layer"]
BOOKKEEPING_POINTERS = ["dev_idx_ptr", "host_idx_ptr", "bad_idx_ptr"]


def kernel_jit(unaligned: Sequence[str] = ()):
    """triton.jit for a host-KV kernel: SIZES and BOOKKEEPING_POINTERS (plus
    `unaligned`) are not specialized; names a kernel lacks are ignored."""
    return triton.jit(
        do_not_specialize=SIZES,
        do_not_specialize_on_alignment=BOOKKEEPING_POINTERS + list(unaligned),
    )


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
def layer_offset(offs_ptr, layer_idx, ALIGNED: tl.constexpr):
    """A layer's element offset in its DeviceLayerTable (ALIGNED: all of them
    are multiples of 16, so row loads stay vectorized)."""
    off = tl.load(offs_ptr + layer_idx)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def device_rows(dev, layer, ALIGNED: tl.constexpr):
    """A side's device rows in one layer as the row code takes them (src):
    dev = (base pointer, token stride, head stride, layer offsets)."""
    return (dev[0], layer_offset(dev[3], layer, ALIGNED), dev[1], dev[2])


@triton.jit
def layer_stats(counters, slot):
    """The stats of one (layer, side) amax slot: counters = (nonfinite, amax,
    bad indices) -> (nonfinite_ptr, amax_ptr)."""
    return (counters[0], counters[1] + slot)


@triton.jit
def side_record(rec, side):
    """One side (K = 0, V = 1) of a record view with both: rec = (pointer,
    unit, layer, token, head strides, side stride)."""
    return (rec[0] + side * rec[5], rec[1], rec[2], rec[3], rec[4])


@triton.jit
def token_slots(tok, mask, idx, n_host):
    """The tokens' device index, host index and in-range mask (idx: the
    transfer's (dev_idx_ptr, host_idx_ptr, bad_idx_ptr))."""
    didx = tl.load(idx[0] + tok, mask=mask, other=0).to(tl.int64)
    hidx = tl.load(idx[1] + tok, mask=mask, other=0).to(tl.int64)
    return didx, hidx, mask & (hidx >= 0) & (hidx < n_host)


@triton.jit
def row_slots(
    row0,
    n_rows,
    idx,
    n_host,
    once,
    H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    """For BLOCK_R rows, H per token: the row in its token, device and host
    index and the in-range mask; an out-of-range token is counted once, at
    its first row where `once` holds."""
    rows = row0 + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    didx, hidx, hmask = token_slots(rows // H, rmask, idx, n_host)
    head = (rows % H).to(tl.int64)
    if COUNT_BAD_IDX:
        count_flags(idx[2], rmask & ~hmask & (head == 0) & once)
    return head, didx, hidx, hmask


@triton.jit
def unit_slots(hidx, UT: tl.constexpr):
    """Host unit and token-in-unit of host indices. Called next to the record
    accesses: two int64 vectors held across the row math spill registers."""
    return hidx // UT, hidx % UT


@triton.jit
def record_offset(rec, unit, layer, within, head):
    """Element offset of (unit, layer, token-in-unit, head) in a record view
    rec = (pointer, unit, layer, token, head strides, ...)."""
    return unit * rec[1] + layer * rec[2] + within * rec[3] + head * rec[4]


@triton.jit
def int8_encode_rows(
    src,
    q,
    s,
    idx,
    stats,
    rows,
    layer,
    H: tl.constexpr,
    D: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    STATS: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    """BLOCK_R rows of D values -> int8 codes + one fp16 scale per row.
    src = (device pointer, layer offset, token and head strides); q, s: the
    codes' and scales' records (record_offset); rows = (row0, n_rows,
    n_host); stats = (nonfinite_ptr, amax_ptr)."""
    D_PAD: tl.constexpr = pow2(D)
    # Once per token: its first head, in layer 0.
    head, didx, hidx, hmask = row_slots(
        rows[0], rows[1], idx, rows[2], layer == 0, H, BLOCK_R, COUNT_BAD_IDX
    )
    d = tl.arange(0, D_PAD)
    m2 = hmask[:, None] & (d < D)[None, :]
    x_row = src[1] + didx * src[2] + head * src[3]
    x = to_fp32(
        tl.load(src[0] + (x_row[:, None] + d[None, :]), mask=m2, other=0), IS_BF16, FP8
    )

    row_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax_raw = tl.max(tl.abs(x), axis=1)
    s32 = tl.math.div_rn(tl.maximum(amax_raw, 1.1754943508222875e-38), 127.0)
    s_bits, scale = fp16_scale_up(s32)
    bad = row_nan | (scale != scale) | (scale > 65504.0)
    s_bits = tl.where(bad, 0x7E00, s_bits).to(tl.int16)  # torch's fp16 NaN

    r = rint(tl.math.div_rn(x, scale[:, None]))
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(bad[:, None], 0.0, r)

    unit, within = unit_slots(hidx, UT)
    q_row = record_offset(q, unit, layer, within, head)
    tl.store(q[0] + (q_row[:, None] + d[None, :]), r.to(tl.int8), mask=m2)
    tl.store(s[0] + record_offset(s, unit, layer, within, head), s_bits, mask=hmask)
    count_stats(stats, bad & hmask, tl.where(hmask & ~bad, amax_raw, 0.0), STATS)


@triton.jit
def count_stats(stats, bad, amax, STATS: tl.constexpr):
    """Count the non-finite flags and raise the amax statistic, as STATS
    enables them (stats = (nonfinite_ptr, amax_ptr), STATS their flags)."""
    if STATS[0]:
        count_flags(stats[0], bad)
    if STATS[1]:
        raise_amax(stats[1], amax)


@triton.jit
def int8_decode_rows(
    q,
    s,
    dst,
    idx,
    rows,
    H: tl.constexpr,
    D: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    """BLOCK_R rows of int8 codes and scales -> device rows. q, s: one layer's
    records (record_offset, layer stride 0); dst = (device pointer, token and
    head strides); rows = (row0, n_rows, n_host)."""
    D_PAD: tl.constexpr = pow2(D)
    head, didx, hidx, hmask = row_slots(
        rows[0], rows[1], idx, rows[2], True, H, BLOCK_R, COUNT_BAD_IDX
    )
    d = tl.arange(0, D_PAD)
    m2 = hmask[:, None] & (d < D)[None, :]
    unit, within = unit_slots(hidx, UT)
    scale = tl.load(s[0] + record_offset(s, unit, 0, within, head), mask=hmask, other=0)
    q_row = record_offset(q, unit, 0, within, head)
    codes = tl.load(q[0] + (q_row[:, None] + d[None, :]), mask=m2, other=0)
    y = (
        codes.to(tl.float32)
        * scale.to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    )
    if FP8:
        out = fp32_to_fp8_bits(y, FP8)
    elif IS_BF16:
        out = bf16_rne_bits(y)
    else:
        # Saturate to fp16's max finite value; NaN rows stay NaN.
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -65504.0), 65504.0))
        out = y.to(tl.float16).to(tl.int16, bitcast=True)
    y_row = didx * dst[1] + head * dst[2]
    tl.store(dst[0] + (y_row[:, None] + d[None, :]), out, mask=m2)


# --- host-side helpers --------------------------------------------------------


@triton.constexpr_function
def pow2(n: int) -> int:
    """The next power of two >= n (a tile's padded width), on the host and in
    the kernels."""
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


def _or_dummy(t, dummy, view_dtype=None):
    """The pointer argument for an optional tensor; a constexpr flag tells the
    kernel whether to touch it."""
    if t is None:
        return dummy
    return t if view_dtype is None else t.view(view_dtype)


RECORD_DIMS = ("unit", "layer", "token", "head")


def record_arg(
    t: torch.Tensor, dims: Sequence[str], strides: Sequence[int] | None = None
) -> tuple:
    """A record view as the kernels take it: (t, its unit, layer, token and
    head strides, then those of its other dims in order), dims naming t's
    leading strides (or `strides`); a dim it lacks has stride 0, as one
    layer's view has in its layer dim."""
    named = dict(zip(dims, t.stride() if strides is None else strides))
    rest = [named[d] for d in dims if d not in RECORD_DIMS]
    return (t, *(named.get(d, 0) for d in RECORD_DIMS), *rest)


class KVCounters(NamedTuple):
    """The statistics an encode_gather updates, each None if not kept: the
    groups stored as non-finite (0-dim int64), the amax per layer and side
    (fp32 [layers, sides]) and the tokens skipped for an out-of-range host
    index (0-dim int64). The pool's HostKVCounters, with the same fields,
    may stand in for it."""

    nonfinite: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    bad_indices: torch.Tensor | None = None


def check_counters(counters, layers: int, sides: int, device) -> KVCounters:
    """counters (a KVCounters, an object with its fields, or None: none),
    checked for tables of `layers` layers of `sides` sides. The kernels take
    them as one tuple, so each must start 16-byte aligned (a whole tensor)."""
    if counters is None:
        return KVCounters()
    counters = KVCounters(counters.nonfinite, counters.amax, counters.bad_indices)
    check_counter("counters.nonfinite", counters.nonfinite, device)
    check_counter("counters.bad_indices", counters.bad_indices, device)
    check_amax(counters.amax, layers, sides, device)
    for name, t in zip(KVCounters._fields, counters):
        if t is not None and t.data_ptr() % 16:
            raise ValueError(
                f"counters.{name} must be a whole tensor (16-byte aligned), "
                "not a slice: the kernels would compile a variant for it"
            )
    return counters


def check_layer_range(first_layer: int, record_layers: int, layers: int) -> None:
    """Records of record_layers layers from table layer first_layer on."""
    if not 0 <= first_layer <= layers - record_layers:
        raise ValueError(
            f"records hold {record_layers} layers from layer {first_layer}, "
            f"the tables {layers}"
        )


def encode_args(
    tables: dict[str, DeviceLayerTable],
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    counters: KVCounters,
) -> dict:
    """The arguments every encode kernel takes, by the kernels' names: each
    side's device rows (dev, per side (base, token stride, head stride, layer
    offsets)), the indices, the counters (nonfinite, amax as int32, bad
    indices: whole tensors, a dummy for each not kept) and the statistics'
    flags (the dtype's and the bad-index flag: kernel_flags)."""
    dummy = next(iter(tables.values())).offsets
    return dict(
        dev=tuple((t.base, *t.stride[:2], t.offsets) for t in tables.values()),
        dev_idx_ptr=device_indices,
        host_idx_ptr=host_indices,
        counters=(
            _or_dummy(counters.nonfinite, dummy),
            _or_dummy(counters.amax, dummy, torch.int32),
            _or_dummy(counters.bad_indices, dummy),
        ),
        ALIGNED=all(t.aligned for t in tables.values()),
        STATS=(counters.nonfinite is not None, counters.amax is not None),
    )


def decode_args(
    dst: dict[str, torch.Tensor],
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    bad_index_counter: torch.Tensor | None,
) -> dict:
    """The arguments every decode kernel takes: each side's device layer (dst,
    per side (element patterns, token stride, head stride)) and the index
    pointers (passed on to the device functions as idx)."""
    return dict(
        dst=tuple((element_bits(t), *t.stride()[:2]) for t in dst.values()),
        dev_idx_ptr=device_indices,
        host_idx_ptr=host_indices,
        bad_idx_ptr=_or_dummy(bad_index_counter, device_indices),
    )


def kernel_flags(dtype: torch.dtype, bad_index_counter) -> tuple[bool, bool]:
    """(IS_BF16, COUNT_BAD_IDX): the device dtype's and the bad-index flag."""
    return dtype == torch.bfloat16, bad_index_counter is not None


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


def check_amax(amax: torch.Tensor | None, layers: int, sides: int, device) -> None:
    """amax, if given: contiguous fp32 [layers, sides] on the device."""
    if amax is not None and (
        amax.dtype != torch.float32
        or tuple(amax.shape) != (layers, sides)
        or not amax.is_contiguous()
        or amax.device != device
    ):
        raise ValueError(
            f"counters.amax must be contiguous float32 [{layers}, {sides}] on "
            f"{device}, got {amax.dtype} {tuple(amax.shape)} on {amax.device}"
        )
