"""Scraping SGLang's own metrics collectors in-process: the scheduler's and
the radix cache's collectors built as a server builds them (a fixture), and
the registry's text exposition parsed with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
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
    # Built the way the scheduler and the radix cache build them.
    scheduler = scheduler_collector(server_args)
    radix = UnifiedRadixCache.__new__(UnifiedRadixCache)
    radix.init_metrics_collector()
    yield scheduler, radix
    # The collectors register in the process-wide registry; a server builds
    # them once, a test once per case.
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
