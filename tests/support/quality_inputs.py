"""The quality and demo tests' inputs: WikiText-2, the packaged SmolLM2, the
short windows CPU tests score, tiny random models and the host pool dispatch."""

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


def dispatch_cls(host_dtype: str, heads: int, dim: int, v_dim: int, page_size=1):
    """The host pool class --hicache-host-dtype's dispatch picks for BF16 KV."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    kw = dict(device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    device_pool = MHATokenToKVPool(
        64, page_size, torch.bfloat16, heads, dim, layer_num=1, v_head_dim=v_dim, **kw
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info, host_dtype)


def tiny_model(tokenizer, path: Path, kind: str = "gemma3") -> hq.ModelBundle:
    """A tiny random Gemma 3 (one 8-token sliding-window layer, one full) or GQA
    Llama saved to `path`, loaded as the harness loads one."""
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
