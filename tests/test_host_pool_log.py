"""Every KV host pool states its bytes per token at start-up: the stock pools
(--hicache-host-dtype auto) as the encoded ones do, once each."""

from __future__ import annotations

import logging

import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    make_device_pool,
    make_host_pool,
)

GEOMETRIES = {
    # (heads 2 x (K 16 + V 16) x 3 layers) BF16
    "mha": (Geometry(), 2 * 32 * 3 * 2),
    # (512 latent + 64 RoPE) x 2 layers, FP16
    "mla": (MLAGeometry(layer_num=2, dtype=torch.float16), 576 * 2 * 2),
}


def start_up_lines(caplog, geo, host_dtype: str) -> tuple[object, list[str]]:
    device_pool = make_device_pool(geo, 64)
    with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.pool_host"):
        pool = make_host_pool(device_pool, host_tokens=128, host_dtype=host_dtype)
    lines = [
        r.getMessage() for r in caplog.records if "host pool stores" in r.getMessage()
    ]
    return pool, lines


@pytest.mark.parametrize("kind", GEOMETRIES)
def test_stock_pool_states_its_bytes_per_token(caplog, kind):
    geo, bytes_per_token = GEOMETRIES[kind]
    pool, lines = start_up_lines(caplog, geo, "auto")
    assert pool.size_per_token == bytes_per_token
    dtype = str(geo.dtype).removeprefix("torch.").upper()
    assert lines == [
        f"HiCache kv host pool stores {dtype} KV: {bytes_per_token} B/token (as the "
        "device KV, --hicache-host-dtype auto), layout=layer_first."
    ]


@pytest.mark.parametrize("kind", GEOMETRIES)
def test_encoded_pool_states_its_own_line_only(caplog, kind):
    geo, _ = GEOMETRIES[kind]
    pool, lines = start_up_lines(caplog, geo, "int8")
    (line,) = lines
    assert f"stores INT8 KV: {pool.size_per_token} B/token (" in line
    assert "--hicache-host-dtype auto" not in line
