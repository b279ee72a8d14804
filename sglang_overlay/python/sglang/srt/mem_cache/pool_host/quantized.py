"""Host (L2) KV pools that store an encoded copy (--hicache-host-dtype).

The device (L1) KV cache stays BF16/FP16; only the host copy is encoded, by a
HostKVFormat (host_format.py) that owns all value math. This mixin does the
rest once for every format and for both MHA and MLA host pools: one host
tensor per record of the format, indexed per layer by a unit (a page for
page_first and page_first_direct, which share one layout, a token for
layer_first); index checks; staging; the torch transfer path; statistics;
and L3 storage pages.

The pool moves its own records (gather -> encode -> store on backup, fetch ->
decode -> scatter on load) on the caller's stream, HiCache's transfer stream,
so the per-layer done event still marks fully restored KV; it therefore
serves both the kernel and the direct io backend. Host indices are
range-checked on the CPU before anything moves.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.mem_cache.pool_host.host_format import EncodeStats, HostKVFormat

logger = logging.getLogger(__name__)

QUANTIZED_HOST_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
QUANTIZED_HOST_IO_BACKENDS = ("kernel", "direct")
QUANTIZED_HOST_DEVICE_DTYPES = (torch.bfloat16, torch.float16)
# Tokens one staging chunk holds (rounded to whole units).
_STAGING_TOKENS = 4096


class QuantizedHostPoolMixin:
    """Format-generic part of an encoded host pool; mix in before the
    upstream host pool class (MHATokenToKVPoolHost, MLATokenToKVPoolHost).

    The concrete pool supplies:
      * class attribute `host_format_cls` (a HostKVFormat subclass);
      * `self.host_format`, built with `_make_host_format(dims, head_num)`
        before HostKVCache.__init__ runs (it sizes the pool from
        get_size_per_token and allocates through init_kv_buffer);
      * the upstream attributes layer_num, target_layer_num, page_size,
        layout, size, page_num, dtype (device dtype), device, pin_memory,
        allocator, pool_label and _transfer_device;
      * `_device_buffers(side_index)`: the per-layer device tensors
        [slots, head_num, dims[side_index]] of format side `sides[side_index]`;
      * a call to `_init_quantized_transfer_state()` from its transfer-view
        set-up, once the device buffers are known, and
        `_finish_transfer_setup()` at the end of __init__.
    It provides get_size_per_token, init_kv_buffer, host_dtype, the torch
    backup_from_device_all_layer / load_to_device_per_layer, the statistics
    and the L3 page methods.
    """

    host_format_cls: ClassVar[type[HostKVFormat]]
    host_format: HostKVFormat
    # Host rows are addressed on the CPU and device rows where the device pool
    # lives; the controller passes indices through unmoved.
    transfers_own_indices = True
    transfer_path = "torch"
    transfer_path_reason = "the pool's own torch transfer code"

    @classmethod
    def _check_layout(cls, layout: str) -> None:
        if layout not in QUANTIZED_HOST_LAYOUTS:
            raise NotImplementedError(
                f"--hicache-host-dtype {cls.host_format_cls.name} supports "
                f"--hicache-mem-layout {', '.join(QUANTIZED_HOST_LAYOUTS)}; "
                f"got {layout!r}."
            )

    @staticmethod
    def _unit_tokens_for(page_size: int, layout: str) -> int:
        return 1 if layout == "layer_first" else page_size

    def _make_host_format(self, dims: tuple[int, ...], head_num: int) -> None:
        self.host_format = self.host_format_cls(
            dims,
            head_num,
            self._unit_tokens_for(self.page_size, self.layout),
            self.dtype,
        )

    @property
    def storage_format_tag(self) -> str:
        return self.host_format.storage_format_tag

    def _finish_transfer_setup(self) -> None:
        logger.info(
            "HiCache %s host format: %s.", self.pool_label, self.host_format.describe()
        )
        logger.info(
            "HiCache %s %s host pool transfer path: %s (%s).",
            self.pool_label,
            self.host_format.name.upper(),
            self.transfer_path,
            self.transfer_path_reason,
        )

    # ------------------------------------------------------------------
    # sizes and buffers

    def get_size_per_token(self):
        total = self.host_format.unit_bytes() * self.layer_num
        ut = self.host_format.unit_tokens
        return total // ut if total % ut == 0 else total / ut

    @property
    def host_dtype(self) -> str:
        """The format's name (metrics label: what the host stores)."""
        return self.host_format.name

    # The metrics reporter's name for it (HostKVCache.host_format_name).
    host_format_name = host_dtype

    @property
    def _page_major(self) -> bool:
        return self.layout != "layer_first"

    @property
    def unit_tokens(self) -> int:
        """Tokens in one addressable host unit: a page, or a token (layer_first)."""
        return self.host_format.unit_tokens

    @property
    def host_units(self) -> int:
        return self.page_num if self._page_major else self.size

    def init_kv_buffer(self):
        units = self.host_units
        alloc_func = ALLOC_MEMORY_FUNCS[self._transfer_device.type]
        self.host_records: dict[str, torch.Tensor] = {}
        for record in self.host_format.records:
            layered = (
                (units, self.layer_num) if self._page_major else (self.layer_num, units)
            )
            self.host_records[record.name] = alloc_func(
                (*layered, *record.shape),
                dtype=record.dtype,
                device=self.device,
                pin_memory=self.pin_memory,
                allocator=self.allocator,
            )
        # HostKVCache.destroy unregisters every tensor in kv_buffer.
        return list(self.host_records.values())

    def _host_layer(self, name: str, layer_id: int) -> torch.Tensor:
        """[units, *record shape] view of one layer of a host record."""
        buf = self.host_records[name]
        return buf[:, layer_id] if self._page_major else buf[layer_id]

    def _host_all_layers(self, name: str) -> torch.Tensor:
        """[units, layers, *record shape] view of a host record."""
        buf = self.host_records[name]
        return buf if self._page_major else buf.transpose(0, 1)

    # ------------------------------------------------------------------
    # transfer state: staging and statistics

    def _init_quantized_transfer_state(self) -> None:
        chunk_units = max(1, _STAGING_TOKENS // self.unit_tokens)
        self.staging_units = min(chunk_units, self.host_units)
        dev = self._transfer_device
        sides = len(self.host_format.sides)
        self._nonfinite_rows = torch.zeros((), dtype=torch.int64, device=dev)
        self._scale_amax = torch.zeros(
            (self.layer_num, sides), dtype=torch.float32, device=dev
        )
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_run_copies = dev.type != "cpu"
        # Staging: one layer of encoded records plus its device-dtype rows, per
        # direction (backup encodes into d2h while a load may be decoding from
        # h2d), allocated up front where the transfer path uses it.
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
    def _d2h(self) -> dict:
        return self._stage("d2h")

    @property
    def _h2d(self) -> dict:
        return self._stage("h2d")

    def _stage(self, direction: str) -> dict:
        if direction not in self._staging:
            self._staging[direction] = self._alloc_staging(self._transfer_device)
        return self._staging[direction]

    def _alloc_staging(self, dev) -> dict:
        """records: name -> [staging_units, *shape]; rows: per side
        [tokens, head_num, dim] in the device dtype."""
        fmt = self.host_format
        tokens = self.staging_units * self.unit_tokens
        return {
            "records": {
                r.name: torch.empty(
                    (self.staging_units, *r.shape), dtype=r.dtype, device=dev
                )
                for r in fmt.records
            },
            "rows": [
                torch.empty((tokens, fmt.head_num, dim), dtype=self.dtype, device=dev)
                for dim in fmt.dims
            ],
        }

    def nonfinite_row_count(self) -> int:
        """Groups (e.g. head rows) backed up with NaN/Inf, or beyond the
        format's scale range, so far.

        They are stored as non-finite and restore as NaN, never as finite
        values. Reading the counter synchronizes with the transfer device
        (all its streams: backups run on HiCache's D2H stream).
        """
        self._sync_transfer_device()
        return int(self._nonfinite_rows.item())

    # The metrics reporter's name for it (HostKVCache.nonfinite_group_count).
    nonfinite_group_count = nonfinite_row_count

    def scale_amax_by_layer(self) -> torch.Tensor:
        """Largest max |x| of a group backed up so far, per layer and side:
        CPU float32 [layer_num, len(sides)]. Groups stored as non-finite do
        not count (nonfinite_row_count() counts them). Tracked on the
        transfer device; reading it synchronizes with it."""
        self._sync_transfer_device()
        return self._scale_amax.to("cpu", copy=True)

    def _sync_transfer_device(self) -> None:
        # Backups and loads run on HiCache's own streams: wait for all of them.
        if self._nonfinite_rows.is_cuda:
            torch.cuda.synchronize(self._nonfinite_rows.device)

    def _track_stats(self, layer_id: int, stats: EncodeStats) -> None:
        slot = self._scale_amax[layer_id]
        torch.maximum(slot, stats.amax, out=slot)
        self._nonfinite_rows += stats.nonfinite

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
                    f"--hicache-host-dtype {self.host_format.name} host pool: "
                    f"host indices [{lo}, {hi}] out of range [0, {self.size}); "
                    "nothing was transferred."
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

    def _check_io_backend(self, io_backend: str) -> None:
        if io_backend not in QUANTIZED_HOST_IO_BACKENDS:
            raise ValueError(
                f"--hicache-host-dtype {self.host_format.name} supports "
                f"--hicache-io-backend {', '.join(QUANTIZED_HOST_IO_BACKENDS)}; "
                f"got {io_backend!r}."
            )

    def _unit_rows(self, rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """First n_tokens staged rows as [units, unit_tokens, heads, dim]."""
        rows = rows[:n_tokens]
        return rows.view(
            n_tokens // self.unit_tokens, self.unit_tokens, *rows.shape[1:]
        )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        self._check_io_backend(io_backend)
        self._backup_torch(host_indices, device_indices)

    def _backup_torch(self, host_indices, device_indices) -> None:
        stage = self._d2h
        names = [r.name for r in self.host_format.records]
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            out = {name: stage["records"][name][:n_units] for name in names}
            for layer_id in range(self.layer_num):
                rows = []
                for side, staged in enumerate(stage["rows"]):
                    device_layer = self._device_buffers(side)[layer_id]
                    torch.index_select(device_layer, 0, dev_rows, out=staged[:n_tokens])
                    rows.append(self._unit_rows(staged, n_tokens))
                self._track_stats(layer_id, self.host_format.encode_into(rows, out))
                for name in names:
                    self._store(name, layer_id, stage["records"][name], units, runs)

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
            raise NotImplementedError(
                f"--hicache-host-dtype {self.host_format.name} host pool has no "
                "draft layers."
            )
        self._check_io_backend(io_backend)
        if not 0 <= layer_id < self.target_layer_num:
            return
        self._load_torch(host_indices, device_indices, layer_id)

    def _load_torch(self, host_indices, device_indices, layer_id) -> None:
        stage = self._h2d
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_tokens = len(dev_rows)
            records = {
                r.name: self._fetch(
                    r.name, layer_id, stage["records"][r.name], units, runs
                )
                for r in self.host_format.records
            }
            rows = [self._unit_rows(staged, n_tokens) for staged in stage["rows"]]
            self.host_format.decode_into(records, rows)
            for side, staged in enumerate(stage["rows"]):
                self._device_buffers(side)[layer_id].index_copy_(
                    0, dev_rows, staged[:n_tokens]
                )

    # ------------------------------------------------------------------
    # L3 storage pages
    #
    # A page goes to storage exactly as it sits in L2: its records, never
    # re-encoded or widened to the device dtype. storage_format_tag names this
    # byte format in every storage key (storage_model_name), so pages of
    # another host format are a miss.
    #
    #   generic backends (file): ONE object per page, the bytes of every
    #     record in the format's `records` order, each in host order
    #     ([layer, *record shape] per unit, units of the page in order).
    #   zero-copy backends (mooncake): the format's zero_copy_objects(), each
    #     gathered from pieces of its records. Page-major layouts only.

    @property
    def storage_buffers_per_object(self) -> int:
        """Host buffers one zero-copy storage object is gathered from."""
        return len(self.host_format.zero_copy_objects()[0])

    def _storage_page_parts(self, index) -> list[torch.Tensor]:
        """Every record of the page at token `index`, as byte views in storage
        order (contiguous for page-major layouts)."""
        index = int(index)
        if index % self.page_size:
            raise ValueError(
                f"storage page index {index} is not aligned to page_size "
                f"{self.page_size}"
            )
        bufs = [self.host_records[r.name] for r in self.host_format.records]
        if self._page_major:
            page = index // self.page_size
            return [buf[page].view(torch.uint8).reshape(-1) for buf in bufs]
        return [
            buf[:, index : index + self.page_size].view(torch.uint8) for buf in bufs
        ]

    @property
    def storage_page_bytes(self) -> int:
        return (
            self.host_format.unit_bytes()
            * self.layer_num
            * (self.page_size // self.unit_tokens)
        )

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        # Several host tensors hold a page, so a flat page is always a copy.
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
                f"--hicache-host-dtype {self.host_format.name} storage page has "
                f"{nbytes} bytes, expected {self.storage_page_bytes} "
                f"({self.storage_format_tag})"
            )
        flat = data_page.reshape(-1).view(torch.uint8)
        offset = 0
        for part in self._storage_page_parts(index):
            size = part.numel()
            part.copy_(flat[offset : offset + size].view(part.shape))
            offset += size

    def _storage_object_pieces(self) -> list[tuple[str, int, int]]:
        """(record, byte offset within the page's record, bytes) of each
        zero-copy buffer of one page, in object order."""
        per_unit = {r.name: r.nbytes for r in self.host_format.records}
        pieces = []
        for obj in self.host_format.zero_copy_objects():
            for name, offset, size in obj:
                if offset + size > per_unit[name]:
                    raise ValueError(f"zero-copy piece beyond record {name!r}")
                pieces.append((name, offset, size))
        return pieces

    def get_page_buffer_meta(self, indices):
        if not self._page_major:
            raise ValueError(
                f"--hicache-host-dtype {self.host_format.name} zero-copy storage "
                "pages need --hicache-mem-layout page_first or page_first_direct; "
                f"got {self.layout}."
            )
        if len(indices) % self.page_size:
            raise ValueError(
                f"--hicache-host-dtype {self.host_format.name} storage page "
                "metadata needs whole pages."
            )
        bases = {name: buf.data_ptr() for name, buf in self.host_records.items()}
        page_strides = {
            name: buf[0].numel() * buf.element_size()
            for name, buf in self.host_records.items()
        }
        pieces = self._zero_copy_page_pieces()
        ptrs, sizes = [], []
        for index in indices[:: self.page_size].tolist():
            page = index // self.page_size
            for name, offset, size in pieces:
                ptrs.append(bases[name] + page * page_strides[name] + offset)
                sizes.append(size)
        return ptrs, sizes

    def _zero_copy_page_pieces(self) -> list[tuple[str, int, int]]:
        """zero_copy_objects' pieces scaled from one layer's record to a page's
        (every layer of a page-major unit is one contiguous block)."""
        return [
            (name, offset * self.layer_num, size * self.layer_num)
            for name, offset, size in self._storage_object_pieces()
        ]

    def get_split_heads_page_buffer_meta(
        self, indices: torch.Tensor, split_factor: int
    ):
        raise NotImplementedError(
            f"--hicache-host-dtype {self.host_format.name} does not split storage "
            "pages by head (--hicache-mem-layout page_head)."
        )

    def get_hybrid_pool_buffer(self):
        return list(self.host_records.values())

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if not self._page_major:
            return False
        bufs = list(self.host_records.values())
        offsets = [buf[0].numel() * buf.element_size() for buf in bufs]
        offsets += [buf.data_ptr() for buf in bufs]
        offsets += [offset for _, offset, _ in self._zero_copy_page_pieces()]
        return all(offset % page_size_bytes == 0 for offset in offsets)
