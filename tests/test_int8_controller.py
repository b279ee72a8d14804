"""The real HiCacheController drives the INT8 host pool through thousands of
random write / evict / load operations on CPU against a reference model:
every load restores exactly the reference-codec values of what was written,
and nothing leaks into other slots."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.hicache_harness import Geometry, finish_transfers, make_rig
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
    rig = make_rig(
        geo,
        device_tokens=64 * page_size,
        host_tokens=96 * page_size,
        layout=layout,
        io_backend=io_backend,
        host_pool_cls=MHATokenToKVPoolINT8Host,
    )
    ctl, dev_pool, alloc = rig.controller, rig.device_pool, rig.allocator
    rng = random.Random(1234 + page_size)
    gen = torch.Generator().manual_seed(5678)
    backed_up = []  # (host_indices, [(k_expected, v_expected) per layer])
    resident = []  # (device_indices, same expectations): restored, still on device
    ops = 0
    for step in range(2500):
        op = rng.random()
        if op < 0.4:  # new KV on device, written through to host
            n = rng.randint(1, 6) * page_size
            dev = alloc.alloc(n)
            if dev is None:
                continue
            expected = []
            for layer in range(geo.layer_num):
                k = torch.randn((n, 2, 8), generator=gen).to(geo.dtype) * rng.choice(
                    (1e-3, 1.0, 50.0)
                )
                v = torch.randn((n, 2, 8), generator=gen).to(geo.dtype)
                dev_pool.k_buffer[layer][dev] = k
                dev_pool.v_buffer[layer][dev] = v
                expected.append((encoded(k), encoded(v)))
            host = ctl.write(dev)
            finish_transfers(ctl)
            # L1 eviction right after the backup: the device copy is gone.
            for layer in range(geo.layer_num):
                dev_pool.k_buffer[layer][dev] = float("nan")
                dev_pool.v_buffer[layer][dev] = float("nan")
            alloc.free(dev)
            if host is not None:
                backed_up.append((host, expected))
            ops += 1
        elif op < 0.75 and backed_up:  # L2 hit: load back and verify
            host, expected = rng.choice(backed_up)
            dev = ctl.load(host)
            if dev is None:
                continue
            ctl.start_loading()
            finish_transfers(ctl)
            for layer, (k, v) in enumerate(expected):
                assert torch.equal(dev_pool.k_buffer[layer][dev], k), step
                assert torch.equal(dev_pool.v_buffer[layer][dev], v), step
            resident.append((dev, expected))
            ops += 1
        elif op < 0.9 and backed_up:  # L2 eviction
            host, _ = backed_up.pop(rng.randrange(len(backed_up)))
            ctl.evict_host(host)
            ops += 1
        elif resident:  # L1 eviction of restored KV
            dev, _ = resident.pop(rng.randrange(len(resident)))
            alloc.free(dev)
            ops += 1
        # No cross-slot leakage: everything still resident is intact.
        if step % 100 == 0:
            for dev, expected in resident:
                for layer, (k, v) in enumerate(expected):
                    assert torch.equal(dev_pool.k_buffer[layer][dev], k), step
                    assert torch.equal(dev_pool.v_buffer[layer][dev], v), step
    assert ops > 1000
    # Host bookkeeping agrees with the model.
    held = sum(len(h) for h, _ in backed_up)
    assert rig.host_pool.available_size() == rig.host_pool.size - held


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
