"""Mooncake page objects spread over several host buffers, on CPU.

A host pool that keeps a page in more than one tensor declares
storage_buffers_per_object; each _k/_v object then moves as one multi-buffer
get/put over that many pointers. Other pools keep HostKVCache's 1: one buffer
per object.

    python -m pytest test/registered/unit/mem_cache/test_mooncake_multi_buffer_pages.py -v
"""

import unittest

import torch

from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

PAGE_SIZE = 4


class _PagePool:
    """Page metadata as a host pool hands it: per page, K then V, each object
    as `buffers` consecutive (pointer, size) pairs."""

    page_size = PAGE_SIZE
    storage_buffers_per_object = HostKVCache.storage_buffers_per_object

    def __init__(self, buffers, declare):
        self.buffers = buffers
        if declare:
            self.storage_buffers_per_object = buffers

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for page in range(len(indices) // PAGE_SIZE):
            for side in range(2):
                for b in range(self.buffers):
                    ptrs.append(1000 * page + 100 * side + b)
                    sizes.append(10 + b)
        return ptrs, sizes


def _store(pool):
    store = MooncakeStore.__new__(MooncakeStore)
    store.mem_pool_host = pool
    store.dcp_size = 1
    store.is_mla_backend = False
    store.should_split_heads = False
    store.mha_suffix = "0"
    return store


class TestMooncakeMultiBufferPages(CustomTestCase):
    def test_objects_gather_the_declared_buffers(self):
        store = _store(_PagePool(buffers=3, declare=True))
        keys, ptrs, sizes = store._batch_preprocess(["a", "b"], torch.arange(8))
        self.assertEqual(keys, ["a_0_k", "a_0_v", "b_0_k", "b_0_v"])
        self.assertEqual(ptrs[1], [100, 101, 102])
        self.assertEqual(ptrs[2], [1000, 1001, 1002])
        self.assertEqual(sizes, [[10, 11, 12]] * 4)

    def test_single_buffer_pools_are_unchanged(self):
        store = _store(_PagePool(buffers=1, declare=False))
        keys, ptrs, sizes = store._batch_preprocess(["a"], torch.arange(4))
        self.assertEqual(keys, ["a_0_k", "a_0_v"])
        self.assertEqual(ptrs, [0, 100])
        self.assertEqual(sizes, [10, 10])

    def test_undeclared_extra_buffers_are_refused(self):
        store = _store(_PagePool(buffers=3, declare=False))
        with self.assertRaises(RuntimeError):
            store._batch_preprocess(["a"], torch.arange(4))


if __name__ == "__main__":
    unittest.main()
