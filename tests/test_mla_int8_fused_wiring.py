"""The MLA INT8 pool's fused transfer choice and start-up self-check
(encoded_fused), with a torch stand-in for the kernels' contract."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from scripts.rigs.hicache_harness import MLAGeometry, fill_random, paged_pools
from sglang.srt.mem_cache.pool_host import encoded_fused
from sglang.srt.mem_cache.pool_host.encoded import choose_transfer
from sglang.srt.mem_cache.pool_host import kv_mla_int8_codec as mla_codec
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

MLATokenToKVPoolINT8Host = host_pool_cls("int8", "mla")


def _format_of(out, dtype, dim):
    ut = out["kv"].shape[-3]
    return MLAInt8HostFormat((dim,), 1, ut, dtype, rope_dim=out["rope"].shape[-1]), ut


def _units(host_indices, ut, n_units, bad_index_counter):
    units = host_indices.view(-1, ut)[:, 0].long() // ut
    ok = (units >= 0) & (units < n_units)
    if bad_index_counter is not None:
        bad_index_counter += (~ok).sum() * ut
    return units, ok


def encode_gather(
    tables,
    device_indices,
    out,
    host_indices,
    *,
    counters=None,
    first_layer=0,
):
    nonfinite, amax, bad = (
        (None, None, None)
        if counters is None
        else (counters.nonfinite, counters.amax, counters.bad_indices)
    )
    (table,) = tables
    dim = table.shape[-1]
    fmt, ut = _format_of(out, table.dtype, dim)
    units, ok = _units(host_indices, ut, out["kv"].shape[0], bad)
    for layer in range(out["kv"].shape[1]):
        device_layer = table.layers[first_layer + layer]
        rows = device_layer[device_indices.long()].view(-1, ut, 1, dim)[ok]
        encoded = fmt.encode_reference([rows])
        for name, value in encoded.items():
            out[name][units[ok], layer] = value
        stats = fmt.encode_into(
            [rows], {n: torch.empty_like(v) for n, v in encoded.items()}
        )
        if nonfinite is not None:
            nonfinite += stats.nonfinite
        if amax is not None:
            slot = amax[first_layer + layer]
            torch.maximum(slot, stats.amax, out=slot)


def decode_scatter(
    records, host_indices, dst, device_indices, *, bad_index_counter=None
):
    (out,) = dst
    fmt, ut = _format_of(records, out.dtype, out.shape[-1])
    units, ok = _units(host_indices, ut, records["kv"].shape[0], bad_index_counter)
    (rows,) = fmt.decode_reference(
        {name: value[units[ok]] for name, value in records.items()}, out.dtype
    )
    dev = device_indices.long().view(-1, ut)[ok].flatten()
    out[dev] = rows.reshape(-1, 1, out.shape[-1])


@pytest.fixture
def kernels(monkeypatch):
    module = types.ModuleType(mla_codec.MLAInt8HostFormat.kernel_module)
    module.available = lambda device: True
    module.encode_gather = encode_gather
    module.decode_scatter = decode_scatter
    monkeypatch.setitem(sys.modules, mla_codec.MLAInt8HostFormat.kernel_module, module)
    return module


def build(layout, page_size, dtype=torch.bfloat16, fused=None):
    geo = MLAGeometry(layer_num=3, dtype=dtype, page_size=page_size)
    # fused None: the CPU default, the torch path.
    return paged_pools(
        geo, layout, 16, 8, host_pool_cls=MLATokenToKVPoolINT8Host,
        fused_transfer=fused,
    )  # fmt: skip


def test_without_the_kernel_module_the_torch_path_serves(monkeypatch):
    monkeypatch.setitem(
        sys.modules, mla_codec.MLAInt8HostFormat.kernel_module, None
    )  # not importable
    _, pool = build("page_first", 4, fused="direct")
    fmt = pool.host_format
    assert not fmt.fused_available(torch.device("cpu"))
    assert pool.transfer_path == "torch"
    assert pool.transfer_path_reason == "no fused int8 kernels for this device"


@pytest.mark.parametrize("access", ["direct", "staged"])
def test_self_check_passes_and_puts_everything_back(kernels, access):
    device_pool, pool = build("page_first", 4, fused=access)
    fill_random(device_pool, torch.arange(64), seed=5)
    before = [t.clone() for t in pool.kv_buffer] + [
        t.clone() for t in device_pool.kv_buffer
    ]
    assert pool.transfer_path == f"fused_{access}"
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    for a, b in zip(before, list(pool.kv_buffer) + list(device_pool.kv_buffer)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert pool.nonfinite_group_count() == 0


def test_self_check_catches_kernels_that_differ(kernels, monkeypatch):
    """A kernel that drops RoPE bits fails the start-up check: the pool falls back to
    the torch path and says why."""

    def lossy_decode(records, host_indices, dst, device_indices, **kw):
        decode_scatter(records, host_indices, dst, device_indices, **kw)
        dst[0][device_indices.long(), 0, -1] = 0

    monkeypatch.setattr(kernels, "decode_scatter", lossy_decode)
    _, pool = build("page_first", 4, fused="direct")
    transfer, why = choose_transfer(pool.transfer_context, False, "direct", check=True)
    assert transfer.path == "torch" and "self-check failed" in why
