"""Run upstream-style unit test files against one SGLang tree on CPU, with the
stand-ins of scripts/rigs/standins.py (used by test_pr_bisect.py in a subprocess).

    HIQ_SGLANG_TREE=<tree> PYTHONPATH=<tree>/python \
        python -m tests.upstream_unit_runner <test files...>
"""

from __future__ import annotations

import importlib.util
import sys
import unittest
from pathlib import Path

from scripts.rigs.standins import install_sglang_standins, install_torchvision_stub

install_torchvision_stub()
install_sglang_standins()

import sglang.srt.mem_cache.pool_host.base as host_pool_base  # noqa: E402

# The test pools need kilobytes; on a shared machine upstream's 10 GiB reserve
# of free RAM is often not there, and every host pool would be refused.
host_pool_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30

failed = 0
for path in map(Path, sys.argv[1:]):
    # As `python3 <test file>` runs it: its folder first on the path, so a test
    # may import a sibling test module's helpers.
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    if suite.countTestCases() == 0:
        print(f"{path}: no tests")
        failed += 1
        continue
    result = unittest.TextTestRunner(verbosity=0).run(suite)
    failed += not result.wasSuccessful()
    print(f"{path}: {result.testsRun} tests, ok={result.wasSuccessful()}")
sys.exit(1 if failed else 0)
