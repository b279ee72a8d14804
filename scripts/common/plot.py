"""The tools' plots (`make demo`'s curves and bars, `make quality`'s KL
histogram), drawn with Pillow (pinned in requirements/cpu-test.txt)."""

from __future__ import annotations

import math
from itertools import cycle
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from scripts.demo.report import spread

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
KL_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]  # fmt: skip


def _fonts(size: int, small: int):  # sized default fonts: Pillow >= 10.1 (pinned 13)
    return ImageFont.load_default(size=size), ImageFont.load_default(size=small)


def nice_step(raw: float, multiples=(1, 2, 2.5, 5, 10)) -> float:
    """The smallest of `multiples` times a power of ten that is at least `raw`."""
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in multiples if m * power >= raw)


def _axis(top_value: float, headroom: float) -> tuple[float, float]:
    """(grid step, axis top) for values up to top_value, with headroom above."""
    step = nice_step(top_value / 5)
    return step, step * math.ceil(top_value * headroom / step)


class _Panels:
    """A 1320 x 560 canvas with a title and two side-by-side framed panels."""

    W, H = 1320, 560
    TOP, BOTTOM = 60, H - 70

    def __init__(self, title: str):
        self.img = Image.new("RGB", (self.W, self.H), "white")
        self.draw = ImageDraw.Draw(self.img)
        self.font, self.small = _fonts(15, 13)
        self.text((self.W // 2, 14), title, "mt", self.font)

    def text(self, xy, text: str, anchor: str, font=None, fill="black") -> None:
        self.draw.text(xy, text, fill=fill, font=font or self.small, anchor=anchor)

    def tick_label(self, x: float, text: str, font=None) -> None:
        self.text((x, self.BOTTOM + 8), text, "mt", font)

    def frame(self, p: int, sy, y_max: float, step: float, fmt: str = "{:.0f}"):
        """Panel p's box and horizontal grid; returns its (left, right)."""
        left = 90 + p * (self.W // 2)
        right = left + self.W // 2 - 130
        self.draw.rectangle([left, self.TOP, right, self.BOTTOM], outline="black")
        for i in range(round(y_max / step) + 1):
            y = i * step
            self.draw.line([left, sy(y), right, sy(y)], fill="#e6e6e6")
            self.text((left - 8, sy(y)), fmt.format(y), "rm")
        return left, right

    def scale(self, y_max: float):
        """Panel y coordinate of a value on a 0..y_max axis."""
        return lambda y: self.BOTTOM - (self.BOTTOM - self.TOP) * y / y_max

    def dashed(self, left: float, right: float, y: float) -> None:
        for x in range(int(left), int(right), 12):
            self.draw.line([x, y, x + 6, y], fill="gray", width=2)

    def bars(self, p: int, names, stacks, colors, headroom, margin, unit=""):
        """Panel p: one bar per name, its stack of values in its `colors`, the
        total above it; returns the panel's (left, right)."""
        step, y_max = _axis(max(sum(s) for s in stacks) or 1.0, headroom)
        sy = self.scale(y_max)
        left, right = self.frame(p, sy, y_max, step, fmt="{:,.0f}")
        slot, draw = (right - left) / len(names), self.draw
        for k, (name, stack, bar_colors) in enumerate(zip(names, stacks, colors)):
            x0, x1 = left + slot * (k + margin), left + slot * (k + (1 - margin))
            base = 0.0
            for value, color in zip(stack, bar_colors):
                if value > 0:
                    draw.rectangle([x0, sy(base + value), x1, sy(base)], fill=color)
                base += value
            self.tick_label((x0 + x1) / 2, name, self.font)
            self.text(((x0 + x1) / 2, sy(base) - 4), f"{base:,.0f}{unit}", "mb")
        return left, right

    def ylabel(self, text: str, x: int) -> None:
        h = self.BOTTOM - self.TOP
        label = Image.new("RGBA", (h, 22), (255, 255, 255, 0))
        draw = ImageDraw.Draw(label)
        draw.text((h // 2, 11), text, fill="black", font=self.font, anchor="mm")
        label = label.rotate(90, expand=True)
        self.img.paste(label, (x, self.TOP), label)


def plot_sweep(sweep, formats, best, budget, path: Path, title: str = "") -> None:
    """`make demo` part 2: hit rate (left) and L2 capacity (right) against the
    host budget, one line per format, the spread over seeds as error bars."""
    c = _Panels(title)
    draw, top, bottom = c.draw, c.TOP, c.BOTTOM
    xs = [row["budget_gb"] for row in sweep]
    x_max = max(xs) * 1.04
    labels = [label for label, _ in formats]
    colors = [COLORS[i % len(COLORS)] for i in range(len(labels))]
    hits, kilotokens = [], []  # per format: (values, sds)
    for label in labels:
        cells = [row["formats"][label] for row in sweep]
        spreads = [spread(cell["hit_rates"]) for cell in cells]
        hits.append(([100 * m for m, _ in spreads], [100 * sd for _, sd in spreads]))
        tokens = [cell["capacity"].tokens / 1000 for cell in cells]
        kilotokens.append((tokens, [0.0] * len(xs)))
    _, kilo_max = _axis(max(max(ys) for ys, _ in kilotokens), 1.02)
    panels = [
        ("cache-hit rate, % of prompt tokens (mean +- sd)", 100.0, hits, 100 * best),
        ("L2 capacity, thousand tokens", kilo_max, kilotokens, None),
    ]
    for p, (ylabel, y_max, ys_list, hline) in enumerate(panels):
        sy = c.scale(y_max)
        left, right = c.frame(p, sy, y_max, y_max / round(y_max / nice_step(y_max / 5)))
        sx = lambda x: left + (right - left) * x / x_max  # noqa: E731
        for x in xs:
            draw.line([sx(x), bottom, sx(x), bottom + 5], fill="black")
            c.tick_label(sx(x), f"{x:g}")
        xlabel = "host budget, GB (--hicache-size)"
        c.text(((left + right) // 2, bottom + 30), xlabel, "mt", c.font)
        c.ylabel(ylabel, left - 75)
        for y in range(top, bottom, 8):
            draw.line([sx(budget), y, sx(budget), y + 3], fill="gray")
        legend = list(zip(labels, colors))
        if hline is not None:
            c.dashed(left, right, sy(hline))
            legend.append(("best possible", "gray"))
        for color, (ys, sds) in zip(colors, ys_list):
            pts = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
            draw.line(pts, fill=color, width=3)
            for (x, y), value, sd in zip(pts, ys, sds):
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
                if sd > 0:  # the spread over seeds
                    lo, hi = sy(value - sd), sy(value + sd)
                    draw.line([x, lo, x, hi], fill=color, width=2)
                    for end in (lo, hi):
                        draw.line([x - 5, end, x + 5, end], fill=color, width=2)
        for i, (label, color) in enumerate(legend):
            ly = top + 12 + 20 * i
            draw.line([left + 12, ly, left + 36, ly], fill=color, width=3)
            c.text((left + 42, ly), label, "lm")
    c.img.save(path)


def plot_bars(bars, parts, path: Path, title: str = "", ylabel: str = "",
              right_label: str = "") -> None:  # fmt: skip
    """Two panels per arm: a stacked bar of `parts` (left) and one value
    (right). `bars` is [(label, [part values], right value)]."""
    c = _Panels(title)
    names = [b[0] for b in bars]
    part_colors = [cycle(COLORS) for _ in bars]
    # Headroom for the legend above the tallest bar.
    left, right = c.bars(0, names, [b[1] for b in bars], part_colors, 1.3, 0.2)
    c.ylabel(ylabel, left - 80)
    lx = right - 210  # right-aligned, above the bars' value labels
    for i, name in enumerate(parts):
        ly = c.TOP + 12 + 20 * i
        c.draw.rectangle([lx, ly - 6, lx + 18, ly + 6], fill=COLORS[i])
        c.text((lx + 26, ly), name, "lm")
    gray = [["#8c8c8c"]] * len(bars)
    left, _ = c.bars(1, names, [[b[2]] for b in bars], gray, 1.3, 0.2)
    c.ylabel(right_label, left - 80)
    c.img.save(path)


def kl_histogram(
    series: dict[str, list[float]], path, title: str = "", bins_per_decade: int = 5
) -> None:
    """`make quality`: histogram of log10(KL) per arm; the legend counts KL == 0."""
    W, H = 960, 560
    left, right, top, bottom = 80, 30, 60, 80
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    font, small = _fonts(14, 12)

    def text(xy, s: str, f=small) -> None:
        d.text(xy, s, fill="black", font=f)

    positive = [x for v in series.values() for x in v if x > 0]
    lo = math.floor(math.log10(min(positive))) if positive else -8
    hi = math.ceil(math.log10(max(positive))) if positive else 0
    lo, hi = max(lo, -12), max(hi, lo + 1)
    nb = (hi - lo) * bins_per_decade
    counts = {name: [0] * nb for name in series}
    for name, vals in series.items():
        for x in vals:
            if x > 0:
                b = int((math.log10(x) - lo) * bins_per_decade)
                counts[name][min(max(b, 0), nb - 1)] += 1
    ymax = int(max([max(c) for c in counts.values() if c] + [1]))
    pw, ph = W - left - right, H - top - bottom
    text((left, 15), title, font)
    d.line([(left, top), (left, top + ph), (left + pw, top + ph)], fill="black")
    for dec in range(lo, hi + 1):
        x = left + pw * (dec - lo) / (hi - lo)
        d.line([(x, top + ph), (x, top + ph + 5)], fill="black")
        text((x - 14, top + ph + 8), f"1e{dec}")
    xlabel = "KL divergence per scored token (log scale)"
    text((left + pw // 2 - 120, H - 30), xlabel, font)
    # Whole "nice" steps (1, 2, 5 x 10^k) on the count axis, at most ~5 ticks.
    step = int(nice_step(ymax / 4, (1, 2, 5, 10))) if ymax >= 4 else 1
    ymax = step * math.ceil(ymax / step)
    for v in range(0, ymax + 1, step):
        y = top + ph - ph * v / ymax
        d.line([(left - 5, y), (left, y)], fill="black")
        text((8, y - 7), f"{v}")
    text((8, top - 25), "tokens", font)
    n = max(len(counts), 1)
    bw = pw / nb
    for i, (name, c) in enumerate(counts.items()):
        color = KL_COLORS[i % len(KL_COLORS)]
        for b, cnt in enumerate(c):
            if cnt:
                x0 = left + b * bw + i * bw / n
                # At least one pixel tall, so a bin of 1 among thousands shows.
                y0 = min(top + ph - ph * cnt / ymax, top + ph - 2)
                d.rectangle([x0, y0, x0 + bw / n - 1, top + ph - 1], fill=color)
        vals = series[name]
        zeros = sum(1 for x in vals if x == 0)
        label = f"{name}: {len(vals)} tokens, {zeros} with KL = 0"
        if len(vals) > zeros:
            pos = sorted(x for x in vals if x > 0)
            label += f", median {pos[len(pos) // 2]:.2e}, max {pos[-1]:.2e}"
        ly = top + 10 + 20 * i
        d.rectangle([left + 20, ly, left + 32, ly + 12], fill=color)
        text((left + 40, ly - 2), label)
    img.save(path)


def plot_l3(result, path: Path) -> None:
    """`make demo-l3`: Mooncake store bytes per token (left) and hit rate
    against the L3 budget (right), per format."""
    c = _Panels("INT8 vs BF16 pages in a Mooncake L3 store")
    draw = c.draw
    colors = {"bf16": COLORS[0], "int8": COLORS[1]}
    a = result["bytes_per_token"]
    stacks = [[row["bytes_per_token"]] for row in a.values()]
    left, _ = c.bars(0, list(a), stacks, [[colors[n]] for n in a], 1.15, 0.25, " B")
    c.ylabel("store bytes per cached token", left - 85)
    rows = result["hit_rate"]
    budgets = sorted({r["l3_bytes"] for r in rows})
    sy = c.scale(1.0)
    left, right = c.frame(1, sy, 1.0, 0.25, fmt="{:.0%}")
    c.ylabel("hit rate, same L3 bytes, small L2", left - 75)
    sx = lambda i: left + 50 + (right - left - 100) * i / max(1, len(budgets) - 1)  # noqa: E731
    c.dashed(left, right, sy(result["best"]))
    for i, b in enumerate(budgets):
        c.tick_label(sx(i), f"L3 {b / (1 << 20):g} MB")
    for label, color in colors.items():
        pts = [(sx(budgets.index(r["l3_bytes"])), sy(r["hit_rate"]))
               for r in rows if r["format"] == label]  # fmt: skip
        draw.line(pts, fill=color, width=3)
        for x, y in pts:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        c.text((pts[-1][0] - 10, pts[-1][1] - 12), label, "rb", c.font, color)
    c.img.save(path)
