"""The host pools' Triton kernels compile for every NVIDIA target we ship for
without a GPU (scripts/kernel_compile.py): no compile error, no spill, the IEEE
arithmetic the codecs' bit-exactness relies on; broken kernels fail the check."""

from __future__ import annotations

import itertools
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
from sglang.kernels.ops.kvcache import kv_int4c_triton as k4c
from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.kernels.ops.kvcache import kv_int8c_triton as k8c

REPO = Path(__file__).resolve().parents[1]
JOBS = max(1, os.cpu_count() or 1)


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """compiled(grid): the kernel_compile grid compiled for every ARCHS target.
    The first call compiles every grid the selected tests read, in JOBS
    workers side by side (one worker keeps one core busy)."""
    runs = {}

    def compile_once(grid: str) -> dict:
        if grid not in runs:
            selected = {
                item.callspec.params["grid"]
                for item in request.session.items
                if item.originalname == "test_every_kernel_compiles_cleanly"
            }
            grids = sorted((selected - set(runs)) | {grid})
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


def kinds(specs: list[dict], *constexprs: str) -> set[tuple]:
    """(is encode, the constexprs' values, tuples flattened) per specialisation."""
    out = set()
    for s in specs:
        values = [s["constexprs"].get(c) for c in constexprs]
        flat = [x for v in values for x in (v if isinstance(v, (list, tuple)) else [v])]
        out.add(("encode" in s["name"], *flat))
    return out


def every(*axes) -> set[tuple]:
    return set(itertools.product((True, False), *axes))


BOTH = (True, False)
INT4_MODES = (k4.KEYS_INT8, k4.KEYS_PER_TOKEN, k4.KEYS_PER_CHANNEL)
PER_TOKEN, PER_CHANNEL = k4.KEYS_PER_TOKEN, k4.KEYS_PER_CHANNEL
INT4C_MODES = (k4c.KEYS_PER_TOKEN, k4c.KEYS_SUB_UNITS)
ROTATIONS = [
    (PER_CHANNEL, 128, 128),
    (PER_TOKEN, 128, 128),
    (k4.KEYS_INT8, 0, 128),
    (PER_CHANNEL, 32, 16),
    (PER_TOKEN, 32, 16),
]
# grid: (constexprs, the (is encode, *values) the grid must reach, the unit
# sizes it must reach, exactly or at least). INT8/MLA: both device dtypes,
# page sizes 1/16/64; INT4/K8V4: every key grouping (INT8 keys, per token, per
# channel) on bf16/fp16, both FP8 dtypes, the rotated blocks (ROT_B); int8c:
# both key modes; int4c: both key modes, restores of 4- and 8-bit key layers
# (PLAN) on bf16/fp16, backups with a plan (and 32-token sub-units without).
COMPILE_GRIDS = {
    "int8": (("IS_BF16",), every(BOTH), {1, 16, 64}, "at least"),
    "mla": (("IS_BF16",), every(BOTH), {1, 16, 64}, "at least"),
    "int4": (("IS_BF16", "KEY_MODE"), every(BOTH, INT4_MODES), {1, 4, 16, 64}, ""),
    "int4-fp8": (
        ("FP8", "KEY_MODE"),
        every((hk.FP8_E4M3, hk.FP8_E5M2), INT4_MODES),
        {1, 4, 16, 64},
        "",
    ),
    "int4-rot": (
        ("KEY_MODE", "ROT_B"),
        {(e, *rot) for e in BOTH for rot in ROTATIONS},
        {1, 4, 16, 64},
        "",
    ),
    "int8c": (
        ("KEY_MODE", "IS_BF16"),
        every((k8c.KEYS_PER_TOKEN, k8c.KEYS_PER_CHANNEL), BOTH),
        {1, 4, 16, 64, 128},
        "",
    ),
    "int4c": (
        ("KEY_MODE", "IS_BF16", "PLAN"),
        {(False, *kind) for kind in itertools.product(INT4C_MODES, BOTH, BOTH)}
        | {(True, mode, bf16, True) for mode in INT4C_MODES for bf16 in BOTH}
        | {(True, k4c.KEYS_SUB_UNITS, True, False)},
        {1, 4, 16, 32, 64, 128},
        "",
    ),
}
IDS = {"int4-fp8": "fp8-int4", "int4-rot": "rotated-int4"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("grid", COMPILE_GRIDS, ids=lambda g: IDS.get(g, g))
def test_every_kernel_compiles_cleanly(compiled, grid, arch):
    """Every specialisation of the grid (scripts/kernel_compile.py): no compile
    error, no spill, the IEEE arithmetic the bit-exactness rests on."""
    specs = clean_specs(compiled, grid, arch)
    constexprs, want, units, how = COMPILE_GRIDS[grid]
    with_kinds = [s for s in specs if "encode" in s["name"] or "decode" in s["name"]]
    assert kinds(with_kinds, *constexprs) == want
    got_units = {s["constexprs"].get("UT") for s in specs}
    assert got_units >= units if how else got_units == units
    if grid in ("int8", "mla"):  # the i64-stride pool
        assert any("i64" in arg_types(s) for s in specs if "encode" in s["name"])
    if grid == "mla":
        assert {s["name"] for s in specs} == {
            "_mla_encode_kernel",
            "_mla_decode_kernel",
        }
        assert {s["constexprs"].get("NT") for s in specs} == {2, 4}
    if grid == "int4-rot":
        assert {s["constexprs"]["IS_BF16"] for s in specs} == {True, False}


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
