"""Synthetic scenes for the demo model: coloured shapes on a plain background.

A scene holds one to three shapes, each of a different kind (circle, square, triangle), anywhere
in the picture. Colours may repeat. Each shape is drawn inside a square bounding box whose side
(``size``, a fraction of the image side) and centre (``x``, ``y``, fractions of the image side
from the left and top edges) are continuous: sizes range from `MIN_SIZE` to `MAX_SIZE`, boxes
stay inside the image but may touch its border, and the boxes of two shapes keep at least
`MIN_GAP` between them (they never overlap, so every shape stays recognisable). A share
(`CENTRED_SHARE`) of the scenes is a single shape in the middle of the picture. The background
tint and each shape's shade vary a little; none of that is named by the text.

Position words: the rule
------------------------
A shape's position is read from the centre of its bounding box on a 3x3 grid of equal thirds.
Its column is ``left`` when ``x < 1/3``, ``right`` when ``x >= 2/3`` and the middle otherwise;
its row is ``top`` when ``y < 1/3``, ``bottom`` when ``y >= 2/3`` and the middle otherwise. The
nine (column, row) readings are phrased (`POSITIONS`)::

    at the top left     at the top      at the top right
    on the left         in the centre   on the right
    at the bottom left  at the bottom   at the bottom right

Two shapes may share a reading (say, both "on the left"); the text is still right. Captions list
the shapes in reading order: by row of their reading (top first), then by column (left first),
then, within one reading, by ``y`` and then ``x``.

Every scene knows its reference texts:

- a caption, e.g. ``"a red circle at the top left and a blue square in the centre"``;
- answers to the questions ``"How many shapes are there?"`` (``"two"``),
  ``"What colour is the circle?"`` (``"red"``, or ``"there is no circle"``) and
  ``"Where is the square?"`` (``"in the centre"``, or ``"there is no square"``).

Generation is seeded (`generate_scenes`), so a training run and an evaluation that use
different seeds see different scenes, and the same seed always gives the same pictures.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

KINDS: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (235, 200, 30),
}
# (column, row) of each reading of the 3x3 grid -> its phrase, in reading order.
POSITIONS: dict[tuple[int, int], str] = {
    (0, 0): "at the top left",
    (1, 0): "at the top",
    (2, 0): "at the top right",
    (0, 1): "on the left",
    (1, 1): "in the centre",
    (2, 1): "on the right",
    (0, 2): "at the bottom left",
    (1, 2): "at the bottom",
    (2, 2): "at the bottom right",
}
NUMBERS = ("zero", "one", "two", "three")

# Prompts the model is trained on. The first of each list is the one the tests and the CLI use.
CAPTION_PROMPTS: tuple[str, ...] = (
    "Describe this image.",
    "What is in this picture?",
    "Caption this image.",
)
COUNT_QUESTIONS: tuple[str, ...] = ("How many shapes are there?", "How many shapes?")
COLOUR_QUESTIONS: tuple[str, ...] = ("What colour is the {kind}?", "What color is the {kind}?")
WHERE_QUESTIONS: tuple[str, ...] = ("Where is the {kind}?",)

# Side of a shape's bounding box as a fraction of the image side: the range, and the largest
# for scenes of 1, 2 and 3 shapes (several large shapes would rarely fit).
MIN_SIZE, MAX_SIZE = 0.16, 0.7
_MAX_SIZE_FOR = {1: MAX_SIZE, 2: 0.5, 3: 0.42}
# Least room between the bounding boxes of two shapes (fraction of the image side), along x or y.
MIN_GAP = 0.02
# Share of scenes that are one shape in the middle (centre within _CENTRED_JITTER of it).
CENTRED_SHARE = 0.15
_CENTRED_JITTER = 0.06
# Colour jitter per channel: keeps the model from keying on exact pixel values while every
# colour stays far from the others.
_COLOUR_JITTER = 20
_DEFAULT_SIZE = 128
_EPS = 1e-9


def position_of(x: float, y: float) -> tuple[int, int]:
    """(column, row) of the 3x3 reading of a centre at ``x``, ``y`` (see the module docstring)."""
    return min(2, max(0, int(x * 3))), min(2, max(0, int(y * 3)))


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, colour name, bounding box (centre ``x``, ``y`` and side ``size``,
    fractions of the image side) and the exact shade it is drawn in."""

    kind: str
    colour: str
    x: float
    y: float
    size: float
    shade: tuple[int, int, int]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.colour not in COLOURS:
            raise ValueError(f"colour must be one of {tuple(COLOURS)}, got {self.colour!r}")
        if not 0.0 < self.size <= 1.0:
            raise ValueError(f"size must be in (0, 1], got {self.size}")
        low, high = self.size / 2 - _EPS, 1 - self.size / 2 + _EPS
        if not (low <= self.x <= high and low <= self.y <= high):
            raise ValueError("the shape's bounding box must lie inside the image")

    @property
    def grid(self) -> tuple[int, int]:
        """(column, row) of the shape's reading on the 3x3 grid."""
        return position_of(self.x, self.y)

    @property
    def position(self) -> str:
        """The position phrase, e.g. ``"at the top left"`` or ``"in the centre"``."""
        return POSITIONS[self.grid]

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.kind} {self.position}"

    def box(self, size: int) -> tuple[float, float, float, float]:
        """The bounding box in pixels of a ``size`` x ``size`` image."""
        half = self.size * size / 2
        return (self.x * size - half, self.y * size - half,
                self.x * size + half, self.y * size + half)

    def apart(self, other: Shape, gap: float = MIN_GAP) -> bool:
        """Whether the two bounding boxes are at least ``gap`` apart along x or y."""
        reach = (self.size + other.size) / 2 + gap - _EPS
        return abs(self.x - other.x) >= reach or abs(self.y - other.y) >= reach


def reading_key(shape: Shape) -> tuple[int, int, float, float]:
    col, row = shape.grid
    return row, col, shape.y, shape.x


@dataclass(frozen=True)
class Scene:
    """One to three shapes of different kinds, apart from each other, on a plain background."""

    shapes: tuple[Shape, ...]
    background: tuple[int, int, int]

    def __post_init__(self) -> None:
        if not 1 <= len(self.shapes) <= 3:
            raise ValueError(f"a scene has 1 to 3 shapes, got {len(self.shapes)}")
        if len({s.kind for s in self.shapes}) != len(self.shapes):
            raise ValueError("the shapes of a scene must be of different kinds")
        for i, a in enumerate(self.shapes):
            for b in self.shapes[i + 1:]:
                if not a.apart(b):
                    raise ValueError("the shapes of a scene must not overlap")
        if list(self.shapes) != sorted(self.shapes, key=reading_key):
            raise ValueError("shapes must be listed in reading order")

    # ------------------------------------------------------------------ texts
    def caption(self) -> str:
        """The reference caption, shapes in reading order."""
        phrases = [s.phrase for s in self.shapes]
        if len(phrases) == 1:
            return phrases[0]
        return ", ".join(phrases[:-1]) + " and " + phrases[-1]

    def count_answer(self) -> str:
        return NUMBERS[len(self.shapes)]

    def find(self, kind: str) -> Shape | None:
        return next((s for s in self.shapes if s.kind == kind), None)

    def colour_answer(self, kind: str) -> str:
        shape = self.find(kind)
        return shape.colour if shape else f"there is no {kind}"

    def where_answer(self, kind: str) -> str:
        shape = self.find(kind)
        return shape.position if shape else f"there is no {kind}"

    def qa_pairs(self) -> list[tuple[str, str]]:
        """Every question (first phrasing of each) with its reference answer."""
        pairs = [(COUNT_QUESTIONS[0], self.count_answer())]
        for kind in KINDS:
            pairs.append((COLOUR_QUESTIONS[0].format(kind=kind), self.colour_answer(kind)))
            pairs.append((WHERE_QUESTIONS[0].format(kind=kind), self.where_answer(kind)))
        return pairs

    # ---------------------------------------------------------------- pixels
    def _draw(self, draw: ImageDraw.ImageDraw, size: int, fills: list[Any]) -> None:
        for shape, fill in zip(self.shapes, fills, strict=True):
            x0, y0, x1, y1 = shape.box(size)
            side = x1 - x0
            if shape.kind == "circle":
                draw.ellipse((x0, y0, x1, y1), fill=fill)
            elif shape.kind == "square":
                # Squares are drawn a little smaller than their box so that their area is close
                # to a circle's of the same size: the kind must be told by outline, not by mass.
                inset = side * 0.08
                draw.rectangle((x0 + inset, y0 + inset, x1 - inset, y1 - inset), fill=fill)
            else:
                draw.polygon([(x0 + side / 2, y0), (x1, y1), (x0, y1)], fill=fill)

    def render(self, size: int = _DEFAULT_SIZE) -> Image.Image:
        """Draw the scene as a ``size`` x ``size`` RGB image."""
        image = Image.new("RGB", (size, size), self.background)
        self._draw(ImageDraw.Draw(image), size, [s.shade for s in self.shapes])
        return image

    def label_map(self, size: int = _DEFAULT_SIZE) -> Image.Image:
        """A ``size`` x ``size`` "L" image: 0 for background, ``i + 1`` where shape ``i`` is."""
        image = Image.new("L", (size, size), 0)
        self._draw(ImageDraw.Draw(image), size, list(range(1, len(self.shapes) + 1)))
        return image


def _shade(rng: random.Random, colour: str) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-_COLOUR_JITTER, _COLOUR_JITTER)))
                 for c in COLOURS[colour])


def random_scene(rng: random.Random, num_shapes: int | None = None,
                 centred: bool | None = None) -> Scene:
    """A random scene drawn from ``rng``.

    Unless given, a share `CENTRED_SHARE` of scenes is one centred shape (``centred``) and the
    others have 1 to 3 shapes, uniformly, of sizes and positions drawn anywhere they fit.
    """
    if centred is None:
        centred = num_shapes in (None, 1) and rng.random() < CENTRED_SHARE
    if centred:
        size = rng.uniform(MIN_SIZE, MAX_SIZE)
        kind, colour = rng.choice(KINDS), rng.choice(list(COLOURS))
        x, y = (0.5 + rng.uniform(-_CENTRED_JITTER, _CENTRED_JITTER) for _ in range(2))
        shapes = [Shape(kind, colour, x, y, size, _shade(rng, colour))]
    else:
        n = num_shapes if num_shapes is not None else rng.randint(1, 3)
        shapes = []
        for kind in rng.sample(KINDS, n):
            colour = rng.choice(list(COLOURS))
            top = _MAX_SIZE_FOR[n]
            while True:  # shrink until it fits somewhere among the shapes already placed
                for _ in range(30):
                    size = rng.uniform(MIN_SIZE, top)
                    x = rng.uniform(size / 2, 1 - size / 2)
                    y = rng.uniform(size / 2, 1 - size / 2)
                    shape = Shape(kind, colour, x, y, size, _shade(rng, colour))
                    if all(shape.apart(other) for other in shapes):
                        break
                else:
                    top = max(MIN_SIZE, top * 0.85)
                    continue
                break
            shapes.append(shape)
    grey = rng.randint(225, 255)
    background = tuple(min(255, grey + rng.randint(-6, 6)) for _ in range(3))
    return Scene(shapes=tuple(sorted(shapes, key=reading_key)), background=background)


def generate_scenes(count: int, seed: int) -> list[Scene]:
    """``count`` scenes from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    return [random_scene(rng) for _ in range(count)]


def write_samples(directory: str | Path, count: int = 12, seed: int = 2039) -> dict[str, Any]:
    """Render ``count`` scenes (1, 2 and 3 shapes in turn) as ``scene_NN.png`` in ``directory``.

    The first is a single centred shape; the second always shows a circle (the chat page's
    browser test asks about its colour). Writes ``scenes.json`` beside them: for each file its
    reference caption and answers, which ``mmserve caption`` and the tests compare against, and
    ``chat_request.json``, a request body for the server's chat endpoint showing the third scene.
    Returns the mapping.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    manifest: dict[str, Any] = {}
    for i in range(count):
        scene = random_scene(rng, num_shapes=i % 3 + 1, centred=i == 0)
        while i == 1 and scene.find("circle") is None:
            scene = random_scene(rng, num_shapes=2, centred=False)
        name = f"scene_{i + 1:02d}.png"
        scene.render().save(out / name)
        manifest[name] = {"caption": scene.caption(), "questions": dict(scene.qa_pairs())}
    (out / "scenes.json").write_text(json.dumps(manifest, indent=2) + "\n")
    # A chat completion request body for curl: the third scene inline, as a data URL.
    first = sorted(manifest)[2]
    url = "data:image/png;base64," + base64.b64encode((out / first).read_bytes()).decode()
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": CAPTION_PROMPTS[0]}]}], "max_tokens": 32, "temperature": 0}
    (out / "chat_request.json").write_text(json.dumps(body, indent=2) + "\n")
    return manifest


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Render sample scenes and their reference texts.")
    parser.add_argument("directory")
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--seed", type=int, default=2039)
    args = parser.parse_args()
    for name, entry in write_samples(args.directory, args.count, args.seed).items():
        print(f"{name}: {entry['caption']}")
