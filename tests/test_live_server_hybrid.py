"""A tiny random gpt-oss (window 128, tests/support/hybrid_model.py) on the live
CPU server: full and SWA KV pools, each with an encoded host pool, on intel_amx
attention stand-ins. HIQ_LIVE_HYBRID_FULL=1 adds BF16; HIQ_LIVE_SERVER=0 skips."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.support.hybrid_model import GPT_OSS_TINY, SLIDING_WINDOW, gpt_oss_tiny_dir
from scripts.rigs.prom import diff
from scripts.rigs.server import (
    CPU_FLAGS,
    LIVE_ONLY,
    NEW_TOKENS,
    SPEC_ENV,
    details,
    hicache_flags,
    output_logprobs,
)
from tests.support.live import assert_greedy_close, called_ops, serve

pytestmark = LIVE_ONLY
FULL = os.environ.get("HIQ_LIVE_HYBRID_FULL") == "1"

PROMPT_TOKENS = 600
PROMPTS = 5  # 3,000 tokens: past the 2,048-token L1, inside the 4,096 host
L1_TOKENS = 2048
# After an INT8 load-back (measured: all 8 agree, logprobs move 0.20; a
# random model is more sensitive to KV rounding than a trained one).
MIN_AGREED = 4
INT8_LOGPROB_TOL = 0.3
# The host pools SGLang builds for a hybrid SWA model, by pool label.
POOLS = ("full", "swa")
LAYERS = {
    "full": GPT_OSS_TINY["layer_types"].count("full_attention"),
    "swa": GPT_OSS_TINY["layer_types"].count("sliding_attention"),
}
# The stand-in ops the intel_amx backend may call (scripts/rigs/standins.py).
ATTENTION_OPS = {"decode_attention_cpu", "extend_attention_cpu"}

ARMS = {"bf16": None} if FULL else {}
ARMS["int8"] = "int8"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return gpt_oss_tiny_dir()


@pytest.fixture(scope="module", params=list(ARMS))
def arm(request, model_dir, prompts):
    name = request.param
    # gpt-oss passes attention sinks, which torch_native does not take:
    # intel_amx after CPU_FLAGS wins, SPEC_ENV brings its AMX op stand-ins.
    flags = [*CPU_FLAGS, *hicache_flags(ARMS[name])]
    flags += ["--attention-backend", "intel_amx", "--max-total-tokens", str(L1_TOKENS)]
    seq = serve(flags, f"live-hybrid-{name}", model_dir, prompts, env=SPEC_ENV)
    return name, ARMS[name], seq


def bytes_per_token(host_dtype: str | None, pool: str) -> int:
    rows = LAYERS[pool] * 2 * GPT_OSS_TINY["num_key_value_heads"]
    head_dim = GPT_OSS_TINY["head_dim"]
    if host_dtype is None:
        return rows * head_dim * 2  # BF16 K and V rows
    return rows * (head_dim + 2)  # INT8: one FP16 scale per head row


def test_startup_builds_hybrid_swa_pools_in_the_arm_format(arm):
    _, host_dtype, seq = arm
    log = seq["log"]
    assert "Hybrid SWA model detected. architectures=['GptOssForCausalLM']" in log
    assert "Use sliding window memory pool. full_layer_tokens=2048" in log
    allocated = re.findall(r"Allocating (\w+) hierarchical KV host pool", log)
    assert sorted(allocated) == sorted(POOLS), allocated
    formats = dict(re.findall(r"HiCache (\w+) host format: (\w+)", log))
    if host_dtype is None:
        assert formats == {}, formats  # the stock pools log no format line
    else:
        assert formats == {pool: host_dtype for pool in POOLS}, formats
        for pool in POOLS:
            expected = bytes_per_token(host_dtype, pool)
            assert (
                f"HiCache {pool} host pool stores INT8 KV: {expected} B/token" in log
            ), pool
    metrics = seq["m0"]
    info = metrics.samples("sglang:hicache_host_info")
    # /metrics reports the full-attention host pool (the one radix hits count).
    assert [labels["host_dtype"] for labels, _ in info] == [host_dtype or "bfloat16"]
    assert metrics.value("sglang:hicache_host_bytes_per_token") == bytes_per_token(
        host_dtype, "full"
    )


def test_device_hit_then_host_hit_with_load_back_after_l1_overflow(arm):
    _, _, seq = arm
    assert seq["first"]["meta_info"]["cached_tokens"] == 0
    assert details(seq["repeat"]) == {"device": PROMPT_TOKENS - 1, "host": 0}
    m1, m2, m3 = seq["m1"], seq["m2"], seq["m3"]
    evicted = diff(m2, m1, "sglang:evicted_tokens_total")
    assert evicted > 0, "four more prompts did not overflow L1"
    assert seq["reuse"]["meta_info"]["cached_tokens"] == PROMPT_TOKENS - 1
    assert details(seq["reuse"]) == {"device": 0, "host": PROMPT_TOKENS - 1}
    # The full pool restores every cached token, the SWA pool only those the
    # next token's window reaches (the window holds the recomputed last one).
    loaded = {
        pool: diff(m3, m2, "sglang:load_back_tokens_total", pool=pool)
        for pool in ("kv", "swa")
    }
    assert loaded == {"kv": PROMPT_TOKENS - 1, "swa": SLIDING_WINDOW - 1}, loaded
    host = diff(m3, m2, "sglang:cached_tokens_total", cache_source="host")
    assert host == PROMPT_TOKENS - 1


def test_greedy_output_after_load_back(arm):
    _, host_dtype, seq = arm
    first, repeat, reuse = seq["first"], seq["repeat"], seq["reuse"]
    assert len(reuse["output_ids"]) == NEW_TOKENS
    # A device hit reads the very pages the cold pass wrote.
    assert repeat["output_ids"] == first["output_ids"]
    assert output_logprobs(repeat) == output_logprobs(first)
    if host_dtype is None:
        # BF16 host pages are exact copies of both pools' device rows.
        assert reuse["output_ids"] == first["output_ids"]
        assert output_logprobs(reuse) == output_logprobs(first)
        return
    agreed, worst = assert_greedy_close(first, reuse, MIN_AGREED, INT8_LOGPROB_TOL)
    print(
        f"[hybrid int8] {agreed}/{NEW_TOKENS} agree, worst {worst:.3f}", file=sys.stderr
    )


def test_only_the_attention_stand_ins_ran(arm):
    # Both ran (prefill and decode); nothing else was called on the stand-in.
    assert called_ops(arm[2]["kernel_calls"]) == ATTENTION_OPS
