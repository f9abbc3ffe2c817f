"""The Batch API beside interactive clients: how long a client's chat request waits for its
first token while a batch runs on the same server, against the same requests sent by a script
all at once (the way to run a batch without the Batch API), and how fast each gets the batch
done.

``mmserve serve`` runs in a subprocess on the bench checkpoint. Three runs, each on a fresh
set of images (so the encoder cache finds none of them):

- ``alone``: the interactive load by itself: ``--clients`` clients, each sending
  ``--requests`` streamed chat requests one after another;
- ``batch``: the same load while a batch of ``--lines`` chat requests runs through
  ``/v1/files`` and ``/v1/batches``;
- ``flood``: the same load while the same ``--lines`` requests are posted to
  ``/v1/chat/completions`` all at once.

Each run reports the interactive requests' time to first token (median and p90) and the
batch's output tokens per second (its lines' tokens over the time from the first upload byte
or post to the last answer).

    python benchmarks/batch_api.py
    python benchmarks/batch_api.py --lines 64 --max-tokens 32 --clients 2 --requests 6
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai

from mmserve.bench.checkpoint import ensure_bench_checkpoint
from mmserve.bench.workload import synthesize_image


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat_body(url: str, text: str, max_tokens: int) -> dict:
    return {"model": "bench", "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text}]}]}


def as_kwargs(body: dict) -> dict:
    """A request body as the openai client's arguments (vLLM's ``min_tokens`` as extra)."""
    kwargs = {k: v for k, v in body.items() if k != "min_tokens"}
    return {**kwargs, "extra_body": {"min_tokens": body["min_tokens"]}}


def in_threads(target, argses: list[tuple]) -> None:
    """``target(*args)`` for each of ``argses`` on threads of their own; the first error of
    any is raised."""
    errors: list[BaseException] = []

    def run(*args) -> None:
        try:
            target(*args)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=args) for args in argses]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class Server:
    def __init__(self, model: str, extra: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", model, "--port",
             str(port), "--served-model-name", "bench", "--log-level", "warning", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited:\n{self.log.read().decode()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not come up")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def interactive(client: openai.OpenAI, bodies: list[dict], clients: int) -> list[float]:
    """Times to first token of ``bodies``, sent by ``clients`` clients one after another."""
    ttfts: list[float] = []
    lock = threading.Lock()

    def run(mine: list[dict]) -> None:
        for body in mine:
            start = time.perf_counter()
            # (log-probabilities: a chunk for each token, whatever text it adds)
            for chunk in client.chat.completions.create(stream=True, logprobs=True,
                                                        **as_kwargs(body)):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    with lock:
                        ttfts.append(time.perf_counter() - start)
                    break
            # (the rest of the stream is read by the loop's exit closing it)

    in_threads(run, [(bodies[i::clients],) for i in range(clients)])
    return ttfts


def by_batch_api(client: openai.OpenAI, bodies: list[dict]) -> tuple[int, float]:
    lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}).encode() + b"\n"
                     for i, body in enumerate(bodies))
    start = time.perf_counter()
    uploaded = client.files.create(file=("batch.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    elapsed = time.perf_counter() - start
    if batch.status != "completed" or batch.request_counts.failed:
        raise RuntimeError(f"the batch did not complete: {batch}")
    return batch.usage.output_tokens, elapsed


def by_flood(client: openai.OpenAI, bodies: list[dict]) -> tuple[int, float]:
    tokens = [0] * len(bodies)
    start = time.perf_counter()

    def post(i: int) -> None:
        tokens[i] = client.chat.completions.create(
            **as_kwargs(bodies[i])).usage.completion_tokens

    in_threads(post, [(i,) for i in range(len(bodies))])
    return sum(tokens), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint, built if needed)")
    p.add_argument("--lines", type=int, default=48, help="the batch's requests")
    p.add_argument("--max-tokens", type=int, default=32, help="each batch request's tokens")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--requests", type=int, default=6, help="each client's requests")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more flags for mmserve serve")
    args = p.parse_args(argv)

    model = args.model or str(ensure_bench_checkpoint())
    rng = random.Random(args.seed)

    def images(count: int) -> list[str]:
        return [data_url(synthesize_image(rng, (args.image_size, args.image_size)))
                for _ in range(count)]

    server = Server(model, args.serve_args.split())
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=600)
    interactive(client, [chat_body(u, "warm up", 4) for u in images(2)], 1)
    stats = httpx.get(f"{server.url}/stats").json()
    print(f"{args.lines} batch requests x {args.max_tokens} tokens; {args.clients} clients x "
          f"{args.requests} streamed requests x 16 tokens; one {args.image_size}x"
          f"{args.image_size} image each; cpu threads {stats.get('cpu_threads')}, "
          f"os.cpu_count {os.cpu_count()}")
    print(f"{'run':<6} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'batch tok/s':>12} "
          f"{'batch s':>8}")
    try:
        for run in ("alone", "batch", "flood"):
            load = [chat_body(u, f"client request {i}", 16)
                    for i, u in enumerate(images(args.clients * args.requests))]
            batch = [chat_body(u, f"caption {i}", args.max_tokens)
                     for i, u in enumerate(images(args.lines))]
            done: dict[str, tuple[int, float]] = {}
            ttfts: list[float] = []

            def batch_side(send=by_batch_api if run == "batch" else by_flood, b=batch,
                           d=done) -> None:
                d["result"] = send(client, b)

            def client_side(t=ttfts, loads=load, wait=0 if run == "alone" else 1.0) -> None:
                time.sleep(wait)  # the batch is under way before the clients come
                t.extend(interactive(client, loads, args.clients))

            in_threads(lambda side: side(), [(client_side,)] if run == "alone" else
                       [(client_side,), (batch_side,)])
            ttfts.sort()
            p50 = statistics.median(ttfts)
            p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
            if "result" in done:
                tokens, elapsed = done["result"]
                print(f"{run:<6} {p50:>10.2f} {p90:>10.2f} {tokens / elapsed:>12.1f} "
                      f"{elapsed:>8.1f}")
            else:
                print(f"{run:<6} {p50:>10.2f} {p90:>10.2f} {'-':>12} {'-':>8}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
