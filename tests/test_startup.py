"""Start-up: --hicache-host-dtype's declaration and publication, and the start-up
table (tests/support/startup_table.py), each row through SGLang's own resolution
over tiny configs (no weights); docs/supported.md carries the same table."""

from __future__ import annotations

import argparse
import logging
import re
from types import SimpleNamespace

import msgspec
import pytest

from sglang.srt.arg_groups.arg_utils import A, Arg, add_cli_args_from_dataclass
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.mem_cache.pool_host.host_env import FUSED_ENV, VERIFY_ENV
from sglang.srt.server_args import ServerArgs
from tests.support import server_args as sa
from tests.support import startup_table as st
from tests.support.server_args import from_argv, resolve

pytestmark = pytest.mark.usefixtures("restore_environ")

QUANTIZED = st.QUANTIZED


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    return {
        name: sa.model_dir(root, name, config, **files)
        for name, (config, files) in st.MODELS.items()
    }


def _start(case: st.Case, paths: dict, parser, host_dtype: str) -> ServerArgs:
    flags = {
        k: paths[v[1:]] if isinstance(v, str) and v.startswith("@") else v
        for k, v in case.flags.items()
    }
    model = paths.get(case.row.model, "dummy")
    if not case.row.cli:
        return resolve(model, hicache_host_dtype=host_dtype, **flags)
    argv = [model, "--device", "cpu", "--skip-tokenizer-init"]
    argv += ["--enable-hierarchical-cache", "--hicache-host-dtype", host_dtype]
    for name, value in flags.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    server_args = from_argv(parser, *argv)
    server_args.resolve_once()
    return server_args


@pytest.mark.usefixtures("mamba_extra_buffer_on_cpu")
@pytest.mark.parametrize("case", st.cases(), ids=lambda case: case.id)
def test_startup_table(case, model_paths, parser, monkeypatch, caplog):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    if case.row.model in st.H100_MODELS:
        monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    if case.row.refused:
        with pytest.raises(ValueError) as error:
            _start(case, model_paths, parser, case.host_dtype)
        message = str(error.value)
        for fragment in case.row.refused:
            assert case.fill(fragment) in message
        for fragment in case.row.absent:
            assert fragment not in message
        return
    with caplog.at_level(logging.INFO, logger="sglang"):
        server_args = _start(case, model_paths, parser, case.host_dtype)
    for name, value in case.row.expect.items():
        assert resolution_result(server_args, name) == case.fill(value)
    for fragment in case.row.log:
        assert case.fill(fragment) in caplog.text
    if case.row.same_as_stock:
        stock = _start(case, model_paths, parser, "auto")
        for name in ("hicache_mem_layout", "hicache_io_backend"):
            assert resolution_result(server_args, name) == resolution_result(
                stock, name
            )


def test_supported_md_carries_the_startup_table():
    """Regenerate docs/supported.md's copy with `python -m
    tests.support.startup_table` after changing a row; every format has rows
    that start and rows that are refused."""
    from sglang.srt.mem_cache.pool_host.host_format import host_dtype_choices

    assert st.docs_section(st.SUPPORTED_MD.read_text()) == st.render()
    cases = st.cases()
    for name in host_dtype_choices():
        outcomes = {bool(c.row.refused) for c in cases if c.host_dtype == name}
        assert outcomes == {True, False}, name


def test_flag_parses_and_defaults_to_auto(parser, capsys):
    assert ServerArgs(model_path="dummy").hicache_host_dtype == "auto"
    assert from_argv(parser, "dummy").hicache_host_dtype == "auto"
    for value in ("auto", *QUANTIZED):
        args = from_argv(parser, "dummy", "--hicache-host-dtype", value)
        assert args.hicache_host_dtype == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy", "--hicache-host-dtype", "fp8"])
    assert "--hicache-host-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_flag_help_text_and_place(parser):
    """--help lists the flag after --hicache-mem-layout, with its default (its
    field is the last of POSITIONAL_FIELD_ORDER, so positional calls keep
    working), choices and help from the host-format registry, in its order."""
    from sglang.srt.arg_groups.field_order import POSITIONAL_FIELD_ORDER
    from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES

    assert POSITIONAL_FIELD_ORDER[-1] == "hicache_host_dtype"

    (action,) = [
        a for a in parser._actions if "--hicache-host-dtype" in a.option_strings
    ]
    assert action.choices == ["auto", *HOST_DTYPES]
    assert list(HOST_DTYPES)[: len(QUANTIZED)] == list(QUANTIZED)
    assert action.help.startswith("Data type of the HiCache host (L2) KV copy.")
    for entry in HOST_DTYPES.values():
        assert f"'{entry.name}' stores {entry.help}" in action.help
    assert "'int8' stores symmetric INT8 with one FP16 scale per token" in action.help
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
        layer_num=2,  # the layers the plan of 8-bit keys maps onto
        page_size=1,  # what the automatic sink page (sink_page.host_plan) checks
        hicache_write_back_staging=False,
        dtype="the device pool's dtype",
    )
    cls, host_input, kwargs = assembler._mha_host_inputs(pool)
    assert (cls, host_input) == (object, info)
    assert calls == [(info, "int8")]
    # An encoded pool is told the device dtype (FP8 KV is stored as uint8).
    assert kwargs["device_kv_dtype"] == "the device pool's dtype"


@pytest.mark.usefixtures("mamba_extra_buffer_on_cpu")
def test_configs_are_the_hybrid_families(model_paths):
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, kimi_linear_config

    names = ("gpt_oss", "qwen3_next", "qwen3_5", "kimi_linear")
    configs = {name: model_config_of(resolve(model_paths[name])) for name in names}
    assert configs["gpt_oss"].is_hybrid_swa
    assert hybrid_gdn_config(configs["qwen3_next"]) is not None
    assert hybrid_gdn_config(configs["qwen3_5"]) is not None
    kimi = configs["kimi_linear"]
    assert kimi_linear_config(kimi) is not None and kimi.kv_lora_rank == 512
    # What the hook used to read: empty for both linear-attention families.
    assert not configs["qwen3_next"].linear_attn_registry_result
    assert not configs["qwen3_5"].linear_attn_registry_result
    assert not kimi.linear_attn_registry_result


STOCK_POOL_WARNINGS = {
    FUSED_ENV: (
        "off",
        f"{FUSED_ENV}=off has no effect with --hicache-host-dtype auto: only the "
        "encoded host pools (--hicache-host-dtype int8, int4, ...) have a fused "
        "transfer path.",
    ),
    VERIFY_ENV: (
        "0.01",
        f"{VERIFY_ENV} has no effect with --hicache-host-dtype auto: only the "
        "encoded host pools check restored pages.",
    ),
}


@pytest.mark.parametrize("name", sorted(STOCK_POOL_WARNINGS))
def test_variable_with_the_stock_pool_warns(monkeypatch, models, caplog, name):
    value, warning = STOCK_POOL_WARNINGS[name]
    monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="sglang.srt.arg_groups"):
        resolve(models["mha"])
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert warnings == [warning]
    # An encoded pool takes the same value.
    resolve(models["mha"], hicache_host_dtype="int8")


@pytest.mark.parametrize("host_dtype", QUANTIZED)
def test_quantized_warns_once_without_hierarchical_cache(caplog, host_dtype):
    hook = "sglang.srt.arg_groups.hicache_hook"
    with caplog.at_level(logging.WARNING, logger=hook):
        resolve(hicache_host_dtype=host_dtype, enable_hierarchical_cache=False)
    said = f"--hicache-host-dtype {host_dtype} has no effect"
    warnings = [r.getMessage() for r in caplog.records if said in r.message]
    assert len(warnings) == 1 and "--enable-hierarchical-cache" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=hook):
        resolve(hicache_host_dtype=host_dtype)
        resolve(enable_hierarchical_cache=False)
    assert "has no effect" not in caplog.text
