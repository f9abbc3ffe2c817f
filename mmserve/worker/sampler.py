"""Token sampling, batched: one pass over the rows that sample, whatever their parameters.

Temperature, min-p, top-k and top-p apply to all those rows at once (a row's own values, or no
filter), and each row draws its token by inverse transform: one uniform variate against its
cumulative probabilities. The variate comes from the row's generator: a seeded request's own
(so it draws what it draws alone, whatever shares the step), or, for the others, one draw of
the runner's shared generator for all of them. The results reach Python in one transfer, with
no per-row synchronization on a GPU, and nothing in it can assert on the device as
``multinomial`` does on probabilities that are not finite. ``sample_on_device`` leaves them on
the device, their transfer started (``SampledTokens``), for a runner that writes them into the
next step's inputs there and hands them to Python once the next step is launched.

A row that fails (a generator that cannot take its seed, probabilities that are not finite)
fails alone: ``sample_each`` returns its exception in its place, so the runner fails that
request and no other, without running the forward pass again or drawing again from the other
rows' generators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.kernels import cpu_ops
from mmserve.kernels.transfer import tensor_on, to_device
from mmserve.sampling_params import SamplingParams
from mmserve.step import TokenLogprobs


@dataclass
class SampledTokens:
    """A step's sampled tokens as the device holds them, on their way to the host.

    ``sample_on_device`` starts their copy to pinned host memory behind the sampling kernels
    on the launching thread's stream, and ``to_list`` waits for that copy alone: on a GPU the
    tokens are turned into Python after the next step is launched, while it computes (a plain
    ``.tolist()`` on the default stream would wait for that step too).
    """

    tokens: torch.Tensor  # [rows] on the device, what later steps read their inputs from
    params: list[SamplingParams]
    errors: dict[int, Exception]  # rows whose generator could not be made
    _host: torch.Tensor  # [1 or 2, rows]: the tokens, and whether each row's draw was finite
    _copied: torch.cuda.Event | None  # recorded after the copy (on a GPU)

    def to_list(self) -> list[int | Exception]:
        """The next token of every row, or the exception its sampling raised."""
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._host.tolist()
        values, oks = rows[0], rows[1] if len(rows) > 1 else None
        if oks is None and not self.errors:
            return values
        out: list[int | Exception] = []
        for i, (p, value) in enumerate(zip(self.params, values, strict=True)):
            if i in self.errors:
                out.append(self.errors[i])
            elif oks is None or oks[i] or p.greedy:
                out.append(value)
            else:
                out.append(RuntimeError(
                    f"the sampling probabilities are not finite (temperature={p.temperature:g}"
                    f", top_k={p.top_k}, top_p={p.top_p:g})"))
        return out


def sample_each(
    logits: torch.Tensor,  # [num_requests, vocab]
    params: list[SamplingParams],
    generator: Callable[[int], torch.Generator],  # row -> its generator, made on demand
) -> list[int | Exception]:
    """The next token of every row, or the exception its sampling raised."""
    return sample_on_device(logits, params, generator).to_list()


def sample_on_device(
    logits: torch.Tensor,  # [num_requests, vocab]
    params: list[SamplingParams],
    generator: Callable[[int], torch.Generator],  # row -> its generator, made on demand
) -> SampledTokens:
    """``sample_each``'s tokens, left on the device with their copy to the host started."""
    greedy = _argmax(logits)
    if all(p.greedy for p in params):
        return _to_host(greedy, params, {}, greedy.unsqueeze(0))
    errors: dict[int, Exception] = {}
    generators: dict[int, torch.Generator] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            try:
                generators[i] = generator(i)
            except Exception as e:  # noqa: BLE001 (handed back for this row alone)
                errors[i] = e
    rows = list(generators)
    tokens, finite = greedy, torch.ones_like(greedy)
    if rows:
        index = tensor_on(rows, torch.long, logits.device)
        drawn, ok = _sample_rows(logits.index_select(0, index), [params[i] for i in rows],
                                 [generators[i] for i in rows])
        tokens = tokens.index_copy(0, index, drawn)
        finite = finite.index_copy(0, index, ok.long())
    return _to_host(tokens, params, errors, torch.stack([tokens, finite]))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax`` (its first maximum, or first NaN): on the CPU the compiled
    kernel's where it is loaded (rows in parallel, a tenth of torch's time at 16 rows of a
    32,000-token vocabulary), which gives torch's answer."""
    if (ops := cpu_ops.fused_kernels(logits)) is not None and logits.stride(-1) == 1:
        return ops.argmax_rows(logits)
    if logits.device.type == "cpu":  # torch's CPU argmax over bfloat16 takes 4x as long as
        logits = logits.float()  # this copy and an argmax over float32 together
    return logits.argmax(dim=-1)


def _to_host(tokens: torch.Tensor, params: list[SamplingParams], errors: dict[int, Exception],
             rows: torch.Tensor) -> SampledTokens:
    """``rows`` copied to the host: on a GPU into pinned memory, without waiting."""
    host, copied = _copy_to_host(rows)
    return SampledTokens(tokens, params, errors, host[0], copied)


def _copy_to_host(*tensors: torch.Tensor
                  ) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """``tensors`` on the host, and on a GPU the event recorded after their copies, which
    are queued into pinned memory behind the work that computes them (the thread goes on;
    it waits on the event when it needs the values). On the CPU, the tensors themselves."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    copied = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, leaving the core
    copied.record()
    return tuple(hosts), copied


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a token for each row: the tokens, and whether each row's probabilities were
    finite (where they are not, its token means nothing)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = tensor_on([p.temperature for p in params], torch.float32, device)
    x = logits.float() / temperature.unsqueeze(1)
    if any(p.min_p for p in params):
        x = _min_p(x, [p.min_p for p in params])
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):  # keep each row's k best (ties with the k-th included)
        top = x.topk(max(ks), dim=-1).values
        k = tensor_on([k or 1 for k in ks], torch.long, device)
        kth = top.gather(1, (k - 1).unsqueeze(1))
        filtered = tensor_on([k > 0 for k in ks], torch.bool, device).unsqueeze(1)
        x = x.masked_fill(filtered & (x < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        x = _top_p(x, [p.top_p for p in params])
    # Inverse transform: the first token whose cumulative probability passes a uniform
    # variate times the row's total (side="right": a token of probability 0 spans nothing and
    # is never drawn). A row with a NaN or an infinite logit, or with every token filtered
    # out, has probabilities, and so a total, that are NaN: not finite.
    cdf = x.softmax(-1).cumsum(-1)
    total = cdf[:, -1]
    finite = torch.isfinite(total)
    u = torch.empty(len(generators), 1, device=device)
    rows_of: dict[int, list[int]] = {}  # generator -> the rows that draw from it, in order
    for row, gen in enumerate(generators):
        rows_of.setdefault(id(gen), []).append(row)
    for rows in rows_of.values():
        gen = generators[rows[0]]
        if len(rows) == len(generators):
            u.uniform_(generator=gen)
        else:
            u[tensor_on(rows, torch.long, device)] = torch.empty(
                len(rows), 1, device=device).uniform_(generator=gen)
    tokens = torch.searchsorted(cdf, u * total.unsqueeze(1), right=True).squeeze(1)
    return tokens.clamp_(max=vocab - 1), finite


def _min_p(x: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """``x`` with each row's tokens less likely than its ``min_p`` times its most likely
    token's probability at -inf (rows with min_p 0 keep every token; the most likely token
    is always kept)."""
    probs = x.softmax(-1)
    top = probs.max(dim=-1, keepdim=True).values
    min_p = tensor_on(min_ps, torch.float32, x.device).unsqueeze(1)
    return x.masked_fill(probs < min_p * top, float("-inf"))


# The nucleus is looked for among this many of the most likely tokens first (on the CPU), and
# in the whole sorted vocabulary only when a row's fall short of its top_p: with the peaked
# distributions of language models it is rarely needed, and sorting whole rows costs more than
# the rest of sampling.
_NUCLEUS_CANDIDATES = 256


def _top_p(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """``x`` with the tokens outside each row's nucleus at -inf: the fewest most likely
    tokens whose probabilities reach its top_p (rows with top_p 1 keep every token)."""
    device, vocab = x.device, x.shape[-1]
    top_p = tensor_on(top_ps, torch.float32, device).unsqueeze(1)
    filtered = top_p < 1.0
    probs = x.softmax(-1)
    top, order = None, None
    if device.type == "cpu" and vocab > _NUCLEUS_CANDIDATES:  # a GPU sorts, never waiting
        top, order = probs.topk(_NUCLEUS_CANDIDATES, dim=-1)  # sorted, most likely first
        if not bool(((top.sum(-1, keepdim=True) >= top_p) | ~filtered).all()):
            top = None
    if top is None:
        top, order = probs.sort(dim=-1, descending=True)
    # Drop a token when the tokens ranked above it already reach top_p; never the most likely
    # (a top_p below float32's smallest number reads as 0, which nothing falls short of).
    drop = top.cumsum(-1) - top >= top_p
    drop[:, 0] = False
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, ~drop) | ~filtered
    return x.masked_fill(~keep, float("-inf"))


def apply_token_bitmasks(logits: torch.Tensor, rows: list[int],
                         bitmasks: list[torch.Tensor]) -> torch.Tensor:
    """``logits`` with every token that row ``rows[i]``'s packed bitmask ``bitmasks[i]``
    leaves out (bit ``j`` of int32 word ``w``: token ``32 * w + j``) set to -inf: a new tensor,
    the raw logits stay for the log-probabilities."""
    vocab = logits.shape[-1]
    words = to_device(torch.stack(bitmasks).to(torch.int32), logits.device)  # [rows, words]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = tensor_on(rows, torch.long, logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


@dataclass
class LogprobTensors:
    """Rows' log-probabilities as the device computed them, on their way to the host (as
    ``SampledTokens``): ``to_list`` waits for their copy alone."""

    num_top: list[int]
    _values: torch.Tensor  # [rows, 1 + top]: each row's token's log-probability, then the top
    _ids: torch.Tensor  # [rows, 1 + top]: the token's rank, then the top tokens
    _copied: torch.cuda.Event | None

    def to_list(self) -> list[TokenLogprobs]:
        if self._copied is not None:
            self._copied.synchronize()
        values, ids = self._values.tolist(), self._ids.tolist()
        return [TokenLogprobs(values[i][0], ids[i][0],
                              tuple(zip(ids[i][1:n + 1], values[i][1:n + 1], strict=True)))
                for i, n in enumerate(self.num_top)]


def logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor,
                       num_top: list[int]) -> LogprobTensors:
    """Row ``i``'s log-probabilities (log-softmax of its logits, in float32): of ``tokens[i]``
    (a tensor on the logits' device), its rank, and the ``num_top[i]`` most likely tokens.
    One pass for the whole batch; the results' copy to the host is started, not waited for."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    top_values, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)
    (values, ids), copied = _copy_to_host(torch.cat([chosen, top_values], dim=1),
                                          torch.cat([ranks, top_ids], dim=1))
    return LogprobTensors(num_top, values, ids, copied)


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   num_top: list[int]) -> list[TokenLogprobs]:
    """``logprobs_on_device`` for tokens known in Python, brought to Python."""
    return logprobs_on_device(logits, tensor_on(tokens, torch.long, logits.device),
                              num_top).to_list()


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
