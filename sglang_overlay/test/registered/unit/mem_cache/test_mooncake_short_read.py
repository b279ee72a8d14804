"""A Mooncake get that fills less than the page buffer is a miss, on CPU.

batch_get_into reports the bytes it read per object. A page whose object is
shorter than the host page (truncated, or written in another page format)
must not count as a hit; a full read still does.

    python -m pytest test/registered/unit/mem_cache/test_mooncake_short_read.py -v
"""

import unittest

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

PAGE_SIZE = 4


class _FakeStore:
    """Answers batch_get_into with scripted byte counts, one per object."""

    def __init__(self, reads):
        self.reads = reads

    def batch_get_into(self, keys, ptrs, sizes):
        return [self.reads(i, size) for i, size in enumerate(sizes)]


def _store(reads):
    device_pool = MHATokenToKVPool(
        size=8 * PAGE_SIZE,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    # A budget of its own: the pool is tiny, whatever else the machine runs.
    with host_memory_budget_scope(1 << 30):
        host_pool = MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            PAGE_SIZE,
            "page_first",
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_pool.size,
            start_layer=0,
            end_layer=device_pool.layer_num,
        )
    # Only what batch_get_v1 reads; the real constructor connects to a master.
    store = MooncakeStore.__new__(MooncakeStore)
    store.mem_pool_host = host_pool
    store.config_prefix = None
    store.dcp_size = 1
    store.is_mla_backend = False
    store.should_split_heads = False
    store.mha_suffix = "0"
    store.enable_storage_metrics = False
    store.store = _FakeStore(reads)
    return store


class TestMooncakeShortRead(CustomTestCase):
    def test_full_reads_are_hits(self):
        store = _store(lambda i, size: size)
        hits = store.batch_get_v1(["a", "b"], torch.arange(2 * PAGE_SIZE))
        self.assertEqual(hits, [True, True])

    def test_a_short_object_makes_its_page_a_miss(self):
        # Objects are (page a: k, v), (page b: k, v); page b's V object is short.
        store = _store(lambda i, size: size - 2 if i == 3 else size)
        with self.assertLogs(level="WARNING") as logs:
            hits = store.batch_get_v1(["a", "b"], torch.arange(2 * PAGE_SIZE))
        self.assertEqual(hits, [True, False])
        self.assertIn("treating it as a miss", logs.output[0])

    def test_a_failed_get_stays_a_miss(self):
        store = _store(lambda i, size: -1 if i == 0 else size)
        hits = store.batch_get_v1(["a", "b"], torch.arange(2 * PAGE_SIZE))
        self.assertEqual(hits, [False, True])


if __name__ == "__main__":
    unittest.main()
