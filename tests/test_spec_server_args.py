"""--hicache-host-dtype with --speculative-algorithm at start-up: SGLang's own
argument resolution over tiny local configs (no weights). Accepted where the
draft's host copy is tested (tests/test_spec_host_pools.py): packed MTP
layers of MHA and MLA (DeepSeek V3) targets under NEXTN/EAGLE, separate
drafts under EAGLE/EAGLE3/STANDALONE; refused, naming the flags and what to
pass, for a sliding-window target's packed MTP layers and for algorithms whose draft
KV the encoded pools never ran with."""

from __future__ import annotations

import pytest
from tests.support.server_args import (
    GPT_OSS,
    QWEN3_NEXT,
    resolve,
)
from tests.support.server_args import DEEPSEEK_V3
from tests.support.server_args import LLAMA as _LLAMA
from tests.support.server_args import model_dir as _model_dir

from sglang.srt.mem_cache.pool_host.host_format import host_dtype_choices

pytestmark = pytest.mark.usefixtures("mamba_extra_buffer_on_cpu", "restore_environ")

ENCODED = tuple(name for name in host_dtype_choices() if name != "auto")
SPEC = dict(
    speculative_num_steps=1,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=2,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    return {
        "mha_mtp": _model_dir(
            root, "mha_mtp", dict(_LLAMA, num_nextn_predict_layers=1)
        ),
        "mha": _model_dir(root, "mha", _LLAMA),
        "draft": _model_dir(root, "draft", dict(_LLAMA, num_hidden_layers=1)),
        "mla_mtp": _model_dir(
            root, "mla_mtp", dict(DEEPSEEK_V3, num_nextn_predict_layers=1)
        ),
        "mla": _model_dir(root, "mla", dict(DEEPSEEK_V3, num_nextn_predict_layers=0)),
        "qwen3_next_mtp": _model_dir(
            root, "qwen3_next_mtp", dict(QWEN3_NEXT, num_nextn_predict_layers=1)
        ),
        "gpt_oss_mtp": _model_dir(
            root, "gpt_oss_mtp", dict(GPT_OSS, num_nextn_predict_layers=1)
        ),
    }


@pytest.mark.parametrize("host_dtype", ENCODED)
@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE"])
def test_accepts_packed_mtp_draft_on_mha(models, algorithm, host_dtype):
    args = resolve(
        models["mha_mtp"],
        hicache_host_dtype=host_dtype,
        speculative_algorithm=algorithm,
        **SPEC,
    )
    assert args.hicache_host_dtype == host_dtype


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("host_dtype", ["int8", "k8v4"])
def test_accepts_separate_draft_on_mha(models, algorithm, host_dtype):
    resolve(
        models["mha"],
        hicache_host_dtype=host_dtype,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=models["draft"],
        **SPEC,
    )


@pytest.mark.parametrize(
    "algorithm,model,draft",
    [("NEXTN", "mla_mtp", None), ("EAGLE3", "mla", "draft")],
)
def test_accepts_mla_int8_with_drafts(models, algorithm, model, draft):
    resolve(
        models[model],
        hicache_host_dtype="int8",
        speculative_algorithm=algorithm,
        speculative_draft_model_path=models[draft] if draft else None,
        **SPEC,
    )


@pytest.mark.parametrize("host_dtype", ["int8", "k8v4"])
def test_accepts_packed_mtp_draft_on_linear_attention_hybrid(models, host_dtype):
    resolve(
        models["qwen3_next_mtp"],
        hicache_host_dtype=host_dtype,
        hicache_mem_layout="page_first",
        speculative_algorithm="NEXTN",
        **SPEC,
    )


@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE"])
def test_refuses_packed_mtp_draft_on_sliding_window_hybrid(models, algorithm):
    with pytest.raises(ValueError) as error:
        resolve(
            models["gpt_oss_mtp"],
            hicache_host_dtype="int8",
            speculative_algorithm=algorithm,
            **SPEC,
        )
    message = str(error.value)
    assert (
        f"--hicache-host-dtype int8 does not support --speculative-algorithm "
        f"{algorithm} with the MTP layers" in message
    )
    assert "GptOssForCausalLM" in message and "num_nextn_predict_layers=1" in message
    assert "Use --hicache-host-dtype auto" in message
    assert "--speculative-draft-model-path" in message
    # The stock pool packs it as upstream does.
    resolve(models["gpt_oss_mtp"], speculative_algorithm=algorithm, **SPEC)


def test_auto_keeps_upstream_behaviour_with_packed_mtp_drafts(models):
    resolve(models["mha_mtp"], speculative_algorithm="NEXTN", **SPEC)
    resolve(models["mla_mtp"], speculative_algorithm="NEXTN", **SPEC)


@pytest.mark.parametrize("algorithm", ["DFLASH", "FROZEN_KV_MTP"])
def test_refuses_untested_algorithms(models, algorithm):
    with pytest.raises(ValueError) as error:
        resolve(
            models["mha"],
            hicache_host_dtype="int8",
            speculative_algorithm=algorithm,
            speculative_draft_model_path=models["draft"],
            **SPEC,
        )
    message = str(error.value)
    assert (
        f"--hicache-host-dtype int8 is not tested with --speculative-algorithm "
        f"{algorithm}" in message
    )
    assert "Use --speculative-algorithm EAGLE, EAGLE3, NEXTN" in message
    assert "--hicache-host-dtype auto" in message
