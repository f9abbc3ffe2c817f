"""What processing hands the engine for one image of a request: a leaf module, so that
``processing`` and ``engine`` both import it without importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# One image's encoder input: the named tensors its family's processing made for it alone, as
# the model's ``encode_images`` takes them ("pixel_values", and e.g. "image_grid_thw"). Beside
# a GPU, "pixel_values" may be the resized pixels still as integers (uint8), with the
# ``PixelArithmetic`` that finishes them under PIXEL_ARITHMETIC: the runner does that on the
# device, for a step's images at once.
EncoderInput = Mapping[str, Any]
PIXEL_ARITHMETIC = "pixel_arithmetic"


# An image given as its embeddings (``ImageEmbeds``) has them here in its encoder input: the
# runner uses them as the encoder's output.
IMAGE_EMBEDS = "image_embeds"


@dataclass(frozen=True)
class ImageEmbeds:
    """An image given as the embeddings its encoder would make, in place of its pixels (vLLM's
    ``image_embeds``): ``embeds`` is ``[tokens, hidden]`` (the decoder's hidden size; a
    leading dimension of 1 is dropped), what the model's vision tower and projector make of
    the image, one row per placeholder token. Families whose token count follows the image's
    size also need the image's patch grid, ``grid_thw`` (Qwen2-VL's ``image_grid_thw``:
    temporal, height and width in patches), for the positions."""

    embeds: torch.Tensor
    grid_thw: tuple[int, int, int] | None = None


def encoder_input_bytes(item: EncoderInput) -> int:
    """Bytes the tensors of one encoder input hold."""
    return sum(t.nelement() * t.element_size() for t in item.values()
               if isinstance(t, torch.Tensor))


def with_integer_pixels(item: EncoderInput, arithmetic: PixelArithmetic) -> EncoderInput:
    """``item`` whose pixel values are resized integers, as uint8, with the arithmetic that
    finishes them."""
    return {**item, "pixel_values": item["pixel_values"].to(torch.uint8),
            PIXEL_ARITHMETIC: arithmetic}


@dataclass(frozen=True)
class PixelArithmetic:
    """What an image processor does to resized pixels: rescale and normalize by channel, as
    one table per channel of the float32 value each of the 256 integer values becomes
    (``table[c, v]``), read off the processor's own output once
    (``MultiModalFamily.device_pixel_arithmetic``), so a lookup gives the same bits it would.
    ``channels`` is the pixel values' channel count: they are read as ``[n, channels, rest]``
    (``[images, 3, height, width]`` and Qwen2-VL's ``[patches, 3 * temporal * patch * patch]``
    both are)."""

    table: torch.Tensor  # float32 [channels, 256]
    channels: int

    def apply(self, pixels: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """The finished float32 pixel values of integer ``pixels`` (uint8), on their device.
        ``table``: ``self.table`` already there (a runner keeps one per table, so that steps
        do not copy it, and wait, each time)."""
        table = self.table.to(pixels.device) if table is None else table
        grouped = pixels.reshape(pixels.shape[0], self.channels, -1)
        out = torch.empty(grouped.shape, dtype=torch.float32, device=pixels.device)
        for c in range(self.channels):
            values = grouped[:, c].reshape(-1).int()
            out[:, c] = table[c].index_select(0, values).view(grouped.shape[0], -1)
        return out.view(pixels.shape)


@dataclass
class ImageInput:
    """One image of a request: its content hash (salted by the request's ``cache_salt``, if
    any: the encoder cache's key), its placeholder range and its encoder input (pixel values,
    and what else its family's encoder takes).

    The pixels are stored with the request, which owns them; the scheduler and the encoder
    cache only read the hash and the range, and the step messages (``mmserve/step.py``) carry
    hashes. The engine hands the pixels of the images a step encodes to the runner apart.
    """

    hash: str
    offset: int  # first placeholder token in the prompt
    length: int  # number of placeholder tokens == number of embeddings
    pixel_values: EncoderInput | None = None  # the encoder's input; None in scheduler tests

    @property
    def end(self) -> int:
        return self.offset + self.length
