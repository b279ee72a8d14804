"""HiCache host-tier metrics, scraped from SGLang's own collectors (issue 11).

Real host pools and real HiCacheController transfers
(tests.support.hicache_harness) feed the real code paths: UnifiedRadixCache's ack loggers into RadixCacheMetricsCollector
(byte counters), and SchedulerMetricsReporter._log_hicache_stats into
SchedulerMetricsCollector.log_stats (host format, bytes, non-finite groups). The text exposition is parsed with prometheus_client's parser and every
value is checked against the pool and the KV that was written. Only the
scheduler around the reporter is a stand-in: it needs a GPU model runner.
"""

from __future__ import annotations

import pytest

from tests.support.metrics import TIER_GEO as GEO
from tests.support.metrics import TierRig
from sglang.srt.mem_cache.pool_host.page_integrity import Refusal, StoragePageRefused


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


def test_format_series_follows_a_transfer_path_change(collectors):
    tier = TierRig("int8", collectors)
    tier.backup(4)
    before = tier.pool.transfer_path
    tier.collect()
    # What the pool does when the driver refuses a host pointer.
    tier.pool.fused_host_access = "staged"
    tier.pool.use_fused_kernels = True
    scrape = tier.collect()
    series = {
        s.labels["transfer_path"]: s.value
        for s in scrape.all("sglang:hicache_host_info")
    }
    assert series == {before: 0, "fused_staged": 1}


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
