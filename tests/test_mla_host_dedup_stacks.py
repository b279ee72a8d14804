"""--enable-mla-hicache-host-dedup refused, naming the flag, where the HiCache stack is
built (the ServerArgs-level cases: tests/support/startup_table.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("restore_environ")

FLAG = "--enable-mla-hicache-host-dedup"


def test_refuses_models_without_mla_kv():
    from scripts.rigs.hicache_harness import (
        Geometry,
        make_device_pool,
        mha_radix_cache,
        publish_server_args,
    )

    server_args = publish_server_args("auto", enable_mla_hicache_host_dedup=True)
    device_pool = make_device_pool(Geometry(), 64)
    with pytest.raises(ValueError, match=f"{FLAG} is for MLA models"):
        mha_radix_cache(server_args, device_pool, requests=2, max_context_len=128)


def test_refuses_hybrid_stacks():
    """Every stack but the plain and DSA ones (Mamba, DeepSeek V4, here SWA)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _select_strategy,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from scripts.rigs.hicache_harness import publish_server_args

    publish_server_args("auto", enable_mla_hicache_host_dedup=True)
    kv = SWAKVPool(
        size=64,
        size_swa=32,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device="cpu",
        enable_alt_stream=False,
    )
    with pytest.raises(ValueError, match=f"{FLAG} serves models with one full"):
        _select_strategy(kv, {ComponentType.FULL, ComponentType.SWA})


def test_stack_refuses_storage_backends_other_than_file_and_mooncake():
    """`file` and `mooncake` pass (the source alone serves L3 for its group)."""
    from sglang.srt.mem_cache.hicache_host_dedup import check_host_dedup_supported
    from scripts.rigs.hicache_harness import MLAGeometry, make_device_pool

    device_pool = make_device_pool(MLAGeometry(layer_num=2), 16)
    for backend in (None, "file", "mooncake"):
        check_host_dedup_supported(device_pool, backend)
    with pytest.raises(ValueError) as error:
        check_host_dedup_supported(device_pool, "nixl")
    message = str(error.value)
    assert f"{FLAG} does not support --hicache-storage-backend nixl" in message
    assert "Use --hicache-storage-backend file or mooncake, or drop" in message
