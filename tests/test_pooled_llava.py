"""The model interface's second family: pooled LLaVA (2 x 2 average pooling of the patch
features, a quarter of LLaVA's tokens per image). transformers has no such architecture, so
the model is checked against LLaVA's own features pooled by hand, and the engine for token
counts, budgets and the encoder cache following the family's numbers, batch results equal to
request-by-request ones, and no leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from mmserve import LLM, SamplingParams
from mmserve.models.llava import LlavaForConditionalGeneration
from mmserve.models.pooled_llava import PooledLlavaForConditionalGeneration
from mmserve.processing.processor import InputProcessor
from mmserve.testing import build_tiny_checkpoint
from tests.conftest import assert_no_leaks, make_image, record_steps

ARCH = "PooledLlavaForConditionalGeneration"
LLAVA_TOKENS, POOLED_TOKENS = 16, 4  # 32 x 32 pixels, 8 x 8 patches: 4 x 4, pooled 2 x 2
IMAGES = [make_image(i, size) for i, size in enumerate([(40, 30), (64, 64), (23, 57)])]


@pytest.fixture(scope="module")
def pooled_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = build_tiny_checkpoint("llava", tmp_path_factory.mktemp("pooled-llava"),
                                 vision="clip", text="llama")
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [ARCH]
    config_file.write_text(json.dumps(config))
    return str(path)


def _chat(text: str, n_images: int) -> list[dict]:
    return [{"role": "user",
             "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def test_family_counts_a_quarter_of_llava(pooled_llava: str, clip_llama: str) -> None:
    llava = InputProcessor(clip_llama, AutoConfig.from_pretrained(clip_llama), 1_000_000)
    proc = InputProcessor(pooled_llava, AutoConfig.from_pretrained(pooled_llava), 1_000_000)
    assert llava.family.max_tokens_per_item == LLAVA_TOKENS
    assert proc.family.max_tokens_per_item == POOLED_TOKENS == proc.tokens_per_image
    for w, h in ((40, 30), (1, 500), (640, 480)):
        assert proc.family.num_image_tokens(w, h) == POOLED_TOKENS
    assert proc.family.pixel_values(proc.family.dummy_image()).shape == (1, 3, 32, 32)
    out = proc.process({"messages": _chat("compare", 2), "images": IMAGES[:2]})
    assert [im.length for im in out.images] == [POOLED_TOKENS, POOLED_TOKENS]
    assert out.token_ids.count(proc.image_token_id) == 2 * POOLED_TOKENS
    # Adjacent placeholders: one run of tokens, split by the family's count.
    out = proc.process({"prompt": proc.image_token * 2 + " hi", "images": IMAGES[:2]})
    assert [(im.offset, im.length) for im in out.images] == [
        (out.images[0].offset, POOLED_TOKENS), (out.images[0].offset + POOLED_TOKENS, 4)]


def test_encoder_pools_llava_features(pooled_llava: str) -> None:
    config = AutoConfig.from_pretrained(pooled_llava)
    torch.manual_seed(0)
    pooled = PooledLlavaForConditionalGeneration(config).eval()
    llava = LlavaForConditionalGeneration(config).eval()
    llava.load_state_dict(pooled.state_dict())
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = pooled.encode_pixels(pixels)
        features = llava.model.vision_tower(pixels)[0][:, 1:]  # [2, 16, dim], CLS dropped
        grid = features.reshape(2, 2, 2, 2, 2, -1)  # [n, rows/2, 2, cols/2, 2, dim]
        by_hand = llava.model.multi_modal_projector(grid.mean(dim=(2, 4)).reshape(2, 4, -1))
    assert out.shape == (2, POOLED_TOKENS, config.text_config.hidden_size)
    torch.testing.assert_close(out, by_hand)


def test_generate_follows_the_familys_numbers(pooled_llava: str) -> None:
    prompts = [{"messages": _chat(text, len(imgs)), "images": imgs} for text, imgs in [
        ("hi", []), ("what is this?", IMAGES[:1]), ("compare these", IMAGES[1:3]),
        ("and this one again, in a long and careful description", IMAGES[:1]),
        ("three", IMAGES)]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(pooled_llava, dtype="float32", max_num_batched_tokens=24, max_num_seqs=3)
    assert llm.engine.encoder_budget.max_tokens_per_item == POOLED_TOKENS
    steps = record_steps(llm)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert_no_leaks(llm.engine)
    encoded = [n for out in steps for n in out.images_to_encode.values()]
    assert encoded and all(n == POOLED_TOKENS for n in encoded)
    stats = llm.stats()
    assert stats["encoder_items_computed"] == 3 and stats["encoder_cache_hits"] > 0
    assert stats["encoder_cache_used_tokens"] == 3 * POOLED_TOKENS
    single = [o.token_ids for p in prompts for o in llm.generate([p], params)]
    assert batched == single and all(len(t) == 8 for t in batched)
    assert_no_leaks(llm.engine)
