"""The rotated 4-bit formats (int4r, k8v4r; kv_hadamard.py): the rotation
against an independent Hadamard matrix, its fallback, tags, and the NaN/Inf
policy (round trips: tests/test_host_codecs.py)."""

from __future__ import annotations


import hashlib

import pytest
import torch

from sglang.srt.mem_cache.pool_host import kv_hadamard as kh
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
from tests.support.codec_inputs import UNIT_KINDS as KINDS
from tests.support.codec_inputs import assert_same_bits, make_units

NAN = float("nan")
INF = float("inf")
BLOCKS = (16, 32, 64, 128, 256)
# (format, its base format).
FORMATS = {"int4r": "int4", "k8v4r": "k8v4"}


def format_cls(name):
    return host_format_cls(name)


def sylvester(block: int) -> torch.Tensor:
    """H_B from Kronecker products, in float64 (not from the butterfly)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.kron(base, h)
    return h


# --- the rotation -----------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
def test_rotation_is_the_seeded_sylvester_hadamard(block):
    """On small integers every butterfly sum is exact, so the fp32 rotation
    must equal the float64 matrix product exactly, and invert exactly."""
    g = torch.Generator().manual_seed(block)
    dim = 2 * block
    x = torch.randint(-50, 51, (7, dim), generator=g).to(torch.float32)
    signs = kh.rotation_signs(dim).to(torch.float64)
    enc = kh.rotation_shift(block)
    assert 2**enc == block  # encode scales by 1/B, H_B H_B = B I
    blocks = (x.double() * signs).unflatten(-1, (2, block))
    want = (blocks @ sylvester(block).T).flatten(-2) * 2.0**-enc
    y = kh.rotate_reference(x, block)
    assert torch.equal(y.double(), want)
    assert torch.equal(kh.unrotate_reference(y, block), x)
    # Orthogonal up to the scale 1/sqrt(B), so never past the row's max |x|.
    gain = y.norm(dim=-1) / x.norm(dim=-1)
    assert torch.allclose(gain, torch.full_like(gain, block**-0.5))
    assert (y.abs().amax(-1) <= x.abs().amax(-1)).all()


def test_signs_are_a_fixed_function_of_the_channel():
    s = kh.rotation_signs(256)
    assert set(s.tolist()) == {-1.0, 1.0}
    assert 0.35 < (s < 0).float().mean().item() < 0.65
    assert torch.equal(kh.rotation_signs(64), s[:64])
    assert torch.equal(kh.rotation_signs(96), kh.rotation_signs(96))


# sha256 of rotation_signs(1024) as fp32 bytes. The signs are part of every
# stored int4r/k8v4r page: changing them needs new storage_format_tags (and new
# hash grid entries, tests/support/hash_grid.py), not a new value here.
SIGNS_SHA256 = "f97c4de6c96b61a9c2f934d8b4563caf1cc6878dcf677c42a4b19b63c8c01a09"


def test_sign_vector_is_pinned():
    signs = kh.rotation_signs(1024)
    digest = hashlib.sha256(signs.numpy().tobytes()).hexdigest()
    assert digest == SIGNS_SHA256, (kh.ROTATION_SEED, digest)
    assert kh.ROTATION_SEED == 0x48695143


@pytest.mark.parametrize(
    "dim,block", ((128, 128), (64, 64), (256, 256), (192, 64), (96, 32), (80, 16))
)
def test_rotation_block_of_head_dims(dim, block):
    assert kh.rotation_block(dim) == block


@pytest.mark.parametrize("dim", (72, 40, 36, 2))
def test_no_power_of_two_block_means_no_rotation(dim):
    assert kh.rotation_block(dim) == 0


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("log2_mag", (-130, -20, 0, 20, 100))
def test_fast_rotation_matches_reference_bit_for_bit(block, log2_mag):
    g = torch.Generator().manual_seed(block + log2_mag)
    x = torch.randn(5, 3, 2 * block, generator=g) * 2.0**log2_mag
    x[0, 0, 1] = NAN
    x[1, 2, 5] = INF
    y = kh.rotate_(x.clone(), block)
    assert_same_bits(y, kh.rotate_reference(x, block))
    assert_same_bits(kh.unrotate_(y.clone(), block), kh.unrotate_reference(y, block))


def test_rotation_refuses_bad_arguments():
    with pytest.raises(TypeError, match="fp32"):
        kh.rotate_reference(torch.zeros(4, 64, dtype=torch.bfloat16), 64)
    with pytest.raises(ValueError, match="power of two"):
        kh.rotate_reference(torch.zeros(4, 96), 64)
    with pytest.raises(ValueError, match="contiguous"):
        kh.rotate_(torch.zeros(64, 4).T, 64)


# --- the formats: reference == torch path, bound, records ------------------


def rows_for(seed, shape, dtype):
    """Rows of every kind at 2**-10 to 2**3, inside the FP16 metadata range
    even for heavy tails (larger rows: test_rotation_keeps_the_base_formats_range)."""
    rows = make_units(seed, shape, dtype, list(KINDS), [-10, 0, 3])
    assert torch.isfinite(rows).all()
    return rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unit_tokens", (1, 16, 64))
@pytest.mark.parametrize("dims", ((128, 128), (64, 96), (80, 80), (192, 128), (72, 72)))
def test_records_are_the_base_formats(fmt, unit_tokens, dims):
    """Same records (names, shapes, dtypes, byte order) and bytes per token as
    the base format, under another storage tag (the round trips:
    tests/test_host_codecs.py)."""
    f = format_cls(fmt)(dims, 2, unit_tokens, torch.bfloat16)
    base = host_format_cls(FORMATS[fmt])(dims, 2, unit_tokens, torch.bfloat16)
    assert f.records == base.records
    assert f.bytes_per_token() == base.bytes_per_token()
    assert f.storage_format_tag != base.storage_format_tag


@pytest.mark.parametrize("fmt", FORMATS)
def test_unrotated_sides_store_the_base_formats_bytes(fmt):
    """A side the format does not rotate (k8v4r's keys), and every side of a
    head dim without a block (72), is stored exactly as the base format."""
    f = format_cls(fmt)((128, 72), 2, 16, torch.bfloat16)
    base = host_format_cls(FORMATS[fmt])((128, 72), 2, 16, torch.bfloat16)
    k = rows_for(3, (2, 16, 2, 128), torch.bfloat16)
    v = rows_for(4, (2, 16, 2, 72), torch.bfloat16)
    got, want = f.encode_reference((k, v)), base.encode_reference((k, v))
    same = {r.name for r in f.records if not r.name.startswith("k")}
    if "k" not in f.rotated_sides:
        same |= {r.name for r in f.records}
    for name in got:
        assert torch.equal(
            got[name].view(torch.uint8), want[name].view(torch.uint8)
        ) == (name in same), name


@pytest.mark.parametrize(
    "fmt,dims,text",
    (
        ("int4r", (128, 128), "k in one 128-point block, v in one 128-point block"),
        ("int4r", (192, 128), "k in 3 blocks of 64, v in one 128-point block"),
        ("k8v4r", (128, 80), "v in 5 blocks of 16"),
        ("int4r", (72, 72), "k NOT rotated (head dim 72 has no power-of-two"),
    ),
)
def test_describe_names_the_rotation_and_the_fallback(fmt, dims, text, caplog):
    f = host_format_cls(fmt)(dims, 2, 64, torch.bfloat16)
    with caplog.at_level("WARNING"):
        line = f.describe()
    assert text in line
    # Only a fallback warns.
    assert ("NOT rotated" in caplog.text) == ("NOT rotated" in text)


def test_storage_tags_name_the_format_and_the_blocks():
    """Pages encoded another way (base format, other blocks, no rotation,
    other key grouping) never share a tag, so they miss in L3. (A tag does
    not name the geometry: other dims give other page sizes.)"""

    def tag(name, dims, ut=64):
        return format_cls(name)(dims, 2, ut, torch.bfloat16).storage_format_tag

    tags = [tag(name, (128, 128)) for name in ("int4", "k8v4", *FORMATS)]
    tags += [tag(name, d) for name in FORMATS for d in ((192, 96), (72, 72))]
    tags += [tag("int4r", (128, 128), ut=1)]
    assert len(set(tags)) == len(tags)
    assert tag("int4r", (128, 128)) == "int4r-fp16meta-v1-kchannel-whtk128-v128"
    assert tag("int4r", (128, 128), 1) == "int4r-fp16meta-v1-ktoken-whtk128-v128"
    assert tag("k8v4r", (72, 72)) == "k8v4r-fp16meta-v1-whtvx"
    # k8v4r rotates only values: the key dim does not enter its tag.
    assert tag("k8v4r", (128, 128)) == tag("k8v4r", (192, 128))


# --- NaN / Inf ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unit_tokens", (1, 64))
@pytest.mark.parametrize("bad", (NAN, INF, -INF))
@pytest.mark.parametrize("dims", ((128, 128), (96, 96)))
def test_nonfinite_never_comes_back_finite(fmt, unit_tokens, bad, dims):
    """A NaN/Inf spreads over its rotation block; every channel of that block
    restores as NaN, and nothing outside the (unit, head) of a per-channel
    key group, or the (token, head) of a per-token group, is touched."""
    dtype = torch.bfloat16
    f = format_cls(fmt)(dims, 2, unit_tokens, dtype)
    k = rows_for(5, (3, unit_tokens, 2, dims[0]), dtype)
    v = rows_for(6, (3, unit_tokens, 2, dims[1]), dtype)
    kc, vc = 5, dims[1] - 1
    k[1, 0, 1, kc] = bad
    v[2, -1, 0, vc] = bad
    records = f.encode_reference((k, v))
    k_hat, v_hat = f.decode_reference(records, dtype)
    stats = f.encode_into((k, v), {n: torch.empty_like(t) for n, t in records.items()})
    assert int(stats.nonfinite) >= 2
    for x_hat, unit, token, head, ch, side in (
        (k_hat, 1, 0, 1, kc, "k"),
        (v_hat, 2, -1, 0, vc, "v"),
    ):
        block = f.rotation_blocks[f.sides.index(side)] or 1
        lo = ch // block * block
        assert torch.isnan(x_hat[unit, token, head, lo : lo + block]).all()
        per_channel_keys = side == "k" and getattr(f, "keys_per_channel", False)
        allowed = torch.zeros_like(x_hat, dtype=torch.bool)
        if per_channel_keys:
            allowed[unit, :, head] = True
        else:
            allowed[unit, token, head] = True
        assert torch.isfinite(x_hat[~allowed]).all()


@pytest.mark.parametrize("fmt", ("int4r", "k8v4r"))
def test_rotation_keeps_the_base_formats_range(fmt):
    """Rows of large aligned values that the base format stores finite (near
    its FP16 metadata limit) stay finite and within the bound when rotated;
    rows past that limit are stored non-finite by both, never as a wrong
    finite value."""
    base = FORMATS[fmt]
    k = torch.full((1, 16, 2, 128), 3.0e4, dtype=torch.bfloat16)
    k[..., ::3] = -6.0e4
    v = k.clone()
    v[:, :, 1] = 1.0e6  # past fp16's 65504 in both formats
    k[:, :, 1] = 1.0e6
    restored = {}
    for name in (base, fmt):
        f = host_format_cls(name)((128, 128), 2, 16, torch.bfloat16)
        records = f.encode_reference((k, v))
        restored[name] = f.decode_reference(records, torch.bfloat16)
        k_hat, v_hat = restored[name]
        assert torch.isnan(v_hat[:, :, 1]).all()
        assert torch.isfinite(v_hat[:, :, 0]).all()
        err = (v_hat[:, :, 0].double() - v[:, :, 0].double()).abs()
        bound = f.error_bound(records, (k_hat, v_hat))[1][:, :, 0].double()
        assert (err <= bound).all()


# --- what the rotation is for -------------------------------------------------


@pytest.mark.parametrize("kind", ("outlier_channel", "heavy"))
def test_rotation_lowers_the_error_of_outlier_rows(kind):
    """Rotating per-token 4-bit groups with outlier channels or heavy tails
    spreads the outliers over the head: a lower mean squared error (not for a
    lone spike: its group's other values are near zero already)."""
    dtype = torch.bfloat16
    x = make_units(11, (8, 1, 4, 128), dtype, [kind], [0])
    errs = {}
    for name in ("int4", "int4r"):
        f = host_format_cls(name)((128, 128), 4, 1, dtype)
        _, v_hat = f.decode_reference(f.encode_reference((x, x)), dtype)
        errs[name] = (v_hat.double() - x.double()).pow(2).mean().item()
    assert errs["int4r"] < 0.8 * errs["int4"], errs
