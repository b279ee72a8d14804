"""The quality tests' inputs (WikiText-2, the packaged SmolLM2 GGUF), the short
windows the CPU tests score (`make quality` is the full-size run) and tiny
random models."""

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


def tiny_model(tokenizer, path: Path, kind: str = "gemma3") -> hq.ModelBundle:
    """A tiny random model saved to `path` with `tokenizer`, loaded as the harness
    loads one: Gemma 3 (one 8-token sliding-window layer, one full) or Llama
    (GQA: 4 query heads, 2 KV heads)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128)
    if kind == "gemma3":
        config = tf.Gemma3TextConfig(
            **shape,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=256,
        )
        model = tf.Gemma3ForCausalLM(config)
    else:
        config = tf.LlamaConfig(
            **shape,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        )
        model = tf.LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hq.load_model(str(path))
