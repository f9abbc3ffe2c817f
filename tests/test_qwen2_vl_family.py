"""Qwen2-VL's processing rules: token counts by the resize rule, an exact largest item, the
pixel bounds that settings and a declared image size put in force, and M-RoPE positions as
transformers computes them."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers import AutoConfig

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidInputError
from mmserve.inputs import ImageInput
from mmserve.processing.processor import InputProcessor
from mmserve.processing.registry import family_for
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor
from tests.conftest import assert_no_leaks, make_image, record_steps

# Pixel settings where the largest item comes from each branch of the resize rule: kept as
# resized, a 200:1 image keeping a row of whole tokens, small images rounded up to min_pixels.
SETTINGS = [{}, {"max_pixels": 28 * 28 * 12}, {"max_pixels": 28 * 28 * 1280},
            {"min_pixels": 28 * 28 * 16, "max_pixels": 28 * 28 * 16},
            {"min_pixels": 28 * 28 * 30, "max_pixels": 28 * 28 * 33}, {"max_pixels": 3136}]


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl")))


def _family(path: str, kwargs: dict | None = None, max_image_size=None):
    return family_for(path, AutoConfig.from_pretrained(path), kwargs, max_image_size)


def _random_sizes(seed: int, count: int) -> list[tuple[int, int]]:
    """Sizes from 1 pixel to 10^8, at aspect ratios up to the 200:1 transformers allows."""
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < count:
        area, ratio = 10 ** rng.uniform(0, 8), 200 ** rng.uniform(-1, 1)
        w, h = max(1, int((area * ratio) ** 0.5)), max(1, int((area / ratio) ** 0.5))
        if max(w, h) <= 200 * min(w, h):
            sizes.append((w, h))
    return sizes


@pytest.mark.parametrize("kwargs", SETTINGS, ids=str)
def test_no_image_becomes_more_than_max_tokens_per_item(qwen2_vl: str, kwargs: dict) -> None:
    family = _family(qwen2_vl, kwargs)
    largest = family.max_tokens_per_item
    counts = [family.num_image_tokens(w, h) for w, h in _random_sizes(len(str(kwargs)), 30000)]
    assert max(counts) <= largest
    # Exact, not a bound: the profile run's dummy image becomes that many tokens.
    assert family.num_image_tokens(*family.dummy_image().size) == largest
    assert family.encoder_input(family.dummy_image())["image_grid_thw"].prod() == 4 * largest
    # The profile run encodes that item, zeros of its shape, made without resizing an image.
    dummy = family.dummy_encoder_input()
    assert dummy["image_grid_thw"].prod() == 4 * largest and not torch.any(dummy["pixel_values"])


def test_token_counts_are_what_the_processor_makes(qwen2_vl: str) -> None:
    family = _family(qwen2_vl)
    for k, size in enumerate([(1, 1), (40, 30), (23, 57), (200, 90), (1000, 5), (300, 260)]):
        image = make_image(k, size)
        grid = family.encoder_input(image)["image_grid_thw"]
        assert int(grid.prod()) // 4 == family.num_image_tokens(*size), size


def test_declared_image_size_bounds_the_processor(qwen2_vl: str) -> None:
    """--limit-mm-per-prompt's width and height: the declared image is processed as before,
    larger ones are scaled down to its area, and the budget shrinks to match."""
    free = _family(qwen2_vl)
    bounded = _family(qwen2_vl, max_image_size=(100, 100))
    assert bounded.max_pixels == 112 * 112  # what 100 x 100 resizes to
    assert bounded.num_image_tokens(100, 100) == free.num_image_tokens(100, 100) == 16
    assert bounded.num_image_tokens(300, 260) <= 16 < free.num_image_tokens(300, 260)
    assert bounded.max_tokens_per_item < free.max_tokens_per_item
    image = make_image(3, (300, 260))
    assert bounded.encoder_input(image)["image_grid_thw"].prod() // 4 == \
        bounded.num_image_tokens(300, 260)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"patch_size": 16}, "vision tower was built for 14"),
    ({"merge_size": 1}, "vision tower was built for 2"),
    ({"do_resize": False}, "do_resize=False"),
    ({"min_pixels": 10000, "max_pixels": 5000}, "more than max_pixels"),
    ({"min_pixels": 50, "max_pixels": 100}, "at least 784"),
    ({"max_pixelz": 100}, "takes no 'max_pixelz'"),
])
def test_settings_the_model_cannot_take_are_refused(qwen2_vl: str, kwargs: dict,
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _family(qwen2_vl, kwargs)


def test_positions_equal_transformers_rope_index(qwen2_vl: str) -> None:
    """Text, images of different shapes, adjacent images: positions and decode offset."""
    family = _family(qwen2_vl)
    processor = load_hf_processor(qwen2_vl)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    cases = [("just text", []), (f"{image}what is it?", [(200, 90)]),
             (f"a{image}b{image}{image}c", [(40, 30), (90, 180), (300, 260)])]
    for text, sizes in cases:
        images = [make_image(k, size) for k, size in enumerate(sizes)]
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        want, delta = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"))
        ids = inputs["input_ids"][0].tolist()
        spans = [i for i, t in enumerate(ids) if t == family.image_token_id]
        ours, first = [], 0
        for img in images:
            item = family.encoder_input(img)
            n = int(item["image_grid_thw"].prod()) // 4
            ours.append(ImageInput("h", spans[first], n, item))
            first += n
        positions, offset = family.prompt_positions(ids, ours)
        assert positions.tolist() == want[:, 0].tolist(), text
        assert offset == int(delta), text


def test_two_largest_images_in_a_small_step_budget(qwen2_vl: str) -> None:
    """Seed 001 with items of different sizes: two images each larger than a step's token
    budget in one prompt, beside a small one. Encoded once each, sliced over steps; no step
    schedules zero tokens; the output is transformers'."""
    llm = LLM(qwen2_vl, dtype="float32", max_num_batched_tokens=16, max_num_seqs=2)
    images = [make_image(1, (700, 600)), make_image(2, (600, 700)), make_image(3, (30, 30))]
    messages = [{"role": "user", "content": [{"type": "image"}] * 3
                 + [{"type": "text", "text": "compare"}]}]
    steps = record_steps(llm)
    out = llm.generate([{"messages": messages, "images": images},
                        {"messages": messages[:1], "images": images}],
                       SamplingParams(max_tokens=6, temperature=0.0))
    assert_no_leaks(llm.engine)
    lengths = [im.length for im in llm.engine.processor.process(
        {"messages": messages, "images": images}).images]
    assert lengths[0] > 16 and lengths[1] > 16 and lengths[2] < 16
    assert all(out.num_scheduled_tokens > 0 for out in steps if out.requests)
    assert llm.stats()["encoder_items_computed"] == 3
    text = load_hf_processor(qwen2_vl).apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=False)
    want = hf_greedy_generate(qwen2_vl, text, images, 6)
    assert out[0].token_ids == want and out[1].token_ids == want


def test_profile_batch_spends_the_whole_encoder_budget(qwen2_vl: str) -> None:
    """Items of any size: after the largest items that fit, the profile run encodes one more
    that spends the rest of the step's encoder budget, as a real step could."""
    from mmserve.config import EngineConfig
    from mmserve.engine.profile_batch import profile_batch_for
    from mmserve.engine.startup import encoder_budget_for, images_per_step

    config = EngineConfig(model=qwen2_vl, dtype="float32", max_num_batched_tokens=300)
    family = _family(qwen2_vl)
    budget = encoder_budget_for(config, family.max_tokens_per_item)
    batch = profile_batch_for(config, AutoConfig.from_pretrained(qwen2_vl), family, budget,
                              images_per_step(config, budget))
    tokens = list(batch.scheduler_output.images_to_encode.values())
    assert tokens[:-1] == [family.max_tokens_per_item] * (300 // family.max_tokens_per_item)
    assert sum(tokens) == budget.compute_tokens == 300
    for h, n in batch.scheduler_output.images_to_encode.items():
        assert int(batch.encoder_pixels[h]["image_grid_thw"].prod()) == 4 * n


@pytest.mark.parametrize("kwargs, says", [
    ({"max_pixels": 10**9}, "at most max_pixels="),
    ({"min_pixels": 28 * 28 * 9, "max_pixels": 28 * 28 * 4}, "more than max_pixels"),
    ({"min_pixels": 10, "max_pixels": 10}, "at least 784"),
    ({"max_pixels": "big"}, "positive whole number"),
    ({"max_pixels": True}, "positive whole number"),
    ({"do_resize": False}, "not 'do_resize'"),
    ([1], "must be an object"),
])
def test_a_requests_settings_beyond_the_servers_are_refused(qwen2_vl: str, kwargs,
                                                            says: str) -> None:
    """A request's ``mm_processor_kwargs`` may shrink its images, never grow them past what
    the encoder budget was sized for, and only the pixel bounds are a request's."""
    processor = InputProcessor(qwen2_vl, AutoConfig.from_pretrained(qwen2_vl), 10**8,
                               {"max_pixels": 28 * 28 * 64})
    prompt = {"prompt": f"{processor.image_token} hi", "images": [make_image(0, (90, 60))],
              "mm_processor_kwargs": kwargs}
    with pytest.raises(InvalidInputError, match=says) as e:
        processor.process(prompt)
    assert e.value.param == "mm_processor_kwargs"
    # The server's own bounds, sent again, are the server's family.
    assert processor._family_for({"max_pixels": 28 * 28 * 64}) is processor.family
    small = processor._family_for({"max_pixels": 28 * 28 * 4})
    assert small.max_pixels == 28 * 28 * 4 and small.min_pixels <= small.max_pixels
    assert small is processor._family_for({"max_pixels": 28 * 28 * 4})  # (made once)
    assert processor.process({**prompt, "mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}}
                             ).images[0].length <= 4
    # A large min_pixels scales a thin image up past the server's largest: that image is
    # refused, another under the same settings is not.
    most = {"min_pixels": 28 * 28 * 64, "max_pixels": 28 * 28 * 64}
    variant = processor._family_for(most)
    thin = next(size for size in ((1, h) for h in range(20, 400, 7))
                if variant.num_image_tokens(*size) > processor.tokens_per_image)
    with pytest.raises(InvalidInputError, match="more than the") as e:
        processor.process({**prompt, "images": [make_image(1, thin)],
                           "mm_processor_kwargs": most})
    assert e.value.param == "mm_processor_kwargs"
    assert processor.process({**prompt, "mm_processor_kwargs": most}).images[0].length <= (
        processor.tokens_per_image)
