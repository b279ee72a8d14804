"""The storage (L3) page bytes of the encoded host (L2) KV pools: a page in
storage is exactly its L2 bytes, never re-encoded, each object sealed
(page_integrity.py) and checked before any of its bytes is used."""

from __future__ import annotations

from typing import Callable

import torch

from sglang.srt.mem_cache.pool_host import page_integrity as integrity
from sglang.srt.mem_cache.pool_host.host_format import HostKVFormat
from sglang.srt.mem_cache.pool_host.transfer import HostRecords


class L3PageCodec:
    """A page in storage is exactly its L2 bytes, never re-encoded, each
    storage object followed by its seal (page_integrity.py), checked before
    any of its bytes is used.

    Generic backends (file): ONE object per page, every record in the
    format's `records` order, each in host order ([layer, *shape] per unit,
    the page's units in order; a planned record over its stored layers
    only), then the seal. Zero-copy backends (mooncake):
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
        units_per_page = page_size // fmt.unit_tokens
        self.page_bytes = fmt.layers_unit_bytes(layer_num) * units_per_page
        self.tag = f"{fmt.storage_format_tag}-{integrity.SEAL_TAG}"
        per_unit = {r.name: r.nbytes for r in fmt.records}
        # Layers each record is stored for (a per-layer plan stores some on a
        # few layers only).
        counts = {n: len(layers) for n, layers in records.stored.items()}
        # zero_copy_objects' pieces scaled from one layer's record to a page's
        # (every stored layer of a page-major unit is one contiguous block).
        self.objects = []
        for obj in fmt.zero_copy_objects():
            for name, offset, size in obj:
                if offset + size > per_unit[name]:
                    raise ValueError(f"zero-copy piece beyond record {name!r}")
            self.objects.append(
                [(n, off * counts[n], size * counts[n]) for n, off, size in obj]
            )
        self.pieces = [piece for obj in self.objects for piece in obj]
        self.buffers_per_object = len(self.objects[0]) + 1
        self.stats = integrity.PageIntegrityStats()
        geometry = (
            f"{self.tag}|layers{layer_num}|page{page_size}|heads{fmt.head_num}"
            f"|dims{fmt.dims}|{fmt.device_dtype}"
        )
        if records.planned:
            # Pages of another plan of the same tag are refused by their seal.
            geometry += f"|plan{sorted(records.plan.items())}"
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
