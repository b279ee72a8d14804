"""MLA host dedup (--enable-mla-hicache-host-dedup) across 2 ranks on CPU: real
HiCacheControllers over gloo, each rank with its own CPU device pool. The
source rank alone backs up; after an L1 eviction every rank's load restores
rank 0's rows bit for bit (peers through the broadcaster); peers hold no host
KV bytes and the same host indices; a source-side load failure raises on
every rank instead of hanging. With the `file` L3 backend the source alone
writes each page; after a restart a prefetch reaches every rank with the same
hits and host indices, and a page file the source cannot use is the same miss
on every rank. With a real mooncake_master the same holds without a restart
(L1 and L2 dropped), and the peer never calls the store. Through the radix
cache, each source-side failure of an L3 prefetch (the store's query or reads
raising, the host pool refusing the bounce, a sealed page refused mid-batch)
is the same miss and the same radix state on every rank, and a source load
failure raises on every rank with one state."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import traceback
from array import array

import pytest
import torch

WORLD = 2
TIMEOUT_S = 120
# (name, host dtype, layout, io backend, page size)
CASES = [
    ("auto_layer_first", "auto", "layer_first", "direct", 1),
    ("auto_page_first_direct", "auto", "page_first_direct", "direct", 4),
    ("int8_page_first", "int8", "page_first", "direct", 1),
    ("int8_page_first_kernel", "int8", "page_first", "kernel", 4),
]
# At attention-TP 4: auto and int8, page 4, both io paths.
FOUR_RANK_CASES = [CASES[1], CASES[3]]
LAYERS = 3
PAGES = {c[0]: c[4] for c in CASES}


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
    """Bytes of the pool's host KV buffers (records, scales, staging), not its
    allocator's per-slot state."""
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
    import torch.distributed as dist

    # Bytes compare bit for bit, and gloo gathers uint8 whatever the dtype.
    t = t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _build(case, group, storage_backend=None):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_host_dedup import HiCacheHostDedup
    from sglang.srt.mem_cache.pool_host.mla import get_mla_host_pool_cls
    from scripts.rigs.hicache_harness import (
        MLAGeometry,
        _rig_memory_budget,
        make_allocator,
        make_device_pool,
    )

    _, host_dtype, layout, io_backend, page = case
    geo = MLAGeometry(layer_num=LAYERS, page_size=page)
    device_pool = make_device_pool(geo, 32 * page)
    allocator = make_allocator(device_pool)
    dedup = HiCacheHostDedup.build(device_pool, group, storage_backend)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    with _rig_memory_budget():
        host_pool = dedup.build_host_pool(
            get_mla_host_pool_cls(host_dtype),
            info,
            2.0,
            0,
            page,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_pool.size,
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            host_token_capacity=48 * page,
            override_kv_cache_dim=device_pool.kv_cache_dim,
            target_layer_num=device_pool.layer_num,
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


def _run_case(case, rank, group) -> dict:
    from sglang.srt.mem_cache.hicache_host_dedup import HostDedupLoadError
    from scripts.rigs.hicache_harness import finish_transfers

    dedup, device_pool, allocator, host_pool, ctl = _build(case, group)
    page = device_pool.page_size
    result = {"is_src": dedup.is_src, "host_kv_bytes": _host_kv_bytes(host_pool)}
    result["host_size"] = host_pool.size

    # The same KV on every rank, as attention TP computes it.
    gen = torch.Generator().manual_seed(1234)
    dev = allocator.alloc(5 * page)
    for layer in range(LAYERS):
        buf = device_pool.kv_buffer[layer]
        rows = torch.randn((len(dev), *buf.shape[1:]), generator=gen)
        buf[dev] = rows.to(buf.dtype)
    host = ctl.write(dev)
    ack = ctl.ack_write_queue[-1]
    result["backup_bytes"] = (ack.num_bytes, ack.num_logical_bytes)
    result["bytes_per_token"] = host_pool.size_per_token
    finish_transfers(ctl)
    mine = host.view(torch.uint8)
    result["same_host_indices"] = all(torch.equal(h, mine) for h in _gather(host))
    # L1 eviction: each rank's stale rows differ, so a missed broadcast shows.
    for layer in range(LAYERS):
        device_pool.kv_buffer[layer][dev] = float(rank + 7)
    allocator.free(dev)

    new_dev = ctl.load(host)
    ctl.start_loading()
    finish_transfers(ctl)
    loaded = torch.stack(
        [device_pool.kv_buffer[layer][new_dev] for layer in range(LAYERS)]
    )
    everyone = _gather(loaded)
    result["equal_to_rank0"] = all(torch.equal(x, everyone[0]) for x in everyone)
    # The restored rows are the written ones (auto) or their round trip (int8).
    gen = torch.Generator().manual_seed(1234)
    written = torch.stack(
        [
            torch.randn(
                (len(dev), *device_pool.kv_buffer[0].shape[1:]), generator=gen
            ).to(device_pool.dtype)
            for _ in range(LAYERS)
        ]
    )
    err = (loaded.float() - written.float()).abs().max().item()
    result["max_abs_err"] = err
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
    if dedup.is_src:
        real = host_pool.load_to_device_per_layer_physical

        def fail_on_layer_1(device_pool_, h, d, layer_id, *a, **k):
            if layer_id == 1:
                raise RuntimeError("injected source load failure")
            return real(device_pool_, h, d, layer_id, *a, **k)

        host_pool.load_to_device_per_layer_physical = fail_on_layer_1
    dev3 = ctl.load(host)
    try:
        ctl.start_loading()
        result["failure"] = "no error"
    except HostDedupLoadError:
        result["failure"] = "HostDedupLoadError"
    finish_transfers(ctl)
    allocator.free(dev3)
    # The group is usable after the failure: a clean load restores again.
    if dedup.is_src:
        host_pool.load_to_device_per_layer_physical = real
    dev4 = ctl.load(host)
    ctl.start_loading()
    finish_transfers(ctl)
    again = torch.stack([device_pool.kv_buffer[layer][dev4] for layer in range(LAYERS)])
    result["after_failure_equal"] = torch.equal(
        again.view(torch.int16), loaded.view(torch.int16)
    )
    dedup.destroy()
    return result


# Above the radix cache's load-back threshold, whole pages at page 4.
RADIX_TOKENS = 32
RADIX_CASES = [
    ("radix_auto", "auto", "page_first_direct", "direct", 4),
    ("radix_int8", "int8", "page_first", "direct", 1),
]


def _radix_stack(case, group, store_dir=None):
    """The radix cache the registry builds from server arguments with the
    flag (and, with `store_dir`, the `file` L3 backend): (cache, device pool,
    allocator, the dedup module's start-up log lines)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from scripts.rigs.hicache_harness import (
        MLAGeometry,
        build_radix_cache,
        make_allocator,
        make_device_pool,
        publish_server_args,
    )

    _, host_dtype, layout, io_backend, page = case
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
    device_pool = make_device_pool(
        MLAGeometry(layer_num=LAYERS, page_size=page), 64 * page
    )
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


def _run_radix_case(case, rank, group, store_dir=None) -> dict:
    """The scheduler's path: --enable-mla-hicache-host-dedup through the
    server arguments, the radix cache and its HiCache stack as the registry
    builds them (pool assembler, HybridCacheController), then insert (written
    through), L1 eviction, a host hit, init_load_back and the load. With
    `store_dir` (the `file` L3 backend), the host copy is evicted too and the
    prefix comes back through the radix cache's L3 prefetch first."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from scripts.rigs.hicache_harness import LoadBackReq

    cache, device_pool, allocator, log = _radix_stack(case, group, store_dir)
    controller = cache.cache_controller
    host_pool = controller.mem_pool_host.anchor_entry.host_pool
    dedup_src = controller.host_dedup.is_src
    result = {
        "is_src": controller.host_dedup.is_src,
        "host_kv_bytes": _host_kv_bytes(host_pool),
        "host_pool": type(host_pool).__name__,
        "log": log,
        "pool_bytes": host_pool.size * host_pool.size_per_token,
    }
    tokens = RADIX_TOKENS
    ids = list(range(100, 100 + tokens))
    slots = allocator.alloc(tokens)
    gen = torch.Generator().manual_seed(99)
    for layer in range(LAYERS):
        buf = device_pool.kv_buffer[layer]
        buf[slots] = torch.randn((tokens, *buf.shape[1:]), generator=gen).to(buf.dtype)
    cache.insert(
        InsertParams(
            key=RadixKey(array("q", ids)),
            value=slots.to(torch.int64),
            prev_prefix_len=0,
        )
    )
    cache.flush_pending_backups()
    cache.check_hicache_events()
    evicted = cache.evict(EvictParams(num_tokens=tokens))
    result["evicted"] = evicted.num_tokens_evicted
    for layer in range(LAYERS):
        device_pool.kv_buffer[layer][slots] = float(rank + 7)
    query = RadixKey(array("q", [*ids, 7]))
    if store_dir is not None:
        result["l3"] = _reload_from_l3(cache, ids, query)
    match = cache.match_prefix(MatchPrefixParams(key=query))
    result["host_hit"] = match.host_hit_length
    lock = cache.lock(match.last_device_node)
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.best_match_node,
            host_hit_length=match.host_hit_length,
            req=LoadBackReq("r0", match.last_device_node),
        )
    )
    result["loaded"] = loaded
    cache.unlock(lock)
    lock = cache.lock(last_node)
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    device = cache.path_device_indices(last_node)
    rows = torch.stack(
        [device_pool.kv_buffer[layer][device] for layer in range(LAYERS)]
    )
    everyone = _gather(rows)
    result["equal_to_rank0"] = all(torch.equal(x, everyone[0]) for x in everyone)
    gen = torch.Generator().manual_seed(99)
    written = torch.stack(
        [
            torch.randn((tokens, *rows.shape[2:]), generator=gen).to(rows.dtype)
            for _ in range(LAYERS)
        ]
    )
    result["max_abs_err"] = (
        (rows.float() - written.float()).abs().max().item()
        if rows.shape == written.shape
        else float("inf")  # not every token came back: the counts say why
    )
    indices = _gather(device.to(torch.int64))
    result["same_device_indices"] = all(torch.equal(x, indices[0]) for x in indices)
    # What sglang:hicache_host_used_bytes reports: the source's bytes only.
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.metrics_reporter import (
        SchedulerMetricsReporter,
    )

    reporter = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cache))
    tier = SchedulerMetricsReporter._read_hicache_host_tier(
        reporter, host_pool, RADIX_TOKENS
    )
    result["reported_used_bytes"] = tier.used_bytes
    result["reported_bytes_per_token"] = tier.bytes_per_token
    result["host_copy"] = [tier.info["host_copy"], tier.info["host_copy_ranks"]]
    result["source_bytes_per_token"] = host_pool.size_per_token if dedup_src else 0
    cache.unlock(lock)
    cache.sanity_check()
    return result


# L3 (`file` backend): (name, host dtype, layout, io backend, page size); int8
# pages are sealed, so a corrupted page file is refused on read.
L3_CASES = [
    ("l3_int8", "int8", "page_first_direct", "direct", 4),
    ("l3_auto", "auto", "layer_first", "direct", 4),
]
L3_PAGES = 6
L3_PAGE_SIZE = {c[0]: c[4] for c in L3_CASES}
# The scheduler's path with the `file` L3 backend (HybridCacheController).
RADIX_L3_CASES = [("radix_l3_int8", "int8", "page_first_direct", "direct", 4)]
L3_REMOVED_PAGE = 4  # its file is removed on the source: the hits stop there
L3_CORRUPT_PAGE = 2  # int8 only: its file's bytes are flipped on the source


def _stamp_tp_rank() -> None:
    """The TP ranks the scheduler stamps, as the storage config reads them."""
    import torch.distributed as dist

    from sglang.srt.runtime_context import get_parallel

    rank = dist.get_rank()
    get_parallel().override_permanently(
        tp_rank=rank,
        tp_size=WORLD,
        attn_tp_rank=rank,
        attn_tp_size=WORLD,
        moe_tp_rank=rank,
        moe_tp_size=WORLD,
        pp_rank=0,
        attn_dcp_rank=0,
    )


def _reload_from_l3(cache, ids, query) -> list:
    """Wait for the L3 backup, drop the host copy, then prefetch the prefix
    as the scheduler does (prefetch_from_storage, check_prefetch_progress);
    both ranks poll in lockstep (each poll is a collective). Returns what
    this rank saw: [host hit before, tokens loaded into the host tier]."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        MatchPrefixParams,
    )

    from scripts.rigs.l3_harness import radix_prefetch, wait_for

    def backed_up():
        cache.check_hicache_events()
        return not cache.ongoing_backup

    wait_for(backed_up, "the L3 backup")
    for component in cache.components:
        cache.evict_host(len(ids), component)
    match = cache.match_prefix(MatchPrefixParams(key=query))
    return [match.host_hit_length, radix_prefetch(cache, match, ids)[0]]


def _l3_stack(case, group, backend: str, extra_config: dict):
    """Fresh dedup state, pools and controller attached to the L3 `backend`:
    what a (re)start builds on every rank. `written` collects the page keys
    the backend's batch_set / batch_set_v1 (Mooncake's zero-copy write) get."""
    from scripts.rigs.l3_harness import publish_runtime

    _, host_dtype, layout, _, page = case
    publish_runtime(page, layout, host_dtype)
    _stamp_tp_rank()
    dedup, device_pool, allocator, host_pool, ctl = _build(case, group, backend)
    ctl.attach_storage_backend(
        backend,
        prefetch_threshold=page,
        model_name=f"hiq/dedup-{backend}",
        storage_backend_extra_config=dict(extra_config),
    )
    written = []
    for name in ("batch_set", "batch_set_v1"):
        real = getattr(ctl.storage_backend, name)

        def counting(keys, *args, _real=real, **kwargs):
            written.extend(keys)
            return _real(keys, *args, **kwargs)

        setattr(ctl.storage_backend, name, counting)
    return dedup, device_pool, allocator, ctl, written


def _l3_prefetch_load(ctl, allocator, device_pool, tokens, rid, page):
    """L3 -> the source's host pool (peers: the same host indices) -> every
    rank's device pool; returns (hit, completed tokens, host indices, rows)."""
    from types import SimpleNamespace

    from scripts.rigs.l3_harness import prefetch_to_host

    l3 = SimpleNamespace(controller=ctl, geo=SimpleNamespace(page_size=page))
    hit, completed, host = prefetch_to_host(l3, tokens, rid, stop_on_miss=False)
    if host is None:
        return hit, completed, torch.empty(0, dtype=torch.int64), None
    ctl.mem_pool_host.free(host[completed:])
    host = host[:completed]
    rows = None
    if completed:
        dev = ctl.load(host)
        ctl.start_loading()
        from scripts.rigs.hicache_harness import finish_transfers

        finish_transfers(ctl)
        rows = torch.stack(
            [device_pool.kv_buffer[layer][dev] for layer in range(LAYERS)]
        )
        allocator.free(dev)
    ctl.mem_pool_host.free(host)
    return hit, completed, host, rows


def _run_l3_case(case, rank, group, store_dir: str) -> dict:
    """Write through to L3 (the source writes each page once), restart with
    fresh pools and controllers on the same store, prefetch and load back;
    then a removed and (int8) a corrupted page file on the source."""
    import torch.distributed as dist

    from scripts.rigs.hicache_harness import finish_transfers
    from scripts.rigs.l3_harness import STORAGE_WAIT_S, file_storage_config
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    page = case[4]
    tokens = list(range(2000, 2000 + L3_PAGES * page))
    hashes = get_storage_hash_str(tokens, None, page_size=page)
    logged = _LogLines("sglang.srt.managers.cache_controller")
    dedup, device_pool, allocator, ctl, written = _l3_stack(
        case, group, "file", file_storage_config(store_dir)
    )
    gen = torch.Generator().manual_seed(4321)
    dev = allocator.alloc(len(tokens))
    for layer in range(LAYERS):
        buf = device_pool.kv_buffer[layer]
        buf[dev] = torch.randn((len(dev), *buf.shape[1:]), generator=gen).to(buf.dtype)
    expected = torch.stack(
        [device_pool.kv_buffer[layer][dev] for layer in range(LAYERS)]
    )
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
    result["page_files"] = sorted(
        f for f in os.listdir(store_dir) if f.endswith(".bin")
    )
    ctl.detach_storage_backend()
    dedup.destroy()

    # Restart: fresh pools and controllers on every rank, the same store.
    dedup, device_pool, allocator, ctl, written = _l3_stack(
        case, group, "file", file_storage_config(store_dir)
    )
    hit, completed, host, rows = _l3_prefetch_load(
        ctl, allocator, device_pool, tokens, "all", page
    )
    result["restart"] = [hit, completed]
    if rows is None:  # nothing restored: "restart" says so on every rank
        rows = torch.full_like(expected, float("nan"))
    result["restart_same_host"] = all(
        torch.equal(x, host.view(torch.uint8)) for x in _gather(host)
    )
    everyone = _gather(rows)
    result["restart_equal_to_rank0"] = all(
        torch.equal(x, everyone[0]) for x in everyone
    )
    result["restart_max_abs_err"] = (rows.float() - expected.float()).abs().max().item()

    # Faults on the source's store: a missing page file, a corrupted one.
    def page_file(i: int) -> str:
        (name,) = [f for f in os.listdir(store_dir) if f.startswith(hashes[i])]
        return os.path.join(store_dir, name)

    if dedup.is_src:
        os.remove(page_file(L3_REMOVED_PAGE))
        if case[1] == "int8":
            path = page_file(L3_CORRUPT_PAGE)
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(path, "wb").write(bytes(data))
    dist.barrier(group)
    hit, completed, host, rows = _l3_prefetch_load(
        ctl, allocator, device_pool, tokens, "faulty", page
    )
    result["faulty"] = [hit, completed]
    result["faulty_same_host"] = all(
        torch.equal(x, host.view(torch.uint8)) for x in _gather(host)
    )
    if rows is not None:
        everyone = _gather(rows)
        result["faulty_equal_to_rank0"] = all(
            torch.equal(x, everyone[0]) for x in everyone
        )
    result["keys_written_after_restart"] = len(written)
    ctl.detach_storage_backend()
    dedup.destroy()
    return result


# L3 on a real mooncake_master: objects live in the store's memory segments,
# which the clients of both ranks mount, so L1 and L2 are dropped instead of
# restarting the ranks.
MOONCAKE_CASES = [("l3_mooncake_int8", "int8", "page_first_direct", "direct", 4)]
MOONCAKE_PAGE_SIZE = {c[0]: c[4] for c in MOONCAKE_CASES}


class _StoreCalls:
    """The Mooncake client with the name of every call it serves recorded."""

    def __init__(self, store, calls: list):
        self._store = store
        self._calls = calls

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._calls.append(name)
            return attr(*args, **kwargs)

        return call


def _run_l3_mooncake_case(case, rank, group, extra_config: dict) -> dict:
    """Write through to Mooncake (the source alone), drop L1 and L2 on every
    rank, prefetch and load back; then an object removed on the source."""
    import torch.distributed as dist

    from scripts.rigs.hicache_harness import finish_transfers
    from scripts.rigs.l3_harness import STORAGE_WAIT_S
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    page = case[4]
    tokens = list(range(3000, 3000 + L3_PAGES * page))
    hashes = get_storage_hash_str(tokens, None, page_size=page)
    logged = _LogLines("sglang.srt.managers.cache_controller")
    dedup, device_pool, allocator, ctl, written = _l3_stack(
        case, group, "mooncake", extra_config
    )
    backend = ctl.storage_backend
    # Peers must never reach the store after attaching: the source serves.
    calls = []
    backend.store = _StoreCalls(backend.store, calls)
    gen = torch.Generator().manual_seed(5678)
    dev = allocator.alloc(len(tokens))
    for layer in range(LAYERS):
        buf = device_pool.kv_buffer[layer]
        buf[dev] = torch.randn((len(dev), *buf.shape[1:]), generator=gen).to(buf.dtype)
    expected = torch.stack(
        [device_pool.kv_buffer[layer][dev] for layer in range(LAYERS)]
    )
    host = ctl.write(dev)
    finish_transfers(ctl)
    op_id = ctl.write_storage(host, tokens, hash_value=hashes)
    op = ctl.ack_backup_queue.get(timeout=STORAGE_WAIT_S)
    assert op.id == op_id
    result = {
        "is_src": dedup.is_src,
        "keys_written": len(written),
        "backup_completed": op.completed_tokens,
        "errors": [x for x in logged.lines if "ackup" in x or "Write page" in x],
    }
    logged.close()
    dist.barrier(group)
    if dedup.is_src:
        # The group's pages, as the store holds them (one object each).
        result["stored_pages"] = backend.batch_exists(hashes)
    # L1 and L2 dropped on every rank; the stale rows differ per rank.
    for layer in range(LAYERS):
        device_pool.kv_buffer[layer][dev] = float(rank + 7)
    allocator.free(dev)
    ctl.mem_pool_host.free(host)
    # The source's freed records are scrubbed, so only a read from the store
    # can restore them.
    for records in ctl.mem_pool_host.kv_buffer or []:
        records.view(torch.uint8).fill_(0x55)
    hit, completed, host, rows = _l3_prefetch_load(
        ctl, allocator, device_pool, tokens, "all", page
    )
    result["reload"] = [hit, completed]
    if rows is None:  # nothing restored: "reload" says so on every rank
        rows = torch.full_like(expected, float("nan"))
    result["reload_same_host"] = all(
        torch.equal(x, host.view(torch.uint8)) for x in _gather(host)
    )
    everyone = _gather(rows)
    result["reload_equal_to_rank0"] = all(torch.equal(x, everyone[0]) for x in everyone)
    result["reload_max_abs_err"] = (rows.float() - expected.float()).abs().max().item()

    # A missing object on the source: the hits stop there on every rank.
    if dedup.is_src:
        backend.delete(hashes[L3_REMOVED_PAGE])
    dist.barrier(group)
    hit, completed, host, rows = _l3_prefetch_load(
        ctl, allocator, device_pool, tokens, "missing", page
    )
    result["missing"] = [hit, completed]
    if rows is None:  # nothing restored: "missing" says so on every rank
        rows = torch.full_like(expected[:, : L3_REMOVED_PAGE * page], float("nan"))
    result["missing_same_host"] = all(
        torch.equal(x, host.view(torch.uint8)) for x in _gather(host)
    )
    everyone = _gather(rows)
    result["missing_equal_to_rank0"] = all(
        torch.equal(x, everyone[0]) for x in everyone
    )
    result["keys_written_total"] = len(written)
    result["store_calls"] = sorted(set(calls))
    ctl.detach_storage_backend()
    dedup.destroy()
    return result


# The scheduler's path with `file` L3, each failure injected on the source
# alone; (name, host dtype, layout, io backend, page size).
RADIX_FAULT_CASE = ("radix_l3_faults", "int8", "page_first_direct", "direct", 4)
# Source-side failures a prefetch meets, in order: each a miss on every rank.
SOURCE_FAULTS = (
    "store_write_raises",  # the source's page writes (batch_set*) raise
    "store_query_raises",  # the source's hit query (batch_exists) raises
    "store_read_raises",  # the source's page reads (batch_get*) raise
    "host_pool_full",  # the source's host pool refuses the prefetch's bounce
    "page_refused",  # a sealed page fails its check mid-batch on the source
)
FAULT_REFUSED_PAGE = 3  # of RADIX_TOKENS // 4 pages: the hits stop there


def _radix_state(cache, match) -> dict:
    """What must be identical on every rank after `match`: the matched path's
    nodes (spans, device lengths, children), its host indices, every device
    index in the tree, the tree's sizes and the host pool's free slots."""
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


def _patch(obj, name: str, fn):
    """Set obj.name to fn; returns the undo."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, fn)
    return lambda: setattr(obj, name, old) if had else delattr(obj, name)


def _run_radix_fault_case(case, rank, group, store_dir: str) -> dict:
    """Through the radix cache with `file` L3: written through, L1 and L2
    evicted; then each of SOURCE_FAULTS on the source alone, a prefetch, and
    what each rank's radix cache holds after it (the same miss everywhere);
    then a clean prefetch and load; last a source host->device failure."""
    import torch.distributed as dist

    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.hicache_host_dedup import HostDedupLoadError
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from scripts.rigs.hicache_harness import LoadBackReq
    from scripts.rigs.l3_harness import radix_prefetch, wait_for

    cache, device_pool, allocator, _ = _radix_stack(case, group, store_dir)
    ctl = cache.cache_controller
    src = ctl.host_dedup.is_src
    backend = ctl.storage_backend
    page, tokens = case[4], RADIX_TOKENS

    def backed_up():
        cache.check_hicache_events()
        return not cache.ongoing_backup

    def drop_host():
        for component in cache.components:
            cache.evict_host(tokens, component)

    def write_through(ids: list, seed: int) -> torch.Tensor:
        """Insert (written through to host and L3), then evict L1 and L2:
        the rows written."""
        slots = allocator.alloc(tokens)
        gen = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            buf = device_pool.kv_buffer[layer]
            rows = torch.randn((tokens, *buf.shape[1:]), generator=gen)
            buf[slots] = rows.to(buf.dtype)
        rows = torch.stack([device_pool.kv_buffer[i][slots] for i in range(LAYERS)])
        cache.insert(
            InsertParams(
                key=RadixKey(array("q", ids)),
                value=slots.to(torch.int64),
                prev_prefix_len=0,
            )
        )
        cache.flush_pending_backups()
        cache.check_hicache_events()
        wait_for(backed_up, "the L3 backup")
        cache.evict(EvictParams(num_tokens=tokens))
        for layer in range(LAYERS):
            device_pool.kv_buffer[layer][slots] = float(rank + 7)
        drop_host()
        return rows

    def state(query) -> dict:
        match = cache.match_prefix(MatchPrefixParams(key=query))
        hit = [match.device_prefix_len, match.host_hit_length]
        return {"hit": hit, **_radix_state(cache, match)}

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
    match = cache.match_prefix(MatchPrefixParams(key=query))
    span = radix_prefetch(cache, match, lost, rid="lost")
    result["faults"]["store_write_raises"] = {"prefetched": list(span), **state(query)}
    drop_host()

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
        data = open(refused, "rb").read()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        open(refused, "wb").write(bytes(flipped))
        return lambda: open(refused, "wb").write(data)

    for i, fault in enumerate(SOURCE_FAULTS[1:]):
        undo = inject(fault)
        dist.barrier(group)
        match = cache.match_prefix(MatchPrefixParams(key=query))
        try:
            span = radix_prefetch(cache, match, ids, rid=f"fault{i}")
        except AssertionError as exc:  # a rank left waiting: the rest is moot
            result["faults"][fault] = {"prefetched": repr(exc)}
            return result
        undo()
        result["faults"][fault] = {"prefetched": list(span), **state(query)}
        drop_host()

    # Nothing broken any more: the prefix comes back and loads everywhere.
    dist.barrier(group)
    match = cache.match_prefix(MatchPrefixParams(key=query))
    result["clean_prefetched"] = list(radix_prefetch(cache, match, ids, rid="clean"))

    def load_back(rid: str):
        match = cache.match_prefix(MatchPrefixParams(key=query))
        lock = cache.lock(match.last_device_node)
        _, last_node = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=match.best_match_node,
                host_hit_length=match.host_hit_length,
                req=LoadBackReq(rid, match.last_device_node),
            )
        )
        cache.unlock(lock)
        return cache.lock(last_node), last_node

    result["clean_hit"] = state(query)["hit"]
    lock, last_node = load_back("clean")
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    device = cache.path_device_indices(last_node)
    rows = torch.stack([device_pool.kv_buffer[i][device] for i in range(LAYERS)])
    everyone = _gather(rows)
    result["clean_equal_to_rank0"] = all(torch.equal(x, everyone[0]) for x in everyone)
    result["clean_max_abs_err"] = (
        (rows.float() - written.float()).abs().max().item()
        if rows.shape == written.shape
        else float("inf")
    )
    cache.unlock(lock)

    # The source's host->device load fails: the batch that reads these rows
    # is already formed, so it raises on every rank (no miss to fall back to).
    cache.evict(EvictParams(num_tokens=tokens))
    host_pool = ctl.mem_pool_host.anchor_entry.host_pool
    undo = lambda: None  # noqa: E731
    if src:
        real = host_pool.load_to_device_per_layer_physical

        def fail_on_layer_1(device_pool_, h, d, layer_id, *a, **k):
            if layer_id == 1:
                raise RuntimeError("injected source load failure")
            return real(device_pool_, h, d, layer_id, *a, **k)

        undo = _patch(host_pool, "load_to_device_per_layer_physical", fail_on_layer_1)
    load_back("failing")
    try:
        cache.ready_to_load_host_cache()
        outcome = "loaded"
    except HostDedupLoadError:
        outcome = "HostDedupLoadError"
    undo()
    result["load_failure"] = {"outcome": outcome, **state(query)}
    return result


def rank_cases(rank: int, group, out_dir: str, mooncake: dict | None) -> dict:
    """Every case on one rank (spawned by tests/support/spawned_ranks.py)."""
    results = {}
    for case in CASES:
        results[case[0]] = _run_case(case, rank, group)
    for case in RADIX_CASES:
        results[case[0]] = _run_radix_case(case, rank, group)
    for case in L3_CASES:
        store = os.path.join(out_dir, case[0])
        results[case[0]] = _run_l3_case(case, rank, group, store)
    for case in RADIX_L3_CASES:
        store = os.path.join(out_dir, case[0])
        results[case[0]] = _run_radix_case(case, rank, group, store)
    for case in MOONCAKE_CASES if mooncake is not None else ():
        results[case[0]] = _run_l3_mooncake_case(case, rank, group, mooncake)
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
    from scripts.rigs.l3_harness import mooncake_unavailable_reason
    from tests.support.spawned_ranks import run_ranks

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


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_load_restores_rank0_rows_on_every_rank(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["is_src"] and not r1["is_src"]
    assert r0["equal_to_rank0"] and r1["equal_to_rank0"]
    # auto restores exactly; int8 within its quantization error.
    limit = 0.0 if case.startswith("auto") else 0.05
    assert r0["max_abs_err"] <= limit and r1["max_abs_err"] <= limit


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_peers_hold_no_host_kv_and_the_same_indices(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["host_size"] == r1["host_size"]
    assert r0["same_host_indices"] and r1["same_host_indices"]
    per_token_floor = LAYERS * 576  # the int8 latent record's payload alone
    assert r0["host_kv_bytes"] >= r0["host_size"] * per_token_floor
    assert r1["host_kv_bytes"] == 0
    # hicache_backup_bytes_total: the source's backup counts once.
    assert r0["backup_bytes"][0] == 5 * r0["bytes_per_token"] * PAGES[case] > 0
    assert r1["backup_bytes"] == [0, 0]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_failures_are_consistent_across_ranks(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["full_write_is_none"] == [True, True]
    assert r0["failure"] == r1["failure"] == "HostDedupLoadError"
    assert r0["after_failure_equal"] and r1["after_failure_equal"]


@pytest.mark.parametrize("case", [c[0] for c in RADIX_CASES])
def test_radix_cache_host_hit_restores_rank0_rows(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["is_src"] and not r1["is_src"]
    assert r1["host_pool"] == "MLATokenToKVPoolHost" and r1["host_kv_bytes"] == 0
    assert r0["host_kv_bytes"] > 0
    tokens = RADIX_TOKENS
    for r in (r0, r1):
        assert (r["evicted"], r["host_hit"], r["loaded"]) == (tokens,) * 3
        assert r["equal_to_rank0"] and r["same_device_indices"]
        assert r["max_abs_err"] <= (0.0 if case == "radix_auto" else 0.05)


def test_start_up_log_states_host_bytes_per_rank_and_per_group(ranks):
    r0, r1 = ranks[0]["radix_int8"], ranks[1]["radix_int8"]
    (src_line,) = [x for x in r0["log"] if "holds" in x]
    (peer_line,) = [x for x in r1["log"] if "holds" in x]
    assert "(source)" in src_line and "(allocator-only)" in peer_line
    assert "this rank holds 0 GB" in peer_line
    # Group bytes: the source's pool; without dedup two copies.
    gb = r0["pool_bytes"] / 1e9
    assert f"this rank holds {gb:.4g} GB" in src_line
    assert f"holds {gb:.4g} GB instead of {2 * gb:.4g} GB" in peer_line


def test_host_tier_metrics_count_the_source_bytes_once(ranks):
    """Summed over the ranks, sglang:hicache_host_used_bytes is the node's."""
    r0, r1 = ranks[0]["radix_int8"], ranks[1]["radix_int8"]
    per_token = r0["source_bytes_per_token"]
    assert per_token > 0
    assert r0["reported_bytes_per_token"] == per_token
    assert r0["reported_used_bytes"] == RADIX_TOKENS * per_token
    assert (r1["reported_used_bytes"], r1["reported_bytes_per_token"]) == (0, 0)
    # sglang:hicache_host_info says which rank holds the group's one copy.
    assert r0["host_copy"] == ["source", str(WORLD)]
    assert r1["host_copy"] == ["peer", str(WORLD)]


@pytest.mark.parametrize("case", [c[0] for c in L3_CASES])
def test_l3_page_is_written_once_per_group(ranks, case):
    """The source writes each page; the peer writes none (no backup error)."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["is_src"] and not r1["is_src"]
    assert r0["keys_written"] == L3_PAGES and r1["keys_written"] == 0
    assert r0["page_files"] == r1["page_files"] and len(r0["page_files"]) == L3_PAGES
    assert r0["backup_completed"] == L3_PAGES * L3_PAGE_SIZE[case]
    assert r1["backup_completed"] == 0 and not r0["errors"] and not r1["errors"]
    # Prefetches read: nobody writes after the restart.
    assert r0["keys_written_after_restart"] == r1["keys_written_after_restart"] == 0


@pytest.mark.parametrize("case", [c[0] for c in L3_CASES])
def test_l3_hit_after_restart_restores_rank0_rows(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    tokens = L3_PAGES * L3_PAGE_SIZE[case]
    assert r0["restart"] == r1["restart"] == [tokens, tokens]
    assert r0["restart_same_host"] and r1["restart_same_host"]
    assert r0["restart_equal_to_rank0"] and r1["restart_equal_to_rank0"]
    limit = 0.0 if case == "l3_auto" else 0.05
    assert r0["restart_max_abs_err"] <= limit and r1["restart_max_abs_err"] <= limit


@pytest.mark.parametrize("case", [c[0] for c in L3_CASES])
def test_l3_source_side_miss_is_the_same_on_every_rank(ranks, case):
    """A removed page file ends the hits; a corrupted (sealed, int8) one is
    refused on read: both ranks see the same hits, pages and host indices."""
    r0, r1 = ranks[0][case], ranks[1][case]
    page = L3_PAGE_SIZE[case]
    usable = L3_CORRUPT_PAGE if case == "l3_int8" else L3_REMOVED_PAGE
    assert r0["faulty"] == r1["faulty"] == [L3_REMOVED_PAGE * page, usable * page]
    assert r0["faulty_same_host"] and r1["faulty_same_host"]
    assert r0["faulty_equal_to_rank0"] and r1["faulty_equal_to_rank0"]


def test_radix_cache_l3_prefetch_restores_rank0_rows(ranks):
    """Through the radix cache: written through to L3, L1 and L2 evicted, the
    prefix prefetched from L3 (the same span on both ranks), then a host hit
    loaded back bit-equal on both ranks, within int8's error of the written."""
    r0, r1 = ranks[0]["radix_l3_int8"], ranks[1]["radix_l3_int8"]
    tokens = RADIX_TOKENS
    assert r0["l3"] == r1["l3"] == [0, tokens]
    for r in (r0, r1):
        assert (r["evicted"], r["host_hit"], r["loaded"]) == (tokens,) * 3
        assert r["equal_to_rank0"] and r["same_device_indices"]
        assert r["max_abs_err"] <= 0.05


def _mooncake(ranks, case):
    if case not in ranks[0]:
        from scripts.rigs.l3_harness import require_mooncake

        require_mooncake()
        pytest.fail(f"{case} did not run though Mooncake is available")
    return ranks[0][case], ranks[1][case]


@pytest.mark.parametrize("case", [c[0] for c in MOONCAKE_CASES])
def test_mooncake_page_is_written_once_per_group(ranks, case):
    """The source writes each page once; the peer never calls the store."""
    r0, r1 = _mooncake(ranks, case)
    assert r0["is_src"] and not r1["is_src"]
    assert r0["keys_written"] == L3_PAGES and r1["keys_written"] == 0
    assert r0["stored_pages"] == L3_PAGES
    assert r0["backup_completed"] == L3_PAGES * MOONCAKE_PAGE_SIZE[case]
    assert r1["backup_completed"] == 0 and not r0["errors"] and not r1["errors"]
    assert r0["keys_written_total"] == L3_PAGES and r1["keys_written_total"] == 0
    assert r0["store_calls"] and r1["store_calls"] == []


@pytest.mark.parametrize("case", [c[0] for c in MOONCAKE_CASES])
def test_mooncake_hit_after_l2_drop_restores_rank0_rows(ranks, case):
    r0, r1 = _mooncake(ranks, case)
    tokens = L3_PAGES * MOONCAKE_PAGE_SIZE[case]
    assert r0["reload"] == r1["reload"] == [tokens, tokens]
    assert r0["reload_same_host"] and r1["reload_same_host"]
    assert r0["reload_equal_to_rank0"] and r1["reload_equal_to_rank0"]
    assert r0["reload_max_abs_err"] <= 0.05 and r1["reload_max_abs_err"] <= 0.05


@pytest.mark.parametrize("case", [c[0] for c in MOONCAKE_CASES])
def test_mooncake_source_side_miss_is_the_same_on_every_rank(ranks, case):
    """An object removed on the source ends the hits on both ranks."""
    r0, r1 = _mooncake(ranks, case)
    pages = L3_REMOVED_PAGE * MOONCAKE_PAGE_SIZE[case]
    assert r0["missing"] == r1["missing"] == [pages, pages]
    assert r0["missing_same_host"] and r1["missing_same_host"]
    assert r0["missing_equal_to_rank0"] and r1["missing_equal_to_rank0"]


def _faults(ranks):
    r0, r1 = ranks[0][RADIX_FAULT_CASE[0]], ranks[1][RADIX_FAULT_CASE[0]]
    for r in (r0, r1):
        assert "error" not in r, r["error"]
    return r0, r1


@pytest.mark.parametrize("fault", SOURCE_FAULTS)
def test_radix_source_side_l3_failure_is_the_same_miss_on_every_rank(ranks, fault):
    """Each failure on the source alone (its store's writes, query or reads
    raising, its host pool refusing the prefetch's bounce, a sealed page
    refused mid-batch): every rank prefetches the same span, and afterwards
    holds the same matched path, host and device indices, tree sizes and
    free host slots."""
    r0, r1 = _faults(ranks)
    f0, f1 = r0["faults"][fault], r1["faults"][fault]
    page = RADIX_FAULT_CASE[4]
    loaded = FAULT_REFUSED_PAGE * page if fault == "page_refused" else 0
    assert f0["prefetched"][0] == f1["prefetched"][0] == loaded, (f0, f1)
    assert f0["hit"] == f1["hit"] == [0, loaded]
    assert f0 == f1  # the radix path, host and device indices, sizes


def test_radix_after_source_failures_a_prefetch_still_restores_rank0_rows(
    ranks,
):
    r0, r1 = _faults(ranks)
    tokens = RADIX_TOKENS
    for r in (r0, r1):
        assert r["clean_prefetched"][0] == tokens and r["clean_hit"] == [0, tokens]
        assert r["clean_equal_to_rank0"] and r["clean_max_abs_err"] <= 0.05


def test_radix_source_load_failure_raises_on_every_rank_with_one_state(
    ranks,
):
    """A host->device failure on the source is no miss (the batch reading the
    rows is formed): HostDedupLoadError on both ranks, the same radix state."""
    r0, r1 = _faults(ranks)
    f0, f1 = r0["load_failure"], r1["load_failure"]
    assert f0["outcome"] == f1["outcome"] == "HostDedupLoadError"
    assert f0 == f1


def test_four_ranks_one_source_three_peers(tmp_path):
    """The same cases at attention-TP 4: three peers, one copy."""
    from tests.support.spawned_ranks import run_ranks

    out = run_ranks(
        tmp_path, 4, "tests.test_mla_host_dedup:rank_cases_4", {}, TIMEOUT_S
    )
    for case, _, _, _, _ in FOUR_RANK_CASES:
        r0, peers = out[0][case], [r[case] for r in out[1:]]
        assert r0["is_src"] and not any(p["is_src"] for p in peers)
        assert all(r[case]["equal_to_rank0"] for r in out)
        assert all(r[case]["same_host_indices"] for r in out)
        assert r0["host_kv_bytes"] > 0
        assert [p["host_kv_bytes"] for p in peers] == [0, 0, 0]
        assert {r[case]["failure"] for r in out} == {"HostDedupLoadError"}
        assert all(r[case]["after_failure_equal"] for r in out)
