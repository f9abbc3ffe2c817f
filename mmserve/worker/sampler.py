"""Token sampling: one function, with a fast path for all-greedy batches."""

from __future__ import annotations

import torch

from mmserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [num_requests, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    out = greedy.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return out
