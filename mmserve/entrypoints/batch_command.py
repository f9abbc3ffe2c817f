"""``mmserve run-batch``'s command: the engine and the server's app built from the flags, a
file (or a pipe) of OpenAI batch requests answered through ``run_batch.run_batch``, with a
progress bar and a summary on standard error."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import stat
import sys
import time
from typing import BinaryIO, TextIO

from mmserve.entrypoints.run_batch import (
    LINE_OVERHEAD_BYTES,
    LINES_PER_SEQ,
    BatchSummary,
    run_batch,
)


def run_batch_command(args: argparse.Namespace) -> int:
    """``mmserve run-batch``: status 0 when every line has its output line (whatever its
    status), 1 when the engine broke on the way or the output could not be written, 2 for
    settings or files that cannot work, 130 when interrupted (Ctrl-C)."""
    from tqdm import tqdm

    from mmserve.demo.checkpoint import demo_model_path
    from mmserve.entrypoints.api_server import OpenAIServer
    from mmserve.entrypoints.serve_command import close_engine, front_door_config, open_engine

    logging.getLogger().setLevel(args.log_level.upper())
    model = args.model_path or args.model
    source = None
    try:
        if model is None:
            model = str(demo_model_path())
        # The window bounds the requests in flight; the engine's own queue needs no bound.
        # Lines are answered apart (and out of order): nothing stored links one to another.
        config = front_door_config(args, model, max_queue=None, responses_store_bytes=0,
                                   files_store_bytes=0)
        _check_output(args.output_file, args.input_file)
        source, total = _open_input(args.input_file)
        engine, compute, defaults = open_engine(args, model, config.engine_process)
    except (OSError, ValueError) as e:
        if source not in (None, sys.stdin.buffer):
            source.close()
        print(f"mmserve run-batch: {e}", file=sys.stderr)
        return 2
    server = OpenAIServer(engine, config, compute, defaults)
    app = server.app()
    progress = tqdm(total=total, unit="req", desc="run-batch", disable=None, file=sys.stderr)
    summary = BatchSummary()
    out: TextIO | None = None

    async def run() -> None:
        async with app.router.lifespan_context(app):
            await run_batch(
                app, source, out, max_line_bytes=config.max_request_body_bytes
                + LINE_OVERHEAD_BYTES, window_lines=LINES_PER_SEQ * engine.config.max_num_seqs,
                broken=lambda: server.engine.error, on_written=lambda _: progress.update(),
                summary=summary)

    start = time.perf_counter()
    status = 0
    try:
        # Opened once the engine is up, so that a checkpoint that cannot load leaves an
        # earlier output file as it was.
        out = sys.stdout if args.output_file == "-" else open(args.output_file, "w",
                                                             encoding="utf-8")
        asyncio.run(run())
        progress.total = summary.lines  # blank lines were counted
    except KeyboardInterrupt:
        status = 130
        print(f"\nmmserve run-batch: interrupted; the first {summary.lines} lines' answers "
              "are written", file=sys.stderr)
    except (OSError, UnicodeError) as e:  # the output: a closed pipe, a full disk
        status = 1
        print(f"mmserve run-batch: cannot write the answers: {e}", file=sys.stderr)
    finally:
        progress.close()
        server.engine.stop()
        close_engine(engine, compute)
        # A pipe is left to the process's exit: the reading thread may still be waiting on
        # it, holding its lock.
        if total is not None:
            source.close()
        if out not in (None, sys.stdout):
            out.close()
    if status:
        return status
    elapsed = time.perf_counter() - start
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(summary.statuses.items()))
    print(f"mmserve run-batch: {summary.lines} lines in {elapsed:.1f} s ({counts}); "
          f"{summary.output_tokens} output tokens, {summary.output_tokens / elapsed:.1f} "
          "tokens/s", file=sys.stderr)
    if summary.stopped is not None:
        rest = ("every input line was read" if summary.read_all else
                f"input lines after line {summary.last_line} were not read")
        print(f"mmserve run-batch: {summary.stopped}; lines answered with status 500 or 503 "
              f"failed with it, and {rest}", file=sys.stderr)
        return 1
    return 0


def _open_input(path: str) -> tuple[BinaryIO, int | None]:
    """The input's bytes, and how many lines it has where it is a file that can be read
    twice (a pipe or a FIFO is read once, as it comes)."""
    if path == "-":
        return sys.stdin.buffer, None
    source = open(path, "rb")  # noqa: SIM115 (closed by the caller)
    if not stat.S_ISREG(os.fstat(source.fileno()).st_mode):
        return source, None
    lines, last = 0, b"\n"
    while chunk := source.read(1 << 20):
        lines += chunk.count(b"\n")
        last = chunk[-1:]
    source.seek(0)
    return source, lines + (last != b"\n")


def _check_output(path: str, input_path: str) -> None:
    """A ``ValueError`` where the answers could not be written to ``path``."""
    if path == "-":
        return
    if os.path.isdir(path):
        raise ValueError(f"--output-file {path} is a directory; name a file")
    if input_path != "-" and os.path.exists(path) and os.path.samefile(path, input_path):
        raise ValueError(f"--output-file {path} is the input file; write the answers "
                         "elsewhere")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"--output-file {path}: cannot write in {folder}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--output-file {path} is not writable")
