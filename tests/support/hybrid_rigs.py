"""Hybrid and speculative host-tier rigs on CPU: server arguments from tiny configs,
published as the scheduler does, SGLang's radix cache over real SWA / linear-attention
device pools, and what a restore must give."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from tests.support.conformance import bits, reference, side_buffers
from scripts.rigs.hicache_harness import build_radix_cache, make_allocator
from tests.support.server_args import GPT_OSS, QWEN3_5, QWEN3_NEXT

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.host_format import (
    host_dtype_choices,
    host_pool_cls,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.sink_page import sink_format

ENCODED = tuple(name for name in host_dtype_choices() if name != "auto")
HOST_DTYPES = ("auto", *ENCODED)
DTYPE = torch.bfloat16


# The stock MHA pool's `kernel` io backend ops (sgl_kernel.kvcacheio).
KERNEL_IO_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_all_layer_lf_pf",
)


# The radix caches built by the current test, released after it
# (conftest.hybrid_runtime_context).
_CACHES: list = []


def publish_server_args(
    model_path, host_dtype, layout, page_size, io_backend, metrics=False, l3=None
):
    """Resolve and publish the server's arguments as the scheduler does; with `l3` (the
    storage backend's arguments) the host tier has an L3."""
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


def build_cache(server_args, params, *, swa: bool, ssm: bool):
    """The radix cache with HiCache, as the scheduler builds it (registry)."""
    cache = build_radix_cache(server_args, params, swa=swa, ssm=ssm)
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
        """Complete queued transfers (CPU events finish at once) and log their acks
        through the radix cache's own metric loggers."""
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
    """The model's text config as SGLang loads it (Qwen3.5's is under its VL wrapper)."""
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
    allocator = make_allocator(kv)
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


def fill_kv(pool, indices, gen):
    """Random KV (a wide range over tokens) into every layer of a device MHA or MLA pool;
    returns the rows per layer, a tuple over sides."""
    written = []
    for layer in range(pool.layer_num):
        rows = []
        for side in side_buffers(pool):
            x = torch.randn((len(indices), *side[layer].shape[1:]), generator=gen)
            x *= torch.logspace(-2, 2, len(indices)).view(-1, 1, 1)
            side[layer][indices] = x.to(side[layer].dtype)
            rows.append(side[layer][indices].clone())
        written.append(tuple(rows))
    return written


def wipe_kv(pool, indices):
    for side in side_buffers(pool):
        for buf in side:
            buf[indices] = float("nan")


def assert_restored(host_pool, pool, indices, written, what, sink_tokens=0):
    """The device rows at `indices` are the host pool's reference restore of `written`,
    the first `sink_tokens` keys (a sink page) its side store's int8 reference."""
    for layer, rows in enumerate(written):
        _, want = reference(host_pool, list(rows))
        if sink_tokens:
            keys = rows[0][:sink_tokens]
            fmt = sink_format(host_pool.host_format, sink_tokens)
            (k8,) = fmt.decode_reference(
                fmt.encode_reference([keys.unsqueeze(0)]), keys.dtype
            )
            want[0][:sink_tokens] = k8[0]
        for side, w in zip(side_buffers(pool), want, strict=True):
            assert torch.equal(bits(side[layer][indices]), bits(w)), (what, layer)


def assert_kv_restored(rig, name, pool, indices, written):
    host_pool = rig.host_pool(name)
    # The radix cache marks a sequence's first KV page as its sink page: with the
    # side store on (int4c on a model that is not QK-normed, by default), the
    # rows written from token 0 restore that page's keys at 8 bits.
    sink = 0
    if name == PoolName.KV and getattr(host_pool, "sink_pages", None) is not None:
        sink = host_pool.page_size if host_pool.sink_page_counts()["stored"] else 0
    assert_restored(host_pool, pool, indices, written, name, sink)


def mamba_state(pool, slots):
    return [
        t[:, slots].clone() for t in (pool.mamba_cache.temporal, *pool.mamba_cache.conv)
    ]


def fill_mamba(pool, slots, gen):
    for t in (pool.mamba_cache.temporal, *pool.mamba_cache.conv):
        t[:, slots] = torch.randn(t[:, slots].shape, generator=gen).to(t.dtype)
    return mamba_state(pool, slots)


def wipe_mamba(pool, slots):
    for t in (pool.mamba_cache.temporal, *pool.mamba_cache.conv):
        t[:, slots] = float("nan")


# -- round trips ---------------------------------------------------------------


def expected_host_cls(host_dtype):
    return MHATokenToKVPoolHost if host_dtype == "auto" else host_pool_cls(host_dtype)


def alloc_swa_tokens(allocator, tokens: int) -> torch.Tensor:
    """Full-attention slots (with their SWA mapping) for a new request's extend."""
    if allocator.page_size == 1:
        return allocator.alloc(tokens)
    zero, length = torch.tensor([0]), torch.tensor([tokens])
    return allocator.alloc_extend(
        zero, zero, length, length, torch.tensor([-1]), tokens
    )


def side_pool_round_trip(rig: Rig, full, name: PoolName, side, wipe_side, follow=()):
    """Write `full` KV slots and the side pool's `side` slots (extra pool `name`, and
    the pools named in `follow`, indexed like it) through the controller, wipe them
    (`wipe_side` wipes the side pool and its followers) and load them back."""
    ctl = rig.controller
    backup = PoolTransfer(name=name, device_indices=side)
    followers = [PoolTransfer(name=n, indices_from_pool=name) for n in follow]
    host = ctl.write(full, extra_pools=[backup, *followers])
    assert host is not None and backup.host_indices is not None
    rig.finish()
    wipe_kv(rig.kv_pool, full)
    wipe_side(rig.side_pool, side)
    rig.allocator.free(full)

    restore = PoolTransfer(name=name, host_indices=backup.host_indices)
    followers = [PoolTransfer(name=n, indices_from_pool=name) for n in follow]
    loaded = ctl.load(host, extra_pools=[restore, *followers])
    assert loaded is not None and restore.device_indices is not None
    ctl.start_loading()
    rig.finish()
    return loaded, restore.device_indices


def swa_round_trip(rig: Rig, tokens: int, seed: int = 0, draft=None):
    """Full and SWA KV (and a `draft` SWA device pool's, DRAFT_SWA) through the
    controller and back, checked; returns `tokens`."""
    gen = torch.Generator().manual_seed(seed)
    full = alloc_swa_tokens(rig.allocator, tokens)
    swa = rig.allocator.translate_loc_from_full_to_swa(full).to(torch.int64)
    full_written = fill_kv(rig.kv_pool, full, gen)
    sides = [rig.side_pool, *([draft] if draft is not None else [])]
    swa_written, *draft_written = [fill_kv(pool, swa, gen) for pool in sides]

    def wipe_sides(_, indices):
        for pool in sides:
            wipe_kv(pool, indices)

    follow = [PoolName.DRAFT_SWA] if draft is not None else []
    loaded, swa_loaded = side_pool_round_trip(
        rig, full, PoolName.SWA, swa, wipe_sides, follow
    )
    assert_kv_restored(rig, PoolName.KV, rig.kv_pool, loaded, full_written)
    assert_kv_restored(rig, PoolName.SWA, rig.side_pool, swa_loaded, swa_written)
    for written in draft_written:
        draft_host = rig.host_pool(PoolName.DRAFT_SWA)
        assert_restored(draft_host, draft, swa_loaded, written, PoolName.DRAFT_SWA)
    return tokens


def mamba_round_trip(rig: Rig, tokens: int, seed: int = 0):
    """Full-attention KV and one request's Mamba state through the controller and
    back; returns the state as written and as restored."""
    gen = torch.Generator().manual_seed(seed)
    mamba_allocator = rig.cache.cache_controller.mem_pool_host.entry_map[
        PoolName.MAMBA
    ].device_alloc_fn
    full = rig.allocator.alloc(tokens)
    slot = mamba_allocator(1)
    written = fill_kv(rig.kv_pool, full, gen)
    state = fill_mamba(rig.side_pool, slot, gen)
    loaded, slot_loaded = side_pool_round_trip(
        rig, full, PoolName.MAMBA, slot, wipe_mamba
    )
    assert_kv_restored(rig, PoolName.KV, rig.kv_pool, loaded, written)
    restored = mamba_state(rig.side_pool, slot_loaded)
    return state, restored
