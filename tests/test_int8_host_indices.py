"""Host-index bounds of the INT8 kernels: indices already on the transfer device skip
the pool's CPU check, so the kernels drop and count bad rows."""

from __future__ import annotations

import torch
from scripts.rigs.hicache_harness import Geometry, fill_random
from tests.support.int8_pool_checks import INTERPRETED_KERNELS, int8_pools
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters

pytestmark = INTERPRETED_KERNELS


def test_encode_skips_and_counts_out_of_range_host_rows():
    L, size, H, D, UT, units = 2, 12, 2, 32, 2, 4
    g = torch.Generator().manual_seed(4)
    layers = [torch.randn(size, H, D, generator=g).half() for _ in range(L)]
    table = kt.DeviceLayerTable(layers)
    dev = torch.tensor([3, 0, 7, 9, 11, 5])
    host = torch.tensor([2, -1, 7, units * UT, 1 << 40, 0])  # 3 bad entries
    k = torch.full((units, L, UT, H, D), 55, dtype=torch.int8)
    v = k.clone()
    s = torch.full((units, L, UT, 2, H), 3.0, dtype=torch.float16)
    bad = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros((L, 2), dtype=torch.float32)
    kt.encode_gather(
        table, table, dev, k, v, s, host, unit_tokens=UT,
        counters=KVCounters(amax=amax, bad_indices=bad),
    )  # fmt: skip
    assert int(bad) == 3
    good = torch.tensor([0, 2, 5])
    written = torch.zeros(units * UT, dtype=torch.bool)
    written[host[good]] = True
    for layer in range(L):
        q_ref, s_ref = codec.quantize_reference(layers[layer][dev[good]])
        flat_k = k[:, layer].reshape(units * UT, H, D)
        assert torch.equal(flat_k[host[good]], q_ref)
        assert (flat_k[~written] == 55).all()
        flat_s = s[:, layer].reshape(units * UT, 2, H)
        assert torch.equal(
            flat_s[host[good], 0].view(torch.int16), s_ref.view(torch.int16)
        )
        assert (flat_s[~written] == 3.0).all()
        # Skipped rows do not feed the scale statistic either.
        assert amax[layer, 0] == layers[layer][dev[good]].float().abs().max()


def test_decode_skips_and_counts_out_of_range_host_rows():
    H, D, UT, units, size = 2, 32, 1, 6, 10
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (units, UT, H, D), generator=g, dtype=torch.int8)
    s = (torch.rand(units, UT, 2, H, generator=g) + 0.5).half()
    host = torch.tensor([4, -3, 0, units])  # 2 bad entries
    dev = torch.tensor([1, 2, 3, 4])
    k_dst = torch.full((size, H, D), -7.0, dtype=torch.bfloat16)
    v_dst = torch.full((size, H, D), -5.0, dtype=torch.bfloat16)
    bad = torch.zeros((), dtype=torch.int64)
    kt.decode_scatter(
        q, q, s, host, k_dst, v_dst, dev, unit_tokens=UT, bad_index_counter=bad
    )
    assert int(bad) == 2
    want = codec.dequantize_reference(q[:, 0], s[:, 0, 0], torch.bfloat16)
    assert torch.equal(k_dst[1], want[4]) and torch.equal(k_dst[3], want[0])
    assert (k_dst[[2, 4]] == -7.0).all() and (v_dst[[2, 4]] == -5.0).all()
    untouched = torch.tensor([0, 5, 6, 7, 8, 9])
    assert (k_dst[untouched] == -7.0).all()


def test_pool_counts_device_resident_bad_rows_on_demand(monkeypatch):
    """On CUDA, host indices already on the device skip the CPU check (it would sync);
    the pool's kernels must then drop and count bad rows."""
    p = 2
    device_pool, pool = int8_pools(Geometry(layer_num=2, page_size=p), 16 * p, 8 * p,
                                   "page_first", "direct")  # fmt: skip
    # Real content on both sides, so a stray write would show.
    fill_random(device_pool, torch.arange(16 * p), seed=1)
    backed_up = pool.alloc(4 * p)
    pool.backup_from_device_all_layer(
        device_pool, backed_up, torch.arange(p, 5 * p), "direct"
    )
    monkeypatch.setattr(pool.planner, "check", lambda host_indices: None)
    # Whole pages of free host slots, then one page that is out of range.
    host = torch.cat([torch.arange(5 * p, 7 * p), torch.arange(-p, 0)])
    dev = torch.arange(16, 16 + len(host))
    before = [b.clone() for b in pool.kv_buffer + device_pool.k_buffer]
    before += [b.clone() for b in device_pool.v_buffer]
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    assert pool.invalid_host_index_count() == 2  # one page of 2 tokens
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(device_pool, host, dev, layer, "direct")
    assert pool.invalid_host_index_count() == 2 + 2 * pool.layer_num
    # Only the valid pages moved: host slots 10..13 and device slots 16..19.
    after = pool.kv_buffer + device_pool.k_buffer + device_pool.v_buffer
    moved = [slice(5, 7)] * len(pool.kv_buffer) + [slice(16, 20)] * 2 * pool.layer_num
    for old, new, m in zip(before, after, moved, strict=True):
        keep = torch.ones(old.shape[0], dtype=torch.bool)
        keep[m] = False
        assert torch.equal(old[keep].view(torch.uint8), new[keep].view(torch.uint8))
