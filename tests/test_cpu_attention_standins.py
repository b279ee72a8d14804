"""The intel_amx attention stand-ins (scripts/rigs/standins.py) against
transformers' gpt-oss eager attention: causal, sinks, sliding window, paged KV;
slots outside the window hold NaN, as a SWA pool's freed slots may."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from scripts.rigs.standins import decode_attention_cpu, extend_attention_cpu

HEADS, KV_HEADS, DIM = 4, 2, 16
TOTAL, EXTEND = 40, 15
SLOTS = 64
SCALING = DIM**-0.5


def reference(q, k, v, sinks, window):
    """Rows [T, H, D] of gpt-oss attention over the whole sequence."""
    module = types.SimpleNamespace(
        sinks=sinks, num_key_value_groups=HEADS // KV_HEADS, training=False
    )
    pos = torch.arange(q.shape[0])
    seen = pos[None, :] <= pos[:, None]
    if window:
        seen &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
    out, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask[None, None],
        SCALING,
    )
    return out[0]


@pytest.fixture
def case():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(TOTAL, HEADS, DIM, generator=gen)
    k = torch.randn(TOTAL, KV_HEADS, DIM, generator=gen)
    v = torch.randn(TOTAL, KV_HEADS, DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen)
    slots = torch.randperm(SLOTS, generator=gen)[:TOTAL]
    req_to_token = torch.zeros(2, SLOTS, dtype=torch.int32)
    req_to_token[1, :TOTAL] = slots.to(torch.int32)
    return q, k, v, sinks, slots, req_to_token


def paged(k, v, slots, window, first_query):
    """The sequence at its slots, NaN where first_query's window does not reach."""
    k_buffer = torch.full((SLOTS, KV_HEADS, DIM), float("nan"))
    v_buffer = torch.full((SLOTS, KV_HEADS, DIM), float("nan"))
    lo = max(0, first_query - window + 1) if window else 0
    k_buffer[slots[lo:]] = k[lo:]
    v_buffer[slots[lo:]] = v[lo:]
    return k_buffer, v_buffer


@pytest.mark.parametrize("window", [0, 8], ids=["full", "sliding"])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_extend_matches_gpt_oss_attention(case, window, with_sinks):
    q, k, v, sinks, slots, req_to_token = case
    sinks = sinks if with_sinks else None
    prefix = TOTAL - EXTEND
    k_buffer, v_buffer = paged(k, v, slots, window, prefix)
    out = torch.empty(EXTEND, HEADS, DIM)
    extend_attention_cpu(
        q[prefix:], k[prefix:], v[prefix:], out, k_buffer, v_buffer, 1.0, 1.0,
        req_to_token, torch.tensor([1]), torch.tensor([TOTAL]),
        torch.tensor([EXTEND]), torch.tensor([0]), EXTEND, SCALING, 0.0, False,
        window, None, sinks, None, True,
    )  # fmt: skip
    ref_sinks = sinks if with_sinks else torch.full((HEADS,), float("-inf"))
    expected = reference(q, k, v, ref_sinks, window)[prefix:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 8], ids=["full", "sliding"])
def test_decode_writes_the_new_row_and_matches_gpt_oss_attention(case, window):
    q, k, v, sinks, slots, req_to_token = case
    last = TOTAL - 1
    k_buffer, v_buffer = paged(k, v, slots, window, last)
    k_buffer[slots[last]] = v_buffer[slots[last]] = float("nan")  # written below
    out = torch.empty(1, HEADS, DIM)
    decode_attention_cpu(
        q[last:], k_buffer, v_buffer, 1.0, 1.0, out, k[last:], v[last:],
        slots[last:], None, req_to_token, torch.tensor([1]),
        torch.tensor([TOTAL]), SCALING, 0.0, False, window, None, sinks,
    )  # fmt: skip
    torch.testing.assert_close(k_buffer[slots[last]], k[last])
    expected = reference(q, k, v, sinks, window)[last:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_extend_without_prefix_does_not_read_an_mla_latent_pool(case):
    """DeepSeek's MHA prefill passes per-head K/V, not the pool's latent row."""
    q, k, v, _, _, req_to_token = case
    latent = torch.full((SLOTS, 1, 3 * DIM), float("nan"))
    out = torch.empty(TOTAL, HEADS, DIM)
    extend_attention_cpu(
        q, k, v, out, latent, latent[..., : 2 * DIM], 1.0, 1.0,
        req_to_token, torch.tensor([1]), torch.tensor([TOTAL]),
        torch.tensor([TOTAL]), torch.tensor([0]), TOTAL, SCALING, 0.0, False,
        0, None, None, None, True,
    )  # fmt: skip
    expected = reference(q, k, v, torch.full((HEADS,), float("-inf")), 0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
