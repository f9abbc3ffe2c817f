"""Sampling: greedy fast path, temperature, top-k and top-p filters, per-request generators."""

from __future__ import annotations

import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import sample, sample_each


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


def test_the_smallest_top_p_keeps_the_most_likely_token() -> None:
    # 5e-324 (the smallest double) is 0 in float32: every token's mass before it reaches
    # that, and the most likely token must stay (it was dropped too: probabilities not finite).
    logits = torch.randn(3, 600, generator=torch.Generator().manual_seed(4))
    for top_p in (5e-324, 1e-30, 1e-6):
        params = [SamplingParams(top_p=top_p, temperature=2.0)] * 3
        assert sample_each(logits, params, lambda i: _gens(3)[i]) == logits.argmax(-1).tolist()


def test_a_seeded_generator_makes_a_draw_reproducible() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0)]
    first = [sample(logits, params, _gens(1, seed=7))[0] for _ in range(3)]
    assert len(set(first)) == 1
    gen = _gens(1, seed=7)[0]
    stream = [sample(logits, params, [gen])[0] for _ in range(20)]
    assert len(set(stream)) > 1  # one generator advances: successive draws differ
    assert first[0] == stream[0]


def test_draws_follow_the_distribution() -> None:
    """The exponential race draws each token with its probability: 40,000 rows sharing one
    generator, as unseeded requests do, within 1.5 points of each probability."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 40_000
    logits = p.log().expand(rows, 4).contiguous()
    shared = torch.Generator().manual_seed(0)
    tokens = sample_each(logits, [SamplingParams(temperature=1.0)] * rows, lambda i: shared)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / rows
    assert (freq - p).abs().max() < 0.015, freq
    hot = sample_each(logits[:rows // 4], [SamplingParams(temperature=2.0)] * (rows // 4),
                      lambda i: shared)  # temperature 2: probabilities ~ sqrt(p)
    freq = torch.bincount(torch.tensor(hot), minlength=4).float() / (rows // 4)
    assert (freq - p.sqrt() / p.sqrt().sum()).abs().max() < 0.02, freq


def test_each_row_keeps_its_own_filters_in_one_batch() -> None:
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.2), SamplingParams(),
              SamplingParams(temperature=0.0), SamplingParams(top_k=10, top_p=0.5),
              SamplingParams(top_k=1, temperature=1.5)]
    allowed = []
    for row, p in zip(logits, params, strict=True):
        probs = row.softmax(-1)
        order = probs.argsort(descending=True)
        keep = order[:p.top_k] if p.top_k else order
        if p.top_p < 1:
            cut = (probs[keep].cumsum(0) - probs[keep] < p.top_p).sum()
            keep = keep[:cut]
        allowed.append(set(keep.tolist()) if not p.greedy else {int(row.argmax())})
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens = sample_each(logits, params, lambda i: gen)
        assert all(t in a for t, a in zip(tokens, allowed, strict=True))
    free = {sample_each(logits[2:3], params[2:3], lambda i: gen)[0] for _ in range(200)}
    assert len(free) > 20  # no filter: draws spread over the vocabulary


def test_a_seeded_row_draws_the_same_whatever_shares_the_batch() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(10))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (3, 4)] + [
        SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_p=0.9)]
    shared = torch.Generator().manual_seed(99)

    def generators(i: int) -> torch.Generator:
        seed = params[i].seed
        return shared if seed is None else torch.Generator().manual_seed(seed)

    together = sample_each(logits, params, generators)
    alone = [sample_each(logits[i:i + 1], params[i:i + 1],
                         lambda _, i=i: generators(i))[0] for i in (0, 1)]
    assert together[:2] == alone


def test_a_row_that_fails_fails_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(11))
    logits[1] = float("nan")
    gen = torch.Generator().manual_seed(0)

    def generators(i: int) -> torch.Generator:
        if i == 2:
            raise RuntimeError("this generator cannot take its seed")
        return gen

    out = sample_each(logits, [SamplingParams(temperature=1.0)] * 3, generators)
    assert isinstance(out[0], int)
    assert isinstance(out[1], RuntimeError) and "not finite" in str(out[1])
    assert isinstance(out[2], RuntimeError) and "cannot take its seed" in str(out[2])


def test_the_nucleus_is_the_same_found_among_the_best_tokens_or_by_a_full_sort() -> None:
    """On the CPU top_p looks among the 256 most likely tokens first: a peaked row's nucleus
    is found there, a flat row's needs the sorted vocabulary; both as a full sort keeps."""
    from mmserve.worker.sampler import _top_p

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 5000, generator=gen)
    x[0] *= 12  # peaked: a nucleus of a few tokens
    x[2] *= 12
    top_ps = [0.9, 0.9, 0.5, 1.0]  # row 1 flat: thousands of tokens; row 3 unfiltered
    got = _top_p(x, top_ps)
    for row, p in enumerate(top_ps):
        probs = x[row].softmax(-1)
        order = probs.argsort(descending=True)
        if p < 1.0:
            cut = int((probs[order].cumsum(0) - probs[order] < p).sum())
            expected = set(order[:cut].tolist())
        else:
            expected = set(range(5000))
        assert set(torch.isfinite(got[row]).nonzero().flatten().tolist()) == expected, row
    assert torch.isfinite(got[1]).sum() > 256  # the flat row went past the first candidates


def test_one_bad_logit_makes_the_row_not_finite() -> None:
    """A single NaN or infinite logit, or every token at -inf, fails the row (its total
    probability is not finite), not its neighbours."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(12))
    logits[0, 7] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")
    logits[3, :40] = float("-inf")  # some tokens ruled out: fine
    out = sample_each(logits, [SamplingParams(temperature=1.0)] * 5,
                      lambda i: torch.Generator().manual_seed(i))
    assert all(isinstance(out[i], RuntimeError) and "not finite" in str(out[i])
               for i in range(3))
    assert isinstance(out[3], int) and out[3] >= 40 and isinstance(out[4], int)


def test_bfloat16_logits_draw_what_their_float32_values_draw() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(13))
    logits = logits.to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(top_k=5, seed=2), SamplingParams(top_p=0.8, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, seed=4)]
    for _ in range(3):
        assert (sample(logits, params, _gens(6)) == sample(logits.float(), params, _gens(6)))
