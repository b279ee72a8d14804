"""MHA host (L2) pools for the rotated 4-bit formats (--hicache-host-dtype
int4r, k8v4r).

The formats (kv_int4_rot_codec, kv_k8v4_rot_codec) have no fused kernels yet,
so these pools always take the generic pool's torch path and say so at
start-up.
"""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.kv_int4_rot_codec import Int4RotHostFormat
from sglang.srt.mem_cache.pool_host.kv_k8v4_rot_codec import K8V4RotHostFormat
from sglang.srt.mem_cache.pool_host.mha_quantized_fused import (
    MHATokenToKVPoolQuantizedFusedHost,
)


class MHATokenToKVPoolINT4RotHost(MHATokenToKVPoolQuantizedFusedHost):
    """MHA host pool holding rotated INT4 keys and values."""

    host_format_cls = Int4RotHostFormat


class MHATokenToKVPoolK8V4RotHost(MHATokenToKVPoolQuantizedFusedHost):
    """MHA host pool holding INT8 keys and rotated INT4 values."""

    host_format_cls = K8V4RotHostFormat
