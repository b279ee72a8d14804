"""Hybrid models' host tiers through SGLang's own hybrid pool assembler,
HybridCacheController and UnifiedRadixCache, on CPU, for every --hicache-host-dtype."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from scripts.rigs.hicache_harness import LoadBackReq
from scripts.rigs.l3_harness import (
    MooncakeMaster,
    radix_prefetch,
    require_mooncake,
    wait_for,
)
from tests.support.metrics import Scrape, scheduler_collector
from tests.support.server_args import GPT_OSS
from tests.support.hybrid_rigs import (
    ENCODED,
    HOST_DTYPES,
    Rig,
    alloc_swa_tokens,
    assert_kv_restored,
    expected_host_cls,
    fill_kv,
    fill_mamba,
    mamba_rig,
    mamba_round_trip,
    mamba_state,
    swa_rig,
    swa_round_trip,
    wipe_kv,
    wipe_mamba,
)

from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

# The rigs' pools and L3 page buffers take a few MB: the free-RAM guard is not
# under test, and a busy machine must not refuse them mid-test.
pytestmark = pytest.mark.usefixtures(
    "hybrid_host_copies_on_cpu", "hybrid_runtime_context", "host_ram_not_under_test"
)

# (layout, page size, io backend): the server default, and the direct copy.
SWA_LAYOUTS = [("page_first", 16, "kernel"), ("layer_first", 1, "direct")]
# The Mamba state pool takes page-first layouts only (layer_first is refused
# at start-up, tests/test_startup.py).
MAMBA_LAYOUTS = [("page_first", 16, "kernel"), ("page_first_direct", 1, "direct")]
BACKENDS = ("file", "mooncake")


def assert_state_as_stock(encoded, stock):
    """The same seed writes the same state in both runs; the encoded run's state
    comes back as the stock pool returns it: unchanged."""
    for want, got, stock_want, stock_got in zip(*encoded, *stock, strict=True):
        assert torch.equal(want, stock_want)
        assert torch.equal(stock_got, stock_want)
        assert torch.equal(got, stock_got)


# -- host hits through the radix cache ----------------------------------------


def radix_key(ids):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", ids))


def reload_from_l3(rig: Rig, ids: list[int], query) -> None:
    """After the L1 eviction: wait for the L3 backups, drop the host copies too, then
    prefetch the prefix from L3 into the host tier as the scheduler does
    (prefetch_from_storage, check_prefetch_progress)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    cache = rig.cache

    def backed_up():
        cache.check_hicache_events()
        return not cache.ongoing_backup

    wait_for(backed_up, "the L3 backup")
    for component in cache.components:
        cache.evict_host(len(ids), component)
    match = cache.match_prefix(MatchPrefixParams(key=query))
    assert (match.device_prefix_len, match.host_hit_length) == (0, 0)
    assert radix_prefetch(cache, match, ids) == (len(ids), 0)
    assert ComponentType.FULL in cache.components


def host_hit(
    rig: Rig, ids, insert, evict, wipe, check, from_l3, load_req=None, **match
):
    """The scheduler's order: `insert` (written through), L1 eviction by `evict` and
    `wipe` (with `from_l3`, L2 eviction and an L3 prefetch too), a match that hits the
    host, init_load_back, the load, `check(match, evicted, device indices)`; the next
    match is a device hit."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        InitLoadBackParams,
        MatchPrefixParams,
    )

    cache, tokens = rig.cache, len(ids)
    cache.insert(insert)
    cache.flush_pending_backups()
    cache.check_hicache_events()
    evicted = cache.evict(evict)
    assert evicted.num_tokens_evicted == tokens
    wipe()
    query = radix_key([*ids, 7])
    if from_l3:
        reload_from_l3(rig, ids, query)

    hit = cache.match_prefix(MatchPrefixParams(key=query, **match))
    assert (hit.device_prefix_len, hit.host_hit_length) == (0, tokens)
    req = load_req or LoadBackReq("r0", None)
    req.last_node = hit.last_device_node
    lock = cache.lock(hit.last_device_node)
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=hit.best_match_node,
            host_hit_length=hit.host_hit_length,
            req=req,
        )
    )
    assert loaded == tokens
    cache.unlock(lock)
    lock = cache.lock(last_node)
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    check(hit, evicted, cache.path_device_indices(last_node))
    again = cache.match_prefix(MatchPrefixParams(key=query))
    assert (again.device_prefix_len, again.host_hit_length) == (tokens, 0)
    cache.unlock(lock)
    cache.sanity_check()


def swa_host_hit(rig: Rig, tokens: int = 48, seed: int = 1, from_l3: bool = False):
    """The full-attention KV comes back for every token, the SWA KV for the window the
    model attends to."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    window, ids = GPT_OSS["sliding_window"], list(range(100, 100 + tokens))
    gen = torch.Generator().manual_seed(seed)
    full = alloc_swa_tokens(rig.allocator, tokens)
    swa = rig.allocator.translate_loc_from_full_to_swa(full)
    full_written = fill_kv(rig.kv_pool, full, gen)
    swa_written = fill_kv(rig.side_pool, swa, gen)

    def wipe():
        wipe_kv(rig.kv_pool, full)
        wipe_kv(rig.side_pool, swa)

    def check(hit, evicted, device):
        assert len(device) == tokens
        assert_kv_restored(rig, PoolName.KV, rig.kv_pool, device, full_written)
        # SWA slots only for the last `window` tokens; the rest map to the
        # padding slot 0.
        swa_device = rig.allocator.translate_loc_from_full_to_swa(device)
        assert not swa_device[: tokens - window].any()
        assert swa_device[tokens - window :].all()
        tail = [(k[-window:], v[-window:]) for k, v in swa_written]
        assert_kv_restored(
            rig, PoolName.SWA, rig.side_pool, swa_device[tokens - window :], tail
        )

    insert = InsertParams(
        key=radix_key(ids), value=full.to(torch.int64), prev_prefix_len=0
    )
    evict = EvictParams(num_tokens=tokens, swa_num_tokens=tokens)
    host_hit(rig, ids, insert, evict, wipe, check, from_l3)


# Mooncake takes page-first layouts only (SGLang rewrites layer_first).
L3_SWA_CASES = [
    (backend, *case) for backend in (None, "file") for case in SWA_LAYOUTS
] + [("mooncake", *case) for case in MAMBA_LAYOUTS]
L3_MAMBA_CASES = [(backend, *case) for backend in BACKENDS for case in MAMBA_LAYOUTS]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    require_mooncake()
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log")
    yield master.start()
    master.stop()


@pytest.fixture
def l3_args(request, tmp_path):
    """The storage arguments of an L3 backend; each test (and each `run` in it) its own
    model name, so tests sharing one Mooncake store keep their keys apart."""

    def storage_args(backend: str, run: str = "") -> dict:
        name = f"{request.node.name}-{run}" if run else request.node.name
        args = dict(hicache_storage_backend=backend, served_model_name=name)
        if backend == "file":
            return dict(args, file_storage_path=str(tmp_path / run))
        master = request.getfixturevalue("mooncake_master")
        return dict(args, extra_config=master.storage_config())

    return storage_args


@pytest.mark.parametrize("backend,layout,page_size,io_backend", L3_SWA_CASES)
@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_sliding_window_host_hit(
    hybrid_model_dirs, l3_args, host_dtype, backend, layout, page_size, io_backend
):
    l3 = None if backend is None else l3_args(backend)
    rig = swa_rig(hybrid_model_dirs, host_dtype, layout, page_size, io_backend, l3=l3)
    assert rig.cache.enable_storage == (l3 is not None)
    # Both attention kinds get the format's encoded pool.
    for name in (PoolName.KV, PoolName.SWA):
        assert type(rig.host_pool(name)) is expected_host_cls(host_dtype), name
        assert rig.host_pool(name).layout == layout
    assert rig.controller.io_backend == io_backend
    if l3 is None:
        # Through the controller alone first: every SWA token comes back.
        swa_round_trip(rig, tokens=2 * page_size if page_size > 1 else 24)
    swa_host_hit(rig, from_l3=l3 is not None)


def mamba_host_hit(rig: Rig, tokens: int = 48, seed: int = 2, from_l3: bool = False):
    """A linear-attention model: KV and the sequence-end state, loaded back into the
    request's own state slot; returns the state written and restored."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    ids = list(range(100, 100 + tokens))
    gen = torch.Generator().manual_seed(seed)
    full = rig.allocator.alloc(tokens)
    slot = rig.cache.req_to_token_pool.mamba_allocator.alloc(1)
    written = fill_kv(rig.kv_pool, full, gen)
    state = fill_mamba(rig.side_pool, slot, gen)
    req = LoadBackReq("r0", None)
    req.kv = SimpleNamespace(
        mamba_pool_idx=None,
        holds_mamba=False,
        mamba_cow_src_index=None,
        mamba_needs_clear=False,
    )
    restored = []

    def wipe():
        wipe_kv(rig.kv_pool, full)
        wipe_mamba(rig.side_pool, slot)

    def check(hit, evicted, device):
        assert evicted.mamba_num_evicted == 1
        assert hit.mamba_host_hit_length == 1
        assert req.kv.mamba_pool_idx is not None
        assert_kv_restored(rig, PoolName.KV, rig.kv_pool, device, written)
        restored.extend(mamba_state(rig.side_pool, req.kv.mamba_pool_idx.view(1)))

    insert = InsertParams(
        key=radix_key(ids),
        value=full.to(torch.int64),
        prev_prefix_len=0,
        mamba_value=slot,
    )
    evict = EvictParams(num_tokens=tokens, mamba_num=1)
    host_hit(
        rig, ids, insert, evict, wipe, check, from_l3, req, cow_mamba=True, req=req
    )
    return state, restored


@pytest.mark.parametrize(
    "backend,layout,page_size,io_backend,model",
    [(None, *case, m) for case in MAMBA_LAYOUTS for m in ("qwen3_next", "qwen3_5")]
    + [(*case, "qwen3_next") for case in L3_MAMBA_CASES],
)
@pytest.mark.parametrize("host_dtype", ENCODED)
def test_linear_attention_host_hit(
    hybrid_model_dirs, l3_args, host_dtype, backend, layout, page_size, io_backend,
    model,
):  # fmt: skip
    def run(dtype):
        # Distinct L3 keys for the stock and the encoded run.
        l3 = None if backend is None else l3_args(backend, run=dtype)
        rig = mamba_rig(
            hybrid_model_dirs, dtype, layout, page_size, io_backend, model=model, l3=l3
        )
        if dtype != "auto":
            assert type(rig.host_pool(PoolName.KV)) is host_pool_cls(dtype)
        # The state pool stays upstream's, whatever the KV format.
        assert type(rig.host_pool(PoolName.MAMBA)) is MambaPoolHost
        # Through the controller alone first (no L3), then through the radix cache.
        tokens = 2 * page_size if page_size > 1 else 24
        trip = mamba_round_trip(rig, tokens) if backend is None else ((), ())
        return rig, trip, mamba_host_hit(rig, from_l3=backend is not None)

    stock, stock_trip, stock_hit = run("auto")
    rig, trip, hit = run(host_dtype)
    mamba = PoolName.MAMBA
    assert rig.host_pool(mamba).layout == stock.host_pool(mamba).layout
    assert_state_as_stock(trip, stock_trip)
    assert_state_as_stock(hit, stock_hit)


# -- metrics -------------------------------------------------------------------


def collect(rig: Rig) -> Scrape:
    """What the scheduler's metrics loop exports for this cache."""
    from sglang.srt.managers.scheduler_components.metrics_reporter import (
        SchedulerMetricsReporter,
    )
    from sglang.srt.observability.metrics_collector import SchedulerStats
    from sglang.srt.runtime_context import get_server_args

    collector = getattr(rig, "_collector", None)
    if collector is None:
        collector = rig._collector = scheduler_collector(get_server_args())
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(
        enable_hierarchical_cache=True, tree_cache=rig.cache
    )
    reporter.stats = SchedulerStats()
    reporter._log_hicache_stats()
    collector.log_stats(reporter.stats)
    return Scrape()


def assert_bytes(scrape, stored, logical):
    """Backups and load-backs each moved `stored` bytes for `logical` device bytes."""
    for name in ("hicache_backup", "load_back"):
        assert scrape.value(f"sglang:{name}_bytes_total") == stored
        assert scrape.value(f"sglang:{name}_logical_bytes_total") == logical


def test_sliding_window_metrics(hybrid_model_dirs):
    host_dtype, page_size = "int8", 16
    rig = swa_rig(
        hybrid_model_dirs, host_dtype, "page_first", page_size, "kernel", True
    )
    kv_host, swa_host = rig.host_pool(PoolName.KV), rig.host_pool(PoolName.SWA)
    tokens = swa_round_trip(rig, tokens=3 * page_size)
    scrape = collect(rig)

    (info,) = scrape.all("sglang:hicache_host_info")
    assert info.labels["host_dtype"] == host_dtype
    assert info.labels["io_backend"] == "kernel"
    assert scrape.value("sglang:hicache_host_bytes_per_token") == kv_host.size_per_token
    # Written through once, loaded back once, per pool.
    for name in ("kv", "swa"):
        assert scrape.value("sglang:hicache_backup_tokens_total", pool=name) == tokens
        assert scrape.value("sglang:load_back_tokens_total", pool=name) == tokens
    stored = tokens * (kv_host.size_per_token + swa_host.size_per_token)
    logical = tokens * (
        kv_host.device_size_per_token() + swa_host.device_size_per_token()
    )
    assert stored < logical  # both pools encode
    assert_bytes(scrape, stored, logical)


def test_linear_attention_metrics(hybrid_model_dirs):
    host_dtype = "int4"
    rig = mamba_rig(hybrid_model_dirs, host_dtype, "page_first", 16, "kernel", True)
    kv_host, mamba_host = rig.host_pool(PoolName.KV), rig.host_pool(PoolName.MAMBA)
    tokens = 32
    mamba_round_trip(rig, tokens)
    scrape = collect(rig)

    (info,) = scrape.all("sglang:hicache_host_info")
    assert info.labels["host_dtype"] == host_dtype
    assert scrape.value("sglang:hicache_host_bytes_per_token") == kv_host.size_per_token
    # One request's state slot in the host Mamba pool.
    assert scrape.value("sglang:hicache_host_mamba_used_states") == 1
    assert (
        scrape.value("sglang:hicache_host_mamba_total_states")
        == mamba_host.logical_size
    )
    assert scrape.value("sglang:hicache_backup_tokens_total", pool="kv") == tokens
    assert scrape.value("sglang:load_back_tokens_total", pool="kv") == tokens
    assert scrape.value("sglang:load_back_tokens_total", pool="mamba") == 1
    stored = tokens * kv_host.size_per_token + mamba_host.size_per_token
    logical = tokens * kv_host.device_size_per_token() + mamba_host.size_per_token
    assert_bytes(scrape, stored, logical)
