"""--hicache-host-dtype: CLI declaration, publication and startup validation.

Everything runs SGLang's own argument parser and resolution pipeline
(``ServerArgs.resolve_once``). ``model_path="dummy"`` stops the pipeline at the
dummy-model boundary, after the model-independent checks; tiny local HF configs
(one MHA Llama, one MLA DeepSeek-V2, no weights) take it through
``handle_hicache`` where the resolved layout and the model are checked.
"""

from __future__ import annotations

import argparse
import logging
import re
from types import SimpleNamespace

import msgspec
import pytest

from sglang.srt.arg_groups.arg_utils import A, Arg, add_cli_args_from_dataclass
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.server_args import ServerArgs
from tests.support.server_args import (
    FP8_KV_CHECKPOINTS,
    INT8_IO_BACKENDS,
    INT8_LAYOUTS,
    LLAMA,
    device_kv_refusal,
    from_argv,
    model_dir,
    resolve,
)

pytestmark = pytest.mark.usefixtures("restore_environ")


# Every --hicache-host-dtype that encodes the host copy; each is validated alike.
QUANTIZED = ("int8", "int4", "k8v4")
per_format = pytest.mark.parametrize("host_dtype", QUANTIZED)


# --------------------------------------------------------------------------
# Declaration
# --------------------------------------------------------------------------


def test_flag_defaults_to_auto(parser):
    assert ServerArgs(model_path="dummy").hicache_host_dtype == "auto"
    assert from_argv(parser, "dummy").hicache_host_dtype == "auto"


@pytest.mark.parametrize("value", ["auto", *QUANTIZED])
def test_flag_parses(parser, value):
    args = from_argv(parser, "dummy", "--hicache-host-dtype", value)
    assert args.hicache_host_dtype == value


def test_flag_rejects_unknown_value(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy", "--hicache-host-dtype", "fp8"])
    assert "--hicache-host-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_unknown_value_from_python_api_fails_at_startup():
    # The argparse choices do not guard ServerArgs(...) built in Python.
    with pytest.raises(ValueError, match="--hicache-host-dtype 'fp8' is not a host KV"):
        resolve(hicache_host_dtype="fp8", enable_hierarchical_cache=False)


def test_flag_help_text(parser):
    from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES

    (action,) = [
        a for a in parser._actions if "--hicache-host-dtype" in a.option_strings
    ]
    # Choices and help come from the host-format registry, in its order.
    assert action.choices == ["auto", *HOST_DTYPES]
    assert list(HOST_DTYPES)[: len(QUANTIZED)] == list(QUANTIZED)
    assert action.help.startswith("Data type of the HiCache host (L2) KV copy.")
    for entry in HOST_DTYPES.values():
        assert f"'{entry.name}' stores {entry.help}" in action.help
    assert "'int8' stores symmetric INT8 with one FP16 scale per token" in action.help


def test_flag_help_sits_with_the_hicache_flags_and_shows_its_default(parser):
    """--help lists the flag after --hicache-mem-layout, not after every other
    flag (its field is appended to POSITIONAL_FIELD_ORDER), with its default."""
    text = parser.format_help()
    flags = re.findall(r"^  (--[\w-]+)", text, re.M)
    at = flags.index("--hicache-host-dtype")
    assert flags[at - 1 : at + 2] == [
        "--hicache-mem-layout",
        "--hicache-host-dtype",
        "--hicache-storage-backend",
    ]
    block = text.split("\n  --hicache-host-dtype ", 1)[1].split("\n  --", 1)[0]
    assert " ".join(block.split()).endswith("is unchanged. Default: auto.")


class _HelpOrderProbe(msgspec.Struct):
    first: A[int, Arg(help="first")] = 0
    second: A[int, Arg(help="second")] = 0
    third: A[int, Arg(help="third", help_after="first")] = 0
    fourth: A[int, Arg(help="fourth", help_after="third")] = 0


class _HelpAfterNoField(msgspec.Struct):
    lone: A[int, Arg(help="lone", help_after="nowhere")] = 0


def test_help_after_moves_a_flag_and_refuses_an_unknown_field():
    parser = argparse.ArgumentParser()
    add_cli_args_from_dataclass(parser, _HelpOrderProbe)
    flags = [a.option_strings[0] for a in parser._actions[1:]]
    assert flags == ["--first", "--third", "--fourth", "--second"]
    with pytest.raises(ValueError, match=r"help_after of \['lone'\] names no field"):
        add_cli_args_from_dataclass(argparse.ArgumentParser(), _HelpAfterNoField)


def test_field_is_last_positional_field():
    # field_order.py: new fields are appended, so positional calls keep working.
    from sglang.srt.arg_groups.field_order import POSITIONAL_FIELD_ORDER

    assert POSITIONAL_FIELD_ORDER[-1] == "hicache_host_dtype"


def test_published_in_memory_config_bag():
    from sglang.srt.runtime_context import _build_config_bags

    server_args = resolve(hicache_host_dtype="int8")
    assert _build_config_bags(server_args)["memory"].hicache_host_dtype == "int8"


def test_host_pool_dispatch_receives_host_dtype(monkeypatch):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    calls = []

    def fake_get_mha_host_pool_cls(info, host_dtype="auto"):
        calls.append((info, host_dtype))
        return object

    monkeypatch.setattr(assembler, "get_mha_host_pool_cls", fake_get_mha_host_pool_cls)
    monkeypatch.setattr(
        assembler, "get_memory", lambda: SimpleNamespace(hicache_host_dtype="int8")
    )
    info = object()
    pool = SimpleNamespace(
        get_device_pool_infos=lambda: [SimpleNamespace(buffer_info=info)],
        size=64,
        host_capacity_tokens=None,
        start_layer=0,
        end_layer=2,
        hicache_write_back_staging=False,
        dtype="the device pool's dtype",
    )
    cls, host_input, kwargs = assembler._mha_host_inputs(pool)
    assert (cls, host_input) == (object, info)
    assert calls == [(info, "int8")]
    # An encoded pool is told the device dtype (FP8 KV is stored as uint8).
    assert kwargs["device_kv_dtype"] == "the device pool's dtype"


# --------------------------------------------------------------------------
# Unsupported combinations fail at startup, naming the flags
# --------------------------------------------------------------------------


@per_format
@pytest.mark.parametrize("kv_cache_dtype", ["mxfp8", "nvfp4", "fp4_mx_block16"])
def test_quantized_rejects_quantized_device_kv(parser, kv_cache_dtype, host_dtype):
    message = device_kv_refusal(parser, host_dtype, kv_cache_dtype)
    assert "quantized host KV needs a BF16/FP16 device KV cache" in message


@per_format
def test_quantized_rejects_fp32_model_dtype_with_auto_kv(host_dtype):
    with pytest.raises(
        ValueError, match=f"--hicache-host-dtype {host_dtype} with --dtype"
    ):
        resolve(hicache_host_dtype=host_dtype, dtype="float32")


@per_format
def test_quantized_rejects_quantized_draft_kv(host_dtype):
    with pytest.raises(
        ValueError,
        match=f"--hicache-host-dtype {host_dtype} with --speculative-draft-kv-cache-dtype",
    ):
        resolve(
            hicache_host_dtype=host_dtype, speculative_draft_kv_cache_dtype="fp8_e4m3"
        )


@per_format
@pytest.mark.parametrize(
    "field,value",
    [
        ("hicache_storage_backend", "hf3fs"),
        ("hicache_storage_backend", "aibrix"),
        ("hicache_mem_layout", "page_head"),
        ("hicache_mem_layout", "page_first_kv_split"),
        ("hicache_mem_layout", "page_unified"),
        ("hicache_io_backend", "kernel_ascend"),
    ],
)
def test_quantized_rejects_what_the_pool_does_not_serve(field, value, host_dtype):
    with pytest.raises(ValueError) as error:
        resolve(hicache_host_dtype=host_dtype, **{field: value})
    flag = "--" + field.replace("_", "-")
    assert f"--hicache-host-dtype {host_dtype} does not support {flag} {value}" in str(
        error.value
    )


@per_format
@pytest.mark.parametrize("backend", ["file", "mooncake", "nixl"])
def test_quantized_accepts_storage_backend(backend, host_dtype):
    # NIXL moves encoded page objects since patch 0011 (tests/test_l3_nixl.py).
    server_args = resolve(
        hicache_host_dtype=host_dtype, hicache_storage_backend=backend
    )
    assert server_args.hicache_storage_backend == backend


@per_format
def test_quantized_storage_needs_cache_memory_mode(host_dtype):
    with pytest.raises(ValueError) as error:
        resolve(
            hicache_host_dtype=host_dtype,
            hicache_storage_backend="file",
            hicache_host_memory_mode="buffer_only",
        )
    assert f"--hicache-host-dtype {host_dtype} with --hicache-storage-backend" in (
        str(error.value)
    )


@per_format
def test_quantized_rejects_decode_host_receive(host_dtype):
    with pytest.raises(
        ValueError,
        match=f"--hicache-host-dtype {host_dtype} does not support "
        "--disaggregation-decode-host-receive-threshold",
    ):
        resolve(
            hicache_host_dtype=host_dtype,
            disaggregation_decode_host_receive_threshold=0.5,
        )


def test_int8_rejects_mla_model_without_128_value_tiles(models):
    # This tiny DeepSeek-V2 has kv_lora_rank 32; tests/test_mla_int8_server_args.py
    # covers the MLA models the INT8 pool accepts.
    with pytest.raises(ValueError) as error:
        resolve(models["mla"], hicache_host_dtype="int8")
    assert "--hicache-host-dtype int8 does not support kv_lora_rank 32" in str(
        error.value
    )


@pytest.mark.parametrize("host_dtype", ("int4", "k8v4"))
def test_4bit_formats_reject_mla_model(models, host_dtype):
    with pytest.raises(ValueError) as error:
        resolve(models["mla"], hicache_host_dtype=host_dtype)
    assert f"--hicache-host-dtype {host_dtype} does not support MLA models" in str(
        error.value
    )
    assert f"has a {host_dtype.upper()} variant" in str(error.value)


def test_auto_keeps_upstream_behaviour_for_the_same_arguments(models):
    # None of the int8 checks applies to the default host dtype.
    resolve(kv_cache_dtype="fp8_e4m3", hicache_storage_backend="file")
    resolve(hicache_mem_layout="page_head")
    resolve(models["mla"])


@per_format
def test_quantized_checks_only_apply_with_a_host_pool(host_dtype):
    resolve(
        hicache_host_dtype=host_dtype,
        enable_hierarchical_cache=False,
        kv_cache_dtype="fp8_e4m3",
        hicache_storage_backend="file",
    )


# --------------------------------------------------------------------------
# Supported combinations
# --------------------------------------------------------------------------


@per_format
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "bfloat16"])
@pytest.mark.parametrize("io_backend", INT8_IO_BACKENDS)
@pytest.mark.parametrize("layout", INT8_LAYOUTS)
def test_quantized_accepts_supported_combinations_before_the_model(
    layout, io_backend, kv_cache_dtype, host_dtype
):
    resolve(
        hicache_host_dtype=host_dtype,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
        kv_cache_dtype=kv_cache_dtype,
    )


def test_unknown_host_dtype_is_refused_at_start_up():
    from sglang.srt.mem_cache.pool_host.host_format import host_dtype_choices

    # The one place that validates the flag; the pool dispatch does not.
    with pytest.raises(ValueError) as error:
        resolve(hicache_host_dtype="int2")
    assert (
        "--hicache-host-dtype 'int2' is not a host KV format; pass one of "
        f"{', '.join(host_dtype_choices())}." in str(error.value)
    )


@per_format
@pytest.mark.parametrize("io_backend", INT8_IO_BACKENDS)
@pytest.mark.parametrize("layout", INT8_LAYOUTS)
def test_quantized_resolves_every_layout_io_pair_as_the_stock_pool(
    models, caplog, layout, io_backend, host_dtype
):
    # The INT8 pool places its own indices for every pair, so it takes
    # upstream's layout/io rewrites unchanged instead of a special case.
    pair = dict(hicache_mem_layout=layout, hicache_io_backend=io_backend)
    stock = resolve(models["mha"], **pair)
    with caplog.at_level(logging.INFO, logger="sglang.srt.arg_groups.hicache_hook"):
        server_args = resolve(models["mha"], hicache_host_dtype=host_dtype, **pair)
    for name in ("hicache_mem_layout", "hicache_io_backend"):
        assert resolution_result(server_args, name) == resolution_result(stock, name)
    assert resolution_result(server_args, "hicache_host_dtype") == host_dtype
    assert f"HiCache host KV dtype: {host_dtype} for MHA models (" in caplog.text


def test_stock_pool_layout_io_rewrite_is_unchanged(models):
    server_args = resolve(
        models["mha"], hicache_mem_layout="page_first", hicache_io_backend="direct"
    )
    assert resolution_result(server_args, "hicache_mem_layout") == "page_first_direct"


# --------------------------------------------------------------------------
# Start-up refusals that used to surface later (issue 11: D2, D3, D4)
# --------------------------------------------------------------------------


# int4 and k8v4 encode an FP8 device KV cache (tests/test_fp8_server_args.py).
@pytest.mark.parametrize("host_dtype", ["int8"])
@pytest.mark.parametrize("checkpoint", sorted(FP8_KV_CHECKPOINTS))
def test_quantized_refuses_fp8_kv_checkpoint_with_auto_kv_dtype(
    tmp_path, checkpoint, host_dtype
):
    quant_config, files = FP8_KV_CHECKPOINTS[checkpoint]
    config = dict(LLAMA)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    path = model_dir(tmp_path, checkpoint, config, **files)
    with pytest.raises(ValueError) as error:
        resolve(path, hicache_host_dtype=host_dtype)
    message = str(error.value)
    assert f"--hicache-host-dtype {host_dtype} with --kv-cache-dtype auto" in message
    assert "FP8 KV cache" in message
    assert "Pass --kv-cache-dtype bf16" in message
    # Neither the storage dtype nor a value --kv-cache-dtype does not accept.
    assert "uint8" not in message and "fp16" not in message
    # The suggested value is a real choice and gets the server past the check.
    resolve(path, hicache_host_dtype=host_dtype, kv_cache_dtype="bf16")
    resolve(path)  # the stock pool serves an FP8 device KV as before


def test_int8_accepts_unquantized_kv_checkpoint(tmp_path):
    config = dict(LLAMA)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
    }
    resolve(model_dir(tmp_path, "w8", config), hicache_host_dtype="int8")


# Speculative decoding (packed MTP drafts, separate drafts): test_spec_server_args.py.


@per_format
def test_quantized_warns_once_without_hierarchical_cache(caplog, host_dtype):
    with caplog.at_level(logging.WARNING, logger="sglang.srt.arg_groups.hicache_hook"):
        resolve(hicache_host_dtype=host_dtype, enable_hierarchical_cache=False)
    warnings = [
        r
        for r in caplog.records
        if f"--hicache-host-dtype {host_dtype} has no effect" in r.message
    ]
    assert len(warnings) == 1
    assert "--enable-hierarchical-cache" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.arg_groups.hicache_hook"):
        resolve(hicache_host_dtype=host_dtype)
        resolve(enable_hierarchical_cache=False)
    assert "has no effect" not in caplog.text
