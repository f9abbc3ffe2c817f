"""Benchmark workloads, generated from a seed: chat requests with images and output lengths.

Every subcommand (and `benchmarks/compare_transformers.py`) builds the same `Workload` from the
same `WorkloadConfig`, so a seed names one exact set of prompts, images and output lengths.
Images are drawn at one size or several (``--image-sizes``, e.g. the preset ``mixed``): a model
with dynamic resolution (Qwen2-VL) makes each size a different number of tokens, LLaVA makes them
all the same.
"""

from __future__ import annotations

import argparse
import io
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

_WORDS = ("the a this that some many one two small large red green blue yellow dark bright old "
          "new cat dog bird car bus tree house road sky water field city person child table "
          "chair window door left right top bottom near behind under over with without and or "
          "what where which how why is are was has shows looks sits stands holds describe explain "
          "picture image photo scene object color shape detail background foreground").split()

_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

# Named lists of image sizes (width, height). "mixed": small, medium, large and wide; with the
# Qwen2.5-VL bench checkpoint 4, 256, 999 and 798 tokens.
IMAGE_SIZE_PRESETS: dict[str, tuple[tuple[int, int], ...]] = {
    "mixed": ((64, 64), (448, 448), (1024, 768), (1600, 400)),
}


@dataclass(frozen=True)
class WorkloadConfig:
    """What the benchmark sends. ``output_len`` is ``(low, high)``, inclusive. The image pool
    cycles through ``image_sizes`` (its images in turn take the next size), so every size is
    drawn about as often."""

    num_prompts: int = 64
    image_sizes: tuple[tuple[int, int], ...] = ((256, 200),)
    unique_images: int | None = None  # pool size; None: one distinct image per slot
    images_per_prompt: int = 1
    output_len: tuple[int, int] = (64, 64)
    shared_prefix_len: int = 0  # tokens of a system prompt shared by every request
    prompt_len: int = 24  # tokens of each request's own question
    image_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}.")
        if not self.image_sizes:
            raise ValueError("image_sizes must name at least one size.")
        for w, h in self.image_sizes:
            if w < 1 or h < 1:
                raise ValueError(f"image size must be positive, got {w}x{h}.")
        if self.unique_images is not None and self.unique_images < 1:
            raise ValueError(f"unique_images must be >= 1, got {self.unique_images}.")
        if self.images_per_prompt < 0:
            raise ValueError(f"images_per_prompt must be >= 0, got {self.images_per_prompt}.")
        low, high = self.output_len
        if not 1 <= low <= high:
            raise ValueError(f"output_len must be A or A:B with 1 <= A <= B, got {low}:{high}.")
        if self.shared_prefix_len < 0 or self.prompt_len < 1:
            raise ValueError("shared_prefix_len must be >= 0 and prompt_len >= 1.")
        if self.image_dir is not None and not Path(self.image_dir).is_dir():
            raise ValueError(f"image folder not found: {self.image_dir!r}.")

    @property
    def num_image_slots(self) -> int:
        return self.num_prompts * self.images_per_prompt


@dataclass
class BenchRequest:
    """One request: chat messages whose ``{"type": "image"}`` parts take ``images`` in order."""

    messages: list[dict[str, Any]]
    images: list[Image.Image]
    image_ids: list[int]  # indices into the workload's image pool
    output_len: int

    def prompt(self) -> dict[str, Any]:
        """The request in the form ``LLM.generate`` and ``LLMEngine.add_request`` take."""
        return {"messages": self.messages, "images": self.images}


@dataclass
class Workload:
    config: WorkloadConfig
    requests: list[BenchRequest]
    pool: list[Image.Image] = field(repr=False)
    _png: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def num_distinct_images(self) -> int:
        return len({i for r in self.requests for i in r.image_ids})

    def png(self, image_id: int) -> bytes:
        """PNG bytes of a pool image (encoded once, for HTTP clients)."""
        if image_id not in self._png:
            buf = io.BytesIO()
            self.pool[image_id].save(buf, format="PNG")
            self._png[image_id] = buf.getvalue()
        return self._png[image_id]


def synthesize_image(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    """A picture with a gradient background and a few shapes, distinct for every draw."""
    w, h = size
    c0 = [rng.randrange(256) for _ in range(3)]
    c1 = [rng.randrange(256) for _ in range(3)]
    # A vertical gradient, drawn as one line per row (fast at any size).
    img = Image.new("RGB", size)
    draw = ImageDraw.Draw(img)
    for y in range(h):
        t = y / max(1, h - 1)
        color = tuple(int(a + (b - a) * t) for a, b in zip(c0, c1, strict=True))
        draw.line([(0, y), (w, y)], fill=color)
    for _ in range(rng.randint(3, 8)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = [x0, y0, x0 + rng.randint(1, max(1, w // 2)), y0 + rng.randint(1, max(1, h // 2))]
        color = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    return img


def _load_folder(folder: str, count: int) -> list[Image.Image]:
    paths = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
    if not paths:
        raise ValueError(f"no images ({', '.join(_IMAGE_SUFFIXES)}) in {folder!r}.")
    return [Image.open(paths[i % len(paths)]).convert("RGB") for i in range(count)]


def _text(rng: random.Random, num_tokens: int, tokenizer: Any | None) -> str:
    """Random words; cut to exactly ``num_tokens`` tokens when a tokenizer is given."""
    text = " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
    if tokenizer is None:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
    return tokenizer.decode(ids).strip()


def build_workload(config: WorkloadConfig, tokenizer: Any | None = None) -> Workload:
    """The requests of ``config``; with the model's ``tokenizer``, text lengths are in tokens
    (otherwise in words)."""
    rng = random.Random(config.seed)
    slots = config.num_image_slots
    pool_size = min(slots, config.unique_images or slots)
    if config.image_dir is not None:
        pool = _load_folder(config.image_dir, pool_size)
    else:
        sizes = config.image_sizes
        pool = [synthesize_image(rng, sizes[i % len(sizes)]) for i in range(pool_size)]
    # Every pool image is used as evenly as possible; the order is shuffled so that repeats come
    # at varied distances, as in multi-turn chat traffic.
    assignment = [i % pool_size for i in range(slots)] if pool_size else []
    rng.shuffle(assignment)
    system = _text(rng, config.shared_prefix_len, tokenizer) if config.shared_prefix_len else ""
    requests = []
    for n in range(config.num_prompts):
        ids = assignment[n * config.images_per_prompt:(n + 1) * config.images_per_prompt]
        content: list[dict[str, Any]] = [{"type": "image"} for _ in ids]
        content.append({"type": "text", "text": _text(rng, config.prompt_len, tokenizer)})
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": content})
        requests.append(BenchRequest(messages, [pool[i] for i in ids], ids,
                                     rng.randint(*config.output_len)))
    return Workload(config, requests, pool)


# ----------------------------------------------------------------- command line
def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"image size must be WxH, e.g. 256x200, got {text!r}") from None
    return w, h


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``WxH[,WxH...]`` or a preset name (`IMAGE_SIZE_PRESETS`)."""
    if text.strip().lower() in IMAGE_SIZE_PRESETS:
        return IMAGE_SIZE_PRESETS[text.strip().lower()]
    return tuple(parse_size(part) for part in text.split(","))


def format_sizes(sizes: tuple[tuple[int, int], ...]) -> str:
    """The inverse of `parse_sizes`: a preset's name, or the sizes as ``WxH,WxH``."""
    for name, preset in IMAGE_SIZE_PRESETS.items():
        if sizes == preset:
            return name
    return _join_sizes(sizes)


def _join_sizes(sizes: tuple[tuple[int, int], ...]) -> str:
    return ",".join(f"{w}x{h}" for w, h in sizes)


def parse_range(text: str) -> tuple[int, int]:
    try:
        parts = [int(v) for v in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"output length must be A or A:B, got {text!r}")
    return parts[0], parts[-1]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every bench subcommand."""
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--image-sizes", "--image-size", dest="image_sizes", type=parse_sizes,
                   default=((256, 200),), metavar="WxH[,WxH...]|mixed",
                   help="size of the drawn images, or several that the images take in turn; "
                   "'mixed' is " + _join_sizes(IMAGE_SIZE_PRESETS["mixed"])
                   + " (small, medium, large, wide; default: 256x200)")
    g.add_argument("--unique-images", type=int, metavar="K",
                   help="distinct images; requests reuse them beyond K (default: all distinct)")
    g.add_argument("--images-per-prompt", type=int, default=1)
    g.add_argument("--output-len", type=parse_range, default=(64, 64), metavar="A|A:B",
                   help="output tokens, fixed or drawn from [A, B] (EOS is ignored)")
    g.add_argument("--shared-prefix-len", type=int, default=0, metavar="T",
                   help="tokens of a system prompt shared by every request")
    g.add_argument("--prompt-len", type=int, default=24, help="tokens of each request's question")
    g.add_argument("--image-dir", help="read images from this folder instead of drawing them")
    g.add_argument("--json", dest="json_path", metavar="PATH", help="write the results here")


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """The workload of the command line; ``--seed`` (an engine flag) seeds it too."""
    return WorkloadConfig(
        num_prompts=args.num_prompts, image_sizes=args.image_sizes,
        unique_images=args.unique_images, images_per_prompt=args.images_per_prompt,
        output_len=args.output_len, shared_prefix_len=args.shared_prefix_len,
        prompt_len=args.prompt_len, image_dir=args.image_dir, seed=args.seed)
