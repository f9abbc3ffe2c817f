"""Sampling: greedy fast path, temperature, top-k and top-p filters, per-request generators."""

from __future__ import annotations

import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import sample


def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_all_greedy_batch_is_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(top_k=1)]
    assert sample(logits, params, _gens(5)) == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    out = sample(logits, params, _gens(4))
    greedy = logits.argmax(-1).tolist()
    assert out[0] == greedy[0] and out[2] == greedy[2]


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    best = set(torch.topk(logits[0], 5).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, [SamplingParams(top_k=5, temperature=5.0)], [gen])[0]
             for _ in range(200)}
    assert draws <= best
    assert len(draws) > 1  # a high temperature spreads over the allowed set


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    gen = torch.Generator().manual_seed(0)
    draws = [sample(logits, [SamplingParams(top_p=0.7)], [gen])[0] for _ in range(300)]
    assert set(draws) == {0, 1}
    # The kept mass is renormalised: token 0 about 0.5 / 0.8 of the time.
    assert 0.5 < draws.count(0) / len(draws) < 0.75


def test_a_seeded_generator_makes_a_draw_reproducible() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0)]
    first = [sample(logits, params, _gens(1, seed=7))[0] for _ in range(3)]
    assert len(set(first)) == 1
    gen = _gens(1, seed=7)[0]
    stream = [sample(logits, params, [gen])[0] for _ in range(20)]
    assert len(set(stream)) > 1  # one generator advances: successive draws differ
    assert first[0] == stream[0]
