"""Host (L2) pool that stores MHA KV as symmetric INT8 (--hicache-host-dtype int8).

The device (L1) KV cache stays BF16/FP16; only the host copy is compressed.
Each token, layer, K|V and head is stored as `head_dim` INT8 values and one
FP16 scale (kv_int8_codec.Int8HostFormat). The generic quantized pool moves
the records with its torch transfer path.
"""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.kv_int8_codec import Int8HostFormat
from sglang.srt.mem_cache.pool_host.mha_quantized import MHATokenToKVPoolQuantizedHost


class MHATokenToKVPoolINT8Host(MHATokenToKVPoolQuantizedHost):
    """MHA host pool holding INT8 KV records and FP16 scales."""

    host_format_cls = Int8HostFormat
