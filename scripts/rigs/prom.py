"""Prometheus text exposition (a server's /metrics) parsed into samples.

One parser for the live-server tests and ``make demo``: it uses
prometheus_client's own parser (the format's reference implementation), so
label escaping, histograms and ``_total`` suffixes follow the spec.

Stable API:

- ``parse(text) -> Metrics``.
- ``Metrics.value(name, **labels) -> float``: the sum of every sample named
  ``name`` whose labels include ``labels`` (0.0 when none matches, so a
  counter that has not been created yet reads as zero); ``default=`` overrides.
- ``Metrics.samples(name) -> list[(labels dict, value)]``.
- ``Metrics.has(name) -> bool``, ``Metrics.names() -> set[str]``.
- ``Metrics.find(substring) -> sorted sample names containing it``.
- ``diff(after, before, name, **labels) -> float``: the change of ``value``.

Names are sample names as exposed (``sglang:cached_tokens_total``,
``..._bucket``), not family names.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families


class Metrics:
    def __init__(self, samples: dict[str, list[tuple[dict, float]]]):
        self._samples = samples

    def samples(self, name: str) -> list[tuple[dict, float]]:
        return list(self._samples.get(name, ()))

    def has(self, name: str) -> bool:
        return name in self._samples

    def names(self) -> set[str]:
        return set(self._samples)

    def find(self, substring: str) -> list[str]:
        return sorted(n for n in self._samples if substring in n)

    def value(self, name: str, default: float = 0.0, **labels: str) -> float:
        matched = [
            v
            for got, v in self._samples.get(name, ())
            if all(got.get(k) == str(want) for k, want in labels.items())
        ]
        return float(sum(matched)) if matched else default

    def __repr__(self) -> str:
        return f"Metrics({len(self._samples)} sample names)"


def parse(text: str) -> Metrics:
    samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return Metrics(dict(samples))


def diff(after: Metrics, before: Metrics, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)
