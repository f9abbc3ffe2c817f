"""Which image URLs the server will read, and reading them safely.

- ``data:image/...;base64,`` URLs are always accepted.
- ``http(s)://`` URLs only for hosts listed in ``allowed_domains`` (exact host names), fetched
  with a byte cap and a total timeout. Redirects are refused, since following one could lead to
  a host that is not allowed.
- ``file://`` URLs only when ``allowed_local_path`` is set, and only if the resolved path (after
  symlinks and ``..``) stays inside it.

Whatever the source, the bytes must be a PNG, JPEG, WebP or GIF image of at most ``max_bytes``
and at most ``max_image_pixels`` once decoded (checked from the header, against decompression
bombs).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from mmserve.processing.images import InvalidInputError, decode_data_url, load_image

_CHUNK = 64 * 1024


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max image bytes must be positive, got {self.max_bytes}.")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"the fetch timeout must be positive, got {self.fetch_timeout_s}.")
        if self.allowed_local_path is not None and not Path(self.allowed_local_path).is_dir():
            raise ValueError(
                f"--allowed-local-media-path {self.allowed_local_path!r} is not a directory.")
        object.__setattr__(self, "allowed_domains",
                           tuple(d.strip().lower() for d in self.allowed_domains if d.strip()))


def load_image_url(url: str, policy: MediaPolicy, param: str = "messages") -> bytes:
    """The bytes of the image at ``url``, or ``InvalidInputError`` saying why not. Blocking:
    call it from a worker thread."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = decode_data_url(url)
    elif scheme in ("http", "https"):
        data = _fetch(url, policy, param)
    elif scheme == "file":
        data = _read_local(url, policy, param)
    else:
        raise InvalidInputError(
            f"unsupported image URL {_short(url)}; send a data:image/...;base64 URL, an "
            "http(s) URL of an allowed domain, or a file:// URL under the allowed local path.",
            param=param)
    if len(data) > policy.max_bytes:
        raise InvalidInputError(
            f"an image is {len(data)} bytes, over the limit of {policy.max_bytes} bytes; send a "
            "smaller image.", param=param)
    check_image_format(data, param)
    return data


def load_image_from_url(url: str, policy: MediaPolicy, max_pixels: int) -> Image.Image:
    """Read and decode the image at ``url`` (first frame; at most ``max_pixels``). Blocking:
    the server calls it from worker threads, so decoding overlaps the engine's steps instead
    of running in the engine thread."""
    return load_image(load_image_url(url, policy), max_pixels)


def check_image_format(data: bytes, param: str = "messages") -> None:
    """Accept only the formats the API promises, by their magic bytes."""
    if (data.startswith(b"\x89PNG\r\n\x1a\n") or data.startswith(b"\xff\xd8\xff")
            or data[:6] in (b"GIF87a", b"GIF89a")
            or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")):
        return
    raise InvalidInputError("an image is not a PNG, JPEG, WebP or GIF file", param=param)


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        raise InvalidInputError(
            f"the image URL {_short(req.full_url)} redirects to {_short(newurl)}; mmserve does "
            "not follow redirects, send the final URL.")


def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in policy.allowed_domains:
        raise InvalidInputError(
            f"fetching images from {host!r} is not allowed; start the server with "
            f"--allowed-media-domains {host or 'HOST'} to allow it, or send a data: URL.",
            param=param)
    deadline = time.monotonic() + policy.fetch_timeout_s
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=policy.fetch_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_bytes:
                raise InvalidInputError(
                    f"the image at {_short(url)} is {length} bytes, over the limit of "
                    f"{policy.max_bytes} bytes.", param=param)
            chunks: list[bytes] = []
            size = 0
            while chunk := resp.read(_CHUNK):
                size += len(chunk)
                if size > policy.max_bytes:
                    raise InvalidInputError(
                        f"the image at {_short(url)} is over the limit of {policy.max_bytes} "
                        "bytes.", param=param)
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
    except InvalidInputError as e:
        e.param = param
        raise
    except urllib.error.HTTPError as e:
        raise InvalidInputError(f"fetching {_short(url)} failed with HTTP {e.code}",
                                param=param) from None
    except TimeoutError:
        raise InvalidInputError(
            f"fetching {_short(url)} took longer than {policy.fetch_timeout_s} s",
            param=param) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise InvalidInputError(f"fetching {_short(url)} failed: {reason}", param=param) from None
    return b"".join(chunks)


def _read_local(url: str, policy: MediaPolicy, param: str) -> bytes:
    if policy.allowed_local_path is None:
        raise InvalidInputError(
            "local image files are disabled; start the server with --allowed-local-media-path "
            "DIR to serve files under DIR, or send a data: URL.", param=param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidInputError(f"file:// URLs must not name a host, got {parts.netloc!r}",
                                param=param)
    root = Path(policy.allowed_local_path).resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise InvalidInputError(
            f"the image path {_short(unquote(parts.path))} is outside the allowed local media "
            "path.", param=param)
    if not path.is_file():
        raise InvalidInputError(f"image file not found: {_short(unquote(parts.path))}",
                                param=param)
    if path.stat().st_size > policy.max_bytes:
        raise InvalidInputError(
            f"the image file is {path.stat().st_size} bytes, over the limit of "
            f"{policy.max_bytes} bytes.", param=param)
    return path.read_bytes()
