"""INT4 / K8V4 fused kernels (kv_int4_triton) on a real GPU (skipped without
CUDA).

Run by scripts/gpu_check.sh on a CUDA machine. Every record byte and every
restored value is compared with the spec reference (tests/support/int4_reference.py)
computed on the CPU, so these check the compiled arithmetic (IEEE division,
fp16 rounding, round-half-even), pinned host records reached through UVA,
and that all work runs on the caller's stream. With HIQ_GPU_TEST_DEVICE=cpu
and TRITON_INTERPRET=1 (gpu_check.sh --dry-run) the same tests run on CPU at
small sizes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tests.support.codec_inputs import DTYPES, edge_rows, random_rows
from scripts.rigs.gpu import (
    CUDA,
    DELAY,
    DEVICE,
    big_tiles_when_interpreted,
    same_bits,
    sync,
)


if DEVICE is not None:
    from tests.support.fp8_reference import random_finite_fp8
    from tests.support.int4_reference import Host, reference_decode, reference_records

    from sglang.kernels.ops.kvcache import kv_int4_triton as k4
    from sglang.kernels.ops.kvcache.host_kv_common import KVCounters


@pytest.fixture(autouse=True)
def big_tiles(monkeypatch):
    big_tiles_when_interpreted(monkeypatch, k4, 16384)


def rows(seed: int, n: int, H: int, d: int, dtype) -> torch.Tensor:
    """[n, H, d] random rows across magnitudes."""
    return random_rows(seed, n * H, d, dtype).reshape(n, H, d)


def put_edge_rows(x: torch.Tensor, slots: torch.Tensor) -> None:
    """The edge rows (NaN/Inf/huge/zero/ties) into the first device slots a
    transfer reads, heads first."""
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


CASES = [
    ("int4", 64, (8, 128, 128)),  # per-channel keys, Qwen3-8B heads
    ("int4", 16, (4, 192, 128)),  # per-channel keys in channel blocks
    ("int4", 1, (8, 128, 128)),  # per-token keys (layer_first's unit)
    ("int4", 4, (2, 96, 80)),  # groups of 32 and a whole-head group
    ("k8v4", 64, (8, 128, 128)),
    ("k8v4", 1, (4, 64, 64)),
]


ROTATED_CASES = [
    ("int4r", 64, (8, 128, 128)),  # one 128-point block, per-channel keys
    ("int4r", 1, (8, 128, 128)),  # a block over two groups, per-token keys
    ("int4r", 4, (2, 96, 80)),  # blocks of 32, blocks of 16 in one group
    ("k8v4r", 64, (8, 128, 128)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,ut,geometry", ROTATED_CASES)
def test_rotated_kernels_bit_exact_against_cpu_reference(fmt, ut, geometry, dtype):
    """int4r / k8v4r (the butterfly inside the kernels' tiles): pinned host
    records and the restored rows equal the format's CPU reference."""
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    H, dk, dv = geometry
    n_units = (256 if CUDA else 8) // ut or 1
    n = n_units * ut
    size = 2 * n + 8
    g = torch.Generator().manual_seed(ut * 5 + H)
    k_cpu, v_cpu = rows(1, size, H, dk, dtype), rows(2, size, H, dv, dtype)
    dev = torch.randperm(size, generator=g)[:n]
    units = torch.randperm(2 * n_units + 1, generator=g)[:n_units]
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    for t in (k_cpu, v_cpu):
        put_edge_rows(t, dev)
    fmt_obj = host_format_cls(fmt, "mha")((dk, dv), H, ut, dtype)
    rotation = fmt_obj._kernel_rotation(DEVICE)
    tables = (
        k4.DeviceLayerTable([k_cpu.to(DEVICE)]),
        k4.DeviceLayerTable([v_cpu.to(DEVICE)]),
    )
    base = fmt.removesuffix("r")
    host = to_host(Host(base, 2 * n_units + 1, 1, ut, H, dk, dv), "host")
    counter = torch.zeros((), dtype=torch.int64, device=DEVICE)
    k4.encode_gather(
        tables, dev.to(DEVICE), host.all_layers(), host_idx.to(DEVICE),
        counters=KVCounters(nonfinite=counter), **rotation,
    )  # fmt: skip
    sync()
    k = k_cpu[dev].view(n_units, ut, H, dk)
    v = v_cpu[dev].view(n_units, ut, H, dv)
    want = fmt_obj.encode_reference((k, v))
    got = {name: buf[units, 0].cpu() for name, buf in host.bufs.items()}
    for name, rec in want.items():
        assert same_bits(got[name], rec), name
    assert int(counter) > 0  # the edge rows reached the kernels
    for out_dtype in DTYPES:
        new_dev = torch.randperm(size, generator=g)[:n].to(DEVICE)
        dst = [
            torch.full((size, H, d), 7.0, dtype=out_dtype, device=DEVICE)
            for d in (dk, dv)
        ]
        k4.decode_scatter(
            host.layer(0), host_idx.to(DEVICE), dst, new_dev, **rotation
        )  # fmt: skip
        sync()
        k_ref, v_ref = fmt_obj.decode_reference(want, out_dtype)
        assert same_bits(dst[0][new_dev].cpu(), k_ref.reshape(n, H, dk)), out_dtype
        assert same_bits(dst[1][new_dev].cpu(), v_ref.reshape(n, H, dv)), out_dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,ut,geometry", CASES)
def test_kernels_bit_exact_against_cpu_reference(fmt, ut, geometry, dtype):
    """Encode all layers into device memory and into pinned host memory,
    decode each layer back to shuffled device slots: the reference's bytes
    and values, the statistics too."""
    H, dk, dv = geometry
    layers = 2
    n_units = (256 if CUDA else 8) // ut or 1
    n = n_units * ut
    size = 2 * n + 8
    g = torch.Generator().manual_seed(ut * 7 + H)
    k_cpu = [rows(i, size, H, dk, dtype) for i in range(layers)]
    v_cpu = [rows(10 + i, size, H, dv, dtype) for i in range(layers)]
    dev = torch.randperm(size, generator=g)[:n]
    host_units = 2 * n_units + 1
    units = torch.randperm(host_units, generator=g)[:n_units]
    host_idx = (units[:, None] * ut + torch.arange(ut)).flatten()
    for t in k_cpu + v_cpu:
        put_edge_rows(t, dev)
    k_dev = [t.to(DEVICE) for t in k_cpu]
    v_dev = [t.to(DEVICE) for t in v_cpu]
    tables = (k4.DeviceLayerTable(k_dev), k4.DeviceLayerTable(v_dev))

    want = Host(fmt, host_units, layers, ut, H, dk, dv)
    want_bad, want_amax = want.fill_reference(k_cpu, v_cpu, dev, units)
    assert want_bad > 0  # the edge rows reached the kernels

    for where in ("device", "host") if CUDA else ("host",):
        host = to_host(Host(fmt, host_units, layers, ut, H, dk, dv), where)
        counter = torch.zeros((), dtype=torch.int64, device=DEVICE)
        bad_idx = torch.zeros((), dtype=torch.int64, device=DEVICE)
        amax = torch.zeros(layers, 2, device=DEVICE)
        k4.encode_gather(
            tables, dev.to(DEVICE), host.all_layers(), host_idx.to(DEVICE),
            counters=KVCounters(counter, amax, bad_idx),
        )  # fmt: skip
        sync()
        for name in want.bufs:
            assert same_bits(host.bufs[name].cpu(), want.bufs[name]), (where, name)
        assert int(counter) == want_bad and int(bad_idx) == 0, where
        assert torch.equal(amax.cpu(), want_amax), where

        for out_dtype in DTYPES:
            new_dev = torch.randperm(size, generator=g)[:n].to(DEVICE)
            for layer in range(layers):
                dst = [
                    torch.full((size, H, d), 7.0, dtype=out_dtype, device=DEVICE)
                    for d in (dk, dv)
                ]
                k4.decode_scatter(
                    host.layer(layer), host_idx.to(DEVICE), dst, new_dev,
                    bad_index_counter=bad_idx,
                )  # fmt: skip
                sync()
                layer_records = {n_: r[units] for n_, r in want.layer(layer).items()}
                k_ref, v_ref = reference_decode(fmt, layer_records, out_dtype)
                got_k, got_v = dst[0][new_dev].cpu(), dst[1][new_dev].cpu()
                assert same_bits(got_k, k_ref.reshape(n, H, dk)), (where, out_dtype)
                assert same_bits(got_v, v_ref.reshape(n, H, dv)), (where, out_dtype)
                untouched = torch.ones(size, dtype=torch.bool, device=DEVICE)
                untouched[new_dev] = False
                assert (dst[0][untouched] == 7.0).all()
        assert int(bad_idx) == 0


@pytest.mark.parametrize("fp8", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
@pytest.mark.parametrize("fmt,ut", [("int4", 64), ("int4", 1), ("k8v4", 16)])
def test_fp8_kernels_bit_exact_against_cpu_reference(fmt, ut, fp8):
    """FP8 device KV (float8 views of uint8 storage, every finite byte and a
    NaN): pinned host records and the restored FP8 bytes equal the CPU
    reference's, so the compiled integer conversions match torch's."""
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
    """With the caller's stream stalled (torch.cuda._sleep), neither kernel
    has written anything before the stall ends; after it, the bytes are the
    reference's."""
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
    stream = torch.cuda.Stream() if CUDA else None
    ctx = torch.cuda.stream(stream) if CUDA else contextlib.nullcontext()
    with ctx:
        if CUDA:
            torch.cuda._sleep(DELAY)
        k4.encode_gather(tables, idx, host.all_layers(), idx)
        done = torch.cuda.Event() if CUDA else None
        if CUDA:
            done.record()
    if CUDA:
        assert not done.query(), "stream not delayed; raise DELAY"
        assert (host.bufs["k"].view(torch.uint8) == 0x5A).all()
        done.synchronize()
    for name, buf in host.bufs.items():
        assert same_bits(buf.cpu(), before[name].cpu()), name

    dst = [torch.full((n, H, D), 7.0, dtype=torch.bfloat16, device=DEVICE) for _ in x]
    with ctx:
        if CUDA:
            torch.cuda._sleep(DELAY)
        k4.decode_scatter(host.layer(0), idx, dst, idx)
        if CUDA:
            done.record()
    if CUDA:
        assert not done.query(), "stream not delayed; raise DELAY"
        assert (dst[0] == 7.0).all()
        done.synchronize()
    k_ref, _ = reference_decode(
        "int4", {name: buf[:, 0].cpu() for name, buf in host.bufs.items()},
        torch.bfloat16,
    )  # fmt: skip
    assert same_bits(dst[0].cpu(), k_ref.reshape(n, H, D))
