"""INT8 HiCache host pool (--hicache-host-dtype int8) on CPU tensors.

Backup then per-layer load through the pool's own transfer path must give
exactly the codec's reference values, in every supported layout and page
size, touch no other slot, restore NaN for non-finite KV, and size the pool
by the encoded bytes.

    python -m pytest test/registered/unit/mem_cache/test_mha_int8_host_pool.py -v
"""

import unittest

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def _device_pool(
    page_size, head_num=2, head_dim=16, v_head_dim=None, layers=2, dtype=None
):
    return MHATokenToKVPool(
        size=16 * page_size,
        page_size=page_size,
        dtype=dtype or torch.bfloat16,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=v_head_dim,
        enable_alt_stream=False,
    )


def _host_pool(device_pool, layout, host_size=0, host_tokens=None, **kwargs):
    info = device_pool.get_device_pool_infos()[0].buffer_info
    cls = get_mha_host_pool_cls(info, host_dtype="int8")
    return cls(
        info,
        2.0,
        host_size,
        device_pool.page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=device_pool.layer_num,
        host_token_capacity=host_tokens,
        **kwargs,
    )


def _pages(first, count, page_size):
    return (
        (torch.arange(first, first + count)[:, None] * page_size)
        .add(torch.arange(page_size))
        .flatten()
    )


def _expected(rows):
    q, scale = codec.quantize_reference(rows)
    return codec.dequantize_reference(q, scale, rows.dtype)


class TestMHAInt8HostPool(CustomTestCase):
    def _round_trip(self, layout, page_size, head_dim=16, v_head_dim=None):
        device_pool = _device_pool(page_size, head_dim=head_dim, v_head_dim=v_head_dim)
        pool = _host_pool(device_pool, layout, host_tokens=16 * page_size)
        src = _pages(1, 3, page_size)
        gen = torch.Generator().manual_seed(page_size)
        written = []
        for layer in range(device_pool.layer_num):
            for buf in (device_pool.k_buffer[layer], device_pool.v_buffer[layer]):
                rows = torch.randn((len(src), *buf.shape[1:]), generator=gen)
                buf[src] = rows.to(buf.dtype)
                written.append(buf[src].clone())
        host = pool.alloc(len(src))
        pool.backup_from_device_all_layer(device_pool, host, src, "kernel")

        for layer in range(device_pool.layer_num):
            device_pool.k_buffer[layer].fill_(3.0)
            device_pool.v_buffer[layer].fill_(3.0)
        dst = _pages(8, 3, page_size)
        for layer in range(device_pool.layer_num):
            pool.load_to_device_per_layer(device_pool, host, dst, layer, "kernel")

        others = torch.ones(device_pool.size + page_size, dtype=torch.bool)
        others[dst] = False
        restored = []
        for layer in range(device_pool.layer_num):
            for buf in (device_pool.k_buffer[layer], device_pool.v_buffer[layer]):
                restored.append(buf[dst])
                self.assertTrue(bool((buf[others] == 3.0).all()))
        for rows, got in zip(written, restored):
            self.assertTrue(torch.equal(got, _expected(rows)))

    def test_round_trip_every_layout_and_page_size(self):
        for layout in LAYOUTS:
            for page_size in (1, 16):
                with self.subTest(layout=layout, page_size=page_size):
                    self._round_trip(layout, page_size)

    def test_round_trip_asymmetric_head_dims(self):
        self._round_trip("page_first", 4, head_dim=32, v_head_dim=16)

    def test_nonfinite_rows_restore_as_nan(self):
        device_pool = _device_pool(1)
        pool = _host_pool(device_pool, "page_first", host_tokens=16)
        src = torch.arange(1, 5)
        device_pool.k_buffer[0][src] = 1.0
        device_pool.k_buffer[0][2, 1, 3] = float("inf")
        host = pool.alloc(4)
        pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        self.assertEqual(pool.nonfinite_group_count(), 1)
        dst = torch.arange(8, 12)
        pool.load_to_device_per_layer(device_pool, host, dst, 0, "direct")
        restored = device_pool.k_buffer[0][dst]
        self.assertTrue(bool(torch.isnan(restored[1, 1]).all()))
        self.assertTrue(bool((restored[1, 0] == 1.0).all()))

    def test_fp16_extremes_restore_saturated_not_inf(self):
        device_pool = _device_pool(1, dtype=torch.float16)
        pool = _host_pool(device_pool, "layer_first", host_tokens=16)
        src = torch.arange(1, 5)
        device_pool.k_buffer[0][src] = 0.5
        device_pool.k_buffer[0][src, 0, 0] = torch.tensor(
            [65504.0, 65472.0, -65504.0, -65472.0], dtype=torch.float16
        )
        host = pool.alloc(4)
        pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        dst = torch.arange(8, 12)
        pool.load_to_device_per_layer(device_pool, host, dst, 0, "direct")
        restored = device_pool.k_buffer[0][dst, 0, 0].tolist()
        self.assertEqual(restored, [65504.0, 65504.0, -65504.0, -65504.0])
        self.assertEqual(pool.nonfinite_group_count(), 0)
        self.assertEqual(pool.scale_amax_by_layer()[0, 0].item(), 65504.0)

    def test_bad_host_indices_move_nothing(self):
        device_pool = _device_pool(2)
        # CUDA's default, run copies: slices wrap negative ids.
        pool = _host_pool(device_pool, "page_first", host_tokens=16, run_copies=True)
        src = _pages(1, 2, 2)
        before = [b.clone() for b in pool.kv_buffer]
        for host in (_pages(-1, 2, 2), _pages(7, 2, 2)):
            with self.assertRaisesRegex(IndexError, "out of range"):
                pool.backup_from_device_all_layer(device_pool, host, src, "direct")
            with self.assertRaisesRegex(IndexError, "out of range"):
                pool.load_to_device_per_layer(device_pool, host, src, 0, "direct")
        for old, new in zip(before, pool.kv_buffer):
            self.assertTrue(torch.equal(old.view(torch.int8), new.view(torch.int8)))

    def test_size_per_token_is_encoded_size(self):
        device_pool = _device_pool(16, head_num=8, head_dim=128, layers=4)
        pool = _host_pool(device_pool, "page_first", host_size=0.01)
        self.assertEqual(pool.get_size_per_token(), 4 * 8 * (128 + 128 + 4))
        allocated = sum(b.numel() * b.element_size() for b in pool.kv_buffer)
        self.assertEqual(allocated, pool.size * pool.get_size_per_token())

    def test_unsupported_layout_is_rejected(self):
        with self.assertRaisesRegex(NotImplementedError, "--hicache-mem-layout"):
            _host_pool(_device_pool(1), "page_head", host_tokens=16)


if __name__ == "__main__":
    unittest.main()
