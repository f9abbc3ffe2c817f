"""What processing hands the engine for one image of a request: a leaf module, so that
``processing`` and ``engine`` both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageInput:
    """One image of a request: its content hash, its placeholder range and its pixels.

    The pixels are stored with the request, which owns them; the scheduler and the encoder
    cache only read the hash and the range, and the step messages (``mmserve/step.py``) carry
    hashes. The engine hands the pixels of the images a step encodes to the runner apart.
    """

    hash: str
    offset: int  # first placeholder token in the prompt
    length: int  # number of placeholder tokens == number of embeddings
    pixel_values: Any = None  # processor output for this image alone; None in scheduler tests

    @property
    def end(self) -> int:
        return self.offset + self.length
