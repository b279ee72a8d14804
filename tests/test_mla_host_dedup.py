"""MLA host dedup (--enable-mla-hicache-host-dedup) on 2 and 4 gloo ranks on CPU: the
source alone holds, backs up and writes to L3 (`file`, a real mooncake_master); every
load, prefetch and source-side failure gives every rank rank 0's rows or the same miss."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import traceback
from array import array
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from scripts.rigs.hicache_harness import (
    LoadBackReq,
    MLAGeometry,
    build_radix_cache,
    finish_transfers,
    make_allocator,
    make_device_pool,
    make_host_pool,
    publish_server_args,
)
from scripts.rigs.l3_harness import (
    STORAGE_WAIT_S,
    mooncake_unavailable_reason,
    prefetch_to_host,
    publish_runtime,
    radix_prefetch,
    require_mooncake,
    wait_for,
)
from tests.support.spawned_ranks import run_ranks

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_host_dedup import HiCacheHostDedup, HostDedupLoadError
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.pool_host.mla import get_mla_host_pool_cls
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

WORLD = 2
TIMEOUT_S = 120
LAYERS = 3
# (name, host dtype, layout, io backend, page size)
CASES = [
    ("auto_layer_first", "auto", "layer_first", "direct", 1),
    ("auto_page_first_direct", "auto", "page_first_direct", "direct", 4),
    ("int8_page_first", "int8", "page_first", "direct", 1),
    ("int8_page_first_kernel", "int8", "page_first", "kernel", 4),
]
# At attention-TP 4: auto and int8, page 4, both io paths.
FOUR_RANK_CASES = [CASES[1], CASES[3]]
# Through the radix cache (the last with the `file` L3 backend); whole pages at page 4,
# above the radix cache's load-back threshold.
RADIX_TOKENS = 32
RADIX_CASES = [
    ("radix_auto", "auto", "page_first_direct", "direct", 4, False),
    ("radix_int8", "int8", "page_first", "direct", 1, False),
    ("radix_l3_int8", "int8", "page_first_direct", "direct", 4, True),
]
# L3 through the controller: `file` (restarted ranks; int8 pages are sealed, so a
# corrupted page file is refused on read) and a real mooncake_master (whose memory
# segments both ranks' clients mount, so L1 and L2 are dropped instead).
L3_CASES = [
    ("l3_int8", "int8", "page_first_direct", "direct", 4, "file"),
    ("l3_auto", "auto", "layer_first", "direct", 4, "file"),
    ("l3_mooncake_int8", "int8", "page_first_direct", "direct", 4, "mooncake"),
]
L3_PAGES = 6
L3_REMOVED_PAGE = 4  # its file or object is removed on the source: the hits stop there
L3_CORRUPT_PAGE = 2  # file int8 only: its file's bytes are flipped on the source
RADIX_FAULT_CASE = ("radix_l3_faults", "int8", "page_first_direct", "direct", 4, True)
# Source-side failures a prefetch meets, in order: each a miss on every rank.
SOURCE_FAULTS = (
    "store_write_raises",  # the source's page writes (batch_set*) raise
    "store_query_raises",  # the source's hit query (batch_exists) raises
    "store_read_raises",  # the source's page reads (batch_get*) raise
    "host_pool_full",  # the source's host pool refuses the prefetch's bounce
    "page_refused",  # a sealed page fails its check mid-batch on the source
)
FAULT_REFUSED_PAGE = 3  # of RADIX_TOKENS // 4 pages: the hits stop there


class _LogLines(logging.Handler):
    """The INFO lines a logger writes until close()."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger(name)
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())

    def close(self) -> None:
        self.logger.removeHandler(self)
        super().close()


def _host_kv_bytes(pool) -> int:
    """Bytes of the pool's host KV buffers, not its allocator's per-slot state."""
    total = 0
    for name, value in vars(pool).items():
        if name in ("mem_state", "free_slots", "slot_used"):
            continue
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                total += t.numel() * t.element_size()
    return total


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    # Bytes compare bit for bit, and gloo gathers uint8 whatever the dtype.
    t = t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _same(t: torch.Tensor) -> bool:
    """Whether every rank holds these bytes (a collective)."""
    everyone = _gather(t)
    return all(torch.equal(x, everyone[0]) for x in everyone)


def _rows(device_pool, dev) -> torch.Tensor:
    return torch.stack([device_pool.kv_buffer[i][dev] for i in range(LAYERS)])


def _fill(device_pool, dev, seed: int) -> torch.Tensor:
    """The same random rows at `dev` on every rank, as attention TP computes them."""
    gen = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        buf = device_pool.kv_buffer[layer]
        buf[dev] = torch.randn((len(dev), *buf.shape[1:]), generator=gen).to(buf.dtype)
    return _rows(device_pool, dev)


def _stale(device_pool, dev, rank: int) -> None:
    """L1 eviction: each rank's stale rows differ, so a missed broadcast shows."""
    for layer in range(LAYERS):
        device_pool.kv_buffer[layer][dev] = float(rank + 7)


def _compare(rows: torch.Tensor, written: torch.Tensor) -> dict:
    """Whether `rows` are rank 0's, and their distance to the first rows written."""
    err = (rows.float() - written[:, : rows.shape[1]].float()).abs().max().item()
    return {"equal_to_rank0": _same(rows), "max_abs_err": err}


def _patch(obj, name: str, fn):
    """Set obj.name to fn; returns the undo."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, fn)
    return lambda: setattr(obj, name, old) if had else delattr(obj, name)


def _fail_source_load(host_pool, is_src: bool):
    """The source's host->device load raises at layer 1; returns the undo."""
    if not is_src:
        return lambda: None
    real = host_pool.load_to_device_per_layer_physical

    def fail_on_layer_1(device_pool_, h, d, layer_id, *a, **k):
        if layer_id == 1:
            raise RuntimeError("injected source load failure")
        return real(device_pool_, h, d, layer_id, *a, **k)

    return _patch(host_pool, "load_to_device_per_layer_physical", fail_on_layer_1)


def _stamp_tp_rank() -> None:
    """The TP ranks the scheduler stamps, as the storage config reads them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    get_parallel().override_permanently(
        tp_rank=rank,
        tp_size=world,
        attn_tp_rank=rank,
        attn_tp_size=world,
        moe_tp_rank=rank,
        moe_tp_size=world,
        pp_rank=0,
        attn_dcp_rank=0,
    )


# -- the pool level: HiCacheController over the dedup group --------------------


def _build(case, group, storage_backend=None):
    _, host_dtype, layout, io_backend, page = case[:5]
    device_pool = make_device_pool(
        MLAGeometry(layer_num=LAYERS, page_size=page), 32 * page
    )
    allocator = make_allocator(device_pool)
    dedup = HiCacheHostDedup.build(device_pool, group, storage_backend)
    cls = get_mla_host_pool_cls(host_dtype)
    host_pool = make_host_pool(
        device_pool,
        host_tokens=48 * page,
        layout=layout,
        host_pool_cls=lambda *args, **kw: dedup.build_host_pool(cls, *args, **kw),
    )
    controller = HiCacheController(
        allocator,
        host_pool,
        page,
        tp_group=None,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend=io_backend,
        host_dedup=dedup,
    )
    return dedup, device_pool, allocator, host_pool, controller


def _load(ctl, host) -> torch.Tensor:
    dev = ctl.load(host)
    ctl.start_loading()
    finish_transfers(ctl)
    return dev


def _run_case(case, rank, group) -> dict:
    dedup, device_pool, allocator, host_pool, ctl = _build(case, group)
    page = device_pool.page_size
    result = {"is_src": dedup.is_src, "host_kv_bytes": _host_kv_bytes(host_pool)}
    result["host_size"] = host_pool.size
    dev = allocator.alloc(5 * page)
    written = _fill(device_pool, dev, 1234)
    host = ctl.write(dev)
    ack = ctl.ack_write_queue[-1]
    result["backup_bytes"] = (ack.num_bytes, ack.num_logical_bytes)
    result["bytes_per_token"] = host_pool.size_per_token
    finish_transfers(ctl)
    result["same_host_indices"] = _same(host)
    _stale(device_pool, dev, rank)
    allocator.free(dev)
    new_dev = _load(ctl, host)
    loaded = _rows(device_pool, new_dev)
    result.update(_compare(loaded, written))
    allocator.free(new_dev)

    # Host pool full: the same allocations refuse on every rank.
    filled = []
    while (h := host_pool.alloc(page)) is not None:
        filled.append(h)
    dev2 = allocator.alloc(page)
    result["full_write_is_none"] = [
        bool(x) for x in _gather(torch.tensor([ctl.write(dev2) is None]))
    ]
    for h in filled:
        host_pool.free(h)
    allocator.free(dev2)

    # A source-side load failure: every rank raises, none hangs.
    undo = _fail_source_load(host_pool, dedup.is_src)
    dev3 = ctl.load(host)
    try:
        ctl.start_loading()
        result["failure"] = "no error"
    except HostDedupLoadError:
        result["failure"] = "HostDedupLoadError"
    finish_transfers(ctl)
    allocator.free(dev3)
    # The group is usable after the failure: a clean load restores again.
    undo()
    again = _rows(device_pool, _load(ctl, host))
    result["after_failure_equal"] = torch.equal(
        again.view(torch.int16), loaded.view(torch.int16)
    )
    dedup.destroy()
    return result


# -- the scheduler's path: the radix cache the registry builds -----------------


def _radix_stack(case, group, store_dir=None):
    """The radix cache built from server arguments with the flag (and, with
    `store_dir`, `file` L3): (cache, device pool, allocator, start-up log lines)."""
    _, host_dtype, layout, io_backend, page, _ = case
    storage = {}
    if store_dir is not None:
        storage = dict(
            hicache_storage_backend="file",
            hicache_storage_backend_extra_config=json.dumps(
                # Prefetch whatever hits (the default threshold is 256 tokens).
                {"file_storage_path": store_dir, "prefetch_threshold": page}
            ),
            hicache_storage_prefetch_policy="wait_complete",
        )
    server_args = publish_server_args(
        host_dtype,
        page_size=page,
        layout=layout,
        io_backend=io_backend,
        hicache_ratio=2.0,
        enable_mla_hicache_host_dedup=True,
        **storage,
    )
    if store_dir is not None:
        _stamp_tp_rank()
    geo = MLAGeometry(layer_num=LAYERS, page_size=page)
    device_pool = make_device_pool(geo, 64 * page)
    allocator = make_allocator(device_pool)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=1024, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=page,
        tp_cache_group=group,
    )
    logged = _LogLines("sglang.srt.mem_cache.hicache_host_dedup")
    cache = build_radix_cache(server_args, params)
    logged.close()
    cache.write_through_threshold = 1
    for entry in cache.cache_controller.mem_pool_host.entries:
        # L3 page buffers ask torch for pinned memory, which needs CUDA.
        entry.host_pool.pin_memory = False
    return cache, device_pool, allocator, logged.lines


def _insert(cache, device_pool, allocator, ids, seed: int) -> tuple:
    """A prefill's rows inserted (written through): (device slots, rows)."""
    slots = allocator.alloc(len(ids))
    written = _fill(device_pool, slots, seed)
    key = RadixKey(array("q", ids))
    cache.insert(InsertParams(key=key, value=slots.to(torch.int64), prev_prefix_len=0))
    cache.flush_pending_backups()
    cache.check_hicache_events()
    return slots, written


def _drop_host(cache, tokens: int, after_l3_backup: bool = False) -> None:
    def backed_up():
        cache.check_hicache_events()
        return not cache.ongoing_backup

    if after_l3_backup:
        wait_for(backed_up, "the L3 backup")
    for component in cache.components:
        cache.evict_host(tokens, component)


def _init_load_back(cache, query, rid: str):
    """Match `query` and start loading its host hit: (host hit, tokens loaded, the
    lock on the loaded path, its last node)."""
    match = cache.match_prefix(MatchPrefixParams(key=query))
    lock = cache.lock(match.last_device_node)
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.best_match_node,
            host_hit_length=match.host_hit_length,
            req=LoadBackReq(rid, match.last_device_node),
        )
    )
    cache.unlock(lock)
    return match.host_hit_length, loaded, cache.lock(last_node), last_node


def _run_radix_case(case, rank, group, store_dir=None) -> dict:
    """Insert (written through), L1 eviction (with L3: the host copy dropped and the
    prefix prefetched back), a host hit, init_load_back and the load."""
    cache, device_pool, allocator, log = _radix_stack(case, group, store_dir)
    controller = cache.cache_controller
    host_pool = controller.mem_pool_host.anchor_entry.host_pool
    result = {
        "is_src": controller.host_dedup.is_src,
        "host_kv_bytes": _host_kv_bytes(host_pool),
        "host_pool": type(host_pool).__name__,
        "log": log,
        "pool_bytes": host_pool.size * host_pool.size_per_token,
    }
    ids = list(range(100, 100 + RADIX_TOKENS))
    slots, written = _insert(cache, device_pool, allocator, ids, seed=99)
    result["evicted"] = cache.evict(
        EvictParams(num_tokens=RADIX_TOKENS)
    ).num_tokens_evicted
    _stale(device_pool, slots, rank)
    query = RadixKey(array("q", [*ids, 7]))
    if store_dir is not None:
        _drop_host(cache, RADIX_TOKENS, after_l3_backup=True)
        match = cache.match_prefix(MatchPrefixParams(key=query))
        result["l3"] = [match.host_hit_length, radix_prefetch(cache, match, ids)[0]]
    result["host_hit"], result["loaded"], lock, last_node = _init_load_back(
        cache, query, "r0"
    )
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    device = cache.path_device_indices(last_node)
    result.update(_compare(_rows(device_pool, device), written))
    result["same_device_indices"] = _same(device.to(torch.int64))
    # What sglang:hicache_host_used_bytes reports: the source's bytes only.
    reporter = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cache))
    tier = SchedulerMetricsReporter._read_hicache_host_tier(
        reporter, host_pool, RADIX_TOKENS
    )
    result["reported_used_bytes"] = tier.used_bytes
    result["reported_bytes_per_token"] = tier.bytes_per_token
    result["host_copy"] = [tier.info["host_copy"], tier.info["host_copy_ranks"]]
    result["source_bytes_per_token"] = (
        host_pool.size_per_token if result["is_src"] else 0
    )
    cache.unlock(lock)
    cache.sanity_check()
    return result


# -- L3 through the controller -------------------------------------------------


class _StoreCalls:
    """The Mooncake client with the name of everything asked of it recorded."""

    def __init__(self, store, calls: list):
        self._store, self._calls = store, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._store, name)


def _l3_stack(case, group, extra_config: dict, written: list):
    """Fresh dedup state, pools and controller attached to the case's L3 backend:
    what a (re)start builds on every rank; `written` collects the page keys its
    batch_set / batch_set_v1 (Mooncake's zero-copy write) get."""
    _, host_dtype, layout, _, page, backend = case
    publish_runtime(page, layout, host_dtype)
    _stamp_tp_rank()
    dedup, device_pool, allocator, host_pool, ctl = _build(case, group, backend)
    ctl.attach_storage_backend(
        backend,
        prefetch_threshold=page,
        model_name=f"hiq/dedup-{backend}",
        storage_backend_extra_config=dict(extra_config),
    )
    for name in ("batch_set", "batch_set_v1"):
        real = getattr(ctl.storage_backend, name)

        def counting(keys, *args, _real=real, **kwargs):
            written.extend(keys)
            return _real(keys, *args, **kwargs)

        setattr(ctl.storage_backend, name, counting)
    return dedup, device_pool, allocator, ctl


def _l3_prefetch_load(ctl, allocator, device_pool, tokens, rid, page, written):
    """L3 -> the source's host pool (peers: the same host indices) -> every rank's
    device pool: the span, whether the host indices and rows are rank 0's, the rows'
    distance to the first `written`."""
    l3 = SimpleNamespace(controller=ctl, geo=SimpleNamespace(page_size=page))
    hit, completed, host = prefetch_to_host(l3, tokens, rid, stop_on_miss=False)
    # Nothing restored: the span says so on every rank.
    rows = torch.full_like(written, float("nan"))
    if host is None:
        host = torch.empty(0, dtype=torch.int64)
    else:
        ctl.mem_pool_host.free(host[completed:])
        host = host[:completed]
        if completed:
            dev = _load(ctl, host)
            rows = _rows(device_pool, dev)
            allocator.free(dev)
        ctl.mem_pool_host.free(host)
    return {
        "span": [hit, completed],
        "same_host": _same(host),
        **_compare(rows, written),
    }


def _run_l3_case(case, rank, group, config: dict, store_dir: str) -> dict:
    """Write through to L3 (the source writes each page once); reload after a restart
    (`file`) or with L1 and L2 dropped (Mooncake); then the same prefetch with a page
    removed (and, `file` int8, one corrupted) on the source."""
    page, backend = case[4], case[5]
    tokens = list(range(2000, 2000 + L3_PAGES * page))
    hashes = get_storage_hash_str(tokens, None, page_size=page)
    logged = _LogLines("sglang.srt.managers.cache_controller")
    written = []
    dedup, device_pool, allocator, ctl = _l3_stack(case, group, config, written)
    calls = []
    if backend == "mooncake":
        # Peers must never reach the store after attaching: the source serves.
        ctl.storage_backend.store = _StoreCalls(ctl.storage_backend.store, calls)
    dev = allocator.alloc(len(tokens))
    expected = _fill(device_pool, dev, 4321)
    host = ctl.write(dev)
    finish_transfers(ctl)
    op_id = ctl.write_storage(host, tokens, hash_value=hashes)
    op = ctl.ack_backup_queue.get(timeout=STORAGE_WAIT_S)
    assert op.id == op_id
    result = {
        "is_src": dedup.is_src,
        "keys_written": len(written),
        "backup_completed": op.completed_tokens,
        # A peer that tried to write its (allocator-only) pool fails here.
        "errors": [x for x in logged.lines if "ackup" in x or "Write page" in x],
    }
    logged.close()
    dist.barrier(group)
    if backend == "file":
        result["page_files"] = sorted(
            f for f in os.listdir(store_dir) if f.endswith(".bin")
        )
        # Restart: fresh pools and controllers on every rank, the same store.
        ctl.detach_storage_backend()
        dedup.destroy()
        dedup, device_pool, allocator, ctl = _l3_stack(case, group, config, written)
    else:
        if dedup.is_src:  # the group's pages, as the store holds them
            result["stored_pages"] = ctl.storage_backend.batch_exists(hashes)
        _stale(device_pool, dev, rank)
        allocator.free(dev)
        ctl.mem_pool_host.free(host)
        # The source's freed records are scrubbed: only the store can restore them.
        for records in ctl.mem_pool_host.kv_buffer or []:
            records.view(torch.uint8).fill_(0x55)
    args = (ctl, allocator, device_pool, tokens)
    result["reload"] = _l3_prefetch_load(*args, "all", page, expected)

    def page_file(i: int) -> str:
        (name,) = [f for f in os.listdir(store_dir) if f.startswith(hashes[i])]
        return os.path.join(store_dir, name)

    if dedup.is_src and backend == "mooncake":
        ctl.storage_backend.delete(hashes[L3_REMOVED_PAGE])
    elif dedup.is_src:
        os.remove(page_file(L3_REMOVED_PAGE))
        if case[1] == "int8":
            _flip_a_byte(page_file(L3_CORRUPT_PAGE))
    dist.barrier(group)
    result["fault"] = _l3_prefetch_load(*args, "fault", page, expected)
    result["keys_written_total"] = len(written)
    result["store_calls"] = sorted(set(calls))
    ctl.detach_storage_backend()
    dedup.destroy()
    return result


def _flip_a_byte(path: str) -> bytes:
    """Corrupt the middle byte of a page file; returns its bytes before."""
    data = open(path, "rb").read()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(flipped))
    return data


# -- source-side failures through the radix cache with `file` L3 ---------------


def _radix_state(cache, match) -> dict:
    """What must be identical on every rank after `match`: the matched path's
    nodes, its host indices, every device index in the tree, the tree's sizes and
    the host pool's free slots."""
    core = cache.tree_core
    (path,) = core.collect_path_info([match.best_match_node])
    host = None
    if match.host_hit_length:
        host = core.build_load_back_spec(match.best_match_node)[0].host_indices
        host = host.tolist()
    host_pool = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    # The order the pool hands out its free slots in (freed slots queue last).
    free = torch.cat([host_pool.free_slots, *host_pool.release_slots])
    return {
        "free_order": hashlib.sha1(free.numpy().tobytes()).hexdigest(),
        "path": [
            [p.path_start, p.path_end, p.full_value_len, p.num_children] for p in path
        ],
        "host": host,
        "device": core.all_values_flatten().tolist(),
        "sizes": [*map(int, core.total_size()), core.evictable_size()],
        "protected": core.protected_size(),
        "host_free": host_pool.available_size(),
    }


def _run_radix_fault_case(case, rank, group, store_dir: str) -> dict:
    """Written through, L1 and L2 evicted; each of SOURCE_FAULTS on the source alone,
    a prefetch and every rank's radix state after it; then a clean prefetch and load;
    last a source host->device failure."""
    cache, device_pool, allocator, _ = _radix_stack(case, group, store_dir)
    ctl = cache.cache_controller
    src = ctl.host_dedup.is_src
    backend = ctl.storage_backend
    page, tokens = case[4], RADIX_TOKENS

    def write_through(ids: list, seed: int) -> torch.Tensor:
        """Insert (written through to host and L3), evict L1 and L2: the rows."""
        slots, rows = _insert(cache, device_pool, allocator, ids, seed)
        cache.evict(EvictParams(num_tokens=tokens))
        _stale(device_pool, slots, rank)
        _drop_host(cache, tokens, after_l3_backup=True)
        return rows

    def state(query) -> dict:
        match = cache.match_prefix(MatchPrefixParams(key=query))
        hit = [match.device_prefix_len, match.host_hit_length]
        return {"hit": hit, **_radix_state(cache, match)}

    def prefetch(ids, query, rid):
        match = cache.match_prefix(MatchPrefixParams(key=query))
        return list(radix_prefetch(cache, match, ids, rid=rid))

    def fail(*args, **kwargs):
        raise RuntimeError("injected source-side L3 failure")

    # The source's L3 write raises: the pages never reach the store.
    result = {"is_src": src, "faults": {}}
    lost = list(range(900, 900 + tokens))
    undo = [_patch(backend, n, fail) for n in ("batch_set", "batch_set_v1") if src]
    write_through(lost, seed=78)
    for u in undo:
        u()
    dist.barrier(group)
    query = RadixKey(array("q", [*lost, 7]))
    span = prefetch(lost, query, "lost")
    result["faults"]["store_write_raises"] = {"prefetched": span, **state(query)}
    _drop_host(cache, tokens)

    ids = list(range(700, 700 + tokens))
    query = RadixKey(array("q", [*ids, 7]))
    written = write_through(ids, seed=77)
    (refused,) = [
        os.path.join(store_dir, f)
        for f in os.listdir(store_dir)
        if f.startswith(get_storage_hash_str(ids, None, page_size=page)[3])
    ]

    def inject(fault: str):
        """Break the source alone; returns the undo."""
        if not src:
            return lambda: None
        if fault == "store_query_raises":
            return _patch(backend, "batch_exists", fail)
        if fault == "store_read_raises":
            undo = [_patch(backend, n, fail) for n in ("batch_get", "batch_get_v1")]
            return lambda: [u() for u in undo]
        if fault == "host_pool_full":
            return _patch(ctl.mem_pool_host, "alloc", lambda *a, **k: None)
        data = _flip_a_byte(refused)
        return lambda: open(refused, "wb").write(data)

    for i, fault in enumerate(SOURCE_FAULTS[1:]):
        undo = inject(fault)
        dist.barrier(group)
        try:
            span = prefetch(ids, query, f"fault{i}")
        except AssertionError as exc:  # a rank left waiting: the rest is moot
            result["faults"][fault] = {"prefetched": repr(exc)}
            return result
        undo()
        result["faults"][fault] = {"prefetched": span, **state(query)}
        _drop_host(cache, tokens)

    # Nothing broken any more: the prefix comes back and loads everywhere.
    dist.barrier(group)
    result["clean_prefetched"] = prefetch(ids, query, "clean")
    result["clean_hit"] = state(query)["hit"]
    _, _, lock, last_node = _init_load_back(cache, query, "clean")
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    rows = _rows(device_pool, cache.path_device_indices(last_node))
    result["clean"] = _compare(rows, written)
    cache.unlock(lock)

    # The source's host->device load fails: the batch that reads these rows is
    # already formed, so it raises on every rank (no miss to fall back to).
    cache.evict(EvictParams(num_tokens=tokens))
    undo = _fail_source_load(ctl.mem_pool_host.anchor_entry.host_pool, src)
    _init_load_back(cache, query, "failing")
    try:
        cache.ready_to_load_host_cache()
        outcome = "loaded"
    except HostDedupLoadError:
        outcome = "HostDedupLoadError"
    undo()
    result["load_failure"] = {"outcome": outcome, **state(query)}
    return result


# -- the ranks and the tests ------------------------------------------------------


def rank_cases(rank: int, group, out_dir: str, mooncake: dict | None) -> dict:
    """Every case on one rank (spawned by tests/support/spawned_ranks.py)."""
    # SGLang builds its page-hash extension (a C++ compile) on first use: here,
    # not in a prefetch thread under a deadline.
    get_storage_hash_str([1, 2, 3], None, page_size=1)
    results = {case[0]: _run_case(case, rank, group) for case in CASES}
    for case in RADIX_CASES:
        store = os.path.join(out_dir, case[0]) if case[5] else None
        results[case[0]] = _run_radix_case(case, rank, group, store)
    for case in L3_CASES:
        store = os.path.join(out_dir, case[0])
        if case[5] == "file":
            config = {"file_storage_path": store}
        elif mooncake is not None:
            config = mooncake
        else:
            continue
        results[case[0]] = _run_l3_case(case, rank, group, config, store)
    # Last: a fault a build does not agree on may leave the ranks out of step
    # (a hang fails the fixture at TIMEOUT_S); an error fails the fault tests.
    store = os.path.join(out_dir, RADIX_FAULT_CASE[0])
    try:
        results[RADIX_FAULT_CASE[0]] = _run_radix_fault_case(
            RADIX_FAULT_CASE, rank, group, store
        )
    except Exception:  # noqa: BLE001 - reported by the fault tests
        results[RADIX_FAULT_CASE[0]] = {"error": traceback.format_exc()}
    return results


def rank_cases_4(rank: int, group) -> dict:
    """The pool-level cases on one of 4 ranks: one source, three peers."""
    return {case[0]: _run_case(case, rank, group) for case in FOUR_RANK_CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("dedup")
    # The session's mooncake_master, when Mooncake runs here (else its tests
    # skip, or fail under CI, with the reason).
    mooncake = None
    if mooncake_unavailable_reason() is None:
        mooncake = request.getfixturevalue("mooncake_master").storage_config()
    return run_ranks(
        out,
        WORLD,
        "tests.test_mla_host_dedup:rank_cases",
        {"out_dir": str(out), "mooncake": mooncake},
        TIMEOUT_S,
    )


def check_pool_case(out: list, case) -> None:
    """The source alone holds and backs up the host KV; every load restores rank 0's
    rows (auto exactly, int8 within its error); a full host pool and a source load
    failure are the same on every rank, and a clean load works after it."""
    name, host_dtype, page = case[0], case[1], case[4]
    src, peers = out[0][name], [r[name] for r in out[1:]]
    assert src["is_src"] and not any(p["is_src"] for p in peers)
    limit = 0.0 if host_dtype == "auto" else 0.05
    for r in out:
        r = r[name]
        assert r["equal_to_rank0"] and r["max_abs_err"] <= limit
        assert r["same_host_indices"] and r["host_size"] == src["host_size"]
        assert r["failure"] == "HostDedupLoadError" and r["after_failure_equal"]
    assert src["full_write_is_none"] == [True] * len(out)
    per_token_floor = LAYERS * 576  # the int8 latent record's payload alone
    assert src["host_kv_bytes"] >= src["host_size"] * per_token_floor
    assert [p["host_kv_bytes"] for p in peers] == [0] * len(peers)
    # hicache_backup_bytes_total: the source's backup counts once.
    assert src["backup_bytes"][0] == 5 * src["bytes_per_token"] * page > 0
    assert all(p["backup_bytes"] == [0, 0] for p in peers)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pool_load_restores_rank0_rows_and_peers_hold_no_host_kv(ranks, case):
    check_pool_case(ranks, case)


def test_four_ranks_one_source_three_peers(tmp_path):
    out = run_ranks(
        tmp_path, 4, "tests.test_mla_host_dedup:rank_cases_4", {}, TIMEOUT_S
    )
    for case in FOUR_RANK_CASES:
        check_pool_case(out, case)


@pytest.mark.parametrize("case", [c[0] for c in RADIX_CASES])
def test_radix_cache_host_hit_restores_rank0_rows(ranks, case):
    """With L3: L1 and L2 evicted, the prefix prefetched (the same span on both
    ranks), then the host hit."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["is_src"] and not r1["is_src"]
    assert r1["host_pool"] == "MLATokenToKVPoolHost" and r1["host_kv_bytes"] == 0
    assert r0["host_kv_bytes"] > 0
    tokens = RADIX_TOKENS
    if "l3" in case:
        assert r0["l3"] == r1["l3"] == [0, tokens]
    for r in (r0, r1):
        assert (r["evicted"], r["host_hit"], r["loaded"]) == (tokens,) * 3
        assert r["equal_to_rank0"] and r["same_device_indices"]
        assert r["max_abs_err"] <= (0.0 if case == "radix_auto" else 0.05)


def test_start_up_log_and_host_tier_metrics_count_the_source_bytes_once(ranks):
    r0, r1 = ranks[0]["radix_int8"], ranks[1]["radix_int8"]
    (src_line,) = [x for x in r0["log"] if "holds" in x]
    (peer_line,) = [x for x in r1["log"] if "holds" in x]
    assert "(source)" in src_line and "(allocator-only)" in peer_line
    assert "this rank holds 0 GB" in peer_line
    # Group bytes: the source's pool; without dedup two copies.
    gb = r0["pool_bytes"] / 1e9
    assert f"this rank holds {gb:.4g} GB" in src_line
    assert f"holds {gb:.4g} GB instead of {2 * gb:.4g} GB" in peer_line
    # Summed over the ranks, sglang:hicache_host_used_bytes is the node's.
    per_token = r0["source_bytes_per_token"]
    assert per_token > 0
    assert r0["reported_bytes_per_token"] == per_token
    assert r0["reported_used_bytes"] == RADIX_TOKENS * per_token
    assert (r1["reported_used_bytes"], r1["reported_bytes_per_token"]) == (0, 0)
    # sglang:hicache_host_info says which rank holds the group's one copy.
    assert r0["host_copy"] == ["source", str(WORLD)]
    assert r1["host_copy"] == ["peer", str(WORLD)]


@pytest.mark.parametrize("case", L3_CASES, ids=[c[0] for c in L3_CASES])
def test_l3_page_written_once_per_group_and_every_rank_reads_it_back(ranks, case):
    """The source writes each page, the peer none (no backup error, no Mooncake
    call); a reload and a source-side miss (a removed page; a corrupted sealed one)
    give both ranks the same span, host indices and rows."""
    name, host_dtype, _, _, page, backend = case
    if name not in ranks[0]:
        require_mooncake()
        pytest.fail(f"{name} did not run though Mooncake is available")
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r0["is_src"] and not r1["is_src"]
    assert (r0["keys_written"], r1["keys_written"]) == (L3_PAGES, 0)
    assert r0["backup_completed"] == L3_PAGES * page and r1["backup_completed"] == 0
    assert not r0["errors"] and not r1["errors"]
    # Prefetches read: nobody writes after the backup.
    assert (r0["keys_written_total"], r1["keys_written_total"]) == (L3_PAGES, 0)
    if backend == "file":
        assert r0["page_files"] == r1["page_files"]
        assert len(r0["page_files"]) == L3_PAGES
    else:
        assert r0["stored_pages"] == L3_PAGES
        assert r0["store_calls"] and r1["store_calls"] == []
    limit = 0.0 if host_dtype == "auto" else 0.05
    sealed = backend == "file" and host_dtype == "int8"
    usable = L3_CORRUPT_PAGE if sealed else L3_REMOVED_PAGE
    spans = {"reload": [L3_PAGES] * 2, "fault": [L3_REMOVED_PAGE, usable]}
    for step, pages in spans.items():
        assert r0[step]["span"] == r1[step]["span"] == [p * page for p in pages]
        for r in (r0, r1):
            assert r[step]["same_host"] and r[step]["equal_to_rank0"]
            assert r[step]["max_abs_err"] <= limit


def _faults(ranks):
    r0, r1 = ranks[0][RADIX_FAULT_CASE[0]], ranks[1][RADIX_FAULT_CASE[0]]
    for r in (r0, r1):
        assert "error" not in r, r["error"]
    return r0, r1


@pytest.mark.parametrize("fault", SOURCE_FAULTS)
def test_radix_source_side_l3_failure_is_the_same_miss_on_every_rank(ranks, fault):
    """Every rank prefetches the same span, and afterwards holds the same matched
    path, host and device indices, tree sizes and free host slots."""
    r0, r1 = _faults(ranks)
    f0, f1 = r0["faults"][fault], r1["faults"][fault]
    loaded = FAULT_REFUSED_PAGE * RADIX_FAULT_CASE[4] if fault == "page_refused" else 0
    assert f0["prefetched"][0] == f1["prefetched"][0] == loaded, (f0, f1)
    assert f0["hit"] == f1["hit"] == [0, loaded]
    assert f0 == f1


def test_radix_after_source_failures_restores_then_a_load_failure_raises_everywhere(
    ranks,
):
    """After the failures a prefetch restores rank 0's rows; then a source
    host->device failure is no miss (the batch reading the rows is formed):
    HostDedupLoadError on both ranks, the same radix state."""
    r0, r1 = _faults(ranks)
    for r in (r0, r1):
        assert r["clean_prefetched"][0] == RADIX_TOKENS
        assert r["clean_hit"] == [0, RADIX_TOKENS]
        assert r["clean"]["equal_to_rank0"] and r["clean"]["max_abs_err"] <= 0.05
    f0, f1 = r0["load_failure"], r1["load_failure"]
    assert f0["outcome"] == f1["outcome"] == "HostDedupLoadError"
    assert f0 == f1
