"""vLLM's ``cache_salt``: a request's prompt blocks and its images' encoder outputs are found
only by requests of the same salt (none being a salt of its own), the answers unchanged;
the salt goes with a request's ``n`` completions and a beam search's rounds; the server takes
it on the chat, completions and Responses endpoints and refuses a malformed one."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.engine.request_maker import RequestMaker
from mmserve.entrypoints.api_server import OpenAIServer
from mmserve.entrypoints.serve_args import ServerConfig
from mmserve.errors import InvalidInputError
from tests.conftest import assert_no_leaks, make_image
from tests.test_server import data_url

TEXT = ("describe the picture in detail, the colours, the shapes, where each one is and "
        "what it could be, then say what you would call it")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def llm(clip_llama: str):
    with LLM(clip_llama, dtype="float32", max_model_len=512) as llm:
        yield llm


def _prompt(seed: int, **salt: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image"},
                                                      {"type": "text", "text": TEXT}]}],
            "images": [make_image(seed, (48, 40))], **salt}


def test_only_requests_of_one_salt_share_prefix_blocks_and_encoder_outputs(llm) -> None:
    stats = llm.engine.stats

    def run(**salt: str) -> tuple[str, int, int]:
        encoded = stats()["encoder_items_computed"]
        out = llm.generate([_prompt(7, **salt)], GREEDY)[0]
        return out.text, out.num_cached_tokens, stats()["encoder_items_computed"] - encoded

    first, cached, encoded = run()
    assert cached == 0 and encoded == 1
    runs = {"again": run(), "alice": run(cache_salt="alice"),
            "alice again": run(cache_salt="alice"), "bob": run(cache_salt="bob"),
            "none again": run()}
    assert {text for text, _, _ in runs.values()} == {first}
    hits = {name: (cached > 0, encoded) for name, (_, cached, encoded) in runs.items()}
    assert hits == {"again": (True, 0), "alice": (False, 1), "alice again": (True, 0),
                    "bob": (False, 1), "none again": (True, 0)}
    assert_no_leaks(llm.engine)


def test_the_salt_goes_with_completions_and_beam_rounds(llm) -> None:
    req = llm.engine.process_request(_prompt(3, cache_salt="s1"),
                                     SamplingParams(n=2, max_tokens=4))
    plain = llm.engine.process_request(_prompt(3), SamplingParams(max_tokens=4))
    assert req.cache_salt == "s1" and plain.cache_salt is None
    assert req.images[0].hash != plain.images[0].hash
    children = RequestMaker.fork(req, ["a", "b"])
    beam = RequestMaker.extend(req, [5, 6], GREEDY, "beam")
    for made in (*children, beam):
        assert made.cache_salt == "s1" and made.images == req.images


@pytest.mark.parametrize("salt", ["", 5, ["a"], "x" * 1025, "a\ud800"])
def test_a_malformed_salt_is_refused(llm, salt) -> None:
    with pytest.raises(InvalidInputError) as e:
        llm.engine.process_request(_prompt(1, cache_salt=salt), GREEDY)
    assert e.value.param == "cache_salt"


@pytest.fixture(scope="module")
def http(llm):
    with TestClient(OpenAIServer(llm.engine, ServerConfig("tiny")).app()) as client:
        yield client
    assert_no_leaks(llm.engine)


def _cached(resp) -> int:
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"]


def test_the_server_takes_the_salt_on_each_endpoint(http) -> None:
    image = data_url(make_image(11, (48, 40)))
    chat = {"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": TEXT}]}]}
    assert _cached(http.post("/v1/chat/completions", json=chat)) == 0
    assert _cached(http.post("/v1/chat/completions", json=chat)) > 0
    assert _cached(http.post("/v1/chat/completions", json={**chat, "cache_salt": "t1"})) == 0
    assert _cached(http.post("/v1/chat/completions", json={**chat, "cache_salt": "t1"})) > 0

    completion = {"model": "tiny", "max_tokens": 2, "prompt": [TEXT, TEXT + " twice"]}
    assert _cached(http.post("/v1/completions", json=completion)) > 0  # within the request
    assert _cached(http.post("/v1/completions", json={**completion, "cache_salt": "t2"})) > 0
    assert _cached(http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                       "prompt": TEXT + " again",
                                                       "cache_salt": "t3"})) == 0

    response = {"model": "tiny", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": image}, {"type": "input_text", "text": TEXT}]}]}
    assert _cached(http.post("/v1/responses", json={**response, "cache_salt": "t4"})) == 0
    assert _cached(http.post("/v1/responses", json={**response, "cache_salt": "t4"})) > 0


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"})])
def test_the_server_refuses_a_malformed_salt(http, path: str, body: dict) -> None:
    for salt in ("", 7, "x" * 1025):
        resp = http.post(path, json={"model": "tiny", **body, "cache_salt": salt})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "cache_salt"
