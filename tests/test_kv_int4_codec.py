"""INT4 / K8V4 KV codec (pool_host/kv_int4_codec.py): the error bound,
non-finite groups, packing order, ties, and fast path == reference bit for
bit, for per-token and per-channel groups."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from tests.support.codec_inputs import (
    DTYPES,
    FP16_MAX,
    INF,
    NAN,
    round_half_even,
    UNIT_KINDS as KINDS,
    assert_same_bits,
    make_units,
)

HEAD_DIMS = (64, 80, 96, 128, 256)  # groups of 64, whole head (80), 32, 64, 64
# Group magnitudes (log2) per input dtype: from subnormals to past the fp16
# meta range (|lo| > 65504, or (hi - lo)/15 > 65504) for bf16.
LOG2_RANGE = {torch.bfloat16: (-140, 22), torch.float16: (-27, 16)}

FAST = settings(max_examples=40, deadline=None)


# --- helpers ---------------------------------------------------------------


def grouped(x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, int]:
    """x's groups along the returned dim, matching the meta layout."""
    if per_channel:
        return x, 1
    d = x.shape[-1]
    g = codec.value_group_size(d)
    return x.unflatten(-1, (d // g, g)), -1


def encode_ref(x, per_channel):
    if per_channel:
        return codec.encode_channels_reference(x)
    return codec.encode_tokens_reference(x)


def encode_fast(x, per_channel):
    packed = torch.full((*x.shape[:-1], x.shape[-1] // 2), 0xAB, dtype=torch.uint8)
    n, t, h, d = x.shape
    if per_channel:
        meta = torch.full((n, h, d, 2), -1.0, dtype=torch.float16)
        amax = codec.encode_channels_into(x, packed, meta)
    else:
        groups = d // codec.value_group_size(d)
        meta = torch.full((n, t, h, groups, 2), -1.0, dtype=torch.float16)
        amax = codec.encode_tokens_into(x, packed, meta)
    return packed, meta, amax


def decode_ref(packed, meta, dtype, per_channel):
    if per_channel:
        return codec.decode_channels_reference(packed, meta, dtype)
    return codec.decode_tokens_reference(packed, meta, dtype)


def decode_fast(packed, meta, dtype, per_channel):
    out = torch.full((*packed.shape[:-1], 2 * packed.shape[-1]), -7.0, dtype=dtype)
    if per_channel:
        codec.decode_channels_into(packed, meta, out)
    else:
        codec.decode_tokens_into(packed, meta, out)
    return out


def bound(meta, restored, per_channel):
    if per_channel:
        return codec.error_bound_channels(meta, restored)
    return codec.error_bound_tokens(meta, restored)


def check_encoding(x: torch.Tensor, per_channel: bool, out_dtype=None) -> None:
    """Everything the format promises, for one input [n, T, H, D]."""
    out_dtype = out_dtype or x.dtype
    packed, meta = encode_ref(x, per_channel)
    f_packed, f_meta, f_amax = encode_fast(x, per_channel)
    assert_same_bits(f_packed, packed)
    assert_same_bits(f_meta, meta)
    restored = decode_ref(packed, meta, out_dtype, per_channel)
    assert_same_bits(decode_fast(packed, meta, out_dtype, per_channel), restored)

    xg, dim = grouped(x.double(), per_channel)
    lo, hi = xg.amin(dim), xg.amax(dim)
    s, m = meta[..., 0].double(), meta[..., 1].double()
    # Non-finite exactly for groups holding NaN/Inf and groups whose zero
    # point or scale leaves fp16.
    finite_in = torch.isfinite(xg).all(dim)
    m_spec = lo.to(torch.float16).double()
    a = (hi - m_spec) / codec.QMAX
    expect_bad = ~finite_in | ~torch.isfinite(m_spec) | (a > FP16_MAX)
    assert torch.equal(torch.isnan(s), expect_bad)
    assert torch.equal(torch.isnan(m), expect_bad)
    assert int(codec.count_nonfinite_groups(meta)) == int(expect_bad.sum())
    q = codec.unpack_int4(packed)
    qg, _ = grouped(q, per_channel)
    rg, _ = grouped(restored, per_channel)
    bad_elems = expect_bad.unsqueeze(dim).expand_as(rg)
    assert torch.isnan(rg[bad_elems]).all()  # NaN never comes back finite
    assert (qg[bad_elems] == 0).all()
    # fast amax: max |x| per group, NaN only where the group holds NaN
    amax = torch.maximum(hi.abs(), lo.abs())
    ok = ~expect_bad
    assert torch.equal(f_amax.double()[ok], amax[ok])

    # zero point = fp16(lo); scale >= (hi - m)/15, at most one fp16 step above
    assert torch.equal(m[ok], m_spec[ok])
    assert (s[ok] >= a[ok] * (1 - 2.0**-23)).all()
    assert (s[ok] >= 2.0**-24).all()
    normal = ok & (a >= 2.0**-14)
    assert (s[normal] <= a[normal] * (1 + 2.0**-10) * (1 + 2.0**-23)).all()
    # q is 0 only by the clamp where x < m, never clipped at 15
    quot = (xg.double() - m.unsqueeze(dim)) / s.unsqueeze(dim)
    okx = ok.unsqueeze(dim).expand_as(quot)
    assert (quot[okx] <= codec.QMAX + 2.0**-18).all()
    # the stated elementwise bound
    err = (x.double() - restored.double()).abs()
    b = bound(meta, restored, per_channel)
    assert b.dtype == torch.float32
    eg, _ = grouped(err, per_channel)
    bg, _ = grouped(b.double(), per_channel)
    assert (eg[okx] <= bg[okx]).all()
    # constant groups restore to their fp16 zero point
    const = ok & (lo == hi)
    assert torch.equal(
        rg[const.unsqueeze(dim).expand_as(rg)].double(),
        m.unsqueeze(dim)
        .expand_as(rg)[const.unsqueeze(dim).expand_as(rg)]
        .to(out_dtype)
        .double(),
    )


# --- property tests --------------------------------------------------------


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 3),
    tokens=st.sampled_from((1, 2, 16, 64)),
    heads=st.integers(1, 3),
    d=st.sampled_from(HEAD_DIMS),
    dtype=st.sampled_from(DTYPES),
    per_channel=st.booleans(),
    out_fp32=st.booleans(),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
    mag_frac=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
)
def test_bound_and_format_hold(
    seed, n, tokens, heads, d, dtype, per_channel, out_fp32, kinds, mag_frac
):
    lo, hi = LOG2_RANGE[dtype]
    mags = [lo + f * (hi - lo) for f in mag_frac]
    x = make_units(seed, (n, tokens, heads, d), dtype, kinds, mags)
    check_encoding(x, per_channel, torch.float32 if out_fp32 else None)


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from(HEAD_DIMS),
    dtype=st.sampled_from(DTYPES),
    per_channel=st.booleans(),
    log2_s=st.integers(-24, 6),
    m_steps=st.integers(-200, 200),
)
def test_exact_grid_restores_exactly(seed, d, dtype, per_channel, log2_s, m_steps):
    """x = m + k*s with k in 0..15 (0 and 15 present in every group) encodes
    to q = k, meta = (s, m) and decodes to x exactly."""
    s = 2.0**log2_s
    m = m_steps * s  # few significant bits: exact in bf16 along with m + 15 s
    g = torch.Generator().manual_seed(seed)
    shape = (2, 16, 2, d)
    k = torch.randint(0, 16, shape, generator=g)
    if per_channel:
        k[:, 0], k[:, 1] = 0, 15
    else:
        gs = codec.value_group_size(d)
        k[..., 0::gs], k[..., 1::gs] = 0, 15
    x = (m + k.double() * s).to(dtype)
    assert torch.equal(x.double(), m + k.double() * s)  # the grid is representable
    packed, meta = encode_ref(x, per_channel)
    assert torch.equal(codec.unpack_int4(packed), k.to(torch.uint8))
    assert (meta[..., 0].double() == s).all() and (meta[..., 1].double() == m).all()
    for out_dtype in (dtype, torch.float32):
        restored = decode_fast(packed, meta, out_dtype, per_channel)
        assert torch.equal(restored.double(), x.double())
    check_encoding(x, per_channel)


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    tokens=st.sampled_from((1, 16)),
    d=st.sampled_from(HEAD_DIMS),
    dtype=st.sampled_from(DTYPES),
    per_channel=st.booleans(),
    bad=st.lists(
        st.tuples(
            st.integers(0, 15), st.integers(0, 255), st.sampled_from((NAN, INF, -INF))
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_nonfinite_poisons_only_its_group(seed, tokens, d, dtype, per_channel, bad):
    g = torch.Generator().manual_seed(seed)
    clean = (torch.randn(2, tokens, 2, d, generator=g) * 3).to(dtype)
    x = clean.clone()
    for t, c, v in bad:
        x[t % 2, t % tokens, (t // 2) % 2, c % d] = v
    packed, meta = encode_ref(x, per_channel)
    c_packed, c_meta = encode_ref(clean, per_channel)
    restored = decode_ref(packed, meta, dtype, per_channel)
    xg, dim = grouped(x, per_channel)
    bad_groups = ~torch.isfinite(xg).all(dim)
    rg, _ = grouped(restored, per_channel)
    expanded = bad_groups.unsqueeze(dim).expand_as(rg)
    assert torch.isnan(rg[expanded]).all()
    assert torch.isfinite(rg[~expanded]).all()
    assert int(codec.count_nonfinite_groups(meta)) == int(bad_groups.sum())
    # Every other group: the bytes of encoding the clean input.
    assert_same_bits(meta[~bad_groups], c_meta[~bad_groups])
    qg, _ = grouped(codec.unpack_int4(packed), per_channel)
    cg, _ = grouped(codec.unpack_int4(c_packed), per_channel)
    assert torch.equal(qg[~expanded], cg[~expanded])
    assert (qg[expanded] == 0).all()
    check_encoding(x, per_channel)


# --- edge cases ------------------------------------------------------------


def edge_rows(dtype: torch.dtype, d: int = 64) -> torch.Tensor:
    """Hand-picked rows (one group each with d = 64) for ranges and specials."""
    info = torch.finfo(dtype)
    lin = torch.linspace(-1, 1, d)
    rows = [
        torch.zeros(d),
        -torch.zeros(d),
        torch.full((d,), float(info.smallest_normal)),
        torch.full((d,), float(info.smallest_normal) / 8),  # subnormal input
        lin * float(info.smallest_normal) * 4,  # subnormal spread
        lin,
        torch.arange(d) - 31.5,
        torch.full((d,), math.pi),  # constant: m = fp16(pi) rounds
        torch.full((d,), -FP16_MAX),
        torch.full((d,), FP16_MAX),
        torch.where(lin > 0, FP16_MAX, -FP16_MAX),  # s = 131008/15 rounds up
        torch.full((d,), float(info.max)),
        torch.full((d,), -float(info.max)),
        torch.full((d,), 1e5),  # bf16: m overflows fp16 -> NaN group
        torch.full((d,), -65520.0),  # rounds to -Inf in fp16
        torch.where(lin > 0, 1e6, -1.0),  # bf16: scale overflows fp16
        torch.tensor([NAN] + [1.0] * (d - 1)),
        torch.tensor([INF] + [1.0] * (d - 1)),
        torch.tensor([1.0] * (d - 1) + [-INF]),
        torch.tensor([1e-3] * (d - 1) + [1e3]),
        torch.tensor([1e4] + [1e4 + 8.0] * (d - 1)),  # large zero point
        lin * 3 + 1000.0,  # m's fp16 ulp (0.5) larger than s/2
    ]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float32,))
@pytest.mark.parametrize("per_channel", (False, True))
def test_edge_inputs_fast_matches_reference(dtype, per_channel):
    rows = edge_rows(dtype)
    # per token: one row = one group; per channel: the 64 entries of a row
    # become the tokens of one unit, so a channel's group is a row.
    x = rows[None, :, None, :] if not per_channel else rows.t()[None, :, None, :]
    packed, meta = encode_ref(x, per_channel)
    f_packed, f_meta, _ = encode_fast(x, per_channel)
    assert_same_bits(f_packed, packed)
    assert_same_bits(f_meta, meta)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert_same_bits(
            decode_fast(packed, meta, out_dtype, per_channel),
            decode_ref(packed, meta, out_dtype, per_channel),
        )
    if dtype != torch.float32:
        check_encoding(x, per_channel)


def test_edge_nonfinite_policy():
    """Which edge rows are stored non-finite, and that they decode to NaN."""
    rows = edge_rows(torch.bfloat16)[None, :, None, :]
    packed, meta = codec.encode_tokens_reference(rows)
    bad = torch.isnan(meta[0, :, 0, 0, 0]).tolist()
    expected = [False] * rows.shape[1]
    # +-65504 is +-65536 in bf16, past fp16 as a zero point; then bf16 max,
    # 1e5, -65520, the fp16 scale overflow, NaN, +Inf, -Inf
    for i in range(8, 19):
        expected[i] = True
    assert bad == expected
    restored = codec.decode_tokens_reference(packed, meta, torch.bfloat16)
    assert torch.isnan(restored[0, torch.tensor(expected)]).all()
    assert torch.isfinite(restored[0, ~torch.tensor(expected)]).all()
    # fp16: the extremes +-65504 are representable, both as m and via s
    rows16 = edge_rows(torch.float16)[None, :, None, :]
    _, meta16 = codec.encode_tokens_reference(rows16)
    assert not torch.isnan(meta16[0, 8:11]).any()
    assert meta16[0, 10, 0, 0, 0].item() == 8736.0  # 131008/15 = 8733.9 rounded up


def test_fp16_meta_range_boundary():
    """Scale range: (hi - m)/15 at 65504 is finite, one fp32 step more is not;
    zero point range: fp16(lo) overflows from -65520 on."""
    top = 15 * FP16_MAX
    above = float(torch.nextafter(torch.tensor(top), torch.tensor(INF)))
    x = torch.tensor(
        [[0.0, top], [0.0, above], [-65519.0, 0.0], [-65520.0, 0.0]],
        dtype=torch.float32,
    )
    _, meta = codec.encode_tokens_reference(x, group=2)
    assert meta[0, 0, 0].item() == FP16_MAX
    assert torch.isnan(meta[1]).all()
    assert meta[2, 0, 1].item() == -FP16_MAX
    assert torch.isnan(meta[3]).all()
    assert int(codec.count_nonfinite_groups(meta)) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", (False, True))
def test_exact_ties_round_half_to_even(dtype, per_channel):
    """(x - m)/s exactly k + 1/2 for every k in 0..14: with m = lo and hi =
    m + 15 s exact, nothing but the rounding mode decides q."""
    quotients = [0.0, 15.0] + [k + 0.5 for k in range(15)] + [7.0] * 15  # 32
    for log2_s, m in ((-20, 0.0), (-3, -2.0), (0, 8.0), (2, -64.0)):
        s = 2.0**log2_s
        col = torch.tensor(quotients, dtype=torch.float64)
        x = (m + col * s).to(dtype)
        assert torch.equal(x.double(), m + col * s)  # the ties are exact inputs
        if per_channel:
            x = x.reshape(1, 32, 1, 1).expand(1, 32, 1, 2).contiguous()
        else:
            x = x.reshape(1, 1, 1, 32)
        expected = torch.tensor([round_half_even(v) for v in quotients])
        packed, meta = encode_ref(x, per_channel)
        f_packed, f_meta, _ = encode_fast(x, per_channel)
        for p, mt in ((packed, meta), (f_packed, f_meta)):
            assert (mt[..., 0].double() == s).all()
            assert (mt[..., 1].double() == m).all()
            q = (
                codec.unpack_int4(p).flatten()
                if not per_channel
                else (codec.unpack_int4(p)[0, :, 0, 0])
            )
            assert torch.equal(q.long(), expected)


def test_packing_order():
    q = torch.tensor([[0, 15, 1, 2, 14, 3]], dtype=torch.uint8)
    packed = codec.pack_int4(q)
    assert packed.tolist() == [[0xF0, 0x21, 0x3E]]  # even channel in the low nibble
    assert torch.equal(codec.unpack_int4(packed), q)
    allq = torch.arange(256).to(torch.uint8)
    assert torch.equal(codec.pack_int4(codec.unpack_int4(allq)), allq)
    # Through the encoder: channel 0 is lo (q 0), channel 1 hi (q 15), channel 2
    # one step (q 1), channel 3 two steps: bytes 0xF0, 0x21.
    x = torch.tensor([[[[0.0, 15.0, 1.0, 2.0]]]], dtype=torch.bfloat16)
    packed, meta = codec.encode_tokens_reference(x)
    assert packed.flatten().tolist() == [0xF0, 0x21]
    assert meta.flatten().tolist() == [1.0, 0.0]
    f_packed, _, _ = encode_fast(x, per_channel=False)
    assert f_packed.flatten().tolist() == [0xF0, 0x21]


def test_group_sizes_and_key_grouping():
    sizes = [codec.value_group_size(d) for d in (64, 80, 96, 128, 256, 40)]
    assert sizes == [64, 80, 32, 64, 64, 40]
    assert codec.K_CHANNEL_MIN_TOKENS == 16
    assert not codec.keys_per_channel(1) and not codec.keys_per_channel(15)
    assert codec.keys_per_channel(16) and codec.keys_per_channel(64)


def test_error_bound_values():
    """Each addition is rounded up in fp32: s = 2, m = 0, x^ = 1 gives
    1 + 2**-24 -> 1 + 2**-23, then + half ulp out."""
    meta = torch.tensor([[[2.0, 0.0]]], dtype=torch.float16)  # [1, 1 group, 2]
    one = torch.ones(1, 2)
    b = codec.error_bound_tokens(meta, one.bfloat16())
    assert b[0, 0].item() == 1.0 + 2.0**-23 + 2.0**-8
    b = codec.error_bound_tokens(meta, one.half())
    assert b[0, 0].item() == 1.0 + 2.0**-23 + 2.0**-11
    # fp32 out: (1 + 2**-23) + 2**-24 isn't an fp32 either: up to 1 + 2**-22
    assert codec.error_bound_tokens(meta, one)[0, 0].item() == 1.0 + 2.0**-22
    # tiny scale, zero point 1000: fp16's half ulp at 1000 (0.25) dominates
    meta = torch.tensor([[[2.0**-24, 1000.0]]], dtype=torch.float16)
    r = torch.full((1, 2), 1000.0, dtype=torch.bfloat16)
    expected = 0.25 + 2.0**-15 + 2.0
    assert codec.error_bound_tokens(meta, r)[0, 0].item() == expected
    # 2**-25 + 2**-149 (fp32) + 2**-134 (bf16): two roundings up, never down
    meta = torch.tensor([[[2.0**-24, 0.0]]], dtype=torch.float16)
    zero = torch.zeros(1, 2, dtype=torch.bfloat16)
    assert codec.error_bound_tokens(meta, zero)[0, 0].item() == 2.0**-25 * (
        1 + 2.0**-22
    )
    # NaN group -> NaN bound; per channel broadcasts meta over tokens
    meta = torch.tensor([[[[NAN, NAN], [4.0, 0.0]]]], dtype=torch.float16)  # [1,1,2,2]
    r = torch.tensor([[[[NAN, 8.0]], [[NAN, 60.0]]]])  # [1, 2 tokens, 1, 2]
    b = codec.error_bound_channels(meta, r)
    assert torch.isnan(b[..., 0]).all()
    assert b[0, 0, 0, 1].item() == 2.0 + 2.0**-21 + 2.0**-21
    assert b[0, 1, 0, 1].item() == 2.0 + 2.0**-19 + 2.0**-19


def test_count_nonfinite_groups_is_a_lazy_int64_tensor():
    meta = torch.tensor([[1.0, 0.0], [NAN, NAN], [NAN, NAN]], dtype=torch.float16)
    n = codec.count_nonfinite_groups(meta)
    assert n.dim() == 0 and n.dtype == torch.int64 and int(n) == 2


def test_bad_arguments_raise():
    x = torch.randn(2, 16, 4, 64).bfloat16()
    packed = torch.empty(2, 16, 4, 32, dtype=torch.uint8)
    meta = torch.empty(2, 16, 4, 1, 2, dtype=torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        codec.encode_tokens_reference(x.double())
    with pytest.raises(ValueError, match="even dim"):
        codec.encode_tokens_reference(torch.randn(2, 63))
    with pytest.raises(ValueError, match="even dim"):
        codec.encode_channels_reference(torch.randn(1, 16, 2, 63))
    with pytest.raises(ValueError, match="units"):
        codec.encode_channels_reference(torch.randn(16, 64))
    with pytest.raises(ValueError, match="packed_out"):
        codec.encode_tokens_into(x, packed[..., :16], meta)
    with pytest.raises(ValueError, match="meta_out"):
        codec.encode_tokens_into(x, packed, meta.float())
    with pytest.raises(ValueError, match="meta_out"):
        codec.encode_channels_into(x, packed, meta)
    with pytest.raises(ValueError, match="uint8"):
        codec.decode_tokens_into(packed.to(torch.int8), meta, torch.empty(x.shape))
    with pytest.raises(ValueError, match="out"):
        codec.decode_tokens_into(packed, meta, torch.empty(2, 16, 4, 64).int())


def test_records_per_channel_switch():
    """Keys per channel from K_CHANNEL_MIN_TOKENS tokens a unit on, per token
    below (the layer_first unit is one token). Bytes per token at Qwen3-8B
    geometry: test_conformance.py (EXPECT)."""
    for t, meta_shape in ((1, (1, 2, 2, 2)), (15, (15, 2, 2, 2)), (16, (2, 128, 2))):
        shapes = codec.int4_record_shapes((128, 128), 2, t)
        assert shapes["k_meta"][0] == meta_shape
        assert shapes["v_meta"][0] == (t, 2, 2, 2)
