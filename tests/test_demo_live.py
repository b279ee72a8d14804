"""`make demo` part 1 on real patched CPU servers (python -m scripts.demo
--live-quick, bf16 and int8 at one host budget, part 2 tiny; ~2 min): bf16's
host tier overflows, int8 serves reuse from host. Sizing rules need no server."""

from __future__ import annotations

import argparse
import json

import pytest

from scripts.demo import live

pytestmark = pytest.mark.filterwarnings("ignore")


def _prompt(group, ids, output_len=4):
    return live.SentPrompt(group=group, text="", ids=list(ids), output_len=output_len)


def test_reuse_order_is_least_recently_used_group_first():
    sent = [_prompt(0, [1]), _prompt(1, [2]), _prompt(0, [3]), _prompt(2, [4])]
    order = live.reuse_order(sent)
    assert [p.group for p in order] == [1, 0, 2]
    assert order[1].ids == [3]  # the group's last-sent prompt


def test_working_set_counts_shared_prefixes_once():
    shared = list(range(100))
    sent = [_prompt(0, shared + [500, 501]), _prompt(0, shared + [600])]
    # 100 shared + 2 + 1 distinct prompt tokens, 2 x 4 outputs, the warm-up's
    # 4, and 2 x (gen + 1) per reused group.
    assert live.working_set_tokens(sent, gen_tokens=3) == 103 + 8 + 4 + 8


def test_budget_refuses_workloads_that_cannot_show_the_difference():
    formats = [("bf16", "auto"), ("int8", "int8")]
    bpt = {"bf16": 23_040, "int8": 11_880}
    config = live.LiveConfig(device_tokens=1_000, margin=1.25)
    budget = live.choose_budget(formats, bpt, 2_000, config)
    assert budget.arm("int8").host_tokens >= 1.25 * 2_000
    assert config.device_tokens < budget.arm("bf16").host_tokens < 2_000
    for arm in budget.arms:
        assert int(config.device_tokens * arm.hicache_ratio) == arm.host_tokens
    with pytest.raises(SystemExit, match="--live-device-tokens"):
        live.choose_budget(formats, bpt, 1_400, config)
    with pytest.raises(SystemExit, match="--live-margin"):
        live.choose_budget(formats, bpt, 2_000, live.LiveConfig(margin=2.0))


def test_bad_flags_name_the_flag():
    from scripts.demo.__main__ import parse_args

    with pytest.raises(SystemExit, match="--live-margin"):
        live.config_from_args(parse_args(["--live-margin", "0.9"]))
    with pytest.raises(SystemExit, match="--live-formats"):
        live.select_formats([("bf16", "auto"), ("int8", "int8")], "bogus")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from scripts.demo.__main__ import main

    out = tmp_path_factory.mktemp("demo-live")
    # Part 2 at a tiny size too, so the whole `make demo` path runs once.
    part2 = ["--seeds", "1", "--sweep", "", "--groups", "4", "--no-commit"]
    argv = ["--live-quick", "--live-formats", "bf16,int8", *part2]
    argv += ["--out", str(out), "--live-log-dir", str(out / "logs")]
    rc = main(argv)
    data = json.loads((out / "demo.json").read_text())
    return argparse.Namespace(rc=rc, out=out, data=data["live"], full=data)


def _arm(data, label):
    return next(a for a in data["arms"] if a["label"] == label)


def _reuse(arm, source):
    return sum(r["cached"][source] for run in arm["seeds"] for r in run["reuse"])


def test_live_demo_int8_serves_from_host_where_bf16_overflows(demo_run):
    data = demo_run.data
    assert demo_run.rc == 0
    bf16, int8 = _arm(data, "bf16"), _arm(data, "int8")
    working_set = data["budget"]["working_set"]
    # The host tiers as the servers report them: one byte budget, BF16 below
    # the working set, INT8 above it.
    for arm in (bf16, int8):
        host = arm["host_start"]
        assert host["bytes_per_token"] == arm["sizing"]["bytes_per_token"]
        # SGLang adds one padding page (one token at page size 1).
        assert host["total_tokens"] == arm["sizing"]["host_tokens"] + 1
        assert (
            abs(host["total_bytes"] - data["budget"]["bytes"])
            <= 2 * host["bytes_per_token"]
        )
    assert bf16["host_start"]["total_tokens"] < working_set
    assert int8["host_start"]["total_tokens"] > working_set
    assert int8["host_start"]["bytes_per_token"] < bf16["host_start"]["bytes_per_token"]

    # Reuse, least recently used group first: bf16 recomputes, int8 loads back.
    n_reused = sum(len(run["reuse"]) for run in int8["seeds"])
    assert n_reused == data["config"]["groups"] * len(data["config"]["seeds"])
    assert _reuse(bf16, "host") == 0
    assert _reuse(int8, "host") > 0
    for run in int8["seeds"]:
        for r in run["reuse"]:
            assert r["cached"]["host"] > 0, "every reused int8 prompt is a host hit"
            assert r["cached"]["device"] + r["cached"]["host"] >= r["prompt_tokens"] - 1
        assert run["reuse_counts"]["load_back_tokens"] >= sum(
            r["cached"]["host"] for r in run["reuse"]
        )


def test_live_demo_counts_agree_with_metrics_and_are_paired(demo_run):
    data = demo_run.data
    bf16, int8 = _arm(data, "bf16"), _arm(data, "int8")
    for arm in (bf16, int8):
        assert arm["kernel_calls"] == []  # no sgl_kernel stand-in op ran
        for run in arm["seeds"]:
            for phase, reuse in (("bench", None), ("reuse", run["reuse"])):
                counts = run[f"{phase}_counts"]
                for source in live.SOURCES:
                    if reuse is None:
                        resp = run["bench"]["cached"][source]
                    else:  # the reuse requests and their scoring requests
                        resp = sum(
                            r["cached"][source] + r["score_cached"][source]
                            for r in reuse
                        )
                    assert counts[f"cached_{source}"] == resp, (arm["label"], phase)
            # bench_serving sent the prompts the demo reuses (server-reported
            # prompt lengths, in send order, equal the demo's tokenization).
            assert run["bench"]["input_lens"] == run["sent_prompt_tokens"]
    for a, b in zip(bf16["seeds"], int8["seeds"]):
        assert a["seed"] == b["seed"]
        assert a["bench"]["input_lens"] == b["bench"]["input_lens"]
        assert [r["prompt_tokens"] for r in a["reuse"]] == [
            r["prompt_tokens"] for r in b["reuse"]
        ]


def test_live_demo_quality_is_scored_after_a_host_load_back(demo_run):
    data = demo_run.data
    bf16, int8 = _arm(data, "bf16"), _arm(data, "int8")
    q = data["quality"]["int8"]
    n = sum(len(run["reuse"]) for run in int8["seeds"])
    gen = data["config"]["gen_tokens"]
    assert q["prompts"] == n and q["positions"] == n * gen
    assert q["prompts_loaded_back_from_host"] == n
    # Scored on bf16's greedy tokens: bf16 scoring its own tokens has them as
    # its argmax (greedy), and int8 is close but measured, not assumed.
    own = [
        t == y
        for run in bf16["seeds"]
        for r in run["reuse"]
        for t, y in zip(r["score_top1"], r["score_ids"])
    ]
    assert sum(own) / len(own) >= 0.9
    assert 0.5 <= q["top1_agreement"] <= 1.0
    assert 0.0 < q["mean_abs_logprob_diff"] < 0.5
    for run, ref in zip(int8["seeds"], bf16["seeds"]):
        for r, b in zip(run["reuse"], ref["reuse"]):
            assert r["score_ids"] == b["output_ids"]
            assert len(r["score_logprobs"]) == gen
    assert (demo_run.out / "demo-live.png").stat().st_size > 0


def test_live_demo_replay_model_agrees_with_the_live_counts(demo_run):
    """Part 2's engine on part 1's requests predicts the live device/host hits."""
    rows = {r["label"]: r for r in demo_run.data["agreement"]}
    assert set(rows) == {"bf16", "int8"}
    for r in rows.values():
        assert r["live_prompt"] == r["replay_prompt"]
        assert r["live_device"] == r["replay_l1"]
        assert r["live_host"] == r["replay_l2"]
    assert rows["int8"]["live_host"][0] > rows["bf16"]["live_host"][0]
    assert "experiment_b" in demo_run.full and demo_run.full["seconds"]["live"] > 0
