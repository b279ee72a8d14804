"""MHA encoded host (L2) KV pool whose transfers run as the format's fused
Triton kernels (QuantizedFusedHostPoolMixin), with the torch path of
MHATokenToKVPoolQuantizedHost as fallback. Each format has one small subclass
that sets `host_format_cls`."""

from __future__ import annotations

import importlib

from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
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


# --hicache-host-dtype -> (module, class) of its MHA host pool, imported on use
# so only the selected format's codec and kernels load.
MHA_QUANTIZED_HOST_POOLS: dict[str, tuple[str, str]] = {
    "int8": (
        "sglang.srt.mem_cache.pool_host.mha_int8_fused",
        "MHATokenToKVPoolINT8FusedHost",
    ),
    "int4": ("sglang.srt.mem_cache.pool_host.mha_int4", "MHATokenToKVPoolINT4Host"),
    "k8v4": ("sglang.srt.mem_cache.pool_host.mha_int4", "MHATokenToKVPoolK8V4Host"),
    "int4r": (
        "sglang.srt.mem_cache.pool_host.mha_int4_rot",
        "MHATokenToKVPoolINT4RotHost",
    ),
    "k8v4r": (
        "sglang.srt.mem_cache.pool_host.mha_int4_rot",
        "MHATokenToKVPoolK8V4RotHost",
    ),
}


def get_mha_quantized_host_pool_cls(host_dtype: str) -> type:
    """The MHA host pool class of an encoded --hicache-host-dtype."""
    # The format first: an unknown or missing format fails naming the flag.
    host_format_cls(host_dtype)
    if host_dtype not in MHA_QUANTIZED_HOST_POOLS:
        raise NotImplementedError(
            f"--hicache-host-dtype {host_dtype} has no MHA host pool."
        )
    module_name, class_name = MHA_QUANTIZED_HOST_POOLS[host_dtype]
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            f"--hicache-host-dtype {host_dtype} is not available for MHA models in "
            f"this build ({module_name}.{class_name}: {e})."
        ) from e
