"""Deprecated: the entry point patched hicache_auto_size.py and
hybrid_pool_assembler.py still import; the registry
(host_format.host_pool_cls) is the dispatch."""

from __future__ import annotations

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


def get_mla_host_pool_cls(buffer_info: MLABufferInfo, host_dtype: str = "auto") -> type:
    if host_dtype == "auto":
        return MLATokenToKVPoolHost
    return host_pool_cls(host_dtype, "mla")
