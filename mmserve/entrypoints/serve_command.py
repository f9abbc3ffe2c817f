"""``mmserve serve``: the engine built (on a thread of this process, or in a process of its
own), the OpenAI-compatible server over it, run by uvicorn until SIGTERM or SIGINT (status 0)
or until the engine breaks (status 1, for a supervisor to restart it)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from mmserve.engine.async_engine import EngineClient
from mmserve.engine.llm_engine import LLMEngine
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.generation_config import sampling_defaults
from mmserve.entrypoints.media import MediaPolicy
from mmserve.entrypoints.serve_args import ServerConfig, list_flag, lora_modules_flag
from mmserve.worker.compute_thread import ComputeThread

logger = logging.getLogger(__name__)


class _StopSignal(Exception):
    """SIGINT or SIGTERM arrived; the server has shut down."""


def _raise_stop_signal(signum: int, frame: object) -> None:
    raise _StopSignal(signum)


@contextlib.contextmanager
def _stop_signals_end_run() -> Iterator[None]:
    """Around ``uvicorn.Server.run``: a SIGINT or SIGTERM ends it quietly. uvicorn catches
    the signal, shuts down gracefully, then raises it again with the handler that was there
    before: by default a KeyboardInterrupt traceback on Ctrl-C, and on SIGTERM death on the
    spot, before ``serve`` releases the engine. This handler turns it into an exception
    caught here instead."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; uvicorn installs none either
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _raise_stop_signal) for sig in stops}
    try:
        yield
    except _StopSignal as e:
        logger.info("stopped by %s", signal.Signals(e.args[0]).name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def served_model_names(args: argparse.Namespace, model: str) -> tuple[str, ...]:
    """``--served-model-name``'s ids (the first reported), or the model's path. A model path
    written after the flag is taken as one more name (the flag takes several, as vLLM's):
    where no model was given and a name is a directory, that is said, not served as the
    demo model under the names."""
    names = tuple(dict.fromkeys(args.served_model_name or ()))
    if (args.model_path or args.model) is None:
        for name in names:
            if os.path.isdir(name):
                raise ValueError(
                    f"--served-model-name took {name!r}, a directory, as a name (the flag takes "
                    "several): put the model before the flag (serve MODEL --served-model-name "
                    "NAME...) or give it with --model.")
    return names or (model,)


def front_door_config(args: argparse.Namespace, model: str, **own: Any) -> ServerConfig:
    """The settings ``serve`` and ``run-batch`` share, from their flags; ``own``: the
    command's own (``serve``'s HTTP settings)."""
    names = served_model_names(args, model)
    lora_modules = lora_modules_flag(args.lora_modules)
    if (lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError(f"{'--lora-modules' if lora_modules else '--allow-runtime-lora-updating'}"
                         " serves LoRA adapters: start with --enable-lora too (and --max-loras "
                         "N for N adapters running at once).")
    if lora_modules:  # checked against the model before its weights load
        from mmserve.engine.lora import check_adapters
        from mmserve.models.lora import AdapterError

        try:
            check_adapters(model, lora_modules, args.max_lora_rank)
        except AdapterError as e:
            raise ValueError(f"--lora-modules: {e}") from None
    return ServerConfig(
        served_model_name=names[0], model_aliases=names[1:],
        max_request_body_bytes=args.max_request_body_bytes,
        media=MediaPolicy(list_flag(args.allowed_media_domains, ()),
                          args.allowed_local_media_path, args.max_image_bytes,
                          args.media_fetch_timeout),
        engine_process=args.engine_process,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_mm_embeds=args.enable_mm_embeds,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        **own)


def open_engine(args: argparse.Namespace, model: str, engine_process: bool | None
                ) -> tuple[LLMEngine | EngineClient, ComputeThread | None, dict[str, Any]]:
    """The engine of ``args``' engine flags, for an ``OpenAIServer``: in a process of its own
    (``engine_process``; None: where it runs on a GPU), else built on the thread that will
    step it (returned beside it); and the sampling defaults of its checkpoint. A
    ``FileNotFoundError`` or ``ValueError`` for settings that cannot work, raised before the
    weights load where they can be told from the flags and files."""
    from mmserve.config import EngineConfig
    from mmserve.engine.core_process import EngineCoreClient
    from mmserve.entrypoints.engine_args import engine_kwargs
    from mmserve.processing.chat_template import load_chat_template

    engine_config = EngineConfig(model=model, **engine_kwargs(args))
    defaults = sampling_defaults(engine_config)  # a bad file stops us before the weights
    load_chat_template(engine_config.chat_template)  # and so does a bad chat template
    if engine_process is None:  # on the CPU, measured no faster and slower to start
        engine_process = engine_config.resolved_device == "cuda"
    if engine_process:
        return EngineCoreClient(engine_config), None, defaults
    # Built on the thread that will step it: torch's parallel regions run slower once a
    # second thread has started some (worker/compute_thread.py). Its requests' text and
    # outputs are made on the event loop, as with an engine process.
    compute = ComputeThread("mmserve-engine")
    try:
        return compute.call(LLMEngine, engine_config, detokenize=False), compute, defaults
    except BaseException:
        compute.close()
        raise


def close_engine(engine: LLMEngine | EngineClient, compute: ComputeThread | None) -> None:
    """Release what ``open_engine`` made."""
    if compute is None:
        engine.close()
    else:
        compute.call(engine.close)
        compute.close()


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT (status 0) or until the engine breaks (status 1,
    for a supervisor to restart it)."""
    import uvicorn

    from mmserve.demo.checkpoint import demo_model_path
    from mmserve.entrypoints.http_protocol import with_header_timeout

    model = args.model_path or args.model
    try:
        if model is None:
            model = str(demo_model_path())
        config = front_door_config(
            args, model,
            api_key=args.api_key,
            max_queue=args.max_queue,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            allowed_origins=list_flag(args.allowed_origins, ServerConfig.allowed_origins),
            allowed_methods=list_flag(args.allowed_methods, ServerConfig.allowed_methods),
            allowed_headers=list_flag(args.allowed_headers, ServerConfig.allowed_headers),
            allow_credentials=args.allow_credentials,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            responses_store_bytes=round(args.responses_store_mib * 2**20),
            files_store_bytes=round(args.files_store_mib * 2**20),
        )
        engine, compute, defaults = open_engine(args, model, config.engine_process)
    except (FileNotFoundError, ValueError) as e:
        print(f"mmserve serve: {e}", file=sys.stderr)
        return 2
    server = None
    try:
        server = OpenAIServer(engine, config, compute, defaults)
        # On SIGTERM uvicorn stops accepting connections and lets the requests in flight
        # finish for up to --shutdown-timeout seconds, cancels what is left, then runs the
        # lifespan shutdown that stops the engine loop (failing any request still in it).
        http = uvicorn.Server(uvicorn.Config(
            server.app(), host=args.host, port=args.port, log_level=args.log_level,
            timeout_keep_alive=5, http=with_header_timeout(config.header_timeout_s),
            timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)),
            ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
            ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs))
        server.http_server = http
        with _stop_signals_end_run():
            http.run()
    finally:
        if server is not None:
            server.engine.stop()  # normally stopped by the lifespan's shutdown already
        close_engine(engine, compute)
    if server.engine.error is not None:
        print(f"mmserve serve: the engine stopped: {server.engine.error}", file=sys.stderr)
        return 1
    return 0
