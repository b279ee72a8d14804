"""FP8 device KV for the tests: every kind of FP8 value as uint8-stored rows,
and an independent round-to-nearest-even over FP8's value grid."""

from __future__ import annotations

import torch

from tests.support.codec_inputs import assert_same_bits

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# A byte that is NaN in both FP8 formats.
FP8_NAN_BYTE = 0x7F


def fp8_id(dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


def finite_bytes(fp8: torch.dtype) -> torch.Tensor:
    """Every byte pattern that is a finite value of fp8 (subnormals, +-0 and
    the largest value included)."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    return torch.arange(256, dtype=torch.uint8)[torch.isfinite(values)]


def random_finite_fp8(shape, fp8: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random finite FP8 bytes, as fp8 values: groups that span the
    format's whole range, subnormals and zeros of both signs."""
    pool = finite_bytes(fp8)
    picks = torch.randint(0, len(pool), shape, generator=gen)
    return pool[picks].view(fp8)


def nearest_even_fp8(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Finite x (float64) -> the nearest finite fp8 value (float64), ties to
    the even code, saturating at the largest finite value: the rounding
    read off FP8's grid, independent of any conversion routine."""
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).double()
    grid = torch.unique(grid[torch.isfinite(grid)])  # sorted, one zero
    x = x.clamp(grid[0], grid[-1])
    hi = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    pick_hi = (hi_v - x) < (x - lo_v)
    tie = (hi_v - x) == (x - lo_v)
    hi_even = (hi_v.to(fp8).view(torch.uint8) & 1) == 0
    return torch.where(pick_hi | (tie & hi_even), hi_v, lo_v)


def assert_canonical_nan(t: torch.Tensor) -> None:
    """NaN groups restore as one NaN pattern per dtype (fp16 0x7E00, bf16
    0x7FC0, FP8 0x7F): torch's own arithmetic leaves the payload to the CPU's
    vector unit, the kernels do not."""
    if t.dtype in FP8:
        nan = torch.isnan(t.float())
        assert (t.view(torch.uint8)[nan] == FP8_NAN_BYTE).all()
        return
    canonical = 0x7E00 if t.dtype == torch.float16 else 0x7FC0
    assert (t.view(torch.int16)[torch.isnan(t)] == canonical).all()


def assert_restored(got: torch.Tensor, want: torch.Tensor) -> None:
    """assert_same_bits, FP8 included: the same NaN positions (a NaN's sign
    is the CPU's business on the torch path), the same bytes elsewhere."""
    if got.dtype not in FP8:
        assert_same_bits(got, want)
        return
    assert want.dtype == got.dtype and want.shape == got.shape
    nan = torch.isnan(got.float())
    assert torch.equal(nan, torch.isnan(want.float()))
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
