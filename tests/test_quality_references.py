"""The quality harness's floor and verdicts (scripts/quality/harness.py) on the
real SmolLM2-135M through SGLang's real L2 path, at a tiny size: the fp32-KV
reference row beside `exact`, both references per arm, the control flagged, the
per-layer K/V errors, the RECOMMENDED table and the targets per model x text."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scripts.quality import harness as hq
from tests.support.quality_inputs import TEXT_FILE

TINY = dict(windows=1, prefix_len=64, score_len=32, greedy_tokens=4, seed=1)
ARMS = ("bf16", "int8", "int4")


@pytest.fixture(scope="module")
def bundle(smollm2_bundle):
    return smollm2_bundle


@pytest.fixture(scope="module")
def report(bundle):
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **TINY, arms=ARMS)
    return hq.run_quality(cfg, bundle, log=lambda s: None)


def test_fp32_reference_row_sits_beside_exact(report):
    arms = report["arms"]
    assert list(arms)[:2] == ["exact", hq.FP32_ARM]
    fp32 = arms[hq.FP32_ARM]
    # Never offloaded, and BF16 rounding costs something measurable.
    assert fp32["restored_tokens"] == 0 and "host_pool" not in fp32
    assert fp32["kl_mean"] > 0 and fp32["kv_rel_err"] > 0
    assert not any(k.startswith(hq.FP32_ARM) for k in report["targets"])
    md = hq.markdown_report(report)
    assert "| fp32_kv | none (reference: fp32 KV, not rounded) |" in md
    summary = hq.summary_markdown({"wikitext-2": report})
    assert "| fp32_kv | none (reference: fp32 KV, not rounded) |" in summary


def test_fp32_reference_is_the_unrounded_prefill(bundle, report, monkeypatch):
    """exact is the fp32 prefill rounded to BF16, in one prefill per window."""
    calls = []
    prefill = hq.prefill_kv
    monkeypatch.setattr(
        hq,
        "prefill_kv",
        lambda m, ids, d: calls.append(d) or prefill(m, ids, d),
    )
    cfg = hq.QualityConfig(text_file=str(TEXT_FILE), **TINY, arms=("bf16",))
    rep = hq.run_quality(cfg, bundle, log=lambda s: None)
    assert calls == [torch.float32]
    assert rep["arms"]["exact"]["ppl"] == report["arms"]["exact"]["ppl"]
    # The L1 rounding per layer: exact vs fp32, far below a 4-bit format's.
    for row in report["per_layer"]["layers"]:
        for side in "kv":
            assert 0 < row[side][hq.FP32_ARM] < 0.01 < row[side]["int4"]


def test_control_is_flagged_as_control(report):
    assert hq.arm_label("bf16") == "bf16 (control)"
    note = "a plumbing control, not a format"
    md = hq.markdown_report(report)
    assert "| bf16 (control) | MHATokenToKVPoolHost" in md and note in md
    assert "| bf16 |" not in md
    summary = hq.summary_markdown({"wikitext-2": report})
    assert "| bf16 (control) | MHATokenToKVPoolHost" in summary and note in summary


def test_both_references_for_every_arm_and_consistent(report):
    arms = report["arms"]
    for s in arms.values():
        for key in ("kl_mean", "top1_agree", "kl_mean_fp32", "top1_agree_fp32"):
            assert math.isfinite(s[key])
    exact, fp32, bf16 = arms["exact"], arms[hq.FP32_ARM], arms["bf16"]
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
    summary = hq.summary_markdown({"wikitext-2": report})
    assert "| top-1 vs exact | mean KL vs exact | top-1 vs fp32_kv " in summary
    assert "| mean KL vs fp32_kv | max KL vs exact | targets |" in summary
    md = hq.markdown_report(report)
    assert "| mean KL vs exact | top-1 vs exact |" in md
    (row,) = [
        x for x in md.splitlines() if x.startswith("| int4 | ") and "Pool" not in x
    ]
    for key in ("kl_mean", "kl_mean_fp32"):
        assert f"| {arms['int4'][key]:.2e} |" in row


def test_per_layer_table_has_one_row_per_layer(report):
    pl = report["per_layer"]
    layers = report["kv_geometry"]["layers"]
    assert [r["layer"] for r in pl["layers"]] == list(range(layers))
    assert pl["window"] == 0 and pl["start"] == report["windows"][0]
    for row in pl["layers"]:
        assert row["attention"] == "full"  # Llama: no sliding window
        assert set(row["k"]) == set(row["v"]) == {hq.FP32_ARM, *ARMS}
        assert row["k"]["bf16"] == row["v"]["bf16"] == 0.0
        assert row["k"]["int8"] > 0 and row["v"]["int4"] > row["v"]["int8"]
    # The whole-KV error is a weighted mean of the per-layer, per-side ones.
    errs = [r[side]["int4"] for r in pl["layers"] for side in "kv"]
    assert min(errs) <= report["arms"]["int4"]["kv_rel_err"] <= max(errs)
    md = hq.markdown_report(report)
    rows = [x for x in md.splitlines() if x.startswith("| ") and "| full |" in x]
    assert len(rows) == layers
    assert "| layer | attention | fp32_kv | bf16 (control) | int8 | int4 |" in md
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


def _keys(summary):
    return {k for k in _targets(summary) if k.split("_")[0] in summary}


def test_recommended_table_drives_the_targets(monkeypatch):
    summary = {
        "int8": _arm("int8", capacity=1.969),
        "int8c": _arm("int8c", capacity=1.925),
        "k8v4": _arm("k8v4", capacity=2.535),
        "int4": _arm("int4", kl=5e-3, capacity=3.556),
        "int4r": _arm("int4r", kl=2e-3, capacity=3.556),
    }
    assert hq.RECOMMENDED == {"8-bit": "int8c", "4-bit": "int4r"}
    assert _keys(summary) == set(
        "int8_ppl_rel_delta_le_0.001 int8_top1_ge_0.995 int8c_ppl_rel_delta_le_0.001"
        " int8c_top1_ge_0.995 k8v4_ppl_rel_delta_le_0.003 int4_ppl_rel_delta_le_0.01"
        " int4_top1_ge_0.97 int4r_top1_ge_0.97 int4r_kl_le_0.6x_int4"
        " int4r_capacity_ge_3.4x".split()
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


def test_a_recommended_format_not_run_is_a_miss(monkeypatch):
    got = _targets({"int8c": _arm("int8c")})
    assert got["recommended_8-bit_int8c_ran"] is True
    assert got["recommended_4-bit_int4r_ran"] is False
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
    ({"int4r": _arm("int4r", capacity=3.4)}, "int4r_capacity_ge_3.4x", True),
    ({"int4r": _arm("int4r", capacity=3.39)}, "int4r_capacity_ge_3.4x", False),
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
    """Tokens per host byte against BF16 at 36 layers x 8 KV heads x 128 dims,
    page 64: the README's figures (docs/design.md, docs/sink-page.md)."""
    from dataclasses import replace

    arms = hq.offload_arms()
    bf16 = 36 * 2 * 8 * 128 * 2
    assert hq.capacity_vs_bf16(arms["bf16"]) == 1.0
    assert hq.capacity_vs_bf16(arms["int8"]) == pytest.approx(bf16 / (36 * 2080))
    assert hq.capacity_vs_bf16(arms["int4r"]) == pytest.approx(bf16 / 41472)
    sink = replace(arms["int4r"], sink_page_tokens=4096)
    assert hq.capacity_vs_bf16(sink) == pytest.approx(bf16 / 42057)


def _cli(tmp_path, *extra):
    return [
        *("--text-file", str(TEXT_FILE), "--out-dir", str(tmp_path)),
        *"--code-text none --windows 1 --prefix-len 64 --score-len 32".split(),
        *"--greedy-tokens 0 --arms bf16,int8 --check-targets".split(),
        *extra,
    ]


def test_check_targets_exit_status_per_cell(bundle, tmp_path, monkeypatch, capsys):
    """Met: exit 0 and the cell says met; a forced miss (a recommended 8-bit
    target no format meets): exit 1 and the cell names the missed target."""
    from scripts.quality import __main__ as quality

    # This tiny run counts as full size, and int8 meets a loose 8-bit target.
    monkeypatch.setitem(bundle.info, "full_size_windows", 1)
    monkeypatch.setattr(hq, "TARGET_PREFIX", 64)
    monkeypatch.setattr(hq, "TARGET_SCORED", 32)
    loose = hq.Target(ppl_rel_delta=0.5, top1=0.5)
    monkeypatch.setitem(hq.RECOMMENDED_TARGETS, "8-bit", loose)
    monkeypatch.setattr(hq, "RECOMMENDED", {"8-bit": "int8"})  # int4r not run
    assert quality.main(_cli(tmp_path, "--name", "met"), bundle=bundle) == 0
    out = capsys.readouterr().out
    assert "- SmolLM2-135M-Instruct x wikitext-2: met" in out
    summary = (tmp_path / "met_summary.md").read_text()
    assert "## Targets per cell" in summary
    assert "- SmolLM2-135M-Instruct x wikitext-2: met" in summary
    assert "recommended 8-bit: PPL delta <= 50%: pass" in summary

    monkeypatch.setitem(hq.RECOMMENDED_TARGETS, "8-bit", hq.Target(capacity=100))
    assert quality.main(_cli(tmp_path, "--name", "miss"), bundle=bundle) == 1
    out = capsys.readouterr().out
    assert "- SmolLM2-135M-Instruct x wikitext-2: MISSED 1 of 4: int8_capacity" in out
    # Without --check-targets the verdict is printed all the same, exit 0.
    argv = [a for a in _cli(tmp_path, "--name", "m2") if a != "--check-targets"]
    assert quality.main(argv, bundle=bundle) == 0
    assert "MISSED 1 of 4: int8_capacity_ge_100x" in capsys.readouterr().out


def test_long_preset_is_one_2048_token_window():
    from scripts.quality import __main__ as quality

    args = quality.parse_args(["--text-file", "t", "--long"])
    assert (args.prefix_len, args.windows) == (2048, 1)
    args = quality.parse_args(["--text-file", "t"])
    assert (args.prefix_len, args.windows) == (hq.TARGET_PREFIX, hq.TARGET_WINDOWS)
    with pytest.raises(SystemExit):
        quality.parse_args(["--text-file", "t", "--long", "--windows", "2"])


def test_full_size_run_counts_the_models_own_windows():
    """The targets' protocol: 32 windows per text on SmolLM2, 8 on Gemma 3."""
    assert hq.PACKAGED_MODELS["smollm2-135m"].full_size_windows == 32
    assert hq.PACKAGED_MODELS["gemma3-270m"].full_size_windows == 8
    summary = {"int8c": _arm("int8c")}
    assert _targets(summary, 8, full_windows=8)["full_size_run"]
    assert not _targets(summary, 8)["full_size_run"]
    assert not _targets(summary, 7, full_windows=8)["full_size_run"]
