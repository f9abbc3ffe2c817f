"""`mmserve bench sweep`: one workload across values of one engine setting.

Each value gets a fresh engine (the setting shapes the memory plan and the caches), the same
workload and the same measurement as `bench throughput`; the table and plot show throughput,
encoder-cache hit rate and latency against the setting, e.g. to size the encoder cache for a
given traffic.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

from mmserve.bench.report import grid_table, plot_panels
from mmserve.bench.throughput import ThroughputRun
from mmserve.config import EngineConfig

# Settings a sweep can vary: the numeric ones (booleans and names are not swept).
_NUMERIC_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)
                   if f.name not in ("model", "dtype", "device", "seed")
                   and not isinstance(f.default, (bool, str))}


def parse_param(text: str) -> tuple[str, list[float | None]]:
    """``name=v1,v2,...`` -> (name, values); ``auto`` or ``none`` leaves the value to the engine."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not values:
        raise ValueError(f"--param must be name=v1,v2,..., got {text!r}.")
    if name not in _NUMERIC_FIELDS:
        raise ValueError(f"--param {name!r} is not a numeric engine setting; choose one of "
                         f"{', '.join(sorted(_NUMERIC_FIELDS))}.")
    parsed: list[float | None] = []
    for v in values.split(","):
        v = v.strip()
        if v.lower() in ("auto", "none"):
            parsed.append(None)
            continue
        try:
            parsed.append(float(v) if "." in v else int(v))
        except ValueError:
            raise ValueError(f"--param {name}: {v!r} is not a number or 'auto'.") from None
    return name, parsed


def run_sweep(
    name: str,
    values: list[float | None],
    run_one: Callable[[dict[str, Any]], ThroughputRun],
) -> list[dict[str, Any]]:
    """Call ``run_one({name: value})`` for every value; one result row per value."""
    rows = []
    for value in values:
        run = run_one({name: value})
        rows.append({"param": name, "value": value, **run.results})
        del run
        gc.collect()  # drop the previous engine's KV cache before building the next
    return rows


_COLUMNS = (
    ("req/s", lambda r: r["requests_per_s"]),
    ("out tok/s", lambda r: r["output_tokens_per_s"]),
    ("enc hit rate", lambda r: r["encoder_cache_hit_rate"]),
    ("images encoded", lambda r: r["encoder_items_computed"]),
    ("evictions", lambda r: r["encoder_cache_evictions"]),
    ("enc cache peak", lambda r: f"{r['peak_encoder_cache_usage']:.0%}"),
    ("preemptions", lambda r: r["num_preemptions"]),
    ("peak KV", lambda r: f"{r['peak_kv_usage']:.0%}"),
    ("TTFT p50 s", lambda r: r["ttft_s"]["median"]),
    ("E2E p90 s", lambda r: r["e2e_latency_s"]["p90"]),
)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    name = rows[0]["param"] if rows else "value"
    return grid_table([name, *(c for c, _ in _COLUMNS)],
                      [["auto" if r["value"] is None else r["value"],
                        *(get(r) for _, get in _COLUMNS)] for r in rows])


def plot_sweep(rows: list[dict[str, Any]], path: str) -> None:
    """Throughput, hit rate and latency against the setting (``auto`` values are left out)."""
    rows = [r for r in rows if r["value"] is not None]
    if not rows:
        return
    rows = sorted(rows, key=lambda r: r["value"])
    plot_panels(path, [r["value"] for r in rows], [
        ("output tokens/s", [r["output_tokens_per_s"] for r in rows]),
        ("encoder cache hit rate", [r["encoder_cache_hit_rate"] for r in rows]),
        ("E2E latency p90 (s)", [r["e2e_latency_s"]["p90"] for r in rows]),
    ], x_label=rows[0]["param"], title=f"mmserve bench sweep over {rows[0]['param']}")
