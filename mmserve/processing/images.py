"""Loading user images safely: PIL images, file paths, raw bytes or data URLs.

Every image is checked from its header, before any pixel is decoded or resized: at most
``max_image_pixels`` pixels (``--max-image-pixels``), at most ``MAX_IMAGE_SIDE`` pixels on each
side and at most ``MAX_IMAGE_ASPECT_RATIO``:1.
mmserve's pixel limit is the only one a user meets: Pillow's own decompression-bomb limit is
raised to match it when it is higher (see ``match_pillow_pixel_limit``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from PIL import Image

# One class for every layer (the engine and the server catch it from mmserve.errors); re-exported
# here because callers have always imported it from this module.
from mmserve.errors import InvalidInputError

__all__ = ["MAX_IMAGE_ASPECT_RATIO", "MAX_IMAGE_SIDE", "ImageLike", "InvalidInputError",
           "check_image", "decode_data_url", "image_hash", "load_image",
           "match_pillow_pixel_limit"]

ImageLike = Image.Image | str | os.PathLike | bytes

MAX_IMAGE_SIDE = 32_768
"""Pixels on the longest side (JPEG and WebP cannot even encode more). With the pixel limit
and the aspect ratio below, it bounds the resize intermediate of any accepted image."""

MAX_IMAGE_ASPECT_RATIO = 200
"""Longest side over shortest side that an image may have (200:1, as in Qwen2-VL's processor).

LLaVA's image processors scale the shortest side up or down to the encoder's input size (224 or
336) before cropping a square, so a thin image is enlarged along its long side first: a
40 x 1,250,000 PNG of 149 KB, under the pixel limit, becomes a 336 x 10.5 M intermediate
(seconds and gigabytes), and 20 x 2,500,000 peaked at 6.5 GB. At 200:1 the intermediate is at
most 336 x 67,200. Hardly any real picture is thinner; change this constant to allow them."""

PIXELS_SETTING = "--max-image-pixels (max_image_pixels in the Python API)"

_pillow_limit_lock = threading.Lock()
# Pillow decodes an opened image on first use, and two threads doing so at once break it: one
# image object passed in several prompts is loaded under a lock (one of a few, by the object).
_image_load_locks = [threading.Lock() for _ in range(16)]


def match_pillow_pixel_limit(max_pixels: int) -> None:
    """Raise Pillow's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``) to
    ``max_pixels`` when that is higher, so that mmserve's ``max_image_pixels`` is the one limit
    in force: Pillow warns above its own limit (89.5 M by default) and refuses above twice it.

    Process-wide: the limit is a global of Pillow, so it also applies to other code in this
    process that opens images with Pillow. It is only ever raised (to the largest
    ``max_image_pixels`` in use), never lowered or disabled; mmserve checks its own limit from
    each image's header first.
    """
    if Image.MAX_IMAGE_PIXELS is None or Image.MAX_IMAGE_PIXELS >= max_pixels:
        return
    with _pillow_limit_lock:  # two engines with different limits: keep the larger
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
            Image.MAX_IMAGE_PIXELS = max_pixels


def load_image(image: ImageLike, max_pixels: int) -> Image.Image:
    """Decode ``image`` fully into an RGB PIL image (first frame), refusing broken files and
    images over ``max_pixels`` pixels or ``MAX_IMAGE_ASPECT_RATIO``:1, checked from the
    header before any pixel is decoded."""
    if isinstance(image, Image.Image):
        _check_size(image.size, max_pixels, "the image")
        with _image_load_locks[id(image) % len(_image_load_locks)]:
            image.load()
        return image.convert("RGB")
    with _open(image, max_pixels) as (img, what):
        try:
            img.seek(0)  # first frame of an animation
            img.load()
            return img.convert("RGB")
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise InvalidInputError(f"cannot decode {what} as an image: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """Pillow's reason, without the Python object it names (``<_io.BytesIO object at
    0x...>``), which tells a client nothing."""
    if isinstance(e, Image.UnidentifiedImageError):
        return "its format is not one that can be read (send PNG, JPEG, GIF or WebP)"
    return re.sub(r"<[^<>]+ object at 0x[0-9a-fA-F]+>", "it", str(e))


def check_image(image: ImageLike, max_pixels: int) -> tuple[int, int]:
    """Check ``image`` as ``load_image`` does, from its header alone (no pixel is decoded);
    returns its (width, height)."""
    if isinstance(image, Image.Image):
        _check_size(image.size, max_pixels, "the image")
        return image.size
    with _open(image, max_pixels) as (img, _):
        return img.size


def decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        kind = header.removeprefix("data:").split(";")[0] if sep else ""
        what = (f"this data URL holds {kind!r}, not an image; "
                if kind and not kind.startswith("image/") else "")
        raise InvalidInputError(
            f"{what}an image data URL must look like 'data:image/<format>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"the image data URL is not valid base64: {e}") from None


def image_hash(img: Image.Image, processor_kwargs: Mapping[str, Any] | None = None) -> str:
    """Content hash of the decoded pixels and of the image processor's keyword arguments
    (``mm_processor_kwargs``): equal pictures under equal settings share encoder-cache entries
    and prefix-cache blocks. The same picture under other settings becomes other pixel values,
    so it must hash apart. Without keyword arguments the hash is that of the pixels alone."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())  # its length follows from the mode and size above
    if processor_kwargs:
        # Canonical text: key order does not matter; values outside JSON (a resampling enum
        # is an int to JSON already) by their repr.
        settings = json.dumps(processor_kwargs, sort_keys=True, separators=(",", ":"),
                              default=repr)
        h.update(b"\0mm_processor_kwargs:" + settings.encode())
    return h.hexdigest()


@contextlib.contextmanager
def _open(image: str | os.PathLike | bytes, max_pixels: int,
          ) -> Iterator[tuple[Image.Image, str]]:
    """Open ``image`` lazily (Pillow reads the header only), check its size, and yield it with
    a description of where it came from; the file is closed on exit."""
    if isinstance(image, (bytes, bytearray)):
        source: io.BytesIO | Path = io.BytesIO(bytes(image))
        what = "the image bytes"
    elif isinstance(image, (str, os.PathLike)):
        text = os.fspath(image)
        if text.startswith("data:"):
            source, what = io.BytesIO(decode_data_url(text)), "the image data URL"
        elif text.startswith(("http://", "https://")):
            raise InvalidInputError(
                "mmserve does not fetch remote images from the Python API; download the image "
                "and pass its bytes, a local path or a PIL image.")
        else:
            source, what = Path(text), f"the image file {text}"
            if not source.is_file():
                raise InvalidInputError(f"image file not found: {text}")
    else:
        raise InvalidInputError(
            "an image must be a PIL image, a path, bytes or a data: URL, not "
            f"{type(image).__name__}")
    match_pillow_pixel_limit(max_pixels)
    try:
        img = Image.open(source)
    except Image.DecompressionBombError:
        # Pillow refuses above twice its limit, which is at least max_pixels by now: the image
        # is over ours. Its size is not known here (Pillow does not return the image).
        raise InvalidInputError(
            f"{what}: more than {2 * Image.MAX_IMAGE_PIXELS} pixels, which exceeds the limit "
            f"of {max_pixels} pixels; resize it, or raise {PIXELS_SETTING}.") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise InvalidInputError(f"cannot decode {what} as an image: {_reason(e)}") from None
    with img:
        _check_size(img.size, max_pixels, what)
        yield img, what


def _check_size(size: tuple[int, int], max_pixels: int, what: str) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise InvalidInputError(f"{what} has an empty size {w}x{h}")
    if w * h > max_pixels:
        raise InvalidInputError(
            f"{what}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} pixels; "
            f"resize it, or raise {PIXELS_SETTING}.")
    if max(w, h) > MAX_IMAGE_ASPECT_RATIO * min(w, h):
        ratio = f"{max(w, h) / min(w, h):.1f}".removesuffix(".0")
        raise InvalidInputError(
            f"{what}: {w}x{h} has an aspect ratio of {ratio}:1, over "
            f"mmserve's limit of {MAX_IMAGE_ASPECT_RATIO}:1 (MAX_IMAGE_ASPECT_RATIO in "
            "mmserve/processing/images.py; the image processor would first scale the short side "
            "up to the encoder's input size). Crop the image, or pad its short side, to at most "
            f"{MAX_IMAGE_ASPECT_RATIO}:1.")
    if max(w, h) > MAX_IMAGE_SIDE:
        raise InvalidInputError(
            f"{what}: {w}x{h} has a side over mmserve's limit of {MAX_IMAGE_SIDE} pixels "
            "(MAX_IMAGE_SIDE in mmserve/processing/images.py); resize it.")
