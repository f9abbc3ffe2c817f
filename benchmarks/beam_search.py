"""Beam search: mmserve's ``LLM.beam_search`` against transformers' ``generate(num_beams=...)``,
in one run, on the same machine, checkpoint, prompts and images.

Each prompt is a chat turn with one distinct image. transformers searches the prompts in
batches of ``--hf-batch-size`` (left padding), each batch until its search ends; mmserve all at
once (as many searches at a time as ``max_num_seqs // beam_width``). Both include
preprocessing. The report gives each side's time, the sequences' tokens per second (every
returned sequence's tokens), the ratio, and how many prompts got the same sequences, in the
same order, from both (in float32 they must all agree; in bfloat16 near-ties may part them).
mmserve runs each beam's step as a request of one token whose prompt is the beam so far: it
computes the beam's tokens that are not in a full cached block again (fewer than
``--block-size`` a beam a step); the report gives the tokens it computed and the prefix
cache's share of the prompt tokens looked up.

    python benchmarks/beam_search.py                       # the bench checkpoint, float32
    python benchmarks/beam_search.py --num-prompts 32 --beam-width 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from mmserve import LLM, BeamSearchParams
from mmserve.bench.checkpoint import ensure_bench_checkpoint
from mmserve.bench.workload import synthesize_image
from mmserve.testing.oracle import load_hf_processor

QUESTION = "Describe this image in detail."


def hf_search(model_dir: str, prompts: list[tuple[str, object]], width: int, max_tokens: int,
              batch_size: int, dtype: torch.dtype) -> tuple[list[list[list[int]]], float]:
    """transformers' sequences per prompt (new tokens, cut after an end token) and the time."""
    import json
    import pathlib

    import transformers

    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(
        model_dir, dtype=dtype).eval()
    processor = load_hf_processor(model_dir)
    processor.tokenizer.padding_side = "left"
    eos = model.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos])
    found: list[list[list[int]]] = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            inputs = processor(text=[t for t, _ in batch], images=[im for _, im in batch],
                               return_tensors="pt", padding=True)
            out = model.generate(**inputs, do_sample=False, num_beams=width,
                                 num_return_sequences=width, max_new_tokens=max_tokens,
                                 pad_token_id=processor.tokenizer.pad_token_id)
            new = out[:, inputs["input_ids"].shape[1]:].tolist()
            for p in range(len(batch)):
                seqs = []
                for tokens in new[p * width:(p + 1) * width]:
                    length = next((j + 1 for j, t in enumerate(tokens) if t in ends),
                                  len(tokens))
                    seqs.append(tokens[:length])
                found.append(seqs)
    return found, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint, built if needed)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model_dir = args.model or str(ensure_bench_checkpoint())
    rng = random.Random(args.seed)
    images = [synthesize_image(rng, (args.image_size, args.image_size))
              for _ in range(args.num_prompts)]
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              ignore_eos=False)

    with LLM(model_dir, dtype=args.dtype, max_model_len=1024, block_size=args.block_size,
             enable_prefix_caching=True) as llm:
        llm.beam_search({"messages": messages, "images": [images[0]]},
                        BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
        before = llm.stats()
        start = time.perf_counter()
        outs = llm.beam_search([{"messages": messages, "images": [im]} for im in images],
                               params)
        mm_time = time.perf_counter() - start
        after = llm.stats()
    text = load_hf_processor(model_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                            tokenize=False)
    hf, hf_time = hf_search(model_dir, [(text, im) for im in images], args.beam_width,
                            args.max_tokens, args.hf_batch_size, getattr(torch, args.dtype))

    generated = sum(len(s.token_ids) for o in outs for s in o.sequences)
    hf_generated = sum(len(s) for seqs in hf for s in seqs)
    same = sum([s.token_ids for s in o.sequences] == seqs for o, seqs in zip(outs, hf,
                                                                               strict=True))
    computed = after["num_scheduled_tokens"] - before["num_scheduled_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    print(f"{args.num_prompts} prompts, one {args.image_size}x{args.image_size} image each, "
          f"beam width {args.beam_width}, at most {args.max_tokens} tokens, {args.dtype}")
    print(f"transformers  {hf_time:7.2f} s  {hf_generated / hf_time:8.1f} sequence tokens/s "
          f"(batches of {args.hf_batch_size})")
    print(f"mmserve       {mm_time:7.2f} s  {generated / mm_time:8.1f} sequence tokens/s")
    print(f"ratio         {hf_time / mm_time:7.2f}x transformers' speed")
    print(f"same sequences, in the same order: {same} of {args.num_prompts} prompts")
    print(f"mmserve computed {computed} tokens in {after['num_steps'] - before['num_steps']} "
          f"steps; the prefix cache served {hits} of the {queried} prompt tokens looked up "
          f"({hits / max(queried, 1):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
