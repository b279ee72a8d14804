"""Every host layout / io backend pair the live CPU server can run, per format.

Opt-in (HIQ_LIVE_MATRIX=1): one server start per pair, about 2-4 minutes each
here. Each pair runs prompt A cold, two more 1,400-token prompts that push A
out of the 4,096-token L1, then A again: a host hit whose greedy tokens equal
the cold pass (BF16 exactly, INT8 as stated in test_live_server.py).

The stock BF16 pool's ``kernel`` io backend calls sgl_kernel.kvcacheio ops,
which exist only with CUDA; scripts/rigs/standins.py has pure-torch
stand-ins of the four it calls for layer_first and page_first, bound by
scripts/rigs/cpu_site/sitecustomize.py. Pairs left out, and why:

- ``page_head`` (BF16, kernel): its two ops have no stand-in here yet.
- ``page_first_direct`` with ``kernel`` and ``page_first`` with ``direct``:
  SGLang's own argument resolution rewrites them to page_first_direct with
  direct (hicache_hook.resolve_layout_io_compatibility), a pair listed here.
- ``layer_first`` with ``direct``: covered by test_live_server.py.

Run here on 2026-12-01: bf16 and int8 with page_first + kernel (SGLang's
defaults) passed, 18 min for the two under load 20-30; the other four pairs
(layer_first + kernel, page_first_direct + direct, bf16 and int8) passed in
2 min 33 s at load about 2. Command:
HIQ_LIVE_MATRIX=1 PYTHONPATH=build/sglang/python .venv/bin/python -m pytest -q tests/test_live_server_matrix.py
"""

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

PAIRS = [
    # (host dtype, layout, io backend)
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
