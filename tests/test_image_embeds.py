"""Images given as their embeddings (``ImageEmbeds``; vLLM's ``image_embeds``): the embeddings
transformers' own model makes of an image, sent in its place, give transformers' greedy
float32 tokens for the image, for LLaVA and both Qwen2-VL families (whose positions come from
the grid sent with them), in the Python API's forms and over HTTP (``--enable-mm-embeds``);
what does not fit the model is refused saying why, and nothing leaks."""

from __future__ import annotations

import base64
import io
import math
import os
import pickle

import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoConfig

from mmserve import LLM, ImageEmbeds, SamplingParams
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.errors import InvalidInputError
from mmserve.processing.hf_processors import load_qwen2_vl_processor
from mmserve.testing import build_tiny_checkpoint
from mmserve.testing.oracle import hf_greedy_generate, hf_image_embeds, load_hf_processor
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
IMAGES = [make_image(1, (40, 30)), make_image(2, (90, 64))]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen-embeds")
    return {family: str(build_tiny_checkpoint(family, root / family))
            for family in ("qwen2_vl", "qwen2_5_vl")}


def _checkpoint(name: str, clip_llama: str, qwen: dict[str, str]) -> str:
    return clip_llama if name == "llava" else qwen[name]


def _messages(n: int, text: str = "what is in these?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text",
                                                                     "text": text}]}]


def _reference(path: str, n: int) -> list[int]:
    template = (load_qwen2_vl_processor(path) if "qwen" in os.path.basename(path)
                else load_hf_processor(path))
    text = template.apply_chat_template(_messages(n), add_generation_prompt=True,
                                        tokenize=False)
    return hf_greedy_generate(path, text, IMAGES[:n], MAX_TOKENS)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "qwen2_5_vl"])
def test_embeddings_in_place_of_images_give_transformers_tokens(name: str, clip_llama: str,
                                                                qwen: dict[str, str]) -> None:
    path = _checkpoint(name, clip_llama, qwen)
    expected = _reference(path, 2)
    embeds = [ImageEmbeds(e, grid) for e, grid in hf_image_embeds(path, IMAGES)]
    with LLM(path, dtype="float32", max_model_len=512) as llm:
        prompts = [
            {"messages": _messages(2), "images": IMAGES},  # the images themselves
            {"messages": _messages(2), "images": embeds},  # both as embeddings
            {"messages": _messages(2), "images": [IMAGES[0], embeds[1]]},  # one of each
            # vLLM's forms: multi_modal_data, and a chat part of its own.
            {"messages": _messages(2), "multi_modal_data": {"image": [
                {"image_embeds": embeds[0].embeds, "image_grid_thw": embeds[0].grid_thw},
                embeds[1]]}},
            {"messages": [{"role": "user", "content": [
                {"type": "image_embeds", "image_embeds": embeds[0]},
                {"type": "image_embeds", "image_embeds": {
                    "image_embeds": embeds[1].embeds[None],  # [1, tokens, hidden]
                    "image_grid_thw": None if embeds[1].grid_thw is None
                    else torch.tensor([embeds[1].grid_thw])}},
                {"type": "text", "text": "what is in these?"}]}]},
        ]
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [expected] * len(prompts)
        assert outs[1].prompt_token_ids == outs[0].prompt_token_ids
        assert_no_leaks(llm.engine)


def test_llava_takes_a_tensor_of_several_images_embeddings(clip_llama: str) -> None:
    """vLLM's ``{"image": tensor [images, tokens, hidden]}``; the same embeddings again (a
    copy: hashed by content) hit the prefix cache past their placeholders."""
    expected = _reference(clip_llama, 2)
    stacked = torch.stack([e for e, _ in hf_image_embeds(clip_llama, IMAGES)])
    with LLM(clip_llama, dtype="float32", max_model_len=512) as llm:
        prompt = {"messages": _messages(2), "multi_modal_data": {"image": stacked}}
        assert llm.generate(prompt, GREEDY)[0].token_ids == expected
        hits = llm.engine.stats()["prefix_cache_hit_tokens"]
        again = {"messages": _messages(2), "multi_modal_data": {"image": stacked.clone()}}
        out = llm.generate(again, GREEDY)[0]
        assert out.token_ids == expected
        # Every whole block of the prompt but the last token's: both images' 32 placeholders.
        cached = llm.engine.stats()["prefix_cache_hit_tokens"] - hits
        assert cached >= 32 and cached == (len(out.prompt_token_ids) - 1) // 16 * 16
        assert_no_leaks(llm.engine)


def test_the_embeddings_are_copied_when_taken(clip_llama: str) -> None:
    """A caller's buffer used again for another image's embeddings changes nothing the
    engine holds under the first one's hash."""
    (first, _), (second, _) = hf_image_embeds(clip_llama, IMAGES)

    def tokens(llm: LLM, embeds: torch.Tensor, text: str) -> list[int]:
        return llm.generate({"messages": _messages(1, text), "images": [ImageEmbeds(embeds)]},
                            GREEDY)[0].token_ids

    with LLM(clip_llama, dtype="float32", max_model_len=512) as llm:
        expected = [tokens(llm, first, "again"), tokens(llm, second, "other")]
    # Without prefix caching, a prompt with the same image reads its embeddings from the
    # encoder cache again (not its KV blocks).
    with LLM(clip_llama, dtype="float32", max_model_len=512,
             enable_prefix_caching=False) as llm:
        buffer = first.clone()
        tokens(llm, buffer, "what is this?")  # the first image's, cached under its hash
        buffer.copy_(second)  # the buffer used again, for the second image
        assert tokens(llm, first.clone(), "again") == expected[0]
        assert tokens(llm, buffer, "other") == expected[1]
        assert_no_leaks(llm.engine)


def test_what_does_not_fit_the_model_is_refused(clip_llama: str, qwen: dict[str, str]) -> None:
    (good, _), = hf_image_embeds(clip_llama, IMAGES[:1])
    cases = [
        # 10^9 rows of a broadcast row: refused before anything is copied (25 GB).
        (ImageEmbeds(good[:1].expand(10**9, -1)), "no image is more than 16 tokens"),
        (ImageEmbeds(good[:, :-1]), "must be [tokens, 64]"),
        (ImageEmbeds(good[:-1]), "images are 16 tokens each"),
        (ImageEmbeds(good, (1, 4, 4)), "take no image_grid_thw"),
        (ImageEmbeds(good.to(torch.int32)), "floating-point"),
        (ImageEmbeds(torch.full_like(good, float("nan"))), "NaN"),
        (ImageEmbeds(good[None].expand(2, -1, -1)), "must be [tokens, 64]"),
        (ImageEmbeds(good.to_sparse()), "dense"),
    ]
    with LLM(clip_llama, dtype="float32", max_model_len=512) as llm:
        for item, message in cases:
            with pytest.raises(InvalidInputError, match=message.replace("[", r"\[")):
                llm.generate({"messages": _messages(1), "images": [item]}, GREEDY)
        with pytest.raises(InvalidInputError, match="must be image embeddings"):
            llm.generate({"messages": [{"role": "user", "content": [
                {"type": "image_embeds", "image_embeds": "nope"}]}]}, GREEDY)
        assert llm.generate({"messages": _messages(1), "images": [ImageEmbeds(good)]},
                            GREEDY)[0].finish_reason == "length"
        assert_no_leaks(llm.engine)
    path = qwen["qwen2_vl"]
    (embeds, grid), = hf_image_embeds(path, IMAGES[:1])
    t, h, w = grid
    cases = [
        (ImageEmbeds(embeds), "need their image_grid_thw"),
        (ImageEmbeds(embeds, (1, h, w + 2)), "which makes"),
        (ImageEmbeds(embeds, (2, h, w)), "is no image's grid"),
        (ImageEmbeds(embeds, (1, h, w + 1)), "is no image's grid"),
        (ImageEmbeds(embeds, (1.0, h, w)), "three positive integers"),
        (ImageEmbeds(embeds, [1, h]), "three positive integers"),
    ]
    merge = AutoConfig.from_pretrained(path).vision_config.spatial_merge_size
    with LLM(path, dtype="float32", max_model_len=2048) as llm:
        for item, message in cases:
            with pytest.raises(InvalidInputError, match=message):
                llm.generate({"messages": _messages(1), "images": [item]}, GREEDY)
        # More tokens than any image under the settings (the encoder budget's unit).
        side = math.isqrt(llm.engine.processor.tokens_per_image) + 1
        big = torch.zeros(side * side, embeds.shape[1])
        with pytest.raises(InvalidInputError, match="no image is more than"):
            llm.generate({"messages": _messages(1), "images": [
                ImageEmbeds(big, (1, side * merge, side * merge))]}, GREEDY)
        assert llm.generate({"messages": _messages(1), "images": [ImageEmbeds(embeds, grid)]},
                            GREEDY)[0].finish_reason == "length"
        assert_no_leaks(llm.engine)


def _b64(value) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


class _Boom:
    """Unpickled, it runs a command: here, one that leaves a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_image_embeds_parts_over_http(clip_llama: str, qwen: dict[str, str],
                                      tmp_path) -> None:
    """An ``image_embeds`` part answers as its image does; without --enable-mm-embeds, and
    for what is no saved tensor (a pickle that runs code, a compressed archive), a 400."""
    (llava_embeds, _), = hf_image_embeds(clip_llama, IMAGES[:1])
    image_part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}

    def chat(http: TestClient, part: dict) -> dict:
        resp = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
            "max_tokens": 6, "temperature": 0})
        return resp.json() | {"status": resp.status_code}

    with LLM(clip_llama, dtype="float32", max_model_len=512) as llm:
        with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as http:
            refused = chat(http, {"type": "image_embeds", "image_embeds": _b64(llava_embeds)})
            assert refused["status"] == 400 and "--enable-mm-embeds" in str(refused)
        config = ServerConfig("tiny", enable_mm_embeds=True)
        with TestClient(OpenAIServer(llm.engine, config).app()) as http:
            want = chat(http, image_part)
            got = chat(http, {"type": "image_embeds", "image_embeds": _b64(llava_embeds)})
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
            assert got["usage"] == want["usage"]
            tokenized = http.post("/tokenize", json={"messages": [{"role": "user", "content": [
                {"type": "image_embeds", "image_embeds": _b64(llava_embeds)}]}]}).json()
            assert tokenized["count"] > 16
            marker = tmp_path / "ran"
            evil = base64.b64encode(pickle.dumps(_Boom(str(marker)))).decode()
            for part, fragment in (
                    ({"image_embeds": "###"}, "not valid base64"),
                    ({"image_embeds": evil}, "not a tensor saved with torch.save"),
                    ({"image_embeds": _b64(_Boom(str(marker)))}, "cannot be read as a tensor"),
                    ({"image_embeds": _b64({"a": llava_embeds})}, "one dense tensor"),
                    ({"image_embeds": _b64(llava_embeds[:3])}, "16 tokens each"),
                    ({"image_embeds": {"image_embeds": 5}}, "base64 string"),
                    ({"image_embeds": _zip_bomb()}, "unpacks to"),
                    # A broadcast view is a few bytes to send and 25 GB copied.
                    ({"image_embeds": _b64(llava_embeds[:1].expand(10**8, -1))},
                     "no image is more than")):
                resp = chat(http, {"type": "image_embeds", **part})
                assert resp["status"] == 400 and fragment in resp["error"]["message"], resp
            assert not marker.exists()  # torch.load(weights_only=True) ran nothing
            assert chat(http, image_part)["choices"] == want["choices"]
        assert_no_leaks(llm.engine)
    path = qwen["qwen2_5_vl"]
    (embeds, grid), = hf_image_embeds(path, IMAGES[:1])
    with LLM(path, dtype="float32", max_model_len=512) as llm:
        config = ServerConfig("tiny", enable_mm_embeds=True)
        with TestClient(OpenAIServer(llm.engine, config).app()) as http:
            want = chat(http, image_part)
            for grid_form in (_b64(torch.tensor([grid])), list(grid)):
                got = chat(http, {"type": "image_embeds", "image_embeds": {
                    "image_embeds": _b64(embeds), "image_grid_thw": grid_form}})
                assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert_no_leaks(llm.engine)


def _zip_bomb() -> str:
    """A zip archive of one highly compressed entry: 4 MB from a few KB."""
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * (4 << 20))
    return base64.b64encode(buffer.getvalue()).decode()
