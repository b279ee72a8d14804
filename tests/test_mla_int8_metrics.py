"""Host-tier metrics of the MLA INT8 pool, scraped from SGLang's own
collectors after real transfers through the real HiCacheController (as
tests/test_hicache_metrics.py does for MHA): format labels, encoded and
logical bytes, non-finite groups (latent tiles)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tests.support.metrics import Scrape

from scripts.rigs.hicache_harness import MLAGeometry, make_rig
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.observability.metrics_collector import SchedulerStats

GEO = MLAGeometry(layer_num=3, page_size=4)
LATENT = GEO.kv_lora_rank


def test_mla_int8_host_tier_metrics(collectors):
    scheduler_collector, radix = collectors
    rig = make_rig(
        GEO,
        device_tokens=64,
        host_tokens=128,
        layout="page_first",
        io_backend="kernel",
        host_dtype="int8",
    )
    pool, ctl, device_pool = rig.host_pool, rig.controller, rig.device_pool
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(
        enable_hierarchical_cache=True,
        tree_cache=SimpleNamespace(token_to_kv_pool_host=pool, cache_controller=ctl),
    )
    reporter.stats = SchedulerStats()

    gen = torch.Generator().manual_seed(0)
    dev = rig.allocator.alloc(16)
    for layer in range(GEO.layer_num):
        rows = torch.randn((16, 1, LATENT + 64), generator=gen) * (layer + 1)
        rows[0, 0, 3] = float("nan")  # one latent tile per layer stored as NaN
        rows = rows.to(GEO.dtype)
        device_pool.kv_buffer[layer][dev] = rows
    ctl.write(dev)
    for ack in ctl.ack_write_queue:
        ack.finish_event.synchronize()
        radix._log_write_ack_metrics(ack)
    ctl.ack_write_queue.clear()

    reporter._log_hicache_stats()
    scheduler_collector.log_stats(reporter.stats)
    scrape = Scrape()
    (info,) = scrape.all("sglang:hicache_host_info")
    assert info.labels["host_dtype"] == "int8"
    assert info.labels["device_dtype"] == "bfloat16"
    assert info.labels["transfer_path"] == pool.transfer_path == "torch"
    host_bpt, device_bpt = 648 * GEO.layer_num, 1152 * GEO.layer_num
    assert scrape.value("sglang:hicache_host_bytes_per_token") == host_bpt
    assert scrape.value("sglang:hicache_backup_bytes_total") == 16 * host_bpt
    assert scrape.value("sglang:hicache_backup_logical_bytes_total") == 16 * device_bpt
    # One latent tile (the MLA format's scale group) per layer stored as NaN.
    assert scrape.value("sglang:hicache_host_nonfinite_groups_total") == GEO.layer_num
    assert pool.nonfinite_group_count() == GEO.layer_num
