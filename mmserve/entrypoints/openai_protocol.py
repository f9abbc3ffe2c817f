"""OpenAI's and vLLM's request wire format: validation of chat, completions and tokenize
requests into what the engine takes, and errors. The answers' shapes are
``openai_shapes.py``'s.

Everything here is plain data in, plain data out (no I/O), so each rule is unit-testable. A
request that breaks a rule raises ``ApiError`` with OpenAI's error body: a message that says
what to change, and the offending parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mmserve.beam_search import BeamSearchParams
from mmserve.engine.request_maker import cache_salt
from mmserve.entrypoints import tool_calls
from mmserve.entrypoints.image_embeds import EmbedsPart, parse_embeds_part
from mmserve.entrypoints.media import FilePart
from mmserve.entrypoints.openai_shapes import list_page
from mmserve.entrypoints.tool_calls import ToolChoice
from mmserve.errors import InvalidInputError
from mmserve.lora_request import LoRARequest
from mmserve.outputs import score_pairs
from mmserve.processing.chat_template import template_kwargs
from mmserve.processing.chat_tools import template_tool_calls
from mmserve.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputs,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


# Where a request's image comes from: a URL, its embeddings, or an uploaded file.
ImageSource = str | EmbedsPart | FilePart


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def paged(items: list[dict[str, Any]], query: Mapping[str, str], default_limit: int,
          max_limit: int, what: str, where: str = "") -> dict[str, Any]:
    """``openai_shapes.list_page`` of ``items``, a bad query parameter a 400 naming it."""
    try:
        return list_page(items, dict(query), default_limit, max_limit, what, where)
    except ValueError as e:  # "limit: must be ..."
        raise bad_page(e) from None


def bad_page(e: ValueError) -> ApiError:
    """A list's bad query parameter (``openai_shapes.list_page``'s ``ValueError``, "param:
    why") as a 400 naming it."""
    param, _, why = str(e).partition(": ")
    return bad_request(f"{param}: {why}", param)


def metadata_of(value: Any) -> dict[str, str]:
    """OpenAI's ``metadata``: at most 16 string keys (64 characters) and values (512)."""
    if value is None:
        return {}
    if not (isinstance(value, dict) and len(value) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    for k, v in value.items())):
        raise bad_request("'metadata' must be an object of at most 16 keys of up to 64 "
                          "characters, with strings of up to 512 characters as values",
                          "metadata")
    return value


@dataclass
class ChatRequest:
    """A validated chat request. ``messages`` hold ``{"type": "image"}`` parts in place of
    ``image_url`` (and ``image_embeds``) parts; ``image_urls`` lists those URLs (and
    ``EmbedsPart``s) in the same order. ``tools``: the
    functions the chat template shows the model (None without any); ``tool_choice``: what
    the answer is read as (``tool_calls.py``)."""

    messages: list[dict[str, Any]]
    image_urls: list[ImageSource]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's: the usage so far in every chunk too
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = ToolChoice()
    # vLLM's add_generation_prompt, continue_final_message, chat_template_kwargs and
    # cache_salt where a request sets them (the engine takes them from the prompt).
    turn: dict[str, Any] = field(default_factory=dict)
    beam: BeamSearchParams | None = None  # vLLM's use_beam_search: params then unused
    # vLLM's: log-probabilities of the prompt's tokens in the answer, with this many
    # alternatives each (None: no such field; ``params`` computes them), and tokens in
    # log-probabilities as "token_id:N" (None: the server's default).
    prompt_logprobs: int | None = None
    tokens_as_ids: bool | None = None
    # vLLM's return_token_ids: the prompt's token ids and each choice's generated ones.
    token_ids: bool = False
    # OpenAI's stored completions: ``store`` keeps the answer, with ``metadata`` and the
    # messages as they were sent (``sent_messages``, images' URLs in place).
    store: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    sent_messages: list[dict[str, Any]] = field(default_factory=list)
    # The LoRA adapter ``model`` names, resolved once, when the server checks the model (an
    # adapter unloaded or loaded anew meanwhile changes nothing of this request).
    lora: LoRARequest | None = None


def parse_chat_request(body: Any, max_model_len: int, max_images: int,
                       defaults: Mapping[str, Any] | None = None,
                       tool_parser: str | None = None, mm_embeds: bool = False) -> ChatRequest:
    """Validate a decoded JSON body of ``POST /v1/chat/completions``; ``defaults``: the
    sampling fields a request that leaves them out gets (``sampling_defaults``);
    ``tool_parser``: the server's parser of calls in the model's text, when it reads them
    (``--enable-auto-tool-choice``)."""
    model = _model(body)
    messages, image_urls = _parse_messages(body.get("messages"), max_images, mm_embeds)
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise bad_request("mmserve answers in text only: send 'modalities': ['text'] or leave "
                          "it out", "modalities")
    for name in ("audio", "web_search_options"):
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported by mmserve; leave it out.", name)
    try:
        tools, tool_choice = tool_calls.parse_tools(body, tool_parser)
    except InvalidInputError as e:
        raise bad_request(str(e), e.param) from None
    logprobs = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    _check_num_logprobs(top_logprobs, "top_logprobs")
    stream, include_usage, continuous_usage = _stream_options(body)
    prompt_logprobs = _prompt_logprobs(body, stream)
    params = _sampling_params(body, max_model_len, default_max_tokens=max_model_len,
                              logprobs=(top_logprobs or 0) if logprobs else None,
                              defaults=defaults or {}, prompt_logprobs=prompt_logprobs,
                              tool_schema=tools and tool_calls.output_schema(tools, tool_choice))
    beam = _beam_search(body, params)
    if beam is not None and tools and tool_choice.mode != "none":
        raise bad_request("a beam search writes text: send 'tool_choice': \"none\" with "
                          "'use_beam_search' or leave the tools out.", "use_beam_search")
    return ChatRequest(messages, image_urls, params, stream=stream, include_usage=include_usage,
                       continuous_usage=continuous_usage, model=model, tools=tools,
                       tool_choice=tool_choice,
                       turn={**_turn(body), **_cache_salt(body), **_mm_kwargs(body)},
                       beam=beam, prompt_logprobs=prompt_logprobs,
                       tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, None),
                       token_ids=_get(body, "return_token_ids", bool, False),
                       store=_get(body, "store", bool, False),
                       metadata=metadata_of(body.get("metadata")),
                       sent_messages=body["messages"])


def _cache_salt(body: dict[str, Any]) -> dict[str, str]:
    """vLLM's ``cache_salt``, checked, as the key of a prompt that has one: the prefix cache
    and the encoder cache share what such a request computes only with requests of the same
    salt."""
    try:
        salt = cache_salt(body)
    except InvalidInputError as e:
        raise bad_request(str(e), e.param) from None
    return {} if salt is None else {"cache_salt": salt}


def _mm_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``mm_processor_kwargs``, where given: image-processor settings for this request's
    images over the server's (the processor says which a model takes)."""
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("'mm_processor_kwargs' must be an object of image-processor "
                          "settings, such as {\"max_pixels\": 200704}", "mm_processor_kwargs")
    return {"mm_processor_kwargs": kwargs}


def _turn(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``add_generation_prompt`` (default true), ``continue_final_message`` (the
    model goes on writing the last message, an assistant's) and ``chat_template_kwargs``
    (more variables for the template), where given; the processor checks that the first two
    agree."""
    turn: dict[str, Any] = {
        name: _get(body, name, bool, None) for name in
        ("add_generation_prompt", "continue_final_message") if body.get(name) is not None}
    if body.get("chat_template_kwargs") is not None:
        try:
            turn["chat_template_kwargs"] = template_kwargs(body["chat_template_kwargs"])
        except InvalidInputError as e:
            raise bad_request(str(e), e.param) from None
    return turn


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions``: one or more prompts, each text or token ids."""

    prompts: list[dict[str, Any]]  # {"prompt": str} or {"prompt_token_ids": [...]}, in order
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    model: str | None = None
    # ``echo``: each choice's text (and log-probabilities) starts with its prompt's; with
    # ``max_tokens`` 0 (``prompt_only``) it is the prompt's alone (the engine samples one
    # token, which is dropped).
    echo: bool = False
    prompt_only: bool = False
    beam: BeamSearchParams | None = None  # vLLM's use_beam_search: params then unused
    prompt_logprobs: int | None = None  # as ``ChatRequest``'s, in each choice
    tokens_as_ids: bool | None = None
    token_ids: bool = False  # as ``ChatRequest``'s, the prompt's in each choice


# The highest temperature either endpoint takes (OpenAI's).
MAX_API_TEMPERATURE = 2.0
# Choices one completions request may ask for (prompts x n): each an engine request of its own.
MAX_COMPLETION_PROMPTS = 256
# OpenAI's default for the completions endpoint (chat's is the context's room).
DEFAULT_COMPLETION_TOKENS = 16


def parse_completion_request(body: Any, max_model_len: int,
                             defaults: Mapping[str, Any] | None = None) -> CompletionRequest:
    """Validate a decoded JSON body of ``POST /v1/completions`` (text only: images go to the
    chat endpoint); ``defaults`` as ``parse_chat_request``'s."""
    model = _model(body)
    for name in ("images", "image", "image_url", "multi_modal_data", "messages", "tools",
                 "tool_choice"):
        if name in body and not (name.startswith("tool") and body[name] in (None, [], "none")):
            raise bad_request(f"'{name}' is not part of /v1/completions, which takes text or "
                              "token ids only; send images, messages and tools to "
                              "/v1/chat/completions.", name)
    echo = _get(body, "echo", bool, False)
    prompt_only = echo and body.get("max_tokens") == 0 and not body.get("max_completion_tokens")
    if prompt_only:  # the prompt scored, nothing generated (as lm-eval-harness asks)
        body = {**body, "max_tokens": 1}
    if body.get("suffix"):
        raise bad_request("'suffix' (fill-in-the-middle) is not supported by mmserve; leave "
                          "it out.", "suffix")
    best_of = _get(body, "best_of", int, 1)
    if best_of != 1:
        raise bad_request(f"best_of={_short_int(best_of)} is not supported; leave it out or "
                          "send 1.", "best_of")
    logprobs = _get(body, "logprobs", int, None)
    _check_num_logprobs(logprobs, "logprobs")
    stream, include_usage, continuous_usage = _stream_options(body)
    if echo and stream and logprobs is not None:
        raise bad_request("'echo' with 'logprobs' is answered whole: send 'stream': false (a "
                          "stream echoes the prompt's text, without its log-probabilities)",
                          "echo")
    prompt_logprobs = _prompt_logprobs(body, stream)
    # An echo's log-probabilities are the prompt's: the engine computes as many alternatives
    # as either field shows, and each field shows its own number.
    scored = prompt_logprobs
    if echo and logprobs is not None:
        scored = max(logprobs, prompt_logprobs or 0)
    params = _sampling_params(body, max_model_len, DEFAULT_COMPLETION_TOKENS, logprobs,
                              defaults or {}, prompt_logprobs=scored)
    salt = _cache_salt(body)
    prompts = [{**prompt, **salt} for prompt in _parse_prompts(body.get("prompt"))]
    if len(prompts) * params.n > MAX_COMPLETION_PROMPTS:
        raise bad_request(f"{len(prompts)} prompts x n={params.n} make {len(prompts) * params.n} "
                          f"choices; at most {MAX_COMPLETION_PROMPTS} are allowed in one "
                          "request, send fewer prompts or a smaller n.", "n")
    beam = _beam_search(body, params)
    if beam is not None and echo:
        raise bad_request("'echo' is not taken with 'use_beam_search'; leave one out.", "echo")
    return CompletionRequest(prompts, params, stream=stream, include_usage=include_usage,
                             continuous_usage=continuous_usage, model=model, echo=echo,
                             prompt_only=prompt_only, beam=beam,
                             prompt_logprobs=prompt_logprobs,
                             tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, None),
                             token_ids=_get(body, "return_token_ids", bool, False))


# Fields of the chat endpoint's the chat form takes (the sampling ones have no use here).
_EMBEDDING_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                          "chat_template_kwargs", "mm_processor_kwargs")


@dataclass
class EmbeddingsRequest:
    """A validated ``POST /v1/embeddings``: text prompts (``input``), or one conversation
    (``messages``), and how the answer is written."""

    prompts: list[dict[str, Any]]  # {"prompt": str} or {"prompt_token_ids": [...]}
    chat: ChatRequest | None  # vLLM's messages form: its images still to fetch
    params: SamplingParams
    model: str | None = None
    as_base64: bool = False
    normalize: bool | None = None  # None: the engine's normalize_embeddings


def parse_embeddings_request(body: Any, max_model_len: int, max_images: int,
                             hidden_size: int, mm_embeds: bool = False) -> EmbeddingsRequest:
    """Validate a decoded JSON body of ``POST /v1/embeddings``: OpenAI's ``input`` (as the
    completions' ``prompt``: each text or token ids an embedding of its own, in order), or
    vLLM's ``messages`` (one conversation in the chat endpoint's form, images included,
    rendered as the chat endpoint renders it: how a vision-language embedding model such as
    E5-V or VLM2Vec is asked about an image); ``encoding_format`` ``float`` or ``base64``;
    ``dimensions`` only as the model's ``hidden_size`` (embeddings are not shortened);
    vLLM's ``normalize`` (default: the engine's), ``truncate_prompt_tokens`` and ``priority``."""
    model = _model(body)
    if ("input" in body) == ("messages" in body):
        raise bad_request("send 'input' (text or token ids, OpenAI's) or 'messages' (a "
                          "conversation in the chat endpoint's form, images included, "
                          "vLLM's), one of the two", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be \"float\" or \"base64\"", "encoding_format")
    dimensions = _get(body, "dimensions", int, None)
    if dimensions is not None and dimensions != hidden_size:
        raise bad_request(f"this model's embeddings have {hidden_size} dimensions and are not "
                          "shortened: leave 'dimensions' out, or send that.", "dimensions")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("'user' must be a string", "user")
    chat_form = "messages" in body
    special = _get(body, "add_special_tokens", bool, not chat_form)
    if special != (not chat_form):
        raise bad_request(f"'add_special_tokens' must be {str(not chat_form).lower()} here "
                          "(the tokenizer's own for text, the chat template's for messages)",
                          "add_special_tokens")
    params = _embedding_params(body)
    normalize = _get(body, "normalize", bool, None)
    as_base64 = encoding == "base64"
    if chat_form:
        chat = parse_chat_request(
            {"model": model, "max_tokens": 1, **_cache_salt(body), **{
                name: body[name] for name in _EMBEDDING_CHAT_FIELDS if name in body}},
            max_model_len, max_images, mm_embeds=mm_embeds)
        return EmbeddingsRequest([], chat, params, model, as_base64, normalize)
    salt = _cache_salt(body)
    prompts = [{**prompt, **salt} for prompt in _parse_prompts(body["input"], "input")]
    return EmbeddingsRequest(prompts, None, params, model, as_base64, normalize)


def _embedding_params(body: dict[str, Any]) -> SamplingParams:
    """An embedding request's parameters: one prefill, its last hidden state kept; vLLM's
    ``truncate_prompt_tokens`` and ``priority``."""
    try:
        return SamplingParams(
            max_tokens=1, temperature=0.0, return_embedding=True, output_kind="final_only",
            truncate_prompt_tokens=_get(body, "truncate_prompt_tokens", int, None),
            priority=_get(body, "priority", int, 0))
    except InvalidInputError as e:
        raise bad_request(str(e), e.param) from None


@dataclass
class ScoreRequest:
    """A validated ``POST /score`` or ``/rerank`` (vLLM's, over embeddings): the items to
    embed, each once (``{"prompt": text}``, or a one-message ``ChatRequest`` whose content
    holds images), each one's field for errors, and the pairs of items scored (cosine
    similarity), in the answer's order."""

    items: list[dict[str, Any] | ChatRequest]
    fields: list[str]
    pairs: list[tuple[int, int]]
    params: SamplingParams
    model: str | None = None
    top_n: int = 0  # /rerank: the best this many (0: all), best first
    documents: list[Any] | None = None  # /rerank: the documents, to return with the results


def parse_score_request(body: Any, max_model_len: int, max_images: int,
                        mm_embeds: bool = False) -> ScoreRequest:
    """vLLM's ``POST /score``: ``text_1`` and ``text_2``, each a text, vLLM's ``{"content":
    [parts]}`` (text and images), or a list of up to 256 of either; one ``text_1`` is scored
    against every ``text_2``, or each against its own (as many of both)."""
    model = _model(body)
    left = _score_items(body.get("text_1"), "text_1", max_model_len, max_images, mm_embeds)
    right = _score_items(body.get("text_2"), "text_2", max_model_len, max_images, mm_embeds)
    try:
        pairs = score_pairs(len(left), len(right))
    except ValueError:
        raise bad_request(f"'text_1' has {len(left)} items and 'text_2' {len(right)}: send one "
                          "'text_1' to score against every 'text_2', or as many of each.",
                          "text_1") from None
    items, fields = zip(*(left + right), strict=True)
    return ScoreRequest(list(items), list(fields), pairs, _embedding_params(body), model)


def parse_rerank_request(body: Any, max_model_len: int, max_images: int,
                         mm_embeds: bool = False) -> ScoreRequest:
    """vLLM's (Jina's, Cohere's) ``POST /rerank``: a ``query`` and ``documents`` (each a text
    or vLLM's ``{"content": [parts]}``; up to 256), ``top_n`` (0: all)."""
    model = _model(body)
    if isinstance(body.get("query"), list):
        raise bad_request("'query' must be one text, or one {'content': [...]}", "query")
    query = _score_items(body.get("query"), "query", max_model_len, max_images, mm_embeds)
    if len(query) != 1:
        raise bad_request("'query' must be one text, or one {'content': [...]} of one part",
                          "query")
    documents = body.get("documents")
    if _lone_content(documents):
        documents = _each_part(documents)
    if not isinstance(documents, list):
        raise bad_request("'documents' must be a non-empty list of texts (or of vLLM's "
                          "{'content': [...]}), or one {'content': [...]} of a part each",
                          "documents")
    docs = _score_items(documents, "documents", max_model_len, max_images, mm_embeds)
    top_n = _get(body, "top_n", int, 0)
    if top_n < 0:
        raise bad_request("'top_n' must be 0 (all) or more", "top_n")
    items, fields = zip(*(query + docs), strict=True)
    return ScoreRequest(list(items), list(fields), score_pairs(1, len(docs)),
                        _embedding_params(body), model, top_n, documents)


def _score_items(value: Any, name: str, max_model_len: int, max_images: int,
                 mm_embeds: bool) -> list[tuple[dict[str, Any] | ChatRequest, str]]:
    """A score or rerank field's items, each with its place, as vLLM reads them: a text, or
    a list of texts and ``{"content": [parts]}`` (one user message's content, images
    included: one item each); a lone ``{"content": [parts]}`` is one item per part."""
    def one(item: Any, where: str) -> tuple[dict[str, Any] | ChatRequest, str]:
        if isinstance(item, str):
            _check_text(item, where)
            if not item:
                raise bad_request(f"{where} is empty; send some text", where)
            return {"prompt": item}, where
        if isinstance(item, dict) and "content" in item:
            others = sorted(set(item) - {"content"})
            if others:
                raise bad_request(f"{where} has fields other than 'content': "
                                  f"{', '.join(repr(o[:32]) for o in others[:4])}", where)
            try:
                return parse_chat_request(
                    {"max_tokens": 1, "messages": [{"role": "user", "content": item["content"]}]},
                    max_model_len, max_images, mm_embeds=mm_embeds), where
            except ApiError as e:  # named as this field's
                theirs = e.param or "messages"
                ours = (where + theirs[len("messages[0]"):]
                        if theirs.startswith("messages[0]") else where)
                raise bad_request(e.message.replace(theirs, ours), ours) from None
        raise bad_request(f"{where} must be a text, or {{'content': [...]}} (text and image "
                          "parts, vLLM's)", where)

    if _lone_content(value):
        value, name = _each_part(value), f"{name}.content"
    if not isinstance(value, list):
        return [one(value, name)]
    if not value:
        raise bad_request(f"'{name}' must not be empty", name)
    if len(value) > MAX_COMPLETION_PROMPTS:
        raise bad_request(f"'{name}' has {len(value)} items; at most {MAX_COMPLETION_PROMPTS} "
                          "are allowed in one request", name)
    items = [one(item, f"{name}[{i}]") for i, item in enumerate(value)]
    images = sum(len(item.image_urls) for item, _ in items if isinstance(item, ChatRequest))
    if images > MAX_COMPLETION_PROMPTS:
        raise bad_request(f"'{name}' holds {images} images; at most {MAX_COMPLETION_PROMPTS} "
                          "are taken in one request", name)
    return items


def _lone_content(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"content"} \
        and isinstance(value["content"], list)


def _each_part(value: dict[str, Any]) -> list[Any]:
    """vLLM's lone ``{"content": [parts]}``: each part an item of its own (a text part its
    text)."""
    return [part["text"] if isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str) else {"content": [part]}
            for part in value["content"]]


@dataclass
class TokenizeRequest:
    """A validated ``POST /tokenize`` (vLLM's): a completions prompt (``{"prompt": text}``)
    or a chat's messages (``{"messages": [...]}``, with ``tools`` where it has them; its
    image URLs in ``image_urls``)."""

    prompt: dict[str, Any]
    image_urls: list[ImageSource]
    return_token_strs: bool = False
    model: str | None = None


# The options of vLLM's /tokenize that change how a prompt is rendered, with the values that
# give the tokens a generation request reads, the only ones taken (by the form they apply to).
_TOKENIZE_RENDERING = {"prompt": {"add_special_tokens": True},
                       "messages": {"add_special_tokens": False}}


def parse_tokenize_request(body: Any, max_images: int,
                           mm_embeds: bool = False) -> TokenizeRequest:
    """Validate a decoded JSON body of ``POST /tokenize``: the tokens are those the model
    reads for the same prompt on ``/v1/completions`` or ``/v1/chat/completions``."""
    model = _model(body)
    strs = _get(body, "return_token_strs", bool, False)
    form = "messages" if body.get("messages") is not None else "prompt"
    if form == "messages" and body.get("prompt") is not None:
        raise bad_request("send 'prompt' or 'messages', not both", "prompt")
    for name, value in _TOKENIZE_RENDERING[form].items():
        given = _get(body, name, bool, value)
        if given != value:
            raise bad_request(f"{name}={str(given).lower()} is not supported: /tokenize gives "
                              f"the tokens a generation request of this {form} reads; leave "
                              "it out.", name)
    if form == "prompt":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string (or send 'messages')",
                              "prompt")
        _check_text(prompt, "prompt")
        return TokenizeRequest({"prompt": prompt}, [], strs, model)
    messages, urls = _parse_messages(body.get("messages"), max_images, mm_embeds)
    try:
        tools, _ = tool_calls.parse_tools({"tools": body.get("tools")}, None)
    except InvalidInputError as e:
        raise bad_request(str(e), e.param) from None
    chat = {"messages": messages, **({} if tools is None else {"tools": tools}), **_turn(body),
            **_mm_kwargs(body)}
    return TokenizeRequest(chat, urls, strs, model)


def parse_detokenize_request(body: Any, vocab_size: int, max_tokens: int
                             ) -> tuple[list[int], str | None]:
    """Validate a decoded JSON body of ``POST /detokenize``: its token ids (each in the
    vocabulary, at most ``max_tokens`` of them) and ``model``."""
    model = _model(body)
    tokens = body.get("tokens")
    if not (isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    if len(tokens) > max_tokens:
        raise bad_request(f"'tokens' has {len(tokens)} ids; at most {max_tokens} (the model's "
                          "max_model_len) are taken", "tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {_short_int(bad)} is not in the vocabulary (0 to "
                          f"{vocab_size - 1})", "tokens")
    return tokens, model


def _parse_prompts(prompt: Any, field_name: str = "prompt") -> list[dict[str, Any]]:
    """OpenAI's prompt forms: a string, a list of token ids, or a list of either (the
    completions' ``prompt``, the embeddings' ``input``)."""
    def one(item: Any, where: str) -> dict[str, Any]:
        if isinstance(item, str):
            _check_text(item, where)
            if not item:
                raise bad_request(f"{where} is empty; send some text", where)
            return {"prompt": item}
        if (isinstance(item, list) and item
                and all(isinstance(t, int) and not isinstance(t, bool) for t in item)):
            return {"prompt_token_ids": item}
        raise bad_request(f"{where} must be a non-empty string or a non-empty list of token "
                          "ids", where)

    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in prompt)):
        return [one(prompt, field_name)]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"'{field_name}' must be a string, a list of token ids, or a "
                          "non-empty list of either", field_name)
    if len(prompt) > MAX_COMPLETION_PROMPTS:
        raise bad_request(f"'{field_name}' has {len(prompt)} prompts; at most "
                          f"{MAX_COMPLETION_PROMPTS} are allowed in one request", field_name)
    return [one(item, f"{field_name}[{i}]") for i, item in enumerate(prompt)]


def _model(body: Any) -> str | None:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    return model


def _check_num_logprobs(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be between 0 and {MAX_LOGPROBS}, got "
                          f"{_short_int(value)}", name)


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: alternatives for each prompt token (0 to ``MAX_LOGPROBS``),
    given in a whole answer (the engine has them once the request ends). A stream has no
    place for them: it takes 0 and shows nothing (as vLLM), and refuses more."""
    value = _get(body, "prompt_logprobs", int, None)
    _check_num_logprobs(value, "prompt_logprobs")
    if stream and value:
        raise bad_request("'prompt_logprobs' are given in a whole answer: send 'stream': false "
                          "with them, or leave them out.", "prompt_logprobs")
    return None if stream else value


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` and vLLM's
    ``stream_options.continuous_usage_stats`` (which takes effect with ``include_usage``)."""
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              "stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _get(options, "include_usage", bool, False, "stream_options.")
        continuous = _get(options, "continuous_usage_stats", bool, False, "stream_options.")
    return stream, include_usage, include_usage and continuous


def _sampling_params(body: dict[str, Any], max_model_len: int, default_max_tokens: int,
                     logprobs: int | None, defaults: Mapping[str, Any],
                     prompt_logprobs: int | None = None,
                     tool_schema: dict[str, Any] | None = None) -> SamplingParams:
    """The sampling fields both endpoints share, checked; those left out from ``defaults``
    where it has them (the checkpoint's generation config). ``prompt_logprobs``: for an
    echo's; ``tool_schema``: the output constraint of a forced tool choice."""
    n = _get(body, "n", int, 1)
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    if max_tokens is None:  # the engine stops at max_model_len anyway
        max_tokens = min(defaults.get("max_tokens", default_max_tokens), max_model_len)
    elif not 1 <= max_tokens <= max_model_len:
        raise bad_request(f"max_tokens must be between 1 and the model's max_model_len "
                          f"({max_model_len}), got {_short_int(max_tokens)}", "max_tokens")
    temperature = _get(body, "temperature", float, defaults.get("temperature", 1.0))
    if not 0 <= temperature <= MAX_API_TEMPERATURE:
        raise bad_request(f"temperature must be between 0 and {MAX_API_TEMPERATURE:g}, got "
                          f"{temperature}", "temperature")
    top_p = _get(body, "top_p", float, defaults.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", int, defaults.get("top_k", 0))
    seed = _get(body, "seed", int, None)
    stop = body.get("stop")
    if isinstance(stop, list):
        for s in stop:
            if isinstance(s, str):
                _check_text(s, "stop")
    elif isinstance(stop, str):
        _check_text(stop, "stop")
    ignore_eos = _get(body, "ignore_eos", bool, False)  # vLLM's extension, for benchmarks
    text_fields = {name: _get(body, name, bool, default) for name, default in (
        ("skip_special_tokens", True), ("include_stop_str_in_output", False))}  # vLLM's too
    structured = _structured_outputs(body)
    if tool_schema is not None:
        if structured is not None:
            raise bad_request("a named or \"required\" tool_choice constrains the output to "
                              "the tools' parameters; leave out response_format and the other "
                              "output constraints.", "tool_choice")
        try:
            structured = StructuredOutputs(json=tool_schema)
        except InvalidInputError as e:
            raise bad_request(str(e).replace("structured_outputs", "the tools' parameters",
                                             1), "tools") from None
    # OpenAI's penalties and logit_bias, and vLLM's min_p, repetition_penalty and min_tokens:
    # their ranges are SamplingParams' to check.
    adjust = {name: _get(body, name, float, defaults.get(name, default))
              for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                    ("min_p", 0.0), ("repetition_penalty", 1.0))}
    try:
        # Each step's outputs hold only what it added: the server puts answers together.
        return SamplingParams(max_tokens=max_tokens, n=n, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                              ignore_eos=ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs,
                              structured_outputs=structured, output_kind="delta",
                              min_tokens=_get(body, "min_tokens", int, 0),
                              logit_bias=_logit_bias(body.get("logit_bias")),
                              allowed_token_ids=body.get("allowed_token_ids"),
                              bad_words=body.get("bad_words"),
                              truncate_prompt_tokens=_get(body, "truncate_prompt_tokens", int,
                                                          None),
                              priority=_get(body, "priority", int, 0), **adjust,
                              **text_fields)
    except InvalidInputError as e:
        raise bad_request(str(e), e.param) from None


# What a beam search (vLLM's ``use_beam_search``) does not take, and the values of each that
# change nothing: it ranks beams by the model's own log-probabilities.
BEAM_SEARCH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature": (0,), "top_p": (1,), "top_k": (0, -1), "min_p": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "min_tokens": (0,), "logit_bias": ({},), "stop": ("", []), "stop_token_ids": ([],),
    "logprobs": (False, 0), "top_logprobs": (0,), "response_format": ({"type": "text"},),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "allowed_token_ids": (), "bad_words": ([],), "priority": (0,),
    "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,)}


def _beam_search(body: dict[str, Any], params: SamplingParams) -> BeamSearchParams | None:
    """vLLM's ``use_beam_search``: ``n`` beams, ``max_tokens``, ``length_penalty``,
    ``early_stopping`` (transformers') and ``ignore_eos``; the sampling fields it does not
    take are refused unless they say what it does anyway."""
    length_penalty = _get(body, "length_penalty", float, 1.0)
    early_stopping = body.get("early_stopping")
    early_stopping = False if early_stopping is None else early_stopping
    if not _get(body, "use_beam_search", bool, False):
        for name, value, default in (("length_penalty", length_penalty, 1.0),
                                     ("early_stopping", early_stopping, False)):
            if value != default or isinstance(value, bool) != isinstance(default, bool):
                raise bad_request(f"'{name}' is a beam search's: send 'use_beam_search': "
                                  "true with it, or leave it out.", name)
        return None
    for name, neutral in BEAM_SEARCH_NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(
                value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            why = ("its rounds run at priority 0" if name == "priority" else
                   "a beam search ranks beams by the model's own log-probabilities")
            raise bad_request(f"'{name}' is not taken with 'use_beam_search' ({why}); leave "
                              "it out.", name)
    try:
        return BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens,
            length_penalty=length_penalty, early_stopping=early_stopping,
            ignore_eos=params.ignore_eos)
    except InvalidInputError as e:
        param = "n" if e.param == "beam_width" else e.param
        raise bad_request(str(e).replace("beam_width", "n (the beam width)", 1),
                          param) from None


def _logit_bias(value: Any) -> dict[int, Any] | None:
    """OpenAI's ``logit_bias``, an object whose keys are token ids written as strings, with
    the ids as integers (the values are checked by ``SamplingParams``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers from "
                          "-100 to 100", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:  # before converting thousands of keys
        raise bad_request(f"'logit_bias' may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                          f"{len(value)}", "logit_bias")
    bias = {}
    for key, v in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            raise bad_request(f"'logit_bias' keys must be token ids, got {_short(repr(key))}",
                              "logit_bias")
        bias[int(key)] = v
    return bias


# vLLM's older names for the fields of structured_outputs.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _structured_outputs(body: dict[str, Any]) -> StructuredOutputs | None:
    """The output constraint a request asks for, in any of the forms clients send: OpenAI's
    ``response_format`` (``json_schema`` or ``json_object``), vLLM's ``structured_outputs``
    object, or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``. At most one of them; a 400 names the field that is wrong."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        fields = _response_format(response_format)
        if fields is not None:
            found.append(("response_format", fields))
    if body.get("structured_outputs") is not None:
        fields = body["structured_outputs"]
        if not isinstance(fields, dict):
            raise bad_request("structured_outputs must be an object with one of json, regex, "
                              "choice, grammar or json_object", "structured_outputs")
        found.append(("structured_outputs", fields))
    for name, field_name in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, {field_name: body[name]}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"send one output constraint, not {len(found)} "
                          f"({', '.join(name for name, _ in found)})", found[1][0])
    name, fields = found[0]
    known = {"json", "json_object", "regex", "choice", "grammar"}
    if unknown := sorted(set(fields) - known):
        raise bad_request(f"{name} has unknown fields {unknown}; it takes one of "
                          f"{sorted(known)}", name)
    try:
        return StructuredOutputs(**fields)
    except InvalidInputError as e:
        raise bad_request(str(e).replace("structured_outputs", name, 1), name) from None


def _response_format(value: Any) -> dict[str, Any] | None:
    """``response_format`` as the fields of a ``StructuredOutputs`` (None for plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("response_format json_schema needs 'json_schema': {'name': ..., "
                              "'schema': {...}} with the schema as an object",
                              "response_format")
        return {"json": spec["schema"]}
    raise bad_request("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                      "{'type': 'json_schema', 'json_schema': {...}}", "response_format")


def _get(obj: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    """``obj[name]`` checked against ``kind`` (ints pass as floats; bools are not ints)."""
    value = obj.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            ok, value = True, float(value)
        except OverflowError:  # an integer with hundreds of digits
            ok = False
    if not ok:
        names = {int: "an integer", float: "a number", bool: "a boolean"}
        shown = _short_int(value) if isinstance(value, int) else _short(repr(value))
        raise bad_request(f"'{prefix}{name}' must be {names[kind]}, got {shown}",
                          prefix + name)
    return value


def _short_int(value: int) -> str:
    """An integer as text, abridged when it is too long to quote (or even to convert)."""
    if abs(value) < 10**30:
        return str(value)
    return f"an integer of {value.bit_length()} bits"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_text(text: str, where: str) -> None:
    """Text must be encodable: JSON escapes can carry lone UTF-16 surrogates ("\\ud800")
    that no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{where} contains an invalid character (a lone UTF-16 surrogate "
                          f"at position {e.start}); send valid Unicode text.", where) from None


def _parse_messages(messages: Any, max_images: int, mm_embeds: bool = False
                    ) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """Chat messages checked, with the URLs of their images (at most ``max_images``), and
    where the server takes them (``mm_embeds``) the images sent as embeddings."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    out: list[dict[str, Any]] = []
    urls: list[ImageSource] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role is {role!r}; use one of {', '.join(ROLES)}",
                              f"{where}.role")
        extra = _tool_fields(msg, role, where)
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            _check_text(content, f"{where}.content")
            out.append({"role": role, "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of parts",
                              f"{where}.content")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"{pwhere}.text must be a string", f"{pwhere}.text")
                _check_text(part["text"], f"{pwhere}.text")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and role != "tool":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                if not isinstance(url, str) or not url:
                    raise bad_request(f"{pwhere}.image_url.url must be a non-empty string",
                                      f"{pwhere}.image_url")
                urls.append(url)
                parts.append({"type": "image"})
            elif kind == "image_embeds" and role != "tool":
                if not mm_embeds:
                    raise bad_request(f"{pwhere} is an image_embeds part: this server takes "
                                      "images as embeddings only when started with "
                                      "--enable-mm-embeds (for trusted clients: they are read "
                                      "with torch.load); send the image as 'image_url'.",
                                      f"{pwhere}.type")
                try:
                    urls.append(parse_embeds_part(part.get("image_embeds"), pwhere))
                except InvalidInputError as e:
                    raise bad_request(str(e), e.param) from None
                parts.append({"type": "image"})
            elif kind == "file" and role != "tool":
                file = part.get("file")
                file_id = file.get("file_id") if isinstance(file, dict) else None
                if not isinstance(file_id, str) or not file_id:
                    raise bad_request(f"{pwhere}.file needs 'file_id': an image uploaded with "
                                      "files.create (files sent inline, 'file_data', are not "
                                      "taken; send images as image_url parts).",
                                      f"{pwhere}.file")
                urls.append(FilePart(file_id))
                parts.append({"type": "image"})
            elif kind in ("video_url", "video", "input_video"):
                raise bad_request(f"{pwhere} is a video part ({kind!r}); video is not "
                                  "supported yet: send images (frames as 'image_url' parts) "
                                  "or text.", f"{pwhere}.type")
            else:
                supported = "'text'"
                if role != "tool":
                    supported += ", 'image_url', 'file'" + (", 'image_embeds'" if mm_embeds
                                                           else "")
                raise bad_request(f"{pwhere} has type {kind!r}; supported: {supported}",
                                  f"{pwhere}.type")
        out.append({"role": role, "content": parts, **extra})
    if len(urls) > max_images:
        raise bad_request(f"the messages carry {len(urls)} images but at most {max_images} are "
                          "allowed per prompt (--limit-mm-per-prompt); send fewer images.",
                          "messages")
    return out, urls


def _tool_fields(msg: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """What a message carries about tools, as chat templates take it: an assistant's earlier
    ``tool_calls`` (arguments as objects), a tool result's ``tool_call_id`` (and ``name``)."""
    extra: dict[str, Any] = {}
    if role == "assistant" and msg.get("tool_calls"):
        try:  # checked here; made the template's by the processor
            template_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        except InvalidInputError as e:
            raise bad_request(str(e), e.param) from None
        extra["tool_calls"] = msg["tool_calls"]
    if role == "tool":
        for name in ("tool_call_id", "name"):
            value = msg.get(name)
            if value is not None and not isinstance(value, str):
                raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
            if value is not None:
                extra[name] = value
    return extra
