"""SGLang's metrics collectors built in-process as a server builds them, their
exposition parsed (Scrape), and a HiCache rig whose real transfers and
reporter feed them (TierRig)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scripts.rigs.hicache_harness import Geometry, make_rig
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.observability.metrics_collector import (
    SchedulerMetricsCollector,
    SchedulerStats,
)
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs


def scheduler_collector(server_args: ServerArgs):
    """The scheduler's metrics collector, built the way the scheduler builds it."""
    return SchedulerMetricsCollector.init_new(
        server_args=server_args,
        enable_priority_scheduling=False,
        enable_lora=False,
        enable_hierarchical_cache=True,
    ).collector


def scheduler_and_radix_collectors():
    """Yields (scheduler collector, radix-cache collector); unregisters them after."""
    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        enable_hierarchical_cache=True,
        enable_metrics=True,
    )
    registered_before = set(REGISTRY._collector_to_names)
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    scheduler = scheduler_collector(server_args)
    radix = UnifiedRadixCache.__new__(UnifiedRadixCache)
    radix.init_metrics_collector()
    yield scheduler, radix
    # A server builds them once in the process-wide registry, a test per case.
    for collector in set(REGISTRY._collector_to_names) - registered_before:
        REGISTRY.unregister(collector)
    reset_context()


class Scrape:
    def __init__(self):
        self.families = {
            f.name: f
            for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
        }
        self.samples = [s for f in self.families.values() for s in f.samples]

    def all(self, name: str, **labels) -> list:
        return [
            s
            for s in self.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]

    def value(self, name: str, **labels) -> float:
        (sample,) = self.all(name, **labels)
        return sample.value


def make_reporter(pool, controller) -> SchedulerMetricsReporter:
    """The scheduler's metrics reporter over this host pool and controller."""
    tree_cache = SimpleNamespace(
        token_to_kv_pool_host=pool, cache_controller=controller
    )
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(
        enable_hierarchical_cache=True, tree_cache=tree_cache
    )
    reporter.stats = SchedulerStats()
    return reporter


def scrape(reporter, scheduler_collector) -> Scrape:
    """The exposition after the reporter's HiCache stats reach the collector."""
    reporter._log_hicache_stats()
    scheduler_collector.log_stats(reporter.stats)
    return Scrape()


TIER_GEO = Geometry(layer_num=3, head_num=2, head_dim=16, dtype=torch.bfloat16)


class TierRig:
    """A HiCache rig plus the real reporter/ack-logging code that feeds metrics."""

    def __init__(
        self,
        host_dtype: str,
        collectors,
        layout: str = "layer_first",
        geo: Geometry = TIER_GEO,
    ):
        self.scheduler_collector, self.radix = collectors
        self.geo = geo
        self.rig = make_rig(
            geo,
            device_tokens=64,
            host_tokens=128,
            layout=layout,
            io_backend="direct",
            host_dtype=host_dtype,
        )
        self.pool = self.rig.host_pool
        self.reporter = make_reporter(self.pool, self.rig.controller)
        self.gen = torch.Generator().manual_seed(0)
        self.written = []  # per layer: K rows, V rows (device dtype)

    def backup(self, n: int, nan_rows: int = 0) -> torch.Tensor:
        """Host indices of n new tokens (the first nan_rows K rows hold a NaN)."""
        geo, ctl, device_pool = self.geo, self.rig.controller, self.rig.device_pool
        device_indices = self.rig.allocator.alloc(n)
        batch = []
        for layer in range(geo.layer_num):
            k = torch.randn((n, geo.head_num, geo.head_dim), generator=self.gen)
            v = torch.randn((n, geo.head_num, geo.head_dim), generator=self.gen)
            k, v = (k * (layer + 1)).to(geo.dtype), (v * 0.5).to(geo.dtype)
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
        return scrape(self.reporter, self.scheduler_collector)
