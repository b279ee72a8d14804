"""Hybrid models at start-up: SGLang's own argument resolution over tiny local
configs (no weights) of each hybrid family. Sliding-window (gpt-oss) and
linear-attention (Qwen3-Next, Qwen3.5) models take every encoded --hicache-host-dtype;
MLA + linear attention (Kimi-Linear) is refused naming the flag; a layout the
Mamba state host pool cannot take is refused for every host dtype, auto too,
instead of failing when the scheduler builds the pool."""

from __future__ import annotations

import pytest
from tests.support.server_args import (
    GPT_OSS,
    QWEN3_5,
    QWEN3_NEXT,
    model_dir,
    resolve,
)

from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES, host_dtype_choices

pytestmark = pytest.mark.usefixtures("mamba_extra_buffer_on_cpu", "restore_environ")

ENCODED = tuple(name for name in host_dtype_choices() if name != "auto")
# The other formats are refused for MLA models as such, before the model check.
ENCODED_MLA = tuple(name for name, entry in HOST_DTYPES.items() if entry.mla_format)

# Kimi-Linear: MLA full-attention layers (DeepSeek latent widths) between KDA
# linear-attention layers.
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 64,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {
        name: model_dir(root, name, config)
        for name, config in (
            ("gpt_oss", GPT_OSS),
            ("qwen3_next", QWEN3_NEXT),
            ("qwen3_5", QWEN3_5),
            ("kimi_linear", KIMI_LINEAR),
        )
    }


def test_configs_are_the_hybrid_families(models):
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, kimi_linear_config

    configs = {name: model_config_of(resolve(path)) for name, path in models.items()}
    assert configs["gpt_oss"].is_hybrid_swa
    assert hybrid_gdn_config(configs["qwen3_next"]) is not None
    assert hybrid_gdn_config(configs["qwen3_5"]) is not None
    kimi = configs["kimi_linear"]
    assert kimi_linear_config(kimi) is not None and kimi.kv_lora_rank == 512
    # What the hook used to read: empty for both linear-attention families.
    assert not configs["qwen3_next"].linear_attn_registry_result
    assert not configs["qwen3_5"].linear_attn_registry_result
    assert not kimi.linear_attn_registry_result


@pytest.mark.parametrize("host_dtype", ENCODED)
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_sliding_window_model_takes_every_encoded_format(models, host_dtype, layout):
    io_backend = "kernel" if layout == "page_first" else "direct"
    server_args = resolve(
        models["gpt_oss"],
        hicache_host_dtype=host_dtype,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
    )
    assert server_args.hicache_mem_layout == layout


@pytest.mark.parametrize(
    "host_dtype, swa_dims",
    [("int4", (15, 16)), ("k8v4", (16, 15)), ("int4r", (15, 15))],
)
def test_sliding_window_pool_dims_are_checked_at_startup(
    tmp_path, host_dtype, swa_dims
):
    """The SWA pool's own head dims (swa_head_dim, swa_v_head_dim) are
    encoded too: an odd one is refused at start-up, not at the first backup."""
    config = dict(GPT_OSS, swa_head_dim=swa_dims[0], swa_v_head_dim=swa_dims[1])
    model = model_dir(tmp_path, "gpt_oss_swa_dims", config)
    with pytest.raises(ValueError, match=f"--hicache-host-dtype {host_dtype} ") as e:
        resolve(model, hicache_host_dtype=host_dtype)
    assert f"{swa_dims}" in str(e.value)
    resolve(model, hicache_host_dtype="int8")  # what the message suggests starts


@pytest.mark.parametrize("model", ["gpt_oss", "qwen3_next"])
def test_hybrid_model_with_nixl_storage_names_both_flags(models, model):
    # NIXL's hybrid side-pool path has not run with encoded KV pages.
    with pytest.raises(ValueError) as error:
        resolve(
            models[model],
            hicache_host_dtype="int8",
            hicache_mem_layout="page_first_direct",
            hicache_io_backend="direct",
            hicache_storage_backend="nixl",
        )
    message = str(error.value)
    assert "--hicache-host-dtype int8 with --hicache-storage-backend nixl" in message
    assert "file or mooncake" in message
    resolve(
        models[model],
        hicache_host_dtype="int8",
        hicache_mem_layout="page_first_direct",
        hicache_io_backend="direct",
        hicache_storage_backend="mooncake",
    )


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("host_dtype", ENCODED)
@pytest.mark.parametrize(
    "layout,io_backend", [("page_first", "kernel"), ("page_first_direct", "direct")]
)
def test_linear_attention_model_takes_every_encoded_format(
    models, model, host_dtype, layout, io_backend
):
    server_args = resolve(
        models[model],
        hicache_host_dtype=host_dtype,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
    )
    assert server_args.hicache_mem_layout == layout


@pytest.mark.parametrize("host_dtype", ENCODED_MLA)
def test_refuses_mla_linear_attention_hybrid(models, host_dtype):
    with pytest.raises(ValueError) as error:
        resolve(models["kimi_linear"], hicache_host_dtype=host_dtype)
    message = str(error.value)
    assert f"--hicache-host-dtype {host_dtype}" in message
    assert "hybrid MLA models" in message and "KimiLinearForCausalLM" in message
    assert "Use --hicache-host-dtype auto." in message
    resolve(models["kimi_linear"])  # auto keeps the stock host pools


@pytest.mark.parametrize("host_dtype", ["auto", *ENCODED])
@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_refuses_layer_first_for_mamba_state(models, model, host_dtype):
    with pytest.raises(ValueError) as error:
        resolve(
            models[model],
            hicache_host_dtype=host_dtype,
            hicache_mem_layout="layer_first",
            hicache_io_backend="direct",
        )
    message = str(error.value)
    assert "--hicache-mem-layout layer_first is not supported" in message
    assert "--hicache-mem-layout page_first" in message
    assert "page_first_direct" in message


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5", "kimi_linear"])
@pytest.mark.parametrize(
    "layout,io_backend", [("page_first", "kernel"), ("page_first_direct", "direct")]
)
def test_auto_takes_the_layouts_the_message_names(models, model, layout, io_backend):
    server_args = resolve(
        models[model], hicache_mem_layout=layout, hicache_io_backend=io_backend
    )
    assert server_args.hicache_mem_layout == layout
