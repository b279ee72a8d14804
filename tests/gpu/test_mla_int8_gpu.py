"""MLA INT8 fused kernels (kv_mla_int8_triton) on a real GPU against the CPU
reference: latent tiles, the RoPE bit copy, the MLA INT8 pool's pinned records
through UVA, the caller's stream (dry run on CPU: see test_host_kv_gpu.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from scripts.rigs import gpu as gs
from tests.support.codec_inputs import edge_rows, random_rows

if gs.DEVICE is not None:
    from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk
    from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat

RANK, ROPE, TILE = 512, 64, 128
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def big_tiles(monkeypatch):
    gs.big_tiles_when_interpreted(monkeypatch, mk, 65536)


def mla_rows(dtype: torch.dtype, tokens: int, seed: int) -> torch.Tensor:
    """[tokens, 1, 576] device rows: edge tiles (NaN/Inf, subnormals, ties,
    past the scale guard) and random tiles across magnitudes; RoPE random
    with one NaN and one Inf row."""
    tiles = torch.cat(
        [edge_rows(dtype, TILE), random_rows(seed, tokens * 4, TILE, dtype)]
    )
    latent = tiles[: tokens * 4].reshape(tokens, 1, RANK)
    rope = random_rows(seed + 1, tokens, ROPE, dtype).reshape(tokens, 1, ROPE)
    rope[1, 0, 0], rope[2, 0, 5] = NAN, -INF
    return torch.cat([latent, rope], dim=-1)


def reference(rows: torch.Tensor):
    """(records [n, 1, ...], restored rows, EncodeStats) from the CPU codec."""
    fmt = MLAInt8HostFormat((RANK + ROPE,), 1, 1, rows.dtype)
    records = fmt.encode_reference([rows[:, None]])
    restored = fmt.decode_reference(records, rows.dtype)[0][:, 0]
    out = {
        r.name: torch.empty((len(rows), *r.shape), dtype=r.dtype) for r in fmt.records
    }
    stats = fmt.encode_into([rows[:, None]], out)
    return {k: v[:, 0] for k, v in records.items()}, restored, stats


def pinned_records(n: int, dtype) -> dict[str, torch.Tensor]:
    """Sentinel-filled [n, 1 layer, 1, 1, w] records in pinned host memory."""
    shapes = {"kv": (torch.int8, RANK), "scale": (torch.float16, RANK // TILE),
              "rope": (dtype, ROPE)}  # fmt: skip
    out = {}
    for name, (dt, width) in shapes.items():
        t = torch.full((n, 1, 1, 1, width), 3, dtype=dt)
        out[name] = t.pin_memory() if gs.CUDA else t
    return out


@pytest.mark.parametrize("layout", gs.LAYOUTS)
@pytest.mark.parametrize("page", (1, 16, 64))
def test_mla_kernels_on_the_pools_pinned_records(layout, page):
    """SGLang's MLA device pool on this device and the MLA INT8 host pool's
    own (pinned) record tensors: one encode launch for all layers, one decode
    per layer, host pages out of order; bytes and bits as the CPU codec."""
    layers, pages = 3, 4
    dev_pool = gs.make_mla_device_pool(
        layer_num=layers, page_size=page, tokens=12 * page, device=gs.DEVICE
    )
    pool = gs.make_mla_host_pool(
        dev_pool, layout=layout, host_tokens=12 * page, pin_memory=gs.CUDA
    )
    g = torch.Generator().manual_seed(page)
    dev = gs.pages_to_tokens(torch.randperm(pages, generator=g) + 1, page)
    rows = [mla_rows(torch.bfloat16, len(dev), seed=layer) for layer in range(layers)]
    for layer, r in enumerate(rows):
        dev_pool.kv_buffer[layer][dev.to(gs.DEVICE)] = r.to(gs.DEVICE)
    host = gs.pages_to_tokens(torch.tensor([5, 2, 3, 9]), page)  # backward jump, gap
    views = {
        name: t.transpose(0, 1) if layout == "layer_first" else t
        for name, t in pool.host_records.items()
    }
    unit_tokens = 1 if layout == "layer_first" else page
    mk.encode_gather(
        [mk.DeviceLayerTable(dev_pool.kv_buffer)], dev.to(gs.DEVICE), views,
        host.to(gs.DEVICE),
    )  # fmt: skip
    gs.sync()
    new_dev = gs.pages_to_tokens(torch.randperm(pages, generator=g) + 6, page)
    for layer, r in enumerate(rows):
        ref_records, ref_rows, _ = reference(r)
        unit, within = host // unit_tokens, host % unit_tokens
        for name, expected in ref_records.items():
            got = views[name][unit, layer, within]
            assert gs.same_bits(got.view(torch.int8), expected.view(torch.int8)), name
        dev_pool.kv_buffer[layer].fill_(7.0)
        records = {
            name: (t[:, layer] if layout != "layer_first" else t[layer])
            for name, t in pool.host_records.items()
        }
        mk.decode_scatter(
            records,
            host.to(gs.DEVICE),
            [dev_pool.kv_buffer[layer]],
            new_dev.to(gs.DEVICE),
        )
        gs.sync()
        assert gs.same_bits(
            dev_pool.kv_buffer[layer][new_dev.to(gs.DEVICE)].cpu(), ref_rows
        )
    gs.destroy_host_pool(pool)


def test_mla_kernels_run_on_the_callers_stream():
    """A backup and a restore queued behind a stall on a side stream: not done
    before the stall ends (nothing ran on another stream), right after it. On
    CPU (dry run) they run at once; the results are checked the same way."""
    n = 4096 if gs.CUDA else 64
    rows = mla_rows(torch.bfloat16, n, seed=3)
    _, ref_rows, _ = reference(rows)
    src = rows.to(gs.DEVICE)
    out = pinned_records(n, torch.bfloat16)
    dst = torch.zeros_like(src)
    idx = torch.arange(n, device=gs.DEVICE)
    stream = torch.cuda.Stream() if gs.CUDA else None
    if gs.CUDA:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if gs.CUDA else contextlib.nullcontext():
        if gs.CUDA:
            torch.cuda._sleep(gs.DELAY)
        mk.encode_gather([mk.DeviceLayerTable([src])], idx, out, idx)
        mk.decode_scatter({k: v[:, 0] for k, v in out.items()}, idx, [dst], idx)
        done = torch.cuda.Event() if gs.CUDA else None
        if gs.CUDA:
            done.record()
    if gs.CUDA:
        assert not done.query()
        done.synchronize()
    assert gs.same_bits(dst.cpu(), ref_rows)
