"""Runs upstream-style unit test files on one SGLang tree on CPU with the stand-ins
(test_pr_bisect.py); `--import` modules first, so one importing a later PR's fails:
python -m tests.upstream_unit_runner [--import mod ...] [--] <test files...>"""

from __future__ import annotations

import importlib
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

args = sys.argv[1:]
modules, files = [], args
if args[:1] == ["--import"]:
    split = args.index("--") if "--" in args else len(args)
    modules, files = args[1:split], args[split + 1 :]

failed = 0
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as error:  # any failure to import is this check's finding
        print(f"import {name}: {type(error).__name__}: {error}")
        failed += 1
print(f"imported {len(modules) - failed} of {len(modules)} modules")
for path in map(Path, files):
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
