"""The patched SGLang server as users run it, live on this CPU machine: BF16
(the stock host pool) via ``python -m sglang.launch_server``, INT8 via
``scripts/hiqcache_serve.sh`` (the image's default command), SmolLM2-135M,
a 4,096-token L1 and twice that on the host. Each arm runs prompt A (1,400
tokens) cold and again (a device hit), four more prompts that evict A to the
host tier, then A again (a host hit, loaded back, counted in /metrics).

A cached pass computes the last prompt token alone, so its CPU arithmetic may
break a near-tie the other way: greedy tokens must equal the cold pass's up
to the first near-tie (MIN_AGREED at least), logprobs within BF16_LOGPROB_TOL
(exact host copies) or INT8_LOGPROB_TOL (one quantization step per head row).
HIQ_LIVE_SERVER=0 skips (each server start costs 40-120 s here).
"""

from __future__ import annotations

import json
import re

import pytest

from scripts.rigs.server import (
    CPU_FLAGS,
    LIVE_ONLY,
    NEW_TOKENS,
    LiveServer,
    details,
    expected_bytes_per_token,
    hicache_flags,
    host_hit_after_overflow,
    run_sequence,
    to_stderr,
)
from tests.support.live import assert_greedy_close, called_ops

pytestmark = LIVE_ONLY

PROMPT_TOKENS = 1400
PROMPTS = 5  # 7,000 tokens: past the 4,096-token L1, inside the 8,192 host
# On these prompts at least this many leading greedy tokens agree.
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
    name = request.param
    spec = ARMS[name]
    server = LiveServer(
        [*CPU_FLAGS, *hicache_flags(spec["host_dtype"])],
        name=f"live-{name}",
        via=spec["via"],
        model=model_dir,
        env=spec["env"],
        progress=to_stderr,
    )
    with server:
        seq = run_sequence(server, prompts)
        server.save_replies(seq)
        yield name, spec, server, seq


def test_startup_names_host_format_and_bytes_per_token(arm, model_dir):
    name, spec, server, seq = arm
    log = server.log_text()
    expected = expected_bytes_per_token(spec["host_dtype"], model_dir)
    metrics = seq["m0"]
    assert metrics.value("sglang:hicache_host_bytes_per_token") == expected
    info = metrics.samples("sglang:hicache_host_info")
    assert len(info) == 1, info
    labels = info[0][0]
    assert labels["host_dtype"] == ("int8" if spec["host_dtype"] else "bfloat16")
    assert labels["layout"] == "layer_first" and labels["io_backend"] == "direct"
    # The pool's size line: tokens and GB agree with bytes/token (2 decimals).
    sized = re.search(r"KV host pool: (\d+) tokens, ([\d.]+) GB host memory", log)
    assert sized, "no host pool size line in the start-up log"
    tokens, gb = int(sized[1]), float(sized[2])
    assert abs(tokens * expected / 1e9 - gb) <= 0.005
    if spec["host_dtype"] == "int8":
        assert "HiCache host KV dtype: int8" in log
        assert "HiCache kv host format: int8 (int8-fp16scale-v1)" in log
        assert f"stores INT8 KV: {expected} B/token" in log
    else:
        # The stock pool logs no format line; /metrics names it (above).
        assert "host format" not in log


def test_host_kv_quality_metrics(arm, model_dir):
    """The per-layer scale amax and the restore check's histogram, read from
    the live server's /metrics after the sequence's backups."""
    _, spec, _, seq = arm
    metrics = seq["m3"]
    amax = metrics.samples("sglang:hicache_host_scale_amax")
    errors = "sglang:hicache_host_verify_relative_error"
    if spec["host_dtype"] is None:
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


def test_repeated_long_prompt_is_a_device_hit(arm):
    _, _, _, seq = arm
    assert seq["first"]["meta_info"]["cached_tokens"] == 0
    repeat = seq["repeat"]["meta_info"]
    # The last prompt token is always recomputed to produce logits.
    assert repeat["cached_tokens"] == PROMPT_TOKENS - 1
    assert details(seq["repeat"]).get("device") == PROMPT_TOKENS - 1
    assert details(seq["repeat"]).get("host", 0) == 0


def test_reuse_after_l1_overflow_is_a_host_hit_counted_in_metrics(arm):
    _, _, _, seq = arm
    host = host_hit_after_overflow(seq, PROMPT_TOKENS)
    assert seq["reuse"]["meta_info"]["cached_tokens"] == PROMPT_TOKENS - 1
    assert details(seq["reuse"])["device"] + host == PROMPT_TOKENS - 1


def test_metrics_agree_with_responses(arm):
    _, _, _, seq = arm
    m0, m3 = seq["m0"], seq["m3"]
    replies = [seq["first"], seq["repeat"], *seq["others"], seq["reuse"]]
    for source in ("device", "host"):
        from_replies = sum(details(r).get(source, 0) for r in replies)
        name = "sglang:cached_tokens_total"
        counted = m3.value(name, cache_source=source) - m0.value(
            name, cache_source=source
        )
        assert counted == from_replies, source
    prompt = m3.value("sglang:prompt_tokens_total") - m0.value(
        "sglang:prompt_tokens_total"
    )
    assert prompt == sum(r["meta_info"]["prompt_tokens"] for r in replies)


def test_greedy_output_after_load_back(arm):
    name, _, _, seq = arm
    first, repeat, reuse = seq["first"], seq["repeat"], seq["reuse"]
    assert len(reuse["output_ids"]) == NEW_TOKENS
    assert_greedy_close(first, repeat, MIN_AGREED, BF16_LOGPROB_TOL)
    tol = INT8_LOGPROB_TOL if name == "int8" else BF16_LOGPROB_TOL
    assert_greedy_close(first, reuse, MIN_AGREED, tol)


def test_sgl_kernel_stand_in_loaded_and_never_called(arm):
    _, _, server, _ = arm
    events = server.kernel_calls()
    # The launcher, tokenizer manager and scheduler import it (at least two).
    assert len({e["pid"] for e in events if e["event"] == "load"}) >= 2, events
    assert called_ops(events) == set()
