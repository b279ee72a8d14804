"""Host-pool checks shared by the encoded MHA formats (tests/test_conformance.py and the
per-format files), each run with a format name."""

from __future__ import annotations

from dataclasses import replace

import torch

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from tests.support.conformance import bits
from tests.support.fp8_reference import random_finite_fp8
from scripts.rigs.hicache_harness import (
    Geometry,
    fill_random,
    make_device_pool,
    make_host_pool,
)


def pages(page_ids, page_size):
    page_ids = torch.as_tensor(page_ids)
    return (page_ids[:, None] * page_size + torch.arange(page_size)).flatten()


def fill_spread(device_pool, indices, seed):
    """Random K/V with a per-channel scale spread (key outliers sit in fixed channels)
    and a far-from-zero offset on some heads."""
    written = fill_random(device_pool, indices, seed)
    for layer, (k_rows, v_rows) in enumerate(written):
        gain = torch.ones(k_rows.shape[-1])
        gain[::7] = 20.0
        k_rows = (k_rows.float() * gain).to(k_rows.dtype)
        v_rows = (v_rows.float() + 3.0).to(v_rows.dtype)
        device_pool.k_buffer[layer][indices] = k_rows
        device_pool.v_buffer[layer][indices] = v_rows
        written[layer] = (k_rows, v_rows)
    return written


def build(
    fmt, layout, page_size, dtype=torch.bfloat16, head_dim=64, v_head_dim=None,
    **pool_kwargs,
):  # fmt: skip
    geo = Geometry(
        layer_num=2,
        head_num=2,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        page_size=page_size,
    )
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pool = make_host_pool(
        device_pool, host_tokens=16 * page_size, layout=layout, host_dtype=fmt,
        **pool_kwargs,
    )  # fmt: skip
    return geo, device_pool, pool


def bytes_per_token_at_qwen3_8b(formats, page_size, layout="page_first", fp8=None):
    """Allocated host bytes per token of each format's pool at Qwen3-8B geometry (36
    layers, 8 KV heads, head dim 128), through the real dispatch, on a BF16 (or `fp8`)
    device pool; each pool's buffers are what get_size_per_token says and the budget
    buys whole pages plus one."""
    geo = Geometry(layer_num=36, head_num=8, head_dim=128, page_size=page_size)
    if fp8 is not None:
        geo = replace(geo, dtype=fp8)
    device_pool = make_device_pool(geo, device_tokens=2 * page_size)
    per_token = {}
    for name in formats:
        extra = {} if name == "auto" or fp8 is None else {"device_kv_dtype": fp8}
        pool = make_host_pool(
            device_pool, host_size_gb=0.02, layout=layout, host_dtype=name, **extra
        )
        if name == "auto" and fp8 is not None:
            assert type(pool) is MHATokenToKVPoolHost and pool.dtype == torch.uint8
        buffers = getattr(pool, "host_records", {"kv": pool.kv_buffer}).values()
        nbytes = sum(b.nbytes for b in buffers)
        assert nbytes == pool.size * pool.get_size_per_token()
        pages = int(0.02e9 // pool.get_size_per_token()) // page_size + 1
        assert pool.size == pages * page_size
        per_token[name] = nbytes / pool.size
    return per_token


def restore_nan_key_and_inf_value(fmt, layout, page_size, after_backup, fp8=None):
    """Back up a NaN key (layer 1, second token, head 1, channel 5) and an Inf value
    (layer 0, last token, head 0, channel 40; NaN on E4M3, which has no Inf), call
    after_backup(pool), restore into new slots; return (pool, restored layer-1 keys,
    restored layer-0 values), FP8 ones as float32."""
    kw = {} if fp8 is None else {"dtype": fp8, "device_kv_dtype": fp8}
    geo, device_pool, pool = build(fmt, layout, page_size, **kw)
    dev, host = pages([1, 2], page_size), pages([3, 4], page_size)
    if fp8 is None:
        fill_spread(device_pool, dev, seed=9)
        nan, inf = float("nan"), float("inf")
    else:  # FP8 is stored as uint8: the bytes of NaN and +Inf (E5M2)
        fill_fp8(device_pool, dev, fp8, seed=9)
        nan, inf = 0x7F, 0x7C if fp8 == torch.float8_e5m2 else 0x7F
    device_pool.k_buffer[1][dev[1], 1, 5] = nan
    device_pool.v_buffer[0][dev[-1], 0, 40] = inf
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    after_backup(pool)
    new_dev = pages([6, 7], page_size)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
    k1, v0 = device_pool.k_buffer[1][new_dev], device_pool.v_buffer[0][new_dev]
    if fp8 is not None:
        k1, v0 = k1.view(fp8).float(), v0.view(fp8).float()
    return pool, k1, v0


def assert_finite_elsewhere(pool, k1, v0):
    """Once the non-finite groups are zeroed: every other restored value and the scale
    statistics are finite."""
    assert torch.isfinite(k1).all() and torch.isfinite(v0).all()
    amax = pool.scale_amax_by_layer()
    assert amax.shape == (2, 2) and torch.isfinite(amax).all() and (amax > 0).all()


def check_fused_path_writes_the_torch_paths_bytes(
    fmt, layout, page_size, access, fp8=None
):
    """Through the real pool, a NaN key included (FP8: edge_fp8_rows): the fused
    kernels' host bytes, statistics and restored rows equal the torch path's."""
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=page_size)
    geo = geo if fp8 is None else replace(geo, dtype=fp8)
    extra = {} if fp8 is None else {"device_kv_dtype": fp8}
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pools = {}
    for path in ("torch", "fused"):
        pool = make_host_pool(
            device_pool, host_tokens=8 * page_size, layout=layout, host_dtype=fmt,
            fused_transfer=access if path == "fused" else "off", **extra,
        )  # fmt: skip
        assert pool.host_format.fused_available(torch.device("cpu"))
        pools[path] = pool
    dev, host = pages([1, 2, 3], page_size), pages([5, 0, 3], page_size)
    if fp8 is None:
        fill_spread(device_pool, dev, seed=12)
        device_pool.k_buffer[0][dev[1], 1, 3] = float("nan")
    else:
        edge_fp8_rows(device_pool, dev, fp8, seed=page_size)
    for pool in pools.values():
        pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    torch_pool, fused_pool = pools["torch"], pools["fused"]
    assert fused_pool.transfer_path == f"fused_{access}"
    for name, buf in torch_pool.host_records.items():
        assert torch.equal(
            fused_pool.host_records[name].view(torch.uint8), buf.view(torch.uint8)
        ), name
    assert fused_pool.nonfinite_group_count() == torch_pool.nonfinite_group_count()
    assert torch.equal(
        fused_pool.scale_amax_by_layer(), torch_pool.scale_amax_by_layer()
    )
    # A byte that is NaN in both FP8 formats: what a wiped FP8 row holds.
    poison = 0 if fp8 is None else 0xFF
    new_dev = pages([8, 10, 9], page_size)
    restored = {}
    for path, pool in pools.items():
        for layer in range(geo.layer_num):
            device_pool.k_buffer[layer].fill_(poison)
            device_pool.v_buffer[layer].fill_(poison)
            pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
        restored[path] = [
            b.clone() for b in device_pool.k_buffer + device_pool.v_buffer
        ]
    untouched = torch.ones(device_pool.k_buffer[0].shape[0], dtype=torch.bool)
    untouched[new_dev] = False
    for a, b in zip(restored["torch"], restored["fused"]):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(bits(a.nan_to_num(0)), bits(b.nan_to_num(0)))
        assert (b[untouched] == poison).all()
    restored = {p: [r[new_dev] for r in rows] for p, rows in restored.items()}
    return torch_pool, fused_pool, restored


def random_fp8(shape, fp8, gen, spread=True) -> torch.Tensor:
    """FP8 rows as an FP8 KV cache holds them: a per-channel spread (key outliers), an
    offset, and values up to the format's largest finite one."""
    x = torch.randn(shape, generator=gen)
    if spread:
        gain = torch.ones(shape[-1])
        gain[::7] = 40.0
        x = x * gain + 2.0
    top = torch.finfo(fp8).max
    x[..., 3] = top  # a saturating group: m + 15 s may round above the top
    return x.clamp(-top, top).to(fp8)


def fill_fp8(device_pool, indices, fp8, seed):
    gen = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(device_pool.layer_num):
        shape = (len(indices), *device_pool.k_buffer[layer].shape[1:])
        k = random_fp8(shape, fp8, gen)
        v = random_fp8(shape, fp8, gen, spread=layer % 2 == 0)
        # SGLang stores FP8 KV as uint8 (index_put has no FP8 kernel).
        device_pool.k_buffer[layer][indices] = k.view(torch.uint8)
        device_pool.v_buffer[layer][indices] = v.view(torch.uint8)
        written.append((k, v))
    return written


def edge_fp8_rows(device_pool, indices, fp8, seed):
    """fill_fp8's rows, every other token replaced by random finite FP8 bytes
    (subnormals, +-0, the largest value), a NaN in K of layer 0 and (E5M2) an Inf in V
    of the last layer."""
    fill_fp8(device_pool, indices, fp8, seed)
    gen = torch.Generator().manual_seed(seed)
    odd = indices[1::2]
    for buf in device_pool.k_buffer + device_pool.v_buffer:
        rows = random_finite_fp8((len(odd), *buf.shape[1:]), fp8, gen)
        buf[odd] = rows.view(torch.uint8)
    device_pool.k_buffer[0][indices[2], 0, 7] = 0x7F  # NaN in both FP8s
    if fp8 == torch.float8_e5m2:
        device_pool.v_buffer[-1][indices[-1], 1, 0] = 0x7C  # +Inf
