"""Result tables a person reads at a glance, and JSON files (the plots: `mmserve.bench.plots`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


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
