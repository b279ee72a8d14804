"""The upstream-style unit tests the exported PRs carry pass against the patched
tree (through unittest, as SGLang's CPU CI runs them)."""

import importlib.util
import unittest

from scripts.rigs.standins import PATCHED_TREE

UNIT, KERNELS = "unit/mem_cache", "kernels/ops/kvcache"
UPSTREAM_TESTS = [
    PATCHED_TREE.parent / "test" / "registered" / folder / f"test_{name}.py"
    for folder, names in (
        (UNIT, ("mha_int8_host_pool", "hicache_host_tier_stats")),
        (UNIT, ("mha_int8_storage_pages", "mha_int4_host_pool", "mla_int8_host_pool")),
        (UNIT, ("mooncake_short_read", "mooncake_multi_buffer_pages")),
        (KERNELS, ("kv_int8_triton", "kv_mla_int8_triton", "kv_int4_triton")),
    )
    for name in names
]


def test_upstream_unit_tests_pass():
    for path in UPSTREAM_TESTS:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        suite = unittest.defaultTestLoader.loadTestsFromModule(module)
        assert suite.countTestCases() > 0, path
        result = unittest.TextTestRunner(verbosity=0).run(suite)
        assert result.wasSuccessful(), (result.failures, result.errors)
