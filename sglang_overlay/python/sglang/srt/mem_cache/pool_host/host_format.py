"""Host (L2) KV formats for HiCache: how one unit of KV is encoded on the host.

A format (--hicache-host-dtype) owns all value math: which host tensors
("records") it stores per unit and layer, how device rows become records and
back, its error bound and its fused kernels. It never sees indices, layouts or
staging; the encoded host pools (pool_host/encoded.py) handle those once for
every format.

A unit is what one host index range addresses per layer: a page for the
page-major layouts (page_first, page_first_direct), a token for layer_first.
Each record is stored as one host tensor of shape (units, layers, *shape)
page-major or (layers, units, *shape) layer_first.

Adding a format is one module defining a HostKVFormat subclass and one
register_host_dtype() entry below (HOST_DTYPES): the flag's choices and
validation, the pool dispatch, auto-sizing and the tools all read it.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import torch

# FP8 device KV (--kv-cache-dtype fp8_e4m3/fp8_e5m2), stored by the device pool
# as uint8 (memory_pool.py's store_dtype); formats with fp8_device_kv encode it.
FP8_DEVICE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def unit_tokens_for(page_size: int, layout: str) -> int:
    """Tokens per host unit: a page for the page-major layouts, a token for
    layer_first."""
    return 1 if layout == "layer_first" else page_size


# --- error-bound arithmetic the formats share ---------------------------------

# (significant bits, exponent of the smallest normal) of each float format.
_FLOAT_FORMATS = {
    torch.bfloat16: (8, -126),
    torch.float16: (11, -14),
    torch.float32: (24, -126),
    torch.float8_e4m3fn: (4, -6),
    torch.float8_e5m2: (3, -14),
}


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a unit in the last place of ``dtype`` at |values| (fp32 values),
    as an exact fp32 power of two; 2**-149 where it would be smaller, Inf at
    Inf, NaN at NaN."""
    bits, emin = _FLOAT_FORMATS[dtype]
    r = values.to(torch.float32).abs()
    # |r| = f * 2**k with f in [0.5, 1): binade exponent k - 1; clamping to the
    # smallest normal gives zero and subnormals the subnormal spacing.
    exp = torch.frexp(r.clamp_min(2.0**emin)).exponent - 1
    # fp32's own half ulp at the bottom (2**-150) isn't representable; 2**-149
    # still bounds it (the upper clamp keeps Inf/NaN lanes from overflowing).
    e = (exp - bits).clamp_(-149, 127)
    # 2**e from its bits (exact, unlike pow): normal or subnormal fp32.
    normal = (e + 127).clamp_min_(1).bitwise_left_shift_(23)
    subnormal = torch.ones_like(e).bitwise_left_shift_((e + 149).clamp_max_(22))
    out = torch.where(e >= -126, normal, subnormal).view(torch.float32)
    out = torch.where(torch.isinf(r), r, out)
    return torch.where(torch.isnan(r), r, out)


def add_round_up(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for a, b >= 0 in fp32, rounded up (Fast2Sum finds the lost part),
    so a bound never undercuts its real-valued formula."""
    big, small = torch.maximum(a, b), torch.minimum(a, b)
    total = big + small
    lost = small - (total - big)
    return torch.where(
        lost > 0, (total.view(torch.int32) + 1).view(torch.float32), total
    )


@dataclass(frozen=True)
class HostRecord:
    """One host tensor of a format.

    `shape` is per unit and per layer; its dtype's bytes times the shape's
    elements are what one unit of one layer takes on the host.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # The layer ids it is stored for; None: every layer (a format's per-layer
    # plan stores some records on a few layers only).
    layers: tuple[int, ...] | None = None

    def stored_on(self, layer_id: int) -> bool:
        return self.layers is None or layer_id in self.layers

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class EncodeStats:
    """What an encode saw, as device tensors (reading them would sync).

    amax: fp32 [len(sides)], the largest max |x| over the groups stored
        finite, 0 if none.
    nonfinite: 0-dim int64, the groups stored as non-finite (they restore as
        NaN).
    """

    amax: torch.Tensor
    nonfinite: torch.Tensor


class HostKVFormat:
    """One encoding of the host KV copy; one instance per pool.

    Geometry is fixed at construction: `dims[i]` is the per-head width of
    device side `sides[i]` (MHA: (head_dim, v_head_dim); MLA: (kv_lora_rank +
    qk_rope_head_dim,)), `head_num` the heads per side and `unit_tokens` the
    tokens per host unit. Subclasses set the class attributes, fill
    `self.records` in __init__ (raising NotImplementedError naming
    --hicache-host-dtype for geometries they cannot encode) and implement the
    methods below. The reference encode/decode define the format: the fast
    torch path and the fused kernels must match them bit for bit.
    """

    # The --hicache-host-dtype value.
    name: ClassVar[str]
    # Names this byte format in L3 storage keys, so pages of another format miss.
    storage_format_tag: ClassVar[str]
    # Device tensors per layer the format encodes, e.g. ("k", "v") or ("kv",).
    sides: ClassVar[tuple[str, ...]]
    # Whether it encodes an FP8 device KV cache (device_dtype float8_e4m3fn or
    # float8_e5m2, the element dtype the device pool stores as uint8).
    fp8_device_kv: ClassVar[bool] = False
    # The module of its fused Triton kernels (encode_gather/decode_scatter and
    # available), imported on first use; None: torch path only.
    kernel_module: ClassVar[str | None] = None
    # Whether the format can keep a sequence's first page's keys at 8 bits in
    # a side store (sink_page.py, SGLANG_HICACHE_SINK_PAGE_TOKENS): formats
    # whose keys are 4-bit.
    sink_page: ClassVar[bool] = False
    # Upper bound on a backed-up page's relative restore error, max |x - x^| /
    # max |x| in fp32 (backup_verify.py), derived from error_bound() in
    # docs/operations.md; the HiCacheHostKVRestoreError alert reads it.
    relative_error_threshold: ClassVar[float | None] = None
    # Whether the format takes key8_layers, a per-layer plan of 8-bit keys
    # (SGLANG_HICACHE_KEY8_LAYERS, layer_plan.py): a constructor keyword whose
    # layers store one more key record (HostRecord.layers).
    key8_plan: ClassVar[bool] = False

    def __init__(
        self,
        dims: tuple[int, ...],
        head_num: int,
        unit_tokens: int,
        device_dtype: torch.dtype,
    ):
        if len(dims) != len(self.sides):
            raise ValueError(
                f"--hicache-host-dtype {self.name} encodes sides {self.sides}; "
                f"got {len(dims)} widths {tuple(dims)}"
            )
        self.dims = tuple(int(d) for d in dims)
        self.head_num = int(head_num)
        self.unit_tokens = int(unit_tokens)
        self.device_dtype = device_dtype
        # Per side, the Hadamard block the encoder rotates rows in; 0: none
        # (the rotated formats set theirs, kv_hadamard.py).
        self.rotation_blocks: tuple[int, ...] = (0,) * len(self.sides)
        # Order = byte order of a generic L3 page object.
        self.records: tuple[HostRecord, ...] = ()

    def for_layer(self, layer_id: int) -> HostKVFormat:
        """The format of one layer: its records are those stored on that layer
        and its encode/decode that layer's math. Formats without a per-layer
        plan are the same on every layer."""
        return self

    def record(self, name: str) -> HostRecord:
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(f"--hicache-host-dtype {self.name} has no record {name!r}")

    def unit_bytes(self) -> int:
        """Host bytes of one unit of one layer, all records."""
        return sum(record.nbytes for record in self.records)

    def bytes_per_token(self) -> float:
        """Host bytes per token and layer, all records."""
        return self.unit_bytes() / self.unit_tokens

    @property
    def planned(self) -> bool:
        """Whether some record is stored on a few layers only."""
        return any(record.layers is not None for record in self.records)

    def layers_unit_bytes(self, layer_num: int) -> int:
        """Host bytes of one unit of layers 0 .. layer_num - 1, each record
        counted on the layers it is stored for."""
        total = 0
        for record in self.records:
            if record.layers is None:
                total += record.nbytes * layer_num
            else:
                total += record.nbytes * sum(1 for i in record.layers if i < layer_num)
        return total

    def describe_plan(self) -> str:
        """The records stored on a few layers only, for the start-up log;
        "" without a plan."""
        return "; ".join(
            f"{r.name} on layers {list(r.layers)}"
            for r in self.records
            if r.layers is not None
        )

    @classmethod
    def bytes_per_token_for(
        cls,
        dims: tuple[int, ...],
        head_num: int,
        unit_tokens: int,
        device_dtype: torch.dtype = torch.bfloat16,
        **geometry,
    ) -> float:
        """bytes_per_token() of a pool that is not built yet (auto-sizing);
        geometry: the format's own constructor keywords (MLA's rope_dim)."""
        return cls(
            dims, head_num, unit_tokens, device_dtype, **geometry
        ).bytes_per_token()

    def describe(self) -> str:
        """One start-up log line: the records and any grouping fallback."""
        parts = ", ".join(
            f"{r.name} {str(r.dtype).removeprefix('torch.')}{list(r.shape)}"
            for r in self.records
        )
        return f"{self.name} ({self.storage_format_tag}): {parts} per unit"

    # -- torch reference: step by step, defines the format ------------------

    def encode_reference(self, rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """rows[i]: [n_units, unit_tokens, head_num, dims[i]] of sides[i]
        (bf16/fp16, FP8 where fp8_device_kv; fp32 accepted). Returns every
        record as [n_units, *shape]."""
        raise NotImplementedError

    def decode_reference(
        self, records: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        """Records [n_units, *shape] -> one tensor per side, like rows[i]."""
        raise NotImplementedError

    # -- fast torch path: in place, no host sync ----------------------------

    def encode_into(
        self, rows: Sequence[torch.Tensor], out: Mapping[str, torch.Tensor]
    ) -> EncodeStats:
        """encode_reference's bytes into out[name] ([n_units, *shape] views)."""
        raise NotImplementedError

    def decode_into(
        self, records: Mapping[str, torch.Tensor], out: Sequence[torch.Tensor]
    ) -> None:
        """decode_reference's values into out[i] (shaped like rows[i])."""
        raise NotImplementedError

    def error_bound(
        self, records: Mapping[str, torch.Tensor], restored: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Elementwise fp32 bound on |x - x^| per side, for bf16/fp16 (or FP8)
        input."""
        raise NotImplementedError

    # -- fused kernels (Triton); the format forwards to its kernel module ----

    def _kernels(self):
        return importlib.import_module(self.kernel_module)

    def fused_available(self, device: torch.device) -> bool:
        """Whether encode_gather/decode_scatter can run for this transfer device
        (a format with fp8_device_kv and kernels has kernels that read FP8)."""
        if self.kernel_module is None:
            return False
        try:
            kernels = self._kernels()
        except ImportError:
            # Kernels not in this build: the pool keeps its torch path.
            return False
        return kernels.available(device)

    def encode_gather(self, tables, device_indices, out, host_indices, **options):
        """Backup in one launch: tables[i] (a DeviceLayerTable of sides[i], all
        layers) rows device_indices -> records at host_indices.

        out[name] is a [unit, layer, *shape] view over the layers of the
        launch (first_layer onward, all of them in one launch) that the record
        is stored on (HostRecord.layers): a planned record's view has only its
        stored layers, and a record stored on none of them is left out; the
        format's kernels map its layers. options: counters, the
        statistics to update (host_kv_common.KVCounters, or the pool's
        HostKVCounters): nonfinite and bad_indices (0-dim int64; a host index
        outside the records is skipped and counted) and amax (fp32 [layers,
        len(sides)]), each optional.
        """
        self._kernels().encode_gather(
            tables, device_indices, out, host_indices, **options
        )

    def decode_scatter(self, records, host_indices, dst, device_indices, **counters):
        """Restore one layer in one launch: records[name] ([unit, *shape] views
        of that layer) at host_indices -> dst[i][device_indices]; counters:
        bad_index_counter."""
        self._kernels().decode_scatter(
            records, host_indices, dst, device_indices, **counters
        )

    # -- L3 zero-copy storage ----------------------------------------------

    def zero_copy_objects(self) -> list[list[tuple[str, int, int]]]:
        """Per storage object of a page, its pieces (record name, byte offset
        within one layer's record of a unit, nbytes). Every object has as
        many pieces, and together they cover every record byte once. A page's
        piece is the same share of the page's block of all layers, so the
        pool multiplies offsets and sizes by the layer count."""
        raise NotImplementedError


@dataclass(frozen=True)
class HostDtype:
    """One --hicache-host-dtype value: the formats it stores per model kind."""

    name: str  # the --hicache-host-dtype value, e.g. "int8"
    mha_format: str  # "module:Class" of its HostKVFormat for MHA models
    mla_format: str | None  # the same for MLA models; None = refused for MLA
    help: str  # one line for --help and the supported matrix


# The registry, in flag order ("auto", upstream's device-dtype copy, is not in
# it). Formats import on first use, so only the selected codec and kernels load.
HOST_DTYPES: dict[str, HostDtype] = {}
MODEL_KINDS = ("mha", "mla")
# The encoded host pool of each model kind; host_pool_cls binds a format to it.
_HOST_POOLS = {
    "mha": "sglang.srt.mem_cache.pool_host.mha_encoded:MHATokenToKVPoolEncodedHost",
    "mla": "sglang.srt.mem_cache.pool_host.mla_encoded:MLATokenToKVPoolEncodedHost",
}
_format_classes: dict[tuple[str, str], type[HostKVFormat]] = {}
_pool_classes: dict[tuple[str, str], type] = {}


def register_host_dtype(entry: HostDtype) -> None:
    """Add (or replace) a --hicache-host-dtype value."""
    if entry.name == "auto" or not entry.name.isidentifier():
        raise ValueError(f"--hicache-host-dtype cannot register {entry.name!r}")
    if HOST_DTYPES.get(entry.name) == entry:
        return
    HOST_DTYPES[entry.name] = entry
    for cache in (_format_classes, _pool_classes):
        for key in [k for k in cache if k[0] == entry.name]:
            del cache[key]


def host_dtype_choices() -> list[str]:
    return ["auto", *HOST_DTYPES]


def get_host_dtype(name: str) -> HostDtype:
    if name not in HOST_DTYPES:
        raise ValueError(
            f"--hicache-host-dtype {name!r} is not a host KV format; pass one of "
            f"{', '.join(host_dtype_choices())}."
        )
    return HOST_DTYPES[name]


def _check_kind(kind: str) -> None:
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind must be one of {MODEL_KINDS}; got {kind!r}")


def _import(target: str, what: str):
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            f"--hicache-host-dtype {what} is not available in this build "
            f"({target}: {e})."
        ) from e


def host_format_cls(name: str, kind: str = "mha") -> type[HostKVFormat]:
    """The HostKVFormat class of a --hicache-host-dtype value for a model kind."""
    _check_kind(kind)
    key = (name, kind)
    if key not in _format_classes:
        target = getattr(get_host_dtype(name), f"{kind}_format")
        if target is None:
            mla = [n for n, e in HOST_DTYPES.items() if e.mla_format]
            raise NotImplementedError(
                f"--hicache-host-dtype {name} does not support MLA models; pass "
                f"one of {', '.join(['auto', *mla])}."
            )
        _format_classes[key] = _import(target, f"{name} for {kind.upper()} models")
    return _format_classes[key]


def host_pool_cls(name: str, kind: str = "mha") -> type:
    """The encoded host pool class of a --hicache-host-dtype value for a model
    kind: the kind's pool bound to the value's format (one class per pair)."""
    key = (name, kind)
    if key not in _pool_classes:
        fmt = host_format_cls(name, kind)
        base = _import(_HOST_POOLS[kind], f"{name} for {kind.upper()} models")
        prefix = "MHATokenToKVPool" if kind == "mha" else "MLATokenToKVPool"
        cls_name = f"{prefix}{name.upper()}Host"
        _pool_classes[key] = type(
            cls_name,
            (base,),
            {
                "host_format_cls": fmt,
                "__module__": base.__module__,
                "__qualname__": cls_name,
            },
        )
    return _pool_classes[key]


def fp8_host_dtypes() -> list[str]:
    """The --hicache-host-dtype values whose MHA format encodes an FP8 device
    KV cache (imports their codecs: start-up checks and refusals only)."""
    return [name for name in HOST_DTYPES if host_format_cls(name, "mha").fp8_device_kv]


_CODECS = "sglang.srt.mem_cache.pool_host"
register_host_dtype(
    HostDtype(
        "int8",
        f"{_CODECS}.kv_int8_codec:Int8HostFormat",
        f"{_CODECS}.kv_mla_int8_codec:MLAInt8HostFormat",
        "symmetric INT8 with one FP16 scale per token, layer, K|V and head "
        "(MLA: the latent in 128-value tiles with one FP16 scale each, RoPE "
        "kept in the device dtype)",
    )
)
register_host_dtype(
    HostDtype(
        "int4",
        f"{_CODECS}.kv_int4_codec:Int4HostFormat",
        None,
        "4-bit codes with an FP16 scale and zero point per group: keys per "
        "channel over a page of at least 16 tokens, else per token; values "
        "per token",
    )
)
register_host_dtype(
    HostDtype(
        "k8v4",
        f"{_CODECS}.kv_int4_codec:K8V4HostFormat",
        None,
        "INT8 keys with one FP16 scale per token, layer and head; 4-bit values "
        "with an FP16 scale and zero point per token group",
    )
)
register_host_dtype(
    HostDtype(
        "int4r",
        f"{_CODECS}.kv_int4_rot_codec:Int4RotHostFormat",
        None,
        "int4 with keys and values rotated per head (Walsh-Hadamard, seeded "
        "sign flip) before encoding: same bytes per token, closer restored KV",
    )
)
register_host_dtype(
    HostDtype(
        "k8v4r",
        f"{_CODECS}.kv_k8v4_rot_codec:K8V4RotHostFormat",
        None,
        "k8v4 with values rotated per head (Walsh-Hadamard, seeded sign flip) "
        "before encoding: same bytes per token, closer restored KV",
    )
)
register_host_dtype(
    HostDtype(
        "int8c",
        f"{_CODECS}.kv_int8c_codec:Int8ChannelHostFormat",
        None,
        "int8 values; 8-bit keys with an FP16 scale and zero point per channel "
        "over a page of at least 64 tokens, else per token in groups of 32 "
        "channels: for QK-normed models (Gemma 3, Qwen3)",
    )
)
register_host_dtype(
    HostDtype(
        "int4c",
        f"{_CODECS}.kv_int4c_codec:Int4ChannelHostFormat",
        None,
        "4-bit keys per channel in 32-token sub-ranges of an FP16 (min, range) "
        "per page, 4-bit values rotated per head: for QK-normed models (8-bit "
        "keys on plan layers; the sink page on Llama-style models)",
    )
)
