"""The host-tier metrics of an FP8 device KV cache with an int4/k8v4 host
copy, scraped from SGLang's own collectors (as tests/test_hicache_metrics.py):
the info series names the FP8 device dtype, not its uint8 storage, and the
bytes are the encoded ones against 1 byte per device value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.rigs.hicache_harness import Geometry, make_rig
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.observability.metrics_collector import SchedulerStats
from tests.support.metrics import Scrape


@pytest.mark.parametrize(
    "host_dtype,fp8",
    [("int4", torch.float8_e4m3fn), ("k8v4", torch.float8_e5m2)],
)
def test_info_series_names_the_fp8_device_dtype(collectors, host_dtype, fp8):
    scheduler_collector, radix = collectors
    geo = Geometry(layer_num=3, head_num=2, head_dim=64, dtype=fp8, page_size=16)
    rig = make_rig(
        geo,
        device_tokens=128,
        host_tokens=256,
        layout="page_first",
        io_backend="direct",
        host_dtype=host_dtype,
        device_kv_dtype=fp8,
    )
    pool, ctl = rig.host_pool, rig.controller
    dev = rig.allocator.alloc(32)
    gen = torch.Generator().manual_seed(0)
    for layer in range(geo.layer_num):
        for buf in (rig.device_pool.k_buffer, rig.device_pool.v_buffer):
            rows = torch.randn((32, 2, 64), generator=gen).to(fp8)
            buf[layer][dev] = rows.view(torch.uint8)
    ctl.write(dev)
    for ack in ctl.ack_write_queue:
        ack.finish_event.synchronize()
        radix._log_write_ack_metrics(ack)
    ctl.ack_write_queue.clear()

    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(
        enable_hierarchical_cache=True,
        tree_cache=SimpleNamespace(token_to_kv_pool_host=pool, cache_controller=ctl),
    )
    reporter.stats = SchedulerStats()
    reporter._log_hicache_stats()
    scheduler_collector.log_stats(reporter.stats)
    scrape = Scrape()

    (info,) = scrape.all("sglang:hicache_host_info")
    assert info.labels["host_dtype"] == host_dtype
    assert info.labels["device_dtype"] == str(fp8).removeprefix("torch.")
    assert info.labels["transfer_path"] == "torch"
    host_bpt = pool.get_size_per_token()
    device_bpt = geo.layer_num * 2 * 2 * 64  # 1 byte per FP8 value
    assert pool.device_size_per_token() == device_bpt and host_bpt < device_bpt
    assert scrape.value("sglang:hicache_host_bytes_per_token") == host_bpt
    assert scrape.value("sglang:hicache_backup_bytes_total") == 32 * host_bpt
    assert scrape.value("sglang:hicache_backup_logical_bytes_total") == 32 * device_bpt
    assert scrape.value("sglang:hicache_host_nonfinite_groups_total") == 0
