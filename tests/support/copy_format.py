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
        out = {
            "k": rows[0].contiguous().view(torch.int16).clone(),
            "v": rows[1].contiguous().view(torch.int16).clone(),
            "unit_amax": torch.stack([self._unit_amax(x) for x in rows], dim=-1),
        }
        return out

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
        for i, side in enumerate(self.sides):
            out[i].copy_(records[side].view(out[i].dtype))

    def error_bound(self, records, restored):
        return tuple(torch.zeros(r.shape) for r in restored)

    # A torch stand-in for fused kernels, with the kernels' contract: tables
    # of all layers, out as [unit, layer, ...] views, indices on the device.
    def fused_available(self, device):
        return True

    def encode_gather(
        self,
        tables,
        device_indices,
        out,
        host_indices,
        *,
        counters=None,
        first_layer=0,
    ):
        amax = None if counters is None else counters.amax
        ut = self.unit_tokens
        units = host_indices.view(-1, ut)[:, 0].long() // ut
        for layer in range(next(iter(out.values())).shape[1]):
            src = first_layer + layer
            rows = [
                t.layers[src][device_indices.long()].view(-1, ut, *t.shape[1:])
                for t in tables
            ]
            encoded = self.encode_reference(rows)
            for name, value in encoded.items():
                out[name][units, layer] = value
            if amax is not None:
                torch.maximum(
                    amax[src], encoded["unit_amax"].amax(dim=0), out=amax[src]
                )

    def decode_scatter(
        self, records, host_indices, dst, device_indices, *, bad_index_counter=None
    ):
        ut = self.unit_tokens
        units = host_indices.view(-1, ut)[:, 0].long() // ut
        for i, side in enumerate(self.sides):
            rows = records[side][units].view(dst[i].dtype)
            dst[i][device_indices.long()] = rows.reshape(-1, *dst[i].shape[1:])

    def zero_copy_objects(self):
        k, v, amax = (r.nbytes for r in self.records)
        return [[("k", 0, k), ("unit_amax", 0, 4)], [("v", 0, v), ("unit_amax", 4, 4)]]
