"""MHATokenToKVPoolINT8Host: the real patched SGLang host pool on CPU."""

from __future__ import annotations


import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    make_device_pool,
)
from tests.support.int8_pool_checks import (
    int8_pool,
)


@pytest.mark.parametrize("layout", ("page_head", "page_unified"))
def test_unsupported_layout_fails_naming_the_flag(layout):
    device_pool = make_device_pool(Geometry(), 16)
    with pytest.raises(NotImplementedError, match="--hicache-mem-layout"):
        int8_pool(device_pool, layout, 16)


def test_quantized_device_kv_fails_naming_the_flag():
    device_pool = make_device_pool(Geometry(dtype=torch.float8_e4m3fn), 16)
    with pytest.raises(NotImplementedError) as error:
        int8_pool(device_pool, "page_first", 16)
    # The value to pass, a real --kv-cache-dtype choice; not the storage dtype.
    message = str(error.value)
    assert "Pass --kv-cache-dtype bf16" in message
    assert "quantized (FP8/FP4)" in message
    assert "uint8" not in message and "fp16" not in message
