"""The quality CLI's targets for the rotated formats (issue 22): int4r's KL
is judged against the int4 arm of the same run, k8v4r's top-1 at 98.5%."""

from __future__ import annotations

import pytest

from scripts.quality import harness as hq


def arm(host_dtype, kl, top1=0.99, ppl_rel_delta=0.0):
    return {
        "host_dtype": host_dtype,
        "kl_mean": kl,
        "top1_agree": top1,
        "ppl_rel_delta": ppl_rel_delta,
    }


def targets(summary):
    cfg = hq.QualityConfig(text_file="unused")
    return hq._targets(cfg, summary, windows=3)


@pytest.mark.parametrize("kl_int4r,met", ((3.0e-3, True), (3.1e-3, False)))
def test_int4r_kl_is_judged_against_int4_in_the_same_run(kl_int4r, met):
    summary = {"int4": arm("int4", 5.0e-3), "int4r": arm("int4r", kl_int4r)}
    got = targets(summary)
    assert got["int4r_kl_le_0.6x_int4"] is met
    cell = hq._target_cells(hq.TARGETS["int4r"], summary["int4r"], summary)
    assert f"KL <= 0.6x int4: {'pass' if met else 'MISS'}" in cell


def test_no_int4_arm_no_kl_target():
    summary = {"int4r": arm("int4r", 1.0)}
    assert not any("kl_le" in key for key in targets(summary))
    assert "KL" not in hq._target_cells(hq.TARGETS["int4r"], summary["int4r"], summary)


@pytest.mark.parametrize(
    "name,top1,met",
    (("k8v4r", 0.985, True), ("k8v4r", 0.9849, False), ("int4r", 0.9699, False)),
)
def test_top1_targets(name, top1, met):
    want = {"k8v4r": 0.985, "int4r": 0.97}[name]
    got = targets({name: arm(name, 1e-3, top1=top1)})
    assert got[f"{name}_top1_ge_{want:g}"] is met
