"""INT4 and K8V4 host copies of an FP8 device KV cache (--kv-cache-dtype fp8_e4m3 /
fp8_e5m2) beyond the conformance round trips: rounding, saturation, non-finite values,
sealed L3 pages, the fused path and its self-check."""

from __future__ import annotations

import logging

import pytest
import torch
import triton
import triton.language as tl

from scripts.rigs import l3_harness as h
from tests.support.fp8_reference import (
    FP8,
    fp8_id,
    nearest_even_fp8,
)
from scripts.rigs.hicache_harness import (
    Geometry,
    assert_self_check_falls_back,
    finish_transfers,
    make_device_pool,
    make_host_pool,
    make_rig,
)
from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.srt.mem_cache.pool_host import encoded_fused
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.page_integrity import (
    SEAL_BYTES,
    StoragePageRefused,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str
from tests.support.int4_pool_checks import (
    allocated_bytes,
    fill_fp8,
    pages,
    random_fp8,
    write_fp8,
)

FORMATS = ("int4", "k8v4")
ENCODE = {"int4": codec.int4_encode_reference, "k8v4": codec.k8v4_encode_reference}
DECODE = {"int4": codec.int4_decode_reference, "k8v4": codec.k8v4_decode_reference}
# A byte that is NaN in both FP8 formats: what a wiped device row holds.
POISON = 0xFF


def unit_tokens(layout: str, page_size: int) -> int:
    return 1 if layout == "layer_first" else page_size


def as_units(rows: torch.Tensor, ut: int) -> torch.Tensor:
    return rows.view(rows.shape[0] // ut, ut, *rows.shape[1:])


def restored(device_pool, layer, indices, fp8):
    return (
        device_pool.k_buffer[layer][indices].view(fp8),
        device_pool.v_buffer[layer][indices].view(fp8),
    )


def expected_restore(fmt, k, v, ut):
    records = ENCODE[fmt](as_units(k, ut), as_units(v, ut))
    k_hat, v_hat = DECODE[fmt](records, k.dtype)
    return k_hat.flatten(0, 1), v_hat.flatten(0, 1), records


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def build(
    fmt, layout, page_size, fp8, head_dim=64, layer_num=2, host_pages=16, **pool_kwargs
):
    geo = Geometry(
        layer_num=layer_num,
        head_num=2,
        head_dim=head_dim,
        dtype=fp8,
        page_size=page_size,
    )
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pool = make_host_pool(
        device_pool,
        host_tokens=host_pages * page_size,
        layout=layout,
        host_dtype=fmt,
        device_kv_dtype=fp8,
        **pool_kwargs,
    )
    return geo, device_pool, pool


# --- the FP8 device pool is what SGLang builds ------------------------------


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
def test_device_pool_stores_fp8_as_uint8(fp8):
    """The premise of device_kv_dtype: the host pool sees uint8 storage only."""
    _, device_pool, pool = build("int4", "page_first", 16, fp8)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    assert device_pool.dtype == fp8 and info.dtype == torch.uint8
    assert pool.device_kv_dtype == fp8 and pool.host_format.device_dtype == fp8
    assert pool.dtype == torch.uint8


# --- backup -> load, every layout / page size / backend ---------------------


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_rounds_to_nearest_even_and_saturates(fmt, fp8):
    """The decode's last step is fp32 -> FP8 round to nearest even with saturation:
    checked against an independent rounding of the fp32 decode over FP8's value grid, on
    rows that reach the format's largest value."""
    _, device_pool, pool = build(fmt, "page_first", 16, fp8)
    dev = pages([0, 1], 16)
    written = fill_fp8(device_pool, dev, fp8, seed=5)
    pool.backup_from_device_all_layer(device_pool, dev, dev, "direct")
    for layer, (k, v) in enumerate(written):
        records = ENCODE[fmt](as_units(k, 16), as_units(v, 16))
        exact = DECODE[fmt](records, torch.float32)
        pool.load_to_device_per_layer(device_pool, dev, dev, layer, "direct")
        got = restored(device_pool, layer, dev, fp8)
        for x, g in zip(exact, got):
            want = nearest_even_fp8(x.flatten(0, 1).double(), fp8)
            assert torch.equal(g.double(), want)


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize(
    "fmt,layout,page_size", [("int4", "page_first", 16), ("int4", "layer_first", 1),
                             ("k8v4", "page_first_direct", 64)],
)  # fmt: skip
def test_nonfinite_fp8_restores_as_nan_and_is_counted(fmt, layout, page_size, fp8):
    geo, device_pool, pool = build(fmt, layout, page_size, fp8)
    dev, host = pages([1, 2], page_size), pages([3, 4], page_size)
    written = fill_fp8(device_pool, dev, fp8, seed=9)
    k_tok, v_tok = dev[1], dev[-1]
    bad = [float("nan")] + ([float("inf")] if fp8 == torch.float8_e5m2 else [])
    k, v = written[1][0].clone(), written[0][1].clone()
    k[1, 1, 5] = torch.tensor(bad[0]).to(fp8)
    v[-1, 0, 40] = torch.tensor(bad[-1]).to(fp8)
    device_pool.k_buffer[1][k_tok] = k[1].view(torch.uint8)
    device_pool.v_buffer[0][v_tok] = v[-1].view(torch.uint8)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    assert pool.nonfinite_group_count() == 2
    new_dev = pages([6, 7], page_size)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host, new_dev, layer, "direct")
    k1 = restored(device_pool, 1, new_dev, fp8)[0].float()
    v0 = restored(device_pool, 0, new_dev, fp8)[1].float()
    if fmt == "int4" and unit_tokens(layout, page_size) >= codec.K_CHANNEL_MIN_TOKENS:
        k_bad = (slice(0, page_size), 1, 5)
    elif fmt == "int4":
        k_bad = (1, 1, slice(0, 64))
    else:
        k_bad = (1, 1, slice(None))
    v_bad = (-1, 0, slice(0, 64))
    # Never finite: the whole group comes back NaN (not Inf, not a number).
    assert torch.isnan(k1[k_bad]).all() and torch.isnan(v0[v_bad]).all()
    k1[k_bad] = 0
    v0[v_bad] = 0
    assert torch.isfinite(k1).all() and torch.isfinite(v0).all()


# --- through the real HiCacheController -------------------------------------


# --- L3: sealed pages through the `file` backend ----------------------------


def _l3_rig(tmp_path, fmt, layout, fp8, name):
    geo = Geometry(layer_num=3, head_num=2, head_dim=64, dtype=fp8, page_size=16)
    h.publish_runtime(geo.page_size, layout, fmt)
    rig = make_rig(
        geo,
        device_tokens=256,
        host_tokens=256,
        layout=layout,
        host_dtype=fmt,
        device_kv_dtype=fp8,
    )
    rig.controller.attach_storage_backend(
        "file",
        prefetch_threshold=geo.page_size,
        model_name=f"hiq/{name}",
        storage_backend_extra_config=h.file_storage_config(tmp_path),
    )
    return h.L3Rig(rig, geo)


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize(
    "fmt,layout", [("int4", "page_first_direct"), ("k8v4", "page_first"),
                   ("int4", "layer_first")],
)  # fmt: skip
def test_file_l3_round_trip_of_sealed_pages(tmp_path, request, fmt, layout, fp8):
    l3 = _l3_rig(tmp_path, fmt, layout, fp8, request.node.name)
    try:
        ctl, rig = l3.controller, l3.rig
        tokens = list(range(500, 500 + 4 * 16))
        dev = rig.allocator.alloc(len(tokens))
        gen = torch.Generator().manual_seed(11)
        expected = []
        for layer in range(l3.geo.layer_num):
            k = random_fp8((len(tokens), 2, 64), fp8, gen)
            v = random_fp8((len(tokens), 2, 64), fp8, gen)
            write_fp8(rig.device_pool, layer, dev, k, v)
            expected.append(expected_restore(fmt, k, v, unit_tokens(layout, 16))[:2])
        host = ctl.write(dev, node_id=0)
        ctl.start_writing()
        finish_transfers(ctl)
        hashes = get_storage_hash_str(tokens, None, page_size=16)
        op_id = ctl.write_storage(host, tokens, hash_value=hashes)
        op = ctl.ack_backup_queue.get(timeout=h.STORAGE_WAIT_S)
        assert op.id == op_id and op.completed_tokens == len(tokens)
        files = list(tmp_path.glob("*.bin"))
        page_bytes = ctl.mem_pool_host.get_size_per_token() * 16
        assert {f.stat().st_size for f in files} == {page_bytes + SEAL_BYTES}
        assert len(files) == 4
        # Evict L1 and L2, poisoning the freed device rows.
        for layer in range(l3.geo.layer_num):
            rig.device_pool.k_buffer[layer][dev] = POISON
            rig.device_pool.v_buffer[layer][dev] = POISON
        rig.allocator.free(dev)
        ctl.mem_pool_host.free(host)
        pf = h.prefetch(l3, tokens + [7])
        assert pf.hit_tokens == pf.completed_tokens == len(tokens)
        dev = h.load_to_device(l3, pf.host_indices)
        for layer, (k, v) in enumerate(expected):
            k_got, v_got = restored(rig.device_pool, layer, dev, fp8)
            assert same_bytes(k_got, k) and same_bytes(v_got, v)
        assert ctl.mem_pool_host.storage_integrity_counts()["verified"] == 4
    finally:
        l3.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_pages_of_one_fp8_dtype_are_refused_by_the_other(fmt):
    """A sealed page names its device dtype: an E4M3 page read into an E5M2 pool (same
    records and sizes) would decode other values, so it is refused before any byte
    reaches the pool."""
    geo, device_pool, e4m3 = build(fmt, "page_first", 16, torch.float8_e4m3fn)
    _, _, e5m2 = build(fmt, "page_first", 16, torch.float8_e5m2)
    _, _, twin = build(fmt, "page_first", 16, torch.float8_e4m3fn)
    dev = pages([1], 16)
    fill_fp8(device_pool, dev, torch.float8_e4m3fn, seed=1)
    e4m3.backup_from_device_all_layer(device_pool, dev, dev, "direct")
    page = e4m3.get_data_page(16, key="k0")
    assert page.numel() == e5m2.get_dummy_flat_data_page().numel()
    before = {n: b.clone() for n, b in e5m2.host_records.items()}
    with pytest.raises(StoragePageRefused):
        e5m2.set_from_flat_data_page(32, page, key="k0")
    for name, buf in e5m2.host_records.items():
        assert same_bytes(buf, before[name])
    twin.set_from_flat_data_page(32, page, key="k0")  # the same dtype reads it
    for name, buf in twin.host_records.items():
        assert same_bytes(buf[2], e4m3.host_records[name][1])


# --- what is refused, and the start-up log -----------------------------------


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
def test_fp8_path_is_chosen_as_for_bf16_and_logged(caplog, fp8):
    """No FP8 exception: on the CPU the pool takes the torch path for the reason every
    pool does, the log says so, and the fused kernels can be switched on (the
    interpreter runs them here)."""
    with caplog.at_level(logging.INFO, logger="sglang"):
        _, device_pool, pool = build("int4", "page_first", 16, fp8)
    name = fp8_id(fp8)
    assert pool.transfer_path == "torch"
    assert pool.transfer_path_reason == "not CUDA (cpu)"
    assert "INT4 host pool transfer path: torch (not CUDA (cpu))" in caplog.text
    assert (
        f"stores INT4 KV: {pool.get_size_per_token()} B/token (torch.float8_{name}: "
        f"{pool.device_size_per_token()} B/token)" in caplog.text
    )
    _, _, pool = build("int4", "page_first", 16, fp8, fused_transfer="direct")
    assert pool.transfer_path == "fused_direct"


@triton.jit
def _truncating_fp8_bits(y, FP8: tl.constexpr):
    """fp32 -> FP8 rounding toward zero: the bug the self-check must catch."""
    u = y.to(tl.uint32, bitcast=True)
    mbits = 3 if FP8 == 1 else 2
    bias = 7 if FP8 == 1 else 15
    a = u & 0x7FFFFFFF
    mag = (a >> (23 - mbits)) - ((127 - bias) << mbits)
    return (mag | ((u >> 24) & 0x80)).to(tl.uint8)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_self_check_runs_on_fp8_and_catches_a_wrong_rounding(
    fmt, fp8, monkeypatch, caplog
):
    """The start-up self-check compares the fused FP8 path with the reference (FP8 rows:
    subnormals, NaN, the largest value) and puts the borrowed bytes back; kernels that
    truncate instead of rounding fail it and the pool falls back to the torch path,
    saying why."""
    _, device_pool, pool = build(fmt, "page_first", 16, fp8, fused_transfer="direct")
    assert pool.transfer_path == "fused_direct"
    before = [b.clone() for b in device_pool.k_buffer + device_pool.v_buffer]
    records = {n: b.clone() for n, b in pool.host_records.items()}
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    for a, b in zip(before, device_pool.k_buffer + device_pool.v_buffer):
        assert torch.equal(a, b)
    for name, buf in pool.host_records.items():
        assert same_bytes(buf, records[name]), name

    monkeypatch.setattr(hk, "fp32_to_fp8_bits", _truncating_fp8_bits)
    assert_self_check_falls_back(pool, caplog, "restore of")


# --- capacity against the stock FP8 host pool ---------------------------------


def capacity_vs_stock_fp8(geo_kwargs, page_size, budget_gb):
    """Host tokens per allocated host byte of each format over the stock FP8 pool's
    (auto), and each pool's bytes per token and layer."""
    geo = Geometry(dtype=torch.float8_e4m3fn, page_size=page_size, **geo_kwargs)
    device_pool = make_device_pool(geo, device_tokens=2 * page_size)
    per_byte, per_token = {}, {}
    for host_dtype in ("auto", "k8v4", "int4"):
        extra = {} if host_dtype == "auto" else {"device_kv_dtype": geo.dtype}
        pool = make_host_pool(
            device_pool,
            host_size_gb=budget_gb,
            layout="page_first",
            host_dtype=host_dtype,
            **extra,
        )
        if host_dtype == "auto":
            assert type(pool) is MHATokenToKVPoolHost
            assert pool.kv_buffer.dtype == torch.uint8  # 1 byte per FP8 value
        nbytes = allocated_bytes(pool)
        assert nbytes == pool.size * pool.get_size_per_token()
        per_byte[host_dtype] = pool.size / nbytes
        per_token[host_dtype] = nbytes / pool.size / geo.layer_num
    ratio = {f: per_byte[f] / per_byte["auto"] for f in ("k8v4", "int4")}
    return ratio, per_token


def test_capacity_vs_stock_fp8_at_test_geometry():
    """2 heads of 64 channels: smaller heads pay relatively more metadata."""
    # int4: 64 + 64 B of codes, per-token meta 8 + 8 B; page 16 keys per
    # channel: 2 x 64 x 4 B per page = 32 B per token.
    for page_size, int4 in ((1, 144), (16, 168), (64, 144)):
        ratio, per_token = capacity_vs_stock_fp8(
            dict(layer_num=2, head_num=2, head_dim=64), page_size, 0.001
        )
        assert per_token["auto"] == 256
        assert per_token["int4"] == int4
        assert ratio["int4"] == pytest.approx(256 / int4)
        # k8v4: 128 B int8 keys + 4 B scales, 64 B codes + 8 B meta.
        assert ratio["k8v4"] == pytest.approx(256 / 204)


@pytest.mark.parametrize("fp8", FP8, ids=fp8_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_saturates_beyond_the_fp8_range(fmt, fp8):
    """Records whose values lie past FP8's largest finite value (m + 15 s up to 61440,
    where E5M2's cast alone gives Inf) restore as the largest value, on the pool's path
    and in the reference."""
    _, device_pool, pool = build(fmt, "page_first", 16, fp8)
    dev = pages([0], 16)
    fill_fp8(device_pool, dev, fp8, seed=4)
    pool.backup_from_device_all_layer(device_pool, dev, dev, "direct")
    v, v_meta = pool.host_records["v"], pool.host_records["v_meta"]
    v[0, 0].fill_(0xFF)  # codes 15 everywhere
    v_meta[0, 0, ..., 0] = 4096.0  # s
    v_meta[0, 0, ..., 1] = 0.0  # m
    v_meta[0, 0, 3, 1, 0, 1] = -65504.0  # a group from below: m alone overflows
    device_pool.v_buffer[0].fill_(POISON)
    pool.load_to_device_per_layer(device_pool, dev, dev, 0, "direct")
    got = restored(device_pool, 0, dev, fp8)[1].float()
    top = torch.finfo(fp8).max
    want = torch.full_like(got, top)
    want[3, 1, 0:64] = -65504.0 + 15 * 4096.0  # -4064: in range for both
    want = want.to(fp8).float()
    assert torch.equal(got, want)
    records = {n: b[:1, 0] for n, b in pool.host_records.items()}
    ref_v = DECODE[fmt](records, fp8)[1].flatten(0, 1)
    assert same_bytes(ref_v, want.to(fp8))
