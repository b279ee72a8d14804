"""INT8 host-pool checks shared by the torch-path and fused-kernel tests
(tests/test_int8_*.py, tests/test_kv_int8_triton.py): the pool, its reference restore
and device slots (the unordered-slots round trips are
tests/test_conformance.py::test_host_index_orders)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from scripts.rigs.hicache_harness import (
    Geometry,
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


def int8_pool(device_pool, layout, host_tokens, use_run_copies=False, **kwargs):
    """kwargs: the pool's own constructor keywords (fused_transfer)."""
    return make_host_pool(
        device_pool,
        host_tokens=host_tokens,
        layout=layout,
        host_pool_cls=MHATokenToKVPoolINT8Host,
        run_copies=use_run_copies,
        **kwargs,
    )


def int8_pools(
    geo: Geometry, device_tokens, host_tokens, layout, access=None, use_run_copies=False
):
    """A CPU device pool and the INT8 host pool over it, on the torch path or, with
    `access` (direct, staged), on the fused kernels."""
    device_pool = make_device_pool(geo, device_tokens=device_tokens)
    # None reads SGLANG_HICACHE_FUSED_TRANSFER: the torch path on CPU.
    pool = int8_pool(
        device_pool, layout, host_tokens, use_run_copies, fused_transfer=access
    )
    return device_pool, pool


def unit_tokens(layout: str, page_size: int) -> int:
    """Tokens per host unit (pool_host/encoded.py)."""
    return 1 if layout == "layer_first" else page_size


def expected_restore(rows: torch.Tensor) -> torch.Tensor:
    q, scale = codec.quantize_reference(rows)
    return codec.dequantize_reference(q, scale, rows.dtype)


def device_alloc(n_pages, page_size, first_page=1, shuffle_seed=None):
    pages = torch.arange(first_page, first_page + n_pages)
    if shuffle_seed is not None:
        gen = torch.Generator().manual_seed(shuffle_seed)
        pages = pages[torch.randperm(n_pages, generator=gen)]
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()
