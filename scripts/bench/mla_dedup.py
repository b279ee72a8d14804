#!/usr/bin/env python3
"""Host bytes per node per cached token and load-path bytes per restored token
for MLA host dedup (--enable-mla-hicache-host-dedup) at DeepSeek-V3 geometry,
TP 8: stock BF16 (one host copy per rank) vs dedup auto vs dedup int8, and the
same with DeepSeek V3.2's DSA indexer K. Bytes per token come from the real
host formats (the MLA int8 format's records); no GPU needed.

    PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.bench.mla_dedup
"""

from __future__ import annotations

import argparse

import torch

from scripts.common.cpu_sglang import install_cpu_standins

LAYERS, KV_LORA_RANK, ROPE = 61, 512, 64  # DeepSeek-V3 / V3.2
# DeepSeek V3.2's indexer K: 128 FP8 values per token and layer, one FP32 scale
# per 128 (DSATokenToKVPool.index_k_with_scale_buffer).
INDEX_HEAD_DIM, INDEX_QUANT_BLOCK = 128, 128
PAGE_SIZE = 64


def latent_bytes_per_layer(host_dtype: str) -> float:
    """Host bytes per token and layer of the latent rows in `host_dtype`."""
    width = KV_LORA_RANK + ROPE
    if host_dtype == "auto":
        return width * torch.bfloat16.itemsize
    install_cpu_standins()
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    fmt = host_format_cls(host_dtype, "mla")(
        (width,), 1, 1, torch.bfloat16, rope_dim=ROPE
    )
    return fmt.unit_bytes() / fmt.unit_tokens


def index_k_bytes_per_layer() -> int:
    """Host bytes per token and layer of SGLang's DSA indexer host pool
    (DSAIndexerPoolHost.size_per_token divided by its layers)."""
    install_cpu_standins()
    from sglang.srt.mem_cache.pool_host.dsa import (
        dsa_indexer_bytes_per_token_per_layer,
    )

    return dsa_indexer_bytes_per_token_per_layer(
        index_head_dim=INDEX_HEAD_DIM, quant_block_size=INDEX_QUANT_BLOCK
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8, help="attention-TP size")
    tp = parser.parse_args().tp
    bf16 = latent_bytes_per_layer("auto")
    int8 = latent_bytes_per_layer("int8")
    index_k = index_k_bytes_per_layer()
    rows = [
        # (label, host copies per node, latent B/token/layer, indexer B)
        ("stock auto (BF16), no dedup", tp, bf16, 0),
        ("dedup auto (BF16)", 1, bf16, 0),
        ("dedup int8", 1, int8, 0),
        ("DSA stock auto, no dedup", tp, bf16, index_k),
        ("DSA dedup auto", 1, bf16, index_k),
        ("DSA dedup int8 (latent int8, indexer K as is)", 1, int8, index_k),
    ]
    print(
        f"DeepSeek-V3 geometry: {LAYERS} layers, kv_lora_rank {KV_LORA_RANK}, "
        f"rope {ROPE}; attention TP {tp}; DSA indexer K {index_k} B/token/layer"
    )
    print(
        f"{'host copy':48} {'B/token/node':>13} {'tokens per node byte vs stock':>30}"
    )
    stock = {0: tp * bf16 * LAYERS, index_k: tp * (bf16 + index_k) * LAYERS}
    for label, copies, latent, index in rows:
        per_node = copies * (latent + index) * LAYERS
        print(f"{label:48} {per_node:13.0f} {stock[index] / per_node:29.2f}x")

    print("\nLoad path, bytes per restored token per rank:")
    print(f"{'':34} {'host->device':>13} {'broadcast in':>13} {'total':>8}")
    loads = [
        ("stock auto, every rank", bf16, 0),
        ("dedup auto, source", bf16, 0),
        ("dedup auto, each other rank", 0, bf16),
        ("dedup int8, source", int8, 0),
        ("dedup int8, each other rank", 0, bf16),
        ("(alt: broadcast int8 records)", 0, int8),
        # DSA: the indexer K moves as is, host->device on the source, then
        # broadcast with the latent.
        ("DSA dedup int8, source", int8 + index_k, 0),
        ("DSA dedup int8, each other rank", 0, bf16 + index_k),
    ]
    for label, h2d, bcast in loads:
        print(
            f"{label:34} {h2d * LAYERS:13.0f} {bcast * LAYERS:13.0f} "
            f"{(h2d + bcast) * LAYERS:8.0f}"
        )


if __name__ == "__main__":
    main()
