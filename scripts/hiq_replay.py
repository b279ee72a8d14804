"""Capacity and cache-hit experiments on CPU, through SGLang's own HiCache code.

Two experiments back the claim "same CPU memory, more reuse":

A. Same L2 token capacity -> host bytes. The real stock host pool and the
   real INT8 host pool are built at the model geometry with the same token
   capacity, and their bytes are read from the tensors they allocated.

B. Same host budget (`--hicache-size` GB) -> L2 tokens and cache-hit rate.
   Each pool's token capacity comes from SGLang's own sizing code
   (`build_kv_host_pool` at the model geometry). A shared-prefix workload is
   then replayed through SGLang's real `UnifiedRadixCache` + HiCache
   (device pool, host pool, cache controller, write-through, L1 and L2
   eviction, load-back) with host pools of exactly those token capacities.
   Hit rates depend on token counts only, so the replay uses a tiny head
   geometry and stays small in memory; the INT8 arm still runs the real
   INT8 host pool, selected by `--hicache-host-dtype int8` through the same
   dispatch the server uses.

What is modelled rather than run: the scheduler. SGLang's scheduler needs a
model runner and a GPU, so `HiCacheReplay` drives the cache with the same
calls, in the same order, as the scheduler's prefill admission
(match_prefix -> init_load_back -> ready_to_load_host_cache), prefill result
(checkpoint: insert the prompt) and request release (insert prompt + output,
split at the prompt, unlock). The simplifications are listed in
`MODEL_NOTES`; `tests/test_replay.py` checks the replay against SGLang's code
on small cases.

Only CPU stand-ins from tests/cpu_standins.py replace CUDA-only pieces
(torchvision stub, a pure-torch transfer_kv_direct, no cudaHostRegister).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import mmap
import sys
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = REPO_ROOT / "tests"

# What the replay models instead of running (printed with every result).
MODEL_NOTES = (
    "radix tree, L1 device pool + allocator, L2 host pools, HiCache controller, "
    "write-through, L1/L2 eviction and load-back are SGLang's own code; "
    "the scheduler is modelled: FCFS prefill batches of whole requests "
    "(<= max_prefill_tokens new tokens, no chunked prefill), at most "
    "`concurrency` requests in flight, each reserving all its remaining output "
    "tokens in L1 (new_token_ratio 1.0, so no retraction), one token per "
    "request per decode step, CPU transfers finish at once (acks next step); "
    "output tokens are inserted into the tree at finish, as the server does"
)


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Workload:
    """SGLang bench_serving `--dataset-name generated-shared-prefix`, by shape.

    Per group one random system prompt; each request appends its own random
    question and asks for `output_len` tokens. Requests are shuffled unless
    `ordered` (bench_serving's `--gsp-ordered`). Deterministic for a seed.
    """

    num_groups: int = 32
    prompts_per_group: int = 4
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    seed: int = 1
    ordered: bool = False
    vocab_size: int = 151_936  # Qwen3

    @property
    def num_requests(self) -> int:
        return self.num_groups * self.prompts_per_group

    def bench_serving_args(self) -> list[str]:
        args = [
            "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(self.num_groups),
            "--gsp-prompts-per-group", str(self.prompts_per_group),
            "--gsp-system-prompt-len", str(self.system_prompt_len),
            "--gsp-question-len", str(self.question_len),
            "--gsp-output-len", str(self.output_len),
            "--seed", str(self.seed),
        ]  # fmt: skip
        if self.ordered:
            args.append("--gsp-ordered")
        return args


@dataclass(frozen=True)
class Serving:
    """The server side of the replay (what a live server would be run with)."""

    l1_tokens: int = 16_384  # --max-total-tokens
    concurrency: int = 8  # bench_serving --max-concurrency
    max_prefill_tokens: int = 16_384  # SGLang's default --max-prefill-tokens
    write_policy: str = "write_through"  # SGLang's default --hicache-write-policy
    insert_output: bool = True  # finished requests insert prompt + output


@dataclass
class Request:
    rid: int
    group: int
    prompt: array  # token ids ('q')
    output: array

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def make_workload(workload: Workload) -> list[Request]:
    """The requests of `workload` in arrival order; deterministic for its seed."""
    rng = np.random.default_rng(workload.seed)
    vocab = workload.vocab_size
    requests = []
    for group in range(workload.num_groups):
        system = rng.integers(0, vocab, workload.system_prompt_len)
        for _ in range(workload.prompts_per_group):
            question = rng.integers(0, vocab, workload.question_len)
            output = rng.integers(0, vocab, workload.output_len)
            requests.append(
                Request(
                    rid=len(requests),
                    group=group,
                    prompt=array("q", np.concatenate([system, question]).tolist()),
                    output=array("q", output.tolist()),
                )
            )
    if not workload.ordered:
        order = rng.permutation(len(requests))
        requests = [requests[i] for i in order]
    return requests


# --------------------------------------------------------------------------
# SGLang set-up on CPU
# --------------------------------------------------------------------------

_SETUP_DONE = False


def setup_sglang(quiet: bool = True) -> None:
    """Install the CPU stand-ins (tests/cpu_standins.py) before sglang imports."""
    global _SETUP_DONE
    if _SETUP_DONE:
        return
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from cpu_standins import install_sglang_standins, install_torchvision_stub

    install_torchvision_stub()
    install_sglang_standins()
    if quiet:
        # Startup chatter a real server prints once (e.g. "host pool smaller
        # than the device pool" for the smallest budgets, CPU event timing).
        logging.getLogger("sglang").setLevel(logging.ERROR)
    _SETUP_DONE = True


def host_formats() -> list[tuple[str, str]]:
    """(label, --hicache-host-dtype value) for every host format the patched
    server accepts, read from its own argument parser. `auto` is the stock
    pool, labelled by the device KV dtype."""
    setup_sglang()
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(
        a for a in parser._actions if "--hicache-host-dtype" in a.option_strings
    )
    formats = []
    for choice in action.choices:
        label = "bf16" if choice == "auto" else choice
        formats.append((label, choice))
    formats.sort(key=lambda item: item[1] != "auto")  # stock first
    return formats


def publish_server_args(
    host_dtype: str,
    *,
    hicache_size: float = 0,
    hicache_ratio: Optional[float] = None,
    layout: str = "page_first",
    io_backend: str = "direct",
    write_policy: str = "write_through",
):
    """Build ServerArgs as the server would and publish its config namespaces
    (what get_memory() / get_serving() read) for this process."""
    setup_sglang()
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        page_size=1,
        enable_hierarchical_cache=True,
        hicache_ratio=hicache_ratio,
        hicache_size=hicache_size,
        hicache_io_backend=io_backend,
        hicache_mem_layout=layout,
        hicache_write_policy=write_policy,
        hicache_host_memory_mode="cache",
        hicache_host_dtype=host_dtype,
    )
    reset_context()
    publish(server_args, role="scheduler")
    return server_args


def make_device_pool(geometry: ModelGeometry, tokens: int):
    setup_sglang()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=tokens,
        page_size=1,
        dtype=geometry.dtype,
        head_num=geometry.head_num,
        head_dim=geometry.head_dim,
        layer_num=geometry.layer_num,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


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
    """Build host pools without committing their memory and without the
    free-RAM check: for sizing pools larger than this machine's RAM.

    Everything else (geometry, sizing, buffer shapes and dtypes) is the real
    pool code; only SGLang's mmap allocator stops prefaulting.
    """
    setup_sglang()
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    saved = common.alloc_mmap
    common.alloc_mmap = _lazy_alloc_mmap
    try:
        with host_memory_budget_scope(1 << 62):
            yield
    finally:
        common.alloc_mmap = saved


def host_buffer_bytes(host_pool) -> int:
    """Bytes of the tensors a host pool allocated for its KV (kv_buffer)."""
    buffers = host_pool.kv_buffer
    if isinstance(buffers, torch.Tensor):
        buffers = [buffers]
    return sum(t.untyped_storage().nbytes() for t in buffers)


def _rss_shmem_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------
# Experiment A: same L2 token capacity -> host bytes
# --------------------------------------------------------------------------


@dataclass
class PoolAllocation:
    label: str
    host_dtype: str
    pool_class: str
    tokens: int
    bytes: int  # read from the allocated buffers
    bytes_per_token: int  # the pool's own get_size_per_token()
    committed: bool  # memory really faulted in (else lazily mapped)
    resident_bytes: int  # RssShmem growth while the pool lived (committed only)
    note: str = ""


def allocate_host_pool(
    host_dtype: str,
    tokens: int,
    geometry: ModelGeometry = QWEN3_8B,
    *,
    layout: str = "page_first",
    commit: bool = True,
    label: Optional[str] = None,
) -> PoolAllocation:
    """Build the real host pool for `host_dtype` holding `tokens` tokens at
    `geometry` (the class comes from the assembler's own dispatch), read its
    allocated bytes, then free it. With `commit`, the pool's memory is really
    faulted in (SGLang's prefaulted mmap); when this machine lacks the free
    RAM that SGLang's host-memory check demands, it falls back to a lazy
    mapping and says so in `note`."""
    setup_sglang()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _mha_host_inputs,
    )

    publish_server_args(host_dtype, layout=layout)
    device_pool = make_device_pool(geometry, 64)
    cls, info, kwargs = _mha_host_inputs(device_pool)
    kwargs.pop("write_back_staging", None)

    def build():
        return cls(
            info,
            2.0,
            0,
            device_pool.page_size,
            layout,
            host_token_capacity=tokens,
            **kwargs,
        )

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
    result = PoolAllocation(
        label=label or host_dtype,
        host_dtype=host_dtype,
        pool_class=type(host_pool).__name__,
        tokens=host_pool.size,
        bytes=host_buffer_bytes(host_pool),
        bytes_per_token=host_pool.get_size_per_token(),
        committed=committed,
        resident_bytes=resident,
        note=note,
    )
    host_pool.destroy()
    del host_pool, device_pool
    gc.collect()
    return result


# --------------------------------------------------------------------------
# Experiment B, part 1: host budget -> token capacity (SGLang's own sizing)
# --------------------------------------------------------------------------


@dataclass
class BudgetCapacity:
    label: str
    host_dtype: str
    budget_gb: float
    pool_class: str
    tokens: int  # the pool's size: what the radix tree can hold in L2
    bytes: int  # bytes of its buffers (mapped lazily, never committed)
    bytes_per_token: int


def capacity_at_budget(
    host_dtype: str,
    budget_gb: float,
    geometry: ModelGeometry = QWEN3_8B,
    *,
    layout: str = "page_first",
    label: Optional[str] = None,
) -> BudgetCapacity:
    """Tokens the server's host pool holds for `--hicache-size budget_gb`:
    builds it with SGLang's `build_kv_host_pool` (as the server does), with
    the buffers mapped lazily so budgets beyond this machine's RAM work."""
    setup_sglang()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_kv_host_pool,
    )

    publish_server_args(host_dtype, hicache_size=budget_gb, layout=layout)
    device_pool = make_device_pool(geometry, 64)
    with lazy_host_allocation():
        host_pool = build_kv_host_pool(kv_pool=device_pool, page_size=1)
    result = BudgetCapacity(
        label=label or host_dtype,
        host_dtype=host_dtype,
        budget_gb=budget_gb,
        pool_class=type(host_pool).__name__,
        tokens=host_pool.size,
        bytes=host_buffer_bytes(host_pool),
        bytes_per_token=host_pool.get_size_per_token(),
    )
    host_pool.destroy()
    del host_pool, device_pool
    gc.collect()
    return result


# --------------------------------------------------------------------------
# Experiment B, part 2: the replay
# --------------------------------------------------------------------------


class _ReqStub:
    """The attributes of a scheduler Req that init_load_back reads."""

    def __init__(self, rid: str, last_node):
        self.rid = rid
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.mamba_pool_idx = None
        self.kv = SimpleNamespace(mamba_pool_idx=None)


class _TpWorkerStub:
    """registry.create_unified_radix_cache hands the layer-done counter to the
    TP worker; on CPU nothing consumes it."""

    hicache_layer_transfer_counter = None

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.hicache_layer_transfer_counter = counter


@dataclass
class _Running:
    request: Request
    lock: object
    last_node: object
    kv: torch.Tensor  # device slots of prompt + decoded tokens so far
    protected: int  # leading slots owned by the tree
    remaining: int  # decode steps left


@dataclass
class ReplayResult:
    label: str
    host_dtype: str
    host_pool_class: str
    host_tokens: int
    l1_tokens: int
    requests: int
    prompt_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int  # loaded back from the host pool
    l2_hit_skipped_tokens: int  # host hits under load_back_threshold
    steps: int
    prefill_batches: int
    max_in_flight: int
    peak_host_used: int
    verified_tokens: int
    verified_restored_tokens: int
    max_restore_error: float  # max |restored - written| / row amax
    seed: int
    per_request: list[tuple[int, int, int]] = field(default_factory=list, repr=False)

    @property
    def hit_tokens(self) -> int:
        return self.l1_hit_tokens + self.l2_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("per_request")
        data["hit_tokens"] = self.hit_tokens
        data["hit_rate"] = self.hit_rate
        return data


class HiCacheReplay:
    """SGLang's UnifiedRadixCache + HiCache with an L2 of exactly
    `host_tokens` tokens, driven request by request as the scheduler drives
    it (see MODEL_NOTES)."""

    def __init__(
        self,
        host_dtype: str,
        host_tokens: int,
        serving: Serving = Serving(),
        *,
        geometry: ModelGeometry = REPLAY_GEOMETRY,
        label: Optional[str] = None,
        verify: bool = True,
        sanity_every: int = 0,
        max_context_len: int = 1 << 16,
        layout: str = "layer_first",  # CPU: the stock pool's `direct` io layout
        io_backend: str = "direct",
    ):
        setup_sglang()
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
        from sglang.srt.mem_cache.registry import (
            TreeCacheBuildContext,
            create_unified_radix_cache,
        )

        self.label = label or host_dtype
        self.host_dtype = host_dtype
        self.serving = serving
        self.geometry = geometry
        self.verify = verify
        self.sanity_every = sanity_every
        self._sanity_calls = 0
        # HostKVCache sizes a ratio pool as int(L1 * ratio) plus one padding
        # page (page_size 1): this ratio gives exactly `host_tokens` slots,
        # the token capacity the same budget buys at the model geometry.
        # (host_tokens - 1) / 2^k is exact in binary floating point.
        ratio = (host_tokens - 1) / serving.l1_tokens
        self.server_args = publish_server_args(
            host_dtype,
            hicache_ratio=ratio,
            layout=layout,
            io_backend=io_backend,
            write_policy=serving.write_policy,
        )
        self.device_pool = make_device_pool(geometry, serving.l1_tokens)
        self.allocator = TokenToKVPoolAllocator(
            serving.l1_tokens, geometry.dtype, "cpu", self.device_pool, need_sort=False
        )
        req_to_token = ReqToTokenPool(
            size=serving.concurrency + 1,
            max_context_len=max_context_len,
            device="cpu",
            enable_memory_saver=False,
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=req_to_token,
            token_to_kv_pool_allocator=self.allocator,
            page_size=1,
        )
        ctx = TreeCacheBuildContext(
            server_args=self.server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=True,
            disable_radix_cache=False,
            tp_worker=_TpWorkerStub(),
            model_config=None,
            tp_size=1,
            tp_rank=0,
            tp_group=None,
        )
        self.cache = create_unified_radix_cache(ctx)
        controller = self.cache.cache_controller
        self.host_pool = controller.mem_pool_host.anchor_entry.host_pool
        info = self.device_pool.get_device_pool_infos()[0].buffer_info
        expected_cls = get_mha_host_pool_cls(info, host_dtype=host_dtype)
        if type(self.host_pool) is not expected_cls:
            raise AssertionError(
                f"{host_dtype}: host pool is {type(self.host_pool).__name__}, "
                f"the dispatch gives {expected_cls.__name__}"
            )
        if host_dtype == "int8":
            assert type(self.host_pool).__name__ == "MHATokenToKVPoolINT8FusedHost"
        if self.host_pool.size != host_tokens:
            raise AssertionError(
                f"host pool holds {self.host_pool.size} tokens, wanted {host_tokens}"
            )
        self._init_kv_tables()

    # -- deterministic K/V content, so restores can be checked ----------------

    _TABLE_ROWS = 4099

    def _init_kv_tables(self) -> None:
        g = self.geometry
        gen = torch.Generator().manual_seed(1234)
        shape = (g.layer_num, 2, self._TABLE_ROWS, g.head_num, g.head_dim)
        self._kv_table = torch.randn(shape, generator=gen).to(g.dtype)

    def _kv_rows(self, token_ids: torch.Tensor, positions: torch.Tensor):
        """Per layer (K rows, V rows) for tokens at positions: a function of
        (token id, position) only, so equal prefixes carry equal KV."""
        idx = (token_ids * 1_000_003 + positions * 7_919) % self._TABLE_ROWS
        return [(t[0][idx], t[1][idx]) for t in self._kv_table]

    def _write_kv(self, slots: torch.Tensor, seq: torch.Tensor, start: int) -> None:
        positions = torch.arange(start, start + len(slots))
        rows = self._kv_rows(seq[start : start + len(slots)], positions)
        for layer, (k, v) in enumerate(rows):
            self.device_pool.k_buffer[layer][slots] = k
            self.device_pool.v_buffer[layer][slots] = v

    def _check_prefix(self, slots: torch.Tensor, seq: torch.Tensor) -> float:
        """Compare device KV at `slots` with what was written for seq[:n].

        BF16 (stock pool) must match bit for bit. INT8 must stay within the
        codec's bound, |x - x^| <= s/2 + half_ulp_out(x^) with
        s <= amax/127 * (1 + 2^-10) (README, "Error bound"). Returns the max
        error relative to the row's absolute maximum.
        """
        n = len(slots)
        rows = self._kv_rows(seq[:n], torch.arange(n))
        # Explicit mantissa bits of the device dtype (7 for BF16, 10 for FP16).
        mantissa_bits = round(-math.log2(torch.finfo(self.geometry.dtype).eps))
        worst = 0.0
        for layer, (k, v) in enumerate(rows):
            for want, buf in (
                (k, self.device_pool.k_buffer[layer]),
                (v, self.device_pool.v_buffer[layer]),
            ):
                got = buf[slots].float()
                want = want.float()
                err = (got - want).abs()
                amax = want.abs().amax(dim=-1, keepdim=True)
                if self.host_dtype == "auto":
                    ok = bool((err == 0).all())
                else:
                    _, exponent = torch.frexp(got)
                    half_ulp = torch.where(
                        got == 0,
                        torch.zeros_like(got),
                        # x^ = m * 2^e, m in [0.5, 1): ulp = 2^(e - 1 - bits)
                        torch.ldexp(torch.ones_like(got), exponent - mantissa_bits - 2),
                    )
                    bound = amax / 127 * (1 + 2**-10) / 2 + half_ulp
                    ok = bool((err <= bound * (1 + 1e-6)).all())
                if not ok:
                    raise AssertionError(
                        f"{self.label}: restored KV differs from what was written "
                        f"(max err {float(err.max()):.4g})"
                    )
                worst = max(worst, float((err / amax.clamp_min(1e-30)).max()))
        return worst

    # -- the cache calls, in scheduler order ----------------------------------

    def _radix_key(self, ids: array, limit: Optional[int] = None):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(ids, limit=limit)

    def _insert(self, ids: array, value: torch.Tensor, prev_prefix_len: int, **kw):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        return self.cache.insert(
            InsertParams(
                key=self._radix_key(ids),
                value=value.to(torch.int64),
                prev_prefix_len=prev_prefix_len,
                inserted_len=prev_prefix_len,
                **kw,
            )
        )

    def _checkpoint(self, run: _Running, ids: array, kv_len: int) -> None:
        """UnifiedRadixCache.checkpoint_into_tree for a plain MHA request:
        insert ids[:kv_len], adopt the tree's slots, move the lock."""
        result = self._insert(ids[:kv_len], run.kv[:kv_len], run.protected)
        new_indices = self.cache.path_device_indices(result.last_device_node)
        assert len(new_indices) == kv_len, (len(new_indices), kv_len)
        run.kv[run.protected : kv_len] = new_indices[run.protected :]
        self.cache.unlock(run.lock)
        run.lock = self.cache.lock(result.last_device_node)
        run.last_node = result.last_device_node
        run.protected = kv_len

    def _alloc(self, n: int) -> torch.Tensor:
        self.allocator.evict_to_free_tokens(self.cache, n)
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError(f"{self.label}: L1 cannot allocate {n} tokens")
        return slots

    def run(self, requests: Sequence[Request], seed: int = 0) -> ReplayResult:
        # The replay moves small tensors; intra-op threads only add overhead.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._run(requests, seed)
        finally:
            torch.set_num_threads(threads)

    def _run(self, requests: Sequence[Request], seed: int) -> ReplayResult:
        from sglang.srt.mem_cache.base_prefix_cache import (
            InitLoadBackParams,
            MatchPrefixParams,
        )

        cache, serving = self.cache, self.serving
        waiting = list(requests)
        running: list[_Running] = []
        stats = dict(
            l1=0, l2=0, l2_skipped=0, steps=0, batches=0, max_in_flight=0,
            peak_host=0, verified=0, verified_restored=0, err=0.0,
        )  # fmt: skip
        per_request = []
        host_pool = self.host_pool
        load_back_threshold = cache.load_back_threshold

        def reserved_decode() -> int:
            return sum(r.remaining for r in running)

        while waiting or running:
            cache.check_hicache_events()
            self._maybe_sanity(stats)
            stats["peak_host"] = max(
                stats["peak_host"], host_pool.size - host_pool.available_size()
            )
            # ---- prefill admission (PrefillAdder.add_one_req, FCFS) --------
            batch: list[tuple[_Running, int, int]] = []
            batch_new_tokens = 0
            budget_used = 0
            while waiting and len(running) + len(batch) < serving.concurrency:
                req = waiting[0]
                ids = req.prompt
                match = cache.match_prefix(
                    MatchPrefixParams(key=self._radix_key(ids, limit=len(ids) - 1))
                )
                device_len = match.device_prefix_len
                host_len = match.host_hit_length
                # The temporary pin keeps this prefix out of the evictable budget.
                lock = cache.lock(match.last_device_node)
                need = (len(ids) - device_len) + len(req.output)
                room = (
                    self.allocator.available_size()
                    + cache.evictable_size()
                    - reserved_decode()
                    - budget_used
                )
                new_tokens = len(ids) - device_len - host_len
                if need > room or (
                    batch and batch_new_tokens + new_tokens > serving.max_prefill_tokens
                ):
                    cache.unlock(lock)
                    break
                waiting.pop(0)
                last_node = match.last_device_node
                loaded = 0
                if host_len > 0:
                    stub = _ReqStub(str(req.rid), last_node)
                    loaded, last_node = cache.init_load_back(
                        InitLoadBackParams(
                            best_match_node=match.best_match_node,
                            host_hit_length=host_len,
                            req=stub,
                        )
                    )
                    if loaded == 0 and host_len >= load_back_threshold:
                        raise AssertionError(
                            f"{self.label}: load-back of {host_len} tokens refused"
                        )
                    if loaded == 0:
                        stats["l2_skipped"] += host_len
                    cache.unlock(lock)
                    lock = cache.lock(last_node)
                prefix = device_len + loaded
                prefix_slots = cache.path_device_indices(last_node)[:prefix]
                assert len(prefix_slots) == prefix
                new_slots = self._alloc(len(ids) - prefix)
                kv = torch.cat(
                    [prefix_slots.to(torch.int64), new_slots.to(torch.int64)]
                )
                run = _Running(
                    request=req,
                    lock=lock,
                    last_node=last_node,
                    kv=kv,
                    protected=prefix,
                    remaining=len(req.output) - 1,
                )
                batch.append((run, device_len, loaded))
                batch_new_tokens += len(ids) - prefix
                budget_used += need
                stats["l1"] += device_len
                stats["l2"] += loaded
                per_request.append((req.rid, device_len, loaded))
            if batch:
                # Host -> device for the whole batch, before its forward pass.
                cache.ready_to_load_host_cache()
                for run, device_len, loaded in batch:
                    seq = torch.tensor(run.request.prompt, dtype=torch.int64)
                    if self.verify and run.protected:
                        err = self._check_prefix(run.kv[: run.protected], seq)
                        stats["err"] = max(stats["err"], err)
                        stats["verified"] += run.protected
                        stats["verified_restored"] += loaded
                    # The forward pass writes the new tokens' KV.
                    self._write_kv(run.kv[run.protected :], seq, run.protected)
                # Prefill result: checkpoint each prompt into the tree.
                for run, _, _ in batch:
                    self._checkpoint(run, run.request.prompt, run.request.prompt_len)
                    running.append(run)
                cache.flush_pending_backups()
                stats["steps"] += 1
                stats["batches"] += 1
                stats["max_in_flight"] = max(stats["max_in_flight"], len(running))
                continue
            if not running:
                raise RuntimeError(
                    f"{self.label}: request {waiting[0].rid} can never be admitted "
                    f"with {serving.l1_tokens} L1 tokens"
                )
            # ---- decode until the next request finishes --------------------
            steps = min(r.remaining for r in running)
            for run in running:
                if steps:
                    slots = self._alloc(steps)
                    full = self._full_ids(run.request)
                    start = len(run.kv)
                    run.kv = torch.cat([run.kv, slots.to(torch.int64)])
                    self._write_kv(slots, full, start)
                run.remaining -= steps
            stats["steps"] += steps
            finished = [r for r in running if r.remaining == 0]
            running = [r for r in running if r.remaining > 0]
            for run in finished:
                self._release(run)
            cache.flush_pending_backups()

        cache.check_hicache_events()
        cache.sanity_check()
        assert self.allocator.available_size() + cache.evictable_size() == (
            serving.l1_tokens
        ), "L1 tokens leaked"
        prompt_tokens = sum(r.prompt_len for r in requests)
        return ReplayResult(
            label=self.label,
            host_dtype=self.host_dtype,
            host_pool_class=type(host_pool).__name__,
            host_tokens=host_pool.size,
            l1_tokens=serving.l1_tokens,
            requests=len(requests),
            prompt_tokens=prompt_tokens,
            l1_hit_tokens=stats["l1"],
            l2_hit_tokens=stats["l2"],
            l2_hit_skipped_tokens=stats["l2_skipped"],
            steps=stats["steps"],
            prefill_batches=stats["batches"],
            max_in_flight=stats["max_in_flight"],
            peak_host_used=stats["peak_host"],
            verified_tokens=stats["verified"],
            verified_restored_tokens=stats["verified_restored"],
            max_restore_error=stats["err"],
            seed=seed,
            per_request=per_request,
        )

    @staticmethod
    def _full_ids(request: Request) -> torch.Tensor:
        return torch.tensor(request.prompt + request.output, dtype=torch.int64)

    def _release(self, run: _Running) -> None:
        """release_kv_cache(checkpoint=True): insert prompt + output (all but
        the last output token, which has no KV), split the leaf at the prompt
        so the output can be evicted alone, unlock."""
        req = run.request
        kv_len = len(run.kv)
        if self.serving.insert_output:
            ids = req.prompt + req.output[: kv_len - req.prompt_len]
            self._checkpoint(run, ids, kv_len)
            self._insert(
                req.prompt,
                run.kv[: req.prompt_len],
                req.prompt_len,
                priority=1,
            )
        else:
            self.allocator.free(run.kv[run.protected :])
        self.cache.unlock(run.lock)
        run.lock = None

    def _maybe_sanity(self, stats) -> None:
        self._sanity_calls += 1
        if self.sanity_every and self._sanity_calls % self.sanity_every == 0:
            self.cache.sanity_check()

    def close(self) -> None:
        try:
            self.cache.release_host_resources()
        except Exception:  # noqa: BLE001 - teardown only
            pass
        self.cache = None


def replay(
    host_dtype: str,
    host_tokens: int,
    workload: Workload = Workload(),
    serving: Serving = Serving(),
    *,
    label: Optional[str] = None,
    verify: bool = True,
    sanity_every: int = 0,
    requests: Optional[list[Request]] = None,
    **engine_options,
) -> ReplayResult:
    """One replay of `workload` with an L2 of `host_tokens` tokens."""
    requests = requests if requests is not None else make_workload(workload)
    engine = HiCacheReplay(
        host_dtype,
        host_tokens,
        serving,
        label=label,
        verify=verify,
        sanity_every=sanity_every,
        **engine_options,
    )
    try:
        return engine.run(requests, seed=workload.seed)
    finally:
        engine.close()


def best_possible_hit_rate(requests: Sequence[Request]) -> float:
    """Hit rate with an unbounded cache and no concurrency: each request
    reuses the longest prefix (at most prompt length - 1) that an earlier
    request's prompt + output began with. Prefixes are compared by a
    polynomial hash of their tokens."""
    mod, base = (1 << 61) - 1, 1_000_003

    def prefix_hashes(ids) -> list[int]:
        out, h = [], 0
        for token in ids:
            h = (h * base + token + 1) % mod
            out.append(h)
        return out

    seen: set[int] = set()
    hits = total = 0
    for req in requests:
        hashes = prefix_hashes(req.prompt)
        best = 0
        for k in range(len(req.prompt) - 1):
            if hashes[k] not in seen:
                break
            best = k + 1
        hits += best
        total += req.prompt_len
        seen.update(prefix_hashes(req.prompt + req.output[:-1]))
    return hits / total if total else 0.0


__all__ = [
    "MODEL_NOTES",
    "QWEN3_8B",
    "REPLAY_GEOMETRY",
    "BudgetCapacity",
    "HiCacheReplay",
    "ModelGeometry",
    "PoolAllocation",
    "ReplayResult",
    "Request",
    "Serving",
    "Workload",
    "allocate_host_pool",
    "capacity_at_budget",
    "host_formats",
    "make_workload",
    "publish_server_args",
    "replay",
    "setup_sglang",
]
