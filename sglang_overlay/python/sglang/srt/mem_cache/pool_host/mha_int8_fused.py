"""INT8 host (L2) KV pool whose transfers run as fused Triton kernels
(sglang.kernels.ops.kvcache.kv_int8_triton, through Int8HostFormat), writing
the same bytes as the torch path of MHATokenToKVPoolINT8Host."""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.mha_int8 import MHATokenToKVPoolINT8Host
from sglang.srt.mem_cache.pool_host.mha_quantized_fused import (
    MHATokenToKVPoolQuantizedFusedHost,
)


class MHATokenToKVPoolINT8FusedHost(
    MHATokenToKVPoolQuantizedFusedHost, MHATokenToKVPoolINT8Host
):
    """The INT8 host pool with fused Triton transfers."""
