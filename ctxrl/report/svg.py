"""Line charts as inline SVG text, for the HTML report (``ctxrl.report.html``): no plotting library, no network.

A chart is a list of ``Series``: a curve (``points=False``, one value per RL step) or markers only (``points=True``,
for evaluations, which happen every few steps: joining two of them with a straight line would draw values that were
never measured). Non-finite values (``"nan"`` in the logs) are left out. Every label is XML-escaped.

Deliberately small: linear axes, a shared x range, a legend; no log scales, zoom or interaction beyond each point's
``<title>`` tooltip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass
class Series:
    """One named curve or set of markers: ``xy`` pairs of (step, value)."""

    name: str
    xy: list[tuple[float, float]] = field(default_factory=list)
    points: bool = False
    color: str = ""
    dashed: bool = False


PLOTTABLE = 1e150
"""The largest magnitude a chart plots: past it (1e308), the span between two values overflows a float."""


def finite(value) -> float | None:
    """``value`` as a float if it is a finite number a chart can scale (the logs write NaN as the string ``"nan"``;
    past ``PLOTTABLE`` either way is left out too), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # (an integer past a float)
        return None
    return number if math.isfinite(number) and abs(number) <= PLOTTABLE else None


def _ticks(low: float, high: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values covering [low, high] (whole numbers only if ``integer``: steps)."""
    if high <= low:
        return [low]
    raw = max((high - low) / count, 1.0 if integer else 0.0)
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.2g}"
    return f"{value:.3g}"


def line_chart(series: list[Series], *, title: str, y_label: str = "", y_range: tuple[float, float] | None = None,
               width: int = 460, height: int = 250) -> str:
    """One chart as an ``<svg>`` element (a string); ``y_range`` fixes the y axis (success: 0..1)."""
    series = [s for s in series if s.xy]
    for i, s in enumerate(series):
        s.color = s.color or PALETTE[i % len(PALETTE)]
    left, right, top = 54, 12, 28
    legend_rows = (len(series) + 1) // 2
    bottom = 34 + 16 * legend_rows
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x for s in series for x, _ in s.xy]
    ys = [y for s in series for _, y in s.xy]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" class="chart-title">{escape(title)}</text>']
    if not xs:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" class="empty">not logged</text></svg>')
        return "".join(out)
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = y_range if y_range else (min(ys), max(ys))
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)

    def px(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * plot_w, 1)

    def py(y: float) -> float:
        return round(top + plot_h - (y - y0) / (y1 - y0) * plot_h, 1)

    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="plot-area"/>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(t)}" y2="{py(t)}" class="grid"/>'
                   f'<text x="{left - 4}" y="{py(t) + 4}" text-anchor="end" class="tick">{_label(t)}</text>')
    for t in _ticks(x0, x1, 6, integer=True):
        out.append(f'<text x="{px(t)}" y="{top + plot_h + 14}" text-anchor="middle" class="tick">{_label(t)}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 27}" text-anchor="middle" class="axis">step</text>')
    if y_label:
        out.append(f'<text transform="translate(12 {top + plot_h / 2}) rotate(-90)" text-anchor="middle" '
                   f'class="axis">{escape(y_label)}</text>')
    out += [_series_svg(s, px, py) for s in series]
    for i, s in enumerate(series):
        out.append(_legend_entry(s, left + (i % 2) * plot_w / 2, top + plot_h + 42 + 16 * (i // 2)))
    out.append("</svg>")
    return "".join(out)


def _series_svg(s: Series, px, py) -> str:
    """One series in the chart's pixels: its evaluations as points, anything else as a line."""
    name = escape(s.name)
    if s.points:
        return (f'<g class="series points" data-series="{name}">'
                + "".join(f'<circle cx="{px(x)}" cy="{py(y)}" r="4" fill="{s.color}" class="eval-point">'
                          f'<title>{name}: step {_label(x)}, {_label(y)}</title></circle>' for x, y in s.xy)
                + "</g>")
    path = " ".join(f"{px(x)},{py(y)}" for x, y in sorted(s.xy))
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""
    return (f'<polyline class="series line" data-series="{name}" points="{path}" fill="none" '
            f'stroke="{s.color}" stroke-width="1.8"{dash}><title>{name}</title></polyline>')


def _legend_entry(s: Series, lx: float, ly: float) -> str:
    mark = (f'<circle cx="{lx + 8}" cy="{ly - 4}" r="4" fill="{s.color}"/>' if s.points else
            f'<line x1="{lx}" x2="{lx + 16}" y1="{ly - 4}" y2="{ly - 4}" stroke="{s.color}" stroke-width="2"/>')
    return f'{mark}<text x="{lx + 22}" y="{ly}" class="legend">{escape(s.name)}</text>'
