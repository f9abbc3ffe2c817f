"""What processing hands the engine for one image of a request: a leaf module, so that
``processing`` and ``engine`` both import it without importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# One image's encoder input: the named tensors its family's processing made for it alone, as
# the model's ``encode_images`` takes them ("pixel_values", and e.g. "image_grid_thw").
EncoderInput = Mapping[str, Any]


def encoder_input_bytes(item: EncoderInput) -> int:
    """Bytes the tensors of one encoder input hold."""
    return sum(t.nelement() * t.element_size() for t in item.values())


@dataclass
class ImageInput:
    """One image of a request: its content hash, its placeholder range and its encoder input
    (pixel values, and what else its family's encoder takes).

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
