"""The model interface, processing side: what differs between model families before encoding.

A family answers, for one checkpoint and the processor settings in force
(``mm_processor_kwargs``, and the largest image declared with ``--limit-mm-per-prompt``), how
many tokens an image becomes, the most one image can become (the encoder budget's
``max_tokens_per_item``), the worst-case dummy image of the profile run, how placeholders are
expanded in text, how one image becomes pixel values, and a prompt's positions (one row for
LLaMA rope, three for M-RoPE) with the offset decode positions continue from.
``InputProcessor``, the start-up plan and the profile batch use nothing else; each family lives
in its own module and registers by Hugging Face architecture name in
``mmserve/processing/registry.py``.
"""

from __future__ import annotations

import functools
import logging
import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs import (
    IMAGE_EMBEDS,
    EncoderInput,
    ImageInput,
    PixelArithmetic,
    with_integer_pixels,
)

logger = logging.getLogger(__name__)


class MultiModalFamily(ABC):
    """One model family's processing rules for one checkpoint. Thread-safe to read: nothing
    here changes after construction, and the image processor keeps no state between calls."""

    def __init__(self, model_dir: str, hf_config, mm_processor_kwargs: dict[str, Any] | None = None,
                 max_image_size: tuple[int, int] | None = None) -> None:
        """Loads the checkpoint's processor. ``mm_processor_kwargs`` go to the image processor
        on every call and into every image's hash; a key it does not take is a ``ValueError``
        here, at start-up. ``max_image_size`` (width, height) is the largest image the settings
        declare, for families whose token count depends on the image's size."""
        self.model_dir = model_dir
        self.hf_config = hf_config
        self.processor = self.load_processor(model_dir)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.mm_processor_kwargs: dict[str, Any] = dict(mm_processor_kwargs or {})
        self.max_image_size = max_image_size
        self.image_token_id: int = hf_config.image_token_id
        self.image_token: str = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        check_kwarg_names(self.image_processor, self.mm_processor_kwargs)

    @classmethod
    def load_processor(cls, model_dir: str) -> Any:
        """The checkpoint's Hugging Face processor (``AutoProcessor``, offline)."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_dir, local_files_only=True)

    @abstractmethod
    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens an image of ``width`` x ``height`` becomes, by the processor's
        own rules under the settings in force."""

    @property
    @abstractmethod
    def max_tokens_per_item(self) -> int:
        """The most tokens one image can become under the settings in force (exact: no image
        yields more), the encoder budget's unit."""

    def embeds_input(self, embeds: torch.Tensor, grid_thw: tuple[int, int, int] | None
                     ) -> tuple[EncoderInput, int]:
        """An image given as its embeddings (``ImageEmbeds``; ``embeds`` is ``[tokens,
        hidden]``, checked by the processor): its encoder input and its token count, or
        ``InvalidInputError`` saying what does not fit this family. Here, for families whose
        every image is ``max_tokens_per_item`` tokens: that many rows, and no grid."""
        if grid_thw is not None:
            raise InvalidInputError(
                f"{type(self).__name__} images take no image_grid_thw (every image is "
                f"{self.max_tokens_per_item} tokens): leave it out.", param="images")
        if embeds.shape[0] != self.max_tokens_per_item:
            raise InvalidInputError(
                f"image embeddings of {embeds.shape[0]} rows: this model's images are "
                f"{self.max_tokens_per_item} tokens each, so their embeddings are "
                f"[{self.max_tokens_per_item}, hidden size]", param="images")
        return {IMAGE_EMBEDS: embeds}, self.max_tokens_per_item

    @abstractmethod
    def dummy_image(self) -> Image.Image:
        """The worst-case image the profile run encodes: one of ``max_tokens_per_item``."""

    def dummy_encoder_input_of(self, num_tokens: int) -> EncoderInput | None:
        """A zero encoder input of ``num_tokens`` tokens, for a profile run that fills the
        encoder's budget with a smaller item; None where every image is the same size."""
        return None

    @abstractmethod
    def encoder_input(self, image: Image.Image, **overrides: Any) -> EncoderInput:
        """The encoder's input for one decoded RGB image, as the processor makes it: named
        tensors ("pixel_values", and what else the family's encoder takes, such as an image
        grid), the model's ``encode_images`` input for this image alone. ``overrides`` are
        image-processor settings over those in force (``device_encoder_input`` turns the
        rescaling and normalization off)."""

    @functools.cached_property
    def device_pixel_arithmetic(self) -> PixelArithmetic | None:
        """The image processor's rescaling and normalization under the settings in force, as
        a table for a device to look the resized pixels up in, or None where the processor's
        pixel values are not such a lookup (then it keeps doing all of it).

        The table is read off the processor's own output (whichever backend: PIL's rescale
        then normalize, torchvision's fused one), on a probe image of a size the processor
        does not resize whose every channel holds every value 0-255, with the rescaling and
        normalization on and off: each value must always become the same number, and every
        value must occur."""
        try:
            probe = _every_value_probe(self.unresized_size())
            full = self.encoder_input(probe)["pixel_values"]
            raw = self.encoder_input(probe, do_rescale=False, do_normalize=False)["pixel_values"]
            arithmetic = _table_from(raw, full)
        except (ValueError, RuntimeError, TypeError) as e:
            arithmetic, reason = None, f"{type(e).__name__}: {e}"
        else:
            reason = "its output is not a lookup of each resized value"
        if arithmetic is None:
            logger.warning("%s: pixels are rescaled and normalized on the CPU, not on the GPU "
                           "(%s)", type(self.image_processor).__name__, reason)
        return arithmetic

    def unresized_size(self) -> tuple[int, int]:
        """A (width, height) the image processor keeps as it is (resizing to itself; a crop
        may follow), at least 16 x 16. The default: the square of the resize output of the
        dummy image, for processors that resize to one shortest edge (LLaVA's CLIP and
        SigLIP processors)."""
        side = max(16, math.isqrt(self.resized_pixels(*self.dummy_image().size)))
        return side, side

    def device_encoder_input(self, image: Image.Image,
                             arithmetic: PixelArithmetic) -> EncoderInput:
        """``encoder_input`` left as the resized integer pixels (uint8, a quarter of the
        bytes) with ``arithmetic`` to finish them where they are encoded (integers 0-255
        whatever the image: ``device_pixel_arithmetic`` checked the processor makes them)."""
        return with_integer_pixels(
            self.encoder_input(image, do_rescale=False, do_normalize=False), arithmetic)

    def pixel_arithmetic_for(self, device: str) -> PixelArithmetic | None:
        """Where the rescaling and normalization run for an engine on ``device``: on a GPU,
        there (the arithmetic, where the processor's output is exactly its lookup), for a
        step's images at once; None: in preprocessing, on the CPU, where the engine's steps
        already take every core."""
        return self.device_pixel_arithmetic if device == "cuda" else None

    def dummy_encoder_input(self) -> EncoderInput:
        """The profile run's encoder input: ``encoder_input(dummy_image())`` with its pixel
        values zeroed (no random numbers, the same shapes)."""
        return {name: torch.zeros_like(t) if t.is_floating_point() else t
                for name, t in self.encoder_input(self.dummy_image()).items()}

    def expand_placeholders(self, text: str, num_tokens: list[int]) -> str:
        """``text`` with its k-th image placeholder expanded for an image of ``num_tokens[k]``
        tokens, as the processor does before tokenizing; every expanded placeholder token
        tokenizes to ``image_token_id``. The default is what LLaVA's and Qwen2-VL's processors
        do: the k-th image token becomes ``num_tokens[k]`` copies of it."""
        pieces = text.split(self.image_token)
        assert len(pieces) == len(num_tokens) + 1  # counted by InputProcessor
        expanded = [pieces[0]]
        for n, piece in zip(num_tokens, pieces[1:], strict=True):
            expanded += [self.image_token * n, piece]
        return "".join(expanded)

    def bounded_to(self, max_tokens: int) -> MultiModalFamily | None:
        """This family under settings that make no image more than ``max_tokens`` tokens, or
        None where the token count is fixed (the start-up plan suggests such a bound when the
        largest image does not fit)."""
        return None

    def item_bound_setting(self) -> str:
        """The settings that bound the largest image, as a user would pass them."""
        return f"mm_processor_kwargs={self.mm_processor_kwargs}"

    def for_request(self, kwargs: dict[str, Any]) -> MultiModalFamily:
        """This family under a request's own image-processor settings (vLLM's per-request
        ``mm_processor_kwargs``, over the server's), or ``InvalidInputError`` saying what to
        change. The processor checks each image it makes against this family's
        ``max_tokens_per_item`` (the encoder's budget was sized for it). The default takes
        none: the family's images are all one size."""
        raise InvalidInputError(
            f"{type(self.image_processor).__name__} makes every image "
            f"{self.max_tokens_per_item} tokens; a request's 'mm_processor_kwargs' have "
            "nothing to change for this model: leave them out.", param="mm_processor_kwargs")

    def resized_pixels(self, width: int, height: int) -> int:
        """Pixels of the image processor's resize output (before any crop) for a ``width`` x
        ``height`` image, for the estimate of preprocessing's memory. The default reads the
        processor's ``size`` (and ``mm_processor_kwargs``' ``size`` or ``do_resize``)."""
        return _resized_pixels(self.image_processor, width, height, self.mm_processor_kwargs)

    @property
    def position_rows(self) -> int:
        """Rows of a prompt's positions: 1 (LLaMA rope), or 3 for M-RoPE (temporal, height,
        width). The runner's inputs and the CUDA graph buffers are sized by it."""
        return 1

    def prompt_positions(self, token_ids: list[int],
                         images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """The rope positions of a prompt, computed once in processing: an int64 array of
        ``[position_rows, len(token_ids)]``, and the offset decode positions continue from
        (the token at index ``i >= len(token_ids)`` has position ``i + offset`` in every row).

        The default is LLaMA's counter: ``arange(N)`` in one row, offset 0."""
        return np.arange(len(token_ids), dtype=np.int64)[None, :], 0


# Image-processor keywords that mmserve sets itself: torch tensors, channels first, on the CPU,
# as the model's encoder takes them.
_RESERVED_KWARGS = ("return_tensors", "data_format", "input_data_format", "device")


def check_kwarg_names(image_processor, kwargs: dict[str, Any]) -> None:
    """Refuse keywords the image processor does not take. Hugging Face processors warn about
    an unknown keyword and ignore it: a misspelt setting would silently change nothing."""
    name = type(image_processor).__name__
    for key in kwargs:
        if key in _RESERVED_KWARGS:
            raise ValueError(f"mm_processor_kwargs: {key!r} is set by mmserve (pixel values "
                             "as torch tensors, channels first, on the CPU); remove it.")
    valid = _image_processor_keys(image_processor)
    if valid is None:  # not listed: a family's start-up probe tries the keywords
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


def _every_value_probe(size: tuple[int, int]) -> Image.Image:
    """An RGB image of ``size`` (at least 256 pixels) whose every channel holds every value:
    pixel i of channel c is (i * (2c + 1)) mod 256, so a crop of whole rows keeps them all
    once it keeps 256 pixels."""
    w, h = size
    i = np.arange(w * h).reshape(h, w)
    pixels = np.stack([(i * (2 * c + 1)) % 256 for c in range(3)], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels)


def _table_from(raw: torch.Tensor, full: torch.Tensor,
                channels: int = 3) -> PixelArithmetic | None:
    """The table mapping each channel's resized value in ``raw`` to the processor's number
    in ``full`` (read as ``[n, channels, rest]``, like ``PixelArithmetic.apply``), or None
    unless the values are integers 0-255, each maps to one number, and all 256 occur."""
    if raw.shape != full.shape or raw.shape[0] == 0:
        return None
    values = raw.reshape(raw.shape[0], channels, -1).transpose(0, 1).reshape(channels, -1)
    numbers = full.reshape(full.shape[0], channels, -1).transpose(0, 1).reshape(channels, -1)
    if not torch.equal(values, values.round().clamp(0, 255)):
        return None
    values = values.long()
    table = torch.empty(channels, 256, dtype=torch.float32)
    for c in range(channels):
        order = values[c].argsort()
        v, x = values[c][order], numbers[c][order].float()
        keys, first = torch.unique_consecutive(v, return_counts=True)
        if len(keys) != 256:
            return None
        starts = first.cumsum(0) - first
        table[c] = x[starts]
        if not torch.equal(x, table[c][v]):  # one number for every occurrence of a value
            return None
    return PixelArithmetic(table, channels)

