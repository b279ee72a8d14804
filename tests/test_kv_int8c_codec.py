"""int8c host format (pool_host/kv_int8c_codec.py): records per key mode, fast
path == reference bit for bit, the error bound, non-finite groups, bytes per
token, and why it exists: QK-normed keys keep their small channels."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.pool_host import host_format as hf
from sglang.srt.mem_cache.pool_host import kv_int8_codec
from sglang.srt.mem_cache.pool_host import kv_int8c_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import half_ulp
from tests.support.codec_inputs import DTYPES, assert_same_bits, make_units

NAN, INF = float("nan"), float("inf")
# Row magnitudes (log2): subnormal-ish to past the fp16 meta range for bf16.
MAGS = {
    torch.bfloat16: [-130, -20, -3, 0, 5, 12, 24],
    torch.float16: [-20, -3, 0, 5, 12],
}


def make_format(unit_tokens, dims=(128, 128), heads=2, dtype=torch.bfloat16):
    return hf.host_format_cls("int8c")(dims, heads, unit_tokens, dtype)


# --- records and bytes -------------------------------------------------------


@pytest.mark.parametrize(
    "unit_tokens,per_channel",
    [(1, False), (16, False), (63, False), (64, True), (128, True)],
)
def test_records_per_key_mode(unit_tokens, per_channel):
    fmt = make_format(unit_tokens, dims=(128, 96), heads=3)
    ut = unit_tokens
    assert codec.keys_per_channel(ut) is per_channel
    if per_channel:
        keys = [
            ("k", (ut, 3, 128), torch.uint8),
            ("k_meta", (3, 128, 2), torch.float16),
        ]
        tag, mode = "int8c-v1-kchannel", "keys per channel over"
    else:
        keys = [("k", (ut, 3, 128), torch.int8), ("k_scale", (ut, 3, 4), torch.float16)]
        tag, mode = "int8c-v1-ktoken", f"units of {ut} token(s) < 64"
    values = [("v", (ut, 3, 96), torch.int8), ("v_scale", (ut, 3), torch.float16)]
    assert [(r.name, r.shape, r.dtype) for r in fmt.records] == keys + values
    assert fmt.keys_per_channel is per_channel
    assert fmt.storage_format_tag == tag
    assert mode in fmt.describe()
    # Two zero-copy objects (keys + their meta, values + their scales) that
    # cover every record byte once.
    objects = fmt.zero_copy_objects()
    assert [[p[0] for p in o] for o in objects] == [
        [keys[0][0], keys[1][0]],
        ["v", "v_scale"],
    ]
    for obj in objects:
        for name, offset, nbytes in obj:
            assert offset == 0 and nbytes == fmt.record(name).nbytes
    assert fmt.kernel_module == "sglang.kernels.ops.kvcache.kv_int8c_triton"


def test_key_groups_of_a_head_dim_not_divisible_by_32():
    fmt = make_format(1, dims=(72, 72))
    assert fmt.record("k_scale").shape == (1, 2, 1)
    assert "groups of 72 channels" in fmt.describe()


def test_registry_entry():
    entry = hf.get_host_dtype("int8c")
    assert entry.mla_format is None
    assert "int8c" in hf.host_dtype_choices()
    with pytest.raises(NotImplementedError, match="does not support MLA"):
        hf.host_format_cls("int8c", "mla")


# --- fast path == reference, the bound, non-finite groups ---------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_channel_spec(dtype):
    """The key groups are int4's math at 8 bits: m = fp16(min), s = (max - m)/255
    rounded up to fp16, codes 0..255 by round-half-even."""
    x = make_units(5, (2, 64, 2, 64), dtype, ["gauss", "shifted", "heavy"], [0, 3, -6])
    fmt = make_format(64, (64, 64), dtype=dtype)
    rec = fmt.encode_reference([x, x])
    xd = x.double()
    lo, hi = xd.amin(1), xd.amax(1)
    m = rec["k_meta"][..., 1].double()
    s = rec["k_meta"][..., 0].double()
    assert torch.equal(m, lo.to(torch.float16).double())
    a = (hi - m) / 255
    assert (s >= a * (1 - 2.0**-23)).all() and (
        s <= a * (1 + 2.0**-10) + 2.0**-24
    ).all()
    q = torch.round((xd - m.unsqueeze(1)) / s.unsqueeze(1)).clamp(0, 255)
    assert torch.equal(rec["k"].double(), q)
    assert rec["k"].max() == 255


def test_per_token_keys_are_int8_rows_of_32_channels():
    x = make_units(6, (2, 16, 2, 128), torch.bfloat16, ["spike", "gauss"], [0, 4])
    rec = make_format(16).encode_reference([x, x])
    q, scale = kv_int8_codec.quantize_reference(x.unflatten(-1, (4, 32)))
    assert torch.equal(rec["k"], q.flatten(-2))
    assert_same_bits(rec["k_scale"], scale)
    q_v, scale_v = kv_int8_codec.quantize_reference(x)
    assert torch.equal(rec["v"], q_v)
    assert_same_bits(rec["v_scale"], scale_v)


@pytest.mark.parametrize("unit_tokens", [1, 64])
@pytest.mark.parametrize(
    "bad",
    [NAN, INF, -INF, "range", "min"],
    ids=["nan", "inf", "-inf", "scale_overflow", "zero_point_overflow"],
)
def test_nonfinite_poisons_only_its_group(unit_tokens, bad):
    """A key group holding NaN/Inf, or whose (s, m) leave fp16, restores as NaN
    (a per-channel group: that channel over the page; a per-token one: its 32
    channels of that token); every other element stays finite."""
    fmt = make_format(unit_tokens, (64, 64))
    k = torch.randn(2, unit_tokens, 2, 64).to(torch.bfloat16)
    v = torch.randn(2, unit_tokens, 2, 64).to(torch.bfloat16)
    t, h, c = unit_tokens - 1, 1, 37
    if bad == "range":  # (hi - m)/255 > 65504 for the group
        k[1, t, h, c], k[1, 0, h, c ^ 1 if unit_tokens == 1 else c] = 1e7, -1e7
    elif bad == "min":  # fp16(min) overflows
        k[1, t, h, c] = -1e6
    else:
        k[1, t, h, c] = bad
    records = fmt.encode_reference([k, v])  # == the fast path: test_host_codecs.py
    stats = fmt.encode_into(
        [k, v], {n: torch.empty_like(t) for n, t in records.items()}
    )
    k_hat, v_hat = fmt.decode_reference(records, torch.bfloat16)
    expect = torch.zeros_like(k_hat, dtype=torch.bool)
    if unit_tokens >= 64:
        expect[1, :, h, c] = True
    else:
        expect[1, t, h, 32:64] = True
    if bad == "min" and unit_tokens == 1:
        # A symmetric row scale of 1e6/127 is still finite fp16: int8 rows
        # encode it, like per-head int8.
        expect[:] = False
    assert torch.equal(torch.isnan(k_hat), expect)
    assert not torch.isnan(v_hat).any()
    assert int(stats.nonfinite) == int(expect.any())
    if expect.any():
        meta = records.get("k_meta", records.get("k_scale"))
        assert torch.isnan(meta).any() and (records["k"][expect] == 0).all()


def test_bad_input_names_the_codec():
    fmt = make_format(64, (64, 64))
    x = torch.zeros(1, 64, 2, 64, dtype=torch.int32)
    with pytest.raises(TypeError, match="kv_int8c_codec"):
        fmt.encode_reference([x, x])
    with pytest.raises(ValueError, match="units, unit_tokens, heads, dim"):
        fmt.encode_reference([x[0].bfloat16(), x[0].bfloat16()])


# --- why: QK-normed keys ------------------------------------------------------


def qk_normed_keys(tokens=64, heads=2, d=128, seed=0):
    """RMS-normalized key rows times a learned per-channel gain spanning 100x,
    with a few channels 30x larger still and some exactly zero (gain 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, heads, d, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    gain = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]
    large = torch.randperm(d, generator=g)[:4]
    gain[large] = 300.0
    zero = torch.tensor([5, 17, 90])
    gain[zero] = 0.0
    return (x * gain).to(torch.bfloat16), large, zero


def test_qk_normed_small_channels_keep_their_precision():
    """Per channel, every channel's error is within 1/255 of its own range
    plus half an fp16 and a bf16 ulp of its magnitude (the zero point's and
    the restore's rounding), and zero channels restore exactly; per-head int8
    loses over a tenth of a small channel's range."""
    k, large, zero = qk_normed_keys()
    fmt = make_format(64)
    records = fmt.encode_reference([k, k])
    k_hat = fmt.decode_reference(records, torch.bfloat16)[0]
    x = k.double()
    err = (x - k_hat.double()).abs().amax(1)  # per (head, channel)
    rng = x.amax(1) - x.amin(1)
    mag = x.abs().amax(1).float()
    slack = half_ulp(mag, torch.float16) + half_ulp(mag, torch.bfloat16)
    assert (err <= rng / 255 + slack.double()).all()
    assert (k_hat[..., zero] == 0).all()

    q, scale = kv_int8_codec.quantize_reference(k)
    per_head = x - kv_int8_codec.dequantize_reference(q, scale, k.dtype).double()
    per_head = per_head.abs().amax(1)
    small = torch.ones(k.shape[-1], dtype=torch.bool)
    small[large] = False
    small[zero] = False
    # The 20 smallest channels by gain: per-head int8's step is set by the
    # large channels, a large fraction of theirs.
    smallest = rng[..., small].argsort(-1)[..., :20]
    frac_int8 = per_head[..., small].gather(-1, smallest) / rng[..., small].gather(
        -1, smallest
    )
    frac_int8c = err[..., small].gather(-1, smallest) / rng[..., small].gather(
        -1, smallest
    )
    assert (frac_int8 > 0.1).all()
    assert (frac_int8c <= 1 / 255 + 2.0**-7).all()
