"""How the encoded host (L2) KV pools move records: the host records, the
planner of host units and runs, staging, the encoding counters, and the torch
transfer (gather -> encode -> store on backup, fetch -> decode -> scatter on
load). A transfer receives a TransferContext of these collaborators, never
the pool; the fused transfer (encoded_fused.py) takes the same context.

A unit is what one host index range addresses per layer: a page for
page_first and page_first_direct, a token for layer_first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from sglang.srt.mem_cache.pool_host.host_env import (
    FUSED_ENV,
    FUSED_MODES,
    fused_transfer_mode,
)
from sglang.srt.mem_cache.pool_host.host_format import EncodeStats, HostKVFormat

# Tokens one staging chunk holds (rounded to whole units).
STAGING_TOKENS = 4096


class HostRecords:
    """One host tensor per format record, over the layers the record is stored
    for (HostRecord.layers; every layer by default): (units, layers, *shape)
    page-major, (layers, units, *shape) layer_first."""

    def __init__(
        self,
        fmt: HostKVFormat,
        units: int,
        layer_num: int,
        page_major: bool,
        alloc: Callable,
    ):
        self.page_major = page_major
        self.units = units
        self.layer_num = layer_num
        self.tensors: dict[str, torch.Tensor] = {}
        # Per record, the layer ids it is stored for, in slot order.
        self.stored: dict[str, tuple[int, ...]] = {}
        self._slots: dict[str, dict[int, int] | None] = {}
        for record in fmt.records:
            layers = stored_layers(fmt, record, layer_num)
            self.stored[record.name] = layers
            # None: every layer, slot = layer id (no lookup on the hot path).
            planned = record.layers is not None
            self._slots[record.name] = (
                {layer: slot for slot, layer in enumerate(layers)} if planned else None
            )
            count = len(layers)
            layered = (units, count) if page_major else (count, units)
            self.tensors[record.name] = alloc((*layered, *record.shape), record.dtype)
        check_layer_formats(fmt, layer_num)

    @property
    def plan(self) -> dict[str, tuple[int, ...]]:
        """The records stored on a subset of the layers, with their layers."""
        return {n: self.stored[n] for n, s in self._slots.items() if s is not None}

    @property
    def planned(self) -> bool:
        """Whether some record is stored on a subset of the layers."""
        return bool(self.plan)

    def slot(self, name: str, layer_id: int) -> int:
        """Where layer `layer_id` sits on record `name`'s layer axis."""
        slots = self._slots[name]
        if slots is None:
            return layer_id
        if layer_id not in slots:
            raise KeyError(f"host record {name!r} is not stored on layer {layer_id}")
        return slots[layer_id]

    def layer(self, name: str, layer_id: int) -> torch.Tensor:
        """[units, *record shape] view of one layer."""
        buf, slot = self.tensors[name], self.slot(name, layer_id)
        return buf[:, slot] if self.page_major else buf[slot]

    def all_layers(self, name: str) -> torch.Tensor:
        """[units, stored layers, *record shape] view."""
        buf = self.tensors[name]
        return buf if self.page_major else buf.transpose(0, 1)


def stored_layers(fmt: HostKVFormat, record, layer_num: int) -> tuple[int, ...]:
    """The layer ids a record is stored for, checked against the pool's layers."""
    if record.layers is None:
        return tuple(range(layer_num))
    layers = tuple(int(layer) for layer in record.layers)
    if list(layers) != sorted(set(layers)) or any(
        not 0 <= layer < layer_num for layer in layers
    ):
        raise ValueError(
            f"--hicache-host-dtype {fmt.name}: record {record.name!r} is planned "
            f"for layers {list(layers)}, not distinct ascending layer ids of this "
            f"host pool's {layer_num} layers; pass layer ids in [0, {layer_num})."
        )
    return layers


def check_layer_formats(fmt: HostKVFormat, layer_num: int) -> None:
    """Each layer's format (for_layer) stores exactly the records the plan puts
    on that layer: the transfers and L3 pages move what the tensors hold."""
    for layer_id in range(layer_num):
        got = [r.name for r in fmt.for_layer(layer_id).records]
        want = [r.name for r in fmt.records if r.stored_on(layer_id)]
        if got != want:
            raise ValueError(
                f"--hicache-host-dtype {fmt.name}: layer {layer_id}'s format "
                f"stores records {got}, its plan {want}."
            )


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
        use_runs: bool | None = None,
    ):
        self.name = name
        self.size = size
        self.unit_tokens = unit_tokens
        self.staging_units = staging_units
        self.device = device
        # Copying per contiguous run keeps host<->device copies asynchronous;
        # on a CPU transfer device one indexed copy does the same work.
        self.use_runs = device.type != "cpu" if use_runs is None else bool(use_runs)

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


@dataclass(frozen=True)
class TransferContext:
    """What a transfer moves records between and counts with."""

    fmt: HostKVFormat
    records: HostRecords
    planner: UnitPlanner
    staging: StagingBuffers
    counters: HostKVCounters
    # The device KV tensors of one side (an index into fmt.sides), per layer.
    device_buffers: Callable[[int], Sequence[torch.Tensor]]
    layer_num: int
    device: torch.device


def transfer_mode(requested: str | None) -> tuple[str, str]:
    """(mode, where it came from) of a pool's fused_transfer argument: a
    FUSED_MODES value, or None to read SGLANG_HICACHE_FUSED_TRANSFER."""
    if requested is None:
        return fused_transfer_mode(), FUSED_ENV
    if requested in FUSED_MODES:
        return requested, "fused_transfer"
    raise ValueError(
        f"fused_transfer={requested!r} is not a transfer path; pass one of "
        f"{', '.join(FUSED_MODES)}, or None to read {FUSED_ENV}."
    )


def torch_transfer_reason(ctx: TransferContext, mode: str, source: str) -> str | None:
    """Why a pool keeps the torch transfer whatever its self-check would say;
    None where the format's fused kernels may run (encoded_fused.py decides)."""
    fmt, dev = ctx.fmt, ctx.device
    if mode == "off":
        return f"{source}=off"
    if mode == "auto" and dev.type != "cuda":
        # On the CPU the kernels run only under the Triton interpreter, when asked.
        return f"not CUDA ({dev.type})"
    if not fmt.fused_available(dev):
        return f"no fused {fmt.name} kernels for this device"
    return None


class TorchTransfer:
    """Gather -> encode -> store on backup, fetch -> decode -> scatter on load,
    through staging, with the format's torch code."""

    path = "torch"

    def __init__(self, ctx: TransferContext):
        self.ctx = ctx

    def _unit_rows(self, rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
        rows = rows[:n_tokens]
        ut = self.ctx.fmt.unit_tokens
        return rows.view(n_tokens // ut, ut, *rows.shape[1:])

    def backup(self, host_indices, device_indices) -> None:
        ctx = self.ctx
        stage = ctx.staging["d2h"]
        # Each layer's format and the records it stores (a per-layer plan
        # stores some records on a few layers only).
        layers = [ctx.fmt.for_layer(layer_id) for layer_id in range(ctx.layer_num)]
        # The element dtype of the device rows (FP8 KV is staged as uint8).
        elem = ctx.fmt.device_dtype
        for units, runs, dev_rows in ctx.planner.chunks(host_indices, device_indices):
            n_tokens = len(dev_rows)
            for layer_id, fmt in enumerate(layers):
                names = [record.name for record in fmt.records]
                out = {name: stage["records"][name][: len(units)] for name in names}
                rows = []
                for side, staged in enumerate(stage["rows"]):
                    device_layer = ctx.device_buffers(side)[layer_id]
                    torch.index_select(device_layer, 0, dev_rows, out=staged[:n_tokens])
                    rows.append(self._unit_rows(staged, n_tokens).view(elem))
                ctx.counters.track(layer_id, fmt.encode_into(rows, out))
                for name in names:
                    store(
                        ctx.records.layer(name, layer_id),
                        stage["records"][name],
                        units,
                        runs,
                    )

    def load(self, host_indices, device_indices, layer_id: int) -> None:
        ctx = self.ctx
        stage = ctx.staging["h2d"]
        fmt = ctx.fmt.for_layer(layer_id)
        elem = fmt.device_dtype
        for units, runs, dev_rows in ctx.planner.chunks(host_indices, device_indices):
            n_tokens = len(dev_rows)
            records = {
                r.name: fetch(
                    ctx.records.layer(r.name, layer_id),
                    stage["records"][r.name],
                    units,
                    runs,
                )
                for r in fmt.records
            }
            rows = [
                self._unit_rows(staged, n_tokens).view(elem) for staged in stage["rows"]
            ]
            fmt.decode_into(records, rows)
            for side, staged in enumerate(stage["rows"]):
                ctx.device_buffers(side)[layer_id].index_copy_(
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
