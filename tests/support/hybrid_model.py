"""A tiny random-weight gpt-oss (sliding-window + full attention) folder for the live
CPU server."""

from __future__ import annotations

from pathlib import Path

from scripts.rigs.model import REPO_ROOT, _cached, smollm2_dir

HYBRID_ROOT = REPO_ROOT / "build" / "hybrid-models"
SLIDING_WINDOW = 128
# Changing any field (or the seed) must change VERSION, the cache key.
VERSION = "3"
SEED = 0
GPT_OSS_TINY = {
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    "hidden_size": 256,
    "intermediate_size": 256,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": SLIDING_WINDOW,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
}
# The output head's weights are scaled up by this after the seeded init, so a
# random model's next-token distribution has clear winners: with the init
# alone, top-2 logprob gaps of 0.03 nats were common, near-ties a restored
# prefix may break either way.
LM_HEAD_GAIN = 4.0
# Router weights are zeroed (its seeded biases kept), so every token takes the
# same two experts: a random router flips top-2 choices on tiny input changes,
# which turned INT8 rounding into logit jumps of a nat or more.


def gpt_oss_tiny_dir() -> Path:
    """The tiny gpt-oss folder (written on first use, then cached)."""
    return _cached(
        HYBRID_ROOT / f"gpt-oss-tiny-v{VERSION}",
        f"gpt-oss-tiny v{VERSION} seed {SEED}",
        _write_gpt_oss_tiny,
    )


def _write_gpt_oss_tiny(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    config = GptOssConfig(
        **GPT_OSS_TINY,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
        for layer in model.model.layers:
            layer.mlp.router.weight.zero_()
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    # Run from the repository root: python -m tests.support.hybrid_model
    print(gpt_oss_tiny_dir())
