"""HiCache host-tier metrics scraped from SGLang's own collectors, fed by real
host pools, HiCacheController transfers, ack loggers and the scheduler's
reporter (only the scheduler around it is a stand-in), parsed with prometheus_client."""

from __future__ import annotations

import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    finish_transfers,
    make_device_pool,
    make_host_pool,
    make_rig,
)
from scripts.rigs import l3_harness as h
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.sink_page import SINK_ENV
from sglang.srt.mem_cache.pool_host.sink_page import L3_KEY_SUFFIX
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES, host_format_cls
from sglang.srt.mem_cache.pool_host.page_integrity import Refusal, StoragePageRefused
from tests.support.metrics import TIER_GEO as GEO
from tests.support.metrics import Scrape, TierRig, make_reporter, scrape


def layer_bytes(dims_itemsize: int, scale_bytes: int = 0) -> int:
    return (
        GEO.layer_num * GEO.head_num * (2 * GEO.head_dim * dims_itemsize + scale_bytes)
    )


EXPECTED = {
    # host_dtype: (host_dtype label, transfer paths, host B/token, device B/token)
    "auto": ("bfloat16", {"copy"}, layer_bytes(2), layer_bytes(2)),
    # INT8 payload plus one FP16 scale per K and V head row
    "int8": ("int8", {"torch"}, layer_bytes(1, 2 * 2), layer_bytes(2)),
}


@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
def test_host_tier_metrics_after_real_transfers(collectors, host_dtype):
    host_label, paths, host_bpt, device_bpt = EXPECTED[host_dtype]
    tier = TierRig(host_dtype, collectors)
    first = tier.backup(24)
    tier.backup(16)
    tier.load(first)
    scrape = tier.collect()

    # The format: exactly one info series, naming what the pool really is.
    (info,) = scrape.all("sglang:hicache_host_info")
    assert info.value == 1
    assert info.labels["host_dtype"] == host_label
    assert info.labels["device_dtype"] == "bfloat16"
    assert info.labels["layout"] == "layer_first"
    assert info.labels["io_backend"] == "direct"
    assert info.labels["transfer_path"] in paths
    assert info.labels["transfer_path"] == tier.pool.transfer_path
    # Without MLA host dedup every rank holds its own copy.
    assert (info.labels["host_copy"], info.labels["host_copy_ranks"]) == ("rank", "1")

    # Bytes as stored: per token and in use.
    assert tier.pool.size_per_token == host_bpt
    assert scrape.value("sglang:hicache_host_bytes_per_token") == host_bpt
    used_tokens = tier.pool.size - tier.pool.available_size()
    assert used_tokens == 40
    assert scrape.value("sglang:hicache_host_used_bytes") == used_tokens * host_bpt
    assert scrape.value("sglang:hicache_host_used_tokens") == used_tokens

    # Traffic: 40 tokens backed up, 24 loaded back; encoded and logical bytes.
    assert scrape.value("sglang:hicache_backup_bytes_total") == 40 * host_bpt
    assert scrape.value("sglang:load_back_bytes_total") == 24 * host_bpt
    assert scrape.value("sglang:hicache_backup_logical_bytes_total") == 40 * device_bpt
    assert scrape.value("sglang:load_back_logical_bytes_total") == 24 * device_bpt

    encodes = host_dtype == "int8"
    assert bool(scrape.all("sglang:hicache_host_nonfinite_groups_total")) == encodes


def test_host_used_bytes_count_physical_rows_under_dcp(collectors):
    """--dcp-size 2: the stock MLA host pool counts dcp_size logical slots per
    physical row, so the used bytes are this rank's rows in use."""
    scheduler_collector, _ = collectors
    dcp = 2
    device_pool = make_device_pool(MLAGeometry(layer_num=2, page_size=4), 64)
    pool = make_host_pool(device_pool, host_tokens=32, dcp_size=dcp)
    assert (pool.dcp_size, pool.size, pool.logical_size) == (dcp, 32, 64)
    reporter = make_reporter(pool, None)
    host = pool.alloc(24)
    rows = len(torch.unique(host // dcp))
    assert rows == 12
    seen = scrape(reporter, scheduler_collector)
    assert seen.value("sglang:hicache_host_used_tokens") == 24
    assert seen.value("sglang:hicache_host_used_bytes") == rows * pool.size_per_token
    # Every slot in use: the bytes of the whole host buffer, not dcp_size times it.
    pool.alloc(pool.available_size())
    buffer_bytes = pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    seen = scrape(reporter, scheduler_collector)
    assert seen.value("sglang:hicache_host_used_bytes") == buffer_bytes


def test_int8_nonfinite_groups(collectors):
    tier = TierRig("int8", collectors, layout="page_first")
    tier.backup(20)
    scrape = tier.collect()
    assert scrape.value("sglang:hicache_host_nonfinite_groups_total") == 0

    # Five tokens whose first K head row (an INT8 scale group) holds a NaN, in
    # every layer.
    tier.backup(8, nan_rows=5)
    scrape = tier.collect()
    nonfinite = 5 * GEO.layer_num
    assert tier.pool.nonfinite_group_count() == nonfinite
    assert scrape.value("sglang:hicache_host_nonfinite_groups_total") == nonfinite
    # Read again with nothing new: the counter does not count twice.
    scrape = tier.collect()
    assert scrape.value("sglang:hicache_host_nonfinite_groups_total") == nonfinite

    # A rebuilt pool counts from 0 again; the exported counter only grows.
    rebuilt = TierRig("int8", collectors, layout="page_first")
    rebuilt.backup(4, nan_rows=2)
    scrape = rebuilt.collect()
    assert rebuilt.pool.nonfinite_group_count() == 2 * GEO.layer_num
    assert scrape.value("sglang:hicache_host_nonfinite_groups_total") == (
        nonfinite + 2 * GEO.layer_num
    )


# id -> (geometry, host dtype, FP8 device KV dtype or None, tokens, io backend)
OTHER_DEVICE_KV = {
    "mla-int8": (MLAGeometry(layer_num=3, page_size=4), "int8", None, 16, "kernel"),
    **{
        f"fp8-{host}": (
            Geometry(layer_num=3, head_num=2, head_dim=64, dtype=fp8, page_size=16),
            host,
            fp8,
            32,
            "direct",
        )
        for host, fp8 in (("int4", torch.float8_e4m3fn), ("k8v4", torch.float8_e5m2))
    },
}


@pytest.mark.parametrize("case", list(OTHER_DEVICE_KV))
def test_mla_and_fp8_device_kv_metrics(collectors, case):
    """MLA INT8 and FP8 device KV under a 4-bit host copy: the info series names
    the device dtype (not FP8's uint8 storage), bytes are encoded vs device."""
    scheduler_collector, radix = collectors
    geo, host_dtype, fp8, n, io_backend = OTHER_DEVICE_KV[case]
    extra = {"device_kv_dtype": fp8} if fp8 else {}
    rig = make_rig(
        geo, device_tokens=4 * n, host_tokens=8 * n, layout="page_first",
        io_backend=io_backend, host_dtype=host_dtype, **extra,
    )  # fmt: skip
    pool, ctl, device_pool = rig.host_pool, rig.controller, rig.device_pool
    gen = torch.Generator().manual_seed(0)
    dev = rig.allocator.alloc(n)
    for layer in range(geo.layer_num):
        if fp8 is None:
            rows = torch.randn((n, 1, geo.kv_lora_rank + 64), generator=gen)
            rows = rows * (layer + 1)
            rows[0, 0, 3] = float("nan")  # one latent tile per layer stored as NaN
            device_pool.kv_buffer[layer][dev] = rows.to(geo.dtype)
            continue
        for buf in (device_pool.k_buffer, device_pool.v_buffer):
            rows = torch.randn((n, 2, 64), generator=gen).to(fp8)
            buf[layer][dev] = rows.view(torch.uint8)
    ctl.write(dev)
    for ack in ctl.ack_write_queue:
        ack.finish_event.synchronize()
        radix._log_write_ack_metrics(ack)
    ctl.ack_write_queue.clear()
    seen = scrape(make_reporter(pool, ctl), scheduler_collector)

    (info,) = seen.all("sglang:hicache_host_info")
    assert info.labels["host_dtype"] == host_dtype
    device_dtype = str(fp8).removeprefix("torch.") if fp8 else "bfloat16"
    assert info.labels["device_dtype"] == device_dtype
    assert info.labels["transfer_path"] == pool.transfer_path == "torch"
    if fp8 is None:  # 512 int8 + 4 FP16 tile scales + 64 BF16 RoPE dims
        host_bpt, device_bpt = 648 * geo.layer_num, 1152 * geo.layer_num
        nonfinite = geo.layer_num
    else:  # 1 byte per FP8 value
        host_bpt, device_bpt, nonfinite = pool.get_size_per_token(), 3 * 2 * 2 * 64, 0
    assert pool.device_size_per_token() == device_bpt and host_bpt < device_bpt
    assert seen.value("sglang:hicache_host_bytes_per_token") == host_bpt
    assert seen.value("sglang:hicache_backup_bytes_total") == n * host_bpt
    assert seen.value("sglang:hicache_backup_logical_bytes_total") == n * device_bpt
    assert seen.value("sglang:hicache_host_nonfinite_groups_total") == nonfinite
    assert pool.nonfinite_group_count() == nonfinite


MHA_FORMATS = ("int8", "int4", "k8v4", "int4r", "k8v4r", "int8c", "int4c")
# (host dtype, model kind); MLA models take int8 only.
FORMATS = [(name, "mha") for name in MHA_FORMATS] + [("int8", "mla")]
# page_first with 16-token pages groups int4 keys per channel over the page;
# layer_first encodes one token per unit (int4 keys per token).
LAYOUTS = [("page_first", 16), ("layer_first", 1)]


def _poison(device_pool, dev: torch.Tensor) -> None:
    """Non-finite values where counting elements, tokens or pages instead of
    groups gives another number."""
    nan, inf = float("nan"), float("inf")
    if isinstance(device_pool, MLATokenToKVPool):
        rank = device_pool.kv_lora_rank
        kv = device_pool.kv_buffer
        kv[0][dev[1], 0, 3] = nan  # latent tile 0 ...
        kv[0][dev[1], 0, 100] = inf  # ... the same tile again
        kv[0][dev[1], 0, 200] = nan  # tile 1 of the same token
        kv[1][dev[2], 0, rank + 1] = nan  # a RoPE row ...
        kv[1][dev[2], 0, rank + 9] = -inf  # ... twice
        kv[1][dev[5], 0, rank + 63] = inf
        return
    k, v = device_pool.k_buffer, device_pool.v_buffer
    k[0][dev[1], 0, 3] = nan  # one key row ...
    k[0][dev[1], 0, 5] = inf  # ... twice (int4 keys per channel: two channels)
    k[0][dev[2], 0, 3] = nan  # the same key channel, another token
    k[1][dev[4], 1, 60] = -inf
    v[0][dev[1], 1, 0] = nan  # a value row: channels 0 and 1, one group
    v[0][dev[1], 1, 1] = nan
    v[1][dev[7], 0, 63] = inf


def _stored_nonfinite_groups(pool) -> int:
    """Groups the records hold as non-finite: a scale, a 4-bit group's (scale,
    zero point) or int4c's (min, range), a RoPE row holding NaN/Inf."""
    total = 0
    for name, record in pool.host_records.items():
        if name == "scale" or name.endswith("_scale"):
            total += int((~torch.isfinite(record.float())).sum())
        elif name.endswith("_meta") or name == "k_range":
            total += int((~torch.isfinite(record[..., 0].float())).sum())
        elif name == "rope":
            total += int((~torch.isfinite(record.float())).any(dim=-1).sum())
    return total


def _backed_up_pool(name, kind, layout, page_size, path):
    if kind == "mla":
        geo = MLAGeometry(
            layer_num=2, kv_lora_rank=256, qk_rope_head_dim=64, page_size=page_size
        )
    else:
        geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=page_size)
    device_pool = make_device_pool(geo, device_tokens=64)
    pool = make_host_pool(
        device_pool, host_tokens=64, layout=layout, host_dtype=name,
        fused_transfer="direct" if path == "fused" else "off",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    dev = torch.arange(page_size, page_size + 32)
    buffers = (
        device_pool.kv_buffer
        if kind == "mla"
        else [*device_pool.k_buffer, *device_pool.v_buffer]
    )
    for buf in buffers:
        buf[dev] = torch.randn(buf[dev].shape, generator=gen).to(buf.dtype)
    _poison(device_pool, dev)
    pool.backup_from_device_all_layer(device_pool, torch.arange(32, 64), dev, "direct")
    return pool


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("layout,page_size", LAYOUTS)
@pytest.mark.parametrize(
    "name,kind", FORMATS, ids=[f"{kind}-{name}" for name, kind in FORMATS]
)
def test_torch_and_fused_paths_count_the_same_groups(name, kind, layout, page_size):
    """Both paths count exactly the groups the pool stored as non-finite."""
    torch_pool = _backed_up_pool(name, kind, layout, page_size, "torch")
    assert torch_pool.transfer_path == "torch"
    stored = _stored_nonfinite_groups(torch_pool)
    assert stored > 0
    assert torch_pool.nonfinite_group_count() == stored
    # Every other format has fused kernels (int4r/k8v4r: their base format's,
    # with the rotation in the tiles), so each has a second count to compare.
    assert torch_pool.host_format.fused_available(torch.device("cpu")), name
    fused_pool = _backed_up_pool(name, kind, layout, page_size, "fused")
    assert fused_pool.transfer_path == "fused_direct"
    for record, buf in torch_pool.host_records.items():
        assert torch.equal(
            fused_pool.host_records[record].view(torch.uint8), buf.view(torch.uint8)
        ), record
    assert fused_pool.nonfinite_group_count() == stored


def test_metric_help_states_the_unit_of_every_format(collectors):
    """The help says what one group is for each codec family (rotated: base)."""
    doc = Scrape().families["sglang:hicache_host_nonfinite_groups"].documentation
    for unit in (
        "int8/k8v4-key head row",
        "4-bit channel group",
        "int8c key channel or 32-channel key group",
        "MLA tile",
        "RoPE row",
    ):
        assert unit in doc, unit
    codecs = {getattr(host_format_cls(n), "base_name", n) for n in HOST_DTYPES}
    # int4c's groups are 4-bit channel groups too: a key channel over a unit
    # (as int4's per-channel keys), else int4's per-token and value groups.
    assert codecs == {"int8", "int4", "k8v4", "int8c", "int4c"}, (
        "a new format needs its unit in the help"
    )


def test_l3_pages_refused_by_reason_and_replaced(collectors):
    """Pages the sealing pool refuses from L3 (per reason) and the controller
    replaced (tests/test_l3_integrity.py), each counted once; pools that do
    not seal export neither series."""
    name, replaced = (
        "sglang:hicache_l3_pages_refused_total",
        "sglang:hicache_l3_pages_replaced_total",
    )
    stock = TierRig("auto", collectors)
    stock.backup(4)
    assert stock.collect().all(name) == stock.collect().all(replaced) == []

    tier = TierRig("int8", collectors)
    host = tier.backup(8)
    assert tier.collect().value(replaced) == 0
    pool = tier.pool
    page = pool.get_data_page(int(host[0]), key="k0")
    corrupt = page.clone()
    corrupt[0] ^= 1
    for data, key in ((corrupt, "k0"), (page, "k1"), (page[:-1], "k0")):
        with pytest.raises(StoragePageRefused):
            pool.set_from_flat_data_page(int(host[0]), data, key=key)
    pool.set_from_flat_data_page(int(host[0]), page, key="k0")  # verified: no count
    want = {r.value: 0 for r in Refusal} | {"checksum": 1, "key": 1, "size": 1}
    for _ in range(2):  # a second read with nothing new does not count twice
        scrape = tier.collect()
        assert {s.labels["reason"]: s.value for s in scrape.all(name)} == want
    # What HiCacheController._page_backup reports after a replacing write.
    tier.pool.note_storage_pages_replaced(3)
    assert tier.collect().value(replaced) == 3
    assert tier.collect().value(replaced) == 3  # nothing new: not counted twice
    tier.pool.note_storage_pages_replaced(2)
    assert tier.collect().value(replaced) == 5


# The sink page's side store (SGLANG_HICACHE_SINK_PAGE_TOKENS).
SINK = ["slots_used", "slots", "kept_4bit_total", "l3_stored_total"]
SINK += ["l3_restored_total", "l3_refused_total"]
SINK_PAGE = 16


def sink_values(scrape: Scrape) -> dict:
    """Every sglang:hicache_sink_page_ series: name (and its label) -> value."""
    values = {}
    for name in SINK:
        for s in scrape.all(f"sglang:hicache_sink_page_{name}"):
            label = s.labels.get("at") or s.labels.get("reason")
            values[f"{name}{{{label}}}" if label else name] = s.value
    return values


def test_sink_page_series_follow_the_store_and_l3(
    collectors, monkeypatch, tmp_path, l3_rigs
):
    """Through the real controller and file L3: slots in use, sink objects
    stored, restored and refused by reason."""
    scheduler_collector, _ = collectors
    monkeypatch.setenv(SINK_ENV, str(4 * SINK_PAGE))
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=SINK_PAGE)
    l3 = h.make_l3_rig(
        "file", h.file_storage_config(tmp_path), host_dtype="int4r", geo=geo,
        layout="page_first", device_tokens=8 * SINK_PAGE, host_tokens=16 * SINK_PAGE,
    )  # fmt: skip
    l3_rigs.append(l3)
    reporter = make_reporter(l3.rig.host_pool, l3.controller)
    slots = l3.rig.host_pool.sink_page_counts()["slots"]
    assert slots == 4
    base = {f"l3_refused_total{{{r.value}}}": 0 for r in Refusal} | {
        "slots": slots,
        "kept_4bit_total{backup}": 0,
        "kept_4bit_total{prefetch}": 0,
    }
    zero = {"slots_used": 0, "l3_stored_total": 0, "l3_restored_total": 0}
    assert sink_values(scrape(reporter, scheduler_collector)) == base | zero

    first = list(range(7, 7 + 2 * SINK_PAGE))
    second = list(range(500, 500 + 2 * SINK_PAGE))
    for seed, tokens in enumerate((first, second), 1):
        # From token 0: device -> L2 (its first page marked) -> L3, then gone.
        dev, host, _, _ = h.write_through(
            l3, tokens, seed=seed, first_page_is_sink=True
        )
        h.evict_everywhere(l3, dev, host)
    objects = sorted(p for p in tmp_path.iterdir() if L3_KEY_SUFFIX in p.name)
    assert len(objects) == 2
    stored = base | zero | {"l3_stored_total": 2}
    assert sink_values(scrape(reporter, scheduler_collector)) == stored

    # The second sequence's object no longer verifies: it restores at 4 bits.
    key = get_storage_hash_str(second, None, page_size=SINK_PAGE)[0]
    (bad,) = [p for p in objects if p.name.startswith(key + L3_KEY_SUFFIX)]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    for tokens in (first, second):
        fetched = h.prefetch(l3, tokens)
        assert fetched.completed_tokens == len(tokens)
        h.load_to_device(l3, fetched.host_indices)
    counts = l3.rig.host_pool.sink_page_counts()
    assert counts["stored"] == 1 and counts["l3"]["restored"] == 1
    want = stored | {"slots_used": 1, "l3_restored_total": 1}
    want["l3_refused_total{checksum}"] = 1
    for _ in range(2):  # a second read with nothing new does not count twice
        assert sink_values(scrape(reporter, scheduler_collector)) == want


def test_sink_page_kept_4bit_when_every_slot_is_taken(collectors):
    """One slot: the second sequence's first page stays 4-bit, and says so."""
    scheduler_collector, _ = collectors
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=SINK_PAGE)
    rig = make_rig(
        geo, device_tokens=16 * SINK_PAGE, host_tokens=16 * SINK_PAGE,
        layout="page_first", host_dtype="int4", sink_page_tokens=16 * SINK_PAGE,
    )  # fmt: skip
    reporter = make_reporter(rig.host_pool, rig.controller)
    for _ in range(2):
        dev = rig.allocator.alloc(2 * SINK_PAGE)
        rig.controller.write(dev, first_page_is_sink=True)
        finish_transfers(rig.controller)
        rig.allocator.free(dev)
    values = sink_values(scrape(reporter, scheduler_collector))
    assert values["slots"] == values["slots_used"] == 1
    assert values["kept_4bit_total{backup}"] == 1


@pytest.mark.parametrize("host_dtype", ["auto", "int4", "int8"])
def test_pools_without_a_sink_page_export_no_sink_series(
    collectors, monkeypatch, host_dtype
):
    monkeypatch.delenv(SINK_ENV, raising=False)
    tier = TierRig(host_dtype, collectors)
    tier.backup(4)
    assert sink_values(tier.collect()) == {}
