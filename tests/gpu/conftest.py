"""GPU tests: stand-ins for what a bare CUDA machine lacks, a JSON report
(HIQ_GPU_TEST_JSON, rewritten after every test); skipped under `make test`
(tests/test_gpu_check.py runs them with --dry-run)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from scripts.rigs.gpu import gpu_test_device, gpu_test_marks, install_gpu_standins

STANDINS = install_gpu_standins() if gpu_test_device() else {}

_records: list[dict] = []
_started = time.time()


def counts(records: list[dict]) -> dict[str, int]:
    """Outcome -> number of tests (a setup error or skip counts once)."""
    out: dict[str, int] = {}
    for r in records:
        if r["when"] == "call" or r["outcome"] != "passed":
            out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    return out


def write_report(status: str, exit_status: int | None = None) -> None:
    path = os.environ.get("HIQ_GPU_TEST_JSON")
    if not path:
        return
    report = {
        "status": status,
        "exit_status": exit_status,
        "seconds": round(time.time() - _started, 1),
        "device": gpu_test_device(),
        "standins": STANDINS,
        "counts": counts(_records),
        "tests": _records,
    }
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in item.path.parents:
            for mark in gpu_test_marks():
                item.add_marker(mark)


def pytest_sessionstart(session):
    write_report("running")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        entry = {
            "test": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
        }
        if report.outcome != "passed":
            entry["detail"] = str(report.longrepr)[-3000:]
        props = dict(getattr(report, "user_properties", []) or [])
        if props:
            entry["properties"] = props
        _records.append(entry)
        write_report("running")


def pytest_sessionfinish(session, exitstatus):
    write_report("finished", int(exitstatus))
