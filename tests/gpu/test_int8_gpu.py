"""INT8 host pool and its fused kernels on a real GPU against the CPU reference:
the compiled arithmetic, pinned host memory through UVA, and the stream rules
(all work on the caller's stream, before HiCache's events).
`gpu_check.sh --dry-run` (tests/test_gpu_check.py) runs every test on CPU
under the interpreter, leaving out only what needs CUDA streams."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch
from tests.support.codec_inputs import DTYPES, edge_rows, random_rows
from scripts.rigs.gpu import (
    CUDA,
    DELAY,
    DEVICE,
    LAYOUTS,
    big_tiles_when_interpreted,
    destroy_host_pool,
    make_device_pool,
    make_host_pool,
    pages_to_tokens,
    same_bits,
    sync,
)

if DEVICE is not None:
    from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
    from sglang.kernels.ops.kvcache import kv_int8_triton as kt
    from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

    MHATokenToKVPoolINT8Host = host_pool_cls("int8")

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def big_tiles(monkeypatch):
    big_tiles_when_interpreted(monkeypatch, kt, 65536)


def side_stream():
    """A HiCache-like transfer stream (non-blocking w.r.t. the default one)."""
    if not CUDA:
        return contextlib.nullcontext(), None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream), stream


def stall(cycles: int) -> None:
    """Hold up the current stream (CUDA); on CPU work runs at once anyway."""
    if CUDA:
        torch.cuda._sleep(cycles)


def record_event():
    """An event on the current stream (CUDA), None on CPU."""
    if not CUDA:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def int8_pool(dev_pool, layout, host_tokens, pin_memory=CUDA, **pool_kwargs):
    """The INT8 host pool as the server builds it on this device. On CPU (dry
    run) the fused kernels are switched on, so the kernels a GPU would run
    are the ones exercised."""
    pool_kwargs.setdefault("fused_transfer", None if CUDA else "direct")
    return make_host_pool(
        dev_pool, cls=MHATokenToKVPoolINT8Host, layout=layout,
        host_tokens=host_tokens, pin_memory=pin_memory, **pool_kwargs,
    )  # fmt: skip


def alloc_host(pool, tokens: int) -> torch.Tensor:
    """pool.alloc that fails naming the sizes (alloc returns None when full)."""
    got = pool.alloc(tokens)
    assert got is not None, (
        f"host pool of {pool.size} tokens has {pool.available_size()} free, "
        f"the test asked for {tokens}: size the pool for every allocation"
    )
    return got


def assert_cuda_defaults(pool) -> None:
    """What a server on CUDA runs with pinned host memory: the fused kernels
    reaching host memory directly, confirmed by the start-up self-check, and
    run copies for the paths that stage."""
    assert pool.use_fused_kernels and pool.transfer_path == "fused_direct"
    assert pool.planner.use_runs


def unordered_units(units: torch.Tensor, count: int) -> torch.Tensor:
    """`count` of the given host units in an order with a run, a backward
    jump and a gap: u2 u3 u0 u5 u6 ... (needs count + 2 units)."""
    order = [2, 3, 0] + list(range(5, count + 2))
    assert len(units) >= count + 2 and len(order) >= count
    return units[order[:count]]


def reference_restore(rows: torch.Tensor) -> torch.Tensor:
    q, s = codec.quantize_reference(rows.cpu())
    return codec.dequantize_reference(q, s, rows.dtype)


def host_records(n, H, D, where):
    """int8 records [n, 1, 1, H, D] on the device or in pinned host memory."""
    if where == "device":
        return torch.full((n, 1, 1, H, D), 99, dtype=torch.int8, device=DEVICE)
    return torch.full((n, 1, 1, H, D), 99, dtype=torch.int8, pin_memory=CUDA)


# --- kernels -------------------------------------------------------------------


def test_fused_path_is_the_default_on_cuda():
    dev_pool = make_device_pool(
        layer_num=2, head_num=2, head_dim=64, tokens=32, device=DEVICE
    )
    pool = make_host_pool(
        dev_pool, cls=MHATokenToKVPoolINT8Host, layout="page_first",
        host_tokens=32, pin_memory=CUDA,
    )  # fmt: skip
    if CUDA:
        assert_cuda_defaults(pool)
        assert pool.staging.directions == ()  # the direct path needs no staging
        assert pool.transfer.tables()[0].aligned  # vectorized device loads
    else:
        assert not pool.use_fused_kernels and not pool.planner.use_runs
    destroy_host_pool(pool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128, 192))
def test_torch_path_on_the_device_is_the_cpu_reference(dtype, d, record_property):
    """The pool's torch path (kv_int8_codec) on this device gives the CPU
    reference's bytes (the kernels: tests/gpu/test_int4_gpu.py, every format)."""
    H = 4
    n = 16384 if CUDA else 64
    rows = torch.cat([edge_rows(dtype, d), random_rows(d, n * H, d, dtype)])
    x = rows[: len(rows) // H * H].view(-1, H, d)
    q_ref, s_ref = codec.quantize_reference(x)
    x_dev = x.to(DEVICE)
    q_t = torch.empty_like(x_dev, dtype=torch.int8)
    s_t = torch.empty(x_dev.shape[:-1], dtype=torch.float16, device=DEVICE)
    codec.quantize_into(x_dev, q_t, s_t)
    assert same_bits(q_t, q_ref) and same_bits(s_t, s_ref)
    record_property("rows", x.shape[0] * H)


# --- pool round trips ----------------------------------------------------------

GEOMETRIES = [(8, 128, 128), (4, 192, 128), (3, 64, 64)]
POOL_CASES = [
    (layout, page, geo)
    for layout in LAYOUTS
    for page in (1, 16, 64)
    for geo in (GEOMETRIES if page == 16 else GEOMETRIES[:1])
]


def pool_round_trip(layout, page, geo, mode, *, poison=False, layers=3, pages=5):
    """Backup then restore through one INT8 pool on DEVICE, both on a side
    stream. mode None: the torch path; else the fused kernels with that host
    access. Returns (written rows per layer, host buffers, restored device
    buffers, new device slots, non-finite count)."""
    H, D, DV = geo
    dev_pool = make_device_pool(
        layer_num=layers, head_num=H, head_dim=D, v_head_dim=DV,
        page_size=page, tokens=16 * page, device=DEVICE,
    )  # fmt: skip
    pool = make_host_pool(
        dev_pool, cls=MHATokenToKVPoolINT8Host, layout=layout,
        host_tokens=16 * page, pin_memory=CUDA, fused_transfer=mode or "off",
    )  # fmt: skip
    g = torch.Generator().manual_seed(H * 100 + page)
    dev = pages_to_tokens(torch.randperm(pages, generator=g) + 1, page)
    written = []
    for layer in range(layers):
        k = torch.randn(len(dev), H, D, generator=g).to(torch.bfloat16) * 3
        v = torch.randn(len(dev), H, DV, generator=g).to(torch.bfloat16)
        if poison and layer == 0:
            v[-1, H - 1, 0] = -INF
            k[0, 0, :] = 1e7  # past the fp16-scale guard
        if poison and layer == 1:
            k[1, 0, 3] = NAN
        dev_pool.k_buffer[layer][dev.to(DEVICE)] = k.to(DEVICE)
        dev_pool.v_buffer[layer][dev.to(DEVICE)] = v.to(DEVICE)
        written.append((k, v))
    # Host pages out of order: a run, a backward jump and a gap.
    host_all = alloc_host(pool, pool.size - pool.page_size)
    host = pages_to_tokens(unordered_units(host_all[::page] // page, pages), page)
    ctx, _ = side_stream()
    with ctx:
        pool.backup_from_device_all_layer(dev_pool, host, dev.to(DEVICE), "kernel")
    sync()
    host_bufs = [b.clone() for b in pool.kv_buffer]

    for layer in range(layers):
        dev_pool.k_buffer[layer].fill_(7.0)
        dev_pool.v_buffer[layer].fill_(7.0)
    new_dev = pages_to_tokens(torch.randperm(pages, generator=g) + 8, page)
    ctx, _ = side_stream()
    with ctx:
        for layer in range(layers):
            pool.load_to_device_per_layer(
                dev_pool, host, new_dev.to(DEVICE), layer, "kernel"
            )
    sync()
    device = [b.cpu() for b in dev_pool.k_buffer + dev_pool.v_buffer]
    count = pool.nonfinite_group_count()
    destroy_host_pool(pool)
    return written, host_bufs, device, new_dev, count


@pytest.mark.parametrize("layout,page,geo", POOL_CASES)
def test_pool_round_trip_fused_equals_torch_path_and_reference(layout, page, geo):
    ref = pool_round_trip(layout, page, geo, None)
    written, _, device, new_dev, _ = ref
    layers = len(written)
    untouched = torch.ones(device[0].shape[0], dtype=torch.bool)
    untouched[new_dev] = False
    for layer, (k, v) in enumerate(written):
        assert same_bits(device[layer][new_dev], reference_restore(k))
        assert same_bits(device[layers + layer][new_dev], reference_restore(v))
        assert (device[layer][untouched] == 7.0).all()
    for mode in ("direct", "staged"):
        got = pool_round_trip(layout, page, geo, mode)
        for a, b in zip(got[1], ref[1]):
            assert same_bits(a, b), (mode, "host records differ from the torch path")
        for a, b in zip(got[2], ref[2]):
            assert same_bits(a, b), (mode, "restored device KV differs")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nonfinite_rows_restore_as_nan_and_are_counted(layout):
    ref = pool_round_trip(layout, 4, (3, 64, 64), None, poison=True)
    got = pool_round_trip(layout, 4, (3, 64, 64), "direct", poison=True)
    assert ref[4] == got[4] == 3  # NaN row, -Inf row, 1e7 (past the scale guard)
    for a, b in zip(got[1] + got[2], ref[1] + ref[2]):
        assert same_bits(a, b)
    written, _, device, new_dev, _ = got
    assert torch.isnan(device[1][new_dev][1, 0]).all()  # K layer 1
    assert torch.isnan(device[3][new_dev][-1, 2]).all()  # V layer 0
    assert torch.isnan(device[0][new_dev][0, 0]).all()  # 1e7 row
    finite = device[0][new_dev].clone()
    finite[0, 0] = 0
    assert torch.isfinite(finite).all()


# --- streams -------------------------------------------------------------------
# On CPU (dry run) these run without stalls: the same pools, allocations and
# transfers, and the same final bytes; the "not yet" checks need CUDA.

QWEN_PAGES = 32 if CUDA else 4  # pages per transfer (the interpreter is slow)


def write_qwen_rows(dev_pool, dev, layers, seed):
    """Random BF16 K/V [8 heads, dim 128] at `dev` of every layer; returns the
    reference codec's restore of each layer's (k, v)."""
    g = torch.Generator().manual_seed(seed)
    expected = []
    for layer in range(layers):
        k = torch.randn(len(dev), 8, 128, generator=g).to(torch.bfloat16)
        v = torch.randn(len(dev), 8, 128, generator=g).to(torch.bfloat16)
        dev_pool.k_buffer[layer][dev] = k.to(DEVICE)
        dev_pool.v_buffer[layer][dev] = v.to(DEVICE)
        expected.append((reference_restore(k), reference_restore(v)))
    return expected


def qwen_like_pool(layout="page_first", page=16, layers=4, pages=QWEN_PAGES):
    """A device pool with `pages` pages of KV written, and an INT8 host pool
    with room for two transfers of them (a warm-up and the one under test)."""
    dev_pool = make_device_pool(
        layer_num=layers, head_num=8, head_dim=128, page_size=page,
        tokens=(2 * pages + 2) * page, device=DEVICE,
    )  # fmt: skip
    pool = int8_pool(dev_pool, layout, host_tokens=(2 * pages + 1) * page)
    dev = pages_to_tokens(torch.arange(1, pages + 1), page).to(DEVICE)
    written = write_qwen_rows(dev_pool, dev, layers, seed=0)
    sync()
    return dev_pool, pool, dev, written


@pytest.mark.parametrize("layout", ("page_first", "layer_first"))
def test_delayed_transfers_stay_on_their_stream(layout):
    """With the transfer stream stalled (torch.cuda._sleep), nothing is
    written before the stall ends, and a consumer that waits on each layer's
    event reads fully restored KV: all work is on the caller's stream."""
    dev_pool, pool, dev, written = qwen_like_pool(layout)
    if CUDA:
        assert_cuda_defaults(pool)
    # Compile the kernels first: a first launch compiles on the CPU, which
    # could outlast the GPU stall below.
    warm = alloc_host(pool, len(dev))
    pool.backup_from_device_all_layer(dev_pool, warm, dev, "kernel")
    pool.load_to_device_per_layer(dev_pool, warm, dev, 0, "kernel")
    sync()
    host = alloc_host(pool, len(dev))  # other host slots than the warm-up's
    before = [b.clone() for b in pool.kv_buffer]
    ctx, stream = side_stream()
    with ctx:
        stall(DELAY)
        pool.backup_from_device_all_layer(dev_pool, host, dev, "kernel")
        backed_up = record_event()
    if CUDA:
        assert not backed_up.query(), "transfer stream not delayed; raise DELAY"
        for b, a in zip(before, pool.kv_buffer):  # host memory, read by the CPU now
            assert torch.equal(b.view(torch.int8), a.view(torch.int8))
        backed_up.synchronize()
    assert not torch.equal(before[0], pool.kv_buffer[0])

    layers = len(written)
    for layer in range(layers):
        dev_pool.k_buffer[layer].fill_(7.0)
        dev_pool.v_buffer[layer].fill_(7.0)
    page = dev_pool.page_size
    new_dev = (dev.flip(0) + len(dev) + page).contiguous()  # other slots, reversed
    if CUDA:
        stream.wait_stream(torch.cuda.current_stream())
    events = []
    with ctx if not CUDA else torch.cuda.stream(stream):
        for layer in range(layers):
            stall(DELAY // layers)
            pool.load_to_device_per_layer(dev_pool, host, new_dev, layer, "kernel")
            events.append(record_event())
    if CUDA:
        # The default stream is not ordered after the stalled transfers.
        assert not events[0].query(), "transfer stream not delayed; raise DELAY"
        assert (dev_pool.k_buffer[layers - 1][new_dev] == 7.0).all()
    seen = []
    for layer in range(layers):
        if CUDA:
            torch.cuda.current_stream().wait_event(events[layer])
        seen.append((dev_pool.k_buffer[layer][new_dev].clone(),
                     dev_pool.v_buffer[layer][new_dev].clone()))  # fmt: skip
    sync()
    for (k, v), (k_ref, v_ref) in zip(seen, written):
        assert same_bits(k.cpu(), k_ref) and same_bits(v.cpu(), v_ref)
    destroy_host_pool(pool)


def test_controller_layer_events_cover_a_delayed_restore(monkeypatch):
    """The real HiCacheController with SGLang's own delay knob
    (SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES): a forward that waits on each
    layer's done event reads restored KV, one that doesn't would not."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    layers, tokens = 4, (200 if CUDA else 24)
    dev_pool = make_device_pool(
        layer_num=layers, head_num=8, head_dim=128, tokens=2 * tokens + 112,
        device=DEVICE,
    )  # fmt: skip
    allocator = TokenToKVPoolAllocator(
        dev_pool.size, torch.bfloat16, DEVICE, dev_pool, need_sort=False
    )
    host_pool = int8_pool(dev_pool, "page_first", host_tokens=2 * tokens)
    ctl = HiCacheController(
        allocator, host_pool, 1, tp_group=None, load_cache_event=threading.Event(),
        write_policy="write_through", io_backend="kernel",
    )  # fmt: skip
    dev = allocator.alloc(tokens)
    expected = write_qwen_rows(dev_pool, dev, layers, seed=1)
    host = ctl.write(dev)
    assert host is not None, "host pool too small for the write"
    for ack in ctl.ack_write_queue:
        ack.finish_event.synchronize()
    ctl.ack_write_queue.clear()
    # Warm-up load (compiles the restore kernel), then evict it again.
    warm = ctl.load(host)
    assert warm is not None, "device pool too small for the warm-up load"
    ctl.start_loading()
    for ack in ctl.ack_load_queue:
        ack.finish_event.synchronize()
    ctl.ack_load_queue.clear()
    allocator.free(warm)
    allocator.free(dev)
    for layer in range(layers):  # L1 eviction: the device copy is gone
        dev_pool.k_buffer[layer].fill_(7.0)
        dev_pool.v_buffer[layer].fill_(7.0)

    if CUDA:
        monkeypatch.setenv("SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES", str(DELAY // layers))
    new_dev = ctl.load(host)
    assert new_dev is not None, "device pool too small for the load"
    producer = ctl.start_loading()
    last = layers - 1
    if CUDA:
        assert (dev_pool.k_buffer[last][new_dev] == 7.0).all()  # not waited: stale
    ctl.layer_done_counter.set_consumer(producer)
    seen = []
    for layer in range(layers):
        ctl.layer_done_counter.wait_until(layer)
        seen.append((dev_pool.k_buffer[layer][new_dev].clone(),
                     dev_pool.v_buffer[layer][new_dev].clone()))  # fmt: skip
    sync()
    for (k, v), (k_ref, v_ref) in zip(seen, expected):
        assert same_bits(k.cpu(), k_ref) and same_bits(v.cpu(), v_ref)
    for ack in ctl.ack_load_queue:
        ack.finish_event.synchronize()
    destroy_host_pool(host_pool)


def test_unpinned_host_memory(caplog):
    """Unpinned host buffers: staged by default; asking for direct either
    works (the platform maps pageable memory: its self-check passes) or the
    pool chooses staged at construction, saying why. The bytes are right
    either way."""
    dev_pool, pinned_pool, dev, written = qwen_like_pool(
        "layer_first", page=1, layers=2
    )
    destroy_host_pool(pinned_pool)
    if CUDA:
        pool = int8_pool(dev_pool, "layer_first", len(dev) + 64, pin_memory=False)
        assert pool.transfer_path == "fused_staged"
        destroy_host_pool(pool)
    with caplog.at_level(logging.WARNING):
        pool = int8_pool(
            dev_pool, "layer_first", len(dev) + 64, pin_memory=False,
            fused_transfer="direct",
        )  # fmt: skip
    assert pool.transfer_path in ("fused_direct", "fused_staged")
    if pool.transfer_path == "fused_staged":
        assert "not device-addressable" in pool.transfer_path_reason
        assert "self-check of the fused_direct path failed" in caplog.text
    host = alloc_host(pool, len(dev))
    pool.backup_from_device_all_layer(dev_pool, host, dev, "kernel")
    sync()
    for layer in range(2):
        dev_pool.k_buffer[layer].fill_(7.0)
        pool.load_to_device_per_layer(dev_pool, host, dev, layer, "kernel")
    sync()
    for layer, (k_ref, _) in enumerate(written):
        assert same_bits(dev_pool.k_buffer[layer][dev].cpu(), k_ref)
    destroy_host_pool(pool)
