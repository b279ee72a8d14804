"""Hybrid models' host tiers through SGLang's own hybrid pool assembler,
HybridCacheController and UnifiedRadixCache, on CPU, for every
--hicache-host-dtype.

Server arguments resolve from tiny local configs (test_hybrid_server_args) and
are published as the scheduler publishes them; the real device pools
(SWAKVPool, HybridLinearKVPool + the Mamba state pool) go through
registry.create_unified_radix_cache, which picks the hybrid stack strategy and
builds the host pools and the controller. KV (and state) is written, the
device copy wiped, and what comes back into fresh slots checked bit for bit:
through the controller directly, through the radix cache's own host hit
(insert, L1 eviction, match, init_load_back), and through an L3 hit (L2
eviction too, prefetch from SGLang's file backend or a real mooncake_master).

- gpt-oss shaped (sliding-window + full attention): the full-attention and the
  SWA host pools are both the format's encoded pool; both restore exactly the
  format's reference decode (the SWA KV for the window the model attends to).
- Qwen3-Next and Qwen3.5 shaped (GDN linear attention + full attention): the
  KV host pool is encoded, the Mamba state host pool stays SGLang's
  MambaPoolHost and its state comes back exactly as with
  --hicache-host-dtype auto.

Metrics: the real radix-cache ack loggers and scheduler reporter feed the real
collectors; byte counters, per-pool token counts and host-tier gauges are
checked against the pools.
"""

from __future__ import annotations

import json
import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY
from tests.support.l3_harness import MooncakeMaster, require_mooncake
from tests.support.metrics import Scrape
from tests.support.server_args import GPT_OSS, QWEN3_5, QWEN3_NEXT

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.host_format import (
    host_dtype_choices,
    host_format_cls,
    host_pool_cls,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from tests.support import standins

ENCODED = tuple(name for name in host_dtype_choices() if name != "auto")
HOST_DTYPES = ("auto", *ENCODED)
# (layout, page size, io backend): the server default, and the direct copy.
SWA_LAYOUTS = [("page_first", 16, "kernel"), ("layer_first", 1, "direct")]
# The Mamba state pool takes page-first layouts only (layer_first is refused
# at start-up, test_hybrid_server_args).
MAMBA_LAYOUTS = [("page_first", 16, "kernel"), ("page_first_direct", 1, "direct")]
DTYPE = torch.bfloat16
BACKENDS = ("file", "mooncake")


# The stock MHA pool's `kernel` io backend ops (sgl_kernel.kvcacheio).
KERNEL_IO_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_all_layer_lf_pf",
)


@pytest.fixture(scope="module", autouse=True)
def _host_copies_on_cpu():
    """CPU stand-ins for the CUDA copies of the stock MHA pool (`kernel`) and
    of the Mamba state host pool, for this module only."""
    from sglang.srt.mem_cache.pool_host import mamba, mha

    with pytest.MonkeyPatch.context() as patch:
        for name in KERNEL_IO_OPS:
            patch.setattr(mha, name, getattr(standins, name), raising=False)
        for name, standin in standins.mamba_standins().items():
            patch.setattr(mamba, name, standin, raising=False)
        yield


# The radix caches built by the current test, released after it.
_CACHES: list = []


@pytest.fixture(autouse=True)
def _runtime_context(monkeypatch):
    from sglang.srt.runtime_context import reset_context

    monkeypatch.setattr(
        "sglang.srt.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer",
        lambda: True,
    )
    registered_before = set(REGISTRY._collector_to_names)
    yield
    while _CACHES:
        cache = _CACHES.pop()
        # Stop the storage threads an L3-backed controller started.
        if cache.cache_controller.enable_storage:
            cache.cache_controller.detach_storage_backend()
        cache.release_host_resources()
    # The caches' and scheduler's collectors register process-wide.
    for collector in set(REGISTRY._collector_to_names) - registered_before:
        REGISTRY.unregister(collector)
    reset_context()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_models")
    paths = {}
    for name, config in (
        ("gpt_oss", GPT_OSS),
        ("qwen3_next", QWEN3_NEXT),
        ("qwen3_5", QWEN3_5),
    ):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(root / name)
    return paths


def publish_server_args(
    model_path, host_dtype, layout, page_size, io_backend, metrics=False, l3=None
):
    """Resolve the server's arguments for the model and publish them for this
    process, as the scheduler does (what get_memory() reads); with `l3` (the
    storage backend's arguments, l3_args) the host tier has an L3."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    storage = {}
    if l3 is not None:
        storage = dict(l3)
        # Prefetch whatever hits, and wait for it (no timeout on CPU).
        extra = dict(storage.pop("extra_config", {}), prefetch_threshold=page_size)
        storage.update(
            hicache_storage_backend_extra_config=json.dumps(extra),
            hicache_storage_prefetch_policy="wait_complete",
        )
    server_args = ServerArgs(
        **storage,
        model_path=model_path,
        device="cpu",
        skip_tokenizer_init=True,
        page_size=page_size,
        enable_hierarchical_cache=True,
        enable_metrics=metrics,
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_io_backend=io_backend,
        hicache_mem_layout=layout,
        hicache_write_policy="write_through",
        hicache_host_dtype=host_dtype,
    )
    server_args.resolve_once()
    assert (server_args.hicache_mem_layout, server_args.page_size) == (
        layout,
        page_size,
    )
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return server_args


class _TpWorker:
    def register_hicache_layer_transfer_counter(self, counter) -> None:
        pass


def build_cache(server_args, params, *, swa: bool, ssm: bool):
    """The radix cache with HiCache, as the scheduler builds it (registry)."""
    from sglang.srt.mem_cache.registry import (
        TreeCacheBuildContext,
        create_unified_radix_cache,
    )

    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=swa,
        is_hybrid_ssm=ssm,
        enable_hierarchical_cache=True,
        disable_radix_cache=False,
        tp_worker=_TpWorker(),
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_unified_radix_cache(ctx)
    for entry in cache.cache_controller.mem_pool_host.entries:
        # Later page buffers (L3 prefetch) ask torch for pinned memory, which
        # needs CUDA; the server's CPU stand-in (cpu_site) does the same.
        entry.host_pool.pin_memory = False
    _CACHES.append(cache)
    return cache


@dataclass
class Rig:
    host_dtype: str
    cache: object
    allocator: object
    kv_pool: object  # the full-attention device pool
    side_pool: object  # the SWA device pool or the Mamba state pool
    side: PoolName

    @property
    def controller(self):
        return self.cache.cache_controller

    def host_pool(self, name: PoolName):
        return self.controller.mem_pool_host.entry_map[name].host_pool

    def finish(self) -> None:
        """Complete queued transfers (CPU events finish at once) and log their
        acks through the radix cache's own metric loggers."""
        ctl = self.controller
        for ack in ctl.ack_write_queue:
            ack.finish_event.synchronize()
            self.cache._log_write_ack_metrics(ack)
        for ack in ctl.ack_load_queue:
            ack.finish_event.synchronize()
            self.cache._log_load_ack_metrics(ack)
        ctl.ack_write_queue.clear()
        ctl.ack_load_queue.clear()


def swa_rig(
    model_dirs, host_dtype, layout, page_size, io_backend, metrics=False, l3=None
) -> Rig:
    """gpt-oss shaped: layers 0, 2 sliding-window, 1, 3 full attention."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    server_args = publish_server_args(
        model_dirs["gpt_oss"], host_dtype, layout, page_size, io_backend, metrics, l3
    )
    kv = SWAKVPool(
        size=256,
        size_swa=128,
        page_size=page_size,
        dtype=DTYPE,
        head_num=GPT_OSS["num_key_value_heads"],
        head_dim=GPT_OSS["head_dim"],
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        device="cpu",
        enable_alt_stream=False,
    )
    allocator = SWATokenToKVPoolAllocator(
        256, 128, page_size, DTYPE, "cpu", kv, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=512, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        sliding_window_size=GPT_OSS["sliding_window"],
        enable_metrics=metrics,
    )
    cache = build_cache(server_args, params, swa=True, ssm=False)
    return Rig(
        host_dtype, cache, allocator, kv.full_kv_pool, kv.swa_kv_pool, PoolName.SWA
    )


def linear_attention_text_config(model: str):
    """The model's text config as SGLang loads it (Qwen3.5's sits under its
    vision-language wrapper)."""
    from sglang.srt.configs import Qwen3NextConfig
    from sglang.srt.configs.qwen3_5 import Qwen3_5MoeTextConfig

    cls, fields = {
        "qwen3_next": (Qwen3NextConfig, QWEN3_NEXT),
        "qwen3_5": (Qwen3_5MoeTextConfig, QWEN3_5["text_config"]),
    }[model]
    return cls(**{k: v for k, v in fields.items() if k != "architectures"})


def mamba_rig(
    model_dirs,
    host_dtype,
    layout,
    page_size,
    io_backend,
    metrics=False,
    model="qwen3_next",
    l3=None,
) -> Rig:
    """Qwen3-Next / Qwen3.5 shaped: GDN layers 0-2, full attention at layer 3."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
    )

    server_args = publish_server_args(
        model_dirs[model], host_dtype, layout, page_size, io_backend, metrics, l3
    )
    config = linear_attention_text_config(model)
    assert config.full_attention_layer_ids == [3]
    cache_params = config.mamba2_cache_params
    req_to_token = HybridReqToTokenPool(
        size=4,
        mamba_size=8,
        mamba_spec_state_size=4,
        max_context_len=512,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=cache_params.layers,
        # What the server resolves for linear-attention models with HiCache.
        enable_mamba_extra_buffer=True,
        speculative_num_draft_tokens=None,
    )
    kv = HybridLinearKVPool(
        size=256,
        dtype=DTYPE,
        page_size=page_size,
        head_num=config.num_key_value_heads,
        head_dim=config.head_dim,
        full_attention_layer_ids=config.full_attention_layer_ids,
        device="cpu",
        mamba_pool=req_to_token.mamba_pool,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(256, DTYPE, "cpu", kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(
            256, page_size, DTYPE, "cpu", kv, need_sort=False
        )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_mamba_extra_buffer=True,
        enable_metrics=metrics,
    )
    cache = build_cache(server_args, params, swa=False, ssm=True)
    return Rig(
        host_dtype,
        cache,
        allocator,
        kv.full_kv_pool,
        req_to_token.mamba_pool,
        PoolName.MAMBA,
    )


# -- what a restore must give ---------------------------------------------------


def kv_restore(host_dtype, host_pool, k, v):
    """Rows k, v ([tokens, heads, dim], in host-slot order) after a round trip
    through the host: themselves for the stock pool, else the format's
    reference encode + decode over the pool's units of tokens."""
    if host_dtype == "auto":
        return k, v
    ut = host_pool.host_format.unit_tokens
    fmt = host_format_cls(host_dtype, "mha")(
        (k.shape[-1], v.shape[-1]), k.shape[1], ut, k.dtype
    )
    records = fmt.encode_reference([x.view(-1, ut, *x.shape[1:]) for x in (k, v)])
    k_ref, v_ref = fmt.decode_reference(records, k.dtype)
    return k_ref.reshape(k.shape), v_ref.reshape(v.shape)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.uint8)


def fill_kv(pool, indices, gen):
    """Random K/V (a wide dynamic range per token) into every layer of a
    device MHA pool; returns the rows per layer."""
    written = []
    for layer in range(pool.layer_num):
        rows = []
        for buffer in (pool.k_buffer[layer], pool.v_buffer[layer]):
            x = torch.randn((len(indices), *buffer.shape[1:]), generator=gen)
            x *= torch.logspace(-2, 2, len(indices)).view(-1, 1, 1)
            buffer[indices] = x.to(buffer.dtype)
            rows.append(buffer[indices].clone())
        written.append(tuple(rows))
    return written


def wipe_kv(pool, indices):
    for layer in range(pool.layer_num):
        pool.k_buffer[layer][indices] = float("nan")
        pool.v_buffer[layer][indices] = float("nan")


def assert_kv_restored(rig, name, pool, indices, written):
    host_pool = rig.host_pool(name)
    for layer, (k, v) in enumerate(written):
        k_ref, v_ref = kv_restore(rig.host_dtype, host_pool, k, v)
        got_k, got_v = pool.k_buffer[layer][indices], pool.v_buffer[layer][indices]
        assert torch.equal(bits(got_k), bits(k_ref)), (name, layer)
        assert torch.equal(bits(got_v), bits(v_ref)), (name, layer)


def mamba_state(pool, slots):
    cache = pool.mamba_cache
    return [t[:, slots].clone() for t in (cache.temporal, *cache.conv)]


def fill_mamba(pool, slots, gen):
    cache = pool.mamba_cache
    for t in (cache.temporal, *cache.conv):
        t[:, slots] = torch.randn(t[:, slots].shape, generator=gen).to(t.dtype)
    return mamba_state(pool, slots)


def wipe_mamba(pool, slots):
    cache = pool.mamba_cache
    for t in (cache.temporal, *cache.conv):
        t[:, slots] = float("nan")


# -- round trips ---------------------------------------------------------------


def expected_host_cls(host_dtype):
    return MHATokenToKVPoolHost if host_dtype == "auto" else host_pool_cls(host_dtype)


def alloc_swa_tokens(allocator, tokens: int) -> torch.Tensor:
    """Full-attention slots (with their SWA mapping) for one new request of
    `tokens` tokens, as the scheduler allocates an extend."""
    if allocator.page_size == 1:
        return allocator.alloc(tokens)
    zero, length = torch.tensor([0]), torch.tensor([tokens])
    return allocator.alloc_extend(
        zero, zero, length, length, torch.tensor([-1]), tokens
    )


def swa_round_trip(rig: Rig, tokens: int, seed: int = 0):
    """Write `tokens` tokens of full and SWA KV through the controller, wipe the
    device, load both back into fresh slots; returns the loaded tokens."""
    ctl, gen = rig.controller, torch.Generator().manual_seed(seed)
    full = alloc_swa_tokens(rig.allocator, tokens)
    swa = rig.allocator.translate_loc_from_full_to_swa(full)
    full_written = fill_kv(rig.kv_pool, full, gen)
    swa_written = fill_kv(rig.side_pool, swa, gen)

    backup = PoolTransfer(name=PoolName.SWA, device_indices=swa.to(torch.int64))
    host = ctl.write(full, extra_pools=[backup])
    assert host is not None and backup.host_indices is not None
    rig.finish()
    wipe_kv(rig.kv_pool, full)
    wipe_kv(rig.side_pool, swa)
    rig.allocator.free(full)

    restore = PoolTransfer(name=PoolName.SWA, host_indices=backup.host_indices)
    loaded = ctl.load(host, extra_pools=[restore])
    assert loaded is not None and restore.device_indices is not None
    ctl.start_loading()
    rig.finish()
    assert_kv_restored(rig, PoolName.KV, rig.kv_pool, loaded, full_written)
    assert_kv_restored(
        rig, PoolName.SWA, rig.side_pool, restore.device_indices, swa_written
    )
    return tokens


def mamba_round_trip(rig: Rig, tokens: int, seed: int = 0):
    """Write `tokens` tokens of full-attention KV and one request's Mamba
    state through the controller, wipe the device, load both back; returns
    the state as restored."""
    ctl, gen = rig.controller, torch.Generator().manual_seed(seed)
    mamba_allocator = rig.cache.cache_controller.mem_pool_host.entry_map[
        PoolName.MAMBA
    ].device_alloc_fn
    full = rig.allocator.alloc(tokens)
    slot = mamba_allocator(1)
    written = fill_kv(rig.kv_pool, full, gen)
    state = fill_mamba(rig.side_pool, slot, gen)

    backup = PoolTransfer(name=PoolName.MAMBA, device_indices=slot)
    host = ctl.write(full, extra_pools=[backup])
    assert host is not None and backup.host_indices is not None
    rig.finish()
    wipe_kv(rig.kv_pool, full)
    wipe_mamba(rig.side_pool, slot)
    rig.allocator.free(full)

    restore = PoolTransfer(name=PoolName.MAMBA, host_indices=backup.host_indices)
    loaded = ctl.load(host, extra_pools=[restore])
    assert loaded is not None and restore.device_indices is not None
    ctl.start_loading()
    rig.finish()
    assert_kv_restored(rig, PoolName.KV, rig.kv_pool, loaded, written)
    restored = mamba_state(rig.side_pool, restore.device_indices)
    return state, restored


@pytest.mark.parametrize("layout,page_size,io_backend", SWA_LAYOUTS)
@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_sliding_window_round_trip(
    model_dirs, host_dtype, layout, page_size, io_backend
):
    rig = swa_rig(model_dirs, host_dtype, layout, page_size, io_backend)
    # Both attention kinds get the format's encoded pool.
    for name in (PoolName.KV, PoolName.SWA):
        assert type(rig.host_pool(name)) is expected_host_cls(host_dtype), name
        assert rig.host_pool(name).layout == layout
    assert rig.controller.io_backend == io_backend
    swa_round_trip(rig, tokens=2 * page_size if page_size > 1 else 24)


@pytest.mark.parametrize("layout,page_size,io_backend", MAMBA_LAYOUTS)
@pytest.mark.parametrize("host_dtype", ENCODED)
@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5"])
def test_linear_attention_round_trip(
    model_dirs, model, host_dtype, layout, page_size, io_backend
):
    tokens = 2 * page_size if page_size > 1 else 24
    stock = mamba_rig(model_dirs, "auto", layout, page_size, io_backend, model=model)
    stock_state, stock_restored = mamba_round_trip(stock, tokens)

    rig = mamba_rig(model_dirs, host_dtype, layout, page_size, io_backend, model=model)
    assert type(rig.host_pool(PoolName.KV)) is host_pool_cls(host_dtype)
    # The state pool stays upstream's, whatever the KV format.
    assert type(rig.host_pool(PoolName.MAMBA)) is MambaPoolHost
    assert type(stock.host_pool(PoolName.MAMBA)) is MambaPoolHost
    assert (
        rig.host_pool(PoolName.MAMBA).layout == stock.host_pool(PoolName.MAMBA).layout
    )
    state, restored = mamba_round_trip(rig, tokens)
    for want, got, stock_want, stock_got in zip(
        state, restored, stock_state, stock_restored
    ):
        # The same seed writes the same state in both runs; the encoded run's
        # state comes back as the stock pool returns it: unchanged.
        assert torch.equal(want, stock_want)
        assert torch.equal(stock_got, stock_want)
        assert torch.equal(got, stock_got)


# -- host hits through the radix cache ----------------------------------------


class _Req:
    """The attributes of a scheduler Req that init_load_back reads."""

    def __init__(self, rid: str, last_node):
        self.rid = rid
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.mamba_pool_idx = None
        self.session = None
        self.kv = SimpleNamespace(mamba_pool_idx=None)


def radix_key(ids):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", ids))


STORAGE_WAIT_S = 20.0


def wait_for(condition, what: str) -> None:
    """Poll the cache's events until `condition()` (storage threads run
    asynchronously); bounded, so a fault fails the test."""
    deadline = time.monotonic() + STORAGE_WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not finish in time")
        time.sleep(0.02)


def reload_from_l3(rig: Rig, ids: list[int], query) -> None:
    """After the L1 eviction: wait for the L3 backups, drop the host copies
    too, then prefetch the prefix from L3 into the host tier as the scheduler
    does (prefetch_from_storage, check_prefetch_progress)."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        CacheRequestHandle,
        MatchPrefixParams,
    )
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
    handle = CacheRequestHandle("r0", 0)
    cache.prefetch_from_storage(
        handle,
        match.last_host_node,
        array("q", ids),
        cache.get_last_hash_value(match.last_host_node),
        None,
        matched_prefix_tokens=array("q"),
    )

    def prefetched():
        cache.check_hicache_events()
        return cache.check_prefetch_progress(handle)

    wait_for(prefetched, "the L3 prefetch")
    assert cache.pop_prefetch_loaded_span(handle) == (len(ids), 0)
    assert ComponentType.FULL in cache.components


def swa_host_hit(rig: Rig, tokens: int = 48, seed: int = 1, from_l3: bool = False):
    """The scheduler's order: insert (written through), L1 eviction (with
    `from_l3`, L2 eviction and an L3 prefetch too), a match that hits the
    host, init_load_back, the load; the full-attention KV comes back for every
    token, the SWA KV for the window the model attends to."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )

    cache, window = rig.cache, GPT_OSS["sliding_window"]
    ids = list(range(100, 100 + tokens))
    gen = torch.Generator().manual_seed(seed)
    full = alloc_swa_tokens(rig.allocator, tokens)
    swa = rig.allocator.translate_loc_from_full_to_swa(full)
    full_written = fill_kv(rig.kv_pool, full, gen)
    swa_written = fill_kv(rig.side_pool, swa, gen)
    cache.insert(
        InsertParams(key=radix_key(ids), value=full.to(torch.int64), prev_prefix_len=0)
    )
    cache.flush_pending_backups()
    cache.check_hicache_events()
    evicted = cache.evict(EvictParams(num_tokens=tokens, swa_num_tokens=tokens))
    assert evicted.num_tokens_evicted == tokens
    wipe_kv(rig.kv_pool, full)
    wipe_kv(rig.side_pool, swa)
    query = radix_key([*ids, 7])
    if from_l3:
        reload_from_l3(rig, ids, query)

    match = cache.match_prefix(MatchPrefixParams(key=query))
    assert (match.device_prefix_len, match.host_hit_length) == (0, tokens)
    lock = cache.lock(match.last_device_node)
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.best_match_node,
            host_hit_length=match.host_hit_length,
            req=_Req("r0", match.last_device_node),
        )
    )
    assert loaded == tokens
    cache.unlock(lock)
    lock = cache.lock(last_node)
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()

    device = cache.path_device_indices(last_node)
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
    # The next match is a device hit.
    again = cache.match_prefix(MatchPrefixParams(key=query))
    assert (again.device_prefix_len, again.host_hit_length) == (tokens, 0)
    cache.unlock(lock)
    cache.sanity_check()


@pytest.mark.parametrize("layout,page_size,io_backend", SWA_LAYOUTS)
@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_sliding_window_host_hit(model_dirs, host_dtype, layout, page_size, io_backend):
    swa_host_hit(swa_rig(model_dirs, host_dtype, layout, page_size, io_backend))


# Mooncake takes page-first layouts only (SGLang rewrites layer_first).
L3_SWA_CASES = [("file", *case) for case in SWA_LAYOUTS] + [
    ("mooncake", *case) for case in MAMBA_LAYOUTS
]
L3_MAMBA_CASES = [(backend, *case) for backend in BACKENDS for case in MAMBA_LAYOUTS]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    require_mooncake()
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log")
    yield master.start()
    master.stop()


def l3_args(request, backend: str, path) -> dict:
    """The storage arguments of an L3 `backend`; each test its own model name,
    so tests sharing one Mooncake store keep their keys apart."""
    args = dict(hicache_storage_backend=backend, served_model_name=request.node.name)
    if backend == "file":
        return dict(args, file_storage_path=str(path))
    master = request.getfixturevalue("mooncake_master")
    return dict(args, extra_config=master.storage_config())


@pytest.mark.parametrize("backend,layout,page_size,io_backend", L3_SWA_CASES)
@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_sliding_window_l3_hit(
    model_dirs, request, tmp_path, host_dtype, backend, layout, page_size, io_backend
):
    l3 = l3_args(request, backend, tmp_path)
    rig = swa_rig(model_dirs, host_dtype, layout, page_size, io_backend, l3=l3)
    assert rig.cache.enable_storage
    swa_host_hit(rig, from_l3=True)


def mamba_host_hit(rig: Rig, tokens: int = 48, seed: int = 2, from_l3: bool = False):
    """The scheduler's order for a linear-attention model: insert KV and the
    sequence-end state, L1 eviction of both, a match that hits the host,
    init_load_back into the request's own state slot, the load. Returns the
    state written and the request's state after the load."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )

    cache = rig.cache
    ids = list(range(100, 100 + tokens))
    gen = torch.Generator().manual_seed(seed)
    full = rig.allocator.alloc(tokens)
    slot = cache.req_to_token_pool.mamba_allocator.alloc(1)
    written = fill_kv(rig.kv_pool, full, gen)
    state = fill_mamba(rig.side_pool, slot, gen)
    cache.insert(
        InsertParams(
            key=radix_key(ids),
            value=full.to(torch.int64),
            prev_prefix_len=0,
            mamba_value=slot,
        )
    )
    cache.flush_pending_backups()
    cache.check_hicache_events()
    evicted = cache.evict(EvictParams(num_tokens=tokens, mamba_num=1))
    assert (evicted.num_tokens_evicted, evicted.mamba_num_evicted) == (tokens, 1)
    wipe_kv(rig.kv_pool, full)
    wipe_mamba(rig.side_pool, slot)
    query = radix_key([*ids, 7])
    if from_l3:
        reload_from_l3(rig, ids, query)

    req = _Req("r0", None)
    req.kv = SimpleNamespace(
        mamba_pool_idx=None,
        holds_mamba=False,
        mamba_cow_src_index=None,
        mamba_needs_clear=False,
    )
    match = cache.match_prefix(MatchPrefixParams(key=query, cow_mamba=True, req=req))
    assert (match.device_prefix_len, match.host_hit_length) == (0, tokens)
    assert match.mamba_host_hit_length == 1
    req.last_node = match.last_device_node
    lock = cache.lock(match.last_device_node)
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.best_match_node,
            host_hit_length=match.host_hit_length,
            req=req,
        )
    )
    assert loaded == tokens and req.kv.mamba_pool_idx is not None
    cache.unlock(lock)
    lock = cache.lock(last_node)
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()

    device = cache.path_device_indices(last_node)
    assert_kv_restored(rig, PoolName.KV, rig.kv_pool, device, written)
    restored = mamba_state(rig.side_pool, req.kv.mamba_pool_idx.view(1))
    again = cache.match_prefix(MatchPrefixParams(key=query))
    assert (again.device_prefix_len, again.host_hit_length) == (tokens, 0)
    cache.unlock(lock)
    cache.sanity_check()
    return state, restored


@pytest.mark.parametrize("layout,page_size,io_backend", MAMBA_LAYOUTS)
@pytest.mark.parametrize("host_dtype", ENCODED)
@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5"])
def test_linear_attention_host_hit(
    model_dirs, model, host_dtype, layout, page_size, io_backend
):
    stock_state, stock_restored = mamba_host_hit(
        mamba_rig(model_dirs, "auto", layout, page_size, io_backend, model=model)
    )
    state, restored = mamba_host_hit(
        mamba_rig(model_dirs, host_dtype, layout, page_size, io_backend, model=model)
    )
    for want, got, stock_want, stock_got in zip(
        state, restored, stock_state, stock_restored
    ):
        assert torch.equal(want, stock_want)
        assert torch.equal(stock_got, stock_want)
        assert torch.equal(got, stock_got)


@pytest.mark.parametrize("backend,layout,page_size,io_backend", L3_MAMBA_CASES)
@pytest.mark.parametrize("host_dtype", ENCODED)
def test_linear_attention_l3_hit(
    model_dirs, request, tmp_path, host_dtype, backend, layout, page_size, io_backend
):
    def rig(dtype):
        l3 = l3_args(request, backend, tmp_path / dtype)
        # Distinct keys for the stock and the encoded run.
        l3["served_model_name"] += f"-{dtype}"
        return mamba_rig(model_dirs, dtype, layout, page_size, io_backend, l3=l3)

    stock_state, stock_restored = mamba_host_hit(rig("auto"), from_l3=True)
    state, restored = mamba_host_hit(rig(host_dtype), from_l3=True)
    for want, got, stock_want, stock_got in zip(
        state, restored, stock_state, stock_restored
    ):
        assert torch.equal(want, stock_want)
        assert torch.equal(stock_got, stock_want)
        assert torch.equal(got, stock_got)


# -- metrics -------------------------------------------------------------------


def scheduler_collector(server_args):
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

    return SchedulerMetricsCollector.init_new(
        server_args=server_args,
        enable_priority_scheduling=False,
        enable_lora=False,
        enable_hierarchical_cache=True,
    ).collector


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


def test_sliding_window_metrics(model_dirs):
    host_dtype, page_size = "int8", 16
    rig = swa_rig(model_dirs, host_dtype, "page_first", page_size, "kernel", True)
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
    assert scrape.value("sglang:hicache_backup_bytes_total") == stored
    assert scrape.value("sglang:load_back_bytes_total") == stored
    assert scrape.value("sglang:hicache_backup_logical_bytes_total") == logical
    assert scrape.value("sglang:load_back_logical_bytes_total") == logical


def test_linear_attention_metrics(model_dirs):
    host_dtype = "int4"
    rig = mamba_rig(model_dirs, host_dtype, "page_first", 16, "kernel", True)
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
    assert scrape.value("sglang:hicache_backup_bytes_total") == stored
    assert scrape.value("sglang:load_back_bytes_total") == stored
    assert scrape.value("sglang:hicache_backup_logical_bytes_total") == logical
    assert scrape.value("sglang:load_back_logical_bytes_total") == logical
