"""Host (L2) KV formats for HiCache: how one unit of KV is encoded on the host.

A format (--hicache-host-dtype) owns all value math: which host tensors
("records") it stores per unit and layer, how device rows become records and
back, its error bound and its fused kernels. It never sees indices, layouts or
staging; the quantized host pools (pool_host/quantized.py) handle those once
for every format.

A unit is what one host index range addresses per layer: a page for the
page-major layouts (page_first, page_first_direct), a token for layer_first.
Each record is stored as one host tensor of shape (units, layers, *shape)
page-major or (layers, units, *shape) layer_first.

Adding a format is one module defining a HostKVFormat subclass, one line in
_FORMAT_CLASSES below, and its tests.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import torch


@dataclass(frozen=True)
class HostRecord:
    """One host tensor of a format.

    `shape` is per unit and per layer; its dtype's bytes times the shape's
    elements are what one unit of one layer takes on the host.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

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
        # Order = byte order of a generic L3 page object.
        self.records: tuple[HostRecord, ...] = ()

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

    @classmethod
    def bytes_per_token_for(
        cls,
        dims: tuple[int, ...],
        head_num: int,
        unit_tokens: int,
        device_dtype: torch.dtype = torch.bfloat16,
    ) -> float:
        """bytes_per_token() of a pool that is not built yet (auto-sizing)."""
        return cls(dims, head_num, unit_tokens, device_dtype).bytes_per_token()

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
        (bf16/fp16; fp32 accepted). Returns every record as [n_units, *shape]."""
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
        """Elementwise fp32 bound on |x - x^| per side, for bf16/fp16 input."""
        raise NotImplementedError

    # -- fused kernels (Triton); the format forwards to its kernel module ----

    def fused_available(self, device: torch.device) -> bool:
        """Whether encode_gather/decode_scatter can run for this transfer device."""
        return False

    def encode_gather(
        self,
        tables: Sequence,
        device_indices: torch.Tensor,
        out: Mapping[str, torch.Tensor],
        host_indices: torch.Tensor,
        *,
        nonfinite_counter: torch.Tensor | None = None,
        scale_amax: torch.Tensor | None = None,
        bad_index_counter: torch.Tensor | None = None,
    ) -> None:
        """Backup in one launch: tables[i] (a DeviceLayerTable of sides[i], all
        layers) rows device_indices -> records at host_indices.

        out[name] is a [unit, layer, *shape] view; scale_amax is fp32
        [layers, len(sides)]. A host index outside the records is skipped and
        counted in bad_index_counter.
        """
        raise NotImplementedError

    def decode_scatter(
        self,
        records: Mapping[str, torch.Tensor],
        host_indices: torch.Tensor,
        dst: Sequence[torch.Tensor],
        device_indices: torch.Tensor,
        *,
        bad_index_counter: torch.Tensor | None = None,
    ) -> None:
        """Restore one layer in one launch: records[name] ([unit, *shape] views
        of that layer) at host_indices -> dst[i][device_indices]."""
        raise NotImplementedError

    # -- L3 zero-copy storage ----------------------------------------------

    def zero_copy_objects(self) -> list[list[tuple[str, int, int]]]:
        """Per storage object of a page, its pieces (record name, byte offset
        within one layer's record of a unit, nbytes). Every object has as
        many pieces, and together they cover every record byte once. A page's
        piece is the same share of the page's block of all layers, so the
        pool multiplies offsets and sizes by the layer count."""
        raise NotImplementedError


# --hicache-host-dtype -> (module, class) of its format, imported on first use
# so a format's kernels and codec load only when selected.
_FORMAT_CLASSES: dict[str, tuple[str, str]] = {
    "int8": ("sglang.srt.mem_cache.pool_host.kv_int8_codec", "Int8HostFormat"),
    "int4": ("sglang.srt.mem_cache.pool_host.kv_int4_codec", "Int4HostFormat"),
    "k8v4": ("sglang.srt.mem_cache.pool_host.kv_int4_codec", "K8V4HostFormat"),
    "int4r": ("sglang.srt.mem_cache.pool_host.kv_int4_rot_codec", "Int4RotHostFormat"),
    "k8v4r": ("sglang.srt.mem_cache.pool_host.kv_k8v4_rot_codec", "K8V4RotHostFormat"),
}

HOST_FORMATS: dict[str, type[HostKVFormat]] = {}


def host_format_names() -> tuple[str, ...]:
    return tuple(_FORMAT_CLASSES)


def host_format_cls(name: str) -> type[HostKVFormat]:
    """The format class of a --hicache-host-dtype value."""
    if name in HOST_FORMATS:
        return HOST_FORMATS[name]
    if name not in _FORMAT_CLASSES:
        raise ValueError(
            f"--hicache-host-dtype {name!r} is not a host KV format; known: "
            f"{', '.join(_FORMAT_CLASSES)}"
        )
    module_name, class_name = _FORMAT_CLASSES[name]
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            f"--hicache-host-dtype {name} is not available in this build "
            f"({module_name}.{class_name}: {e})."
        ) from e
    HOST_FORMATS[name] = cls
    return cls
