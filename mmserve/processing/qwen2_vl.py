"""Qwen2-VL's and Qwen2.5-VL's processing rules: dynamic resolution and M-RoPE positions.

The image processor resizes every image to whole ``patch * merge`` squares whose area lies
between ``min_pixels`` and ``max_pixels`` (transformers' ``smart_resize``, aspect ratio kept as
well as it can), so an image becomes ``(height / patch / merge) * (width / patch / merge)``
tokens: a few for an icon, thousands for a document page. ``max_pixels`` therefore bounds the
tokens of any image, and the encoder budget is sized from it: by ``mm_processor_kwargs``
(``max_pixels``, ``min_pixels``, or ``size``), or by the largest image declared in
``--limit-mm-per-prompt``, which then also bounds the processor (``max_pixels`` becomes the area
that image is resized to, so it is processed as before and anything larger is scaled down).

Positions have three rows (temporal, height, width), by the model's rope-index rule: text
counts on in all three rows; an image's tokens take their grid row and column from where the
image starts, and the text after it continues from there plus the grid's longer side.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs import IMAGE_EMBEDS, EncoderInput, ImageInput
from mmserve.processing.family import MultiModalFamily

# transformers refuses images whose long side exceeds the short one more than this.
MAX_ASPECT_RATIO = 200
# Settings of the vision tower the checkpoint was trained with: not the processor's to change.
_MODEL_SETTINGS = ("patch_size", "merge_size", "temporal_patch_size")


def _is_pixels(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The processor's resize rule (transformers' ``smart_resize``): the image's size after
    resizing, both sides whole multiples of ``factor``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as rule

    return rule(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


class Qwen2VLFamily(MultiModalFamily):
    """``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration``."""

    def __init__(self, model_dir: str, hf_config, mm_processor_kwargs: dict[str, Any] | None = None,
                 max_image_size: tuple[int, int] | None = None) -> None:
        super().__init__(model_dir, hf_config, mm_processor_kwargs, max_image_size)
        self.given_kwargs = dict(self.mm_processor_kwargs)
        vision = hf_config.vision_config
        kwargs = dict(self.mm_processor_kwargs)
        for key in _MODEL_SETTINGS:
            model_value = {"patch_size": vision.patch_size, "merge_size":
                           vision.spatial_merge_size,
                           "temporal_patch_size": vision.temporal_patch_size}[key]
            value = kwargs.pop(key, getattr(self.image_processor, key, model_value))
            if value != model_value:
                raise ValueError(
                    f"{key}={value} in the processor settings of {model_dir}, but the vision "
                    f"tower was built for {model_value}; remove {key} from "
                    "mm_processor_kwargs (or fix preprocessor_config.json).")
        if not kwargs.get("do_resize", getattr(self.image_processor, "do_resize", True)):
            raise ValueError("mm_processor_kwargs: do_resize=False would let an image become "
                             "any number of tokens; dynamic-resolution models need the resize "
                             "(bound the size with max_pixels instead).")
        self.patch_size = vision.patch_size
        self.merge_size = vision.spatial_merge_size
        self.factor = self.patch_size * self.merge_size
        self._checkpoint_min_pixels = self._pixel_bounds({})[0]
        self.min_pixels, self.max_pixels = self._pixel_bounds(kwargs)
        if max_image_size is not None:
            width, height = max_image_size
            declared = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
            self.max_pixels = max(self.min_pixels, declared[0] * declared[1])
        # What every image-processor call gets (and every image hash covers): the caller's
        # settings with the pixel bounds in force written as the processor's ``size``.
        for key in ("min_pixels", "max_pixels", "size"):
            kwargs.pop(key, None)
        kwargs["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        self.processor_kwargs = kwargs
        self.mm_processor_kwargs = {**self.mm_processor_kwargs, **kwargs}
        for key in ("min_pixels", "max_pixels"):
            self.mm_processor_kwargs.pop(key, None)
        self._max_tokens, self._worst_size = self._largest_item()

    @classmethod
    def load_processor(cls, model_dir: str) -> Any:
        from mmserve.processing.hf_processors import load_qwen2_vl_processor

        return load_qwen2_vl_processor(model_dir)

    def _pixel_bounds(self, kwargs: dict[str, Any]) -> tuple[int, int]:
        """(min_pixels, max_pixels): the checkpoint's, overridden by ``mm_processor_kwargs``."""
        size = self.image_processor.size
        get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
        low, high = get("shortest_edge"), get("longest_edge")
        override = kwargs.get("size") or {}
        if not isinstance(override, dict):
            raise ValueError("mm_processor_kwargs: size must be an object with shortest_edge "
                             "and longest_edge (pixels), or use min_pixels / max_pixels.")
        low = kwargs.get("min_pixels", override.get("shortest_edge", low))
        high = kwargs.get("max_pixels", override.get("longest_edge", high))
        for name, value in (("min_pixels", low), ("max_pixels", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive whole number of pixels, got "
                                 f"{value!r}")
        if low > high:
            raise ValueError(f"min_pixels={low} is more than max_pixels={high}; lower "
                             "min_pixels or raise max_pixels.")
        if high < self.factor * self.factor:
            raise ValueError(f"max_pixels={high} is less than one {self.factor}x{self.factor} "
                             f"token; set max_pixels to at least {self.factor ** 2}.")
        return low, high

    # ----------------------------------------------------------------- sizes
    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of patches of a ``width`` x ``height`` image after resizing."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        rows, cols = self.grid(width, height)
        return rows * cols // (self.merge_size ** 2)

    def bounded_to(self, max_tokens: int) -> Qwen2VLFamily:
        """``max_pixels`` of ``max_tokens`` whole tokens (and ``min_pixels`` no more)."""
        max_pixels = max_tokens * self.factor ** 2
        kwargs = {**self.given_kwargs, "max_pixels": max_pixels,
                  "min_pixels": min(self.min_pixels, max_pixels)}
        kwargs.pop("size", None)
        return type(self)(self.model_dir, self.hf_config, kwargs, None)

    def item_bound_setting(self) -> str:
        pixels = {k: v for k, v in self.given_kwargs.items()
                  if k not in ("size", "min_pixels", "max_pixels")}
        pixels["max_pixels"] = self.max_pixels
        if self.min_pixels != self._checkpoint_min_pixels:
            pixels["min_pixels"] = self.min_pixels
        side = math.isqrt(self.max_pixels)
        return (f"max_pixels={self.max_pixels} (--mm-processor-kwargs "
                f"'{json.dumps(pixels)}', or declare the largest "
                f"image, e.g. --limit-mm-per-prompt '{{\"image\": {{\"count\": 1, "
                f"\"width\": {side}, \"height\": {side}}}}}')")

    def for_request(self, kwargs: dict[str, Any]) -> Qwen2VLFamily:
        """``min_pixels`` and ``max_pixels`` (the area an image is resized into) for one
        request's images: ``max_pixels`` up to the server's (``min_pixels`` at most the
        ``max_pixels`` given); each image is still checked against the server's largest
        (``max_tokens_per_item`` stays the server's, which rounding up to a large
        ``min_pixels`` could pass)."""
        unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
        if unknown:
            raise InvalidInputError(
                f"a request's mm_processor_kwargs may set min_pixels and max_pixels (the area "
                f"an image is resized into), not {', '.join(map(repr, unknown))}; the other "
                "settings are the server's (--mm-processor-kwargs).",
                param="mm_processor_kwargs")
        high = kwargs.get("max_pixels", self.max_pixels)
        low = kwargs.get("min_pixels", min(self.min_pixels, high) if _is_pixels(high) else 1)
        for name, value in (("max_pixels", high), ("min_pixels", low)):
            if not _is_pixels(value):  # (before comparing it with the server's)
                raise InvalidInputError(f"mm_processor_kwargs: {name} must be a positive "
                                        f"whole number of pixels, got {value!r:.40}",
                                        param="mm_processor_kwargs")
        if high > self.max_pixels:
            raise InvalidInputError(
                f"mm_processor_kwargs: this server's images are at most max_pixels="
                f"{self.max_pixels} ({self.max_tokens_per_item} tokens), the size its encoder "
                "budget holds: ask for at most that.", param="mm_processor_kwargs")
        if (low, high) == (self.min_pixels, self.max_pixels):
            return self
        try:
            return self._variant(low, high)
        except ValueError as e:
            raise InvalidInputError(f"mm_processor_kwargs: {e}",
                                    param="mm_processor_kwargs") from None

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a family lives as long as its engine)
    def _variant(self, min_pixels: int, max_pixels: int) -> Qwen2VLFamily:
        """A copy of this family with other pixel bounds, sharing its processor."""
        low, high = self._pixel_bounds({"min_pixels": min_pixels, "max_pixels": max_pixels})
        variant = copy.copy(self)
        variant.min_pixels, variant.max_pixels = low, high
        size = {"shortest_edge": low, "longest_edge": high}
        variant.processor_kwargs = {**self.processor_kwargs, "size": size}
        variant.mm_processor_kwargs = {**self.mm_processor_kwargs, "size": size}
        return variant

    def resized_pixels(self, width: int, height: int) -> int:
        rows, cols = self.grid(width, height)
        return rows * cols * self.patch_size ** 2

    @property
    def max_tokens_per_item(self) -> int:
        return self._max_tokens

    def _largest_item(self) -> tuple[int, tuple[int, int]]:
        """The most tokens any image can become, and an image size (width, height) that
        becomes that many: the resize rule evaluated on every kind of image where its maximum
        can lie (``tests/test_qwen2_vl_family.py`` checks random sizes never exceed it).

        - Resized images the rule keeps as they are: ``a x b`` squares of ``factor`` pixels
          with ``a * b * factor^2`` within the bounds; the best for each ``a``.
        - Images at the extreme aspect ratio, at every scale: scaled down, the short side
          cannot go below one square, so the long side may keep more than ``max_pixels``
          allows.
        - Small images scaled up to ``min_pixels``: rounding up each side can overshoot, and
          by most at extreme aspect ratios (all thin images of a short side under half a
          square, whose rounded area is zero).
        """
        f, high = self.factor, self.max_pixels
        sizes: list[tuple[int, int]] = []
        squares = high // (f * f)
        for a in range(1, math.isqrt(squares) + 1):
            b = squares // a
            if b <= a * MAX_ASPECT_RATIO:
                sizes += [(a * f, b * f), (b * f, a * f)]
        for short in (1 << k for k in range(13)):  # the extreme ratio at every scale
            sizes += [(short * MAX_ASPECT_RATIO, short), (short, short * MAX_ASPECT_RATIO)]
        for short in range(1, f // 2):
            for long in range(short, short * MAX_ASPECT_RATIO + 1, max(1, short // 4)):
                sizes += [(long, short), (short, long)]
        # The most tokens; of the images that make them, the fewest pixels.
        best = max(sizes, key=lambda s: (self.num_image_tokens(*s), -s[0] * s[1]))
        return self.num_image_tokens(*best), best

    def unresized_size(self) -> tuple[int, int]:
        """The smallest square the resize rule keeps: a side that is a multiple of the patch
        factor with at least ``min_pixels`` (and 256) pixels."""
        side = self.factor * max(1, math.ceil(math.sqrt(max(self.min_pixels, 256)) / self.factor))
        return side, side

    def dummy_image(self) -> Image.Image:
        """An image of ``max_tokens_per_item`` tokens (of those, the one of fewest pixels)."""
        return Image.new("RGB", self._worst_size)

    def _worst_grid(self) -> tuple[int, int]:
        return self.grid(*self._worst_size)

    def dummy_encoder_input(self) -> EncoderInput:
        """Zero pixels of the worst-case grid, built without resizing an image."""
        return self._zero_input(*self._worst_grid())

    def dummy_encoder_input_of(self, num_tokens: int) -> EncoderInput:
        """One row of ``num_tokens`` tokens: the same patches, so the same encoder work."""
        return self._zero_input(self.merge_size, self.merge_size * num_tokens)

    def _zero_input(self, rows: int, cols: int) -> EncoderInput:
        patch_dim = 3 * self.image_processor.temporal_patch_size * self.patch_size ** 2
        return {"pixel_values": torch.zeros(rows * cols, patch_dim),
                "image_grid_thw": torch.tensor([[1, rows, cols]])}

    # ----------------------------------------------------------------- processing
    def encoder_input(self, image: Image.Image, **overrides: Any) -> dict[str, torch.Tensor]:
        out = self.image_processor([image], return_tensors="pt",
                                   **{**self.processor_kwargs, **overrides})
        grid = out["image_grid_thw"]
        expected = self.num_image_tokens(*image.size)
        if int(grid.prod()) // self.merge_size ** 2 != expected:
            raise RuntimeError(f"the image processor made a {grid.tolist()} grid for a "
                               f"{image.size[0]}x{image.size[1]} image, not the {expected} "
                               "tokens of its resize rule")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}

    def embeds_input(self, embeds: torch.Tensor, grid_thw: tuple[int, int, int] | None
                     ) -> tuple[EncoderInput, int]:
        """Embeddings with their image's patch grid (for the positions): one row per merged
        patch, ``t * h * w / merge_size^2`` of them (the processor has checked that they are
        no more than ``max_tokens_per_item``, before copying them)."""
        m = self.merge_size
        if grid_thw is None:
            raise InvalidInputError(
                "Qwen2-VL image embeddings need their image_grid_thw (temporal, height and "
                "width in patches, as the image processor gives it) for the positions",
                param="images")
        t, h, w = grid_thw
        if t != 1 or h < m or w < m or h % m or w % m:
            raise InvalidInputError(
                f"image_grid_thw {list(grid_thw)} is no image's grid: temporal 1, height and "
                f"width positive multiples of the merge size ({m})", param="images")
        tokens = h * w // (m * m)
        if embeds.shape[0] != tokens:
            raise InvalidInputError(
                f"image embeddings of {embeds.shape[0]} rows for image_grid_thw "
                f"{list(grid_thw)}, which makes {tokens} tokens", param="images")
        return {IMAGE_EMBEDS: embeds, "image_grid_thw": torch.tensor([[t, h, w]])}, tokens

    @property
    def position_rows(self) -> int:
        return 3

    def prompt_positions(self, token_ids: list[int],
                         images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """M-RoPE positions (transformers' ``get_rope_index`` for images): text advances all
        three rows by one a token; an image's tokens are ``(start, start + row, start +
        column)`` over its merged grid, and the text after it resumes at ``start`` plus the
        grid's longer side. Decode positions continue from the largest position plus one."""
        n = len(token_ids)
        positions = np.empty((3, n), dtype=np.int64)
        index, current = 0, 0
        for image in sorted(images, key=lambda im: im.offset):
            text = image.offset - index
            positions[:, index:image.offset] = np.arange(current, current + text)
            current += text
            _, h, w = (int(v) for v in image.pixel_values["image_grid_thw"].reshape(3))
            rows, cols = h // self.merge_size, w // self.merge_size
            if rows * cols != image.length:
                raise ValueError(f"an image of {image.length} tokens has a {rows}x{cols} grid")
            grid_rows, grid_cols = np.divmod(np.arange(rows * cols), cols)
            span = slice(image.offset, image.end)
            positions[0, span] = current
            positions[1, span] = current + grid_rows
            positions[2, span] = current + grid_cols
            current += max(rows, cols)
            index = image.end
        positions[:, index:] = np.arange(current, current + n - index)
        offset = int(positions.max()) + 1 - n if n else 0
        return positions, offset
