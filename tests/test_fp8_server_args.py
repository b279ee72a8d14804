"""Start-up with an FP8 device KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2,
or an FP8-KV checkpoint with auto): int4 and k8v4 are accepted, int8, int8c
and the rotated formats are refused naming the flags and suggesting int4/k8v4.

SGLang's own argument parser and resolution pipeline (ServerArgs.resolve_once)
over a tiny local Llama config (no weights), as tests/test_server_args.py.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from tests.support import server_args as sa

pytestmark = pytest.mark.usefixtures("restore_environ")

FP8_KV = ("fp8_e4m3", "fp8_e5m2")
ACCEPTED = ("int4", "k8v4")
REFUSED = ("int8", "int8c", "int4r", "k8v4r")
LAYOUT_IO = (
    ("page_first", "kernel"),
    ("page_first_direct", "direct"),
    ("layer_first", "kernel"),
    ("layer_first", "direct"),
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return sa.model_dir(tmp_path_factory.mktemp("models"), "llama", sa.LLAMA)


@pytest.mark.parametrize("kv_cache_dtype", FP8_KV)
@pytest.mark.parametrize(
    "host_dtype,layout,io_backend",
    [(f, *lio) for f, lio in itertools.product(ACCEPTED, LAYOUT_IO)],
)
def test_int4_and_k8v4_accept_fp8_device_kv(
    parser, llama, caplog, host_dtype, layout, io_backend, kv_cache_dtype
):
    args = sa.from_argv(
        parser,
        llama,
        "--device",
        "cpu",
        "--skip-tokenizer-init",
        "--enable-hierarchical-cache",
        "--hicache-host-dtype",
        host_dtype,
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--hicache-mem-layout",
        layout,
        "--hicache-io-backend",
        io_backend,
    )
    with caplog.at_level(logging.INFO, logger="sglang"):
        args.resolve_once()
    assert args.hicache_host_dtype == host_dtype
    assert args.kv_cache_dtype == kv_cache_dtype
    assert (
        f"HiCache host KV dtype: {host_dtype} for MHA models" in caplog.text
        and f"--kv-cache-dtype {kv_cache_dtype}, on load" in caplog.text
    )


@pytest.mark.parametrize("kv_cache_dtype", FP8_KV)
@pytest.mark.parametrize("host_dtype", REFUSED)
def test_formats_without_fp8_are_refused_suggesting_int4(
    parser, host_dtype, kv_cache_dtype
):
    message = sa.device_kv_refusal(parser, host_dtype, kv_cache_dtype)
    assert "pass --hicache-host-dtype int4 or k8v4" in message
    assert "--hicache-host-dtype auto" in message
    # The suggestion is a real choice and gets the server past the check.
    sa.resolve(hicache_host_dtype="int4", kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("host_dtype", ACCEPTED)
@pytest.mark.parametrize("checkpoint", sorted(sa.FP8_KV_CHECKPOINTS))
def test_fp8_kv_checkpoint_with_auto_is_accepted(tmp_path, host_dtype, checkpoint):
    """auto makes the device KV FP8 E4M3 (configure_kv_cache_dtype); the
    checkpoint's k/v scales stay with the device pool."""
    quant_config, files = sa.FP8_KV_CHECKPOINTS[checkpoint]
    config = dict(sa.LLAMA)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    path = sa.model_dir(tmp_path, checkpoint, config, **files)
    sa.resolve(path, hicache_host_dtype=host_dtype)


@pytest.mark.parametrize("checkpoint", sorted(sa.FP8_KV_CHECKPOINTS))
def test_fp8_kv_checkpoint_refusal_names_int4(tmp_path, checkpoint):
    quant_config, files = sa.FP8_KV_CHECKPOINTS[checkpoint]
    config = dict(sa.LLAMA)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    path = sa.model_dir(tmp_path, checkpoint, config, **files)
    with pytest.raises(ValueError) as error:
        sa.resolve(path, hicache_host_dtype="int8")
    assert "--hicache-host-dtype int4 or k8v4, which encode FP8 KV" in str(error.value)


@pytest.mark.parametrize("host_dtype", ACCEPTED)
def test_fp8_with_an_mla_model_is_refused(tmp_path, host_dtype):
    path = sa.model_dir(tmp_path, "mla", sa.DEEPSEEK_V2_MLA)
    with pytest.raises(ValueError, match="does not support MLA models"):
        sa.resolve(path, hicache_host_dtype=host_dtype, kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("host_dtype", ACCEPTED)
def test_fp8_draft_kv_stays_refused(host_dtype):
    with pytest.raises(
        ValueError,
        match=f"--hicache-host-dtype {host_dtype} with --speculative-draft-kv",
    ):
        sa.resolve(
            hicache_host_dtype=host_dtype,
            kv_cache_dtype="fp8_e4m3",
            speculative_draft_kv_cache_dtype="fp8_e4m3",
        )
