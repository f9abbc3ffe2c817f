"""Prometheus metrics of one server, in a registry of its own (several apps may share a process).

Request-level series (outcomes, tokens, latencies) are updated as requests progress; engine
counters and gauges (cache usage, hits, preemptions) are read from the engine's stats snapshot
at scrape time. The series vLLM also has are exported under its ``vllm:`` names too (``VLLM``
below), so that dashboards and autoscalers written for a vLLM server read this one.
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
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1 to 5,000,000

_VLLM_FINISH_REASONS = ("stop", "length", "abort")
# mmserve's series that vLLM has too, and vLLM's names for them.
VLLM = {
    "mmserve_num_requests_running": "vllm:num_requests_running",
    "mmserve_num_requests_waiting": "vllm:num_requests_waiting",
    "mmserve_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "mmserve_num_preemptions": "vllm:num_preemptions",
    "mmserve_prefix_cache_queried_tokens": "vllm:prefix_cache_queries",
    "mmserve_prefix_cache_hit_tokens": "vllm:prefix_cache_hits",
    "mmserve_prompt_tokens": "vllm:prompt_tokens",
    "mmserve_generation_tokens": "vllm:generation_tokens",
    "mmserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "mmserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "mmserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "mmserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "mmserve_request_generation_tokens": "vllm:request_generation_tokens",
}


class ServerMetrics:
    """Implements the engine loop's ``RequestObserver`` hooks and renders ``/metrics``."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        self.requests = Counter(
            "mmserve_requests", "Chat requests by outcome: finish reason (stop, length, abort) "
            "or rejected (a 4xx answer) or error (a 5xx answer).",
            ["model_name", "status"], registry=self.registry)
        # vLLM's count of requests that finished (not those refused, nor those a failed step
        # ended), by finish reason, each from 0.
        self.finished = Counter(
            "vllm:request_success", "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        for reason in _VLLM_FINISH_REASONS:
            self.finished.labels(model_name=model_name, finished_reason=reason)
        self.prompt_tokens = self._both(
            Counter, "mmserve_prompt_tokens", "Prompt tokens of finished requests, image "
            "placeholders included.")
        self.generation_tokens = self._both(
            Counter, "mmserve_generation_tokens", "Generated tokens of finished requests.")
        self.ttft = self._both(
            Histogram, "mmserve_time_to_first_token_seconds", "From arrival to the first "
            "generated token.", buckets=_TTFT_BUCKETS)
        self.itl = self._both(
            Histogram, "mmserve_inter_token_latency_seconds", "Between consecutive generated "
            "tokens.", buckets=_ITL_BUCKETS)
        self.e2e = self._both(
            Histogram, "mmserve_e2e_request_latency_seconds", "From arrival to the last "
            "output, of finished requests.", buckets=_E2E_BUCKETS)
        self.request_prompt_tokens = self._both(
            Histogram, "mmserve_request_prompt_tokens", "Prompt tokens of each finished "
            "request, image placeholders included.", buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = self._both(
            Histogram, "mmserve_request_generation_tokens", "Generated tokens of each finished "
            "request.", buckets=_TOKEN_BUCKETS)
        self.responses = Counter(
            "mmserve_http_responses", "HTTP responses by status code, on every path.",
            ["model_name", "code"], registry=self.registry)
        self.registry.register(_EngineCollector(model_name, engine_stats))

    def _both(self, kind: type, name: str, doc: str, **kwargs: Any) -> _Both:
        """A series of this model under ``name`` and under vLLM's name for it."""
        return _Both([kind(n, doc, ["model_name"], registry=self.registry, **kwargs).labels(
            model_name=self._model_name) for n in (name, VLLM[name])])

    # RequestObserver hooks, called on the event loop.
    def on_first_token(self, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)

    def on_next_token(self, seconds_since_previous: float) -> None:
        self.itl.observe(seconds_since_previous)

    def on_finished(self, finish_reason: str, num_prompt_tokens: int,
                    num_generation_tokens: int, seconds_since_arrival: float) -> None:
        self.count(finish_reason)
        if finish_reason in _VLLM_FINISH_REASONS:
            self.finished.labels(model_name=self._model_name,
                                 finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        if finish_reason in ("stop", "length"):  # (not a client gone, nor a failed step)
            self.e2e.observe(seconds_since_arrival)
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(num_generation_tokens)

    def count(self, status: str) -> None:
        self.requests.labels(model_name=self._model_name, status=status).inc()

    def count_response(self, code: int) -> None:
        self.responses.labels(model_name=self._model_name, code=str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Both:
    """Two series that take the same values (mmserve's and vLLM's names)."""

    def __init__(self, series: list[Any]) -> None:
        self.series = series

    def inc(self, amount: float = 1) -> None:
        for one in self.series:
            one.inc(amount)

    def observe(self, value: float) -> None:
        for one in self.series:
            one.observe(value)


class _EngineCollector(Collector):
    """Engine counters and gauges from the stats snapshot (``LLMEngine.stats`` keys)."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []  # dynamic: described by collect() at scrape time

    def collect(self) -> Iterator[Metric]:
        """Each series, and again under vLLM's name where it has one."""
        for metric in self._collect():
            yield metric
            twin = VLLM.get(metric.name)
            if twin is not None:
                renamed = Metric(twin, metric.documentation, metric.type)
                renamed.samples = [sample._replace(name=twin + sample.name[len(metric.name):])
                                   for sample in metric.samples]
                yield renamed

    def _collect(self) -> Iterator[Metric]:
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
