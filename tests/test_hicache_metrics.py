"""HiCache host-tier metrics, scraped from SGLang's own collectors (issue 11).

Real host pools and real HiCacheController transfers
(scripts.rigs.hicache_harness) feed the real code paths: UnifiedRadixCache's ack loggers into RadixCacheMetricsCollector
(byte counters), and SchedulerMetricsReporter._log_hicache_stats into
SchedulerMetricsCollector.log_stats (host format, bytes, non-finite groups). The text exposition is parsed with prometheus_client's parser and every
value is checked against the pool and the KV that was written. Only the
scheduler around the reporter is a stand-in: it needs a GPU model runner.
"""

from __future__ import annotations

from types import SimpleNamespace

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
from tests.support.metrics import TIER_GEO as GEO
from tests.support.metrics import Scrape, TierRig, make_reporter, scrape
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.mem_cache.pool_host.page_integrity import Refusal, StoragePageRefused
from sglang.srt.observability.metrics_collector import (
    SchedulerStats,
)


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
    """Decode context parallelism (--dcp-size 2): upstream's stock MLA host
    pool counts logical slots (logical_size = size * dcp_size, dcp_size of them
    per physical row), so the used bytes are this rank's rows in use."""
    scheduler_collector, _ = collectors
    dcp = 2
    device_pool = make_device_pool(MLAGeometry(layer_num=2, page_size=4), 64)
    pool = make_host_pool(device_pool, host_tokens=32, dcp_size=dcp)
    assert (pool.dcp_size, pool.size, pool.logical_size) == (dcp, 32, 64)
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    tree_cache = SimpleNamespace(token_to_kv_pool_host=pool, cache_controller=None)
    reporter.scheduler = SimpleNamespace(
        enable_hierarchical_cache=True, tree_cache=tree_cache
    )
    reporter.stats = SchedulerStats()
    host = pool.alloc(24)
    rows = len(torch.unique(host // dcp))
    assert rows == 12
    reporter._log_hicache_stats()
    scheduler_collector.log_stats(reporter.stats)
    scrape = Scrape()
    assert scrape.value("sglang:hicache_host_used_tokens") == 24
    used = scrape.value("sglang:hicache_host_used_bytes")
    assert used == rows * pool.size_per_token
    # Every slot in use: the bytes of the whole host buffer, not dcp_size times it.
    pool.alloc(pool.available_size())
    reporter._log_hicache_stats()
    scheduler_collector.log_stats(reporter.stats)
    buffer_bytes = sum(b.numel() * b.element_size() for b in [pool.kv_buffer])
    assert Scrape().value("sglang:hicache_host_used_bytes") == buffer_bytes


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


def test_l3_pages_refused_by_reason(collectors):
    """Pages the sealing pool refuses on the way in from L3 are counted per
    reason once each (issue 21); pools that do not seal export no series."""
    name = "sglang:hicache_l3_pages_refused_total"
    stock = TierRig("auto", collectors)
    stock.backup(4)
    assert stock.collect().all(name) == []

    tier = TierRig("int8", collectors)
    host = tier.backup(8)
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


# --- the sink page's side store (SGLANG_HICACHE_SINK_PAGE_TOKENS) ---------------

SINK = [
    "sglang:hicache_sink_page_slots_used",
    "sglang:hicache_sink_page_slots",
    "sglang:hicache_sink_page_kept_4bit_total",
    "sglang:hicache_sink_page_l3_stored_total",
    "sglang:hicache_sink_page_l3_restored_total",
    "sglang:hicache_sink_page_l3_refused_total",
]
SINK_PAGE = 16


def sink_values(scrape: Scrape) -> dict:
    """Every sink-page series: name (and its label) -> value."""
    values = {}
    for name in SINK:
        for s in scrape.all(name):
            label = s.labels.get("at") or s.labels.get("reason")
            values[f"{name}{{{label}}}" if label else name] = s.value
    return values


def sink_l3_rig(tmp_path, l3_rigs, monkeypatch, sink_tokens: int):
    from sglang.srt.mem_cache.pool_host.sink_page import SINK_ENV
    from scripts.rigs.l3_harness import file_storage_config, make_l3_rig

    monkeypatch.setenv(SINK_ENV, str(sink_tokens))
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=SINK_PAGE)
    l3 = make_l3_rig(
        "file", file_storage_config(tmp_path), host_dtype="int4r", geo=geo,
        layout="page_first", device_tokens=8 * SINK_PAGE,
        host_tokens=16 * SINK_PAGE,
    )  # fmt: skip
    l3_rigs.append(l3)
    return l3


def to_l3_and_back_out(l3, tokens, seed):
    """A sequence from token 0: device -> L2 (its first page marked) -> L3,
    then dropped from L1 and L2."""
    from scripts.rigs.l3_harness import evict_everywhere, write_through

    dev, host, _, _ = write_through(l3, tokens, seed=seed, first_page_is_sink=True)
    evict_everywhere(l3, dev, host)


def prefetched(l3, tokens):
    from scripts.rigs.l3_harness import load_to_device, prefetch

    fetched = prefetch(l3, tokens)
    assert fetched.completed_tokens == len(tokens)
    load_to_device(l3, fetched.host_indices)


def test_sink_page_series_follow_the_store_and_l3(
    collectors, monkeypatch, tmp_path, l3_rigs
):
    """Through the real controller and file L3: slots in use, sink objects
    stored, restored and refused (by reason), as the pool counts them."""
    from sglang.srt.mem_cache.pool_host.sink_page import L3_KEY_SUFFIX

    scheduler_collector, _ = collectors
    l3 = sink_l3_rig(tmp_path, l3_rigs, monkeypatch, sink_tokens=4 * SINK_PAGE)
    reporter = make_reporter(l3.rig.host_pool, l3.controller)
    slots = l3.rig.host_pool.sink_page_counts()["slots"]
    assert slots == 4
    refused_zero = {
        f"sglang:hicache_sink_page_l3_refused_total{{{r.value}}}": 0 for r in Refusal
    }
    base = {
        "sglang:hicache_sink_page_slots": slots,
        "sglang:hicache_sink_page_kept_4bit_total{backup}": 0,
        "sglang:hicache_sink_page_kept_4bit_total{prefetch}": 0,
        **refused_zero,
    }
    assert sink_values(scrape(reporter, scheduler_collector)) == base | {
        "sglang:hicache_sink_page_slots_used": 0,
        "sglang:hicache_sink_page_l3_stored_total": 0,
        "sglang:hicache_sink_page_l3_restored_total": 0,
    }

    first = list(range(7, 7 + 2 * SINK_PAGE))
    second = list(range(500, 500 + 2 * SINK_PAGE))
    to_l3_and_back_out(l3, first, seed=1)
    to_l3_and_back_out(l3, second, seed=2)
    objects = sorted(p for p in tmp_path.iterdir() if L3_KEY_SUFFIX in p.name)
    assert len(objects) == 2
    assert sink_values(scrape(reporter, scheduler_collector)) == base | {
        "sglang:hicache_sink_page_slots_used": 0,
        "sglang:hicache_sink_page_l3_stored_total": 2,
        "sglang:hicache_sink_page_l3_restored_total": 0,
    }

    # The second sequence's object no longer verifies: it restores at 4 bits.
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = get_storage_hash_str(second, None, page_size=SINK_PAGE)[0]
    (bad,) = [p for p in objects if p.name.startswith(key + L3_KEY_SUFFIX)]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    prefetched(l3, first)
    prefetched(l3, second)
    counts = l3.rig.host_pool.sink_page_counts()
    assert counts["stored"] == 1 and counts["l3"]["restored"] == 1
    want = base | {
        "sglang:hicache_sink_page_slots_used": 1,
        "sglang:hicache_sink_page_l3_stored_total": 2,
        "sglang:hicache_sink_page_l3_restored_total": 1,
        "sglang:hicache_sink_page_l3_refused_total{checksum}": 1,
    }
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
    assert values["sglang:hicache_sink_page_slots"] == 1
    assert values["sglang:hicache_sink_page_slots_used"] == 1
    assert values["sglang:hicache_sink_page_kept_4bit_total{backup}"] == 1


@pytest.mark.parametrize("host_dtype", ["auto", "int4", "int8"])
def test_pools_without_a_sink_page_export_no_sink_series(
    collectors, monkeypatch, host_dtype
):
    monkeypatch.delenv("SGLANG_HICACHE_SINK_PAGE_TOKENS", raising=False)
    tier = TierRig(host_dtype, collectors)
    tier.backup(4)
    assert sink_values(tier.collect()) == {}


def test_l3_pages_replaced_is_exported(collectors):
    """Pages the controller replaced in L3 after a prefetch could not use them
    (tests/test_l3_integrity_replace.py) are one counter; pools that do not
    seal export no series."""
    name = "sglang:hicache_l3_pages_replaced_total"
    stock = TierRig("auto", collectors)
    stock.backup(4)
    assert stock.collect().all(name) == []

    tier = TierRig("int8", collectors)
    tier.backup(8)
    assert tier.collect().value(name) == 0
    # What HiCacheController._page_backup reports after a replacing write.
    tier.pool.note_storage_pages_replaced(3)
    assert tier.collect().value(name) == 3
    assert tier.collect().value(name) == 3  # nothing new: not counted twice
    tier.pool.note_storage_pages_replaced(2)
    assert tier.collect().value(name) == 5
