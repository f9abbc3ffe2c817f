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

from mmserve.bench.report import grid_table
from mmserve.bench.throughput import ThroughputRun
from mmserve.config import EngineConfig

# Settings a sweep can vary: the numeric ones, the switches and those with a list of choices
# (not the model, its dtype and device, or free-form text).
_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)
           if f.name not in ("model", "dtype", "device", "seed")
           and (not isinstance(f.default, str) or f.metadata.get("choices"))
           and not str(f.type).startswith(("tuple", "dict"))}

_BOOLEANS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}

SweepValue = float | int | bool | str | None


def parse_param(text: str) -> tuple[str, list[SweepValue]]:
    """``name=v1,v2,...`` -> (name, values). Numbers for numeric settings (``auto`` or ``none``
    leaves the value to the engine), ``true``/``false`` for switches, one of its choices for a
    setting that has them (``encoder_cache_eviction=queue-aware,lru``)."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not values:
        raise ValueError(f"--param must be name=v1,v2,..., got {text!r}.")
    field = _FIELDS.get(name)
    if field is None:
        raise ValueError(f"--param {name!r} is not an engine setting a sweep can vary; choose "
                         f"one of {', '.join(sorted(_FIELDS))}.")
    return name, [_parse_value(field, v.strip()) for v in values.split(",")]


def _parse_value(field: dataclasses.Field, v: str) -> SweepValue:
    choices = field.metadata.get("choices")
    if choices:
        if v not in choices:
            raise ValueError(f"--param {field.name}: {v!r} is not one of {', '.join(choices)}.")
        return v
    if isinstance(field.default, bool):
        if v.lower() not in _BOOLEANS:
            raise ValueError(f"--param {field.name}: {v!r} is not true or false.")
        return _BOOLEANS[v.lower()]
    if v.lower() in ("auto", "none"):
        return None
    try:
        return float(v) if "." in v else int(v)
    except ValueError:
        raise ValueError(f"--param {field.name}: {v!r} is not a number or 'auto'.") from None


def run_sweep(
    name: str,
    values: list[SweepValue],
    run_one: Callable[[dict[str, Any]], ThroughputRun],
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Call ``run_one({name: value})`` for every value, ``repeats`` turns over all the values
    (so a change in the machine's speed moves every value's figures alike); one row per value:
    the results of its median-throughput turn, with every turn's output tokens/s."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    turns: list[list[dict[str, Any]]] = [[] for _ in values]
    for _ in range(repeats):
        for i, value in enumerate(values):
            run = run_one({name: value})
            turns[i].append(run.results)
            del run
            gc.collect()  # drop the previous engine's KV cache before building the next
    rows = []
    for value, results in zip(values, turns, strict=True):
        ranked = sorted(results, key=lambda r: r["output_tokens_per_s"])
        rows.append({"param": name, "value": value, **ranked[(len(ranked) - 1) // 2],
                     "turns_output_tokens_per_s": [r["output_tokens_per_s"] for r in results]})
    return rows


_COLUMNS = (
    ("req/s", lambda r: r["requests_per_s"]),
    ("out tok/s", lambda r: r["output_tokens_per_s"]),
    ("enc hit rate", lambda r: r["encoder_cache_hit_rate"]),
    ("images encoded", lambda r: r["encoder_items_computed"]),
    ("evictions cap/KV", lambda r: f"{r['encoder_cache_evictions']}/"
                                   f"{r['encoder_cache_kv_pressure_evictions']}"),
    ("restores", lambda r: r["encoder_cache_restores"]),
    ("enc cache peak", lambda r: f"{r['peak_encoder_cache_usage']:.0%}"),
    ("preemptions", lambda r: r["num_preemptions"]),
    ("peak KV", lambda r: f"{r['peak_kv_usage']:.0%}"),
    ("TTFT p50 s", lambda r: r["ttft_s"]["median"]),
    ("E2E p90 s", lambda r: r["e2e_latency_s"]["p90"]),
)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """One row per value; with several turns, the median turn's figures, then every turn's
    output tokens/s and each turn's ratio to the first value's in that turn."""
    name = rows[0]["param"] if rows else "value"
    table = grid_table([name, *(c for c, _ in _COLUMNS)],
                       [["auto" if r["value"] is None else r["value"],
                         *(get(r) for _, get in _COLUMNS)] for r in rows])
    if not rows or len(rows[0].get("turns_output_tokens_per_s", ())) < 2:
        return table
    first = rows[0]["turns_output_tokens_per_s"]
    lines = [f"(median of {len(first)} turns; output tokens/s of each turn, and its ratio to "
             f"{name}={_label(rows[0]['value'])} in the same turn)"]
    for r in rows:
        turns = r["turns_output_tokens_per_s"]
        lines.append(f"  {_label(r['value'])}: " + ", ".join(
            f"{t:.2f} ({t / f:.3f})" for t, f in zip(turns, first, strict=True)))
    return table + "\n" + "\n".join(lines)


def _label(value: SweepValue) -> str:
    return "auto" if value is None else str(value)
