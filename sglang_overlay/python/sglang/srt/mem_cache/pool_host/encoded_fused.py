"""Fused transfers of the encoded host (L2) KV pools, their start-up
self-check, and the choice of a pool's transfer path.

Backup is one launch of the format's encode_gather per transfer (every
layer), restore one decode_scatter per layer. With pinned host memory the
kernels address it directly ("direct", UVA); otherwise they run against
device staging whose records move with async copies ("staged"). Both write
the torch path's bytes. The pool's fused_transfer argument, by default
SGLANG_HICACHE_FUSED_TRANSFER, picks the path once, at construction: auto
(fused on CUDA, direct when pinned), off (torch), direct or staged (fused
wherever the format's kernels run, the Triton interpreter on CPU included).
FP8 device KV (stored by SGLang as uint8) reaches the kernels as float8
views, so they know which FP8 the bytes are.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.mem_cache.pool_host import host_env
from sglang.srt.mem_cache.pool_host.transfer import (
    TorchTransfer,
    TransferContext,
    fetch,
    store,
)

logger = logging.getLogger(__name__)

FUSED_ENV = host_env.FUSED_ENV
FUSED_HOST_ACCESS = ("direct", "staged")
TRANSFER_PATHS = ("fused_direct", "fused_staged", "torch")
# Self-check size: at least 2 host units (a backward jump) and 4 tokens (one
# row per special case); the borrowed bytes are put back afterwards.
_SELF_CHECK_UNITS = 2
_SELF_CHECK_TOKENS = 4


def choose_fused(
    ctx: TransferContext,
    pinned: bool,
    mode: str,
    source: str,
    check: bool | None = None,
):
    """encoded.choose_transfer where torch_transfer_reason leaves the fused kernels
    in: the first host access that passes its self-check, else torch."""
    dev = ctx.device
    # The kernels reach host memory directly if it is pinned (UVA), or if the
    # "device" is the CPU itself.
    addressable = pinned or dev.type == "cpu"
    unpinned = "host memory not device-addressable (not pinned)"
    if mode == "staged" or (mode == "direct" and addressable):
        candidates = [(mode, f"{source}={mode}")]
    elif mode == "direct":
        # Some platforms map pageable memory for the device: the self-check
        # of the direct path decides, staged otherwise.
        candidates = [("direct", f"{source}=direct"), ("staged", unpinned)]
    elif addressable:
        candidates = [("direct", "default on CUDA")]
    else:
        candidates = [("staged", unpinned)]
    if check is None:
        check = dev.type == "cuda"
    for access, why in candidates:
        fused = FusedTransfer(ctx, access)
        cause = self_check(ctx, fused) if check else None
        if cause is None:
            return fused, why
    return TorchTransfer(ctx), f"self-check failed: {cause}"


def element_view(ctx: TransferContext, t: torch.Tensor) -> torch.Tensor:
    """A device KV tensor in its element dtype (FP8 KV is stored as uint8)."""
    return t.view(ctx.fmt.device_dtype)


class FusedTransfer:
    """The format's fused kernels, against host memory (access "direct") or
    staging ("staged")."""

    def __init__(self, ctx: TransferContext, access: str):
        if access not in FUSED_HOST_ACCESS:
            raise ValueError(f"fused host access must be direct or staged: {access!r}")
        self.ctx = ctx
        self.access = access
        self.path = f"fused_{access}"
        self._tables = None
        self._load_index_cache = None

    def tables(self):
        """Per side, the device layer table every format's kernels take."""
        if self._tables is None:
            from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable

            ctx = self.ctx
            self._tables = tuple(
                DeviceLayerTable(
                    [element_view(ctx, t) for t in ctx.device_buffers(side)]
                )
                for side in range(len(ctx.fmt.sides))
            )
        return self._tables

    def _on_device(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices as a contiguous int32/int64 tensor on the transfer device,
        enqueued on the current stream without a host sync."""
        dev = self.ctx.device
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

    def backup(self, host_indices, device_indices) -> None:
        from sglang.kernels.ops.kvcache.host_kv_common import KVCounters

        ctx, tables = self.ctx, self.tables()
        fmt, records, counters = ctx.fmt, ctx.records, ctx.counters
        names = list(records.tensors)
        ctx.planner.check(host_indices)
        if self.access == "direct":
            fmt.encode_gather(
                tables,
                self._on_device(device_indices),
                {name: records.all_layers(name) for name in names},
                self._on_device(host_indices),
                counters=counters,
            )
            return
        stage = ctx.staging["d2h"]
        # Whole tensors (the kernels' counters tuple); staging positions are
        # always in range, so no bad-index count.
        staged_counters = KVCounters(counters.nonfinite, counters.amax)
        # One launch per layer: out holds the records stored on that layer.
        stored = [
            [r.name for r in fmt.for_layer(layer_id).records]
            for layer_id in range(ctx.layer_num)
        ]
        for units, runs, dev_rows in ctx.planner.chunks(host_indices, device_indices):
            for layer_id, names in enumerate(stored):
                out = {n: stage["records"][n][: len(units)].unsqueeze(1) for n in names}
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
        dev = self.ctx.device
        stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        key = (id(host_indices), host_indices._version, id(device_indices),
               device_indices._version, stream)  # fmt: skip
        cache = self._load_index_cache
        if cache is not None and cache[0] == key:
            return cache[2]
        self.ctx.planner.check(host_indices)
        placed = self._on_device(host_indices), self._on_device(device_indices)
        # The originals stay referenced, so their ids stay unique while cached.
        self._load_index_cache = (key, (host_indices, device_indices), placed)
        return placed

    def load(self, host_indices, device_indices, layer_id: int) -> None:
        ctx = self.ctx
        fmt, records = ctx.fmt.for_layer(layer_id), ctx.records
        names = [r.name for r in fmt.records]
        dst = [
            element_view(ctx, ctx.device_buffers(side)[layer_id])
            for side in range(len(fmt.sides))
        ]
        if self.access == "direct":
            host_idx, dev_idx = self._load_indices(host_indices, device_indices)
            fmt.decode_scatter(
                {name: records.layer(name, layer_id) for name in names},
                host_idx,
                dst,
                dev_idx,
                bad_index_counter=ctx.counters.bad_indices,
            )
            return
        stage = ctx.staging["h2d"]
        for units, runs, dev_rows in ctx.planner.chunks(host_indices, device_indices):
            staged = {
                name: fetch(
                    records.layer(name, layer_id), stage["records"][name], units, runs
                )
                for name in names
            }
            fmt.decode_scatter(
                staged, stage["positions"][: len(dev_rows)], dst, dev_rows
            )


# ---------------------------------------------------------------------------
# start-up self-check


def self_check(ctx: TransferContext, transfer: FusedTransfer) -> str | None:
    """Run a small backup + restore through `transfer` and compare it bit for
    bit with the format's reference encode/decode; on any error or mismatch,
    warn and return its cause (None: passed).

    It compiles every kernel variant the transfer launches (backup with int64
    and int32 device indices, restore of every layer), and puts the borrowed
    host units, device slots and counters back afterwards; the allocators are
    not touched. Synchronizes: meant for start-up.
    """
    saved = None
    try:
        saved = _save_state(ctx)
        _run_self_check(ctx, transfer, saved["host_indices"], saved["device_indices"])
    except Exception as e:  # noqa: BLE001 - any fault means "don't use it"
        cause = f"{type(e).__name__}: {e}"
        logger.warning(
            "%s host pool self-check of the %s path failed (%s); falling back to "
            "the torch path.",
            ctx.fmt.name.upper(),
            transfer.path,
            cause,
        )
        return cause
    finally:
        if saved is not None:
            _restore_state(ctx, saved)
            transfer._load_index_cache = None
    return None


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


def _stored_names(ctx: TransferContext, layer: int) -> list[str]:
    """The records stored on one layer (its format's, under a per-layer plan)."""
    return [r.name for r in ctx.fmt.for_layer(layer).records]


def _slots(ctx: TransferContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Host token indices of the last units, in reverse unit order (a
    backward jump), and as many device slots from the top of layer 0."""
    ut = ctx.fmt.unit_tokens
    units = ctx.records.units
    n_units = min(max(_SELF_CHECK_UNITS, -(-_SELF_CHECK_TOKENS // ut)), units)
    first = torch.arange(units - 1, units - 1 - n_units, -1, dtype=torch.int64)
    host = (first[:, None] * ut + torch.arange(ut)).flatten()
    device_slots = ctx.device_buffers(0)[0].shape[0]
    if device_slots < len(host):
        raise ValueError("device pool too small for the host pool self-check")
    device = torch.arange(device_slots - len(host), device_slots)
    return host, device.flip(0).to(ctx.device)


def _save_state(ctx: TransferContext) -> dict:
    host, device = _slots(ctx)
    units = ctx.planner.units(host)
    sides = range(len(ctx.fmt.sides))
    return {
        "host_indices": host,
        "device_indices": device,
        "units": units,
        "records": [
            ctx.records.layer(name, layer)[units].clone()
            for layer in range(ctx.layer_num)
            for name in _stored_names(ctx, layer)
        ],
        "rows": [
            ctx.device_buffers(side)[layer][device].clone()
            for side in sides
            for layer in range(ctx.layer_num)
        ],
        "stats": ctx.counters.snapshot(),
    }


def _restore_state(ctx: TransferContext, saved: dict) -> None:
    # The check's own transfers may still be writing host memory.
    ctx.counters.sync()
    records = iter(saved["records"])
    for layer in range(ctx.layer_num):
        for name in _stored_names(ctx, layer):
            ctx.records.layer(name, layer)[saved["units"]] = next(records)
    rows = iter(saved["rows"])
    for side in range(len(ctx.fmt.sides)):
        for layer in range(ctx.layer_num):
            ctx.device_buffers(side)[layer][saved["device_indices"]] = next(rows)
    ctx.counters.restore(saved["stats"])
    ctx.counters.sync()


def _rows(ctx: TransferContext, n_tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Rows spanning many magnitudes, a half-integer tie, a NaN row and the
    dtype's largest value (fp16, FP8: saturation; bf16: past the scale
    range), in the device's element dtype (FP8: subnormals too)."""
    dtype = ctx.fmt.device_dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, ctx.fmt.head_num, dim, generator=g)
    x *= torch.logspace(-6, 4, n_tokens, base=2.0)[:, None, None]
    if n_tokens >= _SELF_CHECK_TOKENS:
        x[0, 0, :2] = torch.tensor([127.0, 0.5])  # 0.5 / s=1: a tie to even
        x[1, 0, 0] = float("nan")
        x[-1, -1, 0] = torch.finfo(dtype).max
    return x.to(dtype)


def _run_self_check(ctx: TransferContext, transfer, host, device) -> None:
    fmt = ctx.fmt
    n, ut = len(host), fmt.unit_tokens
    units = ctx.planner.units(host)
    sides = range(len(fmt.sides))
    # inputs[layer][side]: [n, heads, dim]
    inputs = [
        [_rows(ctx, n, fmt.dims[side], len(fmt.sides) * layer + side) for side in sides]
        for layer in range(ctx.layer_num)
    ]
    expected = [
        fmt.for_layer(layer).encode_reference(
            [x.view(n // ut, ut, *x.shape[1:]) for x in rows]
        )
        for layer, rows in enumerate(inputs)
    ]
    for device_indices in (device, device.to(torch.int32)):
        for layer in range(ctx.layer_num):
            for side in sides:
                buf = ctx.device_buffers(side)[layer]
                buf[device] = inputs[layer][side].view(buf.dtype).to(buf.device)
        transfer.backup(host, device_indices)
        # Records reach host memory asynchronously (kernel stores through
        # UVA, or non-blocking copies): wait before reading them.
        ctx.counters.sync()
        for layer in range(ctx.layer_num):
            for name in _stored_names(ctx, layer):
                stored = ctx.records.layer(name, layer)[units]
                _expect_same("backup", name, layer, stored, expected[layer][name])
            for side in sides:
                ctx.device_buffers(side)[layer][device] = 0
            # Every layer, packed MTP draft layers included.
            transfer.load(host, device_indices, layer)
            want = fmt.for_layer(layer).decode_reference(
                expected[layer], fmt.device_dtype
            )
            for side in sides:
                restored = element_view(ctx, ctx.device_buffers(side)[layer])
                restored = restored[device]
                _expect_same("restore", fmt.sides[side], layer, restored, want[side])
