"""LLaVA's processing rules: every image is resized to the vision tower's one input size and
becomes the same number of tokens (``LlavaProcessor``'s rule), measured once at start-up."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from mmserve.processing.family import MultiModalFamily


class LlavaFamily(MultiModalFamily):
    """``LlavaForConditionalGeneration`` checkpoints served through ``LlavaProcessor``."""

    def __init__(self, model_dir: str, hf_config, mm_processor_kwargs: dict[str, Any] | None = None,
                 max_image_size: tuple[int, int] | None = None) -> None:
        super().__init__(model_dir, hf_config, mm_processor_kwargs, max_image_size)
        # LLaVA processors resize every image to one size: probe the placeholder count once,
        # through the processor's own call under the same settings, and the pixels' size on
        # wide and tall images too (do_center_crop=False makes the size follow the image's
        # shape, which the vision tower cannot take).
        images = {size: Image.new("RGB", size, (200, 120, 40))
                  for size in ((64, 64), (96, 48), (48, 96))}
        try:
            probe = self.processor(text=self.image_token, images=[images[64, 64]],
                                   return_tensors="pt", **self.mm_processor_kwargs)
            pixels = {size: self.pixel_values(img) for size, img in images.items()}
        except Exception as e:  # transformers raises TypeError, ValueError and its own
            if not self.mm_processor_kwargs:
                raise
            raise ValueError(
                f"mm_processor_kwargs {self.mm_processor_kwargs}: "
                f"{type(self.image_processor).__name__} of {model_dir} refuses them: "
                f"{type(e).__name__}: {e}") from e
        self.tokens_per_image = int((probe["input_ids"][0] == self.image_token_id).sum())
        self._check_pixels(pixels, probe["pixel_values"])
        # Placeholders are expanded here, outside the processor: count as the processor does.
        by_rule = self.tokens_by_rule(probe["pixel_values"])
        if by_rule != self.tokens_per_image:
            raise ValueError(
                f"{type(self.processor).__name__} of {model_dir} expands an image to "
                f"{self.tokens_per_image} tokens, not the {by_rule} of LlavaProcessor's rule; "
                "mmserve serves LlavaProcessor checkpoints (patch_size, "
                "num_additional_image_tokens and vision_feature_select_strategy in "
                "processor_config.json).")
        self._side = tuple(probe["pixel_values"].shape[-2:])

    def tokens_by_rule(self, pixel_values: torch.Tensor) -> int:
        """Placeholder tokens for one image, by ``LlavaProcessor``'s rule: one per vision patch
        of the processed image, plus ``num_additional_image_tokens`` (a CLS token), minus one
        when ``vision_feature_select_strategy`` is "default" (the model drops the CLS feature).
        """
        height, width = pixel_values.shape[-2:]
        processor = self.processor
        patch = processor.patch_size
        num = (height // patch) * (width // patch) + (processor.num_additional_image_tokens or 0)
        if processor.vision_feature_select_strategy == "default":
            num -= 1
        return num

    def _check_pixels(self, pixels: dict[tuple[int, int], torch.Tensor],
                      processor_pixels: torch.Tensor) -> None:
        """Every image must become the vision tower's input size (its position embeddings are
        fixed), and the direct image-processor call must make what the processor's own call
        makes: refused at start-up rather than failing request by request."""
        shapes = {size: tuple(p.shape[-2:]) for size, p in pixels.items()}
        side = getattr(getattr(self.hf_config, "vision_config", None), "image_size", None)
        want = {(side, side)} if side else set(shapes.values())
        settings = (f"mm_processor_kwargs {self.mm_processor_kwargs}: "
                    if self.mm_processor_kwargs else "")
        if set(shapes.values()) != want or len(want) != 1:
            made = ", ".join(f"{w}x{h} -> {s[1]}x{s[0]}" for (w, h), s in shapes.items())
            raise ValueError(
                f"{settings}the image processor of {self.model_dir} makes pixel values of "
                f"{made} (image -> pixel values, width x height), but the vision tower takes "
                f"{side}x{side} for every image (vision_config.image_size)"
                + ("; change or drop the settings that resize or crop (do_resize, size, "
                   "do_center_crop, crop_size)." if settings else "."))
        if not torch.equal(processor_pixels, pixels[64, 64]):
            raise ValueError(
                f"{settings}{type(self.processor).__name__} of {self.model_dir} makes other "
                f"pixel values than its image processor {type(self.image_processor).__name__} "
                "called directly (a setting the processor does not pass on?); mmserve calls the "
                "image processor directly and must match the processor exactly.")

    # ----------------------------------------------------------------- the interface
    def num_image_tokens(self, width: int, height: int) -> int:
        return self.tokens_per_image  # every size is resized to the tower's (checked above)

    @property
    def max_tokens_per_item(self) -> int:
        return self.tokens_per_image

    def dummy_image(self) -> Image.Image:
        height, width = self._side
        return Image.new("RGB", (width, height))

    def encoder_input(self, image: Image.Image, **overrides: Any) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values(image, **overrides)}

    def pixel_values(self, image: Image.Image, **overrides: Any) -> torch.Tensor:
        """The same call LlavaProcessor makes (its images kwargs: return_tensors and the
        ``mm_processor_kwargs``), on one image: the processor treats images independently, so
        the values equal a batch call's."""
        return self.image_processor([image], return_tensors="pt",
                                    **{**self.mm_processor_kwargs, **overrides})["pixel_values"]
