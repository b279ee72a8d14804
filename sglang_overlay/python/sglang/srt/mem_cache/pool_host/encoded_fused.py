"""Fused transfers of the encoded host (L2) KV pools and their self-check.

Backup is one launch of the format's encode_gather per transfer (every
layer), restore one decode_scatter per layer. With pinned host memory the
kernels address it directly ("direct", UVA); otherwise they run against
device staging whose records move with async copies ("staged"). Both write
the torch path's bytes. SGLANG_HICACHE_FUSED_TRANSFER picks the path: auto
(fused on CUDA, direct when pinned), off (torch), direct or staged. FP8 device
KV (stored by SGLang as uint8) reaches the kernels as float8 views, so they
know which FP8 the bytes are.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.mem_cache.pool_host.encoded import TorchTransfer, fetch, store
from sglang.srt.mem_cache.pool_host.host_env import FUSED_ENV, fused_transfer_mode

logger = logging.getLogger(__name__)

FUSED_HOST_ACCESS = ("direct", "staged")
TRANSFER_PATHS = ("fused_direct", "fused_staged", "torch")
# Self-check size: at least 2 host units (a backward jump) and 4 tokens (one
# row per special case); the borrowed bytes are put back afterwards.
_SELF_CHECK_UNITS = 2
_SELF_CHECK_TOKENS = 4


def select_transfer(pool):
    """The pool's transfer strategy at construction."""
    mode, dev = fused_transfer_mode(), pool._transfer_device
    # The kernels reach host memory directly if it is pinned (UVA), or if the
    # "device" is the CPU itself.
    if mode in FUSED_HOST_ACCESS:
        access, why = mode, f"{FUSED_ENV}={mode}"
    elif pool.pin_memory or dev.type == "cpu":
        access, why = "direct", "default on CUDA"
    else:
        access, why = "staged", "host memory not device-addressable (not pinned)"
    # On the CPU the kernels run only under the Triton interpreter, switched
    # on by setting use_fused_kernels.
    if mode == "off":
        use, why = False, f"{FUSED_ENV}=off"
    elif dev.type != "cuda":
        use, why = False, f"not CUDA ({dev.type})"
    elif not pool.host_format.fused_available(dev):
        use, why = False, f"no fused {pool.host_format.name} kernels for this device"
    else:
        use = True
    pool._fused_access, pool.transfer_path_reason = access, why
    return FusedTransfer(pool) if use else TorchTransfer(pool)


def set_transfer_path(pool, use_fused: bool, access: str, reason: str) -> None:
    """The one place the path changes after construction, so its reason stays current."""
    if access not in FUSED_HOST_ACCESS:
        raise ValueError(f"fused_host_access must be direct or staged: {access!r}")
    pool._fused_access, pool.transfer_path_reason = access, reason
    if use_fused != isinstance(pool.transfer, FusedTransfer):
        pool.transfer = FusedTransfer(pool) if use_fused else TorchTransfer(pool)


def element_view(pool, t: torch.Tensor) -> torch.Tensor:
    """A device KV tensor in its element dtype (FP8 KV is stored as uint8)."""
    return t.view(pool.host_format.device_dtype)


class FusedTransfer:
    """The format's fused kernels, against host memory or staging."""

    def __init__(self, pool):
        self.pool = pool
        self._tables = None
        self._load_index_cache = None

    @property
    def path(self) -> str:
        return f"fused_{self.pool.fused_host_access}"

    def tables(self):
        """Per side, the device layer table every format's kernels take."""
        if self._tables is None:
            from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable

            pool = self.pool
            self._tables = tuple(
                DeviceLayerTable(
                    [element_view(pool, t) for t in pool._device_buffers(side)]
                )
                for side in range(len(pool.host_format.sides))
            )
        return self._tables

    def _on_device(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices as a contiguous int32/int64 tensor on the transfer device,
        enqueued on the current stream without a host sync."""
        dev = self.pool._transfer_device
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

    def _direct(self, launch) -> bool:
        """Run launch() against host memory; False if the pool uses staging,
        or switches to it because the device cannot reach this host memory."""
        pool = self.pool
        if pool.fused_host_access != "direct":
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
                "%s host pool: the device cannot address the host buffers (%s); "
                "using staged transfers.",
                pool.host_format.name.upper(),
                e,
            )
            set_transfer_path(
                pool, True, "staged", f"host memory not device-addressable: {e}"
            )
            return False

    def backup(self, host_indices, device_indices) -> None:
        from sglang.kernels.ops.kvcache.host_kv_common import KVCounters

        pool, tables = self.pool, self.tables()
        fmt, records, counters = pool.host_format, pool.records, pool.counters
        names = list(records.tensors)
        pool.planner.check(host_indices)

        def direct():
            fmt.encode_gather(
                tables,
                self._on_device(device_indices),
                {name: records.all_layers(name) for name in names},
                self._on_device(host_indices),
                counters=counters,
            )

        if self._direct(direct):
            return
        stage = pool.staging["d2h"]
        # Whole tensors (the kernels' counters tuple); staging positions are
        # always in range, so no bad-index count.
        staged_counters = KVCounters(counters.nonfinite, counters.amax)
        for units, runs, dev_rows in pool.planner.chunks(host_indices, device_indices):
            out = {n: stage["records"][n][: len(units)].unsqueeze(1) for n in names}
            for layer_id in range(pool.layer_num):
                fmt.encode_gather(
                    tables,
                    dev_rows,
                    out,
                    stage["positions"][: len(dev_rows)],
                    counters=staged_counters,
                    first_layer=layer_id,
                )
                for name in names:
                    store(
                        records.layer(name, layer_id),
                        stage["records"][name],
                        units,
                        runs,
                    )

    def _load_indices(self, host_indices, device_indices):
        """Both index tensors on the transfer device, uploaded once per
        transfer: the controller passes the same tensors for every layer."""
        dev = self.pool._transfer_device
        stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        key = (id(host_indices), host_indices._version, id(device_indices),
               device_indices._version, stream)  # fmt: skip
        cache = self._load_index_cache
        if cache is not None and cache[0] == key:
            return cache[2]
        self.pool.planner.check(host_indices)
        placed = self._on_device(host_indices), self._on_device(device_indices)
        # The originals stay referenced, so their ids stay unique while cached.
        self._load_index_cache = (key, (host_indices, device_indices), placed)
        return placed

    def load(self, host_indices, device_indices, layer_id: int) -> None:
        pool = self.pool
        fmt, records = pool.host_format, pool.records
        dst = [
            element_view(pool, pool._device_buffers(side)[layer_id])
            for side in range(len(fmt.sides))
        ]

        def direct():
            host_idx, dev_idx = self._load_indices(host_indices, device_indices)
            fmt.decode_scatter(
                {name: records.layer(name, layer_id) for name in records.tensors},
                host_idx,
                dst,
                dev_idx,
                bad_index_counter=pool.counters.bad_indices,
            )

        if self._direct(direct):
            return
        stage = pool.staging["h2d"]
        for units, runs, dev_rows in pool.planner.chunks(host_indices, device_indices):
            staged = {
                name: fetch(records.layer(name, layer_id), buf, units, runs)
                for name, buf in stage["records"].items()
            }
            fmt.decode_scatter(
                staged, stage["positions"][: len(dev_rows)], dst, dev_rows
            )


# ---------------------------------------------------------------------------
# start-up self-check


def self_check(pool) -> bool:
    """Run a small backup + restore through the pool's fused path and compare
    it bit for bit with the format's reference encode/decode; on any error or
    mismatch, warn and switch to the torch path. Returns whether the fused
    path passed (True on the torch path, which is the reference).

    It compiles every kernel variant the pool launches (backup with int64 and
    int32 device indices, restore of every layer), and puts the borrowed host
    units, device slots and counters back afterwards; the allocators are not
    touched. Synchronizes: meant for start-up.
    """
    if not pool.use_fused_kernels:
        return True
    saved = None
    try:
        saved = _save_state(pool)
        _run_self_check(pool, saved["host_indices"], saved["device_indices"])
    except Exception as e:  # noqa: BLE001 - any fault means "don't use it"
        cause = f"{type(e).__name__}: {e}"
        logger.warning(
            "%s host pool self-check of the %s path failed (%s); falling back to "
            "the torch path.",
            pool.host_format.name.upper(),
            pool.transfer_path,
            cause,
        )
        set_transfer_path(
            pool, False, pool.fused_host_access, f"self-check failed: {cause}"
        )
        return False
    finally:
        if saved is not None:
            _restore_state(pool, saved)
    return True


def _expect_same(step, name, layer, got, want) -> None:
    """Bit-for-bit comparison; NaN payloads don't count."""
    got, want = got.cpu(), want.cpu().reshape(got.shape)
    if got.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        # Through fp32: FP8 has no isnan kernel.
        both_nan = torch.isnan(got.float()) & torch.isnan(want.float())
        differ = (got.view(bits) != want.view(bits)) & ~both_nan
    else:
        differ = got != want
    if bool(differ.any()):
        where = differ.nonzero()[0].tolist()
        raise RuntimeError(
            f"{step} of {name.upper()} layer {layer} differs from the torch "
            f"reference at {where}: {got[tuple(where)].float().item()} != "
            f"{want[tuple(where)].float().item()}"
        )


def _slots(pool) -> tuple[torch.Tensor, torch.Tensor]:
    """Host token indices of the last units, in reverse unit order (a
    backward jump), and as many device slots from the top of layer 0."""
    ut = pool.host_format.unit_tokens
    units = pool.page_num if pool.records.page_major else pool.size
    n_units = min(max(_SELF_CHECK_UNITS, -(-_SELF_CHECK_TOKENS // ut)), units)
    first = torch.arange(units - 1, units - 1 - n_units, -1, dtype=torch.int64)
    host = (first[:, None] * ut + torch.arange(ut)).flatten()
    device_slots = pool._device_buffers(0)[0].shape[0]
    if device_slots < len(host):
        raise ValueError("device pool too small for the host pool self-check")
    device = torch.arange(device_slots - len(host), device_slots)
    return host, device.flip(0).to(pool._transfer_device)


def _save_state(pool) -> dict:
    host, device = _slots(pool)
    units = pool.planner.units(host)
    sides = range(len(pool.host_format.sides))
    return {
        "host_indices": host,
        "device_indices": device,
        "units": units,
        "records": [
            pool.records.layer(name, layer)[units].clone()
            for layer in range(pool.layer_num)
            for name in pool.records.tensors
        ],
        "rows": [
            pool._device_buffers(side)[layer][device].clone()
            for side in sides
            for layer in range(pool.layer_num)
        ],
        "stats": pool.counters.snapshot(),
    }


def _restore_state(pool, saved: dict) -> None:
    # The check's own transfers may still be writing host memory.
    pool.counters.sync()
    records = iter(saved["records"])
    for layer in range(pool.layer_num):
        for name in pool.records.tensors:
            pool.records.layer(name, layer)[saved["units"]] = next(records)
    rows = iter(saved["rows"])
    for side in range(len(pool.host_format.sides)):
        for layer in range(pool.layer_num):
            pool._device_buffers(side)[layer][saved["device_indices"]] = next(rows)
    pool.counters.restore(saved["stats"])
    if isinstance(pool.transfer, FusedTransfer):
        pool.transfer._load_index_cache = None
    pool.counters.sync()


def _rows(pool, n_tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Rows spanning many magnitudes, a half-integer tie, a NaN row and the
    dtype's largest value (fp16, FP8: saturation; bf16: past the scale
    range), in the device's element dtype (FP8: subnormals too)."""
    dtype = pool.host_format.device_dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, pool.host_format.head_num, dim, generator=g)
    x *= torch.logspace(-6, 4, n_tokens, base=2.0)[:, None, None]
    if n_tokens >= _SELF_CHECK_TOKENS:
        x[0, 0, :2] = torch.tensor([127.0, 0.5])  # 0.5 / s=1: a tie to even
        x[1, 0, 0] = float("nan")
        x[-1, -1, 0] = torch.finfo(dtype).max
    return x.to(dtype)


def _run_self_check(pool, host, device) -> None:
    fmt = pool.host_format
    n, ut = len(host), pool.host_format.unit_tokens
    units = pool.planner.units(host)
    sides = range(len(fmt.sides))
    # inputs[layer][side]: [n, heads, dim]
    inputs = [
        [
            _rows(pool, n, fmt.dims[side], len(fmt.sides) * layer + side)
            for side in sides
        ]
        for layer in range(pool.layer_num)
    ]
    expected = [
        fmt.encode_reference([x.view(n // ut, ut, *x.shape[1:]) for x in rows])
        for rows in inputs
    ]
    for device_indices in (device, device.to(torch.int32)):
        for layer in range(pool.layer_num):
            for side in sides:
                buf = pool._device_buffers(side)[layer]
                buf[device] = inputs[layer][side].view(buf.dtype).to(buf.device)
        pool.backup_from_device_all_layer(None, host, device_indices, "kernel")
        # Records reach host memory asynchronously (kernel stores through
        # UVA, or non-blocking copies): wait before reading them.
        pool.counters.sync()
        for layer in range(pool.layer_num):
            for name in pool.records.tensors:
                stored = pool.records.layer(name, layer)[units]
                _expect_same("backup", name, layer, stored, expected[layer][name])
            for side in sides:
                pool._device_buffers(side)[layer][device] = 0
            # Packed MTP draft layers load as the controller's draft mapper does.
            pool.load_to_device_per_layer(
                None, host, device_indices, layer, "kernel",
                is_draft=layer >= pool.target_layer_num,
            )  # fmt: skip
            want = fmt.decode_reference(expected[layer], fmt.device_dtype)
            for side in sides:
                restored = element_view(pool, pool._device_buffers(side)[layer])
                restored = restored[device]
                _expect_same("restore", fmt.sides[side], layer, restored, want[side])
