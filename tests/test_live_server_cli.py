"""Bad HiCache flags fail at start-up through the real CLI (20-40 s a case): a
non-zero exit before serving, naming the flag and what to pass."""

from __future__ import annotations

import json
import os

import pytest

from scripts.rigs.server import CPU_FLAGS, hicache_flags, run_cli
from tests.support.server_args import DEEPSEEK_V2_MLA

pytestmark = pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_SERVER") == "0", reason="HIQ_LIVE_SERVER=0"
)

# A DeepSeek-V2-style MLA config small enough to resolve without weights
# (start-up rejects int4 from the config alone, before any weight loads).
TINY_MLA = {**DEEPSEEK_V2_MLA, "kv_lora_rank": 128}


def refused(args, model=None, env=None) -> str:
    result = run_cli([*CPU_FLAGS, *args], model=model, env=env, timeout=300)
    assert result.returncode != 0, result.stdout[-3000:]
    # It failed in argument checks, not after the engine came up.
    assert "Load weight begin" not in result.stdout, result.stdout[-3000:]
    return result.stdout


def test_unknown_host_dtype_names_the_flag_and_the_choices():
    out = refused(hicache_flags("bogus"))
    assert "--hicache-host-dtype" in out and "bogus" in out
    for choice in ("auto", "int8", "int4", "k8v4"):
        assert choice in out.split("--hicache-host-dtype", 1)[1][:400]


def test_int8_with_hf3fs_storage_names_both_flags_and_the_way_out():
    out = refused(hicache_flags("int8", storage_backend="hf3fs"))
    assert (
        "--hicache-host-dtype int8 does not support --hicache-storage-backend hf3fs"
        in out
    )
    assert "--hicache-host-dtype auto" in out


def test_int4_with_an_mla_model_names_the_flag_and_int8(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_MLA))
    out = refused(hicache_flags("int4"), model=tmp_path)
    assert "--hicache-host-dtype int4 does not support MLA models" in out
    assert "--hicache-host-dtype int8 or auto" in out


def test_sink_page_with_a_format_without_4bit_keys_fails_before_the_model():
    # The pool refused it only when the scheduler built it, after the weights.
    out = refused(
        hicache_flags("k8v4"), env={"SGLANG_HICACHE_SINK_PAGE_TOKENS": "4096"}
    )
    assert "SGLANG_HICACHE_SINK_PAGE_TOKENS keeps the sink page's keys" in out
    assert "pass --hicache-host-dtype int4 or int4r or int4c" in out
