"""The Qwen2-VL and Qwen2.5-VL tiny checkpoints, their processor without torchvision, and the
transformers oracle on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mmserve.processing.hf_processors import load_qwen2_vl_processor
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import hf_greedy_generate, load_hf_processor
from mmserve.testing.qwen2_vl import (
    CHAT_TEMPLATE,
    IMAGE_PLACEHOLDER,
    QWEN_SPECIAL_TOKENS,
    build_tiny_qwen2_vl,
)
from tests.conftest import make_image

VARIANTS = {
    "qwen2_vl": (transformers.Qwen2VLForConditionalGeneration, transformers.Qwen2VLProcessor),
    "qwen2_5_vl": (transformers.Qwen2_5_VLForConditionalGeneration,
                   transformers.Qwen2_5_VLProcessor),
}
LAYOUTS = ("transformers", "published")
SEED = 5
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
# Qwen's published vision field names (the tiny checkpoints write every one of them).
PUBLISHED_VISION_FIELDS = {
    "qwen2_vl": {"depth", "embed_dim", "mlp_ratio", "num_heads", "in_chans", "hidden_size",
                 "patch_size", "spatial_merge_size", "spatial_patch_size", "temporal_patch_size"},
    "qwen2_5_vl": {"depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads",
                   "in_chans", "out_hidden_size", "patch_size", "spatial_merge_size",
                   "spatial_patch_size", "window_size", "fullatt_block_indexes",
                   "tokens_per_second", "temporal_patch_size"},
}
PUBLISHED_PREPROCESSOR_FIELDS = {"min_pixels", "max_pixels", "patch_size", "merge_size",
                                 "temporal_patch_size", "image_mean", "image_std",
                                 "image_processor_type", "processor_class"}


@pytest.fixture(scope="module")
def qwen_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(variant, layout) -> a checkpoint; the same seed in every one."""
    root = tmp_path_factory.mktemp("qwen")
    return {(variant, layout): build_tiny_qwen2_vl(root / f"{variant}-{layout}", variant=variant,
                                                   layout=layout, seed=SEED)
            for variant in VARIANTS for layout in LAYOUTS}


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _prompt(processor, messages=QUESTION) -> str:
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_tokens_config_and_processor(qwen_checkpoints, variant: str) -> None:
    path = qwen_checkpoints[variant, "transformers"]
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.architectures == [VARIANTS[variant][0].__name__]
    processor = load_qwen2_vl_processor(path)
    tokenizer = processor.tokenizer
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS.tokens}
    assert list(ids) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                         "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    assert list(ids.values()) == list(range(8))
    assert (config.image_token_id, config.video_token_id) == (ids["<|image_pad|>"],
                                                              ids["<|video_pad|>"])
    assert (config.vision_start_token_id, config.vision_end_token_id) == (
        ids["<|vision_start|>"], ids["<|vision_end|>"])
    # Qwen2's tokenizer: nothing prepended, eos <|im_end|>, pad <|endoftext|>.
    assert tokenizer.bos_token is None and tokenizer("a cat")["input_ids"][0] > 7
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert len(tokenizer) == config.text_config.vocab_size == 512
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert 2 * sum(text.rope_parameters["mrope_section"]) == head_dim
    vision = config.vision_config
    if variant == "qwen2_5_vl":
        assert (vision.depth, list(vision.fullatt_block_indexes)) == (4, [1, 3])
        # A window of 2 x 2 tokens: a 112 x 112 image (4 x 4 tokens) has four.
        assert vision.window_size == 2 * vision.patch_size * vision.spatial_merge_size
    # Qwen2-VL's image processor (PIL's, or torchvision's where it is installed), at most 64
    # tokens an image.
    image_processor = processor.image_processor
    assert type(image_processor).__module__.startswith("transformers.models.qwen2_vl.")
    grid = processor(text=IMAGE_PLACEHOLDER, images=[make_image(0, (2000, 1500))])[
        "image_grid_thw"][0]
    assert int(grid.prod()) // 4 <= 64
    # The lm_head rows of every special token but <|im_end|> and <|endoftext|> are zero.
    weights = load_file(path / "model.safetensors")
    zero_rows = (weights["lm_head.weight"].abs().sum(dim=1) == 0).nonzero().flatten().tolist()
    assert zero_rows == [ids[t] for t in ids if t not in ("<|im_end|>", "<|endoftext|>")]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layouts_load_to_the_same_model_and_tokens(qwen_checkpoints, variant: str) -> None:
    ours = qwen_checkpoints[variant, "transformers"]
    published = qwen_checkpoints[variant, "published"]
    # transformers' own names in one, Qwen's in the other.
    ours_names = set(load_file(ours / "model.safetensors"))
    published_names = set(load_file(published / "model.safetensors"))
    assert "model.language_model.embed_tokens.weight" in ours_names
    assert "model.visual.patch_embed.proj.weight" in ours_names
    assert all(name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.",
                                "visual.", "lm_head.")) for name in published_names)
    assert len(published_names) == len(ours_names)
    # The published config: flat, M-RoPE as rope_scaling, Qwen's field names.
    config = _json(published / "config.json")
    assert "text_config" not in config and config["hidden_size"] == 64
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert set(config["vision_config"]) == PUBLISHED_VISION_FIELDS[variant]
    preprocessor = _json(published / "preprocessor_config.json")
    assert set(preprocessor) == PUBLISHED_PREPROCESSOR_FIELDS
    assert preprocessor["processor_class"] == VARIANTS[variant][1].__name__
    assert (preprocessor["min_pixels"], preprocessor["max_pixels"]) == (56 * 56, 28 * 28 * 64)
    assert not (published / "processor_config.json").exists()
    assert _json(published / "chat_template.json")["chat_template"] == CHAT_TEMPLATE

    # transformers renames the published weights at load: the same parameters.
    model_class = VARIANTS[variant][0]
    loaded = [model_class.from_pretrained(path).state_dict() for path in (ours, published)]
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][name], loaded[1][name]) for name in loaded[0])
    loaded_config = transformers.AutoConfig.from_pretrained(published)
    assert loaded_config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert loaded_config.vision_config.patch_size == 14

    image = make_image(3, (120, 90))
    tokens = [hf_greedy_generate(path, _prompt(load_hf_processor(path)), [image], 12)
              for path in (ours, published)]
    assert tokens[0] == tokens[1]


def test_chat_template_renders_images_and_text_in_order(qwen_checkpoints) -> None:
    processor = load_qwen2_vl_processor(qwen_checkpoints["qwen2_vl", "transformers"])
    image = {"type": "image"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "compare"}, image,
                                     {"type": "text", "text": " and "},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": "same"},
        {"role": "user", "content": [image, {"type": "text", "text": "now?"}]},
    ]
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert _prompt(processor, messages) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\ncompare{vision} and {vision}<|im_end|>\n"
        "<|im_start|>assistant\nsame<|im_end|>\n"
        f"<|im_start|>user\n{vision}now?<|im_end|>\n"
        "<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert processor.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    with pytest.raises(Exception, match="Unsupported content part: video"):
        _prompt(processor, [{"role": "user", "content": [{"type": "video"}]}])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_processor_without_video_makes_what_the_full_processor_makes(
    qwen_checkpoints, variant: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = qwen_checkpoints[variant, layout]
    ours = load_qwen2_vl_processor(path)
    processor_class = VARIANTS[variant][1]
    assert isinstance(ours, processor_class) and not hasattr(ours, "video_processor")
    # The oracle's processor: transformers' own where it can be built, else this one.
    oracle = load_hf_processor(path)
    if not transformers.utils.is_torchvision_available():
        assert type(oracle) is type(ours)
        with pytest.raises(ImportError, match="Torchvision"):
            transformers.AutoProcessor.from_pretrained(path)

    # The full processor, with a stand-in video processor (a real one needs torchvision).
    check = transformers.ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(
        transformers.ProcessorMixin, "check_argument_for_proper_class",
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    full = processor_class(image_processor=ours.image_processor, tokenizer=ours.tokenizer,
                           video_processor=object(), chat_template=ours.chat_template)

    images = [make_image(1, (150, 100)), make_image(2, (60, 200))]
    text = _prompt(ours, [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "image"}, {"type": "text", "text": "two"},
        {"type": "image"}]}])
    for processor in (full, oracle):
        assert _prompt(processor, QUESTION) == _prompt(ours, QUESTION)
        want = processor(text=text, images=images, return_tensors="pt")
        got = ours(text=text, images=images, return_tensors="pt")
        assert set(got) == set(want) == {"input_ids", "attention_mask", "pixel_values",
                                         "image_grid_thw", "mm_token_type_ids"}
        assert all(torch.equal(got[key], want[key]) for key in want)

    # And by hand: the image processor's pixels, one <|image_pad|> per merged 2 x 2 patches.
    pixels = ours.image_processor(images=images, return_tensors="pt")
    assert torch.equal(got["pixel_values"], pixels["pixel_values"])
    counts = [int(grid.prod()) // 4 for grid in pixels["image_grid_thw"]]
    expanded = text.split("<|image_pad|>")
    expanded = expanded[0] + "<|image_pad|>" * counts[0] + expanded[1] + (
        "<|image_pad|>" * counts[1]) + expanded[2]
    assert got["input_ids"][0].tolist() == ours.tokenizer(expanded)["input_ids"]
    image_pad = ours.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert torch.equal(got["mm_token_type_ids"][0], (got["input_ids"][0] == image_pad).long())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_oracle_output_depends_on_the_image_and_its_size(qwen_checkpoints, variant: str) -> None:
    path = qwen_checkpoints[variant, "transformers"]
    prompt = _prompt(load_hf_processor(path))
    runs = {
        "first": [make_image(1, (112, 84))],
        "second": [make_image(2, (112, 84))],
        "first larger": [make_image(1, (224, 168))],
    }
    tokens = {name: hf_greedy_generate(path, prompt, images, 16) for name, images in runs.items()}
    assert len({tuple(t) for t in tokens.values()}) == 3, tokens
    for generated in tokens.values():
        assert len(generated) == 16 and len(set(generated)) > 8
        assert all(token > 7 for token in generated)  # no special token came out
    # Text alone generates too (M-RoPE positions without images).
    text_only = _prompt(load_hf_processor(path), [{"role": "user", "content": "hi"}])
    assert len(hf_greedy_generate(path, text_only, [], 8)) == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_embeddings_have_no_lm_head(tmp_path: Path, layout: str) -> None:
    path = build_tiny_qwen2_vl(tmp_path, layout=layout, tie_word_embeddings=True)
    weights = load_file(path / "model.safetensors")
    assert not [name for name in weights if name.startswith("lm_head")]
    assert _json(path / "config.json")["tie_word_embeddings"] is True
    embed = next(t for name, t in weights.items() if name.endswith("embed_tokens.weight"))
    assert embed[[1, 3, 4, 5, 6, 7]].abs().sum() == 0 and embed[[0, 2]].abs().sum() > 0
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    generated = hf_greedy_generate(path, _prompt(load_hf_processor(path)),
                                   [make_image(4, (100, 100))], 12)
    assert len(set(generated)) > 4 and all(token > 7 for token in generated)


def test_entry_point_builds_what_the_builder_builds(tmp_path: Path) -> None:
    def contents(path: Path) -> tuple:
        weights = load_file(path / "model.safetensors")
        return (_json(path / "config.json"), (path / "tokenizer.json").read_text(),
                _json(path / "preprocessor_config.json"),
                {name: t.tolist() for name, t in weights.items()})

    options = {"layout": "published", "seed": 2, "max_pixels": 28 * 28 * 16}
    direct = contents(build_tiny_qwen2_vl(tmp_path / "direct", **options))
    assert contents(build_tiny_checkpoint("qwen2_vl", tmp_path / "entry", **options)) == direct
    assert contents(build_tiny_qwen2_vl(tmp_path / "seed3", **{**options, "seed": 3})) != direct
    assert contents(build_tiny_checkpoint("qwen2_5_vl", tmp_path / "entry25", **options)) == (
        contents(build_tiny_qwen2_vl(tmp_path / "direct25", variant="qwen2_5_vl", **options)))
    with pytest.raises(TypeError, match="variant"):
        build_tiny_checkpoint("qwen2_5_vl", tmp_path / "x", variant="qwen2_vl")


def test_builder_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        build_tiny_qwen2_vl(tmp_path, mrope_section=(2, 2, 2))
    with pytest.raises(ValueError, match="variant"):
        build_tiny_qwen2_vl(tmp_path, variant="qwen3_vl")
    with pytest.raises(ValueError, match="layout"):
        build_tiny_qwen2_vl(tmp_path, layout="gguf")
    with pytest.raises(ValueError, match="multiple of 4"):
        build_tiny_qwen2_vl(tmp_path, vision_hidden=20, vision_heads=2)
