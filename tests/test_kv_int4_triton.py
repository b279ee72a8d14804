"""Fused INT4 / K8V4 host-format kernels (kernels/ops/kvcache/kv_int4_triton.py)
under the Triton interpreter (TRITON_INTERPRET=1), against the format
module's reference (kv_int4_codec, via tests/support/int4_reference.py): every
record byte and every restored bit (NaN: position, and the canonical NaN
the kernels write), bf16 and fp16, page-major units of 1/4/16/64 tokens
and layer_first-shaped views, shuffled and fragmented indices, NaN/Inf/huge/
zero groups, out-of-range host indices (counted, not written), int32 and
int64 indices, and the statistics (non-finite groups, amax per layer/side).
FP8 device KV (E4M3FN, E5M2: float8 views of uint8 storage, as SGLang keeps
it): the same round trips restoring the reference's FP8 bytes, and the
fp32 -> FP8 rounding of every fp16 value as a decode's m or INT8 scale,
against the torch path and an independent rounding over FP8's grid.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.int4_reference import (
    FP16_NAN_BITS,
    K_CHANNEL_MIN_TOKENS,
    Host,
    assert_same_records,
    raw,
    reference_decode,
    reference_records,
    spec_decode,
    spec_records,
)
from tests.support.codec_inputs import DTYPES, assert_same_bits
from tests.support.fp8_reference import (
    FP8,
    FP8_NAN_BYTE,
    fp8_id,
    nearest_even_fp8,
    random_finite_fp8,
)

from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec

NAN, INF = float("nan"), float("inf")
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]


def fill_rows(x: torch.Tensor, seed: int, special_rows: torch.Tensor | None):
    """Random rows over magnitudes; NaN/Inf/huge/zero/-0/constant/tiny groups
    in the special rows (8 device slots) if given."""
    g = torch.Generator().manual_seed(seed)
    n, H, D = x.shape
    mags = 2.0 ** torch.randint(-12, 8, (n, H, 1), generator=g).double()
    vals = torch.randn(n, H, D, generator=g, dtype=torch.float64) * mags
    vals[:, :, 3] *= 20  # an outlier channel, as keys have
    x.copy_(vals.to(x.dtype))
    if special_rows is None:
        return
    r = special_rows.tolist()
    x[r[1], 0, 5] = NAN
    x[r[2], H - 1, D - 1] = INF
    x[r[3], 0, 0] = -INF
    x[r[4], 0] = 0.0
    x[r[5], 0] = -0.0
    x[r[6], 0] = 1.5  # constant group: m rounds to the value, s to the floor
    x[r[7], 0, : D // 2] = 7e4 if x.dtype == torch.bfloat16 else 6.5e4  # huge
    x[r[0], H - 1] = 2.0**-20  # tiny: fp16 subnormal m and s


def assert_canonical_nan(t: torch.Tensor) -> None:
    """NaN groups restore as one NaN pattern per dtype (fp16 0x7E00, bf16
    0x7FC0, FP8 0x7F): torch's own arithmetic leaves the payload to the CPU's
    vector unit, the kernels do not."""
    if t.dtype in FP8:
        nan = torch.isnan(t.float())
        assert (t.view(torch.uint8)[nan] == FP8_NAN_BYTE).all()
        return
    canonical = 0x7E00 if t.dtype == torch.float16 else 0x7FC0
    assert (raw(t)[torch.isnan(t)] == canonical).all()


def device_layer(size, H, D, dtype, seed, special_rows):
    """A device layer of fill_rows' rows; FP8 as SGLang holds it (its values
    rounded to FP8, NaN/Inf kept), every other row uniformly random finite
    FP8 bytes."""
    if dtype not in FP8:
        x = torch.empty(size, H, D, dtype=dtype)
        fill_rows(x, seed, special_rows)
        return x
    x = torch.empty(size, H, D)
    fill_rows(x, seed, special_rows)
    x = x.to(dtype)
    keep = torch.ones(size, dtype=torch.bool)
    if special_rows is not None:
        keep[special_rows] = False
    odd = keep & (torch.arange(size) % 2 == 1)
    gen = torch.Generator().manual_seed(seed)
    x.view(torch.uint8)[odd] = random_finite_fp8(
        (int(odd.sum()), H, D), dtype, gen
    ).view(torch.uint8)
    return x


def sentinel_layer(size, H, D, dtype) -> torch.Tensor:
    """A device layer of 7.0 (the restore must leave other slots alone)."""
    return torch.full((size, H, D), 7.0).to(dtype)


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


# --- kernel round trips ----------------------------------------------------------


@pytest.fixture
def big_tiles(monkeypatch):
    """Fewer, larger programs (the interpreter's cost is per program)."""
    monkeypatch.setattr(k4, "ENCODE_TILE", 16384)
    monkeypatch.setattr(k4, "DECODE_TILE", 16384)


def run_case(
    fmt, *, ut, H=2, dk=64, dv=64, layers=2, n_units=3, dtype=torch.bfloat16,
    layer_first=False, index_dtype=torch.int64, specials=True, token_shuffle=False,
    tile=None, seed=0,
):  # fmt: skip
    """Backup n_units units of shuffled device rows into fragmented host units
    with one encode_gather, compare with the reference; then restore each layer
    into shuffled device slots with decode_scatter and compare."""
    g = torch.Generator().manual_seed(seed)
    size = 2 * n_units * ut + 8
    n = n_units * ut
    dev = torch.randperm(size, generator=g)[:n]
    widths = [dk] * layers + [dv] * layers
    rows = [
        device_layer(
            size, H, d, dtype, seed * 31 + i,
            dev[(torch.arange(8) * 7 + i) % n] if specials else None,
        )
        for i, d in enumerate(widths)
    ]  # fmt: skip
    k_layers, v_layers = rows[:layers], rows[layers:]
    host_units = 2 * n_units + 1
    units = torch.randperm(host_units, generator=g)[:n_units]  # gaps, jumps
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    if token_shuffle:  # per-token formats take any token order
        perm = torch.randperm(n, generator=g)
        host_idx = host_idx[perm]
    host = Host(fmt, host_units, layers, ut, H, dk, dv, layer_first)
    want = host.clone()
    counter = torch.zeros((), dtype=torch.int64)
    bad_idx = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros(layers, 2)
    k4.encode_gather(
        (k4.DeviceLayerTable(k_layers), k4.DeviceLayerTable(v_layers)),
        dev.to(index_dtype), host.all_layers(), host_idx.to(index_dtype),
        counters=KVCounters(counter, amax, bad_idx), tile=tile,
    )  # fmt: skip

    # Expected: the reference per unit of the transfer's rows.
    order = torch.argsort(host_idx)  # tokens sorted by host slot
    dev_sorted = dev[order]
    slots = host_idx[order].view(n_units, ut)
    sorted_units = slots[:, 0] // ut
    want_bad, want_amax = want.fill_reference(
        k_layers, v_layers, dev_sorted, sorted_units
    )
    assert_same_records(host, want)
    assert int(counter) == want_bad
    assert int(bad_idx) == 0
    assert torch.equal(amax, want_amax)
    if specials:
        assert want_bad > 0

    # Restore every layer into other slots, shuffled; untouched slots keep 7.
    # FP8 records restore to that FP8 dtype, as the pools restore them.
    for out_dtype in (dtype,) if dtype in FP8 else DTYPES:
        new_dev = torch.randperm(size, generator=g)[:n]
        for layer in range(layers):
            k_dst = sentinel_layer(size, H, dk, out_dtype)
            v_dst = sentinel_layer(size, H, dv, out_dtype)
            k4.decode_scatter(
                host.layer(layer), host_idx.to(index_dtype), (k_dst, v_dst),
                new_dev.to(index_dtype), bad_index_counter=bad_idx, tile=tile,
            )  # fmt: skip
            layer_records = {
                name: rec[sorted_units] for name, rec in host.layer(layer).items()
            }
            k_ref, v_ref = reference_decode(fmt, layer_records, out_dtype)
            rows = new_dev[order]
            assert_restored(k_dst[rows], k_ref.reshape(n, H, dk))
            assert_restored(v_dst[rows], v_ref.reshape(n, H, dv))
            if fmt == "int4":
                assert_canonical_nan(k_dst)
            assert_canonical_nan(v_dst)
            untouched = torch.ones(size, dtype=torch.bool)
            untouched[new_dev] = False
            for dst in (k_dst, v_dst):
                assert (dst[untouched].float() == 7.0).all()
    assert int(bad_idx) == 0
    return host


FORMATS = ("int4", "k8v4")


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ut", (1, 16, 64))
def test_round_trip_page_sizes(fmt, ut, dtype):
    run_case(fmt, ut=ut, dtype=dtype, n_units=3 if ut > 1 else 24, seed=ut)


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_layer_first_views_and_index_dtypes(fmt, index_dtype):
    run_case(
        fmt, ut=1, layer_first=True, n_units=16, index_dtype=index_dtype,
        dtype=torch.float16, seed=5,
    )  # fmt: skip


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_token_keys_any_token_order(fmt):
    """Below 16 tokens per unit keys are per token: host slots in any order."""
    run_case(fmt, ut=4, n_units=4, token_shuffle=True, seed=2)


@pytest.mark.parametrize(
    "dk,dv,H", [(128, 128, 1), (96, 96, 3), (80, 48, 2), (192, 128, 1)]
)
def test_head_dims_and_groups(dk, dv, H):
    """Groups of 64, 32 and whole heads (80, 48: not a multiple of 32), head
    dims that aren't powers of two, per-channel keys split into channel
    blocks by a small tile."""
    run_case("int4", ut=16, H=H, dk=dk, dv=dv, n_units=2, layers=1, tile=512, seed=dk)
    run_case("int4", ut=2, H=H, dk=dk, dv=dv, n_units=3, layers=1, seed=dv)


def test_small_tiles_split_rows():
    """Small tiles: many programs, rows and channel blocks split differently."""
    run_case("int4", ut=16, n_units=2, layers=1, tile=256, seed=9)
    run_case("k8v4", ut=4, n_units=3, layers=1, tile=128, seed=9)


# --- FP8 device KV ---------------------------------------------------------------


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "ut,layer_first", [(1, True), (4, False), (16, False), (64, False)]
)
def test_fp8_round_trip(fmt, ut, layer_first, fp8):
    """FP8 rows (every finite byte, NaN, E5M2's Inf, values rounded to FP8)
    encode to the reference's records and restore to its FP8 bytes, every
    key grouping and unit size, page-major and layer_first views."""
    run_case(
        fmt, ut=ut, dtype=fp8, layer_first=layer_first,
        n_units=16 if ut == 1 else 3, seed=ut + 100 * layer_first,
    )  # fmt: skip


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
def test_fp8_restore_rounds_every_fp16_value(fp8):
    """Every fp16 pattern as a value group's m and as an INT8 key scale, with
    random codes and scales (2**-24: ties broken by one fp32 bit): the
    kernels' integer fp32 -> FP8 conversion gives the torch path's bytes,
    the nearest FP8 value (ties to even, saturated) of the exact fp32
    decode, 0x7F for NaN, and never Inf (+-Inf saturates, as on the torch
    path)."""
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


# --- host indices outside the records, malformed runs, bad arguments ------------


def small_setup(fmt, ut, n_units=2, H=2, D=64, layers=2):
    g = torch.Generator().manual_seed(ut)
    n = n_units * ut
    k = [torch.randn(n, H, D, generator=g).bfloat16() for _ in range(layers)]
    v = [torch.randn(n, H, D, generator=g).bfloat16() for _ in range(layers)]
    host = Host(fmt, n_units + 1, layers, ut, H, D, D)
    tables = (k4.DeviceLayerTable(k), k4.DeviceLayerTable(v))
    return tables, k, v, host


@pytest.mark.parametrize("fmt,ut", [("int4", 16), ("int4", 4), ("k8v4", 16)])
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_out_of_range_host_indices_are_counted_not_written(fmt, ut, index_dtype):
    tables, k, v, host = small_setup(fmt, ut)
    n_host = 3 * ut
    host_idx = torch.arange(2 * ut)  # units 0 and 1
    host_idx[ut + 1] = n_host  # one token of unit 1 past the end
    host_idx[ut + 2] = -1
    before = host.clone()
    bad = torch.zeros((), dtype=torch.int64)
    k4.encode_gather(
        tables, torch.arange(2 * ut).to(index_dtype), host.all_layers(),
        host_idx.to(index_dtype), counters=KVCounters(bad_indices=bad),
    )  # fmt: skip
    per_channel = fmt == "int4" and ut >= K_CHANNEL_MIN_TOKENS
    # Per-channel keys: unit 1's run is broken, so none of its tokens is
    # fully written; per-token formats lose only the two tokens.
    assert int(bad) == (ut if per_channel else 2)
    unit0 = Host(fmt, 1, 2, ut, 2, 64, 64)
    k4.encode_gather(
        (k4.DeviceLayerTable([t[:ut] for t in k]), k4.DeviceLayerTable([t[:ut] for t in v])),
        torch.arange(ut), unit0.all_layers(), torch.arange(ut),
    )  # fmt: skip
    for name, buf in host.bufs.items():
        assert torch.equal(raw(buf[0]), raw(unit0.bufs[name][0])), name  # unit 0 done
        assert torch.equal(raw(buf[2]), raw(before.bufs[name][2])), name  # untouched
    key_unit1 = raw(host.bufs["k"][1])
    if per_channel:
        assert torch.equal(key_unit1, raw(before.bufs["k"][1]))
        assert torch.equal(raw(host.bufs["k_meta"][1]), raw(before.bufs["k_meta"][1]))
    else:
        sentinel = raw(before.bufs["k"][1])
        if ut > 1:
            assert torch.equal(key_unit1[:, 1:3], sentinel[:, 1:3])  # never written
            assert not torch.equal(key_unit1[:, 0], sentinel[:, 0])

    # Restore: the bad tokens keep their device rows and are counted.
    bad.zero_()
    dst = [torch.full((2 * ut, 2, 64), 7.0, dtype=torch.bfloat16) for _ in range(2)]
    k4.decode_scatter(
        host.layer(0), host_idx.to(index_dtype), dst,
        torch.arange(2 * ut).to(index_dtype), bad_index_counter=bad,
    )  # fmt: skip
    assert int(bad) == 2
    assert (dst[0][ut + 1 : ut + 3] == 7.0).all() and (
        dst[1][ut + 1 : ut + 3] == 7.0
    ).all()
    assert not (dst[0][:ut] == 7.0).any()


def test_per_channel_run_out_of_order_writes_no_keys():
    """Per-channel keys need each run of UT tokens to be one unit in order."""
    tables, _, _, host = small_setup("int4", 16)
    before = host.clone()
    host_idx = torch.cat([torch.arange(16), torch.arange(16, 32).flip(0)])
    bad = torch.zeros((), dtype=torch.int64)
    k4.encode_gather(
        tables, torch.arange(32), host.all_layers(), host_idx,
        counters=KVCounters(bad_indices=bad),
    )  # fmt: skip
    assert int(bad) == 16
    assert torch.equal(host.bufs["k"][1], before.bufs["k"][1])
    assert not torch.equal(host.bufs["k"][0], before.bufs["k"][0])
    # Aligned first index, two tokens swapped: refused too.
    bad.zero_()
    swapped = torch.arange(16, 32)
    swapped[[1, 2]] = swapped[[2, 1]]
    k4.encode_gather(
        tables, torch.arange(16), host.all_layers(), swapped,
        counters=KVCounters(bad_indices=bad),
    )  # fmt: skip
    assert int(bad) == 16
    assert torch.equal(host.bufs["k"][1], before.bufs["k"][1])
    # A run that starts mid-unit: also refused.
    bad.zero_()
    k4.encode_gather(
        tables, torch.arange(16), host.all_layers(), torch.arange(8, 24),
        counters=KVCounters(bad_indices=bad),
    )  # fmt: skip
    assert int(bad) == 16


def test_bad_arguments_fail_before_launch():
    tables, _, _, host = small_setup("int4", 16)
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
        want, _, _ = reference_records(fmt, k, v)
        mine, _, _ = spec_records(fmt, k, v)
        fast = {n: torch.empty_like(t) for n, t in want.items()}
        (codec.int4_encode_into if fmt == "int4" else codec.k8v4_encode_into)(
            k, v, fast
        )
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
