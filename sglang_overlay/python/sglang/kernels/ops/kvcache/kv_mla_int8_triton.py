"""Fused Triton kernels for the MLA INT8 host (L2) KV pool (--hicache-host-dtype int8).

An MLA layer keeps one device row per token, [kv_lora_rank latent | rope], in
bf16/fp16. The host format stores per token and layer:

  "kv"     int8 [unit_tokens, 1, kv_lora_rank]      the latent, in tiles
  "scale"  fp16 [unit_tokens, 1, kv_lora_rank / T]   one scale per tile of T
  "rope"   [unit_tokens, 1, rope_dim]                the RoPE part, bit for bit

Each latent tile is encoded exactly like one INT8 head row (kv_int8_codec's
math: fp16 scale amax/127 rounded up, round half to even, NaN tile -> NaN
scale and q = 0), so the kernels reuse kv_int8_triton's row functions: a
token's latent is kv_lora_rank / T "heads" of T values, T elements apart in
both the device row and the record. The RoPE part is copied as 16-bit
patterns. T is read off the records' shapes (kv_lora_rank / scale entries).

  encode_gather   backup, ONE launch per transfer (all layers)
  decode_scatter  restore, ONE launch per layer

Grids: encode (row blocks, layers, latent|rope), decode (row blocks,
latent|rope); a latent program handles BLOCK_R tiles, a RoPE program the
BLOCK_T >= BLOCK_R / tiles tokens of the same block index, so the RoPE
programs cover every token the latent ones do.

Everything kv_int8_triton's docstring says about bit-exactness, host memory
(UVA-direct or staged), host-index bounds and counters, per-transfer
specialization and lazy building holds here unchanged: the arithmetic is the
same code. Counters, as kv_mla_int8_codec's encode_into: non-finite = latent
tiles stored with a NaN scale plus RoPE rows holding NaN/Inf (copied as they
are, so they restore as themselves, never as finite values). scale_amax is
[layers, 1]: the largest amax of the finite latent tiles. A token whose host
index is out of range is counted once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping, Sequence

import torch

from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.kernels.ops.kvcache.kv_int8_triton import DeviceLayerTable, available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - sglang always ships triton
    triton = tl = None

__all__ = ["DeviceLayerTable", "available", "decode_scatter", "encode_gather"]

RECORD_NAMES = ("kv", "scale", "rope")

# The latent programs are kv_int8_triton's row code on tiles; its tile sizes
# (compile-checked on sm_80-90) apply as they are.
ENCODE_TILE = kt.ENCODE_TILE
ENCODE_WARPS = kt.ENCODE_WARPS
DECODE_TILE = kt.DECODE_TILE
DECODE_WARPS = kt.DECODE_WARPS


# ----------------------------------------------------------------------------
# kernel sources (jit-compiled by _build() on first use)


def _rope_offsets_src(
    tok0,
    n_tok,
    n_host,
    dev_idx_ptr,
    host_idx_ptr,
    BLOCK_T: tl.constexpr,
    UT: tl.constexpr,
):
    """Device index, host unit, token-in-unit and mask of BLOCK_T tokens."""
    tok = tok0 + tl.arange(0, BLOCK_T)
    tmask = tok < n_tok
    didx = tl.load(dev_idx_ptr + tok, mask=tmask, other=0).to(tl.int64)
    hidx = tl.load(host_idx_ptr + tok, mask=tmask, other=0).to(tl.int64)
    hmask = tmask & (hidx >= 0) & (hidx < n_host)
    return didx, hidx // UT, hidx % UT, hmask


def _mla_encode_kernel_src(
    x_base,
    x_offs,
    dev_idx_ptr,
    host_idx_ptr,
    kv_out,
    s_out,
    r_out,
    counter_ptr,
    amax_ptr,
    bad_idx_ptr,
    n_tok,
    n_host,
    d_st,
    kv_su,
    kv_sl,
    kv_st,
    s_su,
    s_sl,
    s_st,
    r_su,
    r_sl,
    r_st,
    NT: tl.constexpr,
    T: tl.constexpr,
    T_PAD: tl.constexpr,
    P: tl.constexpr,
    P_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    COUNT: tl.constexpr,
    AMAX: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (row blocks, layers, latent|rope)
    layer_idx = tl.program_id(1)
    layer = layer_idx.to(tl.int64)
    off = tl.load(x_offs + layer_idx)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    if tl.program_id(2) == 0:
        # Tiles as heads: "head" stride T in the device row and the record,
        # the scale's tile stride 1.
        _encode_rows(
            x_base, off, dev_idx_ptr, d_st, T, host_idx_ptr,
            kv_out, kv_su, kv_sl, kv_st, T,
            s_out, s_su, s_sl, s_st, 1,
            layer, tl.program_id(0) * BLOCK_R, n_tok * NT, n_host,
            counter_ptr, amax_ptr + layer, bad_idx_ptr,
            NT, T, T_PAD, UT, BLOCK_R, IS_BF16, COUNT, AMAX, COUNT_BAD_IDX,
        )  # fmt: skip
    else:
        didx, unit, within, hmask = _rope_offsets(
            tl.program_id(0) * BLOCK_T, n_tok, n_host, dev_idx_ptr, host_idx_ptr,
            BLOCK_T, UT,
        )  # fmt: skip
        d = tl.arange(0, P_PAD)
        m2 = hmask[:, None] & (d < P)[None, :]
        src = off + NT * T + didx * d_st
        bits = tl.load(x_base + (src[:, None] + d[None, :]), mask=m2, other=0)
        dst = unit * r_su + layer * r_sl + within * r_st
        tl.store(r_out + (dst[:, None] + d[None, :]), bits, mask=m2)
        if COUNT:
            # A RoPE row holding NaN/Inf (all exponent bits set) counts once,
            # as the codec counts it.
            if IS_BF16:
                exponent = bits.to(tl.int32) & 0x7F80
                special = (exponent == 0x7F80) & m2
            else:
                exponent = bits.to(tl.int32) & 0x7C00
                special = (exponent == 0x7C00) & m2
            row_bad = tl.reduce(special.to(tl.int32), 1, _max_combine) > 0
            n_bad = tl.reduce(row_bad.to(tl.int64), 0, _sum_combine)
            tl.atomic_add(counter_ptr, n_bad, mask=n_bad > 0)


def _mla_decode_kernel_src(
    kv_in,
    s_in,
    r_in,
    host_idx_ptr,
    y_base,
    dev_idx_ptr,
    bad_idx_ptr,
    n_tok,
    n_host,
    kv_su,
    kv_st,
    s_su,
    s_st,
    r_su,
    r_st,
    y_st,
    NT: tl.constexpr,
    T: tl.constexpr,
    T_PAD: tl.constexpr,
    P: tl.constexpr,
    P_PAD: tl.constexpr,
    UT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    IS_BF16: tl.constexpr,
    COUNT_BAD_IDX: tl.constexpr,
):
    # grid: (row blocks, latent|rope)
    if tl.program_id(1) == 0:
        _decode_rows(
            kv_in, kv_su, kv_st, T, s_in, s_su, s_st, 1, host_idx_ptr,
            y_base, y_st, T, dev_idx_ptr, tl.program_id(0) * BLOCK_R,
            n_tok * NT, n_host, bad_idx_ptr,
            NT, T, T_PAD, UT, BLOCK_R, IS_BF16, COUNT_BAD_IDX,
        )  # fmt: skip
    else:
        didx, unit, within, hmask = _rope_offsets(
            tl.program_id(0) * BLOCK_T, n_tok, n_host, dev_idx_ptr, host_idx_ptr,
            BLOCK_T, UT,
        )  # fmt: skip
        d = tl.arange(0, P_PAD)
        m2 = hmask[:, None] & (d < P)[None, :]
        src = unit * r_su + within * r_st
        bits = tl.load(r_in + (src[:, None] + d[None, :]), mask=m2, other=0)
        dst = NT * T + didx * y_st
        tl.store(y_base + (dst[:, None] + d[None, :]), bits, mask=m2)


# Bound by _build() to kv_int8_triton's jit-compiled row functions (built in
# the same mode) and this module's helper.
_encode_rows = None
_decode_rows = None
_max_combine = None
_sum_combine = None
_rope_offsets = None
_KERNELS: SimpleNamespace | None = None

# As in kv_int8_triton: per-transfer sizes and bookkeeping pointers pick no
# kernel variant (a serving pool would otherwise compile mid-flight).
ENCODE_PER_TRANSFER_ARGS = ("n_tok", "n_host")
ENCODE_BOOKKEEPING_POINTERS = (
    "x_offs",
    "dev_idx_ptr",
    "host_idx_ptr",
    "counter_ptr",
    "amax_ptr",
    "bad_idx_ptr",
)
DECODE_PER_TRANSFER_ARGS = ("n_tok", "n_host")
DECODE_BOOKKEEPING_POINTERS = ("host_idx_ptr", "dev_idx_ptr", "bad_idx_ptr")


def _build() -> SimpleNamespace:
    global _KERNELS, _encode_rows, _decode_rows, _rope_offsets
    global _max_combine, _sum_combine
    # kv_int8_triton decides the mode (TRITON_INTERPRET) and owns the row
    # functions; rebuild whenever it rebuilt (reset_kernels there resets here).
    rows = kt._build()
    if _KERNELS is not None and _KERNELS.rows is rows:
        return _KERNELS
    _encode_rows = kt._encode_rows
    _decode_rows = kt._decode_rows
    _max_combine = kt._max_combine
    _sum_combine = kt._sum_combine
    _rope_offsets = triton.jit(_rope_offsets_src)
    _KERNELS = SimpleNamespace(
        rows=rows,
        encode=triton.jit(
            _mla_encode_kernel_src,
            do_not_specialize=ENCODE_PER_TRANSFER_ARGS,
            do_not_specialize_on_alignment=ENCODE_BOOKKEEPING_POINTERS,
        ),
        decode=triton.jit(
            _mla_decode_kernel_src,
            do_not_specialize=DECODE_PER_TRANSFER_ARGS,
            do_not_specialize_on_alignment=DECODE_BOOKKEEPING_POINTERS,
        ),
    )
    return _KERNELS


def reset_kernels() -> None:
    """Forget built kernels, here and in kv_int8_triton (next call rebuilds)."""
    global _KERNELS
    _KERNELS = None
    kt.reset_kernels()


# ----------------------------------------------------------------------------
# host-side wrappers


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
    if dtype not in (torch.bfloat16, torch.float16):
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
    block_r = kt._block_rows(tile, kt._pow2(geo.T))
    return block_r, kt._pow2(kt._cdiv(block_r, geo.NT))


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


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
    """Backup in one launch: for every layer l and token i, encode the device
    row tables[0][l][device_indices[i]] ([kv_lora_rank | rope], bf16/fp16)
    into the records at host_indices[i]:

      out["kv"]     int8 [units, L, unit_tokens, 1, kv_lora_rank]
      out["scale"]  fp16 [units, L, unit_tokens, 1, kv_lora_rank / T]
      out["rope"]   16-bit [units, L, unit_tokens, 1, rope_dim]

    (any strides, last dim contiguous; unit = host_index // unit_tokens).
    Bit-identical to kv_mla_int8_codec's encode_reference. Latent tiles
    stored non-finite and RoPE rows holding NaN/Inf are added to
    nonfinite_counter (0-dim int64) if given, as encode_into counts them;
    scale_amax (fp32 [L, 1]) is raised to each layer's largest finite tile
    amax. A host index outside [0, units * unit_tokens) writes nothing and its
    token is counted once in bad_index_counter. Device indices are not
    range-checked here.
    """
    if len(tables) != 1:
        raise ValueError(f"MLA encodes one side ('kv'), got {len(tables)} tables")
    (table,) = tables
    geo = _record_geometry(out, 5)
    _check_device_row(geo, table.shape, table.dtype, out["rope"].dtype)
    layers = len(table)
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
    kt._check_index("device_indices", device_indices, n, dev)
    kt._check_index("host_indices", host_indices, n, dev)
    kt._check_counter("nonfinite_counter", nonfinite_counter, dev)
    kt._check_counter("bad_index_counter", bad_index_counter, dev)
    if scale_amax is not None and (
        scale_amax.dtype != torch.float32
        or scale_amax.shape != (layers, 1)
        or not scale_amax.is_contiguous()
        or scale_amax.device != dev
    ):
        raise ValueError(
            f"scale_amax must be contiguous float32 [{layers}, 1] on {dev}, got "
            f"{scale_amax.dtype} {tuple(scale_amax.shape)} on {scale_amax.device}"
        )

    kernels = _build()
    block_r, block_t = _blocks(tile or ENCODE_TILE, geo)
    kv, s16, rope = out["kv"], _bits16(out["scale"]), _bits16(out["rope"])
    dummy = table.offsets
    kernels.encode[(kt._cdiv(n * geo.NT, block_r), layers, 2)](
        table.base, table.offsets, device_indices, host_indices, kv, s16, rope,
        kt._or_dummy(nonfinite_counter, dummy),
        kt._or_dummy(scale_amax, dummy, torch.int32),
        kt._or_dummy(bad_index_counter, dummy),
        n, kv.shape[0] * geo.UT, table.stride[0],
        kv.stride(0), kv.stride(1), kv.stride(2),
        s16.stride(0), s16.stride(1), s16.stride(2),
        rope.stride(0), rope.stride(1), rope.stride(2),
        NT=geo.NT, T=geo.T, T_PAD=kt._pow2(geo.T), P=geo.P, P_PAD=kt._pow2(geo.P),
        UT=geo.UT, BLOCK_R=block_r, BLOCK_T=block_t,
        IS_BF16=table.dtype == torch.bfloat16, ALIGNED=table.aligned,
        COUNT=nonfinite_counter is not None, AMAX=scale_amax is not None,
        COUNT_BAD_IDX=bad_index_counter is not None,
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
    (one layer's views: kv int8 [units, unit_tokens, 1, kv_lora_rank], scale
    fp16 [units, unit_tokens, 1, kv_lora_rank / T], rope 16-bit [units,
    unit_tokens, 1, rope_dim]) into dst[0][device_indices[i]], the device
    layer [size, 1, kv_lora_rank + rope_dim] (bf16/fp16, last dim contiguous).

    Bit-identical to kv_mla_int8_codec's decode_reference: NaN tiles restore as
    NaN, fp16 output saturates at +-65504, RoPE bits are copied. A host index
    outside [0, units * unit_tokens) restores nothing (the device row keeps
    its contents) and its token is counted in bad_index_counter if given.
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
    kt._check_index("device_indices", device_indices, n, dev)
    kt._check_index("host_indices", host_indices, n, dev)
    kt._check_counter("bad_index_counter", bad_index_counter, dev)

    kernels = _build()
    block_r, block_t = _blocks(tile or DECODE_TILE, geo)
    kv, s16, rope = records["kv"], _bits16(records["scale"]), _bits16(records["rope"])
    kernels.decode[(kt._cdiv(n * geo.NT, block_r), 2)](
        kv, s16, rope, host_indices, _bits16(y), device_indices,
        kt._or_dummy(bad_index_counter, device_indices),
        n, kv.shape[0] * geo.UT,
        kv.stride(0), kv.stride(1), s16.stride(0), s16.stride(1),
        rope.stride(0), rope.stride(1), y.stride(0),
        NT=geo.NT, T=geo.T, T_PAD=kt._pow2(geo.T), P=geo.P, P_PAD=kt._pow2(geo.P),
        UT=geo.UT, BLOCK_R=block_r, BLOCK_T=block_t,
        IS_BF16=y.dtype == torch.bfloat16,
        COUNT_BAD_IDX=bad_index_counter is not None,
        num_warps=num_warps or DECODE_WARPS,
    )  # fmt: skip
