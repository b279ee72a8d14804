"""Every KV host pool states its bytes per token at start-up: the stock pools
(--hicache-host-dtype auto) as the encoded ones do, once each."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.int4_pool_checks import build
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
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.pool_host"):
        pool = make_host_pool(device_pool, host_tokens=128, host_dtype=host_dtype)
    lines = [
        r.getMessage() for r in caplog.records if "host pool stores" in r.getMessage()
    ]
    return pool, lines


@pytest.mark.parametrize("kind", GEOMETRIES)
def test_stock_and_encoded_pools_state_their_own_line_once(caplog, kind):
    geo, bytes_per_token = GEOMETRIES[kind]
    pool, lines = start_up_lines(caplog, geo, "auto")
    assert pool.size_per_token == bytes_per_token
    dtype = str(geo.dtype).removeprefix("torch.").upper()
    assert lines == [
        f"HiCache kv host pool stores {dtype} KV: {bytes_per_token} B/token (as the "
        "device KV, --hicache-host-dtype auto), layout=layer_first."
    ]
    pool, lines = start_up_lines(caplog, geo, "int8")
    (line,) = lines
    assert f"stores INT8 KV: {pool.size_per_token} B/token (" in line
    assert "--hicache-host-dtype auto" not in line


ROT = "Walsh-Hadamard rotation per head (seeded sign flip)"
VALUES = "values per token in groups of 64 channels"
BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
# (host_dtype, layout, page size, K and V head dims, device dtype, parts of the log)
FORMAT_LINES = [
    ("int4", "page_first", 64, 64, BF16,
     ["keys per channel over 64-token pages", VALUES]),
    ("int4", "page_first_direct", 16, 64, BF16,
     ["keys per channel over 16-token pages", VALUES]),
    ("int4", "page_first", 1, 64, BF16,
     ["keys per token in groups of 64 channels", VALUES]),
    ("int4", "layer_first", 64, 64, BF16,
     ["keys per token in groups of 64 channels", VALUES]),
    ("k8v4", "page_first", 64, 64, BF16, ["keys as int8 per token and head", VALUES]),
    ("int4r", "page_first", 64, 64, BF16,
     [ROT, "keys per channel over 64-token pages", "k in one 64-point block"]),
    ("int4r", "layer_first", 64, 96, BF16,
     [ROT, "keys per token in groups of 32 channels", "v in 3 blocks of 32"]),
    ("k8v4r", "page_first", 16, 64, BF16, [ROT, "keys as int8", "v in one 64-point"]),
    ("int4r", "page_first", 16, 72, BF16, [ROT, "k NOT rotated (head dim 72"]),
    # FP8 device KV: no exception, the torch path on the CPU as for BF16.
    ("int4", "page_first", 16, 64, E4M3, ["keys per channel over 16-token pages"]),
    ("int4", "page_first", 16, 64, E5M2, ["keys per channel over 16-token pages"]),
]  # fmt: skip


@pytest.mark.parametrize("fmt,layout,page_size,dim,dtype,parts", FORMAT_LINES)
def test_encoded_pool_states_key_grouping_rotation_and_path(
    caplog, fmt, layout, page_size, dim, dtype, parts
):
    kw = {} if dtype == BF16 else {"dtype": dtype, "device_kv_dtype": dtype}
    # The sglang logger itself: an in-process server tool may have raised its level.
    with caplog.at_level(logging.INFO, logger="sglang"):
        _, _, pool = build(fmt, layout, page_size, head_dim=dim, v_head_dim=dim, **kw)
    text, name = caplog.text, fmt.upper()
    assert (
        f"stores {name} KV: {round(pool.get_size_per_token())} B/token ({dtype}: "
        f"{pool.device_size_per_token()} B/token)" in text
    )
    assert pool.transfer_path_reason == "not CUDA (cpu)"
    assert f"{name} host pool transfer path: torch (not CUDA (cpu))" in text
    for part in parts:
        assert part in text
    warned = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "NOT rotated" in r.getMessage()
    ]
    assert bool(warned) == ("NOT rotated" in text)
