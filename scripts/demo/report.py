"""`make demo`'s output: statistics over seeds, tables and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Sequence


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation); the sd is 0 for a single value."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def pm(values: Sequence[float], scale: float = 100, digits: int = 1) -> str:
    """mean +- sd of `values` (times `scale`) as text."""
    mean, sd = spread(values)
    return f"{scale * mean:.{digits}f} +- {scale * sd:.{digits}f}"


# --------------------------------------------------------------------------
# Plot: matplotlib when installed, otherwise Pillow
# --------------------------------------------------------------------------

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]


def _series(sweep, formats):
    """Per format: (label, color, hit-rate means, hit-rate sds, L2 kilotokens)."""
    xs = [row["budget_gb"] for row in sweep]
    out = []
    for i, (label, _) in enumerate(formats):
        spreads = [spread(row["formats"][label]["hit_rates"]) for row in sweep]
        hits = [100 * m for m, _ in spreads]
        sds = [100 * sd for _, sd in spreads]
        toks = [row["formats"][label]["capacity"].tokens / 1000 for row in sweep]
        out.append((label, COLORS[i % len(COLORS)], hits, sds, toks))
    return xs, out


def plot_sweep(sweep, formats, best, budget, path: Path, title: str = "") -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_pillow(sweep, formats, best, budget, path, title)
        return "Pillow"
    xs, series = _series(sweep, formats)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, color, hits, sds, toks in series:
        ax1.errorbar(xs, hits, yerr=sds, fmt="o-", capsize=3, color=color, label=label)
        ax2.plot(xs, toks, "o-", color=color, label=label)
    ax1.axhline(100 * best, ls="--", color="gray", label="best possible")
    for ax in (ax1, ax2):
        ax.axvline(budget, ls=":", color="gray")
        ax.set_xlabel("host budget, GB (--hicache-size)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("cache-hit rate, % of prompt tokens (mean +- sd over seeds)")
    ax1.set_ylim(0, 100)
    ax2.set_ylabel("L2 capacity, thousand tokens")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _nice_step(raw: float) -> float:
    """1, 2, 2.5 or 5 times a power of ten, at least `raw`."""
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _plot_pillow(sweep, formats, best, budget, path: Path, title: str) -> None:
    from PIL import Image, ImageDraw, ImageFont

    W, H = 1320, 560
    img = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=15)
        small = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1
        font = small = ImageFont.load_default()
    xs, series = _series(sweep, formats)
    draw.text((W // 2, 14), title, fill="black", font=font, anchor="mt")
    x_max = max(xs) * 1.04
    top_tokens = max(max(s[4]) for s in series)
    step = _nice_step(top_tokens / 5)
    panels = [
        (
            "cache-hit rate, % of prompt tokens (mean +- sd)",
            0,
            100.0,
            [(s[2], s[3]) for s in series],
            100 * best,
        ),
        (
            "L2 capacity, thousand tokens",
            0,
            step * math.ceil(top_tokens * 1.02 / step),
            [(s[4], [0.0] * len(xs)) for s in series],
            None,
        ),
    ]
    for p, (ylabel, y_min, y_max, ys_list, hline) in enumerate(panels):
        left = 90 + p * (W // 2)
        right = left + W // 2 - 130
        top, bottom = 60, H - 70
        sx = lambda x: left + (right - left) * x / x_max  # noqa: E731
        sy = lambda y: bottom - (bottom - top) * (y - y_min) / (y_max - y_min)  # noqa: E731
        draw.rectangle([left, top, right, bottom], outline="black")
        ticks = round((y_max - y_min) / _nice_step((y_max - y_min) / 5))
        for i in range(ticks + 1):
            y = y_min + (y_max - y_min) * i / ticks
            draw.line([left, sy(y), right, sy(y)], fill="#e6e6e6")
            draw.text(
                (left - 8, sy(y)), f"{y:.0f}", fill="black", font=small, anchor="rm"
            )
        for x in xs:
            draw.line([sx(x), bottom, sx(x), bottom + 5], fill="black")
            draw.text(
                (sx(x), bottom + 8), f"{x:g}", fill="black", font=small, anchor="mt"
            )
        draw.text(
            ((left + right) // 2, bottom + 30),
            "host budget, GB (--hicache-size)",
            fill="black",
            font=font,
            anchor="mt",
        )
        label_img = Image.new("RGBA", (bottom - top, 22), (255, 255, 255, 0))
        ImageDraw.Draw(label_img).text(
            ((bottom - top) // 2, 11), ylabel, fill="black", font=font, anchor="mm"
        )
        label_img = label_img.rotate(90, expand=True)
        img.paste(label_img, (left - 75, top), label_img)
        bx = sx(budget)
        for y in range(top, bottom, 8):
            draw.line([bx, y, bx, y + 3], fill="gray")
        legend = [(s[0], s[1]) for s in series]
        if hline is not None:
            for x in range(int(left), int(right), 12):
                draw.line([x, sy(hline), x + 6, sy(hline)], fill="gray", width=2)
            legend.append(("best possible", "gray"))
        for (_, color, *_), (ys, sds) in zip(series, ys_list):
            pts = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
            draw.line(pts, fill=color, width=3)
            for (x, y), value, sd in zip(pts, ys, sds):
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
                if sd > 0:  # the spread over seeds
                    lo, hi = sy(value - sd), sy(value + sd)
                    draw.line([x, lo, x, hi], fill=color, width=2)
                    draw.line([x - 5, lo, x + 5, lo], fill=color, width=2)
                    draw.line([x - 5, hi, x + 5, hi], fill=color, width=2)
        for i, (label, color) in enumerate(legend):
            ly = top + 12 + 20 * i
            draw.line([left + 12, ly, left + 36, ly], fill=color, width=3)
            draw.text((left + 42, ly), label, fill="black", font=small, anchor="lm")
    img.save(path)


def plot_bars(bars, parts, path: Path, title: str = "", ylabel: str = "",
              right_label: str = "") -> str:  # fmt: skip
    """Two panels per arm: a stacked bar of `parts` (left) and one value
    (right). `bars` is [(label, [part values], right value)]."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _bars_pillow(bars, parts, path, title, ylabel, right_label)
        return "Pillow"
    labels = [b[0] for b in bars]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    bottom = [0.0] * len(bars)
    for i, name in enumerate(parts):
        values = [b[1][i] for b in bars]
        ax1.bar(
            labels, values, bottom=bottom, color=COLORS[i % len(COLORS)], label=name
        )
        bottom = [x + y for x, y in zip(bottom, values)]
    ax1.set_ylabel(ylabel)
    ax1.legend()
    ax2.bar(labels, [b[2] for b in bars], color="#8c8c8c")
    ax2.set_ylabel(right_label)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _bars_pillow(bars, parts, path: Path, title, ylabel, right_label) -> None:
    from PIL import Image, ImageDraw, ImageFont

    W, H = 1320, 560
    img = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=15)
        small = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1
        font = small = ImageFont.load_default()
    draw.text((W // 2, 14), title, fill="black", font=font, anchor="mt")
    panels = [
        (ylabel, [b[1] for b in bars], True),
        (right_label, [[b[2]] for b in bars], False),
    ]
    for p, (label, stacks, legend) in enumerate(panels):
        left = 90 + p * (W // 2)
        right = left + W // 2 - 130
        top, bottom = 60, H - 70
        top_value = max(sum(s) for s in stacks) or 1.0
        step = _nice_step(top_value / 5)
        # Headroom for the legend above the tallest bar.
        y_max = step * math.ceil(top_value * 1.3 / step)
        sy = lambda y: bottom - (bottom - top) * y / y_max  # noqa: E731
        draw.rectangle([left, top, right, bottom], outline="black")
        for i in range(round(y_max / step) + 1):
            y = i * step
            draw.line([left, sy(y), right, sy(y)], fill="#e6e6e6")
            draw.text(
                (left - 8, sy(y)), f"{y:,.0f}", fill="black", font=small, anchor="rm"
            )
        slot = (right - left) / len(bars)
        for k, (name, stack) in enumerate(zip([b[0] for b in bars], stacks)):
            x0, x1 = left + slot * (k + 0.2), left + slot * (k + 0.8)
            base = 0.0
            for i, value in enumerate(stack):
                color = COLORS[i % len(COLORS)] if legend else "#8c8c8c"
                if value > 0:
                    draw.rectangle([x0, sy(base + value), x1, sy(base)], fill=color)
                base += value
            draw.text(
                ((x0 + x1) / 2, bottom + 8), name, fill="black", font=font, anchor="mt"
            )
            draw.text(((x0 + x1) / 2, sy(base) - 4), f"{base:,.0f}", fill="black",
                      font=small, anchor="mb")  # fmt: skip
        label_img = Image.new("RGBA", (bottom - top, 22), (255, 255, 255, 0))
        ImageDraw.Draw(label_img).text(
            ((bottom - top) // 2, 11), label, fill="black", font=font, anchor="mm"
        )
        label_img = label_img.rotate(90, expand=True)
        img.paste(label_img, (left - 80, top), label_img)
        if legend:
            # Right-aligned, above the bars' value labels.
            lx = right - 210
            for i, name in enumerate(parts):
                ly = top + 12 + 20 * i
                draw.rectangle([lx, ly - 6, lx + 18, ly + 6], fill=COLORS[i])
                draw.text((lx + 26, ly), name, fill="black", font=small, anchor="lm")
    img.save(path)
