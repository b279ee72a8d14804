"""INT8 KV codec (pool_host/kv_int8_codec.py): the error bound, non-finite
rows, determinism, and fast path == reference bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from tests.support.codec_inputs import (
    DTYPES,
    FP16_MAX,
    INF,
    NAN,
    round_half_even,
    LOG2_RANGE,
    assert_same_bits,
    edge_inputs,
    make_rows,
)

HEAD_DIMS = (64, 96, 128, 256)

FAST = settings(max_examples=40, deadline=None)


def given_rows(dtypes=DTYPES, **strategies):
    """@FAST @given a seed, a head dim `d`, a `dtype` and `strategies`."""
    return lambda test: FAST(
        given(
            seed=st.integers(0, 2**31 - 1),
            d=st.sampled_from(HEAD_DIMS),
            dtype=st.sampled_from(dtypes),
            **strategies,
        )(test)
    )


# --- helpers ---------------------------------------------------------------


def fast_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.full(x.shape, 99, dtype=torch.int8)
    scale = torch.full(x.shape[:-1], -1.0, dtype=codec.SCALE_DTYPE)
    codec.quantize_into(x, q, scale)
    return q, scale


def fast_decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    out = torch.full(q.shape, -7.0, dtype=dtype)
    codec.dequantize_into(q, scale, out)
    return out


def row_amax64(x: torch.Tensor) -> torch.Tensor:
    return x.double().abs().amax(dim=-1)


def check_encoding(x: torch.Tensor, out_dtype: torch.dtype) -> None:
    """Everything the format promises, for one input."""
    q, scale = codec.quantize_reference(x)
    fq, fscale = fast_encode(x)
    assert_same_bits(fq, q)
    assert_same_bits(fscale, scale)
    restored = codec.dequantize_reference(q, scale, out_dtype)
    assert_same_bits(fast_decode(q, scale, out_dtype), restored)

    amax = row_amax64(x)
    a = amax / codec.QMAX
    s = scale.double()
    finite_in = torch.isfinite(x).all(dim=-1)
    # NaN exactly for non-finite inputs and rows whose scale exceeds fp16.
    expect_nan = ~finite_in | (a > FP16_MAX)
    assert torch.equal(torch.isnan(scale), expect_nan)
    assert int(codec.count_nonfinite_rows(scale)) == int(expect_nan.sum())
    assert torch.isnan(restored[expect_nan]).all()
    assert (q[expect_nan] == 0).all()

    ok = ~expect_nan
    # Scale: at least amax/127, at most one fp16 step above it.
    assert (s[ok] >= a[ok]).all()
    assert (s[ok] >= 2.0**-24).all()
    normal = ok & (a >= 2.0**-14)
    assert (s[normal] <= a[normal] * (1 + 2.0**-10)).all()
    sub = ok & (a < 2.0**-14)
    assert (s[sub] <= a[sub] + 2.0**-24).all()  # == only for the amax floor
    # q never clips: the unclamped rounded quotient already is q.
    unclamped = torch.round(x.float() / scale.float().unsqueeze(-1))
    assert torch.equal(unclamped[ok], q[ok].float())
    # The stated elementwise bound.
    err = (x.double() - restored.double()).abs()
    bound = codec.error_bound(scale, restored)
    assert bound.dtype == torch.float32
    assert (err[ok] <= bound[ok].double()).all()
    # All-zero rows come back as exact zeros.
    zero_rows = (amax == 0) & ok
    assert (restored[zero_rows] == 0).all()


# --- property tests --------------------------------------------------------

lead_shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@given_rows(
    lead=lead_shapes,
    out_dtype=st.sampled_from((None, torch.float32)),
    kinds=st.lists(
        st.sampled_from(("gauss", "heavy", "spike", "zero")), min_size=1, max_size=4
    ),
    mag_frac=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
)
def test_bound_and_format_hold(seed, lead, d, dtype, out_dtype, kinds, mag_frac):
    lo, hi = LOG2_RANGE[dtype]
    mags = [lo + f * (hi - lo) for f in mag_frac]
    x = make_rows(seed, (*lead, d), dtype, kinds, mags)
    check_encoding(x, out_dtype or dtype)


@given_rows(
    rows=st.integers(1, 12),
    log2_s=st.integers(-24, 8),
    mantissa=st.sampled_from((1.0, 1.25, 1.5, 1.75)),
)
def test_exact_grid_restores_exactly(seed, rows, d, dtype, log2_s, mantissa):
    """x = k*s with max |k| = 127 encodes to q = k, scale = s, decodes to x."""
    if dtype == torch.bfloat16:
        mantissa = 1.0  # k*s must fit bf16's 8 bits: 7-bit k, power-of-2 s
    s = mantissa * 2.0**log2_s
    if log2_s < -14:
        s = 2.0**log2_s  # fp16 subnormal scales are powers of two here
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-127, 128, (rows, d), generator=g)
    k[:, 0] = torch.where(torch.rand(rows, generator=g) < 0.5, 127, -127)
    k = k[:, torch.randperm(d, generator=g)]
    x = (k.double() * s).to(dtype)
    assert torch.equal(x.double(), k.double() * s)  # the grid is representable
    q, scale = codec.quantize_reference(x)
    assert torch.equal(q, k.to(torch.int8))
    assert (scale.double() == s).all()
    for out_dtype in (dtype, torch.float32):
        assert torch.equal(fast_decode(q, scale, out_dtype).double(), x.double())
    check_encoding(x, dtype)


@given_rows(
    rows=st.integers(1, 16),
    bad=st.lists(
        st.tuples(
            st.integers(0, 15), st.integers(0, 255), st.sampled_from((NAN, INF, -INF))
        ),
        max_size=6,
    ),
)
def test_nonfinite_poison_only_their_row(seed, rows, d, dtype, bad):
    g = torch.Generator().manual_seed(seed)
    clean = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    x = clean.clone()
    bad_rows = set()
    for r, c, v in bad:
        if r < rows:
            x[r, c % d] = v
            bad_rows.add(r)
    q, scale = codec.quantize_reference(x)
    restored = codec.dequantize_reference(q, scale, dtype)
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[list(bad_rows)] = True
    assert torch.isnan(restored[mask]).all()
    assert (q[mask] == 0).all()
    assert int(codec.count_nonfinite_rows(scale)) == len(bad_rows)
    # Other rows: byte-identical to encoding the clean rows alone.
    cq, cscale = codec.quantize_reference(clean[~mask])
    assert_same_bits(q[~mask], cq)
    assert_same_bits(scale[~mask], cscale)
    assert torch.isfinite(restored[~mask]).all()
    check_encoding(x, dtype)


# --- edge cases ------------------------------------------------------------


@pytest.mark.parametrize("case", range(len(edge_inputs())))
def test_edge_inputs_fast_matches_reference(case):
    x = edge_inputs()[case]
    q, scale = codec.quantize_reference(x)
    fq, fscale = fast_encode(x)
    assert_same_bits(fq, q)
    assert_same_bits(fscale, scale)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert_same_bits(
            fast_decode(q, scale, out_dtype),
            codec.dequantize_reference(q, scale, out_dtype),
        )
    if x.dtype != torch.float32:
        check_encoding(x, x.dtype)


def test_fp16_scale_range_guard():
    x = edge_inputs()[-1]  # fp32: 127*65504, 127*65520, just below, just above
    _, scale = codec.quantize_reference(x)
    assert scale[0].item() == FP16_MAX and scale[2].item() == FP16_MAX
    assert math.isnan(scale[1].item()) and math.isnan(scale[3].item())
    assert int(codec.count_nonfinite_rows(scale)) == 2

    big = torch.tensor([[8.4e6, 1.0], [8.2e6, 1.0], [-1e30, 0.0]], dtype=torch.bfloat16)
    _, scale = codec.quantize_reference(big)
    assert torch.equal(torch.isnan(scale), torch.tensor([True, False, True]))
    restored = fast_decode(*fast_encode(big), torch.bfloat16)
    assert torch.isnan(restored[[0, 2]]).all() and torch.isfinite(restored[1]).all()


# Power-of-two scales per dtype where (k + 1/2) * s is exact in the dtype.
TIE_SCALES = {torch.bfloat16: (-24, -3, 0, 12), torch.float16: (-20, -3, 0, 3)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_round_half_to_even(dtype):
    """Rows whose quotients x/s are exactly k + 1/2 for every k in
    [-127, 126]: the amax element 127*s makes s = amax/127 an exact fp16
    power of two, so nothing but the rounding mode decides q."""
    ks = [k + 0.5 for k in range(-127, 127)]
    for log2_s in TIE_SCALES[dtype]:
        s = 2.0**log2_s
        rows = [[127.0] + ks[i : i + 63] for i in range(0, len(ks), 63)]
        rows[-1] += [0.0] * (64 - len(rows[-1]))
        quotients = torch.tensor(rows, dtype=torch.float64)
        x = (quotients * s).to(dtype)
        assert torch.equal(x.double(), quotients * s)  # the ties are exact inputs
        expected = torch.tensor(
            [[round_half_even(v) for v in row] for row in rows], dtype=torch.int8
        )
        for q, scale in (codec.quantize_reference(x), fast_encode(x)):
            assert (scale.double() == s).all()
            assert torch.equal(q, expected)


def test_tiny_scales_round_up_to_fp16_subnormal():
    x = torch.tensor([[1e-30, -1e-30], [0.0, 0.0], [2.0**-24 * 127, 0.0]])
    q, scale = codec.quantize_reference(x.bfloat16())
    assert (scale.double() == 2.0**-24).all()
    assert q[0].tolist() == [0, 0] and q[1].tolist() == [0, 0]
    assert q[2].tolist() == [127, 0]


def test_fp16_output_saturates_at_fp16_max():
    """127 * s rounds past 65504 for |x| >= 65472 with fp16 output; decode
    saturates there (tests/test_int8_saturation.py covers every path)."""
    x = torch.tensor([[FP16_MAX, 1.0]], dtype=torch.float16)
    q, scale = codec.quantize_reference(x)
    assert q[0, 0] == 127 and 127 * scale.double()[0] >= 65520
    restored = codec.dequantize_reference(q, scale, torch.float16)
    assert restored[0, 0].item() == FP16_MAX
    assert torch.isfinite(codec.dequantize_reference(q, scale, torch.float32)).all()


def test_error_bound_values():
    scale = torch.tensor([2.0, 2.0**-24], dtype=torch.float16)
    one = torch.ones(2, 1)
    # half ulp at 1.0: bf16 2**-8, fp16 2**-11, fp32 2**-24.
    for dtype, half_ulp in ((torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)):
        b = codec.error_bound(scale, one.to(dtype))
        assert b[0, 0].item() == 1.0 + half_ulp
        assert b[1, 0].item() == 2.0**-25 + half_ulp
    # fp32: 1 + 2**-24 isn't an fp32; the bound rounds up, never down.
    assert codec.error_bound(scale, one)[0, 0].item() == 1.0 + 2.0**-23
    # Just below a power of two the spacing is the lower binade's.
    below = torch.tensor([[0.99]], dtype=torch.bfloat16)
    assert codec.error_bound(scale[:1], below).item() == 1.0 + 2.0**-9
    # Zero and subnormal outputs: half the smallest subnormal of the dtype.
    zero = torch.zeros(1, 1)
    assert codec.error_bound(scale[1:], zero.half()).item() == 2.0**-25 + 2.0**-25
    assert codec.error_bound(scale[1:], zero.bfloat16()).item() == 2.0**-25 * (
        1 + 2.0**-23
    )  # 2**-25 + 2**-134 rounded up to fp32
    assert codec.error_bound(scale[1:], zero).item() == 2.0**-25 * (1 + 2.0**-23)
    sub = torch.tensor([[3 * 2.0**-24]], dtype=torch.float16)
    assert codec.error_bound(scale[1:], sub).item() == 2.0**-25 + 2.0**-25
    # Non-finite: Inf output -> Inf, NaN row -> NaN.
    nan_scale = torch.tensor([NAN], dtype=torch.float16)
    assert math.isnan(codec.error_bound(nan_scale, torch.full((1, 2), NAN)).max())
    assert math.isinf(codec.error_bound(scale[:1], torch.full((1, 1), INF)).item())


def test_count_nonfinite_rows_is_a_lazy_int64_tensor():
    scale = torch.tensor([[1.0, NAN], [NAN, 2.0], [NAN, 0.5]], dtype=torch.float16)
    n = codec.count_nonfinite_rows(scale)
    assert n.dim() == 0 and n.dtype == torch.int64 and n.device == scale.device
    assert int(n) == 3


def test_single_row():
    x = torch.randn(128).bfloat16()
    q, scale = codec.quantize_reference(x)
    fq, fscale = fast_encode(x)
    assert q.shape == x.shape and scale.shape == ()
    assert_same_bits(fq, q)
    assert_same_bits(fscale, scale)
    assert_same_bits(
        fast_decode(q, scale, torch.bfloat16),
        codec.dequantize_reference(q, scale, torch.bfloat16),
    )


def test_bad_arguments_raise():
    x = torch.randn(4, 64).bfloat16()
    q = torch.empty(4, 64, dtype=torch.int8)
    s = torch.empty(4, dtype=torch.float16)
    with pytest.raises(TypeError):
        codec.quantize_reference(x.to(torch.float64))
    with pytest.raises(ValueError):
        codec.quantize_into(x, q[:, :32], s)
    with pytest.raises(ValueError):
        codec.quantize_into(x, q, s.float())
    with pytest.raises(ValueError):
        codec.dequantize_into(q, s, torch.empty(4, 64, dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fast_path_matches_cpu_reference():
    """The GPU kernels (true division, half-even round, NaN-propagating
    reductions, fp16 conversion) give the CPU reference's bits."""
    kinds = ["gauss", "heavy", "spike", "zero"]
    mags = [-20, -3, 0, 5, 12, 22, 24]
    cases = edge_inputs() + [
        make_rows(seed, (33, 8, d), dtype, kinds, mags)
        for seed, d in enumerate(HEAD_DIMS)
        for dtype in DTYPES + (torch.float32,)
    ]
    for x in cases:
        q, scale = codec.quantize_reference(x)
        xc = x.cuda()
        gq = torch.empty(x.shape, dtype=torch.int8, device="cuda")
        gs = torch.empty(x.shape[:-1], dtype=codec.SCALE_DTYPE, device="cuda")
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
        try:
            codec.quantize_into(xc, gq, gs)
            n_bad = codec.count_nonfinite_rows(gs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert n_bad.device.type == "cuda"
        assert_same_bits(gq.cpu(), q)
        assert_same_bits(gs.cpu(), scale)
        rq, rs = codec.quantize_reference(xc)
        assert_same_bits(rq.cpu(), q)
        assert_same_bits(rs.cpu(), scale)
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            out = torch.empty(x.shape, dtype=out_dtype, device="cuda")
            torch.cuda.set_sync_debug_mode("error")
            try:
                codec.dequantize_into(gq, gs, out)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert_same_bits(out.cpu(), codec.dequantize_reference(q, scale, out_dtype))
