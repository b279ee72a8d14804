"""Encoded host (L2) KV pools (--hicache-host-dtype): the parts every model
kind shares.

The device (L1) KV cache is BF16/FP16, or FP8 for formats with
fp8_device_kv; a HostKVFormat (host_format.py) owns the
value math. A pool (mha_encoded.py, mla_encoded.py) is the upstream
pool of its kind plus EncodedHostPool, which delegates to named
collaborators: HostRecords (one host tensor per record), UnitPlanner (host
indices -> units and runs), StagingBuffers, HostKVCounters, a transfer
strategy (TorchTransfer here, FusedTransfer in encoded_fused.py, chosen once
at construction) and L3PageCodec (the storage page bytes).

A unit is what one host index range addresses per layer: a page for
page_first and page_first_direct, a token for layer_first. Transfers run on
the caller's stream (HiCache's transfer stream), so the per-layer done event
still marks fully restored KV, for the kernel and the direct io backend.
"""

from __future__ import annotations

import logging
from typing import Callable, ClassVar, Sequence

import torch

from sglang.srt.mem_cache.pool_host import page_integrity as integrity
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.mem_cache.pool_host.host_format import EncodeStats, HostKVFormat

logger = logging.getLogger(__name__)

ENCODED_HOST_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
ENCODED_HOST_IO_BACKENDS = ("kernel", "direct")
ENCODED_HOST_DEVICE_DTYPES = (torch.bfloat16, torch.float16)
# Tokens one staging chunk holds (rounded to whole units).
STAGING_TOKENS = 4096


def unit_tokens_for(page_size: int, layout: str) -> int:
    return 1 if layout == "layer_first" else page_size


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


class HostRecords:
    """One host tensor per format record: (units, layers, *shape) page-major,
    (layers, units, *shape) layer_first."""

    def __init__(
        self,
        fmt: HostKVFormat,
        units: int,
        layer_num: int,
        page_major: bool,
        alloc: Callable,
    ):
        self.page_major = page_major
        self.tensors: dict[str, torch.Tensor] = {}
        for record in fmt.records:
            layered = (units, layer_num) if page_major else (layer_num, units)
            self.tensors[record.name] = alloc((*layered, *record.shape), record.dtype)

    def layer(self, name: str, layer_id: int) -> torch.Tensor:
        """[units, *record shape] view of one layer."""
        buf = self.tensors[name]
        return buf[:, layer_id] if self.page_major else buf[layer_id]

    def all_layers(self, name: str) -> torch.Tensor:
        """[units, layers, *record shape] view."""
        buf = self.tensors[name]
        return buf if self.page_major else buf.transpose(0, 1)


class UnitPlanner:
    """Host token indices -> host units, checked on the CPU before anything
    moves (torch indexing would wrap negative ones silently)."""

    def __init__(
        self,
        name: str,
        size: int,
        unit_tokens: int,
        staging_units: int,
        device: torch.device,
    ):
        self.name = name
        self.size = size
        self.unit_tokens = unit_tokens
        self.staging_units = staging_units
        self.device = device
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_runs = device.type != "cpu"

    def check(self, host_indices: torch.Tensor) -> None:
        # Checked where the indices are on the CPU, so the check never syncs.
        if host_indices.device.type == "cpu" and host_indices.numel():
            lo, hi = int(host_indices.min()), int(host_indices.max())
            if lo < 0 or hi >= self.size:
                raise IndexError(
                    f"--hicache-host-dtype {self.name} host pool: host indices "
                    f"[{lo}, {hi}] out of range [0, {self.size}); nothing was "
                    "transferred."
                )

    def units(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Token indices (page-aligned runs for page layouts) -> unit ids on CPU."""
        host_indices = host_indices.to("cpu", torch.int64)
        self.check(host_indices)
        if self.unit_tokens == 1:
            return host_indices
        return host_indices[:: self.unit_tokens] // self.unit_tokens

    @staticmethod
    def runs(units: list[int]) -> list[tuple[int, int, int]]:
        """(chunk offset, first unit, length) for each run of consecutive units."""
        runs = []
        start = 0
        for i in range(1, len(units) + 1):
            if i == len(units) or units[i] != units[i - 1] + 1:
                runs.append((start, units[start], i - start))
                start = i
        return runs

    def chunks(self, host_indices: torch.Tensor, device_indices: torch.Tensor):
        """(units, runs or None, device indices) per staging-sized chunk."""
        units = self.units(host_indices)
        device_indices = device_indices.to(self.device, torch.int64)
        step = self.staging_units
        for first in range(0, len(units), step):
            chunk_units = units[first : first + step]
            tokens = slice(
                first * self.unit_tokens, (first + len(chunk_units)) * self.unit_tokens
            )
            runs = self.runs(chunk_units.tolist()) if self.use_runs else None
            yield chunk_units, runs, device_indices[tokens]


class StagingBuffers:
    """Per direction (a backup encodes into d2h while a load may decode from
    h2d): one chunk of records, its device-dtype rows per side, and the token
    positions the fused kernels take as host indices into staging."""

    def __init__(
        self, fmt: HostKVFormat, units: int, dtype: torch.dtype, device: torch.device
    ):
        self.fmt, self.units, self.dtype, self.device = fmt, units, dtype, device
        self._buffers: dict[str, dict] = {}

    @property
    def directions(self) -> tuple[str, ...]:
        """The directions allocated so far."""
        return tuple(self._buffers)

    def __getitem__(self, direction: str) -> dict:
        if direction not in self._buffers:
            fmt, dev = self.fmt, self.device
            tokens = self.units * fmt.unit_tokens
            self._buffers[direction] = {
                "records": {
                    r.name: torch.empty(
                        (self.units, *r.shape), dtype=r.dtype, device=dev
                    )
                    for r in fmt.records
                },
                "rows": [
                    torch.empty(
                        (tokens, fmt.head_num, dim), dtype=self.dtype, device=dev
                    )
                    for dim in fmt.dims
                ],
                "positions": torch.arange(tokens, dtype=torch.int64, device=dev),
            }
        return self._buffers[direction]


class HostKVCounters:
    """Encoding statistics on the transfer device; reading them synchronizes
    with it (all its streams: backups run on HiCache's D2H stream)."""

    def __init__(self, layer_num: int, sides: int, device: torch.device):
        # Groups (the format's scale groups) stored as non-finite.
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        # Largest max |x| of a group stored finite, per layer and side.
        self.amax = torch.zeros((layer_num, sides), dtype=torch.float32, device=device)
        # Token entries fused launches skipped for an out-of-range host index.
        self.bad_indices = torch.zeros((), dtype=torch.int64, device=device)

    def track(self, layer_id: int, stats: EncodeStats) -> None:
        slot = self.amax[layer_id]
        torch.maximum(slot, stats.amax, out=slot)
        self.nonfinite += stats.nonfinite

    def sync(self) -> None:
        if self.nonfinite.is_cuda:
            torch.cuda.synchronize(self.nonfinite.device)

    def nonfinite_groups(self) -> int:
        """Scale groups of the format (what one scale covers) backed up with
        NaN/Inf, or beyond the format's scale range, so far; they restore as
        NaN."""
        self.sync()
        return int(self.nonfinite.item())

    def amax_by_layer(self) -> torch.Tensor:
        """Largest max |x| of a group backed up so far, per layer and side:
        CPU float32 [layer_num, len(sides)]; non-finite groups do not count."""
        self.sync()
        return self.amax.to("cpu", copy=True)

    def invalid_host_indices(self) -> int:
        """Token entries fused transfers skipped because their host index,
        already on the device, was out of range (one per token and launch).
        Indices that arrive on the CPU raise IndexError instead."""
        self.sync()
        return int(self.bad_indices.item())

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.nonfinite, self.amax, self.bad_indices)]

    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        for live, old in zip((self.nonfinite, self.amax, self.bad_indices), saved):
            live.copy_(old)


class TorchTransfer:
    """Gather -> encode -> store on backup, fetch -> decode -> scatter on load,
    through staging, with the format's torch code."""

    path = "torch"

    def __init__(self, pool: EncodedHostPool):
        self.pool = pool

    def _unit_rows(self, rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
        rows = rows[:n_tokens]
        ut = self.pool.host_format.unit_tokens
        return rows.view(n_tokens // ut, ut, *rows.shape[1:])

    def backup(self, host_indices, device_indices) -> None:
        pool = self.pool
        stage = pool.staging["d2h"]
        names = list(stage["records"])
        # The element dtype of the device rows (FP8 KV is staged as uint8).
        elem = pool.host_format.device_dtype
        for units, runs, dev_rows in pool.planner.chunks(host_indices, device_indices):
            n_tokens = len(dev_rows)
            out = {name: stage["records"][name][: len(units)] for name in names}
            for layer_id in range(pool.layer_num):
                rows = []
                for side, staged in enumerate(stage["rows"]):
                    device_layer = pool._device_buffers(side)[layer_id]
                    torch.index_select(device_layer, 0, dev_rows, out=staged[:n_tokens])
                    rows.append(self._unit_rows(staged, n_tokens).view(elem))
                pool.counters.track(layer_id, pool.host_format.encode_into(rows, out))
                for name in names:
                    store(
                        pool.records.layer(name, layer_id),
                        stage["records"][name],
                        units,
                        runs,
                    )

    def load(self, host_indices, device_indices, layer_id: int) -> None:
        pool = self.pool
        stage = pool.staging["h2d"]
        elem = pool.host_format.device_dtype
        for units, runs, dev_rows in pool.planner.chunks(host_indices, device_indices):
            n_tokens = len(dev_rows)
            records = {
                name: fetch(pool.records.layer(name, layer_id), staged, units, runs)
                for name, staged in stage["records"].items()
            }
            rows = [
                self._unit_rows(staged, n_tokens).view(elem) for staged in stage["rows"]
            ]
            pool.host_format.decode_into(records, rows)
            for side, staged in enumerate(stage["rows"]):
                pool._device_buffers(side)[layer_id].index_copy_(
                    0, dev_rows, staged[:n_tokens]
                )


def store(host: torch.Tensor, stage: torch.Tensor, units, runs) -> None:
    """Staged records -> host rows of one layer."""
    if runs is None:
        host.index_copy_(0, units, stage[: len(units)])
        return
    for offset, unit, length in runs:
        host[unit : unit + length].copy_(
            stage[offset : offset + length], non_blocking=True
        )


def fetch(host: torch.Tensor, stage: torch.Tensor, units, runs) -> torch.Tensor:
    """Host rows of one layer -> staged records."""
    out = stage[: len(units)]
    if runs is None:
        torch.index_select(host, 0, units, out=out)
        return out
    for offset, unit, length in runs:
        out[offset : offset + length].copy_(
            host[unit : unit + length], non_blocking=True
        )
    return out


class L3PageCodec:
    """A page in storage is exactly its L2 bytes, never re-encoded, each
    storage object followed by its seal (page_integrity.py), checked before
    any of its bytes is used.

    Generic backends (file): ONE object per page, every record in the
    format's `records` order, each in host order ([layer, *shape] per unit,
    the page's units in order), then the seal. Zero-copy backends (mooncake):
    the format's zero_copy_objects(), page-major layouts only, each gathered
    with its seal (one more host buffer) as the object's last piece.
    """

    def __init__(
        self,
        fmt: HostKVFormat,
        records: HostRecords,
        page_size: int,
        layer_num: int,
        layout: str,
        alloc: Callable,
    ):
        self.fmt, self.records = fmt, records
        self.page_size, self.layer_num, self.layout = page_size, layer_num, layout
        self.page_bytes = fmt.unit_bytes() * layer_num * (page_size // fmt.unit_tokens)
        self.tag = f"{fmt.storage_format_tag}-{integrity.SEAL_TAG}"
        per_unit = {r.name: r.nbytes for r in fmt.records}
        # zero_copy_objects' pieces scaled from one layer's record to a page's
        # (every layer of a page-major unit is one contiguous block).
        self.objects = []
        for obj in fmt.zero_copy_objects():
            for name, offset, size in obj:
                if offset + size > per_unit[name]:
                    raise ValueError(f"zero-copy piece beyond record {name!r}")
            self.objects.append(
                [(n, off * layer_num, size * layer_num) for n, off, size in obj]
            )
        self.pieces = [piece for obj in self.objects for piece in obj]
        self.buffers_per_object = len(self.objects[0]) + 1
        self.stats = integrity.PageIntegrityStats()
        geometry = (
            f"{self.tag}|layers{layer_num}|page{page_size}|heads{fmt.head_num}"
            f"|dims{fmt.dims}|{fmt.device_dtype}"
        )
        self.flat_sealer = integrity.PageSealer(
            f"{geometry}|flat", (self.page_bytes,), self.stats
        )
        self.zero_copy_sealer = integrity.PageSealer(
            f"{geometry}|zero-copy",
            [sum(size for _, _, size in obj) for obj in self.objects],
            self.stats,
        )
        # One seal per zero-copy object and page; kept out of kv_buffer (not
        # KV bytes), Mooncake registers it through get_hybrid_pool_buffer.
        units = next(iter(records.tensors.values())).shape[0]
        self.seals = (
            alloc((units, len(self.objects), integrity.SEAL_BYTES), torch.uint8)
            if records.page_major
            else None
        )

    def _parts(self, index) -> list[torch.Tensor]:
        """Every record of the page at token `index`, as byte views in storage
        order (contiguous for page-major layouts)."""
        index = int(index)
        if index % self.page_size:
            raise ValueError(
                f"storage page index {index} is not aligned to page_size {self.page_size}"
            )
        bufs = list(self.records.tensors.values())
        if self.records.page_major:
            page = index // self.page_size
            return [buf[page].view(torch.uint8).reshape(-1) for buf in bufs]
        return [
            buf[:, index : index + self.page_size].view(torch.uint8) for buf in bufs
        ]

    def read(self, index, key=None) -> torch.Tensor:
        # Several host tensors hold a page, so a flat page is always a copy.
        out = torch.empty(self.page_bytes + integrity.SEAL_BYTES, dtype=torch.uint8)
        payload = out[: self.page_bytes]
        torch.cat([part.reshape(-1) for part in self._parts(index)], out=payload)
        self.flat_sealer.seal_into(
            out[self.page_bytes :], 0, key, [integrity.byte_view(payload)]
        )
        return out

    def write(self, index, data_page: torch.Tensor, key=None) -> None:
        # Refuses (StoragePageRefused, a ValueError) before any byte reaches the pool.
        flat = self.flat_sealer.check_flat(key, data_page)
        offset = 0
        for part in self._parts(index):
            size = part.numel()
            part.copy_(flat[offset : offset + size].view(part.shape))
            offset += size
        self._note_loaded(int(index))

    def buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        name = self.fmt.name
        if not self.records.page_major:
            raise ValueError(
                f"--hicache-host-dtype {name} zero-copy storage pages need "
                "--hicache-mem-layout page_first or page_first_direct; got "
                f"{self.layout}."
            )
        if len(indices) % self.page_size:
            raise ValueError(
                f"--hicache-host-dtype {name} storage page metadata needs whole pages."
            )
        tensors = self.records.tensors
        bases = {n: buf.data_ptr() for n, buf in tensors.items()}
        strides = {n: buf[0].numel() * buf.element_size() for n, buf in tensors.items()}
        ptrs, sizes = [], []
        for index in indices[:: self.page_size].tolist():
            page = index // self.page_size
            for obj, pieces in enumerate(self.objects):
                for record, offset, size in pieces:
                    ptrs.append(bases[record] + page * strides[record] + offset)
                    sizes.append(size)
                ptrs.append(self.seals[page, obj].data_ptr())
                sizes.append(integrity.SEAL_BYTES)
        return ptrs, sizes

    def host_buffers(self) -> list[torch.Tensor]:
        """Every host buffer a storage backend registers: records and seals."""
        seals = [] if self.seals is None else [self.seals]
        return list(self.records.tensors.values()) + seals

    def stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if not self.records.page_major:
            return False
        bufs = self.host_buffers()
        offsets = [buf[0].numel() * buf.element_size() for buf in bufs]
        offsets += [buf.data_ptr() for buf in bufs]
        offsets += [offset for _, offset, _ in self.pieces]
        return all(offset % page_size_bytes == 0 for offset in offsets)

    def _object_buffers(self, page: int, pieces) -> list:
        views = {
            n: integrity.byte_view(self.records.tensors[n][page]) for n, _, _ in pieces
        }
        return [views[n][offset : offset + size] for n, offset, size in pieces]

    def seal_pages(self, keys, host_indices) -> None:
        """Write the seals of these pages' zero-copy objects (before a put)."""
        if self.seals is None:
            return  # layer_first: flat pages only, sealed by read() per page
        for key, index in zip(keys, host_indices[:: self.page_size].tolist()):
            page = index // self.page_size
            for obj, pieces in enumerate(self.objects):
                self.zero_copy_sealer.seal_into(
                    self.seals[page, obj], obj, key, self._object_buffers(page, pieces)
                )

    def verify_pages(self, keys, host_indices, results) -> list[bool]:
        """Check the pages a zero-copy get delivered, in order, up to the first
        missing or refused one (a prefetch is a prefix). That page's host rows
        and those of the pages after it are zeroed: a failed get may have
        filled part of it, and the batch get filled the later ones unchecked."""
        if self.seals is None:
            # layer_first: copy-mode backends checked each flat page in write().
            return results
        verified = [False] * len(results)
        pages = host_indices[:: self.page_size].tolist()
        for i, (key, index, ok) in enumerate(zip(keys, pages, results)):
            page = index // self.page_size
            reason = None if ok else integrity.Refusal.MISSING
            for obj, pieces in enumerate(self.objects if ok else ()):
                seal = integrity.byte_view(self.seals[page, obj])
                buffers = self._object_buffers(page, pieces)
                reason = self.zero_copy_sealer.check(obj, key, buffers, seal)
                if reason is not None:
                    break
            if reason is not None:
                self.stats.note_refused(reason, f"{self.tag}: key {key}")
                unused = torch.tensor(pages[i:]) // self.page_size
                for buf in (*self.records.tensors.values(), self.seals):
                    buf[unused] = 0
                break
            self.stats.note_verified()
            self._note_loaded(index)
            verified[i] = True
        return verified

    def note_missing(self, key) -> None:
        """A generic backend delivered no object for a page the hit query found."""
        self.stats.note_refused(integrity.Refusal.MISSING, f"{self.tag}: key {key}")

    def _note_loaded(self, index: int) -> None:
        # Load-side non-finite statistic: scales/metadata (or MLA RoPE) as restored.
        bufs = self.records.tensors.values()
        if self.records.page_major:
            records = [buf[index // self.page_size] for buf in bufs]
        else:
            records = [buf[:, index : index + self.page_size] for buf in bufs]
        if integrity.has_nonfinite(records):
            self.stats.note_nonfinite_loaded()

    def counts(self) -> dict:
        """Refused pages by reason, pages verified, pages replaced in storage
        and non-finite pages loaded."""
        return {
            "refused": self.stats.counts(),
            "verified": self.stats.pages_verified,
            "replaced": self.stats.pages_replaced,
            "nonfinite_pages_loaded": self.stats.nonfinite_pages_loaded,
        }


def _bytes_per_token(fmt: HostKVFormat, layers: int):
    total = fmt.unit_bytes() * layers
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

    def __init__(
        self,
        buffer_info,
        host_to_device_ratio: float,
        host_size: int,
        page_size: int,
        layout: str,
        *args,
        device_dtype: torch.dtype,
        **kwargs,
    ):
        check_layout(self.host_format_cls.name, layout)
        # HostKVCache sizes the pool from get_size_per_token, which the format answers.
        self.host_format = self._format_for(
            buffer_info, page_size, layout, device_dtype
        )
        self._plan_side_stores(page_size)
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

    def _plan_side_stores(self, page_size: int) -> None:
        """Stores beside the format's records (sink_page.py) size themselves
        here, so that get_size_per_token counts them when the pool is sized."""

    @classmethod
    def host_bytes_per_device_byte(
        cls, buffer_info, page_size: int = 1, layout: str = "layer_first"
    ) -> float:
        # Page size and layout set the unit a format may group over (e.g.
        # per-page key scales), hence its bytes per token.
        fmt = cls._format_for(buffer_info, page_size, layout, buffer_info.dtype)
        device = sum(fmt.dims) * fmt.head_num * buffer_info.dtype.itemsize
        return fmt.bytes_per_token() / device

    def get_size_per_token(self):
        return _bytes_per_token(self.host_format, self.layer_num)

    @property
    def host_format_name(self) -> str:
        """The --hicache-host-dtype value (the metrics' host_dtype label)."""
        return self.host_format.name

    @property
    def storage_format_tag(self) -> str:
        # Sealed pages are a new byte format: unsealed ones miss by key.
        return self.pages.tag

    def _alloc_host(self, shape, dtype) -> torch.Tensor:
        """One host tensor, allocated (and pinned) as the upstream pool's."""
        alloc_func = ALLOC_MEMORY_FUNCS[self._transfer_device.type]
        return alloc_func(shape, dtype=dtype, device=self.device,
                          pin_memory=self.pin_memory, allocator=self.allocator)  # fmt: skip

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
        # The controller's L3 seal hooks (patch: storage concern) are the codec's.
        self.storage_integrity = self.pages.stats
        self.seal_storage_pages = self.pages.seal_pages
        self.verify_storage_pages = self.pages.verify_pages
        self.note_storage_page_missing = self.pages.note_missing
        self.storage_integrity_counts = self.pages.counts
        # The storage interface of HostKVCache, answered by the codec too.
        self.storage_buffers_per_object = self.pages.buffers_per_object
        self.storage_page_bytes = self.pages.page_bytes
        self.set_from_flat_data_page = self.pages.write
        self.get_page_buffer_meta = self.pages.buffer_meta
        self.get_hybrid_pool_buffer = self.pages.host_buffers
        self.is_stride_page_aligned = self.pages.stride_page_aligned
        # HostKVCache.destroy unregisters every tensor in kv_buffer.
        return list(self.records.tensors.values())

    def _build_transfer(self, device_buffers: Sequence[torch.Tensor]) -> None:
        """Planner, staging, counters and the transfer strategy, in place of
        the upstream movers (they copy raw rows; records move through ours)."""
        from sglang.srt.mem_cache.pool_host import backup_verify, encoded_fused

        self.can_use_jit = False
        self.can_use_write_back_jit = False
        self.staging_page_capacity = 0
        self.staging_token_capacity = 0
        self._init_device_row_stride(device_buffers)
        fmt, dev = self.host_format, self._transfer_device
        units = self.page_num if self.records.page_major else self.size
        staging_units = min(max(1, STAGING_TOKENS // fmt.unit_tokens), units)
        self.planner = UnitPlanner(
            fmt.name, self.size, fmt.unit_tokens, staging_units, dev
        )
        self.staging = StagingBuffers(fmt, staging_units, self.dtype, dev)
        self.counters = HostKVCounters(self.layer_num, len(fmt.sides), dev)
        # The statistics the metrics reporter reads (each syncs the device).
        self.nonfinite_group_count = self.counters.nonfinite_groups
        self.scale_amax_by_layer = self.counters.amax_by_layer
        self.invalid_host_index_count = self.counters.invalid_host_indices
        # Sampled restore check of backed-up pages (backup_verify.py); None: off.
        self.backup_verifier = backup_verify.make_verifier(self)
        self.transfer = encoded_fused.select_transfer(self)
        if self.transfer.path != "fused_direct":
            # Allocated up front where the path uses them (direct needs none).
            self.staging["d2h"], self.staging["h2d"]
        if dev.type == "cuda":
            # What was enqueued here (counters) is complete before the
            # transfer streams touch it.
            torch.cuda.current_stream(dev).synchronize()

    def log_host_bytes_per_token(self) -> None:
        # _finish_setup states them, once the side stores count in the bytes.
        pass

    def _finish_setup(self) -> None:
        from sglang.srt.mem_cache.pool_host import encoded_fused

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
        if self._transfer_device.type == "cuda" and self.use_fused_kernels:
            encoded_fused.self_check(self)
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

    @property
    def transfer_path(self) -> str:
        """Which code moves the records: fused_direct, fused_staged or torch."""
        return self.transfer.path

    # The transfer strategy is chosen at construction; these switch it (tests,
    # tools, and the Triton interpreter on CPU).

    @property
    def use_fused_kernels(self) -> bool:
        return self.transfer.path != "torch"

    @use_fused_kernels.setter
    def use_fused_kernels(self, on: bool) -> None:
        from sglang.srt.mem_cache.pool_host import encoded_fused

        encoded_fused.set_transfer_path(
            self, on, self.fused_host_access, "set on the pool object"
        )

    @property
    def fused_host_access(self) -> str:
        """How fused kernels reach host memory: direct (UVA) or staged."""
        return self._fused_access

    @fused_host_access.setter
    def fused_host_access(self, access: str) -> None:
        from sglang.srt.mem_cache.pool_host import encoded_fused

        encoded_fused.set_transfer_path(
            self, self.use_fused_kernels, access, "set on the pool object"
        )

    @property
    def use_run_copies(self) -> bool:
        return self.planner.use_runs

    @use_run_copies.setter
    def use_run_copies(self, on: bool) -> None:
        self.planner.use_runs = bool(on)

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        check_io_backend(self.host_format.name, io_backend)
        self.transfer.backup(host_indices, device_indices)
        if self.backup_verifier is not None:
            self.backup_verifier.after_backup(host_indices, device_indices)

    def scale_amax_sides(self) -> tuple[str, ...]:
        """The side names of scale_amax_by_layer's columns (the metrics' kv label)."""
        return self.host_format.sides

    def note_storage_pages_replaced(self, pages: int) -> None:
        self.pages.stats.note_replaced(pages)

    def backup_verify_errors(self) -> list[float]:
        """Relative errors of the sampled backed-up pages checked since the last
        call (backup_verify.py); never waits for the device."""
        if self.backup_verifier is None:
            return []
        return self.backup_verifier.drain()

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
            self._load_layer(host_indices, device_indices, layer_id)

    def _load_layer(self, host_indices, device_indices, layer_id: int) -> None:
        self.transfer.load(host_indices, device_indices, layer_id)

    def size_per_token_without_draft(self):
        """Host bytes per token of the target layers alone."""
        return _bytes_per_token(self.host_format, self.target_layer_num)

    # -- L3 storage pages: storage_format_tag names the byte format in every
    # storage key, so pages of another host format miss.

    def get_data_page(self, index, flat: bool = True, key=None) -> torch.Tensor:
        return self.pages.read(index, key)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            self.pages.page_bytes + integrity.SEAL_BYTES,
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def get_split_heads_page_buffer_meta(
        self, indices: torch.Tensor, split_factor: int
    ):
        raise NotImplementedError(
            f"--hicache-host-dtype {self.host_format.name} does not split storage "
            "pages by head (--hicache-mem-layout page_head)."
        )
