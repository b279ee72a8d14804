"""INT4 / K8V4 kernels (kv_int4_triton) and the int4r / k8v4r butterfly under
the Triton interpreter: FP8 restores, chosen rows, bad arguments, the spec's
reading == the codec's reference (round trips: tests/test_host_kernels.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from tests.support.int4_reference import (
    FP16_NAN_BITS,
    Host,
    assert_same_records,
    raw,
    reference_decode,
    reference_records,
    spec_decode,
    spec_records,
)
from tests.support.codec_inputs import DTYPES, assert_same_bits
from tests.support.kernel_cases import sentinel_layer
from tests.support.fp8_reference import (
    FP8,
    assert_canonical_nan,
    assert_restored,
    fp8_id,
    nearest_even_fp8,
)

from sglang.kernels.ops.kvcache import kv_hadamard_triton as hr
from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.pool_host import kv_hadamard
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

NAN, INF = float("nan"), float("inf")
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]


FORMATS = ("int4", "k8v4")


# --- FP8 restores; kernel round trips of every format: test_host_kernels.py ----


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
def test_fp8_restore_rounds_every_fp16_value(fp8):
    """Every fp16 pattern as a value group's m and an INT8 key scale (scales of
    2**-24 break ties by one fp32 bit): the torch path's bytes, the nearest FP8
    (ties to even, saturated) of the exact decode, 0x7F for NaN, never Inf."""
    g = torch.Generator().manual_seed(23)
    n, D = 1 << 16, 8
    every = torch.arange(n, dtype=torch.int32).to(torch.int16).view(torch.float16)
    s = torch.where(
        torch.arange(n) % 2 == 0,
        torch.tensor(2.0**-24),
        torch.rand(n, generator=g) * 2.0 ** torch.randint(-20, 4, (n,), generator=g),
    ).half()
    records = {
        "k": torch.randint(-127, 128, (n, 1, 1, D), generator=g).to(torch.int8),
        "k_scale": every.view(n, 1, 1).clone(),
        "v": torch.randint(0, 256, (n, 1, 1, D // 2), generator=g).to(torch.uint8),
        "v_meta": torch.stack((s, every), -1).view(n, 1, 1, 1, 2),
    }
    dst = [sentinel_layer(n, 1, D, fp8) for _ in range(2)]
    idx = torch.arange(n)
    k4.decode_scatter(records, idx, dst, idx)
    exact = reference_decode("k8v4", records, torch.float32)
    want = reference_decode("k8v4", records, fp8)
    for got, x, ref in zip(dst, exact, want):
        assert_restored(got, ref.view(n, 1, D))
        assert_canonical_nan(got)
        x = x.view(n, 1, D).double()
        number = ~torch.isnan(x)  # +-Inf (from an Inf m or scale) saturates
        assert torch.equal(torch.isnan(got.float()), ~number)
        assert torch.isfinite(got.float()[number]).all()
        assert torch.equal(got.double()[number], nearest_even_fp8(x[number], fp8))


# --- chosen rows: ties, exact grids, special metadata ---------------------------


def encode_rows(fmt, k, v, ut):
    """k, v [n, H, D] (one layer, n a multiple of ut) through the kernels:
    returns (host records [units, *shape] as the kernel wrote them, the
    reference's, non-finite count, reference count)."""
    n, H, dk = k.shape
    units = n // ut
    host = Host(fmt, units, 1, ut, H, dk, v.shape[2])
    counter = torch.zeros((), dtype=torch.int64)
    idx = torch.arange(n)
    k4.encode_gather(
        (k4.DeviceLayerTable([k]), k4.DeviceLayerTable([v])), idx,
        host.all_layers(), idx, counters=KVCounters(nonfinite=counter),
    )  # fmt: skip
    want, bad, _ = reference_records(
        fmt, k.view(units, ut, H, dk), v.view(units, ut, H, -1)
    )
    return host.layer(0), want, int(counter), bad


def check_rows(fmt, k, v, ut):
    got, want, count, want_count = encode_rows(fmt, k, v, ut)
    for name in want:
        assert torch.equal(raw(got[name]), raw(want[name])), name
    assert count == want_count
    n, H, dk = k.shape
    for out_dtype in DTYPES:
        k_dst = torch.full_like(k, 7.0, dtype=out_dtype)
        v_dst = torch.full_like(v, 7.0, dtype=out_dtype)
        idx = torch.arange(n)
        k4.decode_scatter(got, idx, (k_dst, v_dst), idx)
        k_ref, v_ref = reference_decode(fmt, want, out_dtype)
        assert_same_bits(k_dst, k_ref.reshape(k_dst.shape))
        assert_same_bits(v_dst, v_ref.reshape(v_dst.shape))
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ut", (1, 16))
def test_round_half_to_even_ties_and_exact_grid(dtype, ut):
    """Codes k * s + s / 2 (ties: even neighbour), k * s (exact: decode
    gives x back) at power-of-two scales, from fp16 subnormal to large."""
    rows = []
    for log2_s in (-24, -18, -3, 0, 4):
        s = 2.0**log2_s
        grid = torch.arange(16, dtype=torch.float64).repeat(4)  # 0..15: m = 0
        ties = grid.clone()
        ties[16:] += ((ties[16:] > 0) & (ties[16:] < 15)) * 0.5  # first 16 pin s
        rows += [grid * s, ties * s, (grid - 8) * s]
    x = torch.stack(rows).to(dtype)  # [15, 64]
    n = ut * ((len(rows) + ut - 1) // ut)
    x = torch.cat([x, x[: n - len(rows)]])[:, None, :].contiguous()
    got = check_rows("int4", x, x, ut)
    if ut == 1:  # per-token: the grid's codes are exactly k
        codes = got["v"].view(n, 32)
        q = torch.stack([codes & 15, codes >> 4], -1).view(n, 64).long()
        assert torch.equal(q[0], torch.arange(16).repeat(4))
        k = torch.arange(16).repeat(4)
        tie = (torch.arange(64) >= 16) & (k > 0) & (k < 15)
        assert torch.equal(q[1], torch.where(tie, k + k % 2, k))  # half to even


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_groups_non_finite(fmt):
    """Every group NaN/Inf: all metadata NaN, codes 0, amax stays 0."""
    x = torch.full((16, 2, 64), NAN, dtype=torch.bfloat16)
    x[::2] = INF
    host = Host(fmt, 1, 1, 16, 2, 64, 64)
    counter = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros(1, 2)
    idx = torch.arange(16)
    table = k4.DeviceLayerTable([x])
    k4.encode_gather(
        (table, table), idx, host.all_layers(), idx,
        counters=KVCounters(counter, amax),
    )  # fmt: skip
    rec = host.layer(0)
    groups = {"int4": 2 * 64 + 16 * 2, "k8v4": 16 * 2 + 16 * 2}[fmt]
    assert int(counter) == groups
    assert (amax == 0).all()
    assert (rec["v"] == 0).all() and (raw(rec["v_meta"]) == FP16_NAN_BITS).all()


def test_decode_special_metadata():
    """Decode alone over chosen (s, m): NaN in either, fp16 overflow of
    m + 15 s (saturates), subnormal s, -0 and huge m."""
    g = torch.Generator().manual_seed(4)
    n, H, D = 12, 2, 64
    codes = torch.randint(0, 256, (n, 1, H, D // 2), generator=g).to(torch.uint8)
    meta = torch.rand(n, 1, H, 1, 2, generator=g).half()
    meta[0, ..., 0] = NAN
    meta[1, ..., 1] = NAN
    meta[2] = 65504.0  # m + 15 s > fp16 max
    meta[3, ..., 0] = 2.0**-24
    meta[4, ..., 1] = -0.0
    meta[5, ..., 1] = -65504.0
    meta[6, ..., 0] = 4096.0
    records = {"k": codes, "k_meta": meta, "v": codes, "v_meta": meta}
    for out_dtype in DTYPES:
        dst = [torch.full((n, H, D), 7.0, dtype=out_dtype) for _ in range(2)]
        idx = torch.arange(n)
        k4.decode_scatter(records, idx, dst, idx)
        k_ref, v_ref = reference_decode("int4", records, out_dtype)
        assert_same_bits(dst[0], k_ref.view(n, H, D))
        assert_same_bits(dst[1], v_ref.view(n, H, D))
        assert torch.isnan(dst[0][:2]).all()
        if out_dtype == torch.float16:
            assert dst[0][2].abs().max() == 65504.0


# --- bad arguments; refused host indices: test_host_kernels.py ----------------


def test_bad_arguments_fail_before_launch():
    g = torch.Generator().manual_seed(16)
    rows = [
        [torch.randn(32, 2, 64, generator=g).bfloat16() for _ in "LL"] for _ in "KV"
    ]
    tables = tuple(k4.DeviceLayerTable(side) for side in rows)
    host = Host("int4", 3, 2, 16, 2, 64, 64)
    out = host.all_layers()
    idx = torch.arange(24)
    before = host.clone()
    with pytest.raises(ValueError, match="whole units"):
        k4.encode_gather(tables, idx, out, idx)
    with pytest.raises(ValueError, match="records must be"):
        k4.encode_gather(tables, idx[:16], {"k": out["k"]}, idx[:16])
    with pytest.raises(ValueError, match="k_meta"):
        bad_meta = dict(out, k_meta=out["k_meta"][..., 0])
        k4.encode_gather(tables, idx[:16], bad_meta, idx[:16])
    with pytest.raises(ValueError, match="layers"):
        k4.encode_gather(tables, idx[:16], out, idx[:16], first_layer=1)
    with pytest.raises(TypeError, match="int32/int64"):
        k4.encode_gather(tables, idx[:16].float(), out, idx[:16])
    with pytest.raises(ValueError, match="counters.amax"):
        k4.encode_gather(
            tables, idx[:16], out, idx[:16],
            counters=KVCounters(amax=torch.zeros(3, 2)),
        )  # fmt: skip
    with pytest.raises(ValueError, match="even head dim"):
        odd = torch.zeros(16, 2, 63, dtype=torch.bfloat16)
        k4.decode_scatter(host.layer(0), idx[:16], (odd, odd), idx[:16])
    assert_same_records(host, before)


# --- the codec's reference, its fast path and the kernels agree -----------------


def zero_groups(dtype):
    """Rows whose minimum is a zero: all -0, -0 and +0 mixed (either may be
    min's result), zeros with positives; and tiny negatives rounding to -0."""
    rows = [
        torch.full((64,), -0.0),
        torch.tensor([-0.0, 0.0] * 32),
        torch.tensor([0.0, -0.0] * 32),
        torch.cat([torch.tensor([-0.0, 0.0]), torch.rand(62) * 3]),
        torch.cat([torch.tensor([-1e-9]), torch.rand(63)]),
    ]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_spec_reading_codec_reference_and_fast_path_agree(dtype):
    """The codec's reference == this test's own reading of the spec == the
    codec's fast path (encode_into), on random, special and zero-minimum
    groups, both key groupings and both formats."""
    g = torch.Generator().manual_seed(8)
    for fmt, ut in (("int4", 16), ("int4", 1), ("k8v4", 16)):
        x = (torch.randn(2 * ut * 2, 2, 64, generator=g) * 5).to(dtype)
        z = zero_groups(dtype)
        x.view(-1, 64)[: len(z)] = z
        x.view(-1, 64)[len(z), 3] = NAN
        x.view(-1, 64)[len(z) + 1, 0] = -INF
        k = x[: 2 * ut].reshape(2, ut, 2, 64)
        v = x[2 * ut :].reshape(2, ut, 2, 64)
        want, bad, stats = reference_records(fmt, k, v)
        mine, _, _ = spec_records(fmt, k, v)
        fast = {n: torch.empty_like(t) for n, t in want.items()}
        encode_into = (
            codec.int4_encode_into if fmt == "int4" else codec.k8v4_encode_into
        )
        amax, nonfinite = encode_into(k, v, fast)
        # The spec's statistics (the kernel tests' expectation) are the fast path's.
        assert int(nonfinite) == bad > 0 and amax.tolist() == stats
        for name in want:
            assert torch.equal(raw(mine[name]), raw(want[name])), (fmt, ut, name)
            assert torch.equal(raw(fast[name]), raw(want[name])), (fmt, ut, name)
        for out_dtype in DTYPES:
            for a, b in zip(
                spec_decode(fmt, want, out_dtype),
                reference_decode(fmt, want, out_dtype),
            ):
                assert_same_bits(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_minimum_stores_plus_zero(dtype):
    """A group whose minimum is a zero (of either sign, or a negative that
    rounds to zero) stores m = +0 in kernel, codec reference and fast path."""
    z = zero_groups(dtype)
    x = torch.cat([z, z[:3]])[:, None, :].repeat(2, 1, 1)  # 16 tokens, 1 head
    for ut in (1, 16):
        got = check_rows("int4", x.contiguous(), x.contiguous(), ut)
        m = raw(got["v_meta"])[..., 1].flatten()[: len(z)]
        assert (m == 0).all()


# --- the butterfly alone, in fp32 ---------------------------------------------


@triton.jit
def _rotate_rows(x_ptr, sign_ptr, y_ptr, R: tl.constexpr, D: tl.constexpr,
                 D_PAD: tl.constexpr, B: tl.constexpr, DECODE: tl.constexpr):  # fmt: skip
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, D_PAD)[None, :]
    mask = (c < D) & (r >= 0)
    x = tl.load(x_ptr + r * D + c, mask=mask, other=0.0)
    signs = tl.load(sign_ptr + c, mask=c < D, other=0.0)
    if DECODE:
        y = hr.unrotate(x, signs, B)
    else:
        y = hr.rotate(x, signs, B)
    tl.store(y_ptr + r * D + c, y, mask=mask)


@pytest.mark.parametrize("dim", (16, 64, 128, 256, 96, 80), ids=lambda d: f"d{d}")
def test_butterfly_is_the_reference_bit_for_bit(dim):
    """kv_hadamard_triton.rotate/unrotate on fp32 rows whose channels mix
    magnitudes 2**-30..2**30 (so the sums round and the stage order shows),
    with -0, NaN and Inf: the bits of kv_hadamard's reference."""
    g = torch.Generator().manual_seed(dim)
    rows = 8
    mags = 2.0 ** torch.randint(-30, 30, (rows, dim), generator=g).float()
    x = torch.randn(rows, dim, generator=g) * mags
    x[1] = -0.0
    x[2, dim // 2] = NAN
    x[3, 1] = INF
    x[4] = x[4].round()  # exact sums: ties and zeros of both signs
    block = kv_hadamard.rotation_block(dim)
    signs = kv_hadamard.rotation_signs(dim)
    for decode, reference in (
        (False, kv_hadamard.rotate_reference),
        (True, kv_hadamard.unrotate_reference),
    ):
        y = torch.full_like(x, 7.0)
        _rotate_rows[(1,)](x, signs, y, rows, dim, k4.hk.pow2(dim), block, decode)
        want = reference(x, block)
        assert torch.equal(torch.isnan(y), torch.isnan(want))
        assert torch.equal(
            y.nan_to_num(0).view(torch.int32), want.nan_to_num(0).view(torch.int32)
        ), "decode" if decode else "encode"


def test_rotation_arguments_checked():
    fmt = host_format_cls("int4r", "mha")((64, 64), 1, 16, torch.bfloat16)
    host = Host("int4", 2, 1, 16, 1, 64, 64)
    rows = [torch.zeros(16, 1, 64, dtype=torch.bfloat16)]
    tables = (k4.DeviceLayerTable(rows), k4.DeviceLayerTable(rows))
    idx = torch.arange(16)
    signs = kv_hadamard.rotation_signs(64)
    with pytest.raises(ValueError, match="rotation block 48"):
        k4.encode_gather(tables, idx, host.all_layers(), idx,
                         rotation_blocks=(48, 0), rotation_signs=signs)  # fmt: skip
    with pytest.raises(ValueError, match="rotation_signs must be"):
        k4.decode_scatter(host.layer(0), idx, (rows[0], rows[0]), idx,
                          rotation_blocks=(64, 64), rotation_signs=signs[:32])  # fmt: skip
    k8 = Host("k8v4", 2, 1, 16, 1, 64, 64)
    with pytest.raises(ValueError, match="INT8 keys"):
        k4.encode_gather(tables, idx, k8.all_layers(), idx,
                         rotation_blocks=(64, 64), rotation_signs=signs)  # fmt: skip
    assert fmt.fused_available(torch.device("cpu"))
