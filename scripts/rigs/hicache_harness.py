"""Build real SGLang HiCache pieces on CPU: device pool, host pool, controller.

The harness later tests (host formats, quality, replay) build on. Everything
here is SGLang's own code; only the stand-ins in scripts/rigs/standins.py replace what
needs CUDA.
"""

from __future__ import annotations

import itertools
import random
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import get_mla_host_pool_cls


@dataclass
class Geometry:
    layer_num: int = 3
    head_num: int = 2
    head_dim: int = 16
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 1


@dataclass
class MLAGeometry:
    """An MLA model's latent cache; the defaults are DeepSeek V2/V3's widths
    with few layers, for speed."""

    layer_num: int = 3
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 1


# The host layouts and head geometries the pools are exercised over (the
# conformance suite and the compile check share them).
LAYOUTS = ("page_first", "page_first_direct", "layer_first")
# (head_num, head_dim, v_head_dim): TP-sliced head counts, the common dims, K != V.
GEOMETRIES = [
    (1, 64, 64),
    (3, 64, 64),
    (8, 128, 128),
    (2, 96, 96),
    (4, 256, 256),
    (64, 128, 128),
    (4, 192, 128),
]
# The INT8 kernels' pool grid (tests/test_kv_int8_triton.py, and
# scripts/kernel_compile.py): every geometry at page size 16, a subset at 1 and 64.
KERNEL_POOL_CASES = [
    (layout, page_size, geometry)
    for layout, page_size in itertools.product(LAYOUTS, (1, 16, 64))
    for geometry in (
        GEOMETRIES if page_size == 16 else GEOMETRIES[:3] + GEOMETRIES[-1:]
    )
]


@dataclass
class HiCacheRig:
    device_pool: MHATokenToKVPool
    allocator: object
    host_pool: object
    controller: HiCacheController


def _rig_memory_budget():
    """The rigs' pools take a few MB: book them against a fixed budget, not
    the machine's free RAM less the production 10 GiB reserve, so a busy
    machine cannot refuse them."""
    return host_memory_budget_scope(1 << 40)


def make_device_pool(
    geo: Geometry | MLAGeometry, device_tokens: int, device: str = "cpu"
):
    if isinstance(geo, MLAGeometry):
        cls = MLATokenToKVPool
        kind_args = dict(
            kv_lora_rank=geo.kv_lora_rank, qk_rope_head_dim=geo.qk_rope_head_dim
        )
    else:
        cls = MHATokenToKVPool
        kind_args = dict(
            head_num=geo.head_num,
            head_dim=geo.head_dim,
            v_head_dim=geo.v_head_dim,
            enable_alt_stream=False,
        )
    return cls(
        size=device_tokens,
        page_size=geo.page_size,
        dtype=geo.dtype,
        layer_num=geo.layer_num,
        device=device,
        enable_memory_saver=False,
        **kind_args,
    )


def make_host_pool(
    device_pool: MHATokenToKVPool | MLATokenToKVPool,
    *,
    host_tokens: int | None = None,
    host_size_gb: float = 0,
    host_ratio: float = 2.0,
    layout: str = "layer_first",
    host_pool_cls=None,
    host_dtype: str = "auto",
    pin_memory: bool = False,
    **extra,
):
    """The host pool over `device_pool` (MHA or MLA) as hybrid_pool_assembler's
    build_kv_host_pool builds it."""
    info = device_pool.get_device_pool_infos()[0].buffer_info
    if isinstance(device_pool, MLATokenToKVPool):
        cls = host_pool_cls or get_mla_host_pool_cls(host_dtype)
        kind_args = dict(
            override_kv_cache_dim=device_pool.kv_cache_dim,
            target_layer_num=device_pool.layer_num,
        )
    else:
        cls = host_pool_cls or get_mha_host_pool_cls(info, host_dtype)
        kind_args = {}
        if host_dtype != "auto" and extra.get("sink_page_tokens") is None:
            # The variable as set: the rig has no model config, so the
            # automatic sink page (sink_page.host_plan) is the assembler's.
            from sglang.srt.mem_cache.pool_host.sink_page import (
                requested_sink_page_tokens,
            )

            extra["sink_page_tokens"] = requested_sink_page_tokens()
    with _rig_memory_budget():
        return cls(
            info,
            host_ratio,
            host_size_gb,
            device_pool.page_size,
            layout,
            pin_memory=pin_memory,
            device="cpu",
            device_capacity_tokens=device_pool.size,
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            host_token_capacity=host_tokens,
            **kind_args,
            **extra,
        )


def make_allocator(device_pool):
    """The device pool's token allocator (paged above page size 1)."""
    size, page, dtype = device_pool.size, device_pool.page_size, device_pool.dtype
    if page == 1:
        return TokenToKVPoolAllocator(size, dtype, "cpu", device_pool, need_sort=False)
    return PagedTokenToKVPoolAllocator(
        size, page, dtype, "cpu", device_pool, need_sort=False
    )


def make_rig(
    geo: Geometry | MLAGeometry,
    *,
    device_tokens: int = 256,
    host_tokens: int = 512,
    layout: str = "layer_first",
    io_backend: str = "direct",
    host_pool_cls=None,
    **host_extra,
) -> HiCacheRig:
    device_pool = make_device_pool(geo, device_tokens)
    allocator = make_allocator(device_pool)
    host_pool = make_host_pool(
        device_pool,
        host_tokens=host_tokens,
        layout=layout,
        host_pool_cls=host_pool_cls,
        **host_extra,
    )
    controller = HiCacheController(
        allocator,
        host_pool,
        geo.page_size,
        tp_group=None,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend=io_backend,
    )
    return HiCacheRig(device_pool, allocator, host_pool, controller)


def publish_server_args(
    host_dtype: str,
    *,
    page_size: int = 1,
    layout: str = "page_first",
    io_backend: str = "direct",
    **fields,
):
    """ServerArgs for HiCache on CPU (`fields`: more of its fields), published
    for this process as the scheduler publishes them (what get_memory() /
    get_serving() read)."""
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_io_backend=io_backend,
        hicache_mem_layout=layout,
        hicache_host_dtype=host_dtype,
        **fields,
    )
    # The model's HF config, as a server has it (what process_model_config()
    # returns; "dummy" has none): Llama-style, so no per-layer key plan.
    server_args._model_config = _dummy_model_config()
    reset_context()
    publish(server_args, role="scheduler")
    return server_args


def _dummy_model_config():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    return SimpleNamespace(hf_config=LlamaConfig(num_hidden_layers=1))


class _TpWorker:
    def register_hicache_layer_transfer_counter(self, counter) -> None:
        pass  # the registry hands it the layer-done counter; nothing on CPU reads it


# The rest of what a single-rank scheduler with HiCache gives the registry.
_SCHEDULER_CONTEXT = {
    "enable_hierarchical_cache": True,
    "disable_radix_cache": False,
    "tp_worker": _TpWorker(),
    "model_config": None,
    "tp_size": 1,
    "tp_rank": 0,
    "tp_group": None,
}


def build_radix_cache(server_args, params, *, swa: bool = False, ssm: bool = False):
    """The radix cache with HiCache, as the scheduler builds it
    (registry.create_unified_radix_cache)."""
    from sglang.srt.mem_cache.registry import (
        TreeCacheBuildContext,
        create_unified_radix_cache,
    )

    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=swa,
        is_hybrid_ssm=ssm,
        **_SCHEDULER_CONTEXT,
    )
    return create_unified_radix_cache(ctx)


def mha_radix_cache(server_args, device_pool, *, requests: int, max_context_len: int):
    """UnifiedRadixCache + HiCache over an MHA device pool, with the allocator
    and request table the scheduler gives it: (cache, allocator, req_to_token)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator = make_allocator(device_pool)
    req_to_token = ReqToTokenPool(
        size=requests,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=allocator,
        page_size=device_pool.page_size,
    )
    cache = build_radix_cache(server_args, params)
    return cache, allocator, req_to_token


class LoadBackReq:
    """The attributes of a scheduler Req that init_load_back reads."""

    def __init__(self, rid: str, last_node):
        self.rid = rid
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.mamba_pool_idx = None
        self.session = None
        self.kv = SimpleNamespace(mamba_pool_idx=None)


def paged_pools(
    geo: Geometry | MLAGeometry,
    layout: str,
    device_pages: int,
    host_pages: int,
    **host_pool,
):
    """(device pool, host pool) of whole pages, without a controller."""
    device_pool = make_device_pool(geo, device_pages * geo.page_size)
    pool = make_host_pool(
        device_pool, host_tokens=host_pages * geo.page_size, layout=layout, **host_pool
    )
    return device_pool, pool


def paged_rig(
    geo: Geometry | MLAGeometry,
    layout: str,
    io_backend: str,
    device_pages: int,
    host_pages: int,
    **host_pool,
) -> HiCacheRig:
    """make_rig with pools of whole pages, the controller's unit."""
    return make_rig(
        geo,
        device_tokens=device_pages * geo.page_size,
        host_tokens=host_pages * geo.page_size,
        layout=layout,
        io_backend=io_backend,
        **host_pool,
    )


def fill_random(device_pool, indices: torch.Tensor, seed: int = 0):
    """Write random K/V (MLA: latent rows) into `indices` of every layer;
    return the written rows."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    if isinstance(device_pool, MLATokenToKVPool):
        for layer in range(device_pool.layer_num):
            kv = device_pool.kv_buffer[layer]
            rows = torch.randn((len(indices), *kv.shape[1:]), generator=gen)
            kv[indices] = rows.to(kv.dtype)
            written.append(kv[indices].clone())
        return written
    for layer in range(device_pool.layer_num):
        k = device_pool.k_buffer[layer]
        v = device_pool.v_buffer[layer]
        k_rows = torch.randn((len(indices), *k.shape[1:]), generator=gen).to(k.dtype)
        v_rows = torch.randn((len(indices), *v.shape[1:]), generator=gen).to(v.dtype)
        k[indices] = k_rows
        v[indices] = v_rows
        written.append((k_rows, v_rows))
    return written


def finish_transfers(controller: HiCacheController) -> None:
    """Wait for queued transfers (CPU events complete at once) and drain acks."""
    for ack in controller.ack_write_queue + controller.ack_load_queue:
        ack.finish_event.synchronize()
    controller.ack_write_queue.clear()
    controller.ack_load_queue.clear()


def write_evict_load(rig: HiCacheRig, dev: torch.Tensor, evict=None) -> torch.Tensor:
    """Back `dev` up through the controller, free it from L1 (after
    `evict(device_pool, dev)` where given) and load it back; return the
    device indices it was loaded into."""
    ctl = rig.controller
    host = ctl.write(dev)
    assert host is not None
    finish_transfers(ctl)
    if evict is not None:
        evict(rig.device_pool, dev)
    rig.allocator.free(dev)
    new_dev = ctl.load(host)
    assert new_dev is not None
    ctl.start_loading()
    finish_transfers(ctl)
    return new_dev


def assert_self_check_falls_back(pool, caplog, cause: str) -> None:
    """The self-check of the pool's fused path, as its constructor runs it on
    CUDA, fails on `cause`: the torch path is chosen, saying why."""
    import logging

    from sglang.srt.mem_cache.pool_host.encoded import choose_transfer

    requested = pool.transfer_path.removeprefix("fused_")
    with caplog.at_level(logging.WARNING, logger="sglang"):
        transfer, why = choose_transfer(
            pool.transfer_context, pool.pin_memory, requested, check=True
        )
    assert transfer.path == "torch"
    assert why.startswith("self-check failed: ")
    assert cause in why


def device_buffers(device_pool) -> list:
    """The device pool's per-layer buffer lists: [k, v] for MHA, [kv] for MLA."""
    if isinstance(device_pool, MLATokenToKVPool):
        return [device_pool.kv_buffer]
    return [device_pool.k_buffer, device_pool.v_buffer]


def random_controller_operations(
    rig: HiCacheRig,
    write_rows,
    *,
    steps: int,
    seed: int,
    max_pages: int = 6,
    same=torch.equal,
    audit_every: int = 100,
) -> int:
    """Drive the real controller through random writes (each evicted from L1
    at once), loads, L2 and L1 evictions, checking every restore; return the
    number of operations done, drawn from random.Random(seed).

    `write_rows(dev, rng)` writes new rows at device indices `dev` and returns
    the expected restored rows, per layer a tuple in device_buffers() order.
    Every `audit_every` steps, and at the end, all restored rows still on the
    device must be intact (no cross-slot leakage); at the end the host pool's
    free space must match what the test holds there."""
    ctl, alloc, rng = rig.controller, rig.allocator, random.Random(seed)
    buffers = device_buffers(rig.device_pool)
    page_size = rig.device_pool.page_size
    backed_up = []  # (host_indices, expected rows)
    resident = []  # (device_indices, expected rows): restored, still on device

    def assert_restored(dev, expected, step):
        for layer, rows in enumerate(expected):
            for buffer, want in zip(buffers, rows, strict=True):
                assert same(buffer[layer][dev], want), step

    ops = 0
    for step in range(steps):
        op = rng.random()
        if op < 0.4:  # new KV on device, written through to host
            dev = alloc.alloc(rng.randint(1, max_pages) * page_size)
            if dev is None:
                continue
            expected = write_rows(dev, rng)
            host = ctl.write(dev)
            finish_transfers(ctl)
            # L1 eviction right after the backup: the device copy is gone.
            for buffer in buffers:
                for layer in buffer:
                    layer[dev] = float("nan")
            alloc.free(dev)
            if host is not None:
                backed_up.append((host, expected))
            ops += 1
        elif op < 0.75 and backed_up:  # L2 hit: load back and verify
            host, expected = rng.choice(backed_up)
            dev = ctl.load(host)
            if dev is None:
                continue
            ctl.start_loading()
            finish_transfers(ctl)
            assert_restored(dev, expected, step)
            resident.append((dev, expected))
            ops += 1
        elif op < 0.9 and backed_up:  # L2 eviction
            host, _ = backed_up.pop(rng.randrange(len(backed_up)))
            ctl.evict_host(host)
            ops += 1
        elif resident:  # L1 eviction of restored KV
            dev, _ = resident.pop(rng.randrange(len(resident)))
            alloc.free(dev)
            ops += 1
        if audit_every and step % audit_every == 0:
            for dev, expected in resident:
                assert_restored(dev, expected, step)
    for dev, expected in resident:
        assert_restored(dev, expected, "end")
    held = sum(len(h) for h, _ in backed_up)
    assert rig.host_pool.available_size() == rig.host_pool.size - held
    return ops
