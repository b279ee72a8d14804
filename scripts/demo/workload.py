"""The demo's requests: exactly those of SGLang's bench_serving (its own generator,
seeded as `--seed S` seeds it; tests/test_workload.py checks the order)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import random
import sys
import tempfile
import types
from array import array
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

# bench_serving's defaults: --seed 42, and the warm-up's output cap.
BENCH_SERVING_SEED = 42
WARMUP_OUTPUT_CAP = 32
QWEN3_VOCAB_SIZE = 151_669  # len(Qwen3 tokenizer.get_vocab()), ids 0..151668


@dataclass(frozen=True)
class Workload:
    """bench_serving `--dataset-name generated-shared-prefix`, by its flags."""

    num_groups: int = 32
    prompts_per_group: int = 4
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    seed: int = BENCH_SERVING_SEED
    ordered: bool = False
    vocab_size: int = QWEN3_VOCAB_SIZE

    @property
    def num_requests(self) -> int:
        return self.num_groups * self.prompts_per_group

    def with_seed(self, seed: int) -> Workload:
        return Workload(**{**vars(self), "seed": seed})

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


@dataclass
class Request:
    rid: int
    group: int  # the generator's group (system prompt) index
    slot: int  # position in the generator's unshuffled order
    prompt: array  # token ids ('q')
    output: array

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


class VocabOnlyTokenizer:
    """What the generator reads from a tokenizer in token-id mode: the vocab.
    Ids 0..vocab_size-1, as Qwen3's tokenizer has them."""

    def __init__(self, vocab_size: int):
        self._vocab = {f"<{i}>": i for i in range(vocab_size)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


DATASETS = "sglang.benchmark.datasets"


def generator_module():
    """generated_shared_prefix without its package's __init__ (it needs HF datasets)."""
    if DATASETS not in sys.modules:
        import sglang.benchmark

        package = types.ModuleType(DATASETS)
        package.__path__ = [str(Path(sglang.benchmark.__file__).parent / "datasets")]
        sys.modules[DATASETS] = package
    return importlib.import_module(f"{DATASETS}.generated_shared_prefix")


def drop_stand_in_datasets() -> None:
    """Forget generator_module's stand-in package, so that a later import of
    sglang.benchmark.datasets (bench_serving's) gets the real one."""
    package = sys.modules.get(DATASETS)
    if package is not None and not hasattr(package, "get_dataset"):
        for key in [k for k in sys.modules if k.split(".")[:3] == DATASETS.split(".")]:
            del sys.modules[key]


@contextlib.contextmanager
def private_generator(module, log=None) -> Iterator[None]:
    """The generator pickles its output under ~/.cache/sglang; keep that
    cache in a temporary directory so runs leave nothing behind, and what it
    prints in `log` (dropped without one)."""
    saved, log = module.get_gen_prefix_cache_path, log or io.StringIO()
    with (
        tempfile.TemporaryDirectory() as tmp,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        module.get_gen_prefix_cache_path = lambda *a, **k: Path(tmp) / "gsp.pkl"
        try:
            yield
        finally:
            module.get_gen_prefix_cache_path = saved
            drop_stand_in_datasets()


def sample_rows(workload: Workload, tokenizer, *, ordered: bool, input_ids: bool):
    """SGLang's generator, seeded as bench_serving seeds it (random.seed and
    np.random.seed with --seed, right before the dataset is built)."""
    module = generator_module()
    random.seed(workload.seed)
    np.random.seed(workload.seed)
    with private_generator(module):
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
            input_ids=input_ids,
        )


def sent_rows(workload: Workload, tokenizer, *, input_ids: bool) -> list[tuple]:
    """(slot, row) per request sent, in order; the slot from the unshuffled order."""
    sample = functools.partial(sample_rows, workload, tokenizer, input_ids=input_ids)
    ordered, sent = sample(ordered=True), sample(ordered=workload.ordered)

    def key(row):
        return tuple(row.prompt) if input_ids else row.prompt

    slot_of = {key(row): slot for slot, row in enumerate(ordered)}
    if len(slot_of) != len(ordered):
        raise ValueError("generated prompts are not distinct; cannot name slots")
    return [(slot_of[key(row)], row) for row in sent]


def bench_serving_requests(workload: Workload) -> list[Request]:
    """bench_serving's requests for `workload` in send order (outputs random ids)."""
    rows = sent_rows(workload, VocabOnlyTokenizer(workload.vocab_size), input_ids=True)
    per_group = workload.prompts_per_group
    rows = [(slot // per_group, slot, r.prompt, r.output_len) for slot, r in rows]
    return with_outputs(rows, workload.seed, workload.vocab_size)


def with_outputs(rows, seed: int, vocab_size: int) -> list[Request]:
    """Requests from (group, slot, prompt ids, output length) rows in send
    order, each output drawn in turn from one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    requests = []
    for rid, (group, slot, ids, n) in enumerate(rows):
        output = rng.integers(0, vocab_size, n).tolist()
        requests.append(Request(rid, group, slot, array("q", ids), array("q", output)))
    return requests


def warmup_request(requests: Sequence[Request]) -> Request:
    """bench_serving's warm-up: its first request, output capped at 32."""
    return replace(requests[0], rid=-1, output=requests[0].output[:WARMUP_OUTPUT_CAP])


def prefix_hashes(ids) -> list[int]:
    """A polynomial hash of every prefix of `ids`: equal prefixes, equal hashes."""
    mod, base = (1 << 61) - 1, 1_000_003
    out, h = [], 0
    for token in ids:
        h = (h * base + token + 1) % mod
        out.append(h)
    return out


def best_possible_hit_rate(requests: Sequence[Request]) -> float:
    """Hit rate with an unbounded cache and no concurrency."""
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
