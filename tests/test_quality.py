"""CI-sized run of the restored-KV quality harness (scripts/quality/harness.py) on
the real SmolLM2-135M model and WikiText-2, through SGLang's real HiCache
write/load path: the stock BF16 control is bit-identical to the exact arm,
every quantized host format the server accepts has an arm that runs its own
host pool, INT8 stays within a loose bound, and a run in which nothing came
back from L2 refuses to report. The second text (source code) is read from the
installed Python standard library, never from the repo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.common import plot
from scripts.quality import harness as hq
from scripts.quality import texts
from tests.support.quality_inputs import SMALL, TEXT_FILE, tiny_gemma3

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bundle(smollm2_bundle):
    return smollm2_bundle


@pytest.fixture(scope="module")
def report(bundle):
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **SMALL)
    return hq.run_quality(cfg, bundle, ["conftest stand-ins"], log=lambda s: None)


def test_model_is_real_gqa(bundle, report):
    geo = report["kv_geometry"]
    assert (geo["layers"], geo["kv_heads"], geo["head_dim"]) == (30, 3, 64)
    assert bundle.info["weights_sha256"]
    assert report["text"]["tokens"] > 100_000


def _dispatch_cls(bundle_report, host_dtype):
    """The host pool class the server's dispatch picks for the model's KV."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    geo = bundle_report["kv_geometry"]
    device_pool = MHATokenToKVPool(
        size=64,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=geo["kv_heads"],
        head_dim=geo["head_dim"],
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=geo["v_head_dim"],
        enable_alt_stream=False,
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info, host_dtype)


def test_one_arm_per_registered_host_format():
    from scripts.common.host_formats import registered_host_dtypes

    arms = hq.offload_arms()
    assert sorted(a.host_dtype for a in arms.values()) == sorted(
        registered_host_dtypes()
    )
    assert arms["bf16"].host_dtype == "auto" and arms["bf16"].page_size == 1
    assert arms["int8"].page_size == 1  # the README's INT8 figures
    assert arms["int8c"].page_size == 64  # keys per channel, not per token
    for arm in arms.values():
        if arm.host_dtype not in ("auto", "int8"):
            assert arm.page_size == hq.GROUPED_PAGE_SIZE, arm
            assert arm.layout == "page_first"


def test_a_format_added_to_the_server_gets_an_arm(monkeypatch):
    from scripts.common import host_formats

    choices = host_formats.registered_host_dtypes()
    monkeypatch.setattr(
        host_formats, "registered_host_dtypes", lambda: [*choices, "fp6"]
    )
    arms = hq.offload_arms()
    assert arms["fp6"] == hq.Arm("fp6", "fp6", "page_first", hq.GROUPED_PAGE_SIZE)
    assert list(arms)[0] == "bf16"  # the control stays first
    assert hq.offload_arms(page_size=2)["fp6"].page_size == 2


def test_every_offloaded_token_came_back_from_l2(report):
    expected = SMALL["windows"] * SMALL["prefix_len"]
    offloaded = [a for a in report["arms"] if a not in hq.REFERENCES]
    assert offloaded == list(hq.offload_arms())
    for arm in offloaded:
        s = report["arms"][arm]
        assert s["restored_tokens"] == expected, arm
        assert s["written_tokens"] == expected, arm
        assert s["load_acked_tokens"] == expected, arm
    assert report["arms"]["bf16"]["host_pool"] == "MHATokenToKVPoolHost"
    assert report["arms"]["int8"]["host_pool"] == "MHATokenToKVPoolINT8Host"
    assert report["arms"]["exact"]["restored_tokens"] == 0
    assert report["arms"][hq.FP32_ARM]["restored_tokens"] == 0


def _format_bytes_per_token(report, arm) -> float:
    """Host bytes per token (all layers) the arm's format stores, from the
    registry's format class, not from a pool."""
    from sglang.srt.mem_cache.pool_host.encoded import unit_tokens_for
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    geo = report["kv_geometry"]
    if arm.host_dtype == "auto":
        return geo["bf16_bytes_per_token"]
    per_layer = host_format_cls(arm.host_dtype, "mha").bytes_per_token_for(
        (geo["head_dim"], geo["v_head_dim"]),
        geo["kv_heads"],
        unit_tokens_for(arm.page_size, arm.layout),
    )
    return geo["layers"] * per_layer


def test_each_arm_runs_the_host_pool_of_its_format(report):
    """Every arm's pool is the one the --hicache-host-dtype dispatch gives,
    at the arm's page size, and it stores its format's bytes per token
    (a rotated format stores as many as its plain kin)."""
    arms = hq.offload_arms()
    pools = set()
    for name, arm in arms.items():
        s = report["arms"][name]
        assert s["host_pool"] == _dispatch_cls(report, arm.host_dtype).__name__
        assert (
            s["page_size"] == arm.page_size == report["kv_geometry"]["page_sizes"][name]
        )
        assert s["host_bytes_per_token"] == pytest.approx(
            _format_bytes_per_token(report, arm)
        ), name
        pools.add(s["host_pool"])
    assert len(pools) == len(arms), "two arms ran the same host pool class"


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


def test_silently_broken_load_path_refuses_to_report(bundle, report, monkeypatch):
    """The guard reads the device pool, not a flag: a load that is queued and
    acknowledged but never moves bytes is caught too."""
    for arm in hq.offload_arms().values():
        cls = _dispatch_cls(report, arm.host_dtype)
        monkeypatch.setattr(cls, "load_to_device_per_layer", lambda *a, **k: None)
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **{**SMALL, "windows": 1})
    with pytest.raises(hq.NoRestoreError, match="0 of 128"):
        hq.run_quality(cfg, bundle, log=lambda s: None)


@pytest.mark.parametrize("arm_name", ["int8", "k8v4", "int4"])
def test_each_quantized_arm_restores_through_its_own_pool(
    bundle, report, monkeypatch, arm_name
):
    """Breaking one format's pool breaks exactly that arm: its restore goes
    through that pool and no other."""
    arms = hq.offload_arms()
    if arm_name not in arms:
        pytest.fail(f"the server offers no --hicache-host-dtype {arm_name}")
    cls = _dispatch_cls(report, arms[arm_name].host_dtype)
    monkeypatch.setattr(cls, "load_to_device_per_layer", lambda *a, **k: None)
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **{**SMALL, "windows": 1})
    with pytest.raises(hq.RestoreError, match=f"arm {arm_name!r}.*0 of 128"):
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
    assert data["text"]["name"] == "wikitext-2"
    md = (tmp_path / "ci.md").read_text()
    assert "| int8 |" in md and "| bf16 (control) |" in md
    png = (tmp_path / "ci_kl.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # The second text, source code, by default: its own report and windows.
    code = json.loads((tmp_path / "ci_code.json").read_text())
    assert code["text"]["name"] == "python-stdlib"
    assert code["text"]["kind"] == "source code"
    assert (
        code["windows"] != data["windows"]
        or code["text"]["sha256"] != data["text"]["sha256"]
    )
    for arm in hq.offload_arms():
        assert code["arms"][arm]["restored_tokens"] == 64
    summary = (tmp_path / "ci_summary.md").read_text()
    assert "wikitext-2 (prose" in summary and "python-stdlib (source code" in summary
    for arm in hq.offload_arms():
        assert summary.count(f"| {hq.arm_label(arm)} |") == 2
    # The same run with the L2 load skipped exits 2 and writes nothing new.
    assert (
        quality.main(argv[:-2] + ["--name", "none", "--no-restore"], bundle=bundle) == 2
    )
    assert not (tmp_path / "none.json").exists()


def _tiny_llama(bundle, path):
    """A tiny random Llama (GQA: 4 query heads, 2 KV heads) with SmolLM2's
    tokenizer, saved as a Hugging Face model directory and loaded from it."""
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
    LlamaForCausalLM(config).save_pretrained(path)
    bundle.tokenizer.save_pretrained(path)
    return hq.load_model(str(path))


def test_any_hf_causal_lm_directory(bundle, tmp_path):
    """--model takes a Hugging Face model directory; here a tiny random Llama
    (GQA: 4 query heads, 2 KV heads) with page size 2."""
    tiny = _tiny_llama(bundle, tmp_path)
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


def test_windows_start_with_bos_where_served_prompts_do(bundle, tmp_path, monkeypatch):
    """Gemma's served prompts start with BOS, so its windows must too; SmolLM2's
    do not, so its windows are the text's tokens as they were."""
    from dataclasses import replace

    assert hq.PACKAGED_MODELS["gemma3-270m"].prepend_bos
    assert bundle.info["bos_token_id"] is None
    tiny = _tiny_llama(bundle, tmp_path)
    prefixes = []
    prefill = hq.prefill_kv
    monkeypatch.setattr(
        hq,
        "prefill_kv",
        lambda m, ids, d: prefixes.append(list(ids)) or prefill(m, ids, d),
    )
    cfg = hq.QualityConfig(
        text_file=str(TEXT_FILE),
        windows=1,
        prefix_len=32,
        score_len=8,
        greedy_tokens=0,
        arms=("bf16",),
    )
    bos = 7
    with_bos = replace(tiny, info={**tiny.info, "bos_token_id": bos})
    reports = [hq.run_quality(cfg, b, log=lambda s: None) for b in (tiny, with_bos)]
    ids, _ = hq.tokenize_text(tiny.tokenizer, str(TEXT_FILE))
    start = reports[0]["windows"][0]
    assert prefixes[0] == ids[start : start + 32]
    assert prefixes[1] == [bos] + ids[start : start + 31]
    assert reports[1]["arms"]["bf16"]["restored_tokens"] == 32
    assert "BOS" in hq.markdown_report(reports[1])
    assert "BOS" not in hq.markdown_report(reports[0])


def test_sliding_window_model_keeps_every_token_of_the_prefix(bundle, tmp_path):
    """Gemma 3 mixes sliding-window and full layers. SGLang's full-size KV
    pool keeps every token of every layer, so the harness must too: a tiny
    random Gemma 3 with an 8-token window, restored prefix of 32 tokens."""
    tiny = tiny_gemma3(bundle.tokenizer, tmp_path)
    kv = hq.prefill_kv(tiny.model, list(range(100, 132)), torch.bfloat16)
    assert [k.shape[0] for k, _ in kv] == [32, 32]
    cfg = hq.QualityConfig(
        text_file=str(TEXT_FILE),
        windows=1,
        prefix_len=64,
        score_len=16,
        greedy_tokens=4,
        arms=("bf16", "int8"),
    )
    rep = hq.run_quality(cfg, tiny, log=lambda s: None)
    assert rep["targets"]["control_bit_identical"]
    assert rep["arms"]["int8"]["restored_tokens"] == 64
    assert rep["arms"]["int8"]["kl_mean"] > 0


def test_code_text_is_read_from_the_installed_stdlib_not_the_repo(bundle):
    import sysconfig

    source = texts.python_stdlib()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert len(source.paths) == len(texts.STDLIB_FILES) >= 10
    for path in source.paths:
        assert path.resolve().is_relative_to(stdlib), path
        assert not path.resolve().is_relative_to(REPO_ROOT), path
    text = source.read()
    # Every file, whole and in order, and nothing else.
    whole = [p.read_text(encoding="utf-8") for p in source.paths]
    assert texts.FILE_SEPARATOR.join(whole) == text
    assert all("def " in w for w in whole) and "class " in text
    ids, info = hq.tokenize_text(bundle.tokenizer, source)
    assert info["kind"] == "source code" and info["python"]
    assert [f["path"] for f in info["files"]] == [str(p) for p in source.paths]
    assert info["tokens"] == len(ids) >= 32 * (1024 + 512 + 1)
    assert info["chars"] == len(text)


def test_code_text_names_missing_files(tmp_path):
    (tmp_path / "argparse.py").write_text("x = 1\n")
    source = texts.python_stdlib(files=("argparse.py", "nope.py"), root=tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.py"):
        source.read()


def test_summary_shows_each_format_target_as_measured(report):
    """The summary's pass/miss cells follow the measured figures and the
    format's own targets (int4: PPL <= 1%, top-1 >= 97%; k8v4: PPL <= 0.3%),
    or its recommended role's (tests/test_quality_references.py)."""
    assert hq.TARGETS["int4"] == hq.Target(ppl_rel_delta=0.01, top1=0.97)
    assert hq.TARGETS["k8v4"] == hq.Target(ppl_rel_delta=0.003)
    md = hq.summary_markdown({"wikitext-2": report})
    for name, s in report["arms"].items():
        target, _ = hq.arm_target(name, s.get("host_dtype"))
        if target is None or target.ppl_rel_delta is None:
            continue
        label = hq.arm_label(name)
        row = next(line for line in md.splitlines() if line.startswith(f"| {label} |"))
        ok = abs(s["ppl_rel_delta"]) <= target.ppl_rel_delta
        want = (
            f"PPL delta <= {100 * target.ppl_rel_delta:g}%: {'pass' if ok else 'MISS'}"
        )
        assert want in row
        assert f"{100 * s['ppl_rel_delta']:+.4f}%" in row
        assert (
            report["targets"][f"{name}_ppl_rel_delta_le_{target.ppl_rel_delta:g}"] == ok
        )
        if target.top1 is not None:
            ok = s["top1_agree"] >= target.top1
            assert f"top-1 >= {100 * target.top1:g}%: {'pass' if ok else 'MISS'}" in row


def test_windows_do_not_overlap_and_are_seeded():
    a = hq.pick_windows(10_000, 300, 20, seed=7)
    assert a == hq.pick_windows(10_000, 300, 20, seed=7)
    assert a != hq.pick_windows(10_000, 300, 20, seed=8)
    assert all(y - x >= 300 for x, y in zip(a, a[1:]))
    assert a[-1] + 300 <= 10_000
    with pytest.raises(ValueError):
        hq.pick_windows(1000, 300, 4, seed=0)


def test_histogram_handles_all_zero_series(tmp_path):
    plot.kl_histogram(
        {"bf16": [0.0] * 10, "int8": [1e-5, 3e-4, 2e-3]}, tmp_path / "h.png"
    )
    plot.kl_histogram({"bf16": [0.0] * 10}, tmp_path / "z.png")
    assert (tmp_path / "z.png").read_bytes()[:4] == b"\x89PNG"
