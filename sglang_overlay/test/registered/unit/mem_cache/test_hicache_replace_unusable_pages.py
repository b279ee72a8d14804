"""A stored page a prefetch could not use is replaced at its next write, on CPU.

The controller remembers the keys from the first page a prefetch could not use
on (host pools that seal their pages only) and deletes their stored objects
before the write-back of the recomputed pages; HiCacheFile and MooncakeStore
would otherwise skip a key that exists.

    python -m pytest test/registered/unit/mem_cache/test_hicache_replace_unusable_pages.py -v
"""

import tempfile
import threading
import unittest
from types import SimpleNamespace

import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

PAGE_SIZE = 4


def _config(path):
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        extra_config={"file_storage_path": path},
    )


class _Backend:
    """Records delete calls and the keys each batch write is given."""

    deletes_keys = True  # as HiCacheFile, MooncakeStore and HiCacheNixl declare

    def __init__(self):
        self.deleted, self.written = [], []

    def delete(self, key):
        self.deleted.append(key)


def _controller(seals: bool):
    backend = _Backend()
    replaced = []
    # Only what the prefetch bookkeeping and _page_backup read.
    ctl = HiCacheController.__new__(HiCacheController)
    ctl.page_size = PAGE_SIZE
    ctl.storage_backend = backend
    ctl.storage_host_pool = SimpleNamespace(
        seals_storage_pages=seals, note_storage_pages_replaced=replaced.append
    )
    ctl.storage_keys_to_replace = {}
    ctl.storage_keys_to_replace_lock = threading.Lock()

    def page_set(keys, host_indices, extra_info=None):
        backend.written.append((list(keys), list(backend.deleted)))
        return True

    ctl.page_set_func = page_set
    return ctl, backend, replaced


def _backup(ctl, keys):
    op = SimpleNamespace(
        prefix_keys=None,
        hash_value=keys,
        host_indices=torch.arange(len(keys) * PAGE_SIZE),
        completed_tokens=0,
    )
    ctl._page_backup(op)
    return op.completed_tokens


class TestControllerReplacesUnusablePages(CustomTestCase):
    def test_keys_are_deleted_before_their_next_write_once(self):
        ctl, backend, replaced = _controller(seals=True)
        ctl._replace_at_next_write(["c", "d"])
        self.assertEqual(_backup(ctl, ["a", "b", "c", "d"]), 4 * PAGE_SIZE)
        # Deleted before the batch write, counted once; remembered no more.
        self.assertEqual(backend.written, [(["a", "b", "c", "d"], ["c", "d"])])
        self.assertEqual(replaced, [2])
        _backup(ctl, ["c", "d"])
        self.assertEqual(backend.deleted, ["c", "d"])
        self.assertEqual(replaced, [2])

    def test_pools_that_do_not_seal_keep_the_upstream_path(self):
        ctl, backend, replaced = _controller(seals=False)
        ctl._replace_at_next_write(["a"])
        _backup(ctl, ["a"])
        self.assertEqual((backend.deleted, replaced), ([], []))


class TestHiCacheFileDelete(CustomTestCase):
    def test_a_deleted_key_is_written_again(self):
        with tempfile.TemporaryDirectory() as path:
            store = HiCacheFile(_config(path))
            old, new = (
                torch.zeros(8, dtype=torch.uint8),
                torch.ones(8, dtype=torch.uint8),
            )
            self.assertTrue(store.set("k", old))
            self.assertTrue(store.set("k", new))  # an existing key is skipped
            out = torch.empty(8, dtype=torch.uint8)
            self.assertTrue(torch.equal(store.get("k", out), old))
            store.delete("k")
            self.assertFalse(store.exists("k"))
            store.delete("k")  # nothing stored: no error
            self.assertTrue(store.set("k", new))
            self.assertTrue(torch.equal(store.get("k", out), new))


class _FakeStore:
    def __init__(self):
        self.queried, self.removed = [], []

    def batch_is_exist(self, keys):
        self.queried.extend(keys)
        return [1] * len(keys)

    def remove(self, key, force=False):
        self.removed.append((key, force))
        return 0


def _mooncake(mla: bool, split_heads: bool = False):
    # Only what batch_exists and delete read; the real one connects to a master.
    store = MooncakeStore.__new__(MooncakeStore)
    store.config_prefix = "prefix"
    store.is_mla_backend = mla
    store.mla_suffix = ""
    store.should_split_heads = split_heads
    store.mha_suffix = ["0", "1"] if split_heads else "0"
    store.split_factor = 2
    store.store = _FakeStore()
    return store


class TestMooncakeDelete(CustomTestCase):
    def test_delete_removes_the_objects_batch_exists_queries(self):
        for mla, split in ((False, False), (False, True), (True, False)):
            store = _mooncake(mla, split)
            store.batch_exists(["page"])
            store.delete("page")
            # forced: the prefetch that found the page unusable holds a lease
            self.assertEqual(
                store.store.removed, [(k, True) for k in store.store.queried]
            )
            self.assertEqual(len(store.store.removed), 1 if mla else 2 + 2 * split)


if __name__ == "__main__":
    unittest.main()
