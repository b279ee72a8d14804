"""MHA host (L2) pools that store KV as 4-bit codes (--hicache-host-dtype int4,
k8v4).

The device (L1) KV cache stays BF16/FP16; only the host copy is encoded, by
kv_int4_codec's formats. Transfers run as the formats' fused Triton kernels
(sglang.kernels.ops.kvcache.kv_int4_triton) where they can, else the generic
pool's torch path; both write the same bytes.
"""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.kv_int4_codec import (
    Int4HostFormat,
    K8V4HostFormat,
)
from sglang.srt.mem_cache.pool_host.mha_quantized_fused import (
    MHATokenToKVPoolQuantizedFusedHost,
)


class MHATokenToKVPoolINT4Host(MHATokenToKVPoolQuantizedFusedHost):
    """MHA host pool holding INT4 keys (per channel over a page) and values."""

    host_format_cls = Int4HostFormat


class MHATokenToKVPoolK8V4Host(MHATokenToKVPoolQuantizedFusedHost):
    """MHA host pool holding INT8 keys and INT4 values."""

    host_format_cls = K8V4HostFormat
