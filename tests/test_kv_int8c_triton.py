"""int8c fused kernels (kv_int8c_triton) against kv_int8c_codec under the
Triton interpreter: record bytes, restored bits, statistics and bad host
indices, for both key modes, bf16/fp16, whole and partial 32-channel groups."""

from __future__ import annotations

import pytest
import torch


pytestmark = pytest.mark.usefixtures("triton_interpreter")

LAYERS = 2


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
