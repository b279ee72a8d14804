"""`python -m scripts.quality --mla-random`: a random DeepSeek-V2 whose MLA cache
goes through SGLang's real MLA pools and HiCacheController: the BF16 control is
bit-identical, INT8 moves the latent by its quantization error and keeps RoPE
bit for bit, and a restore that brings nothing back refuses to report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.quality import __main__ as quality_main
from scripts.quality import mla_random as mr
from scripts.quality.harness import RestoreError

REPO_ROOT = Path(__file__).resolve().parent.parent


SMALL = dict(layers=2, hidden_size=128, windows=1, prefix_len=48, score_len=16)


@pytest.fixture(scope="module")
def report():
    return mr.run_mla_random(mr.MLARandomConfig(**SMALL), log=lambda s: None)


def test_the_model_is_deepseek_v2_mla(report):
    assert report["model"]["class"] == "DeepseekV2ForCausalLM"
    cfg = report["config"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert "not quality figures" in report["caveat"]


def test_control_is_bit_identical_and_int8_is_close(report):
    arms = report["arms"]
    assert report["control_bit_identical"] is True
    assert arms["bf16"]["max_abs_logit_err"] == 0.0
    assert report["rope_bits_exact"] is True
    int8 = arms["int8"]
    # Quantized for real: the latent moved, by about 1/127 of a tile's amax
    # (unit-RMS latent after kv_a_layernorm), and the logits with it.
    assert 1e-3 < int8["latent_rel_err"] < 2e-2
    assert 0 < int8["max_abs_logit_err"] < 0.1 * report["model"]["exact_logit_std"]
    assert int8["scored_tokens"] == SMALL["score_len"]
    rigs = report["rigs"]
    assert rigs["int8"]["host_pool"] == "MLATokenToKVPoolINT8Host"
    assert rigs["bf16"]["host_pool"] == "MLATokenToKVPoolHost"
    # DeepSeek geometry: 648 B vs 1152 B per token and layer.
    assert rigs["int8"]["host_bytes_per_token"] == 648 * SMALL["layers"]
    assert rigs["bf16"]["host_bytes_per_token"] == 1152 * SMALL["layers"]


def test_a_load_that_restores_nothing_refuses_to_report(monkeypatch):
    from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

    MLATokenToKVPoolINT8Host = host_pool_cls("int8", "mla")

    monkeypatch.setattr(
        MLATokenToKVPoolINT8Host, "load_to_device_per_layer", lambda *a, **k: None
    )
    with pytest.raises(RestoreError, match="rows finite"):
        mr.run_mla_random(
            mr.MLARandomConfig(**SMALL, arms=("exact", "int8")), log=lambda s: None
        )


def test_cli_writes_the_report(tmp_path, capsys):
    argv = [
        "--mla-random", "--mla-layers", "2", "--windows", "1", "--prefix-len", "32",
        "--score-len", "8", "--page-size", "4", "--kv-dtype", "fp16",
        "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert quality_main.main(argv) == 0
    data = json.loads((tmp_path / "quality_mla_random.json").read_text())
    assert data["config"]["page_size"] == 4 and data["config"]["kv_dtype"] == "fp16"
    assert data["control_bit_identical"] is True
    assert data["rigs"]["int8"]["page_size"] == 4
    md = (tmp_path / "quality_mla_random.md").read_text()
    assert "Random weights" in md and "MLATokenToKVPoolINT8Host" in md
    assert "--text-file is required" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality_main.parse_args([])  # neither --text-file nor --mla-random
    assert torch.isfinite(torch.tensor(data["arms"]["int8"]["max_abs_logit_err"]))
