"""The patched server as users run it on CPU (SmolLM2-135M, 4,096-token L1,
twice that on host): BF16 via launch_server, INT8 via scripts/hiqcache_serve.sh;
device and host hits, /metrics, greedy tokens. HIQ_LIVE_SERVER=0 skips."""

from __future__ import annotations

import json
import re

import pytest

from scripts.rigs.server import (
    CPU_FLAGS,
    LIVE_ONLY,
    NEW_TOKENS,
    details,
    expected_bytes_per_token,
    hicache_flags,
    host_hit_after_overflow,
)
from tests.support.live import assert_greedy_close, called_ops, serve

pytestmark = LIVE_ONLY

PROMPT_TOKENS = 1400
PROMPTS = 5  # 7,000 tokens: past the 4,096-token L1, inside the 8,192 host
# A cached pass computes the last prompt token alone, so CPU arithmetic may
# break a near-tie the other way: tokens agree up to it, at least this many.
MIN_AGREED = 4
# Largest |logprob| change of a generated token between the cold pass and a
# cached pass: BF16 (exact host copies) and after an INT8 load-back.
BF16_LOGPROB_TOL = 0.05
INT8_LOGPROB_TOL = 0.25

# The INT8 arm decodes every backed-up page again (the sampled restore check).
VERIFY_EVERY_PAGE = {"SGLANG_HICACHE_VERIFY_SAMPLE_RATE": "1"}
ARMS = {
    "bf16": dict(host_dtype=None, via="launch_server", env=None),
    "int8": dict(host_dtype="int8", via="hiqcache_serve", env=VERIFY_EVERY_PAGE),
}


@pytest.fixture(scope="module", params=sorted(ARMS))
def arm(request, model_dir, prompts):
    spec = ARMS[request.param]
    flags = [*CPU_FLAGS, *hicache_flags(spec["host_dtype"])]
    name = f"live-{request.param}"
    seq = serve(flags, name, model_dir, prompts, env=spec["env"], via=spec["via"])
    return request.param, spec["host_dtype"], seq


def test_startup_names_host_format_and_bytes_per_token(arm, model_dir):
    _, host_dtype, seq = arm
    log, metrics = seq["log"], seq["m0"]
    expected = expected_bytes_per_token(host_dtype, model_dir)
    assert metrics.value("sglang:hicache_host_bytes_per_token") == expected
    info = metrics.samples("sglang:hicache_host_info")
    assert len(info) == 1, info
    labels = info[0][0]
    assert labels["host_dtype"] == (host_dtype or "bfloat16")
    assert labels["layout"] == "layer_first" and labels["io_backend"] == "direct"
    # The pool's size line: tokens and GB agree with bytes/token (2 decimals).
    sized = re.search(r"KV host pool: (\d+) tokens, ([\d.]+) GB host memory", log)
    assert sized, "no host pool size line in the start-up log"
    assert abs(int(sized[1]) * expected / 1e9 - float(sized[2])) <= 0.005
    if host_dtype == "int8":
        assert "HiCache host KV dtype: int8" in log
        assert "HiCache kv host format: int8 (int8-fp16scale-v1)" in log
        assert f"stores INT8 KV: {expected} B/token" in log
    else:
        assert "host format" not in log  # the stock pool logs no format line


def test_host_kv_quality_metrics(arm, model_dir):
    """The per-layer scale amax and the restore check's histogram on /metrics."""
    _, host_dtype, seq = arm
    metrics = seq["m3"]
    amax = metrics.samples("sglang:hicache_host_scale_amax")
    errors = "sglang:hicache_host_verify_relative_error"
    if host_dtype is None:
        assert amax == [] and not metrics.has(f"{errors}_count")
        return
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert {(s["layer"], s["kv"]) for s, _ in amax} == {
        (str(layer), kv) for layer in range(layers) for kv in "kv"
    }
    assert all(0 < value < 1e4 for _, value in amax), amax
    checked = metrics.value(f"{errors}_count", format="int8")
    assert checked > 0
    # Every page restored within INT8's threshold.
    assert metrics.value(f"{errors}_bucket", format="int8", le="0.004") == checked


def test_device_hit_then_host_hit_after_l1_overflow(arm):
    seq = arm[2]
    assert seq["first"]["meta_info"]["cached_tokens"] == 0
    # The last prompt token is always recomputed to produce logits.
    assert seq["repeat"]["meta_info"]["cached_tokens"] == PROMPT_TOKENS - 1
    assert details(seq["repeat"]).get("device") == PROMPT_TOKENS - 1
    assert details(seq["repeat"]).get("host", 0) == 0
    host = host_hit_after_overflow(seq, PROMPT_TOKENS)
    assert seq["reuse"]["meta_info"]["cached_tokens"] == PROMPT_TOKENS - 1
    assert details(seq["reuse"])["device"] + host == PROMPT_TOKENS - 1


def test_metrics_agree_with_responses(arm):
    seq = arm[2]
    m0, m3 = seq["m0"], seq["m3"]
    replies = [seq["first"], seq["repeat"], *seq["others"], seq["reuse"]]
    for source in ("device", "host"):
        name = "sglang:cached_tokens_total"
        counted = m3.value(name, cache_source=source) - m0.value(
            name, cache_source=source
        )
        assert counted == sum(details(r).get(source, 0) for r in replies), source
    name = "sglang:prompt_tokens_total"
    prompt = m3.value(name) - m0.value(name)
    assert prompt == sum(r["meta_info"]["prompt_tokens"] for r in replies)


def test_greedy_output_after_load_back(arm):
    _, host_dtype, seq = arm
    first, repeat, reuse = seq["first"], seq["repeat"], seq["reuse"]
    assert len(reuse["output_ids"]) == NEW_TOKENS
    assert_greedy_close(first, repeat, MIN_AGREED, BF16_LOGPROB_TOL)
    tol = INT8_LOGPROB_TOL if host_dtype == "int8" else BF16_LOGPROB_TOL
    assert_greedy_close(first, reuse, MIN_AGREED, tol)


def test_sgl_kernel_stand_in_loaded_and_never_called(arm):
    events = arm[2]["kernel_calls"]
    # The launcher, tokenizer manager and scheduler import it (at least two).
    assert len({e["pid"] for e in events if e["event"] == "load"}) >= 2, events
    assert called_ops(events) == set()
