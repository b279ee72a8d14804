"""INT8 pool statistics on the torch path and the fused kernels: scale_amax_by_layer()
is the running maximum of the finite rows' amax per layer, K and V; non-finite rows
feed nonfinite_group_count() instead."""

from __future__ import annotations

import pytest
import torch
from scripts.rigs.hicache_harness import Geometry, fill_random
from tests.support.int8_pool_checks import INTERPRETED_KERNELS, int8_pools

pytestmark = INTERPRETED_KERNELS


def expected_amax(device_pool, dev, layer_num) -> torch.Tensor:
    """max |x| over the head rows of dev whose row is finite and encodable."""
    out = torch.zeros(layer_num, 2)
    for layer in range(layer_num):
        for kv, buf in enumerate((device_pool.k_buffer, device_pool.v_buffer)):
            row_amax = buf[layer][dev].float().abs().amax(dim=-1)
            ok = torch.isfinite(row_amax) & (row_amax <= 127 * 65504)
            out[layer, kv] = row_amax[ok].max()
    return out


@pytest.mark.parametrize("access", [None, "direct", "staged"])
@pytest.mark.parametrize("layout,page_size", [("page_first", 2), ("layer_first", 1)])
def test_scale_amax_tracks_finite_rows_per_layer(access, layout, page_size):
    geo = Geometry(layer_num=3, head_num=2, page_size=page_size)
    device_pool, pool = int8_pools(geo, 16 * page_size, 16 * page_size, layout, access)
    assert torch.equal(pool.scale_amax_by_layer(), torch.zeros(3, 2))

    dev = torch.arange(page_size, 5 * page_size)
    fill_random(device_pool, dev, seed=7)
    # Larger than everything else, but in rows that are stored as non-finite.
    device_pool.k_buffer[0][dev[1], 0, :2] = torch.tensor([float("nan"), 5e3])
    device_pool.v_buffer[2][dev[2], 1, 0] = 1e7  # past the fp16 scale range
    device_pool.v_buffer[1][dev[3], 0, 4] = -40.0  # a negative peak counts
    want = expected_amax(device_pool, dev, geo.layer_num)
    assert want[0, 0] < 5e3 and want[2, 1] < 1e7 and want[1, 1] == 40.0
    pool.backup_from_device_all_layer(device_pool, pool.alloc(len(dev)), dev, "direct")
    amax = pool.scale_amax_by_layer()
    assert amax.dtype == torch.float32 and amax.device.type == "cpu"
    assert torch.equal(amax, want)
    assert pool.nonfinite_group_count() == 2

    # A running maximum: smaller rows leave it, a larger one raises its slot.
    dev2 = torch.arange(8 * page_size, 10 * page_size)
    fill_random(device_pool, dev2, seed=8)
    for layer in range(geo.layer_num):
        device_pool.k_buffer[layer][dev2] *= 0.01
        device_pool.v_buffer[layer][dev2] *= 0.01
    device_pool.k_buffer[2][dev2[0], 1, 1] = 100.0
    pool.backup_from_device_all_layer(
        device_pool, pool.alloc(len(dev2)), dev2, "direct"
    )
    want[2, 0] = 100.0
    assert torch.equal(pool.scale_amax_by_layer(), want)
    # Reading returns a copy: callers cannot disturb the device statistic.
    pool.scale_amax_by_layer().zero_()
    assert torch.equal(pool.scale_amax_by_layer(), want)
