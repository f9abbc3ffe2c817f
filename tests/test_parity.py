"""Greedy float32 output equals transformers' generate(), token for token.

Each setting runs a batch of 8 requests mixing 0, 1 and 2 images of different sizes and prompt
lengths through mmserve, and checks the stats that prove the setting did what it claims
(an image split across steps, preemptions, encoder and prefix cache hits).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers import AutoProcessor

from mmserve import LLM, SamplingParams
from mmserve.kernels import cpu_ops
from mmserve.models.llama import DecoderLayer
from mmserve.testing.oracle import hf_greedy_generate
from tests.conftest import ARCHS, assert_no_leaks, generate_all_at_once, make_image, record_steps

MAX_TOKENS = 12
IMAGES = [make_image(i, size) for i, size in enumerate(
    [(40, 30), (64, 64), (23, 57), (100, 41), (32, 32)])]
SYSTEM = ("You are a careful assistant who looks at every picture closely and answers "
          "questions about shapes, colours and positions in short sentences.")


def _conversation(text: str, n_images: int, system: bool = False) -> list[dict]:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    return messages + [{"role": "user", "content": content}]


def mixed_batch() -> list[dict]:
    """8 requests: 0, 1 and 2 images, distinct images, prompt lengths from short to long."""
    texts = ["hi", "what is in this picture?", "describe both of these images in detail",
             "tell me a long story about a red fox and a blue bird who live near the river "
             "and the mountain, with many words", "compare", "count the shapes", "ok",
             "where is the square and what colour is the circle on the left side"]
    layout = [(0, []), (1, [0]), (2, [1, 2]), (0, []), (2, [3, 4]), (1, [2]), (1, [4]), (0, [])]
    return [{"messages": _conversation(t, n), "images": [IMAGES[i] for i in imgs]}
            for t, (n, imgs) in zip(texts, layout, strict=True)]


def shared_batch() -> list[dict]:
    """8 requests sharing a long system prompt and reusing 3 distinct images."""
    texts = ["what is this?", "describe it", "and this one?", "compare them", "colours?",
             "what is this?", "shapes?", "hello"]
    layout = [[0], [1], [0], [1, 2], [2], [0], [], [2, 0]]
    return [{"messages": _conversation(t, len(imgs), system=True),
             "images": [IMAGES[i] for i in imgs]}
            for t, imgs in zip(texts, layout, strict=True)]


@functools.cache
def _processor(path: str):
    return AutoProcessor.from_pretrained(path, local_files_only=True)


def reference(path: str, prompts: list[dict]) -> list[list[int]]:
    """transformers' greedy generate, one request at a time (no padding effects)."""
    out = []
    for p in prompts:
        text = _processor(path).apply_chat_template(p["messages"], add_generation_prompt=True,
                                                   tokenize=False)
        out.append(hf_greedy_generate(path, text, p["images"], MAX_TOKENS))
    return out


def run(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_no_leaks(llm.engine)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_chunked_prefill_splits_images(checkpoints: dict[str, str], arch: str) -> None:
    path = checkpoints[arch]
    prompts = mixed_batch()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=4)
    steps = record_steps(llm)
    assert run(llm, prompts) == reference(path, prompts)
    tokens_per_image = llm.engine.processor.tokens_per_image
    split = [s for out in steps for r in out.requests for s in r.image_slices
             if s.length < tokens_per_image]
    assert split, "no image placeholder range was split across steps"
    # The scheduler's messages name the images to encode by hash and token count; the pixels
    # travel apart (ModelRunner.execute's encoder_pixels).
    encoded = [n for out in steps for n in out.images_to_encode.values()]
    assert encoded and all(n == tokens_per_image for n in encoded)
    assert all(0 < out.num_scheduled_tokens <= 24 for out in steps if out.requests)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_under_preemption(checkpoints: dict[str, str], arch: str) -> None:
    path = checkpoints[arch]
    prompts = mixed_batch()
    # 8 blocks of 16 tokens: one long request fits, eight at once do not. Scheduled in step
    # (scheduled ahead, as on a GPU by default, nobody is preempted: test_async_scheduling.py).
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=128, max_num_seqs=8,
              kv_cache_memory=8 * 16 * _kv_bytes_per_token(path), enable_prefix_caching=False,
              async_scheduling=False)
    assert llm.engine.plan.num_blocks == 8
    outs = generate_all_at_once(llm, prompts, SamplingParams(max_tokens=MAX_TOKENS,
                                                             temperature=0.0))
    assert_no_leaks(llm.engine)
    assert [o.token_ids for o in outs] == reference(path, prompts)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_with_encoder_and_prefix_cache_hits(checkpoints: dict[str, str],
                                                   arch: str) -> None:
    path = checkpoints[arch]
    prompts = shared_batch()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64, max_num_seqs=3)
    assert run(llm, prompts) == reference(path, prompts)
    stats = llm.stats()
    assert stats["encoder_cache_hits"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["encoder_items_computed"] == 3  # one encoder run per distinct image


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_when_the_last_layer_computes_only_sampled_rows(checkpoints: dict[str, str],
                                                              arch: str) -> None:
    """Prompt chunks go through the decoder's last layer as keys and values only: its MLP
    sees the rows the step samples (none for a chunk that ends mid-prompt), the first layer's
    every row, and the tokens stay transformers'. A step with a request asking for prompt
    log-probabilities computes every row, and those equal the runner's with the saving off.
    Eager, so that every step's forward pass calls the hooks (a CUDA graph's replay does not;
    the CUDA runner's own test covers replays)."""
    path = checkpoints[arch]
    prompts = mixed_batch()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=4,
              enforce_eager=True)
    steps = record_steps(llm)
    first, *_, last = (m for m in llm.engine.model.modules() if isinstance(m, DecoderLayer))
    rows: dict[str, list[int]] = {"first": [], "last": []}
    first.mlp.register_forward_hook(lambda m, args, out: rows["first"].append(len(args[0])))
    last.mlp.register_forward_hook(lambda m, args, out: rows["last"].append(len(args[0])))
    assert run(llm, prompts) == reference(path, prompts)
    forwards = [s for s in steps if s.requests]
    assert rows["first"] == [s.num_scheduled_tokens for s in forwards]
    assert rows["last"] == [sum(r.sample for r in s.requests) for s in forwards]
    assert any(n < m for n, m in zip(rows["last"], rows["first"], strict=True))

    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    with_saving = llm.generate(prompts[3], params)[0]
    llm.engine.runner.computes_sampled_rows_only = False
    without = llm.generate(prompts[3], params)[0]
    assert with_saving.prompt_logprobs and with_saving.token_ids == without.token_ids
    assert with_saving.prompt_logprobs == without.prompt_logprobs


def test_a_decoder_that_ignores_output_rows_fails_its_requests_clearly(clip_llama: str,
                                                                      monkeypatch) -> None:
    """A decoder that returns every row where the runner named output rows would sample from
    the wrong rows: the runner refuses its result, and the requests end with an error saying
    why, instead of with wrong tokens."""
    from mmserve.models import forward_context, llama

    def without_output_rows():
        return dataclasses.replace(forward_context.get_forward_context(), output_rows=None)

    llm = LLM(clip_llama, dtype="float32")
    monkeypatch.setattr(llama, "get_forward_context", without_output_rows)
    out = llm.generate(mixed_batch()[1], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.finish_reason == "error" and "output_rows" in out.error
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kernel_path", cpu_ops.supported_paths())
def test_parity_on_every_cpu_kernel_path(checkpoints: dict[str, str], kernel_path: str) -> None:
    """Each CPU kernel path this machine runs (``MMSERVE_CPU_KERNELS``) keeps the tokens
    equal, chunked prefill splitting images included."""
    path = checkpoints["siglip-qwen2"]
    prompts = mixed_batch()
    with cpu_ops.using_path(kernel_path):
        llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=24,
                  max_num_seqs=4)
        linear = cpu_ops.float32_linear()
        assert run(llm, prompts) == reference(path, prompts)
    layers = [type(m) for m in llm.engine.model.modules()]
    assert (linear or torch.nn.Linear) in layers


def test_parity_messages_and_raw_prompt_agree(clip_llama: str) -> None:
    """The raw-prompt form (model's own format) gives the same tokens as the chat form."""
    llm = LLM(clip_llama, dtype="float32")
    chat = mixed_batch()[2]
    text = _processor(clip_llama).apply_chat_template(chat["messages"],
                                                      add_generation_prompt=True, tokenize=False)
    raw = {"prompt": text, "images": chat["images"]}
    assert run(llm, [raw]) == run(llm, [chat])


def _kv_bytes_per_token(path: str) -> int:
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path).text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4
