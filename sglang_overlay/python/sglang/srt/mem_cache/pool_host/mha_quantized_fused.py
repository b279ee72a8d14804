"""Deprecated: the entry point patched mha.py still calls; the registry
(host_format.host_pool_cls) is the dispatch."""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls


def get_mha_quantized_host_pool_cls(host_dtype: str) -> type:
    return host_pool_cls(host_dtype, "mha")
