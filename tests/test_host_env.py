"""The encoded host pools' SGLANG_HICACHE_* variables are checked with the
start-up flags, before the model loads.

Everything runs SGLang's own resolution pipeline (``ServerArgs.resolve_once``)
over tiny local HF configs (no weights), as tests/test_server_args.py does;
the CLI test (tests/test_live_server_cli.py) runs one case through
``python -m sglang.launch_server``. Without these checks a bad value turned
the feature off with a Python warning, and the combinations below passed
start-up: the pool refused them after the model loaded, or ignored them.
"""

from __future__ import annotations

import logging

import pytest

from sglang.srt.mem_cache.pool_host.host_env import FUSED_ENV, SINK_ENV, VERIFY_ENV
from tests.support.server_args import DEEPSEEK_V2_MLA, model_dir, resolve

pytestmark = pytest.mark.usefixtures("restore_environ")

# An MLA model the int8 pool accepts (kv_lora_rank in 128-value tiles).
MLA_INT8 = {**DEEPSEEK_V2_MLA, "kv_lora_rank": 128}


@pytest.fixture
def mla_int8(tmp_path):
    return model_dir(tmp_path, "mla-int8", MLA_INT8)


def refusal(monkeypatch, env: dict, model: str, **flags) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        resolve(model, **flags)
    return str(error.value)


@pytest.mark.parametrize("value", ["abc", "lots", "-64", "4096.5"])
@pytest.mark.parametrize("host_dtype", ["int4", "auto"])
def test_sink_page_tokens_must_be_a_number(monkeypatch, models, value, host_dtype):
    message = refusal(
        monkeypatch, {SINK_ENV: value}, models["mha"], hicache_host_dtype=host_dtype
    )
    assert f"{SINK_ENV}={value!r} is not a number of host tokens" in message
    assert "pass 0 (off)" in message and "e.g. 4096" in message


@pytest.mark.parametrize("host_dtype", ["int8", "k8v4", "k8v4r"])
def test_sink_page_refused_with_formats_without_4bit_keys(
    monkeypatch, models, host_dtype
):
    message = refusal(
        monkeypatch, {SINK_ENV: "4096"}, models["mha"], hicache_host_dtype=host_dtype
    )
    assert SINK_ENV in message and f"--hicache-host-dtype {host_dtype}" in message
    assert "pass --hicache-host-dtype int4 or int4r" in message


def test_sink_page_refused_with_the_stock_pool(monkeypatch, models):
    message = refusal(monkeypatch, {SINK_ENV: "4096"}, models["mha"])
    assert f"{SINK_ENV} keeps the sink page's keys at 8 bits" in message
    assert "--hicache-host-dtype auto stores the device KV" in message
    assert f"Pass --hicache-host-dtype int4 or int4r, or unset {SINK_ENV}" in message


def test_sink_page_refused_with_mla(monkeypatch, mla_int8):
    message = refusal(
        monkeypatch, {SINK_ENV: "4096"}, mla_int8, hicache_host_dtype="int8"
    )
    assert f"{SINK_ENV}: the MLA host pool (--hicache-host-dtype int8" in message
    assert "has no sink page" in message and f"Unset {SINK_ENV}" in message
    # Without the variable the same server starts.
    monkeypatch.delenv(SINK_ENV)
    resolve(mla_int8, hicache_host_dtype="int8")


def test_sink_page_refused_with_fp8_device_kv(monkeypatch, models):
    message = refusal(
        monkeypatch,
        {SINK_ENV: "4096"},
        models["mha"],
        hicache_host_dtype="int4",
        kv_cache_dtype="fp8_e4m3",
    )
    assert "stores BF16/FP16 device KV, not the FP8 KV of --kv-cache-dtype" in message


def test_sink_page_below_the_page_size_is_refused(monkeypatch, models):
    message = refusal(
        monkeypatch,
        {SINK_ENV: "32"},
        models["mha"],
        hicache_host_dtype="int4r",
        page_size=64,
    )
    assert f"{SINK_ENV}=32 must be at least the page size (64)" in message


@pytest.mark.parametrize("host_dtype", ["int4", "int4r"])
@pytest.mark.parametrize("value", ["4096", " 4096 ", "0", ""])
def test_sink_page_accepted_where_it_works(monkeypatch, models, host_dtype, value):
    monkeypatch.setenv(SINK_ENV, value)
    resolve(models["mha"], hicache_host_dtype=host_dtype, page_size=64)


@pytest.mark.parametrize("value", ["fast", "on", "1"])
@pytest.mark.parametrize("host_dtype", ["int8", "auto"])
def test_fused_transfer_must_be_a_path(monkeypatch, models, value, host_dtype):
    message = refusal(
        monkeypatch, {FUSED_ENV: value}, models["mha"], hicache_host_dtype=host_dtype
    )
    assert f"{FUSED_ENV}={value!r} is not a transfer path" in message
    assert "pass auto" in message and "off (torch path), direct or staged" in message


@pytest.mark.parametrize("value", ["auto", "OFF", "direct", "staged", ""])
def test_fused_transfer_accepted_with_encoded_pools(monkeypatch, models, value):
    monkeypatch.setenv(FUSED_ENV, value)
    resolve(models["mha"], hicache_host_dtype="int8")


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


@pytest.mark.parametrize("value", ["abc", "-0.1", "1.5", "nan"])
@pytest.mark.parametrize("host_dtype", ["int8c", "auto"])
def test_verify_sample_rate_must_be_a_fraction(monkeypatch, models, value, host_dtype):
    message = refusal(
        monkeypatch, {VERIFY_ENV: value}, models["mha"], hicache_host_dtype=host_dtype
    )
    assert f"{VERIFY_ENV}={value!r} must be a fraction of backed-up pages" in message
    assert "or 0 to turn the sampled restore check off" in message
