"""Prompts and chat messages -> token ids, placeholder ranges and pixel values.

Rendering and preprocessing follow the checkpoint's own Hugging Face processor, so the tokens
and pixels are exactly those transformers would produce (``test_image_limits.py`` compares
them with a direct processor call). The processor's work is split in two so that requests can
be preprocessed on several threads at once: images are decoded and run through the image
processor (resize, crop, normalize: the expensive part) in the calling thread with no lock, and
only the tokenizer, which is not thread-safe, runs under a lock of this class.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from mmserve.inputs import ImageInput
from mmserve.processing.images import ImageLike, InvalidInputError, image_hash, load_image

logger = logging.getLogger(__name__)

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


@dataclass
class _PreprocessedImage:
    hash: str
    pixel_values: torch.Tensor  # [1, channels, height, width], what the processor makes
    num_tokens: int  # placeholder tokens this image expands to, by the processor's rule
    peak_bytes: int  # estimated memory touched while preprocessing it


class InputProcessor:
    """Turns prompts into token ids and encoder inputs. ``process()`` is safe to call from
    several threads at once; only its tokenizer call is serialized."""

    def __init__(self, model_dir: str, hf_config, max_image_pixels: int,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> None:
        """``mm_processor_kwargs`` go to the image processor on every call (the probes below
        included) and into every image's hash; a key it does not take, or a value it refuses,
        is a ``ValueError`` here, at start-up."""
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.mm_processor_kwargs: dict[str, Any] = dict(mm_processor_kwargs or {})
        self.image_token_id: int = hf_config.image_token_id
        self.image_token: str = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.max_image_pixels = max_image_pixels
        self.eos_token_id = _eos_token_id(model_dir, hf_config, self.tokenizer)
        # Hugging Face fast tokenizers are not thread-safe (concurrent calls can fail with
        # "Already borrowed"); the image work before them needs no lock.
        self._tokenizer_lock = threading.Lock()
        _check_kwarg_names(self.image_processor, self.mm_processor_kwargs)
        # LLaVA processors resize every image to one size: probe the placeholder count once,
        # through the processor's own call under the same settings, and the pixels' size on
        # wide and tall images too (do_center_crop=False makes the size follow the image's
        # shape, which the vision tower cannot take).
        images = {size: Image.new("RGB", size, (200, 120, 40))
                  for size in ((64, 64), (96, 48), (48, 96))}
        try:
            probe = self.processor(text=self.image_token, images=[images[64, 64]],
                                   return_tensors="pt", **self.mm_processor_kwargs)
            pixels = {size: self._pixel_values(img) for size, img in images.items()}
        except Exception as e:  # transformers raises TypeError, ValueError and its own
            if not self.mm_processor_kwargs:
                raise
            raise ValueError(
                f"mm_processor_kwargs {self.mm_processor_kwargs}: "
                f"{type(self.image_processor).__name__} of {model_dir} refuses them: "
                f"{type(e).__name__}: {e}") from e
        self.tokens_per_image = int((probe["input_ids"][0] == self.image_token_id).sum())
        self._check_pixels(model_dir, hf_config, pixels, probe["pixel_values"])
        # process() expands image tokens itself (outside the processor): it must count as the
        # processor does.
        by_rule = _num_image_tokens(self.processor, probe["pixel_values"])
        if by_rule != self.tokens_per_image:
            raise ValueError(
                f"{type(self.processor).__name__} of {model_dir} expands an image to "
                f"{self.tokens_per_image} tokens, not the {by_rule} of LlavaProcessor's rule; "
                "mmserve serves LlavaProcessor checkpoints (patch_size, "
                "num_additional_image_tokens and vision_feature_select_strategy in "
                "processor_config.json).")

    def _check_pixels(self, model_dir: str, hf_config,
                      pixels: dict[tuple[int, int], torch.Tensor],
                      processor_pixels: torch.Tensor) -> None:
        """Every image must become the vision tower's input size (its position embeddings are
        fixed), and this class's direct image-processor call must make what the processor's own
        call makes: refused at start-up rather than failing request by request."""
        shapes = {size: tuple(p.shape[-2:]) for size, p in pixels.items()}
        side = getattr(getattr(hf_config, "vision_config", None), "image_size", None)
        want = {(side, side)} if side else set(shapes.values())
        settings = (f"mm_processor_kwargs {self.mm_processor_kwargs}: "
                    if self.mm_processor_kwargs else "")
        if set(shapes.values()) != want or len(want) != 1:
            made = ", ".join(f"{w}x{h} -> {s[1]}x{s[0]}" for (w, h), s in shapes.items())
            raise ValueError(
                f"{settings}the image processor of {model_dir} makes pixel values of "
                f"{made} (image -> pixel values, width x height), but the vision tower takes "
                f"{side}x{side} for every image (vision_config.image_size)"
                + ("; change or drop the settings that resize or crop (do_resize, size, "
                   "do_center_crop, crop_size)." if settings else "."))
        if not torch.equal(processor_pixels, pixels[64, 64]):
            raise ValueError(
                f"{settings}{type(self.processor).__name__} of {model_dir} makes other pixel "
                f"values than its image processor {type(self.image_processor).__name__} "
                "called directly (a setting the processor does not pass on?); mmserve calls the "
                "image processor directly and must match the processor exactly.")

    # ----------------------------------------------------------------- public
    def process(self, prompt: dict[str, Any] | str,
                max_images: int | None = None) -> ProcessedPrompt:
        """``{"prompt": str, "images": [...]}`` or ``{"messages": [...], "images": [...]}``.

        Thread-safe. Raises ``InvalidInputError`` saying what to change; a prompt with more
        than ``max_images`` images is refused before any image is decoded."""
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
            _check_unicode(text, "prompt")
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
        return self._tokenize(text, [self._preprocess_image(im) for im in images])

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
                self._check_text(content, f"messages[{i}].content")
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
                    self._check_text(part["text"], f"{where}.text")
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
        # Pure text rendering (jinja): no lock needed.
        text = self.processor.apply_chat_template(
            rendered, add_generation_prompt=rendered[-1]["role"] != "assistant", tokenize=False)
        n = text.count(self.image_token)
        if n != len(ordered):  # e.g. the placeholder split across two text parts
            raise InvalidInputError(
                f"the rendered prompt has {n} {self.image_token} placeholder(s) for "
                f"{len(ordered)} image(s); {IMAGE_PART_HINT}, and do not write "
                f"{self.image_token!r} in text.", param="messages")
        return text, ordered

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ----------------------------------------------------------------- steps
    def _check_text(self, text: str, where: str) -> None:
        _check_unicode(text, where)
        if self.image_token in text:
            raise InvalidInputError(
                f"{where} contains {self.image_token!r}, the model's image placeholder; "
                f"{IMAGE_PART_HINT}, not as placeholder text, and remove {self.image_token!r} "
                "from the text.", param=where)

    def _preprocess_image(self, image: ImageLike) -> _PreprocessedImage:
        """Decode, hash and run the image processor on one image. No lock: PIL, numpy and torch
        release the GIL in their heavy loops, so other requests proceed meanwhile."""
        img = load_image(image, self.max_image_pixels)
        digest = image_hash(img, self.mm_processor_kwargs)
        pixel_values = self._pixel_values(img)
        peak = _preprocess_peak_bytes(self.image_processor, img.size, pixel_values,
                                      self.mm_processor_kwargs)
        return _PreprocessedImage(digest, pixel_values,
                                  _num_image_tokens(self.processor, pixel_values), peak)

    def _pixel_values(self, img: Image.Image) -> torch.Tensor:
        """The same call LlavaProcessor makes (its images kwargs: return_tensors and the
        ``mm_processor_kwargs``), on one image: the processor treats images independently, so
        the values equal a batch call's."""
        return self.image_processor([img], return_tensors="pt",
                                    **self.mm_processor_kwargs)["pixel_values"]

    def _tokenize(self, text: str, images: list[_PreprocessedImage]) -> ProcessedPrompt:
        """Expand each image token and tokenize, as ``LlavaProcessor.__call__`` does: the k-th
        image token in the text becomes ``num_tokens`` of image k, then the tokenizer runs on
        the expanded text (it maps each copy to ``image_token_id``)."""
        pieces = text.split(self.image_token)
        assert len(pieces) == len(images) + 1  # counted in process() and render_chat()
        expanded = [pieces[0]]
        for img, piece in zip(images, pieces[1:], strict=True):
            expanded += [self.image_token * img.num_tokens, piece]
        with self._tokenizer_lock:
            ids: list[int] = self.tokenizer(["".join(expanded)])["input_ids"][0]
        pixel_bytes = sum(img.pixel_values.nelement() * img.pixel_values.element_size()
                          for img in images)
        peak = max((img.peak_bytes for img in images), default=0) + pixel_bytes
        if not images:
            return ProcessedPrompt(ids, [], peak)
        # Placeholders of consecutive images may touch; split the run by the per-image count.
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        n = self.tokens_per_image
        if len(positions) != n * len(images) or any(img.num_tokens != n for img in images):
            raise InvalidInputError(
                f"the processor made {len(positions)} image placeholder tokens for "
                f"{len(images)} image(s); expected {n} per image. Do not write the image "
                "token in text except where an image goes.")
        inputs = []
        for k, img in enumerate(images):
            offset = positions[k * n]
            if positions[k * n + n - 1] != offset + n - 1:
                raise InvalidInputError("image placeholder tokens are not contiguous")
            inputs.append(ImageInput(hash=img.hash, offset=offset, length=n,
                                     pixel_values=img.pixel_values))
        return ProcessedPrompt(ids, inputs, peak)


def _preprocess_peak_bytes(image_processor, size: tuple[int, int],
                           pixel_values: torch.Tensor, kwargs: dict[str, Any]) -> int:
    """Estimated memory that preprocessing one image of ``size`` touches at its peak.

    Fitted to peak RSS measured around ``_preprocess_image`` with transformers' PIL-backend
    CLIP processor, within 25% from 1000 x 1000 to 8000 x 6000 and for 200:1 images: five
    copies of the decoded RGB pixels (Pillow's decode, the RGB conversion and the processor's
    own conversion, array and resize input), four of the resized uint8 image before the crop
    (PIL's output and its array copies: what makes thin images expensive), and the float
    output. Torchvision-backed processors differ in detail, not in kind.
    """
    w, h = size
    resized = _resized_pixels(image_processor, w, h, kwargs)
    return 5 * w * h * 3 + 4 * resized * 3 + 2 * pixel_values.nelement() * 4


def _resized_pixels(image_processor, w: int, h: int, kwargs: dict[str, Any]) -> int:
    """Pixels of the image processor's resize output (before cropping) for a w x h input,
    under ``kwargs`` (``mm_processor_kwargs``) where they set ``size`` or ``do_resize``."""
    size = kwargs.get("size", getattr(image_processor, "size", None))
    if isinstance(size, int):  # transformers' reading of a bare edge length
        square = getattr(image_processor, "default_to_square", True)
        size = {"height": size, "width": size} if square else {"shortest_edge": size}

    def get(key: str) -> int | None:
        return size.get(key) if isinstance(size, dict) else getattr(size, key, None)

    if size is None or not kwargs.get("do_resize", getattr(image_processor, "do_resize", True)):
        return w * h
    if get("shortest_edge"):  # short side to the edge, long side in proportion
        edge = get("shortest_edge")
        return edge * int(edge * max(w, h) / min(w, h))
    if get("height") and get("width"):
        return get("height") * get("width")
    return w * h  # another rule: assume no shrinking


# Image-processor keywords that mmserve sets itself: torch tensors, channels first, on the CPU,
# as the model's encoder takes them.
_RESERVED_KWARGS = ("return_tensors", "data_format", "input_data_format", "device")


def _check_kwarg_names(image_processor, kwargs: dict[str, Any]) -> None:
    """Refuse keywords the image processor does not take. Hugging Face processors warn about
    an unknown keyword and ignore it: a misspelt setting would silently change nothing."""
    name = type(image_processor).__name__
    for key in kwargs:
        if key in _RESERVED_KWARGS:
            raise ValueError(f"mm_processor_kwargs: {key!r} is set by mmserve (pixel values "
                             "as torch tensors, channels first, on the CPU); remove it.")
    valid = _image_processor_keys(image_processor)
    if valid is None:  # not listed: the probe calls in InputProcessor try the keywords
        return
    unknown = [key for key in kwargs if key not in valid]
    if unknown:
        takes = ", ".join(sorted(k for k in valid if k not in _RESERVED_KWARGS))
        raise ValueError(
            f"mm_processor_kwargs: {name} takes no {', '.join(map(repr, unknown))}; "
            f"it takes {takes}.")


def _image_processor_keys(image_processor) -> set[str] | None:
    """The keywords an image processor's call takes, where it lists them: transformers' typed
    ``valid_kwargs`` (5.x, and 4.x's fast processors) or ``_valid_processor_keys`` (4.x's slow
    ones). None for a processor that lists none."""
    typed = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", None)
    if typed:
        return set(typed)
    keys = getattr(image_processor, "_valid_processor_keys", None)
    return set(keys) if keys else None


def _num_image_tokens(processor, pixel_values: torch.Tensor) -> int:
    """Placeholder tokens for one image, by ``LlavaProcessor``'s rule: one per vision patch of
    the processed image, plus ``num_additional_image_tokens`` (a CLS token), minus one when
    ``vision_feature_select_strategy`` is "default" (the model drops the CLS feature)."""
    height, width = pixel_values.shape[-2:]
    patch = processor.patch_size
    num = (height // patch) * (width // patch) + (processor.num_additional_image_tokens or 0)
    if processor.vision_feature_select_strategy == "default":
        num -= 1
    return num


def _check_unicode(text: str, where: str) -> None:
    """Refuse lone UTF-16 surrogates (JSON allows "\\ud800" escapes; they are not text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"{where} contains a lone UTF-16 surrogate {text[e.start]!r} at character "
            f"{e.start}, which is not text; send valid Unicode (a \\ud83d-style JSON escape "
            "must be followed by its low surrogate, such as \\ude00).", param=where) from None


def _eos_token_id(model_dir: str, hf_config, tokenizer) -> int | None:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config.text_config, "eos_token_id", None) or tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos
