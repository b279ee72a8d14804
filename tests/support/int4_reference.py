"""What the kernel tests compare with: the INT4 / K8V4 codec's reference and an
independent step-by-step reading of its spec (spec_records / spec_decode), and
a host "pool" of any format's records as the pools lay them out (Host)."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host import kv_int8_codec as int8_codec
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

K_CHANNEL_MIN_TOKENS = 16
FP16_NAN_BITS = 0x7E00


def group_size(dim: int) -> int:
    return 64 if dim % 64 == 0 else 32 if dim % 32 == 0 else dim


def quantize_groups(x: torch.Tensor):
    """Groups along the last dim -> (codes [..., n] int64, s fp16, m fp16,
    non-finite flags, max(|lo|, |hi|))."""
    xf = x.float()
    lo, hi = xf.amin(-1), xf.amax(-1)
    m16 = lo.to(torch.float16)
    m16 = torch.where(m16 == 0, 0.0, m16)  # +0: min(-0, +0) may be either
    m = m16.float()
    s32 = ((hi - m) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    s16 = s32.to(torch.float16)
    s16 = (s16.view(torch.int16) + (s16.float() < s32)).view(torch.float16)
    bad = ~torch.isfinite(xf).all(-1) | ~torch.isfinite(m16) | ~torch.isfinite(s16)
    q = torch.round((xf - m[..., None]) / s16.float()[..., None]).clamp(0, 15)
    q = q.masked_fill(bad[..., None], 0).to(torch.int64)
    nan16 = torch.tensor(FP16_NAN_BITS, dtype=torch.int16).view(torch.float16)
    s16 = torch.where(bad, nan16, s16)
    m16 = torch.where(bad, nan16, m16)
    return q, s16, m16, bad, torch.maximum(lo.abs(), hi.abs())


def pack(q: torch.Tensor) -> torch.Tensor:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def encode_side_per_token(x, group):
    """x [U, UT, H, D] -> (codes, meta [U, UT, H, D/G, 2], stats)."""
    U, UT, H, D = x.shape
    q, s, m, bad, amax = quantize_groups(x.reshape(U, UT, H, D // group, group))
    return pack(q.reshape(U, UT, H, D)), torch.stack([s, m], -1), bad, amax


def encode_keys_per_channel(x):
    """x [U, UT, H, D] -> (codes, meta [U, H, D, 2], stats): one group per
    channel over the unit's tokens."""
    q, s, m, bad, amax = quantize_groups(x.permute(0, 2, 3, 1))
    return pack(q.permute(0, 3, 1, 2)), torch.stack([s, m], -1), bad, amax


def spec_records(fmt, k, v):
    """One layer's rows k, v [U, UT, H, D] -> (records [U, *shape], non-finite
    groups, amax (K, V)), by the spec read step by step."""
    records, bads, amaxes = {}, [], []
    if fmt == "k8v4":
        q, scale = int8_codec.quantize_reference(k)
        records["k"], records["k_scale"] = q, scale
        bads.append(torch.isnan(scale))
        finite = k.float().abs().amax(-1)
        amaxes.append(finite[~torch.isnan(scale)])
    else:
        ut = k.shape[1]
        if ut >= K_CHANNEL_MIN_TOKENS:
            codes, meta, bad, amax = encode_keys_per_channel(k)
        else:
            codes, meta, bad, amax = encode_side_per_token(k, group_size(k.shape[-1]))
        records["k"], records["k_meta"] = codes, meta
        bads.append(bad)
        amaxes.append(amax[~bad])
    codes, meta, bad, amax = encode_side_per_token(v, group_size(v.shape[-1]))
    records["v"], records["v_meta"] = codes, meta
    bads.append(bad)
    amaxes.append(amax[~bad])
    stats = [float(a.max()) if a.numel() else 0.0 for a in amaxes]
    return records, int(sum(int(b.sum()) for b in bads)), stats


def dequantize(codes, meta, group_of_channel, dtype):
    """codes [..., D/2] packed, meta (s, m) per channel via group_of_channel."""
    q = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).float()
    s, m = meta[..., 0].float(), meta[..., 1].float()
    y = group_of_channel(m) + q * group_of_channel(s)
    top = torch.finfo(dtype).max
    return y.clamp(-top, top).to(dtype)


def spec_decode(fmt, records, dtype):
    """One layer's records [U, *shape] -> (k, v) rows [U, UT, H, D], by the
    spec read step by step."""
    v_codes, v_meta = records["v"], records["v_meta"]
    ut = v_codes.shape[1]

    def per_token(codes, meta):
        group = 2 * codes.shape[-1] // meta.shape[-2]
        return lambda t: t.repeat_interleave(group, -1)

    v = dequantize(v_codes, v_meta, per_token(v_codes, v_meta), dtype)
    if fmt == "k8v4":
        k = int8_codec.dequantize_reference(records["k"], records["k_scale"], dtype)
    elif records["k_meta"].dim() == 4:  # per-channel [U, H, D, 2]
        k = dequantize(
            records["k"], records["k_meta"],
            lambda t: t[:, None].expand(-1, ut, -1, -1), dtype,
        )  # fmt: skip
    else:
        k_codes, k_meta = records["k"], records["k_meta"]
        k = dequantize(k_codes, k_meta, per_token(k_codes, k_meta), dtype)
    return k, v


def reference_records(fmt, k, v):
    """One layer's rows k, v [U, UT, H, D] -> (the codec reference's records
    [U, *shape], non-finite groups, amax (K, V))."""
    encode = {"int4": codec.int4_encode_reference, "k8v4": codec.k8v4_encode_reference}
    _, bad, stats = spec_records(fmt, k, v)
    return encode[fmt](k, v), bad, stats


def reference_decode(fmt, records, dtype):
    """One layer's records [U, *shape] -> the codec reference's (k, v)."""
    decode = {"int4": codec.int4_decode_reference, "k8v4": codec.k8v4_decode_reference}
    return decode[fmt](records, dtype)


# --- a host "pool": one buffer per record -------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t


class Host:
    """Host records of any format as the pool lays them out: page-major
    [units, L, *shape] or layer_first [L, units, *shape] (unit = 1 token),
    sentinel-filled; a record stored on some layers only (a per-layer plan)
    has just those layers, in order. dims: (dk, dv), or (dk,) for MLA;
    geometry: the format's constructor keywords (int4c's key8_layers)."""

    def __init__(self, fmt, units, layers, ut, H, dk, dv=None, layer_first=False,
                 kind="mha", dtype=torch.bfloat16, geometry=None):  # fmt: skip
        assert not layer_first or ut == 1
        self.fmt, self.kind, self.ut, self.layer_first = fmt, kind, ut, layer_first
        self.H, self.dims = H, (dk,) if dv is None else (dk, dv)
        self.geometry = dict(geometry or {})
        self.bufs, self.stored = {}, {}
        for r in self.format(dtype).records:
            n = layers if r.layers is None else len(r.layers)
            lead = (n, units) if layer_first else (units, n)
            buf = torch.empty(*lead, *r.shape, dtype=r.dtype)
            raw(buf).fill_(0x5A)
            self.bufs[r.name] = buf
            self.stored[r.name] = r.layers

    def format(self, dtype):
        cls = host_format_cls(self.fmt, self.kind)
        return cls(self.dims, self.H, self.ut, dtype, **self.geometry)

    def slot(self, name, layer):
        """The layer's index in record `name`'s buffer, None if not stored."""
        layers = self.stored[name]
        if layers is None:
            return layer
        return layers.index(layer) if layer in layers else None

    def reference(self, rows, layer=0):
        """(records, non-finite groups, amax per side) of rows [U, UT, H, D]:
        int4/k8v4 by the codec's reference and the spec's statistics, other
        formats by their (layer's) format object and its torch path's
        statistics."""
        if self.fmt in ("int4", "k8v4"):
            return reference_records(self.fmt, *rows)
        fmt = self.format(rows[0].dtype).for_layer(layer)
        records = fmt.encode_reference(rows)
        scratch = {n: torch.empty_like(t) for n, t in records.items()}
        stats = fmt.encode_into(rows, scratch)
        return records, int(stats.nonfinite), stats.amax.tolist()

    def decode(self, records, dtype, layer=0):
        """The reference's restored rows per side of records [U, *shape]."""
        if self.fmt in ("int4", "k8v4"):
            return reference_decode(self.fmt, records, dtype)
        return self.format(dtype).for_layer(layer).decode_reference(records, dtype)

    def all_layers(self):
        """[units, L, *shape] views (encode)."""
        return {
            n: b.transpose(0, 1) if self.layer_first else b
            for n, b in self.bufs.items()
        }

    def layer(self, layer):
        """[units, *shape] views of one layer's records (decode)."""
        views = {}
        for n, b in self.bufs.items():
            i = self.slot(n, layer)
            if i is not None:
                views[n] = b[i] if self.layer_first else b[:, i]
        return views

    def fill_reference(self, sides, dev, units):
        """Write the reference records of rows `dev` of every layer (sides[i]:
        side i's layers), unit by unit, at host `units`; return (non-finite
        groups, amax [L, sides])."""
        n_units, ut = len(units), self.ut
        views, bad_total = self.all_layers(), 0
        amax = torch.zeros(len(sides[0]), len(sides))
        for layer, layer_rows in enumerate(zip(*sides)):
            rows = [x[dev].view(n_units, ut, *x.shape[1:]) for x in layer_rows]
            records, bad, stats = self.reference(rows, layer)
            bad_total += bad
            amax[layer] = torch.tensor(stats)
            for name, rec in records.items():
                views[name][units, self.slot(name, layer)] = rec
        return bad_total, amax

    def clone(self):
        other = object.__new__(Host)
        other.__dict__.update(self.__dict__)
        other.bufs = {n: b.clone() for n, b in self.bufs.items()}
        return other


def assert_same_records(got: Host, want: Host):
    for name in want.bufs:
        a, b = got.bufs[name], want.bufs[name]
        assert a.dtype == b.dtype and torch.equal(raw(a), raw(b)), name
