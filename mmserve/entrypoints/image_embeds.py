"""vLLM's ``image_embeds`` chat parts: an image sent as its embeddings, a tensor saved with
``torch.save`` and base64-encoded, instead of its pixels. Taken only where the server is
started with ``--enable-mm-embeds`` (as vLLM's flag): the tensors are read with
``torch.load(weights_only=True)``, which unpickles tensors and plain values only, but is
still far more machinery than an image decoder, for clients the operator trusts.

A part is ``{"type": "image_embeds", "image_embeds": "<base64>"}``, or for families that need
the image's patch grid (Qwen2-VL) ``{"image_embeds": {"image_embeds": "<base64>",
"image_grid_thw": "<base64>" or [t, h, w]}}``. What the model needs of the tensor (its hidden
size, its token count and grid) is checked where every prompt's images are: the processor.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.errors import InvalidInputError
from mmserve.inputs import ImageEmbeds

# What the zip archive torch.save writes may hold beyond the tensor's bytes (its pickle and
# records): an archive that unpacks to more than its size and this is refused unread.
_ARCHIVE_SLACK = 64 * 1024


@dataclass(frozen=True)
class EmbedsPart:
    """An ``image_embeds`` part as the request sent it (decoded off the event loop)."""

    embeds: str
    grid_thw: str | list[Any] | None = None


def parse_embeds_part(value: Any, where: str) -> EmbedsPart:
    """A part's ``image_embeds`` value checked for its form (not yet decoded)."""
    if isinstance(value, str):
        return EmbedsPart(value)
    if isinstance(value, dict) and isinstance(value.get("image_embeds"), str):
        grid = value.get("image_grid_thw")
        if grid is None or isinstance(grid, (str, list)):  # (its numbers: the processor's)
            return EmbedsPart(value["image_embeds"], grid)
    raise InvalidInputError(
        f"{where}.image_embeds must be a base64 string of a tensor saved with torch.save, or "
        "{'image_embeds': <base64>, 'image_grid_thw': <base64> or [t, h, w]}",
        param=f"{where}.image_embeds")


def load_embeds(part: EmbedsPart, param: str = "messages") -> ImageEmbeds:
    """The tensors of ``part``, or ``InvalidInputError`` saying why not. Blocking: call it
    from a worker thread."""
    embeds = _tensor(part.embeds, "image_embeds", param)
    grid = part.grid_thw
    if isinstance(grid, str):
        grid = _tensor(grid, "image_grid_thw", param)
    return ImageEmbeds(embeds, grid)


def _tensor(text: str, name: str, param: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"{name} is not valid base64", param=param) from None
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, ValueError, OSError):
        unpacked = None
    if unpacked is None:
        raise InvalidInputError(f"{name} is not a tensor saved with torch.save (its zip "
                                "format)", param=param)
    if unpacked > len(raw) + _ARCHIVE_SLACK:
        raise InvalidInputError(f"{name} unpacks to {unpacked} bytes from {len(raw)}: send "
                                "the tensor as torch.save writes it, uncompressed", param=param)
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (anything torch.load refuses is the client's)
        raise InvalidInputError(f"{name} cannot be read as a tensor: {str(e)[:200]}",
                                param=param) from None
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise InvalidInputError(f"{name} must hold one dense tensor, not "
                                f"{type(value).__name__}", param=param)
    return value
