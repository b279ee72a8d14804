"""MLA host (L2) pool that stores the latent KV in an encoded host format
(--hicache-host-dtype; MLA formats encode one side, "kv", the latent rows of
kv_lora_rank + qk_rope_head_dim values). EncodedHostPool's collaborators move
them; L3 pages keep MLA's key scheme, one object per page (rank-replicated
keys). Dispatched through host_format.host_pool_cls(name, "mla")."""

from __future__ import annotations

from typing import Sequence

import torch

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
from sglang.srt.mem_cache.pool_host import layer_plan
from sglang.srt.mem_cache.pool_host.encoded import (
    ENCODED_HOST_DEVICE_DTYPES,
    EncodedHostPool,
)
from sglang.srt.mem_cache.pool_host.host_format import unit_tokens_for
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


class MLATokenToKVPoolEncodedHost(EncodedHostPool, MLATokenToKVPoolHost):
    log_kind = "MLA "

    @classmethod
    def _format_for(cls, buffer_info, page_size, layout, device_dtype, key8_layers=()):
        layer_plan.refuse_mla_plan(cls.host_format_cls.name, key8_layers)
        return cls.host_format_cls(
            (buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim,),
            1,
            unit_tokens_for(page_size, layout),
            device_dtype,
            rope_dim=buffer_info.qk_rope_head_dim,
        )

    def __init__(
        self,
        buffer_info: MLABufferInfo,
        *args,
        override_kv_cache_dim: int | None = None,
        dcp_size: int = 1,
        layer_shard_enabled: bool = False,
        **kwargs,
    ):
        _refuse_unsupported(
            self.host_format_cls.name,
            buffer_info,
            override_kv_cache_dim,
            dcp_size,
            layer_shard_enabled,
        )
        # Packed NEXTN draft layers (draft_buffer_infos) are encoded after the
        # target's with the same format; the upstream pool checks their row
        # width and dtype.
        super().__init__(
            buffer_info,
            *args,
            device_dtype=buffer_info.dtype,
            override_kv_cache_dim=override_kv_cache_dim,
            dcp_size=dcp_size,
            layer_shard_enabled=layer_shard_enabled,
            **kwargs,
        )

    def device_size_per_token(self) -> int:
        """Bytes per token of the same KV in the device dtype (what BF16 offload stores)."""
        return self.kv_cache_dim * self.dtype.itemsize * self.layer_num

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    def _device_buffers(self, side_index: int) -> Sequence[torch.Tensor]:
        # One side: the latent rows [slots, 1, kv_lora_rank + qk_rope_head_dim].
        return self.device_kv_buffers

    def _initialize_transfer_views(self) -> None:
        self.staging_buffer = None
        self.token_stride_size = self.kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        self.data_refs = []
        self.data_ptrs = None
        self._build_transfer(self.device_kv_buffers)

    def get_contiguous_buf_infos(self):
        raise NotImplementedError(
            f"--hicache-host-dtype {self.host_format.name} host pools hold encoded "
            "records that KV transfer cannot write into; use --hicache-host-dtype "
            "auto."
        )


def _refuse_unsupported(
    name: str,
    buffer_info: MLABufferInfo,
    override_kv_cache_dim: int | None,
    dcp_size: int,
    layer_shard_enabled: bool,
) -> None:
    """Fail at construction, naming the flag, for what the pool cannot encode."""
    width = buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim
    if (
        buffer_info.packed_fp8
        or buffer_info.scales is not None
        or buffer_info.dtype not in ENCODED_HOST_DEVICE_DTYPES
        or isinstance(buffer_info.buffers, MLASplitBuffers)
        or (override_kv_cache_dim or width) != width
    ):
        raise NotImplementedError(
            f"--hicache-host-dtype {name} for MLA models needs a BF16/FP16 latent KV "
            "cache of kv_lora_rank + qk_rope_head_dim values per token, got "
            f"{buffer_info.dtype} rows of {override_kv_cache_dim or width} "
            "(FP8/FP4 KV, DSA packed rows and NPU split buffers are not "
            "supported). Pass --kv-cache-dtype bf16, or use --hicache-host-dtype "
            "auto."
        )
    if dcp_size > 1:
        raise NotImplementedError(
            f"--hicache-host-dtype {name} for MLA models does not support decode "
            "context parallelism (--dcp-size > 1)."
        )
    if layer_shard_enabled:
        raise NotImplementedError(
            f"--hicache-host-dtype {name} for MLA models does not support "
            "layer-sharded device KV."
        )
