"""The MLA INT8 host pool (pool_host/mla_encoded.py, int8 MLA format) at DeepSeek
geometry on CPU: SGLang's real MLATokenToKVPool, the real MLA host pools and the real
HiCacheController."""

from __future__ import annotations

import pytest
import torch

from scripts.rigs.hicache_harness import (
    MLAGeometry,
    fill_random,
    make_device_pool,
    make_host_pool,
    make_rig,
    write_evict_load,
)
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import TILE, MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

MLATokenToKVPoolINT8Host = host_pool_cls("int8", "mla")

LATENT, ROPE = 512, 64
NAN, INF = float("nan"), float("inf")
LAYOUT_IO = [
    ("page_first", "kernel"),
    ("page_first", "direct"),
    ("page_first_direct", "kernel"),
    ("page_first_direct", "direct"),
    ("layer_first", "kernel"),
    ("layer_first", "direct"),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def expected_restore(rows: torch.Tensor) -> torch.Tensor:
    """What the format's reference restores for device rows [n, 1, 576]."""
    f = MLAInt8HostFormat((LATENT + ROPE,), 1, 1, rows.dtype)
    x = rows.view(-1, 1, 1, LATENT + ROPE)
    (y,) = f.decode_reference(f.encode_reference([x]), rows.dtype)
    return y.view_as(rows)


def poison(pool, dev):
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer][dev] = NAN


def round_trip(rig, n_tokens: int, seed: int = 0, edit=None):
    """Device rows -> L2 (controller write) -> L1 eviction (poisoned) -> load."""
    pool = rig.device_pool
    dev = rig.allocator.alloc(n_tokens)
    written = fill_random(pool, dev, seed=seed)
    if edit is not None:
        edit(pool, dev)
        written = [pool.kv_buffer[i][dev].clone() for i in range(pool.layer_num)]
    dev2 = write_evict_load(rig, dev, evict=poison)
    restored = [pool.kv_buffer[i][dev2].clone() for i in range(pool.layer_num)]
    return written, restored


def test_capacity_from_allocated_buffers():
    """DeepSeek geometry (61 layers), the same token count in both pools: bytes are
    summed over the tensors each pool really allocated."""
    geo = MLAGeometry(layer_num=61, page_size=64)
    device_pool = make_device_pool(geo, 64)
    tokens = 2 * 64
    pools = {
        hd: make_host_pool(
            device_pool, host_tokens=tokens, layout="page_first", host_dtype=hd
        )
        for hd in ("auto", "int8")
    }
    stock, int8 = pools["auto"], pools["int8"]
    assert stock.size == int8.size == tokens
    stock_bytes = stock.kv_buffer.numel() * stock.kv_buffer.element_size()
    int8_bytes = sum(t.numel() * t.element_size() for t in int8.kv_buffer)
    assert int8_bytes == int8.get_size_per_token() * tokens == 648 * 61 * tokens
    assert stock_bytes == stock.get_size_per_token() * tokens == 1152 * 61 * tokens
    info = device_pool.get_device_pool_infos()[0].buffer_info
    assert MLATokenToKVPoolINT8Host.host_bytes_per_device_byte(info) == 648 / 1152
    assert int8.device_size_per_token() == stock.get_size_per_token()


@pytest.mark.parametrize("layout,page_size", [("page_first", 4), ("layer_first", 1)])
def test_nonfinite_policy_and_statistics(layout, page_size):
    """A NaN latent tile restores as NaN (that tile only), an Inf RoPE value as Inf;
    both are counted; the amax statistic covers finite tiles only."""
    geo = MLAGeometry(layer_num=3, page_size=page_size)
    rig = make_rig(
        geo,
        device_tokens=16 * page_size,
        host_tokens=16 * page_size,
        layout=layout,
        io_backend="direct",
        host_dtype="int8",
    )
    pool = rig.host_pool
    assert pool.nonfinite_group_count() == 0
    assert torch.equal(pool.scale_amax_by_layer(), torch.zeros(3, 1))

    def edit(device_pool, dev):
        device_pool.kv_buffer[0][dev[1], 0, TILE + 3] = NAN
        device_pool.kv_buffer[0][dev[1], 0, 5] = 300.0  # finite tile, counts
        device_pool.kv_buffer[1][dev[2], 0, LATENT + 1] = INF
        device_pool.kv_buffer[2][dev[3], 0, 2 * TILE] = 1e7  # past fp16 scales
        device_pool.kv_buffer[2][dev[0], 0, 7] = -40.0

    written, restored = round_trip(rig, 4 * page_size, seed=3, edit=edit)
    nan_tile = torch.isnan(restored[0][1, 0])
    assert nan_tile[TILE : 2 * TILE].all() and nan_tile.sum() == TILE
    assert restored[1][2, 0, LATENT + 1].item() == INF
    assert torch.isnan(restored[2][3, 0, 2 * TILE : 3 * TILE]).all()
    assert pool.nonfinite_group_count() == 3
    amax = pool.scale_amax_by_layer()
    assert amax.shape == (3, 1) and amax.dtype == torch.float32
    want = []
    for w in written:
        tiles = w[..., :LATENT].unflatten(-1, (4, TILE)).float().abs().amax(-1)
        ok = torch.isfinite(tiles) & (tiles <= 127 * 65504)
        want.append(tiles[ok].max().item())
    assert amax[:, 0].tolist() == want
    assert want[0] == 300.0 and want[2] == 40.0


@pytest.mark.parametrize(
    "case",
    # Packed NEXTN drafts are served: tests/test_spec_host_pools.py.
    ["layout", "fp8", "fp32", "dcp", "layer_shard", "wide_rows"],
)
def test_unsupported_setups_fail_naming_the_flag(case):
    dtype = {"fp8": torch.float8_e4m3fn, "fp32": torch.float32}.get(
        case, torch.bfloat16
    )
    device_pool = make_device_pool(MLAGeometry(layer_num=2, dtype=dtype), 16)
    kwargs = dict(
        host_tokens=32, layout="page_unified" if case == "layout" else "page_first"
    )
    if case == "dcp":
        kwargs.update(dcp_size=2, dcp_rank=0)
    if case == "layer_shard":
        kwargs["layer_shard_enabled"] = True
    if case == "wide_rows":
        device_pool.kv_cache_dim = 656  # a DSA FP8 packed row
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int8"):
        make_host_pool(device_pool, host_pool_cls=MLATokenToKVPoolINT8Host, **kwargs)
