"""MLA INT8 host format (pool_host/kv_mla_int8_codec.py): latent tiles encoded with
kv_int8_codec's exact math, RoPE kept bit for bit, per-tile scales, the NaN/Inf policy
and fail-fast geometry (fast path == reference: tests/test_host_codecs.py)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec as int8
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import (
    TILE,
    MLAInt8HostFormat,
)
from tests.support.codec_inputs import DTYPES, assert_same_bits

LATENT, ROPE = 512, 64  # DeepSeek V2/V3, Kimi K2
NAN, INF = float("nan"), float("inf")


def fmt(unit_tokens=4, dtype=torch.bfloat16, latent=LATENT, rope=ROPE):
    return MLAInt8HostFormat((latent + rope,), 1, unit_tokens, dtype, rope_dim=rope)


def rows(seed, n_units, f, dtype, tile_log2=None):
    """[n_units, ut, 1, 576] rows whose latent tiles have their own magnitudes
    (MLA latents vary by orders of magnitude across channels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n_units, f.unit_tokens, 1, f.latent_dim + f.rope_dim), generator=g)
    tile_log2 = tile_log2 or [0.0] * f.tiles
    for t, e in enumerate(tile_log2):
        x[..., t * TILE : (t + 1) * TILE] *= 2.0**e
    return x.to(dtype)


def fast_encode(f, x):
    out = {
        r.name: torch.full((x.shape[0], *r.shape), 7, dtype=r.dtype) for r in f.records
    }
    stats = f.encode_into([x], out)
    return out, stats


# --- format and capacity -----------------------------------------------------


def test_records_and_bytes_at_deepseek_geometry():
    f = fmt(unit_tokens=64)
    assert [(r.name, r.shape, r.dtype) for r in f.records] == [
        ("kv", (64, 1, 512), torch.int8),
        ("scale", (64, 1, 4), torch.float16),
        ("rope", (64, 1, 64), torch.bfloat16),
    ]
    # 648 B per token and layer: 1.78x BF16's 1152 B.
    assert f.bytes_per_token() == 648 == f.bytes_per_token_for((576,), 1, 64)
    assert f.storage_format_tag == "mla-int8-t128-fp16scale-rope16-v1"
    assert f.sides == ("kv",) and f.name == "int8"


@pytest.mark.parametrize(
    "dims,head_num,dtype,match",
    [
        ((500 + 64,), 1, torch.bfloat16, "multiple of 128"),
        ((576,), 2, torch.bfloat16, "head_num=1"),
        ((576, 576), 1, torch.bfloat16, "one latent row"),
        ((576,), 1, torch.float8_e4m3fn, "BF16/FP16"),
        ((576,), 1, torch.float32, "BF16/FP16"),
    ],
)
def test_unsupported_geometry_fails_naming_the_flag(dims, head_num, dtype, match):
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int8") as e:
        MLAInt8HostFormat(dims, head_num, 1, dtype)
    assert match in str(e.value)


# --- the encoding: kv_int8_codec per tile, RoPE verbatim ---------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_tile_is_kv_int8_codec_and_rope_is_verbatim(dtype):
    f = fmt(unit_tokens=3, dtype=dtype)
    x = rows(1, 2, f, dtype, tile_log2=[-6, 0, 4, 9 if dtype == torch.bfloat16 else 6])
    rec = f.encode_reference([x])
    for t in range(f.tiles):
        q, s = int8.quantize_reference(x[..., t * TILE : (t + 1) * TILE])
        assert torch.equal(rec["kv"][..., t * TILE : (t + 1) * TILE], q)
        assert_same_bits(rec["scale"][..., t], s)
    assert_same_bits(rec["rope"], x[..., LATENT:])
    (y,) = f.decode_reference(rec, dtype)
    assert_same_bits(y[..., LATENT:], x[..., LATENT:])


def test_tiles_keep_small_channels_precise_next_to_large_ones():
    """A per-token scale would let one large tile drown the others; per-tile
    scales bound each tile's error by its own amax."""
    f = fmt(unit_tokens=8)
    x = rows(3, 4, f, torch.bfloat16, tile_log2=[8, -4, -4, -4])
    (y,) = f.decode_reference(f.encode_reference([x]), torch.bfloat16)
    small = slice(TILE, LATENT)
    rel = (x[..., small].float() - y[..., small].float()).abs().amax(-1) / x[
        ..., small
    ].float().abs().amax(-1)
    assert rel.max() < 0.01  # < 1/127 of the tile's own amax (plus rounding)
    # The per-token scale of kv_int8_codec on the same row loses them.
    q, s = int8.quantize_reference(x[..., :LATENT])
    yr = int8.dequantize_reference(q, s, torch.bfloat16)
    assert (yr[..., small] == 0).float().mean() > 0.9


# --- non-finite input ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_poisons_only_its_tile_and_rope_keeps_it(dtype, bad):
    f = fmt(unit_tokens=2, dtype=dtype)
    x = rows(4, 3, f, dtype)
    x[0, 1, 0, 2 * TILE + 5] = bad  # latent tile 2 of token (0, 1)
    x[2, 0, 0, LATENT + 7] = bad  # RoPE of token (2, 0)
    rec, stats = fast_encode(f, x)
    assert_same_bits(rec["scale"], f.encode_reference([x])["scale"])
    (y,) = f.decode_reference(rec, dtype)
    nan_tile = torch.zeros_like(x, dtype=torch.bool)
    nan_tile[0, 1, 0, 2 * TILE : 3 * TILE] = True
    assert torch.isnan(y[nan_tile]).all()
    # Nothing else became NaN except the RoPE value itself, kept verbatim.
    rope_bad = y[2, 0, 0, LATENT + 7]
    assert torch.isnan(rope_bad) if bad != bad else rope_bad.item() == bad
    others = ~nan_tile
    others[2, 0, 0, LATENT + 7] = False
    assert torch.isfinite(y[others]).all()
    assert stats.nonfinite.item() == 2  # one tile + one RoPE row
    finite = torch.isfinite(rec["scale"])
    assert stats.amax.item() == (
        x[..., :LATENT].unflatten(-1, (4, TILE)).float().abs().amax(-1)[finite].max()
    )


def test_tile_beyond_fp16_scale_range_restores_as_nan():
    f = fmt(unit_tokens=1)
    x = rows(5, 1, f, torch.bfloat16)
    x[0, 0, 0, 3 * TILE] = 1.0e7  # 1e7 / 127 > 65504: no fp16 scale
    rec, stats = fast_encode(f, x)
    (y,) = f.decode_reference(rec, torch.bfloat16)
    assert torch.isnan(y[0, 0, 0, 3 * TILE : 4 * TILE]).all()
    assert torch.isfinite(y[0, 0, 0, : 3 * TILE]).all()
    assert stats.nonfinite.item() == 1


def test_fp16_output_saturates_instead_of_inf():
    f = fmt(unit_tokens=1, dtype=torch.float16)
    x = torch.zeros((1, 1, 1, LATENT + ROPE), dtype=torch.float16)
    x[..., 0] = 65504.0
    x[..., TILE] = -65472.0
    (y,) = f.decode_reference(f.encode_reference([x]), torch.float16)
    assert torch.isfinite(y).all()
    assert y[..., 0].item() == 65504.0 and y[..., TILE].item() == -65504.0


def test_bad_rows_raise():
    f = fmt(unit_tokens=2)
    with pytest.raises(ValueError, match="rows must be"):
        f.encode_reference([torch.zeros((1, 2, 1, 512), dtype=torch.bfloat16)])
