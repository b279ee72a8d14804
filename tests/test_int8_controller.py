"""The real HiCacheController drives the INT8 host pool through thousands of
random write / evict / load operations on CPU against a reference model:
every load restores exactly the reference-codec values of what was written,
and nothing leaks into other slots."""

from __future__ import annotations


import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    finish_transfers,
    make_rig,
    paged_rig,
    random_controller_operations,
)
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

MHATokenToKVPoolINT8Host = host_pool_cls("int8")


def encoded(rows):
    q, scale = codec.quantize_reference(rows)
    return codec.dequantize_reference(q, scale, rows.dtype)


@pytest.mark.parametrize(
    "layout,page_size,io_backend",
    [
        ("page_first", 1, "direct"),
        ("page_first", 4, "kernel"),
        ("page_first_direct", 4, "direct"),
        ("layer_first", 1, "direct"),
        ("layer_first", 2, "kernel"),
    ],
)
def test_random_operations_against_reference(layout, page_size, io_backend):
    geo = Geometry(layer_num=2, head_num=2, head_dim=8, page_size=page_size)
    rig = paged_rig(
        geo, layout, io_backend, 64, 96, host_pool_cls=MHATokenToKVPoolINT8Host
    )
    dev_pool = rig.device_pool
    gen = torch.Generator().manual_seed(5678)

    def write_rows(dev, rng):
        expected = []
        for layer in range(geo.layer_num):
            k = torch.randn((len(dev), 2, 8), generator=gen).to(geo.dtype) * rng.choice(
                (1e-3, 1.0, 50.0)
            )
            v = torch.randn((len(dev), 2, 8), generator=gen).to(geo.dtype)
            dev_pool.k_buffer[layer][dev] = k
            dev_pool.v_buffer[layer][dev] = v
            expected.append((encoded(k), encoded(v)))
        return expected

    ops = random_controller_operations(
        rig, write_rows, steps=2500, seed=1234 + page_size
    )
    assert ops > 1000


def test_transfer_metrics_count_encoded_bytes():
    """HiCache's byte counters (hicache_backup_bytes_total, load_back_bytes_total)
    and host capacity gauge report the INT8 pool's encoded figures."""
    geo = Geometry(layer_num=4, head_num=8, head_dim=128)
    rig = make_rig(
        geo, device_tokens=64, host_tokens=128, host_pool_cls=MHATokenToKVPoolINT8Host
    )
    dev = rig.allocator.alloc(10)
    rig.controller.write(dev)
    encoded = 4 * 8 * (128 + 128 + 4)
    assert rig.controller.ack_write_queue[-1].num_bytes == 10 * encoded
    assert rig.host_pool.logical_size == 128  # sglang:hicache_host_total_tokens
    finish_transfers(rig.controller)
