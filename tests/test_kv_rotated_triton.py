"""Fused kernels of the rotated host formats (int4r, k8v4r): kv_int4_triton
with the Walsh-Hadamard rotation inside its tiles (kv_hadamard_triton), under
the Triton interpreter, against the format's own reference
(host_format_cls(name, "mha").encode_reference / decode_reference): every
record byte and every restored bit (NaN: position), bf16 and fp16, page
sizes 1/16/64 (keys per token and per channel), head dims of one block, of a
block wider than a group (128: two groups of 64) and not powers of two (96:
three blocks of 32; 80: five blocks of 16 in one group), NaN/Inf rows, and
the statistics (non-finite groups, amax) the torch path reports.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from tests.support.int4_reference import Host, assert_same_records
from tests.support.codec_inputs import DTYPES, assert_same_bits

from sglang.kernels.ops.kvcache import kv_hadamard_triton as hr
from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.pool_host import kv_hadamard
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

BASE = {"int4r": "int4", "k8v4r": "k8v4"}
NAN, INF = float("nan"), float("inf")
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]


@pytest.fixture
def big_tiles(monkeypatch):
    """Fewer, larger programs (the interpreter's cost is per program)."""
    monkeypatch.setattr(k4, "ENCODE_TILE", 16384)
    monkeypatch.setattr(k4, "DECODE_TILE", 16384)


def fill_rows(x: torch.Tensor, seed: int, nan_row: int, inf_row: int) -> None:
    """Rows over magnitudes with an outlier channel, one NaN and one -Inf.
    Every other row mixes magnitudes 2**-16..2**8 channel by channel, so the
    butterfly's fp32 sums round (rows of one magnitude sum exactly in any
    order, and would not tell the stage order apart)."""
    g = torch.Generator().manual_seed(seed)
    n, H, D = x.shape
    mags = 2.0 ** torch.randint(-10, 8, (n, H, 1), generator=g).double()
    mixed = 2.0 ** torch.randint(-16, 8, (n, H, D), generator=g).double()
    mags = torch.where(torch.arange(n)[:, None, None] % 2 == 1, mixed, mags)
    vals = torch.randn(n, H, D, generator=g, dtype=torch.float64) * mags
    vals[:, :, 3] *= 20
    x.copy_(vals.to(x.dtype))
    x[nan_row, 0, 5] = NAN
    x[inf_row, H - 1, D - 1] = -INF


# --- the butterfly alone, in fp32 ---------------------------------------------


@triton.jit
def _rotate_rows(x_ptr, sign_ptr, y_ptr, R: tl.constexpr, D: tl.constexpr,
                 D_PAD: tl.constexpr, B: tl.constexpr, DECODE: tl.constexpr):  # fmt: skip
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, D_PAD)[None, :]
    mask = (c < D) & (r >= 0)
    x = tl.load(x_ptr + r * D + c, mask=mask, other=0.0)
    signs = tl.load(sign_ptr + c, mask=c < D, other=0.0)
    if DECODE:
        y = hr.unrotate(x, signs, B)
    else:
        y = hr.rotate(x, signs, B)
    tl.store(y_ptr + r * D + c, y, mask=mask)


@pytest.mark.parametrize("dim", (16, 64, 128, 256, 96, 80), ids=lambda d: f"d{d}")
def test_butterfly_is_the_reference_bit_for_bit(dim):
    """kv_hadamard_triton.rotate/unrotate on fp32 rows whose channels mix
    magnitudes 2**-30..2**30 (so the sums round and the stage order shows),
    with -0, NaN and Inf: the bits of kv_hadamard's reference."""
    g = torch.Generator().manual_seed(dim)
    rows = 8
    mags = 2.0 ** torch.randint(-30, 30, (rows, dim), generator=g).float()
    x = torch.randn(rows, dim, generator=g) * mags
    x[1] = -0.0
    x[2, dim // 2] = NAN
    x[3, 1] = INF
    x[4] = x[4].round()  # exact sums: ties and zeros of both signs
    block = kv_hadamard.rotation_block(dim)
    signs = kv_hadamard.rotation_signs(dim)
    for decode, reference in (
        (False, kv_hadamard.rotate_reference),
        (True, kv_hadamard.unrotate_reference),
    ):
        y = torch.full_like(x, 7.0)
        _rotate_rows[(1,)](x, signs, y, rows, dim, k4.hk.pow2(dim), block, decode)
        want = reference(x, block)
        assert torch.equal(torch.isnan(y), torch.isnan(want))
        assert torch.equal(
            y.nan_to_num(0).view(torch.int32), want.nan_to_num(0).view(torch.int32)
        ), "decode" if decode else "encode"


# --- kernel round trips ---------------------------------------------------------


def run_case(
    name, *, ut, H=2, dk=64, dv=64, layers=2, n_units=3, dtype=torch.bfloat16,
    layer_first=False, index_dtype=torch.int64, tile=None, seed=0,
):  # fmt: skip
    """One encode_gather of n_units units from shuffled device rows into
    fragmented host units, against the format's reference per layer; then a
    decode_scatter per layer into shuffled slots for both output dtypes."""
    g = torch.Generator().manual_seed(seed)
    fmt = host_format_cls(name, "mha")((dk, dv), H, ut, dtype)
    rotation = fmt._kernel_rotation("cpu")
    size = 2 * n_units * ut + 8
    n = n_units * ut
    dev = torch.randperm(size, generator=g)[:n]
    k_layers = [torch.empty(size, H, dk, dtype=dtype) for _ in range(layers)]
    v_layers = [torch.empty(size, H, dv, dtype=dtype) for _ in range(layers)]
    for i, t in enumerate(k_layers + v_layers):
        fill_rows(t, seed * 31 + i, int(dev[i % n]), int(dev[(3 * i + 1) % n]))
    host_units = 2 * n_units + 1
    units = torch.randperm(host_units, generator=g)[:n_units]
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    host = Host(BASE[name], host_units, layers, ut, H, dk, dv, layer_first)
    want = host.clone()
    counter = torch.zeros((), dtype=torch.int64)
    amax = torch.zeros(layers, 2)
    k4.encode_gather(
        (k4.DeviceLayerTable(k_layers), k4.DeviceLayerTable(v_layers)),
        dev.to(index_dtype), host.all_layers(), host_idx.to(index_dtype),
        counters=KVCounters(counter, amax), tile=tile, **rotation,
    )  # fmt: skip

    want_views, want_bad, want_amax = want.all_layers(), 0, torch.zeros(layers, 2)
    for layer in range(layers):
        k = k_layers[layer][dev].view(n_units, ut, H, dk)
        v = v_layers[layer][dev].view(n_units, ut, H, dv)
        records = fmt.encode_reference((k, v))
        scratch = {name: torch.empty_like(rec) for name, rec in records.items()}
        stats = fmt.encode_into((k, v), scratch)  # the torch path's statistics
        want_bad += int(stats.nonfinite)
        want_amax[layer] = stats.amax
        for rec_name, rec in records.items():
            want_views[rec_name][units, layer] = rec
    assert_same_records(host, want)
    assert int(counter) == want_bad > 0
    assert torch.equal(amax, want_amax)

    for out_dtype in DTYPES:
        new_dev = torch.randperm(size, generator=g)[:n]
        out_fmt = host_format_cls(name, "mha")((dk, dv), H, ut, out_dtype)
        for layer in range(layers):
            k_dst = torch.full((size, H, dk), 7.0, dtype=out_dtype)
            v_dst = torch.full((size, H, dv), 7.0, dtype=out_dtype)
            k4.decode_scatter(
                host.layer(layer), host_idx.to(index_dtype), (k_dst, v_dst),
                new_dev.to(index_dtype), tile=tile, **rotation,
            )  # fmt: skip
            records = {n_: r[units] for n_, r in host.layer(layer).items()}
            k_ref, v_ref = out_fmt.decode_reference(records, out_dtype)
            assert_same_bits(k_dst[new_dev], k_ref.reshape(n, H, dk))
            assert_same_bits(v_dst[new_dev], v_ref.reshape(n, H, dv))
            # NaN and -Inf inputs never come back finite.
            for src, dst in ((k_layers[layer], k_dst), (v_layers[layer], v_dst)):
                bad_in = ~torch.isfinite(src[dev])
                assert bad_in.any() and torch.isnan(dst[new_dev][bad_in]).all()
            untouched = torch.ones(size, dtype=torch.bool)
            untouched[new_dev] = False
            assert (k_dst[untouched] == 7.0).all() and (v_dst[untouched] == 7.0).all()
    return fmt


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("dtype", DTYPES, ids=("bf16", "fp16"))
@pytest.mark.parametrize("name", BASE)
@pytest.mark.parametrize("ut", (1, 16, 64))
def test_round_trip_page_sizes(name, ut, dtype):
    """Head dim 128: one 128-point block over two value groups of 64."""
    fmt = run_case(
        name, ut=ut, dk=128, dv=128, dtype=dtype, n_units=2 if ut > 1 else 20,
        layers=1 if ut == 64 else 2, seed=ut,
    )  # fmt: skip
    assert fmt.rotation_blocks == ((128 if name == "int4r" else 0), 128)


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("name", BASE)
def test_layer_first_views_and_int32_indices(name):
    run_case(
        name, ut=1, layer_first=True, n_units=12, index_dtype=torch.int32,
        dtype=torch.float16, seed=5,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dims,blocks",
    [((64, 64), (64, 64)), ((96, 96), (32, 32)), ((80, 48), (16, 16))],
    ids=("d64", "d96", "d80v48"),
)
def test_head_dims_blocks_and_groups(dims, blocks):
    """One block per group (64), blocks of 32 in groups of 32 (96), blocks of
    16 inside a whole-head group (80, 48); per-channel keys in channel blocks
    of a small tile (each holding whole rotation blocks) and per-token keys."""
    dk, dv = dims
    fmt = run_case("int4r", ut=16, H=2, dk=dk, dv=dv, n_units=2, layers=1, tile=512)
    assert fmt.rotation_blocks == blocks
    run_case("int4r", ut=2, H=3, dk=dk, dv=dv, n_units=3, layers=1, seed=dv)
    run_case("k8v4r", ut=16, H=2, dk=dk, dv=dv, n_units=2, layers=1, tile=256)


def test_unrotated_fallback_dims_are_the_base_kernels():
    """Head dim 72 has no block of 16 or more: blocks (0, 0), the base
    format's bytes."""
    fmt = run_case("int4r", ut=16, dk=72, dv=72, n_units=1, layers=1)
    assert fmt.rotation_blocks == (0, 0)


def test_rotation_arguments_checked():
    fmt = host_format_cls("int4r", "mha")((64, 64), 1, 16, torch.bfloat16)
    host = Host("int4", 2, 1, 16, 1, 64, 64)
    rows = [torch.zeros(16, 1, 64, dtype=torch.bfloat16)]
    tables = (k4.DeviceLayerTable(rows), k4.DeviceLayerTable(rows))
    idx = torch.arange(16)
    signs = kv_hadamard.rotation_signs(64)
    with pytest.raises(ValueError, match="rotation block 48"):
        k4.encode_gather(tables, idx, host.all_layers(), idx,
                         rotation_blocks=(48, 0), rotation_signs=signs)  # fmt: skip
    with pytest.raises(ValueError, match="rotation_signs must be"):
        k4.decode_scatter(host.layer(0), idx, (rows[0], rows[0]), idx,
                          rotation_blocks=(64, 64), rotation_signs=signs[:32])  # fmt: skip
    k8 = Host("k8v4", 2, 1, 16, 1, 64, 64)
    with pytest.raises(ValueError, match="INT8 keys"):
        k4.encode_gather(tables, idx, k8.all_layers(), idx,
                         rotation_blocks=(64, 64), rotation_signs=signs)  # fmt: skip
    assert fmt.fused_available(torch.device("cpu"))
