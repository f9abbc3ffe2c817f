"""Loading user images safely: PIL images, file paths, raw bytes or data URLs."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from pathlib import Path

from PIL import Image

ImageLike = Image.Image | str | os.PathLike | bytes


class InvalidInputError(ValueError):
    """A request the engine refuses, with a message that says what to change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def load_image(image: ImageLike, max_pixels: int) -> Image.Image:
    """Decode ``image`` fully into an RGB PIL image, refusing bombs and broken files."""
    if isinstance(image, Image.Image):
        _check_pixels(image.size, max_pixels)
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        return _decode(bytes(image), max_pixels, "image bytes")
    if isinstance(image, (str, os.PathLike)):
        text = os.fspath(image)
        if text.startswith("data:"):
            return _decode(decode_data_url(text), max_pixels, "data URL")
        if text.startswith(("http://", "https://")):
            raise InvalidInputError(
                "mmserve does not fetch remote images from the Python API; download the image "
                "and pass its bytes, a local path or a PIL image.")
        path = Path(text)
        if not path.is_file():
            raise InvalidInputError(f"image file not found: {text}")
        return _decode(path.read_bytes(), max_pixels, f"image file {text}")
    raise InvalidInputError(
        f"an image must be a PIL image, a path, bytes or a data: URL, not {type(image).__name__}")


def decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise InvalidInputError(
            "an image data URL must look like 'data:image/<format>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"the image data URL is not valid base64: {e}") from None


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    w, h = size
    if w * h > max_pixels:
        raise InvalidInputError(
            f"image of {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} pixels; "
            "resize it, or raise max_image_pixels.")
    if w < 1 or h < 1:
        raise InvalidInputError(f"image has an empty size {w}x{h}")


def _decode(data: bytes, max_pixels: int, what: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            _check_pixels(img.size, max_pixels)  # from the header, before decoding pixels
            img.seek(0)  # first frame of an animation
            img.load()
    except InvalidInputError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as e:
        raise InvalidInputError(f"cannot decode {what} as an image: {e}") from None
    return img.convert("RGB")


def image_hash(img: Image.Image) -> str:
    """Content hash of the decoded pixels: equal pictures share encoder-cache entries."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()
