"""The demo's requests are bench_serving's (scripts/demo/workload.py): its
generated-shared-prefix generator in text mode, with SmolLM2's real tokenizer and
bench_serving's seeding, in the order bench_serving sends them."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from scripts.demo import workload as wl

SMALL = wl.Workload(
    num_groups=4,
    prompts_per_group=3,
    system_prompt_len=48,
    question_len=16,
    output_len=20,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from scripts.quality.harness import smollm_gguf_path

    gguf = smollm_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _bench_serving_text_rows(workload, tokenizer, ordered):
    """bench_serving's main before the run: seed random and numpy, build the rows."""
    module = wl.generator_module()
    random.seed(workload.seed)
    np.random.seed(workload.seed)
    return module.sample_generated_shared_prefix_requests(
        num_groups=workload.num_groups,
        prompts_per_group=workload.prompts_per_group,
        system_prompt_len=workload.system_prompt_len,
        question_len=workload.question_len,
        output_len=workload.output_len,
        range_ratio=1.0,
        tokenizer=tokenizer,
        seed=workload.seed,
        ordered=ordered,
    )


def test_sampling_leaves_the_real_datasets_package_importable(monkeypatch):
    # A stand-in package left in sys.modules broke bench_serving's import of
    # the real one later in the same process (tests/test_upstream_unit.py).
    for key in [k for k in sys.modules if k.split(".")[:3] == wl.DATASETS.split(".")]:
        monkeypatch.delitem(sys.modules, key)
    assert wl.bench_serving_requests(SMALL)
    assert wl.DATASETS not in sys.modules
    from sglang.benchmark.datasets import DatasetRow

    assert DatasetRow.__module__ == f"{wl.DATASETS}.common"


def test_default_seed_and_seeding_are_bench_servings():
    import sglang.benchmark

    # Read, not imported: serving.py imports every dataset's dependencies.
    source = (Path(sglang.benchmark.__file__).parent / "serving.py").read_text()
    assert '"--seed", type=int, default=42' in source
    assert "random.seed(args.seed)\n    np.random.seed(args.seed)" in source
    assert wl.Workload().seed == wl.BENCH_SERVING_SEED == 42


def test_order_and_lengths_equal_bench_serving_text_mode(
    tokenizer, tmp_path, monkeypatch
):
    workload = SMALL.with_seed(7)  # not the default: the seed reaches the generator
    module = wl.generator_module()
    cache = tmp_path / "gsp.pkl"
    monkeypatch.setattr(module, "get_gen_prefix_cache_path", lambda *a, **k: cache)
    slot_of = {
        row.prompt: slot
        for slot, row in enumerate(_bench_serving_text_rows(workload, tokenizer, True))
    }
    cache.unlink()
    sent = _bench_serving_text_rows(workload, tokenizer, False)
    requests = wl.bench_serving_requests(workload)
    assert [r.slot for r in requests] == [slot_of[row.prompt] for row in sent]
    # Shuffled, not the generator's order.
    assert [r.slot for r in requests] != sorted(r.slot for r in requests)
    assert [len(r.output) for r in requests] == [row.output_len for row in sent]
    for req in requests:
        assert req.group == req.slot // SMALL.prompts_per_group
        assert req.prompt_len == SMALL.system_prompt_len + SMALL.question_len
    by_group = {}
    for req in requests:
        by_group.setdefault(req.group, set()).add(
            tuple(req.prompt[: SMALL.system_prompt_len])
        )
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == SMALL.num_groups


def test_warmup_request_is_the_first_with_32_output_tokens():
    for output_len in (20, 40):  # under and over bench_serving's cap of 32
        workload = wl.Workload(**{**vars(SMALL), "output_len": output_len})
        requests = wl.bench_serving_requests(workload)
        warm = wl.warmup_request(requests)
        assert warm.prompt == requests[0].prompt
        assert len(warm.output) == min(output_len, 32)
