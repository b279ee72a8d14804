"""GPU tests: stand-ins for what a bare CUDA machine lacks, and a JSON report.

scripts/gpu_check.sh runs these with --confcutdir=tests/gpu, so the CPU
stand-ins of tests/conftest.py (which no-op cudaHostRegister) are not loaded.
Under `make test` (CPU) tests/conftest.py is loaded first and every test here
is skipped. HIQ_GPU_TEST_JSON=<path> writes one record per test to <path>.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_support import gpu_test_device, install_gpu_standins  # noqa: E402

STANDINS = install_gpu_standins() if gpu_test_device() else {}

_records: list[dict] = []
_started = time.time()


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        entry = {
            "test": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
        }
        if report.outcome != "passed":
            text = str(report.longrepr)
            entry["detail"] = text[-3000:]
        props = dict(getattr(report, "user_properties", []) or [])
        if props:
            entry["properties"] = props
        _records.append(entry)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("HIQ_GPU_TEST_JSON")
    if not path:
        return
    counts = {}
    for r in _records:
        if r["when"] == "call" or r["outcome"] != "passed":
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    Path(path).write_text(
        json.dumps(
            {
                "exit_status": int(exitstatus),
                "seconds": round(time.time() - _started, 1),
                "device": gpu_test_device(),
                "standins": STANDINS,
                "counts": counts,
                "tests": _records,
            },
            indent=1,
        )
    )
