"""The restored-KV quality harness (scripts/quality/) on the real SmolLM2-135M and
WikiText-2 through SGLang's real HiCache write/load path, at CI size: arms, guards,
texts, the references, the per-layer table and the targets per cell."""

from __future__ import annotations

import json
import math
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sglang.srt.mem_cache.pool_host.sink_page import AUTO_SINK_PAGE_TOKENS

from scripts.common import plot
from scripts.quality import __main__ as quality
from scripts.quality import harness as hq
from scripts.quality import texts
from tests.support.quality_inputs import SMALL, TEXT_FILE, dispatch_cls, tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
ONE_WINDOW = {**SMALL, "windows": 1}


@pytest.fixture(scope="module")
def bundle(smollm2_bundle):
    return smollm2_bundle


def run(bundle, standins=None, **config):
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **config)
    return hq.run_quality(cfg, bundle, standins, log=lambda s: None)


@pytest.fixture(scope="module")
def report(bundle):
    return run(bundle, ["conftest stand-ins"], **SMALL)


def _dispatch_cls(report, host_dtype):
    geo = report["kv_geometry"]
    return dispatch_cls(host_dtype, geo["kv_heads"], geo["head_dim"], geo["v_head_dim"])


def test_one_arm_per_registered_host_format(monkeypatch):
    from scripts.common import host_formats

    arms = hq.offload_arms()
    choices = host_formats.registered_host_dtypes()
    assert sorted(a.host_dtype for a in arms.values()) == sorted(choices)
    assert arms["bf16"].host_dtype == "auto" and arms["bf16"].page_size == 1
    assert arms["int8"].page_size == 1  # the README's INT8 figures
    assert arms["int8c"].page_size == 64  # keys per channel, not per token
    for arm in arms.values():
        if arm.host_dtype not in ("auto", "int8"):
            assert arm.page_size == hq.GROUPED_PAGE_SIZE, arm
            assert arm.layout == "page_first"
    # A format added to the server gets an arm.
    monkeypatch.setattr(
        host_formats, "registered_host_dtypes", lambda: [*choices, "fp6"]
    )
    arms = hq.offload_arms()
    assert arms["fp6"] == hq.Arm("fp6", "fp6", "page_first", hq.GROUPED_PAGE_SIZE)
    assert list(arms)[0] == "bf16"  # the control stays first
    assert hq.offload_arms(page_size=2)["fp6"].page_size == 2


def _format_bytes_per_token(report, arm) -> float:
    """Host bytes per token (all layers) of the arm's format, from its class."""
    from sglang.srt.mem_cache.pool_host.host_format import unit_tokens_for
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


def test_every_arm_restores_every_token_through_the_pool_of_its_format(bundle, report):
    """Each arm's pool is the --hicache-host-dtype dispatch's at the arm's page
    size, stores its format's bytes per token, and brought every token back."""
    geo = report["kv_geometry"]  # the real GQA model and text
    assert (geo["layers"], geo["kv_heads"], geo["head_dim"]) == (30, 3, 64)
    assert bundle.info["weights_sha256"] and report["text"]["tokens"] > 100_000
    expected = SMALL["windows"] * SMALL["prefix_len"]
    arms = hq.offload_arms()
    assert [a for a in report["arms"] if a not in hq.REFERENCES] == list(arms)
    pools = set()
    for name, arm in arms.items():
        s = report["arms"][name]
        for key in ("restored_tokens", "written_tokens", "load_acked_tokens"):
            assert s[key] == expected, (name, key)
        assert s["host_pool"] == _dispatch_cls(report, arm.host_dtype).__name__
        page_size = report["kv_geometry"]["page_sizes"][name]
        assert s["page_size"] == arm.page_size == page_size
        # SmolLM2 is not QK-normed: int4c gets the sink page as the server
        # would (sink_page.host_plan), and its store counts in the bytes.
        sink = AUTO_SINK_PAGE_TOKENS if arm.host_dtype == "int4c" else None
        assert s.get("sink_page_tokens") == sink, name
        want = _format_bytes_per_token(report, arm)
        if sink:
            want += s["sink_store_bytes"] / s["host_tokens"]
        assert s["host_bytes_per_token"] == pytest.approx(want), name
        pools.add(s["host_pool"])
    assert len(pools) == len(arms), "two arms ran the same host pool class"
    assert report["arms"]["bf16"]["host_pool"] == "MHATokenToKVPoolHost"
    assert report["arms"]["int8"]["host_pool"] == "MHATokenToKVPoolINT8Host"
    assert report["arms"]["exact"]["restored_tokens"] == 0
    assert report["arms"][hq.FP32_ARM]["restored_tokens"] == 0


def test_control_is_bit_identical_and_int8_within_loose_bound(report):
    control = report["control"]
    assert control["kv_bit_identical"] and control["logits_bit_identical"]
    s = report["arms"]["bf16"]
    assert s["ppl"] == report["arms"]["exact"]["ppl"]
    assert s["kl_max"] == 0.0 and s["max_abs_dlogprob"] == 0.0
    assert s["top1_agree"] == 1.0 and s["greedy_agree"] == 1.0
    assert report["targets"]["control_bit_identical"]
    s = report["arms"]["int8"]
    # Lossy (the codec really ran) but close.
    assert 0 < s["kv_rel_err"] < 0.03 and s["kl_mean"] > 0 and s["kl_max"] < 0.05
    assert abs(s["ppl_rel_delta"]) < 0.02
    assert s["top1_agree"] >= 0.95 and s["greedy_agree"] >= 0.5
    bf16_bytes = report["arms"]["bf16"]["host_bytes_per_token"]
    assert s["host_bytes_per_token"] * 1.9 < bf16_bytes


@pytest.mark.parametrize("broken", ["no-restore", "every-pool", "int8", "int4"])
def test_a_run_that_restores_nothing_refuses_to_report(
    bundle, report, monkeypatch, broken
):
    """The guard reads the device pool, not a flag: a load acknowledged that moves
    no bytes is caught, and breaking one format's pool breaks exactly that arm."""
    arms = hq.offload_arms()
    error, match, broken_arms = hq.RestoreError, f"arm {broken!r}.*0 of 128", [broken]
    if broken == "no-restore":
        error, match, broken_arms = hq.NoRestoreError, None, []
    elif broken == "every-pool":
        error, match, broken_arms = hq.NoRestoreError, "0 of 128", list(arms)
    elif broken not in arms:
        pytest.fail(f"the server offers no --hicache-host-dtype {broken}")
    for name in broken_arms:
        cls = _dispatch_cls(report, arms[name].host_dtype)
        monkeypatch.setattr(cls, "load_to_device_per_layer", lambda *a, **k: None)
    with pytest.raises(error, match=match):
        run(bundle, **ONE_WINDOW, restore=broken != "no-restore")


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_arms_restore_through_the_l2_pools(bundle, kv_dtype):
    """FP8 L1 (docs/fp8-device-kv.md): exact never offloaded, the control the stock
    1-byte FP8 host pool, int4/k8v4 FP8 -> host -> FP8."""
    arms_run = ("exact", "bf16", "int4", "k8v4")
    report = run(bundle, **ONE_WINDOW, kv_dtype=kv_dtype, arms=arms_run)
    kv = report["kv_geometry"]
    assert kv["kv_dtype"] == kv_dtype
    control = report["control"]
    assert control["kv_bit_identical"] and control["logits_bit_identical"]
    arms = report["arms"]
    # The fp32 reference scores beside the FP8 rows: FP8 rounding's own cost.
    assert arms[hq.FP32_ARM]["kl_mean"] > 0
    assert arms["bf16"]["kl_mean_fp32"] == arms["exact"]["kl_mean_fp32"] > 0
    assert arms["bf16"]["host_pool"] == "MHATokenToKVPoolHost"
    # The stock pool keeps 1 byte per FP8 value.
    fp8_bytes = kv["layers"] * kv["kv_heads"] * (kv["head_dim"] + kv["v_head_dim"])
    assert arms["bf16"]["host_bytes_per_token"] == fp8_bytes
    for name, cls in (("int4", "INT4"), ("k8v4", "K8V4")):
        s = arms[name]
        assert s["host_pool"] == f"MHATokenToKVPool{cls}Host"
        assert s["restored_tokens"] == s["written_tokens"] > 0
        # Lossy (the codec ran on FP8 values) but close, and smaller.
        assert 0 < s["kv_rel_err"] < 0.2 and s["kl_mean"] > 0
        assert s["host_bytes_per_token"] < fp8_bytes
        assert torch.isfinite(torch.tensor(s["ppl"]))


def test_cli_writes_markdown_json_and_png(bundle, tmp_path):
    argv = [
        *("--text-file", str(TEXT_FILE), "--seed", "3", "--out-dir", str(tmp_path)),
        *"--windows 1 --prefix-len 64 --score-len 32 --greedy-tokens 4".split(),
        *("--name", "ci"),
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
    assert (tmp_path / "ci_kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The second text, source code, by default: its own report and windows.
    code = json.loads((tmp_path / "ci_code.json").read_text())
    assert code["text"]["name"] == "python-stdlib"
    assert code["text"]["kind"] == "source code"
    assert (
        code["windows"] != data["windows"]
        or code["text"]["sha256"] != data["text"]["sha256"]
    )
    summary = (tmp_path / "ci_summary.md").read_text()
    assert "wikitext-2 (prose" in summary and "python-stdlib (source code" in summary
    for arm in hq.offload_arms():
        assert code["arms"][arm]["restored_tokens"] == 64
        assert summary.count(f"| {hq.arm_label(arm)} |") == 2
    # The same run with the L2 load skipped exits 2 and writes nothing new.
    argv = argv[:-2] + ["--name", "none", "--no-restore"]
    assert quality.main(argv, bundle=bundle) == 2
    assert not (tmp_path / "none.json").exists()


def _cli(tmp_path, *extra, arms="bf16,int8"):
    return [
        *("--text-file", str(TEXT_FILE), "--out-dir", str(tmp_path), "--arms", arms),
        *"--code-text none --windows 1 --prefix-len 64 --score-len 32".split(),
        *("--greedy-tokens", "0", *extra),
    ]


def test_cli_scores_the_doc_text_as_a_third_report(bundle, tmp_path):
    argv = _cli(
        tmp_path, "--name", "ci", "--doc-text", "python-docs", arms="exact,bf16,int8"
    )
    assert quality.main(argv, bundle=bundle) == 0
    prose = json.loads((tmp_path / "ci.json").read_text())
    docs = json.loads((tmp_path / "ci_docs.json").read_text())
    assert docs["text"]["name"] == "python-docs"
    assert docs["text"]["sha256"] != prose["text"]["sha256"]
    assert docs["arms"]["int8"]["restored_tokens"] == 64
    assert not (tmp_path / "ci_code.json").exists()
    assert "python-docs (documentation" in (tmp_path / "ci_summary.md").read_text()


def test_any_hf_causal_lm_directory_and_bos(bundle, tmp_path, monkeypatch):
    """--model takes a Hugging Face model directory (a tiny random GQA Llama, page
    size 2). Gemma's served prompts start with BOS, so its windows must too;
    SmolLM2's do not, so its windows are the text's tokens as they were."""
    assert hq.PACKAGED_MODELS["gemma3-270m"].prepend_bos
    assert bundle.info["bos_token_id"] is None
    tiny = tiny_model(bundle.tokenizer, tmp_path, "llama")
    prefixes = []
    prefill = hq.prefill_kv
    monkeypatch.setattr(
        hq,
        "prefill_kv",
        lambda m, ids, d: prefixes.append(list(ids)) or prefill(m, ids, d),
    )
    bos = 7
    with_bos = replace(tiny, info={**tiny.info, "bos_token_id": bos})
    sizes = dict(windows=1, prefix_len=32, score_len=16, greedy_tokens=4)
    reports = [
        run(tiny, **sizes, page_size=2),
        run(with_bos, **sizes, arms=("bf16",)),
    ]
    rep = reports[0]
    assert rep["kv_geometry"]["layers"] == 2 and rep["kv_geometry"]["kv_heads"] == 2
    assert rep["targets"]["control_bit_identical"]
    assert rep["arms"]["int8"]["restored_tokens"] == 32
    ids, _ = hq.tokenize_text(tiny.tokenizer, str(TEXT_FILE))
    start = reports[0]["windows"][0]
    assert prefixes[0] == ids[start : start + 32]
    assert prefixes[1] == [bos] + ids[start : start + 31]
    assert reports[1]["arms"]["bf16"]["restored_tokens"] == 32
    assert "BOS" in hq.markdown_report(reports[1])
    assert "BOS" not in hq.markdown_report(reports[0])


def test_sliding_window_model_keeps_every_token_of_the_prefix(bundle, tmp_path):
    """SGLang's full-size KV pool keeps every token of every layer, so the harness
    must too (a tiny Gemma 3, 8-token window); the table names each layer's kind."""
    tiny = tiny_model(bundle.tokenizer, tmp_path)
    kv = hq.prefill_kv(tiny.model, list(range(100, 132)), torch.bfloat16)
    assert [k.shape[0] for k, _ in kv] == [32, 32]
    sizes = dict(windows=1, prefix_len=64, score_len=16, greedy_tokens=4)
    rep = run(tiny, **sizes, arms=("bf16", "int8"))
    assert rep["targets"]["control_bit_identical"]
    assert rep["arms"]["int8"]["restored_tokens"] == 64
    assert rep["arms"]["int8"]["kl_mean"] > 0
    kinds = [r["attention"] for r in rep["per_layer"]["layers"]]
    assert kinds == ["sliding (8)", "full"]
    md = hq.markdown_report(rep)
    assert "| 0 | sliding (8) |" in md and "| 1 | full |" in md


@pytest.mark.parametrize("name", ["python-stdlib", "python-docs"])
def test_second_and_third_texts_are_read_from_the_installed_python(bundle, name):
    """Whole files (stdlib sources; pydoc_data's topics), in order, from where
    Python installs them, never from the repo."""
    from pydoc_data import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    if name == "python-stdlib":
        source, kind = texts.python_stdlib(), "source code"
        assert len(source.paths) == len(texts.STDLIB_FILES) >= 10
        parts = [p.read_text(encoding="utf-8") for p in source.paths]
        assert all("def " in part for part in parts)
    else:
        source, kind = texts.python_docs(), "documentation"
        assert len(source.paths) == 1
        parts = list(topics.topics.values())
    for path in source.paths:
        assert path.resolve().is_relative_to(stdlib), path
        assert not path.resolve().is_relative_to(REPO_ROOT), path
    text = source.read()
    assert text == texts.FILE_SEPARATOR.join(parts)
    if name == "python-stdlib":
        assert "class " in text
    else:  # no Python syntax
        assert "topics = {" not in text and 'The "assert" statement' in text
    ids, info = hq.tokenize_text(bundle.tokenizer, source)
    assert info["kind"] == kind and info["name"] == name
    assert info["tokens"] == len(ids) >= 32 * (1024 + 512 + 1)
    if name == "python-stdlib":
        assert info["python"] and info["chars"] == len(text)
        assert [f["path"] for f in info["files"]] == [str(p) for p in source.paths]


def test_texts_name_missing_files(tmp_path):
    (tmp_path / "argparse.py").write_text("x = 1\n")
    code = texts.python_stdlib(files=("argparse.py", "nope.py"), root=tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.py"):
        code.read()
    with pytest.raises(FileNotFoundError, match="topics.py"):
        texts.python_docs(root=tmp_path).read()


def test_summary_shows_each_format_target_as_measured(report):
    """Pass/miss cells follow the measured figures and the format's own targets
    (int4: PPL <= 1%, top-1 >= 97%; k8v4: PPL <= 0.3%) or its role's."""
    assert hq.TARGETS["int4"] == hq.Target(ppl_rel_delta=0.01, top1=0.97)
    assert hq.TARGETS["k8v4"] == hq.Target(ppl_rel_delta=0.003)
    md = hq.summary_markdown({"wikitext-2": report})
    for name, s in report["arms"].items():
        target, _ = hq.arm_target(name, s.get("host_dtype"))
        if target is None or target.ppl_rel_delta is None:
            continue
        label = hq.arm_label(name)
        row = next(line for line in md.splitlines() if line.startswith(f"| {label} |"))
        limit = target.ppl_rel_delta
        ok = abs(s["ppl_rel_delta"]) <= limit
        assert f"PPL delta <= {100 * limit:g}%: {'pass' if ok else 'MISS'}" in row
        assert f"{100 * s['ppl_rel_delta']:+.4f}%" in row
        assert report["targets"][f"{name}_ppl_rel_delta_le_{limit:g}"] == ok
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


# --- the references, the per-layer table and the verdicts --------------------


def test_references_and_control_rows(report):
    """Both references score every arm (fp32_kv beside exact: never offloaded,
    no targets), and the control is flagged as one."""
    arms = report["arms"]
    assert list(arms)[:2] == ["exact", hq.FP32_ARM]
    exact, fp32, bf16 = arms["exact"], arms[hq.FP32_ARM], arms["bf16"]
    # Never offloaded, and BF16 rounding costs something measurable.
    assert fp32["restored_tokens"] == 0 and "host_pool" not in fp32
    assert fp32["kl_mean"] > 0 and fp32["kv_rel_err"] > 0
    assert not any(k.startswith(hq.FP32_ARM) for k in report["targets"])
    for s in arms.values():
        for key in ("kl_mean", "top1_agree", "kl_mean_fp32", "top1_agree_fp32"):
            assert math.isfinite(s[key])
    # Each reference against itself, and the control against exact: zero.
    assert exact["kl_mean"] == fp32["kl_mean_fp32"] == bf16["kl_mean"] == 0.0
    assert exact["top1_agree"] == fp32["top1_agree_fp32"] == bf16["top1_agree"] == 1
    # The control is exact, so it sits exactly where exact does against fp32.
    assert bf16["kl_mean_fp32"] == exact["kl_mean_fp32"] > 0
    assert bf16["top1_agree_fp32"] == exact["top1_agree_fp32"]
    # A lossy arm differs from both, by different amounts.
    assert arms["int4"]["kl_mean"] > 0 and arms["int4"]["kl_mean_fp32"] > 0
    assert arms["int4"]["kl_mean"] != arms["int4"]["kl_mean_fp32"]
    assert fp32["ppl_rel_delta_fp32"] == 0.0
    assert hq.arm_label("bf16") == "bf16 (control)"
    md = hq.markdown_report(report)
    summary = hq.summary_markdown({"wikitext-2": report})
    for text in (md, summary):
        assert "| fp32_kv | none (reference: fp32 KV, not rounded) |" in text
        assert "| bf16 (control) | MHATokenToKVPoolHost" in text
        assert "a plumbing control, not a format" in text
    assert "| bf16 |" not in md
    assert "| top-1 vs exact | mean KL vs exact | top-1 vs fp32_kv " in summary
    assert "| mean KL vs fp32_kv | max KL vs exact | targets |" in summary
    assert "| mean KL vs exact | top-1 vs exact |" in md
    (row,) = [
        x for x in md.splitlines() if x.startswith("| int4 | ") and "Pool" not in x
    ]
    for key in ("kl_mean", "kl_mean_fp32"):
        assert f"| {arms['int4'][key]:.2e} |" in row


def test_fp32_reference_is_the_unrounded_prefill(bundle, report, monkeypatch):
    """exact is the fp32 prefill rounded to BF16, in one prefill per window."""
    calls = []
    prefill = hq.prefill_kv
    monkeypatch.setattr(
        hq,
        "prefill_kv",
        lambda m, ids, d: calls.append(d) or prefill(m, ids, d),
    )
    rep = run(bundle, **SMALL, arms=("bf16",))
    assert calls == [torch.float32] * SMALL["windows"]
    assert rep["arms"]["exact"]["ppl"] == report["arms"]["exact"]["ppl"]
    # The L1 rounding per layer: exact vs fp32, far below a 4-bit format's.
    for row in report["per_layer"]["layers"]:
        for side in "kv":
            assert 0 < row[side][hq.FP32_ARM] < 0.01 < row[side]["int4"]


def test_per_layer_table_has_one_row_per_layer(report):
    pl = report["per_layer"]
    layers = report["kv_geometry"]["layers"]
    assert [r["layer"] for r in pl["layers"]] == list(range(layers))
    assert pl["window"] == 0 and pl["start"] == report["windows"][0]
    for row in pl["layers"]:
        assert row["attention"] == "full"  # Llama: no sliding window
        assert set(row["k"]) == set(row["v"]) == {hq.FP32_ARM, *hq.offload_arms()}
        assert row["k"]["bf16"] == row["v"]["bf16"] == 0.0
        assert row["k"]["int8"] > 0 and row["v"]["int4"] > row["v"]["int8"]
    # The whole-KV error is a weighted mean of the per-layer, per-side ones.
    errs = [r[side]["int4"] for r in pl["layers"] for side in "kv"]
    assert min(errs) <= report["arms"]["int4"]["kv_rel_err"] <= max(errs)
    md = hq.markdown_report(report)
    rows = [x for x in md.splitlines() if x.startswith("| ") and "| full |" in x]
    assert len(rows) == layers
    labels = " | ".join(map(hq.arm_label, hq.offload_arms()))
    assert f"| layer | attention | fp32_kv | {labels} |" in md
    assert "| fp32_kv | bf16 (control) | int8 |" in md
    data = json.loads(json.dumps(report))
    assert len(data["per_layer"]["layers"]) == layers


# --- which targets apply, and the per-cell verdict ---------------------------


def _arm(host_dtype, kl=1e-3, top1=0.999, ppl=0.0, capacity=1.0):
    return {
        "host_dtype": host_dtype,
        "kl_mean": kl,
        "top1_agree": top1,
        "ppl_rel_delta": ppl,
        "capacity_vs_bf16": capacity,
    }


def _targets(summary, windows=1, **kw):
    return hq._targets(hq.QualityConfig(text_file="unused"), summary, windows, **kw)


def test_recommended_table_drives_the_targets(monkeypatch):
    got = _targets({"int8c": _arm("int8c")})  # a recommended format not run: miss
    assert got["recommended_8-bit_int8c_ran"] is True
    assert got["recommended_4-bit_int4c_ran"] is False
    summary = {
        "int8": _arm("int8", capacity=1.969),
        "int8c": _arm("int8c", capacity=1.925),
        "k8v4": _arm("k8v4", capacity=2.535),
        "int4": _arm("int4", kl=5e-3, capacity=3.556),
        "int4r": _arm("int4r", kl=2e-3, capacity=3.556),
        "int4c": _arm("int4c", kl=2e-3, capacity=3.429),
    }
    assert hq.RECOMMENDED == {"8-bit": "int8c", "4-bit": "int4c"}
    assert {k for k in _targets(summary) if k.split("_")[0] in summary} == set(
        "int8_ppl_rel_delta_le_0.001 int8_top1_ge_0.995 int8c_ppl_rel_delta_le_0.001"
        " int8c_top1_ge_0.995 k8v4_ppl_rel_delta_le_0.003 int4_ppl_rel_delta_le_0.01"
        " int4_top1_ge_0.97 int4r_ppl_rel_delta_le_0.01 int4r_top1_ge_0.97"
        " int4r_kl_le_0.6x_int4 int4c_top1_ge_0.97 int4c_kl_le_0.6x_int4"
        " int4c_capacity_ge_3.4x".split()
    )
    # The lead names another format: the role's targets move with it, and the
    # former one falls back to its own format's targets.
    monkeypatch.setitem(hq.RECOMMENDED, "8-bit", "k8v4")
    monkeypatch.setitem(hq.RECOMMENDED, "4-bit", "int4")
    got = _targets(summary)
    assert {k for k in got if k.startswith("k8v4_")} == {
        "k8v4_ppl_rel_delta_le_0.001",
        "k8v4_top1_ge_0.995",
    }
    assert {k for k in got if k.startswith("int4r_")} == {
        "int4r_ppl_rel_delta_le_0.01",
        "int4r_top1_ge_0.97",
        "int4r_kl_le_0.6x_int4",
    }
    # Plain int4 as the 4-bit: its KL against itself, 0.6x, misses.
    assert got["int4_kl_le_0.6x_int4"] is False
    assert got["int4_capacity_ge_3.4x"] is True
    target, role = hq.arm_target("int4", "int4")
    cell = hq._target_cells(target, summary["int4"], summary, role)
    assert cell.startswith("recommended 4-bit: ")
    # An opt-in arm (the sink page) named there runs by default.
    cfg = hq.QualityConfig(text_file="unused")
    assert "int4r_sink" not in hq._selected_arms(cfg)[0]
    monkeypatch.setitem(hq.RECOMMENDED, "4-bit", "int4r_sink")
    arms, offloaded = hq._selected_arms(cfg)
    assert arms[-1] == "int4r_sink" and offloaded[-1].sink_page_tokens > 0
    assert arms.count("int4r_sink") == 1


def _kl_rows(kl_int4r):
    return {"int4": _arm("int4", kl=5.0e-3), "int4r": _arm("int4r", kl=kl_int4r)}


# (arms, target, met): int4r's KL is judged against int4 in the same run (no
# target without an int4 arm: met None), k8v4r's top-1 at 98.5%.
TARGET_ROWS = [
    (_kl_rows(3.0e-3), "int4r_kl_le_0.6x_int4", True),
    (_kl_rows(3.1e-3), "int4r_kl_le_0.6x_int4", False),
    ({"int4r": _arm("int4r", kl=1.0)}, "int4r_kl_le_0.6x_int4", None),
    ({"k8v4r": _arm("k8v4r", top1=0.985)}, "k8v4r_top1_ge_0.985", True),
    ({"k8v4r": _arm("k8v4r", top1=0.9849)}, "k8v4r_top1_ge_0.985", False),
    ({"int4r": _arm("int4r", top1=0.9699)}, "int4r_top1_ge_0.97", False),
    ({"int4c": _arm("int4c", capacity=3.4)}, "int4c_capacity_ge_3.4x", True),
    ({"int4c": _arm("int4c", capacity=3.39)}, "int4c_capacity_ge_3.4x", False),
]


@pytest.mark.parametrize("summary,key,met", TARGET_ROWS)
def test_target_thresholds(summary, key, met):
    got = _targets(summary, windows=3)
    if met is None:
        assert not any("kl_le" in k for k in got)
    else:
        assert got[key] is met
    if "_kl_" in key:
        cell = hq._target_cells(hq.TARGETS["int4r"], summary["int4r"], summary)
        verdict = "" if met is None else {True: ": pass", False: ": MISS"}[met]
        assert ("KL <= 0.6x int4" + verdict in cell) is (met is not None)
        assert ("KL" in cell) is (met is not None)


def test_capacity_is_the_formats_at_qwen3_8b_geometry():
    """Tokens per host byte against BF16 at Qwen3-8B, page 64: the README's."""
    arms = hq.offload_arms()
    bf16 = 36 * 2 * 8 * 128 * 2
    assert hq.capacity_vs_bf16(arms["bf16"]) == 1.0
    assert hq.capacity_vs_bf16(arms["int8"]) == pytest.approx(bf16 / (36 * 2080))
    assert hq.capacity_vs_bf16(arms["int4r"]) == pytest.approx(bf16 / 41472)
    sink = replace(arms["int4r"], sink_page_tokens=4096)
    assert hq.capacity_vs_bf16(sink) == pytest.approx(bf16 / 42057)


def test_check_targets_exit_status_per_cell(bundle, tmp_path, monkeypatch, capsys):
    """Met: exit 0, the cell says met; a forced miss (an 8-bit target no format
    meets): exit 1, the cell names it."""
    # This tiny run counts as full size, and int8 meets a loose 8-bit target.
    monkeypatch.setitem(bundle.info, "full_size_windows", 1)
    monkeypatch.setattr(hq, "TARGET_PREFIX", 64)
    monkeypatch.setattr(hq, "TARGET_SCORED", 32)
    loose = hq.Target(ppl_rel_delta=0.5, top1=0.5)
    monkeypatch.setitem(hq.RECOMMENDED_TARGETS, "8-bit", loose)
    monkeypatch.setattr(hq, "RECOMMENDED", {"8-bit": "int8"})  # int4r not run
    check = ("--check-targets", "--name")
    assert quality.main(_cli(tmp_path, *check, "met"), bundle=bundle) == 0
    out = capsys.readouterr().out
    assert "- SmolLM2-135M-Instruct x wikitext-2: met" in out
    summary = (tmp_path / "met_summary.md").read_text()
    assert "## Targets per cell" in summary
    assert "- SmolLM2-135M-Instruct x wikitext-2: met" in summary
    assert "recommended 8-bit: PPL delta <= 50%: pass" in summary

    monkeypatch.setitem(hq.RECOMMENDED_TARGETS, "8-bit", hq.Target(capacity=100))
    assert quality.main(_cli(tmp_path, *check, "miss"), bundle=bundle) == 1
    out = capsys.readouterr().out
    assert "- SmolLM2-135M-Instruct x wikitext-2: MISSED 1 of 4: int8_capacity" in out
    # Without --check-targets the verdict is printed all the same, exit 0.
    assert quality.main(_cli(tmp_path, "--name", "m2"), bundle=bundle) == 0
    assert "MISSED 1 of 4: int8_capacity_ge_100x" in capsys.readouterr().out


def test_long_preset_and_full_size_windows():
    args = quality.parse_args(["--text-file", "t", "--long"])
    assert (args.prefix_len, args.windows) == (2048, 1)
    args = quality.parse_args(["--text-file", "t"])
    assert (args.prefix_len, args.windows) == (hq.TARGET_PREFIX, hq.TARGET_WINDOWS)
    with pytest.raises(SystemExit):
        quality.parse_args(["--text-file", "t", "--long", "--windows", "2"])
    # The targets' protocol: 32 windows per text on SmolLM2, 8 on Gemma 3.
    assert hq.PACKAGED_MODELS["smollm2-135m"].full_size_windows == 32
    assert hq.PACKAGED_MODELS["gemma3-270m"].full_size_windows == 8
    summary = {"int8c": _arm("int8c")}
    assert _targets(summary, 8, full_windows=8)["full_size_run"]
    assert not _targets(summary, 8)["full_size_run"]
    assert not _targets(summary, 7, full_windows=8)["full_size_run"]
