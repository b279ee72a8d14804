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
`kernel` and `direct` io backends on any device. Two implementations:

  fused (default on CUDA; kv_int8_triton): backup is ONE Triton launch per
    transfer that gathers the device rows of every layer, quantizes them and
    writes the records straight into the pinned host buffers through their
    device-mapped (UVA) address; restore is ONE launch per layer that reads
    the records from host memory, dequantizes them and scatters them into
    the device pool. No staging, no separate copies. fused_host_access =
    "staged" runs the same kernels against the device staging buffers and
    moves the records with per-run async copies instead (used when the host
    memory is not pinned, or if the driver refuses a host pointer).
  torch (CPU, and the reference): gather -> kv_int8_codec -> staging ->
    per-run async copies, chunk by chunk.

Both write the same bytes (tests/test_kv_int8_triton.py runs the kernels
under TRITON_INTERPRET=1 against this path). Everything is enqueued on the
caller's current stream (HiCache's D2H / H2D stream), so the per-layer done
event still marks fully restored KV. CPU index tensors are uploaded through
pinned memory on that stream, and every temporary is allocated on it.
Staging buffers are allocated once per direction (only where a path uses
them); transfers through them run in chunks of the staging capacity, and
reusing one buffer across chunks is safe because all uses are ordered on
one transfer stream.

SGLANG_HICACHE_INT8_FUSED overrides the choice: "auto" (default: fused on
CUDA, direct if the host pool is pinned, else staged; torch elsewhere),
"off" (torch path), "direct" or "staged" (fused, that host access).
`transfer_path` ("fused_direct", "fused_staged" or "torch") and
`transfer_path_reason` say which one moves the data and why; the pool keeps
them current when it switches. On CUDA the constructor runs `self_check()`:
one small backup + restore through the fused path, compared bit for bit with
the torch reference codec, which also compiles every kernel variant the pool
launches; on any mismatch or error the pool falls back to the torch path.

Host indices are range-checked before anything moves: on the CPU where they
arrive there (no sync), and by the fused kernels themselves when they are
already on the device (out-of-range rows are skipped and counted in
`invalid_host_index_count()`, read on demand, so the hot path never syncs).

Statistics, accumulated on the transfer device and read (with a sync) only
on demand: `nonfinite_row_count()`, `scale_amax_by_layer()` (largest finite
per-row amax backed up, per layer, K and V) and `invalid_host_index_count()`.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from sglang.kernels.ops.kvcache import kv_int8_triton as fused
from sglang.srt.environ import envs
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
FUSED_HOST_ACCESS = ("direct", "staged")
TRANSFER_PATHS = ("fused_direct", "fused_staged", "torch")
_FUSED_ENV = "SGLANG_HICACHE_INT8_FUSED"
# Self-check size: at least 2 host units (a backward jump) and 4 tokens (one
# row per special case); the borrowed bytes are put back afterwards.
_SELF_CHECK_UNITS = 2
_SELF_CHECK_TOKENS = 4


def _expect_same(step, name, layer, got, want) -> None:
    """Bit-for-bit comparison for the self-check; NaN payloads don't count."""
    got, want = got.cpu(), want.cpu()
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
        if self._transfer_device.type == "cuda" and self.use_fused_kernels:
            self.self_check()
        logger.info(
            "HiCache %s INT8 host pool transfer path: %s (%s).",
            pool_label,
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
        self._invalid_host_indices = torch.zeros((), dtype=torch.int64, device=dev)
        self._scale_amax = torch.zeros(
            (self.layer_num, 2), dtype=torch.float32, device=dev
        )
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_run_copies = dev.type != "cpu"
        self._select_transfer_path(dev)
        self._fused_layer_tables = None
        self._load_index_cache = None
        # Staging: one layer of encoded records plus its device-dtype rows, per
        # direction (backup encodes into _d2h while a load may be decoding from
        # _h2d). The fused direct path needs none: allocated here only if
        # another path is selected (lazily if one is switched on later).
        self._staging = {}
        if not (self.use_fused_kernels and self.fused_host_access == "direct"):
            self._stage("d2h")
            self._stage("h2d")
        if self.use_fused_kernels:
            self._fused_tables()
        if dev.type == "cuda":
            # What was enqueued here (counter, staging positions) is complete
            # before the transfer streams touch it.
            torch.cuda.current_stream(dev).synchronize()

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
        # Fused kernels by default on CUDA; tests switch them on for CPU (the
        # Triton interpreter) by setting use_fused_kernels.
        if mode == "off":
            self._set_transfer_path(False, access, f"{_FUSED_ENV}=off")
        elif dev.type != "cuda":
            self._set_transfer_path(False, access, f"not CUDA ({dev.type})")
        elif not fused.available(dev):
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
            # Token positions in a chunk: the fused kernels' "host index" when
            # they address staging instead of the host buffers.
            "positions": torch.arange(tokens, dtype=torch.int64, device=dev),
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

    def invalid_host_index_count(self) -> int:
        """Token entries that fused transfers skipped because their host
        index, already on the device, was out of range (one per token and
        launch: a restore counts once per layer). Indices that arrive on the
        CPU are rejected with IndexError instead. Reading it synchronizes."""
        self._sync_transfer_device()
        return int(self._invalid_host_indices.item())

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
        if self.use_fused_kernels:
            self._backup_fused(host_indices, device_indices)
            return
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
        if io_backend not in INT8_HOST_IO_BACKENDS:
            raise ValueError(
                f"--hicache-host-dtype int8 supports --hicache-io-backend "
                f"{', '.join(INT8_HOST_IO_BACKENDS)}; got {io_backend!r}."
            )
        if not 0 <= layer_id < self.target_layer_num:
            return
        if self.use_fused_kernels:
            self._load_fused(host_indices, device_indices, layer_id)
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
    # start-up self-check

    def self_check(self) -> bool:
        """Run a small backup + restore through the selected fused path and
        compare it bit for bit with the torch reference codec; on any error or
        mismatch, warn and switch to the torch path. Returns whether the fused
        path passed (True on the torch path, which is the reference).

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
                "INT8 host pool self-check of the %s path failed (%s); "
                "falling back to the torch path.",
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
        units = self.page_num if self._page_major else self.size
        ut = self.unit_tokens
        n_units = min(max(_SELF_CHECK_UNITS, -(-_SELF_CHECK_TOKENS // ut)), units)
        first = torch.arange(units - 1, units - 1 - n_units, -1, dtype=torch.int64)
        host = (first[:, None] * ut + torch.arange(ut)).flatten()
        device_slots = self.device_k_buffers[0].shape[0]
        if device_slots < len(host):
            raise ValueError("device pool too small for the INT8 self-check")
        device = torch.arange(device_slots - len(host), device_slots)
        return host, device.flip(0).to(self._transfer_device)

    def _save_self_check_state(self) -> dict:
        host, device = self._self_check_slots()
        units = self._host_units(host)
        return {
            "host_indices": host,
            "device_indices": device,
            "records": [
                self._host_layer(name, layer)[units].clone()
                for layer in range(self.layer_num)
                for name in ("k", "v", "scale")
            ],
            "units": units,
            "rows": [
                buf[layer][device].clone()
                for buf in (self.device_k_buffers, self.device_v_buffers)
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
            for name in ("k", "v", "scale"):
                self._host_layer(name, layer)[saved["units"]] = next(records)
        rows = iter(saved["rows"])
        for buf in (self.device_k_buffers, self.device_v_buffers):
            for layer in range(self.layer_num):
                buf[layer][saved["device_indices"]] = next(rows)
        stats = (self._nonfinite_rows, self._scale_amax, self._invalid_host_indices)
        for live, old in zip(stats, saved["stats"]):
            live.copy_(old)
        self._load_index_cache = None
        self._sync_transfer_device()

    def _self_check_rows(self, n_tokens: int, dim: int, seed: int) -> torch.Tensor:
        """Rows spanning many magnitudes, a half-integer tie, a NaN row and the
        dtype's largest value (fp16: saturation; bf16: past the scale range)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n_tokens, self.head_num, dim, generator=g)
        x *= torch.logspace(-6, 4, n_tokens, base=2.0)[:, None, None]
        if n_tokens >= _SELF_CHECK_TOKENS:
            x[0, 0, :2] = torch.tensor([127.0, 0.5])  # 0.5 / s=1: a tie to even
            x[1, 0, 0] = float("nan")
            x[-1, -1, 0] = torch.finfo(self.dtype).max
        return x.to(self.dtype)

    def _run_self_check(self, host, device) -> None:
        n = len(host)
        units = self._host_units(host)
        dev_bufs = (self.device_k_buffers, self.device_v_buffers)
        inputs = [
            [
                self._self_check_rows(n, buf[layer].shape[-1], 2 * layer + kv)
                for layer in range(self.layer_num)
            ]
            for kv, buf in enumerate(dev_bufs)
        ]
        expected = [
            [codec.quantize_reference(x) for x in per_layer] for per_layer in inputs
        ]
        for device_indices in (device, device.to(torch.int32)):
            for kv, buf in enumerate(dev_bufs):
                for layer in range(self.layer_num):
                    buf[layer][device] = inputs[kv][layer].to(buf[layer].device)
            self.backup_from_device_all_layer(None, host, device_indices, "kernel")
            # Records reach host memory asynchronously (kernel stores through
            # UVA, or non-blocking copies): wait before reading them.
            self._sync_transfer_device()
            for layer in range(self.layer_num):
                for kv, name in enumerate(("k", "v")):
                    q_ref, s_ref = expected[kv][layer]
                    stored = self._host_layer(name, layer)[units]
                    scales = self._host_layer("scale", layer)[units][:, :, kv]
                    _expect_same(
                        "backup", name, layer, stored, q_ref.view(stored.shape)
                    )
                    _expect_same(
                        "backup scale", name, layer, scales, s_ref.view(scales.shape)
                    )
                for buf in dev_bufs:
                    buf[layer][device] = 0
                self.load_to_device_per_layer(
                    None, host, device_indices, layer, "kernel"
                )
                for kv, buf in enumerate(dev_bufs):
                    q_ref, s_ref = expected[kv][layer]
                    restored = buf[layer][device].cpu()
                    want = codec.dequantize_reference(q_ref, s_ref, self.dtype)
                    _expect_same("restore", "kv"[kv], layer, restored, want)

    # ------------------------------------------------------------------
    # fused kernels (kv_int8_triton)

    def _fused_tables(self) -> tuple[fused.DeviceLayerTable, fused.DeviceLayerTable]:
        if self._fused_layer_tables is None:
            self._fused_layer_tables = (
                fused.DeviceLayerTable(self.device_k_buffers),
                fused.DeviceLayerTable(self.device_v_buffers),
            )
        return self._fused_layer_tables

    def _records_all_layers(self) -> tuple[torch.Tensor, ...]:
        """Host K, V and scale buffers as [unit, layer, token_in_unit, ...] views."""
        bufs = (self.k_host_buffer, self.v_host_buffer, self.scale_buffer)
        return bufs if self._page_major else tuple(b.transpose(0, 1) for b in bufs)

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

    def _check_host_indices(self, host_indices: torch.Tensor) -> None:
        # Checked where the indices are on the CPU (no device sync); indices
        # already on the device are bounded by the fused kernels themselves.
        if host_indices.device.type == "cpu" and host_indices.numel():
            lo, hi = int(host_indices.min()), int(host_indices.max())
            if lo < 0 or hi >= self.size:
                raise IndexError(
                    f"INT8 host pool: host indices [{lo}, {hi}] out of range "
                    f"[0, {self.size}); nothing was transferred."
                )

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
                "INT8 host pool: the device cannot address the host buffers "
                "(%s); using staged transfers.",
                e,
            )
            self._set_transfer_path(
                True, "staged", f"host memory not device-addressable: {e}"
            )
            return False

    def _backup_fused(self, host_indices, device_indices) -> None:
        k_tab, v_tab = self._fused_tables()
        self._check_host_indices(host_indices)

        def direct():
            k_out, v_out, s_out = self._records_all_layers()
            fused.encode_gather(
                k_tab,
                v_tab,
                self._on_transfer_device(device_indices),
                k_out,
                v_out,
                s_out,
                self._on_transfer_device(host_indices),
                unit_tokens=self.unit_tokens,
                nonfinite_counter=self._nonfinite_rows,
                scale_amax=self._scale_amax,
                bad_index_counter=self._invalid_host_indices,
            )

        if self._fused_direct(direct):
            return
        stage = self._d2h
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            n_units, n_tokens = len(units), len(dev_rows)
            for layer_id in range(self.layer_num):
                fused.encode_gather(
                    k_tab.select(layer_id),
                    v_tab.select(layer_id),
                    dev_rows,
                    stage["k"][:n_units].unsqueeze(1),
                    stage["v"][:n_units].unsqueeze(1),
                    stage["scale"][:n_units].unsqueeze(1),
                    stage["positions"][:n_tokens],
                    unit_tokens=self.unit_tokens,
                    nonfinite_counter=self._nonfinite_rows,
                    scale_amax=self._scale_amax[layer_id : layer_id + 1],
                )
                for name in ("k", "v", "scale"):
                    self._store(name, layer_id, stage[name], units, runs)

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
        dev_k = self.device_k_buffers[layer_id]
        dev_v = self.device_v_buffers[layer_id]

        def direct():
            host_idx, dev_idx = self._load_indices(host_indices, device_indices)
            fused.decode_scatter(
                self._host_layer("k", layer_id),
                self._host_layer("v", layer_id),
                self._host_layer("scale", layer_id),
                host_idx,
                dev_k,
                dev_v,
                dev_idx,
                unit_tokens=self.unit_tokens,
                bad_index_counter=self._invalid_host_indices,
            )

        if self._fused_direct(direct):
            return
        stage = self._h2d
        for units, runs, dev_rows in self._chunks(host_indices, device_indices):
            scales = self._fetch("scale", layer_id, stage["scale"], units, runs)
            k = self._fetch("k", layer_id, stage["k"], units, runs)
            v = self._fetch("v", layer_id, stage["v"], units, runs)
            fused.decode_scatter(
                k,
                v,
                scales,
                stage["positions"][: len(dev_rows)],
                dev_k,
                dev_v,
                dev_rows,
                unit_tokens=self.unit_tokens,
            )

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
