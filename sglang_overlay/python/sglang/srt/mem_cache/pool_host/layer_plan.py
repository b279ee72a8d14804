"""The per-layer plan of 8-bit keys (SGLANG_HICACHE_KEY8_LAYERS): which layers
of the model a host format that takes one (HostKVFormat.key8_plan) stores
with 8-bit keys.

A 4-bit key format loses most on QK-normed models (results/runs/
2026-12-07-quality-4bit-metadata.md): their pre-norm key ranges are flat, so
a few layers' keys carry the error. The rule, from the model's HF config:

- QK-normed with sliding-window layers (Gemma 3): its full-attention layers;
- QK-normed without them (Qwen3, Qwen3-MoE, OLMo 2): the first
  max(1, layers // 12) layers;
- not QK-normed (Llama-style): none; the sink page
  (SGLANG_HICACHE_SINK_PAGE_TOKENS) is what pays there, so such a format gets
  it unless that variable is set (sink_page.host_plan). Plan and sink page
  together cost capacity, so it is one or the other.

SGLANG_HICACHE_KEY8_LAYERS: ``auto`` (default, the rule; none for a format
without a plan), ``none``, or a comma list of model layer ids. The hybrid pool
assembler passes the plan (as the pool's own layer ids under pipeline
parallelism) to the encoded MHA host pools; the HiCache hook checks an
explicit list at start-up.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)

KEY8_ENV = "SGLANG_HICACHE_KEY8_LAYERS"

# HF model_type values of the QK-normed families (q_norm/k_norm before RoPE).
QK_NORM_MODEL_TYPES = frozenset(
    {
        "gemma3",
        "gemma3_text",
        "qwen3",
        "qwen3_moe",
        "olmo2",
        "olmo3",
        "olmoe",
    }
)


def requested_key8_layers(
    env: Mapping[str, str] | None = None,
) -> str | tuple[int, ...]:
    """SGLANG_HICACHE_KEY8_LAYERS of `env` (the process's by default), read
    strictly: "auto" (unset or empty), or the model layer ids (none: ())."""
    raw = (os.environ if env is None else env).get(KEY8_ENV, "")
    value = raw.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value == "none":
        return ()
    try:
        layers = [int(part) for part in value.split(",")]
    except ValueError:
        layers = [-1]
    if min(layers) < 0 or len(set(layers)) != len(layers):
        raise ValueError(
            f"{KEY8_ENV}={raw!r} is not a plan of 8-bit key layers; pass auto, "
            "none, or distinct model layer ids separated by commas (e.g. 5,11,17)."
        )
    return tuple(sorted(layers))


def text_config(hf_config: Any) -> Any:
    # Multimodal configs (Gemma 3) keep the language model's in text_config.
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else getattr(hf_config, "text_config", hf_config)


def qk_normed(hf_config: Any) -> bool:
    """Whether the model normalizes queries and keys per head before RoPE."""
    return text_config(hf_config).model_type in QK_NORM_MODEL_TYPES or (
        getattr(hf_config, "model_type", None) in QK_NORM_MODEL_TYPES
    )


def layer_kinds(hf_config: Any) -> list[str]:
    """Per layer, "full" or "sliding" attention, from `layer_types` or Gemma 3's
    older `sliding_window_pattern` (every n-th layer is full)."""
    text = text_config(hf_config)
    layers = text.num_hidden_layers
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return ["sliding" if "sliding" in kind else "full" for kind in kinds]
    pattern = getattr(text, "sliding_window_pattern", None)
    if pattern and getattr(text, "sliding_window", None):
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    return ["full"] * layers


def auto_key8_layers(hf_config: Any) -> tuple[int, ...]:
    """The rule's model layer ids for this HF config (module docstring)."""
    if not qk_normed(hf_config):
        return ()
    kinds = layer_kinds(hf_config)
    if "sliding" in kinds:
        return tuple(i for i, kind in enumerate(kinds) if kind == "full")
    return tuple(range(max(1, len(kinds) // 12)))


def key8_host_dtypes() -> list[str]:
    """The --hicache-host-dtype values whose MHA format takes a plan (imports
    their codecs: refusals only)."""
    from sglang.srt.mem_cache.pool_host.host_format import (
        HOST_DTYPES,
        host_format_cls,
    )

    return [
        name
        for name, entry in HOST_DTYPES.items()
        if entry.mha_format and host_format_cls(name, "mha").key8_plan
    ]


def _refuse_format(name: str, why: str) -> None:
    takers = key8_host_dtypes()
    use = (
        f"pass --hicache-host-dtype {' or '.join(takers)}, or"
        if takers
        else "no host dtype of this build takes one;"
    )
    raise ValueError(
        f"{KEY8_ENV} plans 8-bit key layers, but {why}; {use} set {KEY8_ENV} "
        "to auto or none."
    )


def format_keywords(fmt_cls, key8_layers: Sequence[int]) -> dict:
    """The format constructor's plan keyword: {} without a plan; refuses a plan
    for a format that has none."""
    if not key8_layers:
        return {}
    if not fmt_cls.key8_plan:
        _refuse_format(
            fmt_cls.name,
            f"--hicache-host-dtype {fmt_cls.name} has no 8-bit key plan",
        )
    return {"key8_layers": tuple(int(layer) for layer in key8_layers)}


def refuse_mla_plan(name: str, key8_layers: Sequence[int]) -> None:
    """MLA pools store one latent per token, no keys to plan."""
    if key8_layers:
        _refuse_format(
            name,
            f"the MLA host pool (--hicache-host-dtype {name}) stores one latent "
            "per token, no separate keys",
        )


def model_key8_layers(
    hf_config: Any, requested: str | tuple[int, ...], fmt_cls
) -> tuple[int, ...]:
    """The model layer ids of the plan: the rule where `requested` is auto
    (none for a format without a plan), else the explicit list, checked."""
    if requested == "auto":
        return auto_key8_layers(hf_config) if fmt_cls.key8_plan else ()
    layers = text_config(hf_config).num_hidden_layers
    bad = [layer for layer in requested if layer >= layers]
    if bad:
        raise ValueError(
            f"{KEY8_ENV}: layers {bad} are not layers of this model "
            f"({layers} layers, ids 0..{layers - 1}); pass ids below {layers}, "
            "auto or none."
        )
    format_keywords(fmt_cls, requested)
    return tuple(requested)


def to_pool_layers(
    model_layers: Sequence[int],
    start_layer: int,
    layer_num: int,
    layer_mapping: dict[int, int] | None = None,
) -> tuple[int, ...]:
    """Model layer ids as the host pool's: model layer start_layer + i is this
    pipeline stage's layer i, stored on pool layer layer_mapping[i] (None:
    pool layer i, of layer_num)."""
    if layer_mapping is None:
        layer_mapping = {i: i for i in range(layer_num)}
    return tuple(
        sorted(
            layer_mapping[i - start_layer]
            for i in model_layers
            if i - start_layer in layer_mapping
        )
    )


def pool_key8_layers(
    hf_config: Any,
    fmt_cls,
    start_layer: int,
    layer_num: int,
    layer_mapping: dict[int, int] | None = None,
) -> tuple[int, ...]:
    """The plan as the host pool's layer ids: model layer start_layer + i is
    this pipeline stage's layer i, stored on pool layer layer_mapping[i] (a
    hybrid SWA model's full and sliding pools each hold some layers; None:
    pool layer i, of layer_num)."""
    model_layers = model_key8_layers(hf_config, requested_key8_layers(), fmt_cls)
    local = to_pool_layers(model_layers, start_layer, layer_num, layer_mapping)
    if model_layers:
        logger.info(
            "HiCache host KV plan (%s=%s): 8-bit keys on model layers %s; "
            "this host pool's layers %s of %d.",
            KEY8_ENV,
            os.environ.get(KEY8_ENV, "auto") or "auto",
            list(model_layers),
            list(local),
            layer_num,
        )
    return local


def assembler_key8_layers(
    host_dtype: str,
    start_layer: int,
    layer_num: int,
    layer_mapping: dict[int, int] | None = None,
) -> tuple[int, ...]:
    """pool_key8_layers for the running server's model (its HF config, no
    weights), for the hybrid pool assembler."""
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
    from sglang.srt.runtime_context import process_model_config

    fmt_cls = host_format_cls(host_dtype, "mha")
    requested = requested_key8_layers()
    if not requested or (requested == "auto" and not fmt_cls.key8_plan):
        return ()  # no plan to choose: the model config is not needed
    hf_config = process_model_config().hf_config
    return pool_key8_layers(hf_config, fmt_cls, start_layer, layer_num, layer_mapping)


def check_key8_layers_args(server_args: Any) -> None:
    """SGLANG_HICACHE_KEY8_LAYERS against the host dtype and the model at
    start-up (hicache_hook): an explicit list the pools would refuse."""
    from sglang.srt.arg_groups.overrides import (
        model_config_of,
        resolving_view,
        use_mla_backend,
    )
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    requested = requested_key8_layers()
    if not requested or requested == "auto":
        return
    cfg = resolving_view(server_args)
    name = cfg.hicache_host_dtype
    if name == "auto":
        _refuse_format(name, "--hicache-host-dtype auto stores the device KV as it is")
    if use_mla_backend(server_args):
        refuse_mla_plan(name, requested)
    model_key8_layers(
        model_config_of(server_args).hf_config, requested, host_format_cls(name, "mha")
    )
