"""Codec test inputs shared by the codec and kernel tests: rows of chosen
kinds and magnitudes, hand-picked edge rows, and a bit-exact comparison."""

from __future__ import annotations

import math

import torch

DTYPES = (torch.bfloat16, torch.float16)
FP16_MAX = 65504.0
NAN = float("nan")
INF = float("inf")
# Smallest/largest row magnitude (log2) per input dtype: from the dtype's
# subnormals up to past the fp16-scale guard (127 * 65504 ~= 2**23) for bf16.
LOG2_RANGE = {torch.bfloat16: (-140, 30), torch.float16: (-27, 16)}


def round_half_even(v: float) -> int:
    """Nearest integer, ties to the even neighbour (spelled out, not torch)."""
    lo = math.floor(v)
    if v - lo != 0.5:
        return lo + (v - lo > 0.5)
    return lo if lo % 2 == 0 else lo + 1


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor, so torch.equal compares bits."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    return t.view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Identical dtype/shape, identical NaN positions, identical bits elsewhere
    (NaN payloads may differ between kernels, positions may not)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.is_floating_point:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b)
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    assert torch.equal(int_view(a.contiguous()), int_view(b.contiguous()))


def make_rows(
    seed: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kinds: list[str],
    log2_mags: list[float],
) -> torch.Tensor:
    """Rows of the given kinds and magnitudes; kinds/mags cycle over rows."""
    g = torch.Generator().manual_seed(seed)
    *lead, d = shape
    n = math.prod(lead)
    rows = torch.empty(n, d, dtype=torch.float64)
    for i in range(n):
        kind, mag = kinds[i % len(kinds)], 2.0 ** log2_mags[i % len(log2_mags)]
        if kind == "gauss":
            rows[i] = torch.randn(d, generator=g, dtype=torch.float64) * mag
        elif kind == "heavy":  # z / sqrt(u): heavy tails, rare 1000x outliers
            z = torch.randn(d, generator=g, dtype=torch.float64)
            u = torch.rand(d, generator=g, dtype=torch.float64).clamp_min(1e-6)
            rows[i] = z / u.sqrt() * mag
        elif kind == "spike":  # one outlier channel, rest small
            rows[i] = torch.randn(d, generator=g, dtype=torch.float64) * mag * 1e-3
            rows[i, int(torch.randint(d, (1,), generator=g))] = mag
        elif kind == "zero":
            rows[i] = 0.0
        else:
            raise AssertionError(kind)
    # Values past the dtype's range become +-Inf here, which is a valid
    # (non-finite) input row.
    return rows.reshape(shape).to(dtype)


# make_units' kinds: make_rows' and the group-shaped ones of the 4-bit codecs.
UNIT_KINDS = ("gauss", "heavy", "spike", "zero", "const", "outlier_channel", "shifted")


def make_units(seed, shape, dtype, kinds, log2_mags) -> torch.Tensor:
    """[n, T, H, D] rows (one per token and head) of the given kinds and
    magnitudes, cycled over rows."""
    g = torch.Generator().manual_seed(seed)
    *lead, d = shape
    n = math.prod(lead)
    rows = torch.empty(n, d, dtype=torch.float64)
    outlier_channels = torch.randperm(d, generator=g)[:3]
    for i in range(n):
        kind, mag = kinds[i % len(kinds)], 2.0 ** log2_mags[i % len(log2_mags)]
        z = torch.randn(d, generator=g, dtype=torch.float64)
        if kind == "gauss":
            rows[i] = z * mag
        elif kind == "heavy":  # z / sqrt(u): heavy tails
            u = torch.rand(d, generator=g, dtype=torch.float64).clamp_min(1e-6)
            rows[i] = z / u.sqrt() * mag
        elif kind == "spike":  # one outlier element
            rows[i] = z * mag * 1e-3
            rows[i, int(torch.randint(d, (1,), generator=g))] = mag
        elif kind == "zero":
            rows[i] = 0.0
        elif kind == "const":  # all-equal groups: m rounds, s hits its floor
            rows[i] = mag * (1 + float(torch.rand((), generator=g)))
        elif kind == "outlier_channel":  # fixed channels 30x larger (keys)
            rows[i] = z * mag / 30
            rows[i, outlier_channels] *= 30
        elif kind == "shifted":  # far from zero: the zero point matters
            rows[i] = mag + z * mag / 64
        else:
            raise AssertionError(kind)
    return rows.reshape(shape).to(dtype)


def special_rows(dtype: torch.dtype, d: int = 64) -> list[torch.Tensor]:
    """Hand-picked fp32 rows for dtype that stress rounding, ranges and specials."""
    info = torch.finfo(dtype)
    return [
        torch.zeros(d),
        -torch.zeros(d),
        torch.full((d,), float(info.smallest_normal)),
        torch.full((d,), float(info.smallest_normal) / 8),  # subnormal input
        torch.linspace(-1, 1, d),
        torch.arange(d) - (d / 2 - 0.5),  # half-integer quotients
        torch.full((d,), float(info.max)),
        torch.full((d,), -float(info.max)),
        torch.full((d,), 127 * FP16_MAX),  # the guard boundary, fp32 only exact
        torch.full((d,), 1e7),
        torch.full((d,), 3e38),
        torch.tensor([NAN] + [1.0] * (d - 1)),
        torch.tensor([INF] + [1.0] * (d - 1)),
        torch.tensor([1.0] * (d - 1) + [-INF]),
        torch.tensor([1e-3] * (d - 1) + [1e3]),
    ]


def edge_inputs() -> list[torch.Tensor]:
    """Hand-picked rows that stress rounding, ranges and specials."""
    out = []
    for dtype in DTYPES + (torch.float32,):
        rows = special_rows(dtype)
        out.append(torch.stack(rows).to(dtype))
    # fp32 scale boundary: exactly 127*65504 is finite, the next float isn't.
    edge = torch.tensor([127 * FP16_MAX, 127 * 65520.0], dtype=torch.float32)
    below = torch.nextafter(edge[:1], torch.tensor([0.0]))
    above = torch.nextafter(edge[:1], torch.tensor([INF]))
    out.append(torch.cat([edge, below, above]).unsqueeze(-1).expand(4, 8).clone())
    return out


def edge_rows(dtype: torch.dtype, d: int = 64) -> torch.Tensor:
    """special_rows plus exact .5 ties (the GPU tests' edge rows)."""
    rows = special_rows(dtype, d)
    for log2_s in (-24, -14, -3, 0, 5):
        k = torch.arange(-(d - 1) // 2, d // 2, dtype=torch.float64)[: d - 1] + 0.5
        rows.append(torch.cat([torch.tensor([127.0]), k]) * 2.0**log2_s)
    return torch.stack(rows).to(dtype)


def random_rows(seed: int, n: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """n rows of gaussian / heavy-tailed / spiky / zero data, magnitudes from
    the dtype's subnormals to past the fp16-scale guard."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-140, 30) if dtype == torch.bfloat16 else (-27, 16)
    mags = torch.exp2(
        lo + (hi - lo) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    )
    kind = torch.randint(0, 4, (n, 1), generator=g)
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    u = torch.rand(n, d, generator=g, dtype=torch.float64).clamp_min(1e-6)
    heavy = z / u.sqrt()
    spike = z * 1e-3
    spike[torch.arange(n), torch.randint(0, d, (n,), generator=g)] = 1.0
    x = torch.where(kind == 0, z, torch.where(kind == 1, heavy, spike))
    x = torch.where(kind == 3, torch.zeros_like(x), x) * mags
    return x.to(dtype)
