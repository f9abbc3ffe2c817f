"""Token sampling: one function, with a fast path for all-greedy batches.

Rows are sampled one by one after the greedy fast path, and a row that fails (a generator
that cannot take its seed, probabilities that are not finite) fails alone: ``sample_each``
returns its exception in its place, so the runner fails that request and no other, without
running the forward pass again or drawing again from the other rows' generators.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmserve.sampling_params import SamplingParams
from mmserve.step import TokenLogprobs


def sample_each(
    logits: torch.Tensor,  # [num_requests, vocab]
    params: list[SamplingParams],
    generator: Callable[[int], torch.Generator],  # row -> its generator, made on demand
) -> list[int | Exception]:
    """The next token of every row, or the exception its sampling raised."""
    greedy = logits.argmax(dim=-1).tolist()
    if all(p.greedy for p in params):
        return greedy
    out: list[int | Exception] = list(greedy)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            out[i] = _sample_row(logits[i], p, generator(i))
        except Exception as e:  # noqa: BLE001 (handed back for this row alone)
            out[i] = e
    return out


def apply_token_bitmasks(logits: torch.Tensor, rows: list[int],
                         bitmasks: list[torch.Tensor]) -> torch.Tensor:
    """``logits`` with every token that row ``rows[i]``'s packed bitmask ``bitmasks[i]``
    leaves out (bit ``j`` of int32 word ``w``: token ``32 * w + j``) set to -inf: a new tensor,
    the raw logits stay for the log-probabilities."""
    vocab = logits.shape[-1]
    words = torch.stack(bitmasks).to(logits.device, torch.int32)  # [rows, ceil(vocab / 32)]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   num_top: list[int]) -> list[TokenLogprobs]:
    """Row ``i``'s log-probabilities (log-softmax of its logits, in float32): of ``tokens[i]``,
    its rank, and the ``num_top[i]`` most likely tokens. One pass for the whole batch."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    values_l, ids_l = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen_l[i], ranks_l[i],
                          tuple(zip(ids_l[i][:n], values_l[i][:n], strict=True)))
            for i, n in enumerate(num_top)]


def sample(
    logits: torch.Tensor,  # [num_requests, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """``sample_each`` for callers that want the first failure raised."""
    tokens = sample_each(logits, params, generators.__getitem__)
    for t in tokens:
        if isinstance(t, Exception):
            raise t
    return tokens  # type: ignore[return-value]


def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    row = row.float() / p.temperature
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
    # Checked first: on a GPU, multinomial asserts on the device, which ends every later CUDA
    # call in the process, not just this row.
    if not bool(torch.isfinite(probs).all()):
        raise RuntimeError(f"the sampling probabilities are not finite "
                           f"(temperature={p.temperature:g}, top_k={p.top_k}, top_p={p.top_p:g})")
    return int(torch.multinomial(probs, 1, generator=generator))
