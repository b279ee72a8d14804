"""INT8 codec for the HiCache host (L2) KV pool.

Symmetric INT8 with one FP16 scale per head row, i.e. per (token, layer, K|V,
head). For ``x`` of shape ``[..., head_dim]`` (bf16 or fp16; fp32 accepted)
the codec stores ``q`` int8 ``[..., head_dim]`` and ``scale`` fp16 ``[...]``:

    amax = max(max |x| over head_dim in fp32, finfo(float32).tiny)
    s    = amax / 127 (fp32, correctly rounded), rounded *up* to fp16
    q    = clamp(round_half_even(x / s), -127, 127)
    x^   = sat(float32(q) * float32(s)).to(out_dtype)

Rounding the scale up keeps the clamp from ever cutting a finite row, and
``sat`` clamps to the output dtype's largest finite value so that finite input
never decodes to Inf. A row with NaN/Inf, or whose scale would overflow fp16,
is stored with a NaN scale and decodes to all NaN; ``count_nonfinite_rows``
counts such rows without a host sync. For a finite bf16/fp16 row every element
satisfies ``|x - x^| <= s/2 + half_ulp_out(x^)`` (``error_bound``); the
derivation and the measured error are in the HiCache host dtype docs page.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host.host_format import (
    EncodeStats,
    HostKVFormat,
    HostRecord,
    add_round_up,
    half_ulp,
)

SCALE_DTYPE = torch.float16
QMAX = 127

# FP8 (k8v4's keys from an FP8 device KV cache) widens exactly to fp32.
_INPUT_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
# Floor for amax: an all-zero row gets the smallest scale and q = 0, not 0/0.
_AMAX_FLOOR = torch.finfo(torch.float32).tiny


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax -> stored fp16 scale (NaN for rows that can't be encoded).

    Only touches per-row tensors, so the temporaries are small.
    """
    amax = amax.clamp_min(_AMAX_FLOOR)
    # Divide by a tensor on amax's device rather than a Python number: CUDA
    # turns division by a CPU scalar into multiplication by its reciprocal,
    # which is not correctly rounded and would make CPU and GPU disagree.
    s32 = amax / torch.full((), QMAX, dtype=torch.float32, device=amax.device)
    s16 = s32.to(SCALE_DTYPE)
    # Round-to-nearest may have gone down; step to the next fp16 up. s16 >= 0,
    # so bit pattern + 1 is the next representable value (0 -> 2**-24,
    # 65504 -> Inf, which the guard below turns into NaN).
    s16.view(torch.int16).add_(s16.to(torch.float32) < s32)
    # NaN/Inf amax or an fp16 overflow: the row is unrepresentable.
    return s16.masked_fill_(~torch.isfinite(s16), float("nan"))


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"kv_int8_codec: unsupported input dtype {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"kv_int8_codec: need x of shape [..., head_dim], got {x.shape}"
        )


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode x [..., head_dim] -> (q int8 [..., head_dim], scale fp16 [...]).

    Straightforward, step-by-step version of the format; the fast path must
    match it bit for bit.
    """
    _check_input(x)
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1).clamp_min(_AMAX_FLOOR)
    s32 = amax / torch.full((), QMAX, dtype=torch.float32, device=x.device)
    s16 = s32.to(SCALE_DTYPE)
    next_up = (s16.view(torch.int16) + 1).view(SCALE_DTYPE)
    s16 = torch.where(s16.to(torch.float32) < s32, next_up, s16)
    bad = ~torch.isfinite(s16)
    scale = torch.where(bad, torch.full_like(s16, float("nan")), s16)

    quotient = xf / scale.to(torch.float32).unsqueeze(-1)
    qf = torch.round(quotient).clamp(-QMAX, QMAX)
    qf = torch.where(bad.unsqueeze(-1), torch.zeros_like(qf), qf)
    return qf.to(torch.int8), scale


def dequantize_reference(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Decode (q, scale) -> x^ of the given dtype; NaN rows decode to NaN,
    finite rows saturate at the dtype's largest finite value."""
    xf = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    top = torch.finfo(dtype).max
    return xf.clamp(-top, top).to(dtype)


def quantize_into(
    x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor
) -> torch.Tensor:
    """Encode x into preallocated q_out (int8, x's shape) and scale_out (fp16).

    Bit-identical to quantize_reference. Any of the tensors may be strided
    views (gathered rows, slices of a bigger host buffer). No host sync: all
    value-dependent decisions are tensor ops.

    Returns each row's amax, max |x| in fp32 (x.shape[:-1]; NaN for rows
    holding NaN), for callers that track the scale range.
    """
    _check_input(x)
    if q_out.dtype != torch.int8 or q_out.shape != x.shape:
        raise ValueError(
            f"q_out must be int8 {tuple(x.shape)}, "
            f"got {q_out.dtype} {tuple(q_out.shape)}"
        )
    if scale_out.dtype != SCALE_DTYPE or scale_out.shape != x.shape[:-1]:
        raise ValueError(
            f"scale_out must be {SCALE_DTYPE} {tuple(x.shape[:-1])}, "
            f"got {scale_out.dtype} {tuple(scale_out.shape)}"
        )

    # The one full-size temporary: x widened to fp32 (exact). copy=True so an
    # fp32 x is never modified in place below.
    xf = x.to(torch.float32, copy=True)
    # amax = max(max x, -min x): exact, NaN-propagating, no |x| temporary, and
    # on CPU two plain reductions beat both aminmax and abs().amax().
    amax = torch.maximum(xf.amax(dim=-1), xf.amin(dim=-1).neg_())
    scale = _scale_from_amax(amax)
    scale_out.copy_(scale)

    # Quotient in place; true division, as in the reference (a tensor divisor,
    # so no reciprocal shortcut on CUDA either).
    qf = xf.div_(scale.to(torch.float32).unsqueeze(-1))
    # Finite rows have |x/s| <= 127; a NaN-scale row is NaN throughout (x/NaN),
    # so nan_to_num_ zeroes exactly the rows the reference masks.
    qf.round_().clamp_(-QMAX, QMAX).nan_to_num_(nan=0.0)
    q_out.copy_(qf)
    return amax


def dequantize_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Decode (q, scale) into out; out's dtype is the output dtype.

    Bit-identical to dequantize_reference: the product is exact in fp32,
    saturates at out's largest finite value and rounds once, into out.
    """
    if q.dtype != torch.int8 or scale.shape != q.shape[:-1]:
        raise ValueError(
            f"need int8 q [..., D] and scale [...], got {q.shape}, {scale.shape}"
        )
    if out.shape != q.shape or not out.dtype.is_floating_point:
        raise ValueError(
            f"out must be floating-point {tuple(q.shape)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    # Widen q to fp32 explicitly: a mixed int8 * fp32 -> out mul gives the same
    # bits but runs several times slower on CPU.
    xf = q.to(torch.float32)
    xf.mul_(scale.to(torch.float32).unsqueeze(-1))
    if out.dtype != torch.float32:
        # clamp_ keeps NaN and changes only results that would round to the
        # largest finite value anyway or to Inf.
        top = torch.finfo(out.dtype).max
        xf.clamp_(-top, top)
    out.copy_(xf)


def error_bound(scale: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """Elementwise bound s/2 + half_ulp_out(x^) on |x - x^|, as fp32.

    Valid for bf16/fp16 inputs (see the module docstring). The fp32 sum is
    rounded up, so the result is the formula exactly when it is an fp32 and
    the next fp32 above it otherwise. Inf where x^ is Inf, NaN for NaN rows.
    """
    r = restored.to(torch.float32).abs()
    half_s = (scale.to(torch.float32) / 2).unsqueeze(-1)
    bound = add_round_up(half_s, half_ulp(r, restored.dtype))
    return torch.where(torch.isnan(r), r, bound)


def count_nonfinite_rows(scale: torch.Tensor) -> torch.Tensor:
    """Number of rows stored as non-finite (NaN scale), as a 0-dim int64 tensor
    on scale's device; no host sync, so callers can accumulate it lazily."""
    return torch.count_nonzero(~torch.isfinite(scale))


class Int8HostFormat(HostKVFormat):
    """--hicache-host-dtype int8: the codec above per head row of K and V.

    Records per unit and layer: "k" int8 [ut, H, Dk], "v" int8 [ut, H, Dv],
    "scale" fp16 [ut, 2, H] (K scales at [:, 0], V scales at [:, 1]).
    """

    name = "int8"
    storage_format_tag = "int8-fp16scale-v1"
    sides = ("k", "v")
    kernel_module = "sglang.kernels.ops.kvcache.kv_int8_triton"
    # s/2 <= amax/254 * (1 + 2^-10) per row (docs/operations.md).
    relative_error_threshold = 0.004

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        ut, heads = self.unit_tokens, self.head_num
        self.records = (
            HostRecord("k", (ut, heads, self.dims[0]), torch.int8),
            HostRecord("v", (ut, heads, self.dims[1]), torch.int8),
            HostRecord("scale", (ut, 2, heads), SCALE_DTYPE),
        )

    def encode_reference(self, rows):
        encoded = [quantize_reference(x) for x in rows]
        return {
            "k": encoded[0][0],
            "v": encoded[1][0],
            "scale": torch.stack([encoded[0][1], encoded[1][1]], dim=-2),
        }

    def decode_reference(self, records, dtype):
        return tuple(
            dequantize_reference(records[side], records["scale"][..., i, :], dtype)
            for i, side in enumerate(self.sides)
        )

    def encode_into(self, rows, out) -> EncodeStats:
        scales = out["scale"]
        amax = []
        for i, side in enumerate(self.sides):
            row_amax = quantize_into(rows[i], out[side], scales[..., i, :])
            # Rows stored as NaN do not count towards the running amax.
            finite = torch.isfinite(scales[..., i, :])
            kept = torch.where(finite, row_amax, 0.0)
            amax.append(kept.amax() if kept.numel() else kept.new_zeros(()))
        return EncodeStats(torch.stack(amax), count_nonfinite_rows(scales))

    def decode_into(self, records, out) -> None:
        for i, side in enumerate(self.sides):
            dequantize_into(records[side], records["scale"][..., i, :], out[i])

    def error_bound(self, records, restored):
        return tuple(
            error_bound(records["scale"][..., i, :], restored[i])
            for i in range(len(self.sides))
        )

    def encode_gather(self, tables, device_indices, out, host_indices, **options):
        # kv_int8_triton takes each side's table and record by name.
        self._kernels().encode_gather(
            tables[0],
            tables[1],
            device_indices,
            out["k"],
            out["v"],
            out["scale"],
            host_indices,
            unit_tokens=self.unit_tokens,
            **options,
        )

    def decode_scatter(self, records, host_indices, dst, device_indices, **counters):
        self._kernels().decode_scatter(
            records["k"],
            records["v"],
            records["scale"],
            host_indices,
            dst[0],
            dst[1],
            device_indices,
            unit_tokens=self.unit_tokens,
            **counters,
        )

    def zero_copy_objects(self):
        # Two objects per page, as a BF16 page has (_k and _v): each takes its
        # payload and half of the page's scale bytes.
        k_bytes, v_bytes, s_bytes = (record.nbytes for record in self.records)
        half = s_bytes // 2
        return [
            [("k", 0, k_bytes), ("scale", 0, half)],
            [("v", 0, v_bytes), ("scale", half, s_bytes - half)],
        ]
