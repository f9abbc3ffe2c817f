"""Result tables a person reads at a glance, JSON files, and line plots drawn with Pillow.

Pillow is already a dependency (images); a few polylines do not justify matplotlib.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

_COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14))


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
            if abs(value) >= scale:
                return f"{value / scale:,.1f} {suffix}"
        return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def section_table(title: str, sections: Sequence[tuple[str, Sequence[tuple[str, Any]]]]) -> str:
    """A two-column table under a title, split into named sections."""
    rows = [(k, fmt(v)) for _, items in sections for k, v in items]
    width = max(len(k) for k, _ in rows) + 2
    value_width = max(len(v) for _, v in rows)
    rule = "=" * (width + value_width + 2)
    lines = [rule, title.center(len(rule)).rstrip(), rule]
    for name, items in sections:
        if name:
            lines.append(f"-- {name} ".ljust(len(rule), "-"))
        lines.extend(f"{k:<{width}}{fmt(v):>{value_width + 2}}" for k, v in items)
    lines.append(rule)
    return "\n".join(lines)


def grid_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table with a header row; numbers right-aligned."""
    cells = [list(header)] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def plot_panels(
    path: str | Path,
    x: Sequence[float],
    panels: Sequence[tuple[str, Sequence[float]]],
    x_label: str,
    title: str,
    width: int = 900,
    panel_height: int = 150,
) -> None:
    """Stacked line charts sharing one x axis, one panel per series, saved as PNG."""
    margin_left, margin_right, top, gap = 70, 20, 36, 34
    height = top + len(panels) * (panel_height + gap) + 20
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((margin_left, 10), title, fill="black")
    x_lo, x_hi = (min(x), max(x)) if x else (0.0, 1.0)
    x_span = (x_hi - x_lo) or 1.0
    plot_w = width - margin_left - margin_right
    for i, (name, ys) in enumerate(panels):
        y0 = top + i * (panel_height + gap) + 14
        y_hi = max(max(ys, default=0), 1e-12)
        draw.text((margin_left, y0 - 14), name, fill=_COLORS[i % len(_COLORS)])
        draw.rectangle([margin_left, y0, margin_left + plot_w, y0 + panel_height],
                       outline=(160, 160, 160))
        draw.text((4, y0 - 4), fmt(max(ys, default=0)), fill="gray")
        draw.text((4, y0 + panel_height - 10), "0", fill="gray")
        points = [(margin_left + (xv - x_lo) / x_span * plot_w,
                   y0 + panel_height - yv / y_hi * panel_height)
                  for xv, yv in zip(x, ys, strict=True)]
        if len(points) == 1:
            px, py = points[0]
            draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=_COLORS[i % len(_COLORS)])
        elif points:
            draw.line(points, fill=_COLORS[i % len(_COLORS)], width=2)
    bottom = top + len(panels) * (panel_height + gap) - gap + 16
    draw.text((margin_left, bottom), f"{fmt(float(x_lo))}", fill="gray")
    draw.text((margin_left + plot_w - 60, bottom), f"{fmt(float(x_hi))}", fill="gray")
    draw.text((margin_left + plot_w // 2 - 30, bottom), x_label, fill="black")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
