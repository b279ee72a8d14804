"""The attention-sink page of the 4-bit host formats: the keys of the page
holding a sequence's token 0 kept at 8 bits (SGLANG_HICACHE_SINK_PAGE_TOKENS).

The hybrid pool assembler passes the variable (requested_sink_page_tokens) to
the encoded MHA host pools, and the HiCache hook checks it at start-up
(check_sink_page_args).

The radix cache says which backed-up page is a sequence's first (the first
page of a node whose parent is the root) through HiCacheController.write's
``first_page_is_sink``; the pool calls ``mark_sink_page`` before that backup
runs. A marked page gets a slot in a side store of its keys at 8 bits
(Int8KeysFormat: the int8 codec's per-row keys and scales, one unit per page,
every layer), since keys carry most of the 4-bit loss and per-channel key
ranges break on the sink page. The page is still encoded at 4 bits in the
pool's own records, so L3 always receives (and returns) the format's 4-bit
page under its own tag; a restore from L2 decodes the whole page from the
4-bit records, then its keys again from the side store over them. A marked
page's slot goes to L3 as one more object under the page's key plus
L3_KEY_SUFFIX, sealed as Int8KeysFormat and bound to that key; a prefetch
from token 0 brings it back into a slot when it verifies and one is free.

The side store has one slot per ``sink_page_tokens`` host tokens (one per
sequence of that length), allocated with the pool and counted in its bytes
per token. A first page that finds the store full stays 4-bit and is counted
(``sink_page_counts()["kept_4bit"]``); freeing a host page returns its slot.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec as int8
from sglang.srt.mem_cache.pool_host import page_integrity as integrity
from sglang.srt.mem_cache.pool_host.host_format import (
    FP8_DEVICE_DTYPES,
    EncodeStats,
    HostKVFormat,
    HostRecord,
)
from sglang.srt.mem_cache.pool_host.page_codec import L3PageCodec
from sglang.srt.mem_cache.pool_host.transfer import (
    STAGING_TOKENS,
    HostKVCounters,
    HostRecords,
    StagingBuffers,
    TorchTransfer,
    TransferContext,
    UnitPlanner,
)

logger = logging.getLogger(__name__)

SINK_ENV = "SGLANG_HICACHE_SINK_PAGE_TOKENS"
# Host tokens per slot of the automatic sink page (host_plan): the value this
# module's documentation (docs/sink-page.md) recommends, one 4k sequence a slot.
AUTO_SINK_PAGE_TOKENS = 4096
# The L3 object of a sink page's 8-bit keys: the page's storage key + this.
L3_KEY_SUFFIX = "-sink8keys"


def readable_bytes(n: int) -> str:
    """n bytes in the largest decimal unit that keeps a whole number before the
    point: 17.8 KB, 9.6 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def requested_sink_page_tokens(env: Mapping[str, str] | None = None) -> int:
    """SGLANG_HICACHE_SINK_PAGE_TOKENS of `env` (the process's by default),
    read strictly (Envs would turn a malformed value into 0, off, with a
    warning): host tokens per 8-bit sink-page slot; 0 (unset or empty) is off
    here (host_plan may then choose the sink page for the model)."""
    raw = (os.environ if env is None else env).get(SINK_ENV, "")
    try:
        tokens = int(raw.strip() or 0)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(
            f"{SINK_ENV}={raw!r} is not a number of host tokens; pass 0 (off) or "
            "the host tokens per 8-bit sink-page slot, at least --page-size "
            "(e.g. 4096), or unset it."
        )
    return tokens


def sink_page_tokens(fmt, page_size: int, requested: int) -> int:
    """Host tokens per side-store slot (0: off), from the pool's keyword;
    refuses what the format cannot keep."""
    if not requested:
        return 0
    check_sink_page_format(type(fmt), fmt.name)
    if fmt.device_dtype in FP8_DEVICE_DTYPES:
        raise ValueError(
            f"{SINK_ENV}: the 8-bit sink page stores BF16/FP16 device KV, not "
            f"{str(fmt.device_dtype).removeprefix('torch.')}. Unset {SINK_ENV} or "
            "pass --kv-cache-dtype bf16."
        )
    check_sink_page_size(requested, page_size)
    return requested


@dataclass(frozen=True)
class HostPlan:
    """The per-model choice of a host format: its 8-bit key layers (model layer
    ids) or its sink page, and why."""

    key8_layers: tuple[int, ...]
    sink_page_tokens: int  # host tokens per 8-bit sink-page slot; 0: off
    why: str

    def describe(self, name: str) -> str:
        if self.key8_layers:
            choice = f"8-bit keys on model layers {list(self.key8_layers)}"
        elif self.sink_page_tokens:
            choice = (
                "the sink page (8-bit keys of each sequence's first page, one "
                f"slot per {self.sink_page_tokens} host tokens)"
            )
        else:
            choice = "no plan and no sink page"
        return f"--hicache-host-dtype {name}: {choice}, {self.why}"


def _auto_sink_off(fmt_cls, page_size: int, device_dtype) -> str:
    """Why the automatic sink page cannot be kept ("" when it can): then it is
    off, not refused, since the operator did not ask for it."""
    if not fmt_cls.sink_page:
        return f"{fmt_cls.name} keeps no sink page"
    if device_dtype in FP8_DEVICE_DTYPES:
        return "the sink page stores BF16/FP16 device KV, not FP8"
    if page_size > AUTO_SINK_PAGE_TOKENS:
        return (
            f"page size {page_size} is over its {AUTO_SINK_PAGE_TOKENS} host "
            "tokens per slot"
        )
    return ""


def host_plan(
    fmt_cls,
    hf_config: Any,
    env: Mapping[str, str] | None = None,
    *,
    page_size: int = 1,
    device_dtype=None,
) -> HostPlan:
    """The plan or the sink page of `fmt_cls` for this model: an explicit
    SGLANG_HICACHE_SINK_PAGE_TOKENS (0: off) wins; else a format that takes a
    plan gets the rule's plan on a QK-normed model, and the sink page
    (AUTO_SINK_PAGE_TOKENS) on any other where its pool can keep one.
    hf_config may be None for a format without a plan and no explicit list."""
    from sglang.srt.mem_cache.pool_host.layer_plan import (
        KEY8_ENV,
        model_key8_layers,
        requested_key8_layers,
        text_config,
    )

    env = os.environ if env is None else env
    requested = requested_key8_layers(env)
    key8 = model_key8_layers(hf_config, requested, fmt_cls) if requested else ()
    if env.get(SINK_ENV, "").strip():
        tokens = requested_sink_page_tokens(env)
        return HostPlan(key8, tokens, f"{SINK_ENV}={tokens} as set")
    if not fmt_cls.key8_plan:
        return HostPlan(key8, 0, f"{fmt_cls.name} takes no plan; {SINK_ENV} unset")
    if requested != "auto":
        # The operator chose the plan (none included): no sink page behind it.
        return HostPlan(key8, 0, f"{KEY8_ENV} as set, {SINK_ENV} unset")
    model_type = text_config(hf_config).model_type
    if key8:
        return HostPlan(key8, 0, f"{model_type} is QK-normed ({KEY8_ENV}=auto)")
    off = _auto_sink_off(fmt_cls, page_size, device_dtype)
    if off:
        return HostPlan(
            (), 0, f"{model_type} is not QK-normed, but no sink page: {off}"
        )
    return HostPlan(
        (),
        AUTO_SINK_PAGE_TOKENS,
        f"{model_type} is not QK-normed ({KEY8_ENV}=auto, {SINK_ENV} unset)",
    )


def assembler_host_plan(
    host_dtype: str,
    start_layer: int,
    layer_num: int,
    page_size: int,
    device_dtype,
    layer_mapping: dict[int, int] | None = None,
) -> dict:
    """The encoded MHA host pool's keywords of host_plan for the running
    server's model (its HF config, no weights): sink_page_tokens and
    key8_layers (the pool's layer ids), for the hybrid pool assembler."""
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
    from sglang.srt.mem_cache.pool_host.layer_plan import (
        requested_key8_layers,
        to_pool_layers,
    )
    from sglang.srt.runtime_context import process_model_config

    fmt_cls = host_format_cls(host_dtype, "mha")
    requested = requested_key8_layers()
    hf_config = None
    if fmt_cls.key8_plan or requested not in ("auto", ()):
        hf_config = process_model_config().hf_config
    plan = host_plan(fmt_cls, hf_config, page_size=page_size, device_dtype=device_dtype)
    local = to_pool_layers(plan.key8_layers, start_layer, layer_num, layer_mapping)
    if fmt_cls.key8_plan or plan.key8_layers:
        logger.info(
            "HiCache host KV plan: %s; this host pool's 8-bit key layers %s of %d "
            "(its bytes per token follow).",
            plan.describe(host_dtype),
            list(local),
            layer_num,
        )
    return dict(sink_page_tokens=plan.sink_page_tokens, key8_layers=local)


def check_sink_page_args(server_args: Any) -> None:
    """SGLANG_HICACHE_SINK_PAGE_TOKENS against the host dtype and the model, at
    start-up (hicache_hook): what the pool would refuse once built, or ignore
    (the stock and the MLA host pools have no sink page)."""
    from sglang.srt.arg_groups.hicache_host_checks import (
        _FP8_KV_CACHE_DTYPES,
        architecture,
        checkpoint_kv_cache_quant_algo,
    )
    from sglang.srt.arg_groups.overrides import (
        model_config_of,
        resolving_view,
        use_mla_backend,
    )
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    tokens = requested_sink_page_tokens()
    if not tokens:
        return
    cfg = resolving_view(server_args)
    if cfg.hicache_host_dtype == "auto":
        able = " or ".join(sink_page_host_dtypes())
        raise ValueError(
            f"{SINK_ENV} keeps the sink page's keys at 8 bits inside "
            f"--hicache-host-dtype {able}; --hicache-host-dtype auto stores "
            f"the device KV as it is. Pass --hicache-host-dtype {able}, or "
            f"unset {SINK_ENV}."
        )
    model_config = model_config_of(server_args)
    if use_mla_backend(server_args):
        raise ValueError(
            f"{SINK_ENV}: the MLA host pool (--hicache-host-dtype "
            f"{cfg.hicache_host_dtype}, {architecture(model_config)}) has no "
            "sink page; it is kept by the MHA 4-bit formats "
            f"({', '.join(sink_page_host_dtypes())}). Unset {SINK_ENV}."
        )
    fmt_cls = host_format_cls(cfg.hicache_host_dtype, "mha")
    check_sink_page_format(fmt_cls, cfg.hicache_host_dtype)
    fp8_kv = cfg.kv_cache_dtype in _FP8_KV_CACHE_DTYPES or (
        cfg.kv_cache_dtype == "auto"
        and checkpoint_kv_cache_quant_algo(model_config) == "FP8"
    )
    if fp8_kv:
        declared = " (the checkpoint declares FP8 KV)" * (cfg.kv_cache_dtype == "auto")
        raise ValueError(
            f"{SINK_ENV}: the 8-bit sink page stores BF16/FP16 device KV, not the "
            f"FP8 KV of --kv-cache-dtype {cfg.kv_cache_dtype}{declared}. Unset "
            f"{SINK_ENV} or pass --kv-cache-dtype bf16."
        )
    check_sink_page_size(tokens, cfg.page_size or 1)


def sink_page_host_dtypes() -> list[str]:
    """The --hicache-host-dtype values whose MHA format keeps a sink page
    (imports their codecs: refusals only)."""
    from sglang.srt.mem_cache.pool_host.host_format import (
        HOST_DTYPES,
        host_format_cls,
    )

    return [
        n
        for n, e in HOST_DTYPES.items()
        if e.mha_format and host_format_cls(n, "mha").sink_page
    ]


def check_sink_page_format(fmt_cls, name: str) -> None:
    """Refuses a host format that does not declare the sink page (start-up
    and pool alike)."""
    if fmt_cls.sink_page:
        return
    able = sink_page_host_dtypes()
    raise ValueError(
        f"{SINK_ENV} keeps the sink page's keys at 8 bits inside the formats "
        f"that store keys at 4 bits ({', '.join(able)}); --hicache-host-dtype "
        f"{name} does not. Unset {SINK_ENV} or pass --hicache-host-dtype "
        f"{' or '.join(able)}."
    )


def check_sink_page_size(tokens: int, page_size: int) -> None:
    if tokens < page_size:
        raise ValueError(
            f"{SINK_ENV}={tokens} must be at least the page size ({page_size}): "
            "one side-store slot per that many host tokens, e.g. 4096."
        )


class Int8KeysFormat(HostKVFormat):
    """The side store's records: the int8 codec (kv_int8_codec) on the keys
    alone. Records per unit and layer: "k" int8 [ut, H, Dk], "k_scale" fp16
    [ut, H]: k8v4's key records, bit for bit."""

    name = "int8-keys"
    storage_format_tag = "int8keys-fp16scale-v1"
    sides = ("k",)

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        ut, heads = self.unit_tokens, self.head_num
        self.records = (
            HostRecord("k", (ut, heads, self.dims[0]), torch.int8),
            HostRecord("k_scale", (ut, heads), int8.SCALE_DTYPE),
        )

    def encode_reference(self, rows):
        q, scale = int8.quantize_reference(rows[0])
        return {"k": q, "k_scale": scale}

    def decode_reference(self, records, dtype):
        return (int8.dequantize_reference(records["k"], records["k_scale"], dtype),)

    def encode_into(self, rows, out) -> EncodeStats:
        scale = out["k_scale"]
        amax = int8.quantize_into(rows[0], out["k"], scale)
        # Rows stored as NaN do not count towards the running amax.
        amax = torch.where(torch.isfinite(scale), amax, 0.0).amax()
        return EncodeStats(amax.view(1), int8.count_nonfinite_rows(scale))

    def decode_into(self, records, out) -> None:
        int8.dequantize_into(records["k"], records["k_scale"], out[0])

    def error_bound(self, records, restored):
        return (int8.error_bound(records["k_scale"], restored[0]),)

    def zero_copy_objects(self):
        return [[(r.name, 0, r.nbytes) for r in self.records]]


def sink_format(fmt, page_size: int) -> Int8KeysFormat:
    """The side store's format: one unit per page of the pool's key geometry."""
    return Int8KeysFormat(fmt.dims[:1], fmt.head_num, page_size, fmt.device_dtype)


def slot_bytes(fmt, page_size: int) -> int:
    """Host bytes of one side-store slot, per layer."""
    return sink_format(fmt, page_size).unit_bytes()


def _upload(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Through pinned memory on CUDA: a pageable upload would wait for the stream.
    if device.type == "cuda":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


class SinkPageStore:
    """The side store and the host-page -> slot map, a collaborator of the
    pool; its records move with a TorchTransfer of their own context (the
    pool's device buffers, the store's records, planner, staging, counters).

    The keys move on the torch path on every transfer device: the int8 fused
    kernels encode and decode K and V together (no keys-only launch without a
    kernel change), and a sequence has one sink page of keys to move. L3 I/O
    is the controller's: the store hands it objects and takes bytes back."""

    def __init__(
        self,
        pool_ctx: TransferContext,
        page_size: int,
        page_num: int,
        host_size: int,
        tokens_per_slot: int,
        alloc,
        dtype: torch.dtype,
    ):
        fmt, dev = pool_ctx.fmt, pool_ctx.device
        self.page_size, self.page_num = page_size, page_num
        self.tokens_per_slot = tokens_per_slot
        self.pool_format_name = fmt.name
        # The pool's host indices are checked by the pool's planner.
        self._check_host_indices = pool_ctx.planner.check
        self.host_format = sink_format(fmt, page_size)
        self.slots = min(page_num, max(1, -(-host_size // tokens_per_slot)))
        self.records = HostRecords(
            self.host_format, self.slots, pool_ctx.layer_num, True, alloc
        )
        staging_units = min(max(1, STAGING_TOKENS // page_size), self.slots)
        planner = UnitPlanner(
            f"{fmt.name} sink page", self.slots * page_size, page_size,
            staging_units, dev,
        )  # fmt: skip
        # Kept apart from the pool's: the pool's count the 4-bit copy of every page.
        counters = HostKVCounters(pool_ctx.layer_num, 1, dev)
        self.transfer = TorchTransfer(
            TransferContext(
                self.host_format,
                self.records,
                planner,
                StagingBuffers(self.host_format, staging_units, dtype, dev),
                counters,
                pool_ctx.device_buffers,
                pool_ctx.layer_num,
                dev,
            )  # fmt: skip
        )
        # A slot in L3: the int8 keys' own tag, geometry and seal (page_first:
        # one object per slot, every record in order), bound to its own key.
        self.l3 = L3PageCodec(
            self.host_format, self.records, page_size, pool_ctx.layer_num,
            "page_first", alloc,
        )  # fmt: skip
        self._split_cache = None
        self.kept_4bit = 0
        # Sink objects handed to L3 with their pages, sink pages prefetched
        # from L3 with their 8-bit keys, and those that came back 4-bit
        # because the store was full (refusals: self.l3.stats).
        self.l3_stored = 0
        self.l3_restored = 0
        self.l3_full = 0
        self.clear()

    def log_setup(self, pool_label: str) -> None:
        logger.info(
            "HiCache %s sink page: the keys of each sequence's first page at "
            "8 bits (int8 records) in %d slots, one per %d host tokens (%s=%d), "
            "%s; L3 pages stay %s (copy-mode backends such as file: plus one "
            "int8-keys object per sink page).",
            pool_label,
            self.slots,
            self.tokens_per_slot,
            SINK_ENV,
            self.tokens_per_slot,
            readable_bytes(self.nbytes()),
            self.pool_format_name,
        )

    def clear(self) -> None:
        self.slot_of_page = torch.full((self.page_num,), -1, dtype=torch.int64)
        self.free_slots = list(range(self.slots - 1, -1, -1))
        self._split_cache = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.records.tensors.values())

    def counts(self) -> dict:
        """Sink pages held at 8 bits now, slots, and first pages kept 4-bit
        because the store was full."""
        return {
            "stored": self.slots - len(self.free_slots),
            "slots": self.slots,
            "kept_4bit": self.kept_4bit,
            "l3": {
                "stored": self.l3_stored,
                "restored": self.l3_restored,
                "full": self.l3_full,
                "refused": self.l3.stats.counts(),
            },
        }

    # -- which pages -------------------------------------------------------

    def _first_unit(self, host_indices: torch.Tensor) -> int | None:
        """The host page of host_indices' first page, if it is one whole page."""
        page = self.page_size
        first = host_indices[:page].to("cpu", torch.int64)
        if len(first) < page or int(first[0]) % page:
            return None
        if not torch.equal(first, torch.arange(int(first[0]), int(first[0]) + page)):
            return None
        return int(first[0]) // page

    def mark(self, host_indices: torch.Tensor) -> bool:
        """Give the first page of host_indices a slot; False if it stays 4-bit."""
        unit = self._first_unit(host_indices)
        if unit is None:
            return False
        if self.slot_of_page[unit] >= 0:
            return True
        slot = self._take_slot()
        if slot is None:
            self.kept_4bit += 1
            return False
        self._assign(unit, slot)
        return True

    def _take_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def _assign(self, unit: int, slot: int) -> None:
        self.slot_of_page[unit] = slot
        self._split_cache = None

    def release(self, indices: torch.Tensor) -> None:
        """Freed host tokens: their pages' slots go back to the store."""
        if len(self.free_slots) == self.slots or not indices.numel():
            return
        units = torch.unique(indices.to("cpu", torch.int64) // self.page_size)
        slots = self.slot_of_page[units]
        held = slots >= 0
        if bool(held.any()):
            self.free_slots.extend(slots[held].tolist())
            self.slot_of_page[units[held]] = -1
            self._split_cache = None

    def _split(self, host_indices, device_indices):
        """(side-store host, sink device) indices of a transfer's marked
        tokens, or None if it holds none. Loads pass the same tensors for
        every layer, so the last split is kept."""
        if len(self.free_slots) == self.slots:
            return None
        key = (id(host_indices), host_indices._version,
               id(device_indices), device_indices._version)  # fmt: skip
        cache = self._split_cache
        if cache is not None and cache[0] == key:
            return cache[2]
        host = host_indices.to("cpu", torch.int64)
        self._check_host_indices(host)
        slot = self.slot_of_page[host // self.page_size]
        sink = slot >= 0
        split = None
        if bool(sink.any()):
            pos = sink.nonzero().squeeze(1)
            split = (
                slot[pos] * self.page_size + host[pos] % self.page_size,
                device_indices[_upload(pos, device_indices.device)],
            )
        # The originals stay referenced, so their ids stay unique while cached.
        self._split_cache = (key, (host_indices, device_indices), split)
        return split

    # -- transfers ---------------------------------------------------------

    def backup(self, host_indices, device_indices) -> None:
        """After the pool's 4-bit backup: the marked pages' keys, at 8 bits."""
        split = self._split(host_indices, device_indices)
        if split is not None:
            self.transfer.backup(*split)

    def load(self, host_indices, device_indices, layer_id: int) -> None:
        """One layer, after the pool restored every token at 4 bits: the
        marked tokens' keys again from the side store, on the same stream."""
        split = self._split(host_indices, device_indices)
        if split is not None:
            self.transfer.load(*split, layer_id)

    # -- L3 ------------------------------------------------------------------

    def l3_objects(self, keys, host_indices) -> list[tuple[str, torch.Tensor]]:
        """(key, sealed object) of the 8-bit keys of the marked pages among
        these L3 pages (keys[i]: the page at host_indices[i * page_size])."""
        if len(self.free_slots) == self.slots:
            return []
        pages = host_indices[:: self.page_size].to("cpu", torch.int64)
        slots = self.slot_of_page[pages // self.page_size].tolist()
        objects = [
            (
                key + L3_KEY_SUFFIX,
                self.l3.read(slot * self.page_size, key + L3_KEY_SUFFIX),
            )
            for key, slot in zip(keys, slots)
            if slot >= 0
        ]
        self.l3_stored += len(objects)
        return objects

    def l3_request(self, key: str, host_indices):
        """(side key, destination) of the 8-bit keys' object to get for the
        4-bit page at host_indices, prefetched from L3 under `key`; None if
        the page needs none or the store is full (it stays 4-bit)."""
        unit = self._first_unit(host_indices)
        if unit is None or self.slot_of_page[unit] >= 0:
            return None
        if not self.free_slots:
            self.l3_full += 1
            return None
        dst = torch.empty(self.l3.page_bytes + integrity.SEAL_BYTES, dtype=torch.uint8)
        return key + L3_KEY_SUFFIX, dst

    def l3_restore(self, side_key: str, host_indices, data) -> None:
        """The bytes the controller got for l3_request's side key (None: the
        get missed or failed) into a slot, once they verify."""
        if data is None:
            self.l3.note_missing(side_key)
            return
        unit = self._first_unit(host_indices)
        if unit is None or self.slot_of_page[unit] >= 0:
            return
        slot = self._take_slot()
        if slot is None:
            self.l3_full += 1
            return
        try:
            self.l3.write(slot * self.page_size, data, side_key)
        except integrity.StoragePageRefused:
            self.free_slots.append(slot)
            return
        self._assign(unit, slot)
        self.l3_restored += 1
