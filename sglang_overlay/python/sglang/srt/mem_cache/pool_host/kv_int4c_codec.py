"""The int4c host (L2) format: 4-bit keys per channel with two-level metadata,
4-bit rotated values per token; 8-bit keys on the layers of a per-layer plan.

For QK-normed models (Gemma 3, Qwen3, OLMo 2): their keys are not centred and
a few channels carry most of the range, so keys go per channel (KIVI) with a
page-wide FP16 (min, range) and a 4-bit sub-range per 32 tokens, which costs
the bytes of int4's per-channel metadata but follows a channel's drift within
the page (docs/design.md, results/runs/2026-12-07-quality-4bit-metadata.md).

Records per unit and layer (``U`` = unit_tokens, ``H`` = heads, ``Dk``/``Dv``
the head dims), in this order, which is the byte order of an L3 page:

- keys per channel (``U >= 16``): "k" uint8 [U, H, Dk/2], "k_range" fp16
  [H, Dk, 2] ((L, R) per channel), "k_sub" uint8 [U/S, H, Dk];
- keys per token (``U < 16``: page size below 16, or layer_first where a unit
  is one token): "k" uint8 [U, H, Dk/2], "k_meta" fp16 [U, H, Dk/G, 2],
  exactly int4's per-token key groups (kv_int4_codec, ``G`` its value group);
- plan layers only (``key8_layers``): "k_lo" uint8 [U, H, Dk/2], the low
  nibbles of 8-bit key codes whose high nibbles are "k";
- "v" uint8 [U, H, Dv/2], "v_meta" fp16 [U, H, Dv/GV, 2].

Keys per channel, for one unit, head h and channel c (fp32 throughout; every
product marked "exact" fits fp32's 24 bits, so a kernel may fuse it with the
following add (FMA) and still match; the divisions are IEEE true divisions,
never a multiplication by a reciprocal; rint is round half to even):

    lo, hi = min, max over the unit's U tokens               (exact)
    L  = lo rounded DOWN to fp16, a zero L is +0
    R  = (hi - L) rounded UP to fp16, a zero R is +0         (R >= 0)
    sub-unit j of S tokens (S = 32 if U % 32 == 0, else S = U):
    mn, mx = min, max over its S tokens                      (exact)
    a  = clamp(floor(((mn - L) / R) * 16), 0, 15)            (R > 0; else 0)
    b  = min(max(ceil(((mx - L) / R) * 16), a + 1), 16)      (R > 0; else 1)
    k_sub = a | (b - 1) << 4
    sub_lo = L + (R * a) * 2**-4                             (product exact)
    w  = R * (b - a)                                         (exact)
    s  = w / N         N = 16 * 15 = 240 (4-bit), 16 * 255 = 4080 (8-bit)
    q  = clamp(rint((x - sub_lo) / s), 0, 15 or 255)         (R > 0; else 0)
    x^ = sat(sub_lo + (q * w) / N).to(out_dtype)             (q * w exact)

Decode divides q * w by N rather than multiplying q by s: q * w is exact (at
most 8 + 4 + 11 bits), so no product rounds and FMA contraction cannot change
a restored bit. 4-bit codes are packed as int4 packs them (even channel in the
low nibble); 8-bit codes q8 store q8 >> 4 in "k" and q8 & 15 in "k_lo", both
packed that way. A channel-unit holding NaN/Inf, or whose L or R overflows
fp16, is stored as k_range (NaN, NaN), k_sub 0 and codes 0, restores as NaN
over the unit and counts as one non-finite group. Per-token 8-bit keys (plan
layers below 16 tokens) are int4's per-token groups at qmax 255, split the
same way.

Values: each head row is rotated (kv_hadamard: Walsh-Hadamard butterfly with
the seeded sign flip) in blocks of B = min(128, kv_hadamard.rotation_block(Dv))
(unrotated where that is 0), then stored as int4's per-token value groups of
GV = 128 channels where Dv divides by 128, else int4's value group, and
unrotated on restore.

Error bound, keys per channel, every element of a finite channel-unit:

    |x - x^| <= w / (2 N) + R * 2**-17 + half_ulp_fp32(sub_lo)
                + half_ulp_fp32(x^) + half_ulp_out(x^)

The w / (2 N) term is half a step. R * 2**-17 covers the fp32 rounding of
the a/b quotients (an element may sit at most R * 2**-23 outside its
sub-range), of the code quotient (at most 2**-18 of a step) and of q * w / N;
half_ulp_fp32(sub_lo) covers the grid origin's rounding. Values: int4's
per-token bound in the rotated domain, carried through the rotation by
kv_hadamard.rotated_error_bound.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence

import torch

from sglang.srt.mem_cache.pool_host import kv_hadamard
from sglang.srt.mem_cache.pool_host import kv_int4_codec as int4
from sglang.srt.mem_cache.pool_host.host_format import (
    EncodeStats,
    HostKVFormat,
    HostRecord,
    half_ulp,
)

logger = logging.getLogger(__name__)

META_DTYPE = torch.float16
# Tokens per key sub-unit when the unit divides by it.
K_SUB_TOKENS = 32
# Below this many tokens per unit, keys go per token (int4's threshold).
K_CHANNEL_MIN_TOKENS = int4.K_CHANNEL_MIN_TOKENS
# Sub-range codes a, b index sixteenths of the channel's range.
SUB_LEVELS = 16
QMAX4, QMAX8 = 15, 255
# Largest value rotation block and value group.
V_BLOCK_MAX = 128
# The bound's allowance for fp32 rounding, in units of R (module docstring).
_RANGE_SLACK = 2.0**-17

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def sub_unit_tokens(unit_tokens: int) -> int:
    """Tokens per key sub-unit; 0: keys per token (units below 16 tokens)."""
    if unit_tokens < K_CHANNEL_MIN_TOKENS:
        return 0
    return K_SUB_TOKENS if unit_tokens % K_SUB_TOKENS == 0 else unit_tokens


def value_rotation_block(dim: int) -> int:
    """Channels per value rotation block; 0: values stored unrotated."""
    return min(V_BLOCK_MAX, kv_hadamard.rotation_block(dim))


def value_group(dim: int) -> int:
    """Channels per value group (one FP16 scale and zero point per token)."""
    return V_BLOCK_MAX if dim % V_BLOCK_MAX == 0 else int4.value_group_size(dim)


def _check_units(x: torch.Tensor, name: str) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"kv_int4c_codec: unsupported {name} dtype {x.dtype}")
    if x.dim() != 4 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"kv_int4c_codec: need {name} of shape [units, unit_tokens, heads, dim] "
            f"with an even dim, got {tuple(x.shape)}"
        )


def _divisor(n: int, device) -> torch.Tensor:
    # A tensor, not a Python number: CUDA would multiply by the reciprocal.
    return torch.full((), float(n), dtype=torch.float32, device=device)


# --- keys per channel: reference ----------------------------------------------


def _fp16_down(lo: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 <= it (a zero is +0; NaN stays NaN, values
    below -65504 become -Inf)."""
    l16 = lo.to(META_DTYPE)
    bits = l16.view(torch.int16)
    # Toward -Inf: a set sign bit (negative, -0) grows the magnitude by +1.
    step = torch.where(bits < 0, 1, -1).to(torch.int16)
    down = (bits + step).view(META_DTYPE)
    return torch.where(l16.to(torch.float32) > lo, down, l16) + 0.0


def _fp16_up(r: torch.Tensor) -> torch.Tensor:
    """fp32 >= 0 (or -0) -> the smallest fp16 >= it (a zero is +0)."""
    r16 = r.to(META_DTYPE)
    up = (r16.view(torch.int16) + 1).view(META_DTYPE)
    return torch.where(r16.to(torch.float32) < r, up, r16) + 0.0


def channel_range(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per channel (lo, hi) fp32 -> k_range fp16 [..., 2] = (L, R); (NaN, NaN)
    where either is non-finite."""
    low = _fp16_down(lo)
    rng = _fp16_up(hi - low.to(torch.float32))
    bad = ~(torch.isfinite(low) & torch.isfinite(rng))
    low = low.masked_fill(bad, float("nan"))
    rng = rng.masked_fill(bad, float("nan"))
    return torch.stack((low, rng), dim=-1)


def sub_codes(
    mn: torch.Tensor, mx: torch.Tensor, low: torch.Tensor, rng: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-unit (min, max) and the channel's fp32 (L, R) -> fp32 (a, b)."""
    ok = rng > 0  # False for R == 0 and for NaN
    sixteen = float(SUB_LEVELS)
    a = (((mn - low) / rng) * sixteen).floor().clamp(0, SUB_LEVELS - 1)
    b = (((mx - low) / rng) * sixteen).ceil()
    b = torch.maximum(b, a + 1).clamp_max(SUB_LEVELS)
    # + 0.0: -0 from floor(-0) is +0, as the byte decodes.
    a = torch.where(ok, a, 0.0) + 0.0
    return a, torch.where(ok, b, 1.0)


def sub_grid(
    low: torch.Tensor, rng: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (sub_lo, w) of a sub-unit: its grid origin and R * (b - a)."""
    return low + (rng * a) * (1.0 / SUB_LEVELS), rng * (b - a)


def sub_byte(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a + (b - 1) * SUB_LEVELS).to(torch.uint8)


def sub_unbyte(k_sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_sub uint8 -> fp32 (a, b)."""
    return (k_sub & 15).to(torch.float32), (k_sub >> 4).to(torch.float32) + 1


def _steps(qmax: int) -> int:
    """N of the module docstring: steps of a sub-range of R * (b - a) / 16."""
    return SUB_LEVELS * qmax


def _split_units(x: torch.Tensor, sub: int) -> torch.Tensor:
    """[n, U, H, D] -> [n, U/S, S, H, D] (a view)."""
    return x.unflatten(1, (x.shape[1] // sub, sub))


def encode_channels_reference(
    k: torch.Tensor, sub: int, qmax: int = QMAX4
) -> dict[str, torch.Tensor]:
    """k [n, U, H, D] -> {"k_codes" fp32 [n, U, H, D] (0..qmax), "k_range",
    "k_sub"}, step by step (module docstring)."""
    xf = k.to(torch.float32)
    k_range = channel_range(xf.amin(1), xf.amax(1))  # [n, H, D, 2]
    low, rng = k_range.to(torch.float32).unbind(-1)
    xs = _split_units(xf, sub)  # [n, J, S, H, D]
    low, rng = low.unsqueeze(1), rng.unsqueeze(1)  # [n, 1, H, D]
    a, b = sub_codes(xs.amin(2), xs.amax(2), low, rng)  # [n, J, H, D]
    sub_lo, w = sub_grid(low, rng, a, b)
    s = w / _divisor(_steps(qmax), xf.device)
    q = ((xs - sub_lo.unsqueeze(2)) / s.unsqueeze(2)).round().clamp(0, qmax)
    q = torch.where((rng > 0).unsqueeze(2), q, 0.0)
    return {"k_codes": q.flatten(1, 2), "k_range": k_range, "k_sub": sub_byte(a, b)}


def decode_channels_reference(
    codes: torch.Tensor,
    k_range: torch.Tensor,
    k_sub: torch.Tensor,
    qmax: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """codes [n, U, H, D] (0..qmax, any dtype) -> x^ [n, U, H, D] of dtype."""
    low, rng = k_range.to(torch.float32).unsqueeze(1).unbind(-1)
    a, b = sub_unbyte(k_sub)
    sub_lo, w = sub_grid(low, rng, a, b)
    sub = codes.shape[1] // k_sub.shape[1]
    q = _split_units(codes.to(torch.float32), sub)
    x = sub_lo.unsqueeze(2) + (q * w.unsqueeze(2)) / _divisor(_steps(qmax), q.device)
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).flatten(1, 2).to(dtype)


# --- keys per channel: fast path (in place, no host sync) -----------------------


def encode_channels_into(
    k: torch.Tensor, k_range_out: torch.Tensor, k_sub_out: torch.Tensor, qmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_channels_reference's k_range and k_sub into the outputs; returns
    (fp32 codes [n, U, H, D], max |x| per channel-unit fp32 [n, H, D])."""
    xf = k.to(torch.float32, copy=True)
    lo, hi = xf.amin(1), xf.amax(1)
    k_range = channel_range(lo, hi)
    k_range_out.copy_(k_range)
    low, rng = k_range.to(torch.float32).unsqueeze(1).unbind(-1)
    xs = _split_units(xf, k.shape[1] // k_sub_out.shape[1])
    a, b = sub_codes(xs.amin(2), xs.amax(2), low, rng)
    k_sub_out.copy_(sub_byte(a, b))
    sub_lo, w = sub_grid(low, rng, a, b)
    s = w.div_(_divisor(_steps(qmax), xf.device))
    # R == 0 gives 0 / 0 and a non-finite channel NaN: nan_to_num_ zeroes
    # exactly the codes the reference masks (R == 0 means x == L == sub_lo).
    xs.sub_(sub_lo.unsqueeze(2)).div_(s.unsqueeze(2)).round_().clamp_(0, qmax)
    xs.nan_to_num_(nan=0.0)
    return xf, torch.maximum(hi, lo.neg_())


def decode_channels_into(
    qf: torch.Tensor,
    k_range: torch.Tensor,
    k_sub: torch.Tensor,
    qmax: int,
    out: torch.Tensor,
) -> None:
    """fp32 codes qf [n, U, H, D] (clobbered) -> out, the reference's bits."""
    low, rng = k_range.to(torch.float32).unsqueeze(1).unbind(-1)
    a, b = sub_unbyte(k_sub)
    sub_lo, w = sub_grid(low, rng, a, b)
    q = _split_units(qf, qf.shape[1] // k_sub.shape[1])
    q.mul_(w.unsqueeze(2)).div_(_divisor(_steps(qmax), qf.device))
    q.add_(sub_lo.unsqueeze(2))
    if out.dtype != torch.float32:
        top = torch.finfo(out.dtype).max
        qf.clamp_(-top, top)
    out.copy_(qf)


def error_bound_channels(
    k_range: torch.Tensor,
    k_sub: torch.Tensor,
    qmax: int,
    restored: torch.Tensor,
) -> torch.Tensor:
    """Elementwise fp32 bound on |x - x^| for per-channel keys (module
    docstring); NaN where the channel-unit is non-finite."""
    low, rng = k_range.to(torch.float32).unsqueeze(1).unbind(-1)
    a, b = sub_unbyte(k_sub)
    sub_lo, w = sub_grid(low, rng, a, b)
    quant = w.double() / (2 * _steps(qmax)) + rng.double() * _RANGE_SLACK
    quant = quant + half_ulp(sub_lo, torch.float32).double()
    sub = restored.shape[1] // k_sub.shape[1]
    r = _split_units(restored, sub)
    bound = quant.unsqueeze(2) + half_ulp(r.float(), torch.float32).double()
    bound = bound + half_ulp(r.float(), restored.dtype).double()
    bound = kv_hadamard._next_up_fp32(bound).flatten(1, 2)
    bad = torch.isnan(restored) | torch.isnan(bound)
    return bound.masked_fill(bad, float("nan"))


# --- keys per token (units below 16 tokens): int4's groups ----------------------


def _split_nibbles(q8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes (fp32 or integer) -> (q8 >> 4, q8 & 15) as fp32."""
    hi = q8.to(torch.float32).div(16).floor()
    return hi, q8.to(torch.float32) - hi * 16


def _pack(q: torch.Tensor) -> torch.Tensor:
    return int4.pack_int4(q.to(torch.uint8))


def _join_nibbles(k: torch.Tensor, k_lo: torch.Tensor) -> torch.Tensor:
    """Packed high and low nibbles -> fp32 8-bit codes [..., D]."""
    return int4._unpack_float(k).mul_(16).add_(int4._unpack_float(k_lo))


# --- the host format ------------------------------------------------------------


class Int4ChannelHostFormat(HostKVFormat):
    """--hicache-host-dtype int4c: 4-bit keys per channel in 32-token
    sub-units of a page-wide FP16 (min, range) (per token below 16 tokens),
    4-bit values per token after a per-head Walsh-Hadamard rotation, and
    8-bit keys on the layers of `key8_layers`. Records: module docstring.

    With a plan, for_layer(layer_id) is the format of one layer (its records
    and key width); the instance itself only describes the pool.
    """

    name = "int4c"
    storage_format_tag = "int4c-v1"
    sides = ("k", "v")
    # 4-bit keys: the sink page (sink_page.py) is what pays on Llama-style
    # models, where the per-layer plan does not.
    sink_page = True
    # Takes key8_layers (SGLANG_HICACHE_KEY8_LAYERS, layer_plan.py): k_lo is
    # stored on those layers only.
    key8_plan = True
    # Keys: half a step w / 480 <= R / 30 <= 2 amax (1 + 2^-10)^2 / 30; values
    # int4's (2 + 2^-11)(1 + 2^-10) / 30 of the rotated max (docs/operations.md).
    relative_error_threshold = 0.068

    def __init__(
        self,
        dims,
        head_num,
        unit_tokens,
        device_dtype,
        key8_layers: tuple[int, ...] = (),
    ):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        dk, dv = self.dims
        if dk % 2 or dv % 2:
            raise NotImplementedError(
                f"--hicache-host-dtype {self.name} packs two 4-bit codes per byte "
                f"and needs even head dims; got {self.dims}. Use "
                "--hicache-host-dtype int8."
            )
        if device_dtype not in _INPUT_DTYPES:
            raise NotImplementedError(
                f"--hicache-host-dtype {self.name} encodes BF16/FP16 device KV, "
                f"not {str(device_dtype).removeprefix('torch.')}; pass "
                "--hicache-host-dtype int4 or k8v4 for an FP8 KV cache."
            )
        layers = tuple(sorted({int(i) for i in key8_layers}))
        if any(i < 0 for i in layers):
            raise ValueError(
                f"--hicache-host-dtype {self.name}: key8 layer ids must be >= 0, "
                f"got {tuple(key8_layers)}"
            )
        self.key8_layers = layers
        ut, heads = self.unit_tokens, self.head_num
        self.sub_tokens = sub_unit_tokens(ut)
        self.v_block = value_rotation_block(dv)
        self.v_group = value_group(dv)
        self.rotation_blocks = (0, self.v_block)
        if self.sub_tokens:
            keys = (
                HostRecord("k", (ut, heads, dk // 2), torch.uint8),
                HostRecord("k_range", (heads, dk, 2), META_DTYPE),
                HostRecord("k_sub", (ut // self.sub_tokens, heads, dk), torch.uint8),
            )
        else:
            group = int4.value_group_size(dk)
            keys = (
                HostRecord("k", (ut, heads, dk // 2), torch.uint8),
                HostRecord("k_meta", (ut, heads, dk // group, 2), META_DTYPE),
            )
        if layers:
            keys += (HostRecord("k_lo", (ut, heads, dk // 2), torch.uint8, layers),)
        self.records = (
            *keys,
            HostRecord("v", (ut, heads, dv // 2), torch.uint8),
            HostRecord("v_meta", (ut, heads, dv // self.v_group, 2), META_DTYPE),
        )
        # Key grouping and plan: pages of another grouping or plan must miss in
        # L3 (the sub-unit follows from the page size, which the seal binds).
        grouping = "kchannel" if self.sub_tokens else "ktoken"
        tag = f"{type(self).storage_format_tag}-{grouping}"
        if layers:
            tag += "-k8l" + "_".join(map(str, layers))
        self.storage_format_tag = tag
        # Key code width of this instance: 4 or 8 on a layer's format, None on
        # a pool's format with a plan (it encodes per layer only).
        self.key_bits: int | None = None if layers else 4
        self._layer_formats: dict[bool, Int4ChannelHostFormat] = {}
        self._pool_format = self

    # -- the per-layer plan ------------------------------------------------------

    def for_layer(self, layer_id: int) -> HostKVFormat:
        pool = self._pool_format
        if not pool.key8_layers:
            return pool
        keys8 = layer_id in pool.key8_layers
        if keys8 not in pool._layer_formats:
            fmt = copy.copy(pool)
            fmt.records = tuple(r for r in pool.records if r.stored_on(layer_id))
            fmt.key_bits = 8 if keys8 else 4
            pool._layer_formats[keys8] = fmt
        return pool._layer_formats[keys8]

    def _qmax(self) -> int:
        if self.key_bits is None:
            raise ValueError(
                f"--hicache-host-dtype {self.name} with 8-bit keys on layers "
                f"{self.key8_layers} encodes one layer at a time: use "
                "for_layer(layer_id)"
            )
        return QMAX8 if self.key_bits == 8 else QMAX4

    def describe(self) -> str:
        dk, dv = self.dims
        if self.sub_tokens:
            keys = (
                f"keys per channel over {self.unit_tokens}-token pages (FP16 min "
                f"and range per page, 4-bit sub-range codes per {self.sub_tokens} "
                "tokens)"
            )
        else:
            keys = (
                f"keys per token in groups of {int4.value_group_size(dk)} channels: "
                f"{self.unit_tokens} token(s) per host unit < {K_CHANNEL_MIN_TOKENS} "
                f"(page_size < {K_CHANNEL_MIN_TOKENS} or layer_first)"
            )
        if self.v_block:
            values = f"values rotated per head in blocks of {self.v_block}"
        else:
            values = (
                f"values NOT rotated (head dim {dv} has no power-of-two block of "
                f"at least {kv_hadamard.MIN_BLOCK} channels)"
            )
        values += f", per token in groups of {self.v_group}"
        if self.key8_layers:
            extra = self._pool_format.record("k_lo").nbytes / self.unit_tokens
            plan = (
                f"8-bit keys (k_lo, +{extra:g} B/token) on layers "
                f"{list(self.key8_layers)}, 4-bit keys elsewhere"
            )
        else:
            plan = "4-bit keys on every layer"
        return f"{super().describe()}; {keys}, {values}; {plan}"

    # -- reference -----------------------------------------------------------

    def _encode_keys_reference(self, k: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_units(k, "k")
        qmax = self._qmax()
        if self.sub_tokens:
            out = encode_channels_reference(k, self.sub_tokens, qmax)
            q = out.pop("k_codes")
        else:
            group = int4.value_group_size(k.shape[-1])
            xg = int4._token_groups(k, group)
            q, meta = int4._encode_groups_reference(xg, -1, qmax=qmax)
            q, out = q.flatten(-2), {"k_meta": meta}
        if qmax == QMAX4:
            return {"k": _pack(q), **out}
        hi, lo = _split_nibbles(q)
        return {"k": _pack(hi), **out, "k_lo": _pack(lo)}

    def _decode_keys_reference(self, records, dtype) -> torch.Tensor:
        qmax = self._qmax()
        if qmax == QMAX4:
            q = int4.unpack_int4(records["k"])
        else:
            q = _join_nibbles(records["k"], records["k_lo"])
        if self.sub_tokens:
            return decode_channels_reference(
                q, records["k_range"], records["k_sub"], qmax, dtype
            )
        meta = records["k_meta"]
        group = q.shape[-1] // meta.shape[-2]
        x = int4._decode_groups_reference(int4._token_groups(q, group), meta, -1, dtype)
        return x.flatten(-2)

    def encode_reference(self, rows):
        k, v = rows
        _check_units(v, "v")
        if self.v_block:
            v = kv_hadamard.rotate_reference(v.to(torch.float32), self.v_block)
        v_q, v_meta = int4.encode_tokens_reference(v, self.v_group)
        return {**self._encode_keys_reference(k), "v": v_q, "v_meta": v_meta}

    def _decode_values_rotated(self, records) -> torch.Tensor:
        """The rotated-domain values y^ (fp32), before unrotation."""
        return int4.decode_tokens_reference(
            records["v"], records["v_meta"], torch.float32
        )

    def decode_reference(self, records, dtype):
        k = self._decode_keys_reference(records, dtype)
        if not self.v_block:
            return k, int4.decode_tokens_reference(
                records["v"], records["v_meta"], dtype
            )
        v = kv_hadamard.unrotate_reference(
            self._decode_values_rotated(records), self.v_block
        )
        top = torch.finfo(dtype).max
        return k, v.clamp(-top, top).to(dtype)

    # -- fast path -----------------------------------------------------------

    def encode_into(self, rows, out: Mapping[str, torch.Tensor]) -> EncodeStats:
        k, v = rows
        _check_units(k, "k")
        _check_units(v, "v")
        qmax = self._qmax()
        if self.sub_tokens:
            meta = out["k_range"]
            qf, k_amax = encode_channels_into(k, meta, out["k_sub"], qmax)
        else:
            meta = out["k_meta"]
            group = k.shape[-1] // meta.shape[-2]
            qf = k.to(torch.float32, copy=True)
            k_amax = int4._encode_groups_into(
                int4._token_groups(qf, group), -1, meta, qmax
            )
        if qmax == QMAX4:
            int4._pack_into(qf, out["k"])
        else:
            hi, lo = _split_nibbles(qf)
            int4._pack_into(hi, out["k"])
            int4._pack_into(lo, out["k_lo"])
        if self.v_block:
            v = v.to(torch.float32, copy=True).contiguous()
            v = kv_hadamard.rotate_(v, self.v_block)
        v_amax = int4.encode_tokens_into(v, out["v"], out["v_meta"])
        amax = torch.stack(
            (
                int4.finite_amax(k_amax, meta),
                int4.finite_amax(v_amax, out["v_meta"]),
            )
        )
        nonfinite = int4.count_nonfinite_groups(meta) + int4.count_nonfinite_groups(
            out["v_meta"]
        )
        return EncodeStats(amax, nonfinite)

    def decode_into(self, records, out: Sequence[torch.Tensor]) -> None:
        k_out, v_out = out
        qmax = self._qmax()
        if qmax == QMAX4:
            qf = int4._unpack_float(records["k"])
        else:
            qf = _join_nibbles(records["k"], records["k_lo"])
        if self.sub_tokens:
            decode_channels_into(qf, records["k_range"], records["k_sub"], qmax, k_out)
        else:
            meta = records["k_meta"]
            group = qf.shape[-1] // meta.shape[-2]
            int4._decode_groups_into(
                int4._token_groups(qf, group),
                meta,
                -1,
                k_out.unflatten(-1, (-1, group)),
            )
        if not self.v_block:
            int4.decode_tokens_into(records["v"], records["v_meta"], v_out)
            return
        tmp = torch.empty(v_out.shape, dtype=torch.float32, device=v_out.device)
        int4.decode_tokens_into(records["v"], records["v_meta"], tmp)
        kv_hadamard.unrotate_(tmp, self.v_block)
        if v_out.dtype != torch.float32:
            top = torch.finfo(v_out.dtype).max
            tmp.clamp_(-top, top)
        v_out.copy_(tmp)

    def error_bound(self, records, restored):
        k, v = restored
        qmax = self._qmax()
        if self.sub_tokens:
            k_bound = error_bound_channels(
                records["k_range"], records["k_sub"], qmax, k
            )
        else:
            k_bound = int4.error_bound_tokens(records["k_meta"], k)
        if not self.v_block:
            return k_bound, int4.error_bound_tokens(records["v_meta"], v)
        y = self._decode_values_rotated(records)
        e = int4.error_bound_tokens(records["v_meta"], y)
        return k_bound, kv_hadamard.rotated_error_bound(y, e, v, self.v_block)

    # -- fused kernels (kv_int4c_triton): told the plan and the value rotation --

    kernel_module = "sglang.kernels.ops.kvcache.kv_int4c_triton"

    def _kernel_options(self, device) -> dict:
        """The kernels' rotation arguments for a transfer device (the signs
        cached per device on the pool's format)."""
        cache = self._pool_format.__dict__.setdefault("_signs_by_device", {})
        device = torch.device(device)
        if device not in cache:
            cache[device] = kv_hadamard.rotation_signs(self.dims[1], device)
        return {
            "rotation_blocks": self.rotation_blocks,
            "rotation_signs": cache[device],
        }

    def encode_gather(self, tables, device_indices, out, host_indices, **options):
        """HostKVFormat.encode_gather; out["k_lo"] holds the plan's layers
        among the records' layers, in order."""
        super().encode_gather(
            tables,
            device_indices,
            out,
            host_indices,
            key8_layers=self.key8_layers,
            **options,
            **self._kernel_options(tables[0].device),
        )

    def decode_scatter(self, records, host_indices, dst, device_indices, **counters):
        super().decode_scatter(
            records,
            host_indices,
            dst,
            device_indices,
            **counters,
            **self._kernel_options(dst[0].device),
        )

    # -- L3 zero-copy storage -----------------------------------------------------

    def zero_copy_objects(self):
        # Two objects per page, as a BF16 page has (_k and _v), with as many
        # pieces each (the pool sends buffers_per_object per object): the key
        # records, then the value codes in pieces to match, then v_meta.
        keys = [r for r in self.records if r.name.startswith("k")]
        v, v_meta = self.record("v"), self.record("v_meta")
        parts = len(keys) - 1
        cuts = [v.nbytes * i // parts for i in range(parts + 1)]
        values = [(v.name, lo, hi - lo) for lo, hi in zip(cuts, cuts[1:])]
        return [
            [(r.name, 0, r.nbytes) for r in keys],
            [*values, (v_meta.name, 0, v_meta.nbytes)],
        ]
