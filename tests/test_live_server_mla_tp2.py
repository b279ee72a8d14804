"""MLA host dedup on the live CPU server at TP=2 (a tiny random DeepSeek-V3, int8): a
host hit after L1 overflow is decoded on TP0 and broadcast to TP1 with the first pass's
greedy tokens; /metrics say TP0 holds the host bytes. HIQ_LIVE_MLA_TP2=0 skips it."""

from __future__ import annotations

import os
import re

import pytest

from scripts.rigs.mla_model import DEEPSEEK_V3_TINY, deepseek_v3_tiny_dir
from scripts.rigs.model import stdlib_prompts
from scripts.rigs.server import (
    CPU_FLAGS,
    LIVE_ONLY,
    NEW_TOKENS,
    SPEC_ENV,
    LiveServer,
    hicache_flags,
    host_hit_after_overflow,
    run_sequence,
    to_stderr,
    tp_env,
)
from tests.support.live import assert_greedy_close, called_ops

pytestmark = [
    LIVE_ONLY,
    pytest.mark.skipif(
        os.environ.get("HIQ_LIVE_MLA_TP2") == "0",
        reason="HIQ_LIVE_MLA_TP2=0",
    ),
]

TP = 2
PROMPT_TOKENS = 600
PROMPTS = 5  # 3,000 tokens: past the 2,048-token L1, inside the 4,096 host
L1_TOKENS = 2048
# int8 latent rounding may move a logprob (the hybrid test's bound); every
# greedy token must agree unless one pass sat at a near-tie.
MIN_AGREED = NEW_TOKENS
INT8_LOGPROB_TOL = 0.3
# The stand-in ops the intel_amx backend may call (scripts/rigs/standins.py).
ATTENTION_OPS = {"decode_attention_cpu", "extend_attention_cpu"}
# int8 MLA host row per layer: the latent as int8 with one FP16 scale per
# 128-value tile, RoPE kept in BF16.
LATENT = DEEPSEEK_V3_TINY["kv_lora_rank"]
ROPE = DEEPSEEK_V3_TINY["qk_rope_head_dim"]
BYTES_PER_TOKEN = DEEPSEEK_V3_TINY["num_hidden_layers"] * (
    LATENT + 2 * (LATENT // 128) + 2 * ROPE
)


def server_args() -> list[str]:
    return [
        *CPU_FLAGS,
        *hicache_flags("int8"),
        # After CPU_FLAGS, so these win. torch_native cannot run an MLA prefill (it
        # reads K from the pool, which holds the latent: docs/mla-dedup.md), so
        # intel_amx with its ops' torch stand-ins (HIQ_SGL_KERNEL_TORCH_OPS=1).
        "--attention-backend",
        "intel_amx",
        "--max-total-tokens",
        str(L1_TOKENS),
        "--tp",
        str(TP),
        "--enable-mla-hicache-host-dedup",
        "--enable-metrics-for-all-schedulers",
    ]


@pytest.fixture(scope="module")
def seq():
    model_dir = deepseek_v3_tiny_dir()
    prompts = stdlib_prompts(model_dir, PROMPTS, PROMPT_TOKENS)
    with LiveServer(
        server_args(),
        name="live-mla-tp2",
        model=model_dir,
        env={**SPEC_ENV, **tp_env(TP)},
        progress=to_stderr,
    ) as server:
        out = run_sequence(server, prompts)
        out["log"] = server.log_text()
        out["kernel_calls"] = server.kernel_calls()
    server.save_replies(out)
    return out


def test_startup_tp0_holds_the_host_pool_tp1_allocator_only(seq):
    log = seq["log"]
    held = dict(re.findall(r"TP(\d)\] --enable-mla-hicache-host-dedup: (.*)", log))
    assert set(held) == {"0", "1"}, held
    assert "of host KV (source)" in held["0"], held["0"]
    assert "holds 0 GB of host KV (allocator-only)" in held["1"], held["1"]
    assert f"attention-TP group of {TP} ranks" in held["1"]
    assert re.search(r"TP1\] MLATokenToKVPoolHost dummy mode: allocator-only", log)
    expected = f"stores INT8 KV: {BYTES_PER_TOKEN} B/token"
    assert re.search(rf"TP0\] HiCache kv MLA host pool {expected}", log), expected


def test_reuse_after_l1_overflow_is_a_host_hit_with_the_first_greedy_tokens(seq):
    host_hit_after_overflow(seq, PROMPT_TOKENS)
    first, reuse = seq["first"], seq["reuse"]
    assert len(reuse["output_ids"]) == NEW_TOKENS
    # TP1's heads attend over the layers TP0 decoded and broadcast: a peer
    # that missed them would attend over other prompts' rows.
    assert_greedy_close(first, reuse, MIN_AGREED, INT8_LOGPROB_TOL)


def test_metrics_one_rank_holds_the_host_bytes(seq):
    m3 = seq["m3"]
    info = {
        labels["tp_rank"]: (labels["host_copy"], labels["host_copy_ranks"])
        for labels, _ in m3.samples("sglang:hicache_host_info")
    }
    assert info == {"0": ("source", str(TP)), "1": ("peer", str(TP))}, info
    used = {r: m3.value("sglang:hicache_host_used_bytes", tp_rank=r) for r in "01"}
    assert used["0"] >= PROMPT_TOKENS * BYTES_PER_TOKEN and used["1"] == 0, used
    per_token = {
        r: m3.value("sglang:hicache_host_bytes_per_token", tp_rank=r) for r in "01"
    }
    assert per_token == {"0": BYTES_PER_TOKEN, "1": 0}, per_token


def test_only_the_attention_standins_were_called(seq):
    assert called_ops(seq["kernel_calls"]) <= ATTENTION_OPS
