"""MHA host (L2) pool that stores KV in an encoded host format
(--hicache-host-dtype): the format encodes each layer's K and V rows (sides
"k" and "v"); EncodedHostPool's collaborators move them. Dispatched through
host_format.host_pool_cls(name, "mha"), which binds the format."""

from __future__ import annotations

from typing import Sequence

import torch

from sglang.srt.mem_cache.device_pool_info import MHABufferInfo
from sglang.srt.mem_cache.pool_host import layer_plan
from sglang.srt.mem_cache.pool_host.encoded import (
    ENCODED_HOST_DEVICE_DTYPES,
    EncodedHostPool,
)
from sglang.srt.mem_cache.pool_host.host_format import (
    FP8_DEVICE_DTYPES,
    unit_tokens_for,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost


class MHATokenToKVPoolEncodedHost(EncodedHostPool, MHATokenToKVPoolHost):
    """L3 storage moves pages in this encoded form: one object per page for
    generic backends (file), the format's zero-copy objects per page for
    zero-copy backends (mooncake)."""

    @classmethod
    def _format_for(cls, buffer_info, page_size, layout, device_dtype, key8_layers=()):
        # key8_layers: the per-layer plan (layer_plan.py), refused by a format
        # without one.
        return cls.host_format_cls(
            (buffer_info.head_dim, buffer_info.v_head_dim),
            buffer_info.head_num,
            unit_tokens_for(page_size, layout),
            device_dtype,
            **layer_plan.format_keywords(cls.host_format_cls, key8_layers),
        )

    def __init__(
        self,
        buffer_info: MHABufferInfo,
        *args,
        write_back_staging: tuple[torch.Tensor, torch.Tensor] | None = None,
        device_kv_dtype: torch.dtype | None = None,
        **kwargs,
    ):
        # device_kv_dtype: the device pool's dtype; FP8 KV reaches the pool as
        # its uint8 storage dtype, so only the caller knows which FP8 it is.
        self.device_kv_dtype = self._check_device_dtype(buffer_info, device_kv_dtype)
        # Packed MTP draft layers (draft_buffer_infos, one per draft pool) are
        # encoded after the target's with the same format: the upstream pool
        # checks their geometry and appends their device buffers. Records move
        # through the pool's own staging, not the upstream write_back_staging.
        super().__init__(
            buffer_info, *args, device_dtype=self.device_kv_dtype, **kwargs
        )

    @classmethod
    def _check_device_dtype(
        cls, buffer_info: MHABufferInfo, device_kv_dtype: torch.dtype | None
    ) -> torch.dtype:
        """The element dtype of the device KV rows, or a refusal naming the flags."""
        fmt = cls.host_format_cls
        store = buffer_info.dtype
        dtype = store if device_kv_dtype is None else device_kv_dtype
        fp8 = dtype in FP8_DEVICE_DTYPES and store == torch.uint8
        if buffer_info.scales is None and (
            (dtype in ENCODED_HOST_DEVICE_DTYPES and store == dtype)
            or (fp8 and fmt.fp8_device_kv)
        ):
            return dtype
        if fp8:
            from sglang.srt.mem_cache.pool_host.host_format import fp8_host_dtypes

            fp8_names = fp8_host_dtypes()
            raise NotImplementedError(
                f"--hicache-host-dtype {fmt.name} does not encode an FP8 device KV "
                f"cache ({str(dtype).removeprefix('torch.')}). Use "
                f"--hicache-host-dtype {' or '.join([*fp8_names, 'auto'])}, or "
                "--kv-cache-dtype bf16."
            )
        # FP4 (scales) or uint8 storage of unknown FP8 kind, or another dtype.
        got = (
            "a quantized (FP8/FP4) one"
            if store.itemsize <= 1 or buffer_info.scales is not None
            else str(store).removeprefix("torch.")
        )
        raise NotImplementedError(
            f"--hicache-host-dtype {fmt.name} needs a BF16/FP16 device KV cache"
            f"{' (or FP8, passed as device_kv_dtype)' if fmt.fp8_device_kv else ''}, "
            f"got {got}. Pass --kv-cache-dtype bf16, or use "
            "--hicache-host-dtype auto."
        )

    def device_size_per_token(self) -> int:
        """Bytes per token of the same KV in the device dtype (what BF16 offload stores)."""
        dims = self.head_dim + self.v_head_dim
        return dims * self.head_num * self.layer_num * self.dtype.itemsize

    def get_ksize_per_token(self):
        return self.head_dim * self.head_num * self.layer_num

    def _device_buffers(self, side_index: int) -> Sequence[torch.Tensor]:
        return (self.device_k_buffers, self.device_v_buffers)[side_index]

    def _initialize_transfer_views(self, buffer_info, write_back_staging) -> None:
        self.element_dim = self.head_num * self.head_dim
        self.token_stride_size = self.element_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        self.k_data_refs = []
        self.v_data_refs = []
        self.k_data_ptrs = None
        self.v_data_ptrs = None
        self.host_kv_data_refs = []
        self._build_transfer((*self.device_k_buffers, *self.device_v_buffers))
