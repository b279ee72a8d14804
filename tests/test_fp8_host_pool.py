"""INT4 and K8V4 host copies of an FP8 device KV cache beyond the conformance rows:
rounding, saturation, pages of the other FP8 dtype, the fused path's self-check."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from scripts.rigs.hicache_harness import assert_self_check_falls_back
from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.srt.mem_cache.pool_host import encoded_fused
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host.page_integrity import StoragePageRefused
from tests.support import int4_pool_checks as pint
from tests.support.fp8_reference import FP8, fp8_id, nearest_even_fp8
from tests.support.int4_pool_checks import fill_fp8, pages

FORMATS = ("int4", "k8v4")
ENCODE = {"int4": codec.int4_encode_reference, "k8v4": codec.k8v4_encode_reference}
DECODE = {"int4": codec.int4_decode_reference, "k8v4": codec.k8v4_decode_reference}
# A byte that is NaN in both FP8 formats: what a wiped device row holds.
POISON = 0xFF


def as_units(rows: torch.Tensor, ut: int) -> torch.Tensor:
    return rows.view(rows.shape[0] // ut, ut, *rows.shape[1:])


def restored(device_pool, layer, indices, fp8):
    return (
        device_pool.k_buffer[layer][indices].view(fp8),
        device_pool.v_buffer[layer][indices].view(fp8),
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def build(fmt, fp8, **pool_kwargs):
    """(geometry, device pool, pool): page_first, 16-token pages, on FP8 device KV."""
    return pint.build(
        fmt, "page_first", 16, dtype=fp8, device_kv_dtype=fp8, **pool_kwargs
    )


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_rounds_to_nearest_even_and_saturates(fmt, fp8):
    """The decode's last step is fp32 -> FP8 round to nearest even with saturation:
    checked against an independent rounding of the fp32 decode over FP8's value grid, on
    rows that reach the format's largest value."""
    _, device_pool, pool = build(fmt, fp8)
    dev = pages([0, 1], 16)
    written = fill_fp8(device_pool, dev, fp8, seed=5)
    pool.backup_from_device_all_layer(device_pool, dev, dev, "direct")
    for layer, (k, v) in enumerate(written):
        records = ENCODE[fmt](as_units(k, 16), as_units(v, 16))
        exact = DECODE[fmt](records, torch.float32)
        pool.load_to_device_per_layer(device_pool, dev, dev, layer, "direct")
        got = restored(device_pool, layer, dev, fp8)
        for x, g in zip(exact, got):
            want = nearest_even_fp8(x.flatten(0, 1).double(), fp8)
            assert torch.equal(g.double(), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pages_of_one_fp8_dtype_are_refused_by_the_other(fmt):
    """A sealed page names its device dtype: an E4M3 page read into an E5M2 pool (same
    records and sizes) would decode other values, so it is refused before any byte
    reaches the pool."""
    geo, device_pool, e4m3 = build(fmt, torch.float8_e4m3fn)
    _, _, e5m2 = build(fmt, torch.float8_e5m2)
    _, _, twin = build(fmt, torch.float8_e4m3fn)
    dev = pages([1], 16)
    fill_fp8(device_pool, dev, torch.float8_e4m3fn, seed=1)
    e4m3.backup_from_device_all_layer(device_pool, dev, dev, "direct")
    page = e4m3.get_data_page(16, key="k0")
    assert page.numel() == e5m2.get_dummy_flat_data_page().numel()
    before = {n: b.clone() for n, b in e5m2.host_records.items()}
    with pytest.raises(StoragePageRefused):
        e5m2.set_from_flat_data_page(32, page, key="k0")
    for name, buf in e5m2.host_records.items():
        assert same_bytes(buf, before[name])
    twin.set_from_flat_data_page(32, page, key="k0")  # the same dtype reads it
    for name, buf in twin.host_records.items():
        assert same_bytes(buf[2], e4m3.host_records[name][1])


@triton.jit
def _truncating_fp8_bits(y, FP8: tl.constexpr):
    """fp32 -> FP8 rounding toward zero: the bug the self-check must catch."""
    u = y.to(tl.uint32, bitcast=True)
    mbits = 3 if FP8 == 1 else 2
    bias = 7 if FP8 == 1 else 15
    a = u & 0x7FFFFFFF
    mag = (a >> (23 - mbits)) - ((127 - bias) << mbits)
    return (mag | ((u >> 24) & 0x80)).to(tl.uint8)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_self_check_runs_on_fp8_and_catches_a_wrong_rounding(
    fmt, fp8, monkeypatch, caplog
):
    """The start-up self-check compares the fused FP8 path with the reference (FP8 rows:
    subnormals, NaN, the largest value) and puts the borrowed bytes back; kernels that
    truncate instead of rounding fail it and the pool falls back to the torch path,
    saying why."""
    _, device_pool, pool = build(fmt, fp8, fused_transfer="direct")
    assert pool.transfer_path == "fused_direct"
    before = [b.clone() for b in device_pool.k_buffer + device_pool.v_buffer]
    records = {n: b.clone() for n, b in pool.host_records.items()}
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    for a, b in zip(before, device_pool.k_buffer + device_pool.v_buffer):
        assert torch.equal(a, b)
    for name, buf in pool.host_records.items():
        assert same_bytes(buf, records[name]), name

    monkeypatch.setattr(hk, "fp32_to_fp8_bits", _truncating_fp8_bits)
    assert_self_check_falls_back(pool, caplog, "restore of")


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_saturates_beyond_the_fp8_range(fmt, fp8):
    """Records whose values lie past FP8's largest finite value (m + 15 s up to 61440,
    where E5M2's cast alone gives Inf) restore as the largest value, on the pool's path
    and in the reference."""
    _, device_pool, pool = build(fmt, fp8)
    dev = pages([0], 16)
    fill_fp8(device_pool, dev, fp8, seed=4)
    pool.backup_from_device_all_layer(device_pool, dev, dev, "direct")
    v, v_meta = pool.host_records["v"], pool.host_records["v_meta"]
    v[0, 0].fill_(0xFF)  # codes 15 everywhere
    v_meta[0, 0, ..., 0] = 4096.0  # s
    v_meta[0, 0, ..., 1] = 0.0  # m
    v_meta[0, 0, 3, 1, 0, 1] = -65504.0  # a group from below: m alone overflows
    device_pool.v_buffer[0].fill_(POISON)
    pool.load_to_device_per_layer(device_pool, dev, dev, 0, "direct")
    got = restored(device_pool, 0, dev, fp8)[1].float()
    top = torch.finfo(fp8).max
    want = torch.full_like(got, top)
    want[3, 1, 0:64] = -65504.0 + 15 * 4096.0  # -4064: in range for both
    want = want.to(fp8).float()
    assert torch.equal(got, want)
    records = {n: b[:1, 0] for n, b in pool.host_records.items()}
    ref_v = DECODE[fmt](records, fp8)[1].flatten(0, 1)
    assert same_bytes(ref_v, want.to(fp8))
