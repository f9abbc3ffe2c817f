"""Embeddings: mmserve's ``LLM.embed`` against transformers' forward pass, in one run, on the
same machine, checkpoint, prompts and images (new ones each round, so that mmserve's
encoder cache finds none).

Each prompt is a chat turn with one distinct image and a line of text; its embedding is the
final hidden state of its last token (``normalize=False`` on mmserve's side, so the two are
compared as computed). transformers runs the prompts in batches of ``--hf-batch-size`` (right
padding: each row's last real token is read, which no padding precedes); mmserve all at once,
prefix caching off so that every prompt is computed. Both include preprocessing. The report
gives each side's prompts per second, the ratio, and the largest difference between the two
sides' embeddings (float32: up to the order of sums).

    python benchmarks/embeddings.py                       # the bench checkpoint, float32
    python benchmarks/embeddings.py --num-prompts 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch

from mmserve import LLM
from mmserve.bench.checkpoint import ensure_bench_checkpoint
from mmserve.bench.workload import synthesize_image
from mmserve.testing.oracle import load_hf_processor


def hf_embeddings(model_dir: str, texts: list[str], images: list, batch_size: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """transformers' last-token hidden states ``[prompts, hidden]`` and the time they took."""
    import transformers

    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(
        model_dir, dtype=dtype).eval()
    processor = load_hf_processor(model_dir)
    processor.tokenizer.padding_side = "right"
    found = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            inputs = processor(text=texts[i:i + batch_size], images=images[i:i + batch_size],
                               return_tensors="pt", padding=True)
            hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]
            last = inputs["attention_mask"].sum(dim=1) - 1
            found.append(hidden[torch.arange(hidden.shape[0]), last].float())
    return torch.cat(found), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint, built if needed)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="each side, alternating")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model_dir = args.model or str(ensure_bench_checkpoint())
    rng = random.Random(args.seed)
    messages = [[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": f"Image {i}: summarize it in one word."}]}]
        for i in range(args.num_prompts)]
    template = load_hf_processor(model_dir)
    texts = [template.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
             for m in messages]

    def new_images() -> list:  # (every round its own: the encoder cache finds none of them)
        return [synthesize_image(rng, (args.image_size, args.image_size))
                for _ in range(args.num_prompts)]

    print(f"{args.num_prompts} prompts, one {args.image_size}x{args.image_size} image each, "
          f"{args.dtype}")
    with LLM(model_dir, dtype=args.dtype, enable_prefix_caching=False) as llm:
        llm.embed([{"messages": m, "images": [im]}  # warm-up: the first batch takes longer
                   for m, im in zip(messages, new_images(), strict=True)])
        for round_ in range(args.rounds):
            images = new_images()
            prompts = [{"messages": m, "images": [im]}
                       for m, im in zip(messages, images, strict=True)]
            hits = llm.stats()["encoder_cache_hits"]
            start = time.perf_counter()
            outs = llm.embed(prompts, normalize=False)
            mm_time = time.perf_counter() - start
            assert llm.stats()["encoder_cache_hits"] == hits  # (each image encoded)
            ours = torch.tensor([o.outputs.embedding for o in outs])
            theirs, hf_time = hf_embeddings(model_dir, texts, images, args.hf_batch_size,
                                            getattr(torch, args.dtype))
            print(f"round {round_ + 1}: transformers {args.num_prompts / hf_time:7.2f} "
                  f"prompts/s (batches of {args.hf_batch_size}), mmserve "
                  f"{args.num_prompts / mm_time:7.2f} prompts/s, ratio "
                  f"{hf_time / mm_time:5.2f}x; largest difference "
                  f"{(ours - theirs).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
