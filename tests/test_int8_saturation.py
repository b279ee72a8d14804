"""Extreme finite inputs never restore as Inf: fp16 KV at +-65472/65504 saturates
on decode, bf16 past the fp16 scale range is stored NaN and counted; on the
codec, the fused kernels (interpreter) and the pool's torch and fused paths."""

from __future__ import annotations

import pytest
import torch
from scripts.rigs.hicache_harness import Geometry, make_device_pool, make_host_pool
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from tests.support.kernel_cases import run_case

MHATokenToKVPoolINT8Host = host_pool_cls("int8")

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]
FP16_MAX = 65504.0
BF16_MAX = torch.finfo(torch.bfloat16).max
# Largest bf16 whose scale fits fp16 (127 * 65024 rounds back to it), and the
# next bf16 up, whose scale overflows.
BF16_LARGEST_ENCODABLE = 8257536.0
BF16_FIRST_TOO_LARGE = 8323072.0


def large_fp16_rows() -> torch.Tensor:
    """Every finite fp16 with |x| >= 16384 as the row's peak, both signs, with
    a small second element: [n, 2] fp16."""
    bits = torch.arange(0x7400, 0x7C00, dtype=torch.int32).to(torch.int16)
    top = bits.view(torch.float16)
    top = torch.cat([top, -top])
    return torch.stack([top, torch.full_like(top, 3.0)], dim=1)


def test_the_four_overflowing_fp16_values_saturate():
    x = torch.tensor([[65504.0], [65472.0], [-65504.0], [-65472.0], [65440.0]])
    q, s = codec.quantize_reference(x.half())
    # The defect's mechanism: q = 127 at s = 516 rounds past fp16's max.
    assert (q[:4].abs() == 127).all() and (s[:4] == 516).all()
    restored = codec.dequantize_reference(q, s, torch.float16)
    assert restored.flatten().tolist() == [
        FP16_MAX, FP16_MAX, -FP16_MAX, -FP16_MAX, 65472.0
    ]  # fmt: skip


def test_large_fp16_rows_stay_finite_and_within_the_bound():
    x = large_fp16_rows()
    q, s = codec.quantize_reference(x)
    restored = codec.dequantize_reference(q, s, torch.float16)
    assert torch.isfinite(restored).all()
    err = (x.float() - restored.float()).abs()
    assert (err <= codec.error_bound(s, restored)).all()
    # The fast path writes the same bits.
    q2 = torch.empty_like(q)
    s2 = torch.empty_like(s)
    codec.quantize_into(x, q2, s2)
    fast = torch.empty_like(restored)
    codec.dequantize_into(q2, s2, fast)
    assert torch.equal(fast.view(torch.int16), restored.view(torch.int16))
    # Saturation only clamps: to fp32 nothing changes, and the fp16 result is
    # the fp32 product rounded, except where that rounding gave Inf.
    wide = codec.dequantize_reference(q, s, torch.float32)
    plain = wide.half()
    overflowed = torch.isinf(plain)
    assert overflowed.sum() == 4  # x = +-65472, +-65504
    assert torch.equal(restored[~overflowed], plain[~overflowed])


def test_fused_kernels_saturate_like_the_reference():
    x = large_fp16_rows()[:, None, :]  # [n, H=1, 2]
    run_case("int8", ut=1, H=1, dims=(2, 2), n_units=len(x), dtype=x.dtype, rows=[x, x])


def round_trip(dtype, values, access):
    """Back up one token per value (K: the value in head 0, V: its negation),
    restore it; returns restored K, V rows and the non-finite count."""
    geo = Geometry(layer_num=2, head_num=2, head_dim=16, dtype=dtype)
    device_pool = make_device_pool(geo, device_tokens=32)
    pool = make_host_pool(
        device_pool, host_tokens=32, layout="layer_first",
        host_pool_cls=MHATokenToKVPoolINT8Host, fused_transfer=access or "off",
    )  # fmt: skip
    n = len(values)
    dev = torch.arange(1, n + 1)
    for layer in range(geo.layer_num):
        device_pool.k_buffer[layer][dev] = 0.5
        device_pool.v_buffer[layer][dev] = 0.5
        device_pool.k_buffer[layer][dev, 0, 0] = torch.tensor(values, dtype=dtype)
        device_pool.v_buffer[layer][dev, 1, 3] = -torch.tensor(values, dtype=dtype)
    host = pool.alloc(n)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    new_dev = dev + 16
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
    k = device_pool.k_buffer[1][new_dev, 0, 0].float()
    v = device_pool.v_buffer[1][new_dev, 1, 3].float()
    return k, v, pool.nonfinite_group_count()


PATHS = [None, "direct", "staged"]


@pytest.mark.parametrize("access", PATHS)
def test_pool_restores_fp16_extremes_finite(access):
    values = [65504.0, 65472.0, -65504.0, -65472.0, 65440.0, -127.0]
    k, v, nonfinite = round_trip(torch.float16, values, access)
    want = [FP16_MAX, FP16_MAX, -FP16_MAX, -FP16_MAX, 65472.0, -127.0]
    assert k.tolist() == want
    assert v.tolist() == [-w for w in want]
    assert nonfinite == 0


@pytest.mark.parametrize("access", PATHS)
def test_pool_bf16_extremes_are_finite_or_counted_never_inf(access):
    values = [BF16_LARGEST_ENCODABLE, -BF16_LARGEST_ENCODABLE]
    too_large = [BF16_FIRST_TOO_LARGE, BF16_MAX, -BF16_MAX]
    k, v, nonfinite = round_trip(torch.bfloat16, values + too_large, access)
    assert k[:2].tolist() == values and v[:2].tolist() == [-x for x in values]
    # Past the FP16 scale range: NaN, counted (2 layers x K and V rows).
    assert torch.isnan(k[2:]).all() and torch.isnan(v[2:]).all()
    assert nonfinite == 2 * 2 * len(too_large)
    assert not torch.isinf(torch.cat([k, v])).any()
