"""Beside a GPU, preprocessing hands the runner resized integer pixels (uint8) and the runner
rescales and normalizes them on its device, a step's images at once, by a table of what the
image processor makes of each of the 256 values. Its output must be the processor's bit for
bit, or the processor keeps doing all of it; and an engine that works so gives the same
tokens. The runner's side is device-agnostic, so these run on the CPU by asking for it there."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.inputs import PIXEL_ARITHMETIC, encoder_input_bytes
from mmserve.processing.family import MultiModalFamily
from mmserve.processing.registry import family_for
from mmserve.testing import build_tiny_checkpoint
from tests.conftest import assert_no_leaks, generate_all_at_once, make_image

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llava": ("llava", {"vision": "clip", "text": "llama"}),
    "llava-siglip": ("llava", {"vision": "siglip", "text": "qwen2"}),
    "qwen2_vl": ("qwen2_vl", {}),
    "qwen2_5_vl": ("qwen2_5_vl", {}),
}
SIZES = [(40, 30), (64, 64), (23, 57), (200, 90), (301, 259)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("device-pixels")
    return {name: str(build_tiny_checkpoint(family, root / name, **options))
            for name, (family, options) in FAMILIES.items()}


def _family(model: str, **kwargs) -> MultiModalFamily:
    from transformers import AutoConfig

    return family_for(model, AutoConfig.from_pretrained(model, local_files_only=True),
                      kwargs or None, None)


def _noise(seed: int, size: tuple[int, int]) -> Image.Image:
    w, h = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3),
                                                                dtype=np.uint8))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_lookup_is_the_image_processor_bit_for_bit(models, name):
    family = _family(models[name])
    arithmetic = family.device_pixel_arithmetic
    assert arithmetic is not None
    for seed, size in enumerate(SIZES):
        image = _noise(seed, size)
        expected = family.encoder_input(image)
        sent = family.device_encoder_input(image, arithmetic)
        assert sent["pixel_values"].dtype == torch.uint8
        assert sent[PIXEL_ARITHMETIC] is arithmetic
        assert torch.equal(arithmetic.apply(sent["pixel_values"]), expected["pixel_values"])
        for key in expected.keys() - {"pixel_values"}:  # the image grid of Qwen2-VL
            assert torch.equal(sent[key], expected[key])
        # A quarter of the float32 pixels' bytes (plus the grid's, where there is one).
        pixel_bytes = expected["pixel_values"].nelement() * 4
        assert encoder_input_bytes(sent) == encoder_input_bytes(expected) - pixel_bytes * 3 // 4


@pytest.mark.parametrize("kwargs", [
    {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False},
    {"image_mean": 0.5, "image_std": 0.25},
    {"image_mean": [0.1, 0.2, 0.3], "image_std": [0.9, 0.8, 0.7], "rescale_factor": 1 / 127.5},
])
def test_settings_that_change_the_arithmetic_change_the_table(models, kwargs):
    family = _family(models["llava"], **kwargs)
    arithmetic = family.device_pixel_arithmetic
    assert arithmetic is not None
    image = _noise(3, (70, 50))
    sent = family.device_encoder_input(image, arithmetic)
    assert torch.equal(arithmetic.apply(sent["pixel_values"]),
                       family.encoder_input(image)["pixel_values"])


def test_the_table_is_read_off_whatever_arithmetic_the_processor_does(models, monkeypatch):
    """transformers' torchvision backend folds rescaling into normalization, (x - 255 mean) /
    (255 std), which rounds differently from the PIL backend's two steps: the table is the
    processor's own output, so it matches either."""
    family = _family(models["llava"])
    real = family.encoder_input
    ip = family.image_processor
    mean = torch.tensor(ip.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(ip.image_std).view(1, 3, 1, 1)

    def fused(image, **overrides):
        item = dict(real(image, do_rescale=False, do_normalize=False))
        if overrides.get("do_normalize", True):
            item["pixel_values"] = (item["pixel_values"].float() - mean * 255) / (std * 255)
        return item

    monkeypatch.setattr(family, "encoder_input", fused)
    arithmetic = family.device_pixel_arithmetic
    assert arithmetic is not None
    image = _noise(5, (90, 60))
    got = arithmetic.apply(family.device_encoder_input(image, arithmetic)["pixel_values"])
    assert torch.equal(got, fused(image)["pixel_values"])
    # Not the PIL backend's two steps (rescaled in float64 and rounded once, then normalized
    # in float32), whichever backend ``real`` is where this runs.
    raw = real(image, do_rescale=False, do_normalize=False)["pixel_values"]
    two_steps = ((raw.double() * ip.rescale_factor).float() - mean) / std
    assert not torch.equal(got, two_steps)


def test_a_probe_that_misses_values_keeps_the_arithmetic_on_the_cpu(models, monkeypatch):
    """Every value of every channel must have been seen: a probe of 8 x 8 pixels (64 values)
    cannot vouch for the other 192."""
    family = _family(models["llava"])
    monkeypatch.setattr(family, "unresized_size", lambda: (8, 8))
    assert family.device_pixel_arithmetic is None


def test_a_processor_that_is_not_a_lookup_keeps_its_arithmetic(models, monkeypatch):
    """Pixel values that are not a function of each resized value alone (here a normalized
    output that also depends on the pixel's row) make the family keep preprocessing on the
    CPU; so do resized pixels that are not integers."""
    family = _family(models["llava"])
    real = family.encoder_input

    def by_row(image, **overrides):
        item = dict(real(image, **overrides))
        if overrides.get("do_normalize", True):
            rows = torch.arange(item["pixel_values"].shape[-2]).view(-1, 1)
            item["pixel_values"] = item["pixel_values"] + 1e-3 * rows
        return item

    monkeypatch.setattr(family, "encoder_input", by_row)
    assert family.device_pixel_arithmetic is None
    assert family.pixel_arithmetic_for("cuda") is None

    family = _family(models["llava"])
    real = family.encoder_input

    def fractional(image, **overrides):
        item = dict(real(image, **overrides))
        item["pixel_values"] = item["pixel_values"] + 0.5
        return item

    monkeypatch.setattr(family, "encoder_input", fractional)
    assert family.device_pixel_arithmetic is None


def test_only_a_gpu_engine_leaves_the_arithmetic_to_its_device(models):
    family = _family(models["qwen2_5_vl"])
    assert family.pixel_arithmetic_for("cpu") is None
    assert family.pixel_arithmetic_for("cuda") is family.device_pixel_arithmetic


def test_a_plan_for_a_gpu_profiles_the_integer_pixels(models):
    """``mmserve plan --device cuda`` on a machine without one dry-runs on the CPU's meta
    device, with the pixels a GPU engine would be sent."""
    from transformers import AutoConfig

    from mmserve.config import EngineConfig
    from mmserve.engine.encoder_cache import compute_encoder_budget
    from mmserve.engine.profile_batch import profile_batch_for

    model = models["llava"]
    family = _family(model)
    config = EngineConfig(model=model, device="cpu", max_model_len=256, max_num_seqs=4)
    budget = compute_encoder_budget(family.max_tokens_per_item, 256, 4, 1, None)
    hf_config = AutoConfig.from_pretrained(model, local_files_only=True)
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.uint8)):
        batch = profile_batch_for(config, hf_config, family, budget, 1, device)
        (item,) = batch.encoder_pixels.values()
        assert item["pixel_values"].dtype == dtype
        assert (PIXEL_ARITHMETIC in item) == (device == "cuda")


def _prompts(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": f"What is in picture {i}?"}]}],
        "images": [make_image(i, SIZES[i % len(SIZES)])]} for i in range(n)]


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl"])
def test_an_engine_finishing_pixels_on_its_device_gives_the_same_tokens(models, name,
                                                                        monkeypatch):
    """float32 greedy: several images of different sizes encoded in one step (one copy and
    one lookup per shape), then cache hits; the same tokens as the engine whose preprocessing
    finishes the pixels, which is token-exact to transformers (test_parity.py,
    test_qwen_parity.py)."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = _prompts(6) + _prompts(2)  # the last two: encoder-cache hits
    settings = dict(dtype="float32", max_model_len=1024, max_num_seqs=8)
    # Preprocessing finishes the pixels (the CPU's way, here whatever the device).
    monkeypatch.setattr(MultiModalFamily, "pixel_arithmetic_for", lambda self, device: None)
    with LLM(models[name], **settings) as llm:
        assert llm.engine.processor.pixel_arithmetic is None
        expected = [o.token_ids for o in generate_all_at_once(llm, prompts, params)]
    # The runner finishes them (a GPU's way, here whatever the device).
    monkeypatch.setattr(MultiModalFamily, "pixel_arithmetic_for",
                        lambda self, device: self.device_pixel_arithmetic)
    with LLM(models[name], **settings) as llm:
        engine = llm.engine
        assert engine.processor.pixel_arithmetic is not None
        req = engine.process_request(prompts[0], params)
        assert req.images[0].pixel_values["pixel_values"].dtype == torch.uint8
        encoded = []
        real = engine.runner._encoder_inputs
        monkeypatch.setattr(engine.runner, "_encoder_inputs",
                            lambda items: encoded.append(len(items)) or real(items))
        got = [o.token_ids for o in generate_all_at_once(llm, prompts, params)]
        assert got == expected
        assert max(encoded) > 1  # a step encoded several images together
        assert len(engine.runner._pixel_tables) == 1  # copied to the device once
        assert_no_leaks(engine)
