"""The real HiCacheController drives the MLA INT8 host pool through random
write / evict / load operations on CPU against a reference model (DeepSeek
latent width): every load restores exactly the reference format's values of
what was written, nothing leaks into other slots, and the host pool's
bookkeeping matches the model."""

from __future__ import annotations


import pytest
import torch

from scripts.rigs.hicache_harness import (
    MLAGeometry,
    finish_transfers,
    make_rig,
    paged_rig,
    random_controller_operations,
)
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
    rig = paged_rig(geo, layout, io_backend, 48, 64, host_dtype="int8")
    assert type(rig.host_pool) is MLATokenToKVPoolINT8Host
    dev_pool = rig.device_pool
    gen = torch.Generator().manual_seed(8765)
    width = geo.kv_lora_rank + geo.qk_rope_head_dim

    def write_rows(dev, rng):
        expected = []
        for layer in range(geo.layer_num):
            rows = torch.randn((len(dev), 1, width), generator=gen)
            # Latent magnitudes differ per tile and per write.
            rows[..., :128] *= rng.choice((1e-3, 1.0, 50.0))
            rows = rows.to(dtype)
            dev_pool.kv_buffer[layer][dev] = rows
            expected.append((encoded(rows),))
        return expected

    ops = random_controller_operations(
        rig, write_rows, steps=1500, seed=4321 + page_size, same=same
    )
    assert ops > 600


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
