"""The bundled demo model: scene generator, accuracy on unseen scenes, parity, default model.

The accuracy test is the demo's promise: on 200 freshly generated scenes (a seed used neither by
training nor by its evaluation), mmserve serving the bundled checkpoint gives the exact reference
caption, colour answer and count answer for at least 90% of them. Parity with transformers is
checked on every one of those prompts; the engine runs them all as one batch, so batching,
prefix caching and encoder caching are all exercised against the unbatched reference.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.demo import checkpoint
from mmserve.demo.checkpoint import demo_model_path
from mmserve.demo.recipe import CHAT_TEMPLATE, user_turn
from mmserve.demo.scenes import (
    CAPTION_PROMPTS,
    CELLS,
    COLOUR_QUESTIONS,
    COLOURS,
    COUNT_QUESTIONS,
    WHERE_QUESTIONS,
    Scene,
    Shape,
    generate_scenes,
    random_scene,
)
from mmserve.entrypoints.cli import main as cli_main
from mmserve.testing.oracle import hf_greedy_generate
from tests.conftest import assert_no_leaks

TEST_SEED = 20_261_122  # training uses seed 0, its held-out evaluation 7_000_000
NUM_SCENES = 200
BAR = 0.90
SAMPLES = Path(__file__).resolve().parents[1] / "samples"


# ------------------------------------------------------------------ scene generator (no model)
def test_scenes_are_seeded_and_vary() -> None:
    first, again, other = (generate_scenes(50, seed) for seed in (1, 1, 2))
    assert first == again
    assert first != other
    assert {len(s.shapes) for s in first} == {1, 2, 3}
    assert len({s.caption() for s in first}) > 40


def test_caption_and_answers_follow_the_scene() -> None:
    shade = COLOURS["red"]
    scene = Scene(shapes=(
        Shape("circle", "red", "top left", 0.5, 0.5, 0.5, shade),
        Shape("square", "blue", "top right", 0.5, 0.5, 0.5, COLOURS["blue"]),
        Shape("triangle", "yellow", "bottom right", 0.5, 0.5, 0.5, COLOURS["yellow"]),
    ), background=(250, 250, 250))
    assert scene.caption() == ("a red circle at the top left, a blue square at the top right "
                               "and a yellow triangle at the bottom right")
    assert scene.count_answer() == "three"
    assert scene.colour_answer("square") == "blue"
    assert scene.where_answer("triangle") == "at the bottom right"
    solo = Scene(shapes=(scene.shapes[1],), background=(250, 250, 250))
    assert solo.caption() == "a blue square at the top right"
    assert solo.colour_answer("circle") == "there is no circle"


def test_render_draws_each_shape_in_its_cell() -> None:
    for scene in generate_scenes(30, seed=5):
        image = scene.render(64)
        for cell, (col, row) in CELLS.items():
            crop = image.crop((col * 32, row * 32, col * 32 + 32, row * 32 + 32))
            colours = {c for _, c in crop.getcolors(32 * 32)}
            shape = next((s for s in scene.shapes if s.cell == cell), None)
            if shape is None:
                assert colours == {scene.background}
            else:
                assert shape.shade in colours


def test_scene_rejects_ambiguous_layouts() -> None:
    shape = Shape("circle", "red", "top left", 0.5, 0.5, 0.5, COLOURS["red"])
    with pytest.raises(ValueError, match="different kinds"):
        Scene(shapes=(shape, Shape("circle", "red", "top right", 0.5, 0.5, 0.5, (0, 0, 0))),
              background=(255, 255, 255))
    with pytest.raises(ValueError, match="kind must be one of"):
        Shape("star", "red", "top left", 0.5, 0.5, 0.5, (0, 0, 0))


def test_no_model_and_no_demo_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "DEMO_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="pass the path"):
        checkpoint.demo_model_path()
    with pytest.raises(FileNotFoundError, match="pass the path"):
        LLM()


# ------------------------------------------------------------------------- the trained model
@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    # No model: LLM() must pick the bundled demo checkpoint.
    return LLM(dtype="float32")


def _test_prompts() -> list[tuple[str, int, str, str]]:
    """(task, scene index, question, reference answer) for every scene and task."""
    rng = random.Random(TEST_SEED)
    items = []
    for i, scene in enumerate(generate_scenes(NUM_SCENES, TEST_SEED)):
        kind = rng.choice(scene.shapes).kind
        items += [
            ("caption", i, CAPTION_PROMPTS[0], scene.caption()),
            ("count", i, COUNT_QUESTIONS[0], scene.count_answer()),
            ("colour", i, COLOUR_QUESTIONS[0].format(kind=kind), scene.colour_answer(kind)),
            ("where", i, WHERE_QUESTIONS[0].format(kind=kind), scene.where_answer(kind)),
        ]
    return items


def test_checkpoint_is_the_demo_format() -> None:
    path = demo_model_path()
    assert (path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 20 * 2**20, f"the demo checkpoint is {size / 2**20:.1f} MiB"


@pytest.fixture(scope="module")
def unseen(demo_llm: LLM) -> tuple[list[Image.Image], list[tuple[str, int, str, str]], list]:
    """All test prompts on the unseen scenes, run through mmserve as one batch."""
    images = [scene.render() for scene in generate_scenes(NUM_SCENES, TEST_SEED)]
    items = _test_prompts()
    prompts = [{"messages": user_turn(question), "images": [images[i]]}
               for _, i, question, _ in items]
    outputs = demo_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    return images, items, outputs


def test_demo_model_sees_unseen_scenes(demo_llm: LLM, unseen) -> None:
    _, items, outputs = unseen
    accuracy = {}
    for task in ("caption", "count", "colour", "where"):
        hits = [out.text == answer for (t, _, _, answer), out in zip(items, outputs, strict=True)
                if t == task]
        accuracy[task] = sum(hits) / len(hits)
    print("\ndemo model exact-match accuracy on", NUM_SCENES, "unseen scenes:",
          "  ".join(f"{task} {acc:.1%}" for task, acc in accuracy.items()))
    assert_no_leaks(demo_llm.engine)
    for task in ("caption", "count", "colour"):
        assert accuracy[task] >= BAR, f"{task} accuracy {accuracy[task]:.1%} is under {BAR:.0%}"


@pytest.mark.slow
def test_demo_model_matches_transformers(demo_llm: LLM, unseen) -> None:
    """The same greedy tokens as transformers, one unbatched request at a time."""
    images, items, outputs = unseen
    processor = demo_llm.engine.processor.processor
    path = demo_model_path()
    checked = 0
    for (_, i, question, _), out in zip(items, outputs, strict=True):
        text = processor.apply_chat_template(user_turn(question), add_generation_prompt=True,
                                             tokenize=False)
        assert out.token_ids == hf_greedy_generate(path, text, [images[i]], 40), question
        checked += 1
    assert checked == 4 * NUM_SCENES


def test_caption_cli_uses_the_demo_model(capsys) -> None:
    manifest = json.loads((SAMPLES / "scenes.json").read_text())
    paths = sorted(SAMPLES / name for name in manifest)
    assert len(paths) >= 12
    # README's first command, with the default dtype (bfloat16 where the CPU has it).
    assert cli_main(["caption", *map(str, paths), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [entry["image"] for entry in printed] == [str(p) for p in paths]
    assert [entry["caption"] for entry in printed] == [
        manifest[p.name]["caption"] for p in paths]


def test_demo_answers_the_sample_questions(demo_llm: LLM) -> None:
    """Every question of scenes.json on every sample, absent shapes ("there is no ...") too."""
    manifest = json.loads((SAMPLES / "scenes.json").read_text())
    asked = [(name, question, answer) for name, entry in manifest.items()
             for question, answer in entry["questions"].items()]
    images = {name: Image.open(SAMPLES / name) for name in manifest}
    outs = demo_llm.generate(
        [{"messages": user_turn(q), "images": [images[name]]} for name, q, _ in asked],
        SamplingParams(max_tokens=16, temperature=0.0))
    wrong = [(name, q, out.text) for (name, q, a), out in zip(asked, outs, strict=True)
             if out.text != a]
    print(f"\nsample questions: {len(asked) - len(wrong)}/{len(asked)} right")
    assert len(wrong) <= (1 - BAR) * len(asked), wrong


def test_random_scene_respects_num_shapes() -> None:
    rng = random.Random(3)
    assert all(len(random_scene(rng, num_shapes=n).shapes) == n for n in (1, 2, 3, 3, 2, 1))
