"""An independent, step-by-step torch reading of the int4c spec's keys
(/docs: per channel over a unit, two-level metadata, 8-bit plan layers), for
tests/test_kv_int4c_codec.py to hold the codec's reference (and so, through
tests/test_host_kernels.py, the kernels) against. Test-only."""

from __future__ import annotations

import torch

FP16_NAN_BITS = 0x7E00


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32)


def _half(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.float16)


def fp16_down(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 <= x (NaN kept)."""
    h = x.to(torch.float16)
    up = h.float() > x
    step = torch.where(
        h.float() > 0, _bits(h) - 1, torch.where(h.float() == 0, -32767, _bits(h) + 1)
    )
    return torch.where(up, _half(step), h)


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """fp32 >= 0 -> the smallest fp16 >= x."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, _half(_bits(h) + 1), h)


def encode_keys(k: torch.Tensor, sub_tokens: int, key8: bool):
    """k [U, UT, H, D] -> (codes uint8 [U, UT, H, D] (0..15 or 0..255),
    k_range fp16 [U, H, D, 2], k_sub uint8 [U, UT/S, H, D], bad [U, H, D])."""
    U, UT, H, D = k.shape
    x = k.float()
    lo, hi = x.amin(1), x.amax(1)  # [U, H, D]
    L16 = fp16_down(lo) + 0.0  # a zero L is +0
    L = L16.float()
    R16 = fp16_up(hi - L) + 0.0  # R >= 0; -0 (hi = -0) is +0
    R = R16.float()
    bad = ~torch.isfinite(x).all(1) | ~torch.isfinite(L16) | ~torch.isfinite(R16)
    xs = x.view(U, UT // sub_tokens, sub_tokens, H, D)
    lo_j, hi_j = xs.amin(2), xs.amax(2)  # [U, NS, H, D]
    Lj, Rj = L[:, None], R[:, None]
    coded = (Rj > 0) & ~bad[:, None]
    a = torch.floor((lo_j - Lj) / Rj * 16).clamp(0, 15)
    a = torch.where(coded, a, torch.zeros_like(a))
    b = torch.ceil((hi_j - Lj) / Rj * 16)
    b = torch.minimum(torch.maximum(b, a + 1), torch.full_like(b, 16))
    b = torch.where(coded, b, torch.ones_like(b))
    levels = 255 if key8 else 15
    sub_lo = Lj + Rj * a / 16
    step = Rj * (b - a) / (16 * levels)
    q = torch.round((xs - sub_lo[:, :, None]) / step[:, :, None]).clamp(0, levels)
    q = torch.where(coded[:, :, None], q, torch.zeros_like(q))
    nan = _half(torch.tensor(FP16_NAN_BITS))
    rng = torch.stack((torch.where(bad, nan, L16), torch.where(bad, nan, R16)), -1)
    sub = (a.to(torch.int32) | ((b.to(torch.int32) - 1) << 4)).to(torch.uint8)
    return q.view(U, UT, H, D).to(torch.uint8), rng, sub, bad


def decode_keys(codes, rng, sub, dtype, key8: bool):
    """encode_keys' output -> keys [U, UT, H, D] of dtype: sub_lo + (q * w) /
    N, q * w exact."""
    U, UT, H, D = codes.shape
    ns = sub.shape[1]
    L, R = rng[..., 0].float()[:, None], rng[..., 1].float()[:, None]
    a = (sub & 15).float()
    b = (sub >> 4).float() + 1
    levels = 255 if key8 else 15
    sub_lo = L + R * a / 16
    w = R * (b - a)
    q = codes.float().view(U, ns, UT // ns, H, D)
    y = sub_lo[:, :, None] + (q * w[:, :, None]) / (16 * levels)
    top = torch.finfo(dtype).max
    return y.view(U, UT, H, D).clamp(-top, top).to(dtype)


def pack(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)
