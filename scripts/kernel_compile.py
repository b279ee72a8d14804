"""Compile the INT8 host pools' Triton kernels for NVIDIA GPUs on a CPU-only machine.

Triton picks its compile target from the active driver. TargetOnlyDriver is a
stand-in that reports a CUDA target (sm_80/86/89/90) and nothing else; with
it active, the pool's real launch sites (MHATokenToKVPoolINT8Host backup and
restore -> kv_int8_triton.encode_gather / decode_scatter) run as usual, and
every `kernel[grid](...)` they reach is recorded instead of launched, keeping
the first launch of each distinct specialisation (Triton's own binder and
cache key). Each of those is then compiled for each target with Triton's
warm-up on the recorded arguments: PTX and, by Triton's bundled ptxas, a
cubin, never launched. Grid "mla" does the same for the MLA INT8 pool
(MLATokenToKVPoolINT8Host -> kv_mla_int8_triton) on SGLang's MLA device pool.

What is checked on each compiled kernel (CompiledSpec.problems):
  * ptxas reports no register spills (its `-v` log, captured per compile);
  * the PTX keeps the arithmetic kv_int8_codec's bit-exactness rests on:
    every fp32 division is IEEE `div.rn.f32` (no `div.approx`/`div.full`,
    no `rcp.approx`); every fp32 -> fp16 conversion is `cvt.rn.f16.f32`
    (round to nearest even, no flush-to-zero, no saturation), and the only
    fp16 arithmetic is the round-to-nearest multiply LLVM may narrow the fp16
    decode to (same single rounding of the exact q * s); the only
    flush-to-zero instruction is libdevice's floor (`cvt.rmi.ftz.f32.f32`,
    harmless, docs/kernels.md); and the NaN tests (x != x) were
    not folded away; FP8 kernels (FP8 constexpr) convert by integer
    operations, with no hardware FP8 conversion (`cvt.*.e4m3x2`/`e5m2x2`,
    absent before sm_89).

Run it as a tool from the repository root (build/sglang first on the path):
    python -m scripts.kernel_compile --format int8c [--arch 86,90] [--jobs N]
prints each compiled specialisation with its problems and exits 1 if any has
one; tests/test_kernel_compile.py asserts on the same summaries.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import os
import re
import resource
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction, compute_cache_key

SHIPPED_ARCHS = (80, 86, 89, 90)
# make test compiles for the A6000 users run (sm_86); the release check,
# HIQ_KERNEL_ARCHS=all (or a list, "86,90"), adds H100/H200 (sm_90) and the rest.


def parse_archs(text: str, source: str) -> tuple[int, ...]:
    """'all' or a comma list of SHIPPED_ARCHS ("86,90"); `source` names the
    flag or variable the text came from, for the error."""
    try:
        archs = (
            SHIPPED_ARCHS
            if text == "all"
            else tuple(sorted({int(a) for a in text.split(",") if a.strip()}))
        )
    except ValueError:
        archs = ()
    if not archs or not set(archs) <= set(SHIPPED_ARCHS):
        raise ValueError(f"{source}={text!r}: pass 'all' or some of {SHIPPED_ARCHS}")
    return archs


ARCHS = parse_archs(os.environ.get("HIQ_KERNEL_ARCHS", "86"), "HIQ_KERNEL_ARCHS")

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_F32_DIV = re.compile(r"\b(div(?:\.[a-z0-9]+)*\.f32)\b")
_TO_F16 = re.compile(r"\b(cvt(?:\.[a-z0-9]+)*\.f16(?:x2)?\.f32)\b")
_RNE_TO_F16 = {"cvt.rn.f16.f32", "cvt.rn.f16x2.f32"}
# LLVM may narrow fptrunc(fp32(q) * fp32(s)) to an fp16 multiply: the same
# single RNE rounding of the exact product (fp32 holds it: 11 + 11 <= 24 bits).
_F16_MATH = re.compile(r"\b((?:add|sub|mul|fma|div)(?:\.[a-z0-9]+)*\.f16(?:x2)?)\b")
_RNE_F16_MUL = {"mul.f16", "mul.rn.f16", "mul.f16x2", "mul.rn.f16x2"}
_FTZ = re.compile(r"\b([a-z]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*)\b")
_NAN_TEST = re.compile(r"\b(setp\.(?:nan|neu|equ)\.f32|testp\.notanumber\.f32)\b")
_ALLOWED_FTZ = {"cvt.rmi.ftz.f32.f32"}  # libdevice floor (enable_reflect_ftz)
_FP8_CVT = re.compile(r"\b(cvt(?:\.[a-z0-9]+)*\.(?:e4m3|e5m2)x2(?:\.[a-z0-9]+)*)\b")


class TargetOnlyDriver:
    """Triton driver stand-in: a CUDA target for the compiler, no device.

    Each target gets its own device key, so Triton keeps a separate kernel
    cache per target. Anything that would touch a GPU (loading a cubin,
    launching) is not provided and fails loudly if reached."""

    def __init__(self, arch: int):
        self.arch = arch

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> str:
        return f"compile-only-sm_{self.arch}"

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass
class CompiledSpec:
    """One distinct kernel specialisation compiled for one target."""

    arch: int
    name: str
    hash: str
    signature: dict
    constexprs: dict
    ptx: str
    ptxas_log: str

    @property
    def is_bf16(self) -> bool:
        return bool(self.constexprs.get("IS_BF16"))

    @property
    def fp8(self) -> int:
        return int(self.constexprs.get("FP8", 0))

    def describe(self) -> str:
        types = ",".join(str(t) for t in self.signature.values() if t != "constexpr")
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"sm_{self.arch} {self.name}({types}; {consts}) [{self.hash[:12]}]"

    def spill_bytes(self) -> int | None:
        found = _SPILLS.findall(self.ptxas_log)
        return sum(int(a) + int(b) for a, b in found) if found else None

    def problems(self) -> list[str]:
        return ptxas_problems(self.ptxas_log) + ptx_problems(
            self.ptx, self.name, self.is_bf16, self.fp8
        )


def ptxas_problems(log: str) -> list[str]:
    found = _SPILLS.findall(log)
    if not found:
        return ["no ptxas -v report (was the kernel compiled here?)"]
    spills = [(int(a), int(b)) for a, b in found if int(a) or int(b)]
    return [f"register spills: {st} B stored, {ld} B loaded" for st, ld in spills]


def ptx_problems(ptx: str, name: str, is_bf16: bool, fp8: int = 0) -> list[str]:
    """The PTX properties the codec's bit-exactness argument relies on
    (fp8: the kernel's FP8 constexpr, 0 for 16-bit device KV)."""
    encode = "encode" in name
    problems = []
    divs = set(_F32_DIV.findall(ptx))
    if divs - {"div.rn.f32"}:
        problems.append(f"non-IEEE fp32 division: {sorted(divs - {'div.rn.f32'})}")
    if encode and "div.rn.f32" not in divs:
        problems.append("encode has no IEEE division (div.rn.f32)")
    if re.search(r"\brcp\.approx", ptx):
        problems.append("approximate reciprocal (rcp.approx)")
    to_f16 = set(_TO_F16.findall(ptx))
    if to_f16 - _RNE_TO_F16:
        problems.append(f"fp32->fp16 not plain RNE: {sorted(to_f16 - _RNE_TO_F16)}")
    f16_math = set(_F16_MATH.findall(ptx))
    if f16_math - _RNE_F16_MUL:
        problems.append(
            f"fp16 arithmetic beyond RNE mul: {sorted(f16_math - _RNE_F16_MUL)}"
        )
    if encode and not to_f16:
        problems.append("no fp32->fp16 scale conversion (cvt.rn.f16.f32)")
    if not encode and not is_bf16 and not fp8 and not (to_f16 or f16_math):
        problems.append(
            "fp16 decode neither converts (cvt.rn.f16.f32) nor multiplies in fp16"
        )
    ftz = set(_FTZ.findall(ptx)) - _ALLOWED_FTZ
    if ftz:
        problems.append(f"flush-to-zero instructions: {sorted(ftz)}")
    if (encode or is_bf16 or fp8) and not _NAN_TEST.search(ptx):
        problems.append("NaN test (x != x) folded away: no unordered fp32 compare")
    fp8_cvt = set(_FP8_CVT.findall(ptx))
    if fp8_cvt:
        problems.append(f"hardware FP8 conversion (not on sm_80/86): {sorted(fp8_cvt)}")
    return problems


@dataclass
class CompileRun:
    """The distinct specialisations one drive launched, compiled for one target."""

    arch: int
    launches: int  # kernel launches the drive made (all compiled from specs)
    specs: dict[str, CompiledSpec] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process and its ptxas runs

    def by_name(self, name: str) -> list[CompiledSpec]:
        return [s for s in self.specs.values() if name in s.name]


@dataclass
class _Launch:
    fn: JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


def _cpu_seconds() -> float:
    usage = [
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    ]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _record_instead_of_launch(launches: dict, counter: list):
    """JITFunction.__getitem__ that keeps the first launch of each distinct
    specialisation (Triton's own cache key, from its own binder) and runs
    nothing."""

    def getitem(self: JITFunction, grid):
        def record(*args, **kwargs):
            device = driver.active.get_current_device()
            _, key_cache, _, _, binder = self.device_caches[device]
            bound = {"debug": False, "instrumentation_mode": "", **kwargs}
            _, specialization, options = binder(*args, **bound)
            key = (id(self), compute_cache_key(key_cache, specialization, options))
            launches.setdefault(key, _Launch(self, grid, args, kwargs))
            counter[0] += 1

        return record

    return getitem


def _named_constexprs(arg_names, constants) -> dict:
    """The kernel's constexprs by name; a kernel's Geometry tuple by its
    fields' names (the checks read IS_BF16, UT, ... whichever way it comes)."""
    named = {}
    for path, value in constants.items():
        if len(path) == 1:
            fields = value._asdict() if hasattr(value, "_asdict") else None
            named.update(fields or {arg_names[path[0]]: value})
    return named


def _compile(launch: _Launch, arch: int) -> CompiledSpec:
    log = io.StringIO()
    # knobs.nvidia.dump_ptxas_log makes make_cubin print ptxas -v.
    with contextlib.redirect_stdout(log):
        kernel = launch.fn.run(
            *launch.args, grid=launch.grid, warmup=True, **launch.kwargs
        )
    return CompiledSpec(
        arch=arch,
        name=kernel.name,
        hash=kernel.hash,
        signature=dict(kernel.src.signature),
        constexprs=_named_constexprs(launch.fn.arg_names, kernel.src.constants),
        ptx=kernel.asm["ptx"],
        ptxas_log=log.getvalue(),
    )


def compile_for_targets(drive, archs, cache_dir) -> dict[int, CompileRun]:
    """Run drive() with every Triton launch recorded instead of run, then
    compile each distinct specialisation it launched for each sm_<arch>
    (PTX and cubin, Triton's full pipeline with warm-up).

    The kernels must have been built in compiled mode: a process that
    imported triton without TRITON_INTERPRET (compile_grid_in_workers)."""
    from sglang.kernels.ops.kvcache import host_kv_common

    if host_kv_common.available("cpu"):
        raise RuntimeError(
            "the kernels were built interpreted: compile them in a process "
            "started with TRITON_INTERPRET=0 (compile_grid_in_workers)"
        )
    launches, counter = {}, [0]
    runs = {}
    previous_driver = driver._active
    with knobs.cache.scope(), knobs.compilation.scope(), knobs.nvidia.scope():
        knobs.cache.dir = str(cache_dir)
        # A cached cubin would skip ptxas and with it the spill report.
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        try:
            driver.set_active(TargetOnlyDriver(archs[0]))
            with pytest.MonkeyPatch.context() as recording:
                recording.setattr(
                    JITFunction,
                    "__getitem__",
                    _record_instead_of_launch(launches, counter),
                )
                drive()
            for arch in archs:
                driver.set_active(TargetOnlyDriver(arch))
                run = runs[arch] = CompileRun(arch, launches=counter[0])
                start, cpu_start = time.perf_counter(), _cpu_seconds()
                for launch in launches.values():
                    spec = _compile(launch, arch)
                    run.specs.setdefault(spec.hash, spec)
                run.seconds = time.perf_counter() - start
                run.cpu_seconds = _cpu_seconds() - cpu_start
        finally:
            driver.set_active(previous_driver)
    return runs


# --- driving the pool's launch sites ----------------------------------------

# Transfer sizes in pages: n_rows = tokens * heads is a kernel argument, and
# Triton specialises integers on == 1 and on divisibility by 16; 1, 3 and 16
# pages reach every class the grid's geometries can produce.
TRANSFER_PAGES = (1, 3, 16)
HOST_ACCESS = ("direct", "staged")
# Device index tensors as the pool can receive them on CUDA: int64 (the
# allocator's), int32, and an int64 view not 16-byte aligned (a slice of a
# radix node's indices). Host indices arrive on the CPU and are uploaded into
# a fresh (aligned) tensor, so only their dtype varies.
DEVICE_INDEX_KINDS = ("int64", "int32", "int64-unaligned")
DTYPES = (torch.bfloat16, torch.float16)  # the device KV dtypes the pools take


@dataclass(frozen=True)
class PoolCase:
    layout: str
    page_size: int
    geometry: tuple[int, int, int]  # (head_num, head_dim, v_head_dim)
    dtype: torch.dtype
    host_access: str
    device_index_kinds: tuple[str, ...] = ("int64",)
    layer_num: int = 2
    # Host slots; None: 17 pages. Beyond memory, the host buffers are meta
    # tensors (shapes and strides only): nothing is launched, nothing touched.
    host_tokens: int | None = None
    # Packed MTP draft layers (one device pool each) after the target's.
    draft_layers: int = 0

    def __str__(self) -> str:
        h, d, dv = self.geometry
        return (
            f"{self.layout}/p{self.page_size}/h{h}d{d}v{dv}/"
            f"{str(self.dtype).removeprefix('torch.')}/{self.host_access}"
            + (f"/host{self.host_tokens}" if self.host_tokens else "")
            + (f"/draft{self.draft_layers}" if self.draft_layers else "")
        )


def _device_indices(rows: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "int32":
        return rows.to(torch.int32)
    if kind == "int64-unaligned":
        padded = torch.empty(len(rows) + 1, dtype=torch.int64)
        padded[1:] = rows
        view = padded[1:]
        assert view.data_ptr() % 16 != 0
        return view
    return rows.clone()


def _meta_alloc(dims, dtype, device, pin_memory, allocator):
    return torch.empty(dims, dtype=dtype, device="meta")


def drive_pool(case: PoolCase) -> None:
    """The MHA INT8 pool (host_pool_cls("int8")) over `case`."""
    from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

    from scripts.rigs.hicache_harness import Geometry

    head_num, head_dim, v_head_dim = case.geometry
    geo = Geometry(
        layer_num=case.layer_num,
        head_num=head_num,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=case.dtype,
        page_size=case.page_size,
    )
    drive_host_pool(case, geo, host_pool_cls=host_pool_cls("int8"))


def drive_host_pool(case, geo, **pool_kwargs) -> None:
    """Backups and per-layer restores of every transfer size through a real
    encoded host pool (make_host_pool(**pool_kwargs)) with the fused kernels
    selected: `case` a PoolCase or MLACase, `geo` its device geometry."""
    from scripts.rigs.hicache_harness import make_device_pool, make_host_pool

    from sglang.srt.mem_cache.pool_host import base, encoded
    from sglang.srt.mem_cache.pool_host.host_format import HostKVFormat

    p = case.page_size
    pages = max(TRANSFER_PAGES) + 1
    device_pool = make_device_pool(geo, device_tokens=pages * p)
    drafts = _draft_pools(geo, case.draft_layers, pages * p)
    with pytest.MonkeyPatch.context() as mp, base.host_memory_budget_scope(1 << 60):
        if case.host_tokens is not None:
            mp.setattr(encoded, "ALLOC_MEMORY_FUNCS", {"cpu": _meta_alloc})
        # The kernels compile for the stand-in CUDA target here, launched on
        # CPU tensors: the pool is asked for them as if they ran.
        mp.setattr(HostKVFormat, "fused_available", lambda self, device: True)
        pool = make_host_pool(
            device_pool,
            host_tokens=case.host_tokens or pages * p,
            layout=case.layout,
            draft_buffer_infos=_draft_infos(drafts),
            fused_transfer=case.host_access,
            **pool_kwargs,
        )
    for n_pages in TRANSFER_PAGES:
        tokens = n_pages * p
        rows = torch.arange(p, p + tokens)  # device page 0 is the padding page
        host = torch.arange(pool.size - tokens, pool.size)  # the top slots
        for kind in case.device_index_kinds:
            dev = _device_indices(rows, kind)
            pool.backup_from_device_all_layer(device_pool, host.clone(), dev, "kernel")
            # One index pair for every layer of a restore, as the controller does.
            restore_host = host.clone()
            for layer in range(case.layer_num):
                pool.load_to_device_per_layer(
                    device_pool, restore_host, dev, layer, "kernel"
                )
            _load_drafts(pool, drafts, restore_host, dev)
    if pool.transfer_path != f"fused_{case.host_access}":
        raise AssertionError(f"{case}: the pool chose {pool.transfer_path}")


def _draft_pools(geo, layers: int, device_tokens: int) -> list:
    from scripts.rigs.hicache_harness import make_device_pool

    one = type(geo)(**{**geo.__dict__, "layer_num": 1})
    return [make_device_pool(one, device_tokens) for _ in range(layers)]


def _draft_infos(drafts) -> tuple:
    return tuple(d.get_device_pool_infos()[0].buffer_info for d in drafts)


def _load_drafts(pool, drafts, host, dev) -> None:
    """Each draft layer's restore, as the controller's draft mapper issues it."""
    for depth, draft in enumerate(drafts):
        pool.load_to_device_per_layer(
            draft, host, dev, pool.target_layer_num + depth, "kernel", is_draft=True
        )


# --- the grid, and one worker process per group of targets -------------------


def pool_grid() -> list[PoolCase]:
    """The test suite's pool grid (tests/test_kv_int8_triton.py POOL_CASES:
    every geometry at page size 16, a subset at 1 and 64) for both device
    dtypes and both host-access modes; every device index kind on the
    odd-head geometry; and pools whose host buffers exceed 2**31 elements."""
    from scripts.rigs.hicache_harness import KERNEL_POOL_CASES as POOL_CASES
    from scripts.rigs.hicache_harness import LAYOUTS

    cases = [
        PoolCase(layout, page_size, geometry, dtype, access)
        for layout, page_size, geometry in POOL_CASES
        for dtype in DTYPES
        for access in HOST_ACCESS
    ]
    cases += [
        PoolCase(layout, page_size, (3, 64, 64), dtype, access, DEVICE_INDEX_KINDS)
        for layout in LAYOUTS
        for page_size in (1, 16)
        for dtype in DTYPES
        for access in HOST_ACCESS
    ]
    # Element offsets past 2**31: layer_first's layer stride itself (an i64
    # kernel argument), page_first's unit * stride (int64 in the kernel).
    # Staging strides do not depend on the pool size, so direct access only.
    huge = (1 << 31) // (8 * 128) + 64
    cases += [
        PoolCase(layout, 64, (8, 128, 128), dtype, "direct", host_tokens=huge)
        for layout in LAYOUTS
        for dtype in DTYPES
    ]
    # Packed MTP drafts: the layer tables reach separate draft allocations.
    cases += [
        PoolCase(
            "page_first", 16, (8, 128, 128), torch.bfloat16, access, draft_layers=1
        )
        for access in HOST_ACCESS
    ]
    return cases


# --- the MLA kernels ---------------------------------------------------------


@dataclass(frozen=True)
class MLACase:
    layout: str
    page_size: int
    dtype: torch.dtype
    host_access: str
    device_index_kinds: tuple[str, ...] = ("int64",)
    kv_lora_rank: int = 512
    rope_dim: int = 64
    layer_num: int = 2
    host_tokens: int | None = None  # beyond memory: meta tensors, as PoolCase
    draft_layers: int = 0  # packed MTP (NEXTN) draft layers, as PoolCase

    def __str__(self) -> str:
        return (
            f"mla/{self.layout}/p{self.page_size}/r{self.kv_lora_rank}+{self.rope_dim}/"
            f"{str(self.dtype).removeprefix('torch.')}/{self.host_access}"
            + (f"/host{self.host_tokens}" if self.host_tokens else "")
            + (f"/draft{self.draft_layers}" if self.draft_layers else "")
        )


def drive_mla(case: MLACase) -> None:
    """The MLA INT8 pool (MLATokenToKVPoolINT8Host: its launch sites call
    kv_mla_int8_triton through MLAInt8HostFormat) over `case`."""
    from scripts.rigs.hicache_harness import MLAGeometry

    geo = MLAGeometry(
        layer_num=case.layer_num,
        kv_lora_rank=case.kv_lora_rank,
        qk_rope_head_dim=case.rope_dim,
        dtype=case.dtype,
        page_size=case.page_size,
    )
    drive_host_pool(case, geo, host_dtype="int8")


def mla_grid() -> list[MLACase]:
    """DeepSeek geometry: every layout, page size 1/16/64, both device dtypes
    and both host-access modes; every device index kind at page 16; a smaller
    latent; host records past 2**31 elements (direct access)."""
    cases = [
        MLACase(layout, page_size, dtype, access)
        for layout in ("page_first", "page_first_direct", "layer_first")
        for page_size in (1, 16, 64)
        for dtype in DTYPES
        for access in HOST_ACCESS
    ]
    cases += [
        MLACase(layout, 16, dtype, "direct", DEVICE_INDEX_KINDS)
        for layout in ("page_first", "layer_first")
        for dtype in DTYPES
    ]
    cases += [MLACase("page_first", 16, torch.bfloat16, "direct", kv_lora_rank=256)]
    # layer_first's layer stride (512 int8 per token) passes 2**31 elements,
    # an i64 kernel argument; page_first's unit * stride is int64 in-kernel.
    huge = (1 << 31) // 512 + 64 * 64
    cases += [
        MLACase(layout, 64, dtype, "direct", host_tokens=huge)
        for layout in ("page_first", "layer_first")
        for dtype in DTYPES
    ]
    # DeepSeek NEXTN: one packed MTP draft layer after the target's.
    cases += [
        MLACase("page_first", 16, torch.bfloat16, access, draft_layers=1)
        for access in HOST_ACCESS
    ]
    return cases


# --- the INT4 / K8V4 kernels, driven directly ----------------------------------
# Their pools are built elsewhere; until they drive these kernels, the grid
# calls encode_gather / decode_scatter as a pool does: one backup of all
# layers with every statistic (direct access), one layer without the
# bad-index counter (staged), and a restore per layer.


@dataclass(frozen=True)
class Int4Case:
    fmt: str  # "int4" | "k8v4", or rotated: "int4r" | "k8v4r"
    unit_tokens: int  # page size; 1 with layer_first
    geometry: tuple[int, int, int]  # (head_num, head_dim, v_head_dim)
    dtype: torch.dtype
    layer_first: bool = False
    index_kinds: tuple[str, ...] = ("int64",)
    staged: bool = False  # also one layer without the bad-index counter
    layer_num: int = 2
    key8_layers: tuple[int, ...] = ()  # int4c's plan (its 8-bit key layers)

    def __str__(self) -> str:
        h, d, dv = self.geometry
        layout = "layer_first" if self.layer_first else "page_first"
        return (
            f"{self.fmt}/{layout}/p{self.unit_tokens}/h{h}d{d}v{dv}/"
            f"{str(self.dtype).removeprefix('torch.')}"
        )


def drive_int4_case(case: Int4Case) -> None:
    from sglang.kernels.ops.kvcache import kv_int4_triton as k4
    from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    H, dk, dv = case.geometry
    ut, layers = case.unit_tokens, case.layer_num
    pages = max(TRANSFER_PAGES) + 1
    size = (pages + 1) * ut
    k_layers = [torch.zeros(size, H, dk, dtype=case.dtype) for _ in range(layers)]
    v_layers = [torch.zeros(size, H, dv, dtype=case.dtype) for _ in range(layers)]
    tables = (k4.DeviceLayerTable(k_layers), k4.DeviceLayerTable(v_layers))
    # Rotated formats: the blocks and signs their pools pass (the launch is
    # only recorded, so the CPU tensors stand in for device ones).
    rotation = {}
    if case.fmt.endswith("r"):
        fmt = host_format_cls(case.fmt, "mha")((dk, dv), H, ut, case.dtype)
        rotation = fmt._kernel_rotation(k_layers[0].device)
    base = case.fmt.removesuffix("r")
    host = _int4_records(base, pages, layers, (ut, H, dk, dv), case.layer_first)
    counter = torch.zeros((), dtype=torch.int64)
    bad = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros(layers, 2)
    for n_pages in TRANSFER_PAGES:
        tokens = n_pages * ut
        rows = torch.arange(ut, ut + tokens)
        host_idx = torch.arange((pages - n_pages) * ut, pages * ut)
        for kind in case.index_kinds:
            dev = _device_indices(rows, kind)
            k4.encode_gather(
                tables, dev, host, host_idx,
                counters=KVCounters(counter, amax, bad), **rotation,
            )  # fmt: skip
            for layer in range(layers):
                dst = (k_layers[layer], v_layers[layer])
                k4.decode_scatter(
                    _layer(host, layer), host_idx, dst, dev, bad_index_counter=bad,
                    **rotation,
                )  # fmt: skip
            if case.staged:
                one_layer = {n: t[:, :1] for n, t in host.items()}
                k4.encode_gather(
                    tables, dev, one_layer, host_idx,
                    counters=KVCounters(counter, amax), first_layer=layers - 1,
                    **rotation,
                )  # fmt: skip
                k4.decode_scatter(_layer(host, 0), host_idx, dst, dev, **rotation)


def _int4_records(fmt: str, units: int, layers: int, shape, layer_first: bool):
    """An INT4/K8V4 pool's host records by name, [units, L, *record] views
    (layer_first: [L, units, *record] storage); shape is (ut, H, dk, dv)."""
    from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec

    ut, H, dk, dv = shape
    shapes = {"int4": codec.int4_record_shapes, "k8v4": codec.k8v4_record_shapes}
    records = {}
    for name, (rec, dtype) in shapes[fmt]((dk, dv), H, ut).items():
        if layer_first:
            records[name] = torch.zeros(layers, units, *rec, dtype=dtype).transpose(
                0, 1
            )
        else:
            records[name] = torch.zeros(units, layers, *rec, dtype=dtype)
    return records


def _layer(records: dict, layer: int) -> dict:
    """One layer's [units, *record] views of _int4_records' records."""
    return {name: t[:, layer] for name, t in records.items()}


def int4_family_grid(int4: str, k8v4: str, layer_first_dtypes, extra) -> list:
    """The cases the int4/k8v4 kernels (and their rotated forms) share, at
    Qwen3-8B's heads: every key grouping, BF16 and FP16, int32 and int64
    indices and the staged calls at page 64; then int4's `extra`
    (unit tokens, geometry) cases in BF16."""
    bf16, fp16, qwen = torch.bfloat16, torch.float16, (8, 128, 128)
    both = ("int64", "int32")
    return [
        Int4Case(int4, 64, qwen, bf16, index_kinds=both, staged=True),
        Int4Case(int4, 64, qwen, fp16),
        Int4Case(int4, 16, qwen, bf16),
        Int4Case(int4, 4, qwen, bf16),
        *(Int4Case(int4, 1, qwen, d, layer_first=True) for d in layer_first_dtypes),
        Int4Case(k8v4, 64, qwen, bf16, index_kinds=both, staged=True),
        Int4Case(k8v4, 64, qwen, fp16),
        Int4Case(k8v4, 1, qwen, bf16, layer_first=True),
        *(Int4Case(int4, ut, geometry, bf16) for ut, geometry in extra),
    ]


def int4_grid() -> list[Int4Case]:
    """Both formats (per-channel keys at page sizes 16 and 64, per-token keys
    at 4 and layer_first's 1), then head dims with channel blocks, groups of
    32 and whole-head groups at one page size. Kept small: compiling is the
    slow part (minutes per target on 2 loaded cores)."""
    dtypes = (torch.bfloat16, torch.float16)
    return int4_family_grid(
        "int4", "k8v4", dtypes, ((64, (4, 192, 128)), (4, (2, 96, 80)))
    )


def int4_fp8_grid() -> list[Int4Case]:
    """FP8 device KV (the FP8 constexpr): each FP8 dtype with each key
    grouping (per-channel, per-token, K8V4's INT8 keys) at Qwen3-8B's heads,
    int32/int64 indices and the staged calls at page 64."""
    e4m3, e5m2, qwen = torch.float8_e4m3fn, torch.float8_e5m2, (8, 128, 128)
    both = ("int64", "int32")
    return [
        Int4Case("int4", 64, qwen, e4m3, index_kinds=both, staged=True),
        Int4Case("int4", 1, qwen, e4m3, layer_first=True),
        Int4Case("k8v4", 64, qwen, e4m3),
        Int4Case("int4", 16, qwen, e5m2),
        Int4Case("int4", 4, qwen, e5m2),
        Int4Case("k8v4", 1, qwen, e5m2, layer_first=True),
    ]


def int4_rotated_grid() -> list[Int4Case]:
    """int4r / k8v4r (the rotation inside the same kernels): Qwen3-8B's heads
    (one 128-point block over two value groups), and head dims 96/80 (blocks
    of 32 and 16, a whole-head group of 80)."""
    extra = ((16, (2, 96, 80)), (4, (2, 96, 80)))
    return int4_family_grid("int4r", "k8v4r", (torch.float16,), extra)


def drive_format_case(case: Int4Case) -> None:
    """A format's own encode_gather / decode_scatter over `case` (records
    allocated from its HostRecords, [unit, layer, ...] or layer_first's
    [layer, unit, ...] transposed), as drive_int4_case calls the INT4 ones."""
    from sglang.kernels.ops.kvcache.host_kv_common import (
        DeviceLayerTable,
        KVCounters,
    )
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    H, dk, dv = case.geometry
    ut, layers = case.unit_tokens, case.layer_num
    pages = max(TRANSFER_PAGES) + 1
    size = (pages + 1) * ut
    geometry = {"key8_layers": case.key8_layers} if case.key8_layers else {}
    fmt = host_format_cls(case.fmt, "mha")((dk, dv), H, ut, case.dtype, **geometry)
    k_layers = [torch.zeros(size, H, dk, dtype=case.dtype) for _ in range(layers)]
    v_layers = [torch.zeros(size, H, dv, dtype=case.dtype) for _ in range(layers)]
    tables = (DeviceLayerTable(k_layers), DeviceLayerTable(v_layers))
    records, stored = {}, {}
    for r in fmt.records:
        # A record of a per-layer plan holds its layers only, in order.
        n = layers if r.layers is None else len(r.layers)
        if case.layer_first:
            t = torch.zeros(n, pages, *r.shape, dtype=r.dtype).transpose(0, 1)
        else:
            t = torch.zeros(pages, n, *r.shape, dtype=r.dtype)
        records[r.name] = t
        stored[r.name] = list(range(layers)) if r.layers is None else list(r.layers)

    def of_layers(first: int, count: int) -> dict:
        """The views of layers [first, first + count) of the records stored there."""
        views = {}
        for name, t in records.items():
            slots = [
                i for i, x in enumerate(stored[name]) if first <= x < first + count
            ]
            if slots:
                views[name] = t[:, slots[0] : slots[-1] + 1]
        return views

    counter = torch.zeros((), dtype=torch.int64)
    bad = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros(layers, 2)
    for n_pages in TRANSFER_PAGES:
        rows = torch.arange(ut, ut + n_pages * ut)
        host_idx = torch.arange((pages - n_pages) * ut, pages * ut)
        for kind in case.index_kinds:
            dev = _device_indices(rows, kind)
            counters = KVCounters(counter, amax, bad)
            fmt.encode_gather(tables, dev, records, host_idx, counters=counters)
            for layer in range(layers):
                dst = (k_layers[layer], v_layers[layer])
                one = {n: t[:, 0] for n, t in of_layers(layer, 1).items()}
                fmt.decode_scatter(one, host_idx, dst, dev, bad_index_counter=bad)
            if case.staged:
                last = of_layers(layers - 1, 1)
                fmt.encode_gather(
                    tables, dev, last, host_idx, counters=KVCounters(counter, amax),
                    first_layer=layers - 1,
                )  # fmt: skip
                fmt.decode_scatter(
                    {n: t[:, 0] for n, t in last.items()}, host_idx, dst, dev
                )


def int8c_grid() -> list[Int4Case]:
    """int8c (kv_int8c_triton) at Qwen3-8B's heads: per-channel keys at page 64
    (BF16 and FP16, int32/int64 indices, the staged calls) and 128, per-token
    key groups at page 16 and layer_first's 1; Gemma 3's one 256-dim head; a
    key dim of 80 (one group per head)."""
    bf16, fp16, qwen = torch.bfloat16, torch.float16, (8, 128, 128)
    both = ("int64", "int32")
    return [
        Int4Case("int8c", 64, qwen, bf16, index_kinds=both, staged=True),
        Int4Case("int8c", 64, qwen, fp16),
        Int4Case("int8c", 128, qwen, bf16),
        Int4Case("int8c", 16, qwen, bf16, index_kinds=both, staged=True),
        Int4Case("int8c", 1, qwen, bf16, layer_first=True),
        Int4Case("int8c", 1, qwen, fp16, layer_first=True),
        Int4Case("int8c", 64, (1, 256, 256), bf16),
        Int4Case("int8c", 4, (2, 80, 48), bf16),
    ]


def int4c_grid() -> list[Int4Case]:
    """int4c (kv_int4c_triton) at Qwen3-8B's heads with 8-bit keys on layer 1
    of 2: 32-token sub-units at page 64 (BF16 and FP16, int32/int64 indices,
    the staged calls) and 128, one 16-token sub-unit at page 16, per-token
    keys at page 4 and layer_first's 1 (4- and 8-bit), no plan at page 64;
    Gemma 3's one 256-dim head (two 128-value blocks); head dims 80/96 (value
    blocks of 16 in a group of 80, of 32 in groups of 32)."""
    bf16, fp16, qwen = torch.bfloat16, torch.float16, (8, 128, 128)
    both, plan = ("int64", "int32"), (1,)
    return [
        Int4Case("int4c", 64, qwen, bf16, index_kinds=both, staged=True,
                 key8_layers=plan),
        Int4Case("int4c", 64, qwen, fp16, staged=True, key8_layers=plan),
        Int4Case("int4c", 64, qwen, bf16),
        Int4Case("int4c", 128, qwen, bf16, key8_layers=plan),
        Int4Case("int4c", 16, qwen, bf16, key8_layers=plan),
        Int4Case("int4c", 4, qwen, bf16, key8_layers=plan),
        Int4Case("int4c", 1, qwen, bf16, layer_first=True, key8_layers=plan),
        Int4Case("int4c", 1, qwen, fp16, layer_first=True, key8_layers=plan),
        Int4Case("int4c", 64, (1, 256, 256), bf16, key8_layers=plan),
        Int4Case("int4c", 32, (2, 80, 96), bf16, key8_layers=plan),
    ]  # fmt: skip


# --- small drives and kernels broken on purpose (the check must fail) ---------

SMALL = PoolCase("page_first", 16, (2, 128, 128), torch.bfloat16, "direct")
SMALL_INT4 = Int4Case("int4", 16, (2, 64, 64), torch.bfloat16, layer_num=1)
SMALL_INT4_ROT = Int4Case("int4r", 16, (2, 128, 128), torch.bfloat16, layer_num=1)


class DivRnToSlash(ast.NodeTransformer):
    """tl.math.div_rn(a, b) -> a / b: Triton's fast (approximate) division."""

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "div_rn":
            return ast.BinOp(node.args[0], ast.Div(), node.args[1])
        return node


class PrependTypeError(ast.NodeTransformer):
    """A first statement that shifts a float tensor: a Triton type error."""

    def visit_FunctionDef(self, node):
        bad = ast.parse("_bad = tl.arange(0, BLOCK_R).to(tl.float32) << 1").body
        node.body = bad + node.body
        return node


def mutant(jit_fn, transformer, out_dir: Path):
    """A jit function whose source is jit_fn's rewritten by transformer, in
    jit_fn's module namespace (written to a file: Triton reads it back)."""
    import triton

    fn = jit_fn.fn
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tree.body[0].decorator_list = []  # jit-ed below, once
    source = ast.unparse(tree)
    mutated = ast.unparse(ast.fix_missing_locations(transformer.visit(tree)))
    assert mutated != source
    path = out_dir / f"{fn.__name__}_mutant.py"
    path.write_text(mutated)
    namespace = {}
    exec(compile(mutated, str(path), "exec"), fn.__globals__, namespace)
    return triton.jit(namespace[fn.__name__])


def _mutate(name: str, out_dir: Path) -> None:
    """Break one kernel as MUTATIONS[name] says, in this (worker) process."""
    from sglang.kernels.ops.kvcache import host_kv_common as hk
    from sglang.kernels.ops.kvcache import kv_int4_triton as k4
    from sglang.kernels.ops.kvcache import kv_int8_triton as kt

    if name == "decode-type-error":
        hk.int8_decode_rows = mutant(hk.int8_decode_rows, PrependTypeError(), out_dir)
    elif name == "encode-div":
        hk.int8_encode_rows = mutant(hk.int8_encode_rows, DivRnToSlash(), out_dir)
    elif name == "encode-spill":
        kt.ENCODE_TILE = 1 << 15  # far past the register file
    elif name == "int4-div":
        k4._group_params = mutant(k4._group_params, DivRnToSlash(), out_dir)
    else:
        raise ValueError(f"unknown mutation {name!r}; choose from {MUTATIONS}")


MUTATIONS = ("decode-type-error", "encode-div", "encode-spill", "int4-div")

GRIDS = {
    "int8": lambda: [drive_pool(case) for case in pool_grid()],
    "mla": lambda: [drive_mla(case) for case in mla_grid()],
    "int4": lambda: [drive_int4_case(case) for case in int4_grid()],
    "int4-rot": lambda: [drive_int4_case(case) for case in int4_rotated_grid()],
    "int4-fp8": lambda: [drive_int4_case(case) for case in int4_fp8_grid()],
    "int8c": lambda: [drive_format_case(case) for case in int8c_grid()],
    "int4c": lambda: [drive_format_case(case) for case in int4c_grid()],
    "small": lambda: drive_pool(SMALL),
    "small-int4": lambda: drive_int4_case(SMALL_INT4),
    # Packed MTP drafts alone (both grids above include them).
    "draft": lambda: [
        drive(case)
        for drive, grid in ((drive_pool, pool_grid), (drive_mla, mla_grid))
        for case in grid()
        if case.draft_layers
    ],
    "small-int4-rot": lambda: drive_int4_case(SMALL_INT4_ROT),
}
# Grids whose JSON carries each kernel's PTX (small enough to send back).
PTX_GRIDS = ("small", "small-int4")


def summary(run: CompileRun, with_ptx: bool = False) -> dict:
    """What the tests assert on, as JSON."""
    return {
        "arch": run.arch,
        "launches": run.launches,
        "seconds": round(run.seconds, 1),
        "cpu_seconds": round(run.cpu_seconds, 1),
        "specs": [
            {
                "describe": spec.describe(),
                "name": spec.name,
                "signature": spec.signature,
                "constexprs": {k: v for k, v in spec.constexprs.items()},
                "spill_bytes": spec.spill_bytes(),
                "problems": spec.problems(),
                **({"ptx": spec.ptx} if with_ptx else {}),
            }
            for spec in run.specs.values()
        ],
    }


def _worker_main(argv: list[str]) -> None:
    """python -m scripts.kernel_compile --worker OUT_DIR GRID[+MUTATION] ARCH...:
    compile the grid (a GRIDS key), with one kernel broken (a MUTATIONS name)
    if given, for each target, writing OUT_DIR/sm_<arch>.json."""
    import json
    import tempfile

    from scripts.common.cpu_sglang import install_cpu_standins

    install_cpu_standins()  # before sglang is imported

    out, (grid, _, mutation), archs = Path(argv[0]), argv[1].partition("+"), argv[2:]
    if mutation:
        _mutate(mutation, out)
    with tempfile.TemporaryDirectory() as cache_dir:
        runs = compile_for_targets(GRIDS[grid], [int(a) for a in archs], cache_dir)
    for arch, run in runs.items():
        summary_json = json.dumps(summary(run, with_ptx=grid in PTX_GRIDS))
        (out / f"sm_{arch}.json").write_text(summary_json)


def compile_grid_in_workers(
    archs, out_dir, jobs: int, grid: str = "int8"
) -> dict[int, dict]:
    """Compile a grid (GRIDS: "int8" the MHA pool's, "mla" the MLA kernels',
    "int4" the INT4/K8V4 kernels'; "GRID+MUTATION" with a kernel broken) for
    each target in `jobs` parallel processes (Triton compiles one kernel at a
    time per process); each drives the grid once. The workers build the
    kernels in compiled mode (TRITON_INTERPRET=0)."""
    import json
    import subprocess

    groups = [list(archs[i::jobs]) for i in range(jobs) if archs[i::jobs]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "scripts.kernel_compile", "--worker"]
            + [str(out_dir), grid, *(str(arch) for arch in group)],
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "TRITON_INTERPRET": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for group in groups
    ]
    logs = [p.communicate()[0] for p in procs]
    results = {}
    for group, proc, log in zip(groups, procs, logs):
        if proc.returncode:
            raise AssertionError(
                f"compile worker for sm_{group} failed ({proc.returncode}):\n"
                + log[-6000:]
            )
        for arch in group:
            results[arch] = json.loads(Path(out_dir, f"sm_{arch}.json").read_text())
    return results


def compile_grids_in_workers(
    grids, archs, out_root, jobs: int
) -> dict[str, dict[int, dict]]:
    """compile_grid_in_workers for several grids at once: one worker process
    per grid and target, at most `jobs` running (one compiles on one core)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(grid_arch):
        grid, arch = grid_arch
        out = Path(out_root, grid)
        out.mkdir(parents=True, exist_ok=True)
        return compile_grid_in_workers((arch,), out, 1, grid=grid)[arch]

    work = [(grid, arch) for grid in grids for arch in archs]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        runs = list(pool.map(one, work))
    results: dict[str, dict[int, dict]] = {grid: {} for grid in grids}
    for (grid, arch), run in zip(work, runs):
        results[grid][arch] = run
    return results


# --- the tool -----------------------------------------------------------------

# The grids that compile a --hicache-host-dtype value's kernels (MHA and MLA).
FORMAT_GRIDS = {
    "int8": ("int8", "mla"),
    "int4": ("int4", "int4-fp8"),
    "k8v4": ("int4", "int4-fp8"),
    "int4r": ("int4-rot",),
    "k8v4r": ("int4-rot",),
    "int8c": ("int8c",),
    "int4c": ("int4c",),
}


def report(grid: str, run: dict) -> list[str]:
    """The report lines of one grid compiled for one target: a heading, then
    each specialisation with its spill bytes and problems."""
    lines = [
        f"{grid} sm_{run['arch']}: {len(run['specs'])} distinct specialisations "
        f"from {run['launches']} launches in {run['seconds']} s "
        f"({run['cpu_seconds']} CPU s)"
    ]
    for spec in run["specs"]:
        lines.append(f"  {spec['describe']}: {spec['spill_bytes']} B spilled")
        lines += [f"    PROBLEM {problem}" for problem in spec["problems"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m scripts.kernel_compile",
        description="Compile the host pools' Triton kernels for NVIDIA targets "
        "without a GPU and check each specialisation (no spill, IEEE "
        "arithmetic); exit 1 if any has a problem.",
    )
    parser.add_argument(
        "--format",
        action="append",
        default=[],
        choices=sorted(FORMAT_GRIDS),
        help="a --hicache-host-dtype value whose kernels to compile (repeatable)",
    )
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="GRID[+MUTATION]",
        help=f"a grid by name, {sorted(GRIDS)}, optionally with one kernel "
        f"broken on purpose (+ one of {list(MUTATIONS)}) (repeatable)",
    )
    parser.add_argument(
        "--arch",
        default=",".join(map(str, ARCHS)),
        help=f"'all' or a comma list of {SHIPPED_ARCHS} (default: "
        "HIQ_KERNEL_ARCHS, else 86)",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes"
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="DIR",
        help="also keep each run's summary as DIR/<grid>/sm_<arch>.json",
    )
    args = parser.parse_args(argv)
    try:
        archs = parse_archs(args.arch, "--arch")
    except ValueError as e:
        parser.error(str(e))
    for grid in args.grid:
        name, _, mutation = grid.partition("+")
        if name not in GRIDS or (mutation and mutation not in MUTATIONS):
            parser.error(
                f"--grid {grid!r}: pass one of {sorted(GRIDS)}, optionally "
                f"+ one of {list(MUTATIONS)}"
            )
    grids = list(dict.fromkeys([g for f in args.format for g in FORMAT_GRIDS[f]]))
    grids += [g for g in args.grid if g not in grids]
    if not grids:
        parser.error("pass --format or --grid (what to compile)")
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        runs = compile_grids_in_workers(grids, archs, args.json or scratch, args.jobs)
    problems = 0
    for grid in grids:
        for arch in archs:
            print("\n".join(report(grid, runs[grid][arch])))
            problems += sum(len(s["problems"]) for s in runs[grid][arch]["specs"])
    targets = ", ".join(f"sm_{a}" for a in archs)
    print(f"kernel_compile: {problems} problem(s) in {grids} for {targets}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
