"""Tests phase of scripts/gpu_check.sh: `python -m tests.gpu.run_gpu_tests --json
OUT.json [--dry-run] [pytest args]`, exit 0 only if tests ran and passed (no CUDA
device without --dry-run, a missing package, none passed, a skip on CUDA: fail)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def verdict(report: dict, rc: int, device: str) -> str:
    """'ok', or why the phase failed."""
    counts = report.get("counts", {})
    bad = {k: v for k, v in counts.items() if k not in ("passed", "skipped")}
    if bad or rc != 0:
        return f"failed: pytest exit {rc}, {counts}"
    if not counts.get("passed"):
        return f"failed: no test passed ({counts or 'none collected'})"
    if device == "cuda" and counts.get("skipped"):
        return f"failed: {counts['skipped']} test(s) skipped on CUDA"
    return "ok"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter")
    args, pytest_args = parser.parse_known_args(argv)
    if args.dry_run:
        # Before triton is imported: the kernels run interpreted on CPU.
        os.environ["HIQ_GPU_TEST_DEVICE"] = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HIQ_GPU_TEST_JSON"] = str(args.json)
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def give_up(reason: str) -> int:
        args.json.write_text(json.dumps({"verdict": f"failed: {reason}"}, indent=1))
        print(f"gpu-check tests: FAILED: {reason}", file=sys.stderr)
        return 2

    from scripts.rigs import gpu as gpu_support

    missing = gpu_support.missing_packages()
    if missing:
        return give_up(f"missing packages: {', '.join(missing)}")
    device = gpu_support.gpu_test_device()
    if device is None:
        return give_up(
            "no CUDA device visible (torch.cuda.is_available() is False; "
            "--dry-run runs the tests on CPU)"
        )
    try:
        gpu_support.import_modules_under_test()
    except gpu_support.MissingPackage as e:
        return give_up(f"missing package: {e}")
    print("gpu-check tests: imports ok, device", device, file=sys.stderr, flush=True)

    import pytest

    # Options (-k, -x) narrow the run; without a test path, all of tests/gpu.
    if not any(a.endswith(".py") or ".py::" in a for a in pytest_args):
        pytest_args.append(str(HERE))
    options = ["-p", "no:cacheprovider", f"--confcutdir={HERE}", "-q", "-rfEs"]
    rc = int(pytest.main(options + pytest_args))
    report = json.loads(args.json.read_text()) if args.json.exists() else {}
    report["verdict"] = verdict(report, rc, device)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"gpu-check tests: {report['verdict']}", file=sys.stderr)
    return 0 if report["verdict"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
