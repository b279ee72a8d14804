"""Host (L2) pool that stores MLA latent KV as INT8 (--hicache-host-dtype int8).

The device (L1) latent cache stays BF16/FP16; only the host copy is encoded,
by kv_mla_int8_codec: the ``kv_lora_rank`` latent values as INT8 tiles of 128
with one FP16 scale each, the ``qk_rope_head_dim`` RoPE values verbatim. Each
record ("kv", "scale", "rope") lives in its own host tensor, indexed per layer
by a unit: a page for page_first and page_first_direct, a token for
layer_first.

Like the MHA INT8 pool, the pool moves its own records on the caller's stream
(gather -> encode -> store on backup, fetch -> decode -> scatter on load), so
it serves the kernel and the direct io backend alike, and host indices are
range-checked on the CPU before anything moves.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import (
    DEVICE_DTYPES,
    MLAInt8HostFormat,
)
from sglang.srt.mem_cache.pool_host.mha_int8 import MHATokenToKVPoolINT8Host
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

logger = logging.getLogger(__name__)

MLA_INT8_HOST_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
MLA_INT8_HOST_IO_BACKENDS = ("kernel", "direct")
# Tokens one staging chunk holds (rounded to whole pages).
_STAGING_TOKENS = 4096
_FLAG = "--hicache-host-dtype int8"


class MLATokenToKVPoolINT8Host(MLATokenToKVPoolHost):
    """MLA host pool holding the latent cache in MLAInt8HostFormat.

    L3 storage moves pages in this encoded form, one object per page (MLA keys
    are rank-replicated): the page's "kv", "scale" and "rope" records, each in
    host order, concatenated in that order.
    """

    host_format_cls = MLAInt8HostFormat
    storage_format_tag = MLAInt8HostFormat.storage_format_tag
    # Host rows are addressed on the CPU and device rows where the device pool
    # lives; the controller passes indices through unmoved.
    transfers_own_indices = True
    transfer_path = "torch"
    transfer_path_reason = "the pool's own torch transfer code"

    @classmethod
    def host_bytes_per_device_byte(
        cls, buffer_info: MLABufferInfo, page_size: int = 1, layout: str = ""
    ) -> float:
        width = buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim
        encoded = cls.host_format_cls.bytes_per_token_for(
            (width,),
            1,
            1,
            buffer_info.dtype,
            rope_dim=buffer_info.qk_rope_head_dim,
        )
        return encoded / (width * buffer_info.dtype.itemsize)

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
        _refuse_unsupported(
            buffer_info,
            layout,
            override_kv_cache_dim,
            draft_buffer_infos,
            dcp_size,
            layer_shard_enabled,
        )
        width = buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim
        self.host_format = self.host_format_cls(
            (width,),
            1,
            page_size if layout != "layer_first" else 1,
            buffer_info.dtype,
            rope_dim=buffer_info.qk_rope_head_dim,
        )
        self.host_records: dict[str, torch.Tensor] = {}
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
        logger.info(
            "HiCache %s MLA host pool stores INT8 KV: %d B/token (%s: %d B/token), "
            "%.3fx tokens per host byte, layout=%s; %s. Transfer path: %s (%s).",
            pool_label,
            self.get_size_per_token(),
            self.dtype,
            self.device_size_per_token(),
            self.device_size_per_token() / self.get_size_per_token(),
            layout,
            self.host_format.describe(),
            self.transfer_path,
            self.transfer_path_reason,
        )

    # ------------------------------------------------------------------
    # sizes and buffers

    def get_size_per_token(self):
        return int(self.host_format.bytes_per_token() * self.layer_num)

    def device_size_per_token(self) -> int:
        """Bytes per token of the same KV in the device dtype (what BF16 offload stores)."""
        return self.kv_cache_dim * self.dtype.itemsize * self.layer_num

    @property
    def host_dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def _page_major(self) -> bool:
        return self.layout != "layer_first"

    @property
    def unit_tokens(self) -> int:
        return self.host_format.unit_tokens

    def init_kv_buffer(self):
        units = self.page_num if self._page_major else self.size
        alloc_func = ALLOC_MEMORY_FUNCS[self._transfer_device.type]
        for record in self.host_format.records:
            dims = (
                (units, self.layer_num, *record.shape)
                if self._page_major
                else (self.layer_num, units, *record.shape)
            )
            self.host_records[record.name] = alloc_func(
                dims,
                dtype=record.dtype,
                device=self.device,
                pin_memory=self.pin_memory,
                allocator=self.allocator,
            )
        self.token_stride_size = self.kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        # HostKVCache.destroy unregisters every tensor in kv_buffer.
        return list(self.host_records.values())

    def _initialize_transfer_views(self) -> None:
        # Upstream movers copy raw rows; encoded records move through our own path.
        self.can_use_jit = False
        self.can_use_write_back_jit = False
        self.staging_page_capacity = 0
        self.staging_token_capacity = 0
        self.staging_buffer = None
        self.data_refs = []
        self.data_ptrs = None
        self._init_device_row_stride(self.device_kv_buffers)

        units = self.page_num if self._page_major else self.size
        self.staging_units = min(max(1, _STAGING_TOKENS // self.unit_tokens), units)
        dev = self._transfer_device
        self._nonfinite_rows = torch.zeros((), dtype=torch.int64, device=dev)
        self._scale_amax = torch.zeros(
            (self.layer_num, len(self.host_format.sides)),
            dtype=torch.float32,
            device=dev,
        )
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_run_copies = dev.type != "cpu"
        # One layer of encoded records plus its device-dtype rows, per direction
        # (a backup may encode while a load decodes).
        self._staging = {
            "d2h": self._alloc_staging(dev),
            "h2d": self._alloc_staging(dev),
        }
        if dev.type == "cuda":
            # The counters enqueued here are complete before the transfer
            # streams touch them.
            torch.cuda.current_stream(dev).synchronize()

    def _alloc_staging(self, dev) -> dict[str, torch.Tensor]:
        stage = {
            record.name: torch.empty(
                (self.staging_units, *record.shape), dtype=record.dtype, device=dev
            )
            for record in self.host_format.records
        }
        stage["rows"] = torch.empty(
            (self.staging_units * self.unit_tokens, 1, self.kv_cache_dim),
            dtype=self.dtype,
            device=dev,
        )
        return stage

    def _host_layer(self, name: str, layer_id: int) -> torch.Tensor:
        """[units, *record.shape] view of one layer of a host record."""
        buf = self.host_records[name]
        return buf[:, layer_id] if self._page_major else buf[layer_id]

    def get_contiguous_buf_infos(self):
        raise NotImplementedError(
            f"{_FLAG} host pools hold encoded records that KV transfer cannot "
            "write into; disaggregated decode needs --hicache-host-dtype auto."
        )

    # ------------------------------------------------------------------
    # host-tier statistics

    def nonfinite_row_count(self) -> int:
        """Latent tiles stored with a NaN scale plus RoPE rows holding NaN/Inf,
        backed up so far. They restore as NaN (RoPE: as stored), never as
        finite values. Reading synchronizes with the transfer device."""
        self._sync_transfer_device()
        return int(self._nonfinite_rows.item())

    def scale_amax_by_layer(self) -> torch.Tensor:
        """Largest finite latent-tile amax backed up so far, per layer: CPU
        float32 [layer_num, 1]. Reading synchronizes with the transfer device."""
        self._sync_transfer_device()
        return self._scale_amax.to("cpu", copy=True)

    def _sync_transfer_device(self) -> None:
        if self._nonfinite_rows.is_cuda:
            torch.cuda.synchronize(self._nonfinite_rows.device)

    # ------------------------------------------------------------------
    # transfers
    #
    # Index handling is the MHA INT8 pool's, shared until the host-format
    # machinery makes it generic: host units on the CPU, range-checked before
    # anything moves, staging-sized chunks, run copies on a device.

    _host_units = MHATokenToKVPoolINT8Host._host_units
    _check_host_indices = MHATokenToKVPoolINT8Host._check_host_indices
    _runs = staticmethod(MHATokenToKVPoolINT8Host._runs)
    _chunks = MHATokenToKVPoolINT8Host._chunks
    _store = MHATokenToKVPoolINT8Host._store
    _fetch = MHATokenToKVPoolINT8Host._fetch

    @staticmethod
    def _check_io_backend(io_backend: str) -> None:
        if io_backend not in MLA_INT8_HOST_IO_BACKENDS:
            raise ValueError(
                f"{_FLAG} supports --hicache-io-backend "
                f"{', '.join(MLA_INT8_HOST_IO_BACKENDS)}; got {io_backend!r}."
            )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        self._check_io_backend(io_backend)
        stage = self._staging["d2h"]
        names = [record.name for record in self.host_format.records]
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            rows = stage["rows"][:n_tokens]
            out = {name: stage[name][:n_units] for name in names}
            for layer_id in self._target_layer_indices:
                host_layer = self._host_layer_by_controller[layer_id]
                device_buffer = self.device_kv_buffers[
                    self._buffer_index_by_layer[layer_id]
                ]
                torch.index_select(device_buffer, 0, dev_rows, out=rows)
                stats = self.host_format.encode_into(
                    [rows.view(n_units, self.unit_tokens, *rows.shape[1:])], out
                )
                self._nonfinite_rows += stats.nonfinite
                slot = self._scale_amax[host_layer]
                torch.maximum(slot, stats.amax, out=slot)
                for name in names:
                    self._store(name, host_layer, stage[name], units, runs)

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id,
        io_backend,
        *,
        is_draft: bool = False,
    ):
        if is_draft:
            raise NotImplementedError(f"{_FLAG} MLA host pool has no draft layers.")
        self._check_io_backend(io_backend)
        if layer_id not in self._target_layer_indices:
            return
        host_layer = self._host_layer_by_controller[layer_id]
        device_buffer = self.device_kv_buffers[self._buffer_index_by_layer[layer_id]]
        stage = self._staging["h2d"]
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            records = {
                record.name: self._fetch(
                    record.name, host_layer, stage[record.name], units, runs
                )
                for record in self.host_format.records
            }
            rows = stage["rows"][:n_tokens]
            self.host_format.decode_into(
                records, [rows.view(n_units, self.unit_tokens, *rows.shape[1:])]
            )
            device_buffer.index_copy_(0, dev_rows, rows)

    # ------------------------------------------------------------------
    # L3 storage pages
    #
    # A page goes to storage exactly as it sits in L2, never re-encoded or
    # widened: its "kv", "scale" and "rope" records in that order, each in host
    # order ([layer, token, ...]). storage_format_tag names this byte format in
    # every storage key, so pages of another host format are a miss. Generic
    # backends (file) get it as one flat copy; zero-copy backends (mooncake) as
    # one object per page gathered from the record buffers, which MLA's
    # rank-replicated keys already expect.

    def _storage_page_parts(self, index) -> list[torch.Tensor]:
        """Byte views of the page's records at token `index`, in storage order
        (one per record for page-major layouts, one per record and layer for
        layer_first)."""
        index = int(index)
        if index % self.page_size or not 0 <= index < self.size:
            raise ValueError(
                f"storage page index {index} is not a page start of this pool "
                f"(page_size {self.page_size}, size {self.size})"
            )
        parts = []
        for record in self.host_format.records:
            buf = self.host_records[record.name]
            if self._page_major:
                parts.append(buf[index // self.page_size].view(torch.uint8).reshape(-1))
            else:
                parts.extend(
                    buf[layer, index : index + self.page_size]
                    .view(torch.uint8)
                    .reshape(-1)
                    for layer in range(self.layer_num)
                )
        return parts

    @property
    def storage_page_bytes(self) -> int:
        return self.get_size_per_token() * self.page_size

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        # Three host tensors hold a page, so a flat page is always a copy.
        return torch.cat(self._storage_page_parts(index))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            self.storage_page_bytes,
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        nbytes = data_page.numel() * data_page.element_size()
        if nbytes != self.storage_page_bytes:
            # A short or long object is not a page of this format: refuse it
            # before any byte reaches the pool.
            raise ValueError(
                f"MLA INT8 storage page has {nbytes} bytes, expected "
                f"{self.storage_page_bytes} ({self.storage_format_tag})"
            )
        flat = data_page.reshape(-1).view(torch.uint8)
        offset = 0
        for part in self._storage_page_parts(index):
            part.copy_(flat[offset : offset + part.numel()])
            offset += part.numel()

    def get_page_buffer_meta(self, indices):
        """(pointer, bytes) of every piece of each page's one storage object,
        in the flat page's byte order."""
        if len(indices) % self.page_size:
            raise ValueError("MLA INT8 storage page metadata needs whole pages.")
        ptrs, sizes = [], []
        for index in indices[:: self.page_size].tolist():
            for part in self._storage_page_parts(index):
                ptrs.append(part.data_ptr())
                sizes.append(part.numel())
        return ptrs, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        # Pages span three record tensors; O_DIRECT file backends take the
        # copying path instead.
        return False


def _refuse_unsupported(
    buffer_info: MLABufferInfo,
    layout: str,
    override_kv_cache_dim: int | None,
    draft_buffer_infos: Sequence[MLABufferInfo],
    dcp_size: int,
    layer_shard_enabled: bool,
) -> None:
    """Fail at construction, naming the flag, for what the pool cannot encode."""
    if layout not in MLA_INT8_HOST_LAYOUTS:
        raise NotImplementedError(
            f"{_FLAG} for MLA models supports --hicache-mem-layout "
            f"{', '.join(MLA_INT8_HOST_LAYOUTS)}; got {layout!r}."
        )
    width = buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim
    if (
        buffer_info.packed_fp8
        or buffer_info.scales is not None
        or buffer_info.dtype not in DEVICE_DTYPES
        or not isinstance(buffer_info.buffers, tuple)
        or (override_kv_cache_dim or width) != width
    ):
        raise NotImplementedError(
            f"{_FLAG} for MLA models needs a BF16/FP16 latent KV cache of "
            f"kv_lora_rank + qk_rope_head_dim values per token, got "
            f"{buffer_info.dtype} rows of {override_kv_cache_dim or width} "
            "(FP8/FP4 KV, DSA packed rows and NPU split buffers are not supported). "
            "Pass --kv-cache-dtype bf16, or use --hicache-host-dtype auto."
        )
    if draft_buffer_infos:
        raise NotImplementedError(
            f"{_FLAG} does not pack MTP draft KV layers into the MLA host pool."
        )
    if dcp_size > 1:
        raise NotImplementedError(
            f"{_FLAG} for MLA models does not support decode context parallelism."
        )
    if layer_shard_enabled:
        raise NotImplementedError(
            f"{_FLAG} for MLA models does not support layer-sharded device KV."
        )


def get_mla_host_pool_cls(buffer_info: MLABufferInfo, host_dtype: str = "auto") -> type:
    """The MLA host pool class for --hicache-host-dtype."""
    if host_dtype == "int8":
        return MLATokenToKVPoolINT8Host
    return MLATokenToKVPoolHost
