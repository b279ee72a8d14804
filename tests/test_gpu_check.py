"""scripts/gpu_check.sh on CPU: --dry-run runs both phases end to end (tests/gpu/
interpreted, the benchmark at tiny sizes); the tests phase fails in one line
without CUDA, a package or a Python with torch (default: the checkout's .venv)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
from scripts.overlay import read_lock
from tests.gpu.run_gpu_tests import verdict
from scripts.rigs import gpu as gpu_support


def gpu_check(*args: str, site: Path, out: Path, env_extra=None, timeout=900):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HIQ_GPU_TEST_DEVICE", "TRITON_INTERPRET", "HIQ_GPU_TEST_JSON")
    }
    env["PYTHON"] = sys.executable
    env.update(env_extra or {})
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--out", str(out), "--site", str(site), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """One installed site for the module (the phases reuse it, as on the GPU)."""
    return tmp_path_factory.mktemp("gpu-site") / "site"


def test_dry_run_runs_both_phases(site, tmp_path):
    proc = gpu_check("--dry-run", site=site, out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status["tests"] == status["bench"] == "ok"
    assert status["install"] == "ok" and status["apply_series"] == "ok"
    assert "one pip call" in summary["steps"][0]["detail"]

    tests = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert tests["verdict"] == "ok" and tests["device"] == "cpu"
    # Every GPU test ran on CPU: none is left to CUDA alone.
    assert tests["counts"] == {"passed": len(tests["tests"])}
    ran = {t["test"].split("::")[1].split("[")[0] for t in tests["tests"]}
    assert {
        "test_delayed_transfers_stay_on_their_stream",
        "test_controller_layer_events_cover_a_delayed_restore",
        "test_unpinned_host_memory",
        "test_kernels_bit_exact_against_cpu_reference",
        "test_mla_kernels_on_the_pools_pinned_records",
        "test_mla_kernels_run_on_the_callers_stream",
    } <= ran

    # The kernel table runs every format's kernels, MLA INT8 included.
    assert any(
        "test_kernels_bit_exact_against_cpu_reference[" in t["test"]
        and "mla" in t["test"]
        for t in tests["tests"]
    )

    bench = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert "fatal" not in bench and bench["failed_checks"] == []
    # The codec benchmark iterates the registry: every format and model kind
    # with fused kernels in this build ran, at every unit size, and restored
    # its reference bytes.
    from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES

    runs = bench["codec"]["runs"]
    ran = {(r["format"], r["kind"], r["unit_tokens"]) for r in runs}
    skipped = {s.split(":")[0] for s in bench["codec"]["skipped"]}
    for name, entry in HOST_DTYPES.items():
        for kind, units in (("mha", (64, 1)), ("mla", (1,))):
            for ut in units if getattr(entry, f"{kind}_format") else ():
                assert (name, kind, ut) in ran or f"{name}/{kind}/p{ut}" in skipped
    assert {("int8", "mha", 1), ("int4", "mha", 64), ("k8v4", "mha", 64)} <= ran
    assert all(all(r["checks"].values()) and r["encode_GBps"] > 0 for r in runs)
    figures = bench["figures"]["transfers"]
    assert {(f["config"], f["tokens"]) for f in figures} == {
        (cfg, n) for cfg in ("page_first/p64", "layer_first/p1") for n in (64, 128)
    }
    for f in figures:
        assert f["restore_ms_per_layer_int8"] > 0 and f["backup_ms_per_layer_bf16"] > 0
    assert bench["figures"]["codec_encode_GBps"] > 0
    mla = next(r for r in runs if r["kind"] == "mla" and r["format"] == "int8")
    assert mla["ratio_vs_device"] == 1152 / 648 and mla["decode_GBps"] > 0
    assert bench["figures"]["device_copy_GBps"] > 0

    # A later phase reuses the installed site: no second pip install. (Extra
    # arguments after -- narrow the pytest run.)
    again = tmp_path / "again"
    proc = gpu_check("--dry-run", "tests", "--", "-k", "default_on_cuda",
                     site=site, out=again)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads((again / "gpu_check.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["site", "tests"]
    assert json.loads((again / "gpu_tests.json").read_text())["counts"] == {"passed": 1}


def test_tests_phase_fails_without_cuda(site, tmp_path):
    if gpu_support.gpu_test_device() == "cuda":
        pytest.skip("this machine has CUDA")
    proc = gpu_check("tests", site=site, out=tmp_path)
    assert proc.returncode != 0
    assert "FAILED: no CUDA device visible" in proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert report["verdict"].startswith("failed: no CUDA device")
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps[-1]["step"] == "tests" and steps[-1]["status"] == "failed"


def test_missing_package_is_named_in_one_line(site, tmp_path):
    """orjson (sglang imports it) absent: both phases say so in one line."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "orjson.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'orjson'\", name='orjson')\n"
    )
    env = {"PYTHONPATH": str(shadow)}
    proc = gpu_check("--dry-run", site=site, out=tmp_path / "out", env_extra=env)
    assert proc.returncode != 0
    for log in ("gpu_tests.log", "gpu_bench.log"):
        text = (tmp_path / "out" / log).read_text()
        lines = [l for l in text.splitlines() if "missing package" in l]
        assert len(lines) == 1 and "orjson (module orjson" in lines[0], text[-2000:]
        assert "Traceback" not in text and "imports ok" not in text


RECORDING_PYTHON = """#!/bin/bash
echo "$0" >> "$CALLS"
{run}
"""


def bare_checkout(root: Path, venv_python: str | None) -> Path:
    """The script and sglang.lock alone; `venv_python` is .venv/bin/python's body."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "gpu_check.sh", root / "scripts")
    shutil.copy2(REPO / "sglang.lock", root)
    if venv_python is not None:
        python = root / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(RECORDING_PYTHON.format(run=venv_python))
        python.chmod(0o755)
    return root


def bare_gpu_check(root: Path, python3: str, *args: str, **env: str):
    """gpu_check.sh of `root` with no PYTHON, a python3 on PATH running `python3`."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(RECORDING_PYTHON.format(run=python3))
    (bin_dir / "python3").chmod(0o755)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "tests", "--out", str(root / "out"), *args],
        cwd=root,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "CALLS": str(root / "calls"),
            "HIQ_WHEEL_CACHE": str(root / "no-wheels"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    calls = root / "calls"
    return proc, calls.read_text().split() if calls.exists() else []


def test_default_python_is_the_checkouts_venv(tmp_path):
    root = bare_checkout(tmp_path / "repo", f'exec "{sys.executable}" "$@"')
    proc, calls = bare_gpu_check(root, "exit 1")
    # Past the torch check with the venv's Python, on to the missing wheel.
    assert proc.returncode == 2
    version = read_lock(REPO / "sglang.lock")["SGLANG_VERSION"]
    assert f"error: no sglang {version} wheel for cp" in proc.stderr, proc.stderr
    assert set(calls) == {str(root / ".venv" / "bin" / "python")}


def test_python_without_torch_fails_in_one_line(tmp_path):
    root = bare_checkout(tmp_path / "repo", None)
    # The test venv's interpreter without its site-packages: no torch, no triton.
    proc, calls = bare_gpu_check(root, f'exec "{sys.executable}" -S "$@"')
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "[gpu-check] error: python3 has no torch, triton: pass PYTHON=/path/to/python"
        " with PyTorch and Triton (on CPU the test venv: make venv, then"
        " PYTHON=.venv/bin/python)"
    ]
    assert set(calls) == {str(root / "bin" / "python3")}
    assert not (root / "out" / "gpu_check.json").exists()  # no step ran

    proc, _ = bare_gpu_check(
        bare_checkout(tmp_path / "other", None), "exit 1", PYTHON="/no/python"
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "[gpu-check] error: no Python at /no/python: pass PYTHON=/path/to/python"
        " (one with PyTorch and Triton)"
    ]


def test_missing_packages_found_without_importing(monkeypatch, tmp_path):
    listing = tmp_path / "carried.txt"
    listing.write_text("# comment\nhiq-absent-dist hiq_absent_module\npytest pytest\n")
    monkeypatch.setattr(gpu_support, "CARRIED_PACKAGES", listing)
    assert gpu_support.carried_packages() == {
        "hiq_absent_module": "hiq-absent-dist",
        "pytest": "pytest",
    }
    assert gpu_support.missing_packages() == ["hiq-absent-dist (hiq_absent_module)"]


@pytest.mark.parametrize(
    "counts,rc,device,ok",
    [
        ({"passed": 3}, 0, "cuda", True),
        ({"passed": 3}, 0, "cpu", True),
        ({"passed": 3, "skipped": 1}, 0, "cpu", True),
        ({"passed": 3, "skipped": 1}, 0, "cuda", False),  # nothing may skip on CUDA
        ({"skipped": 4}, 0, "cpu", False),  # everything skipped
        ({}, 5, "cuda", False),  # nothing collected
        ({"passed": 2, "failed": 1}, 1, "cuda", False),
        ({"passed": 2, "error": 1}, 1, "cuda", False),
    ],
)
def test_tests_phase_verdict(counts, rc, device, ok):
    assert (verdict({"counts": counts}, rc, device) == "ok") is ok


def test_test_report_is_rewritten_after_every_test(monkeypatch, tmp_path):
    """A tests phase cut at its limit still leaves the tests it got through."""
    import importlib.util
    from types import SimpleNamespace

    path = REPO / "tests" / "gpu" / "conftest.py"
    spec = importlib.util.spec_from_file_location("gpu_conftest_under_test", path)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    out = tmp_path / "gpu_tests.json"
    monkeypatch.setenv("HIQ_GPU_TEST_JSON", str(out))
    plugin.pytest_sessionstart(None)
    assert json.loads(out.read_text())["status"] == "running"
    for i, outcome in enumerate(("passed", "failed")):
        plugin.pytest_runtest_logreport(
            SimpleNamespace(
                when="call", outcome=outcome, nodeid=f"t.py::test_{i}",
                duration=0.5, longrepr="boom", user_properties=[],
            )
        )  # fmt: skip
        report = json.loads(out.read_text())
        assert report["status"] == "running" and len(report["tests"]) == i + 1
    assert report["counts"] == {"passed": 1, "failed": 1}
    assert report["tests"][1]["detail"] == "boom"
    plugin.pytest_sessionfinish(None, 1)
    assert json.loads(out.read_text())["status"] == "finished"
