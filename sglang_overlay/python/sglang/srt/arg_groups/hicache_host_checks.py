# SPDX-License-Identifier: Apache-2.0
"""Start-up checks of the host KV pool that need the model.

hicache_hook runs them once the model config is known and the layout resolved:
check_model_for_host_kv for every --hicache-host-dtype, auto included, and
check_model_for_encoded_host_kv for the encoded ones, each with the encoded
pools' SGLANG_HICACHE_* variables (pool_host/host_env.py), which the pools
would otherwise refuse only once the scheduler builds them, or ignore. Each
refusal names the flag or variable and what to pass instead.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from sglang.srt.arg_groups.overrides import (
    model_config_of,
    resolving_view,
    use_mla_backend,
)

# --kv-cache-dtype values of an FP8 device KV cache, which only the formats
# with fp8_device_kv (host_format.fp8_host_dtypes) encode.
_FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")

logger = logging.getLogger(__name__)


def check_device_kv_dtype(cfg: Any, flag: str, plain: tuple, needs: str) -> None:
    """--kv-cache-dtype against an encoded --hicache-host-dtype: `plain`
    (BF16/FP16) for every format, FP8 for the formats that encode it."""
    if cfg.kv_cache_dtype in plain:
        return
    from sglang.srt.mem_cache.pool_host.host_format import fp8_host_dtypes

    fp8_dtypes = " or ".join(fp8_host_dtypes())
    if cfg.kv_cache_dtype not in _FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"{flag} with --kv-cache-dtype {cfg.kv_cache_dtype}: {needs} "
            "(--kv-cache-dtype auto or bf16, FP16 device KV with --dtype float16 "
            "and --kv-cache-dtype auto; fp8_e4m3 or fp8_e5m2 with "
            f"--hicache-host-dtype {fp8_dtypes})."
        )
    if cfg.hicache_host_dtype not in fp8_host_dtypes():
        raise ValueError(
            f"{flag} with --kv-cache-dtype {cfg.kv_cache_dtype}: {flag} gains "
            "nothing over the 1-byte FP8 device values and does not encode "
            f"them; pass --hicache-host-dtype {fp8_dtypes} (MHA models) for a "
            "smaller host copy of FP8 KV, or --hicache-host-dtype auto."
        )


def check_model_for_host_kv(server_args: Any) -> None:
    if resolving_view(server_args).hicache_host_dtype == "auto":
        _check_env_with_stock_pool()
    else:
        _refuse_fp8_dsa_latent(server_args)
    if os.environ.get("SGLANG_HICACHE_KEY8_LAYERS", "").strip():
        # Imported only when set: the plan's module loads torch.
        from sglang.srt.mem_cache.pool_host.layer_plan import check_key8_layers_args

        check_key8_layers_args(server_args)


def _refuse_fp8_dsa_latent(server_args: Any) -> None:
    """A DSA model's FP8 latent KV, which SGLang picks for --kv-cache-dtype
    auto on SM100+ GPUs once the model is known, is stored with per-block
    scales the encoded MLA pool does not read: name the fix, bfloat16."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    cfg = resolving_view(server_args)
    if cfg.kv_cache_dtype not in _FP8_KV_CACHE_DTYPES:
        return
    model_config = model_config_of(server_args)
    if not is_deepseek_dsa(model_config.hf_config):
        return
    given = server_args.kv_cache_dtype
    resolved = (
        f"{given}, which SGLang resolves to {cfg.kv_cache_dtype} for DSA models "
        "on this GPU"
        if given != cfg.kv_cache_dtype
        else given
    )
    raise ValueError(
        f"--hicache-host-dtype {cfg.hicache_host_dtype} with --kv-cache-dtype "
        f"{resolved}: the DSA model {architecture(model_config)} then keeps its "
        "latent KV in FP8 with per-block scales, and this host format encodes a "
        "BF16/FP16 latent. Pass --kv-cache-dtype bfloat16, or use "
        "--hicache-host-dtype auto."
    )


def _check_env_with_stock_pool() -> None:
    """The variables of the encoded pools on a stock (auto) host pool: bad
    values are refused as they would be with an encoded pool; the transfer
    path only warns, as a deployment may set it for every server."""
    from sglang.srt.mem_cache.pool_host import host_env

    mode = host_env.fused_transfer_mode()
    if host_env.verify_sample_rate(0.0):
        logger.warning(
            f"{host_env.VERIFY_ENV} has no effect with --hicache-host-dtype auto: "
            "only the encoded host pools check restored pages."
        )
    if mode != "auto":
        logger.warning(
            f"{host_env.FUSED_ENV}={mode} has no effect with --hicache-host-dtype "
            "auto: only the encoded host pools (--hicache-host-dtype int8, int4, "
            "...) have a fused transfer path."
        )


def _check_env_with_encoded_pool() -> None:
    """What the encoded pool would refuse of its variables once built."""
    from sglang.srt.mem_cache.pool_host import host_env

    host_env.fused_transfer_mode()
    host_env.verify_sample_rate(0.0)


def architecture(model_config: Any) -> str:
    """The model's architecture name, for refusals."""
    return (model_config.hf_config.architectures or ["this model"])[0]


def is_hybrid_model(model_config: Any) -> bool:
    """Whether SGLang builds hybrid pools for the model: sliding-window layers,
    or linear-attention/Mamba layers by config class (configs/hybrid_arch.py)
    or through the linear-attention registry."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return bool(model_config.is_hybrid_swa or mambaish_config(model_config) is not None)


def check_model_for_encoded_host_kv(server_args: Any) -> None:
    if use_mla_backend(server_args):
        _refuse_unsupported_mla(server_args)
    _refuse_unencodable_head_dims(server_args)
    _refuse_checkpoint_fp8_kv(server_args)
    _refuse_untested_speculative_draft(server_args)
    _refuse_nixl_with_hybrid_model(server_args)
    _check_env_with_encoded_pool()


def _refuse_nixl_with_hybrid_model(server_args: Any) -> None:
    """NIXL moves encoded KV pages (patch 0011), but its path for the side
    pools (sliding-window, Mamba state, the DSA indexer) has not run with them."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    cfg = resolving_view(server_args)
    model_config = model_config_of(server_args)
    if cfg.hicache_storage_backend != "nixl":
        return
    if is_hybrid_model(model_config):
        kind = "hybrid models"
        what = "sliding-window or linear-attention layers"
    elif is_deepseek_dsa(model_config.hf_config):
        kind = "DSA models"
        what = "the indexer's key pages"
    else:
        return
    raise ValueError(
        f"--hicache-host-dtype {cfg.hicache_host_dtype} with "
        f"--hicache-storage-backend nixl does not support {kind} "
        f"({architecture(model_config)}: {what}). Use "
        "--hicache-storage-backend file or mooncake, or --hicache-host-dtype auto."
    )


def _refuse_unsupported_mla(server_args: Any) -> None:
    """The MLA host pool encodes plain MLA latent caches (DeepSeek V2/V3,
    Kimi K2 and the like) whose kv_lora_rank splits into 128-value tiles, and
    the latent of DSA models (DeepSeek V3.2, GLM-5), whose indexer keys stay
    SGLang's byte copy (pool_host/dsa.py)."""
    from sglang.srt.configs.model_config import is_deepseek_v4

    cfg = resolving_view(server_args)
    model_config = model_config_of(server_args)
    hf_config = model_config.hf_config
    unsupported = None
    if is_deepseek_v4(hf_config):
        unsupported = "DeepSeek V4's compressed MLA caches"
    elif is_hybrid_model(model_config):
        unsupported = (
            "hybrid MLA models (sliding-window or linear-attention layers: "
            f"{architecture(model_config)})"
        )
    elif cfg.enable_hisparse:
        unsupported = "--enable-hisparse"
    elif cfg.enable_dsa_cache_layer_split:
        unsupported = "--enable-dsa-cache-layer-split (layer-sharded device KV)"
    elif cfg.dcp_size > 1:
        unsupported = "--dcp-size > 1 (no DCP index translation in the encoded pool)"
    elif model_config.kv_lora_rank % 128:
        unsupported = (
            f"kv_lora_rank {model_config.kv_lora_rank}, which is not a multiple "
            "of the 128-value tiles"
        )
    if unsupported is not None:
        raise ValueError(
            f"--hicache-host-dtype {cfg.hicache_host_dtype} does not support "
            f"{unsupported}. Use --hicache-host-dtype auto."
        )


def _refuse_unencodable_head_dims(server_args: Any) -> None:
    """Build the host format over the model's head dims, as the pool will, so
    a geometry its codec cannot encode (an odd dim for the 4-bit and k8v4
    formats, MLA without a RoPE part) fails here and not at the first backup.
    The format comes from the pool class the dispatch builds, so a value whose
    pool is not in this build is refused, not served by the stock pool."""
    import torch

    from sglang.srt.mem_cache.pool_host.host_format import (
        host_pool_cls,
        unit_tokens_for,
    )

    cfg = resolving_view(server_args)
    model_config = model_config_of(server_args)
    unit_tokens = unit_tokens_for(cfg.page_size or 1, cfg.hicache_mem_layout)
    kind = "mla" if use_mla_backend(server_args) else "mha"
    try:
        fmt = host_pool_cls(cfg.hicache_host_dtype, kind).host_format_cls
    except NotImplementedError as e:
        raise ValueError(str(e)) from e
    if kind == "mla":
        rope_dim = model_config.qk_rope_head_dim
        geometries = [((model_config.kv_lora_rank + rope_dim,), {"rope_dim": rope_dim})]
    else:
        geometries = [((model_config.head_dim, model_config.v_head_dim), {})]
        if model_config.is_hybrid_swa:
            swa_dims = (model_config.swa_head_dim, model_config.swa_v_head_dim)
            geometries.append((swa_dims, {}))
    for dims, extra in geometries:
        try:
            fmt(dims, 1, unit_tokens, torch.bfloat16, **extra)
        except NotImplementedError as e:
            raise ValueError(str(e)) from e


def checkpoint_kv_cache_quant_algo(model_config: Any) -> str | None:
    """The KV cache quantization a checkpoint declares, as --kv-cache-dtype auto
    would apply it once the weights load (configure_kv_cache_dtype)."""
    quant_cfg = getattr(model_config.hf_config, "quantization_config", None)
    if quant_cfg is not None and not isinstance(quant_cfg, dict):
        quant_cfg = quant_cfg.to_dict()
    quant_cfg = dict(quant_cfg or {})
    # ModelOpt checkpoints keep it in a separate hf_quant_config.json.
    modelopt_file = os.path.join(model_config.model_path, "hf_quant_config.json")
    if not quant_cfg and os.path.isfile(modelopt_file):
        with open(modelopt_file) as f:
            quant_cfg = json.load(f).get("quantization", {})
    algo = quant_cfg.get("kv_cache_quant_algo")
    scheme = quant_cfg.get("kv_cache_scheme")
    if algo is None and isinstance(scheme, dict):
        # compressed-tensors describes FP8 KV as an 8-bit float scheme.
        if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            algo = "FP8"
    return algo.upper() if isinstance(algo, str) else None


def _refuse_checkpoint_fp8_kv(server_args: Any) -> None:
    cfg = resolving_view(server_args)
    if cfg.kv_cache_dtype != "auto":
        return
    algo = checkpoint_kv_cache_quant_algo(model_config_of(server_args))
    if algo is None:
        return
    from sglang.srt.mem_cache.pool_host.host_format import fp8_host_dtypes

    fp8_dtypes = fp8_host_dtypes()
    if algo == "FP8" and cfg.hicache_host_dtype in fp8_dtypes:
        # The device KV becomes FP8 E4M3 (configure_kv_cache_dtype), which
        # this format encodes; the checkpoint's k/v scales stay on the device.
        return
    also = (
        f", or --hicache-host-dtype {' or '.join(fp8_dtypes)}, which encode FP8 KV"
        if algo == "FP8"
        else ""
    )
    raise ValueError(
        f"--hicache-host-dtype {cfg.hicache_host_dtype} with --kv-cache-dtype "
        f"auto: this checkpoint declares an {algo} KV cache "
        "(kv_cache_quant_algo), and this host format needs a BF16/FP16 "
        "device KV cache. Pass --kv-cache-dtype bf16 to keep the device KV "
        f"in BF16{also}, or use --hicache-host-dtype auto."
    )


# Draft KV the encoded pools are tested with (tests/test_spec_host_pools.py):
# packed MTP layers (NEXTN, or EAGLE on the checkpoint's own MTP layers) of
# MHA, linear-attention hybrid and MLA targets, and a separate draft model's
# sidecar pool (EAGLE, EAGLE3, STANDALONE); NGRAM keeps no draft KV.
SPECULATIVE_WITH_ENCODED_HOST_KV = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")


def _refuse_untested_speculative_draft(server_args: Any) -> None:
    """Drafts whose KV lives in the target's page envelopes (DFLASH, DSPARK)
    or in a pool the encoded pools were never run with are refused."""
    cfg = resolving_view(server_args)
    algorithm = (cfg.speculative_algorithm or "").upper()
    if algorithm in ("EAGLE", "NEXTN"):
        _refuse_packed_mtp_draft_on_hybrid(server_args, cfg)
    if not algorithm or algorithm in SPECULATIVE_WITH_ENCODED_HOST_KV:
        return
    raise ValueError(
        f"--hicache-host-dtype {cfg.hicache_host_dtype} is not tested with "
        f"--speculative-algorithm {cfg.speculative_algorithm} (its draft KV "
        "host copy). Use --speculative-algorithm "
        f"{', '.join(SPECULATIVE_WITH_ENCODED_HOST_KV)}, or --hicache-host-dtype "
        "auto."
    )


def _refuse_packed_mtp_draft_on_hybrid(server_args: Any, cfg: Any) -> None:
    """A sliding-window target's MTP layers pack into its full and SWA host
    pools, not tested with encoded pools (linear-attention targets, whose
    draft shares the Mamba state, are)."""
    model_config = model_config_of(server_args)
    if not model_config.is_hybrid_swa:
        return
    from sglang.srt.configs.model_config import ModelConfig

    draft_config = ModelConfig.from_server_args(
        server_args,
        model_path=cfg.speculative_draft_model_path or cfg.model_path,
        model_revision=cfg.speculative_draft_model_revision,
        is_draft_model=True,
    )
    if draft_config.num_nextn_predict_layers:
        raise ValueError(
            f"--hicache-host-dtype {cfg.hicache_host_dtype} does not support "
            f"--speculative-algorithm {cfg.speculative_algorithm} with the MTP "
            f"layers of the sliding-window model {architecture(model_config)} "
            "(num_nextn_predict_layers="
            f"{draft_config.num_nextn_predict_layers}), whose draft KV packs into "
            "its full and SWA host pools: untested. Use --hicache-host-dtype auto, or "
            "a separate draft model (--speculative-algorithm EAGLE3 with "
            "--speculative-draft-model-path)."
        )
