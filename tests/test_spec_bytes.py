"""Host bytes per token with and without packed MTP draft layers at named model
geometries, from the real host pools: reported = allocated, the draft adds its layers'
share. `python -m tests.test_spec_bytes` prints the table docs/speculative.md quotes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

PAGE_SIZE = 64
LAYOUT = "page_first"
TOKENS = 2 * PAGE_SIZE


@dataclass(frozen=True)
class Model:
    name: str
    kind: str  # "mha" | "mla"
    layers: int  # attention layers with KV (target)
    draft_layers: int  # num_nextn_predict_layers
    head_num: int = 0  # KV heads (MHA)
    head_dim: int = 0


MODELS = (
    # config.json: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64.
    Model("DeepSeek-V3 (NEXTN)", "mla", 61, 1),
    # num_hidden_layers 46, num_key_value_heads 8, head_dim 128.
    Model("GLM-4.5-Air (NEXTN)", "mha", 46, 1, head_num=8, head_dim=128),
    # 48 layers, every 4th full attention: 12 KV layers; 2 KV heads of 256.
    Model("Qwen3-Next-80B-A3B (NEXTN)", "mha", 12, 1, head_num=2, head_dim=256),
)


def formats(kind: str) -> tuple[str, ...]:
    from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES

    if kind == "mla":
        return ("auto", *(n for n, e in HOST_DTYPES.items() if e.mla_format))
    return ("auto", *HOST_DTYPES)


def build(model: Model, host_dtype: str, with_draft: bool):
    """The host pool as build_kv_host_pool makes it (drafts packed)."""
    from scripts.rigs.hicache_harness import (
        Geometry,
        MLAGeometry,
        make_device_pool,
        make_host_pool,
    )

    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    def geometry(layers):
        if model.kind == "mla":
            return MLAGeometry(layer_num=layers, page_size=PAGE_SIZE)
        return Geometry(
            layer_num=layers,
            head_num=model.head_num,
            head_dim=model.head_dim,
            page_size=PAGE_SIZE,
        )

    target = make_device_pool(geometry(model.layers), TOKENS)
    drafts = [
        make_device_pool(geometry(1), TOKENS)
        for _ in range(model.draft_layers if with_draft else 0)
    ]
    with host_memory_budget_scope(1 << 40):
        return make_host_pool(
            target,
            host_tokens=2 * TOKENS,
            layout=LAYOUT,
            host_dtype=host_dtype,
            draft_buffer_infos=tuple(
                d.get_device_pool_infos()[0].buffer_info for d in drafts
            ),
        )


def allocated_per_token(pool) -> float:
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer]
    return sum(b.nbytes for b in buffers) / pool.size


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name.split()[0])
def test_bytes_per_token_with_and_without_the_draft(model):
    for host_dtype in formats(model.kind):
        without = build(model, host_dtype, with_draft=False)
        packed = build(model, host_dtype, with_draft=True)
        for pool in (without, packed):
            # What the metrics' bytes_per_token and the start-up log report.
            assert pool.size_per_token == allocated_per_token(pool), host_dtype
        total = model.layers + model.draft_layers
        assert packed.layer_num == total
        assert packed.size_per_token * model.layers == (
            without.size_per_token * total
        ), host_dtype
        if host_dtype != "auto":
            assert packed.size_per_token_without_draft() == without.size_per_token


def main() -> None:
    from tests import conftest  # noqa: F401  (the CPU stand-ins, before sglang)

    print(
        f"page_size {PAGE_SIZE}, --hicache-mem-layout {LAYOUT}, BF16 device KV; "
        "host bytes per token"
    )
    print("| model | --hicache-host-dtype | target only | target + draft | x BF16 |")
    print("|---|---|---:|---:|---:|")
    bf16 = {}
    for model, host_dtype in ((m, f) for m in MODELS for f in formats(m.kind)):
        without = build(model, host_dtype, with_draft=False)
        packed = build(model, host_dtype, with_draft=True)
        if host_dtype == "auto":
            bf16[model.name] = packed.size_per_token
        ratio = bf16[model.name] / packed.size_per_token
        print(
            f"| {model.name} | {host_dtype} | {without.size_per_token:g} | "
            f"{packed.size_per_token:g} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
