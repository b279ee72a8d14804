"""The Walsh-Hadamard rotation of the rotated host (L2) formats (int4r, k8v4r)
inside the INT4/K8V4 kernels (kv_int4_triton): device functions applied to a
program's fp32 tile between its load and its group code, so rotating costs no
extra pass over memory.

The rotation is kv_hadamard's, step for step: per block of B channels the
unnormalized Sylvester butterfly in fp32, stages h = 1, 2, ..., B/2, channels
i and i + h of each 2h-block becoming (a + b, a - b), after the sign flip
(encode) or before it (decode), and encode's exact scale 2**-log2(B). Every
step is one IEEE add/sub or an exact multiply, in the same order, so the bits
equal the reference's (docs/kernels.md#rotated-formats).

A tile's channels must be laid out so that each B-block is B consecutive
elements of the tile in row-major order, starting at a multiple of B: rows of
a whole number of blocks (padding lanes only after the last block), or rows
of one group each when B/G consecutive rows are one head's B channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def butterfly(x, B: tl.constexpr):
    """H_B on every B-block of a tile (flattened row-major), same shape out."""
    N: tl.constexpr = x.numel
    y = tl.reshape(x, [N])
    # Blocks of up to 2**12 channels; the stages past log2(B) compile away.
    for s in tl.static_range(12):
        if (1 << s) < B:
            pairs = tl.reshape(y, [N // (2 << s), 2, 1 << s])
            a, b = tl.split(tl.permute(pairs, (0, 2, 1)))
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [N])
    return tl.reshape(y, x.shape)


@triton.jit
def rotate(x, signs, B: tl.constexpr):
    """Encode side: H_B(signs * x) * 2**-log2(B); signs broadcast to x."""
    return butterfly(x * signs, B) * (1.0 / B)


@triton.jit
def unrotate(y, signs, B: tl.constexpr):
    """Decode side: signs * H_B(y)."""
    return butterfly(y, B) * signs


# --- host side ----------------------------------------------------------------


def check_rotation(side: str, dim: int, block: int, signs, device) -> None:
    """A side rotated in blocks of `block` needs a power-of-two block dividing
    its head dim and an fp32 sign per channel on the transfer device."""
    if block == 0:
        return
    if block < 2 or block & (block - 1) or dim % block or block > 4096:
        raise ValueError(
            f"{side}: rotation block {block} is not a power of two (2..4096) "
            f"dividing head dim {dim}"
        )
    ok = (
        isinstance(signs, torch.Tensor)
        and signs.dtype == torch.float32
        and signs.dim() == 1
        and signs.numel() >= dim
        and signs.is_contiguous()
        and signs.device == torch.device(device)
    )
    if not ok:
        raise ValueError(
            f"{side}: rotation_signs must be a contiguous fp32 [>= {dim}] tensor "
            f"on {device} (kv_hadamard.rotation_signs), got "
            f"{None if signs is None else (signs.dtype, tuple(signs.shape), signs.device)}"
        )
