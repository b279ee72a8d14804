"""Start-up self-check of the INT8 host pool (encoded_fused.self_check) and its
transfer-path reporting, run on CPU pools with the fused kernels under the Triton
interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import logging

import pytest
import torch
from scripts.rigs.hicache_harness import Geometry, fill_random
from tests.support.int8_pool_checks import INTERPRETED_KERNELS, int8_pools
from sglang.srt.mem_cache.pool_host import encoded_fused
from sglang.srt.mem_cache.pool_host.encoded import choose_transfer
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.kernels.ops.kvcache import kv_int8_triton as kt

pytestmark = INTERPRETED_KERNELS
LOGGER = "sglang.srt.mem_cache.pool_host"
FUSED_LOGGER = "sglang.srt.mem_cache.pool_host.encoded_fused"


def build(geo: Geometry, layout: str, access: str | None):
    """A CPU INT8 pool with some real content: 3 backed-up pages."""
    p = geo.page_size
    device_pool, pool = int8_pools(geo, 16 * p, 16 * p, layout, access)
    dev = torch.arange(p, 4 * p)
    fill_random(device_pool, dev, seed=3)
    device_pool.k_buffer[0][dev[1], 0, 0] = float("nan")  # a non-finite row
    host = pool.alloc(3 * p)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    return device_pool, pool


def snapshot(device_pool, pool):
    return {
        "host": [b.clone() for b in pool.kv_buffer],
        "device": [b.clone() for b in device_pool.k_buffer + device_pool.v_buffer],
        "free_slots": pool.free_slots.clone(),
        "available": pool.available_size(),
        "nonfinite": pool.nonfinite_group_count(),
        "amax": pool.scale_amax_by_layer(),
        "invalid": pool.invalid_host_index_count(),
    }


def assert_unchanged(before, after):
    for key in ("host", "device"):
        for a, b in zip(before[key], after[key]):
            bits = torch.int16 if a.element_size() == 2 else a.dtype
            assert torch.equal(a.view(bits), b.view(bits)), key
    assert torch.equal(before["free_slots"], after["free_slots"])
    assert torch.equal(before["amax"], after["amax"])
    for key in ("available", "nonfinite", "invalid"):
        assert before[key] == after[key], key


CASES = [
    ("page_first", 4, torch.bfloat16, "direct"),
    ("layer_first", 1, torch.float16, "direct"),
    ("page_first_direct", 2, torch.float16, "staged"),
]


@pytest.mark.parametrize("layout,page_size,dtype,access", CASES)
def test_self_check_passes_and_leaves_the_pool_as_it_was(
    layout, page_size, dtype, access
):
    geo = Geometry(layer_num=2, page_size=page_size, dtype=dtype)
    device_pool, pool = build(geo, layout, access)
    assert pool.transfer_path == f"fused_{access}"
    before = snapshot(device_pool, pool)
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    assert_unchanged(before, snapshot(device_pool, pool))


def test_torch_path_needs_no_self_check(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the torch path must not launch kernels")

    monkeypatch.setattr(kt, "encode_gather", fail)
    device_pool, pool = build(Geometry(), "page_first", None)
    assert pool.transfer_path == "torch"


def flip_one_byte(t: torch.Tensor, index) -> None:
    raw = t.view(torch.int8) if t.element_size() == 1 else t.view(torch.int16)
    raw[index] ^= 1


def inject_exception(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected launch failure")

    monkeypatch.setattr(kt, "encode_gather", broken)
    return "RuntimeError: injected launch failure"


def run_then(monkeypatch, kernel: str, corrupt) -> None:
    """Replace the kernel by itself followed by corrupt(*its arguments)."""
    real = getattr(kt, kernel)

    def corrupting(*args, **kw):
        real(*args, **kw)
        corrupt(*args, **kw)

    monkeypatch.setattr(kt, kernel, corrupting)


def inject_wrong_record_byte(monkeypatch):
    def corrupt(k_tab, v_tab, dev_idx, k_out, v_out, s_out, host_idx, **kw):
        ut = kw["unit_tokens"]
        first = int(host_idx[0])  # the last layer's V, first token written
        flip_one_byte(v_out, (first // ut, -1, first % ut, 0, 3))

    run_then(monkeypatch, "encode_gather", corrupt)
    return "backup of V layer"


def inject_wrong_restored_byte(monkeypatch):
    def corrupt(k_in, v_in, s_in, host_idx, k_dst, v_dst, dev_idx, **kw):
        flip_one_byte(k_dst, (int(dev_idx[-1]), 0, 5))

    run_then(monkeypatch, "decode_scatter", corrupt)
    return "restore of K layer 0"


@pytest.mark.parametrize(
    "inject",
    [inject_exception, inject_wrong_record_byte, inject_wrong_restored_byte],
)
@pytest.mark.parametrize("access", ["direct", "staged"])
def test_self_check_fault_falls_back_to_torch(monkeypatch, caplog, inject, access):
    geo = Geometry(layer_num=2, page_size=2, dtype=torch.float16)
    device_pool, pool = build(geo, "page_first", access)
    before = snapshot(device_pool, pool)
    cause = inject(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = encoded_fused.self_check(pool.transfer_context, pool.transfer)
    assert found is not None and cause in found
    warnings = [
        r
        for r in caplog.records
        if r.name == FUSED_LOGGER and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1 and cause in warnings[0].getMessage()
    assert f"fused_{access}" in warnings[0].getMessage()
    assert_unchanged(before, snapshot(device_pool, pool))

    # The choice the constructor makes on CUDA: the torch path, saying why.
    transfer, why = choose_transfer(pool.transfer_context, False, access, check=True)
    assert transfer.path == "torch" and why.startswith("self-check failed: ")
    assert cause in why

    # A pool on the torch path keeps working, with the reference's bytes.
    monkeypatch.undo()
    device_pool, pool = build(geo, "page_first", None)
    dev = torch.arange(8 * geo.page_size, 10 * geo.page_size)
    fill_random(device_pool, dev, seed=9)
    rows = device_pool.k_buffer[1][dev].clone()
    host = pool.alloc(len(dev))
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    device_pool.k_buffer[1][dev] = 0
    pool.load_to_device_per_layer(device_pool, host, dev, 1, "direct")
    q, s = codec.quantize_reference(rows)
    want = codec.dequantize_reference(q, s, rows.dtype)
    assert torch.equal(
        device_pool.k_buffer[1][dev].view(torch.int16), want.view(torch.int16)
    )


def test_transfer_path_and_reason(monkeypatch, caplog):
    geo = Geometry()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _, pool = build(geo, "page_first", None)
    assert (pool.transfer_path, pool.transfer_path_reason) == (
        "torch",
        "not CUDA (cpu)",
    )
    assert not pool.planner.use_runs
    lines = [
        r.getMessage() for r in caplog.records if "transfer path" in r.getMessage()
    ]
    assert lines == ["HiCache kv INT8 host pool transfer path: torch (not CUDA (cpu))."]

    monkeypatch.setenv("SGLANG_HICACHE_FUSED_TRANSFER", "off")
    _, pool = build(geo, "page_first", None)
    assert pool.transfer_path_reason == "SGLANG_HICACHE_FUSED_TRANSFER=off"
    # Asked for, the kernels run here (under the interpreter).
    monkeypatch.setenv("SGLANG_HICACHE_FUSED_TRANSFER", "staged")
    assert build(geo, "page_first", None)[1].transfer_path == "fused_staged"
    monkeypatch.setenv("SGLANG_HICACHE_FUSED_TRANSFER", "bogus")
    with pytest.raises(ValueError, match="SGLANG_HICACHE_FUSED_TRANSFER"):
        build(geo, "page_first", None)
    monkeypatch.setenv("SGLANG_HICACHE_FUSED_TRANSFER", "off")

    # The constructor argument overrides the variable, once.
    _, pool = build(geo, "page_first", "staged")
    assert (pool.transfer_path, pool.transfer_path_reason) == (
        "fused_staged",
        "fused_transfer=staged",
    )
    with pytest.raises(ValueError, match="fused_transfer='bogus'.*auto, off"):
        build(geo, "page_first", "bogus")


def test_the_pool_has_no_transfer_path_setters():
    """The path is chosen once, at construction."""
    _, pool = build(Geometry(), "page_first", "direct")
    with pytest.raises(AttributeError):
        pool.use_fused_kernels = False
    assert not hasattr(pool, "fused_host_access")
    assert not hasattr(pool, "use_run_copies")
    assert pool.transfer_path == "fused_direct"


def test_unpinned_direct_request_is_settled_at_construction(monkeypatch):
    """Asked for direct access to unpinned host memory on CUDA, the choice tries the
    direct path's self-check, then staged: decided once, before any transfer, never by a
    failing launch."""
    import dataclasses

    _, pool = build(Geometry(), "page_first", None)
    monkeypatch.setattr(kt, "available", lambda device: True)
    checked = []

    def self_check(ctx, transfer):
        checked.append(transfer.path)
        return "ValueError: no UVA" if transfer.access == "direct" else None

    monkeypatch.setattr(encoded_fused, "self_check", self_check)
    on_cuda = dataclasses.replace(pool.transfer_context, device=torch.device("cuda"))
    transfer, why = choose_transfer(on_cuda, False, "direct")
    assert checked == ["fused_direct", "fused_staged"]
    assert (transfer.path, why) == (
        "fused_staged",
        "host memory not device-addressable (not pinned)",
    )
    # Pinned, the direct path is the only candidate: failing, torch serves.
    checked.clear()
    transfer, why = choose_transfer(on_cuda, True, "direct")
    assert checked == ["fused_direct"]
    assert (transfer.path, why) == ("torch", "self-check failed: ValueError: no UVA")
