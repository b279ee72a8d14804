"""SGLang's HiCache pools on CPU: experiment A's host bytes and B's sizing."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional
from unittest import mock

import torch

from scripts.common.cpu_sglang import install_cpu_standins


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    layer_num: int
    head_num: int  # KV heads per TP rank
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        return (
            f"{self.name}: {self.layer_num} layers, {self.head_num} KV heads, "
            f"{self.head_dim} dims, {str(self.dtype).removeprefix('torch.')}"
        )


QWEN3_8B = ModelGeometry("Qwen3-8B (TP=1)", layer_num=36, head_num=8, head_dim=128)
# Hit rates depend only on token counts; the replay's KV rows are this small.
REPLAY_GEOMETRY = ModelGeometry("replay", layer_num=2, head_num=1, head_dim=16)


@functools.cache
def setup_sglang() -> None:
    """Install the CPU stand-ins (scripts/rigs/standins.py) before sglang imports."""
    # Startup chatter of optional GPU dependencies, not about the cache.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    install_cpu_standins()
    # Startup chatter a real server prints once (e.g. "host pool smaller
    # than the device pool" for the smallest budgets, CPU event timing).
    logging.getLogger("sglang").setLevel(logging.ERROR)


def host_formats() -> list[tuple[str, str]]:
    """(label, --hicache-host-dtype) of the stock pool (first) and every format."""
    setup_sglang()
    from scripts.common.host_formats import host_formats as server_formats

    return [(f.label, f.host_dtype) for f in server_formats()]


def make_device_pool(geometry: ModelGeometry, tokens: int, page_size: int = 1):
    setup_sglang()
    from scripts.rigs.hicache_harness import Geometry, make_device_pool

    g = geometry
    geo = Geometry(
        g.layer_num, g.head_num, g.head_dim, dtype=g.dtype, page_size=page_size
    )
    return make_device_pool(geo, tokens)


def without_automatic_sink_page():
    """The demo sizes pools at Qwen3-8B geometry over the rigs' Llama-style
    dummy config, so int4c's automatic sink page (sink_page.host_plan), which
    follows the config, stays off unless SGLANG_HICACHE_SINK_PAGE_TOKENS is set."""
    from sglang.srt.mem_cache.pool_host.sink_page import SINK_ENV

    if os.environ.get(SINK_ENV, "").strip():
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {SINK_ENV: "0"})


def _published_device_pool(host_dtype, geometry, page_size: int, **server_fields):
    """Publish the server's arguments, then a small device pool to size host pools on."""
    from scripts.rigs.hicache_harness import publish_server_args

    publish_server_args(host_dtype, page_size=page_size, **server_fields)
    return make_device_pool(geometry, max(64, page_size), page_size)


def _lazy_alloc_mmap(dims: tuple, dtype: torch.dtype) -> torch.Tensor:
    """alloc_mmap without prefaulting: the same anonymous mapping, committed
    page by page only when touched."""
    n_bytes = math.prod(dims) * torch.empty([], dtype=dtype).element_size()
    size = max(mmap.PAGESIZE, -(-n_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    mm = mmap.mmap(-1, size, flags=flags)
    return torch.frombuffer(mm, dtype=dtype, count=math.prod(dims)).reshape(dims)


@contextlib.contextmanager
def lazy_host_allocation() -> Iterator[None]:
    """Host pools sized without committing memory or the free-RAM check."""
    setup_sglang()
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with (
        mock.patch.object(common, "alloc_mmap", _lazy_alloc_mmap),
        host_memory_budget_scope(1 << 62),
    ):
        yield


def _rss_shmem_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _measured(host_pool, host_dtype: str, label, page_size: int) -> dict:
    """The fields PoolAllocation and BudgetCapacity share; destroys the pool."""
    buffers = host_pool.kv_buffer  # its KV tensors: one, or a list
    buffers = [buffers] if isinstance(buffers, torch.Tensor) else buffers
    fields = dict(
        label=label or host_dtype,
        host_dtype=host_dtype,
        pool_class=type(host_pool).__name__,
        page_size=page_size,
        tokens=host_pool.size,
        bytes=sum(t.untyped_storage().nbytes() for t in buffers),
        bytes_per_token=host_pool.get_size_per_token(),
    )
    host_pool.destroy()
    gc.collect()
    return fields


@dataclass
class PoolAllocation:
    label: str
    host_dtype: str
    pool_class: str
    page_size: int
    tokens: int
    bytes: int  # read from the allocated buffers
    bytes_per_token: float  # the pool's own get_size_per_token()
    committed: bool  # memory really faulted in (else lazily mapped)
    resident_bytes: int  # RssShmem growth while the pool lived (committed only)
    note: str = ""


def allocate_host_pool(
    host_dtype: str,
    tokens: int,
    geometry: ModelGeometry = QWEN3_8B,
    *,
    layout: str = "page_first",
    page_size: int = 1,
    commit: bool = True,
    label: Optional[str] = None,
) -> PoolAllocation:
    """The real host pool's bytes for `tokens` tokens; committed, or lazy (`note`)
    where free RAM is short of SGLang's check."""
    setup_sglang()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs

    device_pool = _published_device_pool(host_dtype, geometry, page_size, layout=layout)
    with without_automatic_sink_page():
        cls, info, kwargs = _mha_host_inputs(device_pool)
    # Host pools hold whole pages.
    tokens = -(-tokens // page_size) * page_size
    kwargs.pop("write_back_staging", None)
    args = (info, 2.0, 0, device_pool.page_size, layout)
    build = functools.partial(cls, *args, host_token_capacity=tokens, **kwargs)

    note = ""
    committed = commit
    gc.collect()
    rss_before = _rss_shmem_bytes()
    host_pool = None
    if commit:
        try:
            host_pool = build()
        except ValueError as exc:
            if "Not enough host memory" not in str(exc):
                raise
            note = (
                "not committed: this machine's free RAM minus SGLang's 10 GiB "
                "reserve is too small, so the buffers were mapped lazily"
            )
            committed = False
    if host_pool is None:
        with lazy_host_allocation():
            host_pool = build()
    resident = _rss_shmem_bytes() - rss_before if committed else 0
    fields = _measured(host_pool, host_dtype, label, page_size)
    return PoolAllocation(
        **fields, committed=committed, resident_bytes=resident, note=note
    )


@dataclass
class BudgetCapacity:
    label: str
    host_dtype: str
    budget_gb: float
    pool_class: str
    page_size: int
    tokens: int  # the pool's size: what the radix tree can hold in L2
    bytes: int  # bytes of its buffers (mapped lazily, never committed)
    bytes_per_token: float


def capacity_at_budget(
    host_dtype: str,
    budget_gb: float,
    geometry: ModelGeometry = QWEN3_8B,
    *,
    layout: str = "page_first",
    page_size: int = 1,
    label: Optional[str] = None,
) -> BudgetCapacity:
    """Tokens SGLang's `build_kv_host_pool` holds for `--hicache-size`."""
    setup_sglang()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_kv_host_pool,
    )

    device_pool = _published_device_pool(
        host_dtype, geometry, page_size, layout=layout, hicache_size=budget_gb
    )
    with lazy_host_allocation(), without_automatic_sink_page():
        host_pool = build_kv_host_pool(kv_pool=device_pool, page_size=page_size)
    fields = _measured(host_pool, host_dtype, label, page_size)
    return BudgetCapacity(**fields, budget_gb=budget_gb)


# SGLang's default --chunked-prefill-size by GPU memory (GiB bound, tokens):
# memory_hook's rule needs a model and a device, so this is a copy that
# tests/test_replay.py checks against the rule's source.
SERVER_CHUNKED_PREFILL_DEFAULTS = (
    (20, 2048),
    (35, 4096),
    (60, 4096),
    (90, 8192),
    (160, 8192),
    (math.inf, 16384),
)


def server_chunked_prefill_size(gpu_memory_gb: float) -> int:
    """The --chunked-prefill-size a server picks by default on a GPU with
    `gpu_memory_gb` GiB of memory."""
    return next(
        size for bound, size in SERVER_CHUNKED_PREFILL_DEFAULTS if gpu_memory_gb < bound
    )
