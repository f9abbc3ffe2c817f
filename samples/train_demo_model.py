"""Train the bundled demo model (``samples/demo-model``) from scratch on the CPU.

The model learns to describe synthetic scenes of coloured shapes (``mmserve.demo.scenes``) and to
answer three kinds of question about them (how many shapes, what colour is the circle, where is
the square). It is a standard ``LlavaForConditionalGeneration`` with a 2-layer CLIP vision tower
and a 3-layer Llama decoder (about 1M parameters), saved in the Hugging Face layout, so that
transformers and mmserve both load it.

Every step draws fresh scenes from a seeded stream, so the model never sees a picture twice, and
the evaluation scenes come from another seed. Training uses the chat format users send: one
``{"type": "image"}`` part and a text part in a user turn, the answer in the assistant turn;
the loss covers the answer and the end-of-sequence token only.

Run from the repository root (about 20-30 minutes on one CPU core with the defaults)::

    nice python samples/train_demo_model.py --out samples/demo-model > train.log 2>&1

Every ``--eval-every`` steps it prints the exact-match accuracy of each task on 200 held-out
scenes and saves the checkpoint, so an interrupted run still leaves a usable model. Exact match
is measured with teacher forcing: greedy decoding reproduces the reference text exactly if and
only if the argmax at every answer position (``</s>`` included) is the reference token, so one
forward pass per batch gives the same number as generating.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from mmserve.demo.recipe import (
    ModelShape,
    build_config,
    build_processor,
    build_tokenizer,
    training_example,
    user_turn,
)
from mmserve.demo.scenes import (
    CAPTION_PROMPTS,
    COLOUR_QUESTIONS,
    COUNT_QUESTIONS,
    WHERE_QUESTIONS,
    Scene,
    generate_scenes,
    random_scene,
)
from mmserve.testing.tiny_checkpoint import EOS_TOKEN

IGNORE_INDEX = -100
EVAL_SEED = 7_000_000  # held-out scenes; the tests evaluate on yet another seed


class Batcher:
    """Turns (scene, prompt, answer) triples into padded model inputs with answer-only labels."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self._prompt_ids: dict[str, list[int]] = {}

    def _prompt(self, text: str) -> list[int]:
        """Token ids of the rendered user turn + generation prompt, image placeholders expanded."""
        if text not in self._prompt_ids:
            from PIL import Image

            rendered = self.processor.apply_chat_template(
                user_turn(text), add_generation_prompt=True, tokenize=False)
            ids = self.processor(text=rendered, images=[Image.new("RGB", (64, 64))])
            self._prompt_ids[text] = ids["input_ids"][0]
        return self._prompt_ids[text]

    def _answer(self, answer: str) -> list[int]:
        return self.tokenizer(answer + EOS_TOKEN, add_special_tokens=False)["input_ids"]

    def check_tokenization(self, scene: Scene, prompt: str, answer: str) -> None:
        """Prompt ids + answer ids must equal the ids of the whole rendered conversation."""
        messages = user_turn(prompt) + [{"role": "assistant", "content": answer}]
        rendered = self.processor.apply_chat_template(messages, tokenize=False)
        whole = self.processor(text=rendered, images=[scene.render()])["input_ids"][0]
        joined = self._prompt(prompt) + self._answer(answer)
        # The rendered conversation ends with a newline after </s>; generation stops before it.
        if whole[:len(joined)] != joined:
            raise RuntimeError("prompt and answer tokenize differently apart than together")

    def __call__(self, items: list[tuple[Scene, str, str]]) -> dict[str, torch.Tensor]:
        pad = self.tokenizer.pad_token_id
        seqs, labels = [], []
        for _, prompt, answer in items:
            p, a = self._prompt(prompt), self._answer(answer)
            seqs.append(p + a)
            labels.append([IGNORE_INDEX] * len(p) + a)
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(items), width), pad, dtype=torch.long)
        label_ids = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, (s, lab) in enumerate(zip(seqs, labels, strict=True)):
            input_ids[i, :len(s)] = torch.tensor(s)
            label_ids[i, :len(s)] = torch.tensor(lab)
            mask[i, :len(s)] = 1
        pixels = self.processor.image_processor(
            [scene.render() for scene, _, _ in items], return_tensors="pt")["pixel_values"]
        return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": pixels,
                "labels": label_ids}


def eval_sets(count: int) -> dict[str, list[tuple[Scene, str, str]]]:
    """Held-out scenes with the first phrasing of each task (the one the tests ask)."""
    scenes = generate_scenes(count, seed=EVAL_SEED)
    rng = random.Random(EVAL_SEED)
    sets: dict[str, list[tuple[Scene, str, str]]] = {
        "caption": [(s, CAPTION_PROMPTS[0], s.caption()) for s in scenes],
        "count": [(s, COUNT_QUESTIONS[0], s.count_answer()) for s in scenes],
        "colour": [], "where": []}
    for s in scenes:
        kind = rng.choice(s.shapes).kind
        sets["colour"].append((s, COLOUR_QUESTIONS[0].format(kind=kind), s.colour_answer(kind)))
        sets["where"].append((s, WHERE_QUESTIONS[0].format(kind=kind), s.where_answer(kind)))
    return sets


@torch.no_grad()
def exact_match(model: Any, batcher: Batcher, items: list[tuple[Scene, str, str]]) -> float:
    """Share of items whose greedy answer is exactly the reference (by teacher forcing)."""
    model.eval()
    correct = 0
    for start in range(0, len(items), 100):
        batch = batcher(items[start:start + 100])
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        predicted = logits[:, :-1].argmax(-1)
        target = batch["labels"][:, 1:]
        scored = target != IGNORE_INDEX
        correct += int(((predicted == target) | ~scored).all(dim=1).sum())
    model.train()
    return correct / len(items)


def save(model: Any, processor: Any, out: Path) -> None:
    from transformers import GenerationConfig

    tok = processor.tokenizer
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    # preprocessor_config.json too, for readers that do not parse processor_config.json.
    processor.image_processor.save_pretrained(out)
    processor.save_pretrained(out)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "demo-model")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="seed of the training scenes")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()

    from transformers import LlavaForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    processor = build_processor(build_tokenizer())
    shape = ModelShape()
    model = LlavaForConditionalGeneration(build_config(len(processor.tokenizer), shape))
    model.train()
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}; {shape}", flush=True)

    batcher = Batcher(processor)
    for _ in range(20):
        scene = random_scene(rng)
        batcher.check_tokenization(scene, *training_example(scene, rng))
    evals = eval_sets(args.eval_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    started = time.perf_counter()
    running = 0.0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        items = []
        for _ in range(args.batch_size):
            scene = random_scene(rng)
            items.append((scene, *training_example(scene, rng)))
        loss = model(**batcher(items)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        done = step + 1
        if done % args.log_every == 0:
            print(f"step {done:5d}  loss {running / args.log_every:.4f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  "
                  f"{time.perf_counter() - started:7.1f}s", flush=True)
            running = 0.0
        if done % args.eval_every == 0 or done == args.steps:
            scores = {task: exact_match(model, batcher, items) for task, items in evals.items()}
            print(f"eval step {done}: " + "  ".join(f"{t} {s:.1%}" for t, s in scores.items()),
                  flush=True)
            save(model, processor, args.out)
    print(f"saved {args.out} after {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
