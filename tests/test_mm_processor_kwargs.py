"""``mm_processor_kwargs`` (vLLM's ``--mm-processor-kwargs``): the image processor's settings for
every call, taken as a dict in the Python API and a JSON object on the command line.

Under them, token ids and pixel values equal the checkpoint's own processor called with the same
keywords, greedy float32 output equals transformers' ``generate()`` on those pixels, and each
image's hash (the key of the encoder cache and part of every prefix-cache block hash) changes with
the settings. Keywords the image processor does not take stop the start with their name:
Hugging Face processors would warn and ignore them, so a misspelt setting would change nothing.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import AutoConfig, AutoProcessor

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.entrypoints.cli import build_parser, main
from mmserve.entrypoints.engine_args import engine_argv, engine_kwargs
from mmserve.errors import InvalidInputError
from mmserve.processing.images import image_hash
from mmserve.processing.processor import InputProcessor
from tests.conftest import assert_no_leaks, make_image

MAX_TOKENS = 12
IMAGES = [make_image(i, size) for i, size in enumerate([(40, 30), (64, 64), (23, 57)])]
# Settings that change the pixels but not the number of tokens per image: no normalization; a
# different mean and spread; a larger resize (then the same centre crop) with another filter.
SETTINGS = [
    {"do_normalize": False},
    {"image_mean": [0.2, 0.5, 0.8], "image_std": [0.5, 0.25, 0.5]},
    {"size": {"shortest_edge": 48}, "resample": 0},
]


@functools.cache
def _hf_processor(path: str):
    return AutoProcessor.from_pretrained(path, local_files_only=True)


@functools.cache
def _hf_model(path: str):
    import transformers

    architecture = AutoConfig.from_pretrained(path).architectures[0]
    model = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _input_processor(path: str, kwargs: dict | None) -> InputProcessor:
    return InputProcessor(path, AutoConfig.from_pretrained(path, local_files_only=True),
                          50_000_000, kwargs)


def _chat(text: str, images: list) -> dict:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "images": images}


PROMPTS = [_chat("what is in this picture?", [IMAGES[0]]),
           _chat("describe both of these images", [IMAGES[1], IMAGES[2]]),
           _chat("hi", [])]


@torch.no_grad()
def reference(path: str, prompts: list[dict], kwargs: dict) -> list[list[int]]:
    """transformers' greedy generate, one request at a time, its processor called with
    ``kwargs`` (the oracle of ``mmserve.testing.oracle``, with the processor's keywords)."""
    processor, model = _hf_processor(path), _hf_model(path)
    out = []
    for p in prompts:
        text = processor.apply_chat_template(p["messages"], add_generation_prompt=True,
                                             tokenize=False)
        inputs = processor(text=text, images=p["images"] or None, return_tensors="pt",
                           **kwargs)
        ids = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS,
                             pad_token_id=processor.tokenizer.pad_token_id)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


# ------------------------------------------------------------------ the setting itself
def test_config_takes_a_dict_and_keeps_its_own_copy() -> None:
    given = {"do_normalize": False, "size": {"shortest_edge": 48}}
    config = EngineConfig(model="m", mm_processor_kwargs=given)
    given["size"]["shortest_edge"] = 64
    assert config.mm_processor_kwargs == {"do_normalize": False, "size": {"shortest_edge": 48}}
    # Frozen, compared by value, replaceable; never hashed.
    assert config == EngineConfig(model="m", mm_processor_kwargs={
        "size": {"shortest_edge": 48}, "do_normalize": False})
    assert config.replace(max_num_seqs=2).mm_processor_kwargs == config.mm_processor_kwargs
    assert EngineConfig(model="m", mm_processor_kwargs={}).mm_processor_kwargs is None


@pytest.mark.parametrize("value, message", [
    ('{"do_normalize": false}', "must be a JSON object"),  # JSON text is for the CLI
    ([("do_normalize", False)], "got list"),
    ({1: True}, "keys must be strings, got [1]"),
])
def test_config_refuses_what_is_not_an_object_of_names(value, message: str) -> None:
    with pytest.raises(ValueError, match="mm_processor_kwargs") as e:
        EngineConfig(model="m", mm_processor_kwargs=value)
    assert message in str(e.value)


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_flag_takes_json_and_round_trips(command: str) -> None:
    text = '{"do_normalize": false, "image_mean": [0.5, 0.5, 0.5]}'
    args = build_parser().parse_args([command, "--mm-processor-kwargs", text])
    assert engine_kwargs(args)["mm_processor_kwargs"] == json.loads(text)
    config = EngineConfig(model="m", **engine_kwargs(args))
    assert config.mm_processor_kwargs == {"do_normalize": False, "image_mean": [0.5, 0.5, 0.5]}
    # What `bench serve` passes on to the server it starts reads back the same.
    argv = engine_argv(args)
    assert argv[:1] == ["--mm-processor-kwargs"]
    again = build_parser().parse_args(["serve", *argv])
    assert engine_kwargs(again) == engine_kwargs(args)


@pytest.mark.parametrize("text, message", [
    ("do_normalize=false", "not JSON"),
    ('["do_normalize", false]', "must be a JSON object"),
])
def test_bad_flag_values_are_usage_errors(text: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--mm-processor-kwargs", text])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_help_lists_the_flag(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--mm-processor-kwargs MM_PROCESSOR_KWARGS" in out
    assert "keyword arguments for the image processor" in out


# ------------------------------------------------------------------ refused at start-up
@pytest.mark.parametrize("kwargs, message", [
    # A misspelling: transformers' LlavaProcessor would warn and ignore it.
    ({"do_normalise": False}, "takes no 'do_normalise'; it takes "),
    ({"do_normalize": "no"}, "do_normalize"),
    ({"return_tensors": "np"}, "'return_tensors' is set by mmserve"),
    # Without the centre crop the size follows the image: the vision tower takes 32x32 only.
    ({"do_center_crop": False}, "96x48 -> 64x32"),
])
def test_settings_the_image_processor_refuses_stop_the_start(clip_llama: str, kwargs: dict,
                                                             message: str) -> None:
    with pytest.raises(ValueError, match="mm_processor_kwargs") as e:
        _input_processor(clip_llama, kwargs)
    assert message in str(e.value)
    if "takes no" in message:  # the valid names are listed
        assert "do_normalize" in str(e.value) and "image_mean" in str(e.value)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        LLM(clip_llama, dtype="float32", mm_processor_kwargs=kwargs)


def test_plan_takes_the_flag(clip_llama: str, capsys) -> None:
    base = ["plan", clip_llama, "--dtype=float32", "--device=cpu", "--json"]
    assert main([*base, "--mm-processor-kwargs", '{"do_normalize": false}']) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"]["tokens_per_image"] == 16
    assert main([*base, "--mm-processor-kwargs", '{"do_normalise": false}']) == 1
    assert "takes no 'do_normalise'" in json.loads(capsys.readouterr().out)["error"]


# ------------------------------------------------------------------ exact with transformers
@pytest.mark.parametrize("kwargs", SETTINGS, ids=lambda kw: ",".join(kw))
def test_tokens_and_pixels_equal_the_processor_called_with_the_settings(
        clip_llama: str, kwargs: dict) -> None:
    proc = _input_processor(clip_llama, kwargs)
    default = _input_processor(clip_llama, None)
    assert proc.tokens_per_image == default.tokens_per_image == 16
    for prompt in PROMPTS[:2]:
        got = proc.process(prompt)
        text, images = proc.render_chat(prompt["messages"], prompt["images"])
        want = _hf_processor(clip_llama)(text=text, images=images, return_tensors="pt", **kwargs)
        assert got.token_ids == want["input_ids"][0].tolist()
        pixels = torch.cat([im.pixel_values["pixel_values"] for im in got.images])
        assert torch.equal(pixels, want["pixel_values"])
        # The settings changed the pixels (so the comparison above says something).
        plain = torch.cat([im.pixel_values["pixel_values"]
                           for im in default.process(prompt).images])
        assert not torch.allclose(pixels, plain)


@pytest.mark.parametrize("kwargs", SETTINGS[:2], ids=lambda kw: ",".join(kw))
def test_greedy_output_equals_transformers_generate(clip_llama: str, kwargs: dict) -> None:
    llm = LLM(clip_llama, dtype="float32", max_num_batched_tokens=24, mm_processor_kwargs=kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_no_leaks(llm.engine)
    want = reference(clip_llama, PROMPTS, kwargs)
    assert [o.token_ids for o in outs] == want
    # The settings reach the output: without them transformers generates otherwise.
    assert want[:2] != reference(clip_llama, PROMPTS[:2], {})


# ------------------------------------------------------------------ the hash
def test_hash_follows_the_settings(clip_llama: str) -> None:
    image = IMAGES[0]
    assert image_hash(image) == image_hash(image, None) == image_hash(image, {})
    assert (image_hash(image, {"do_normalize": False, "resample": 0})
            == image_hash(image, {"resample": 0, "do_normalize": False}))  # order-free
    assert image_hash(image, {"do_normalize": False}) != image_hash(image, {"do_normalize": True})

    def hashes(kwargs: dict | None) -> list[str]:
        prompt = _input_processor(clip_llama, kwargs).process(PROMPTS[0])
        return [im.hash for im in prompt.images]

    plain, no_norm, other_mean = hashes(None), hashes(SETTINGS[0]), hashes(SETTINGS[1])
    assert plain == [image_hash(image)]  # unchanged without settings
    assert len({plain[0], no_norm[0], other_mean[0]}) == 3
    assert hashes(dict(SETTINGS[0])) == no_norm  # the same settings: the same entry


def test_a_request_of_a_fixed_size_model_is_told_its_settings_change_nothing(
        clip_llama: str) -> None:
    """A LLaVA image is always the same tokens: a request's own ``mm_processor_kwargs``
    (vLLM's) are refused with the reason, the server's settings still apply, and the engine
    goes on."""
    with LLM(clip_llama, dtype="float32", max_model_len=256) as llm:
        prompt = {"prompt": "<image> what?", "images": [make_image(0, (40, 30))],
                  "mm_processor_kwargs": {"max_pixels": 1000}}
        with pytest.raises(InvalidInputError, match="nothing to change") as e:
            llm.generate(prompt, SamplingParams(max_tokens=2))
        assert e.value.param == "mm_processor_kwargs"
        del prompt["mm_processor_kwargs"]
        assert len(llm.generate(prompt, SamplingParams(max_tokens=2))[0].token_ids) == 2
        # An empty object is no setting at all.
        prompt["mm_processor_kwargs"] = {}
        assert len(llm.generate(prompt, SamplingParams(max_tokens=2))[0].token_ids) == 2
        assert_no_leaks(llm.engine)
