"""MLA INT8 HiCache host pool (--hicache-host-dtype int8 on MLA) on CPU tensors.

Backup then per-layer load through the pool's own transfer path must give
exactly the format's reference values at DeepSeek latent geometry (512 + 64)
in every supported layout, keep the RoPE part bit for bit, restore NaN for a
non-finite latent tile, size the pool by the encoded bytes, and hand L3 the
encoded page.

    python -m pytest test/registered/unit/mem_cache/test_mla_int8_host_pool.py -v
"""

import unittest

import torch

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.mla import get_mla_host_pool_cls
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

LAYOUTS = ("page_first", "page_first_direct", "layer_first")
LATENT, ROPE = 512, 64


def _device_pool(page_size, layers=2, dtype=torch.bfloat16):
    return MLATokenToKVPool(
        size=16 * page_size,
        page_size=page_size,
        dtype=dtype,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _host_pool(device_pool, layout, host_tokens):
    info = device_pool.get_device_pool_infos()[0].buffer_info
    cls = get_mla_host_pool_cls("int8")
    return cls(
        info,
        2.0,
        0,
        device_pool.page_size,
        layout,
        pin_memory=False,
        device="cpu",
        override_kv_cache_dim=device_pool.kv_cache_dim,
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=device_pool.layer_num,
        target_layer_num=device_pool.layer_num,
        host_token_capacity=host_tokens,
    )


def _expected(rows):
    fmt = MLAInt8HostFormat((LATENT + ROPE,), 1, 1, rows.dtype)
    x = rows.view(-1, 1, 1, LATENT + ROPE)
    (restored,) = fmt.decode_reference(fmt.encode_reference([x]), rows.dtype)
    return restored.view_as(rows)


class TestMLAInt8HostPool(CustomTestCase):
    def _round_trip(self, layout, page_size, dtype):
        device_pool = _device_pool(page_size, dtype=dtype)
        pool = _host_pool(device_pool, layout, host_tokens=16 * page_size)
        src = torch.arange(page_size, 4 * page_size)
        gen = torch.Generator().manual_seed(page_size)
        written = []
        for layer in range(device_pool.layer_num):
            rows = torch.randn((len(src), 1, LATENT + ROPE), generator=gen)
            rows[..., :128] *= 100.0  # one tile far larger than the others
            device_pool.kv_buffer[layer][src] = rows.to(dtype)
            written.append(device_pool.kv_buffer[layer][src].clone())
        host = pool.alloc(len(src))
        pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        dst = torch.arange(8 * page_size, 11 * page_size)
        for layer in range(device_pool.layer_num):
            pool.load_to_device_per_layer(device_pool, host, dst, layer, "kernel")
        for layer, rows in enumerate(written):
            restored = device_pool.kv_buffer[layer][dst]
            self.assertTrue(torch.equal(restored, _expected(rows)))
            self.assertTrue(
                torch.equal(
                    restored[..., LATENT:].view(torch.int16),
                    rows[..., LATENT:].view(torch.int16),
                )
            )
            # No other device slot was written.
            self.assertFalse(device_pool.kv_buffer[layer][:page_size].any())

    def test_round_trip_every_layout(self):
        for layout in LAYOUTS:
            for page_size in (1, 4):
                for dtype in (torch.bfloat16, torch.float16):
                    with self.subTest(layout=layout, page_size=page_size, dtype=dtype):
                        self._round_trip(layout, page_size, dtype)

    def test_nonfinite_tile_restores_as_nan(self):
        device_pool = _device_pool(1)
        pool = _host_pool(device_pool, "page_first", host_tokens=16)
        src = torch.arange(1, 3)
        device_pool.kv_buffer[0][src] = 1.0
        device_pool.kv_buffer[0][1, 0, 200] = float("nan")
        host = pool.alloc(2)
        pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        dst = torch.arange(5, 7)
        pool.load_to_device_per_layer(device_pool, host, dst, 0, "direct")
        restored = device_pool.kv_buffer[0][dst]
        self.assertTrue(torch.isnan(restored[0, 0, 128:256]).all())
        self.assertEqual(int(torch.isnan(restored).sum()), 128)
        self.assertEqual(pool.nonfinite_group_count(), 1)

    def test_sized_by_encoded_bytes(self):
        device_pool = _device_pool(4, layers=3)
        pool = _host_pool(device_pool, "page_first", host_tokens=32)
        self.assertEqual(pool.get_size_per_token(), 3 * (512 + 4 * 2 + 64 * 2))
        allocated = sum(t.numel() * t.element_size() for t in pool.kv_buffer)
        self.assertEqual(allocated, 32 * pool.get_size_per_token())
        info = device_pool.get_device_pool_infos()[0].buffer_info
        self.assertAlmostEqual(type(pool).host_bytes_per_device_byte(info), 648 / 1152)

    def test_storage_page_round_trip(self):
        device_pool = _device_pool(4)
        pool = _host_pool(device_pool, "page_first_direct", host_tokens=32)
        src = torch.arange(4, 8)
        device_pool.kv_buffer[1][src] = torch.randn(4, 1, LATENT + ROPE).bfloat16()
        host = pool.alloc(4)
        pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        page = pool.get_data_page(int(host[0]))
        # The page's records, then its seal (page_integrity.py).
        self.assertEqual(page.numel(), pool.get_size_per_token() * 4 + SEAL_BYTES)
        target = pool.alloc(4)
        pool.set_from_flat_data_page(int(target[0]), page)
        self.assertTrue(torch.equal(pool.get_data_page(int(target[0])), page))
        with self.assertRaises(ValueError):
            pool.set_from_flat_data_page(int(target[0]), page[:-8])


if __name__ == "__main__":
    unittest.main()
