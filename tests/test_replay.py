"""The capacity / cache-hit replay behind `make demo` (scripts/demo/), scaled down:
SGLang's real UnifiedRadixCache + HiCache with only the scheduler modelled; the
demo's claims, checked restores, and the limiting cases SGLang's cache must meet."""

from __future__ import annotations

import math

import pytest
import torch

from scripts.demo import pools
from scripts.demo import replay as rp
from scripts.demo import workload as wl
from tests.support.quality_inputs import dispatch_cls

SMALL = wl.Workload(
    num_groups=8,
    prompts_per_group=4,
    system_prompt_len=512,
    question_len=64,
    output_len=64,
    seed=7,
)
SERVING = rp.Serving(l1_tokens=2048, concurrency=4, max_prefill_tokens=4096)
# Limiting cases compare with the unbounded-cache hit rate: no warm-up.
COLD = {"warmup_requests": 0}
# Budgets scaled with the workload (GB at Qwen3-8B geometry): from an L2
# smaller than L1 to one that holds the whole workload in INT8.
BUDGETS_GB = (0.1, 0.2, 0.4, 0.8)
INT8_BOUND = 1 / 254 * (1 + 2**-10) + 2**-8  # s/2 + a BF16 half-ulp, / amax
# 4-bit values in groups of the whole 16-dim head of the replay rows:
# s/2 = (hi - lo)/30 <= amax/15, plus the fp16 zero point's and BF16's rounding.
INT4_BOUND = 1 / 15 + 2**-10 + 2**-8
QUANTIZED = ("int8", "k8v4", "int4")


@pytest.fixture(scope="module", autouse=True)
def _fresh_runtime_context():
    yield
    from sglang.srt.runtime_context import reset_context

    reset_context()


@pytest.fixture(scope="module")
def formats():
    return dict(pools.host_formats())


@pytest.fixture(scope="module")
def requests():
    return wl.bench_serving_requests(SMALL)


@pytest.fixture(scope="module")
def sweep(formats, requests):
    results = {}
    for gb in BUDGETS_GB:
        for label, host_dtype in formats.items():
            cap = pools.capacity_at_budget(host_dtype, gb, label=label)
            res = rp.replay(
                host_dtype,
                cap.tokens,
                requests,
                SERVING,
                label=label,
                sanity_every=1,  # SGLang's tree invariants at every step
            )
            results[gb, label] = (cap, res)
    return results


def test_formats_come_from_the_registry_and_the_server_accepts_them(formats):
    from scripts.common.host_formats import host_dtype_choices, registered_host_dtypes

    assert sorted(formats.values()) == sorted(registered_host_dtypes())
    # Every row is a value --hicache-host-dtype accepts.
    assert set(formats.values()) <= set(host_dtype_choices())
    assert list(formats)[0] == "bf16" and formats["bf16"] == "auto"
    for name in QUANTIZED:
        assert formats[name] == name


def _dispatch_cls(host_dtype, page_size=1):
    return dispatch_cls(host_dtype, 8, 128, 128, page_size)  # Qwen3-8B's KV


def test_demo_rows_come_from_the_server_dispatch(formats):
    """Experiments A and B at the demo's page size (64): the dispatch's pool class,
    bytes read from its buffers, the capacity targets at Qwen3-8B."""
    from scripts.demo.__main__ import DEFAULT_PAGE_SIZE, TARGET_RATIO

    page = DEFAULT_PAGE_SIZE
    rows = {}
    for label, dt in formats.items():
        alloc = pools.allocate_host_pool(
            dt, 4096, page_size=page, commit=False, label=label
        )
        cap = pools.capacity_at_budget(dt, 8, page_size=page, label=label)
        expected = _dispatch_cls(dt, page).__name__
        assert alloc.pool_class == cap.pool_class == expected, label
        assert alloc.page_size == cap.page_size == page
        assert alloc.bytes == alloc.tokens * alloc.bytes_per_token
        assert cap.bytes_per_token == alloc.bytes_per_token
        rows[label] = alloc
    bf16 = rows["bf16"].bytes
    for label, target in TARGET_RATIO.items():
        assert bf16 / rows[label].bytes >= target, label
    # Qwen3-8B, 36 layers x 8 heads x 128 dims, page 64 (hostfmt-spec 5).
    assert rows["int4"].bytes_per_token == 36 * (512 + 64 + 512 + 64)
    assert rows["k8v4"].bytes_per_token == 36 * (1024 + 16 + 512 + 64)
    assert rows["int8"].bytes_per_token == 36 * 8 * (128 + 128 + 4)


def test_int8_never_holds_fewer_tokens_nor_hits_less(sweep, formats):
    gained = False
    for gb in BUDGETS_GB:
        base_cap, base = sweep[gb, "bf16"]
        for label in formats:
            cap, res = sweep[gb, label]
            assert cap.tokens >= base_cap.tokens, (gb, label)
            assert res.hit_rate >= base.hit_rate, (gb, label, base.hit_rate)
        int8_cap, int8 = sweep[gb, "int8"]
        assert int8_cap.tokens / base_cap.tokens >= 1.93
        gained |= int8.hit_rate > base.hit_rate
    assert gained, "the budgets never separate the formats: the test is vacuous"


def test_budget_capacity_is_the_pools_allocation(sweep):
    for (gb, label), (cap, res) in sweep.items():
        # Bytes were read from the pool's buffers; they are exactly its tokens'
        # records, within the budget plus SGLang's one padding page.
        assert cap.bytes == cap.tokens * cap.bytes_per_token
        assert cap.bytes <= gb * 1e9 + cap.bytes_per_token
        assert cap.bytes > gb * 1e9 - cap.bytes_per_token
        # The replay's L2 is a real pool of exactly that many tokens.
        assert res.host_tokens == cap.tokens
        assert res.peak_host_used <= res.host_tokens
        expected = _dispatch_cls(cap.host_dtype).__name__
        assert cap.pool_class == res.host_pool_class == expected


def test_qwen3_8b_bytes_per_token_and_committed_allocation(formats):
    caps, alloc, tokens = {}, {}, 2048
    for label, dt in formats.items():
        caps[label] = pools.capacity_at_budget(dt, 8, label=label)
        alloc[label] = pools.allocate_host_pool(
            dt, tokens, pools.QWEN3_8B, commit=True, label=label
        )
    assert caps["bf16"].bytes_per_token == 36 * 8 * 2 * 128 * 2
    assert caps["int8"].bytes_per_token == 36 * 8 * (128 + 128 + 4)
    assert caps["bf16"].tokens == 54_254  # experiment A's capacity
    assert caps["int8"].tokens == 106_838
    for label, a in alloc.items():
        assert a.tokens == tokens
        assert a.bytes == tokens * a.bytes_per_token
        if a.committed:
            assert a.resident_bytes >= a.bytes * 0.99, label
    assert alloc["bf16"].bytes / alloc["int8"].bytes >= 1.93


def test_replay_is_deterministic_for_a_seed(requests):
    again = wl.bench_serving_requests(SMALL)
    assert [r.prompt for r in again] == [r.prompt for r in requests]
    other = wl.bench_serving_requests(SMALL.with_seed(8))
    assert [r.slot for r in other] != [r.slot for r in requests]
    runs = [
        rp.replay("int8", 1400, wl.bench_serving_requests(SMALL), SERVING)
        for _ in range(2)
    ]
    assert runs[0].per_request == runs[1].per_request
    assert runs[0].to_json() == runs[1].to_json()


def test_restores_are_checked_against_what_was_written(sweep):
    for (gb, label), (_, res) in sweep.items():
        assert res.verified_tokens == res.hit_tokens
        assert res.verified_restored_tokens == res.l2_hit_tokens
        if label == "bf16":
            assert res.max_restore_error == 0.0
            continue
        # Lossy where anything came back from L2 (the format really ran).
        assert (res.max_restore_error > 0) == (res.l2_hit_tokens > 0), label
        # Rotated formats spread a block's error over its channels: their
        # bound is per element (tests/test_kv_rotated_codec.py), not per amax.
        if label not in QUANTIZED:
            continue
        bound = INT8_BOUND if label == "int8" else INT4_BOUND
        assert res.max_restore_error <= bound, label
    assert any(res.l2_hit_tokens > 0 for _, res in sweep.values())


@pytest.mark.parametrize("host_dtype", ["auto", *QUANTIZED])
def test_restore_check_catches_corrupted_loads(requests, host_dtype):
    engine = rp.HiCacheReplay(host_dtype, 4000, SERVING)
    host_pool = engine.host_pool
    original = host_pool.load_to_device_per_layer

    def corrupt(device_pool, host_indices, device_indices, layer_id, *a, **kw):
        original(device_pool, host_indices, device_indices, layer_id, *a, **kw)
        rows = device_indices[:1].to(torch.int64)
        device_pool.k_buffer[layer_id][rows] += 1.0

    host_pool.load_to_device_per_layer = corrupt
    try:
        with pytest.raises(AssertionError, match="restored KV differs"):
            engine.run(requests)
    finally:
        engine.close()


def shared_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
def test_sequential_replay_reaches_the_unbounded_hit_rate(requests, host_dtype):
    """One request at a time, an L2 that holds everything, an L1 of about one
    request: SGLang's cache serves every reusable prefix, from L1 or L2."""
    best = wl.best_possible_hit_rate(requests)
    serving = rp.Serving(l1_tokens=1024, concurrency=1, max_prefill_tokens=4096, **COLD)
    res = rp.replay(host_dtype, 16_384, requests, serving, sanity_every=1)
    assert res.hit_rate == pytest.approx(best)
    # The request just before is still in L1 when the next one is matched, so
    # what a request shares with it (its group's system prompt) is an L1 hit;
    # the rest of the reuse has to come back from L2.
    from_previous = sum(
        min(shared_prefix(req.prompt, prev.prompt + prev.output[:-1]),
            req.prompt_len - 1)
        for prev, req in zip(requests, requests[1:])
    )  # fmt: skip
    assert from_previous > 0
    assert res.l1_hit_tokens >= from_previous
    assert res.l2_hit_tokens > 0
    assert res.max_in_flight == 1


def test_concurrency_bounds_requests_in_flight(requests):
    serving = rp.Serving(
        l1_tokens=16_384, concurrency=4, max_prefill_tokens=4096, **COLD
    )
    res = rp.replay("auto", 16_384, requests, serving)
    assert res.max_in_flight == 4
    # Batch-mates cannot reuse each other's prefix (the prefill batch matches
    # before it inserts), so concurrency can only lose hits.
    assert res.hit_rate <= wl.best_possible_hit_rate(requests)


def test_demo_cli_writes_table_json_and_plot(tmp_path, capsys, formats):
    """`make demo`'s replay part end to end, scaled down (lazy pools); its live
    part is tests/test_demo_live.py's."""
    import json

    from scripts.demo.__main__ import main

    out = tmp_path / "results"
    argv = [
        "--groups", "8", "--system-prompt-len", "512", "--question-len", "64",
        "--output-len", "64", "--l1-tokens", "2048", "--concurrency", "4",
        "--budget", "0.4", "--sweep", "0.2", "--tokens", "2048", "--no-commit",
        "--seeds", "2", "--no-live", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "A) Same L2 capacity: 2,048 tokens" in text
    assert "B) Same host budget: --hicache-size 0.4 (GB)" in text
    assert "replay model:" in text  # what is modelled is said in the output
    assert "seeds 42..43 (2)" in text and "+-" in text
    data = json.loads((out / "demo.json").read_text())
    assert data["never_worse"] is True
    assert [f["label"] for f in data["formats"]] == list(formats)
    assert data["page_size"] == 64
    for label, target in (("int8", 1.93), ("int4", 3.5)):
        assert data["summary"][label]["tokens_ratio"] >= target
        assert data["summary"][label]["bytes_ratio"] >= target
    assert set(data["bytes_per_token_by_page_size"]) == set(formats)
    assert "k8v4 vs bf16" in text and "int4 vs bf16" in text
    assert [row["budget_gb"] for row in data["experiment_b"]["sweep"]] == [0.2, 0.4]
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("layout,io_backend", [("page_first", "kernel")])
def test_int8_with_the_server_default_layout_and_io_backend(
    requests, layout, io_backend
):
    """The server's default layout and io backend through UnifiedRadixCache and
    HybridCacheController: the INT8 pool (the flag's dispatch) restores within
    the codec bound, with the default replay configuration's hits."""
    from sglang.srt.runtime_context import get_memory

    cap = pools.capacity_at_budget("int8", BUDGETS_GB[1], label="int8")
    engine = rp.HiCacheReplay(
        "int8", cap.tokens, SERVING, layout=layout, io_backend=io_backend
    )
    try:
        assert get_memory().hicache_host_dtype == "int8"
        assert type(engine.host_pool).__name__ == "MHATokenToKVPoolINT8Host"
        assert engine.host_pool.size == cap.tokens
        assert engine.host_pool.layout == layout
        assert engine.cache.cache_controller.io_backend == io_backend
    finally:
        engine.close()
    results = [
        rp.replay("int8", cap.tokens, requests, SERVING, **options)
        for options in ({}, {"layout": layout, "io_backend": io_backend})
    ]
    base, server_default = results
    assert server_default.l2_hit_tokens > 0
    assert server_default.verified_restored_tokens == server_default.l2_hit_tokens
    assert server_default.max_restore_error <= INT8_BOUND
    assert server_default.hit_tokens == base.hit_tokens


def _pair_of_one_group(requests):
    """Two requests sharing a system prompt, in bench_serving's order."""
    first = requests[0]
    mate = next(r for r in requests[1:] if r.group == first.group)
    return [first, mate]


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_lag_hides_the_last_prefill_from_the_next_admission(requests, overlap):
    """The second request joins the next step (a one-prompt prefill budget): the
    overlap scheduler admits it before the first's result is in the tree, so the
    shared system prompt is recomputed; without it, it hits."""
    pair = _pair_of_one_group(requests)
    serving = rp.Serving(
        l1_tokens=16_384,
        concurrency=2,
        max_prefill_tokens=pair[0].prompt_len,
        overlap_schedule=overlap,
        **COLD,
    )
    res = rp.replay("auto", 16_384, pair, serving, sanity_every=1)
    assert res.prefill_batches == 2
    second_hit = res.per_request[1][1] + res.per_request[1][2]
    if overlap:
        assert second_hit == 0
    else:
        assert second_hit >= SMALL.system_prompt_len


def test_chunked_prefill_splits_steps_and_shares_the_done_chunks(requests):
    """A prompt over several chunks: the chunks done are in the tree before the
    next admission, so a group-mate reuses them even under the overlap lag."""
    pair = _pair_of_one_group(requests)
    chunk = 256
    serving = rp.Serving(
        l1_tokens=16_384, concurrency=2, chunked_prefill_size=chunk, **COLD
    )
    res = rp.replay("auto", 16_384, pair, serving, sanity_every=1)
    assert res.prefill_batches >= -(-pair[0].prompt_len // chunk)
    second_hit = res.per_request[1][1]
    assert 0 < second_hit < pair[0].prompt_len
    assert second_hit % chunk == 0


def test_warmup_is_the_first_request_and_flush_drops_it(requests):
    """bench_serving's warm-up sends the first request: the measured one then finds
    its prompt cached, unless the cache is flushed after the warm-up."""
    first = requests[:1]
    warm = rp.replay("auto", 16_384, first, rp.Serving(l1_tokens=4096))
    assert warm.per_request[0][1] == first[0].prompt_len - 1
    flushed = rp.Serving(l1_tokens=4096, flush_cache=True)
    cold = rp.replay("auto", 16_384, first, flushed)
    assert cold.per_request[0][1:] == (0, 0)


def test_chunked_prefill_defaults_match_the_server_rule():
    """The demo's copy of SGLang's --chunked-prefill-size by GPU memory, against
    the rule's source (running it needs a model)."""
    import inspect
    import re

    from sglang.srt.arg_groups import memory_hook

    source = inspect.getsource(memory_hook.handle_gpu_memory_settings)
    bounds = [int(b) for b in re.findall(r"gpu_mem < (\d+) \* 1024", source)]
    sizes = [int(s) for s in re.findall(r"chunked_prefill_size=(\d+)", source)]
    # One size per bound, then the largest GPUs' size, then the no-GPU fallback.
    expected = list(zip(bounds, sizes)) + [(math.inf, sizes[len(bounds)])]
    assert list(pools.SERVER_CHUNKED_PREFILL_DEFAULTS) == expected
    assert pools.server_chunked_prefill_size(48) == 4096
    assert pools.server_chunked_prefill_size(80) == 8192
