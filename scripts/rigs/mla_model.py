"""A tiny random-weight DeepSeek-V3 (MLA) folder for the live CPU server.

``DeepseekV3ForCausalLM`` with tiny dims (2 dense layers, no MoE, 4 heads,
kv_lora_rank 128, RoPE 64: the smallest latent the int8 MLA host format
takes, one 128-value tile), seeded random weights and the SmolLM2 tokenizer
read from the packaged GGUF (no downloads). Written under build/mla-models/
on first use (about 6 s), then cached by VERSION.

Stable API: ``DEEPSEEK_V3_TINY`` (the config fields), ``deepseek_v3_tiny_dir()
-> Path``. ``python -m scripts.rigs.mla_model`` writes it and prints the path.
"""

from __future__ import annotations

from pathlib import Path

from scripts.rigs.model import REPO_ROOT, _cached, _gguf_path

MLA_ROOT = REPO_ROOT / "build" / "mla-models"
# Changing any field (or the seed) must change VERSION, the cache key.
VERSION = "4"
SEED = 0
DEEPSEEK_V3_TINY = {
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,  # every layer dense: no MoE on CPU
    # DeepSeek V3's config.json has it and SGLang reads it (deepseek_v2.py).
    "moe_layer_freq": 1,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "head_dim": 64,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
    # DeepSeek V3's own YaRN scaling: SGLang's CPU rope for MLA
    # (rotary_embedding/factory.py get_rope_cpu) takes only deepseek_yarn.
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
# The output head's weights are scaled up after the seeded init so the random
# model's next token has clear winners (as tests/support/hybrid_model.py).
LM_HEAD_GAIN = 4.0


def deepseek_v3_tiny_dir() -> Path:
    """The tiny DeepSeek-V3 folder (written on first use, then cached)."""
    return _cached(
        MLA_ROOT / f"deepseek-v3-tiny-v{VERSION}",
        f"deepseek-v3-tiny v{VERSION} seed {SEED}",
        _write_deepseek_v3_tiny,
    )


def _write_deepseek_v3_tiny(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = DeepseekV3Config(
        **DEEPSEEK_V3_TINY,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    # Run from the repository root: python -m scripts.rigs.mla_model
    print(deepseek_v3_tiny_dir())
