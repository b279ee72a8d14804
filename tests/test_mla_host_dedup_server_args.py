"""--enable-mla-hicache-host-dedup at start-up: SGLang's own argument
resolution over a tiny local DeepSeek config (no weights). Accepted with
HiCache and any host dtype the model takes; refused, naming the flag, without
HiCache or with an L3 storage backend."""

from __future__ import annotations

import pytest
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
