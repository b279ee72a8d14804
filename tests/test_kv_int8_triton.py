"""Fused INT8 kernels (kv_int8_triton) under the Triton interpreter: the codec
tests' rows against the reference, the pool's fused path == its torch path
(every layout, page size, geometry), and how the pool picks its path."""

from __future__ import annotations

import types

import msgspec
import pytest
import torch
from scripts.rigs.hicache_harness import (
    Geometry,
    fill_random,
    make_device_pool,
    make_host_pool,
)
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.srt.mem_cache.pool_host import encoded, encoded_fused
from tests.support.codec_inputs import (
    DTYPES,
    LOG2_RANGE,
    assert_same_bits,
    edge_inputs,
    make_rows,
)
from tests.support.conformance import (
    KERNEL_POOL_CASES,
    LAYOUTS,
    heads_geometry,
)
from tests.support.int4_reference import raw
from tests.support.kernel_cases import run_case
from tests.support.int8_pool_checks import (
    INTERPRETED_KERNELS,
    MHATokenToKVPoolINT8Host,
)

# numpy warns about lanes the kernels mask out (NaN-row quotients, padding).
pytestmark = INTERPRETED_KERNELS
NAN, INF = float("nan"), float("inf")


# --- kernel level ------------------------------------------------------------


def fused_decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """Decode q [n, H, D], scale [n, H] with the kernel into a sentinel-filled
    device layer at shuffled slots; returns the rows in input order."""
    n, H, D = q.shape
    size = 2 * n + 3
    slots = torch.randperm(size, generator=torch.Generator().manual_seed(n))[:n]
    k_dst = torch.full((size, H, D), -7.0, dtype=dtype)
    v_dst = torch.full((size, H, D), -5.0, dtype=dtype)
    s = torch.stack([scale, scale], dim=1)  # [n, 2, H]
    kt.decode_scatter(
        q[:, None], q[:, None], s[:, None], torch.arange(n), k_dst, v_dst, slots,
        unit_tokens=1,
    )  # fmt: skip
    untouched = torch.ones(size, dtype=torch.bool)
    untouched[slots] = False
    assert (k_dst[untouched] == -7.0).all() and (v_dst[untouched] == -5.0).all()
    assert_same_bits(k_dst[slots], v_dst[slots])
    return k_dst[slots]


def check_rows(x: torch.Tensor, tile: int | None = None) -> None:
    """x [n, H, D] as one layer of K and V rows (units of one token) through
    both kernels: the reference's bytes, values and non-finite count."""
    n, H, d = x.shape
    run_case(
        "int8", ut=1, H=H, dims=(d, d), n_units=n, dtype=x.dtype, rows=[x, x],
        tile=tile,
    )  # fmt: skip


@pytest.mark.parametrize(
    "case", [i for i, x in enumerate(edge_inputs()) if x.dtype in DTYPES]
)
def test_codec_edge_inputs(case):
    """Zeros, -0, smallest normal, subnormal, half-integer quotients, dtype
    max, past the fp16-scale guard, NaN/Inf, spikes: the codec tests' rows."""
    x = edge_inputs()[case]
    check_rows(x.reshape(x.shape[0], 1, x.shape[1]))
    # Same rows as heads of fewer tokens (head index math, odd head count).
    check_rows(x[:15].reshape(5, 3, x.shape[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_random_rows_across_magnitudes(dtype, d):
    """Gaussian, heavy-tailed, spiky and zero rows from the dtype's subnormals
    to beyond the scale guard, every head_dim the pool sees."""
    lo, hi = LOG2_RANGE[dtype]
    mags = [lo + (hi - lo) * i / 23 for i in range(24)]
    x = make_rows(d, (48, 4, d), dtype, ["gauss", "heavy", "spike", "zero"], mags)
    check_rows(x)
    # Small tiles: more programs, rows split differently.
    check_rows(x[:9], tile=256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_half_to_even_ties(dtype):
    """Quotients exactly on .5 (both signs, odd and even neighbours) and
    just off it, at power-of-two scales from fp16 subnormal to large."""
    rows = []
    for log2_s in (-24, -20, -14, -3, 0, 5):
        s = 2.0**log2_s
        k = torch.arange(-126, 127, dtype=torch.float64) + 0.5  # all ties
        rows.append(torch.cat([torch.tensor([127.0]), k[:63]]) * s)  # amax 127 s
        rows.append(torch.cat([torch.tensor([-127.0]), k[63:126]]) * s)
        rows.append(torch.cat([torch.tensor([127.0]), k[126:189]]) * s)
        rows.append(torch.cat([torch.tensor([-127.0]), k[189:252]]) * s)
    x = torch.stack(rows).to(dtype)
    check_rows(x[:, None, :])
    # Scales that aren't powers of two (fp16: values just around ties).
    g = torch.Generator().manual_seed(3)
    y = (torch.randint(-254, 255, (32, 64), generator=g).double() / 2 * 1.37).to(dtype)
    check_rows(y[:, None, :])


def test_exact_grid_and_fp16_output_overflow():
    for dtype, mant in ((torch.bfloat16, 1.0), (torch.float16, 1.75)):
        s = mant * 2.0**-3
        k = torch.randint(
            -127, 128, (8, 64), generator=torch.Generator().manual_seed(1)
        )
        k[:, 0] = 127
        x = (k.double() * s).to(dtype)
        q, scale = codec.quantize_reference(x)
        assert torch.equal(q, k.to(torch.int8)) and (scale.double() == s).all()
        check_rows(x[:, None])
    # fp16 values near 65504: q * s passes fp16's max; saturated, as the reference.
    x = torch.tensor([[65504.0] + [1.0] * 63], dtype=torch.float16)
    check_rows(x[:, None])


def test_decode_special_scales():
    """Decode alone over NaN, subnormal, largest and random scales."""
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-127, 128, (40, 2, 96), generator=g, dtype=torch.int8)
    q[:, :, 0] = 127
    scale = (torch.rand(40, 2, generator=g) * 4).half()
    scale[0] = NAN
    scale[1] = 2.0**-24
    scale[2] = 65504.0
    scale[3, 0] = 6.1e-5
    scale[4] = 0.0  # never produced by encode; still decodes to zeros
    for out_dtype in DTYPES:
        assert_same_bits(
            fused_decode(q, scale, out_dtype),
            codec.dequantize_reference(q, scale, out_dtype),
        )


# --- pool level: fused path == torch path ------------------------------------


@pytest.fixture
def big_tiles(monkeypatch):
    """Fewer, larger programs: the interpreter's cost is per program (the
    kernel-level tests above cover the default and small tiles)."""
    monkeypatch.setattr(kt, "ENCODE_TILE", 65536)
    monkeypatch.setattr(kt, "DECODE_TILE", 65536)


def pool_round_trip(
    geo, layout, mode, n_pages=3, poison=False, device_index_dtype=torch.int64
):
    """Backup then restore through one INT8 pool; mode None = torch path, else
    the fused kernels with that host access. Returns the host buffers after
    backup, the device buffers after restore, and the non-finite count."""
    p = geo.page_size
    device_pool = make_device_pool(geo, device_tokens=16 * p)
    pool = make_host_pool(
        device_pool, host_tokens=16 * p, layout=layout,
        host_pool_cls=MHATokenToKVPoolINT8Host, fused_transfer=mode,
    )  # fmt: skip
    # None: the CPU default, the torch path.
    assert pool.transfer_path == ("torch" if mode is None else f"fused_{mode}")
    gen = torch.Generator().manual_seed(geo.head_num * 7 + p)
    pages = torch.randperm(n_pages, generator=gen) + 1
    dev = (pages[:, None] * p + torch.arange(p)).flatten()
    fill_random(device_pool, dev, seed=geo.head_num)
    if poison:
        device_pool.k_buffer[1][dev[1], 0, 3] = NAN
        device_pool.v_buffer[0][dev[-1], geo.head_num - 1, 0] = -INF
        device_pool.k_buffer[0][dev[0], 0, :] = 1e7  # past the fp16-scale guard
    host_all = pool.alloc(pool.size - pool.page_size)
    host = torch.cat([host_all[:p], host_all[2 * p :]])[: len(dev)]  # a gap
    pool.backup_from_device_all_layer(
        device_pool, host, dev.to(device_index_dtype), "direct"
    )
    host_bufs = [b.clone() for b in pool.kv_buffer]

    for layer in range(geo.layer_num):
        device_pool.k_buffer[layer].fill_(7.0)
        device_pool.v_buffer[layer].fill_(7.0)
    new_pages = torch.randperm(n_pages, generator=gen) + 8
    new_dev = (new_pages[:, None] * p + torch.arange(p)).flatten()
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(
            device_pool, host, new_dev.to(device_index_dtype), layer, "direct"
        )
    device = [b.clone() for b in device_pool.k_buffer + device_pool.v_buffer]
    return host_bufs, device, pool.nonfinite_group_count()


def assert_same_results(a, b):
    for x, y in zip(a[0], b[0]):  # host records and scales: identical bytes
        assert x.dtype == y.dtype and torch.equal(raw(x), raw(y))
    for x, y in zip(a[1], b[1]):  # whole device buffers, untouched slots too
        assert_same_bits(x, y)
    assert a[2] == b[2]


POOL_CASES = KERNEL_POOL_CASES  # the grid the compile check compiles


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("layout,page_size,geometry", POOL_CASES)
def test_pool_fused_matches_torch_path(layout, page_size, geometry):
    geo = heads_geometry(geometry, page_size)
    poison = geometry == (3, 64, 64)
    n_pages = 2 if geo.head_num * page_size >= 1024 else 3
    ref = pool_round_trip(geo, layout, None, n_pages, poison=poison)
    if poison:
        assert ref[2] == 3  # the NaN row, the -Inf row, the 1e7 row
    assert_same_results(pool_round_trip(geo, layout, "direct", n_pages, poison), ref)
    # Staged runs the same kernels on staging strides: a subset suffices.
    if page_size == 16 and geometry in ((3, 64, 64), (4, 192, 128)):
        assert_same_results(
            pool_round_trip(geo, layout, "staged", n_pages, poison), ref
        )


@pytest.mark.usefixtures("big_tiles")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_nonfinite_rows_and_device_index_dtypes(layout, dtype):
    geo = Geometry(layer_num=3, head_num=3, head_dim=16, page_size=2, dtype=dtype)
    ref = pool_round_trip(geo, layout, None, n_pages=5, poison=True)
    assert ref[2] == 3
    for mode in encoded_fused.FUSED_HOST_ACCESS:
        got = pool_round_trip(
            geo, layout, mode, n_pages=5, poison=True, device_index_dtype=torch.int32
        )
        assert_same_results(got, ref)
        assert got[2] == 3


@pytest.mark.usefixtures("big_tiles")
def test_staged_fused_path_chunks(monkeypatch):
    monkeypatch.setattr(encoded, "STAGING_TOKENS", 8)
    geo = Geometry(layer_num=2, head_num=2, head_dim=16, page_size=2)
    ref = pool_round_trip(geo, "page_first", None, n_pages=7, poison=True)
    assert_same_results(
        pool_round_trip(geo, "page_first", "staged", n_pages=7, poison=True), ref
    )


def test_one_launch_per_backup_and_per_layer(monkeypatch):
    calls = {"encode": 0, "decode": 0}
    for name in calls:
        real = getattr(kt, f"{name}_gather" if name == "encode" else f"{name}_scatter")

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(kt, real.__name__, counted)
    monkeypatch.setattr(encoded, "STAGING_TOKENS", 8)  # direct ignores chunks
    geo = Geometry(layer_num=4, head_num=2, head_dim=16, page_size=2)
    pool_round_trip(geo, "page_first", "direct", n_pages=7)
    assert calls == {"encode": 1, "decode": geo.layer_num}


class CudaTypedCpu(str):
    """A device the pool reads as CUDA (`.type == "cuda"`) that torch allocates
    on and compares equal to the CPU: path selection runs as on a GPU."""

    type = "cuda"

    def __eq__(self, other):
        if isinstance(other, torch.device):
            return other == torch.device("cpu")
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__


def build_pool_on(device_pool, device=None, pin_memory=False):
    """An INT8 host pool for device_pool, as if that pool lived on `device`."""
    info = device_pool.get_device_pool_infos()[0].buffer_info
    if device is not None:
        info = msgspec.structs.replace(info, device=device)
    return MHATokenToKVPoolINT8Host(
        info, 2.0, 0, device_pool.page_size, "page_first",
        pin_memory=pin_memory, device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer, end_layer=device_pool.end_layer,
        host_token_capacity=16,
    )  # fmt: skip


@pytest.fixture
def cuda_typed(monkeypatch):
    """A CUDA-typed device whose CUDA-only calls are no-ops on CPU: stream
    synchronizes (nothing is queued) and pinning index uploads. The module
    runs under the interpreter, so the kernels count as available and run,
    as on a GPU."""
    stream = types.SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # Index uploads go through pinned memory on CUDA; here the copy is a CPU
    # copy either way (as tests/conftest.py no-ops cudaHostRegister).
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    return CudaTypedCpu("cpu")


@pytest.mark.parametrize("pinned", (True, False))
def test_cuda_defaults_fused_and_run_copies(cuda_typed, pinned):
    """On CUDA: fused kernels, per-run copies, and direct host access exactly
    when the host memory is pinned."""
    pool = build_pool_on(make_device_pool(Geometry(), 16), cuda_typed, pinned)
    assert pool.planner.use_runs
    assert pool.transfer_path == ("fused_direct" if pinned else "fused_staged")
    # The direct path stages nothing; the staged one has both directions.
    assert sorted(pool.staging.directions) == ([] if pinned else ["d2h", "h2d"])


@pytest.mark.parametrize("mode", ("off", "direct", "staged"))
def test_fused_env_overrides_the_cuda_default(cuda_typed, monkeypatch, mode):
    monkeypatch.setenv(encoded_fused.FUSED_ENV, mode)
    pool = build_pool_on(make_device_pool(Geometry(), 16), cuda_typed, True)
    assert pool.transfer_path == ("torch" if mode == "off" else f"fused_{mode}")
    assert pool.planner.use_runs  # the torch path on CUDA copies per run


def test_cuda_typed_pool_round_trips_on_the_default_path(cuda_typed):
    """The fake is good for more than construction: a pool built as on CUDA
    backs up and restores through its default (fused, direct) path."""
    device_pool = make_device_pool(Geometry(page_size=1), 16)
    pool = build_pool_on(device_pool, cuda_typed, pin_memory=True)
    dev = torch.arange(1, 6)
    written = fill_random(device_pool, dev, seed=2)
    host = pool.alloc(len(dev))
    pool.backup_from_device_all_layer(device_pool, host, dev, "kernel")
    new_dev = torch.arange(8, 13)
    for layer in range(device_pool.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "kernel")
    for layer, (k, v) in enumerate(written):
        for buf, rows in ((device_pool.k_buffer, k), (device_pool.v_buffer, v)):
            expected = codec.dequantize_reference(
                *codec.quantize_reference(rows), rows.dtype
            )
            assert torch.equal(buf[layer][new_dev], expected)
