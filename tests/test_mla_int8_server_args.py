"""--hicache-host-dtype int8 for MLA models at start-up: SGLang's own argument
resolution over tiny local DeepSeek configs (no weights). Plain MLA models
whose kv_lora_rank splits into 128-value tiles are accepted with every layout
and io backend the MLA INT8 pool serves, BF16/FP16 device KV; FP8 device KV,
DSA sparse models, HiSparse and DCP are refused (speculative drafts:
test_spec_server_args.py), naming the flag."""

from __future__ import annotations

import logging

import pytest
from tests.support.server_args import (
    DEEPSEEK_V2_MLA,
    DEEPSEEK_V3,
    INT8_IO_BACKENDS,
    INT8_LAYOUTS,
    model_dir,
    resolve,
)

from sglang.srt.arg_groups.overrides import resolution_result

pytestmark = pytest.mark.usefixtures("restore_environ")

# DeepSeek-V2's latent widths (kv_lora_rank 512, qk_rope_head_dim 64).
_DEEPSEEK_MLA = dict(DEEPSEEK_V2_MLA, kv_lora_rank=512, qk_rope_head_dim=64)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("mla"), "deepseek", _DEEPSEEK_MLA)


def refused(path, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        resolve(path, hicache_host_dtype="int8", **kwargs)
    message = str(error.value)
    assert "--hicache-host-dtype int8" in message
    return message


@pytest.mark.parametrize("io_backend", INT8_IO_BACKENDS)
@pytest.mark.parametrize("layout", INT8_LAYOUTS)
def test_accepts_plain_mla_with_every_layout_and_io_backend(
    mla_model, caplog, layout, io_backend
):
    pair = dict(hicache_mem_layout=layout, hicache_io_backend=io_backend)
    stock = resolve(mla_model, **pair)
    with caplog.at_level(logging.INFO, logger="sglang.srt.arg_groups.hicache_hook"):
        server_args = resolve(mla_model, hicache_host_dtype="int8", **pair)
    # The MLA INT8 pool takes upstream's layout/io rewrites unchanged.
    for name in ("hicache_mem_layout", "hicache_io_backend"):
        assert resolution_result(server_args, name) == resolution_result(stock, name)
    assert "HiCache host KV dtype: int8 for MLA models (" in caplog.text
    assert "the latent in 128-value tiles" in caplog.text


# FP16 device KV is --dtype float16 with --kv-cache-dtype auto: argparse has
# no fp16 --kv-cache-dtype.
@pytest.mark.parametrize(
    "kv_cache_dtype,dtype",
    [("bf16", "auto"), ("auto", "bfloat16"), ("auto", "float16")],
)
def test_accepts_bf16_and_fp16_device_kv(mla_model, kv_cache_dtype, dtype):
    resolve(
        mla_model, hicache_host_dtype="int8", kv_cache_dtype=kv_cache_dtype, dtype=dtype
    )


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_refuses_fp8_mla_device_kv(mla_model, kv_cache_dtype):
    message = refused(mla_model, kv_cache_dtype=kv_cache_dtype)
    assert f"--kv-cache-dtype {kv_cache_dtype}" in message


def test_refuses_layouts_the_pool_does_not_serve(mla_model):
    message = refused(mla_model, hicache_mem_layout="page_unified")
    assert "--hicache-mem-layout page_unified" in message


def test_refuses_dsa_sparse_mla(tmp_path, monkeypatch):
    # SGLang's DSA resolution reads the GPU's compute capability; stand in an H100.
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    config = dict(
        DEEPSEEK_V3,
        q_lora_rank=16,
        index_topk=64,
        index_head_dim=32,
        index_n_heads=2,
    )
    message = refused(model_dir(tmp_path, "dsa", config))
    assert "DSA/NSA sparse-attention MLA models" in message


# Speculative drafts (NEXTN packed, EAGLE3 separate) are accepted:
# test_spec_server_args.py.


def test_refuses_kv_lora_rank_without_128_value_tiles(tmp_path):
    config = dict(_DEEPSEEK_MLA, kv_lora_rank=320)
    message = refused(model_dir(tmp_path, "odd", config))
    assert "kv_lora_rank 320" in message


def test_auto_accepts_what_int8_refuses(tmp_path, mla_model):
    resolve(mla_model, kv_cache_dtype="fp8_e4m3")
    resolve(model_dir(tmp_path, "odd", dict(_DEEPSEEK_MLA, kv_lora_rank=320)))
