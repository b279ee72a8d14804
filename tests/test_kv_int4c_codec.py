"""int4c host format (kv_int4c_codec.py): records, the keys against an
independent reading of the spec, the per-layer plan, non-finite channel-units,
and why it exists (round trips: tests/test_host_codecs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang.srt.mem_cache.pool_host import host_format as hf
from sglang.srt.mem_cache.pool_host import kv_int4_codec
from sglang.srt.mem_cache.pool_host import kv_int4c_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import half_ulp
from tests.support import int4c_spec as spec
from tests.support.codec_inputs import assert_same_bits
from tests.support.kernel_cases import fill_rows

NAN, INF = float("nan"), float("inf")


def make_format(unit_tokens, dims=(128, 128), heads=2, dtype=torch.bfloat16, **kw):
    return hf.host_format_cls("int4c")(dims, heads, unit_tokens, dtype, **kw)


# --- records, bytes, tags -------------------------------------------------------


@pytest.mark.parametrize(
    "ut,sub",
    [(1, 0), (7, 0), (15, 0), (16, 16), (24, 24), (32, 32), (64, 32), (80, 80),
     (128, 32)],
)  # fmt: skip
def test_records_per_key_mode(ut, sub):
    fmt = make_format(ut)
    assert fmt.sub_tokens == sub
    h = 2
    keys = (
        [("k", (ut, h, 64)), ("k_range", (h, 128, 2)), ("k_sub", (ut // sub, h, 128))]
        if sub
        else [("k", (ut, h, 64)), ("k_meta", (ut, h, 2, 2))]
    )
    values = [("v", (ut, h, 64)), ("v_meta", (ut, h, 1, 2))]
    assert [(r.name, r.shape) for r in fmt.records] == keys + values
    assert all(r.layers is None for r in fmt.records)
    tag = "int4c-v1-" + ("kchannel" if sub else "ktoken")
    assert fmt.storage_format_tag == tag
    text = fmt.describe()
    if sub:
        assert f"4-bit sub-range codes per {sub} tokens" in text
    else:
        assert "keys per token" in text and "page_size < 16 or layer_first" in text
    assert "values rotated per head in blocks of 128" in text
    # Every record byte in exactly one zero-copy piece; objects alike in pieces.
    objs = fmt.zero_copy_objects()
    assert len(objs) == 2 and len({len(o) for o in objs}) == 1
    covered = {r.name: np.zeros(r.nbytes, int) for r in fmt.records}
    for obj in objs:
        for name, off, size in obj:
            covered[name][off : off + size] += 1
    assert all((c == 1).all() for c in covered.values())


def test_value_rotation_and_groups_per_head_dim():
    # (Dv, rotation block, group): 128-value blocks and groups where Dv allows.
    for dv, block, group in [(256, 128, 128), (128, 128, 128), (64, 64, 64),
                             (96, 32, 32), (80, 16, 80), (72, 0, 72)]:  # fmt: skip
        fmt = make_format(64, dims=(128, dv))
        assert (fmt.v_block, fmt.v_group) == (block, group)
        assert fmt.rotation_blocks == (0, block)
        assert fmt.record("v_meta").shape == (64, 2, dv // group, 2)
    assert "values NOT rotated" in make_format(64, dims=(128, 72)).describe()


def test_registry_entry():
    entry = hf.get_host_dtype("int4c")
    assert entry.mla_format is None
    assert hf.host_format_cls("int4c") is codec.Int4ChannelHostFormat
    assert "int4c" in hf.host_dtype_choices()
    cls = codec.Int4ChannelHostFormat
    assert cls.sink_page and not cls.fp8_device_kv
    assert cls.kernel_module == "sglang.kernels.ops.kvcache.kv_int4c_triton"


def test_bad_geometry_names_the_flag():
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int4c"):
        make_format(64, dims=(127, 128))
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int4c"):
        make_format(64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="key8 layer ids"):
        make_format(64, key8_layers=(-1,))


# --- the spec, independently read ------------------------------------------------


@pytest.mark.parametrize("key8", [False, True])
@pytest.mark.parametrize("ut", [16, 24, 32, 48, 64, 96])
def test_keys_are_the_spec_reading(ut, key8):
    """k, k_lo, k_range and k_sub and the restored keys are, bit for bit,
    tests/support/int4c_spec.py's: random rows with NaN/Inf/huge/zero/
    constant/tiny groups (kernel_cases.fill_rows) over one 16..31 or 48-token
    sub-unit and 32-token sub-units (96: three), 4- and 8-bit keys."""
    dtype = torch.float16 if ut % 3 == 0 else torch.bfloat16
    fmt = make_format(ut, dims=(64, 64), dtype=dtype, key8_layers=(0,) * key8)
    fmt = fmt.for_layer(0)
    x = torch.empty(3 * ut, 2, 64, dtype=dtype)
    fill_rows(x, ut, torch.randperm(3 * ut, generator=torch.manual_seed(ut))[:8])
    k = x.view(3, ut, 2, 64)
    ref = fmt.encode_reference([k, k])
    q, rng, sub, _ = spec.encode_keys(k, fmt.sub_tokens, key8)
    assert torch.equal(ref["k"], spec.pack(q >> 4 if key8 else q))
    assert ("k_lo" in ref) == key8
    if key8:
        assert torch.equal(ref["k_lo"], spec.pack(q & 15))
    assert torch.equal(ref["k_range"].view(torch.int16), rng.view(torch.int16))
    assert torch.equal(ref["k_sub"], sub)
    for out in (dtype, torch.float32):
        want = spec.decode_keys(q, rng, sub, out, key8)
        assert_same_bits(fmt.decode_reference(ref, out)[0], want)


def test_a_drifting_channel_gets_narrow_sub_ranges():
    """A channel at 0.9..1.3 over the first 32 tokens and 2..3 over the next:
    L = 0.9 rounded down to fp16, R = 2.1 rounded up; the first 32 tokens use
    sixteenths 0..4 of it (0.4 / 2.1 * 16 = 3.05), the last 8..16."""
    k = torch.zeros(1, 64, 1, 8, dtype=torch.bfloat16)
    k[0, :32, 0, 0] = torch.linspace(0.9, 1.3, 32)
    k[0, 32:, 0, 0] = torch.linspace(2.0, 3.0, 32)
    ref = make_format(64, dims=(8, 8), heads=1).encode_reference([k, k])
    low, rng = ref["k_range"][0, 0, 0].tolist()
    assert low <= 0.8984375 and rng >= 3.0 - low
    assert [(int(b) & 15, (int(b) >> 4) + 1) for b in ref["k_sub"][0, :, 0, 0]] == [
        (0, 4),
        (8, 16),
    ]


def test_eight_bit_plan_layer_round_trip_and_records():
    """A plan layer stores k_lo (q8 & 15) beside k (q8 >> 4) and restores
    within a sixteenth of the 4-bit layer's error; other layers have no k_lo
    and the same bytes as without a plan."""
    fmt = make_format(64, key8_layers=(3, 1))
    assert fmt.key8_layers == (1, 3)
    assert fmt.record("k_lo").layers == (1, 3)
    assert fmt.for_layer(0) is fmt.for_layer(2) is not fmt.for_layer(1)
    assert fmt.for_layer(1) is fmt.for_layer(3)
    assert fmt.for_layer(1).for_layer(0) is fmt.for_layer(0)
    four, eight = fmt.for_layer(0), fmt.for_layer(1)
    assert [r.name for r in four.records] == [r.name for r in make_format(64).records]
    assert [r.name for r in eight.records] == [
        "k", "k_range", "k_sub", "k_lo", "v", "v_meta"
    ]  # fmt: skip
    assert four.storage_format_tag == eight.storage_format_tag
    assert fmt.storage_format_tag == "int4c-v1-kchannel-k8l1_3"
    assert make_format(64, key8_layers=(1,)).storage_format_tag != (
        fmt.storage_format_tag
    )
    for f in (fmt, fmt.for_layer(0), fmt.for_layer(1)):
        assert "8-bit keys (k_lo, +128 B/token) on layers [1, 3]" in f.describe()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 64, 2, 128, generator=g).to(torch.bfloat16)
    err = {}
    for lf in (four, eight):
        ref = lf.encode_reference([k, k])
        restored = lf.decode_reference(ref, torch.bfloat16)
        bounds = lf.error_bound(ref, restored)
        e = (k.double() - restored[0].double()).abs()
        assert (e <= bounds[0].double()).all()
        err[lf.key_bits] = e.max().item()
    assert err[8] < err[4] / 10
    # The pool's format with a plan encodes per layer only.
    with pytest.raises(ValueError, match="for_layer"):
        fmt.encode_reference([k, k])
    plain = make_format(64)
    assert plain.for_layer(5) is plain and plain.key_bits == 4


# --- non-finite channel-units ---------------------------------------------------


@pytest.mark.parametrize("ut", [16, 64])
@pytest.mark.parametrize("bad", [NAN, INF, -INF, 70000.0, -65510.0])
@pytest.mark.parametrize("plan", [(), (0,)])
def test_nonfinite_poisons_its_channel_unit_only(plan, bad, ut):
    """A NaN/Inf key, or one past fp16's range (L or R overflows), restores NaN
    over its channel and unit (never finite) and counts once; every other key
    restores finite."""
    fmt = make_format(ut, key8_layers=plan).for_layer(0)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, ut, 2, 128, generator=g).to(torch.bfloat16)
    v = torch.randn(2, ut, 2, 128, generator=g).to(torch.bfloat16)
    k[1, 5, 1, 9] = bad
    ref = fmt.encode_reference([k, v])
    k_hat, v_hat = fmt.decode_reference(ref, torch.bfloat16)
    assert torch.isnan(k_hat[1, :, 1, 9]).all()
    k_hat[1, :, 1, 9] = 0
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    # One range stored NaN, so counted once (test_host_codecs: count == stored).
    assert int(torch.isnan(ref["k_range"][..., 0]).sum()) == 1
    assert ref["k_sub"][1, :, 1, 9].eq(0).all()


# --- why int4c: QK-normed keys ---------------------------------------------------


def qk_normed_keys(tokens=64, heads=2, d=128, seed=0):
    """Post-RoPE keys of a QK-normed model: non-centred rows (a per-channel
    mean plus noise), RMS-normalized, times a learned per-channel gain (0.1 to
    10, four channels 30, one 300, two zero pairs), then rotated by RoPE
    (base 10000), so slow channel pairs drift within a page."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=g) * 2
    x = mean + 0.1 * torch.randn(1, tokens, heads, d, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    gain = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]
    large = torch.tensor([3, 40, 70, 100])
    gain[large] = 30.0
    gain[64 + 20] = 300.0
    zero = torch.tensor([5, 5 + 64, 17, 17 + 64])
    gain[zero] = 0.0
    x = x * gain
    half = d // 2
    theta = 10000.0 ** (-torch.arange(half) / half)
    angle = torch.arange(tokens).view(1, -1, 1, 1) * theta
    a, b = x[..., :half], x[..., half:]
    x = torch.cat(
        (a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()), -1
    )
    # RoPE mixes channel c with c + d/2: both of a large or zero pair are out.
    small = torch.ones(half, dtype=torch.bool)
    small[large % half] = small[20] = small[zero % half] = False
    small = small.repeat(2)
    return x.to(torch.bfloat16), small, zero


def test_qk_normed_small_channels_keep_their_precision():
    """int4c's bound, from the math: per sub-unit j of a channel, b - a <=
    16 (mx_j - mn_j) / R + 2 (floor and ceil each widen by under one
    sixteenth), so |x - x^| <= w / 480 + slack <= (mx_j - mn_j) / 30 + R / 240
    + R 2^-17 + half an fp16 ulp of R (R rounded up) + fp32/bf16 half ulps of
    x^. Every small channel keeps it and zero channels restore exactly.
    int4's per-channel page keys (step R / 15) break it on the channels that
    drift within the page, and int4's per-token groups (the large channel's
    scale) on every small channel."""
    k, small, zero = qk_normed_keys()
    fmt = make_format(64)
    records = fmt.encode_reference([k, k])
    k_hat = fmt.decode_reference(records, torch.bfloat16)[0]
    x = k.double()
    page_rng = (x.amax(1) - x.amin(1))[0]  # [H, D]
    xs = x[0].unflatten(0, (2, 32))  # [J, S, H, D]
    sub_rng = xs.amax(1) - xs.amin(1)  # [J, H, D]
    ulps = half_ulp(k_hat[0].float(), torch.float32).double()
    ulps = ulps + half_ulp(k_hat[0].float(), torch.bfloat16).double()
    r16 = half_ulp(page_rng.float(), torch.float16).double() * 2
    bound = (sub_rng / 30 + (page_rng + r16) * (1 / 240 + 2.0**-17)).repeat_interleave(
        32, 0
    ) + ulps  # [U, H, D]
    err_c = (x[0] - k_hat[0].double()).abs()
    assert (err_c[..., small] <= bound[..., small]).all()
    assert (k_hat[..., zero] == 0).all()

    # int4: per channel over the page.
    q, meta = kv_int4_codec.encode_channels_reference(k)
    k4 = kv_int4_codec.decode_channels_reference(q, meta, torch.bfloat16)
    err_4 = (x[0] - k4[0].double()).abs()
    # Channels drifting within the page: each 32-token sub-range under 60% of
    # the page range (RoPE's slow pairs).
    drift = small & (sub_rng.amax(0) < 0.6 * page_rng)  # [H, D]
    assert drift.sum() >= 10
    broken = (err_4 > bound).any(0)[drift]
    print(
        f"\ndrift channels {int(drift.sum())}: int4 breaks the bound on {broken.float().mean():.0%}; max err int4c {err_c.amax(0)[drift].mean():.4f} vs int4 {err_4.amax(0)[drift].mean():.4f}"
    )
    assert broken.float().mean() >= 0.8, broken.float().mean()
    assert err_c.amax(0)[drift].mean() < 0.7 * err_4.amax(0)[drift].mean()

    # int4 per token (its keys below 16 tokens): one scale per 64 channels,
    # set by the large channels.
    q, meta = kv_int4_codec.encode_tokens_reference(k)
    kt = kv_int4_codec.decode_tokens_reference(q, meta, torch.bfloat16)
    err_t = (x[0] - kt[0].double()).abs()
    assert (err_t > bound).any(0)[:, small].all()
