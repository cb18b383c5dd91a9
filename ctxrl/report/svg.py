"""Line charts as inline SVG text, for the HTML report (``ctxrl.report.html``): no plotting library, no network.

A chart is a list of ``Series``: a curve (``points=False``, one value per RL step) or markers only (``points=True``,
for evaluations, which happen every few steps: joining two of them with a straight line would draw values that were
never measured). Non-finite values (``"nan"`` in the logs) are left out. Every label is XML-escaped.

Hygiene: the left margin grows with the widest tick label, so the y axis's title never overlaps the ticks; a series
whose values differ by less than ``FLAT`` of their size (float noise such as a KL of 1e-13) is drawn flat, on an axis
around its value, not stretched into a trend; a legend entry too long for its column takes the whole width, and one
too long for that is cut with "…" (the whole name in its ``<title>``).

A line series may also carry its exponential moving average (``ema``), drawn as a second curve of class
``smoothed`` beside the raw one (class ``raw``); the page shows one or the other with a checkbox and CSS alone.

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
    smooth: bool = True
    """Also draw its EMA (``ema``) for the page's smoothing toggle (a line series only)."""


EMA_WEIGHT = 0.8
"""The smoothing toggle's weight: each point is 0.8 of the average so far and 0.2 of itself (TensorBoard's slider)."""

FLAT = 1e-9
"""A series whose values span less than this times their size (at least 1) is flat: its span is float noise."""

CHAR_PX = 6.2
"""The width of one character of the charts' 11 px font, for sizing margins and legend columns."""

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


def ema(xy: list[tuple[float, float]], weight: float = EMA_WEIGHT) -> list[tuple[float, float]]:
    """The exponential moving average of ``xy`` (sorted by step), debiased so that its first point is the first value
    (as TensorBoard's smoothing): ``m_t = w m_{t-1} + (1 - w) y_t``, shown as ``m_t / (1 - w^t)``."""
    out, m = [], 0.0
    for t, (x, y) in enumerate(sorted(xy), 1):
        m = weight * m + (1 - weight) * y
        out.append((x, m / (1 - weight ** t)))
    return out


def is_flat(low: float, high: float) -> bool:
    """Whether values from ``low`` to ``high`` are one value up to float noise (``FLAT``)."""
    return high - low <= FLAT * max(1.0, abs(low), abs(high))


def _label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.2g}"
    return f"{value:.3g}"


def line_chart(series: list[Series], *, title: str, y_label: str = "", y_range: tuple[float, float] | None = None,
               x_label: str = "step", width: int = 460, height: int = 250) -> str:
    """One chart as an ``<svg>`` element (a string); ``y_range`` fixes the y axis (success: 0..1)."""
    series = [s for s in series if s.xy]
    for i, s in enumerate(series):
        s.color = s.color or PALETTE[i % len(PALETTE)]
    xs = [x for s in series for x, _ in s.xy]
    ys = [y for s in series for _, y in s.xy]
    flat = middle = None
    if xs:
        x0, x1 = min(xs), max(xs)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        y0, y1, middle = _y_axis(ys, y_range)
        flat = middle is not None
        y_ticks = _ticks(y0, y1)
        labels = [_label(t) for t in y_ticks]
    else:
        labels = []
    # the y title's column, then the widest tick label, then the axis: they never overlap
    left = 22 + 6 + int(max((len(t) for t in labels), default=1) * CHAR_PX)
    right, top = 12, 28
    plot_w = width - left - right
    rows = _legend_rows(series, plot_w)
    bottom = 34 + 16 * (max(r for r, _, _ in rows) + 1 if rows else 0)
    plot_h = height - top - bottom
    if plot_h < 80:  # a long legend makes the chart taller rather than the plot smaller
        height += 80 - plot_h
        plot_h = 80
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" class="chart-title">{escape(title)}</text>']
    if not xs:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" class="empty">not logged</text></svg>')
        return "".join(out)

    def px(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * plot_w, 1)

    def py(y: float) -> float:
        return round(top + plot_h - (y - y0) / (y1 - y0) * plot_h, 1)

    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="plot-area"/>')
    for t, label in zip(y_ticks, labels):
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(t)}" y2="{py(t)}" class="grid"/>'
                   f'<text x="{left - 4}" y="{py(t) + 4}" text-anchor="end" class="tick">{label}</text>')
    for t in _ticks(x0, x1, 6, integer=True):
        out.append(f'<text x="{px(t)}" y="{top + plot_h + 14}" text-anchor="middle" class="tick">{_label(t)}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 27}" text-anchor="middle" class="axis">'
               f'{escape(x_label)}</text>')
    if y_label:
        out.append(f'<text transform="translate(12 {top + plot_h / 2}) rotate(-90)" text-anchor="middle" '
                   f'class="axis">{escape(y_label)}</text>')
    if flat:
        out.append(_flatten(series, middle, left + plot_w - 4, top + 12))
    out += [_series_svg(s, px, py) for s in series]
    out += [_legend_entry(s, text, left + column * plot_w / 2, top + plot_h + 42 + 16 * row)
            for s, (row, column, text) in zip(series, rows)]
    out.append("</svg>")
    return "".join(out)


def _flatten(series: list[Series], middle: float, x: float, y: float) -> str:
    """Draw float noise as the one value it is: every series at ``middle``; the note that says so, at (x, y)."""
    for s in series:
        s.xy = [(px, middle) for px, _ in s.xy]
    return f'<text x="{x}" y="{y}" text-anchor="end" class="flat-note">flat: every value {_label(middle)}</text>'


def _y_axis(ys: list[float], y_range: tuple[float, float] | None) -> tuple[float, float, float | None]:
    """(low, high, the one value or None): ``y_range`` as given, else the values' span; a span of one value up to
    float noise gets an axis around that value (returned third), so that noise is not drawn as a trend."""
    y0, y1 = y_range if y_range else (min(ys), max(ys))
    if y_range or not is_flat(y0, y1):
        return y0, y1, None
    middle = (y0 + y1) / 2
    middle = 0.0 if abs(middle) <= FLAT else middle
    return middle - (abs(middle) * 0.1 or 1), middle + (abs(middle) * 0.1 or 1), middle


def _legend_rows(series: list[Series], plot_w: float) -> list[tuple[int, int, str]]:
    """(row, column, shown name) of each legend entry: two columns while every name fits half the width, else one
    entry a row, a name too long even for that cut with "…"."""
    fits = int((plot_w - 22) / CHAR_PX)
    half = int((plot_w / 2 - 26) / CHAR_PX)
    if all(len(s.name) <= half for s in series):
        return [(i // 2, i % 2, s.name) for i, s in enumerate(series)]
    return [(i, 0, s.name if len(s.name) <= fits else s.name[:fits - 1] + "…") for i, s in enumerate(series)]


def _series_svg(s: Series, px, py) -> str:
    """One series in the chart's pixels: its evaluations as points, anything else as a line."""
    name = escape(s.name)
    if s.points:
        return (f'<g class="series points" data-series="{name}">'
                + "".join(f'<circle cx="{px(x)}" cy="{py(y)}" r="4" fill="{s.color}" class="eval-point">'
                          f'<title>{name}: step {_label(x)}, {_label(y)}</title></circle>' for x, y in s.xy)
                + "</g>")
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""

    def polyline(xy: list[tuple[float, float]], kind: str, title: str) -> str:
        path = " ".join(f"{px(x)},{py(y)}" for x, y in sorted(xy))
        return (f'<polyline class="series line {kind}" data-series="{name}" points="{path}" fill="none" '
                f'stroke="{s.color}" stroke-width="1.8"{dash}><title>{title}</title></polyline>')

    if not s.smooth or len(s.xy) < 3:
        return polyline(s.xy, "", name)
    return (polyline(s.xy, "raw", name)
            + polyline(ema(s.xy), "smoothed", f"{name}, EMA (weight {EMA_WEIGHT})"))


def _legend_entry(s: Series, text: str, lx: float, ly: float) -> str:
    mark = (f'<circle cx="{lx + 8}" cy="{ly - 4}" r="4" fill="{s.color}"/>' if s.points else
            f'<line x1="{lx}" x2="{lx + 16}" y1="{ly - 4}" y2="{ly - 4}" stroke="{s.color}" stroke-width="2"/>')
    return (f'{mark}<text x="{lx + 22}" y="{ly}" class="legend">{escape(text)}<title>{escape(s.name)}</title>'
            '</text>')

