"""OpenAI's and vLLM's answer wire format: completions, choices, stream chunks, usage, and
log-probabilities in each endpoint's shape (vLLM's ``prompt_logprobs`` too). Plain data in,
plain data out."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mmserve.step import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Token counts; ``prompt_tokens`` includes the image placeholder tokens, of which
    ``cached_tokens`` came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    # The engine's "abort" has no OpenAI name; its client is gone by then anyway.
    return "stop" if reason == "abort" else reason


# JSON has no -inf: the log-probability of a token the model rules out is written as this, as
# OpenAI and vLLM do.
MIN_LOGPROB = -9999.0


def logprobs_content(token_ids: Sequence[int], entries: Sequence[TokenLogprobs],
                     token_text: Callable[[int], str], as_ids: bool = False
                     ) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice (or of a chunk's tokens): each token as text with its
    UTF-8 bytes and log-probability, and its ``top_logprobs`` alternatives. ``token_text`` is
    the text a token id stands for on its own; with ``as_ids`` (vLLM's
    ``return_tokens_as_token_ids``) a token is named "token_id:N" instead (its bytes stay its
    text's)."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": token_label(token, text, as_ids), "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(token, e.logprob),
                         "top_logprobs": [item(t, v) for t, v in e.top]}
                        for token, e in zip(token_ids, entries, strict=True)]}


def chat_choice(index: int, text: str | None, reason: str | None,
                logprobs: dict[str, Any] | None = None,
                calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A choice of a chat completion; ``calls``: its ``tool_calls``, where it made any."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def completion(request_id: str, model: str, choices: list[dict[str, Any]],
               usage_counts: dict[str, Any], created: int | None = None) -> dict[str, Any]:
    """A chat completion; ``choices`` from ``chat_choice`` (``n`` of them); ``created`` (None:
    now)."""
    return {"id": request_id, "object": "chat.completion",
            "created": int(time.time()) if created is None else created,
            "model": model, "choices": choices, "usage": usage_counts}


def chunk(request_id: str, model: str, created: int, delta: dict[str, Any] | None,
          reason: str | None = None, include_usage: bool = False,
          usage_counts: dict[str, Any] | None = None,
          logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One SSE chunk of choice ``index``. ``delta=None`` makes the usage-only chunk
    (``choices`` empty)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [] if delta is None else [
            {"index": index, "delta": delta, "logprobs": logprobs,
             "finish_reason": finish_reason(reason)}],
    }
    if include_usage:
        body["usage"] = usage_counts  # null on every chunk but the last, as OpenAI does
    return body


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                        token_text: Callable[[int], str], text_offset: int = 0,
                        as_ids: bool = False, top: Any = None) -> dict[str, Any]:
    """The completions endpoint's (older) ``logprobs`` shape: parallel lists of the tokens as
    text, their log-probabilities, ``{token: logprob}`` of the top alternatives
    (``top_logprobs``; ``top`` stands for them where given), and each token's offset in the
    completion text (the lengths of the tokens' texts added up, from ``text_offset``). An
    entry None (an echoed prompt's first token) is null in both. With ``as_ids``, tokens are
    named "token_id:N" (the offsets stay the text's)."""
    texts = [token_text(t) for t in token_ids]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": [token_label(t, text, as_ids) for t, text in zip(token_ids, texts,
                                                                        strict=True)],
            "token_logprobs": [None if e is None else max(e.logprob, MIN_LOGPROB)
                               for e in entries],
            "top_logprobs": (top_logprobs(entries, token_text, as_ids) if top is None
                             else top),
            "text_offset": offsets}


def top_logprobs(entries: Sequence[TokenLogprobs | None], token_text: Callable[[int], str],
                 as_ids: bool = False,
                 alternatives: int | None = None) -> list[dict[str, float] | None]:
    """The completions endpoint's ``top_logprobs``: ``{token: logprob}`` of each entry's
    first ``alternatives`` (all where None; null for an entry None)."""
    return [None if e is None else
            {token_label(t, token_text(t), as_ids): max(v, MIN_LOGPROB)
             for t, v in e.top[:alternatives]}
            for e in entries]


def token_label(token: int, text: str, as_ids: bool) -> str:
    """How log-probabilities name a token: its text, or "token_id:N" (vLLM's
    ``return_tokens_as_token_ids``, for clients that want the ids the model picked)."""
    return f"token_id:{token}" if as_ids else text


def prompt_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                    token_text: Callable[[int], str],
                    alternatives: int | None = None) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of an answer: for each prompt token (None for the first,
    which nothing predicts), an object from token ids (as strings) to ``{"logprob", "rank",
    "decoded_token"}``: the prompt's token and the ``alternatives`` most likely (all the
    entry has where None)."""
    out: list[dict[str, Any] | None] = []
    for token, e in zip(token_ids, entries, strict=True):
        if e is None:
            out.append(None)
            continue
        found = {str(token): {"logprob": max(e.logprob, MIN_LOGPROB), "rank": e.rank,
                              "decoded_token": token_text(token)}}
        for rank, (t, v) in enumerate(e.top[:alternatives], 1):
            found.setdefault(str(t), {"logprob": max(v, MIN_LOGPROB), "rank": rank,
                                      "decoded_token": token_text(t)})
        out.append(found)
    return out


def text_completion(request_id: str, model: str, choices: list[dict[str, Any]],
                    usage_counts: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` response; ``choices`` from ``completion_choice``."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_counts}


def completion_choice(index: int, text: str, reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def completion_chunk(request_id: str, model: str, created: int,
                     choice: dict[str, Any] | None, include_usage: bool = False,
                     usage_counts: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk of ``/v1/completions``: one prompt's new text, or (``choice=None``) the
    usage of them all."""
    body: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                            "model": model, "choices": [] if choice is None else [choice]}
    if include_usage:
        body["usage"] = usage_counts
    return body


def model_card(model: str, created: int, max_model_len: int,
               root: str | None = None, parent: str | None = None) -> dict[str, Any]:
    """The served model under one of its ids, as ``GET /v1/models`` lists it and ``GET
    /v1/models/{id}`` gives it; ``root``: the id answers report (this one by default).
    ``parent``: for a LoRA adapter (``root`` its path), the model it adapts (vLLM's)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "mmserve",
            "root": root or model, "parent": parent, "max_model_len": max_model_len}


def model_list(models: Sequence[str], created: int, max_model_len: int) -> dict[str, Any]:
    """Every id the model is served under, the one answers report first."""
    return {"object": "list", "data": [model_card(name, created, max_model_len, models[0])
                                       for name in models]}


def embeddings(request_id: str, model: str, created: int, data: Sequence[list[float] | str],
               prompt_tokens: int) -> dict[str, Any]:
    """``POST /v1/embeddings``' answer: each embedding as numbers, or as the base64 of its
    float32 bytes (``encoding_format``)."""
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": values}
                     for i, values in enumerate(data)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def scores(request_id: str, model: str, created: int, values: Sequence[float],
           prompt_tokens: int) -> dict[str, Any]:
    """vLLM's ``POST /score`` answer: each pair's score, in order."""
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": value}
                     for i, value in enumerate(values)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0}}


def reranked(request_id: str, model: str, documents: Sequence[Any], values: Sequence[float],
             top_n: int, prompt_tokens: int) -> dict[str, Any]:
    """vLLM's (Jina's) ``POST /rerank`` answer: the documents best first (the best ``top_n``;
    0: all), each with its index, its text (or its content) and its score."""
    order = sorted(range(len(values)), key=lambda i: -values[i])[:top_n or len(values)]
    return {"id": request_id, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "results": [{"index": i, "relevance_score": values[i],
                         "document": ({"text": documents[i]} if isinstance(documents[i], str)
                                      else {"multi_modal": _part_or_parts(documents[i])})}
                        for i in order]}


def _part_or_parts(document: dict[str, Any]) -> Any:
    """A multimodal document as vLLM returns it: its one content part (or its parts)."""
    parts = document["content"]
    return parts[0] if len(parts) == 1 else parts


def list_page(items: list[dict[str, Any]], query: dict[str, str], default_limit: int,
              max_limit: int, what: str, where: str = "") -> dict[str, Any]:
    """A page of an OpenAI list (oldest first in ``items``) as a ``GET`` with ``query`` asks
    for it: ``order`` (``desc``, the default, newest first, or ``asc``), at most ``limit``
    items (1 to ``max_limit``, ``default_limit`` where left out) after the one whose id is
    ``after``. Raises ``ValueError`` naming a bad parameter."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ValueError("order: must be 'asc' or 'desc'")
    try:
        limit = int(query.get("limit", default_limit))
    except ValueError:
        raise ValueError(f"limit: must be an integer from 1 to {max_limit}") from None
    if not 1 <= limit <= max_limit:
        raise ValueError(f"limit: must be an integer from 1 to {max_limit}")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ValueError(f"after: no {what} {after!r}{' ' + where if where else ''}")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(ordered)}
