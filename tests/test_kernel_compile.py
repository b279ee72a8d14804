"""The INT8 host pools' Triton kernels (MHA and MLA) compile for every NVIDIA
target we ship for (sm_80, sm_86, sm_89, sm_90), without a GPU: sm_86 in
make test, all four with HIQ_KERNEL_ARCHS=all (kernel_compile.ARCHS).

Every specialisation the pool can launch over the test grid is compiled
through the pool's real launch sites with the pinned Triton and its bundled
ptxas (scripts/kernel_compile.py, in worker processes that build the kernels in
compiled mode), then checked: no compile error, no register
spill, and the PTX keeps the IEEE arithmetic kv_int8_codec's bit-exactness
argument relies on. The last tests break a kernel on purpose and show each
kind of breakage fails the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scripts.kernel_compile import (
    ARCHS,
    FORMAT_GRIDS,
    GRIDS,
    SMALL,
    TRANSFER_PAGES,
    compile_for_targets,
    compile_grid_in_workers,
    compile_grids_in_workers,
    main,
    ptx_problems,
)

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache import kv_int8_triton as kt

REPO = Path(__file__).resolve().parents[1]
JOBS = max(1, os.cpu_count() or 1)
# The grid each compile test reads; the fixture compiles those selected at once.
TEST_GRIDS = {
    "test_every_pool_kernel_compiles_cleanly": "int8",
    "test_every_mla_kernel_compiles_cleanly": "mla",
    "test_every_int4_kernel_compiles_cleanly": "int4",
    "test_every_fp8_int4_kernel_compiles_cleanly": "int4-fp8",
    "test_every_rotated_int4_kernel_compiles_cleanly": "int4-rot",
    "test_every_int8c_kernel_compiles_cleanly": "int8c",
}


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """compiled(grid): the kernel_compile grid compiled for every ARCHS target.
    The first call compiles every grid the selected tests read, in JOBS
    workers side by side (one worker keeps one core busy)."""
    runs = {}

    def compile_once(grid: str) -> dict:
        if grid not in runs:
            selected = {
                TEST_GRIDS.get(item.originalname) for item in request.session.items
            }
            grids = sorted((selected - {None} - set(runs)) | {grid})
            start = time.perf_counter()
            out = tmp_path_factory.mktemp("kernel-compile")
            runs.update(compile_grids_in_workers(grids, ARCHS, out, JOBS))
            for name in grids:
                for arch, run in runs[name].items():
                    print(
                        f"{name} sm_{arch}: {len(run['specs'])} distinct specialisations "
                        f"from {run['launches']} launches in {run['seconds']} s "
                        f"({run['cpu_seconds']} CPU s)"
                    )
            wall = time.perf_counter() - start
            print(f"{grids} compile check: {wall:.0f} s wall with {JOBS} worker(s)")
        return runs[grid]

    return compile_once


def clean_specs(compiled, grid: str, arch: int) -> list[dict]:
    """The grid's specialisations for sm_<arch>, none with a problem."""
    specs = compiled(grid)[arch]["specs"]
    problems = [f"{s['describe']}: {p}" for s in specs for p in s["problems"]]
    assert not problems, "\n".join(problems)
    return specs


def arg_types(spec: dict) -> set[str]:
    """A specialisation's argument types, those of tuple arguments (records,
    device rows) included."""
    types, todo = set(), list(spec["signature"].values())
    while todo:
        t = todo.pop()
        if isinstance(t, (list, tuple)):
            todo.extend(t)
        else:
            types.add(t)
    return types


@pytest.mark.parametrize("arch", ARCHS)
def test_every_pool_kernel_compiles_cleanly(compiled, arch):
    specs = clean_specs(compiled, "int8", arch)
    # The grid reached both kernels for both device dtypes, every unit size
    # (page_size 1/16/64 and layer_first's 1) and the i64-stride pool.
    kinds = {
        ("encode" in s["name"], s["constexprs"].get("IS_BF16"))
        for s in specs
        if "encode" in s["name"] or "decode" in s["name"]
    }
    assert kinds == {(e, b) for e in (True, False) for b in (True, False)}
    assert {s["constexprs"].get("UT") for s in specs} >= {1, 16, 64}
    assert any("i64" in arg_types(s) for s in specs if "encode" in s["name"])


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mla_kernel_compiles_cleanly(compiled, arch):
    """kv_mla_int8_triton over the MLA grid (scripts/kernel_compile.py
    mla_grid): the same checks as the MHA kernels, which it shares the
    arithmetic with."""
    specs = clean_specs(compiled, "mla", arch)
    assert {s["name"] for s in specs} == {
        "_mla_encode_kernel",
        "_mla_decode_kernel",
    }
    kinds = {("encode" in s["name"], s["constexprs"].get("IS_BF16")) for s in specs}
    assert kinds == {(e, b) for e in (True, False) for b in (True, False)}
    assert {s["constexprs"].get("UT") for s in specs} >= {1, 16, 64}
    assert {s["constexprs"].get("NT") for s in specs} == {2, 4}
    assert any("i64" in arg_types(s) for s in specs if "encode" in s["name"])


def assert_int4_grid_clean(specs: list[dict], dtype_constexpr: str, values) -> None:
    """Both kv_int4_triton kernels for every device dtype (values of
    dtype_constexpr), key grouping (INT8 keys, per-token, per-channel) and
    unit size."""
    kinds = {
        (
            "encode" in s["name"],
            s["constexprs"][dtype_constexpr],
            s["constexprs"]["KEY_MODE"],
        )
        for s in specs
    }
    modes = (k4.KEYS_INT8, k4.KEYS_PER_TOKEN, k4.KEYS_PER_CHANNEL)
    assert kinds == {(e, v, m) for e in (True, False) for v in values for m in modes}
    assert {s["constexprs"]["UT"] for s in specs} == {1, 4, 16, 64}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_int4_kernel_compiles_cleanly(compiled, arch):
    """The INT4 / K8V4 kernels (kv_int4_triton) over their grid: no spill,
    the IEEE arithmetic the format's bit-exactness rests on."""
    assert_int4_grid_clean(
        clean_specs(compiled, "int4", arch), "IS_BF16", (True, False)
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_every_fp8_int4_kernel_compiles_cleanly(compiled, arch):
    """The INT4 / K8V4 kernels on FP8 device KV (kernel_compile.int4_fp8_grid):
    no spill, the IEEE arithmetic, NaN tests kept and no hardware FP8
    conversion, for both FP8 dtypes and every key grouping."""
    specs = clean_specs(compiled, "int4-fp8", arch)
    assert_int4_grid_clean(specs, "FP8", (hk.FP8_E4M3, hk.FP8_E5M2))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_rotated_int4_kernel_compiles_cleanly(compiled, arch):
    """The rotated variants (ROT_B = (K, V) blocks > 0: the butterfly inside the
    INT4 / K8V4 tiles) over kernel_compile.int4_rotated_grid: the same
    checks, for every key grouping, block size and unit size."""
    specs = clean_specs(compiled, "int4-rot", arch)
    kinds = {
        (
            "encode" in s["name"],
            s["constexprs"]["KEY_MODE"],
            *s["constexprs"]["ROT_B"],
        )
        for s in specs
    }
    per_token, per_channel = k4.KEYS_PER_TOKEN, k4.KEYS_PER_CHANNEL
    assert kinds == {
        (e, *rot)
        for e in (True, False)
        for rot in (
            (per_channel, 128, 128),
            (per_token, 128, 128),
            (k4.KEYS_INT8, 0, 128),
            (per_channel, 32, 16),
            (per_token, 32, 16),
        )
    }
    assert {s["constexprs"]["UT"] for s in specs} == {1, 4, 16, 64}
    assert {s["constexprs"]["IS_BF16"] for s in specs} == {True, False}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_int8c_kernel_compiles_cleanly(compiled, arch):
    """int8c's kernels (kv_int8c_triton: INT8 rows and kv_int4_triton's channel
    groups at 8 bits) over kernel_compile.int8c_grid: no spill, the IEEE
    arithmetic, both key modes, both device dtypes, every unit size."""
    from sglang.kernels.ops.kvcache import kv_int8c_triton as k8c

    specs = clean_specs(compiled, "int8c", arch)
    kinds = {
        (
            "encode" in s["name"],
            s["constexprs"]["KEY_MODE"],
            s["constexprs"]["IS_BF16"],
        )
        for s in specs
    }
    modes = (k8c.KEYS_PER_TOKEN, k8c.KEYS_PER_CHANNEL)
    both = (True, False)
    assert kinds == {(e, m, b) for e in both for m in modes for b in both}
    assert {s["constexprs"]["UT"] for s in specs} == {1, 4, 16, 64, 128}


# --- the check fails on broken kernels ---------------------------------------
# Each breaks a kernel in a fresh compile worker (kernel_compile.MUTATIONS).


def compile_small(tmp_path, grid: str, arch: int = 86) -> dict:
    return compile_grid_in_workers((arch,), tmp_path, 1, grid=grid)[arch]


def by_name(run: dict, name: str) -> list[dict]:
    return [s for s in run["specs"] if name in s["name"]]


def test_type_error_in_a_kernel_fails_compilation(tmp_path):
    with pytest.raises(AssertionError, match="CompilationError"):
        compile_small(tmp_path, "small+decode-type-error")


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scripts.kernel_compile", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


def tool_run(tmp_path, grid: str, arch: int, status: int) -> dict:
    """`python -m scripts.kernel_compile --grid GRID`: its report lists each
    specialisation, every problem under its kernel, and counts them in its
    last line and its exit status; returns the run it kept (--json)."""
    proc = run_tool("--grid", grid, "--arch", str(arch), "--json", str(tmp_path))
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / grid / f"sm_{arch}.json").read_text())
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{grid} sm_{arch}: {len(run['specs'])} distinct")
    problems = [p for s in run["specs"] for p in s["problems"]]
    assert [line for line in lines if "PROBLEM" in line] == [
        f"    PROBLEM {p}" for p in problems
    ]
    assert lines[-1].startswith(f"kernel_compile: {len(problems)} problem(s)")
    return run


def test_approximate_division_is_reported(tmp_path):
    run = tool_run(tmp_path, "small+encode-div", 86, status=1)
    (encode,) = by_name(run, "encode")
    assert "div.full.f32" in encode["ptx"]
    assert any("non-IEEE fp32 division" in p for p in encode["problems"])
    assert any("no IEEE division" in p for p in encode["problems"])
    assert all(not spec["problems"] for spec in by_name(run, "decode"))


def test_register_spill_is_reported(tmp_path):
    # A tile far past the register file: ptxas has to spill.
    (encode,) = by_name(compile_small(tmp_path, "small+encode-spill"), "encode")
    assert encode["spill_bytes"] > 0
    assert any("register spills" in p for p in encode["problems"])


def test_ptx_checks_flag_non_ieee_fp16_and_missing_nan_test(tmp_path):
    run = tool_run(tmp_path, "small", 89, status=0)
    # Direct access: one backup launch and one restore launch per layer.
    assert run["launches"] == len(TRANSFER_PAGES) * (1 + SMALL.layer_num)
    (encode,) = by_name(run, "encode")
    assert encode["problems"] == []
    ptx = encode["ptx"]

    def flagged(text, what):
        return any(what in p for p in ptx_problems(text, encode["name"], True))

    assert not flagged(ptx, "")
    assert flagged(ptx.replace("cvt.rn.f16.f32", "cvt.rn.ftz.f16.f32"), "not plain RNE")
    assert flagged(ptx.replace("cvt.rn.f16.f32", "cvt.rz.f16.f32"), "not plain RNE")
    assert flagged(ptx.replace("div.rn.f32", "div.approx.f32"), "non-IEEE")
    assert flagged(ptx + "\n\tmul.rz.f16 %rs1, %rs2, %rs3;", "fp16 arithmetic")
    assert flagged(ptx + "\n\tabs.ftz.f32 %f1, %f2;", "flush-to-zero")
    no_nan = ptx.replace("setp.nan.f32", "setp.lt.f32")
    assert flagged(no_nan.replace("setp.neu.f32", "setp.ne.f32"), "NaN test")


def test_approximate_division_in_int4_kernels_is_reported(tmp_path):
    run = compile_small(tmp_path, "small-int4+int4-div")
    encodes = by_name(run, "encode")
    assert encodes and all(
        any("non-IEEE fp32 division" in p for p in spec["problems"]) for spec in encodes
    )
    assert all(not spec["problems"] for spec in by_name(run, "decode"))


def test_compiling_interpreted_kernels_is_refused(tmp_path):
    """In this (interpreted) process the compile check refuses to run rather
    than compile nothing."""
    if not kt.available("cpu"):
        pytest.skip("kernels built for the GPU here")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"):
        compile_for_targets(lambda: None, (86,), tmp_path)


# --- the tool: python -m scripts.kernel_compile --------------------------------


def test_every_host_format_has_a_compile_grid():
    """--format takes every registered --hicache-host-dtype value (a new format
    needs its grid here) and names only real grids."""
    from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES

    assert set(FORMAT_GRIDS) == set(HOST_DTYPES)
    assert {g for grids in FORMAT_GRIDS.values() for g in grids} <= set(GRIDS)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--format", "int8", "--arch", "75"], "--arch='75'"),
        (["--grid", "small+no-such-break"], "--grid 'small+no-such-break'"),
        ([], "pass --format or --grid"),
    ],
)
def test_tool_refuses_bad_arguments(capsys, args, named):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2 and named in capsys.readouterr().err
