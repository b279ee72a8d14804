"""The quality tests' inputs: WikiText-2 and the packaged SmolLM2 GGUF, and
the few short windows the CPU tests score (the full-size run is `make
quality`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.quality import harness as hq

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXT_FILE = Path(
    os.environ.get(
        "HIQ_WIKITEXT", REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
    )
)
SMALL = dict(windows=2, prefix_len=128, score_len=64, greedy_tokens=8, seed=1)


def require_inputs():
    missing = []
    if not TEXT_FILE.is_file():
        missing.append(f"WikiText-2 at {TEXT_FILE} (set HIQ_WIKITEXT)")
    try:
        hq.smollm_gguf_path()
    except FileNotFoundError as exc:
        missing.append(str(exc))
    if missing:
        if os.environ.get("CI"):
            pytest.fail("quality test inputs missing in CI: " + "; ".join(missing))
        pytest.skip("; ".join(missing))


def tiny_gemma3(tokenizer, path: Path) -> hq.ModelBundle:
    """A tiny random Gemma 3 (one 8-token sliding-window layer, one full), saved
    to `path` with `tokenizer` and loaded as the harness loads a model."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    )
    Gemma3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hq.load_model(str(path))
