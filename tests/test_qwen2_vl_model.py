"""Qwen2-VL's and Qwen2.5-VL's pieces against transformers' own modules, on random weights:
the vision towers over packed images of different sizes, and M-RoPE's tables."""

from __future__ import annotations

import pytest
import torch
import transformers

from mmserve.kernels.cpu_ops import packed_encoder_attention
from mmserve.models.loader import load_weights
from mmserve.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                            "rope_theta": 1e6}}
VARIANTS = {
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                 Qwen2VLForConditionalGeneration,
                 {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64,
                  "mlp_ratio": 2}),
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig,
                   transformers.Qwen2_5_VLForConditionalGeneration,
                   Qwen2_5_VLForConditionalGeneration,
                   {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                    "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1, 3]}),
}
# (t, rows, columns) of patches: wide, small, tall; sizes that do not fill whole windows.
GRIDS = [(1, 6, 10), (1, 4, 4), (1, 12, 8)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request: pytest.FixtureRequest):
    config_cls, hf_cls, our_cls, vision = VARIANTS[request.param]
    config = config_cls(text_config=TEXT, vision_config=vision)
    torch.manual_seed(0)
    reference = hf_cls(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(std=0.3)
    ours = our_cls(config).eval()
    load_weights(ours, reference.state_dict().items())
    return reference, ours


def test_vision_tower_packs_images_of_different_sizes(models) -> None:
    reference, ours = models
    torch.manual_seed(1)
    sizes = [t * h * w for t, h, w in GRIDS]
    pixels = torch.randn(sum(sizes), 3 * 2 * 14 * 14)
    with torch.no_grad():
        want = reference.model.visual(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
        items = [{"pixel_values": p, "image_grid_thw": torch.tensor([g])}
                 for p, g in zip(pixels.split(sizes), GRIDS, strict=True)]
        got = ours.encode_images(items)
        alone = ours.encode_images(items[2:])
    assert [e.shape[0] for e in got] == [n // 4 for n in sizes]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    # Packing changes nothing: an image encoded alone gets the same embeddings.
    torch.testing.assert_close(alone[0], got[2], rtol=1e-5, atol=1e-5)


def test_mrope_tables_equal_transformers(models) -> None:
    reference, ours = models
    positions = torch.randint(0, 60, (3, 1, 9))
    cos, sin = reference.model.language_model.rotary_emb(torch.zeros(1, 9, 64), positions)
    our_cos, our_sin = ours.model.language_model.rotary.cos_sin(positions[:, 0], torch.float32)
    torch.testing.assert_close(our_cos[:, 0], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(our_sin[:, 0], sin[0], rtol=0, atol=0)


def test_packed_attention_stays_within_segments() -> None:
    torch.manual_seed(2)
    boundaries = [0, 3, 7, 10, 14, 15]  # lengths 3, 4, 3, 4, 1: two share a batch each
    q, k, v = (torch.randn(15, 2, 8) for _ in range(3))
    got = packed_encoder_attention(q, k, v, boundaries, 0.3)
    for lo, hi in zip(boundaries[:-1], boundaries[1:], strict=True):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1),
            scale=0.3).transpose(0, 1)
        torch.testing.assert_close(got[lo:hi], want)
