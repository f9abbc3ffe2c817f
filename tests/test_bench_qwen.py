"""`mmserve bench` with images of several sizes: the mixed workload, tokens per image and the
encoder's figures in the report, Qwen2-VL FLOP counts, and the Qwen2.5-VL bench checkpoint
(built scaled down; the real one takes 20 s and 400 MB)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import pytest
import torch
from PIL import Image

from mmserve.bench import checkpoint as bench_checkpoint
from mmserve.bench.flops import ModelFlops
from mmserve.bench.workload import (
    IMAGE_SIZE_PRESETS,
    WorkloadConfig,
    build_workload,
    format_sizes,
    parse_sizes,
)
from mmserve.testing import build_tiny_checkpoint
from tests.test_bench import bench

# The Qwen2.5-VL bench checkpoint at tiny widths (its layer types, window size and pixel bounds
# kept but max_pixels: at most 64 tokens an image).
SMALL_QWEN_SHAPES = {
    "vision_hidden": 32, "vision_layers": 4, "vision_heads": 2, "vision_intermediate_size": 64,
    "fullatt_block_indexes": (1, 3), "text_hidden": 64, "text_layers": 2, "text_heads": 4,
    "text_kv_heads": 2, "mrope_section": (2, 3, 3), "intermediate_size": 128,
    "vocab_size": 600, "max_position_embeddings": 2048, "max_pixels": 28 * 28 * 64,
}
RUN_FLAGS = ["--output-len", "2:4", "--prompt-len", "6", "--dtype", "float32", "--no-progress",
             "--no-peak"]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Qwen2.5-VL: windows of 2 x 2 tokens, at most 64 tokens an image."""
    return str(build_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen") / "ckpt"))


def _tokens(image_processor, size: tuple[int, int]) -> int:
    grid = image_processor(images=[Image.new("RGB", size)])["image_grid_thw"][0]
    return int(grid.prod()) // image_processor.merge_size ** 2


# ----------------------------------------------------------------- workload
def test_mixed_image_sizes_are_seeded_and_all_drawn() -> None:
    sizes = parse_sizes("mixed")
    assert sizes == IMAGE_SIZE_PRESETS["mixed"] and len(set(sizes)) == 4
    config = WorkloadConfig(num_prompts=10, image_sizes=sizes, unique_images=6, seed=5)
    a, b = build_workload(config), build_workload(config)
    assert [r.image_ids for r in a.requests] == [r.image_ids for r in b.requests]
    assert [im.tobytes() for im in a.pool] == [im.tobytes() for im in b.pool]
    # The pool takes the sizes in turn: each size drawn, as often as the pool allows.
    assert [im.size for im in a.pool] == [sizes[i % 4] for i in range(6)]
    assert {im.size for r in a.requests for im in r.images} == set(sizes)
    other = build_workload(dataclasses.replace(config, seed=6))
    assert [im.tobytes() for im in other.pool] != [im.tobytes() for im in a.pool]


def test_image_sizes_flag_forms() -> None:
    assert parse_sizes("64x32,100X100") == ((64, 32), (100, 100))
    assert parse_sizes(" Mixed ") == IMAGE_SIZE_PRESETS["mixed"]
    assert format_sizes(IMAGE_SIZE_PRESETS["mixed"]) == "mixed"
    assert format_sizes(((64, 32), (100, 100))) == "64x32,100x100"
    with pytest.raises(argparse.ArgumentTypeError, match="WxH"):
        parse_sizes("64x32,large")
    with pytest.raises(ValueError, match="positive"):
        WorkloadConfig(image_sizes=((64, 0),))
    with pytest.raises(ValueError, match="at least one"):
        WorkloadConfig(image_sizes=())


def test_mixed_preset_token_counts_on_the_qwen_bench_shapes() -> None:
    """The sizes of "mixed" span the Qwen2.5-VL bench checkpoint's range (4 to 1024 tokens):
    small, medium, large and wide images, as the workload module documents."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    shapes = bench_checkpoint.BENCH_CHECKPOINTS["qwen2_5_vl"].shapes
    processor = Qwen2VLImageProcessorPil(
        min_pixels=shapes["min_pixels"], max_pixels=shapes["max_pixels"],
        patch_size=shapes["patch_size"], temporal_patch_size=shapes["temporal_patch_size"],
        merge_size=shapes["spatial_merge_size"])
    assert [_tokens(processor, s) for s in IMAGE_SIZE_PRESETS["mixed"]] == [4, 256, 999, 798]
    assert _tokens(processor, (4000, 4000)) == 1024


# ----------------------------------------------------------------- report
def test_bench_throughput_tokens_per_image_and_encoder_figures(tiny_qwen: str, tmp_path,
                                                               capsys) -> None:
    from mmserve.processing.hf_processors import load_qwen2_vl_processor

    out = tmp_path / "tp.json"
    sizes = ((56, 56), (112, 112), (224, 112))
    rc = bench(["throughput", "--model", tiny_qwen, "--num-prompts", "6",
                "--image-sizes", format_sizes(sizes), *RUN_FLAGS, "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "tokens per image (min / median / max)" in table
    assert "vision encoder share of step time" in table
    r = json.loads(out.read_text())
    assert r["failed"] == 0
    assert r["workload"]["image_sizes"] == "56x56,112x112,224x112"
    # Six distinct images taking the three sizes in turn; each size its own token count.
    image_processor = load_qwen2_vl_processor(tiny_qwen).image_processor
    counts = [_tokens(image_processor, s) for s in sizes]
    assert len(set(counts)) == 3
    assert r["tokens_per_image"] == {"min": min(counts), "median": statistics.median(counts * 2),
                                     "max": max(counts)}
    # The cache holds them all: every image encoded once, each its own tokens' worth.
    assert r["encoder_items_computed"] == 6
    assert r["encoder_tokens_computed"] == 2 * sum(counts)
    assert sum(s["image_tokens_encoded"] for s in r["steps"]) == r["encoder_tokens_computed"]
    assert 0 < r["peak_encoder_cache_used_tokens"] <= r["encoder_cache_tokens"]
    assert r["peak_encoder_cache_usage"] == pytest.approx(
        r["peak_encoder_cache_used_tokens"] / r["encoder_cache_tokens"])
    assert max(s["encoder_cache_used_tokens"] for s in r["steps"]) == (
        r["peak_encoder_cache_used_tokens"])
    assert r["peak_encoder_cache_borrowed_tokens"] >= 0
    step_s = sum(s["duration_s"] for s in r["steps"])
    assert 0.0 < r["encoder_share_of_step_time"] < 1.0
    assert r["encoder_share_of_step_time"] == pytest.approx(r["time_s"]["encoder"] / step_s)
    assert sum(s["encoder_s"] for s in r["steps"]) == pytest.approx(r["time_s"]["encoder"])
    # Encoder FLOPs by each image's own size.
    from transformers import AutoConfig

    flops = ModelFlops.from_hf_config(AutoConfig.from_pretrained(tiny_qwen))
    assert r["model_flops"]["encoder"] == 2 * sum(flops.encoder(n) for n in counts)


def test_llava_makes_every_size_the_same_tokens(clip_llama: str, tmp_path) -> None:
    out = tmp_path / "tp.json"
    rc = bench(["throughput", "--model", clip_llama, "--num-prompts", "4", "--image-sizes",
                "mixed", *RUN_FLAGS, "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["workload"]["image_sizes"] == "mixed"
    assert r["tokens_per_image"] == {"min": 16, "median": 16, "max": 16}  # 32 px, patch 8
    assert r["encoder_tokens_computed"] == 16 * r["encoder_items_computed"]


# ----------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vision_flops_match_torch_flop_counter(family: str, tiny_qwen: str,
                                                    tmp_path) -> None:
    """The vision tower's count against torch's FlopCounterMode on transformers' tower: exact
    where the windows tile the image (Qwen2.5-VL's tiny windows: 4 x 4 patches), an overcount
    of at most the window layers' attention where the image's edges clip them."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from mmserve.processing.hf_processors import load_qwen2_vl_processor

    path = tiny_qwen if family == "qwen2_5_vl" else build_tiny_checkpoint(family, tmp_path)
    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    image_processor = load_qwen2_vl_processor(path).image_processor
    flops = ModelFlops.from_hf_config(config)
    for size, exact in (((56, 56), True), ((224, 112), True), ((112, 60), True),
                        ((84, 84), family == "qwen2_vl")):
        inputs = image_processor(images=[Image.new("RGB", size)], return_tensors="pt")
        grid = inputs["image_grid_thw"]
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model.model.visual(inputs["pixel_values"], grid_thw=grid)
        ours = flops.encoder(int(grid.prod()) // 4)
        if exact:
            assert ours == counter.get_total_flops(), size
        else:
            assert counter.get_total_flops() < ours < 1.1 * counter.get_total_flops(), size


# ----------------------------------------------------------------- bench checkpoint
@pytest.fixture
def small_qwen_bench(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """The registry's qwen2_5_vl entry at `SMALL_QWEN_SHAPES`, cached under ``tmp_path``."""
    entry = bench_checkpoint.BENCH_CHECKPOINTS["qwen2_5_vl"]
    monkeypatch.setitem(bench_checkpoint.BENCH_CHECKPOINTS, "qwen2_5_vl", dataclasses.replace(
        entry, shapes={**entry.shapes, **SMALL_QWEN_SHAPES}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "mmserve" / "bench-qwen2_5_vl"


def test_qwen_bench_checkpoint_scaled_down(small_qwen_bench) -> None:
    from transformers import AutoConfig

    from mmserve.processing.hf_processors import load_qwen2_vl_processor
    from mmserve.testing.qwen2_vl import QWEN_SPECIAL_TOKENS

    path = bench_checkpoint.ensure_bench_checkpoint(name="qwen2_5_vl")
    assert path == small_qwen_bench
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen2_5_vl"
    vision, text = config.vision_config, config.text_config
    assert (vision.window_size, vision.fullatt_block_indexes) == (112, [1, 3])
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (14, 2, 2)
    assert text.rope_parameters["mrope_section"] == [2, 3, 3]
    assert text.rope_parameters["rope_theta"] == 1e6
    assert text.num_key_value_heads == 2
    processor = load_qwen2_vl_processor(path)
    tokenizer = processor.tokenizer
    # Every id is a text piece but Qwen's special tokens, which keep the builder's ids.
    assert len(tokenizer) == 600
    specials = QWEN_SPECIAL_TOKENS.tokens
    assert tokenizer.convert_ids_to_tokens(list(range(len(specials)))) == list(specials)
    assert all(tokenizer.decode([i]) for i in range(len(specials), 600))
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert processor.image_processor.size == {"shortest_edge": 56 * 56,
                                              "longest_edge": 28 * 28 * 64}
    text_prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True)
    assert text_prompt.endswith("<|im_start|>assistant\n") and "<|image_pad|>" in text_prompt
    # Complete and of these shapes: not built again; another seed is another checkpoint.
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert bench_checkpoint.ensure_bench_checkpoint(name="qwen2_5_vl") == path
    assert weights.stat().st_mtime_ns == mtime
    bench_checkpoint.ensure_bench_checkpoint(name="qwen2_5_vl", seed=1)
    assert weights.stat().st_mtime_ns != mtime


def test_bench_checkpoint_flag_runs_the_qwen_checkpoint(small_qwen_bench, tmp_path) -> None:
    out = tmp_path / "tp.json"
    rc = bench(["throughput", "--bench-checkpoint", "qwen2_5_vl", "--num-prompts", "2",
                "--image-sizes", "mixed", *RUN_FLAGS, "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["model"] == str(small_qwen_bench) and r["failed"] == 0
    assert r["tokens_per_image"]["min"] < r["tokens_per_image"]["max"]


def test_bench_checkpoint_and_model_are_exclusive(clip_llama: str, capsys) -> None:
    assert bench(["throughput", "--model", clip_llama, "--bench-checkpoint", "llava"]) == 2
    assert "--model or --bench-checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown bench checkpoint"):
        bench_checkpoint.ensure_bench_checkpoint(name="llava-next")
