"""L3 storage page I/O of the INT8 HiCache host pool on CPU tensors.

A flat page (generic backends such as `file`) is the page's K records, V
records and scales, byte for byte as in L2, and writing it into another page
reproduces them; a page of the wrong size is refused untouched. Zero-copy
metadata (Mooncake) points at exactly those bytes, two objects per page.

    python -m pytest test/registered/unit/mem_cache/test_mha_int8_storage_pages.py -v
"""

import ctypes
import unittest

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

PAGE_SIZE = 4


def _pools(layout):
    device_pool = MHATokenToKVPool(
        size=16 * PAGE_SIZE,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    host_pool = get_mha_host_pool_cls(info, host_dtype="int8")(
        info,
        2.0,
        0,
        PAGE_SIZE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=device_pool.layer_num,
        host_token_capacity=16 * PAGE_SIZE,
    )
    gen = torch.Generator().manual_seed(0)
    for layer in range(device_pool.layer_num):
        for buf in (device_pool.k_buffer[layer], device_pool.v_buffer[layer]):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    rows = torch.arange(2 * PAGE_SIZE)
    host_pool.backup_from_device_all_layer(device_pool, rows, rows, "direct")
    return host_pool


def _page_records(pool, index):
    bufs = (pool.host_records["k"], pool.host_records["v"], pool.host_records["scale"])
    if pool.layout == "layer_first":
        parts = [b[:, index : index + PAGE_SIZE] for b in bufs]
    else:
        parts = [b[index // PAGE_SIZE] for b in bufs]
    return torch.cat([p.contiguous().view(torch.uint8).flatten() for p in parts])


class TestMHAInt8StoragePages(CustomTestCase):
    def test_flat_page_is_the_l2_records_and_round_trips(self):
        for layout in ("page_first", "page_first_direct", "layer_first"):
            with self.subTest(layout=layout):
                pool = _pools(layout)
                page = pool.get_data_page(PAGE_SIZE)
                self.assertEqual(page.dtype, torch.uint8)
                # The page's records, then its seal (page_integrity.py).
                self.assertEqual(
                    page.numel(), pool.get_size_per_token() * PAGE_SIZE + SEAL_BYTES
                )
                records = page[:-SEAL_BYTES]
                self.assertTrue(torch.equal(records, _page_records(pool, PAGE_SIZE)))
                pool.set_from_flat_data_page(5 * PAGE_SIZE, page)
                self.assertTrue(
                    torch.equal(_page_records(pool, 5 * PAGE_SIZE), records)
                )

    def test_wrong_size_page_is_refused_untouched(self):
        pool = _pools("page_first")
        before = _page_records(pool, 5 * PAGE_SIZE)
        page = pool.get_dummy_flat_data_page().fill_(7)
        for bad in (page[:-1], torch.cat([page, page[:1]])):
            with self.assertRaisesRegex(ValueError, "expected"):
                pool.set_from_flat_data_page(5 * PAGE_SIZE, bad)
        self.assertTrue(torch.equal(_page_records(pool, 5 * PAGE_SIZE), before))

    def test_zero_copy_objects_cover_the_page(self):
        for layout in ("page_first", "page_first_direct"):
            with self.subTest(layout=layout):
                pool = _pools(layout)
                ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * PAGE_SIZE))
                self.assertEqual(len(ptrs), 2 * 2 * pool.storage_buffers_per_object)
                n = 2 * pool.storage_buffers_per_object  # K, scales, seal; V, ...
                for page in range(2):
                    k, s_lo, _, v, s_hi, _ = (
                        torch.frombuffer(
                            bytearray(ctypes.string_at(ptr, size)), dtype=torch.uint8
                        )
                        for ptr, size in zip(
                            ptrs[n * page : n * page + n],
                            sizes[n * page : n * page + n],
                        )
                    )
                    self.assertTrue(
                        torch.equal(
                            torch.cat([k, v, s_lo, s_hi]),
                            _page_records(pool, page * PAGE_SIZE),
                        )
                    )

    def test_layer_first_has_no_zero_copy_pages(self):
        pool = _pools("layer_first")
        with self.assertRaisesRegex(ValueError, "--hicache-mem-layout"):
            pool.get_page_buffer_meta(torch.arange(PAGE_SIZE))
        self.assertFalse(pool.is_stride_page_aligned())


if __name__ == "__main__":
    unittest.main()
