"""Every format's host pool and fused kernels on a real GPU, bit for bit against
the CPU reference: the compiled arithmetic, pinned host records through UVA and
the caller's stream. `gpu_check.sh --dry-run` runs them on CPU, interpreted."""

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
    from tests.support.fp8_reference import random_finite_fp8
    from tests.support.int4_reference import Host, reference_decode, reference_records

    from sglang.kernels.ops.kvcache import kv_int4_triton as k4
    from sglang.kernels.ops.kvcache import kv_int4c_triton as k4c
    from sglang.kernels.ops.kvcache import kv_int8_triton as kt
    from sglang.kernels.ops.kvcache import kv_int8c_triton as k8c
    from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk
    from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, KVCounters
    from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
    from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

    MHATokenToKVPoolINT8Host = host_pool_cls("int8")

NAN, INF = float("nan"), float("inf")
# The dry run's interpreter costs per value: at most 4 heads there.
MAX_HEADS = None if CUDA else 4


@pytest.fixture(autouse=True)
def big_tiles(monkeypatch):
    for kernels, tile in (
        (k4, 16384), (k4c, 16384), (k8c, 16384), (kt, 65536), (mk, 65536)
    ):  # fmt: skip
        big_tiles_when_interpreted(monkeypatch, kernels, tile)


def side_stream():
    """A HiCache-like transfer stream (non-blocking w.r.t. the default one)."""
    if not CUDA:
        return contextlib.nullcontext(), None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream), stream


def stall(cycles: int) -> None:
    if CUDA:  # on CPU the work runs at once anyway
        torch.cuda._sleep(cycles)


def record_event():
    if not CUDA:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def int8_pool(dev_pool, layout, host_tokens, pin_memory=CUDA, **pool_kwargs):
    """The server's INT8 host pool; on CPU with the fused kernels a GPU runs."""
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
    """A CUDA server's pinned pool: fused kernels reaching host memory directly
    (the self-check passed), run copies where it stages."""
    assert pool.use_fused_kernels and pool.transfer_path == "fused_direct"
    assert pool.planner.use_runs


def unordered_units(units: torch.Tensor, count: int) -> torch.Tensor:
    """`count` units ordered u2 u3 u0 u5 u6 ...: a run, a backward jump, a gap."""
    order = [2, 3, 0] + list(range(5, count + 2))
    assert len(units) >= count + 2 and len(order) >= count
    return units[order[:count]]


def evict(dev_pool) -> None:
    """Every device slot of every layer to 7.0: the L1 copy is gone."""
    for buf in dev_pool.k_buffer + dev_pool.v_buffer:
        buf.fill_(7.0)


def read_layers(dev_pool, slots, layers, wait) -> list:
    """Each layer's (K, V) at `slots`, read after `wait(layer)`."""
    seen = []
    for i in range(layers):
        wait(i)
        seen.append((dev_pool.k_buffer[i][slots].clone(),
                     dev_pool.v_buffer[i][slots].clone()))  # fmt: skip
    return seen


def drain(queue) -> None:
    for ack in queue:
        ack.finish_event.synchronize()
    queue.clear()


def reference_restore(rows: torch.Tensor) -> torch.Tensor:
    q, s = codec.quantize_reference(rows.cpu())
    return codec.dequantize_reference(q, s, rows.dtype)


# --- the INT8 pool -------------------------------------------------------------


def test_fused_path_is_the_default_on_cuda():
    dev_pool = make_device_pool(
        layer_num=2, head_num=2, head_dim=64, tokens=32, device=DEVICE
    )
    pool = int8_pool(dev_pool, "page_first", 32, fused_transfer=None)
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
    """The pool's torch path (kv_int8_codec) here gives the CPU reference's
    bytes (the kernels: test_kernels_bit_exact_against_cpu_reference)."""
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
    """Backup then restore through one INT8 pool, both on a side stream (mode
    None: the torch path, else that fused host access). Returns (written, host
    buffers, restored device buffers, new device slots, non-finite count)."""
    H, D, DV = geo
    H = min(H, MAX_HEADS or H)
    dev_pool = make_device_pool(
        layer_num=layers, head_num=H, head_dim=D, v_head_dim=DV,
        page_size=page, tokens=16 * page, device=DEVICE,
    )  # fmt: skip
    pool = int8_pool(dev_pool, layout, 16 * page, fused_transfer=mode or "off")
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

    evict(dev_pool)
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


# --- streams (on CPU: no stalls, the same final bytes) -------------------------

QWEN_PAGES = 32 if CUDA else 4  # pages per transfer (the interpreter is slow)


def write_qwen_rows(dev_pool, dev, layers, seed):
    """Random BF16 K/V [8, 128] at `dev`; returns each layer's reference restore."""
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
    """`pages` pages of KV written, and an INT8 pool with room for two transfers."""
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
    """A stalled transfer stream writes nothing before the stall ends, and a
    consumer waiting on each layer's event reads restored KV."""
    dev_pool, pool, dev, written = qwen_like_pool(layout)
    if CUDA:
        assert_cuda_defaults(pool)
    # A first launch compiles on the CPU, which could outlast the stall below.
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
    evict(dev_pool)
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
    stream_now = torch.cuda.current_stream() if CUDA else None
    seen = read_layers(
        dev_pool, new_dev, layers, lambda i: CUDA and stream_now.wait_event(events[i])
    )
    sync()
    for (k, v), (k_ref, v_ref) in zip(seen, written):
        assert same_bits(k.cpu(), k_ref) and same_bits(v.cpu(), v_ref)
    destroy_host_pool(pool)


def test_controller_layer_events_cover_a_delayed_restore(monkeypatch):
    """The real HiCacheController, delayed by SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES:
    a forward waiting on each layer's done event reads restored KV."""
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
    drain(ctl.ack_write_queue)
    # Warm-up load (compiles the restore kernel), then evict it again.
    warm = ctl.load(host)
    assert warm is not None, "device pool too small for the warm-up load"
    ctl.start_loading()
    drain(ctl.ack_load_queue)
    allocator.free(warm)
    allocator.free(dev)
    evict(dev_pool)

    if CUDA:
        monkeypatch.setenv("SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES", str(DELAY // layers))
    new_dev = ctl.load(host)
    assert new_dev is not None, "device pool too small for the load"
    producer = ctl.start_loading()
    last = layers - 1
    if CUDA:
        assert (dev_pool.k_buffer[last][new_dev] == 7.0).all()  # not waited: stale
    ctl.layer_done_counter.set_consumer(producer)
    seen = read_layers(dev_pool, new_dev, layers, ctl.layer_done_counter.wait_until)
    sync()
    for (k, v), (k_ref, v_ref) in zip(seen, expected):
        assert same_bits(k.cpu(), k_ref) and same_bits(v.cpu(), v_ref)
    drain(ctl.ack_load_queue)
    destroy_host_pool(host_pool)


def test_unpinned_host_memory(caplog):
    """Unpinned: staged by default; direct either works (the self-check passes)
    or the pool chooses staged at construction, saying why; right bytes either way."""
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


# --- every format's kernels ---------------------------------------------------


def rows(seed: int, n: int, H: int, d: int, dtype) -> torch.Tensor:
    """[n, H, d] random rows across magnitudes."""
    return random_rows(seed, n * H, d, dtype).reshape(n, H, d)


def put_edge_rows(x: torch.Tensor, slots: torch.Tensor) -> None:
    """The edge rows (NaN/Inf/huge/zero/ties) into the first slots read."""
    n, H, d = len(slots), x.shape[1], x.shape[2]
    edge = edge_rows(x.dtype, d)
    flat = x[slots].reshape(n * H, d)
    m = min(len(edge), n * H)
    flat[:m] = edge[:m]
    x[slots] = flat.view(n, H, d)


def to_host(host: Host, where: str) -> Host:
    """The records in device memory or in pinned host memory (UVA)."""
    for name, buf in host.bufs.items():
        host.bufs[name] = buf.to(DEVICE) if where == "device" else buf
        if where == "host" and CUDA:
            host.bufs[name] = buf.pin_memory()
    return host


# Per format: its constructor keywords.
GEOMETRY = {"int4c": {"key8_layers": (1,)}}
CASES = [
    ("int4", 64, (8, 128, 128)),  # per-channel keys, Qwen3-8B heads
    ("int4", 16, (4, 192, 128)),  # per-channel keys in channel blocks
    ("int4", 1, (8, 128, 128)),  # per-token keys (layer_first's unit)
    ("int4", 4, (2, 96, 80)),  # groups of 32 and a whole-head group
    ("k8v4", 64, (8, 128, 128)),
    ("k8v4", 1, (4, 64, 64)),
    # Rotated (the butterfly inside the kernels' tiles): one 128-point block
    # (per-channel and per-token keys), blocks of 32 and of 16 in one group.
    ("int4r", 64, (8, 128, 128)),
    ("int4r", 1, (8, 128, 128)),
    ("int4r", 4, (2, 96, 80)),
    ("k8v4r", 64, (8, 128, 128)),
    ("int8", 1, (4, 64, 64)),
    ("int8", 16, (4, 128, 128)),
    ("int8", 64, (4, 192, 128)),
    ("int8c", 64, (8, 128, 128)),  # per-channel keys
    ("int8c", 1, (4, 128, 96)),  # per-token groups of 32
    # int4c with 8-bit keys on layer 1: 32-token sub-units, one 48-token
    # sub-unit (Gemma 3's head, two 128-value blocks), per-token keys.
    ("int4c", 64, (8, 128, 128)),
    ("int4c", 48, (1, 256, 256)),
    ("int4c", 1, (8, 128, 128)),
    ("int4c", 4, (2, 96, 80)),
    ("mla-int8", 1, (1, 576)),  # DeepSeek's latent 512 + RoPE 64
    ("mla-int8", 64, (1, 576)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,ut,geometry", CASES)
def test_kernels_bit_exact_against_cpu_reference(fmt, ut, geometry, dtype):
    """Encode all layers into device and pinned host records, decode each layer
    to shuffled device slots: the reference's bytes, values and statistics."""
    H, *dims = geometry
    H = min(H, MAX_HEADS or H)
    kind = "mla" if fmt.startswith("mla-") else "mha"
    layers = 2
    n_units = (256 if CUDA else 8) // ut or 1
    n = n_units * ut
    size = 2 * n + 8
    g = torch.Generator().manual_seed(ut * 7 + H)
    sides = [
        [rows(10 * s + i, size, H, d, dtype) for i in range(layers)]
        for s, d in enumerate(dims)
    ]
    dev = torch.randperm(size, generator=g)[:n]
    host_units = 2 * n_units + 1
    units = torch.randperm(host_units, generator=g)[:n_units]
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    for side in sides:
        for t in side:
            put_edge_rows(t, dev)
            if kind == "mla":  # NaN and -Inf RoPE rows too
                t[dev[1], 0, -64], t[dev[2], 0, -59] = NAN, -INF
    tables = [DeviceLayerTable([t.to(DEVICE) for t in side]) for side in sides]

    def new_host():
        return Host(fmt.removeprefix("mla-"), host_units, layers, ut, H, *dims,
                    kind=kind, dtype=dtype, geometry=GEOMETRY.get(fmt))  # fmt: skip

    want = new_host()
    f = want.format(dtype)
    want_bad, want_amax = want.fill_reference(sides, dev, units)
    assert want_bad > 0  # the edge rows reached the kernels

    for where in ("device", "host") if CUDA else ("host",):
        host = to_host(new_host(), where)
        counter = torch.zeros((), dtype=torch.int64, device=DEVICE)
        bad_idx = torch.zeros((), dtype=torch.int64, device=DEVICE)
        amax = torch.zeros(layers, len(dims), device=DEVICE)
        f.encode_gather(
            tables, dev.to(DEVICE), host.all_layers(), host_idx.to(DEVICE),
            counters=KVCounters(counter, amax, bad_idx),
        )  # fmt: skip
        sync()
        for name in want.bufs:
            assert same_bits(host.bufs[name].cpu(), want.bufs[name]), (where, name)
        assert int(counter) == want_bad and int(bad_idx) == 0, where
        assert torch.equal(amax.cpu(), want_amax), where

        # MLA keeps its RoPE in the device dtype: it restores to that dtype. The
        # dry run's other dtype is tests/test_host_kernels.py's, interpreted too.
        for out_dtype in DTYPES if kind == "mha" and CUDA else (dtype,):
            new_dev = torch.randperm(size, generator=g)[:n].to(DEVICE)
            for layer in range(layers):
                dst = [
                    torch.full((size, H, d), 7.0, dtype=out_dtype, device=DEVICE)
                    for d in dims
                ]
                f.decode_scatter(
                    host.layer(layer), host_idx.to(DEVICE), dst, new_dev,
                    bad_index_counter=bad_idx,
                )  # fmt: skip
                sync()
                layer_records = {n_: r[units] for n_, r in want.layer(layer).items()}
                refs = want.decode(layer_records, out_dtype, layer)
                for d, out, ref in zip(dims, dst, refs):
                    got = out[new_dev].cpu()
                    assert same_bits(got, ref.reshape(n, H, d)), (where, out_dtype)
                untouched = torch.ones(size, dtype=torch.bool, device=DEVICE)
                untouched[new_dev] = False
                assert (dst[0][untouched] == 7.0).all()
        assert int(bad_idx) == 0


@pytest.mark.parametrize("fp8", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
@pytest.mark.parametrize("fmt,ut", [("int4", 64), ("int4", 1), ("k8v4", 16)])
def test_fp8_kernels_bit_exact_against_cpu_reference(fmt, ut, fp8):
    """FP8 device KV (every finite byte and a NaN): pinned records and restored
    FP8 bytes are the reference's (compiled integer conversions match torch's)."""
    H, dk, dv = 8, 128, 128
    n_units = (256 if CUDA else 8) // ut or 1
    n = n_units * ut
    g = torch.Generator().manual_seed(ut)
    k_cpu, v_cpu = (random_finite_fp8((n, H, d), fp8, g) for d in (dk, dv))
    k_cpu.view(torch.uint8)[1, 0, 3] = 0x7F  # NaN in both FP8s
    tables = tuple(
        k4.DeviceLayerTable([t.view(torch.uint8).to(DEVICE).view(fp8)])
        for t in (k_cpu, v_cpu)
    )
    host = to_host(Host(fmt, n_units, 1, ut, H, dk, dv), "host")
    idx = torch.arange(n, device=DEVICE)
    k4.encode_gather(tables, idx, host.all_layers(), idx)
    sync()
    records, bad, _ = reference_records(
        fmt, k_cpu.view(n_units, ut, H, dk), v_cpu.view(n_units, ut, H, dv)
    )
    assert bad == 1
    for name, rec in records.items():
        assert same_bits(host.bufs[name][:, 0].cpu(), rec), name
    dst = [
        torch.zeros(n, H, d, dtype=torch.uint8, device=DEVICE).view(fp8)
        for d in (dk, dv)
    ]
    k4.decode_scatter(host.layer(0), idx, dst, idx)
    sync()
    for got, want in zip(dst, reference_decode(fmt, records, fp8)):
        want = want.reshape(got.shape).view(torch.uint8)
        assert torch.equal(got.cpu().view(torch.uint8), want)


def test_transfers_stay_on_the_callers_stream():
    """The INT4 kernels on a stalled stream write nothing before the stall ends,
    then the reference's bytes."""
    H, D, ut, n_units = 8, 128, 64, (16 if CUDA else 1)
    n = n_units * ut
    x = [rows(3, n, H, D, torch.bfloat16).to(DEVICE) for _ in range(2)]
    tables = (k4.DeviceLayerTable([x[0]]), k4.DeviceLayerTable([x[1]]))
    host = to_host(Host("int4", n_units, 1, ut, H, D, D), "host")
    idx = torch.arange(n, device=DEVICE)
    # Compile first: a first launch compiles on the CPU, outlasting the stall.
    k4.encode_gather(tables, idx, host.all_layers(), idx)
    warm = [torch.empty_like(t) for t in x]
    k4.decode_scatter(host.layer(0), idx, warm, idx)
    sync()
    before = {name: buf.clone() for name, buf in host.bufs.items()}
    for buf in host.bufs.values():
        buf.view(torch.uint8).fill_(0x5A)
    ctx, _ = side_stream()
    with ctx:
        stall(DELAY)
        k4.encode_gather(tables, idx, host.all_layers(), idx)
        done = record_event()
    if CUDA:
        assert not done.query(), "stream not delayed; raise DELAY"
        assert (host.bufs["k"].view(torch.uint8) == 0x5A).all()
        done.synchronize()
    for name, buf in host.bufs.items():
        assert same_bits(buf.cpu(), before[name].cpu()), name

    dst = [torch.full((n, H, D), 7.0, dtype=torch.bfloat16, device=DEVICE) for _ in x]
    ctx, _ = side_stream()
    with ctx:
        stall(DELAY)
        k4.decode_scatter(host.layer(0), idx, dst, idx)
        done = record_event()
    if CUDA:
        assert not done.query(), "stream not delayed; raise DELAY"
        assert (dst[0] == 7.0).all()
        done.synchronize()
    k_ref, _ = reference_decode(
        "int4", {name: buf[:, 0].cpu() for name, buf in host.bufs.items()},
        torch.bfloat16,
    )  # fmt: skip
    assert same_bits(dst[0].cpu(), k_ref.reshape(n, H, D))
