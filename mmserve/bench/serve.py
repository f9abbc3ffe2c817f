"""`mmserve bench serve`: load an OpenAI-compatible chat server over HTTP and time it.

Requests are streamed (``stream_options.include_usage``) so every token's arrival is seen:
TTFT (time to first token), TPOT (time per output token after the first), ITL (gaps between
streamed chunks) and end-to-end latency, as `vllm bench serve` defines them. Arrivals follow a
Poisson process at ``--request-rate`` (``inf``: all at once), optionally capped at
``--max-concurrency`` requests in flight. A failed request is counted and its error kept; it
never disappears from the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.bench.report import section_table, write_json
from mmserve.bench.stats import summarize
from mmserve.bench.workload import BenchRequest, Workload, build_workload, workload_config
from mmserve.entrypoints.engine_args import engine_argv

# Seconds to wait for a server this command started to answer /health.
SERVER_START_TIMEOUT_S = 300.0


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start_s: float = 0.0  # since the run began
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def chat_body(req: BenchRequest, workload: Workload, model: str,
              schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI chat request of ``req``: images as PNG data URLs, greedy, EOS ignored;
    with ``schema``, its output constrained to that JSON schema (``response_format``), which
    ends it when the document does."""
    image_ids = iter(req.image_ids)
    messages = []
    for msg in req.messages:
        content = msg["content"]
        if isinstance(content, list):
            content = [part if part["type"] != "image" else {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64,"
                              + base64.b64encode(workload.png(next(image_ids))).decode()}}
                for part in content]
        messages.append({"role": msg["role"], "content": content})
    body = {"model": model, "messages": messages, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench", "schema": schema}}
    return body


async def send_chat(client, url: str, body: dict[str, Any], t0: float) -> RequestResult:
    """POST one streaming chat request and time every chunk that carries text."""
    result = RequestResult(start_s=time.perf_counter() - t0)
    start = time.perf_counter()
    last = start
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return result
                now = time.perf_counter()
                delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
                if delta.get("content"):
                    if not parts:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    parts.append(delta["content"])
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
    except Exception as e:  # noqa: BLE001 - every failure is counted, whatever raised it
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.text = "".join(parts)
    if result.output_tokens == 0:
        result.error = "the stream ended without a usage chunk (stream_options.include_usage)"
        return result
    if math.isnan(result.ttft_s):  # tokens that decode to no text: first token at the end
        result.ttft_s = result.e2e_s
    result.ok = True
    return result


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    use_tqdm: bool = True,
    timeout_s: float = 600.0,
    schema: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send the workload (every request under ``schema`` if given); returns per-request
    results (workload order) and the duration."""
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/v1/chat/completions"
    bodies = [chat_body(r, workload, model, schema) for r in workload.requests]
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(bodies), desc="requests", disable=not use_tqdm)
    limits = httpx.Limits(max_connections=max_concurrency or len(bodies))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(body: dict[str, Any]) -> RequestResult:
            if gate is None:
                result = await send_chat(client, url, body, t0)
            else:
                async with gate:
                    result = await send_chat(client, url, body, t0)
            bar.update(1)
            return result

        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def serve_results(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def ms(values: list[float]) -> dict[str, float]:
        s = summarize([v for v in values if not math.isnan(v)])
        return {k: (v * 1e3 if k != "count" else v) for k, v in s.items()}

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "duration_s": duration,
        "requests_per_s": len(ok) / duration, "output_tokens": out_tokens,
        "prompt_tokens": in_tokens, "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms([r.ttft_s for r in ok]), "tpot_ms": ms([r.tpot_s for r in ok]),
        "itl_ms": ms([x for r in ok for x in r.itl_s]), "e2e_ms": ms([r.e2e_s for r in ok]),
    }


def serve_table(r: dict[str, Any]) -> str:
    def lat(key: str) -> list[tuple[str, Any]]:
        s = r[key]
        name = key.removesuffix("_ms").upper()
        return [(f"{name} mean / median (ms)", f"{s['mean']:.1f} / {s['median']:.1f}"),
                (f"{name} p90 / p99 (ms)", f"{s['p90']:.1f} / {s['p99']:.1f}")]

    return section_table("mmserve bench serve", [
        ("", [("requests completed / failed", f"{r['completed']} / {r['failed']}"),
              ("duration (s)", r["duration_s"]), ("requests/s", r["requests_per_s"]),
              ("output tokens/s", r["output_tokens_per_s"]),
              ("total tokens/s", r["total_tokens_per_s"])]),
        ("latency", [*lat("ttft_ms"), *lat("tpot_ms"), *lat("itl_ms"), *lat("e2e_ms")]),
    ])


# ----------------------------------------------------------------- a server of our own
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`mmserve serve` in a subprocess on 127.0.0.1, stopped on exit."""

    def __init__(self, model: str, engine_args: list[str], max_queue: int,
                 torch_threads: int | None = None) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", "--model", model,
                    "--host", "127.0.0.1", "--port", str(self.port), "--max-queue",
                    str(max_queue), "--log-level", "warning", *engine_args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if torch_threads:
            self.env["OMP_NUM_THREADS"] = str(torch_threads)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LocalServer:
        import httpx

        self.proc = subprocess.Popen(self.cmd, env=self.env)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} "
                                   f"before it was ready: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the server did not answer /health in {SERVER_START_TIMEOUT_S} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def served_model(base_url: str, fallback: str) -> str:
    """The first model id the server lists, or ``fallback``."""
    import httpx

    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return fallback


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--base-url", help="server to load (default: start `mmserve serve` here)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    g.add_argument("--max-concurrency", type=int, help="most requests in flight")
    g.add_argument("--served-model-name", help="model id to send (default: the server's first)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                   help="the server started here runs its engine in a process of its own, or "
                   "not (default: `mmserve serve`'s)")
    g.add_argument("--structured-output", metavar="SCHEMA.json",
                   help="constrain every request's output to this JSON schema (response_format "
                   "json_schema), to measure what structured output costs")
    p.add_argument("--plot", metavar="PATH.png",
                   help="TTFT and ITL latency CDFs (.svg or .pdf by the suffix; needs "
                   "matplotlib: pip install \"mmserve[bench]\")")


def run_serve_command(
    args: argparse.Namespace,
    resolve_model: Callable[..., str],
    on_results: Callable[[list[RequestResult]], None] | None = None,
) -> int:
    """Run the load, print the table, write ``--json``; ``on_results`` then gets every
    request's result (workload order), e.g. to plot them."""
    from contextlib import nullcontext

    from transformers import AutoTokenizer

    if args.base_url is None:
        model = resolve_model(args)
        layout = {None: [], True: ["--engine-process"], False: ["--no-engine-process"]}
        server = LocalServer(model, engine_argv(args) + layout[args.engine_process],
                             max_queue=args.num_prompts, torch_threads=args.torch_threads)
    else:
        model, server = args.model, nullcontext()
    schema = None
    if args.structured_output:
        schema = json.loads(Path(args.structured_output).read_text())
        if not isinstance(schema, dict):
            raise SystemExit(f"--structured-output {args.structured_output}: a JSON schema is "
                             "a JSON object")
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True) if model else None
    workload = build_workload(workload_config(args), tokenizer)
    with server as local:
        base_url = args.base_url or local.base_url
        name = args.served_model_name or served_model(base_url, model or "default")
        results, duration = asyncio.run(run_load(
            base_url, name, workload, args.request_rate, args.max_concurrency, args.seed,
            use_tqdm=not args.no_progress, schema=schema))
    summary = serve_results(results, duration)
    print(serve_table(summary))
    for error, count in summary["errors"].items():
        print(f"failed x{count}: {error}", file=sys.stderr)
    if args.json_path:
        write_json(args.json_path, {"base_url": args.base_url, "model": name,
                                    "request_rate": None if math.isinf(args.request_rate)
                                    else args.request_rate,
                                    "max_concurrency": args.max_concurrency,
                                    "structured_output": args.structured_output, **summary})
    if on_results is not None:
        on_results(results)
    return 0 if summary["failed"] == 0 else 1
