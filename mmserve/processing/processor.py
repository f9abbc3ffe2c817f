"""Prompts and chat messages -> token ids, placeholder ranges and pixel values.

Rendering and preprocessing follow the checkpoint's own Hugging Face processor, so the tokens
and pixels are exactly those transformers would produce (``test_image_limits.py`` compares
them with a direct processor call). The processor's work is split in two so that requests can
be preprocessed on several threads at once: images are decoded and run through the image
processor (resize, crop, normalize: the expensive part) in the calling thread with no lock, and
only the tokenizer, which is not thread-safe, runs under a lock of this class.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import numbers
import threading
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np
import torch
from PIL import Image

from mmserve.errors import PromptTooLongError
from mmserve.inputs import (
    PIXEL_ARITHMETIC,
    EncoderInput,
    ImageEmbeds,
    ImageInput,
    encoder_input_bytes,
)
from mmserve.processing.chat_template import (
    content_format,
    load_chat_template,
    template_kwargs,
)
from mmserve.processing.chat_tools import template_tool_calls, template_tools
from mmserve.processing.family import MultiModalFamily
from mmserve.processing.images import ImageLike, InvalidInputError, image_hash, load_image
from mmserve.processing.registry import family_for

logger = logging.getLogger(__name__)

# A prompt to be truncated (``truncate_prompt_tokens``) may be this many times max_model_len
# tokens before it is: the tokenizer, which requests take in turn, reads all of it.
TRUNCATED_PROMPT_FACTOR = 4
MAX_REQUEST_MM_KWARGS = 16  # settings in one prompt's mm_processor_kwargs

IMAGE_PART_HINT = ("send images as image parts ({\"type\": \"image_url\", \"image_url\": "
                   "{\"url\": ...}}, or {\"type\": \"image\"} with 'images' in the Python API)")


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    images: list[ImageInput]
    # Estimated peak of the memory this request's preprocessing touched, in bytes: for the
    # costliest image, its decoded RGB pixels, the image processor's copies of them and its
    # resized intermediate; plus every image's pixel values (see _preprocess_peak_bytes). With
    # ``keep_freed_memory()`` in effect glibc keeps about that much in the process afterwards;
    # the engine may call ``cpu_allocator.release_free_memory()`` when it is large next to a
    # step's activations, and report it.
    preprocess_peak_bytes: int = 0
    # The prompt's rope positions, [position_rows, len(token_ids)], and the offset decode
    # positions continue from: the family's ``prompt_positions``, computed once here.
    positions: np.ndarray | None = None
    decode_offset: int = 0


@dataclass
class _PreprocessedImage:
    hash: str
    pixel_values: EncoderInput  # the family's encoder input, what the processor makes
    num_tokens: int  # placeholder tokens this image expands to, by the processor's rule
    peak_bytes: int  # estimated memory touched while preprocessing it


class InputProcessor:
    """Turns prompts into token ids and encoder inputs. ``process()`` is safe to call from
    several threads at once; only its tokenizer call is serialized. What differs between
    model families (token counts, placeholder expansion, pixels) comes from the checkpoint's
    ``MultiModalFamily``; this class knows none of it."""

    def __init__(self, model_dir: str, hf_config, max_image_pixels: int,
                 mm_processor_kwargs: dict[str, Any] | None = None,
                 max_image_size: tuple[int, int] | None = None, device: str = "cpu",
                 chat_template: str | None = None,
                 chat_template_content_format: str = "auto") -> None:
        """``mm_processor_kwargs`` go to the image processor on every call (the family's
        start-up probes included) and into every image's hash; a key it does not take, or a
        value it refuses, is a ``ValueError`` here, at start-up. ``device`` is the engine's:
        on a GPU the pixels' rescaling and normalization are left to it
        (``MultiModalFamily.pixel_arithmetic_for``). ``chat_template`` (a file's path or a
        template's text, ``load_chat_template``) replaces the checkpoint's chat template; a
        missing file or a template that does not parse is a ``ValueError`` here too;
        ``chat_template_content_format`` says how it takes each message's content
        (``content_format``)."""
        template = load_chat_template(chat_template)
        self.family = family_for(model_dir, hf_config, mm_processor_kwargs, max_image_size)
        self.pixel_arithmetic = self.family.pixel_arithmetic_for(device)
        self._decoded_copies = _decoded_copies(self.family.image_processor)
        self.processor = self.family.processor
        if template is not None:
            # The processor renders with its own template unless given one; set once here,
            # it replaces the checkpoint's (one template, or several by name) in every chat.
            self.processor.chat_template = template
        self.content_format = content_format(self.processor.chat_template,
                                             chat_template_content_format)
        self.tokenizer = self.family.tokenizer
        self.image_processor = self.family.image_processor
        self.image_token_id: int = self.family.image_token_id
        self.image_token: str = self.family.image_token
        self.max_image_pixels = max_image_pixels
        # The decoder's width: what image embeddings given in place of pixels must have.
        self.hidden_size: int = hf_config.get_text_config().hidden_size
        # Every token that ends a sequence (the generation config's, which may list several:
        # Qwen2-VL's <|im_end|> and <|endoftext|>).
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config, self.tokenizer)
        # Hugging Face fast tokenizers are not thread-safe (concurrent calls can fail with
        # "Already borrowed"); the image work before them needs no lock.
        self._tokenizer_lock = threading.Lock()
        # The most characters one token stands for: a text longer than max_model_len times
        # this (twice, for normalizers that join characters) is too long whatever it holds,
        # and is refused before the chat template and the tokenizer spend seconds on it.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        # What the tokenizer puts before a text (Llama's BOS; nothing for Qwen2's), which a
        # truncated prompt keeps.
        self._added_prefix = tuple(self.tokenizer("")["input_ids"])

    @property
    def tokens_per_image(self) -> int:
        """The most tokens one image becomes (the family's ``max_tokens_per_item``)."""
        return self.family.max_tokens_per_item

    # ----------------------------------------------------------------- public
    def process(self, prompt: dict[str, Any] | str, max_images: int | None = None,
                max_tokens: int | None = None, keep_last: int | None = None
                ) -> ProcessedPrompt:
        """``{"prompt": str, "images": [...]}``, ``{"messages": [...], "images": [...]}``, or
        ``{"prompt_token_ids": [...]}`` (token ids as the model reads them, text only). vLLM's
        ``"multi_modal_data": {"image": image or [images]}`` may stand for ``"images"``.
        ``keep_last`` (vLLM's ``truncate_prompt_tokens``): only the prompt's last tokens, as
        many, where it has more (its images must be among them).

        Thread-safe. Raises ``InvalidInputError`` saying what to change; a prompt with more
        than ``max_images`` images is refused before any image is decoded, and one whose text
        cannot fit in ``max_tokens`` tokens (``TRUNCATED_PROMPT_FACTOR`` times that to be
        truncated) before it is rendered and tokenized."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidInputError(
                "a prompt must be a string or a dict with 'prompt' or 'messages' (and 'images')")
        if "multi_modal_data" in prompt:
            prompt = _images_from_multi_modal_data(prompt)
        if "prompt_token_ids" in prompt:
            if prompt.get("images"):
                raise InvalidInputError("a prompt of token ids takes no images; send the text "
                                        "with image placeholders instead", param="images")
            ids = prompt["prompt_token_ids"]
            if max_tokens is not None and keep_last is not None and isinstance(ids, list) \
                    and len(ids) > TRUNCATED_PROMPT_FACTOR * max_tokens:
                raise InvalidInputError(
                    f"the prompt is {len(ids):,} tokens; truncate_prompt_tokens takes prompts "
                    f"of up to {TRUNCATED_PROMPT_FACTOR} times max_model_len "
                    f"({TRUNCATED_PROMPT_FACTOR * max_tokens:,} tokens): send fewer.",
                    param="prompt")
            return self._with_positions(self._truncated(self._token_prompt(ids), keep_last))
        images = prompt.get("images") or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        if max_tokens is not None and keep_last is not None:
            max_tokens *= TRUNCATED_PROMPT_FACTOR
        max_chars = None if max_tokens is None else 2 * max_tokens * self.max_token_chars
        if "messages" in prompt:
            text, images = self.render_chat(
                prompt["messages"], list(images), max_chars, prompt.get("tools"),
                prompt.get("add_generation_prompt", True),
                prompt.get("continue_final_message", False),
                prompt.get("chat_template_kwargs"))
        elif "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidInputError("'prompt' must be a string", param="prompt")
            self._check_length(len(text), max_chars, "prompt")
            check_unicode(text, "prompt")
            n = text.count(self.image_token)
            if n != len(images):
                raise InvalidInputError(
                    f"the prompt has {n} {self.image_token} placeholder(s) but {len(images)} "
                    f"image(s) were given; put one {self.image_token} where each image goes.",
                    param="prompt")
        else:
            raise InvalidInputError("a prompt dict needs a 'prompt' or a 'messages' key")
        if max_images is not None and len(images) > max_images:
            raise InvalidInputError(
                f"the prompt has {len(images)} images but limit_mm_per_prompt is {max_images}; "
                "send fewer images or raise limit_mm_per_prompt.", param="images")
        # One image at a time, so only one decoded image and its resize are alive at once.
        # A prompt's own settings apply to its images (text alone ignores them, as vLLM).
        family = self._family_for(prompt.get("mm_processor_kwargs")) if images else self.family
        processed = self._tokenize(text, [self._preprocess_image(im, family) for im in images])
        return self._with_positions(self._truncated(processed, keep_last, self._added_prefix))

    def render_chat(self, messages: Any, images: list[ImageLike], max_chars: int | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None
                    ) -> tuple[str, list[ImageLike]]:
        """Render OpenAI-style messages with the chat template; returns text and images in
        placeholder order (``{"type": "image"}`` parts take from ``images`` in order,
        ``image_url`` parts carry their own). Messages whose text is over ``max_chars``
        characters are refused before rendering. ``tools``: the functions (OpenAI's
        ``tools``) the template shows the model; a message's ``tool_calls`` (an assistant's
        earlier calls) and ``tool_call_id`` (a tool's result) reach it as they are. As in
        vLLM, the prompt ends with the template's start of a new assistant turn
        (``add_generation_prompt``), or, with ``continue_final_message``, inside the last
        message, an assistant's, which the model then goes on writing.
        ``chat_template_kwargs``: more variables for the template (``template_kwargs``)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("'messages' must be a non-empty list", param="messages")
        _check_turn_ending(messages, add_generation_prompt, continue_final_message)
        variables = template_kwargs(chat_template_kwargs)
        if tools is not None:
            tools = template_tools(tools)
        pending = list(images)
        ordered: list[ImageLike] = []
        rendered = []
        # Text so far: the tools' too, which the template writes into the prompt.
        chars = 0 if tools is None else len(json.dumps(tools, ensure_ascii=False))
        self._check_length(chars, max_chars, "tools")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or "role" not in msg:
                raise InvalidInputError(f"messages[{i}] must be an object with a 'role'",
                                        param=f"messages[{i}]")
            role = msg["role"]
            if role not in ("system", "user", "assistant", "developer", "tool"):
                raise InvalidInputError(
                    f"messages[{i}].role {role!r} is not one of system, user, assistant, tool",
                    param=f"messages[{i}].role")
            role = "system" if role == "developer" else role
            extra = {name: msg[name] for name in ("tool_call_id", "name")
                     if msg.get(name) is not None}
            if msg.get("tool_calls"):
                extra["tool_calls"] = template_tool_calls(msg["tool_calls"],
                                                          f"messages[{i}].tool_calls")
            chars += len(json.dumps(extra, ensure_ascii=False, default=str)) if extra else 0
            content = msg.get("content")
            if content is None:
                content = ""
            if isinstance(content, str):
                chars += len(content)
                self._check_length(chars, max_chars, f"messages[{i}].content")
                self._check_text(content, f"messages[{i}].content")
                rendered.append({"role": role, "content": [{"type": "text", "text": content}],
                                 **extra})
                continue
            if not isinstance(content, list):
                raise InvalidInputError(f"messages[{i}].content must be a string or a list",
                                        param=f"messages[{i}].content")
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"messages[{i}].content[{j}]"
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise InvalidInputError(f"{where}.text must be a string", param=where)
                    chars += len(part["text"])
                    self._check_length(chars, max_chars, f"{where}.text")
                    self._check_text(part["text"], f"{where}.text")
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image", "image_url", "image_pil"):
                    if kind == "image_pil":  # vLLM's part for a PIL image in LLM.chat
                        if not isinstance(part.get("image_pil"), Image.Image):
                            raise InvalidInputError(f"{where}.image_pil must be a PIL image",
                                                    param=where)
                        ordered.append(part["image_pil"])
                    elif kind == "image_url":
                        url = part.get("image_url")
                        url = url.get("url") if isinstance(url, dict) else url
                        if not isinstance(url, str):
                            raise InvalidInputError(f"{where}.image_url.url must be a string",
                                                    param=where)
                        ordered.append(url)
                    elif part.get("image") is not None:
                        ordered.append(part["image"])
                    elif pending:
                        ordered.append(pending.pop(0))
                    else:
                        raise InvalidInputError(
                            f"{where} is an image part but no image is left in 'images'",
                            param=where)
                    parts.append({"type": "image"})
                elif kind == "image_embeds":  # vLLM's part: an image as its embeddings
                    ordered.append(as_image_embeds(part.get("image_embeds"),
                                                   f"{where}.image_embeds"))
                    parts.append({"type": "image"})
                elif kind in ("video", "video_url", "input_video"):
                    raise InvalidInputError(
                        f"{where} is a video part ({kind!r}); video is not supported yet: send "
                        "images (frames as 'image_url' parts) or text.", param=where)
                else:
                    raise InvalidInputError(
                        f"{where} has type {kind!r}; supported: 'text', 'image', 'image_url', "
                        "'image_pil', 'image_embeds'",
                        param=where)
            rendered.append({"role": role, "content": parts, **extra})
        if pending:
            raise InvalidInputError(
                f"{len(pending)} image(s) in 'images' have no {{'type': 'image'}} part in the "
                "messages; add one part per image.", param="images")
        if self.content_format == "string":
            rendered = [_as_string_content(msg, i) for i, msg in enumerate(rendered)]
        # Pure text rendering (jinja): no lock needed. A template refuses what it cannot
        # render (a role it has no turn for, turns out of order) by raising.
        try:
            text = self.processor.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
                **({} if tools is None else {"tools": tools}), **variables)
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError,
                IndexError, RecursionError) as e:
            raise InvalidInputError(
                f"the chat template cannot render these messages: {str(e)[:300]}; change the "
                "messages (or start the server with a --chat-template that renders them).",
                param="messages") from None
        n = text.count(self.image_token)
        if n != len(ordered):  # e.g. the placeholder split across two text parts
            raise InvalidInputError(
                f"the rendered prompt has {n} {self.image_token} placeholder(s) for "
                f"{len(ordered)} image(s); {IMAGE_PART_HINT}, and do not write "
                f"{self.image_token!r} in text.", param="messages")
        return text, ordered

    def _token_prompt(self, ids: Any) -> ProcessedPrompt:
        """A prompt given as token ids: each in the vocabulary, none the image placeholder."""
        vocab = len(self.tokenizer)
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise InvalidInputError("'prompt_token_ids' must be a non-empty list of integers",
                                    param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInputError(f"token id {bad} is not in the vocabulary (0 to "
                                    f"{vocab - 1})", param="prompt")
        if self.image_token_id in ids:
            raise InvalidInputError(
                f"token id {self.image_token_id} is the image placeholder; a prompt of token "
                "ids takes no images", param="prompt")
        return ProcessedPrompt(list(ids), [], 0)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """``text``'s tokens, without special tokens (as a piece of a prompt's text)."""
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ----------------------------------------------------------------- steps
    def _check_length(self, chars: int, max_chars: int | None, where: str) -> None:
        """Refuse a prompt whose text (``chars`` characters so far) cannot fit."""
        if max_chars is not None and chars > max_chars:
            raise PromptTooLongError(
                f"the prompt's text is at least {chars:,} characters, more than "
                f"{max_chars // (2 * self.max_token_chars):,} tokens can hold (max_model_len, "
                f"or {TRUNCATED_PROMPT_FACTOR} times it for a prompt to be truncated; no token "
                f"of this model spans more than {self.max_token_chars} characters); shorten "
                "the prompt or raise max_model_len.", param=where)

    def _check_text(self, text: str, where: str) -> None:
        check_unicode(text, where)
        if self.image_token in text:
            raise InvalidInputError(
                f"{where} contains {self.image_token!r}, the model's image placeholder; "
                f"{IMAGE_PART_HINT}, not as placeholder text, and remove {self.image_token!r} "
                "from the text.", param=where)

    def _family_for(self, kwargs: Any) -> MultiModalFamily:
        """The family under a prompt's own ``mm_processor_kwargs`` (vLLM's), where it has
        any: image-processor settings over the server's, for its images
        (``MultiModalFamily.for_request`` says which)."""
        if kwargs is None:
            return self.family
        if not isinstance(kwargs, dict) or len(kwargs) > MAX_REQUEST_MM_KWARGS:
            raise InvalidInputError(f"'mm_processor_kwargs' must be an object of at most "
                                    f"{MAX_REQUEST_MM_KWARGS} image-processor settings",
                                    param="mm_processor_kwargs")
        return self.family.for_request(kwargs) if kwargs else self.family

    def _preprocess_image(self, image: ImageLike | ImageEmbeds,
                          family: MultiModalFamily) -> _PreprocessedImage:
        """Decode, hash and run ``family``'s image processor on one image. No lock: PIL, numpy
        and torch release the GIL in their heavy loops, so other requests proceed
        meanwhile."""
        if isinstance(image, ImageEmbeds):
            return self._preprocess_embeds(image)
        img = load_image(image, self.max_image_pixels)
        num_tokens = family.num_image_tokens(*img.size)
        if num_tokens > self.family.max_tokens_per_item:  # (a prompt's own settings)
            raise InvalidInputError(
                f"under the prompt's mm_processor_kwargs a {img.size[0]}x{img.size[1]} image "
                f"becomes {num_tokens} tokens, more than the {self.family.max_tokens_per_item} "
                "of this server's largest image: ask for a smaller min_pixels.",
                param="mm_processor_kwargs")
        digest = image_hash(img, family.mm_processor_kwargs)
        pixel_values = (family.encoder_input(img) if self.pixel_arithmetic is None
                        else family.device_encoder_input(img, self.pixel_arithmetic))
        peak = _preprocess_peak_bytes(img.size, family.resized_pixels(*img.size),
                                      pixel_values, self._decoded_copies)
        return _PreprocessedImage(digest, pixel_values, num_tokens, peak)

    def _preprocess_embeds(self, item: ImageEmbeds) -> _PreprocessedImage:
        """An image given as its embeddings: checked against the model (the decoder's hidden
        size, the family's token count and grid), kept on the CPU, hashed by content."""
        embeds = item.embeds
        if not (isinstance(embeds, torch.Tensor) and embeds.layout == torch.strided
                and embeds.is_floating_point()):
            raise InvalidInputError("image embeddings must be a dense floating-point tensor "
                                    "(torch.float32, float16 or bfloat16)", param="images")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.dim() != 2 or embeds.shape[1] != self.hidden_size or not embeds.shape[0]:
            raise InvalidInputError(
                f"image embeddings must be [tokens, {self.hidden_size}] (this model's hidden "
                f"size), got {list(item.embeds.shape)}", param="images")
        most = self.family.max_tokens_per_item
        if embeds.shape[0] > most:  # before any copy: a broadcast view costs nothing to send
            raise InvalidInputError(
                f"image embeddings of {embeds.shape[0]} rows: no image is more than {most} "
                f"tokens under the server's settings ({self.family.item_bound_setting()})",
                param="images")
        # A copy of our own, always: the caller's tensor may change after this (a buffer used
        # again), and the caches hold these under a hash of what they are now.
        embeds = torch.empty(embeds.shape, dtype=embeds.dtype).copy_(embeds.detach())
        if not bool(torch.isfinite(embeds).all()):
            raise InvalidInputError("image embeddings hold NaN or infinite values",
                                    param="images")
        grid = _grid_thw(item.grid_thw)
        encoder_input, num_tokens = self.family.embeds_input(embeds, grid)
        digest = hashlib.sha256(f"embeds {embeds.dtype} {list(embeds.shape)} {grid}".encode())
        digest.update(embeds.view(torch.uint8).numpy())
        nbytes = encoder_input_bytes(encoder_input)
        return _PreprocessedImage(digest.hexdigest(), encoder_input, num_tokens, nbytes)

    def _tokenize(self, text: str, images: list[_PreprocessedImage]) -> ProcessedPrompt:
        """Expand each image placeholder by the family's rule and tokenize the expanded text
        (the tokenizer maps each placeholder copy to ``image_token_id``)."""
        expanded = self.family.expand_placeholders(text, [img.num_tokens for img in images])
        with self._tokenizer_lock:
            ids: list[int] = self.tokenizer([expanded])["input_ids"][0]
        pixel_bytes = sum(encoder_input_bytes(img.pixel_values) for img in images)
        peak = max((img.peak_bytes for img in images), default=0) + pixel_bytes
        if not images:
            return ProcessedPrompt(ids, [], peak)
        # Placeholders of consecutive images may touch; split the run by the per-image counts.
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        counts = [img.num_tokens for img in images]
        if len(positions) != sum(counts):
            raise InvalidInputError(
                f"the processor made {len(positions)} image placeholder tokens for "
                f"{len(images)} image(s); expected {', '.join(map(str, counts))} per image. Do "
                "not write the image token in text except where an image goes.")
        inputs = []
        first = 0
        for img in images:
            n = img.num_tokens
            offset = positions[first]
            if positions[first + n - 1] != offset + n - 1:
                raise InvalidInputError("image placeholder tokens are not contiguous")
            inputs.append(ImageInput(hash=img.hash, offset=offset, length=n,
                                     pixel_values=img.pixel_values))
            first += n
        return ProcessedPrompt(ids, inputs, peak)

    @staticmethod
    def _truncated(prompt: ProcessedPrompt, keep_last: int | None,
                   added: tuple[int, ...] = ()) -> ProcessedPrompt:
        """``prompt``'s last ``keep_last`` tokens, where it has more; its images' offsets
        moved with them (none may be cut). Tokens the tokenizer ``added`` at the start (a
        BOS) stay there, among the ``keep_last``, as transformers' truncation keeps them."""
        ids = prompt.token_ids
        kept = len(added) if added and tuple(ids[:len(added)]) == added else 0
        kept = min(kept, keep_last or 0)
        cut = 0 if keep_last is None else len(ids) - keep_last  # the tokens to drop
        if cut <= 0:
            return prompt
        for i, image in enumerate(prompt.images):
            if image.offset < kept + cut:
                raise InvalidInputError(
                    f"truncate_prompt_tokens={keep_last} keeps {keep_last} of the prompt's "
                    f"{len(ids)} tokens, which would cut image {i + 1}; keep at least "
                    f"{kept + len(ids) - image.offset}, or send fewer images.",
                    param="truncate_prompt_tokens")
        prompt.token_ids = ids[:kept] + ids[kept + cut:]
        prompt.images = [dataclasses.replace(image, offset=image.offset - cut)
                         for image in prompt.images]
        return prompt

    def _with_positions(self, prompt: ProcessedPrompt) -> ProcessedPrompt:
        """``prompt`` with its positions, by the family's rule."""
        positions, offset = self.family.prompt_positions(prompt.token_ids, prompt.images)
        rows = self.family.position_rows
        if positions.shape != (rows, len(prompt.token_ids)):
            raise ValueError(f"{type(self.family).__name__}.prompt_positions made positions of "
                             f"shape {positions.shape}, not {(rows, len(prompt.token_ids))}")
        prompt.positions, prompt.decode_offset = positions, int(offset)
        return prompt


def _grid_thw(value: Any) -> tuple[int, int, int] | None:
    """An ``ImageEmbeds.grid_thw`` as three ints (a list, tuple or tensor of 3, or [[t, h,
    w]], as the image processor's ``image_grid_thw`` is)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            value = None
        else:
            value = value.reshape(-1).tolist() if value.nelement() == 3 else None
    elif isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0],
                                                                           (list, tuple)):
        value = value[0]
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                       and 0 < v < 1 << 20
                       for v in value)):
        raise InvalidInputError("image_grid_thw must be three positive integers (temporal, "
                                "height, width in patches)", param="images")
    return int(value[0]), int(value[1]), int(value[2])


def as_image_embeds(value: Any, where: str) -> ImageEmbeds:
    """vLLM's forms of an image's embeddings as an ``ImageEmbeds``: one already, a tensor, or
    ``{"image_embeds": tensor, "image_grid_thw": grid}``."""
    if isinstance(value, ImageEmbeds):
        return value
    if isinstance(value, torch.Tensor):
        return ImageEmbeds(value)
    if isinstance(value, dict) and isinstance(value.get("image_embeds"), torch.Tensor):
        return ImageEmbeds(value["image_embeds"], value.get("image_grid_thw"))
    raise InvalidInputError(f"{where} must be image embeddings: a tensor [tokens, hidden], "
                            "an ImageEmbeds, or {'image_embeds': tensor, 'image_grid_thw': "
                            "[t, h, w]}", param=where)


def _decoded_copies(image_processor: Any) -> int:
    """Copies of an image's decoded RGB pixels that ``image_processor`` holds at once: five
    with transformers' PIL backend, three with its torchvision backend (the default where
    torchvision is installed), which converts the image to a tensor once and resizes that."""
    from transformers.image_processing_backends import TorchvisionBackend

    return 3 if isinstance(image_processor, TorchvisionBackend) else 5


def _preprocess_peak_bytes(size: tuple[int, int], resized: int, pixel_values: EncoderInput,
                           decoded_copies: int) -> int:
    """Estimated memory that preprocessing one image of ``size`` touches at its peak, when
    the image processor resizes it to ``resized`` pixels (before any crop).

    Fitted to peak RSS measured around ``_preprocess_image`` with transformers' PIL-backend
    CLIP processor, within 25% from 1000 x 1000 to 8000 x 6000 and for 200:1 images: five
    copies of the decoded RGB pixels (Pillow's decode, the RGB conversion and the processor's
    own conversion, array and resize input), four of the resized uint8 image before the crop
    (PIL's output and its array copies: what makes thin images expensive), and the float
    output (counted as float32 where the pixels leave as integers for a GPU, which Qwen2-VL's
    processor still makes as float32 first). The torchvision backend's three copies were
    measured on one 3000 x 2000 image (58.3 MB at the peak, the estimate 54.5 MB).
    """
    w, h = size
    output = encoder_input_bytes(pixel_values)
    if PIXEL_ARITHMETIC in pixel_values:
        output += 3 * pixel_values["pixel_values"].nelement()  # uint8 -> float32
    return decoded_copies * w * h * 3 + 4 * resized * 3 + 2 * output


def _images_from_multi_modal_data(prompt: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` with vLLM's ``multi_modal_data`` (``{"image": image or [images]}``) given as
    mmserve's ``images``; other modalities, or images given both ways, are refused."""
    data = prompt["multi_modal_data"]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidInputError("'multi_modal_data' must be a dict such as {'image': [...]}",
                                param="multi_modal_data")
    others = sorted(str(key) for key in data if key != "image")
    if others:
        raise InvalidInputError(f"mmserve takes images only: 'multi_modal_data' has "
                                f"{', '.join(map(repr, others))}; keep only 'image'",
                                param="multi_modal_data")
    images = data.get("image")
    if images is None:
        images = []
    elif isinstance(images, torch.Tensor) and images.dim() == 3:
        images = list(images)  # vLLM's embeddings of several images, [images, tokens, hidden]
    elif not isinstance(images, (list, tuple)):
        images = [images]
    # vLLM's embeddings forms: a tensor, or {"image_embeds": ..., "image_grid_thw": ...}.
    images = [as_image_embeds(im, "multi_modal_data") if isinstance(im, (torch.Tensor, dict))
              else im for im in images]
    if images and prompt.get("images"):
        raise InvalidInputError("images are given both in 'images' and in "
                                "'multi_modal_data'; give them in one of the two",
                                param="multi_modal_data")
    rest = {key: value for key, value in prompt.items() if key != "multi_modal_data"}
    return {**rest, "images": list(images) or rest.get("images") or []}


def check_unicode(text: str, where: str) -> None:
    """Refuse lone UTF-16 surrogates (JSON allows "\\ud800" escapes; they are not text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"{where} contains a lone UTF-16 surrogate {text[e.start]!r} at character "
            f"{e.start}, which is not text; send valid Unicode (a \\ud83d-style JSON escape "
            "must be followed by its low surrogate, such as \\ude00).", param=where) from None


def _eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """The tokens that end a sequence, as transformers' ``generate`` stops at them: the
    generation config's (an id or a list), else the text config's, else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config.text_config, "eos_token_id", None) or tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(dict.fromkeys(eos if isinstance(eos, (list, tuple)) else [eos]))


def _as_string_content(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A rendered message for a template that takes content as text: its text parts joined
    by line breaks (vLLM's rule). Such a template has nowhere to put an image."""
    parts = message["content"]
    if any(part["type"] != "text" for part in parts):
        raise InvalidInputError(
            f"messages[{index}] has an image, but the chat template takes each message's "
            "content as text alone (chat_template_content_format string) and cannot place it; "
            "use a template that loops over the content's parts.", param=f"messages[{index}]")
    return {**message, "content": "\n".join(part["text"] for part in parts)}


def _check_turn_ending(messages: list[Any], add_generation_prompt: Any,
                       continue_final_message: Any) -> None:
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise InvalidInputError(f"'{name}' must be a boolean", param=name)
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise InvalidInputError("'continue_final_message' goes on writing the last message, "
                                "'add_generation_prompt' starts a new one: send "
                                "'add_generation_prompt': false with it.",
                                param="continue_final_message")
    last = messages[-1]
    if not (isinstance(last, dict) and last.get("role") == "assistant"):
        raise InvalidInputError("'continue_final_message' goes on writing the last message, "
                                "which must be the assistant's.", param="continue_final_message")
