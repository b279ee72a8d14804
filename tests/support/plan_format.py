"""The copy toy (copy_format.py) with a per-layer plan, as int4c's key8_layers: keys as
their high byte on every layer (lossy), plus record `k_lo`, the low byte, stored only on
its key8_layers, where keys restore exactly."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host.host_format import HostDtype, HostRecord
from tests.support.copy_format import CopyHostFormat

ENTRY = HostDtype(
    "plan",
    mha_format="tests.support.plan_format:PlanHostFormat",
    mla_format=None,
    help="toy format with a per-layer plan (tests)",
)


class PlanHostFormat(CopyHostFormat):
    name = "plan"
    storage_format_tag = "plan-test-v1"
    key8_plan = True

    def __init__(self, dims, head_num, unit_tokens, device_dtype, key8_layers=()):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        if key8_layers and self.unit_tokens % 4 and self.unit_tokens != 1:
            # As a format whose 8-bit keys group 4 tokens (or go per token).
            raise NotImplementedError(
                "--hicache-host-dtype plan: SGLANG_HICACHE_KEY8_LAYERS needs "
                "units of 1 token or a multiple of 4; pass --page-size 1 or a "
                "multiple of 4, or set it to none."
            )
        self.key8_layers = tuple(key8_layers)
        # Whether this is a plan layer's format (for_layer); None: the pool's.
        self.key8: bool | None = None
        k, v, amax = self.records
        k = HostRecord("k", k.shape, torch.uint8)
        k_lo = HostRecord("k_lo", k.shape, torch.uint8, layers=self.key8_layers)
        self.records = (k, *((k_lo,) if self.key8_layers else ()), v, amax)
        self._layers: dict[bool, PlanHostFormat] = {}

    def for_layer(self, layer_id):
        if not self.key8_layers:
            return self
        key8 = layer_id in self.key8_layers
        if key8 not in self._layers:
            fmt = PlanHostFormat(
                self.dims, self.head_num, self.unit_tokens, self.device_dtype
            )
            fmt.key8 = key8
            fmt.records = tuple(r for r in self.records if r.stored_on(layer_id))
            self._layers[key8] = fmt
        return self._layers[key8]

    def _key8(self) -> bool:
        if self.key8 is None and self.key8_layers:
            raise RuntimeError("a planned format encodes per layer (for_layer)")
        return bool(self.key8)

    def encode_reference(self, rows):
        out = super().encode_reference(rows)
        # (low, high) bytes of the 16-bit keys (little-endian).
        lo, hi = out["k"].view(torch.uint8).unflatten(-1, (-1, 2)).unbind(-1)
        out["k"] = hi.clone()
        if self._key8():
            out["k_lo"] = lo.clone()
        return out

    def decode_reference(self, records, dtype):
        hi = records["k"]
        lo = records["k_lo"] if self._key8() else torch.zeros_like(hi)
        # The 16-bit patterns are the device dtype's; fp32 (the restore check)
        # converts them.
        k = torch.stack([lo, hi], dim=-1).flatten(-2).view(self.device_dtype)
        return k.to(dtype), records["v"].view(self.device_dtype).to(dtype, copy=True)

    def error_bound(self, records, restored):
        # Keys without k_lo keep sign and exponent only.
        k = restored[0].float().abs() * (0 if self._key8() else 1)
        return k, torch.zeros(restored[1].shape)

    def zero_copy_objects(self):
        n = {r.name: r.nbytes for r in self.records}
        if "k_lo" not in n:
            return super().zero_copy_objects()
        half = n["v"] // 2
        return [
            [("k", 0, n["k"]), ("k_lo", 0, n["k_lo"]), ("unit_amax", 0, 4)],
            [("v", 0, half), ("v", half, n["v"] - half), ("unit_amax", 4, 4)],
        ]
