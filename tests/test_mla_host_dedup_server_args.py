"""--enable-mla-hicache-host-dedup at start-up: SGLang's own argument
resolution over a tiny local DeepSeek config (no weights). Accepted with
HiCache and any host dtype the model takes; refused, naming the flag, without
HiCache or with an L3 storage backend."""

from __future__ import annotations

import pytest
import torch
from tests.support.server_args import DEEPSEEK_V2_MLA, model_dir, resolve

pytestmark = pytest.mark.usefixtures("restore_environ")

FLAG = "--enable-mla-hicache-host-dedup"
_DEEPSEEK_MLA = dict(DEEPSEEK_V2_MLA, kv_lora_rank=512, qk_rope_head_dim=64)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("mla"), "deepseek", _DEEPSEEK_MLA)


@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
def test_accepted_with_hicache(mla_model, host_dtype):
    args = resolve(
        mla_model, hicache_host_dtype=host_dtype, enable_mla_hicache_host_dedup=True
    )
    assert args.enable_mla_hicache_host_dedup


def test_off_by_default(mla_model):
    assert not resolve(mla_model).enable_mla_hicache_host_dedup


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_refuses_storage_backends(mla_model, backend):
    with pytest.raises(ValueError, match=f"{FLAG} does not support"):
        resolve(
            mla_model,
            enable_mla_hicache_host_dedup=True,
            hicache_storage_backend=backend,
        )


def test_refuses_without_hicache(mla_model):
    with pytest.raises(ValueError, match=f"{FLAG} requires --enable-hierarchical"):
        resolve(
            mla_model,
            enable_hierarchical_cache=False,
            enable_mla_hicache_host_dedup=True,
        )


# --- refused where the HiCache stack is built (the model's pools) -------------


def test_refuses_models_without_mla_kv():
    """An MHA model's plain stack: the flag is refused, naming it."""
    from tests.support.hicache_harness import (
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
    """A sliding-window hybrid (and every stack but the plain one: DSA,
    Mamba, DeepSeek V4) is refused, naming the flag."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _select_strategy,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from tests.support.hicache_harness import publish_server_args

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
