"""HiCache host-tier metrics, scraped from SGLang's own collectors (issue 11).

Real host pools and real HiCacheController transfers
(tests.support.hicache_harness) feed the real code paths: UnifiedRadixCache's ack loggers into RadixCacheMetricsCollector
(byte counters), and SchedulerMetricsReporter._log_hicache_stats into
SchedulerMetricsCollector.log_stats (host format, bytes, non-finite groups). The text exposition is parsed with prometheus_client's parser and every
value is checked against the pool and the KV that was written. Only the
scheduler around the reporter is a stand-in: it needs a GPU model runner.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.hicache_harness import Geometry, make_rig
from tests.support.metrics import Scrape
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.mem_cache.pool_host.page_integrity import Refusal, StoragePageRefused
from sglang.srt.observability.metrics_collector import (
    SchedulerStats,
)

GEO = Geometry(layer_num=3, head_num=2, head_dim=16, dtype=torch.bfloat16)


class TierRig:
    """A HiCache rig plus the real reporter/ack-logging code that feeds metrics."""

    def __init__(self, host_dtype: str, collectors, layout: str = "layer_first"):
        self.scheduler_collector, self.radix = collectors
        self.rig = make_rig(
            GEO,
            device_tokens=64,
            host_tokens=128,
            layout=layout,
            io_backend="direct",
            host_dtype=host_dtype,
        )
        self.pool = self.rig.host_pool
        tree_cache = SimpleNamespace(
            token_to_kv_pool_host=self.pool, cache_controller=self.rig.controller
        )
        self.reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
        self.reporter.scheduler = SimpleNamespace(
            enable_hierarchical_cache=True, tree_cache=tree_cache
        )
        self.reporter.stats = SchedulerStats()
        self.gen = torch.Generator().manual_seed(0)
        self.written = []  # per layer: K rows, V rows (device dtype)

    def backup(self, n: int, nan_rows: int = 0) -> torch.Tensor:
        """n new tokens on the device (the first nan_rows K rows hold a NaN),
        written through to the host; returns the host indices."""
        ctl, device_pool = self.rig.controller, self.rig.device_pool
        device_indices = self.rig.allocator.alloc(n)
        batch = []
        for layer in range(GEO.layer_num):
            k = torch.randn((n, GEO.head_num, GEO.head_dim), generator=self.gen)
            v = torch.randn((n, GEO.head_num, GEO.head_dim), generator=self.gen)
            k, v = (k * (layer + 1)).to(GEO.dtype), (v * 0.5).to(GEO.dtype)
            k[:nan_rows, 0, 0] = float("nan")
            device_pool.k_buffer[layer][device_indices] = k
            device_pool.v_buffer[layer][device_indices] = v
            batch.append((k, v))
        self.written.append(batch)
        host_indices = ctl.write(device_indices)
        for ack in ctl.ack_write_queue:
            ack.finish_event.synchronize()
            self.radix._log_write_ack_metrics(ack)
        ctl.ack_write_queue.clear()
        self.rig.allocator.free(device_indices)
        return host_indices

    def load(self, host_indices: torch.Tensor) -> None:
        ctl = self.rig.controller
        device_indices = ctl.load(host_indices)
        ctl.start_loading()
        for ack in ctl.ack_load_queue:
            ack.finish_event.synchronize()
            self.radix._log_load_ack_metrics(ack)
        ctl.ack_load_queue.clear()
        self.rig.allocator.free(device_indices)

    def collect(self) -> Scrape:
        self.reporter._log_hicache_stats()
        self.scheduler_collector.log_stats(self.reporter.stats)
        return Scrape()


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
