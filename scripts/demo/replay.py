"""Experiment B's replay: bench_serving's requests through SGLang's own radix cache
+ HiCache at a budget's exact host capacities, the scheduler modelled (MODEL_NOTES)."""

from __future__ import annotations

import contextlib
from array import array
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from scripts.demo.pools import (
    REPLAY_GEOMETRY,
    make_device_pool,
    setup_sglang,
    without_automatic_sink_page,
)
from scripts.demo.workload import Request, warmup_request

# What the replay models instead of running (printed with every result).
MODEL_NOTES = (
    "radix tree, L1 device pool + allocator, L2 host pools, HiCache controller, "
    "write-through, L1/L2 eviction and load-back are SGLang's own code; "
    "the scheduler is modelled: FCFS prefill batches (<= max_prefill_tokens new "
    "tokens; with chunked prefill, <= chunked_prefill_size per step, the last "
    "request cut and continued first next step, its done part inserted at the "
    "start of that step), at most `concurrency` requests in flight, each "
    "reserving all its remaining output tokens in L1 (ignore_eos, so no "
    "retraction), one token per request per decode step; with the overlap "
    "scheduler a prefill's prompts are inserted only after the next step's "
    "admission; CPU transfers finish at once (acks next step); output tokens "
    "are inserted into the tree at finish, as the server does"
)


@dataclass(frozen=True)
class Serving:
    """The server side of the replay (what a live server would be run with)."""

    l1_tokens: int = 16_384  # --max-total-tokens
    concurrency: int = 8  # bench_serving --max-concurrency
    max_prefill_tokens: int = 16_384  # SGLang's default --max-prefill-tokens
    chunked_prefill_size: Optional[int] = None
    overlap_schedule: bool = True  # SGLang's default (--disable-overlap-schedule)
    write_policy: str = "write_through"  # SGLang's default --hicache-write-policy
    insert_output: bool = True  # finished requests insert prompt + output
    warmup_requests: int = 1  # bench_serving --warmup-requests
    flush_cache: bool = False  # bench_serving --flush-cache (after the warm-up)


@dataclass
class _Running:
    request: Request
    lock: object
    last_node: object
    kv: torch.Tensor  # device slots of the prompt prefilled so far + decoded tokens
    protected: int  # leading slots owned by the tree
    remaining: int  # decode steps left

    @property
    def prefilled(self) -> int:
        return min(len(self.kv), self.request.prompt_len)


@dataclass
class _Step:
    """One prefill step: its requests and the budgets they used."""

    runs: list = field(default_factory=list)  # (_Running, extend start, extend len)
    done: list = field(default_factory=list)  # runs whose prompt is now complete
    new_tokens: int = 0
    reserved: int = 0
    chunk_left: Optional[int] = None


@dataclass
class ReplayResult:
    """One run's counts (its engine adds them up as it runs)."""

    label: str = ""
    host_dtype: str = ""
    host_pool_class: str = ""
    host_tokens: int = 0
    l1_tokens: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0  # loaded back from the host pool
    l2_hit_skipped_tokens: int = 0  # host hits under load_back_threshold
    steps: int = 0
    prefill_batches: int = 0
    max_in_flight: int = 0
    peak_host_used: int = 0
    verified_tokens: int = 0
    verified_restored_tokens: int = 0
    max_restore_error: float = 0.0  # max |restored - written| / row amax
    seed: int = 0
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
    """SGLang's UnifiedRadixCache + HiCache with an L2 of exactly `host_tokens`."""

    def __init__(
        self,
        host_dtype: str,
        host_tokens: int,
        serving: Serving = Serving(),
        *,
        label: Optional[str] = None,
        sanity_every: int = 0,
        layout: str = "layer_first",  # CPU: the stock pool's `direct` io layout
        io_backend: str = "direct",
    ):
        setup_sglang()
        from scripts.rigs.hicache_harness import mha_radix_cache, publish_server_args

        self.label = label or host_dtype
        self.host_dtype = host_dtype
        self.serving = serving
        self.geometry = REPLAY_GEOMETRY
        self.sanity_every = sanity_every
        self._sanity_calls = 0
        # int(L1 * ratio) plus one padding page is exactly `host_tokens` slots.
        ratio = (host_tokens - 1) / serving.l1_tokens
        self.server_args = publish_server_args(
            host_dtype,
            hicache_ratio=ratio,
            layout=layout,
            io_backend=io_backend,
            hicache_write_policy=serving.write_policy,
        )
        # The device pool, allocator, request table and radix cache, as the
        # scheduler builds them.
        self.device_pool = make_device_pool(self.geometry, serving.l1_tokens)
        with without_automatic_sink_page():
            self.cache, self.allocator, self.req_to_token = mha_radix_cache(
                self.server_args,
                self.device_pool,
                requests=serving.concurrency + 1,
                max_context_len=1 << 16,
            )
        controller = self.cache.cache_controller
        self.host_pool = controller.mem_pool_host.anchor_entry.host_pool
        self._check_host_pool(host_tokens)
        self._init_kv_tables()
        self._reference_format = None  # built on the first restore check

    def _check_host_pool(self, host_tokens: int) -> None:
        """The --hicache-host-dtype dispatch's pool, with `host_tokens` slots."""
        from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

        info = self.device_pool.get_device_pool_infos()[0].buffer_info
        expected_cls = get_mha_host_pool_cls(info, host_dtype=self.host_dtype)
        if type(self.host_pool) is not expected_cls:
            raise AssertionError(
                f"{self.host_dtype}: host pool is {type(self.host_pool).__name__}, "
                f"the dispatch gives {expected_cls.__name__}"
            )
        if self.host_pool.size != host_tokens:
            raise AssertionError(
                f"host pool holds {self.host_pool.size} tokens, wanted {host_tokens}"
            )

    # -- deterministic K/V content, so restores can be checked ----------------

    _TABLE_ROWS = 4099

    def _init_kv_tables(self) -> None:
        g = self.geometry
        gen = torch.Generator().manual_seed(1234)
        shape = (g.layer_num, 2, self._TABLE_ROWS, g.head_num, g.head_dim)
        self._kv_table = torch.randn(shape, generator=gen).to(g.dtype)

    def _kv_rows(self, token_ids: torch.Tensor, positions: torch.Tensor):
        """Per layer (K, V) rows from (token id, position) alone."""
        idx = (token_ids * 1_000_003 + positions * 7_919) % self._TABLE_ROWS
        return [(t[0][idx], t[1][idx]) for t in self._kv_table]

    def _write_kv(self, slots: torch.Tensor, seq: torch.Tensor, start: int) -> None:
        positions = torch.arange(start, start + len(slots))
        rows = self._kv_rows(seq[start : start + len(slots)], positions)
        for layer, (k, v) in enumerate(rows):
            self.device_pool.k_buffer[layer][slots] = k
            self.device_pool.v_buffer[layer][slots] = v

    def _expected_restore(self, k: torch.Tensor, v: torch.Tensor):
        """What a restore of rows k, v must give: the format's reference round trip."""
        if self.host_dtype == "auto":
            return k, v
        if self._reference_format is None:
            self._reference_format = type(self.host_pool).host_format_cls(
                (k.shape[-1], v.shape[-1]), k.shape[1], 1, k.dtype
            )
        fmt = self._reference_format
        records = fmt.encode_reference([k.unsqueeze(1), v.unsqueeze(1)])
        k_ref, v_ref = fmt.decode_reference(records, k.dtype)
        return k_ref.squeeze(1), v_ref.squeeze(1)

    def _check_prefix(
        self, slots: torch.Tensor, seq: torch.Tensor, loaded: int = 0
    ) -> float:
        """Bit for bit, each token is the written KV or its L2 round trip (the last
        `loaded` the round trip); the max error relative to the row's amax."""
        n = len(slots)
        rows = self._kv_rows(seq[:n], torch.arange(n))
        worst = 0.0
        for layer, (k, v) in enumerate(rows):
            for written, expected, buf in zip(
                (k, v),
                self._expected_restore(k, v),
                (self.device_pool.k_buffer[layer], self.device_pool.v_buffer[layer]),
            ):
                got = buf[slots]
                round_trip = (got == expected).flatten(1).all(1)
                kept = (got == written).flatten(1).all(1)
                if not ((round_trip | kept).all() and round_trip[n - loaded :].all()):
                    err = (got.float() - expected.float()).abs().max()
                    raise AssertionError(
                        f"{self.label}: restored KV differs from what was written "
                        f"(max err vs the round trip {float(err):.4g})"
                    )
                err = (got.float() - written.float()).abs()
                amax = written.float().abs().amax(dim=-1, keepdim=True)
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
        """UnifiedRadixCache.checkpoint_into_tree for a plain MHA request."""
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

    # -- the scheduler model ----------------------------------------------------

    def run(self, requests: Sequence[Request], seed: int = 0) -> ReplayResult:
        """bench_serving against this server: warm-up, then `requests`."""
        # The replay moves small tensors; intra-op threads only add overhead.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(self.serving.warmup_requests if requests else 0):
                self._serve([warmup_request(requests)], ReplayResult())
            if self.serving.flush_cache:
                self.flush_cache()
            stats = ReplayResult(
                self.label,
                self.host_dtype,
                type(self.host_pool).__name__,
                self.host_pool.size,
                self.serving.l1_tokens,
                len(requests),
                sum(r.prompt_len for r in requests),
                seed=seed,
            )
            self._serve(requests, stats)
            return stats
        finally:
            torch.set_num_threads(threads)

    def flush_cache(self) -> None:
        """Scheduler.flush_cache with nothing in flight."""
        self.cache.reset()
        self.req_to_token.clear()
        self.allocator.clear()

    def _serve(self, requests: Sequence[Request], stats: ReplayResult) -> None:
        """Scheduler steps as in event_loop_overlap (event_loop_normal without it)."""
        self._waiting = list(requests)
        self._running: list[_Running] = []
        self._chunked: Optional[_Running] = None
        # Prefill results not yet processed (the overlap scheduler's lag).
        self._unprocessed: list[_Running] = []
        while self._waiting or self._running or self._chunked or self._unprocessed:
            self.cache.check_hicache_events()
            self._maybe_sanity()
            used = self.host_pool.size - self.host_pool.available_size()
            stats.peak_host_used = max(stats.peak_host_used, used)
            self._stash_chunked()
            step = self._admit(stats)
            # The last step's prefill results come after this step's admission.
            self._process_prefill_results(self._unprocessed)
            self._unprocessed = []
            if step.runs:
                self._run_prefill(step, stats)
                if self.serving.overlap_schedule:
                    self._unprocessed = step.done
                else:
                    self._process_prefill_results(step.done)
                self.cache.flush_pending_backups()
                continue
            if not self._running:
                stuck = self._chunked.request if self._chunked else self._waiting[0]
                raise RuntimeError(
                    f"{self.label}: request {stuck.rid} can never be admitted "
                    f"with {self.serving.l1_tokens} L1 tokens"
                )
            self._decode_until_a_request_finishes(stats)
        self.cache.check_hicache_events()
        self.cache.sanity_check()
        assert self.allocator.available_size() + self.cache.evictable_size() == (
            self.serving.l1_tokens
        ), "L1 tokens leaked"

    def _room(self, step: _Step) -> int:
        """L1 tokens a new admission may take: free + evictable - reserved."""
        free = self.allocator.available_size() + self.cache.evictable_size()
        return free - sum(r.remaining for r in self._running) - step.reserved

    def _stash_chunked(self) -> None:
        """get_next_batch_to_run: the chunked request's done part goes into the tree."""
        run = self._chunked
        if run is not None and run.prefilled > run.protected:
            self._checkpoint(run, run.request.prompt, run.prefilled)

    def _admit(self, stats: ReplayResult) -> _Step:
        """PrefillAdder: the chunked request's next chunk, then new requests FCFS."""
        step = _Step(chunk_left=self.serving.chunked_prefill_size)
        in_flight = len(self._running) + (self._chunked is not None)
        if self._chunked is not None:
            self._continue_chunked(step)
        while self._waiting and in_flight < self.serving.concurrency:
            if step.chunk_left is not None and step.chunk_left <= 0:
                break
            if not self._admit_one(self._waiting[0], step, stats):
                break
            self._waiting.pop(0)
            in_flight += 1
        return step

    def _extend_len(self, step: _Step, want: int) -> tuple[int, bool]:
        """(tokens this step computes, whether the request is cut there)."""
        if step.chunk_left is None or want <= step.chunk_left:
            return want, False
        return step.chunk_left, True

    def _continue_chunked(self, step: _Step) -> None:
        run = self._chunked
        start = run.prefilled
        extend, cut = self._extend_len(step, run.request.prompt_len - start)
        need = extend + (0 if cut else len(run.request.output))
        if need > self._room(step):
            return
        run.kv = torch.cat([run.kv, self._alloc(extend).to(torch.int64)])
        self._chunked = None
        self._charge(step, run, start, extend, need, None, cut)

    def _charge(self, step: _Step, run: _Running, start, extend, need, loaded, cut):
        step.runs.append((run, start, extend, loaded))
        step.new_tokens += extend
        step.reserved += need
        if step.chunk_left is not None:
            step.chunk_left -= extend
        if cut:  # the rest is next step's chunk
            self._chunked = run
        else:
            step.done.append(run)

    def _admit_one(self, req: Request, step: _Step, stats: ReplayResult) -> bool:
        """match_prefix -> budget checks -> init_load_back -> allocate."""
        from scripts.rigs.hicache_harness import LoadBackReq
        from sglang.srt.mem_cache.base_prefix_cache import (
            InitLoadBackParams,
            MatchPrefixParams,
        )

        cache, ids = self.cache, req.prompt
        match = cache.match_prefix(
            MatchPrefixParams(key=self._radix_key(ids, limit=len(ids) - 1))
        )
        device_len, host_len = match.device_prefix_len, match.host_hit_length
        # The temporary pin keeps this prefix out of the evictable budget.
        lock = cache.lock(match.last_device_node)
        extend, cut = self._extend_len(step, len(ids) - device_len - host_len)
        need = (len(ids) - device_len) + len(req.output) if not cut else extend
        if need > self._room(step) or (
            step.runs and step.new_tokens + extend > self.serving.max_prefill_tokens
        ):
            cache.unlock(lock)
            return False
        last_node, loaded = match.last_device_node, 0
        if host_len > 0:
            loaded, last_node = cache.init_load_back(
                InitLoadBackParams(
                    best_match_node=match.best_match_node,
                    host_hit_length=host_len,
                    req=LoadBackReq(str(req.rid), last_node),
                )
            )
            if loaded == 0 and host_len >= cache.load_back_threshold:
                raise AssertionError(
                    f"{self.label}: load-back of {host_len} tokens refused"
                )
            if loaded == 0:
                stats.l2_hit_skipped_tokens += host_len
            cache.unlock(lock)
            lock = cache.lock(last_node)
        prefix = device_len + loaded
        # A refused load-back is recomputed: the cut moves with it.
        extend, cut = self._extend_len(step, len(ids) - prefix)
        prefix_slots = cache.path_device_indices(last_node)[:prefix]
        assert len(prefix_slots) == prefix
        kv = torch.cat(
            [prefix_slots.to(torch.int64), self._alloc(extend).to(torch.int64)]
        )
        run = _Running(req, lock, last_node, kv, prefix, len(req.output) - 1)
        self._charge(step, run, prefix, extend, need, loaded, cut)
        stats.l1_hit_tokens += device_len
        stats.l2_hit_tokens += loaded
        stats.per_request.append((req.rid, device_len, loaded))
        return True

    def _run_prefill(self, step: _Step, stats: ReplayResult) -> None:
        """Host -> device loads for the batch, then its forward pass's new KV."""
        self.cache.ready_to_load_host_cache()
        for run, start, extend, loaded in step.runs:
            seq = torch.tensor(run.request.prompt, dtype=torch.int64)
            if loaded is not None and run.protected:  # its cached prefix, checked
                err = self._check_prefix(run.kv[: run.protected], seq, loaded)
                stats.max_restore_error = max(stats.max_restore_error, err)
                stats.verified_tokens += run.protected
                stats.verified_restored_tokens += loaded
            self._write_kv(run.kv[start : start + extend], seq, start)
        self._running += step.done
        stats.steps += 1
        stats.prefill_batches += 1
        in_flight = len(self._running) + (self._chunked is not None)
        stats.max_in_flight = max(stats.max_in_flight, in_flight)

    def _process_prefill_results(self, runs: list[_Running]) -> None:
        """process_batch_result_prefill: checkpoint each complete prompt."""
        for run in runs:
            self._checkpoint(run, run.request.prompt, run.request.prompt_len)

    def _decode_until_a_request_finishes(self, stats: ReplayResult) -> None:
        steps = min(r.remaining for r in self._running)
        for run in self._running:
            if steps:
                slots = self._alloc(steps)
                start = len(run.kv)
                run.kv = torch.cat([run.kv, slots.to(torch.int64)])
                full = run.request.prompt + run.request.output
                self._write_kv(slots, torch.tensor(full, dtype=torch.int64), start)
            run.remaining -= steps
        stats.steps += steps
        finished = [r for r in self._running if r.remaining == 0]
        self._running = [r for r in self._running if r.remaining > 0]
        for run in finished:
            self._release(run)
        self.cache.flush_pending_backups()

    def _release(self, run: _Running) -> None:
        """release_kv_cache(checkpoint=True): insert prompt + output."""
        req = run.request
        kv_len = len(run.kv)
        if self.serving.insert_output:
            ids = req.prompt + req.output[: kv_len - req.prompt_len]
            self._checkpoint(run, ids, kv_len)
            self._insert(
                req.prompt, run.kv[: req.prompt_len], req.prompt_len, priority=1
            )
        else:
            self.allocator.free(run.kv[run.protected :])
        self.cache.unlock(run.lock)
        run.lock = None

    def _maybe_sanity(self) -> None:
        self._sanity_calls += 1
        if self.sanity_every and self._sanity_calls % self.sanity_every == 0:
            self.cache.sanity_check()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # teardown only
            self.cache.release_host_resources()
        self.cache = None


def replay(
    host_dtype: str,
    host_tokens: int,
    requests: Sequence[Request],
    serving: Serving = Serving(),
    *,
    seed: int = 0,
    **engine_options,
) -> ReplayResult:
    """One bench_serving run of `requests` against a fresh cache."""
    engine = HiCacheReplay(host_dtype, host_tokens, serving, **engine_options)
    try:
        return engine.run(requests, seed=seed)
    finally:
        engine.close()
