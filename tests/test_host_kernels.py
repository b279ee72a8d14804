"""Fused kernels of every host format (encode_gather / decode_scatter) under the
Triton interpreter, one table: every record byte and restored bit against the
format's reference, layouts, indices, dtypes, tiles; refused host indices."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, KVCounters
from tests.support.codec_inputs import DTYPES
from tests.support.fp8_reference import FP8, fp8_id
from tests.support.int4_reference import Host, raw
from tests.support.kernel_cases import big_tiles, run_case

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]
BF, FP = torch.bfloat16, torch.float16
ROTATED = ("int4r", "k8v4r")
# Every format with kernels; "mla-int8": MLA INT8 (one side, latent + RoPE).
FORMATS = ("int4", "k8v4", *ROTATED, "int8", "int8c", "int4c", "mla-int8")
# Per format: its constructor keywords (int4c: 8-bit keys on layer 1 of 2).
GEOMETRY = {"int4c": {"key8_layers": (1,)}}


@pytest.fixture(autouse=True)
def _big_tiles(monkeypatch):
    big_tiles(monkeypatch)


# Per format: (dims, heads, units at 1 token, units otherwise, layers at 64).
PAGE_CASES = {
    "int4": ((64, 64), 2, 24, 3, 2),
    "k8v4": ((64, 64), 2, 24, 3, 2),
    "int4r": ((128, 128), 2, 20, 2, 1),  # one 128-point block over two groups
    "k8v4r": ((128, 128), 2, 20, 2, 1),
    "int8": ((128, 128), 2, 24, 3, 2),
    "int8c": ((128, 128), 2, 24, 3, 1),  # per-channel keys at 64
    "int4c": ((64, 128), 2, 24, 3, 2),  # one 128-value rotation block
    "mla-int8": ((576,), 1, 16, 3, 2),  # DeepSeek's 512 + 64
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ut", (1, 16, 64))
def test_round_trip_page_sizes(fmt, ut, dtype):
    dims, H, single, multi, layers64 = PAGE_CASES[fmt]
    f, _, _ = run_case(
        fmt, ut=ut, H=H, dims=dims, dtype=dtype, n_units=multi if ut > 1 else single,
        layers=layers64 if ut == 64 else 2, seed=ut, geometry=GEOMETRY.get(fmt),
    )  # fmt: skip
    if fmt in ROTATED:
        assert f.rotation_blocks == ((128 if fmt == "int4r" else 0), 128)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_layer_first_views_and_index_dtypes(fmt, index_dtype):
    dims, H, single, _, _ = PAGE_CASES[fmt]
    run_case(
        fmt, ut=1, H=H, dims=dims, layer_first=True, n_units=min(single, 16),
        index_dtype=index_dtype, dtype=FP, seed=5, geometry=GEOMETRY.get(fmt),
    )  # fmt: skip


@pytest.mark.parametrize("fmt", ("int4", "k8v4", "int8", "int8c", "int4c"))
def test_per_token_keys_any_token_order(fmt):
    """Per-token units (int4/int4c below 16 tokens, int8c below 64) take host
    slots in any order."""
    run_case(fmt, ut=4, n_units=4, token_shuffle=True, seed=2,
             geometry=GEOMETRY.get(fmt))  # fmt: skip


# (format, unit tokens, heads, dims, dtype, tile, rotation blocks): groups of
# 64, 32 and whole heads (80, 48), head dims that aren't powers of two,
# per-channel keys in channel blocks of a small tile (holding whole rotation
# blocks), small tiles splitting rows; rotation blocks of 128, 64, 32 and 16
# inside a whole-head group, none at all (72: the base bytes); int8c's key
# modes over whole and partial 32-channel groups; int4c's 32-token sub-units
# in channel blocks, one sub-unit of 48 and 24 tokens, value blocks of 128,
# 32 and 16 (in a whole-head group of 80) or none (72), per-token keys of 32
# channels (8-bit on layer 1); MLA latents of 1-2 tiles.
HEAD_DIM_CASES = [
    ("int4", 16, 1, (128, 128), BF, 512, None),
    ("int4", 2, 1, (128, 128), BF, None, None),
    ("int4", 16, 3, (96, 96), BF, 512, None),
    ("int4", 2, 3, (96, 96), BF, None, None),
    ("int4", 16, 2, (80, 48), BF, 512, None),
    ("int4", 2, 2, (80, 48), BF, None, None),
    ("int4", 16, 1, (192, 128), BF, 512, None),
    ("int4", 2, 1, (192, 128), BF, None, None),
    ("int4", 16, 2, (64, 64), BF, 256, None),
    ("k8v4", 4, 2, (64, 64), BF, 128, None),
    ("int4r", 16, 2, (64, 64), BF, 512, (64, 64)),
    ("int4r", 2, 3, (64, 64), BF, None, (64, 64)),
    ("k8v4r", 16, 2, (64, 64), BF, 256, (0, 64)),
    ("int4r", 16, 2, (96, 96), BF, 512, (32, 32)),
    ("int4r", 2, 3, (96, 96), BF, None, (32, 32)),
    ("k8v4r", 16, 2, (96, 96), BF, 256, (0, 32)),
    ("int4r", 16, 2, (80, 48), BF, 512, (16, 16)),
    ("int4r", 2, 3, (80, 48), BF, None, (16, 16)),
    ("k8v4r", 16, 2, (80, 48), BF, 256, (0, 16)),
    ("int4r", 16, 2, (72, 72), BF, None, (0, 0)),
    ("int8", 4, 2, (64, 32), BF, 256, None),
    ("int8", 1, 3, (192, 128), FP, None, None),
    ("int8c", 64, 2, (128, 128), BF, None, None),
    ("int8c", 64, 1, (256, 256), FP, None, None),
    ("int8c", 128, 1, (64, 96), BF, None, None),
    ("int8c", 16, 2, (128, 64), FP, None, None),
    ("int8c", 1, 3, (64, 64), BF, None, None),
    ("int8c", 4, 2, (80, 48), BF, None, None),
    ("int4c", 64, 1, (128, 256), BF, 512, (0, 128)),
    ("int4c", 48, 1, (64, 96), FP, None, (0, 32)),
    ("int4c", 24, 2, (80, 80), BF, None, (0, 16)),
    ("int4c", 16, 1, (64, 72), BF, None, (0, 0)),
    ("int4c", 4, 2, (96, 64), BF, 256, (0, 64)),
    ("mla-int8", 2, 1, (192,), BF, None, None),
    ("mla-int8", 2, 1, (320,), BF, 256, None),
]


@pytest.mark.parametrize("fmt,ut,H,dims,dtype,tile,blocks", HEAD_DIM_CASES)
def test_head_dims_groups_and_tiles(fmt, ut, H, dims, dtype, tile, blocks):
    f, _, _ = run_case(
        fmt, ut=ut, H=H, dims=dims, dtype=dtype,
        n_units=2 if ut >= 16 else 3 if ut > 1 else 12,
        layers=1 if fmt in ("int4", "k8v4", *ROTATED) else 2,
        tile=tile, seed=dims[0] + ut, geometry=GEOMETRY.get(fmt),
    )  # fmt: skip
    if blocks is not None:
        assert f.rotation_blocks == blocks


# int4c's plan and sub-units beyond GEOMETRY's 8-bit layer 1: (unit tokens,
# heads, dims, 8-bit key layers, dtype, tile, index dtype): one 32-token
# sub-unit with no plan, three in a padded tile, 8-bit keys on every layer,
# one 24-token sub-unit of 32-channel heads, several key programs per head
# (a small tile) with int32 indices.
INT4C_PLAN_CASES = [
    (32, 1, (64, 128), (), BF, None, torch.int64),
    (96, 1, (32, 256), (1,), BF, None, torch.int64),
    (64, 2, (64, 64), (0, 1), FP, None, torch.int64),
    (24, 1, (32, 32), (0,), FP, None, torch.int64),
    (64, 1, (128, 128), (0,), BF, 1024, torch.int32),
]


@pytest.mark.parametrize("ut,H,dims,key8,dtype,tile,index_dtype", INT4C_PLAN_CASES)
def test_int4c_plan_layers_and_sub_units(ut, H, dims, key8, dtype, tile, index_dtype):
    run_case(
        "int4c", ut=ut, H=H, dims=dims, dtype=dtype, n_units=2, tile=tile,
        index_dtype=index_dtype, seed=ut, geometry={"key8_layers": key8},
    )  # fmt: skip


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", ("int4", "k8v4"))
@pytest.mark.parametrize(
    "ut,layer_first", [(1, True), (4, False), (16, False), (64, False)]
)
def test_fp8_round_trip(fmt, ut, layer_first, fp8):
    """FP8 rows (every finite byte, NaN, E5M2's Inf, values rounded to FP8)
    encode to the reference's records and restore to its FP8 bytes."""
    run_case(
        fmt, ut=ut, dtype=fp8, layer_first=layer_first,
        n_units=16 if ut == 1 else 3, seed=ut + 100 * layer_first,
    )  # fmt: skip


# --- host indices the kernels refuse (default tiles, as the pools launch) -------


def refusal_setup(monkeypatch, fmt, ut, n_units):
    """(format, device tables, host of n_units + 1 units, its copy) at the
    default tiles, two layers of random bf16 rows."""
    monkeypatch.undo()  # the default tiles
    g = torch.Generator().manual_seed(ut)
    host = Host(fmt, n_units + 1, 2, ut, 2, 64, 64, geometry=GEOMETRY.get(fmt))
    rows = [[torch.randn(n_units * ut, 2, 64, generator=g).to(BF) for _ in "LL"]
            for _ in "KV"]  # fmt: skip
    f = host.format(BF)
    per_channel = getattr(f, "keys_per_channel", False) or getattr(f, "sub_tokens", 0)
    return f, [DeviceLayerTable(s) for s in rows], host, host.clone(), per_channel


@pytest.mark.parametrize(
    "fmt,ut,index_dtype",
    [(f, ut, i) for f, ut in (("int4", 16), ("int4", 4), ("k8v4", 16))
     for i in (torch.int32, torch.int64)]
    + [("int4c", 32, torch.int64), ("int4c", 4, torch.int64),
       ("int8c", 64, torch.int64), ("int8c", 1, torch.int64)],
)  # fmt: skip
def test_out_of_range_host_indices_are_counted_not_written(
    monkeypatch, fmt, ut, index_dtype
):
    """Host indices past the records or negative are counted, not written (a
    per-channel key unit holding one loses its keys); restores skip them."""
    n_units = max(2, 4 // ut)
    f, tables, host, before, per_channel = refusal_setup(monkeypatch, fmt, ut, n_units)
    n = n_units * ut
    host_idx = torch.arange(n)
    host_idx[ut + 1] = (n_units + 1) * ut  # one token of unit 1 past the end
    host_idx[ut + 2] = -1
    dev_idx = torch.arange(n).to(index_dtype)
    bad = torch.zeros((), dtype=torch.int64)
    f.encode_gather(tables, dev_idx, host.all_layers(), host_idx.to(index_dtype),
                    counters=KVCounters(bad_indices=bad))  # fmt: skip
    assert int(bad) == (ut if per_channel else 2)
    want = before.clone()
    want.fill_reference([t.layers for t in tables], torch.arange(ut), torch.tensor([0]))
    for name, buf in host.bufs.items():
        assert torch.equal(raw(buf[0]), raw(want.bufs[name][0])), name  # unit 0
        assert torch.equal(raw(buf[-1]), raw(before.bufs[name][-1])), name
        if ut == 1:
            continue
        unit1, old = raw(buf[1]), raw(before.bufs[name][1])
        if per_channel and name.startswith("k"):
            assert torch.equal(unit1, old), name  # the broken run's keys
        else:  # per-token records: tokens 1 and 2 of unit 1 never written
            assert torch.equal(unit1[:, 1:3], old[:, 1:3]), name
            assert not torch.equal(unit1[:, 0], old[:, 0]), name
    bad.zero_()
    dst = [torch.full((n, 2, 64), 7.0, dtype=BF) for _ in range(2)]
    f.decode_scatter(host.layer(0), host_idx.to(index_dtype), dst, dev_idx,
                     bad_index_counter=bad)  # fmt: skip
    assert int(bad) == 2
    assert all((t[ut + 1 : ut + 3] == 7.0).all() for t in dst)
    assert not (dst[0][:ut] == 7.0).any()


@pytest.mark.parametrize("fmt,ut", [("int4", 16), ("int8c", 64), ("int4c", 32)])
def test_per_channel_runs_not_one_unit_in_order_write_no_keys(monkeypatch, fmt, ut):
    """Per-channel keys need each run of UT tokens to be one host unit in
    order: reversed, two tokens swapped, or starting mid-unit, the run's keys
    are not written and its tokens counted; its values still are."""
    f, tables, host, before, _ = refusal_setup(monkeypatch, fmt, ut, 2)
    swapped = torch.arange(ut, 2 * ut)
    swapped[[1, 2]] = swapped[[2, 1]]
    for dev, host_idx in (
        (torch.arange(2 * ut), torch.cat([torch.arange(ut), swapped.flip(0)])),
        (torch.arange(ut), swapped),
        (torch.arange(ut), torch.arange(ut // 2, ut // 2 + ut)),
    ):
        bad = torch.zeros((), dtype=torch.int64)
        f.encode_gather(tables, dev, host.all_layers(), host_idx,
                        counters=KVCounters(bad_indices=bad))  # fmt: skip
        assert int(bad) == ut
        for name, buf in host.bufs.items():
            if name.startswith("k"):
                assert torch.equal(raw(buf[1]), raw(before.bufs[name][1])), name
    assert not torch.equal(host.bufs["k"][0], before.bufs["k"][0])
    assert not torch.equal(host.bufs["v"][1], before.bufs["v"][1])
