"""The real HiCacheController drives the MLA INT8 host pool through random
write / evict / load operations on CPU against a reference model (DeepSeek
latent width): every load restores exactly the reference format's values of
what was written, nothing leaks into other slots, and the host pool's
bookkeeping matches the model."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.hicache_harness import MLAGeometry, finish_transfers, make_rig
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

MLATokenToKVPoolINT8Host = host_pool_cls("int8", "mla")


def encoded(rows: torch.Tensor) -> torch.Tensor:
    f = MLAInt8HostFormat((rows.shape[-1],), 1, 1, rows.dtype)
    x = rows.view(-1, 1, 1, rows.shape[-1])
    (y,) = f.decode_reference(f.encode_reference([x]), rows.dtype)
    return y.view_as(rows)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    "layout,page_size,io_backend,dtype",
    [
        ("page_first", 1, "direct", torch.bfloat16),
        ("page_first", 4, "kernel", torch.float16),
        ("page_first_direct", 4, "direct", torch.bfloat16),
        ("layer_first", 1, "kernel", torch.float16),
        ("layer_first", 2, "direct", torch.bfloat16),
    ],
)
def test_random_operations_against_reference(layout, page_size, io_backend, dtype):
    geo = MLAGeometry(layer_num=2, dtype=dtype, page_size=page_size)
    rig = make_rig(
        geo,
        device_tokens=48 * page_size,
        host_tokens=64 * page_size,
        layout=layout,
        io_backend=io_backend,
        host_dtype="int8",
    )
    assert type(rig.host_pool) is MLATokenToKVPoolINT8Host
    ctl, dev_pool, alloc = rig.controller, rig.device_pool, rig.allocator
    rng = random.Random(4321 + page_size)
    gen = torch.Generator().manual_seed(8765)
    width = geo.kv_lora_rank + geo.qk_rope_head_dim
    backed_up = []  # (host_indices, [expected rows per layer])
    resident = []  # (device_indices, same): restored, still on device
    ops = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.4:  # new KV on device, written through to host
            n = rng.randint(1, 6) * page_size
            dev = alloc.alloc(n)
            if dev is None:
                continue
            expected = []
            for layer in range(geo.layer_num):
                rows = torch.randn((n, 1, width), generator=gen)
                # Latent magnitudes differ per tile and per write.
                rows[..., :128] *= rng.choice((1e-3, 1.0, 50.0))
                rows = rows.to(dtype)
                dev_pool.kv_buffer[layer][dev] = rows
                expected.append(encoded(rows))
            host = ctl.write(dev)
            finish_transfers(ctl)
            # L1 eviction right after the backup: the device copy is gone.
            for layer in range(geo.layer_num):
                dev_pool.kv_buffer[layer][dev] = float("nan")
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
            for layer, rows in enumerate(expected):
                assert same(dev_pool.kv_buffer[layer][dev], rows), step
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
                for layer, rows in enumerate(expected):
                    assert same(dev_pool.kv_buffer[layer][dev], rows), step
    assert ops > 600
    held = sum(len(h) for h, _ in backed_up)
    assert rig.host_pool.available_size() == rig.host_pool.size - held


def test_transfer_byte_counters_count_encoded_bytes():
    """HiCache's byte counters (hicache_backup_bytes_total) and the host
    capacity report the MLA INT8 pool's encoded figures."""
    rig = make_rig(
        MLAGeometry(layer_num=4), device_tokens=64, host_tokens=128, host_dtype="int8"
    )
    dev = rig.allocator.alloc(10)
    rig.controller.write(dev)
    assert rig.controller.ack_write_queue[-1].num_bytes == 10 * 4 * 648
    assert rig.host_pool.logical_size == 128
    finish_transfers(rig.controller)
