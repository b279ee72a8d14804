"""Walsh-Hadamard rotation of KV heads for the rotated host (L2) formats.

A rotated format (int4r, k8v4r) applies an orthogonal transform to each head
row of a side before its base format (int4, k8v4) encodes it, and undoes it
after decoding; attention only ever sees the restored BF16/FP16 rows. The
transform spreads outlier channels over the whole head, so 4-bit groups see a
flatter range.

Definition (per head row, fp32 throughout; every step is exact or one IEEE
add/sub, so the reference, the torch path and a kernel that keeps this order
give identical bits):

    B    = rotation_block(D): the largest power of two dividing D, at least
           MIN_BLOCK; 0 (no rotation) if there is none
    sign = rotation_signs(D): +-1 per channel from a fixed seed
    y    = H_B(sign * x) * 2**-log2(B)     (encode, per B-block)
    x^   = sign * H_B(y^)                  (decode)

``H_B`` is the unnormalized Sylvester Hadamard butterfly: for h = 1, 2, ...,
B/2, channels i and i + h of each 2h-block become (a + b, a - b). ``H_B H_B =
B I``, so decode inverts encode. The power-of-two scale is exact and keeps
every rotated value within the row's largest |x|, so a row whose range fits
the base format's FP16 metadata still fits after rotation (a 1/sqrt(B) scale
would overflow it for rows of large, aligned values).

Error: with e_j the base format's bound on |y_j - y^_j| in the rotated
domain, every channel of a block satisfies

    |x - x^| <= sum_j e_j + slack * sum_j (|y^_j| + e_j)
                + half_ulp_fp32(x^) + half_ulp_out(x^)

with slack = (log2(B) + 2) * B * 2**-22 covering fp32 rounding in both
butterflies and in the base format's quotient on fp32 input
(``rotated_error_bound``).

NaN/Inf: the butterfly spreads a non-finite value over its block (Inf - Inf
is NaN), so every group of the base format that holds a channel of that block
is stored non-finite and restores as NaN; decode spreads NaN back over the
block. A NaN or Inf therefore never comes back finite; it costs its whole
block of that token (and, for per-channel keys, of the page's tokens).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import ClassVar, Mapping, Sequence

import torch

from sglang.srt.mem_cache.pool_host.host_format import EncodeStats

logger = logging.getLogger(__name__)

# Blocks below this mix too few channels to flatten an outlier; such heads
# are stored unrotated (and say so at start-up).
MIN_BLOCK = 16
ROTATION_SEED = 0x48695143  # "HiQC"
_MASK64 = (1 << 64) - 1


def rotation_block(dim: int) -> int:
    """Channels per rotation block for a head of ``dim``; 0: not rotated."""
    block = dim & -dim
    return block if block >= MIN_BLOCK else 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@lru_cache(maxsize=None)
def _signs_list(dim: int) -> tuple[float, ...]:
    return tuple(
        -1.0 if _splitmix64(ROTATION_SEED + c) >> 63 else 1.0 for c in range(dim)
    )


def rotation_signs(dim: int, device=None) -> torch.Tensor:
    """fp32 [dim] of +-1: channel c's sign, a function of c alone (the same
    for every head, layer and side)."""
    return torch.tensor(_signs_list(dim), dtype=torch.float32, device=device)


def rotation_shift(block: int) -> int:
    """Encode scales by 2**-rotation_shift(B) = 1/B; decode does not scale."""
    return block.bit_length() - 1


def _check(x: torch.Tensor, block: int) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"kv_hadamard: rotate fp32 rows, got {x.dtype}")
    if block <= 0 or block & (block - 1) or x.shape[-1] % block:
        raise ValueError(
            f"kv_hadamard: block {block} is not a power of two dividing dim "
            f"{x.shape[-1]}"
        )


# --- reference: stage by stage, defines the rotation ------------------------


def _butterfly_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    y = x.unflatten(-1, (x.shape[-1] // block, block))
    h = 1
    while h < block:
        pairs = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y.flatten(-2)


def _pow2(shift: int, device) -> torch.Tensor:
    return torch.full((), 2.0**-shift, dtype=torch.float32, device=device)


def rotate_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 rows [..., D] -> rotated fp32 rows (encode side)."""
    _check(x, block)
    signs = rotation_signs(x.shape[-1], x.device)
    y = _butterfly_reference(x * signs, block)
    return y * _pow2(rotation_shift(block), x.device)


def unrotate_reference(y: torch.Tensor, block: int) -> torch.Tensor:
    """Rotated fp32 rows -> fp32 rows (decode side)."""
    _check(y, block)
    return _butterfly_reference(y, block) * rotation_signs(y.shape[-1], y.device)


# --- fast path: in place, one half-size temporary per stage -----------------


def _butterfly_(x: torch.Tensor, block: int) -> None:
    y = x.unflatten(-1, (x.shape[-1] // block, block))
    h = 1
    while h < block:
        pairs = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        a_old = a.clone()
        a.add_(b)
        # a - b itself, not -(b - a): x - x is +0 either way round.
        torch.sub(a_old, b, out=b)
        h *= 2


def rotate_(x: torch.Tensor, block: int) -> torch.Tensor:
    """rotate_reference in place on a contiguous fp32 tensor; returns x."""
    _check(x, block)
    if not x.is_contiguous():
        raise ValueError("kv_hadamard: rotate_ needs a contiguous tensor")
    x.mul_(rotation_signs(x.shape[-1], x.device))
    _butterfly_(x, block)
    return x.mul_(_pow2(rotation_shift(block), x.device))


def unrotate_(y: torch.Tensor, block: int) -> torch.Tensor:
    """unrotate_reference in place on a contiguous fp32 tensor; returns y."""
    _check(y, block)
    if not y.is_contiguous():
        raise ValueError("kv_hadamard: unrotate_ needs a contiguous tensor")
    _butterfly_(y, block)
    return y.mul_(rotation_signs(y.shape[-1], y.device))


# --- the error bound --------------------------------------------------------


def _next_up_fp32(bound64: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest fp32 >= it (NaN/Inf kept)."""
    b32 = bound64.to(torch.float32)
    up = torch.nextafter(b32, torch.full_like(b32, float("inf")))
    return torch.where(b32.to(torch.float64) < bound64, up, b32)


def rotated_error_bound(
    rotated_restored: torch.Tensor,
    rotated_bound: torch.Tensor,
    restored: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Elementwise fp32 bound on |x - x^| (module docstring) from the base
    format's decoded rotated rows y^ (fp32), its bound e on them, and the
    restored rows x^; NaN where the block holds a non-finite group."""
    from sglang.srt.mem_cache.pool_host.host_format import half_ulp

    log2 = block.bit_length() - 1
    slack = (log2 + 2) * block * 2.0**-22
    y = rotated_restored.to(torch.float64).unflatten(-1, (-1, block))
    e = rotated_bound.to(torch.float64).unflatten(-1, (-1, block))
    err_sum = e.sum(-1, keepdim=True)
    mag_sum = (y.abs() + e).sum(-1, keepdim=True)
    bound = (err_sum + slack * mag_sum).expand_as(y).flatten(-2)
    bound = bound + half_ulp(restored.float(), torch.float32).to(torch.float64)
    bound = bound + half_ulp(restored.float(), restored.dtype).to(torch.float64)
    bound = _next_up_fp32(bound)
    bad = torch.isnan(restored) | torch.isnan(bound)
    return torch.where(bad, torch.full_like(bound, float("nan")), bound)


# --- the format mixin -------------------------------------------------------


class RotatedHostFormatMixin:
    """Rotation around a base HostKVFormat (mix in before it): sides named in
    `rotated_sides` are rotated before the base format encodes them and
    unrotated after it decodes them; records, sizes and L3 objects are the
    base format's. The base format's fused kernels rotate inside their tiles
    (kv_hadamard_triton)."""

    rotated_sides: ClassVar[tuple[str, ...]]
    # Base format's --hicache-host-dtype, for the log line.
    base_name: ClassVar[str]
    # Not measured or tested with FP8 device KV yet: refused at start-up.
    fp8_device_kv = False

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        # Per side: rotation block (0: stored unrotated).
        self.rotation_blocks = tuple(
            rotation_block(d) if side in self.rotated_sides else 0
            for side, d in zip(self.sides, self.dims)
        )
        # The tag names the block per side, so pages rotated another way
        # (or not at all) miss in L3 instead of decoding wrongly.
        blocks = "-".join(
            f"{side}{b or 'x'}"
            for side, b in zip(self.sides, self.rotation_blocks)
            if side in self.rotated_sides
        )
        self.storage_format_tag = f"{self.storage_format_tag}-wht{blocks}"

    def rotation_description(self) -> str:
        parts, fallback = [], []
        for side, dim, block in zip(self.sides, self.dims, self.rotation_blocks):
            if side not in self.rotated_sides:
                continue
            if block == dim:
                parts.append(f"{side} in one {block}-point block")
            elif block:
                parts.append(f"{side} in {dim // block} blocks of {block}")
            else:
                fallback.append(side)
                parts.append(
                    f"{side} NOT rotated (head dim {dim} has no power-of-two "
                    f"block of at least {MIN_BLOCK} channels; stored as "
                    f"{self.base_name})"
                )
        return "Walsh-Hadamard rotation per head (seeded sign flip): " + ", ".join(
            parts
        )

    def describe(self) -> str:
        text = f"{super().describe()}; {self.rotation_description()}"
        if any(
            side in self.rotated_sides and not block
            for side, block in zip(self.sides, self.rotation_blocks)
        ):
            logger.warning("--hicache-host-dtype %s: %s", self.name, text)
        return text

    def _check_rows(self, rows: Sequence[torch.Tensor]) -> None:
        for side, x in zip(self.sides, rows):
            if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise TypeError(
                    f"--hicache-host-dtype {self.name}: unsupported {side} dtype "
                    f"{x.dtype}"
                )

    # reference

    def encode_reference(self, rows):
        self._check_rows(rows)
        rotated = [
            rotate_reference(x.to(torch.float32), b) if b else x
            for x, b in zip(rows, self.rotation_blocks)
        ]
        return super().encode_reference(rotated)

    def decode_reference(self, records, dtype):
        decoded = super().decode_reference(records, torch.float32)
        out = []
        for y, b in zip(decoded, self.rotation_blocks):
            x = unrotate_reference(y, b) if b else y
            top = torch.finfo(dtype).max
            out.append(x.clamp(-top, top).to(dtype))
        return tuple(out)

    # torch path

    def encode_into(self, rows, out: Mapping[str, torch.Tensor]) -> EncodeStats:
        self._check_rows(rows)
        rotated = [
            rotate_(x.to(torch.float32, copy=True), b) if b else x
            for x, b in zip(rows, self.rotation_blocks)
        ]
        return super().encode_into(rotated, out)

    def decode_into(self, records, out) -> None:
        temps = [
            torch.empty(o.shape, dtype=torch.float32, device=o.device) if b else o
            for o, b in zip(out, self.rotation_blocks)
        ]
        super().decode_into(records, temps)
        for o, t, b in zip(out, temps, self.rotation_blocks):
            if not b:
                continue
            unrotate_(t, b)
            if o.dtype != torch.float32:
                top = torch.finfo(o.dtype).max
                t.clamp_(-top, top)
            o.copy_(t)

    def error_bound(self, records, restored):
        decoded = super().decode_reference(records, torch.float32)
        base_restored = [
            y if b else x for x, y, b in zip(restored, decoded, self.rotation_blocks)
        ]
        base_bounds = super().error_bound(records, base_restored)
        return tuple(
            rotated_error_bound(y, e, x, b) if b else e
            for x, y, e, b in zip(restored, decoded, base_bounds, self.rotation_blocks)
        )

    # kernels: the base format's, told the blocks and given the signs

    def _kernel_rotation(self, device) -> dict:
        """The kernels' rotation arguments for a transfer device."""
        cache = self.__dict__.setdefault("_signs_by_device", {})
        device = torch.device(device)
        if device not in cache:
            cache[device] = rotation_signs(max(self.dims), device)
        return {
            "rotation_blocks": self.rotation_blocks,
            "rotation_signs": cache[device],
        }

    def encode_gather(self, tables, device_indices, out, host_indices, **options):
        super().encode_gather(
            tables,
            device_indices,
            out,
            host_indices,
            **options,
            **self._kernel_rotation(tables[0].device),
        )

    def decode_scatter(self, records, host_indices, dst, device_indices, **counters):
        super().decode_scatter(
            records,
            host_indices,
            dst,
            device_indices,
            **counters,
            **self._kernel_rotation(dst[0].device),
        )
