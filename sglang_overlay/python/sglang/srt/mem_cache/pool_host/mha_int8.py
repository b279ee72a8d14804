"""Host (L2) pool that stores MHA KV as symmetric INT8 (--hicache-host-dtype int8).

The device (L1) KV cache stays BF16/FP16; only the host copy is compressed.
Backup quantizes on the transfer device right before the D2H copy, and load
dequantizes on the transfer device right after the H2D copy, both on the
HiCache transfer stream, so the per-layer done event still marks fully
restored KV.

Record format, per token, layer and K|V: `head_num * head_dim` INT8 values
and `head_num` FP16 scales (kv_int8_codec). Payload and scales live in
separate host tensors, so neither carries padding:

  page_first, page_first_direct (one layout: a page is contiguous over layers)
    k_buffer      [page_num, layer_num, page_size, head_num, head_dim]    int8
    v_buffer      [page_num, layer_num, page_size, head_num, v_head_dim]  int8
    scale_buffer  [page_num, layer_num, page_size, 2, head_num]           fp16
  layer_first
    k_buffer      [layer_num, size, 1, head_num, head_dim]                int8
    v_buffer      [layer_num, size, 1, head_num, v_head_dim]              int8
    scale_buffer  [layer_num, size, 1, 2, head_num]                       fp16

Both are indexed by a "unit" (a page, or a token for layer_first) per layer,
which is what the transfer code below works in. Bytes per token are
`layer_num * head_num * (head_dim + v_head_dim + 4)`, against
`layer_num * head_num * (head_dim + v_head_dim) * 2` for BF16: 1.97x tokens
per host byte at head_dim 128.

The pool owns its transfer code (gather -> encode -> store, and
load -> decode -> scatter), so every supported layout works with both the
`kernel` and `direct` io backends on any device. Staging buffers are
allocated once per direction and transfers are processed in chunks of the
staging capacity; reusing one buffer across chunks is safe because all uses
are ordered on one transfer stream.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from sglang.srt.mem_cache.device_pool_info import MHABufferInfo
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

logger = logging.getLogger(__name__)

INT8_HOST_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
INT8_HOST_IO_BACKENDS = ("kernel", "direct")
INT8_HOST_DEVICE_DTYPES = (torch.bfloat16, torch.float16)
# Tokens one staging chunk holds (rounded to whole pages).
_INT8_STAGING_TOKENS = 4096


def int8_host_bytes_ratio(buffer_info: MHABufferInfo) -> float:
    """Host bytes of the INT8 copy per device byte of the same tokens."""
    dims = buffer_info.head_dim + buffer_info.v_head_dim
    encoded = dims + 2 * codec.SCALE_DTYPE.itemsize
    return encoded / (dims * buffer_info.dtype.itemsize)


class MHATokenToKVPoolINT8Host(MHATokenToKVPoolHost):
    # Host rows are addressed on the CPU and device rows where the device pool
    # lives; the controller passes indices through unmoved.
    transfers_own_indices = True
    storage_format_tag = "int8-fp16scale-v1"

    def __init__(
        self,
        buffer_info: MHABufferInfo,
        host_to_device_ratio: float,
        host_size: int,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        *,
        device_capacity_tokens: int,
        start_layer: int,
        end_layer: int,
        draft_buffer_infos: Sequence[MHABufferInfo] = (),
        write_back_staging: tuple[torch.Tensor, torch.Tensor] | None = None,
        pool_label: str = "kv",
        host_token_capacity: int | None = None,
    ):
        if layout not in INT8_HOST_LAYOUTS:
            raise NotImplementedError(
                f"--hicache-host-dtype int8 supports --hicache-mem-layout "
                f"{', '.join(INT8_HOST_LAYOUTS)}; got {layout!r}."
            )
        if draft_buffer_infos:
            raise NotImplementedError(
                "--hicache-host-dtype int8 does not pack MTP draft KV layers yet."
            )
        if buffer_info.scales is not None or buffer_info.dtype not in (
            INT8_HOST_DEVICE_DTYPES
        ):
            raise NotImplementedError(
                "--hicache-host-dtype int8 needs a BF16/FP16 device KV cache "
                f"(--kv-cache-dtype auto/bf16/fp16); got {buffer_info.dtype}"
                + (" with quantization scales." if buffer_info.scales else ".")
            )
        self.store_dtype = torch.int8
        self.scale_dtype = codec.SCALE_DTYPE
        self.k_host_buffer: torch.Tensor | None = None
        self.v_host_buffer: torch.Tensor | None = None
        self.scale_buffer: torch.Tensor | None = None
        super().__init__(
            buffer_info,
            host_to_device_ratio,
            host_size,
            page_size,
            layout,
            pin_memory,
            device,
            allocator_type,
            device_capacity_tokens=device_capacity_tokens,
            start_layer=start_layer,
            end_layer=end_layer,
            write_back_staging=None,
            pool_label=pool_label,
            host_token_capacity=host_token_capacity,
        )
        logger.info(
            "HiCache %s host pool stores INT8 KV: %d B/token (%s: %d B/token), "
            "%.2fx tokens per host byte, layout=%s.",
            pool_label,
            self.get_size_per_token(),
            self.dtype,
            self.device_size_per_token(),
            self.device_size_per_token() / self.get_size_per_token(),
            layout,
        )

    # ------------------------------------------------------------------
    # sizes and buffers

    def get_size_per_token(self):
        payload = (self.head_dim + self.v_head_dim) * self.head_num
        scales = 2 * self.head_num * self.scale_dtype.itemsize
        return (payload + scales) * self.layer_num

    def device_size_per_token(self) -> int:
        """Bytes per token of the same KV in the device dtype (what BF16 offload stores)."""
        return (
            (self.head_dim + self.v_head_dim)
            * self.head_num
            * self.layer_num
            * self.dtype.itemsize
        )

    def get_ksize_per_token(self):
        return self.head_dim * self.head_num * self.layer_num

    @property
    def _page_major(self) -> bool:
        return self.layout != "layer_first"

    @property
    def unit_tokens(self) -> int:
        """Tokens in one addressable host unit: a page, or a token (layer_first)."""
        return self.page_size if self._page_major else 1

    def _unit_dims(self, units: int, layered: bool = True) -> dict[str, tuple]:
        """Shapes of K, V and scale tensors for `units` units."""
        per_unit = {
            "k": (self.unit_tokens, self.head_num, self.head_dim),
            "v": (self.unit_tokens, self.head_num, self.v_head_dim),
            "scale": (self.unit_tokens, 2, self.head_num),
        }
        if not layered:
            return {name: (units, *shape) for name, shape in per_unit.items()}
        if self._page_major:
            return {
                name: (units, self.layer_num, *shape)
                for name, shape in per_unit.items()
            }
        return {
            name: (self.layer_num, units, *shape) for name, shape in per_unit.items()
        }

    def init_kv_buffer(self):
        units = self.page_num if self._page_major else self.size
        dims = self._unit_dims(units)
        alloc_func = ALLOC_MEMORY_FUNCS[self._transfer_device.type]
        buffers = []
        for name, dtype in (
            ("k", self.store_dtype),
            ("v", self.store_dtype),
            ("scale", self.scale_dtype),
        ):
            buffers.append(
                alloc_func(
                    dims[name],
                    dtype=dtype,
                    device=self.device,
                    pin_memory=self.pin_memory,
                    allocator=self.allocator,
                )
            )
        self.k_host_buffer, self.v_host_buffer, self.scale_buffer = buffers
        # HostKVCache.destroy unregisters every tensor in kv_buffer.
        return buffers

    def _initialize_transfer_views(self, buffer_info, write_back_staging) -> None:
        self.element_dim = self.head_num * self.head_dim
        self.token_stride_size = self.element_dim * self.store_dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        self._init_device_row_stride((*self.device_k_buffers, *self.device_v_buffers))
        # Upstream movers copy raw rows; encoded records move through our own path.
        self.can_use_jit = False
        self.can_use_write_back_jit = False
        self.staging_page_capacity = 0
        self.staging_token_capacity = 0
        self.k_data_refs = []
        self.v_data_refs = []
        self.k_data_ptrs = None
        self.v_data_ptrs = None
        self.host_kv_data_refs = []

        chunk_units = max(1, _INT8_STAGING_TOKENS // self.unit_tokens)
        units = self.page_num if self._page_major else self.size
        self.staging_units = min(chunk_units, units)
        dev = self._transfer_device
        # One layer of encoded records plus its device-dtype rows, per direction:
        # backup encodes into _d2h while a load may be decoding from _h2d.
        self._d2h = self._alloc_staging(dev)
        self._h2d = self._alloc_staging(dev)
        self._nonfinite_rows = torch.zeros((), dtype=torch.int64, device=dev)
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_run_copies = dev.type != "cpu"

    def _alloc_staging(self, dev) -> dict[str, torch.Tensor]:
        dims = self._unit_dims(self.staging_units, layered=False)
        tokens = self.staging_units * self.unit_tokens
        return {
            "k": torch.empty(dims["k"], dtype=self.store_dtype, device=dev),
            "v": torch.empty(dims["v"], dtype=self.store_dtype, device=dev),
            "scale": torch.empty(dims["scale"], dtype=self.scale_dtype, device=dev),
            "k_rows": torch.empty(
                (tokens, self.head_num, self.head_dim), dtype=self.dtype, device=dev
            ),
            "v_rows": torch.empty(
                (tokens, self.head_num, self.v_head_dim), dtype=self.dtype, device=dev
            ),
        }

    def _host_layer(self, name: str, layer_id: int) -> torch.Tensor:
        """[units, unit_tokens, ...] view of one layer of a host tensor."""
        buf = {
            "k": self.k_host_buffer,
            "v": self.v_host_buffer,
            "scale": self.scale_buffer,
        }[name]
        return buf[:, layer_id] if self._page_major else buf[layer_id]

    def nonfinite_row_count(self) -> int:
        """Head rows backed up with NaN/Inf (or beyond FP16 scale range) so far.

        They are stored with a NaN scale and restore as NaN, never as finite
        values. Reading the counter synchronizes with the transfer device.
        """
        return int(self._nonfinite_rows.item())

    # ------------------------------------------------------------------
    # transfers

    def _host_units(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Token indices (page-aligned runs for page layouts) -> host unit ids on CPU."""
        host_indices = host_indices.to("cpu", torch.int64)
        if self.unit_tokens == 1:
            return host_indices
        return host_indices[:: self.unit_tokens] // self.unit_tokens

    @staticmethod
    def _runs(units: list[int]) -> list[tuple[int, int, int]]:
        """(chunk offset, first unit, length) for each run of consecutive units."""
        runs = []
        start = 0
        for i in range(1, len(units) + 1):
            if i == len(units) or units[i] != units[i - 1] + 1:
                runs.append((start, units[start], i - start))
                start = i
        return runs

    def _chunks(self, host_indices: torch.Tensor, device_indices: torch.Tensor):
        """Split a transfer into staging-sized chunks of whole units."""
        units = self._host_units(host_indices)
        device_indices = device_indices.to(self._transfer_device, torch.int64)
        step = self.staging_units
        for first in range(0, len(units), step):
            chunk_units = units[first : first + step]
            tokens = slice(
                first * self.unit_tokens,
                (first + len(chunk_units)) * self.unit_tokens,
            )
            runs = self._runs(chunk_units.tolist()) if self.use_run_copies else None
            yield chunk_units, runs, device_indices[tokens]

    def _store(self, name, layer_id, stage, units, runs) -> None:
        """Staged encoded records -> host rows of one layer."""
        host = self._host_layer(name, layer_id)
        if runs is None:
            host.index_copy_(0, units, stage[: len(units)])
            return
        for offset, unit, length in runs:
            host[unit : unit + length].copy_(
                stage[offset : offset + length], non_blocking=True
            )

    def _fetch(self, name, layer_id, stage, units, runs) -> torch.Tensor:
        """Host rows of one layer -> staged encoded records."""
        host = self._host_layer(name, layer_id)
        out = stage[: len(units)]
        if runs is None:
            torch.index_select(host, 0, units, out=out)
            return out
        for offset, unit, length in runs:
            out[offset : offset + length].copy_(
                host[unit : unit + length], non_blocking=True
            )
        return out

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        if io_backend not in INT8_HOST_IO_BACKENDS:
            raise ValueError(
                f"--hicache-host-dtype int8 supports --hicache-io-backend "
                f"{', '.join(INT8_HOST_IO_BACKENDS)}; got {io_backend!r}."
            )
        stage = self._d2h
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            for layer_id in range(self.layer_num):
                for name, device_buffers in (
                    ("k", self.device_k_buffers),
                    ("v", self.device_v_buffers),
                ):
                    rows = stage[f"{name}_rows"][:n_tokens]
                    torch.index_select(device_buffers[layer_id], 0, dev_rows, out=rows)
                    kv = 0 if name == "k" else 1
                    codec.quantize_into(
                        rows.view(n_units, self.unit_tokens, *rows.shape[1:]),
                        stage[name][:n_units],
                        stage["scale"][:n_units, :, kv],
                    )
                    self._store(name, layer_id, stage[name], units, runs)
                self._nonfinite_rows += codec.count_nonfinite_rows(
                    stage["scale"][:n_units]
                )
                self._store("scale", layer_id, stage["scale"], units, runs)

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
            raise NotImplementedError("INT8 KV host pool has no draft layers.")
        if io_backend not in INT8_HOST_IO_BACKENDS:
            raise ValueError(
                f"--hicache-host-dtype int8 supports --hicache-io-backend "
                f"{', '.join(INT8_HOST_IO_BACKENDS)}; got {io_backend!r}."
            )
        if not 0 <= layer_id < self.target_layer_num:
            return
        stage = self._h2d
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            scales = self._fetch("scale", layer_id, stage["scale"], units, runs)
            for kv, (name, device_buffers) in enumerate(
                (("k", self.device_k_buffers), ("v", self.device_v_buffers))
            ):
                records = self._fetch(name, layer_id, stage[name], units, runs)
                rows = stage[f"{name}_rows"][:n_tokens]
                codec.dequantize_into(
                    records,
                    scales[:, :, kv],
                    rows.view(n_units, self.unit_tokens, *rows.shape[1:]),
                )
                device_buffers[layer_id].index_copy_(0, dev_rows, rows)

    # ------------------------------------------------------------------
    # L3 storage pages: not yet (fail fast, like the MXFP8 host pool)

    def _storage_pages_unsupported(self) -> NotImplementedError:
        return NotImplementedError(
            "INT8 KV host pool does not expose storage (L3) pages yet: "
            "--hicache-host-dtype int8 cannot be combined with "
            "--hicache-storage-backend."
        )

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise self._storage_pages_unsupported()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise self._storage_pages_unsupported()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise self._storage_pages_unsupported()

    def get_page_buffer_meta(self, indices):
        raise self._storage_pages_unsupported()

    def get_split_heads_page_buffer_meta(
        self, indices: torch.Tensor, split_factor: int
    ):
        raise self._storage_pages_unsupported()

    def get_hybrid_pool_buffer(self):
        return [self.k_host_buffer, self.v_host_buffer, self.scale_buffer]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return False
