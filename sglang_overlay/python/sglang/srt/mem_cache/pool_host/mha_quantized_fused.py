"""MHA encoded host (L2) KV pool whose transfers run as the format's fused
Triton kernels (QuantizedFusedHostPoolMixin), with the torch path of
MHATokenToKVPoolQuantizedHost as fallback. Each format has one small subclass
that sets `host_format_cls`."""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.mha_quantized import MHATokenToKVPoolQuantizedHost
from sglang.srt.mem_cache.pool_host.quantized_fused import QuantizedFusedHostPoolMixin


class MHATokenToKVPoolQuantizedFusedHost(
    QuantizedFusedHostPoolMixin, MHATokenToKVPoolQuantizedHost
):
    """The encoded MHA host pool with fused transfers (format and torch path
    in MHATokenToKVPoolQuantizedHost)."""

    def _initialize_transfer_views(self, buffer_info, write_back_staging) -> None:
        self._init_fused_transfer_state()
        super()._initialize_transfer_views(buffer_info, write_back_staging)
        self._finish_fused_setup()


def get_mha_quantized_host_pool_cls(host_dtype: str) -> type:
    """Deprecated: host_format.host_pool_cls(host_dtype, "mha")."""
    return host_pool_cls(host_dtype, "mha")
