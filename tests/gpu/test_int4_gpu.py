"""Every format's fused kernels on a real GPU (INT4 / K8V4 / int4r / k8v4r in
kv_int4_triton, and INT8, int8c, int4c, MLA INT8), bit for bit against the CPU
reference (tests/support/int4_reference.py): the compiled arithmetic, pinned
host records through UVA, the caller's stream. `gpu_check.sh --dry-run` runs
them on CPU under the interpreter."""

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
    from sglang.kernels.ops.kvcache import kv_int4c_triton as k4c
    from sglang.kernels.ops.kvcache import kv_int8_triton as kt
    from sglang.kernels.ops.kvcache import kv_int8c_triton as k8c
    from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk
    from sglang.kernels.ops.kvcache.host_kv_common import DeviceLayerTable, KVCounters


NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def big_tiles(monkeypatch):
    for kernels, tile in (
        (k4, 16384), (k4c, 16384), (k8c, 16384), (kt, 65536), (mk, 65536)
    ):  # fmt: skip
        big_tiles_when_interpreted(monkeypatch, kernels, tile)


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
    """Encode all layers into device memory and into pinned host memory,
    decode each layer back to shuffled device slots: the reference's bytes
    and values, the statistics too."""
    H, *dims = geometry
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

        # MLA keeps its RoPE in the device dtype: it restores to that dtype.
        for out_dtype in DTYPES if kind == "mha" else (dtype,):
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
