"""Sampled restore check of backed-up host pages (SGLANG_HICACHE_VERIFY_SAMPLE_RATE).

On about `rate` of the pages a backup encodes (0.1% by default), the encoded
pool decodes the page it has just stored back on the transfer device, in
fp32, and compares it with the device rows it was encoded from. The result is
one number per sampled page, the relative reconstruction error

    r = max |x - x^| / max |x|       over the page, all layers, each side

in the domain the format quantizes (rotated formats: after their rotation),
so r stays under the format's `relative_error_threshold` (docs/operations.md
derives each from the format's error bound). A page whose device rows hold
NaN/Inf gives NaN and is not reported (the non-finite counter covers it); a
finite page that restores NaN reports +Inf.

Everything runs on the caller's stream right after the backup's own work, as
device tensors: the value reaches the host through a non-blocking copy and an
event, and `drain()` (the metrics reporter) takes the samples whose event has
completed, so nothing on the transfer path waits for the device.
"""

from __future__ import annotations

import math
import random
from collections import deque

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.pool_host import host_env

VERIFY_ENV = host_env.VERIFY_ENV
# Samples kept for the reporter; without one (no --enable-metrics) the oldest go.
MAX_PENDING = 1024


def verify_sample_rate() -> float:
    """SGLANG_HICACHE_VERIFY_SAMPLE_RATE as a fraction of pages in [0, 1]."""
    return host_env.verify_sample_rate(envs.SGLANG_HICACHE_VERIFY_SAMPLE_RATE.default)


def make_verifier(ctx, page_size: int) -> BackupVerifier | None:
    """The pool's verifier over its transfer context, or None where the rate is
    0 (no work at all)."""
    rate = verify_sample_rate()
    return BackupVerifier(ctx, page_size, rate) if rate > 0 else None


def relative_error(fmt, rows, restored) -> torch.Tensor:
    """max |x - x^| / max |x| over every side (0-dim fp32, on the rows' device);
    NaN where x holds NaN/Inf, +Inf where finite x restores NaN. `restored`
    (fp32) is overwritten."""
    from sglang.srt.mem_cache.pool_host import kv_hadamard

    blocks = fmt.rotation_blocks
    errors, tops = [], []
    for x, y, block in zip(rows, restored, blocks):
        if x.dtype.itemsize == 1:
            x = x.to(torch.float32)  # FP8 KV: exact in fp32, no mixed FP8 math
        if block:
            # Compared where the base format quantizes: the encoder rotated x
            # with this function, so x's rotation has the encoder's bits.
            x = kv_hadamard.rotate_(x.to(torch.float32, copy=True), block)
            kv_hadamard.rotate_(y, block)
        # In place and in x's dtype where exact (|x| and max are), to keep the
        # check a few passes over the page.
        err = y.sub_(x).abs_().amax()
        err = torch.where(torch.isnan(err), math.inf, err)
        # amax propagates NaN, so a non-finite x shows up in top.
        top = x.abs().amax().to(torch.float32)
        # Per side: a small side's error is not hidden by a large side's range.
        errors.append(torch.where(top > 0, err / top, err))
        tops.append(top)
    worst = torch.stack(errors).amax()
    return torch.where(torch.isfinite(torch.stack(tops)).all(), worst, math.nan)


class BackupVerifier:
    """Picks the sampled pages of each backup and enqueues their check."""

    def __init__(self, ctx, page_size: int, rate: float, seed: int = 0):
        # The pool's TransferContext (transfer.py): records, planner, device.
        self.ctx = ctx
        self.page_size = page_size
        self.rate = rate
        self._rng = random.Random(seed)
        # Pages of later backups to pass before the next sampled one.
        self._gap = self._next_gap()
        self._pending: deque = deque()
        self._host_slots: torch.Tensor | None = None
        self.pages_checked = 0
        self.samples_dropped = 0

    def _next_gap(self) -> int:
        # Geometric gaps: each page is sampled independently with probability
        # rate, at one draw per sample instead of one per page.
        if self.rate >= 1.0:
            return 0
        u = self._rng.random()
        return int(math.log1p(-u) / math.log1p(-self.rate))

    def after_backup(self, host_indices, device_indices) -> None:
        page = self.page_size
        n_pages = len(host_indices) // page
        while self._gap < n_pages:
            tokens = slice(self._gap * page, (self._gap + 1) * page)
            self._check_page(host_indices[tokens], device_indices[tokens])
            self._gap += 1 + self._next_gap()
        self._gap -= n_pages

    def _layer_groups(self) -> list[tuple[object, list[int]]]:
        """(format, layers) of the layers that share one for_layer format, in
        layer order of first use: one group, every layer, without a plan."""
        groups: dict[int, tuple[object, list[int]]] = {}
        for layer in range(self.ctx.layer_num):
            fmt = self.ctx.fmt.for_layer(layer)
            groups.setdefault(id(fmt), (fmt, []))[1].append(layer)
        return list(groups.values())

    def _check_page(self, host_indices, device_indices) -> None:
        ctx, fmt = self.ctx, self.ctx.fmt
        dev = ctx.device
        units = ctx.planner.units(host_indices)
        runs = ctx.planner.runs(units.tolist())
        device_indices = device_indices.to(dev, torch.int64)
        rows, restored = [], []
        for side in range(len(fmt.sides)):
            layers = ctx.device_buffers(side)[: ctx.layer_num]
            x = torch.empty(
                (len(layers), len(device_indices), *layers[0].shape[1:]),
                dtype=layers[0].dtype,
                device=dev,
            )
            for layer_id, layer in enumerate(layers):
                torch.index_select(layer, 0, device_indices, out=x[layer_id])
            # [layers * units, unit_tokens, heads, dim], the records' order.
            x = x.view(fmt.device_dtype).view(-1, fmt.unit_tokens, *x.shape[2:])
            rows.append(x)
            restored.append(torch.empty(x.shape, dtype=torch.float32, device=dev))
        groups = self._layer_groups()
        if len(groups) == 1:
            records = {r.name: self._fetch(r.name, runs, dev) for r in fmt.records}
            fmt.decode_into(records, restored)
        else:
            # A per-layer plan: each group's layers decode with their format.
            n = len(units)
            for layer_fmt, layers in groups:
                records = {
                    r.name: self._fetch(r.name, runs, dev, layers)
                    for r in layer_fmt.records
                }
                out = [torch.empty_like(y[: n * len(layers)]) for y in restored]
                layer_fmt.decode_into(records, out)
                for y, part in zip(restored, out):
                    for i, layer in enumerate(layers):
                        y[layer * n : (layer + 1) * n] = part[i * n : (i + 1) * n]
        self._enqueue(relative_error(fmt, rows, restored))
        self.pages_checked += 1

    def _fetch(self, name: str, runs, dev, layers=None) -> torch.Tensor:
        """The page's record `name` as [layers * units, *shape] on dev, read on
        the current stream, so after the backup that wrote it; layers: those
        layers only (None: every layer)."""
        ctx, records = self.ctx, self.ctx.records
        if records.page_major:
            # [units, layers, *shape]: each run is one contiguous host block.
            parts = [
                records.tensors[name][unit : unit + n].to(dev, non_blocking=True)
                for _, unit, n in runs
            ]
            page = torch.cat(parts)
            if layers is not None:
                slots = [records.slot(name, layer) for layer in layers]
                page = page[:, torch.tensor(slots, device=page.device)]
            return page.transpose(0, 1).flatten(0, 1)
        # layer_first [layers, units, *shape]: contiguous per layer and run.
        parts = [
            torch.cat(
                [
                    records.layer(name, layer)[unit : unit + n].to(
                        dev, non_blocking=True
                    )
                    for _, unit, n in runs
                ]
            )
            for layer in (range(ctx.layer_num) if layers is None else layers)
        ]
        return torch.stack(parts).flatten(0, 1)

    def _enqueue(self, value: torch.Tensor) -> None:
        if value.is_cuda:
            if self._host_slots is None:
                # One pinned ring, allocated once: a slot per pending sample.
                self._host_slots = torch.empty(MAX_PENDING, pin_memory=True)
            slot = self._host_slots[self.pages_checked % MAX_PENDING]
            slot.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((slot, event))
        else:
            self._pending.append((value, None))
        if len(self._pending) > MAX_PENDING:
            # Its slot is the one just written.
            self._pending.popleft()
            self.samples_dropped += 1

    def drain(self) -> list[float]:
        """Relative errors of the sampled pages whose check has completed, in
        order; pages that held NaN/Inf on the device are left out."""
        out = []
        while self._pending:
            value, event = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            r = float(value)
            if not math.isnan(r):
                out.append(r)
        return out
