"""The int8c host (L2) format: INT8 values, 8-bit keys per channel.

Records per unit and layer (``ut`` = unit_tokens, ``H`` = heads, ``Dk``/``Dv``
the head dims), in this order, which is the byte order of an L3 page:

- per channel (``ut >= K_CHANNEL_MIN_TOKENS_8`` = 64):
  "k" uint8 [ut, H, Dk], "k_meta" fp16 [H, Dk, 2] ((s, m) per channel),
  "v" int8 [ut, H, Dv], "v_scale" fp16 [ut, H];
- per token (``ut < 64``: page size 1..63, or layer_first where a unit is a
  token): "k" int8 [ut, H, Dk], "k_scale" fp16 [ut, H, Dk/G],
  "v" int8 [ut, H, Dv], "v_scale" fp16 [ut, H];
  ``G = 32`` if Dk divides by 32, else ``G = Dk`` (one group per head).

Values are exactly ``kv_int8_codec`` per head row: symmetric INT8 with one
FP16 scale per token and head, rounded up.

Keys of a unit of at least 64 tokens are quantized per channel: one group per
(head, channel) over the unit's tokens, with exactly ``kv_int4_codec``'s
asymmetric group math at 8 bits (QMAX = 255, codes stored unpacked, one per
byte). For a group ``x`` (bf16 or fp16; fp32 accepted), all arithmetic fp32:

    lo, hi = min x, max x                         (exact)
    m  = fp16(lo), round to nearest even; a zero m is +0
    s  = max((hi - m) / 255, finfo(float32).tiny), rounded *up* to fp16
    q  = clamp(round_half_even((x - m) / s), 0, 255)
    x^ = sat(m + q * s).to(out_dtype)

``k_meta[h, c, 0]`` is ``s`` and ``k_meta[h, c, 1]`` is ``m``. A group holding
NaN/Inf, or whose ``m`` or ``s`` would overflow fp16, is stored as meta (NaN,
NaN) with codes 0 and restores as NaN. ``q * s`` is exact in fp32 (8 + 11
significant bits), so every element of a finite group satisfies

    |x - x^| <= max(s/2, half_ulp_fp16(m)) + half_ulp_fp32(x^) + half_ulp_out(x^)

(``s/2`` = (hi - lo)/510 up to the fp16 rounding of s: 1/510 of the channel's
own range, so a small channel keeps its precision next to large ones).

Keys of a smaller unit are quantized per token, ``kv_int8_codec``'s row math
applied to ``[..., Dk/G, G]``: one FP16 scale per G consecutive channels,
``s = amax / 127`` rounded up, ``q = clamp(round_half_even(x / s), -127, 127)``,
bound ``s/2 + half_ulp_out(x^)`` as int8's. At 64 tokens both key modes cost the
same bytes (4 B of (s, m) per channel per 64 tokens = 2 B per 32 channels per
token), so Qwen3-8B geometry (8 KV heads, head dim 128) takes 266 B per token,
head and layer against BF16's 512 (1.925x) at page 64 and at page 1.

Pages of this format carry the L3 tag "int8c-v1-kchannel" or
"int8c-v1-ktoken": the two key modes have the same page size, so a
layer_first server's pages must not be read by a page_first one.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host import kv_int4_codec, kv_int8_codec
from sglang.srt.mem_cache.pool_host.host_format import (
    EncodeStats,
    HostKVFormat,
    HostRecord,
)

META_DTYPE = torch.float16
SCALE_DTYPE = kv_int8_codec.SCALE_DTYPE
# The largest per-channel key code (8 bits, asymmetric).
K_QMAX = 255
# Per-channel key metadata (4 B per channel) costs what per-token groups of 32
# cost (2 B per 32 channels per token) at 64 tokens; below that it costs more
# and a short unit's range is less representative, so smaller units fall back.
K_CHANNEL_MIN_TOKENS_8 = 64
# Channels per key scale in the per-token fallback.
K_TOKEN_GROUP = 32

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def keys_per_channel(unit_tokens: int) -> bool:
    """Whether keys of a unit of ``unit_tokens`` tokens use per-channel groups."""
    return unit_tokens >= K_CHANNEL_MIN_TOKENS_8


def key_token_group(dim: int) -> int:
    """Channels per key scale in the per-token fallback for a head of ``dim``."""
    return K_TOKEN_GROUP if dim % K_TOKEN_GROUP == 0 else dim


def _check_units(x: torch.Tensor, name: str) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"kv_int8c_codec: unsupported {name} dtype {x.dtype}")
    if x.dim() != 4 or x.shape[-1] == 0:
        raise ValueError(
            f"kv_int8c_codec: need {name} of shape [units, unit_tokens, heads, dim], "
            f"got {tuple(x.shape)}"
        )


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., D] -> [..., D/group, group] (a view: splitting one dim always is)."""
    return x.unflatten(-1, (x.shape[-1] // group, group))


# --- keys: reference ---------------------------------------------------------


def encode_keys_reference(k: torch.Tensor) -> dict[str, torch.Tensor]:
    """k [n, T, H, Dk] -> {"k", "k_meta"} (T >= 64) or {"k", "k_scale"}."""
    _check_units(k, "k")
    if keys_per_channel(k.shape[1]):
        q, meta = kv_int4_codec._encode_groups_reference(k, 1, qmax=K_QMAX)
        return {"k": q, "k_meta": meta}
    group = key_token_group(k.shape[-1])
    q, scale = kv_int8_codec.quantize_reference(_groups(k, group))
    return {"k": q.flatten(-2), "k_scale": scale}


def decode_keys_reference(
    records: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    if "k_meta" in records:
        return kv_int4_codec._decode_groups_reference(
            records["k"], records["k_meta"], 1, dtype
        )
    k, scale = records["k"], records["k_scale"]
    group = k.shape[-1] // scale.shape[-1]
    return kv_int8_codec.dequantize_reference(_groups(k, group), scale, dtype).flatten(
        -2
    )


# --- keys: fast path (in place, no host sync) --------------------------------


def encode_keys_into(k: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_keys_reference's bytes into out's key records (strided views
    allowed). Returns (largest max |x| over the finite groups, 0-dim fp32;
    groups stored non-finite, 0-dim int64)."""
    _check_units(k, "k")
    if keys_per_channel(k.shape[1]):
        meta = out["k_meta"]
        # The one full-size temporary: k widened to fp32 (exact); copy=True so
        # an fp32 k is never modified in place.
        xf = k.to(torch.float32, copy=True)
        amax = kv_int4_codec._encode_groups_into(xf, 1, meta, qmax=K_QMAX)
        # Codes 0..255 are exact in fp32: one float -> uint8 copy stores them.
        out["k"].copy_(xf)
        return (
            kv_int4_codec.finite_amax(amax, meta),
            kv_int4_codec.count_nonfinite_groups(meta),
        )
    scale = out["k_scale"]
    group = k.shape[-1] // scale.shape[-1]
    amax = kv_int8_codec.quantize_into(
        _groups(k, group), _groups(out["k"], group), scale
    )
    return _finite_row_amax(amax, scale), kv_int8_codec.count_nonfinite_rows(scale)


def decode_keys_into(records, out: torch.Tensor) -> None:
    if "k_meta" in records:
        qf = records["k"].to(torch.float32)
        kv_int4_codec._decode_groups_into(qf, records["k_meta"], 1, out)
        return
    k, scale = records["k"], records["k_scale"]
    group = k.shape[-1] // scale.shape[-1]
    kv_int8_codec.dequantize_into(_groups(k, group), scale, _groups(out, group))


def _finite_row_amax(amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest row amax over the rows stored finite, 0 if none (0-dim fp32)."""
    kept = torch.where(torch.isfinite(scale), amax, 0.0)
    return kept.amax() if kept.numel() else kept.new_zeros(())


def error_bound_keys(records, restored: torch.Tensor) -> torch.Tensor:
    """Elementwise fp32 bound on |k - k^| (module docstring); NaN for
    non-finite groups."""
    if "k_meta" in records:
        return kv_int4_codec.error_bound_channels(records["k_meta"], restored)
    scale = records["k_scale"]
    group = restored.shape[-1] // scale.shape[-1]
    return kv_int8_codec.error_bound(scale, _groups(restored, group)).flatten(-2)


# --- the host format ---------------------------------------------------------


class Int8ChannelHostFormat(HostKVFormat):
    """--hicache-host-dtype int8c: INT8 values per head row, 8-bit keys per
    channel over units of at least 64 tokens (else per token in groups of 32
    channels). Records: module docstring."""

    name = "int8c"
    storage_format_tag = "int8c-v1"
    sides = ("k", "v")
    kernel_module = "sglang.kernels.ops.kvcache.kv_int8c_triton"
    # Keys (2 + 2^-11)(1 + 2^-10)/510, values int8's (1 + 2^-10)/254 of a
    # page's max |x| (docs/operations.md).
    relative_error_threshold = 0.004

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        ut, heads = self.unit_tokens, self.head_num
        dk, dv = self.dims
        self.keys_per_channel = keys_per_channel(ut)
        if self.keys_per_channel:
            keys = (
                HostRecord("k", (ut, heads, dk), torch.uint8),
                HostRecord("k_meta", (heads, dk, 2), META_DTYPE),
            )
        else:
            keys = (
                HostRecord("k", (ut, heads, dk), torch.int8),
                HostRecord(
                    "k_scale", (ut, heads, dk // key_token_group(dk)), SCALE_DTYPE
                ),
            )
        self.records = (
            *keys,
            HostRecord("v", (ut, heads, dv), torch.int8),
            HostRecord("v_scale", (ut, heads), SCALE_DTYPE),
        )
        # Both key modes have the same page bytes at 64 tokens per page: the tag
        # keeps a layer_first server's L3 pages from being read per channel.
        grouping = "kchannel" if self.keys_per_channel else "ktoken"
        self.storage_format_tag = f"{type(self).storage_format_tag}-{grouping}"

    def describe(self) -> str:
        if self.keys_per_channel:
            keys = (
                f"keys per channel over {self.unit_tokens}-token pages "
                "(asymmetric 8-bit)"
            )
        else:
            keys = (
                f"keys per token in groups of {key_token_group(self.dims[0])} "
                f"channels: units of {self.unit_tokens} token(s) < "
                f"{K_CHANNEL_MIN_TOKENS_8} (page_size < {K_CHANNEL_MIN_TOKENS_8} "
                "or layer_first)"
            )
        return f"{super().describe()}; {keys}, values per token and head"

    def encode_reference(self, rows):
        k, v = rows
        _check_units(v, "v")
        v_q, v_scale = kv_int8_codec.quantize_reference(v)
        return {**encode_keys_reference(k), "v": v_q, "v_scale": v_scale}

    def decode_reference(self, records, dtype):
        v = kv_int8_codec.dequantize_reference(records["v"], records["v_scale"], dtype)
        return decode_keys_reference(records, dtype), v

    def encode_into(self, rows, out) -> EncodeStats:
        k, v = rows
        _check_units(v, "v")
        k_amax, k_bad = encode_keys_into(k, out)
        v_scale = out["v_scale"]
        v_amax = kv_int8_codec.quantize_into(v, out["v"], v_scale)
        return EncodeStats(
            torch.stack((k_amax, _finite_row_amax(v_amax, v_scale))),
            k_bad + kv_int8_codec.count_nonfinite_rows(v_scale),
        )

    def decode_into(self, records, out) -> None:
        decode_keys_into(records, out[0])
        kv_int8_codec.dequantize_into(records["v"], records["v_scale"], out[1])

    def error_bound(self, records, restored):
        k, v = restored
        return (
            error_bound_keys(records, k),
            kv_int8_codec.error_bound(records["v_scale"], v),
        )

    def zero_copy_objects(self):
        # Two objects per page, as a BF16 page has (_k and _v): each side's
        # payload, then its scales.
        k, k_meta, v, v_scale = self.records
        return [
            [(k.name, 0, k.nbytes), (k_meta.name, 0, k_meta.nbytes)],
            [(v.name, 0, v.nbytes), (v_scale.name, 0, v_scale.nbytes)],
        ]
