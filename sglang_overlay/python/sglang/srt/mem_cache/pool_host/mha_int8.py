"""Host (L2) pool that stores MHA KV as symmetric INT8 (--hicache-host-dtype int8).

The device (L1) KV cache stays BF16/FP16; only the host copy is compressed.
Each token, layer, K|V and head is stored as `head_dim` INT8 values and one
FP16 scale (kv_int8_codec). Payload and scales live in separate host tensors,
indexed per layer by a unit: a page for page_first and page_first_direct
(which share one layout), a token for layer_first.

The pool moves its own records (gather -> encode -> store on backup, fetch ->
decode -> scatter on load) on the caller's stream, HiCache's transfer stream,
so the per-layer done event still marks fully restored KV; it therefore
serves both the kernel and the direct io backend. Host indices are
range-checked on the CPU before anything moves.
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


class MHATokenToKVPoolINT8Host(MHATokenToKVPoolHost):
    """MHA host pool holding INT8 KV records and FP16 scales (format above).

    L3 storage moves pages in this encoded form: one object per page for
    generic backends (file), two per page (_k, _v) for zero-copy backends
    (mooncake); the "L3 storage pages" section below gives the byte order.
    """

    # Host rows are addressed on the CPU and device rows where the device pool
    # lives; the controller passes indices through unmoved.
    transfers_own_indices = True
    storage_format_tag = "int8-fp16scale-v1"
    transfer_path = "torch"
    transfer_path_reason = "the pool's own torch transfer code"

    @classmethod
    def host_bytes_per_device_byte(cls, buffer_info: MHABufferInfo) -> float:
        dims = buffer_info.head_dim + buffer_info.v_head_dim
        encoded = dims + 2 * codec.SCALE_DTYPE.itemsize
        return encoded / (dims * buffer_info.dtype.itemsize)

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
            # FP8/FP4 KV reaches the pool as its one-byte storage dtype.
            got = (
                "a quantized (FP8/FP4) one"
                if buffer_info.dtype.itemsize <= 1 or buffer_info.scales is not None
                else str(buffer_info.dtype).removeprefix("torch.")
            )
            raise NotImplementedError(
                f"--hicache-host-dtype int8 needs a BF16/FP16 device KV cache, got "
                f"{got}. Pass --kv-cache-dtype bf16, or use --hicache-host-dtype auto."
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
        self._finish_transfer_setup()

    def _finish_transfer_setup(self) -> None:
        logger.info(
            "HiCache %s INT8 host pool transfer path: %s (%s).",
            self.pool_label,
            self.transfer_path,
            self.transfer_path_reason,
        )

    # ------------------------------------------------------------------
    # sizes and buffers

    def get_size_per_token(self):
        payload = (self.head_dim + self.v_head_dim) * self.head_num
        scales = 2 * self.head_num * self.scale_dtype.itemsize
        return (payload + scales) * self.layer_num

    @property
    def host_dtype(self) -> torch.dtype:
        return self.store_dtype

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
        self._nonfinite_rows = torch.zeros((), dtype=torch.int64, device=dev)
        self._scale_amax = torch.zeros(
            (self.layer_num, 2), dtype=torch.float32, device=dev
        )
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_run_copies = dev.type != "cpu"
        # Staging: one layer of encoded records plus its device-dtype rows, per
        # direction (backup encodes into _d2h while a load may be decoding from
        # _h2d), allocated up front where the transfer path uses it.
        self._staging = {}
        if self._uses_staging():
            self._stage("d2h")
            self._stage("h2d")
        if dev.type == "cuda":
            # What was enqueued here (counters) is complete before the
            # transfer streams touch it.
            torch.cuda.current_stream(dev).synchronize()

    def _uses_staging(self) -> bool:
        return True

    @property
    def _d2h(self) -> dict[str, torch.Tensor]:
        return self._stage("d2h")

    @property
    def _h2d(self) -> dict[str, torch.Tensor]:
        return self._stage("h2d")

    def _stage(self, direction: str) -> dict[str, torch.Tensor]:
        if direction not in self._staging:
            self._staging[direction] = self._alloc_staging(self._transfer_device)
        return self._staging[direction]

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
        values. Reading the counter synchronizes with the transfer device
        (all its streams: backups run on HiCache's D2H stream).
        """
        self._sync_transfer_device()
        return int(self._nonfinite_rows.item())

    def scale_amax_by_layer(self) -> torch.Tensor:
        """Largest per-row amax (max |x| of a head row) backed up so far, per
        layer, for K and V: CPU float32 [layer_num, 2]. Rows stored as
        non-finite do not count (nonfinite_row_count() counts them). Tracked
        on the transfer device; reading it synchronizes with it."""
        self._sync_transfer_device()
        return self._scale_amax.to("cpu", copy=True)

    def _sync_transfer_device(self) -> None:
        # Backups and loads run on HiCache's own streams: wait for all of them.
        if self._nonfinite_rows.is_cuda:
            torch.cuda.synchronize(self._nonfinite_rows.device)

    def _track_scale_amax(self, layer_id, kv, amax, scale) -> None:
        """Raise the layer's running amax by the finite rows just encoded."""
        finite_amax = torch.where(torch.isfinite(scale), amax, 0.0).amax()
        slot = self._scale_amax[layer_id, kv]
        torch.maximum(slot, finite_amax, out=slot)

    # ------------------------------------------------------------------
    # transfers

    def _host_units(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Token indices (page-aligned runs for page layouts) -> host unit ids on
        CPU; rejects indices outside the pool before anything moves (torch
        indexing would wrap negative ones silently)."""
        host_indices = host_indices.to("cpu", torch.int64)
        self._check_host_indices(host_indices)
        if self.unit_tokens == 1:
            return host_indices
        return host_indices[:: self.unit_tokens] // self.unit_tokens

    def _check_host_indices(self, host_indices: torch.Tensor) -> None:
        # Checked where the indices are on the CPU, so the check never syncs.
        if host_indices.device.type == "cpu" and host_indices.numel():
            lo, hi = int(host_indices.min()), int(host_indices.max())
            if lo < 0 or hi >= self.size:
                raise IndexError(
                    f"INT8 host pool: host indices [{lo}, {hi}] out of range "
                    f"[0, {self.size}); nothing was transferred."
                )

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

    @staticmethod
    def _check_io_backend(io_backend: str) -> None:
        if io_backend not in INT8_HOST_IO_BACKENDS:
            raise ValueError(
                f"--hicache-host-dtype int8 supports --hicache-io-backend "
                f"{', '.join(INT8_HOST_IO_BACKENDS)}; got {io_backend!r}."
            )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        self._check_io_backend(io_backend)
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
                    scales = stage["scale"][:n_units, :, kv]
                    amax = codec.quantize_into(
                        rows.view(n_units, self.unit_tokens, *rows.shape[1:]),
                        stage[name][:n_units],
                        scales,
                    )
                    self._track_scale_amax(layer_id, kv, amax, scales)
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
        self._check_io_backend(io_backend)
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
    # L3 storage pages
    #
    # A page goes to storage exactly as it sits in L2: its INT8 K records, INT8
    # V records and FP16 scales, never re-encoded or widened to the device
    # dtype. storage_format_tag names this byte format in every storage key
    # (storage_model_name), so pages of another host format are a miss.
    #
    #   generic backends (file): ONE object per page, the bytes
    #     K records | V records | scales, each in host order
    #     ([layer, token, head, dim] and [layer, token, K|V, head]).
    #   zero-copy backends (mooncake): TWO objects per page, as for a BF16 page
    #     (keys _k and _v), each gathered from two host buffers: _k holds the
    #     K records and the first half of the page's scale bytes, _v the V
    #     records and the second half. Page-major layouts only.

    # Host buffers one zero-copy storage object is gathered from.
    storage_buffers_per_object = 2

    def _storage_page_parts(self, index) -> list[torch.Tensor]:
        """K, V and scale records of the page at token `index`, as byte views
        in storage order (contiguous for page-major layouts)."""
        index = int(index)
        if index % self.page_size:
            raise ValueError(
                f"storage page index {index} is not aligned to page_size "
                f"{self.page_size}"
            )
        bufs = (self.k_host_buffer, self.v_host_buffer, self.scale_buffer)
        if self._page_major:
            page = index // self.page_size
            return [buf[page].view(torch.uint8).reshape(-1) for buf in bufs]
        return [
            buf[:, index : index + self.page_size].view(torch.uint8) for buf in bufs
        ]

    @property
    def storage_page_bytes(self) -> int:
        return self.get_size_per_token() * self.page_size

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        # Three host tensors hold a page, so a flat page is always a copy.
        return torch.cat([part.reshape(-1) for part in self._storage_page_parts(index)])

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
                f"INT8 storage page has {nbytes} bytes, expected "
                f"{self.storage_page_bytes} ({self.storage_format_tag})"
            )
        flat = data_page.reshape(-1).view(torch.uint8)
        offset = 0
        for part in self._storage_page_parts(index):
            size = part.numel()
            part.copy_(flat[offset : offset + size].view(part.shape))
            offset += size

    def _storage_object_pieces(self) -> list[tuple[int, int, int]]:
        """(buffer, byte offset within the page, bytes) of each zero-copy
        buffer of one page, in object order: K records, scales' first half,
        V records, scales' second half."""
        k_bytes, v_bytes, s_bytes = (
            part.numel() for part in self._storage_page_parts(0)
        )
        half = s_bytes // 2
        return [(0, 0, k_bytes), (2, 0, half), (1, 0, v_bytes), (2, half, half)]

    def get_page_buffer_meta(self, indices):
        if not self._page_major:
            raise ValueError(
                "--hicache-host-dtype int8 zero-copy storage pages need "
                "--hicache-mem-layout page_first or page_first_direct; got "
                f"{self.layout}."
            )
        if len(indices) % self.page_size:
            raise ValueError("INT8 storage page metadata needs whole pages.")
        bufs = (self.k_host_buffer, self.v_host_buffer, self.scale_buffer)
        bases = [buf.data_ptr() for buf in bufs]
        page_strides = [buf[0].numel() * buf.element_size() for buf in bufs]
        pieces = self._storage_object_pieces()
        ptrs, sizes = [], []
        for index in indices[:: self.page_size].tolist():
            page = index // self.page_size
            for buf, offset, size in pieces:
                ptrs.append(bases[buf] + page * page_strides[buf] + offset)
                sizes.append(size)
        return ptrs, sizes

    def get_split_heads_page_buffer_meta(
        self, indices: torch.Tensor, split_factor: int
    ):
        raise NotImplementedError(
            "--hicache-host-dtype int8 does not split storage pages by head "
            "(--hicache-mem-layout page_head)."
        )

    def get_hybrid_pool_buffer(self):
        return [self.k_host_buffer, self.v_host_buffer, self.scale_buffer]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if not self._page_major:
            return False
        bufs = (self.k_host_buffer, self.v_host_buffer, self.scale_buffer)
        offsets = [buf[0].numel() * buf.element_size() for buf in bufs]
        offsets += [buf.data_ptr() for buf in bufs]
        offsets += [offset for _, offset, _ in self._storage_object_pieces()]
        return all(offset % page_size_bytes == 0 for offset in offsets)
