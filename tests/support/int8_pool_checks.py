"""INT8 host-pool checks shared by the torch-path and fused-kernel tests
(tests/test_int8_*.py, tests/test_kv_int8_triton.py): the pool, the
documented record layouts read directly, and the unordered-slots round trip."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from scripts.rigs.hicache_harness import (
    Geometry,
    fill_random,
    make_device_pool,
    make_host_pool,
)

MHATokenToKVPoolINT8Host = host_pool_cls("int8")

# For modules whose fused kernels run under Triton's interpreter on CPU
# tensors: numpy warns about the lanes the kernels mask out.
INTERPRETED_KERNELS = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("triton_interpreter"),
]


def int8_pool(device_pool, layout, host_tokens, use_run_copies=False):
    pool = make_host_pool(
        device_pool,
        host_tokens=host_tokens,
        layout=layout,
        host_pool_cls=MHATokenToKVPoolINT8Host,
    )
    pool.use_run_copies = use_run_copies
    return pool


def int8_pools(geo: Geometry, device_tokens, host_tokens, layout, access=None):
    """A CPU device pool and the INT8 host pool over it, on the torch path or,
    with `access` (direct, staged), on the fused kernels."""
    device_pool = make_device_pool(geo, device_tokens=device_tokens)
    pool = int8_pool(device_pool, layout, host_tokens)
    if access is not None:
        pool.use_fused_kernels = True
        pool.fused_host_access = access
    return device_pool, pool


def unit_tokens(layout: str, page_size: int) -> int:
    """Tokens per host unit (pool_host/encoded.py)."""
    return 1 if layout == "layer_first" else page_size


def host_records(buffers, layout, page_size, layer, tokens):
    """(k, v, k_scale, v_scale) that host buffers (the pool's kv_buffer: K, V,
    scales) hold for `tokens` of `layer`, read straight from the documented
    layouts:  page_first*: [page, layer, token_in_page, ...]
              layer_first: [layer, token, 1, ...]"""
    out = []
    for buf in buffers:
        if layout == "layer_first":
            out.append(buf[layer, tokens, 0])
        else:
            out.append(buf[tokens // page_size, layer, tokens % page_size])
    k, v, scale = out
    return k, v, scale[:, 0], scale[:, 1]


def unordered_host_pages(page_size):
    """Host pages in an order with runs (6 7, 2 3), a backward jump (7 -> 2),
    a gap (3 -> 9) and a descending pair (5 4), as token indices."""
    pages = torch.tensor([6, 7, 2, 3, 9, 5, 4])
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def expected_restore(rows: torch.Tensor) -> torch.Tensor:
    q, scale = codec.quantize_reference(rows)
    return codec.dequantize_reference(q, scale, rows.dtype)


def device_alloc(n_pages, page_size, first_page=1, shuffle_seed=None):
    pages = torch.arange(first_page, first_page + n_pages)
    if shuffle_seed is not None:
        gen = torch.Generator().manual_seed(shuffle_seed)
        pages = pages[torch.randperm(n_pages, generator=gen)]
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def check_unordered_round_trip(layout, page_size, configure):
    """Backup to host slots in a scrambled order, then load them back in yet
    another order: each token's records sit at exactly its host slot (read
    from the buffers directly), nothing else on the host changed, and each
    device slot gets the reference restore of the token loaded into it.
    configure(pool) picks the transfer path."""
    geo = Geometry(layer_num=2, head_num=2, head_dim=16, page_size=page_size)
    device_pool = make_device_pool(geo, device_tokens=32 * page_size)
    pool = int8_pool(device_pool, layout, 16 * page_size)
    configure(pool)
    host = unordered_host_pages(page_size)
    n = len(host)
    dev = device_alloc(n // page_size, page_size, shuffle_seed=3)
    written = fill_random(device_pool, dev, seed=11)
    snapshot = [b.clone() for b in pool.kv_buffer]
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")

    for layer, (k_rows, v_rows) in enumerate(written):
        k, v, k_scale, v_scale = host_records(
            pool.kv_buffer, layout, page_size, layer, host
        )
        for got, got_scale, rows in ((k, k_scale, k_rows), (v, v_scale, v_rows)):
            q_ref, s_ref = codec.quantize_reference(rows)
            assert torch.equal(got, q_ref)
            assert torch.equal(got_scale.view(torch.int16), s_ref.view(torch.int16))
    # Every host slot not in `host` kept its bytes.
    untouched = torch.ones(pool.size, dtype=torch.bool)
    untouched[host] = False
    kept = torch.nonzero(untouched).flatten()
    for layer in range(geo.layer_num):
        now = host_records(pool.kv_buffer, layout, page_size, layer, kept)
        then = host_records(snapshot, layout, page_size, layer, kept)
        for a, b in zip(now, then):
            assert torch.equal(a.view(torch.int8), b.view(torch.int8))

    # Load in another scrambled order: reversed pages, into fresh device slots.
    order = torch.arange(n).view(-1, page_size).flip(0).flatten()
    new_dev = device_alloc(n // page_size, page_size, first_page=16, shuffle_seed=4)
    for layer in range(geo.layer_num):
        device_pool.k_buffer[layer].fill_(7.0)
        device_pool.v_buffer[layer].fill_(7.0)
        pool.load_to_device_per_layer(
            device_pool, host[order], new_dev, layer, "direct"
        )
    untouched_dev = torch.ones(device_pool.k_buffer[0].shape[0], dtype=torch.bool)
    untouched_dev[new_dev] = False
    for layer, (k_rows, v_rows) in enumerate(written):
        for buf, rows in (
            (device_pool.k_buffer[layer], k_rows),
            (device_pool.v_buffer[layer], v_rows),
        ):
            assert torch.equal(buf[new_dev], expected_restore(rows[order]))
            assert (buf[untouched_dev] == 7.0).all()
