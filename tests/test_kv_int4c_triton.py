"""int4c fused kernels (kv_int4c_triton) under the Triton interpreter, called
directly, where they differ from every other format's: staged one-layer
backups (which k_lo slot), host indices outside the records and broken
per-channel runs, bad arguments. Every record byte and restored bit against
the format's reference, over unit sizes, 8-bit plan layers, BF16/FP16 and
NaN/Inf: tests/test_host_kernels.py; the reference against an independent
reading of the spec: tests/test_kv_int4c_codec.py."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_int4c_triton as kc
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
from tests.support.int4_reference import raw

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]
BF = torch.bfloat16


def setup(ut, d, key8=(), layers=2, units=1, lo_layers=None, seed=0, tokens=None):
    """(format, device rows, their tables, host records [units, layers, *shape]
    of 0x5A (lo_layers given: one layer staged, k_lo holding lo_layers), the
    kernels' rotation arguments)."""
    f = host_format_cls("int4c")((d, d), 1, ut, BF, key8_layers=key8)
    g = torch.Generator().manual_seed(seed)
    n = tokens or ut
    sides = [[torch.randn(n, 1, d, generator=g).to(BF) for _ in range(layers)]
             for _ in range(2)]  # fmt: skip
    out = {}
    for r in f.records:
        m = layers if r.layers is None else len(r.layers)
        if lo_layers is not None:
            m = lo_layers if r.name == "k_lo" else 1
        out[r.name] = torch.full((units * m * r.nbytes,), 0x5A, dtype=torch.uint8)
        out[r.name] = out[r.name].view(r.dtype).view(units, m, *r.shape)
    tables = tuple(hk.DeviceLayerTable(s) for s in sides)
    return f, sides, tables, out, f._kernel_options("cpu")


def test_staged_one_layer_backup_uses_its_own_slot():
    """A staged backup of one layer (first_layer = 1): k_lo holds that layer
    alone if it is a plan layer, no layer otherwise."""
    ut, d = 32, 64
    idx = torch.arange(ut)
    for first in (1, 2, 0):
        lo = int(first in (1, 2))
        f, sides, tables, out, rot = setup(ut, d, (1, 2), 3, lo_layers=lo, seed=3)
        kc.encode_gather(tables, idx, out, idx, first_layer=first, key8_layers=(1, 2),
                         **rot)  # fmt: skip
        x = [s[first].view(1, ut, 1, d) for s in sides]
        want = f.for_layer(first).encode_reference(x)
        assert torch.equal(out["k"][:, 0], want["k"])
        assert ("k_lo" in want) == bool(lo)
        if lo:
            assert torch.equal(out["k_lo"][:, 0], want["k_lo"])
    f, _, tables, out, rot = setup(ut, d, (1,), 3, lo_layers=0)
    with pytest.raises(ValueError, match="k_lo holds 0 layers"):
        kc.encode_gather(tables, idx, out, idx, first_layer=1, key8_layers=(1,), **rot)


@pytest.mark.parametrize("ut", (32, 4))
def test_out_of_range_host_indices_are_counted_not_written(ut):
    d = 64
    _, _, tables, out, rot = setup(ut, d, (1,), units=3, seed=ut, tokens=2 * ut)
    host_idx = torch.arange(2 * ut)
    host_idx[ut + 1] = 3 * ut  # past the 3 units
    host_idx[ut + 2] = -1
    before = {n: t.clone() for n, t in out.items()}
    bad = torch.zeros((), dtype=torch.int64)
    kc.encode_gather(tables, torch.arange(2 * ut), out, host_idx, key8_layers=(1,),
                     counters=hk.KVCounters(bad_indices=bad), **rot)  # fmt: skip
    # Per-channel keys: unit 1's run is broken, none of its keys written.
    assert int(bad) == (ut if ut >= 16 else 2)
    for name, t in out.items():
        assert torch.equal(raw(t[2]), raw(before[name][2])), name  # untouched
        assert not torch.equal(raw(t[0]), raw(before[name][0])), name
    if ut >= 16:
        for name in ("k", "k_range", "k_sub", "k_lo"):
            assert torch.equal(raw(out[name][1]), raw(before[name][1])), name
    bad.zero_()
    dst = [torch.full((2 * ut, 1, d), 7.0, dtype=BF) for _ in range(2)]
    one = {n: t[:, 0] for n, t in out.items() if n != "k_lo"}
    kc.decode_scatter(one, host_idx, dst, torch.arange(2 * ut),
                      bad_index_counter=bad, **rot)  # fmt: skip
    assert int(bad) == 2
    assert all((t[ut + 1 : ut + 3] == 7.0).all() for t in dst)
    assert not (dst[0][:ut] == 7.0).any()


def test_bad_arguments_fail_before_launch():
    ut, d = 32, 64
    _, _, tables, out, rot = setup(ut, d, layers=1)
    idx, signs = torch.arange(ut), rot["rotation_signs"]
    with pytest.raises(ValueError, match="does not divide the value group"):
        kc.encode_gather(tables, idx, out, idx, rotation_blocks=(0, 128),
                         rotation_signs=signs)  # fmt: skip
    with pytest.raises(ValueError, match="keys are not rotated"):
        kc.encode_gather(tables, idx, out, idx, rotation_blocks=(64, 64),
                         rotation_signs=signs)  # fmt: skip
    with pytest.raises(ValueError, match="whole units"):
        kc.encode_gather(tables, idx[:16], out, idx[:16], **rot)
    broken = dict(out, k_sub=out["k_sub"][..., :-1])
    with pytest.raises(ValueError, match="k_sub"):
        kc.encode_gather(tables, idx, broken, idx, **rot)
    with pytest.raises(ValueError, match="records must be"):
        kc.encode_gather(tables, idx, {**out, "k_scale": out["k"]}, idx, **rot)
