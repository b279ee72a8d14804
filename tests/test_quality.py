"""CI-sized run of the restored-KV quality harness (scripts/quality/harness.py) on
the real SmolLM2-135M model and WikiText-2, through SGLang's real HiCache
write/load path: the stock BF16 control is bit-identical to the exact arm,
INT8 stays within a loose bound, and a run in which nothing came back from L2
refuses to report."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from scripts.quality import harness as hq  # noqa: E402

TEXT_FILE = Path(
    os.environ.get(
        "HIQ_WIKITEXT", REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
    )
)
# A few short windows: the full-size run is `make quality`.
SMALL = dict(windows=2, prefix_len=128, score_len=64, greedy_tokens=8, seed=1)


def _require_inputs():
    missing = []
    if not TEXT_FILE.is_file():
        missing.append(f"WikiText-2 at {TEXT_FILE} (set HIQ_WIKITEXT)")
    try:
        hq.smollm_gguf_path()
    except FileNotFoundError as exc:
        missing.append(str(exc))
    if missing:
        if os.environ.get("CI"):
            pytest.fail("quality test inputs missing in CI: " + "; ".join(missing))
        pytest.skip("; ".join(missing))


@pytest.fixture(scope="module")
def bundle():
    _require_inputs()
    hq.install_cpu_runtime()
    return hq.load_model()


@pytest.fixture(scope="module")
def report(bundle):
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **SMALL)
    return hq.run_quality(cfg, bundle, ["conftest stand-ins"], log=lambda s: None)


def test_model_is_real_gqa(bundle, report):
    geo = report["kv_geometry"]
    assert (geo["layers"], geo["kv_heads"], geo["head_dim"]) == (30, 3, 64)
    assert bundle.info["weights_sha256"]
    assert report["text"]["tokens"] > 100_000


def test_every_offloaded_token_came_back_from_l2(report):
    expected = SMALL["windows"] * SMALL["prefix_len"]
    for arm in ("bf16", "int8"):
        s = report["arms"][arm]
        assert s["restored_tokens"] == expected
        assert s["written_tokens"] == expected
        assert s["load_acked_tokens"] == expected
    assert report["arms"]["bf16"]["host_pool"] == "MHATokenToKVPoolHost"
    assert report["arms"]["int8"]["host_pool"] == "MHATokenToKVPoolINT8FusedHost"
    assert report["arms"]["exact"]["restored_tokens"] == 0


def test_control_arm_is_bit_identical_to_exact(report):
    control = report["control"]
    assert control["kv_bit_identical"] and control["logits_bit_identical"]
    s = report["arms"]["bf16"]
    assert s["ppl"] == report["arms"]["exact"]["ppl"]
    assert s["kl_max"] == 0.0 and s["max_abs_dlogprob"] == 0.0
    assert s["top1_agree"] == 1.0 and s["greedy_agree"] == 1.0
    assert report["targets"]["control_bit_identical"]


def test_int8_within_loose_bound(report):
    s = report["arms"]["int8"]
    # Lossy (the codec really ran) but close.
    assert 0 < s["kv_rel_err"] < 0.03
    assert s["kl_mean"] > 0
    assert abs(s["ppl_rel_delta"]) < 0.02
    assert s["top1_agree"] >= 0.95
    assert s["kl_max"] < 0.05
    assert s["greedy_agree"] >= 0.5
    assert (
        s["host_bytes_per_token"] * 1.9 < report["arms"]["bf16"]["host_bytes_per_token"]
    )


def test_run_without_restore_refuses_to_report(bundle):
    cfg = hq.QualityConfig(
        text_file=str(TEXT_FILE), **{**SMALL, "windows": 1}, restore=False
    )
    with pytest.raises(hq.NoRestoreError):
        hq.run_quality(cfg, bundle, log=lambda s: None)


def test_silently_broken_load_path_refuses_to_report(bundle, monkeypatch):
    """The guard reads the device pool, not a flag: a load that is queued and
    acknowledged but never moves bytes is caught too."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mha_int8 import MHATokenToKVPoolINT8Host

    for cls in (MHATokenToKVPoolHost, MHATokenToKVPoolINT8Host):
        monkeypatch.setattr(cls, "load_to_device_per_layer", lambda *a, **k: None)
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **{**SMALL, "windows": 1})
    with pytest.raises(hq.NoRestoreError, match="0 of 128"):
        hq.run_quality(cfg, bundle, log=lambda s: None)


def test_cli_writes_markdown_json_and_png(bundle, tmp_path):
    from scripts.quality import __main__ as quality

    argv = [
        "--text-file",
        str(TEXT_FILE),
        "--windows",
        "1",
        "--prefix-len",
        "64",
        "--score-len",
        "32",
        "--greedy-tokens",
        "4",
        "--seed",
        "3",
        "--out-dir",
        str(tmp_path),
        "--name",
        "ci",
    ]
    assert quality.main(argv, bundle=bundle) == 0
    data = json.loads((tmp_path / "ci.json").read_text())
    assert data["config"]["seed"] == 3 and len(data["windows"]) == 1
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["sglang"]
    assert data["arms"]["int8"]["restored_tokens"] == 64
    assert "--seed 3" in data["command"]
    md = (tmp_path / "ci.md").read_text()
    assert "| int8 |" in md and "| bf16 |" in md
    png = (tmp_path / "ci_kl.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # The same run with the L2 load skipped exits 2 and writes nothing new.
    assert (
        quality.main(argv[:-2] + ["--name", "none", "--no-restore"], bundle=bundle) == 2
    )
    assert not (tmp_path / "none.json").exists()


def test_any_hf_causal_lm_directory(bundle, tmp_path):
    """--model takes a Hugging Face model directory; here a tiny random Llama
    (GQA: 4 query heads, 2 KV heads) with page size 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(bundle.tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    bundle.tokenizer.save_pretrained(tmp_path)
    tiny = hq.load_model(str(tmp_path))
    cfg = hq.QualityConfig(
        text_file=str(TEXT_FILE),
        windows=1,
        prefix_len=32,
        score_len=16,
        greedy_tokens=4,
        page_size=2,
    )
    rep = hq.run_quality(cfg, tiny, log=lambda s: None)
    assert rep["kv_geometry"]["layers"] == 2 and rep["kv_geometry"]["kv_heads"] == 2
    assert rep["targets"]["control_bit_identical"]
    assert rep["arms"]["int8"]["restored_tokens"] == 32


def test_windows_do_not_overlap_and_are_seeded():
    a = hq.pick_windows(10_000, 300, 20, seed=7)
    assert a == hq.pick_windows(10_000, 300, 20, seed=7)
    assert a != hq.pick_windows(10_000, 300, 20, seed=8)
    assert all(y - x >= 300 for x, y in zip(a, a[1:]))
    assert a[-1] + 300 <= 10_000
    with pytest.raises(ValueError):
        hq.pick_windows(1000, 300, 4, seed=0)


def test_histogram_handles_all_zero_series(tmp_path):
    hq.kl_histogram_png(
        {"bf16": [0.0] * 10, "int8": [1e-5, 3e-4, 2e-3]}, tmp_path / "h.png"
    )
    hq.kl_histogram_png({"bf16": [0.0] * 10}, tmp_path / "z.png")
    assert (tmp_path / "z.png").read_bytes()[:4] == b"\x89PNG"
