"""The `--plot` figures of `mmserve bench`, drawn with matplotlib (the optional ``bench`` extra).

- `plot_timeline`: `bench throughput`'s engine steps, panels sharing the time axis;
- `plot_sweep`: `bench sweep`'s results against the swept setting's values;
- `plot_latency_cdf`: `bench serve`'s TTFT and ITL empirical CDFs.

matplotlib is imported inside the functions, so the rest of the bench runs without it; the
commands call `check_plot_path` before they run anything, so a missing matplotlib or an image
format it cannot write costs no benchmark run. Figures are `matplotlib.figure.Figure` objects
saved through the Agg canvas: no pyplot, no global state, no display needed. Each function
saves the figure to ``path`` and returns it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.bench.stats import percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mmserve.bench.throughput import TimelineStep

MATPLOTLIB_MISSING = '--plot needs matplotlib: pip install "mmserve[bench]"'
DPI = 120
# matplotlib's default colour cycle (tab10), by name so each panel can pick its own.
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def check_plot_path(path: str | Path) -> None:
    """Raise ``ValueError`` (with a message for the user) unless ``path`` can be plotted to:
    matplotlib is importable and writes the format the file name's suffix asks for."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(MATPLOTLIB_MISSING) from None
    suffix = Path(path).suffix.lower().removeprefix(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib does not write .{suffix} files; use "
                         ".png, .svg or .pdf (or one of ." + ", .".join(sorted(formats)) + ")")


def _figure(width: float, height: float) -> Figure:
    try:
        import matplotlib  # noqa: F401  (first: a submodule left in sys.modules would hide it)
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None
    return Figure(figsize=(width, height), dpi=DPI)


def _save(fig: Figure, path: str | Path) -> None:
    """Tight layout, then PNG (or the format the suffix names; PNG without one) at `DPI`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attaches itself; vector formats switch canvas inside savefig
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format=None if path.suffix else "png", facecolor="white")


def _grid(ax: Axes) -> None:
    ax.grid(True, color="0.9", linewidth=0.8)
    ax.set_axisbelow(True)


# ------------------------------------------------------------------ bench throughput
def plot_timeline(steps: Sequence[TimelineStep], path: str | Path) -> Figure:
    """Per-step timeline of `bench throughput`: one panel per quantity, all against the seconds
    since the first request was added; each step's value is drawn flat over that step's own
    interval (from its start to its end), so a long step reads as a wide bar."""
    panels: list[tuple[str, str, list[tuple[str, list[float]]]]] = [
        ("Tokens scheduled per step", "tokens",
         [("tokens scheduled", [s.scheduled_tokens for s in steps])]),
        ("Requests", "requests",
         [("running", [s.running for s in steps]), ("waiting", [s.waiting for s in steps])]),
        ("KV cache", "blocks in use", [("KV blocks in use", [s.kv_blocks_used for s in steps])]),
        ("Encoder cache", "tokens",
         [("in the encoder-cache reserve", [s.encoder_cache_used_tokens for s in steps]),
          ("borrowed from free KV blocks",
           [s.encoder_cache_borrowed_tokens for s in steps])]),
        ("Image tokens encoded per step", "tokens",
         [("image tokens encoded", [s.image_tokens_encoded for s in steps])]),
        ("Step time", "ms", [("step time", [1e3 * s.duration_s for s in steps])]),
    ]
    fig = _figure(10, 2.0 * len(panels) + 0.8)
    axes = fig.subplots(len(panels), 1, sharex=True)
    # Each step is the pair (start, end) at its value; consecutive steps join at the edges.
    x = [t for s in steps for t in (s.end_s - s.duration_s, s.end_s)]
    color = iter(_COLORS * 2)
    for ax, (title, unit, series) in zip(axes, panels, strict=True):
        for label, values in series:
            y = [v for v in values for _ in range(2)]
            c = next(color)
            ax.plot(x, y, color=c, linewidth=1.2, label=label)
            ax.fill_between(x, y, color=c, alpha=0.15, linewidth=0)
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.margins(x=0)
        if len(series) > 1:
            ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
        _grid(ax)
    if steps:  # from 0: a gap before the first step is the requests' preprocessing
        axes[-1].set_xlim(0, steps[-1].end_s)
    else:
        axes[0].text(0.5, 0.5, "no engine steps", transform=axes[0].transAxes, ha="center")
    axes[-1].set_xlabel("time since the first request was added (s)")
    fig.suptitle(f"mmserve bench throughput: {len(steps)} engine steps", fontsize=12)
    _save(fig, path)
    return fig


# ------------------------------------------------------------------ bench sweep
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sweep_panels(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, y label, [(series label, dotted key into the row)]) for the figures the rows hold."""
    candidates = [
        ("Throughput", "output tokens/s", [("output tokens/s", "output_tokens_per_s")]),
        ("Encoder-cache hit rate", "share of requested images",
         [("hit rate", "encoder_cache_hit_rate")]),
        ("Images encoded, encoder-cache evictions", "images",
         [("images encoded", "encoder_items_computed"),
          ("evictions (capacity)", "encoder_cache_evictions"),
          ("evictions (KV pressure)", "encoder_cache_kv_pressure_evictions")]),
        ("Latency (a full backlog from the start)", "seconds",
         [("TTFT p50", "ttft_s.median"), ("TTFT p99", "ttft_s.p99"),
          ("E2E p50", "e2e_latency_s.median"), ("E2E p99", "e2e_latency_s.p99")]),
    ]
    panels = []
    for title, unit, series in candidates:
        kept = [(label, key) for label, key in series
                if all(_is_number(_lookup(r, key)) for r in rows)]
        if kept and rows:
            panels.append((title, unit, kept))
    return panels


def _lookup(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _value_label(v: Any) -> str:
    if v is None:
        return "auto"
    if isinstance(v, float) and v.is_integer():
        return f"{v:g}"
    return str(v)


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path) -> Figure:
    """`bench sweep`'s rows against the swept setting: output tokens/s, encoder-cache hit rate,
    images encoded (and evictions), TTFT and end-to-end latency percentiles.

    Numeric values go on a numeric axis in increasing order (logarithmic when they span more
    than a factor of 10) and joined by lines; if any value is not a number (``auto``, a policy
    name, a switch) every value is a category, in the order swept, drawn as grouped bars.
    """
    param = rows[0]["param"] if rows else "value"
    values = [r["value"] for r in rows]
    numeric = bool(rows) and all(_is_number(v) for v in values)
    if numeric:
        order = sorted(range(len(rows)), key=lambda i: values[i])
        rows = [rows[i] for i in order]
        xs: list[float] = [r["value"] for r in rows]
    else:
        xs = list(range(len(rows)))
    labels = [_value_label(r["value"]) for r in rows]
    panels = _sweep_panels(rows)
    ncols = 2 if len(panels) > 1 else 1
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = _figure(5.2 * ncols, 3.3 * nrows + 0.6)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    log_x = numeric and min(xs) > 0 and max(xs) / min(xs) > 10
    for ax, (title, unit, series) in zip(axes, panels, strict=False):
        width = 0.8 / len(series)
        for i, (label, key) in enumerate(series):
            ys = [_lookup(r, key) for r in rows]
            color = _COLORS[i % len(_COLORS)]
            if numeric:  # a curve through the measured values; equal values stay visible
                ax.plot(xs, ys, marker="osD^"[i % 4], markersize=8 - 1.5 * i, color=color,
                        label=label, clip_on=False, zorder=3)
            else:  # unordered categories: grouped bars, no line between them
                ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], ys, width,
                       color=color, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.set_xlabel(param)
        if log_x:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(xs, labels, rotation=30 if max(map(len, labels), default=0) > 6 else 0)
        if not numeric:
            ax.set_xlim(-0.5, len(xs) - 0.5)
        if any(key == "encoder_cache_hit_rate" for _, key in series):
            ax.set_ylim(-0.03 if numeric else 0, 1.03)
            ax.yaxis.set_major_formatter(_percent())
        else:
            ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9))
        if len(series) > 1:
            ax.legend(fontsize=8)
        _grid(ax)
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    if not rows:
        axes[0].text(0.5, 0.5, "no sweep results", transform=axes[0].transAxes, ha="center")
    fig.suptitle(f"mmserve bench sweep over {param}: {len(rows)} values", fontsize=12)
    _save(fig, path)
    return fig


def _plain_numbers():
    """Log-axis tick labels as 10, 100, 1,000 and 0.1 rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,g}" if v >= 1 else f"{v:g}")


def _percent():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0, decimals=0)


# ------------------------------------------------------------------ bench serve
def plot_latency_cdf(ttft_ms: Sequence[float], itl_ms: Sequence[float],
                     path: str | Path, title: str = "mmserve bench serve") -> Figure:
    """Empirical CDFs of time to first token (one sample per request) and inter-token latency
    (one per gap between streamed chunks), in milliseconds, with the median and p99 marked
    (the same percentiles as the result table)."""
    fig = _figure(11, 4.2)
    axes = fig.subplots(1, 2)
    for ax, (name, what, samples, color) in zip(axes, [
        ("TTFT", "requests", ttft_ms, _COLORS[0]),
        ("ITL", "token gaps", itl_ms, _COLORS[1]),
    ], strict=True):
        values = sorted(v for v in samples if not math.isnan(v))
        n = len(values)
        ax.set_title(f"{name}: {n:,} {what}", fontsize=10)
        # A long tail (a few gaps stalled behind another request's prefill) would squeeze the
        # body of the distribution into one corner: then the axis is logarithmic.
        log_x = bool(values) and values[0] > 0 and values[-1] / values[0] > 20
        ax.set_xlabel(f"{name} (ms{', log scale' if log_x else ''})")
        if log_x:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(_plain_numbers())
        ax.set_ylabel(f"fraction of {what}")
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(_percent())
        _grid(ax)
        if not values:
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center")
            continue
        # The empirical CDF: after the i-th smallest value, i/n of the samples are at most it.
        ax.step([values[0], *values], [0.0, *((i + 1) / n for i in range(n))], where="post",
                color=color, linewidth=1.6, label="empirical CDF")
        for q, style, mark in ((50, "--", "median"), (99, ":", "p99")):
            v = percentile(values, q)
            ax.axvline(v, color="0.3", linestyle=style, linewidth=1.2,
                       label=f"{mark} {v:,.1f} ms")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{title}: latency CDFs", fontsize=12)
    _save(fig, path)
    return fig
