"""The OpenAI-compatible HTTP server: a Starlette app over one shared engine loop (run by
``mmserve serve``, ``serve_command.py``).

Endpoints: ``POST /v1/chat/completions`` (plain or streamed as server-sent events),
``POST /v1/completions`` (text or token-id prompts, one or several; plain or streamed),
``POST /v1/responses`` (OpenAI's Responses API, stateless: ``responses_protocol.py``),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /version``, ``GET /health`` (200 while
the engine loop lives; never needs a key), ``GET /metrics`` (Prometheus text), ``GET /stats``
(the engine's counters as JSON, for operators, tests and the chat page), vLLM's
``POST /tokenize`` and ``POST /detokenize``, and ``GET /`` (the chat page, ``chat_page.py``;
its page and assets never need a key, the API calls it makes do). Every error is OpenAI's JSON
error body; every response carries an ``X-Request-Id`` that the server's log lines about it
quote (``http_middleware.py``); answers are put together from the engine's outputs by
``answers.py``.

No single client can stall the service: request headers and bodies have deadlines, image
fetches have a total deadline on a pool of their own, a request the engine fails on is
answered with an error while the others go on, and SIGTERM drains for at most
``--shutdown-timeout`` seconds. If the engine breaks for good (its steps fail for every
request), ``/health`` turns 503 and the process exits with status 1 so that a supervisor
restarts it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import mmserve
from mmserve.beam_search import BeamSearchParams
from mmserve.engine.async_engine import AsyncEngine, EngineClient, QueueFullError, RequestStream
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.lora import check_adapters
from mmserve.entrypoints import chat_page, tool_calls
from mmserve.entrypoints import openai_protocol as proto
from mmserve.entrypoints import openai_shapes as shapes
from mmserve.entrypoints import responses_protocol as responses
from mmserve.entrypoints.answers import (
    Answer,
    completion_ids,
    deltas,
    per_prompt,
    responses_usage,
    usage_of,
    without_generated,
)
from mmserve.entrypoints.batch_api import BatchApi
from mmserve.entrypoints.completion_store import StoredCompletionsApi
from mmserve.entrypoints.conversations import ConversationsApi
from mmserve.entrypoints.generation_config import sampling_defaults
from mmserve.entrypoints.http_middleware import (
    ApiKeyMiddleware,
    ClosingStream,
    LargeParts,
    RequestIdMiddleware,
    error_response,
    http_exception,
    request_ids_of,
)
from mmserve.entrypoints.media import MediaLoader
from mmserve.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from mmserve.entrypoints.openai_protocol import ApiError
from mmserve.entrypoints.response_store import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    EventLog,
    InProgressError,
    ResponseStore,
    Stored,
)
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.entrypoints.tool_call_readers import merge
from mmserve.entrypoints.uploads_api import UploadsApi
from mmserve.errors import (
    AdapterUnavailableError,
    EngineDeadError,
    InvalidInputError,
    PromptTooLongError,
)
from mmserve.lora_request import LoRARequest
from mmserve.models.lora import AdapterError
from mmserve.outputs import RequestOutput, cosine_scores, embedding_of
from mmserve.sampling_params import SamplingParams
from mmserve.step import TokenLogprobs
from mmserve.worker.compute_thread import ComputeThread

logger = logging.getLogger(__name__)


def _nothing() -> None:
    pass


# Where a request's decoded body is kept once read (``invocations`` reads it first).
_READ_BODY = "mmserve.read_body"
# /tokenize requests processed at once, and processed or waiting.
MAX_TOKENIZING = 4
MAX_TOKENIZE_WAITING = 64
# LoRA adapters a server names, those loaded at run time included.
MAX_SERVED_ADAPTERS = 256


class OpenAIServer:
    """Request handlers over one ``EngineClient`` (the engine on a thread of this process, or
    in a process of its own)."""

    def __init__(self, engine: LLMEngine | EngineClient, config: ServerConfig,
                 compute: ComputeThread | None = None,
                 defaults: dict[str, Any] | None = None) -> None:
        """``engine``: an engine to step on a thread of this process (``compute``, the thread
        it was built on, ``ComputeThread``; by default a thread of its own), or the client of
        one stepped elsewhere (``core_process.EngineCoreClient``). ``defaults``: the sampling
        fields of requests that leave them out (by default ``sampling_defaults`` of the
        engine's config)."""
        self.config = config
        self.model = config.served_model_name  # the id answers report
        self.model_names = (self.model, *config.model_aliases)  # the ids requests may name
        # LoRA adapters requests name as their model (vLLM's --lora-modules), by name.
        self.loras = {name: LoRARequest(name, i, path)
                      for i, (name, path) in enumerate(config.lora_modules, 1)}
        self._lora_ids = itertools.count(len(self.loras) + 1)  # those loaded at run time
        self.max_model_len = engine.config.max_model_len
        self.max_images = engine.config.limit_mm_per_prompt
        self.sampling_defaults = (sampling_defaults(engine.config) if defaults is None
                                  else defaults)
        self.media = MediaLoader(config.media, engine.config.max_image_pixels)
        # The parser of calls in the model's text, where "auto" tool choice is on.
        self.tool_parser = config.tool_call_parser if config.enable_auto_tool_choice else None
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model, self._stats)
        if isinstance(engine, EngineClient):
            engine.max_waiting = config.max_queue
            engine.observer = self.metrics
            engine.on_dead = self._engine_died
            self.engine = engine
        else:
            self.engine = AsyncEngine(engine, config.max_queue, observer=self.metrics,
                                      on_dead=self._engine_died, compute=compute)
        # /tokenize requests processed at once (each waits its turn): they take the
        # preprocessing threads that requests use, and no slot in the engine bounds them.
        self._tokenizing = asyncio.Semaphore(MAX_TOKENIZING)
        self._num_tokenizing = 0  # processed or waiting; past MAX_TOKENIZE_WAITING, 503
        # Set by ``serve``: the uvicorn server to stop if the engine dies.
        self.http_server: Any = None
        # The Responses API's stored responses (none where the store has no room at all),
        # and the tasks of the background ones that run.
        self.response_store = (ResponseStore(config.responses_store_bytes)
                               if config.responses_store_bytes > 0 else None)
        self._background: set[asyncio.Future] = set()
        # Conversations are kept beside the responses, in as many bytes.
        self.conversations = ConversationsApi(
            config.responses_store_bytes, self._read_json,
            lambda messages: proto.parse_chat_request(
                {"messages": messages, "max_tokens": 1}, self.max_model_len, self.max_images))
        # Chat completions sent with ``store: true``, in as many bytes again.
        self.stored_completions = StoredCompletionsApi(config.responses_store_bytes,
                                                       self._read_json)
        # OpenAI's Files and Batch APIs: a batch's lines are posted to this server's app.
        self.batch_api = BatchApi(
            config.files_store_bytes, model=self.model,
            max_body_bytes=config.max_request_body_bytes,
            seats=engine.config.max_num_seqs // 2, body_timeout_s=config.body_timeout_s,
            by_priority=engine.config.scheduling_policy == "priority",
            api_key=config.api_key, read_json=self._read_json,
            broken=lambda: self.engine.error, engine_stats=self._stats)
        # OpenAI's Uploads API: a file sent in parts, into the same store.
        self.uploads = UploadsApi(self.batch_api.files, self._read_json)

        @functools.lru_cache(maxsize=1 << 16)
        def token_text(token_id: int) -> str:  # what a token stands for, for logprobs
            return self.tokenizer.decode([token_id])

        self._token_text = token_text

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The event loop's own tokenizer, copied at start-up off the loop (a large
        vocabulary takes a few tenths of a second): a fast tokenizer is not safe to share
        between threads, and the preprocessing threads tokenize with the processor's."""
        return copy.deepcopy(self.engine.tokenizer)

    def _copy_tokenizer(self) -> None:
        try:
            self.tokenizer  # noqa: B018 (made and cached)
        except AttributeError:  # a stand-in engine without a processor (tests)
            pass

    def _engine_died(self, error: BaseException) -> None:
        logger.critical("the engine is broken (%s); stopping the server so that it can be "
                        "restarted", error)
        if self.http_server is not None:
            self.http_server.should_exit = True

    def _stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # ----------------------------------------------------------------- small endpoints
    async def health(self, request: Request) -> Response:
        if self.engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine loop not running"}, status_code=503)

    async def models(self, request: Request) -> Response:
        listed = shapes.model_list(self.model_names, self.created, self.max_model_len)
        listed["data"] += [self._adapter_card(name) for name in self.loras]
        return JSONResponse(listed)

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter`` (``--allow-runtime-lora-updating``):
        ``{"lora_name", "lora_path"}`` served from now on as a model of that name, once the
        adapter is checked against the checkpoint (off the event loop)."""
        try:
            name, path = self._lora_update(await self._read_json(request), "lora_path")
            self._check_adapter_name_free(name)
            if not isinstance(path, str) or not path:
                raise proto.bad_request("lora_path must be the adapter's folder.", "lora_path")
            config = self.engine.config
            try:
                await asyncio.to_thread(check_adapters, config.model, [(name, path)],
                                        config.max_lora_rank)
            except AdapterError as e:
                raise proto.bad_request(str(e), "lora_path") from None
            self._check_adapter_name_free(name)  # again: (loads sent at once)
        except ApiError as e:
            return error_response(e)
        self.loras[name] = LoRARequest(name, next(self._lora_ids), path)
        logger.info("serving LoRA adapter %r from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: ``{"lora_name"}`` no longer served
        (requests running with it finish with it)."""
        try:
            name, _ = self._lora_update(await self._read_json(request))
            if name not in self.loras:
                raise ApiError(404, f"no LoRA adapter {name!r} is served.", param="lora_name",
                               code="model_not_found")
        except ApiError as e:
            return error_response(e)
        del self.loras[name]
        logger.info("no longer serving LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _check_adapter_name_free(self, name: str) -> None:
        """A 400 unless ``name`` may name one more adapter loaded at run time."""
        if name in self.loras or name in self.model_names:
            raise proto.bad_request(f"the LoRA adapter {name!r} is loaded already (or is the "
                                    "model's name); unload it first, or pick another name.",
                                    "lora_name")
        if len(self.loras) >= MAX_SERVED_ADAPTERS:
            raise proto.bad_request(f"{MAX_SERVED_ADAPTERS} LoRA adapters are served already; "
                                    "unload one first.", "lora_name")

    def _lora_update(self, body: Any, path_field: str | None = None) -> tuple[str, Any]:
        """A runtime LoRA update's ``lora_name`` (and its ``path_field``'s value), checked:
        the server must allow it and run adapters."""
        if not self.config.allow_runtime_lora_updating:
            raise ApiError(404, "runtime LoRA updating is off: start the server with "
                           "--allow-runtime-lora-updating (and --enable-lora).",
                           code="not_found")
        if not self.engine.config.enable_lora:
            raise proto.bad_request("the engine runs no LoRA adapters: start it with "
                                    "--enable-lora.")
        if not isinstance(body, dict):
            raise proto.bad_request("the body must be a JSON object with lora_name.")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise proto.bad_request("lora_name must be a name of 1 to 256 characters.",
                                    "lora_name")
        return name, body.get(path_field) if path_field else None

    def _adapter_card(self, name: str) -> dict[str, Any]:
        """A LoRA adapter as vLLM lists it: its path the ``root``, the model its
        ``parent``."""
        return shapes.model_card(name, self.created, self.max_model_len,
                                 root=self.loras[name].lora_path, parent=self.model)

    async def retrieve_model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{id}`` (the client's ``models.retrieve``): the served
        model, or a 404 for any other id."""
        model = request.path_params["model"]
        try:
            self._check_model(model)
        except ApiError as e:
            return error_response(e)
        if model in self.loras:
            return JSONResponse(self._adapter_card(model))
        return JSONResponse(shapes.model_card(model, self.created, self.max_model_len,
                                              root=self.model))

    async def invocations(self, request: Request) -> Response:
        """SageMaker's ``POST /invocations`` (as vLLM serves it): the endpoint the body's
        shape names, ``messages`` the chat's, ``prompt`` the completions', ``input`` the
        Responses API's (vLLM, which has no Responses API there, sends it to embeddings),
        ``text_1`` the score's, ``query`` the rerank's."""
        try:
            body = await self._read_json(request)
        except ApiError as e:
            return error_response(e)
        request.scope[_READ_BODY] = (body,)
        if isinstance(body, dict):
            for field, endpoint in (("messages", self.chat), ("prompt", self.completions),
                                    ("input", self.responses), ("text_1", self.score),
                                    ("query", self.rerank)):
                if field in body:
                    return await endpoint(request)
        return error_response(proto.bad_request(
            "/invocations answers a chat completion ('messages'), a completion ('prompt'), a "
            "response ('input'), scores ('text_1') or a reranking ('query'): the body has "
            "none of these fields."))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": mmserve.__version__})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def stats(self, request: Request) -> Response:
        return JSONResponse({**self.engine.stats(), "num_in_flight": self.engine.num_in_flight})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: the tokens the model reads for a completions prompt or a
        chat's messages (images' placeholders expanded, as each image's size makes them)."""
        try:
            req = proto.parse_tokenize_request(await self._read_json(request), self.max_images,
                                               self.config.enable_mm_embeds)
            self._check_model(req.model)
            async with self._tokenizing_slot():
                images = await asyncio.gather(*(self.media.load(url) for url in req.image_urls))
                ids = await self.engine.prompt_token_ids({**req.prompt, "images": list(images)})
        except (ApiError, InvalidInputError, QueueFullError) as e:
            return error_response(_as_api_error(e))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: the text of token ids, special tokens' included."""
        try:
            ids, model = proto.parse_detokenize_request(
                await self._read_json(request), len(self.tokenizer), self.max_model_len)
            self._check_model(model)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    # ----------------------------------------------------------------- chat
    async def chat(self, request: Request) -> Response:
        request_id, engine_id = request_ids_of(request, "chatcmpl-")
        try:
            chat = await self._parse(request)
            prompt = await self._prompt_of(chat)
            streams = await self._add(completion_ids(engine_id, chat.params.n), prompt,
                                      chat.params, chat.beam)
        except (ApiError, InvalidInputError, QueueFullError, EngineDeadError) as e:
            return self._refused(e)
        store = self.stored_completions.store if chat.store else None
        if store is not None and not store.reserve(request_id):
            # A client's id that names a stored completion, or one being answered: this
            # one's is the engine's (the id with a suffix of its own).
            request_id = engine_id
            reserved = store.reserve(request_id)
            assert reserved  # (an engine id is this request's alone)

        def done() -> None:
            self._abort(streams)
            if store is not None:
                store.unreserve(request_id)
        if chat.stream:
            def keep(outs: list[RequestOutput], created: int) -> None:
                self._store_completion(self._completion_body(request_id, outs, chat, created),
                                       chat)
            return self._event_stream(
                self._sse(request_id, streams, chat.include_usage, chat.tool_choice,
                          chat.continuous_usage, self._as_ids(chat.tokens_as_ids),
                          chat.token_ids, on_whole=keep if store is not None else None,
                          model=self._answer_model(chat.lora)),
                on_close=done)
        try:
            return await self._complete(request, request_id, streams, chat)
        finally:
            done()

    def _store_completion(self, body: dict[str, Any], chat: proto.ChatRequest) -> None:
        """Keep a finished answer whose request sent ``store: true``."""
        if chat.store:
            self.stored_completions.keep(body, chat.sent_messages, chat.metadata)

    # ----------------------------------------------------------------- responses
    async def responses(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/responses`` (``responses_protocol.py``): the chat request it
        amounts to, answered as a response object or its stream of events, or at once and
        run on (``background``); kept in the store where it asks (``store``). A request that
        names a conversation holds it until its answer ends, however it ends."""
        held: list[Callable[[], None]] = []  # its release (emptied where the answer's end
        try:                                   # releases it)
            return await self._respond(request, held)
        finally:
            for release in held:
                release()

    async def _respond(self, request: Request, held: list[Callable[[], None]]) -> Response:
        response_id, engine_id = request_ids_of(request, "resp_")
        created = int(time.time())
        req = None
        try:
            req = self._responses_request(await self._read_json(request), held)
            chat = req.chat
            chat.lora = self._check_model_and_room(chat.model)
            prompt = await self._prompt_of(chat)
            try:
                (stream,) = await self.engine.add_completions([engine_id], prompt, chat.params)
            except PromptTooLongError as e:
                if not req.truncate:
                    raise PromptTooLongError(f"{e} Or send 'truncation': \"auto\" to drop "
                                             "the conversation's earliest turns.",
                                             e.param) from None
                prompt = await self._truncated(prompt, e)
                (stream,) = await self.engine.add_completions([engine_id], prompt, chat.params)
        except (ApiError, InvalidInputError, QueueFullError, EngineDeadError) as e:
            err = _as_api_error(e)
            if req is not None:  # about the chat it amounts to: in the Responses API's names
                err = req.renamed(err)
            self.metrics.count("rejected" if err.status < 500 else "error")
            return error_response(err)
        reader = tool_calls.reader_for(chat.tool_choice, self.tool_parser,
                                       lambda: responses.new_id("call"))
        if req.store and self.response_store is not None and response_id in self.response_store:
            # A client's X-Request-Id names a stored response already: this one's is the
            # engine's (the id with a suffix of its own). One sent twice at once is stored
            # once (``ResponseStore.put`` replaces nothing).
            response_id = engine_id
        events = responses.ResponseEvents(response_id, self._answer_model(chat.lora),
                                          req.echo, created)
        if req.background or chat.stream:  # the conversation is released once it is added
            release = held[0] if held else _nothing  # to, or the answer ends otherwise
            if req.background:
                answer = self._run_in_background(req, events, stream, reader, release)
            else:
                answer = self._event_stream(self._response_events(
                    events, stream, reader, req,
                    on_final=lambda final: self._add_to_conversation(req, final, release)),
                    on_close=lambda: (self._abort([stream]), release()))
            held.clear()  # (handed over)
            return answer
        outs = await self._final_outputs(request, [stream])
        if isinstance(outs, Response):
            return outs
        (out,) = outs
        whole = (self._text_delta(out.text, out) if reader is None
                 else reader.feed(out.text) + reader.finish())
        response = events.whole(whole, out.finish_reason, responses_usage(out))
        self._add_to_conversation(req, response)
        self._keep(req, response)
        return JSONResponse(response)

    def _responses_request(self, body: Any, held: list[Callable[[], None]] | None,
                           input_required: bool = True) -> responses.ResponsesRequest:
        """A Responses API body checked, with the items it goes on from: the chain of the
        stored response ``previous_response_id`` names, or the items of the conversation
        ``conversation`` names, held for it (its release put in ``held``; None: read, not
        held)."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        named = body.get("conversation") if isinstance(body, dict) else None
        if previous is not None and named is not None:
            raise proto.bad_request("send one of 'previous_response_id' and 'conversation': "
                                    "a response goes on from one of them", "conversation")
        earlier, conversation = None, None
        if isinstance(previous, str):
            earlier = self._conversation(previous)
        if named is not None:
            if held is None:
                found = self.conversations.named(named)
            else:
                found, release = self.conversations.hold(named)
                held.append(release)
            earlier, conversation = list(found.items), found.id
        return responses.parse_responses_request(
            body, self.max_model_len, self.max_images, self.sampling_defaults,
            self.tool_parser, earlier, can_store=self.response_store is not None,
            conversation=conversation, input_required=input_required)

    async def response_input_tokens(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/responses/input_tokens``: how many tokens a Responses API
        request of this body would give the model (the conversation it goes on from, its
        tools and images included; with ``truncation: "auto"``, what is left once its
        earliest turns are dropped; without, all of it, however long), counted as the
        request would be made, on the bounded tokenizing threads of ``/tokenize``."""
        req = None
        try:
            body = await self._read_json(request)
            if isinstance(body, dict):  # (what generating alone reads is not checked here)
                body = {k: v for k, v in body.items() if k in _COUNTED_FIELDS}
            req = self._responses_request(body, None, input_required=False)
            req.chat.lora = self._check_model(req.chat.model)
            async with self._tokenizing_slot():
                prompt = await self._prompt_of(req.chat)
                ids, too_long = None, None
                try:
                    ids = await self.engine.prompt_token_ids(prompt)
                except PromptTooLongError as e:  # (text too long to tokenize at all)
                    if not req.truncate:
                        raise PromptTooLongError(f"{e} Or send 'truncation': \"auto\" to "
                                                 "count what is left without the "
                                                 "conversation's earliest turns.",
                                                 e.param) from None
                    too_long = e
                if req.truncate and (ids is None or len(ids) > self.max_model_len):
                    too_long = too_long or PromptTooLongError(
                        f"the input is {len(ids)} tokens (images included) but "
                        f"max_model_len is {self.max_model_len}.", "input")
                    ids = await self.engine.prompt_token_ids(
                        await self._truncated(prompt, too_long))
        except (ApiError, InvalidInputError, QueueFullError) as e:
            err = _as_api_error(e)
            return error_response(err if req is None else req.renamed(err))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})

    @contextlib.asynccontextmanager
    async def _tokenizing_slot(self) -> AsyncIterator[None]:
        """A turn of the threads that count tokens for ``/tokenize`` and
        ``/v1/responses/input_tokens``: a 503 past ``MAX_TOKENIZE_WAITING`` waiting."""
        if self._num_tokenizing >= MAX_TOKENIZE_WAITING:
            raise QueueFullError(f"{MAX_TOKENIZE_WAITING} requests to count tokens are "
                                 "already waiting; retry later.")
        self._num_tokenizing += 1
        try:
            async with self._tokenizing:
                yield
        finally:
            self._num_tokenizing -= 1

    async def _truncated(self, prompt: dict[str, Any], error: PromptTooLongError
                         ) -> dict[str, Any]:
        """``truncation: "auto"``: the prompt without as few of its earliest turns as make it
        fit ``max_model_len`` (a binary search over where it may start, each try tokenized
        as the request would be); ``error`` where even its last turn does not."""
        messages = prompt["messages"]
        starts = responses.truncation_starts(messages)

        async def cut(start: int) -> dict[str, Any] | None:
            kept, images = responses.without_turns(messages, start, prompt["images"])
            candidate = {**prompt, "messages": kept, "images": images}
            try:
                ids = await self.engine.prompt_token_ids(candidate)
            except PromptTooLongError:
                return None
            return candidate if len(ids) <= self.max_model_len else None

        best = None
        lo, hi = 0, len(starts) - 1  # the earliest start that fits, among starts[lo:hi + 1]
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = await cut(starts[mid])
            if candidate is None:
                lo = mid + 1
            else:
                best, hi = candidate, mid - 1
        if best is None:
            raise PromptTooLongError(
                f"{error} 'truncation': \"auto\" drops the conversation's earliest turns, "
                "but what is left without them (the instructions, the tools, the last user "
                "message and what follows it) does not fit either.",
                error.param)
        return best

    def _conversation(self, previous: str) -> list[dict[str, Any]]:
        """The stored conversation ``previous_response_id`` continues (a 404 where it is not
        stored)."""
        store = self.response_store
        try:
            items = None if store is None else store.conversation(previous)
        except InProgressError as e:
            raise proto.bad_request(
                f"previous_response_id {previous[:64]!r} cannot be continued yet: the "
                f"background response {e.response_id[:64]!r} in its conversation is still "
                "running; wait for it (GET /v1/responses/{id}) or cancel it.",
                "previous_response_id") from None
        if items is None:
            why = ("this server stores no responses (--responses-store-mib 0)" if store is None
                   else "it, or one before it in the conversation, is not stored (never "
                   "stored, deleted, or forgotten to make room)")
            raise ApiError(404, f"previous_response_id {previous[:64]!r} cannot be continued: "
                           f"{why}; send the whole conversation in 'input'.",
                           "previous_response_id", code="previous_response_not_found")
        return items

    def _keep(self, req: responses.ResponsesRequest, response: dict[str, Any]) -> None:
        """Store a finished response where it asks; one that does not fit says so
        (``store`` false, where it is still to be sent)."""
        if req.store and self.response_store is not None:
            if self.response_store.put(response, req.input_items, req.previous) is None:
                response["store"] = False

    def _add_to_conversation(self, req: responses.ResponsesRequest,
                             response: dict[str, Any],
                             release: Callable[[], None] = _nothing) -> None:
        """A response that completed (or stopped at its token limit) adds its input and
        output items to the conversation it names, if that is still kept; then the
        conversation is ``release``d (before the client hears that the response ended)."""
        try:
            self._add_items(req, response)
        finally:
            release()

    def _add_items(self, req: responses.ResponsesRequest, response: dict[str, Any]) -> None:
        if req.conversation is None or response.get("status") not in ("completed",
                                                                      "incomplete"):
            return
        store = self.conversations.store
        found = None if store is None else store.get(req.conversation)
        items = [*req.input_items, *responses.finished_items(response.get("output") or [])]
        if found is not None and not store.add(found, items):
            logger.warning("response %s was not added to conversation %s: the store of "
                           "conversations has no room for it (--responses-store-mib)",
                           response.get("id"), req.conversation)

    def _run_in_background(self, req: responses.ResponsesRequest,
                           events: responses.ResponseEvents, stream: RequestStream,
                           reader: tool_calls.CallReader | None,
                           release: Callable[[], None]) -> Response:
        """Answer a ``background`` request at once (queued) and run it on a task of its own;
        the store holds it, in progress, until it ends or is cancelled (then ``release``)."""
        store = self.response_store
        assert store is not None  # (the request was refused otherwise)
        entry = store.put(events.snapshot("queued"), req.input_items, req.previous)
        if entry is None:
            self._abort([stream])
            release()
            self.metrics.count("rejected")
            return error_response(ApiError(
                503, f"the response store ({store.max_bytes} bytes of JSON, "
                "--responses-store-mib) has no room for this request beside the background "
                "responses running; send it without 'background', or retry later.",
                "background", type="server_overloaded", code="store_full",
                headers={"Retry-After": "1"}))

        if req.chat.stream:
            entry.log = EventLog()

        async def run() -> None:
            try:
                async for event in self._response_events(
                        events, stream, reader, queued=True,
                        on_final=lambda final: self._add_to_conversation(req, final,
                                                                         release)):
                    store.record(entry, event)
            except Exception as e:  # noqa: BLE001 (a bug here must not leave it running)
                logger.exception("background response %s failed", events.response_id)
                for event in events.fail(ApiError(500, f"the server failed this "
                                                       f"response ({e})")):
                    store.record(entry, event)
            if not events.final:  # (the answer's stream ended without its last output)
                for event in events.fail(ApiError(500, "the answer ended before it "
                                                       "finished")):
                    store.record(entry, event)
            store.update(events.final)

        def ended(task: asyncio.Future) -> None:
            """Ended, cancelled or deleted (even before it began to run): its engine request
            is aborted, and its followers' streams end."""
            self._background.discard(task)
            self._abort([stream])
            release()
            if entry.log is not None:
                entry.log.end()

        store.start(entry, asyncio.ensure_future(run()), events)
        self._background.add(entry.task)
        entry.task.add_done_callback(ended)
        if entry.log is not None:  # followed from its first event; the client may leave
            return self._event_stream(entry.log.follow())
        return JSONResponse(entry.response)

    async def get_response(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``: a stored response (in progress, for a background one
        that runs); with ``stream``, a background stream's events again, those after
        ``starting_after`` (its own until it ends, for one that runs)."""
        entry = self._stored(request)
        if isinstance(entry, Response):
            return entry
        query = request.query_params
        streamed = query.get("stream", "false").lower()
        if streamed not in ("true", "1", "false", "0"):
            return error_response(proto.bad_request("'stream' must be true or false.",
                                                    "stream"))
        streamed = streamed in ("true", "1")
        if not streamed and "starting_after" in query:
            return error_response(proto.bad_request(
                "'starting_after' applies to a stream: send 'stream=true' with it.",
                "starting_after"))
        if streamed:
            after = _starting_after(query)
            if isinstance(after, Response):
                return after
            if entry.log is None or (entry.log.cut and not entry.log.events):
                why = ("it was not made with 'background' and 'stream'" if entry.log is None
                       else "its events outgrew the response store and were not kept")
                return error_response(proto.bad_request(
                    f"this response cannot be streamed again: {why}; GET it without "
                    "'stream'.", "stream"))
            return self._event_stream(entry.log.follow(after))
        if entry.running:  # as it stands (ended, where its last output has come)
            return JSONResponse(entry.events.final or entry.events.snapshot())
        return JSONResponse(entry.response)

    async def delete_response(self, request: Request) -> Response:
        """``DELETE /v1/responses/{id}``: forget a stored response (a background one that
        runs is cancelled first)."""
        entry = self._stored(request)
        if isinstance(entry, Response):
            return entry
        response_id = entry.response["id"]
        if entry.running:
            self._stop_background(entry, "response_deleted", "the response was deleted")
        self.response_store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel_response(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: stop a background response that runs (its
        engine request aborted); one that has ended is answered as it is."""
        entry = self._stored(request)
        if isinstance(entry, Response):
            return entry
        if not entry.response.get("background"):
            return error_response(proto.bad_request(
                "only responses made with 'background': true can be cancelled.",
                "response_id"))
        if entry.running:
            # One whose answer has ended (its task was about to store it) is stored as such.
            events = entry.events
            self._stop_background(entry, "response_cancelled",
                                  "the response was cancelled; GET it for the items done")
            self.response_store.update(events.final or events.cancel())
        return JSONResponse(entry.response)

    def _stop_background(self, entry: Stored, code: str, why: str) -> None:
        """Cancel a running background response, its stream's followers told why (unless
        its answer has ended, and its last event with it)."""
        if entry.log is not None and not entry.events.final:
            self.response_store.record(entry, entry.log.last_event(code, why))
        entry.task.cancel()

    async def response_input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: the request's input, a page at a time."""
        entry = self._stored(request)
        if isinstance(entry, Response):
            return entry
        try:
            return JSONResponse(proto.paged(entry.input_items, request.query_params,
                                            DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, "input item",
                                            "in this response"))
        except ApiError as e:
            return error_response(e)

    def _stored(self, request: Request) -> Stored | Response:
        """The stored response a path names, or the 404 that says it is not stored."""
        response_id = request.path_params["response_id"]
        entry = None if self.response_store is None else self.response_store.get(response_id)
        if entry is None:
            return error_response(ApiError(
                404, f"no stored response {response_id[:64]!r}: responses are kept where "
                "a request asks ('store', the default) and this server stores them "
                "(--responses-store-mib), until deleted or forgotten to make room.",
                "response_id", code="response_not_found"))
        return entry

    @staticmethod
    def _event_stream(events: AsyncIterator[str], on_close: Callable[[], object] | None = None
                      ) -> ClosingStream:
        """Server-sent ``events``; ``on_close`` is called once the answer has ended, however
        it ended (a client gone before its first event never starts ``events``, whose own
        ``finally`` then never runs)."""
        return ClosingStream(events, on_close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _response_events(self, events: responses.ResponseEvents, stream: RequestStream,
                               reader: tool_calls.CallReader | None,
                               req: responses.ResponsesRequest | None = None,
                               queued: bool = False,
                               on_final: Callable[[dict[str, Any]], None] | None = None
                               ) -> AsyncIterator[str]:
        """A response's events as its answer comes; a failure ends them with
        ``response.failed``. ``on_final`` is told of the finished response before its last
        event is sent (it adds it to its conversation); it is kept where ``req`` asks."""
        answer = Answer()
        try:
            for event in events.start(queued):
                yield event
            async with contextlib.aclosing(self._merged([stream])) as merged:
                async for _, out in merged:
                    if isinstance(out, ApiError):
                        for event in events.fail(out):
                            yield event
                        break
                    answer.add(out)
                    for delta in (self._text_delta(out.new_text, out) if reader is None
                                  else deltas(reader, out)):
                        for event in events.delta(delta):
                            yield event
                    if out.finished:
                        last = events.finish(out.finish_reason,
                                             responses_usage(answer.whole(out)))
                        if on_final is not None:
                            on_final(events.final)
                        for event in last:
                            yield event
        finally:
            self._abort([stream])
        if req is not None and events.final:
            self._keep(req, events.final)

    def _text_delta(self, text: str, out: RequestOutput) -> list[dict[str, Any]]:
        """A response's text delta, with its tokens' log-probabilities where the request
        asked for them (a token that completes no character yet has no text of its own)."""
        if out.logprobs is None:
            return [{"content": text}] if text else []
        return [{"content": text, "logprobs": shapes.logprobs_content(
            out.token_ids, out.logprobs, self._token_text,
            self.config.return_tokens_as_token_ids)["content"]}]

    async def _add(self, request_ids: list[str], prompt: dict[str, Any],
                   params: SamplingParams, beam: BeamSearchParams | None
                   ) -> list[RequestStream]:
        """A prompt's choices: its ``n`` completions, or the sequences of its beam search
        (``use_beam_search``), each a stream of outputs."""
        if beam is None:
            return await self.engine.add_completions(request_ids, prompt, params)
        try:
            return await self.engine.add_beam_search(request_ids, prompt, beam, self._decode)
        except InvalidInputError as e:
            if e.param != "beam_width":
                raise
            raise InvalidInputError(str(e).replace("beam_width", "n"), param="n") from None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def _prompt_of(self, chat: proto.ChatRequest) -> dict[str, Any]:
        """The engine's prompt of a chat request: its messages, its images fetched, and what
        else the template takes (tools, how the prompt ends, more variables)."""
        images = await asyncio.gather(*(self.media.load(url) for url in chat.image_urls))
        prompt = {"messages": chat.messages, "images": list(images), **chat.turn}
        if chat.tools is not None:
            prompt["tools"] = chat.tools
        return self._with_lora(prompt, chat.lora)

    async def _parse(self, request: Request) -> proto.ChatRequest:
        chat = proto.parse_chat_request(await self._read_json(request), self.max_model_len,
                                        self.max_images, self.sampling_defaults,
                                        self.tool_parser, self.config.enable_mm_embeds)
        chat.lora = self._check_model_and_room(chat.model)  # before fetching images
        return chat

    async def _read_json(self, request: Request) -> Any:
        read = request.scope.get(_READ_BODY)
        if read is not None:  # read already (/invocations, to see where it goes)
            return read[0]
        body = await self._read_body(request)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise proto.bad_request(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise proto.bad_request("the request body is nested too deeply") from None
        except ValueError:  # Python refuses to convert integers of over 4300 digits
            raise proto.bad_request("the request body has a number with thousands of digits; "
                                    "send numbers of ordinary size.") from None

    def _check_model_and_room(self, model: str | None) -> LoRARequest | None:
        lora = self._check_model(model)
        if not self.engine.has_room():  # add_request checks again
            raise QueueFullError(
                f"{self.engine.max_waiting} requests are already waiting for a slot "
                f"(--max-queue {self.engine.max_waiting}); retry later.")
        return lora

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """``ApiError`` 404 for a model this server does not serve; else the LoRA adapter
        it names (None: the model's own weights), resolved once for the request."""
        if model is not None and model not in self.model_names and model not in self.loras:
            names = " or ".join(repr(name) for name in (*self.model_names, *self.loras))
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{names}.", param="model", code="model_not_found")
        return self.loras.get(model) if model is not None else None

    def _answer_model(self, lora: LoRARequest | None) -> str:
        """The model an answer names: the request's LoRA adapter, else the served model's
        first name."""
        return self.model if lora is None else lora.lora_name

    @staticmethod
    def _with_lora(prompt: dict[str, Any], lora: LoRARequest | None) -> dict[str, Any]:
        """The engine's prompt, running with ``lora`` where there is one."""
        return prompt if lora is None else {**prompt, "lora_request": lora}

    async def _read_body(self, request: Request) -> bytes:
        cap = self.config.max_request_body_bytes
        too_big = ApiError(413, f"the request body is over {cap} bytes; send smaller images or "
                           "fewer of them.", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise too_big
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise too_big
                chunks.append(chunk)

        timeout = self.config.body_timeout_s
        try:
            await asyncio.wait_for(read(), timeout)
        except ClientDisconnect:
            raise proto.bad_request("the client disconnected while sending the body") from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body took longer than {timeout:g} s to arrive "
                           "(--body-timeout); send it faster or in a smaller request.",
                           code="request_timeout", headers={"Connection": "close"}) from None
        return b"".join(chunks)

    async def _final_outputs(self, request: Request,
                             streams: list[RequestStream]) -> list[RequestOutput] | Response:
        """Wait for every stream's last output; abort them all if the client goes away
        meanwhile. A response instead when there is nothing to answer with (the client left,
        the engine died, a request failed)."""

        async def final_output(stream: RequestStream) -> RequestOutput | None:
            answer, last = Answer(), None
            async for out in stream:
                answer.add(out)
                last = out
            return None if last is None else answer.whole(last)

        answers = asyncio.ensure_future(asyncio.gather(*(final_output(s) for s in streams)))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({answers, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answers.done():
                answers.cancel()
                # A cancelled gather ends with the CancelledError as its exception, which
                # asyncio logs as never retrieved unless someone reads it.
                answers.add_done_callback(_read_outcome)
                for stream in streams:
                    self.engine.abort(stream.request_id)
        if not answers.done() or answers.cancelled():
            return Response(status_code=499)  # nobody is listening
        try:
            outs = answers.result()
        except EngineDeadError as e:
            self.metrics.count("error")
            return error_response(_as_api_error(e))
        for out in outs:
            if out.finish_reason == "error":
                return error_response(_failed(out))
        return outs

    async def _complete(self, request: Request, request_id: str,
                        streams: list[RequestStream], chat: proto.ChatRequest) -> Response:
        """Wait for the whole answer (every choice); abort if the client goes away."""
        outs = await self._final_outputs(request, streams)
        if isinstance(outs, Response):
            return outs
        body = self._completion_body(request_id, outs, chat)
        self._store_completion(body, chat)
        large = LargeParts()
        if chat.prompt_logprobs is not None:  # vLLM's: the prompt's, once (every choice's
            body["prompt_logprobs"] = self._prompt_logprobs(  # is the same)
                outs[0], large, chat.prompt_logprobs)
        return large.response(body)

    def _completion_body(self, request_id: str, outs: list[RequestOutput],
                         chat: proto.ChatRequest, created: int | None = None
                         ) -> dict[str, Any]:
        """The chat completion of ``outs``, each choice's whole output (without vLLM's
        ``prompt_logprobs``, which a caller adds), ``created`` then (None: now)."""
        choices = []
        tool_choice, as_ids = chat.tool_choice, self._as_ids(chat.tokens_as_ids)
        for i, out in enumerate(outs):
            logprobs = None if out.logprobs is None else shapes.logprobs_content(
                out.token_ids, out.logprobs, self._token_text, as_ids)
            reader = tool_calls.reader_for(tool_choice, self.tool_parser)
            if reader is None:
                choices.append(shapes.chat_choice(i, out.text, out.finish_reason, logprobs))
                continue
            content, calls = merge(reader.feed(out.text) + reader.finish())
            choices.append(shapes.chat_choice(
                i, content, tool_calls.finish_reason(out.finish_reason, tool_choice, reader),
                logprobs, calls))
        body = shapes.completion(request_id, self._answer_model(chat.lora), choices,
                                 usage_of([outs]), created)
        if chat.token_ids:  # vLLM's return_token_ids
            body["prompt_token_ids"] = outs[0].prompt_token_ids
            for choice, out in zip(choices, outs, strict=True):
                choice["token_ids"] = out.token_ids
        return body

    def _as_ids(self, tokens_as_ids: bool | None) -> bool:
        """Whether a request's log-probabilities name tokens "token_id:N"."""
        return (self.config.return_tokens_as_token_ids if tokens_as_ids is None
                else tokens_as_ids)

    def _prompt_logprobs(self, out: RequestOutput, large: LargeParts,
                         alternatives: int) -> Any:
        """vLLM's ``prompt_logprobs`` of ``out`` with ``alternatives`` each, a part of
        ``large`` (a long prompt's)."""
        ids, entries = out.prompt_token_ids or [], out.prompt_logprobs or []
        return large.add(lambda start, end: shapes.prompt_logprobs(
            ids[start:end], entries[start:end], self._token_text, alternatives), len(entries))

    async def _sse(self, rid: str, streams: list[RequestStream], include_usage: bool,
                   tool_choice: tool_calls.ToolChoice, continuous_usage: bool = False,
                   as_ids: bool = False, token_ids: bool = False,
                   on_whole: Callable[[list[RequestOutput], int], None] | None = None, *,
                   model: str) -> AsyncIterator[str]:
        """A chat answer's chunks: each choice's role first, with the choice's first output
        (as OpenAI and vLLM send it: a client that times the first chunk times the first
        token), then its text as it comes (or the tool calls read from it), in the order the
        choices produce it (``index`` says whose), the usage last when asked (and in every
        chunk, that choice's so far, with ``continuous_usage``). ``token_ids`` (vLLM's
        ``return_token_ids``): the prompt's token ids in each choice's first chunk, and in
        each chunk of a choice the ids of its tokens since the one before. ``on_whole``: told
        of every choice's whole output, and the chunks' ``created``, once all have finished
        (not when the stream failed or the client left). ``model``: the one chunks name."""
        created = int(time.time())
        answers = [Answer() for _ in streams]
        readers = [tool_calls.reader_for(tool_choice, self.tool_parser) for _ in streams]
        prompt_ids: list[int] | None = None  # the prompt's, for the next chunk to carry

        def event(index: int, delta: dict[str, Any] | None, reason: str | None = None,
                  usage: dict[str, Any] | None = None, out: RequestOutput | None = None) -> str:
            nonlocal prompt_ids
            logprobs, ids = None, []
            if out is not None and (out.logprobs is not None or token_ids):
                ids, entries = answers[index].unsent()  # the tokens since the last chunk
                if out.logprobs is not None:
                    logprobs = shapes.logprobs_content(ids, entries, self._token_text, as_ids)
            if continuous_usage and delta is not None and usage is None:
                usage = answers[index].usage_so_far()
            body = shapes.chunk(rid, model, created, delta, reason, include_usage, usage,
                                logprobs, index)
            if token_ids and delta is not None:
                body["choices"][0]["token_ids"] = ids
                if prompt_ids is not None:
                    body["prompt_token_ids"], prompt_ids = prompt_ids, None
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        finals: list[RequestOutput | None] = [None] * len(streams)
        started = [False] * len(streams)
        try:
            async with contextlib.aclosing(self._merged(streams)) as merged:
                async for index, out in merged:
                    if isinstance(out, ApiError):  # the stream ends with its error event
                        yield f"data: {json.dumps(out.body())}\n\n"
                        break
                    if not started[index]:
                        if token_ids:  # in each choice's first chunk, as vLLM's
                            prompt_ids = out.prompt_token_ids
                        started[index] = True
                        yield event(index, {"role": "assistant", "content": ""}, usage=(
                            shapes.usage(out.num_prompt_tokens, 0, out.num_cached_tokens)
                            if continuous_usage else None))
                    answers[index].add(out)
                    reader = readers[index]
                    for delta in deltas(reader, out):
                        yield event(index, delta, out=out)
                    if out.finished:
                        reason = out.finish_reason if reader is None else (
                            tool_calls.finish_reason(out.finish_reason, tool_choice, reader))
                        yield event(index, {}, reason, out=out)
                        finals[index] = answers[index].whole(out)
                else:
                    if on_whole is not None and None not in finals:
                        on_whole(finals, created)
                    if include_usage:
                        yield event(0, None, usage=usage_of([[o for o in finals if o]]))
            yield "data: [DONE]\n\n"
        finally:  # the client went away, or we are done: aborting a finished one does nothing
            self._abort(streams)

    async def _merged(self, streams: list[RequestStream]
                      ) -> AsyncIterator[tuple[int, RequestOutput | ApiError]]:
        """The outputs of several streams as they come, each with its stream's index. A
        failure (a request the engine failed, an engine that stopped) comes as its error (an
        SSE stream sends OpenAI's error body: the openai client raises it), and nothing comes
        after it. Leaving (the client went away, a failure, the end) aborts every stream's
        request; aborting a finished one does nothing."""
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = (
            asyncio.Queue())

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await merged.put((index, out))
            except EngineDeadError as e:
                await merged.put((index, e))
            await merged.put((index, None))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            running = len(streams)
            while running:
                index, item = await merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    self.metrics.count("error")
                    yield index, _as_api_error(item)
                    return
                elif item.finish_reason == "error":
                    yield index, _failed(item)
                    return
                else:
                    yield index, item
        finally:
            for task in pumps:
                task.cancel()
            self._abort(streams)

    def _abort(self, streams: Sequence[RequestStream]) -> None:
        for stream in streams:
            self.engine.abort(stream.request_id)

    def _refused(self, error: Exception, streams: Sequence[RequestStream] = ()) -> Response:
        """The error answer of a request refused before its answer began, ``streams`` (its
        prompts added already) aborted."""
        self._abort(streams)
        err = _as_api_error(error)
        self.metrics.count("rejected" if err.status < 500 else "error")
        return error_response(err)

    # ----------------------------------------------------------------- embeddings
    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: each ``input`` prompt's embedding, or vLLM's
        ``messages`` form (one conversation, images included); each prompt an engine
        request of one prefill step."""
        request_id, engine_id = request_ids_of(request, "embd-")
        try:
            req = proto.parse_embeddings_request(
                await self._read_json(request), self.max_model_len, self.max_images,
                self.engine.processor.hidden_size, self.config.enable_mm_embeds)
            lora = self._check_model_and_room(req.model)
        except (ApiError, InvalidInputError, QueueFullError, EngineDeadError) as e:
            return self._refused(e)
        if req.chat is not None:
            items, fields = [req.chat], ["messages"]
        else:
            items = req.prompts
            fields = ["input"] if len(items) == 1 else [f"input[{i}]" for i in range(len(items))]
        outs = await self._embed(request, engine_id, items, fields, req.params, lora)
        if isinstance(outs, Response):
            return outs
        normalize = (self.engine.config.normalize_embeddings if req.normalize is None
                     else req.normalize)
        data = [_embedding_values(embedding_of(out, normalize), req.as_base64)
                for out in outs]
        return JSONResponse(shapes.embeddings(request_id, self._answer_model(lora),
                                              int(time.time()), data,
                                              sum(out.num_prompt_tokens for out in outs)))

    async def score(self, request: Request) -> Response:
        """vLLM's ``POST /score`` over embeddings: the cosine similarity of each pair."""
        scored = await self._scored(request, "score-", proto.parse_score_request)
        if isinstance(scored, Response):
            return scored
        request_id, _, scores, tokens, model = scored
        return JSONResponse(shapes.scores(request_id, model,
                                          int(time.time()), scores, tokens))

    async def rerank(self, request: Request) -> Response:
        """vLLM's (Jina's, Cohere's) ``POST /rerank`` over embeddings: the documents by the
        cosine similarity of their embeddings to the query's, best first."""
        scored = await self._scored(request, "rerank-", proto.parse_rerank_request)
        if isinstance(scored, Response):
            return scored
        request_id, req, scores, tokens, model = scored
        return JSONResponse(shapes.reranked(request_id, model,
                                            req.documents, scores,
                                            req.top_n, tokens))

    async def _scored(self, request: Request, prefix: str, parse: Any
                      ) -> tuple[str, proto.ScoreRequest, list[float], int, str] | Response:
        """A score or rerank request's id, the request, its pairs' scores, the prompt
        tokens of its items (each embedded once) and the model the answer names."""
        request_id, engine_id = request_ids_of(request, prefix)
        try:
            req = parse(await self._read_json(request), self.max_model_len, self.max_images,
                        self.config.enable_mm_embeds)
            lora = self._check_model_and_room(req.model)
        except (ApiError, InvalidInputError, QueueFullError, EngineDeadError) as e:
            return self._refused(e)
        outs = await self._embed(request, engine_id, req.items, req.fields, req.params, lora)
        if isinstance(outs, Response):
            return outs
        return (request_id, req, cosine_scores([embedding_of(out) for out in outs], req.pairs),
                sum(out.num_prompt_tokens for out in outs), self._answer_model(lora))

    async def _embed(self, request: Request, engine_id: str,
                     items: list[dict[str, Any] | proto.ChatRequest], fields: list[str],
                     params: SamplingParams, lora: LoRARequest | None = None
                     ) -> list[RequestOutput] | Response:
        """Each item's embedding request (a prompt, or a chat whose images are fetched
        here; with the LoRA adapter ``lora``), answered whole; a refusal names the item's
        field (``fields``), and the items added before it are aborted."""
        streams: list[RequestStream] = []
        try:
            for i, item in enumerate(items):
                if i and await request.is_disconnected():  # (images fetched one by one)
                    self._abort(streams)
                    return Response(status_code=499)
                try:
                    prompt = self._with_lora(
                        item if isinstance(item, dict) else await self._prompt_of(item), lora)
                    streams += await self.engine.add_completions([f"{engine_id}-{i}"], prompt,
                                                                 params)
                except (ApiError, InvalidInputError) as e:  # named as this endpoint's field
                    e.param = _in_field(e.param, fields[i])
                    raise
        except (ApiError, InvalidInputError, QueueFullError, EngineDeadError) as e:
            return self._refused(e, streams)
        except BaseException:  # (a bug, or the handler cancelled): none left running
            self._abort(streams)
            raise
        outs = await self._final_outputs(request, streams)
        if not isinstance(outs, Response) and not all(
                torch.isfinite(out.embedding).all() for out in outs):
            return error_response(ApiError(
                500, "the model's hidden state is not finite for this input (the weights or "
                "the dtype overflow); no embedding can be given.", type="server_error",
                code="generation_failed"))
        return outs

    # ----------------------------------------------------------------- completions
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: text or token-id prompts (images go to the chat endpoint),
        each prompt an engine request of its own and a choice of the answer."""
        request_id, engine_id = request_ids_of(request, "cmpl-")
        streams: list[RequestStream] = []
        try:
            req = proto.parse_completion_request(await self._read_json(request),
                                                 self.max_model_len, self.sampling_defaults)
            lora = self._check_model_and_room(req.model)
            n = req.params.n
            for i, prompt in enumerate(req.prompts):  # choice p * n + j: prompt p's j-th
                streams += await self._add([f"{engine_id}-{i * n + j}" for j in range(n)],
                                           self._with_lora(prompt, lora), req.params,
                                           req.beam)
        except (ApiError, InvalidInputError, QueueFullError, EngineDeadError) as e:
            return self._refused(e, streams)  # (the prompts added before the one refused)
        echoes = None
        if req.echo:  # each choice's prompt's text (choice p * n + j: prompt p's)
            texts = [self._prompt_text(prompt, req.params.truncate_prompt_tokens)
                     for prompt in req.prompts]
            echoes = [texts[i // n] for i in range(len(streams))]
        if req.stream:
            return self._event_stream(
                self._completion_sse(request_id, streams, req.include_usage, n, echoes,
                                     req.prompt_only, req.continuous_usage,
                                     self._as_ids(req.tokens_as_ids), req.token_ids,
                                     model=self._answer_model(lora)),
                on_close=lambda: self._abort(streams))
        outs = await self._final_outputs(request, streams)
        if isinstance(outs, Response):
            return outs
        if req.prompt_only:
            outs = [without_generated(out) for out in outs]
        choices = []
        as_ids = self._as_ids(req.tokens_as_ids)
        large = LargeParts()  # an echoed prompt's log-probabilities, vLLM's prompt_logprobs
        for i, out in enumerate(outs):
            first = outs[i - i % n]  # the prompt's first choice, which scored the prompt
            logprobs = None
            if out.logprobs is not None:
                ids, entries = out.token_ids, out.logprobs
                if echoes is not None:  # the prompt's tokens first (the first has none)
                    ids = [*(out.prompt_token_ids or ()), *ids]
                    entries = [*(first.prompt_logprobs or ()), *entries]
                logprobs = self._completion_logprobs(ids, entries, as_ids, large,
                                                     req.params.logprobs)
            text = out.text if echoes is None else echoes[i] + out.text
            choices.append(shapes.completion_choice(i, text, out.finish_reason, logprobs))
            if req.token_ids:  # vLLM's return_token_ids
                choices[-1]["prompt_token_ids"] = out.prompt_token_ids
                choices[-1]["token_ids"] = out.token_ids
            if req.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(first, large,
                                                                       req.prompt_logprobs)
        return large.response(shapes.text_completion(request_id, self._answer_model(lora),
                                                     choices,
                                                     usage_of(per_prompt(outs, n))))

    def _completion_logprobs(self, ids: list[int], entries: list[TokenLogprobs | None],
                             as_ids: bool, large: LargeParts,
                             alternatives: int | None) -> dict[str, Any]:
        """The completions endpoint's ``logprobs`` of ``ids`` with ``alternatives`` each, its
        alternatives (the large part, for an echoed prompt) written a piece at a time."""
        top = large.add(lambda start, end: shapes.top_logprobs(
            entries[start:end], self._token_text, as_ids, alternatives), len(entries))
        return shapes.completion_logprobs(ids, entries, self._token_text, as_ids=as_ids,
                                          top=top)

    def _prompt_text(self, prompt: dict[str, Any], keep_last: int | None) -> str:
        """What ``echo`` repeats of a completions prompt: its text (whole, as vLLM's), or the
        text of the token ids it reads (``keep_last``: ``truncate_prompt_tokens``)."""
        if "prompt" in prompt:
            return prompt["prompt"]
        ids = prompt["prompt_token_ids"]
        if keep_last is not None:
            ids = ids[-(self.max_model_len if keep_last == -1 else keep_last):]
        return self.tokenizer.decode(ids)

    async def _completion_sse(self, rid: str, streams: list[RequestStream],
                              include_usage: bool, n: int, echoes: list[str] | None = None,
                              prompt_only: bool = False, continuous_usage: bool = False,
                              as_ids: bool = False, token_ids: bool = False, *,
                              model: str) -> AsyncIterator[str]:
        """The choices' streams merged into one, each chunk one choice's new text (``index``
        says which), after a chunk of each choice's prompt where ``echoes`` has them (with
        ``prompt_only``, nothing generated follows); the usage of them all last when asked
        for (and in each chunk of new text, its choice's so far, with
        ``continuous_usage``). ``token_ids`` (vLLM's ``return_token_ids``): each choice's
        prompt token ids in its first chunk of new text, and in each such chunk the ids of
        its tokens since the one before."""
        created = int(time.time())

        def event(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
            body = shapes.completion_chunk(rid, model, created, choice,
                                           include_usage,
                                           usage)
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        answers = [Answer() for _ in streams]
        offsets = [0] * len(streams)  # the text of the tokens chunks carried logprobs for
        answered = [False] * len(streams)  # a chunk of the choice's new text went out
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            for index, text in enumerate(echoes or ()):
                yield event(shapes.completion_choice(index, text, None))
            async with contextlib.aclosing(self._merged(streams)) as merged:
                async for index, out in merged:
                    if isinstance(out, ApiError):  # the stream ends with its error event
                        yield f"data: {json.dumps(out.body())}\n\n"
                        break
                    if prompt_only:
                        out = without_generated(out)
                    answers[index].add(out)
                    if not (out.new_text or out.finished):
                        continue
                    logprobs, ids = None, []
                    if out.logprobs is not None or token_ids:
                        ids, entries = answers[index].unsent()
                    if out.logprobs is not None:
                        logprobs = shapes.completion_logprobs(
                            ids, entries, self._token_text, offsets[index], as_ids)
                        offsets[index] += sum(len(self._token_text(t)) for t in ids)
                    reason = out.finish_reason if out.finished else None
                    choice = shapes.completion_choice(index, out.new_text, reason, logprobs)
                    if token_ids:
                        if not answered[index]:
                            choice["prompt_token_ids"] = out.prompt_token_ids
                        choice["token_ids"] = ids
                    answered[index] = True
                    yield event(choice,
                                answers[index].usage_so_far() if continuous_usage else None)
                    if out.finished:
                        finals[index] = answers[index].whole(out)
                else:
                    if include_usage:
                        yield event(None, usage_of(per_prompt([o for o in finals if o], n)))
            yield "data: [DONE]\n\n"
        finally:
            self._abort(streams)

    # ----------------------------------------------------------------- app
    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.engine.start()
            try:
                self.batch_api.start(app)
                if self.batch_api.store is not None:  # images may name uploaded files
                    self.media.file_path = self.batch_api.files.image_path
                # The event loop's tokenizer, copied off the loop before requests need it.
                await asyncio.get_running_loop().run_in_executor(None, self._copy_tokenizer)
            except BaseException:  # (the engine's loop gives its steps back)
                self.uploads.close()
                await self.batch_api.stop()
                await self.engine.shutdown()
                raise
            logger.info("serving %r", self.model)
            yield
            # uvicorn has drained in-flight requests (SIGTERM) before this point; background
            # responses are not requests, and stop here.
            for task in list(self._background):
                task.cancel()
            self.uploads.close()
            await self.batch_api.stop()
            await self.engine.shutdown()
            self.media.close()

        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            *(Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, self.rerank, methods=["POST"])
              for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/input_tokens", self.response_input_tokens, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel_response,
                  methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", self.response_input_items,
                  methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            # An id may hold slashes (a checkpoint's path, an organization's name).
            Route("/v1/models/{model:path}", self.retrieve_model, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),  # SageMaker's
            Route("/invocations", self.invocations, methods=["POST"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            *self.batch_api.routes(),
            *self.uploads.routes(),
            *self.conversations.routes(),
            *self.stored_completions.routes(),
            *chat_page.routes(),
        ]
        config = self.config
        cors = [Middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials,
                           expose_headers=["X-Request-Id"])] if config.allowed_origins else []
        return Starlette(
            routes=routes, lifespan=lifespan,  # (a browser's preflight needs no API key)
            middleware=[*cors,
                        Middleware(RequestIdMiddleware, count=self.metrics.count_response),
                        Middleware(ApiKeyMiddleware, api_key=config.api_key)],
            exception_handlers={HTTPException: http_exception})


def build_app(engine: LLMEngine, config: ServerConfig) -> Starlette:
    """The Starlette app serving ``engine``; the engine loop starts with the app's lifespan."""
    return OpenAIServer(engine, config).app()


# OpenAI's fields of POST /v1/responses/input_tokens, and vLLM's mm_processor_kwargs and
# cache_salt; the Responses API's other fields (sampling, storing, streaming) change no
# input token and are not read there.
_COUNTED_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "truncation", "conversation", "previous_response_id", "mm_processor_kwargs",
    "cache_salt"})


def _as_api_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, AdapterUnavailableError):
        # (the server's own adapter, which the request named: nothing the client sent)
        return ApiError(500, f"the model's LoRA adapter cannot run: {e}", param="model",
                        type="server_error", code="adapter_unavailable")
    if isinstance(e, InvalidInputError):
        return proto.bad_request(str(e), e.param)
    if isinstance(e, QueueFullError):
        return ApiError(503, str(e), type="server_overloaded", code="queue_full",
                        headers={"Retry-After": "1"})
    return ApiError(503, str(e), type="server_error", code="engine_unavailable")


def _in_field(param: str | None, field: str) -> str | None:
    """An embedding item's error's ``param`` as the endpoint's ``field`` for the item: the
    engine names a prompt's ``prompt`` (or ``messages``, ``images``), and a chat item's
    ``messages[0]...`` (vLLM's ``{"content": [...]}`` items are one user message)."""
    if field == "messages" or param in ("truncate_prompt_tokens", "priority", "request_id"):
        return param
    if param is not None and param.startswith("messages[0]"):
        return field + param[len("messages[0]"):]
    return field


def _embedding_values(embedding: torch.Tensor, as_base64: bool) -> list[float] | str:
    """An embedding as the answer writes it: its numbers, or the base64 of its float32
    little-endian bytes (``encoding_format: "base64"``, which the openai client asks for)."""
    values = embedding.to(torch.float32).contiguous()
    if as_base64:
        raw = values.numpy().astype("<f4", copy=False).tobytes()
        return base64.b64encode(raw).decode("ascii")
    return values.tolist()


def _starting_after(query: Any) -> int | Response:
    """``GET /v1/responses/{id}?stream=true``'s ``starting_after``: the events numbered above
    it are streamed (all of them where it is left out)."""
    raw = query.get("starting_after")
    if raw is None:
        return -1
    try:
        after = int(raw)
    except ValueError:
        after = -1
    if after < 0 or len(raw) > 18:
        return error_response(proto.bad_request(
            "'starting_after' must be an event's sequence_number (an integer from 0).",
            "starting_after"))
    return after


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _read_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _failed(out: RequestOutput) -> ApiError:
    """The engine failed this request (and only this one: the others went on)."""
    return ApiError(500, f"the engine failed while generating this request's answer "
                    f"({out.error}); other requests are unaffected, retrying may work.",
                    type="server_error", code="generation_failed")
