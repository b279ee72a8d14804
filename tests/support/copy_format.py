"""A lossless toy host format, registered by tests through the registry alone: K and V
rows as their 16-bit patterns, plus one per-unit record (amax of the unit's finite K and
V rows, fp32) with no token axis, like per-page key scales."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host.host_format import (
    EncodeStats,
    HostDtype,
    HostKVFormat,
    HostRecord,
)

ENTRY = HostDtype(
    "copy",
    mha_format="tests.support.copy_format:CopyHostFormat",
    mla_format=None,
    help="lossless toy format (tests)",
)


class CopyHostFormat(HostKVFormat):
    name = "copy"
    storage_format_tag = "copy-test-v1"
    sides = ("k", "v")

    def __init__(self, dims, head_num, unit_tokens, device_dtype):
        super().__init__(dims, head_num, unit_tokens, device_dtype)
        ut, heads = self.unit_tokens, self.head_num
        self.records = (
            HostRecord("k", (ut, heads, self.dims[0]), torch.int16),
            HostRecord("v", (ut, heads, self.dims[1]), torch.int16),
            HostRecord("unit_amax", (2,), torch.float32),
        )

    def encode_reference(self, rows):
        return {
            "k": rows[0].contiguous().view(torch.int16).clone(),
            "v": rows[1].contiguous().view(torch.int16).clone(),
            "unit_amax": torch.stack([self._unit_amax(x) for x in rows], dim=-1),
        }

    @staticmethod
    def _unit_amax(x):
        xf = x.float().flatten(1)
        return torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax(dim=1)

    def decode_reference(self, records, dtype):
        return tuple(records[side].view(dtype).clone() for side in self.sides)

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
        return tuple(torch.zeros(r.shape) for r in restored)

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
        k, v, amax = (r.nbytes for r in self.records)
        return [[("k", 0, k), ("unit_amax", 0, 4)], [("v", 0, v), ("unit_amax", 4, 4)]]
