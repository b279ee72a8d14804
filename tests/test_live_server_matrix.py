"""Every host layout / io backend pair the live CPU server runs, per format
(opt-in, HIQ_LIVE_MATRIX=1, one start each; the stock pool's kernel io backend
on kvcacheio stand-ins): a host hit with the cold pass's greedy tokens."""

from __future__ import annotations

import os
import sys

import pytest

from scripts.rigs.model import smollm2_dir, stdlib_prompts
from scripts.rigs.server import CPU_FLAGS, LiveServer, hicache_flags, to_stderr

pytestmark = pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_MATRIX") != "1", reason="HIQ_LIVE_MATRIX=1"
)

PROMPT_TOKENS = 1400
NEW_TOKENS = 6

# (host dtype, layout, io backend); left out: page_head (no stand-in), pairs
# SGLang rewrites, layer_first + direct (tests/test_live_server.py).
PAIRS = [
    (None, "layer_first", "kernel"),
    (None, "page_first", "kernel"),
    (None, "page_first_direct", "direct"),
    ("int8", "layer_first", "kernel"),
    ("int8", "page_first_direct", "direct"),
    ("int8", "page_first", "kernel"),
]


@pytest.mark.parametrize(
    "host_dtype,layout,io_backend",
    PAIRS,
    ids=[f"{d or 'bf16'}-{lay}-{io}" for d, lay, io in PAIRS],
)
def test_pair_serves_host_hits_with_first_pass_tokens(host_dtype, layout, io_backend):
    model = smollm2_dir()
    prompts = stdlib_prompts(model, 3, PROMPT_TOKENS)
    flags = hicache_flags(host_dtype, layout=layout, io_backend=io_backend)
    name = f"pair-{host_dtype or 'bf16'}-{layout}-{io_backend}"
    server = LiveServer(
        [*CPU_FLAGS, *flags],
        name=name,
        model=model,
        progress=to_stderr,
    )
    with server:
        info = server.metrics().samples("sglang:hicache_host_info")[0][0]
        print(f"{name}: ran as {info}", file=sys.stderr)
        assert (info["layout"], info["io_backend"]) == (layout, io_backend)

        def gen(ids):
            return server.generate(input_ids=ids, max_new_tokens=NEW_TOKENS)

        first = gen(prompts[0])
        for p in prompts[1:]:
            gen(p)
        reuse = gen(prompts[0])
        calls = [e for e in server.kernel_calls() if e["event"] == "call"]
    host = (reuse["meta_info"].get("cached_tokens_details") or {}).get("host", 0)
    assert host > 0, reuse["meta_info"]
    assert reuse["output_ids"] == first["output_ids"]
    assert calls == []
