"""CI-sized FP8 L1 arm of the quality harness (scripts/quality/harness.py,
--kv-dtype fp8_e4m3 / fp8_e5m2) on the real SmolLM2-135M and WikiText-2:
exact is the FP8 KV never offloaded, the control the stock 1-byte FP8 host
pool (bit-identical), int4 and k8v4 the FP8 -> host -> FP8 round trip through
their own pools. A report, not a quality gate: the figures are in
docs/fp8-device-kv.md."""

from __future__ import annotations

import pytest
import torch

from scripts.common.cpu_sglang import install_cpu_standins
from scripts.quality import harness as hq
from tests.support.quality_inputs import SMALL, TEXT_FILE
from tests.support.quality_inputs import require_inputs as _require_inputs


@pytest.fixture(scope="module")
def bundle():
    _require_inputs()
    install_cpu_standins()
    return hq.load_model()


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_arms_restore_through_the_l2_pools(bundle, kv_dtype):
    cfg = hq.QualityConfig(
        text_file=str(TEXT_FILE),
        **{**SMALL, "windows": 1},
        kv_dtype=kv_dtype,
        arms=("exact", "bf16", "int4", "k8v4"),
    )
    report = hq.run_quality(cfg, bundle, log=lambda s: None)
    assert report["kv_geometry"]["kv_dtype"] == kv_dtype
    control = report["control"]
    assert control["kv_bit_identical"] and control["logits_bit_identical"]
    arms = report["arms"]
    # The fp32 reference scores beside the FP8 rows: FP8 rounding's own cost.
    assert arms[hq.FP32_ARM]["kl_mean"] > 0
    assert arms["bf16"]["kl_mean_fp32"] == arms["exact"]["kl_mean_fp32"] > 0
    assert arms["bf16"]["host_pool"] == "MHATokenToKVPoolHost"
    kv = report["kv_geometry"]
    # The stock pool keeps 1 byte per FP8 value.
    assert arms["bf16"]["host_bytes_per_token"] == (
        kv["layers"] * kv["kv_heads"] * (kv["head_dim"] + kv["v_head_dim"])
    )
    for name, cls in (("int4", "INT4"), ("k8v4", "K8V4")):
        s = arms[name]
        assert s["host_pool"] == f"MHATokenToKVPool{cls}Host"
        assert s["restored_tokens"] == s["written_tokens"] > 0
        # Lossy (the codec ran on FP8 values) but close, and smaller.
        assert 0 < s["kv_rel_err"] < 0.2 and s["kl_mean"] > 0
        assert s["host_bytes_per_token"] < arms["bf16"]["host_bytes_per_token"]
        assert torch.isfinite(torch.tensor(s["ppl"]))
