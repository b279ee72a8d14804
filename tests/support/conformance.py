"""The conformance grid: every --hicache-host-dtype value of the registry (and the toy
format) as a case, and the reference a pool must restore bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import host_format as hf
from tests.support import copy_format as toy
from scripts.rigs.hicache_harness import (  # noqa: F401 (LAYOUTS, the grids: API)
    GEOMETRIES,
    KERNEL_POOL_CASES,
    LAYOUTS,
    Geometry,
    MLAGeometry,
)

IO_BACKENDS = ("direct", "kernel")
PAGE_SIZES = (1, 16, 64)


def heads_geometry(geometry, page_size: int, layer_num: int = 2) -> Geometry:
    """The two-layer Geometry of a (head_num, head_dim, v_head_dim) row of
    GEOMETRIES."""
    head_num, head_dim, v_head_dim = geometry
    return Geometry(
        layer_num=layer_num,
        head_num=head_num,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        page_size=page_size,
    )


# A format's L3 page size where 16 would leave a key grouping out: int8c's keys
# go per channel from 64-token units (layer_first's token units stay per token).
L3_PAGE_SIZES = {"int8c": 64}

STOCK = "auto"
TOY = toy.ENTRY.name


@dataclass(frozen=True)
class FormatCase:
    host_dtype: str  # a --hicache-host-dtype value; "auto" is the stock pool
    kind: str  # "mha" or "mla"

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.host_dtype}"

    @property
    def stock(self) -> bool:
        return self.host_dtype == STOCK

    @property
    def toy(self) -> bool:
        return self.host_dtype == TOY

    def format_cls(self):
        if self.toy:
            return toy.CopyHostFormat
        return hf.host_format_cls(self.host_dtype, self.kind)

    def host_format(self, page_size: int = 16, layout: str = "page_first"):
        """The format instance of the case's pool at this page size and layout."""
        geo = self.geometry(page_size)
        if self.kind == "mla":
            dims, heads = (geo.kv_lora_rank + geo.qk_rope_head_dim,), 1
        else:
            dims, heads = (geo.head_dim, geo.v_head_dim), geo.head_num
        ut = 1 if layout == "layer_first" else page_size
        return self.format_cls()(dims, heads, ut, geo.dtype)

    def has_fused_kernels(self) -> bool:
        """Whether the format's fused kernels run on CPU tensors here (under Triton's
        interpreter, tests/conftest.py)."""
        if self.stock:
            return False
        return self.host_format().fused_available(torch.device("cpu"))

    def storage_tag(self, layout: str, page_size: int) -> str:
        """The pool's L3 storage tag: int4 and int8c tag their key grouping, per channel
        on page-major units of enough tokens, else per token."""
        return self.host_format(page_size, layout).storage_format_tag

    def geometry(self, page_size: int, dtype=torch.bfloat16, layer_num: int = 2):
        if self.kind == "mla":
            return MLAGeometry(layer_num=layer_num, dtype=dtype, page_size=page_size)
        # K != V widths, except for the stock pool: it refuses layer_first
        # for them.
        return Geometry(
            layer_num=layer_num,
            head_num=2,
            head_dim=64,
            v_head_dim=None if self.stock else 32,
            dtype=dtype,
            page_size=page_size,
        )


def format_cases(*, stock: bool = True, kinds=("mha", "mla")) -> list[FormatCase]:
    """The stock control, every registered value per model kind it supports, then the
    toy format (registered by the toy_host_format fixture)."""
    cases = []
    for kind in kinds:
        if stock:
            cases.append(FormatCase(STOCK, kind))
        for name, entry in hf.HOST_DTYPES.items():
            if name != TOY and getattr(entry, f"{kind}_format") is not None:
                cases.append(FormatCase(name, kind))
        if getattr(toy.ENTRY, f"{kind}_format") is not None:
            cases.append(FormatCase(TOY, kind))
    return cases


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so NaNs and signed zeros compare exactly."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def side_buffers(device_pool) -> list[list[torch.Tensor]]:
    """The device buffers per side (MHA: K, V; MLA: the latent), each a list over
    layers."""
    if isinstance(device_pool, MLATokenToKVPool):
        return [device_pool.kv_buffer]
    return [device_pool.k_buffer, device_pool.v_buffer]


def rows_at(device_pool, indices: torch.Tensor) -> list[list[torch.Tensor]]:
    """[layer][side] copies of the device rows at `indices`."""
    sides = side_buffers(device_pool)
    # FP8 KV is stored as uint8: its rows, as the dtype they hold.
    return [
        [side[layer][indices].view(device_pool.dtype).clone() for side in sides]
        for layer in range(device_pool.layer_num)
    ]


def unit_tokens(pool) -> int:
    return 1 if pool.layout == "layer_first" else pool.page_size


def reference(pool, rows: list[torch.Tensor]):
    """(records, restored) the pool's format gives for one layer's rows per side,
    written in host order; records is None for the stock pool."""
    fmt = getattr(pool, "host_format", None)
    if fmt is None:
        return None, [r.clone() for r in rows]
    ut = unit_tokens(pool)
    units = [r.view(r.shape[0] // ut, ut, *r.shape[1:]) for r in rows]
    records = fmt.encode_reference(units)
    restored = fmt.decode_reference(records, rows[0].dtype)
    return records, [x.reshape(r.shape) for x, r in zip(restored, rows)]


def error_bounds(pool, records, restored: list[torch.Tensor]) -> list[torch.Tensor]:
    """The format's elementwise bound on |x - x^| per side, shaped like the rows."""
    ut = unit_tokens(pool)
    units = [r.view(r.shape[0] // ut, ut, *r.shape[1:]) for r in restored]
    bounds = pool.host_format.error_bound(records, units)
    return [b.reshape(r.shape) for b, r in zip(bounds, restored)]


def host_units(pool, host_indices: torch.Tensor) -> torch.Tensor:
    ut = unit_tokens(pool)
    return host_indices[::ut] // ut


def host_unit_records(pool, layer: int, units: torch.Tensor) -> dict:
    """Each record of `units` of `layer`, read from the documented layouts: page-major
    [unit, layer, *shape], layer_first [layer, unit, *shape]."""
    page_major = pool.layout != "layer_first"
    return {
        name: buf[units, layer] if page_major else buf[layer, units]
        for name, buf in pool.host_records.items()
    }


def spread(device_pool, indices: torch.Tensor, seed: int) -> None:
    """Random rows at `indices` of every layer with the ranges real KV has: channels 20x
    the rest (key outliers), an offset side, tiny and large tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = len(indices)
    token_gain = torch.logspace(-6, 4, n, base=2.0)[torch.randperm(n, generator=gen)]
    for s, side in enumerate(side_buffers(device_pool)):
        for layer in range(device_pool.layer_num):
            buf = side[layer]
            x = torch.randn((n, *buf.shape[1:]), generator=gen)
            x[..., ::7] *= 20.0
            x *= token_gain.view(-1, *[1] * (x.dim() - 1))
            if s == 1:
                x += 3.0
            dtype = device_pool.dtype
            if dtype != buf.dtype:  # FP8 stored as uint8: up to its largest value
                top = torch.finfo(dtype).max
                x[..., 3] = top
                buf[indices] = x.clamp(-top, top).to(dtype).view(buf.dtype)
                continue
            buf[indices] = x.to(buf.dtype)


def scrambled_host_free_list(pool, page_size: int, seed: int) -> None:
    """Leave the host pool's free slots as the radix cache leaves them after evictions:
    out of order, with runs, backward jumps and gaps."""
    taken = pool.alloc(pool.available_size())
    if page_size == 1:
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(64, generator=gen)
        pool.free(taken[order])
        return
    # A run (6 7), a backward jump (7 -> 2), a gap (2 -> 9), a descending pair.
    pages = torch.tensor([6, 7, 2, 9, 5, 4, 11, 3])
    pool.free((pages[:, None] * page_size + torch.arange(page_size)).flatten())


# --- per-format expectations ----------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What one MHA format promises beyond the round trips, one row per registered
    --hicache-host-dtype value (test_conformance.py: "expectations")."""

    # host bytes per token and layer at Qwen3-8B geometry (8 KV heads, head dim
    # 128), page_first, by page size 1, 16, 64 (BF16: 4096)
    qwen3_8b_bytes: tuple[int, int, int]
    # keys per channel from pages of this many tokens (page layouts); else per token
    keys_per_channel_from: int | None
    # what a NaN key poisons with per-channel keys: its "channel" or its "head"
    # (rotation block) over the page
    per_channel_nan: str | None
    token_nan_channels: int  # per-token keys: the NaN key's group (from channel 0)
    nonfinite_groups: tuple[int, int]  # counted for a NaN key + an Inf value: per
    # token, per channel
    fused: bool  # fused kernels (interpreted on CPU here)
    sink: bool  # takes SGLANG_HICACHE_SINK_PAGE_TOKENS (8-bit sink-page keys)
    # encodes an FP8 device KV cache, in qwen3_8b_bytes; else refuses FP8
    fp8: bool


# Page 16 is one 16-token sub-range for int4c (k_sub 4 B per channel per 16 tokens).
I4, I4C = (1152, 1344, 1152), (1120, 1376, 1152)
EXPECT = {
    "int8": Expect((2080,) * 3, None, None, 64, (2, 2), True, False, False),
    "int4": Expect(I4, 16, "channel", 64, (2, 2), True, True, True),
    "k8v4": Expect((1616,) * 3, None, None, 64, (2, 2), True, False, True),
    "int4r": Expect(I4, 16, "head", 64, (2, 65), True, True, False),
    "k8v4r": Expect((1616,) * 3, None, None, 64, (2, 2), True, False, False),
    "int8c": Expect((2128,) * 3, 64, "channel", 32, (2, 2), True, False, False),
    "int4c": Expect(I4C, 16, "channel", 64, (2, 2), True, True, False),
}
