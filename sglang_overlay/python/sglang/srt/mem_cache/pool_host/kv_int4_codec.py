"""INT4 and K8V4 codecs for the HiCache host (L2) KV pool.

Asymmetric 4-bit codes with one FP16 (scale, zero point) pair per group. A
group is a set of values of one head in one layer:

- values, and keys when a unit holds fewer than ``K_CHANNEL_MIN_TOKENS``
  tokens ("per token"): one token, ``G`` consecutive channels, where ``G`` is
  64 if the head dim divides by 64, else 32 if it divides by 32, else the head;
- keys of a unit of at least ``K_CHANNEL_MIN_TOKENS`` tokens ("per channel"):
  one channel over the unit's tokens, because key outliers sit in fixed
  channels.

For a group ``x`` (bf16 or fp16; fp32 accepted), all arithmetic in fp32:

    lo, hi = min x, max x                         (exact)
    m  = fp16(lo), round to nearest even; a zero m is +0
    s  = max((hi - m) / 15, finfo(float32).tiny), rounded *up* to fp16
    q  = clamp(round_half_even((x - m) / s), 0, 15)
    x^ = sat(m + q * s).to(out_dtype)

``q`` is packed two per byte along the channels, the even channel in the low
nibble: ``byte[c] = q[2c] | q[2c + 1] << 4``. ``meta[..., 0]`` is ``s`` and
``meta[..., 1]`` is ``m``. A group holding NaN/Inf, or whose ``m`` or ``s``
would overflow fp16, is stored with ``meta = (NaN, NaN)`` and ``q = 0`` and
decodes to all NaN; ``count_nonfinite_groups`` counts such groups without a
host sync. ``sat`` clamps to the output dtype's largest finite value. For a
finite bf16/fp16 group every element satisfies

    |x - x^| <= max(s/2, half_ulp_fp16(m)) + half_ulp_fp32(x^) + half_ulp_out(x^)

(``error_bound_tokens`` / ``error_bound_channels``); the derivation is in the
HiCache host dtype docs page.

FP8 input (an FP8 device KV cache) is encoded from its values, each exact in
fp32 and in fp16, so the bound above holds with ``half_ulp_out`` of the FP8
dtype; restores saturate at its largest finite value and round to nearest
even.

K8V4 stores keys exactly as ``kv_int8_codec`` and values as above.

Shapes: the record functions take ``k``/``v`` as ``[units, unit_tokens,
head_num, dim]`` and return the records of the host formats ``int4`` ("k",
"k_meta", "v", "v_meta") and ``k8v4`` ("k", "k_scale", "v", "v_meta"),
which Int4HostFormat and K8V4HostFormat wrap for the host pools.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, NamedTuple

import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec
from sglang.srt.mem_cache.pool_host.host_format import (
    FP8_DEVICE_DTYPES,
    EncodeStats,
    HostKVFormat,
    HostRecord,
    add_round_up,
    half_ulp,
)

META_DTYPE = torch.float16
QMAX = 15
# Per-channel key groups (KIVI) need enough tokens for a channel's range to be
# representative; at 16 tokens their metadata costs 2 bits per key (per-token
# groups of 64 cost 0.5), so smaller units fall back to per-token keys.
K_CHANNEL_MIN_TOKENS = 16

# FP8 device KV (--kv-cache-dtype fp8_e4m3/fp8_e5m2) is encoded from its
# values, each exact in fp32, and restored rounded and saturated to FP8.
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, *FP8_DEVICE_DTYPES)
# Floor for the scale: a constant group gets the smallest scale and q = 0.
_SCALE_FLOOR = torch.finfo(torch.float32).tiny


def value_group_size(dim: int) -> int:
    """Channels per value (and per-token key) group for a head of ``dim``."""
    for group in (64, 32):
        if dim % group == 0:
            return group
    return dim


def keys_per_channel(unit_tokens: int) -> bool:
    """Whether keys of a unit of ``unit_tokens`` tokens use per-channel groups."""
    return unit_tokens >= K_CHANNEL_MIN_TOKENS


def _check_input(x: torch.Tensor, name: str = "x") -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"kv_int4_codec: unsupported {name} dtype {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"kv_int4_codec: need {name} of shape [..., dim] with an even dim, "
            f"got {tuple(x.shape)}"
        )


def _check_units(x: torch.Tensor, name: str) -> None:
    _check_input(x, name)
    if x.dim() != 4:
        raise ValueError(
            f"kv_int4_codec: need {name} of shape [units, unit_tokens, heads, dim], "
            f"got {tuple(x.shape)}"
        )


def _check_out(t: torch.Tensor, dtype: torch.dtype, shape, name: str) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name} must be {dtype} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}"
        )


# --- packing ---------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (any integer dtype, [..., D], D even) -> uint8 [..., D/2],
    even channel in the low nibble."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> codes uint8 [..., D] (inverse of pack_int4)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    low, high = packed & 15, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# --- one set of groups: reference ------------------------------------------
# ``xg`` holds the groups along ``dim``; meta has xg's shape without ``dim``,
# plus a trailing (s, m) axis.


def _encode_groups_reference(
    xg: torch.Tensor, dim: int, qmax: int = QMAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step by step: the fast path and the kernels must match it bit for bit.
    qmax: the largest code (15; int8c's 8-bit keys pass 255)."""
    xf = xg.to(torch.float32)
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    # A zero m is +0 (x + 0.0): min(-0, +0) may return either zero.
    m16 = lo.to(META_DTYPE) + 0.0
    s32 = (hi - m16.to(torch.float32)) / torch.full(
        (), qmax, dtype=torch.float32, device=xf.device
    )
    s32 = torch.where(s32 < _SCALE_FLOOR, torch.full_like(s32, _SCALE_FLOOR), s32)
    s16 = s32.to(META_DTYPE)
    next_up = (s16.view(torch.int16) + 1).view(META_DTYPE)
    s16 = torch.where(s16.to(torch.float32) < s32, next_up, s16)
    bad = ~(torch.isfinite(m16) & torch.isfinite(s16))
    nan = torch.full_like(s16, float("nan"))
    s16 = torch.where(bad, nan, s16)
    m16 = torch.where(bad, nan, m16)

    quotient = (xf - m16.to(torch.float32)) / s16.to(torch.float32)
    qf = torch.round(quotient).clamp(0, qmax)
    qf = torch.where(bad, torch.zeros_like(qf), qf)
    meta = torch.stack((s16.squeeze(dim), m16.squeeze(dim)), dim=-1)
    return qf.to(torch.uint8), meta


def _decode_groups_reference(
    q: torch.Tensor, meta: torch.Tensor, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    s = meta[..., 0].to(torch.float32).unsqueeze(dim)
    m = meta[..., 1].to(torch.float32).unsqueeze(dim)
    xf = m + q.to(torch.float32) * s
    top = torch.finfo(dtype).max
    return xf.clamp(-top, top).to(dtype)


# --- one set of groups: fast path (in place, no host sync) -----------------


def _group_meta_into(
    lo: torch.Tensor,
    hi: torch.Tensor,
    meta_out: torch.Tensor,
    dim: int,
    qmax: int = QMAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per group -> fp32 (s, m) shaped like lo; writes meta_out.

    Both are NaN for groups that can't be encoded, so the quotient below is NaN
    there. Only touches per-group tensors.
    """
    m16 = lo.to(META_DTYPE).add_(0.0)  # a zero m is +0, as in the reference
    m32 = m16.to(torch.float32)
    # A tensor divisor, not a Python number: CUDA would turn the latter into a
    # multiplication by the reciprocal, which is not correctly rounded.
    s32 = (hi - m32).div_(torch.full((), qmax, dtype=torch.float32, device=lo.device))
    s32.clamp_min_(_SCALE_FLOOR)
    s16 = s32.to(META_DTYPE)
    # Round-to-nearest may have gone down; s16 > 0, so bits + 1 is the next
    # fp16 up (65504 -> Inf, caught below).
    s16.view(torch.int16).add_(s16.to(torch.float32) < s32)
    bad = ~(torch.isfinite(m16) & torch.isfinite(s16))
    s16.masked_fill_(bad, float("nan"))
    m16.masked_fill_(bad, float("nan"))
    meta_out[..., 0].copy_(s16.squeeze(dim))
    meta_out[..., 1].copy_(m16.squeeze(dim))
    return s16.to(torch.float32), m32.masked_fill_(bad, float("nan"))


def _encode_groups_into(
    xf: torch.Tensor, dim: int, meta_out: torch.Tensor, qmax: int = QMAX
) -> torch.Tensor:
    """Quantize the fp32 groups of xf in place to codes 0..qmax (still fp32).

    Returns max |x| per group (fp32, meta's shape without (s, m)).
    """
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    s, m = _group_meta_into(lo, hi, meta_out, dim, qmax)
    # Finite groups have 0 <= (x - m)/s <= qmax up to rounding; a NaN-meta group
    # is NaN throughout, so nan_to_num_ zeroes exactly the groups the
    # reference masks.
    xf.sub_(m).div_(s).round_().clamp_(0, qmax).nan_to_num_(nan=0.0)
    return torch.maximum(hi, lo.neg_()).squeeze(dim)


def _pack_into(qf: torch.Tensor, packed_out: torch.Tensor) -> None:
    """fp32 codes [..., D] -> packed_out uint8 [..., D/2]; clobbers qf."""
    even, odd = qf[..., 0::2], qf[..., 1::2]
    # q_even + 16 q_odd <= 255 is exact in fp32, so one float->uint8 copy packs
    # without an integer temporary.
    packed_out.copy_(odd.mul_(16).add_(even))


def _unpack_float(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> fp32 codes [..., D]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    qf = torch.empty(
        (*packed.shape[:-1], 2 * packed.shape[-1]),
        dtype=torch.float32,
        device=packed.device,
    )
    # Nibbles by fp32 arithmetic in place (exact for 0..255), so no integer
    # temporaries: high = floor(byte / 16), low = byte - 16 * high.
    even, odd = qf[..., 0::2], qf[..., 1::2]
    odd.copy_(packed).div_(16).floor_()
    even.copy_(packed).add_(odd, alpha=-16)
    return qf


def _decode_groups_into(
    qf: torch.Tensor, meta: torch.Tensor, dim: int, out: torch.Tensor
) -> None:
    """fp32 codes (groups along dim) -> out, same bits as the reference: q*s is
    exact in fp32, so m + q*s rounds once, then once more into out."""
    qf.mul_(meta[..., 0].to(torch.float32).unsqueeze(dim))
    qf.add_(meta[..., 1].to(torch.float32).unsqueeze(dim))
    if out.dtype != torch.float32:
        top = torch.finfo(out.dtype).max
        qf.clamp_(-top, top)
    out.copy_(qf)


# --- per-token groups (values; keys of small units) ------------------------


def _token_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"dim {x.shape[-1]} is not a multiple of group {group}")
    return x.unflatten(-1, (x.shape[-1] // group, group))


def encode_tokens_reference(
    x: torch.Tensor, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed uint8 [..., D/2], meta fp16 [..., D/G, 2]),
    groups of G = ``group`` (default value_group_size(D)) channels per token."""
    _check_input(x)
    group = group or value_group_size(x.shape[-1])
    q, meta = _encode_groups_reference(_token_groups(x, group), -1)
    return pack_int4(q.flatten(-2)), meta


def encode_tokens_into(
    x: torch.Tensor, packed_out: torch.Tensor, meta_out: torch.Tensor
) -> torch.Tensor:
    """Encode x [..., D] into packed_out (uint8 [..., D/2]) and meta_out
    (fp16 [..., D/G, 2]); G is D / meta_out.shape[-2]. Bit-identical to
    encode_tokens_reference; outputs may be strided views; no host sync.

    Returns max |x| per group (fp32 [..., D/G]; NaN for groups holding NaN).
    """
    _check_input(x)
    d = x.shape[-1]
    _check_out(packed_out, torch.uint8, (*x.shape[:-1], d // 2), "packed_out")
    n_groups = meta_out.shape[-2] if meta_out.dim() >= 2 else 0
    if n_groups == 0 or d % n_groups:
        raise ValueError(f"meta_out {tuple(meta_out.shape)} doesn't group dim {d}")
    _check_out(meta_out, META_DTYPE, (*x.shape[:-1], n_groups, 2), "meta_out")
    # The one full-size temporary: x widened to fp32 (exact); copy=True so an
    # fp32 x is never modified in place.
    xf = x.to(torch.float32, copy=True)
    amax = _encode_groups_into(_token_groups(xf, d // n_groups), -1, meta_out)
    _pack_into(xf, packed_out)
    return amax


def decode_tokens_reference(
    packed: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(packed [..., D/2], meta [..., D/G, 2]) -> x^ [..., D] of ``dtype``."""
    q = unpack_int4(packed)
    group = q.shape[-1] // meta.shape[-2]
    return _decode_groups_reference(_token_groups(q, group), meta, -1, dtype).flatten(
        -2
    )


def decode_tokens_into(
    packed: torch.Tensor, meta: torch.Tensor, out: torch.Tensor
) -> None:
    """Decode into out ([..., D], floating point); bit-identical to
    decode_tokens_reference."""
    _check_decode_out(packed, out)
    qf = _unpack_float(packed)
    group = qf.shape[-1] // meta.shape[-2]
    _decode_groups_into(
        _token_groups(qf, group), meta, -1, out.unflatten(-1, (-1, group))
    )


def _check_decode_out(packed: torch.Tensor, out: torch.Tensor) -> None:
    shape = (*packed.shape[:-1], 2 * packed.shape[-1])
    if tuple(out.shape) != shape or not out.dtype.is_floating_point:
        raise ValueError(
            f"out must be floating-point {shape}, got {out.dtype} {tuple(out.shape)}"
        )


# --- per-channel groups (keys of units of >= K_CHANNEL_MIN_TOKENS tokens) --
# x is [units, unit_tokens, heads, D]; a group is one (unit, head, channel).


def encode_channels_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, T, H, D] -> (packed uint8 [n, T, H, D/2], meta fp16 [n, H, D, 2])."""
    _check_units(x, "x")
    q, meta = _encode_groups_reference(x, 1)
    return pack_int4(q), meta


def encode_channels_into(
    x: torch.Tensor, packed_out: torch.Tensor, meta_out: torch.Tensor
) -> torch.Tensor:
    """Encode x [n, T, H, D] into packed_out (uint8 [n, T, H, D/2]) and
    meta_out (fp16 [n, H, D, 2]); bit-identical to encode_channels_reference,
    no host sync. Returns max |x| per group (fp32 [n, H, D])."""
    _check_units(x, "x")
    n, t, h, d = x.shape
    _check_out(packed_out, torch.uint8, (n, t, h, d // 2), "packed_out")
    _check_out(meta_out, META_DTYPE, (n, h, d, 2), "meta_out")
    xf = x.to(torch.float32, copy=True)
    amax = _encode_groups_into(xf, 1, meta_out)
    _pack_into(xf, packed_out)
    return amax


def decode_channels_reference(
    packed: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(packed [n, T, H, D/2], meta [n, H, D, 2]) -> x^ [n, T, H, D]."""
    return _decode_groups_reference(unpack_int4(packed), meta, 1, dtype)


def decode_channels_into(
    packed: torch.Tensor, meta: torch.Tensor, out: torch.Tensor
) -> None:
    """Decode into out [n, T, H, D]; bit-identical to decode_channels_reference."""
    _check_decode_out(packed, out)
    _decode_groups_into(_unpack_float(packed), meta, 1, out)


# --- statistics and the error bound ----------------------------------------


def count_nonfinite_groups(meta: torch.Tensor) -> torch.Tensor:
    """Groups stored non-finite (NaN meta), as a 0-dim int64 tensor on meta's
    device; no host sync."""
    return torch.count_nonzero(torch.isnan(meta[..., 0]))


def finite_amax(amax: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Largest group amax over the groups stored finite, 0 if none (0-dim
    fp32; amax has meta's shape without the (s, m) axis)."""
    kept = torch.where(torch.isnan(meta[..., 0]), 0.0, amax)
    return kept.amax() if kept.numel() else kept.new_zeros(())


def _error_bound(
    s: torch.Tensor, m: torch.Tensor, restored: torch.Tensor
) -> torch.Tensor:
    """max(s/2, half_ulp_fp16(m)) + half_ulp_fp32(x^) + half_ulp_out(x^), fp32,
    rounded up; s and m broadcast to restored."""
    s, m = torch.broadcast_tensors(s.to(torch.float32), m, restored)[:2]
    quant = torch.maximum(s / 2, half_ulp(m, META_DTYPE))
    bound = add_round_up(quant, half_ulp(restored, torch.float32))
    bound = add_round_up(bound, half_ulp(restored, restored.dtype))
    return torch.where(torch.isnan(restored) | torch.isnan(s), restored.float(), bound)


def error_bound_tokens(meta: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |x - x^| for per-token groups (module docstring);
    restored [..., D], meta [..., D/G, 2]. NaN for non-finite groups."""
    group = restored.shape[-1] // meta.shape[-2]
    r = _token_groups(restored, group)
    s, m = meta[..., 0].unsqueeze(-1), meta[..., 1].unsqueeze(-1)
    return _error_bound(s, m, r).flatten(-2)


def error_bound_channels(meta: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |x - x^| for per-channel groups; restored
    [n, T, H, D], meta [n, H, D, 2]."""
    s, m = meta[..., 0].unsqueeze(1), meta[..., 1].unsqueeze(1)
    return _error_bound(s, m, restored)


# --- the records of the int4 and k8v4 host formats --------------------------
# k, v: [units, unit_tokens, heads, dim]; every record is [units, *shape].


def int4_record_shapes(
    dims: tuple[int, int], head_num: int, unit_tokens: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-unit (shape, dtype) of each int4 record, in L3 byte order."""
    dk, dv = dims
    if keys_per_channel(unit_tokens):
        k_meta = (head_num, dk, 2)
    else:
        k_meta = (unit_tokens, head_num, dk // value_group_size(dk), 2)
    return {
        "k": ((unit_tokens, head_num, dk // 2), torch.uint8),
        "k_meta": (k_meta, META_DTYPE),
        "v": ((unit_tokens, head_num, dv // 2), torch.uint8),
        "v_meta": ((unit_tokens, head_num, dv // value_group_size(dv), 2), META_DTYPE),
    }


def k8v4_record_shapes(
    dims: tuple[int, int], head_num: int, unit_tokens: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-unit (shape, dtype) of each k8v4 record, in L3 byte order."""
    dk, dv = dims
    return {
        "k": ((unit_tokens, head_num, dk), torch.int8),
        "k_scale": ((unit_tokens, head_num), kv_int8_codec.SCALE_DTYPE),
        "v": ((unit_tokens, head_num, dv // 2), torch.uint8),
        "v_meta": ((unit_tokens, head_num, dv // value_group_size(dv), 2), META_DTYPE),
    }


def _encode_keys_reference(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if keys_per_channel(k.shape[1]):
        return encode_channels_reference(k)
    return encode_tokens_reference(k)


def int4_encode_reference(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    _check_units(k, "k")
    _check_units(v, "v")
    k_q, k_meta = _encode_keys_reference(k)
    v_q, v_meta = encode_tokens_reference(v)
    return {"k": k_q, "k_meta": k_meta, "v": v_q, "v_meta": v_meta}


def k8v4_encode_reference(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    _check_units(k, "k")
    _check_units(v, "v")
    k_q, k_scale = kv_int8_codec.quantize_reference(k)
    v_q, v_meta = encode_tokens_reference(v)
    return {"k": k_q, "k_scale": k_scale, "v": v_q, "v_meta": v_meta}


def int4_decode_reference(
    records: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    k_meta = records["k_meta"]
    if k_meta.dim() == 4:  # [n, H, Dk, 2]: per channel
        k = decode_channels_reference(records["k"], k_meta, dtype)
    else:
        k = decode_tokens_reference(records["k"], k_meta, dtype)
    return k, decode_tokens_reference(records["v"], records["v_meta"], dtype)


def k8v4_decode_reference(
    records: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    k = kv_int8_codec.dequantize_reference(records["k"], records["k_scale"], dtype)
    return k, decode_tokens_reference(records["v"], records["v_meta"], dtype)


def int4_encode_into(
    k: torch.Tensor, v: torch.Tensor, out: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast int4 encode into out's records (strided views allowed), no host
    sync. Returns (amax fp32 [2]: largest max |x| over the finite groups of
    k and v, nonfinite: 0-dim int64 groups stored non-finite)."""
    _check_units(k, "k")
    if keys_per_channel(k.shape[1]):
        k_amax = encode_channels_into(k, out["k"], out["k_meta"])
    else:
        k_amax = encode_tokens_into(k, out["k"], out["k_meta"])
    v_amax = encode_tokens_into(v, out["v"], out["v_meta"])
    amax = torch.stack(
        (finite_amax(k_amax, out["k_meta"]), finite_amax(v_amax, out["v_meta"]))
    )
    nonfinite = count_nonfinite_groups(out["k_meta"]) + count_nonfinite_groups(
        out["v_meta"]
    )
    return amax, nonfinite


def k8v4_encode_into(
    k: torch.Tensor, v: torch.Tensor, out: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast k8v4 encode; returns (amax [2], nonfinite) as int4_encode_into,
    a key row counting as one group."""
    _check_units(k, "k")
    k_scale = out["k_scale"]
    k_amax = kv_int8_codec.quantize_into(k, out["k"], k_scale)
    k_amax = torch.where(torch.isfinite(k_scale), k_amax, 0.0)
    v_amax = encode_tokens_into(v, out["v"], out["v_meta"])
    amax = torch.stack(
        (
            k_amax.amax() if k_amax.numel() else k_amax.new_zeros(()),
            finite_amax(v_amax, out["v_meta"]),
        )
    )
    nonfinite = kv_int8_codec.count_nonfinite_rows(k_scale) + count_nonfinite_groups(
        out["v_meta"]
    )
    return amax, nonfinite


def int4_decode_into(
    records: Mapping[str, torch.Tensor], k_out: torch.Tensor, v_out: torch.Tensor
) -> None:
    k_meta = records["k_meta"]
    if k_meta.dim() == 4:
        decode_channels_into(records["k"], k_meta, k_out)
    else:
        decode_tokens_into(records["k"], k_meta, k_out)
    decode_tokens_into(records["v"], records["v_meta"], v_out)


def k8v4_decode_into(
    records: Mapping[str, torch.Tensor], k_out: torch.Tensor, v_out: torch.Tensor
) -> None:
    kv_int8_codec.dequantize_into(records["k"], records["k_scale"], k_out)
    decode_tokens_into(records["v"], records["v_meta"], v_out)


# --- the host formats (pool_host/host_format.py) ---------------------------


class _Codec(NamedTuple):
    """A format's module-level functions (above) that its methods call."""

    encode_reference: Callable
    decode_reference: Callable
    encode_into: Callable
    decode_into: Callable


class _Int4ValuesHostFormat(HostKVFormat):
    """What int4 and k8v4 share: sides K and V, INT4 values, fused kernels in
    sglang.kernels.ops.kvcache.kv_int4_triton, one zero-copy object per side."""

    sides = ("k", "v")
    # FP8 values are exact in fp32 and restore rounded to the same FP8 dtype,
    # on the torch path and in the fused kernels alike.
    fp8_device_kv = True
    kernel_module = "sglang.kernels.ops.kvcache.kv_int4_triton"
    # 4-bit groups: s/2 <= amax (2 + 2^-11)(1 + 2^-10)/30 (docs/operations.md); k8v4
    # keys stay under int8's 0.004, rotated formats are checked rotated.
    relative_error_threshold = 0.068
    _codec: ClassVar[_Codec]

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        odd = [d for d in self._even_dims() if d % 2]
        if odd:
            raise NotImplementedError(
                f"--hicache-host-dtype {self.name} packs two 4-bit codes per byte "
                f"and needs even head dims; got {self.dims}. Use "
                "--hicache-host-dtype int8."
            )
        self.records = tuple(
            HostRecord(name, shape, dtype)
            for name, (shape, dtype) in self._record_shapes().items()
        )

    def _int4_dims(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _even_dims(self) -> tuple[int, ...]:
        """Head dims the codec needs even (the packed 4-bit sides)."""
        return self._int4_dims()

    def _record_shapes(self) -> dict:
        raise NotImplementedError

    def encode_reference(self, rows):
        return self._codec.encode_reference(*rows)

    def decode_reference(self, records, dtype):
        return self._codec.decode_reference(records, dtype)

    def encode_into(self, rows, out) -> EncodeStats:
        return EncodeStats(*self._codec.encode_into(*rows, out))

    def decode_into(self, records, out) -> None:
        self._codec.decode_into(records, *out)

    def _values_description(self) -> str:
        dv = self.dims[1]
        return f"values per token in groups of {value_group_size(dv)} channels"

    def zero_copy_objects(self):
        # One object per side, as a BF16 page has (_k and _v): payload, then
        # its metadata.
        k, k_meta, v, v_meta = self.records
        return [
            [(k.name, 0, k.nbytes), (k_meta.name, 0, k_meta.nbytes)],
            [(v.name, 0, v.nbytes), (v_meta.name, 0, v_meta.nbytes)],
        ]


class Int4HostFormat(_Int4ValuesHostFormat):
    """--hicache-host-dtype int4: keys per channel over a unit of at least
    K_CHANNEL_MIN_TOKENS tokens (else per token), values per token.

    Records per unit and layer: "k" uint8 [ut, H, Dk/2]; "k_meta" fp16
    [H, Dk, 2] per channel or [ut, H, Dk/G, 2] per token; "v" uint8
    [ut, H, Dv/2]; "v_meta" fp16 [ut, H, Dv/G, 2].
    """

    name = "int4"
    storage_format_tag = "int4-fp16meta-v1"
    # Its 4-bit keys lose most on the attention sinks (sink_page.py).
    sink_page = True
    _codec = _Codec(
        int4_encode_reference,
        int4_decode_reference,
        int4_encode_into,
        int4_decode_into,
    )

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        self.keys_per_channel = keys_per_channel(self.unit_tokens)
        # Per-channel and per-token key metadata can have the same size (64
        # tokens, 64-channel groups): the tag keeps L3 pages of one from being
        # read as the other.
        grouping = "kchannel" if self.keys_per_channel else "ktoken"
        self.storage_format_tag = f"{type(self).storage_format_tag}-{grouping}"

    def _int4_dims(self):
        return self.dims

    def _record_shapes(self):
        return int4_record_shapes(self.dims, self.head_num, self.unit_tokens)

    def describe(self) -> str:
        if self.keys_per_channel:
            keys = f"keys per channel over {self.unit_tokens}-token pages"
        else:
            dk = self.dims[0]
            keys = (
                f"keys per token in groups of {value_group_size(dk)} channels: "
                f"{self.unit_tokens} token(s) per host unit < "
                f"{K_CHANNEL_MIN_TOKENS} (page_size < {K_CHANNEL_MIN_TOKENS} "
                "or layer_first)"
            )
        return f"{super().describe()}; {keys}, {self._values_description()}"

    def error_bound(self, records, restored):
        k, v = restored
        if self.keys_per_channel:
            k_bound = error_bound_channels(records["k_meta"], k)
        else:
            k_bound = error_bound_tokens(records["k_meta"], k)
        return k_bound, error_bound_tokens(records["v_meta"], v)


class K8V4HostFormat(_Int4ValuesHostFormat):
    """--hicache-host-dtype k8v4: keys as int8 (kv_int8_codec), values as int4.

    Records per unit and layer: "k" int8 [ut, H, Dk]; "k_scale" fp16 [ut, H];
    "v" uint8 [ut, H, Dv/2]; "v_meta" fp16 [ut, H, Dv/G, 2].
    """

    name = "k8v4"
    storage_format_tag = "k8v4-fp16meta-v1"
    _codec = _Codec(
        k8v4_encode_reference,
        k8v4_decode_reference,
        k8v4_encode_into,
        k8v4_decode_into,
    )

    def _int4_dims(self):
        return self.dims[1:]

    def _even_dims(self):
        # The k8v4 codec checks its int8 keys with the same even-width rule.
        return self.dims

    def _record_shapes(self):
        return k8v4_record_shapes(self.dims, self.head_num, self.unit_tokens)

    def describe(self) -> str:
        return (
            f"{super().describe()}; keys as int8 per token and head, "
            f"{self._values_description()}"
        )

    def error_bound(self, records, restored):
        k, v = restored
        return (
            kv_int8_codec.error_bound(records["k_scale"], k),
            error_bound_tokens(records["v_meta"], v),
        )
