"""A toy host format with a per-layer plan, registered by tests through the
registry alone (as int4c's key8_layers): keys as the high byte of their 16-bit
pattern on every layer ("8-bit keys", lossy), plus record `k_lo`, the low
byte, stored only on its key8_layers, where keys restore exactly; values as
their 16-bit patterns; a per-unit fp32 amax record after them."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host.host_format import (
    EncodeStats,
    HostDtype,
    HostKVFormat,
    HostRecord,
)

ENTRY = HostDtype(
    "plan",
    mha_format="tests.support.plan_format:PlanHostFormat",
    mla_format=None,
    help="toy format with a per-layer plan (tests)",
)


def _bytes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) bytes of 16-bit rows (little-endian)."""
    b = x.contiguous().view(torch.uint8).unflatten(-1, (-1, 2))
    return b[..., 0], b[..., 1]


class PlanHostFormat(HostKVFormat):
    name = "plan"
    storage_format_tag = "plan-test-v1"
    sides = ("k", "v")
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
        ut, heads = self.unit_tokens, self.head_num
        k_lo = HostRecord(
            "k_lo", (ut, heads, self.dims[0]), torch.uint8, layers=self.key8_layers
        )
        self.records = (
            HostRecord("k", (ut, heads, self.dims[0]), torch.uint8),
            *((k_lo,) if self.key8_layers else ()),
            HostRecord("v", (ut, heads, self.dims[1]), torch.int16),
            HostRecord("unit_amax", (2,), torch.float32),
        )
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
        lo, hi = _bytes(rows[0])
        out = {"k": hi.clone()}
        if self._key8():
            out["k_lo"] = lo.clone()
        out["v"] = rows[1].contiguous().view(torch.int16).clone()
        out["unit_amax"] = torch.stack([self._unit_amax(x) for x in rows], dim=-1)
        return out

    @staticmethod
    def _unit_amax(x):
        xf = x.float().flatten(1)
        return torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax(dim=1)

    def decode_reference(self, records, dtype):
        hi = records["k"]
        lo = records["k_lo"] if self._key8() else torch.zeros_like(hi)
        # The 16-bit patterns are the device dtype's; fp32 (the restore check)
        # converts them.
        k = torch.stack([lo, hi], dim=-1).flatten(-2).view(self.device_dtype)
        return k.to(dtype), records["v"].view(self.device_dtype).to(dtype, copy=True)

    def encode_into(self, rows, out):
        ref = self.encode_reference(rows)
        for name, value in ref.items():
            out[name].copy_(value)
        nonfinite = sum(
            torch.count_nonzero(~torch.isfinite(x.float()).all(dim=-1)) for x in rows
        )
        return EncodeStats(ref["unit_amax"].amax(dim=0), nonfinite)

    def decode_into(self, records, out):
        for o, x in zip(out, self.decode_reference(records, self.device_dtype)):
            o.copy_(x)

    def error_bound(self, records, restored):
        # Keys without k_lo keep sign and exponent only.
        k = restored[0].float().abs() * (0 if self._key8() else 1)
        return k, torch.zeros(restored[1].shape)

    # A torch stand-in for fused kernels, with the kernels' contract: tables
    # of all layers, out[name] a [unit, layer, ...] view of the record's
    # stored layers among the launch's, indices on the device.
    def fused_available(self, device):
        return True

    def encode_gather(
        self, tables, device_indices, out, host_indices, *, counters=None, first_layer=0
    ):
        amax = None if counters is None else counters.amax
        ut = self.unit_tokens
        units = host_indices.view(-1, ut)[:, 0].long() // ut
        launch = range(first_layer, first_layer + out["k"].shape[1])
        for src in launch:
            rows = [
                t.layers[src][device_indices.long()].view(-1, ut, *t.shape[1:])
                for t in tables
            ]
            fmt = self.for_layer(src)
            encoded = fmt.encode_reference(rows)
            for record in fmt.records:
                stored = [i for i in launch if record.stored_on(i)]
                out[record.name][units, stored.index(src)] = encoded[record.name]
            if amax is not None:
                torch.maximum(
                    amax[src], encoded["unit_amax"].amax(dim=0), out=amax[src]
                )

    def decode_scatter(
        self, records, host_indices, dst, device_indices, *, bad_index_counter=None
    ):
        ut = self.unit_tokens
        units = host_indices.view(-1, ut)[:, 0].long() // ut
        picked = {name: records[name][units] for name in records}
        for i, x in enumerate(self.decode_reference(picked, self.device_dtype)):
            dst[i][device_indices.long()] = x.reshape(-1, *dst[i].shape[1:])

    def zero_copy_objects(self):
        n = {r.name: r.nbytes for r in self.records}
        keys = [("k", 0, n["k"])]
        if "k_lo" in n:
            keys.append(("k_lo", 0, n["k_lo"]))
        half = n["v"] // 2
        values = [("v", 0, half)]
        if "k_lo" in n:
            values.append(("v", half, n["v"] - half))
        else:
            values = [("v", 0, n["v"])]
        return [
            [*keys, ("unit_amax", 0, 4)],
            [*values, ("unit_amax", 4, 4)],
        ]
