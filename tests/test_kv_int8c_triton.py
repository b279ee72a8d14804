"""The int8c fused kernels (kv_int8c_triton) against the format's reference
(kv_int8c_codec) under the Triton interpreter: every record byte of a backup
of all layers, every restored element (NaN positions, not payloads), the
statistics, and bad host indices, for both key modes (per channel at units
of 64 tokens, per token in groups of 32 below), bf16 and fp16, head dims with
and without whole 32-channel groups."""

from __future__ import annotations

import pytest
import torch

from tests.support.codec_inputs import assert_same_bits

pytestmark = pytest.mark.usefixtures("triton_interpreter")

LAYERS = 2
# (unit tokens, heads, key dim, value dim): per-channel keys at 64 (and a
# 128-token unit), per-token groups at 16 and 1 (layer_first), a key dim that
# is not a multiple of 32 (one group per head), uneven K/V widths.
CASES = [
    (64, 2, 128, 128, torch.bfloat16),
    (64, 1, 256, 256, torch.float16),
    (128, 1, 64, 96, torch.bfloat16),
    (16, 2, 128, 64, torch.float16),
    (1, 3, 64, 64, torch.bfloat16),
    (4, 2, 80, 48, torch.bfloat16),
]


def _fmt(ut, heads, dk, dv, dtype):
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    return host_format_cls("int8c", "mha")((dk, dv), heads, ut, dtype)


def _device_layers(seed, size, heads, dim, dtype, specials: bool):
    """Keys with a per-channel gain over 2**10 (QK-normed heads), some rows
    NaN/Inf/zero, one channel zero everywhere."""
    g = torch.Generator().manual_seed(seed)
    gain = 2.0 ** torch.randint(-6, 5, (dim,), generator=g).float()
    layers = []
    for layer in range(LAYERS):
        x = torch.randn(size, heads, dim, generator=g) * gain
        x[:, :, 1] = 0.0
        if specials:
            x[2 + layer, 0, 3] = float("nan")
            x[5, heads - 1, dim - 1] = float("inf") if layer else -float("inf")
            x[7] = 0.0
        layers.append(x.to(dtype))
    return layers


def _host(fmt, units: int) -> dict[str, torch.Tensor]:
    return {
        r.name: torch.zeros(units, LAYERS, *r.shape, dtype=r.dtype) for r in fmt.records
    }


def _transfer(ut: int, units: int, size: int, seed: int):
    """Whole units in shuffled order to gapped host units; device rows
    anywhere (a permutation of the pool's rows)."""
    g = torch.Generator().manual_seed(seed)
    host_units = torch.randperm(units, generator=g)[: units // 2]
    host = (host_units[:, None] * ut + torch.arange(ut)).flatten()
    dev = torch.randperm(size, generator=g)[: len(host)]
    return host_units, host, dev


@pytest.mark.parametrize("ut,heads,dk,dv,dtype", CASES)
def test_backup_and_restore_match_the_reference(ut, heads, dk, dv, dtype):
    from sglang.kernels.ops.kvcache import host_kv_common as hk

    fmt = _fmt(ut, heads, dk, dv, dtype)
    units = 6 if ut >= 16 else 24
    size = units * ut + 9
    k_layers = _device_layers(ut + dk, size, heads, dk, dtype, specials=True)
    v_layers = _device_layers(ut + dv + 1, size, heads, dv, dtype, specials=True)
    tables = (hk.DeviceLayerTable(k_layers), hk.DeviceLayerTable(v_layers))
    host_units, host, dev = _transfer(ut, units, size, seed=ut)
    out = _host(fmt, units)
    counters = hk.KVCounters(
        torch.zeros((), dtype=torch.int64),
        torch.zeros(LAYERS, 2),
        torch.zeros((), dtype=torch.int64),
    )
    fmt.encode_gather(tables, dev, out, host, counters=counters)

    nonfinite, amax = 0, torch.zeros(LAYERS, 2)
    for layer in range(LAYERS):
        rows = [
            t[layer][dev].view(-1, ut, heads, t[layer].shape[-1])
            for t in (k_layers, v_layers)
        ]
        want = fmt.encode_reference(rows)
        for name, t in want.items():
            assert_same_bits(out[name][host_units, layer], t)
        # What the pool's torch path reports for the same rows.
        scratch = {n: torch.empty_like(t) for n, t in want.items()}
        stats = fmt.encode_into(rows, scratch)
        nonfinite += int(stats.nonfinite)
        amax[layer] = stats.amax
    assert int(counters.nonfinite) == nonfinite > 0
    assert torch.equal(counters.amax, amax)
    assert int(counters.bad_indices) == 0

    for layer in range(LAYERS):
        dst = (torch.zeros_like(k_layers[0]), torch.zeros_like(v_layers[0]))
        records = {n: t[:, layer] for n, t in out.items()}
        fmt.decode_scatter(records, host, dst, dev)
        want = fmt.decode_reference(
            {n: t[host_units] for n, t in records.items()}, dtype
        )
        for got, exp in zip(dst, want):
            assert_same_bits(got[dev], exp.reshape(len(dev), *exp.shape[2:]))


@pytest.mark.parametrize("ut", [64, 1])
def test_out_of_range_host_indices_are_counted_and_skipped(ut):
    from sglang.kernels.ops.kvcache import host_kv_common as hk

    heads, dk, dv, dtype = 2, 64, 64, torch.bfloat16
    fmt = _fmt(ut, heads, dk, dv, dtype)
    units = 4 if ut > 1 else 16
    size = units * ut + 3
    k_layers = _device_layers(3, size, heads, dk, dtype, specials=False)
    v_layers = _device_layers(4, size, heads, dv, dtype, specials=False)
    tables = (hk.DeviceLayerTable(k_layers), hk.DeviceLayerTable(v_layers))
    host = torch.arange(units * ut, (units + 1) * ut)  # one unit past the end
    dev = torch.arange(ut)
    out = _host(fmt, units)
    bad = torch.zeros((), dtype=torch.int64)
    fmt.encode_gather(tables, dev, out, host, counters=hk.KVCounters(bad_indices=bad))
    assert int(bad) == ut
    assert all(not t.any() for t in out.values())

    dst = (torch.full_like(k_layers[0], 3.0), torch.full_like(v_layers[0], 3.0))
    restore_bad = torch.zeros((), dtype=torch.int64)
    records = {n: t[:, 0] for n, t in out.items()}
    fmt.decode_scatter(records, host, dst, dev, bad_index_counter=restore_bad)
    assert int(restore_bad) == ut
    assert all(bool((t == 3.0).all()) for t in dst)


def test_per_channel_keys_need_whole_units_in_order():
    """A run of 64 tokens that is not one host unit in order writes no keys
    (its tokens are counted), as the INT4 kernels do."""
    from sglang.kernels.ops.kvcache import host_kv_common as hk

    ut, heads, dk, dtype = 64, 1, 64, torch.bfloat16
    fmt = _fmt(ut, heads, dk, dk, dtype)
    k_layers = _device_layers(5, 2 * ut, heads, dk, dtype, specials=False)
    v_layers = _device_layers(6, 2 * ut, heads, dk, dtype, specials=False)
    tables = (hk.DeviceLayerTable(k_layers), hk.DeviceLayerTable(v_layers))
    host = torch.arange(ut).roll(1)  # unit 0, out of order
    out = _host(fmt, 2)
    bad = torch.zeros((), dtype=torch.int64)
    fmt.encode_gather(
        tables, torch.arange(ut), out, host, counters=hk.KVCounters(bad_indices=bad)
    )
    assert int(bad) == ut
    assert not out["k"].any() and not out["k_meta"].any()
    assert out["v"].any()  # values are per token: stored where they belong
