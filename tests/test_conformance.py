"""Host-format conformance: every --hicache-host-dtype value of the registry (MHA, and
MLA where the value has an MLA format), the toy format registered through the registry
alone, and the stock pool as the control, through the real HiCacheController on CPU."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import host_format as hf
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import get_mla_host_pool_cls
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    finish_transfers,
    make_device_pool,
    make_host_pool,
    make_rig,
    paged_pools,
    paged_rig,
    random_controller_operations,
)
from tests.support import int4_pool_checks as pint
from tests.support.codec_inputs import DTYPES
from tests.support.conformance import (
    EXPECT,
    GEOMETRIES,
    IO_BACKENDS,
    L3_PAGE_SIZES,
    LAYOUTS,
    PAGE_SIZES,
    STOCK,
    TOY,
    FormatCase,
    bits,
    error_bounds,
    format_cases,
    heads_geometry,
    host_unit_records,
    host_units,
    reference,
    rows_at,
    scrambled_host_free_list,
    side_buffers,
    spread,
    unit_tokens,
)
from tests.support.fp8_reference import FP8
from tests.support.int4_pool_checks import bytes_per_token_at_qwen3_8b, pages

CASES = format_cases()
MHA_CASES = format_cases(kinds=("mha",))
FUSED_CASES = [c for c in CASES if c.has_fused_kernels()]
SENTINEL = 7.0


@pytest.fixture
def case(request):
    """The parametrized FormatCase, with the toy format registered for it."""
    case: FormatCase = request.param
    if case.toy:
        request.getfixturevalue("toy_host_format")
    return case


def case_params(cases, grid, keep=lambda case, *row: True):
    """pytest params of every case crossed with every grid row it `keep`s."""
    params = []
    for c, row in itertools.product(cases, grid):
        row = row if isinstance(row, tuple) else (row,)
        if keep(c, *row):
            ids = "-".join([c.id, *map(str, row)]).replace("torch.", "")
            params.append(pytest.param(c, *row, id=ids))
    return params


def accepted(case: FormatCase, layout: str, io_backend: str, path: str) -> bool:
    """Whether the case takes this combination on CPU: the stock pool's kernel backend
    is CUDA-only, it refuses page_first with the direct backend, and it has one copy
    path."""
    if case.stock:
        return (io_backend, path) == ("direct", "torch") and layout != "page_first"
    return True


def expected_pool_cls(case: FormatCase, device_pool):
    info = device_pool.get_device_pool_infos()[0].buffer_info
    if case.kind == "mla":
        return get_mla_host_pool_cls(case.host_dtype)
    return get_mha_host_pool_cls(info, case.host_dtype)


# Every transfer path: (the pool's fused_transfer, run_copies) arguments;
# CUDA's torch path and staged kernels copy per run, CPU's index once.
INDEX_PATHS = {
    "torch": ("off", False),
    "runs": ("off", True),
    "fused_direct": ("direct", False),
    "fused_staged": ("staged", False),
    "fused_staged_runs": ("staged", True),
}


def path_kwargs(case: FormatCase, path: str) -> dict:
    """The encoded pool's arguments that choose `path` (a stock pool has one)."""
    access, runs = INDEX_PATHS[path]
    return {} if case.stock else {"fused_transfer": access, "run_copies": runs}


def fill_sentinel(device_pool) -> None:
    for side in side_buffers(device_pool):
        for buf in side:
            buf.fill_(SENTINEL)


def outside(device_pool, dev: torch.Tensor) -> torch.Tensor:
    """The device slots a transfer into `dev` must leave alone."""
    mask = torch.ones(side_buffers(device_pool)[0][0].shape[0], dtype=torch.bool)
    mask[dev] = False
    return mask


def assert_records_at(pool, written, units: torch.Tensor, host_before: dict) -> None:
    """The host records at `units` are the reference encoding of `written` (per layer);
    every other unit keeps its bytes."""
    names = [r.name for r in pool.host_format.records]
    for layer, rows in enumerate(written):
        want, _ = reference(pool, rows)
        got = host_unit_records(pool, layer, units)
        assert list(got) == names
        for name in names:
            assert torch.equal(bits(got[name]), bits(want[name])), (name, layer)
    axis = 1 if pool.layout == "layer_first" else 0
    for name, before in host_before.items():
        kept = torch.ones(before.shape[axis], dtype=torch.bool)
        kept[units] = False
        pick = (slice(None), kept) if axis else (kept,)
        after = pool.host_records[name]
        assert torch.equal(bits(after[pick]), bits(before[pick])), name


def controller_round_trip(
    case: FormatCase, geo, *, layout: str, io_backend: str, path="torch", seed=0
):
    """Device -> L2 (controller write) -> L1 eviction -> L2 -> L1 (controller load),
    host slots scrambled first; checks every byte against the format's reference."""
    ps = geo.page_size
    rig = make_rig(
        geo,
        device_tokens=max(96, 10 * ps),
        host_tokens=max(96, 12 * ps),
        layout=layout,
        io_backend=io_backend,
        host_dtype=case.host_dtype,
        **path_kwargs(case, path),
        **({"device_kv_dtype": geo.dtype} if geo.dtype in FP8 else {}),
    )
    ctl, device_pool, pool = rig.controller, rig.device_pool, rig.host_pool
    assert type(pool) is expected_pool_cls(case, device_pool)
    assert isinstance(device_pool, MLATokenToKVPool) == (case.kind == "mla")
    if not case.stock:
        assert pool.transfer_path == ("torch" if path == "runs" else path)
    scrambled_host_free_list(pool, ps, seed)
    free_before = pool.available_size()

    dev = rig.allocator.alloc(37 if ps == 1 else 4 * ps)
    spread(device_pool, dev, seed)
    written = rows_at(device_pool, dev)
    host_before = (
        None if case.stock else {n: b.clone() for n, b in pool.host_records.items()}
    )
    host = ctl.write(dev, node_id=0)
    assert host is not None, "host pool full"
    finish_transfers(ctl)
    assert len(torch.unique(host)) == len(dev)
    if not case.stock:
        assert_records_at(pool, written, host_units(pool, host), host_before)

    fill_sentinel(device_pool)
    rig.allocator.free(dev)
    # Load in another order than the backup's: the pages reversed.
    order = torch.arange(len(host)).view(-1, ps).flip(0).flatten()
    dev2 = ctl.load(host[order], node_id=0)
    assert dev2 is not None, "device pool full"
    ctl.start_loading()
    finish_transfers(ctl)

    restored = rows_at(device_pool, dev2)
    untouched = outside(device_pool, dev2)
    for layer, (rows, got) in enumerate(zip(written, restored)):
        records, want = reference(pool, rows)
        for g, w in zip(got, want):
            assert torch.equal(bits(g), bits(w[order])), layer
        if records is not None:
            in_order = [g[torch.argsort(order)] for g in got]
            bounds = error_bounds(pool, records, in_order)
            for x, g, bound in zip(rows, in_order, bounds):
                assert ((g.double() - x.double()).abs() <= bound.double()).all()
            if geo.dtype in FP8:  # finite FP8 in, finite FP8 out: saturated
                top = torch.finfo(geo.dtype).max
                assert all((g.double().abs() <= top).all() for g in got)
        for side in side_buffers(device_pool):
            assert (side[layer][untouched] == SENTINEL).all()
    assert pool.available_size() == free_before - len(host)
    return rig


# --- every layout x io backend, torch and per-run copies ----------------------

BF16, FP16 = torch.bfloat16, torch.float16
# Each encoded format takes every layout x io backend on the torch path and on
# the per-run copies CUDA uses (BF16 at page sizes 1 and 16, as on CUDA's
# common pages); page size and dtype vary over the torch rows so that each
# format meets every (page size, dtype), (io backend, dtype) and (layout,
# dtype) pair once (test_grids_cover_every_pair).
ENCODED_GRID = [
    ("page_first", "direct", 16, BF16, "torch"),
    ("page_first_direct", "direct", 1, FP16, "torch"),
    ("layer_first", "direct", 64, FP16, "torch"),
    ("page_first", "kernel", 16, FP16, "torch"),
    ("page_first_direct", "kernel", 64, BF16, "torch"),
    ("layer_first", "kernel", 1, BF16, "torch"),
] + [
    (layout, io_backend, (1, 16)[i % 2], BF16, "runs")
    for i, (io_backend, layout) in enumerate(itertools.product(IO_BACKENDS, LAYOUTS))
]
# The stock pool takes the direct backend's torch copies outside page_first
# (accepted): each of those layouts at every page size, the dtypes taking
# turns (BF16 first).
STOCK_GRID = [
    (layout, "direct", page_size, DTYPES[i % 2], "torch")
    for i, (layout, page_size) in enumerate(
        itertools.product(("page_first_direct", "layer_first"), PAGE_SIZES)
    )
]
TORCH_PARAMS = case_params(
    [c for c in CASES if not c.stock], ENCODED_GRID
) + case_params([c for c in CASES if c.stock], STOCK_GRID)


def grid_of(case: FormatCase) -> list:
    return STOCK_GRID if case.stock else ENCODED_GRID


# FP8 device KV (stored as uint8) for the formats that encode it: every
# layout, page size and io backend with both FP8 dtypes.
FP8_GRID = [
    (layout, io_backend, page_size, fp8, "torch")
    for layout, io_backend, page_size, fp8 in itertools.product(
        LAYOUTS, IO_BACKENDS, PAGE_SIZES, FP8
    )
]
FP8_PARAMS = case_params(
    [c for c in MHA_CASES if c.host_dtype in EXPECT and EXPECT[c.host_dtype].fp8],
    FP8_GRID,
)


# Fused kernels (Triton's interpreter on CPU): a small grid, it is slow.
FUSED_GRID = [
    ("page_first", "direct", 16, BF16, "fused_direct"),
    ("page_first_direct", "kernel", 4, BF16, "fused_staged"),
    ("layer_first", "direct", 1, BF16, "fused_direct"),
    ("layer_first", "kernel", 1, BF16, "fused_staged"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "case,layout,io_backend,page_size,dtype,path",
    TORCH_PARAMS + FP8_PARAMS + case_params(FUSED_CASES, FUSED_GRID),
    indirect=["case"],
)
def test_controller_round_trip(
    request, case, layout, io_backend, page_size, dtype, path
):
    if path.startswith("fused") and not case.toy:  # the toy's kernels are torch
        request.getfixturevalue("triton_interpreter")
    controller_round_trip(
        case,
        case.geometry(page_size, dtype),
        layout=layout,
        io_backend=io_backend,
        path=path,
        seed=3 if path.startswith("fused") else page_size,
    )


# --- host index orders: runs, gaps, backward jumps, repeats -------------------

# Host units of a backup (a run, a backward jump, a gap, a descending step) and
# of a load (an adjacent and a distant repeat, an ascending gap, a run, a
# backward jump), as eviction order and shared prefixes hand them to a pool:
# merged into one contiguous copy, any of them would move wrong rows silently.
BACKUP_UNITS = [5, 6, 2, 9, 3]
LOAD_UNITS = [9, 9, 2, 5, 6, 3, 2]
INDEX_GRID = list(itertools.product(LAYOUTS, INDEX_PATHS))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "case,layout,path",
    case_params(
        [c for c in CASES if not c.stock],
        INDEX_GRID,
        lambda c, layout, path: c in FUSED_CASES or INDEX_PATHS[path][0] == "off",
    ),
    indirect=["case"],
)
def test_host_index_orders(request, case, layout, path):
    """Pool backup and per-layer load at BACKUP_UNITS then LOAD_UNITS: the host records
    are the reference encoding at exactly those units, each loaded token is the
    reference restore of its unit's rows, and nothing else changes on either side."""
    access, runs = INDEX_PATHS[path]
    if access != "off" and not case.toy:  # the toy's "kernels" are torch code
        request.getfixturevalue("triton_interpreter")
    geo = case.geometry(4)
    rig = make_rig(
        geo, device_tokens=64, host_tokens=80, layout=layout,
        host_dtype=case.host_dtype, **path_kwargs(case, path),
    )  # fmt: skip
    device_pool, pool = rig.device_pool, rig.host_pool
    assert pool.transfer_path == ("torch" if access == "off" else f"fused_{access}")
    ut = unit_tokens(pool)
    host = pages(BACKUP_UNITS, ut)
    dev = torch.arange(4, 4 + len(host))
    spread(device_pool, dev, seed=5)
    written = rows_at(device_pool, dev)
    host_before = {n: b.clone() for n, b in pool.host_records.items()}
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    assert_records_at(pool, written, torch.tensor(BACKUP_UNITS), host_before)

    load = pages(LOAD_UNITS, ut)
    dev2 = torch.arange(28, 28 + len(load))
    fill_sentinel(device_pool)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, load, dev2, layer, "direct")
    # Each loaded token's position among the backed-up ones.
    pick = pages([BACKUP_UNITS.index(u) for u in LOAD_UNITS], ut)
    untouched = outside(device_pool, dev2)
    for layer, rows in enumerate(written):
        _, want = reference(pool, rows)
        for side, w in zip(side_buffers(device_pool), want):
            assert torch.equal(bits(side[layer][dev2]), bits(w[pick])), layer
            assert (side[layer][untouched] == SENTINEL).all()


def test_unit_planner_runs_split_at_every_break():
    from sglang.srt.mem_cache.pool_host.encoded import UnitPlanner

    runs = UnitPlanner.runs
    assert runs([]) == []
    assert runs([4]) == [(0, 4, 1)]
    assert runs([5, 6, 7]) == [(0, 5, 3)]
    # A backward jump, a gap, a repeat, a descending step: each starts a run.
    assert runs([5, 6, 2, 9, 9, 4, 3, 4]) == [
        (0, 5, 2),
        (2, 2, 1),
        (3, 9, 1),
        (4, 9, 1),
        (5, 4, 1),
        (6, 3, 2),
    ]


# --- head geometries: TP-sliced head counts, the common dims, K != V ---------

# Every geometry once per format over the three layouts (direct io), and two
# heads at the widths the 4-bit value groups and rotations split differently
# (kernel io); INT8 also takes the full layout x page x geometry grid.
# The widest heads at 4-token pages: 16 tokens moved instead of 37 or 64.
GEOMETRY_LAYOUTS = {
    (1, 64, 64): ("page_first_direct", 16),
    (3, 64, 64): ("layer_first", 1),
    (8, 128, 128): ("layer_first", 4),
    (2, 96, 96): ("page_first_direct", 16),
    (4, 256, 256): ("page_first_direct", 4),
    (64, 128, 128): ("page_first", 4),
    (4, 192, 128): ("page_first", 16),
}
GEOMETRY_GRID = [
    (*GEOMETRY_LAYOUTS[geometry], geometry, "direct") for geometry in GEOMETRIES
] + [
    ("page_first", 16, (2, *dims), "kernel")
    for dims in ((128, 128), (192, 128), (96, 96), (80, 80), (72, 72))
]


# INT8 at every layout x page size (one geometry: its torch path has no
# geometry-specific code).
INT8_GEOMETRY_GRID = [
    (layout, page_size, GEOMETRIES[0], "direct")
    for layout, page_size in itertools.product(LAYOUTS, PAGE_SIZES)
]


@pytest.mark.parametrize(
    "case,layout,page_size,geometry,io_backend",
    case_params(MHA_CASES, GEOMETRY_GRID, lambda c, *row: not c.stock)
    + case_params([FormatCase("int8", "mha")], INT8_GEOMETRY_GRID),
    indirect=["case"],
)
def test_geometry_round_trip(case, layout, page_size, geometry, io_backend):
    geo = heads_geometry(geometry, page_size)
    controller_round_trip(
        case, geo, layout=layout, io_backend=io_backend, seed=geo.head_num
    )


# --- what the thinned grids still cover -------------------------------------


def pairs(rows, i: int, j: int) -> set:
    return {(row[i], row[j]) for row in rows}


@pytest.mark.parametrize("fmt_case", CASES, ids=[c.id for c in CASES])
def test_grids_cover_every_pair(fmt_case):
    """The covering design above, per format: every layout x io backend x copy path it
    takes, every page size with every dtype, both fused accesses on every layout and io
    backend, every layout and backend in L3, every head geometry."""
    rows = grid_of(fmt_case)
    assert all(accepted(fmt_case, layout, io, path) for layout, io, *_, path in rows)
    torch_rows = [row for row in rows if row[-1] == "torch"]
    assert pairs(torch_rows, 2, 3) == set(itertools.product(PAGE_SIZES, DTYPES))
    if fmt_case.stock:
        layouts = {"page_first_direct", "layer_first"}
        assert pairs(rows, 0, 2) == set(itertools.product(layouts, PAGE_SIZES))
    else:
        layouts = set(LAYOUTS)
        paths = ("torch", "runs")
        combos = {(layout, io, path) for layout, io, *_, path in rows}
        assert combos == set(itertools.product(LAYOUTS, IO_BACKENDS, paths))
        assert pairs(torch_rows, 1, 3) == set(itertools.product(IO_BACKENDS, DTYPES))
        assert pairs(torch_rows, 0, 3) == set(itertools.product(LAYOUTS, DTYPES))
    if fmt_case in FUSED_CASES:
        assert {row[0] for row in FUSED_GRID} == set(LAYOUTS)
        assert {row[1] for row in FUSED_GRID} == set(IO_BACKENDS)
        assert {row[-1] for row in FUSED_GRID} == {"fused_direct", "fused_staged"}
    l3 = [r for r in L3_GRID if accepted(fmt_case, r[1], "direct", "torch")]
    assert {backend for backend, _ in l3} == {"file", "mooncake"}
    assert {layout for _, layout in l3} == layouts
    if not fmt_case.stock:
        # Every key grouping (storage tag) on the torch rows and in L3.
        tags = {
            fmt_case.storage_tag(layout, ps)
            for layout, ps in itertools.product(LAYOUTS, PAGE_SIZES)
        }
        assert {fmt_case.storage_tag(r[0], r[2]) for r in torch_rows} == tags
        l3_page = l3_geometry(fmt_case).page_size
        assert {fmt_case.storage_tag(layout, l3_page) for _, layout in l3} == tags
    if fmt_case.kind == "mha" and not fmt_case.stock:
        assert {row[2] for row in GEOMETRY_GRID} >= set(GEOMETRIES)
        assert {row[0] for row in GEOMETRY_GRID} == set(LAYOUTS)


# --- L3: the controller's storage threads, file and a real Mooncake master -----

L3_PAGES = {"mha": 4, "mla": 6}
L3_GRID = [
    ("file", "page_first_direct"),
    ("file", "page_first"),
    ("file", "layer_first"),
    ("mooncake", "page_first_direct"),
    ("mooncake", "page_first"),
]


def l3_geometry(case: FormatCase, dtype=torch.bfloat16):
    if case.kind == "mla":
        return case.geometry(4, layer_num=3)
    return case.geometry(L3_PAGE_SIZES.get(case.host_dtype, 16), dtype)


def l3_tokens(case: FormatCase, first: int = 1000) -> list[int]:
    n = L3_PAGES[case.kind] * l3_geometry(case).page_size
    return list(range(first, first + n))


def storage_config(request, backend: str, tmp_path):
    if backend == "mooncake":
        return request.getfixturevalue("mooncake_master").storage_config()
    return h.file_storage_config(tmp_path)


def make_l3(request, case, backend, config, layout, model_name=None, dtype=BF16):
    geo = l3_geometry(case, dtype)
    l3 = h.make_l3_rig(
        backend,
        config,
        host_dtype=case.host_dtype,
        geo=geo,
        layout=layout,
        # Room for L3_PAGES pages and the prefetch at 64-token pages.
        device_tokens=max(256, 8 * geo.page_size),
        host_tokens=max(512, 16 * geo.page_size),
        model_name=model_name or f"hiq/{request.node.name}",
        **({"device_kv_dtype": dtype} if dtype in FP8 else {}),
    )
    request.getfixturevalue("l3_rigs").append(l3)
    assert type(l3.controller.mem_pool_host) is expected_pool_cls(
        case, l3.rig.device_pool
    )
    return l3


def evict(l3, dev, host) -> None:
    """h.evict_everywhere; FP8 rows (uint8) poisoned with 0xFF, NaN in both FP8s."""
    if l3.rig.device_pool.dtype not in FP8:
        return h.evict_everywhere(l3, dev, host)
    for side in side_buffers(l3.rig.device_pool):
        for buf in side:
            buf[dev] = 0xFF
    l3.rig.allocator.free(dev)
    l3.controller.mem_pool_host.free(host)


def write_to_l3(l3, case, seed=0):
    """KV for the case's tokens: device -> L2 -> L3, then evicted from L1 and L2."""
    tokens = l3_tokens(case)
    dev, host, hashes, stored = h.write_through(
        l3, tokens, edit=lambda pool, idx: spread(pool, idx, seed)
    )
    assert stored == len(hashes) == L3_PAGES[case.kind]
    written = rows_at(l3.rig.device_pool, dev)
    evict(l3, dev, host)
    return written


def fetch_and_check(l3, case, written):
    """L3 -> L2 -> L1: bit for bit the reference restore of what was written."""
    tokens = l3_tokens(case)
    pf = h.prefetch(l3, tokens + [7])
    assert pf.hit_tokens == pf.completed_tokens == len(tokens)
    dev = h.load_to_device(l3, pf.host_indices)
    pool = l3.controller.mem_pool_host
    for layer, (rows, got) in enumerate(zip(written, rows_at(l3.rig.device_pool, dev))):
        _, want = reference(pool, rows)
        for g, w in zip(got, want):
            assert torch.equal(bits(g), bits(w)), layer
    evict(l3, dev, pf.host_indices)


# FP8 device KV in the file store: sealed pages of the formats that encode it.
L3_FP8 = {
    ("int4", "page_first_direct"),
    ("k8v4", "page_first"),
    ("int4", "layer_first"),
}


@pytest.mark.parametrize(
    "case,backend,layout,dtype",
    # The L3 rigs use the direct io backend.
    case_params(
        CASES,
        [(*row, BF16) for row in L3_GRID],
        lambda c, b, layout, d: accepted(c, layout, "direct", "torch"),
    )
    + case_params(
        MHA_CASES,
        [("file", layout, fp8) for layout in LAYOUTS for fp8 in FP8],
        lambda c, b, layout, d: (c.host_dtype, layout) in L3_FP8,
    ),
    indirect=["case"],
)
def test_l3_round_trip(request, tmp_path, case, backend, layout, dtype):
    config = storage_config(request, backend, tmp_path)
    l3 = make_l3(request, case, backend, config, layout, dtype=dtype)
    pool, n_pages = l3.controller.mem_pool_host, L3_PAGES[case.kind]
    page_bytes = pool.get_size_per_token() * l3.geo.page_size
    # Encoded pages carry their seal (page_integrity) after the records.
    seal = 0 if case.stock else SEAL_BYTES
    if not case.stock:
        assert pool.storage_page_bytes == page_bytes
    if backend == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        # MLA pages take the rank-replicated key path: one object per page.
        objects = 1 if case.kind == "mla" else 2
        assert l3.backend.is_mla_backend == (case.kind == "mla")
        assert l3.controller.page_get_func == l3.controller._page_get_zero_copy
        before = master.metrics()
    written = write_to_l3(l3, case)
    if backend == "file":
        files = list(tmp_path.glob("*.bin"))
        assert len(files) == n_pages  # one object per page
        assert {f.stat().st_size for f in files} == {page_bytes + seal}
    else:
        after = master.metrics()
        added = after["master_key_count"] - before["master_key_count"]
        assert added == objects * n_pages
        # What the store holds per token is what the host pool holds per token.
        stored = after["master_allocated_bytes"] - before["master_allocated_bytes"]
        assert stored == n_pages * (page_bytes + objects * seal)
    fetch_and_check(l3, case, written)
    if not case.stock:
        assert pool.storage_integrity_counts()["verified"] == n_pages


@pytest.mark.parametrize("backend", ["file", "mooncake"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_l3_formats_never_read_each_others_pages(
    request, tmp_path, toy_host_format, kind, backend
):
    """Every format's pages of the same tokens and model coexist in one store; each pool
    hits only its own (the storage tag is in the key)."""
    config = storage_config(request, backend, tmp_path)
    name = f"hiq/{request.node.name}"
    cases = format_cases(kinds=(kind,))
    rigs = [
        make_l3(request, c, backend, config, "page_first_direct", name) for c in cases
    ]
    tags = [
        getattr(l3.controller.mem_pool_host, "storage_format_tag", "") for l3 in rigs
    ]
    assert len(set(tags)) == len(cases)
    written = []
    for seed, (c, l3) in enumerate(zip(cases, rigs)):
        # Nothing of the formats stored before (different KV, same tokens).
        assert h.prefetch(l3, l3_tokens(c) + [7]).hit_tokens == 0
        written.append(write_to_l3(l3, c, seed=seed))
    for c, l3, rows in zip(cases, rigs, written):
        fetch_and_check(l3, c, rows)


def page_records(pool, rows_per_layer, page: int) -> torch.Tensor:
    """The flat page's payload from the reference encoding: every record in `records`
    order, [layer, *shape] per unit, units in order."""
    ps, ut = pool.page_size, unit_tokens(pool)
    per_layer = [
        pool.host_format.encode_reference(
            [r[page * ps : (page + 1) * ps].view(-1, ut, *r.shape[1:]) for r in rows]
        )
        for rows in rows_per_layer
    ]
    parts = []
    for record in pool.host_format.records:
        layers = torch.stack([enc[record.name] for enc in per_layer])
        if pool.layout != "layer_first":
            layers = layers.transpose(0, 1)
        parts.append(layers.contiguous().view(torch.uint8).flatten())
    return torch.cat(parts)


@pytest.mark.parametrize(
    "case,layout",
    case_params([c for c in CASES if not c.stock], LAYOUTS),
    indirect=["case"],
)
def test_storage_pages(case, layout):
    """get_data_page is the reference records then the seal; the page written into
    another slot restores the reference rows, a short page is refused before any byte
    moves; zero-copy pieces tile each page's records exactly once, each object ending in
    its seal (page-major layouts only)."""
    geo = l3_geometry(case)
    ps = geo.page_size
    rig = make_rig(
        geo, device_tokens=8 * ps, host_tokens=8 * ps, layout=layout,
        host_dtype=case.host_dtype,
    )  # fmt: skip
    device_pool, pool = rig.device_pool, rig.host_pool
    dev, host = torch.arange(ps, 3 * ps), pages([3, 1], ps)
    spread(device_pool, dev, seed=4)
    written = rows_at(device_pool, dev)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    page = pool.get_data_page(3 * ps)
    assert page.dtype == torch.uint8
    assert page.numel() == pool.storage_page_bytes + SEAL_BYTES
    assert pool.storage_page_bytes == pool.get_size_per_token() * ps
    assert torch.equal(page[:-SEAL_BYTES], page_records(pool, written, 0))

    pool.set_from_flat_data_page(6 * ps, page)
    snapshot = [bits(b).clone() for b in pool.host_records.values()]
    with pytest.raises(ValueError, match="bytes, expected"):
        pool.set_from_flat_data_page(0, page[:-1])
    for a, b in zip(snapshot, pool.host_records.values()):
        assert torch.equal(a, bits(b))
    fresh = torch.arange(4 * ps, 5 * ps)
    for layer, rows in enumerate(written):
        pool.load_to_device_per_layer(
            device_pool, pages([6], ps), fresh, layer, "direct"
        )
        _, want = reference(pool, [r[:ps] for r in rows])
        for side, w in zip(side_buffers(device_pool), want):
            assert torch.equal(bits(side[layer][fresh]), bits(w)), layer

    if layout == "layer_first":
        with pytest.raises(ValueError, match="page_first or page_first_direct"):
            pool.get_page_buffer_meta(host)
        return
    ptrs, sizes = pool.get_page_buffer_meta(host)
    objects = 1 if case.kind == "mla" else 2
    per_object = pool.storage_buffers_per_object
    assert len(ptrs) == len(sizes) == 2 * objects * per_object
    for p, unit in enumerate((3, 1)):
        first = p * objects * per_object
        for obj in range(objects):
            end = first + (obj + 1) * per_object - 1
            assert ptrs[end] == pool.pages.seals[unit, obj].data_ptr()
            assert sizes[end] == SEAL_BYTES
        pieces = sorted(
            (ptr, size)
            for i, (ptr, size) in enumerate(zip(ptrs, sizes))
            if first <= i < first + objects * per_object
            and (i + 1 - first) % per_object
        )
        records = sorted(
            (b[unit].data_ptr(), b[unit].nbytes) for b in pool.host_records.values()
        )
        # Adjacent pieces merge into each record's block: every byte once.
        merged = []
        for ptr, size in pieces:
            if (
                merged
                and merged[-1][0] + merged[-1][1] == ptr
                and not any(r[0] == ptr for r in records)
            ):
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((ptr, size))
        assert merged == records


# --- the real controller's random writes, loads and evictions -----------------

# (host_dtype, kind, layout, page size, io backend, fused access, dtype, steps,
# fewest operations done)
RANDOM_OPS = [
    ("int8", "mha", "page_first", 1, "direct", "off", BF16, 2500, 1000),
    ("int8", "mha", "page_first", 4, "kernel", "off", BF16, 2500, 1000),
    ("int8", "mha", "page_first_direct", 4, "direct", "off", BF16, 2500, 1000),
    ("int8", "mha", "layer_first", 1, "direct", "off", BF16, 2500, 1000),
    ("int8", "mha", "layer_first", 2, "kernel", "off", BF16, 2500, 1000),
    ("int4", "mha", "page_first", 16, "kernel", "off", BF16, 300, 150),
    ("int4", "mha", "layer_first", 1, "direct", "off", BF16, 300, 150),
    ("int4", "mha", "page_first_direct", 1, "direct", "off", BF16, 300, 150),
    ("k8v4", "mha", "page_first", 16, "direct", "off", BF16, 300, 150),
    ("k8v4", "mha", "layer_first", 2, "kernel", "off", BF16, 300, 150),
    ("int4r", "mha", "page_first", 16, "kernel", "off", BF16, 300, 150),
    ("int4r", "mha", "layer_first", 1, "direct", "off", BF16, 300, 150),
    ("int4r", "mha", "page_first_direct", 64, "kernel", "off", BF16, 300, 150),
    ("int4r", "mha", "page_first", 16, "direct", "off", BF16, 300, 150),
    ("int4r", "mha", "page_first", 16, "kernel", "direct", BF16, 300, 150),
    ("k8v4r", "mha", "page_first", 16, "kernel", "off", BF16, 300, 150),
    ("k8v4r", "mha", "layer_first", 1, "direct", "off", BF16, 300, 150),
    ("k8v4r", "mha", "page_first_direct", 64, "kernel", "off", BF16, 300, 150),
    ("k8v4r", "mha", "layer_first", 2, "kernel", "off", BF16, 300, 150),
    ("k8v4r", "mha", "layer_first", 2, "kernel", "direct", BF16, 300, 150),
    ("int8", "mla", "page_first", 1, "direct", "off", BF16, 1500, 600),
    ("int8", "mla", "page_first", 4, "kernel", "off", FP16, 1500, 600),
    ("int8", "mla", "page_first_direct", 4, "direct", "off", BF16, 1500, 600),
    ("int8", "mla", "layer_first", 1, "kernel", "off", FP16, 1500, 600),
    ("int8", "mla", "layer_first", 2, "direct", "off", BF16, 1500, 600),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "fmt,kind,layout,page_size,io_backend,access,dtype,steps,min_ops",
    RANDOM_OPS,
    ids=["-".join(map(str, row[:6])) for row in RANDOM_OPS],
)
def test_random_controller_operations(
    request, fmt, kind, layout, page_size, io_backend, access, dtype, steps, min_ops
):
    """Random writes, loads and L1/L2 evictions through HiCacheController: every restore
    is the format's reference restore, nothing leaks."""
    if access != "off":
        request.getfixturevalue("triton_interpreter")
    case = FormatCase(fmt, kind)
    rig = paged_rig(
        case.geometry(page_size, dtype), layout, io_backend, 32, 48,
        host_dtype=fmt, fused_transfer=access,
    )  # fmt: skip
    assert type(rig.host_pool) is hf.host_pool_cls(fmt, kind)
    path = "torch" if access == "off" else f"fused_{access}"
    assert rig.host_pool.transfer_path == path
    gen = torch.Generator().manual_seed(8)

    def write_rows(dev, rng):
        expected = []
        for layer in range(rig.device_pool.layer_num):
            rows = []
            for s, side in enumerate(side_buffers(rig.device_pool)):
                x = torch.randn((len(dev), *side[layer].shape[1:]), generator=gen)
                x = (x * (rng.choice((1e-3, 1.0, 50.0)) if s == 0 else x)).to(dtype)
                side[layer][dev] = x
                rows.append(x)
            expected.append(tuple(reference(rig.host_pool, rows)[1]))
        return expected

    ops = random_controller_operations(
        rig, write_rows, steps=steps, seed=7 + page_size, max_pages=3,
        same=lambda a, b: torch.equal(bits(a), bits(b)),
        audit_every=100 if steps > 300 else 0,
    )  # fmt: skip
    assert ops > min_ops


@pytest.mark.parametrize(
    "geo,encoded",
    [(Geometry(layer_num=4, head_num=8, head_dim=128), 4 * 8 * (128 + 128 + 4)),
     (MLAGeometry(layer_num=4), 4 * 648)],
    ids=["mha", "mla"],
)  # fmt: skip
def test_transfer_byte_counters_count_encoded_bytes(geo, encoded):
    """hicache_backup_bytes_total and the host capacity gauge report the INT8 pool's
    encoded figures."""
    rig = make_rig(geo, device_tokens=64, host_tokens=128, host_dtype="int8")
    rig.controller.write(rig.allocator.alloc(10))
    assert rig.controller.ack_write_queue[-1].num_bytes == 10 * encoded
    assert rig.host_pool.logical_size == 128  # sglang:hicache_host_total_tokens
    finish_transfers(rig.controller)


# --- set-ups a pool refuses at start-up, naming what to pass -----------------

E4M3, E5M2 = FP8
# (host_dtype, Geometry changes, layout, the pool's extra arguments, message parts;
# a part starting with "!" must not appear)
REFUSALS = [
    *[(f, {"head_dim": 63}, "page_first", {}, ["--hicache-host-dtype"])
      for f in ("int4", "k8v4")],
    *[("int8", {}, layout, {}, ["--hicache-mem-layout"])
      for layout in ("page_head", "page_unified")],
    ("int8", {"dtype": E4M3}, "page_first", {},
     ["Pass --kv-cache-dtype bf16", "quantized (FP8/FP4)", "!uint8", "!fp16"]),
    *[(f, {"dtype": E5M2}, "page_first", {}, ["device_kv_dtype"])
      for f in ("int4", "k8v4")],
]  # fmt: skip


@pytest.mark.parametrize("fmt,geo,layout,extra,parts", REFUSALS)
def test_unsupported_setups_fail_naming_the_flag(fmt, geo, layout, extra, parts):
    device_pool = make_device_pool(replace(Geometry(page_size=16), **geo), 64)
    with pytest.raises(NotImplementedError) as error:
        make_host_pool(
            device_pool, host_tokens=64, layout=layout, host_dtype=fmt, **extra
        )
    message = str(error.value)
    for part in parts:
        assert (part[1:] not in message) if part[0] == "!" else (part in message)


# --- per-format expectations (tests/support/conformance.py: EXPECT) ------------

ENCODED_MHA = [c.host_dtype for c in MHA_CASES if c.host_dtype in EXPECT]
FP8_FORMATS = [fmt for fmt in ENCODED_MHA if EXPECT[fmt].fp8]


def test_expectations_cover_every_registered_format():
    """A new --hicache-host-dtype value needs its row of expectations."""
    assert set(EXPECT) == {name for name in hf.HOST_DTYPES if name != TOY}


DISPATCH_PARAMS = case_params(CASES, [BF16]) + case_params(
    [c for c in MHA_CASES if c.stock or c.host_dtype in FP8_FORMATS], FP8
)


@pytest.mark.parametrize("case,dtype", DISPATCH_PARAMS, indirect=["case"])
def test_build_kv_host_pool_dispatches_by_host_dtype(case, dtype):
    """hybrid_pool_assembler.build_kv_host_pool, as the scheduler calls it,
    builds the value's pool (the FP8 device dtype passed on, patch 0010, the
    device pool storing FP8 as uint8); the stock pool without --hicache-host-dtype."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    h.publish_runtime(4, "page_first", case.host_dtype)
    device_pool = make_device_pool(case.geometry(4, dtype), 64)
    pool = hybrid_pool_assembler.build_kv_host_pool(
        kv_pool=device_pool, page_size=4, host_size=0
    )
    assert type(pool) is expected_pool_cls(case, device_pool)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    assert (info.dtype == torch.uint8) == (dtype in FP8)
    stock = expected_pool_cls(FormatCase(STOCK, case.kind), device_pool)
    if case.kind == "mha":
        assert get_mha_host_pool_cls(info) is stock
    if case.stock:
        assert type(pool) is stock and (dtype not in FP8 or pool.dtype == torch.uint8)
        return
    assert type(pool) is hf.host_pool_cls(case.host_dtype, case.kind)
    assert type(pool).host_format_cls.name == case.host_dtype
    assert pool.transfer_path == "torch"  # CPU
    if dtype in FP8:
        assert pool.device_kv_dtype == pool.host_format.device_dtype == dtype
        assert device_pool.dtype == dtype and pool.dtype == torch.uint8


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", ENCODED_MHA)
def test_bytes_per_token_at_qwen3_8b_geometry(fmt, layout):
    """Allocated host bytes per token and layer through the real dispatch (36 layers, 8
    KV heads, head dim 128) against BF16's 4096, FP8's 2048 where the format encodes FP8
    (the same bytes as on BF16, else refused naming the values that do); the budget
    buys whole pages of that size plus one padding page."""
    expect = EXPECT[fmt]
    fp8 = torch.float8_e4m3fn
    for i, page_size in enumerate(PAGE_SIZES):
        want = 36 * expect.qwen3_8b_bytes[i if layout != "layer_first" else 0]
        for device, stock in ((None, 4096), (fp8, 2048)):  # 1 byte per FP8 value
            if device is not None and not expect.fp8:
                with pytest.raises(NotImplementedError) as error:
                    bytes_per_token_at_qwen3_8b((fmt,), page_size, layout, fp8)
                message = str(error.value)
                assert f"--hicache-host-dtype {fmt} does not encode an FP8" in message
                assert "--hicache-host-dtype int4 or k8v4 or auto" in message
                continue
            per_token = bytes_per_token_at_qwen3_8b(
                ("auto", fmt), page_size, layout, device
            )
            ratio = per_token["auto"] / per_token[fmt]
            print(f"\n{fmt} page {page_size} on {device or 'BF16'}: {ratio:.3f}x")
            assert per_token["auto"] == 36 * stock
            assert per_token[fmt] == want, page_size


def keys_per_channel(fmt: str, layout: str, page_size: int) -> bool:
    start = EXPECT[fmt].keys_per_channel_from
    return start is not None and layout != "layer_first" and page_size >= start


def nan_key_span(fmt: str, layout: str, page_size: int, channel: int) -> tuple:
    """What a NaN key at (token 1, head 1, `channel`) of the first page poisons on
    restore, as an index into the restored [token, head, channel] keys."""
    expect = EXPECT[fmt]
    if not keys_per_channel(fmt, layout, page_size):
        return (1, 1, slice(0, expect.token_nan_channels))
    if expect.per_channel_nan == "channel":
        return (slice(0, page_size), 1, channel)
    return (slice(0, page_size), 1)


# Every format on BF16 device KV; FP8 device KV (E5M2: an Inf value, E4M3: NaN).
NONFINITE_ROWS = [
    (fmt, layout, page_size, None)
    for fmt in ENCODED_MHA
    for layout, page_size in (
        ("page_first", 16),
        ("page_first", 64),
        ("layer_first", 1),
        ("page_first_direct", 1),
    )
] + [
    (fmt, layout, page_size, fp8)
    for fmt, layout, page_size in (
        ("int4", "page_first", 16),
        ("int4", "layer_first", 1),
        ("k8v4", "page_first_direct", 64),
    )
    for fp8 in FP8
]


@pytest.mark.parametrize(
    "fmt,layout,page_size,fp8",
    NONFINITE_ROWS,
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_nonfinite_kv_restores_as_nan_over_its_group_and_is_counted(
    fmt, layout, page_size, fp8
):
    """A NaN key (token 1, head 1, channel 5) and an Inf value (last token, head 0): the
    format's group of each restores as NaN (never finite, never Inf) and is counted, the
    rest restores finite with finite scale statistics."""
    expect = EXPECT[fmt]
    per_channel = keys_per_channel(fmt, layout, page_size)
    counted = []
    pool, k1, v0 = pint.restore_nan_key_and_inf_value(
        fmt,
        layout,
        page_size,
        lambda pool: counted.append(pool.nonfinite_group_count()),
        fp8,
    )
    assert counted == [expect.nonfinite_groups[per_channel]]
    k_bad = nan_key_span(fmt, layout, page_size, channel=5)
    v_bad = (-1, 0)
    assert torch.isnan(k1[k_bad]).all() and torch.isnan(v0[v_bad]).all()
    k1[k_bad] = 0
    v0[v_bad] = 0
    pint.assert_finite_elsewhere(pool, k1, v0)


@pytest.mark.parametrize("fmt", ENCODED_MHA)
def test_fused_kernels_sink_page_and_tag_where_expected(fmt):
    """Only the 4-bit-key formats keep a sink page, the others refuse the variable
    naming it; a format's L3 tag starts with its name, so no format (or key grouping)
    reads another's pages."""
    case = FormatCase(fmt, "mha")
    assert case.has_fused_kernels() == EXPECT[fmt].fused
    assert case.storage_tag("page_first", 16).split("-")[0] == fmt
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=16)
    device_pool = make_device_pool(geo, 256)
    kwargs = dict(host_tokens=256, layout="page_first", host_dtype=fmt)
    if EXPECT[fmt].sink:
        pool = make_host_pool(device_pool, sink_page_tokens=64, **kwargs)
        assert pool.sink_pages is not None
    else:
        with pytest.raises(ValueError, match="SGLANG_HICACHE_SINK_PAGE_TOKENS"):
            make_host_pool(device_pool, sink_page_tokens=64, **kwargs)
    assert make_host_pool(device_pool, **kwargs).sink_pages is None


@pytest.mark.parametrize("fmt", ENCODED_MHA)
def test_transfer_larger_than_staging_is_chunked(fmt, monkeypatch):
    from sglang.srt.mem_cache.pool_host import encoded

    monkeypatch.setattr(encoded, "STAGING_TOKENS", 32)
    _, device_pool, pool = pint.build(fmt, "page_first", 16)
    dev, host = pages([1, 2, 3, 4, 5], 16), pages([9, 3, 4, 0, 7], 16)
    written = pint.fill_spread(device_pool, dev, seed=5)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    new_dev = pages([10, 11, 12, 13, 14], 16)
    for layer, rows in enumerate(written):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
        _, want = reference(pool, list(rows))
        for side, w in zip(side_buffers(device_pool), want):
            assert torch.equal(bits(side[layer][new_dev]), bits(w)), layer


ENCODED_CASES = [c for c in CASES if not c.stock and not c.toy]


def pool_state(device_pool, pool) -> list[torch.Tensor]:
    """Host records, device rows and statistics, to compare before and after."""
    buffers = [*pool.host_records.values()]
    buffers += [b for side in side_buffers(device_pool) for b in side]
    amax, count = pool.scale_amax_by_layer().clone(), pool.nonfinite_group_count()
    return [bits(b).clone() for b in buffers] + [amax, torch.tensor(count)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", list(INDEX_PATHS))
@pytest.mark.parametrize("case", ENCODED_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_host_indices_and_io_backend_rejected_and_nothing_moves(
    request, case, layout, path
):
    """Whole valid pages then one out of range (negative, past the end), and an io
    backend the pool lacks, on every transfer path: refused naming the flag before any
    byte moves; host records, device rows and statistics unchanged."""
    access, runs = INDEX_PATHS[path]
    if access != "off":
        if case not in FUSED_CASES:
            pytest.skip(f"{case.id} has no fused kernels")
        request.getfixturevalue("triton_interpreter")
    device_pool, pool = paged_pools(
        case.geometry(16), layout, 16, 16, host_dtype=case.host_dtype,
        **path_kwargs(case, path),
    )  # fmt: skip
    spread(device_pool, torch.arange(16 * 16), seed=1)
    pool.backup_from_device_all_layer(
        device_pool, pages([3, 4], 16), pages([1, 2], 16), "direct"
    )
    assert pool.transfer_path == ("torch" if access == "off" else f"fused_{access}")
    assert pool.use_fused_kernels == (access != "off")
    dev = pages([1, 2], 16)
    before = pool_state(device_pool, pool)
    for first in (-16, pool.size):
        bad = torch.cat([pages([5], 16), torch.arange(first, first + 16)])
        flag = f"--hicache-host-dtype {case.host_dtype}"
        with pytest.raises(IndexError, match=flag) as e:
            pool.backup_from_device_all_layer(device_pool, bad, dev, "direct")
        assert re.search(r"host indices \[-?\d+, \d+\] out of range", str(e.value))
        for layer in range(pool.layer_num):
            with pytest.raises(IndexError, match="nothing was transferred"):
                pool.load_to_device_per_layer(device_pool, bad, dev, layer, "direct")
    dev, host = pages([1], 16), pages([2], 16)
    with pytest.raises(ValueError, match="--hicache-io-backend"):
        pool.backup_from_device_all_layer(device_pool, host, dev, "kernel_ascend")
    with pytest.raises(ValueError, match="--hicache-io-backend"):
        pool.load_to_device_per_layer(device_pool, host, dev, 0, "kernel_ascend")
    for a, b in zip(before, pool_state(device_pool, pool), strict=True):
        assert torch.equal(a, b)


AUTO_SIZE_GRID = [("page_first", ps) for ps in (1, 4, 16, 64)] + [
    ("layer_first", 16),
    ("page_first_direct", 4),
    ("layer_first", 1),
    ("layer_first", 64),
]


@pytest.mark.parametrize(
    "case,layout,page_size", case_params(CASES, AUTO_SIZE_GRID), indirect=["case"]
)
def test_auto_size_counts_the_pools_host_bytes(monkeypatch, case, layout, page_size):
    """--hicache-host-memory-fraction sizing (_estimate_hicache_bytes) scales the device
    bytes by host_bytes_per_device_byte, which is what a pool of that page size and
    layout really allocates per device byte."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import hicache_auto_size

    device_pool = make_device_pool(case.geometry(page_size), 4 * page_size)
    pool = make_host_pool(
        device_pool, host_tokens=4 * page_size, layout=layout,
        host_dtype=case.host_dtype,
    )  # fmt: skip
    assert type(pool) is expected_pool_cls(case, device_pool)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    ratio = (
        1.0
        if case.stock
        else type(pool).host_bytes_per_device_byte(info, page_size, layout)
    )
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer]
    allocated = sum(b.nbytes for b in buffers)
    assert ratio == pytest.approx(allocated / pool.size / pool.device_size_per_token())
    params = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: device_pool),
        req_to_token_pool=None,
        mtp_draft_device_pools=(),
        page_size=page_size,
    )
    memory = SimpleNamespace(
        hicache_host_dtype=case.host_dtype, hicache_mem_layout=layout
    )
    monkeypatch.setattr(hicache_auto_size, "get_memory", lambda: memory)
    estimate = hicache_auto_size._estimate_hicache_bytes(params, None)
    assert estimate == int(hicache_auto_size._pool_bytes(device_pool) * ratio)


FUSED_BYTES = [
    (fmt, *row, None)
    for fmt in ENCODED_MHA
    if EXPECT[fmt].fused
    for row in [
        ("page_first", 16, "direct"),
        ("page_first_direct", 4, "staged"),
        ("layer_first", 1, "direct"),
        ("layer_first", 2, "staged"),
    ]
] + [
    # FP8 device KV: every layout and page size, direct and staged in turn.
    (fmt, layout, page_size, ("direct", "staged")[i % 2], fp8)
    for i, (fmt, layout, page_size) in enumerate(
        itertools.product(FP8_FORMATS, LAYOUTS, PAGE_SIZES)
    )
    for fp8 in FP8
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("fmt,layout,page_size,access,fp8", FUSED_BYTES)
def test_fused_path_writes_the_torch_paths_bytes_and_statistics(
    fmt, layout, page_size, access, fp8
):
    """A NaN key included: the fused kernels' host bytes, non-finite count, amax and
    restored rows equal the torch path's, the NaN over its group."""
    torch_pool, _, restored = pint.check_fused_path_writes_the_torch_paths_bytes(
        fmt, layout, page_size, access, fp8
    )
    if fp8 is not None:
        # edge_fp8_rows: a NaN key, and with E5M2 an Inf value.
        assert torch_pool.nonfinite_group_count() == 1 + (fp8 == torch.float8_e5m2)
        return
    assert torch_pool.nonfinite_group_count() >= 1
    span = nan_key_span(fmt, layout, page_size, channel=3)
    assert torch.isnan(restored["fused"][0][span]).all()
