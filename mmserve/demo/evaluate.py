"""Held-out evaluation of a demo-style checkpoint on freshly rendered scenes.

    python -m mmserve.demo.evaluate --model samples/demo-model --num-scenes 200 --seed 31337

renders ``--num-scenes`` scenes of `mmserve.demo.scenes` from ``--seed`` (a seed training never
uses: training draws from seed 0's stream and checks itself on `EVAL_SEED` 7,000,000 of the
training script; the tests use 20,261,122), runs the model greedily in float32 through
``mmserve.LLM`` as one batch, and reports:

- ``caption shapes``: the share of captions that name the scene's shapes with the right colours,
  in any order: the multiset of (colour, kind) pairs named equals the scene's (`score_caption`);
- ``caption positions``: the share that also give each shape its position phrase;
- ``caption exact``: the share identical to the reference caption;
- ``count``, ``colour``, ``where``: the share of exact-right answers to "How many shapes are
  there?" and, for each of the three kinds (present or not), "What colour is the {kind}?" and
  "Where is the {kind}?" (``colour present`` and ``where present`` count only the kinds shown).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from typing import Any

from mmserve.demo.scenes import (
    CAPTION_PROMPTS,
    COLOUR_QUESTIONS,
    COLOURS,
    COUNT_QUESTIONS,
    KINDS,
    POSITIONS,
    WHERE_QUESTIONS,
    Scene,
    generate_scenes,
)

HELD_OUT_SEED = 31_337
_PHRASE = re.compile(
    r"\b(" + "|".join(COLOURS) + r") (" + "|".join(KINDS) + r")\b"
    + r"(?: (" + "|".join(sorted(POSITIONS.values(), key=len, reverse=True)) + r")\b)?")


def caption_shapes(text: str) -> list[tuple[str, str, str | None]]:
    """The (colour, kind, position phrase or None) of each shape a caption names, in order."""
    return [(m[1], m[2], m[3]) for m in _PHRASE.finditer(text)]


def score_caption(text: str, reference: Scene | str) -> tuple[bool, bool]:
    """(colours and shapes all right, positions also right) of a caption of a scene.

    ``reference`` is the scene or its reference caption. The first holds when the multiset of
    (colour, kind) pairs named equals the scene's, in any order; the second when the multiset of
    (colour, kind, position) triples does too.
    """
    named = caption_shapes(text)
    if isinstance(reference, str):
        truth = caption_shapes(reference)
    else:
        truth = [(s.colour, s.kind, s.position) for s in reference.shapes]
    shapes_right = Counter((c, k) for c, k, _ in named) == Counter((c, k) for c, k, _ in truth)
    return shapes_right, shapes_right and Counter(named) == Counter(truth)


def evaluation_prompts(scenes: list[Scene]) -> list[tuple[str, int, str, str, bool]]:
    """(task, scene index, question, reference answer, about a shown shape) for every scene."""
    items = []
    for i, scene in enumerate(scenes):
        items.append(("caption", i, CAPTION_PROMPTS[0], scene.caption(), True))
        items.append(("count", i, COUNT_QUESTIONS[0], scene.count_answer(), True))
        for kind in KINDS:
            shown = scene.find(kind) is not None
            items.append(("colour", i, COLOUR_QUESTIONS[0].format(kind=kind),
                          scene.colour_answer(kind), shown))
            items.append(("where", i, WHERE_QUESTIONS[0].format(kind=kind),
                          scene.where_answer(kind), shown))
    return items


def evaluate(llm: Any, num_scenes: int = 200, seed: int = HELD_OUT_SEED) -> dict[str, Any]:
    """Scores of ``llm`` (an ``mmserve.LLM``) on ``num_scenes`` held-out scenes of ``seed``."""
    from mmserve import SamplingParams
    from mmserve.demo.recipe import user_turn

    scenes = generate_scenes(num_scenes, seed)
    images = [scene.render() for scene in scenes]
    items = evaluation_prompts(scenes)
    outputs = llm.generate(
        [{"messages": user_turn(q), "images": [images[i]]} for _, i, q, _, _ in items],
        SamplingParams(max_tokens=48, temperature=0.0))
    hits: dict[str, list[bool]] = {}
    mistakes = []
    for (task, i, question, answer, shown), out in zip(items, outputs, strict=True):
        if task == "caption":
            shapes_right, positions_right = score_caption(out.text, scenes[i])
            hits.setdefault("caption shapes", []).append(shapes_right)
            hits.setdefault("caption positions", []).append(positions_right)
            hits.setdefault("caption exact", []).append(out.text == answer)
            if not shapes_right:
                mistakes.append({"scene": i, "question": question, "answer": out.text,
                                 "reference": answer})
            continue
        hits.setdefault(task, []).append(out.text == answer)
        if task != "count" and shown:
            hits.setdefault(f"{task} present", []).append(out.text == answer)
    scores = {name: sum(h) / len(h) for name, h in hits.items()}
    return {"num_scenes": num_scenes, "seed": seed, "scores": scores,
            "caption_mistakes": mistakes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo)")
    parser.add_argument("--num-scenes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=HELD_OUT_SEED)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)

    import torch

    from mmserve import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="float32") if args.model else LLM(dtype="float32")
    result = evaluate(llm, args.num_scenes, args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.num_scenes} held-out scenes, seed {args.seed}:")
    for name, score in result["scores"].items():
        print(f"  {name:18s} {score:6.1%}")
    for m in result["caption_mistakes"][:10]:
        print(f"  wrong: {m['answer']!r}  (reference {m['reference']!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
