"""The upstream-style unit test that the exported PR carries passes against
the patched tree (run through unittest, as SGLang's CPU CI would)."""

import importlib.util
import unittest

from scripts.rigs.standins import PATCHED_TREE

UPSTREAM_TESTS = [
    PATCHED_TREE.parent / "test/registered/unit/mem_cache/test_mha_int8_host_pool.py",
    PATCHED_TREE.parent / "test/registered/kernels/ops/kvcache/test_kv_int8_triton.py",
    PATCHED_TREE.parent / "test/registered/unit/mem_cache/test_hicache_host_tier_stats.py",
    PATCHED_TREE.parent
    / "test/registered/unit/mem_cache/test_mha_int8_storage_pages.py",
    PATCHED_TREE.parent / "test/registered/unit/mem_cache/test_mha_int4_host_pool.py",
    PATCHED_TREE.parent / "test/registered/unit/mem_cache/test_mla_int8_host_pool.py",
    PATCHED_TREE.parent
    / "test/registered/kernels/ops/kvcache/test_kv_mla_int8_triton.py",
    PATCHED_TREE.parent / "test/registered/kernels/ops/kvcache/test_kv_int4_triton.py",
    PATCHED_TREE.parent / "test/registered/unit/mem_cache/test_mooncake_short_read.py",
    PATCHED_TREE.parent
    / "test/registered/unit/mem_cache/test_mooncake_multi_buffer_pages.py",
]


def test_upstream_unit_tests_pass():
    for path in UPSTREAM_TESTS:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        suite = unittest.defaultTestLoader.loadTestsFromModule(module)
        assert suite.countTestCases() > 0
        result = unittest.TextTestRunner(verbosity=0).run(suite)
        assert result.wasSuccessful(), (result.failures, result.errors)
