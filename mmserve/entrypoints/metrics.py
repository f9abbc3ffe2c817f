"""Prometheus metrics of one server, in a registry of its own (several apps may share a process).

Request-level series (outcomes, tokens, latencies) are updated as requests progress; engine
counters and gauges (cache usage, hits, preemptions) are read from the engine's stats snapshot
at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Implements the engine loop's ``RequestObserver`` hooks and renders ``/metrics``."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self.requests = Counter(
            "mmserve_requests", "Chat requests by outcome: finish reason (stop, length, abort) "
            "or rejected (a 4xx answer) or error (a 5xx answer).",
            ["model_name", "status"], registry=self.registry)
        self.prompt_tokens = Counter(
            "mmserve_prompt_tokens", "Prompt tokens of finished requests, image placeholders "
            "included.", ["model_name"], registry=self.registry).labels(**labels)
        self.generation_tokens = Counter(
            "mmserve_generation_tokens", "Generated tokens of finished requests.",
            ["model_name"], registry=self.registry).labels(**labels)
        self.ttft = Histogram(
            "mmserve_time_to_first_token_seconds", "From arrival to the first generated token.",
            ["model_name"], buckets=_TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram(
            "mmserve_inter_token_latency_seconds", "Between consecutive generated tokens.",
            ["model_name"], buckets=_ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.responses = Counter(
            "mmserve_http_responses", "HTTP responses by status code, on every path.",
            ["model_name", "code"], registry=self.registry)
        self._model_name = model_name
        self.registry.register(_EngineCollector(model_name, engine_stats))

    # RequestObserver hooks, called on the event loop.
    def on_first_token(self, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)

    def on_next_token(self, seconds_since_previous: float) -> None:
        self.itl.observe(seconds_since_previous)

    def on_finished(self, finish_reason: str, num_prompt_tokens: int,
                    num_generation_tokens: int) -> None:
        self.count(finish_reason)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)

    def count(self, status: str) -> None:
        self.requests.labels(model_name=self._model_name, status=status).inc()

    def count_response(self, code: int) -> None:
        self.responses.labels(model_name=self._model_name, code=str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine counters and gauges from the stats snapshot (``LLMEngine.stats`` keys)."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []  # dynamic: described by collect() at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            return c

        total = max(1, s["kv_blocks_total"])
        enc_total = max(1, s["encoder_cache_tokens"])
        yield gauge("mmserve_num_requests_running", "Requests being computed.", s["num_running"])
        yield gauge("mmserve_num_requests_waiting", "Requests queued or preempted.",
                    s["num_waiting"])
        yield gauge("mmserve_kv_cache_usage_perc", "Share of KV blocks in use (0 to 1).",
                    (total - s["kv_blocks_free"]) / total)
        yield gauge("mmserve_encoder_cache_usage_perc",
                    "Share of the encoder cache's embedding tokens holding images (0 to 1).",
                    s["encoder_cache_used_tokens"] / enc_total)
        yield counter("mmserve_encoder_cache_hits", "Images found in the encoder cache.",
                      s["encoder_cache_hits"])
        yield counter("mmserve_encoder_cache_misses", "Images that had to be encoded.",
                      s["encoder_cache_misses"])
        evictions = CounterMetricFamily(
            "mmserve_encoder_cache_evictions", "Encoder cache entries dropped, by reason: "
            "capacity (the reserve was full and no free KV block could take them), kv_pressure "
            "(the KV cache took back the blocks they borrowed).", labels=["model_name", "reason"])
        evictions.add_metric([self.model_name, "capacity"], s["encoder_cache_evictions"])
        evictions.add_metric([self.model_name, "kv_pressure"],
                             s["encoder_cache_kv_pressure_evictions"])
        yield evictions
        yield gauge("mmserve_encoder_cache_reserve_tokens", "The encoder cache's own memory, in "
                    "embedding tokens.", s["encoder_cache_tokens"])
        yield gauge("mmserve_encoder_cache_borrowed_entries", "Image embeddings kept in free KV "
                    "blocks.", s["encoder_cache_borrowed_entries"])
        yield gauge("mmserve_encoder_cache_borrowed_bytes", "Bytes of KV blocks lent to image "
                    "embeddings.", s["encoder_cache_borrowed_bytes"])
        lookups = s["encoder_cache_hits"] + s["encoder_cache_misses"]
        yield gauge("mmserve_encoder_cache_hit_rate", "Share of image lookups found in the "
                    "encoder cache (reserve or borrowed blocks), 0 to 1.",
                    s["encoder_cache_hits"] / lookups if lookups else 0.0)
        yield counter("mmserve_num_failed_requests", "Requests an engine step failed for "
                      "(finished with an error while the others went on).",
                      s["num_failed_requests"])
        yield gauge("mmserve_preprocess_peak_bytes", "The largest memory peak of one request's "
                    "preprocessing so far (estimated from its images' sizes).",
                    s["preprocess_peak_bytes"])
        yield counter("mmserve_memory_releases", "Times preprocessing's freed memory was "
                      "returned to the operating system.", s["num_memory_releases"])
        yield counter("mmserve_num_preemptions", "Requests preempted for lack of KV blocks.",
                      s["num_preemptions"])
        yield counter("mmserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix "
                      "cache.", s["prefix_cache_hit_tokens"])
        yield counter("mmserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                      "prefix cache.", s["prefix_cache_queried_tokens"])
        yield counter("mmserve_engine_steps", "Engine steps run.", s["num_steps"])
        yield counter("mmserve_engine_step_seconds", "Wall seconds the engine spent in steps "
                      "(its rate is the share of the time it computed rather than waited for "
                      "work).", s["step_seconds"])
        yield counter("mmserve_scheduled_tokens", "Prompt and decode tokens scheduled into "
                      "engine steps (over mmserve_engine_steps: tokens per step).",
                      s["num_scheduled_tokens"])
