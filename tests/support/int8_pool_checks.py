"""The INT8 pool and markers shared by the tests of its fused kernels
(tests/test_int8_*.py, tests/test_kv_int8_triton.py)."""

from __future__ import annotations

import pytest

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


def int8_pools(
    geo: Geometry, device_tokens, host_tokens, layout, access=None, use_run_copies=False
):
    """A CPU device pool and the INT8 host pool over it, on the torch path or, with
    `access` (direct, staged), on the fused kernels."""
    device_pool = make_device_pool(geo, device_tokens=device_tokens)
    # None reads SGLANG_HICACHE_FUSED_TRANSFER: the torch path on CPU.
    pool = make_host_pool(
        device_pool, host_tokens=host_tokens, layout=layout,
        host_pool_cls=MHATokenToKVPoolINT8Host, run_copies=use_run_copies,
        fused_transfer=access,
    )  # fmt: skip
    return device_pool, pool
