"""`make demo`'s statistics over seeds (its plots: scripts/common/plot.py)."""

from __future__ import annotations

import re
import statistics
from typing import Callable, Iterable, Sequence


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation); the sd is 0 for a single value."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def pm(values: Sequence[float], scale: float = 100, digits: int = 1) -> str:
    """mean +- sd of `values` (times `scale`) as text, thousands separated."""
    mean, sd = spread(values)
    return f"{scale * mean:,.{digits}f} +- {scale * sd:,.{digits}f}"


def table(template: str, headers: str, rows: Iterable[Sequence], say: Callable = print):
    """Says a header line, then one line per row of values: `template` has a
    `{:spec}` per column, and each of the ;-separated `headers` takes its column's
    alignment and width."""
    head = re.sub(r"\{:([<>^]?\d*)[^}]*\}", r"{:\1}", template)
    say(head.format(*headers.split(";")))
    for row in rows:
        say(template.format(*row))
