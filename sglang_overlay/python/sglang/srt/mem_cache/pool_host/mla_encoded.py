"""MLA host (L2) pool that stores the latent KV in an encoded host format
(--hicache-host-dtype; MLA formats encode one side, "kv", the latent rows of
kv_lora_rank + qk_rope_head_dim values). EncodedHostPool's collaborators move
them; L3 pages keep MLA's key scheme, one object per page (rank-replicated
keys). Dispatched through host_format.host_pool_cls(name, "mla")."""

from __future__ import annotations

from typing import Sequence

import torch

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
from sglang.srt.mem_cache.pool_host.encoded import (
    ENCODED_HOST_DEVICE_DTYPES,
    EncodedHostPool,
    check_layout,
    unit_tokens_for,
)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


class MLATokenToKVPoolEncodedHost(EncodedHostPool, MLATokenToKVPoolHost):
    log_kind = "MLA "

    @classmethod
    def _format_for(cls, buffer_info, page_size, layout, device_dtype):
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
        host_to_device_ratio: float,
        host_size: int,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        override_kv_cache_dim: int | None = None,
        draft_buffer_infos: Sequence[MLABufferInfo] = (),
        dcp_size: int = 1,
        dcp_rank: int = 0,
        *,
        device_capacity_tokens: int,
        start_layer: int,
        end_layer: int,
        target_layer_num: int,
        layer_shard_enabled: bool = False,
        pool_label: str = "kv",
        host_token_capacity: int | None = None,
    ):
        name = self.host_format_cls.name
        check_layout(name, layout)
        _refuse_unsupported(
            name,
            buffer_info,
            override_kv_cache_dim,
            dcp_size,
            layer_shard_enabled,
        )
        # HostKVCache sizes the pool from get_size_per_token, which the format answers.
        self.host_format = self._format_for(
            buffer_info, page_size, layout, buffer_info.dtype
        )
        super().__init__(
            buffer_info,
            host_to_device_ratio,
            host_size,
            page_size,
            layout,
            pin_memory,
            device,
            allocator_type,
            override_kv_cache_dim,
            # Packed NEXTN draft layers are encoded after the target's with the
            # same format; the upstream pool checks their row width and dtype.
            draft_buffer_infos,
            dcp_size,
            dcp_rank,
            device_capacity_tokens=device_capacity_tokens,
            start_layer=start_layer,
            end_layer=end_layer,
            target_layer_num=target_layer_num,
            layer_shard_enabled=layer_shard_enabled,
            pool_label=pool_label,
            host_token_capacity=host_token_capacity,
        )
        self._finish_setup()

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
