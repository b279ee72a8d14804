"""Fused Triton transfers for the encoded host (L2) KV pools.

Backup is one kernel launch per transfer that gathers the device rows of every
layer, encodes them and writes the records into the host buffers; restore is
one launch per layer that reads, decodes and scatters them. The kernels are
the format's (HostKVFormat.encode_gather / decode_scatter). With pinned host
memory they address it directly (UVA, "direct"); otherwise they run against
device staging buffers whose records move with async copies ("staged"). Both
write the same bytes as the torch path of QuantizedHostPoolMixin.

SGLANG_HICACHE_INT8_FUSED (named after the first format; it governs every
format) picks the path: "auto" (fused on CUDA, direct when the host memory is
pinned), "off" (torch path), "direct" or "staged". On CUDA the constructor
runs `self_check()`, a small backup and restore compared bit for bit with the
format's reference encode/decode, which also compiles every kernel variant;
on any mismatch or error the pool falls back to the torch path.
"""

from __future__ import annotations

import logging

import torch

# Every format's kernels take the device KV as this per-side layer table.
from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable
from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

FUSED_HOST_ACCESS = ("direct", "staged")
TRANSFER_PATHS = ("fused_direct", "fused_staged", "torch")
_FUSED_ENV = "SGLANG_HICACHE_INT8_FUSED"
# Self-check size: at least 2 host units (a backward jump) and 4 tokens (one
# row per special case); the borrowed bytes are put back afterwards.
_SELF_CHECK_UNITS = 2
_SELF_CHECK_TOKENS = 4


def _expect_same(step, name, layer, got, want) -> None:
    """Bit-for-bit comparison for the self-check; NaN payloads don't count."""
    got, want = got.cpu(), want.cpu().reshape(got.shape)
    if got.is_floating_point():
        bits = torch.int16 if got.element_size() == 2 else torch.int32
        both_nan = torch.isnan(got) & torch.isnan(want)
        differ = (got.view(bits) != want.view(bits)) & ~both_nan
    else:
        differ = got != want
    if bool(differ.any()):
        where = differ.nonzero()[0].tolist()
        raise RuntimeError(
            f"{step} of {name.upper()} layer {layer} differs from the torch "
            f"reference at {where}: {got[tuple(where)].item()} != "
            f"{want[tuple(where)].item()}"
        )


class QuantizedFusedHostPoolMixin:
    """Fused transfer paths for a QuantizedHostPoolMixin pool; mix in before
    it. Needs nothing beyond that mixin's contract; the concrete pool calls
    `_init_fused_transfer_state()` before `_init_quantized_transfer_state()`
    and `_finish_fused_setup()` after it."""

    def _init_fused_transfer_state(self) -> None:
        dev = self._transfer_device
        self._invalid_host_indices = torch.zeros((), dtype=torch.int64, device=dev)
        self._fused_layer_tables = None
        self._load_index_cache = None
        self._select_transfer_path(dev)

    def _finish_fused_setup(self) -> None:
        if self.use_fused_kernels:
            self._fused_tables()

    def _finish_transfer_setup(self) -> None:
        if self._transfer_device.type == "cuda" and self.use_fused_kernels:
            self.self_check()
        super()._finish_transfer_setup()

    def _uses_staging(self) -> bool:
        # The fused direct path needs no staging; it is allocated lazily if
        # the pool switches to another path later.
        return not (self.use_fused_kernels and self.fused_host_access == "direct")

    def _alloc_staging(self, dev) -> dict:
        stage = super()._alloc_staging(dev)
        # Token positions in a chunk: the kernels' "host index" when they
        # address staging instead of the host buffers.
        tokens = self.staging_units * self.unit_tokens
        stage["positions"] = torch.arange(tokens, dtype=torch.int64, device=dev)
        return stage

    def _select_transfer_path(self, dev: torch.device) -> None:
        mode = envs.SGLANG_HICACHE_INT8_FUSED.get().strip().lower() or "auto"
        if mode not in ("auto", "off", *FUSED_HOST_ACCESS):
            raise ValueError(
                f"{_FUSED_ENV} must be auto, off, direct or staged; got {mode!r}"
            )
        # The kernels reach host memory directly if it is pinned (UVA), or if
        # the "device" is the CPU itself.
        pinned = self.pin_memory or dev.type == "cpu"
        if mode in FUSED_HOST_ACCESS:
            access, why = mode, f"{_FUSED_ENV}={mode}"
        elif pinned:
            access, why = "direct", "default on CUDA"
        else:
            access, why = "staged", "host memory not device-addressable (not pinned)"
        # Fused kernels by default on CUDA; on the CPU they run only under the
        # Triton interpreter, switched on by setting use_fused_kernels.
        if mode == "off":
            self._set_transfer_path(False, access, f"{_FUSED_ENV}=off")
        elif dev.type != "cuda":
            self._set_transfer_path(False, access, f"not CUDA ({dev.type})")
        elif not self.host_format.fused_available(dev):
            self._set_transfer_path(False, access, "triton cannot run on this device")
        else:
            self._set_transfer_path(True, access, why)

    def _set_transfer_path(self, use_fused: bool, access: str, reason: str) -> None:
        """The one place the transfer path changes, so its reason stays current."""
        if access not in FUSED_HOST_ACCESS:
            raise ValueError(f"fused_host_access must be direct or staged: {access!r}")
        self._use_fused = bool(use_fused)
        self._fused_access = access
        self.transfer_path_reason = reason

    @property
    def transfer_path(self) -> str:
        """Which code moves the records: fused_direct, fused_staged or torch."""
        if not self._use_fused:
            return "torch"
        return f"fused_{self._fused_access}"

    @property
    def use_fused_kernels(self) -> bool:
        return self._use_fused

    @use_fused_kernels.setter
    def use_fused_kernels(self, on: bool) -> None:
        self._set_transfer_path(on, self._fused_access, "set on the pool object")

    @property
    def fused_host_access(self) -> str:
        return self._fused_access

    @fused_host_access.setter
    def fused_host_access(self, access: str) -> None:
        self._set_transfer_path(self._use_fused, access, "set on the pool object")

    def invalid_host_index_count(self) -> int:
        """Token entries that fused transfers skipped because their host
        index, already on the device, was out of range (one per token and
        launch: a restore counts once per layer). Indices that arrive on the
        CPU are rejected with IndexError instead. Reading it synchronizes."""
        self._sync_transfer_device()
        return int(self._invalid_host_indices.item())

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        if not self.use_fused_kernels:
            super().backup_from_device_all_layer(
                device_pool, host_indices, device_indices, io_backend
            )
            return
        self._check_io_backend(io_backend)
        self._backup_fused(host_indices, device_indices)

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
        if not self.use_fused_kernels or is_draft:
            super().load_to_device_per_layer(
                device_pool,
                host_indices,
                device_indices,
                layer_id,
                io_backend,
                is_draft=is_draft,
            )
            return
        self._check_io_backend(io_backend)
        if 0 <= layer_id < self.target_layer_num:
            self._load_fused(host_indices, device_indices, layer_id)

    # ------------------------------------------------------------------
    # start-up self-check

    def self_check(self) -> bool:
        """Run a small backup + restore through the selected fused path and
        compare it bit for bit with the format's reference encode/decode; on
        any error or mismatch, warn and switch to the torch path. Returns
        whether the fused path passed (True on the torch path, which is the
        reference).

        It compiles every kernel variant the pool launches (backup with int64
        and int32 device indices, restore of every layer), so serving does not
        compile. It borrows a few host units and device slots and puts their
        bytes, and the statistics counters, back afterwards; the allocators
        are not touched. Synchronizes: meant for start-up.
        """
        if not self.use_fused_kernels:
            return True
        saved = None
        try:
            saved = self._save_self_check_state()
            self._run_self_check(saved["host_indices"], saved["device_indices"])
        except Exception as e:  # noqa: BLE001 - any fault means "don't use it"
            cause = f"{type(e).__name__}: {e}"
            logger.warning(
                "%s host pool self-check of the %s path failed (%s); "
                "falling back to the torch path.",
                self.host_format.name.upper(),
                self.transfer_path,
                cause,
            )
            self._set_transfer_path(
                False, self.fused_host_access, f"self-check failed: {cause}"
            )
            return False
        finally:
            if saved is not None:
                self._restore_self_check_state(saved)
        return True

    def _self_check_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host token indices of the last units, in reverse unit order (a
        backward jump), and as many device slots from the top of layer 0."""
        units = self.host_units
        ut = self.unit_tokens
        n_units = min(max(_SELF_CHECK_UNITS, -(-_SELF_CHECK_TOKENS // ut)), units)
        first = torch.arange(units - 1, units - 1 - n_units, -1, dtype=torch.int64)
        host = (first[:, None] * ut + torch.arange(ut)).flatten()
        device_slots = self._device_buffers(0)[0].shape[0]
        if device_slots < len(host):
            raise ValueError("device pool too small for the host pool self-check")
        device = torch.arange(device_slots - len(host), device_slots)
        return host, device.flip(0).to(self._transfer_device)

    def _record_names(self) -> list[str]:
        return [r.name for r in self.host_format.records]

    def _save_self_check_state(self) -> dict:
        host, device = self._self_check_slots()
        units = self._host_units(host)
        sides = range(len(self.host_format.sides))
        return {
            "host_indices": host,
            "device_indices": device,
            "records": [
                self._host_layer(name, layer)[units].clone()
                for layer in range(self.layer_num)
                for name in self._record_names()
            ],
            "units": units,
            "rows": [
                self._device_buffers(side)[layer][device].clone()
                for side in sides
                for layer in range(self.layer_num)
            ],
            "stats": [
                t.clone()
                for t in (
                    self._nonfinite_rows,
                    self._scale_amax,
                    self._invalid_host_indices,
                )
            ],
        }

    def _restore_self_check_state(self, saved: dict) -> None:
        # The check's own transfers may still be writing host memory.
        self._sync_transfer_device()
        records = iter(saved["records"])
        for layer in range(self.layer_num):
            for name in self._record_names():
                self._host_layer(name, layer)[saved["units"]] = next(records)
        rows = iter(saved["rows"])
        for side in range(len(self.host_format.sides)):
            for layer in range(self.layer_num):
                self._device_buffers(side)[layer][saved["device_indices"]] = next(rows)
        stats = (self._nonfinite_rows, self._scale_amax, self._invalid_host_indices)
        for live, old in zip(stats, saved["stats"]):
            live.copy_(old)
        self._load_index_cache = None
        self._sync_transfer_device()

    def _self_check_rows(self, n_tokens: int, dim: int, seed: int) -> torch.Tensor:
        """Rows spanning many magnitudes, a half-integer tie, a NaN row and the
        dtype's largest value (fp16: saturation; bf16: past the scale range)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n_tokens, self.host_format.head_num, dim, generator=g)
        x *= torch.logspace(-6, 4, n_tokens, base=2.0)[:, None, None]
        if n_tokens >= _SELF_CHECK_TOKENS:
            x[0, 0, :2] = torch.tensor([127.0, 0.5])  # 0.5 / s=1: a tie to even
            x[1, 0, 0] = float("nan")
            x[-1, -1, 0] = torch.finfo(self.dtype).max
        return x.to(self.dtype)

    def _run_self_check(self, host, device) -> None:
        fmt = self.host_format
        n, ut = len(host), self.unit_tokens
        units = self._host_units(host)
        sides = range(len(fmt.sides))
        # inputs[layer][side]: [n, heads, dim]
        inputs = [
            [
                self._self_check_rows(n, fmt.dims[side], len(fmt.sides) * layer + side)
                for side in sides
            ]
            for layer in range(self.layer_num)
        ]
        expected = [
            fmt.encode_reference([x.view(n // ut, ut, *x.shape[1:]) for x in rows])
            for rows in inputs
        ]
        for device_indices in (device, device.to(torch.int32)):
            for layer in range(self.layer_num):
                for side in sides:
                    buf = self._device_buffers(side)[layer]
                    buf[device] = inputs[layer][side].to(buf.device)
            self.backup_from_device_all_layer(None, host, device_indices, "kernel")
            # Records reach host memory asynchronously (kernel stores through
            # UVA, or non-blocking copies): wait before reading them.
            self._sync_transfer_device()
            for layer in range(self.layer_num):
                for name in self._record_names():
                    stored = self._host_layer(name, layer)[units]
                    _expect_same("backup", name, layer, stored, expected[layer][name])
                for side in sides:
                    self._device_buffers(side)[layer][device] = 0
                self.load_to_device_per_layer(
                    None, host, device_indices, layer, "kernel"
                )
                want = fmt.decode_reference(expected[layer], self.dtype)
                for side in sides:
                    restored = self._device_buffers(side)[layer][device]
                    _expect_same(
                        "restore", fmt.sides[side], layer, restored, want[side]
                    )

    # ------------------------------------------------------------------
    # fused kernels

    def _fused_tables(self) -> tuple[DeviceLayerTable, ...]:
        if self._fused_layer_tables is None:
            self._fused_layer_tables = tuple(
                DeviceLayerTable(self._device_buffers(side))
                for side in range(len(self.host_format.sides))
            )
        return self._fused_layer_tables

    def _on_transfer_device(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices as a contiguous int32/int64 tensor on the transfer device,
        enqueued on the current stream without a host sync."""
        dev = self._transfer_device
        if indices.dtype not in (torch.int32, torch.int64):
            indices = indices.to(torch.int64)
        indices = indices.contiguous()
        if indices.device == dev:
            return indices
        if dev.type == "cuda" and indices.device.type == "cpu":
            # Through pinned memory (a pageable upload may synchronize); the
            # pinned block stays reserved until the copy has run.
            return indices.pin_memory().to(dev, non_blocking=True)
        return indices.to(dev)

    def _fused_direct(self, launch) -> bool:
        """Run launch() against host memory; False if the pool uses staging,
        or switches to it because the device cannot reach this host memory."""
        if self.fused_host_access != "direct":
            return False
        try:
            launch()
            return True
        except ValueError as e:
            # Triton's launcher: "Pointer argument cannot be accessed from
            # Triton (cpu tensor?)", raised before anything is enqueued.
            if "cannot be accessed" not in str(e):
                raise
            logger.warning(
                "%s host pool: the device cannot address the host buffers "
                "(%s); using staged transfers.",
                self.host_format.name.upper(),
                e,
            )
            self._set_transfer_path(
                True, "staged", f"host memory not device-addressable: {e}"
            )
            return False

    def _backup_fused(self, host_indices, device_indices) -> None:
        tables = self._fused_tables()
        names = self._record_names()
        self._check_host_indices(host_indices)

        def direct():
            self.host_format.encode_gather(
                tables,
                self._on_transfer_device(device_indices),
                {name: self._host_all_layers(name) for name in names},
                self._on_transfer_device(host_indices),
                nonfinite_counter=self._nonfinite_rows,
                scale_amax=self._scale_amax,
                bad_index_counter=self._invalid_host_indices,
            )

        if self._fused_direct(direct):
            return
        stage = self._d2h
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            out = {
                name: stage["records"][name][:n_units].unsqueeze(1) for name in names
            }
            for layer_id in range(self.layer_num):
                self.host_format.encode_gather(
                    [table.select(layer_id) for table in tables],
                    dev_rows,
                    out,
                    stage["positions"][:n_tokens],
                    nonfinite_counter=self._nonfinite_rows,
                    scale_amax=self._scale_amax[layer_id : layer_id + 1],
                )
                for name in names:
                    self._store(name, layer_id, stage["records"][name], units, runs)

    def _load_indices(self, host_indices, device_indices):
        """Both index tensors on the transfer device, uploaded once per
        transfer: the controller passes the same tensors for every layer."""
        dev = self._transfer_device
        stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        key = (
            id(host_indices),
            host_indices._version,
            id(device_indices),
            device_indices._version,
            stream,
        )
        cache = self._load_index_cache
        if cache is not None and cache[0] == key:
            return cache[2]
        self._check_host_indices(host_indices)
        placed = (
            self._on_transfer_device(host_indices),
            self._on_transfer_device(device_indices),
        )
        # The originals stay referenced, so their ids stay unique while cached.
        self._load_index_cache = (key, (host_indices, device_indices), placed)
        return placed

    def _load_fused(self, host_indices, device_indices, layer_id) -> None:
        names = self._record_names()
        dst = [
            self._device_buffers(side)[layer_id]
            for side in range(len(self.host_format.sides))
        ]

        def direct():
            host_idx, dev_idx = self._load_indices(host_indices, device_indices)
            self.host_format.decode_scatter(
                {name: self._host_layer(name, layer_id) for name in names},
                host_idx,
                dst,
                dev_idx,
                bad_index_counter=self._invalid_host_indices,
            )

        if self._fused_direct(direct):
            return
        stage = self._h2d
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            records = {
                name: self._fetch(name, layer_id, stage["records"][name], units, runs)
                for name in names
            }
            self.host_format.decode_scatter(
                records, stage["positions"][: len(dev_rows)], dst, dev_rows
            )
