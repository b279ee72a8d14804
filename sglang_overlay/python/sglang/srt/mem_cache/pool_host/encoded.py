"""Encoded host (L2) KV pools (--hicache-host-dtype): the parts every model
kind shares.

The device (L1) KV cache is BF16/FP16, or FP8 for formats with
fp8_device_kv; a HostKVFormat (host_format.py) owns the value math. A pool
(mha_encoded.py, mla_encoded.py) is the upstream pool of its kind plus
EncodedHostPool, which delegates to named collaborators: the transfer
collaborators (transfer.py: HostRecords, UnitPlanner, StagingBuffers,
HostKVCounters), one transfer chosen at construction (TorchTransfer, or
FusedTransfer in encoded_fused.py), L3PageCodec (page_codec.py: the storage
page bytes) and, where the format declares one, the sink page's side store
(sink_page.py). The fused transfer and the side store are imported only where
they are on (the format's kernels in the build, the sink page asked for), so
the pool stands without them.

Transfers run on the caller's stream (HiCache's transfer stream), so the
per-layer done event still marks fully restored KV, for the kernel and the
direct io backend.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Sequence

import torch

from sglang.srt.mem_cache.pool_host import backup_verify
from sglang.srt.mem_cache.pool_host import page_integrity as integrity
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.mem_cache.pool_host.host_format import HostKVFormat
from sglang.srt.mem_cache.pool_host.page_codec import L3PageCodec
from sglang.srt.mem_cache.pool_host.transfer import (
    STAGING_TOKENS,
    HostKVCounters,
    HostRecords,
    StagingBuffers,
    TorchTransfer,
    TransferContext,
    UnitPlanner,
    torch_transfer_reason,
    transfer_mode,
)

logger = logging.getLogger(__name__)

ENCODED_HOST_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
ENCODED_HOST_IO_BACKENDS = ("kernel", "direct")
ENCODED_HOST_DEVICE_DTYPES = (torch.bfloat16, torch.float16)


def choose_transfer(
    ctx: TransferContext,
    pinned: bool,
    requested: str | None,
    check: bool | None = None,
):
    """(transfer, why) for a pool: the path `requested` (a FUSED_MODES value;
    None reads SGLANG_HICACHE_FUSED_TRANSFER) allows on this device and host
    memory, kept only if its self-check passes. Runs once, at construction.
    check: run the self-check; None: on CUDA, where the kernels compile (on
    the CPU they run under the Triton interpreter, for tests and tools). The
    fused transfer's module ships with the kernels, so it is imported here."""
    mode, source = transfer_mode(requested)
    why = torch_transfer_reason(ctx, mode, source)
    if why is not None:
        return TorchTransfer(ctx), why
    from sglang.srt.mem_cache.pool_host import encoded_fused

    return encoded_fused.choose_fused(ctx, pinned, mode, source, check)


def check_io_backend(name: str, io_backend: str) -> None:
    if io_backend not in ENCODED_HOST_IO_BACKENDS:
        raise ValueError(
            f"--hicache-host-dtype {name} supports --hicache-io-backend "
            f"{', '.join(ENCODED_HOST_IO_BACKENDS)}; got {io_backend!r}."
        )


def check_layout(name: str, layout: str) -> None:
    if layout not in ENCODED_HOST_LAYOUTS:
        raise NotImplementedError(
            f"--hicache-host-dtype {name} supports --hicache-mem-layout "
            f"{', '.join(ENCODED_HOST_LAYOUTS)}; got {layout!r}."
        )


def _bytes_per_token(fmt: HostKVFormat, layers: int):
    # Each record on the layers it is stored for (a per-layer plan).
    total = fmt.layers_unit_bytes(layers)
    ut = fmt.unit_tokens
    return total // ut if total % ut == 0 else total / ut


def _describe_draft_bytes(pool) -> str:
    # Packed MTP draft layers are stored after the target's.
    draft = pool.layer_num - pool.target_layer_num
    if not draft:
        return ""
    return (
        f", {pool.target_layer_num} target + {draft} packed draft layers "
        f"({pool.size_per_token_without_draft()} B/token without the draft)"
    )


class EncodedHostPool:
    """The encoded half of a host pool; listed before the upstream pool of
    its kind (MHATokenToKVPoolHost, MLATokenToKVPoolHost), which supplies
    layer_num, target_layer_num, page_size, layout, size, page_num, dtype,
    device, pin_memory, allocator, pool_label and _transfer_device.

    The kind defines `_format_for` (its format's geometry) and
    `_device_buffers(side)`, checks what only it can in its constructor
    before this one, and calls `_build_transfer(device buffers)` from the
    upstream's `_initialize_transfer_views`.

    fused_transfer: the transfer path, one of auto, off, direct, staged
    (encoded_fused.py); None reads SGLANG_HICACHE_FUSED_TRANSFER. run_copies:
    whether transfers copy host rows per contiguous run; None: on CUDA.
    sink_page_tokens: host tokens per 8-bit sink-page slot (sink_page.py);
    None or 0: no sink page. key8_layers: the pool's layer ids whose keys the
    format stores at 8 bits (a per-layer plan, layer_plan.py); (): none.
    """

    host_format_cls: ClassVar[type[HostKVFormat]]
    host_format: HostKVFormat
    # The model kind in start-up log lines ("" for MHA, "MLA ").
    log_kind: ClassVar[str] = ""
    # Host rows are addressed on the CPU and device rows where the device pool
    # lives; the controller passes indices through unmoved.
    transfers_own_indices = True
    # Storage page objects carry seals bound to their key (page_integrity.py).
    seals_storage_pages = True
    # The sink page's side store (sink_page.SinkPageStore); None when off.
    sink_pages = None

    def __init__(
        self,
        buffer_info,
        host_to_device_ratio: float,
        host_size: int,
        page_size: int,
        layout: str,
        *args,
        device_dtype: torch.dtype,
        fused_transfer: str | None = None,
        run_copies: bool | None = None,
        sink_page_tokens: int | None = None,
        key8_layers: Sequence[int] = (),
        **kwargs,
    ):
        check_layout(self.host_format_cls.name, layout)
        # HostKVCache sizes the pool from get_size_per_token, which the format answers.
        self.host_format = self._format_for(
            buffer_info, page_size, layout, device_dtype, key8_layers=key8_layers
        )
        self._fused_transfer = fused_transfer
        self._run_copies = run_copies
        # Planned before the upstream constructor sizes the pool, so that
        # get_size_per_token counts the side store.
        self._sink_tokens_per_slot = self._sink_page_tokens(page_size, sink_page_tokens)
        super().__init__(
            buffer_info,
            host_to_device_ratio,
            host_size,
            page_size,
            layout,
            *args,
            **kwargs,
        )
        self._finish_setup()

    def _sink_page_tokens(self, page_size: int, requested: int | None) -> int:
        """Host tokens per sink-page slot, 0 (off) unless asked for; the side
        store (sink_page.py) then refuses what the format cannot keep."""
        if not requested:
            return 0
        from sglang.srt.mem_cache.pool_host import sink_page

        return sink_page.sink_page_tokens(self.host_format, page_size, requested)

    @classmethod
    def host_bytes_per_device_byte(
        cls,
        buffer_info,
        page_size: int = 1,
        layout: str = "layer_first",
        key8_layers: Sequence[int] = (),
    ) -> float:
        # Page size and layout set the unit a format may group over (e.g.
        # per-page key scales), hence its bytes per token.
        fmt = cls._format_for(
            buffer_info, page_size, layout, buffer_info.dtype, key8_layers=key8_layers
        )
        device = sum(fmt.dims) * fmt.head_num * buffer_info.dtype.itemsize
        if fmt.planned:
            # Records stored on a few layers: the mean over the pool's layers
            # (only MHA pools take a plan).
            layers = len(buffer_info.buffers.k)
            return _bytes_per_token(fmt, layers) / layers / device
        return fmt.bytes_per_token() / device

    def init_kv_buffer(self):
        page_major = self.layout != "layer_first"
        units = self.page_num if page_major else self.size
        self.records = HostRecords(
            self.host_format, units, self.layer_num, page_major, self._alloc_host
        )
        self.host_records = self.records.tensors
        self.pages = L3PageCodec(
            self.host_format, self.records, self.page_size, self.layer_num,
            self.layout, self._alloc_host,
        )  # fmt: skip
        # HostKVCache.destroy unregisters every tensor in kv_buffer.
        return list(self.records.tensors.values())

    def _alloc_host(self, shape, dtype) -> torch.Tensor:
        """One host tensor, allocated (and pinned) as the upstream pool's."""
        alloc_func = ALLOC_MEMORY_FUNCS[self._transfer_device.type]
        return alloc_func(shape, dtype=dtype, device=self.device,
                          pin_memory=self.pin_memory, allocator=self.allocator)  # fmt: skip

    def _build_transfer(self, device_buffers: Sequence[torch.Tensor]) -> None:
        """Planner, staging and counters, in place of the upstream movers
        (they copy raw rows; records move through ours); _finish_setup
        chooses the transfer once they exist."""
        self.can_use_jit = False
        self.can_use_write_back_jit = False
        self.staging_page_capacity = 0
        self.staging_token_capacity = 0
        self._init_device_row_stride(device_buffers)
        fmt, dev = self.host_format, self._transfer_device
        staging_units = min(
            max(1, STAGING_TOKENS // fmt.unit_tokens), self.records.units
        )
        self.planner = UnitPlanner(
            fmt.name, self.size, fmt.unit_tokens, staging_units, dev, self._run_copies
        )
        self.staging = StagingBuffers(fmt, staging_units, self.dtype, dev)
        self.counters = HostKVCounters(self.layer_num, len(fmt.sides), dev)
        self.transfer_context = TransferContext(
            fmt, self.records, self.planner, self.staging, self.counters,
            self._device_buffers, self.layer_num, dev,
        )  # fmt: skip
        # Sampled restore check of backed-up pages (backup_verify.py); None: off.
        self.backup_verifier = backup_verify.make_verifier(
            self.transfer_context, self.page_size
        )

    def _finish_setup(self) -> None:
        """After the upstream constructor: the sink page's side store, then
        the transfer (its self-check borrows host and device rows), once."""
        if self._sink_tokens_per_slot:
            from sglang.srt.mem_cache.pool_host.sink_page import SinkPageStore

            self.sink_pages = SinkPageStore(
                self.transfer_context, self.page_size, self.page_num, self.size,
                self._sink_tokens_per_slot, self._alloc_host, self.dtype,
            )  # fmt: skip
            self.size_per_token = self.get_size_per_token()
        self.transfer, self.transfer_path_reason = choose_transfer(
            self.transfer_context, self.pin_memory, self._fused_transfer
        )
        if self.transfer.path != "fused_direct":
            # Allocated up front where the path uses them (direct needs none).
            self.staging["d2h"], self.staging["h2d"]
        if self._transfer_device.type == "cuda":
            # What was enqueued here (counters) is complete before the
            # transfer streams touch it.
            torch.cuda.current_stream(self._transfer_device).synchronize()
        self._log_setup()

    def _log_setup(self) -> None:
        logger.info(
            "HiCache %s %shost pool stores %s KV: %d B/token (%s: %d B/token), "
            "%.2fx tokens per host byte, layout=%s%s.",
            self.pool_label,
            self.log_kind,
            self.host_format.name.upper(),
            # A side store's share makes it fractional; the ratio keeps it exact.
            round(self.get_size_per_token()),
            self.host_format.device_dtype,
            self.device_size_per_token(),
            self.device_size_per_token() / self.get_size_per_token(),
            self.layout,
            _describe_draft_bytes(self),
        )
        logger.info(
            "HiCache %s host format: %s.", self.pool_label, self.host_format.describe()
        )
        plan = self.host_format.describe_plan()
        if plan:
            logger.info(
                "HiCache %s host format plan: %s of %d; %s B/token.",
                self.pool_label,
                plan,
                self.layer_num,
                _bytes_per_token(self.host_format, self.layer_num),
            )
        logger.info(
            "HiCache %s %s host pool transfer path: %s (%s).",
            self.pool_label,
            self.host_format.name.upper(),
            self.transfer_path,
            self.transfer_path_reason,
        )
        if self.sink_pages is not None:
            self.sink_pages.log_setup(self.pool_label)

    # -- what the pool stores ------------------------------------------------

    def get_size_per_token(self):
        base = _bytes_per_token(self.host_format, self.layer_num)
        if self.sink_pages is not None:
            # What was allocated, so start-up log and metrics state real bytes.
            per_token = (base * self.size + self.sink_pages.nbytes()) / self.size
            return int(per_token) if per_token == int(per_token) else per_token
        if self._sink_tokens_per_slot:
            # Before allocation (HostKVCache sizes the pool by it): a slot's
            # share of its sink_page_tokens host tokens.
            from sglang.srt.mem_cache.pool_host.sink_page import slot_bytes

            slot = slot_bytes(self.host_format, self.page_size)
            return base + slot * self.layer_num / self._sink_tokens_per_slot
        return base

    def size_per_token_without_draft(self):
        """Host bytes per token of the target layers alone."""
        return _bytes_per_token(self.host_format, self.target_layer_num)

    def log_host_bytes_per_token(self) -> None:
        # _log_setup states them, once the side store counts in the bytes.
        pass

    @property
    def host_format_name(self) -> str:
        """The --hicache-host-dtype value (the metrics' host_dtype label)."""
        return self.host_format.name

    @property
    def transfer_path(self) -> str:
        """Which code moves the records: fused_direct, fused_staged or torch."""
        return self.transfer.path

    @property
    def use_fused_kernels(self) -> bool:
        return self.transfer.path != "torch"

    # -- transfers -----------------------------------------------------------

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        check_io_backend(self.host_format.name, io_backend)
        self.transfer.backup(host_indices, device_indices)
        if self.sink_pages is not None:
            self.sink_pages.backup(host_indices, device_indices)
        if self.backup_verifier is not None:
            self.backup_verifier.after_backup(host_indices, device_indices)

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft: bool = False
    ):  # fmt: skip
        check_io_backend(self.host_format.name, io_backend)
        # Packed MTP draft layers follow the target's (host layer
        # target_layer_num + depth, as the controller's draft mapper passes it).
        first, end = (
            (self.target_layer_num, self.layer_num)
            if is_draft
            else (0, self.target_layer_num)
        )
        if first <= layer_id < end:
            self.transfer.load(host_indices, device_indices, layer_id)
            if self.sink_pages is not None:
                # The marked tokens' keys again from the side store, over the
                # 4-bit ones, on the same stream.
                self.sink_pages.load(host_indices, device_indices, layer_id)

    # -- statistics the metrics reporter reads (each syncs the device) -------

    def nonfinite_group_count(self) -> int:
        return self.counters.nonfinite_groups()

    def scale_amax_by_layer(self) -> torch.Tensor:
        return self.counters.amax_by_layer()

    def scale_amax_sides(self) -> tuple[str, ...]:
        """The side names of scale_amax_by_layer's columns (the metrics' kv label)."""
        return self.host_format.sides

    def invalid_host_index_count(self) -> int:
        return self.counters.invalid_host_indices()

    def backup_verify_errors(self) -> list[float]:
        """Relative errors of the sampled backed-up pages checked since the last
        call (backup_verify.py); never waits for the device."""
        if self.backup_verifier is None:
            return []
        return self.backup_verifier.drain()

    # -- L3 storage pages (page_codec.py): storage_format_tag names the byte
    # format in every storage key, so pages of another host format miss.

    @property
    def storage_format_tag(self) -> str:
        # Sealed pages are a new byte format: unsealed ones miss by key.
        return self.pages.tag

    @property
    def storage_page_bytes(self) -> int:
        return self.pages.page_bytes

    @property
    def storage_buffers_per_object(self) -> int:
        return self.pages.buffers_per_object

    @property
    def storage_integrity(self) -> integrity.PageIntegrityStats:
        return self.pages.stats

    def get_data_page(self, index, flat: bool = True, key=None) -> torch.Tensor:
        return self.pages.read(index, key)

    def set_from_flat_data_page(self, index, data_page, key=None) -> None:
        self.pages.write(index, data_page, key)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            self.pages.page_bytes + integrity.SEAL_BYTES,
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def get_page_buffer_meta(self, indices):
        return self.pages.buffer_meta(indices)

    def get_split_heads_page_buffer_meta(
        self, indices: torch.Tensor, split_factor: int
    ):
        raise NotImplementedError(
            f"--hicache-host-dtype {self.host_format.name} does not split storage "
            "pages by head (--hicache-mem-layout page_head)."
        )

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return self.pages.host_buffers()

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return self.pages.stride_page_aligned(page_size_bytes)

    def seal_storage_pages(self, keys, host_indices) -> None:
        self.pages.seal_pages(keys, host_indices)

    def verify_storage_pages(self, keys, host_indices, results) -> list[bool]:
        return self.pages.verify_pages(keys, host_indices, results)

    def note_storage_page_missing(self, key) -> None:
        self.pages.note_missing(key)

    def note_storage_pages_replaced(self, pages: int) -> None:
        self.pages.stats.note_replaced(pages)

    def storage_integrity_counts(self) -> dict:
        return self.pages.counts()

    # -- the sink page (sink_page.py): a format capability, off by default ---

    def mark_sink_page(self, host_indices: torch.Tensor) -> None:
        if self.sink_pages is not None:
            with self.lock:
                self.sink_pages.mark(host_indices)

    def storage_sink_objects(self, keys, host_indices) -> list:
        if self.sink_pages is None:
            return []
        with self.lock:
            return self.sink_pages.l3_objects(keys, host_indices)

    def storage_sink_page_get(self, key, host_indices):
        if self.sink_pages is None:
            return None
        with self.lock:
            return self.sink_pages.l3_request(key, host_indices)

    def restore_storage_sink_page(self, key, host_indices, data) -> None:
        if self.sink_pages is not None:
            with self.lock:
                self.sink_pages.l3_restore(key, host_indices, data)

    def sink_page_counts(self) -> dict | None:
        return None if self.sink_pages is None else self.sink_pages.counts()

    def free(self, indices: torch.Tensor) -> int:
        with self.lock:
            if self.sink_pages is not None:
                self.sink_pages.release(indices)
            return super().free(indices)

    def clear(self):
        super().clear()
        if self.sink_pages is not None:
            self.sink_pages.clear()
