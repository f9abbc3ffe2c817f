"""Prompts and chat messages -> token ids, placeholder ranges and pixel values.

Rendering and preprocessing go through the checkpoint's own Hugging Face processor, so the
tokens and pixels are exactly those transformers would produce.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from mmserve.engine.request import ImageInput
from mmserve.processing.images import ImageLike, InvalidInputError, image_hash, load_image

logger = logging.getLogger(__name__)


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    images: list[ImageInput]


class InputProcessor:
    def __init__(self, model_dir: str, hf_config, max_image_pixels: int) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id: int = hf_config.image_token_id
        self.image_token: str = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.max_image_pixels = max_image_pixels
        self.eos_token_id = _eos_token_id(model_dir, hf_config, self.tokenizer)
        # LLaVA processors resize every image to one size: probe the placeholder count once.
        probe = self.processor(text=self.image_token, images=[Image.new("RGB", (64, 64))],
                               return_tensors="pt")
        self.tokens_per_image = int((probe["input_ids"][0] == self.image_token_id).sum())

    # ----------------------------------------------------------------- public
    def process(self, prompt: dict[str, Any] | str) -> ProcessedPrompt:
        """``{"prompt": str, "images": [...]}`` or ``{"messages": [...], "images": [...]}``."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidInputError(
                "a prompt must be a string or a dict with 'prompt' or 'messages' (and 'images')")
        images = prompt.get("images") or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        if "messages" in prompt:
            text, images = self.render_chat(prompt["messages"], list(images))
        elif "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidInputError("'prompt' must be a string", param="prompt")
            n = text.count(self.image_token)
            if n != len(images):
                raise InvalidInputError(
                    f"the prompt has {n} {self.image_token} placeholder(s) but {len(images)} "
                    f"image(s) were given; put one {self.image_token} where each image goes.",
                    param="prompt")
        else:
            raise InvalidInputError("a prompt dict needs a 'prompt' or a 'messages' key")
        return self.tokenize(text, [load_image(im, self.max_image_pixels) for im in images])

    def render_chat(self, messages: Any, images: list[ImageLike]) -> tuple[str, list[ImageLike]]:
        """Render OpenAI-style messages with the chat template; returns text and images in
        placeholder order (``{"type": "image"}`` parts take from ``images`` in order,
        ``image_url`` parts carry their own)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("'messages' must be a non-empty list", param="messages")
        pending = list(images)
        ordered: list[ImageLike] = []
        rendered = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or "role" not in msg:
                raise InvalidInputError(f"messages[{i}] must be an object with a 'role'",
                                        param=f"messages[{i}]")
            role = msg["role"]
            if role not in ("system", "user", "assistant", "developer"):
                raise InvalidInputError(
                    f"messages[{i}].role {role!r} is not one of system, user, assistant",
                    param=f"messages[{i}].role")
            role = "system" if role == "developer" else role
            content = msg.get("content")
            if content is None:
                content = ""
            if isinstance(content, str):
                rendered.append({"role": role, "content": [{"type": "text", "text": content}]})
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
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image", "image_url"):
                    if kind == "image_url":
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
                else:
                    raise InvalidInputError(
                        f"{where} has type {kind!r}; supported: 'text', 'image', 'image_url'",
                        param=where)
            rendered.append({"role": role, "content": parts})
        if pending:
            raise InvalidInputError(
                f"{len(pending)} image(s) in 'images' have no {{'type': 'image'}} part in the "
                "messages; add one part per image.", param="images")
        text = self.processor.apply_chat_template(
            rendered, add_generation_prompt=rendered[-1]["role"] != "assistant", tokenize=False)
        return text, ordered

    def tokenize(self, text: str, images: list[Image.Image]) -> ProcessedPrompt:
        out = self.processor(text=text, images=images or None, return_tensors="pt")
        ids: list[int] = out["input_ids"][0].tolist()
        if not images:
            return ProcessedPrompt(ids, [])
        pixel_values: torch.Tensor = out["pixel_values"]
        # Placeholders of consecutive images may touch; split the run by the per-image count.
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        n = self.tokens_per_image
        if len(positions) != n * len(images):
            raise InvalidInputError(
                f"the processor made {len(positions)} image placeholder tokens for "
                f"{len(images)} image(s); expected {n} per image. Do not write the image "
                "token in text except where an image goes.")
        inputs = []
        for k, img in enumerate(images):
            offset = positions[k * n]
            if positions[k * n + n - 1] != offset + n - 1:
                raise InvalidInputError("image placeholder tokens are not contiguous")
            inputs.append(ImageInput(hash=image_hash(img), offset=offset, length=n,
                                     pixel_values=pixel_values[k:k + 1]))
        return ProcessedPrompt(ids, inputs)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _eos_token_id(model_dir: str, hf_config, tokenizer) -> int | None:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config.text_config, "eos_token_id", None) or tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos
