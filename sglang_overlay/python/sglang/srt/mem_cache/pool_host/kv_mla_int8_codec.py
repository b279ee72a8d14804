"""INT8 host format for MLA latent KV (--hicache-host-dtype int8 on MLA models).

An MLA layer caches one row per token: ``kv_lora_rank`` latent values followed
by ``qk_rope_head_dim`` RoPE values (512 + 64 for DeepSeek V2/V3, Kimi K2).
Following DeepSeek's own FP8 KV cache, the latent part is quantized in tiles of
``TILE`` = 128 values, each with its own scale, and the RoPE part is kept in
the device dtype bit for bit: RoPE values carry the positional phase that
attention scores depend on directly, and they are only 64 of 576 values.

Each tile is encoded with kv_int8_codec's exact math (symmetric INT8, the FP16
scale ``amax / 127`` rounded up, NaN policy and saturation). Per token and
layer the host stores three records:

    "kv"     int8         [unit_tokens, 1, kv_lora_rank]
    "scale"  fp16         [unit_tokens, 1, kv_lora_rank / TILE]
    "rope"   device dtype [unit_tokens, 1, qk_rope_head_dim]

DeepSeek geometry: 512 + 8 + 128 = 648 B against 1,152 B in BF16 (1.778x).
A tile holding NaN/Inf, or one whose scale would overflow fp16, is stored with
a NaN scale and restores as NaN; RoPE values restore exactly, non-finite ones
included. For finite input every latent element obeys kv_int8_codec's bound
``|x - x^| <= s/2 + half_ulp_out(x^)`` with its tile's scale ``s``; RoPE
elements restore with no error. docs/advanced_features/hicache_host_dtype_mla.md
gives the reasons for this split and the measured error.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec as int8
from sglang.srt.mem_cache.pool_host.host_format import (
    EncodeStats,
    HostKVFormat,
    HostRecord,
)

TILE = 128
SCALE_DTYPE = int8.SCALE_DTYPE
DEVICE_DTYPES = (torch.bfloat16, torch.float16)


class MLAInt8HostFormat(HostKVFormat):
    """Latent in 128-value INT8 tiles with FP16 scales, RoPE in the device dtype.

    One instance per pool: ``dims = (kv_lora_rank + rope_dim,)``, ``head_num =
    1``; ``unit_tokens`` is the tokens one host unit holds (a page, or one token
    for layer_first). Rows passed in and out are
    ``[n_units, unit_tokens, 1, kv_lora_rank + rope_dim]``. The amax statistic
    covers the latent tiles; ``nonfinite`` counts NaN-scale tiles and RoPE rows
    holding NaN/Inf.
    """

    name: ClassVar[str] = "int8"
    storage_format_tag: ClassVar[str] = "mla-int8-t128-fp16scale-rope16-v1"
    # The MHA int8 bound per tile; RoPE restores exactly (docs/operations.md).
    relative_error_threshold: ClassVar[float] = 0.004
    sides: ClassVar[tuple[str, ...]] = ("kv",)
    kernel_module = "sglang.kernels.ops.kvcache.kv_mla_int8_triton"

    def __init__(self, dims, head_num, unit_tokens, device_dtype, *, rope_dim=64):
        self.latent_dim, self.rope_dim = _split_dims(dims, head_num, rope_dim)
        if device_dtype not in DEVICE_DTYPES:
            raise NotImplementedError(
                "--hicache-host-dtype int8 needs a BF16/FP16 MLA device KV cache, "
                f"got {device_dtype}."
            )
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        self.tiles = self.latent_dim // TILE
        ut = unit_tokens
        self.records = (
            HostRecord("kv", (ut, 1, self.latent_dim), torch.int8),
            HostRecord("scale", (ut, 1, self.tiles), SCALE_DTYPE),
            HostRecord("rope", (ut, 1, self.rope_dim), device_dtype),
        )

    def describe(self) -> str:
        return (
            f"MLA latent {self.latent_dim} as INT8 in {self.tiles} tiles of {TILE} "
            f"with FP16 scales, RoPE {self.rope_dim} kept as {self.device_dtype}: "
            f"{self.bytes_per_token():g} B/token/layer"
        )

    # ------------------------------------------------------------------
    # torch reference: step by step; the fast path and kernels match it bit
    # for bit

    def encode_reference(self, rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        (x,) = rows
        self._check_rows(x)
        latent, rope = self._split(x)
        q, scale = int8.quantize_reference(latent)
        return {
            "kv": q.flatten(-2),
            "scale": scale,
            "rope": rope.to(self.device_dtype, copy=True),
        }

    def decode_reference(
        self, records: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        latent = int8.dequantize_reference(
            records["kv"].unflatten(-1, (self.tiles, TILE)), records["scale"], dtype
        )
        return (torch.cat([latent.flatten(-2), records["rope"].to(dtype)], dim=-1),)

    # ------------------------------------------------------------------
    # fast torch path: in place, no host sync

    def encode_into(
        self, rows: Sequence[torch.Tensor], out: Mapping[str, torch.Tensor]
    ) -> EncodeStats:
        (x,) = rows
        self._check_rows(x)
        if x.shape[0] == 0:
            zero = torch.zeros(1, dtype=torch.float32, device=x.device)
            return EncodeStats(
                zero, torch.zeros((), dtype=torch.int64, device=x.device)
            )
        latent, rope = self._split(x)
        scale = out["scale"]
        tile_amax = int8.quantize_into(
            latent, out["kv"].unflatten(-1, (self.tiles, TILE)), scale
        )
        out["rope"].copy_(rope)
        # NaN-scale tiles report a NaN amax; they are counted, not tracked.
        amax = torch.where(torch.isfinite(scale), tile_amax, 0.0).amax().reshape(1)
        nonfinite = int8.count_nonfinite_rows(scale) + _count_nonfinite_rows(rope)
        return EncodeStats(amax, nonfinite)

    def decode_into(
        self, records: Mapping[str, torch.Tensor], out: Sequence[torch.Tensor]
    ) -> None:
        (x,) = out
        latent, rope = self._split(x)
        int8.dequantize_into(
            records["kv"].unflatten(-1, (self.tiles, TILE)), records["scale"], latent
        )
        rope.copy_(records["rope"])

    def error_bound(
        self, records: Mapping[str, torch.Tensor], restored: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Elementwise bound on |x - x^| for finite bf16/fp16 input, fp32: the
        INT8 bound of each latent tile, 0 on RoPE (NaN where x^ is NaN)."""
        (x,) = restored
        latent, rope = self._split(x)
        latent_bound = int8.error_bound(records["scale"], latent).flatten(-2)
        rope_bound = torch.where(
            torch.isnan(rope), float("nan"), torch.zeros_like(rope, dtype=torch.float32)
        )
        return (torch.cat([latent_bound, rope_bound], dim=-1),)

    # ------------------------------------------------------------------
    # L3 zero-copy: MLA pages are one object per page (rank-replicated keys)

    def zero_copy_objects(self) -> list[list[tuple[str, int, int]]]:
        """One object holding every record of the unit, in ``records`` order:
        [(record name, byte offset within the unit's record, nbytes)], per layer."""
        return [[(r.name, 0, r.nbytes) for r in self.records]]

    # ------------------------------------------------------------------

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent tiles [..., tiles, TILE] and RoPE [..., rope_dim] views of x."""
        latent = x[..., : self.latent_dim].unflatten(-1, (self.tiles, TILE))
        return latent, x[..., self.latent_dim :]

    def _check_rows(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.latent_dim + self.rope_dim or x.dim() < 2:
            raise ValueError(
                f"MLA INT8 format: rows must be [..., {self.latent_dim + self.rope_dim}]"
                f", got {tuple(x.shape)}"
            )


def _split_dims(dims: tuple[int, ...], head_num: int, rope_dim: int) -> tuple[int, int]:
    if len(dims) != 1 or head_num != 1:
        raise NotImplementedError(
            "--hicache-host-dtype int8 for MLA expects one latent row per token "
            f"(dims=(kv_lora_rank + qk_rope_head_dim,), head_num=1); got dims={dims}, "
            f"head_num={head_num}."
        )
    if rope_dim <= 0:
        # The pool keeps RoPE as its own record; an empty one cannot be mapped.
        raise NotImplementedError(
            "--hicache-host-dtype int8 for MLA needs a RoPE part "
            f"(qk_rope_head_dim > 0); got qk_rope_head_dim={rope_dim}. Use "
            "--hicache-host-dtype auto for this model."
        )
    latent = dims[0] - rope_dim
    if latent <= 0 or latent % TILE:
        raise NotImplementedError(
            f"--hicache-host-dtype int8 for MLA needs kv_lora_rank a multiple of "
            f"{TILE}; got kv_lora_rank={latent}, qk_rope_head_dim={rope_dim}."
        )
    return latent, rope_dim


def _count_nonfinite_rows(rope: torch.Tensor) -> torch.Tensor:
    """RoPE rows holding NaN/Inf, 0-dim int64, no host sync."""
    if rope.shape[-1] == 0:
        return torch.zeros((), dtype=torch.int64, device=rope.device)
    return torch.count_nonzero((~torch.isfinite(rope)).any(dim=-1))
