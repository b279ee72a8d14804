"""int4c fused kernels (kv_int4c_triton) under the Triton interpreter, called
directly: staged one-layer backups (which k_lo slot) and bad arguments (round
trips and refused host indices: tests/test_host_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_int4c_triton as kc
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]
BF = torch.bfloat16


def setup(ut, d, key8=(), layers=2, lo_layers=None, seed=0):
    """(format, device rows, their tables, host records [1, layers, *shape] of
    0x5A (lo_layers given: one layer staged, k_lo holding lo_layers), the
    kernels' rotation arguments)."""
    f = host_format_cls("int4c")((d, d), 1, ut, BF, key8_layers=key8)
    g = torch.Generator().manual_seed(seed)
    sides = [[torch.randn(ut, 1, d, generator=g).to(BF) for _ in range(layers)]
             for _ in range(2)]  # fmt: skip
    out = {}
    for r in f.records:
        m = layers if r.layers is None else len(r.layers)
        if lo_layers is not None:
            m = lo_layers if r.name == "k_lo" else 1
        out[r.name] = torch.full((m * r.nbytes,), 0x5A, dtype=torch.uint8)
        out[r.name] = out[r.name].view(r.dtype).view(1, m, *r.shape)
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
