"""ServerArgs rigs: SGLang's own argument parser and resolution pipeline
(``ServerArgs.resolve_once``, imported when called) over tiny local HF configs
(no weights), which the start-up table (tests/support/startup_table.py) names."""

from __future__ import annotations

import argparse
import json

# What every tiny config shares.
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    torch_dtype="bfloat16",
)
LLAMA = dict(
    _TINY,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    rope_theta=10000.0,
)
DEEPSEEK_V2_MLA = dict(
    LLAMA,
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    moe_intermediate_size=32,
    num_key_value_heads=4,
    rms_norm_eps=1e-6,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
    moe_layer_freq=1,
)
# DeepSeek-V3 at DeepSeek-V2's latent widths (kv_lora_rank 512, qk_rope_head_dim 64).
DEEPSEEK_V3 = dict(
    DEEPSEEK_V2_MLA,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    kv_lora_rank=512,
    qk_rope_head_dim=64,
)
GPT_OSS = dict(
    _TINY,
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    intermediate_size=64,
    head_dim=16,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=32,
    num_local_experts=4,
    num_experts_per_tok=2,
)
QWEN3_NEXT = dict(
    _TINY,
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    head_dim=16,
    num_hidden_layers=4,
    full_attention_interval=4,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
# Qwen3.5 (MoE): a Qwen3-Next text model with Gated DeltaNet layers under a
# vision-language wrapper (hybrid_gdn_config reads its text config).
QWEN3_5 = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        **{k: v for k, v in QWEN3_NEXT.items() if k != "architectures"},
        "model_type": "qwen3_5_moe_text",
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    },
    "vision_config": dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64
    ),
}
# Kimi-Linear: MLA full-attention layers (DeepSeek latent widths) between KDA
# linear-attention layers.
KIMI_LINEAR = dict(
    _TINY,
    architectures=["KimiLinearForCausalLM"],
    model_type="kimi_linear",
    moe_intermediate_size=32,
    num_key_value_heads=4,
    num_hidden_layers=4,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=64,
    v_head_dim=16,
    mla_use_nope=True,
    num_experts=4,
    num_experts_per_token=2,
    num_shared_experts=1,
    first_k_dense_replace=1,
    linear_attn_config=dict(
        kda_layers=[1, 2, 3],
        full_attn_layers=[4],
        num_heads=4,
        head_dim=16,
        short_conv_kernel_size=4,
    ),
)
_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
# name -> (config.json's quantization_config or None, other files).
FP8_KV_CHECKPOINTS = {
    # an FP8 checkpoint's quantization_config (Fp8Config reads it)
    "fp8_config": (dict(_FP8, kv_cache_quant_algo="FP8"), {}),
    # compressed-tensors describes the KV cache as an 8-bit float scheme
    "compressed_tensors": (
        {
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor"},
        },
        {},
    ),
    # ModelOpt keeps it in hf_quant_config.json beside config.json
    "modelopt": (
        None,
        {
            "hf_quant_config.json": {
                "quantization": dict(quant_algo="FP8", kv_cache_quant_algo="FP8")
            }
        },
    ),
}


def write_models(root) -> dict[str, str]:
    """The tiny MHA (Llama) and MLA (DeepSeek-V2) configs under `root`."""
    return {
        "mha": model_dir(root, "mha", LLAMA),
        "mla": model_dir(root, "mla", DEEPSEEK_V2_MLA),
    }


def cli_parser() -> argparse.ArgumentParser:
    """SGLang's own `sglang serve` argument parser."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def from_argv(parser, *argv: str):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", *argv]))


def resolve(model_path: str = "dummy", **kwargs):
    from sglang.srt.server_args import ServerArgs

    kwargs.setdefault("enable_hierarchical_cache", True)
    server_args = ServerArgs(
        model_path=model_path, device="cpu", skip_tokenizer_init=True, **kwargs
    )
    server_args.resolve_once()
    return server_args


def model_dir(root, name: str, config: dict, **files: dict) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for filename, content in files.items():
        (path / filename).write_text(json.dumps(content))
    return str(path)
