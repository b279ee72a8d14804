"""key_scales.py's capacity column (issue 35): its byte model of the 4-bit
candidates equals the registered formats' records at Qwen3-8B geometry, and
its layer plan rule picks the layers docs/quality-int8c.md states."""

from __future__ import annotations

import pytest
import torch

from scripts.quality import key_scales as ks

HEADS, DIM = 8, 128


def _fmt(name: str, unit_tokens: int):
    from sglang.srt.mem_cache.pool_host import host_format as hf

    cls = hf.host_format_cls(name)
    return cls((DIM, DIM), HEADS, unit_tokens, torch.bfloat16)


def _side_bytes(fmt, side: str) -> float:
    """A format's host bytes per token and layer of one side's records."""
    nbytes = sum(r.nbytes for r in fmt.records if r.name.split("_")[0] == side)
    return nbytes / fmt.unit_tokens


@pytest.mark.parametrize("arm,unit", (("int4", 64), ("int4_k32", 32)))
def test_uniform_arms_cost_what_int4_records_cost(arm, unit):
    layers = len(ks.QWEN3_8B[0])
    want = layers * _fmt("int4", unit).bytes_per_token()
    assert ks.bytes_per_token(arm, *ks.QWEN3_8B) == want


def test_an_8bit_key_layer_costs_int8c_keys_plus_int4_values():
    # k8_first3: three layers of int8c keys + int4 values, 33 layers of int4.
    int4, int8c = _fmt("int4", 64), _fmt("int8c", 64)
    k8_layer = _side_bytes(int8c, "k") + _side_bytes(int4, "v")
    want = 33 * int4.bytes_per_token() + 3 * k8_layer
    assert ks.bytes_per_token("k8_first3", *ks.QWEN3_8B) == want
    # The capacity target's arithmetic: 3 such layers fit 3.4x, 4 do not.
    assert 4 * DIM * HEADS * 36 / want >= 3.4
    assert 4 * DIM * HEADS * 36 / (want + k8_layer - int4.bytes_per_token()) < 3.4


def test_layer_plan_rule():
    qwen = [i for i in range(36) if ks.plan_keys8(i, ks.QWEN3_8B[0])]
    gemma = [i for i in range(18) if ks.plan_keys8(i, ks.GEMMA3_270M[0])]
    assert qwen == [0, 1, 2]
    assert gemma == [5, 11, 17]
