"""Synthetic scenes for the demo model: coloured shapes on a plain background.

A scene holds one to three shapes, each of a different kind (circle, square, triangle), in the
cells of a 2x2 grid (top left, top right, bottom left, bottom right). Colours may repeat. Sizes,
positions inside the cell and the background tint vary; none of them is named by the text, so the
model has to look at the picture to say which shape sits where.

Every scene knows its reference texts:

- a caption that lists the shapes in reading order (top row first, left to right), e.g.
  ``"a red circle at the top left and a blue square at the bottom right"``;
- answers to the questions ``"How many shapes are there?"`` (``"two"``),
  ``"What colour is the circle?"`` (``"red"``, or ``"there is no circle"``) and
  ``"Where is the square?"`` (``"at the top left"``, or ``"there is no square"``).

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
# Reading order: top row first, left to right. (column, row) of each cell in the 2x2 grid.
CELLS: dict[str, tuple[int, int]] = {
    "top left": (0, 0),
    "top right": (1, 0),
    "bottom left": (0, 1),
    "bottom right": (1, 1),
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

# Shape size as a fraction of the cell's side, and the colour jitter per channel. The jitter keeps
# the model from keying on exact pixel values while every colour stays far from the others.
_MIN_SIZE, _MAX_SIZE = 0.45, 0.85
_COLOUR_JITTER = 20
_DEFAULT_SIZE = 128


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, colour name, grid cell, and where and how big it is drawn.

    ``size`` is the side of the shape's bounding square as a fraction of the cell's side;
    ``dx`` and ``dy`` place that square inside the cell as a fraction of the free room (0 at the
    left/top edge, 1 at the right/bottom edge).
    """

    kind: str
    colour: str
    cell: str
    size: float
    dx: float
    dy: float
    shade: tuple[int, int, int]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.colour not in COLOURS:
            raise ValueError(f"colour must be one of {tuple(COLOURS)}, got {self.colour!r}")
        if self.cell not in CELLS:
            raise ValueError(f"cell must be one of {tuple(CELLS)}, got {self.cell!r}")
        if not 0.0 < self.size <= 1.0 or not (0.0 <= self.dx <= 1.0 and 0.0 <= self.dy <= 1.0):
            raise ValueError("size must be in (0, 1] and dx, dy in [0, 1]")

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.kind} at the {self.cell}"


@dataclass(frozen=True)
class Scene:
    """One to three shapes of different kinds in different cells, on a plain background."""

    shapes: tuple[Shape, ...]
    background: tuple[int, int, int]

    def __post_init__(self) -> None:
        if not 1 <= len(self.shapes) <= 3:
            raise ValueError(f"a scene has 1 to 3 shapes, got {len(self.shapes)}")
        if len({s.kind for s in self.shapes}) != len(self.shapes):
            raise ValueError("the shapes of a scene must be of different kinds")
        if len({s.cell for s in self.shapes}) != len(self.shapes):
            raise ValueError("the shapes of a scene must sit in different cells")
        order = [list(CELLS).index(s.cell) for s in self.shapes]
        if order != sorted(order):
            raise ValueError("shapes must be listed in reading order of their cells")

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
        return f"at the {shape.cell}" if shape else f"there is no {kind}"

    def qa_pairs(self) -> list[tuple[str, str]]:
        """Every question (first phrasing of each) with its reference answer."""
        pairs = [(COUNT_QUESTIONS[0], self.count_answer())]
        for kind in KINDS:
            pairs.append((COLOUR_QUESTIONS[0].format(kind=kind), self.colour_answer(kind)))
            pairs.append((WHERE_QUESTIONS[0].format(kind=kind), self.where_answer(kind)))
        return pairs

    # ---------------------------------------------------------------- pixels
    def render(self, size: int = _DEFAULT_SIZE) -> Image.Image:
        """Draw the scene as a ``size`` x ``size`` RGB image."""
        image = Image.new("RGB", (size, size), self.background)
        draw = ImageDraw.Draw(image)
        cell = size / 2
        for shape in self.shapes:
            col, row = CELLS[shape.cell]
            side = shape.size * cell
            x0 = col * cell + shape.dx * (cell - side)
            y0 = row * cell + shape.dy * (cell - side)
            box = (x0, y0, x0 + side, y0 + side)
            if shape.kind == "circle":
                draw.ellipse(box, fill=shape.shade)
            elif shape.kind == "square":
                # Squares are drawn a little smaller than their box so that their area is close
                # to a circle's of the same size: the kind must be told by outline, not by mass.
                inset = side * 0.08
                draw.rectangle((x0 + inset, y0 + inset, x0 + side - inset, y0 + side - inset),
                               fill=shape.shade)
            else:
                draw.polygon([(x0 + side / 2, y0), (x0 + side, y0 + side), (x0, y0 + side)],
                             fill=shape.shade)
        return image


def random_scene(rng: random.Random, num_shapes: int | None = None) -> Scene:
    """A random scene drawn from ``rng`` (1 to 3 shapes, uniformly, unless given)."""
    n = num_shapes if num_shapes is not None else rng.randint(1, 3)
    kinds = rng.sample(KINDS, n)
    cells = sorted(rng.sample(list(CELLS), n), key=list(CELLS).index)
    shapes = []
    for kind, cell in zip(kinds, cells, strict=True):
        colour = rng.choice(list(COLOURS))
        shade = tuple(
            min(255, max(0, c + rng.randint(-_COLOUR_JITTER, _COLOUR_JITTER)))
            for c in COLOURS[colour])
        shapes.append(Shape(kind=kind, colour=colour, cell=cell,
                            size=rng.uniform(_MIN_SIZE, _MAX_SIZE),
                            dx=rng.random(), dy=rng.random(), shade=shade))
    grey = rng.randint(225, 255)
    background = tuple(min(255, grey + rng.randint(-6, 6)) for _ in range(3))
    return Scene(shapes=tuple(shapes), background=background)


def generate_scenes(count: int, seed: int) -> list[Scene]:
    """``count`` scenes from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    return [random_scene(rng) for _ in range(count)]


def write_samples(directory: str | Path, count: int = 12, seed: int = 2039) -> dict[str, Any]:
    """Render ``count`` scenes (1, 2 and 3 shapes in turn) as ``scene_NN.png`` in ``directory``.

    Writes ``scenes.json`` beside them: for each file its reference caption and answers, which
    ``mmserve caption`` and the tests compare against, and ``chat_request.json``, a request
    body for the server's chat endpoint showing the third scene. Returns the mapping.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    manifest: dict[str, Any] = {}
    for i in range(count):
        scene = random_scene(rng, num_shapes=i % 3 + 1)
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
