"""Device-agnostic model runner: encoder runs, input preparation, forward, sampling.

Device classes only decide where tensors live and how memory is measured; everything that
turns a SchedulerOutput (and the pixels of the images it encodes) into a forward pass is here.
The runner reads its step messages from ``mmserve/step.py`` and nothing of the engine.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.inputs import IMAGE_EMBEDS, PIXEL_ARITHMETIC, EncoderInput
from mmserve.kernels.cpu_ops import cpu_attention_backend, pack_linear_layers
from mmserve.kernels.paged_attention import (
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
    write_kv_cache,
)
from mmserve.kernels.transfer import (
    host_tensor,
    int_tensor,
    tensor_on,
    to_device,
    to_device_all,
)
from mmserve.models import parallel
from mmserve.models.forward_context import AttentionBackend, OutputRows, forward_context
from mmserve.models.lora import LoRARows, attach_lora, read_adapter
from mmserve.models.parallel import CollectiveError
from mmserve.profiling import phase
from mmserve.sampling_params import SamplingParams
from mmserve.step import (
    PENDING_TOKEN,
    DecodeRows,
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from mmserve.worker.block_tables import BlockTables
from mmserve.worker.busy_timer import BusyTimer
from mmserve.worker.cpu_allocator import (
    advise_huge_pages,
    keep_freed_memory,
    release_free_memory,
)
from mmserve.worker.cpu_threads import AdaptiveThreads, restore_threads
from mmserve.worker.logits_adjust import TokenHistory, adjust_logits
from mmserve.worker.memory_profiler import track_peak_bytes
from mmserve.worker.sampler import (
    LogprobTensors,
    SampledTokens,
    apply_token_bitmasks,
    logprobs_on_device,
    sample_on_device,
    token_logprobs,
)

logger = logging.getLogger(__name__)

# Prompt rows whose vocabulary-wide logits are computed at once for prompt logprobs.
PROMPT_LOGPROB_ROWS = 256

# The encoder inputs of the images a step encodes, by image hash: each image's named tensors as
# its family's processing made them ("pixel_values", and e.g. "image_grid_thw"); the engine
# gathers them from the requests that show the images (the scheduler's messages carry only the
# hashes).
EncoderPixels = Mapping[str, Mapping[str, torch.Tensor]]


@dataclass
class DeferredTokens:
    """A step's sampled tokens left on the device: the rows' requests, their tokens, and for
    a step with rows that ask for log-probabilities, what computes those from the tokens."""

    request_ids: list[str]
    drawn: SampledTokens
    # The tokens -> the rows' log-probabilities, and the requests whose computation failed.
    logprobs: Callable[[list[int | Exception]],
                       tuple[dict[str, TokenLogprobs], dict[str, str]]] | None = None

    def collect(self, out: ModelOutput) -> None:
        """The tokens (and log-probabilities) into ``out``, once the device has them."""
        tokens = self.drawn.to_list()
        for rid, token in zip(self.request_ids, tokens, strict=True):
            if isinstance(token, Exception):
                out.errors[rid] = _reason(token)
                logger.error("sampling failed for request %s: %s", rid, _reason(token))
            else:
                out.sampled[rid] = token
        if self.logprobs is not None:
            logprobs, failed = self.logprobs(tokens)
            out.logprobs.update(logprobs)
            for rid, reason in failed.items():  # as a failed step's rerun alone: no token
                out.sampled.pop(rid, None)
                out.errors[rid] = reason


@dataclass
class PromptLogprobs:
    """A step's prompt log-probabilities as the device computed them: by request, the
    position of its first entry and the entries in pieces of up to ``PROMPT_LOGPROB_ROWS``."""

    pieces: dict[str, tuple[int, list[LogprobTensors]]]

    def collect(self, out: ModelOutput) -> None:
        """The entries into ``out``, once the device has them."""
        for rid, (first, pieces) in self.pieces.items():
            out.prompt_logprobs[rid] = (first, [e for p in pieces for e in p.to_list()])


@dataclass
class Embeddings:
    """A step's embeddings (``SamplingParams.return_embedding``): the final hidden state of
    each asking request's last prompt token, in float32, left on the device."""

    request_ids: list[str]
    rows: torch.Tensor

    def collect(self, out: ModelOutput) -> None:
        """The rows into ``out``, once the device has them."""
        host = self.rows.cpu()
        for rid, row in zip(self.request_ids, host, strict=True):
            # A row of its own: a view would carry (pickled to the engine core's front end,
            # or kept alive) the whole step's rows with it.
            out.embeddings[rid] = row.clone()


Deferred = DeferredTokens | PromptLogprobs | Embeddings


@dataclass
class StepResult:
    """A launched step (``ModelRunner.launch``): ``result()`` is its ``ModelOutput``, the
    results it left on the device (its tokens, their log-probabilities, the prompt's)
    brought to Python. Any one thread may call it once ``launch`` has returned the step,
    while the launching thread goes on (the engine's own on a GPU, a thread of the runner's
    on the CPU)."""

    output: ModelOutput
    deferred: list[Deferred]

    def result(self) -> ModelOutput:
        out = self.output
        start = time.perf_counter()
        for step in self.deferred:
            step.collect(out)
        if self.deferred:  # waiting for the results, and their conversion, count as sampling
            out.times.sample += time.perf_counter() - start
        self.deferred = []
        return out


class ModelRunner:
    device = torch.device("cpu")
    # The torch reference; device runners set their own in __init__.
    attention: AttentionBackend = staticmethod(paged_attention)
    # Whether ``launch`` leaves a step's sampled tokens on the device for ``StepResult`` to
    # bring to Python (and the next step reads its pending tokens there): on a GPU the next
    # step is launched before this one's tokens are waited for. On the CPU the step has
    # computed them by then; converting at once there also keeps a row whose draw was not
    # finite out of a step scheduled ahead (whose draws from the shared generator it would
    # shift).
    defer_sampled_tokens = False
    # Whether ``launch`` returns once the step's work is queued on the device, before it
    # runs (a GPU's): asynchronous scheduling then launches each step on the engine's own
    # thread (``InlineSteps``). The CPU computes the step in ``launch``: a thread of the
    # runner's own computes it while the engine schedules the next (``StepThread``).
    launches_asynchronously = False
    # Whether the decoder's last layer computes only the rows a step samples
    # (``OutputRows``), where no row asks for prompt log-probabilities.
    computes_sampled_rows_only = True
    # The backend's K/V writer, (key, value, kv_cache, slot_mapping): what the last layer
    # calls for the rows it does not attend with.
    write_kv = staticmethod(write_kv_cache)

    def __init__(
        self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []  # each layer's [2, blocks, ...]
        # The same memory as [pieces, blocks, values] tensors (a piece: a layer's keys or its
        # values), pieces in layer order, keys first: where borrowed blocks hold an encoder
        # output.
        self._kv_groups: list[torch.Tensor] = []
        self.allocate_kv_cache(num_blocks)
        # Image embeddings by content hash; the scheduler's encoder-cache manager says when to
        # add and drop them.
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        # The PixelArithmetic tables integer pixels are looked up in, on the device, by their
        # bytes: copied once, not in every step that encodes images.
        self._pixel_tables: dict[bytes, torch.Tensor] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device).manual_seed(seed)
        # Where each request's token sampled in its last step that sampled is: that step's
        # tokens on the device, and the row. A step scheduled ahead of it (PENDING_TOKEN,
        # asynchronous scheduling) computes from it, read there.
        self.last_sampled: dict[str, tuple[torch.Tensor, int]] = {}
        # Embeddings pooled over a prompt that came in several chunks: request id -> (the
        # position its next chunk starts at, the sum of the rows so far or the first row),
        # and the updates of the step being run, kept once it has run (``_note_sampled``).
        self._pooled: dict[str, tuple[int, torch.Tensor]] = {}
        self._pooled_step: dict[str, tuple[int, torch.Tensor] | None] = {}
        # The tokens before of the requests whose penalties or min_tokens need them.
        self.token_history = TokenHistory(model.vocab_size, self.device)
        # Every running request's KV block ids: a step sends only the ones it adds.
        self.block_tables = BlockTables()
        self._image_owners: dict[str, int] = {}  # this step's images' encoding ranks
        self._failed: set[str] = set()  # the requests the last step failed for
        # Set while someone measures how long the device computes (``busy_timer.py``).
        self.busy_timer: BusyTimer | None = None
        # The LoRA adapters' slots (``attach_lora``; None without), and the adapter each
        # holds (``SchedulerOutput.lora_adapters``' identities; None: none, or one that did
        # not load).
        self.lora_state = getattr(model, "lora", None)
        self._slot_adapters: list[tuple[str, int, str] | None] = (
            [None] * self.lora_state.max_loras if self.lora_state is not None else [])

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def execute(self, scheduler_output: SchedulerOutput,
                encoder_pixels: EncoderPixels) -> ModelOutput:
        """Run one step: the sampled token of every request whose chunk completed, and where
        the step's time went (``ModelOutput.times``).

        ``encoder_pixels`` holds the pixel values of every image in
        ``scheduler_output.images_to_encode``, by hash. A step that raises is contained: each
        of its requests runs again alone, so that only the requests that fail by themselves
        come back in ``errors`` and the others get their tokens. Rerunning is safe because a
        request's chunk writes the same K/V values to the same slots each time, and its images
        are encoded with it.
        """
        return self.launch(scheduler_output, encoder_pixels).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput,
               encoder_pixels: EncoderPixels) -> StepResult:
        """``execute``'s step, returned once its work is issued: with
        ``defer_sampled_tokens`` its sampled tokens, and the prompt log-probabilities it
        computed, stay on the device until ``StepResult.result()`` (which also computes the
        log-probabilities rows ask for, from the logits kept till then), which any thread may
        call while this one launches the next step."""
        # Every request's new blocks first, those of requests this step drops below included
        # (the scheduler counts them as sent), before anything here may raise.
        self.block_tables.release(scheduler_output.finished_request_ids)
        self.block_tables.update(scheduler_output.chunks)
        self.block_tables.update_decodes(scheduler_output.decodes)
        for h in scheduler_output.freed_encoder_hashes:
            self.encoder_outputs.pop(h, None)
        for h, (num_tokens, block_ids) in scheduler_output.encoder_restores.items():
            self.encoder_outputs[h] = self._read_kv_blocks(block_ids, num_tokens)
        for h, block_ids in scheduler_output.encoder_spills.items():
            self._write_kv_blocks(block_ids, self.encoder_outputs.pop(h))
        for rid in scheduler_output.finished_request_ids:
            self.generators.pop(rid, None)
            self.last_sampled.pop(rid, None)
            self._pooled.pop(rid, None)
        if len(self.token_history):
            self.token_history.drop(scheduler_output.finished_request_ids)
        out = ModelOutput()
        if scheduler_output.lora_adapters:
            failed = self._load_loras(scheduler_output.lora_adapters)
            if failed:
                scheduler_output = self._without_failed_loras(scheduler_output, failed, out)
        scheduler_output = self._fill_pending(scheduler_output, out)
        self._assign_images(scheduler_output)
        deferred: list[Deferred] | None = (
            [] if self.defer_sampled_tokens else None)
        try:
            self._note_sampled(self._execute(scheduler_output, encoder_pixels, out, deferred))
            return StepResult(self._note_failed(out), deferred or [])
        except CollectiveError:
            raise  # the ranks' group is broken: no request can run (the engine stops)
        except Exception as e:  # noqa: BLE001 (contained below, and logged)
            if parallel.tp_size() > 1 and _may_differ_between_ranks(e):
                # Raised on this rank alone, perhaps mid-layer: the ranks' collectives no
                # longer pair up, so nothing can be rerun in step (as vLLM, the engine stops).
                raise CollectiveError(f"tensor-parallel rank {parallel.tp_rank()}: "
                                      f"{_reason(e)}") from e
            requests = scheduler_output.requests  # (objects: a failed step's rare path)
            if len(requests) <= 1:
                out.errors.update({r.request_id: _reason(e) for r in requests})
                logger.error("engine step failed for request %s: %s",
                             ", ".join(r.request_id for r in requests) or "(none)",
                             _reason(e), exc_info=e)
                return StepResult(self._note_failed(
                    self._with_failed_images(scheduler_output, out)), [])
            logger.warning("an engine step of %d requests failed (%s); running each alone to "
                           "find the ones responsible", len(requests), _reason(e))
        for req in requests:
            try:
                self._note_sampled(self._execute(scheduler_output.only(req), encoder_pixels, out))
            except CollectiveError:
                raise
            except Exception as e:  # noqa: BLE001
                out.errors[req.request_id] = _reason(e)
                logger.error("engine step failed for request %s: %s", req.request_id,
                             _reason(e), exc_info=e)
        return StepResult(self._note_failed(
            self._with_failed_images(scheduler_output, out)), [])

    def _load_loras(self, adapters: Mapping[int, tuple[str, int, str]]) -> dict[int, str]:
        """Read each adapter the step needs into its slot where the slot holds another;
        one that does not read leaves its slot empty (read again by the next step that needs
        it). Returns the slots it failed for, with why."""
        text_config = self.model.config.text_config
        failed, read = {}, False
        for slot, adapter in adapters.items():
            if self._slot_adapters[slot] == adapter:
                continue
            read = True
            name, _, path = adapter
            self._slot_adapters[slot] = None
            try:
                self.lora_state.load(slot, read_adapter(name, path, text_config,
                                                        self.lora_state.max_rank, self.dtype))
                self._slot_adapters[slot] = adapter
            except Exception as e:  # noqa: BLE001 (its requests fail with why; others run)
                self.lora_state.clear(slot)
                failed[slot] = str(e)
                logger.error("LoRA adapter %r did not load: %s", name, e)
        if read and parallel.tp_size() > 1:
            # Every rank drops the same requests, whichever rank's read failed: their steps'
            # collectives must pair up. (Every rank reads in the same steps: they hold the
            # same adapters, told by the same steps.)
            for slot, reason in {k: v for ranks in parallel.gather_objects(failed)
                                 for k, v in ranks.items()}.items():
                if slot not in failed:
                    self.lora_state.clear(slot)
                    self._slot_adapters[slot] = None
                    failed[slot] = reason
        return failed

    def _without_failed_loras(self, scheduler_output: SchedulerOutput, failed: dict[int, str],
                              out: ModelOutput) -> SchedulerOutput:
        """The step less the requests whose adapter did not load (``failed``: slot -> why),
        each failed with why (``lora_failures``)."""
        decodes = scheduler_output.decodes
        rows = list(zip(decodes.request_ids, decodes.lora_slots, strict=True))
        rows += [(r.request_id, r.lora_slot) for r in scheduler_output.chunks]
        dropped = {rid: failed[slot] for rid, slot in rows if slot in failed}
        if not dropped:
            return scheduler_output
        out.lora_failures.update(dropped)
        return scheduler_output.without(set(dropped))

    def _lora_rows(self, decodes: DecodeRows, chunks: list[ScheduledRequest], num_rows: int,
                   sampled: list[ScheduledRequest], output_rows: OutputRows | None
                   ) -> LoRARows | None:
        """The step's rows by adapter slot (None: no row runs with an adapter)."""
        row_slots = list(decodes.lora_slots)
        for r in chunks:
            row_slots += [r.lora_slot] * len(r.token_ids)
        if max(row_slots, default=-1) < 0:
            return None

        def groups(slots: list[int], total: int) -> list[tuple[int, torch.Tensor | None]]:
            found: dict[int, list[int]] = {}
            for i, slot in enumerate(slots):
                if slot >= 0:
                    found.setdefault(slot, []).append(i)
            if len(found) == 1 and len(next(iter(found.values()))) == total:
                return [(next(iter(found)), None)]  # all rows (no padding rows) run with it
            return [(slot, to_device(int_tensor(rows), self.device))
                    for slot, rows in found.items()]

        full = groups(row_slots, num_rows)
        if output_rows is None:
            return LoRARows(num_rows, full)
        out_slots = row_slots[:len(decodes)] + [r.lora_slot for r in sampled]
        return LoRARows(num_rows, full, len(out_slots), groups(out_slots, len(out_slots)))

    def _note_sampled(self, where: dict[str, tuple[torch.Tensor, int]]) -> None:
        """A step's attempt has succeeded: remember where each request's token is (the next
        step reads it there), and count it for the requests whose history is kept; keep what
        it pooled of prompts that go on in later chunks."""
        for rid, pooled in self._pooled_step.items():
            if pooled is None:
                self._pooled.pop(rid, None)
            else:
                self._pooled[rid] = pooled
        self._pooled_step = {}
        self.last_sampled.update(where)
        self.token_history.record(where)

    def _assign_images(self, scheduler_output: SchedulerOutput) -> None:
        """Which rank encodes each of the step's images (tensor parallelism, the tower
        data-parallel): fixed for the whole step, as the executor split the pixels, so that
        a rerun of one request finds them where they were sent."""
        if parallel.tp_size() == 1 or parallel.split_encoder():
            return  # every image is encoded here
        to_encode = scheduler_output.images_to_encode
        self._image_owners.clear()
        self._image_owners.update(split_by_tokens(list(to_encode), to_encode,
                                                  parallel.tp_size()))

    def _fill_pending(self, scheduler_output: SchedulerOutput,
                      out: ModelOutput) -> SchedulerOutput:
        """The step without the requests it cannot run. In a step scheduled ahead, a
        request the step before failed for, or that has no token there, leaves the step (in
        ``out.errors``, which the engine ignores): it would compute, and draw random numbers,
        for nothing. Each remaining ``PENDING_TOKEN`` (a token scheduled ahead of its
        sampling) is read from the device when the step's inputs are made
        (``_with_pending_tokens``). The engine's message is not changed (a copy is)."""
        chunks, decodes = scheduler_output.chunks, scheduler_output.decodes
        failed, self._failed = self._failed, set()
        if not scheduler_output.ahead:
            return scheduler_output
        last_sampled = self.last_sampled
        void: set[str] = set()
        for rid, token in zip(decodes.request_ids, decodes.token_ids, strict=True):
            if rid in failed or (token == PENDING_TOKEN and rid not in last_sampled):
                void.add(rid)
        for r in chunks:
            if r.request_id in failed or (r.token_ids[-1] == PENDING_TOKEN
                                          and r.request_id not in last_sampled):
                void.add(r.request_id)
        if not void:
            return scheduler_output
        for rid in void:  # scheduled before its step failed, or without a token: nothing to run
            out.errors[rid] = ("its step before failed" if rid in failed
                               else "its step before produced no token")
        return scheduler_output.without(void)

    def _with_pending_tokens(self, input_ids: torch.Tensor, decodes: DecodeRows,
                             chunks: list[ScheduledRequest]) -> torch.Tensor:
        """``input_ids`` with each ``PENDING_TOKEN`` replaced, on the device, by the token the
        request's last step sampled there: nothing waits for that step's tokens to reach
        Python."""
        # (row of input_ids, request) of each token to fill in: most decode rows when
        # scheduling ahead, so a comprehension, not a call per row.
        request_ids = decodes.request_ids
        pending = ([(i, request_ids[i]) for i, token in enumerate(decodes.token_ids)
                    if token == PENDING_TOKEN]
                   if PENDING_TOKEN in decodes.token_ids else [])
        end = len(decodes)
        for r in chunks:
            end += len(r.token_ids)
            if r.token_ids[-1] == PENDING_TOKEN:
                pending.append((end - 1, r.request_id))
        if not pending:
            return input_ids
        last_sampled = self.last_sampled
        sources = [last_sampled[rid] for _, rid in pending]  # (tokens on the device, row)
        first = sources[0][0]
        if all(tokens is first for tokens, _ in sources):  # one step's tokens: most steps
            groups = [(first, [row for _, row in sources], [at for at, _ in pending])]
        else:
            by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
            for (at_row, _), (tokens, row) in zip(pending, sources, strict=True):
                _, rows, at = by_tensor.setdefault(id(tokens), (tokens, [], []))
                rows.append(row)
                at.append(at_row)
            groups = list(by_tensor.values())
        for tokens, rows, at in groups:
            index, at = to_device_all([int_tensor(rows), int_tensor(at)], input_ids.device)
            input_ids[at] = tokens[index]
        return input_ids

    def _note_failed(self, out: ModelOutput) -> ModelOutput:
        """Remember the requests the step failed for (a step scheduled ahead of this one
        skips them), and forget where their tokens are. Failures a deferred step's tokens show
        later (``StepResult``) are the engine's to handle."""
        self._failed = set(out.errors).union(out.lora_failures)
        for rid in self._failed:
            self.last_sampled.pop(rid, None)
        return out

    def _with_failed_images(self, scheduler_output: SchedulerOutput,
                            out: ModelOutput) -> ModelOutput:
        out.failed_images = [h for h in scheduler_output.images_to_encode
                             if h not in self.encoder_outputs]
        return out

    def _execute(self, scheduler_output: SchedulerOutput, encoder_pixels: EncoderPixels,
                 out: ModelOutput,
                 deferred: list[Deferred] | None = None
                 ) -> dict[str, tuple[torch.Tensor, int]]:
        """One attempt at the step: its tokens (and log-probabilities) go into ``out`` once
        all of it has run, the seconds of each part into ``out.times``. A request whose
        sampling fails goes into ``out.errors`` (the others keep their tokens); anything else
        that fails raises, leaving ``out``'s results as they were. With a ``deferred`` list
        the sampled tokens go there, on the device, with what computes the log-probabilities
        rows ask for once the tokens are known, and so do the prompt log-probabilities.
        Returns where each sampled token is (for ``last_sampled``, which the caller updates
        only once the attempt has succeeded: a rerun reads the step before's tokens)."""
        times = out.times
        chunks, decodes = scheduler_output.chunks, scheduler_output.decodes
        self._pooled_step = {}  # (what a failed attempt pooled is not kept)
        t0 = time.perf_counter()
        with self._phase("encoder"):
            self._run_encoder(scheduler_output, encoder_pixels)
        t1 = time.perf_counter()
        times.encoder += t1 - t0
        if not chunks and not len(decodes):
            return {}
        with phase("prepare"):
            input_ids, positions, meta, sample_rows, num_rows = self._prepare_inputs(
                decodes, chunks)
            input_ids = self._with_pending_tokens(input_ids, decodes, chunks)
            embeds = self._embed(input_ids, chunks, len(decodes))
            sampled = [r for r in chunks if r.sample]
            self._follow_history(chunks)
            # The sampling rows' requests, decode rows first, as columns.
            ids = scheduler_output.sampling_ids()
            params = decodes.sampling_params + [r.sampling_params for r in sampled]
            output_rows = self._output_rows(chunks, decodes, sampled, ids, sample_rows,
                                            num_rows, meta)
            lora = (self._lora_rows(decodes, chunks, input_ids.shape[0], sampled, output_rows)
                    if self.lora_state is not None else None)
        t2 = time.perf_counter()
        times.prepare += t2 - t1
        with self._phase("forward"):
            hidden = self._forward(positions, embeds, meta, output_rows, lora=lora)
            if output_rows is not None:
                _check_output_rows(hidden, output_rows)
            rows = (hidden if output_rows is not None else hidden[sample_rows]) if ids else None
            logits = self.model.compute_logits(rows) if ids else None
            # (Without output rows whenever a request asks for them.)
            prompt_logprobs = self._prompt_logprobs(chunks, hidden, len(decodes))
            embeddings = self._embeddings(chunks, sampled, len(decodes), rows, hidden)
        t3 = time.perf_counter()
        times.forward += t3 - t2
        if deferred is not None and prompt_logprobs.pieces:
            deferred.append(prompt_logprobs)  # brought to Python with the step's tokens
            prompt_logprobs = PromptLogprobs({})
        if embeddings is not None:
            if deferred is not None:
                deferred.append(embeddings)
            else:
                embeddings.collect(out)
        if logits is None:
            prompt_logprobs.collect(out)  # waits for them: forward time
            times.forward += time.perf_counter() - t3
            return {}
        wants_logprobs = any(p.logprobs is not None for p in params)
        with self._phase("sample"):
            drawn = self._sample(ids, params, logits, {
                len(decodes) + i: r.token_bitmask for i, r in enumerate(sampled)
                if r.token_bitmask is not None}, keep_logits=wants_logprobs)
        tokens_at = drawn.tokens
        where = {rid: (tokens_at, i) for i, rid in enumerate(ids)}
        if deferred is not None:  # log-probabilities too, once the tokens are known
            deferred.append(DeferredTokens(
                ids, drawn, functools.partial(self._contained_logprobs, ids, params, logits)
                if wants_logprobs else None))
            times.sample += time.perf_counter() - t3
            return where
        tokens = drawn.to_list()
        logprobs = self._logprobs(ids, params, logits, tokens) if wants_logprobs else {}
        prompt_logprobs.collect(out)  # the last that may raise (a rerun replaces its entries)
        times.sample += time.perf_counter() - t3
        for rid, token in zip(ids, tokens, strict=True):
            if isinstance(token, Exception):
                out.errors[rid] = _reason(token)
                logger.error("sampling failed for request %s: %s", rid, _reason(token))
            else:
                out.sampled[rid] = token
        out.logprobs.update(logprobs)
        return where

    def _follow_history(self, chunks: list[ScheduledRequest]) -> None:
        """Count afresh the tokens of the chunks' requests that send them (on admission, and
        after a failed step), whose penalties or min_tokens need them."""
        for r in chunks:
            if r.known_token_ids is not None:
                self.token_history.follow(r.request_id, r.sampling_params, r.known_token_ids,
                                          r.num_prompt_tokens)

    def _sample(self, ids: list[str], params: list[SamplingParams], logits: torch.Tensor,
                bitmasks: dict[int, torch.Tensor], keep_logits: bool) -> SampledTokens:
        """Each row's token (rows: the requests ``ids``, sampling by ``params``), under the
        row's grammar bitmask where ``bitmasks`` has one, then the changes its parameters ask
        for (``adjust_logits``), left on the device."""
        sample_from = logits if not bitmasks else apply_token_bitmasks(
            logits, list(bitmasks), list(bitmasks.values()))
        # In place unless the model's logits are wanted after (for log-probabilities).
        sample_from = adjust_logits(sample_from, ids, params, self.token_history,
                                    in_place=sample_from is not logits or not keep_logits)
        return sample_on_device(sample_from, params,
                                lambda i: self._generator(ids[i], params[i]))

    @classmethod
    def _contained_logprobs(cls, ids: list[str], params: list[SamplingParams],
                            logits: torch.Tensor, tokens: list[int | Exception]
                            ) -> tuple[dict[str, TokenLogprobs], dict[str, str]]:
        """``_logprobs`` for a step whose tokens were left on the device, computed once they
        are known (the step cannot be rerun by then): if the batch's computation fails, each
        row's is computed alone, and only the requests whose own fails are failed."""
        try:
            return cls._logprobs(ids, params, logits, tokens), {}
        except Exception as e:  # noqa: BLE001 (contained below, and logged)
            logger.warning("the log-probabilities of a step's %d rows failed (%s); computing "
                           "each row's alone", len(ids), _reason(e))
        found: dict[str, TokenLogprobs] = {}
        failed: dict[str, str] = {}
        for i, (rid, p) in enumerate(zip(ids, params, strict=True)):
            if p.logprobs is None or isinstance(tokens[i], Exception):
                continue
            try:
                found.update(cls._logprobs([rid], [p], logits[i:i + 1], [tokens[i]]))
            except Exception as e:  # noqa: BLE001
                failed[rid] = _reason(e)
                logger.error("log-probabilities failed for request %s: %s", rid, _reason(e),
                             exc_info=e)
        return found, failed

    @staticmethod
    def _logprobs(ids: list[str], params: list[SamplingParams], logits: torch.Tensor,
                  tokens: list[int | Exception]) -> dict[str, TokenLogprobs]:
        """The log-probabilities of the rows that ask for them and have a token."""
        rows = [i for i, (p, token) in enumerate(zip(params, tokens, strict=True))
                if p.logprobs is not None and not isinstance(token, Exception)]
        if not rows:
            return {}
        index = tensor_on(rows, torch.long, logits.device)
        return dict(zip(
            (ids[i] for i in rows),
            token_logprobs(logits.index_select(0, index), [tokens[i] for i in rows],
                           [params[i].logprobs for i in rows]),
            strict=True))

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """A part of a step that works on the device: a span for the busy timer, when one is
        set, and a range in torch's profiler, when it records (``mmserve.profiling``)."""
        timer = self.busy_timer
        with phase(name), nullcontext() if timer is None else timer.span():
            yield

    def _embeddings(self, chunks: list[ScheduledRequest], sampled: list[ScheduledRequest],
                    start: int, rows: torch.Tensor | None, hidden: torch.Tensor
                    ) -> Embeddings | None:
        """The embeddings of the requests that asked and sample in this step (once, at the
        end of their prompts, so only prompt chunks are looked at: a step of decodes alone
        costs nothing more), or None. Last-token pooling reads their sampling ``rows``
        (``sampled``'s from row ``start``, after the decode rows); mean and first-token
        pooling read every row of their chunks in ``hidden`` (which then has them all), a
        prompt in several chunks pooled a chunk at a time (``_pooled``)."""
        at = [start + i for i, r in enumerate(sampled) if r.sampling_params.return_embedding
              and r.sampling_params.pooling == "last"]
        request_ids, vectors = [], []
        if at and rows is not None:
            picked = rows.index_select(0, tensor_on(at, torch.long, rows.device))
            request_ids += [sampled[i - start].request_id for i in at]
            vectors.append(picked.float())
        for r in chunks:
            pooling = r.sampling_params.pooling
            if pooling != "last":
                pooled = self._pool(r, hidden[start:start + len(r.token_ids)], pooling)
                if r.sample:
                    self._pooled_step[r.request_id] = None
                    total = pooled[1]
                    vector = total / pooled[0] if pooling == "mean" else total
                    request_ids.append(r.request_id)
                    vectors.append(vector[None])
                else:
                    self._pooled_step[r.request_id] = pooled
            start += len(r.token_ids)
        if not request_ids:
            return None
        return Embeddings(request_ids, torch.cat(vectors) if len(vectors) > 1 else vectors[0])

    def _pool(self, r: ScheduledRequest, rows: torch.Tensor, pooling: str
              ) -> tuple[int, torch.Tensor]:
        """The chunk's ``rows`` pooled with what its prompt's earlier chunks pooled: (the
        position the next chunk starts at, their sum, or the first row), in float32."""
        end = r.start_pos + len(r.token_ids)
        if r.start_pos == 0:
            # (A copy of the first row: a view would keep the step's rows alive.)
            first = rows.float().sum(0) if pooling == "mean" else rows[0].float().clone()
            return end, first
        before = self._pooled.get(r.request_id)
        if before is None or before[0] != r.start_pos:
            raise RuntimeError(f"request {r.request_id}'s prompt is pooled from position "
                               f"{r.start_pos}, but its earlier chunks were not")
        return end, before[1] + rows.float().sum(0) if pooling == "mean" else before[1]

    def _prompt_logprobs(self, chunks: list[ScheduledRequest], hidden: torch.Tensor,
                         start: int) -> PromptLogprobs:
        """The log-probabilities of the prompt tokens that follow each request's first rows
        (``ScheduledRequest.prompt_logprob_targets``; the first chunk's at row ``start`` of
        ``hidden``), through the LM head
        ``PROMPT_LOGPROB_ROWS`` rows at a time (a prompt chunk's logits would otherwise be
        thousands of vocabulary-wide rows at once), left on the device."""
        found = {}
        for r in chunks:
            targets = r.prompt_logprob_targets
            if targets:
                pieces = []
                for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                    piece = targets[i:i + PROMPT_LOGPROB_ROWS]
                    rows = hidden[start + i:start + i + len(piece)]
                    pieces.append(logprobs_on_device(
                        self.model.compute_logits(rows),
                        tensor_on(piece, torch.long, hidden.device),
                        [r.sampling_params.prompt_logprobs] * len(piece)))
                found[r.request_id] = (r.start_pos + 1, pieces)
            start += len(r.token_ids)
        return PromptLogprobs(found)

    def _forward(self, positions: torch.Tensor, embeds: torch.Tensor, meta,
                 output_rows: OutputRows | None = None,
                 lora: LoRARows | None = None) -> torch.Tensor:
        """The decoder pass over the flat batch: every row's hidden state, or those of
        ``output_rows`` alone, each row with its LoRA adapter's (``lora``); device runners
        swap the attention backend."""
        with forward_context(meta, self.attention, output_rows, lora):
            return self.model(positions, embeds)

    def _output_rows(self, chunks: list[ScheduledRequest], decodes: DecodeRows,
                     sampled: list[ScheduledRequest], sampling_ids: list[str],
                     sample_rows: torch.Tensor, num_rows: int, meta) -> OutputRows | None:
        """The rows the step samples (``sampling_ids``' requests), for a decoder that computes
        its last layer for them alone, when that saves anything: some of the requests'
        ``num_rows`` rows are not sampled (prompt chunks; padding rows do not count) and none
        asks for prompt log-probabilities (which read every row; looked for only in such
        steps)."""
        num_sampled = len(sampling_ids)
        if (not self.computes_sampled_rows_only or num_sampled == num_rows
                or any(r.prompt_logprob_targets or r.sampling_params.pooling != "last"
                       for r in chunks)):
            return None
        seq_lens = ([s + 1 for s in decodes.start_pos]
                    + [r.start_pos + len(r.token_ids) for r in sampled])
        # The sampled rows as decodes of their sequences (with padding sequences that have no
        # rows where the backend pads decode batches: they compute nothing).
        as_decodes, _ = self._attention_metadata(sampling_ids, [1] * num_sampled, seq_lens)
        return OutputRows(sample_rows, as_decodes,
                          functools.partial(self.write_kv, slot_mapping=meta.slot_mapping))

    @classmethod
    def load_model(cls, model_dir: str, hf_config, dtype: torch.dtype,
                   lora_slots: tuple[int, int] | None = None) -> tuple[nn.Module, int]:
        """The checkpoint's model on this runner's device, and the bytes its weights take
        (those of its LoRA slots included: ``lora_slots`` is ``(max_loras,
        max_lora_rank)``, ``EngineConfig.lora_slots``)."""
        from mmserve.models.loader import load_model

        model = load_model(model_dir, hf_config, dtype)
        if lora_slots is not None:
            attach_lora(model, *lora_slots)
        model = model.to(cls.device)
        tensors = [*model.parameters(), *model.buffers()]
        return model, sum(t.numel() * t.element_size() for t in tensors)

    def set_threads(self, threads: int | None) -> None:
        """Compute threads: a fixed count, or None for the device's default."""

    def close(self) -> None:
        """Drop every tensor the runner holds: the KV cache (also bound to the model's
        attention layers), encoder outputs, generators and the model itself. The engine then
        hands the freed memory back (``release_memory``)."""
        if self.model is not None:
            for attn in self.model.attention_layers():
                attn.kv_cache = None
        self.kv_caches, self._kv_groups = [], []
        self.encoder_outputs.clear()
        self._pixel_tables.clear()
        self.generators.clear()
        self.last_sampled.clear()
        self._pooled.clear()
        self._pooled_step = {}
        self.token_history.drop(self.token_history.followed)
        self.block_tables.clear()
        self.model = None

    @classmethod
    def release_memory(cls) -> None:
        """Give memory that no tensor uses any more back to the operating system (the CPU's
        heap) or the driver (the CUDA allocator's cache)."""
        release_free_memory()

    @property
    def num_threads(self) -> int | None:
        """The compute threads of the last step, where the device has them (the CPU)."""
        return None

    def check_health(self) -> None:
        """Nothing to look at in the engine's own process (worker processes are looked at by
        ``MultiprocExecutor.check_health``)."""

    def capture_model(self, max_num_seqs: int, max_model_len: int,
                      position_rows: int = 1) -> None:
        """Prepare fast paths for decode batches (CUDA graphs) whose positions have
        ``position_rows`` rows; nothing to do on the CPU."""

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        seed = params.seed
        if seed is None:
            return self.default_generator
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    def _run_encoder(self, scheduler_output: SchedulerOutput,
                     encoder_pixels: EncoderPixels) -> None:
        """Encode this step's new images in one call of the model's ``encode_images``, which
        packs images of different sizes (never padding them to the largest)."""
        hashes = [h for h in scheduler_output.images_to_encode if h not in self.encoder_outputs]
        if not hashes:
            return
        tokens = scheduler_output.images_to_encode
        if parallel.tp_size() > 1 and not parallel.split_encoder():
            self.encoder_outputs.update(self._encode_data_parallel(hashes, tokens,
                                                                   encoder_pixels))
            return
        self.encoder_outputs.update(self._encode(hashes, tokens, encoder_pixels))

    def _encode(self, hashes: list[str], tokens: Mapping[str, int],
                encoder_pixels: EncoderPixels) -> dict[str, torch.Tensor]:
        """``hashes``' embeddings, each checked against the tokens its prompt has for it.
        Images given as their embeddings (``ImageEmbeds``) are not encoded: theirs are
        used as they are, on this runner's device and in its dtype."""
        if not hashes:
            return {}
        given = {h: encoder_pixels[h][IMAGE_EMBEDS] for h in hashes
                 if IMAGE_EMBEDS in encoder_pixels[h]}
        encode = [h for h in hashes if h not in given]
        found = {h: to_device(e, self.device).to(self.dtype) for h, e in given.items()}
        if encode:
            items = self._encoder_inputs([encoder_pixels[h] for h in encode])
            # One [tokens, hidden] per image.
            found.update(zip(encode, self.model.encode_images(items), strict=True))
        for h in hashes:
            if found[h].shape[0] != tokens[h]:
                raise RuntimeError(f"image {h[:12]} became {found[h].shape[0]} embeddings, but "
                                   f"its prompt has {tokens[h]} placeholder tokens")
        return {h: found[h] for h in hashes}

    def _encode_data_parallel(self, hashes: list[str], tokens: Mapping[str, int],
                              encoder_pixels: EncoderPixels) -> dict[str, torch.Tensor]:
        """The vision tower data-parallel: each rank encodes its share of the images (split
        by their token counts), then every rank receives every embedding. A failure on any
        rank fails the encoding on all of them with its reason, so the ranks stay in step
        (and rerun the step request by request together)."""
        owner = self._image_owners
        mine = [h for h in hashes if owner[h] == parallel.tp_rank()]
        error = None
        try:
            local = self._encode(mine, tokens, encoder_pixels)
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 (raised on every rank below)
            local, error = {}, _reason(e)
        failures = [(rank, reason) for rank, reason in enumerate(parallel.gather_objects(error))
                    if reason is not None]
        if failures:
            rank, reason = failures[0]
            raise RuntimeError(f"{reason} (encoding on tensor-parallel rank {rank})")
        found = {}
        for rank in range(parallel.tp_size()):
            theirs = [h for h in hashes if owner[h] == rank]
            if not theirs:
                continue
            if rank == parallel.tp_rank():
                flat = torch.cat([local[h] for h in theirs]).to(self.dtype)
            else:
                flat = torch.empty(sum(tokens[h] for h in theirs), self.model.hidden_size,
                                   dtype=self.dtype, device=self.device)
            parallel.broadcast(flat, rank)
            found.update(zip(theirs, flat.split([tokens[h] for h in theirs]), strict=True))
        return found

    def _encoder_inputs(self, items: list[EncoderInput]) -> list[dict[str, torch.Tensor]]:
        """The images' tensors on this runner's device: pixels in its dtype, integer tensors
        (image grids, which the model reads into Python) left on the CPU. Pixels sent as
        integers (``PIXEL_ARITHMETIC``) are finished here, all of one arithmetic and shape
        in one copy and one lookup."""
        out, groups = [], {}
        for i, item in enumerate(items):
            item = dict(item)
            arithmetic = item.pop(PIXEL_ARITHMETIC, None)
            if arithmetic is not None:  # equal tables, whichever object (pickled apart)
                key = (arithmetic.table.numpy().tobytes(), item["pixel_values"].shape[1:])
                groups.setdefault(key, (arithmetic, []))[1].append(i)
            out.append({name: to_device(t, self.device).to(self.dtype)
                        if t.is_floating_point() else t
                        for name, t in item.items()})
        for (key, _), (arithmetic, members) in groups.items():
            pixels = [out[i]["pixel_values"] for i in members]
            if (table := self._pixel_tables.get(key)) is None:
                table = self._pixel_tables[key] = to_device(arithmetic.table, self.device)
            finished = arithmetic.apply(to_device(torch.cat(pixels), self.device), table)
            for i, p in zip(members, finished.to(self.dtype).split([len(p) for p in pixels]),
                            strict=True):
                out[i]["pixel_values"] = p
        return out

    def _embed(self, input_ids: torch.Tensor, chunks: list[ScheduledRequest],
               start: int) -> torch.Tensor:
        """Token embeddings with image embeddings scattered over their placeholders (the
        first chunk's at row ``start``)."""
        rows, sources = [], []
        for r in chunks:
            for s in r.image_slices:
                rows.append(torch.arange(start + s.dst_start, start + s.dst_start + s.length))
                sources.append(self.encoder_outputs[s.image_hash][s.src_start:s.src_start
                                                                  + s.length])
            start += len(r.token_ids)
        if not rows:
            return self.model.embed_tokens(input_ids)
        row_index = to_device(torch.cat(rows), self.device)
        # Placeholder ids may lie outside the text vocabulary: embed a harmless id there.
        input_ids = input_ids.index_fill(0, row_index, 0)
        embeds = self.model.embed_tokens(input_ids)
        embeds[row_index] = torch.cat(sources).to(embeds.dtype)
        return embeds

    def _prepare_inputs(
        self, decodes: DecodeRows, chunks: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, int]:
        """The flat batch: token ids, positions, attention metadata, the rows to sample and
        the number of the requests' rows (without the padding rows a device may add).

        Positions are ``[rows, num_tokens]`` from the requests' slices (``[3, num_tokens]``
        for M-RoPE), squeezed to ``[num_tokens]`` when there is one row, as LLaMA's rope
        takes them."""
        n = len(decodes)
        ids = decodes.token_ids + []  # (a copy)
        sample_rows = list(range(n))
        query_lens = [1] * n
        seq_lens = [s + 1 for s in decodes.start_pos]  # each one's tokens once this step ran
        for r in chunks:  # one pass, plain integers: the tensors are made from whole columns
            tokens = r.token_ids
            ids += tokens
            query_lens.append(len(tokens))
            seq_lens.append(r.start_pos + len(tokens))
            if r.sample:
                sample_rows.append(len(ids) - 1)
        meta, num_padding = self._attention_metadata(
            decodes.request_ids + [r.request_id for r in chunks], query_lens, seq_lens)
        num_rows = len(ids)
        # Padding rows embed token 0 at position 0; the metadata makes them compute nothing.
        ids.extend([0] * num_padding)
        ids, positions, sample_rows = to_device_all(
            [int_tensor(ids), flat_positions(decodes, chunks, num_padding),
             int_tensor(sample_rows)], self.device)
        return ids, positions, meta, sample_rows, num_rows

    def _attention_metadata(self, request_ids: list[str], query_lens: list[int],
                            seq_lens: list[int]) -> tuple[AttentionMetadata, int]:
        """The attention backend's metadata for these requests' rows, and how many padding
        rows the batch needs."""
        width = -(-max(seq_lens, default=1) // self.block_size)
        meta = build_attention_metadata(query_lens, seq_lens,
                                        self.block_tables.rows(request_ids, width),
                                        self.block_size, self.device)
        return meta, 0

    # ----------------------------------------------------------------- borrowed blocks
    @property
    def kv_block_elements(self) -> int:
        """Values one KV block holds over every layer, keys and values."""
        return sum(c.numel() // c.shape[1] for c in self.kv_caches)

    @torch.inference_mode()
    def _write_kv_blocks(self, block_ids: list[int], embeds: torch.Tensor) -> None:
        """Copy an encoder output into borrowed KV blocks (free ones: no request reads them).

        Laid out piece after piece (every layer's keys, then its values, in layer order),
        ``len(block_ids)`` blocks of each, as far as the output reaches; one copy per group of
        pieces (``_kv_groups``): with one tensor for every layer, a single copy."""
        flat = embeds.reshape(-1)
        n = len(block_ids)
        index = tensor_on(block_ids, torch.long, self.device)
        start = 0
        for group in self._kv_groups:
            if start >= flat.numel():
                break
            capacity = n * group.shape[2]  # one piece's share of the output
            pieces = min(group.shape[0], -(-(flat.numel() - start) // capacity))
            chunk = flat[start:start + pieces * capacity]
            if chunk.numel() < pieces * capacity:  # the last piece's tail: zeros
                chunk = torch.cat([chunk, chunk.new_zeros(pieces * capacity - chunk.numel())])
            group[:pieces].index_copy_(1, index, chunk.view(pieces, n, -1))
            start += pieces * capacity

    @torch.inference_mode()
    def _read_kv_blocks(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The ``[num_tokens, hidden]`` encoder output ``_write_kv_blocks`` put there."""
        total = num_tokens * self.model.hidden_size
        n = len(block_ids)
        index = tensor_on(block_ids, torch.long, self.device)
        parts, count = [], 0
        for group in self._kv_groups:
            if count >= total:
                break
            pieces = min(group.shape[0], -(-(total - count) // (n * group.shape[2])))
            part = group[:pieces].index_select(1, index).reshape(-1)
            parts.append(part)
            count += part.numel()
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        return whole[:total].view(num_tokens, -1)

    # ----------------------------------------------------------------- memory plan
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Give every attention layer a fresh zeroed cache of ``num_blocks`` blocks.

        The engine builds the runner with no blocks; on a GPU the profile run first gets the
        blocks its batch writes, and once the plan is made this is called with the planned
        count. Consecutive layers of one shape (every decoder's layers here) get views of one
        tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]``, so that an encoder
        output moving in or out of borrowed blocks is one copy over all their pieces
        (``_kv_groups``), not one per layer and kind.
        """
        layers = self.model.attention_layers()
        for attn in layers:  # the old cache goes before the new one is allocated
            attn.kv_cache = None
        self.kv_caches, self._kv_groups = [], []
        for shape, run in itertools.groupby(layers, lambda a: (a.num_kv_heads, a.head_dim)):
            run = list(run)
            whole = torch.empty(len(run), 2, num_blocks, self.block_size, *shape,
                                dtype=self.dtype, device=self.device)
            self._advise_kv_cache(whole)
            whole.zero_()
            for attn, cache in zip(run, whole.unbind(0), strict=True):
                attn.kv_cache = cache
                self.kv_caches.append(cache)
            self._kv_groups.append(whole.view(2 * len(run), num_blocks,
                                              self.block_size * shape[0] * shape[1]))

    def _advise_kv_cache(self, cache: torch.Tensor) -> None:
        """A fresh KV cache, before it is first touched (the CPU asks for huge pages)."""

    def measure_profile_peak(self, batch: SchedulerOutput, encoder_pixels: EncoderPixels) -> int:
        """Peak bytes that ``profile_run(batch, encoder_pixels)`` allocates above what was
        already alive.

        Counts the tensors the run creates (``memory_profiler.track_peak_bytes``); runners on
        devices with allocator statistics override this.
        """
        _, peak = track_peak_bytes(lambda: self.profile_run(batch, encoder_pixels))
        return peak

    @torch.inference_mode()
    def profile_run(self, batch: SchedulerOutput, encoder_pixels: EncoderPixels) -> None:
        """Run ``batch`` (the engine's ``profile_batch``) like a step, without sampling.

        Leaves nothing behind but what it wrote into the current KV cache, which the engine
        replaces afterwards: encoder outputs and generators are as before, and no random
        numbers are drawn (the inputs are zeros and nothing is sampled, which also lets the
        run work on the meta device).
        """
        try:
            # The rows the penalties of as many requests would take, held through the step.
            with self.token_history.profiled(batch.num_requests):
                self._assign_images(batch)
                self.block_tables.update(batch.chunks)
                self.block_tables.update_decodes(batch.decodes)
                self._run_encoder(batch, encoder_pixels)
                input_ids, positions, meta, sample_rows, _ = self._prepare_inputs(
                    batch.decodes, batch.chunks)
                embeds = self._embed(input_ids, batch.chunks, len(batch.decodes))
                # Every row with an adapter that changes every projection: the most a
                # step's adapters add.
                state = self.lora_state
                lora = None if state is None else LoRARows(input_ids.shape[0], [(
                    0, torch.arange(input_ids.shape[0], device=input_ids.device))])
                with nullcontext() if state is None else state.profiling():
                    hidden = self._forward(positions, embeds, meta, lora=lora)
                self.model.compute_logits(hidden[sample_rows])
        finally:
            for h in batch.images_to_encode:
                self.encoder_outputs.pop(h, None)
            self._image_owners.clear()
            self.block_tables.release(batch.request_ids())


class CPUModelRunner(ModelRunner):
    """The CPU: the compiled kernels of ``kernels/cpu_ops.py`` when they build (attention,
    and for bfloat16 packed linear layers and fused norms and activations), torch otherwise,
    and a C heap that keeps freed memory (``cpu_allocator.py``)."""

    device = torch.device("cpu")

    @classmethod
    def load_model(cls, model_dir: str, hf_config, dtype: torch.dtype,
                   lora_slots: tuple[int, int] | None = None) -> tuple[nn.Module, int]:
        """The model, with its linear layers' weights packed once for the path's matmul
        (``cpu_ops.pack_linear_layers``: oneDNN's, or a compiled kernel's; the vision tower's,
        which only multiplies prompt-sized inputs, may take another than the decoder's)."""
        model, weight_bytes = super().load_model(model_dir, hf_config, dtype, lora_slots)
        pack_linear_layers(model, prompt_only=model.encoder_modules())
        return model, weight_bytes

    def __init__(self, *args, **kwargs) -> None:
        keep_freed_memory()  # steps reuse their activations' pages instead of faulting them in
        super().__init__(*args, **kwargs)
        self.attention = cpu_attention_backend()  # compiled kernels when they build
        self.adaptive_threads: AdaptiveThreads | None = None
        self.fixed_threads: int | None = None  # set by set_threads, read from any thread
        self._threads_before_fixed: int | None = None  # torch's count that a fixed one replaced

    def _advise_kv_cache(self, cache: torch.Tensor) -> None:
        advise_huge_pages(cache)  # decode attention reads blocks scattered across it

    def set_threads(self, threads: int | None) -> None:
        """``threads`` fixed, or None: as many as other processes leave cores free
        (``cpu_threads.py``)."""
        if threads is None:
            self.adaptive_threads = AdaptiveThreads()
        else:
            self.adaptive_threads = None
            self.fixed_threads = threads
            if self._threads_before_fixed is None:
                self._threads_before_fixed = torch.get_num_threads()
            torch.set_num_threads(threads)

    @property
    def num_threads(self) -> int:
        """The compute threads of the last step (read from any thread: torch's count is a
        thread's own, and steps may run on a thread of their own)."""
        if self.adaptive_threads is not None:
            return self.adaptive_threads.threads
        return self.fixed_threads or torch.get_num_threads()

    def close(self) -> None:
        """``ModelRunner.close``, and torch's thread count back to what it was before the
        adaptive policy lowered it or a fixed count replaced it (unless someone set another
        since). Called on the thread ``set_threads`` was: the count is a thread's own."""
        super().close()
        if self.adaptive_threads is not None:
            self.adaptive_threads = None
            restore_threads()
        before, self._threads_before_fixed = self._threads_before_fixed, None
        if before is not None and torch.get_num_threads() == self.fixed_threads:
            torch.set_num_threads(before)

    def launch(self, scheduler_output: SchedulerOutput,
               encoder_pixels: EncoderPixels) -> StepResult:
        """``ModelRunner.launch``, the thread count looked at first (every step runs through
        here, with asynchronous scheduling too)."""
        if self.adaptive_threads is not None:
            self.adaptive_threads.update()
        return super().launch(scheduler_output, encoder_pixels)


def flat_positions(decodes: DecodeRows, chunks: list[ScheduledRequest],
                   num_padding: int = 0) -> torch.Tensor:
    """The batch's positions (on the host), the decode rows' then the chunks' side by side and
    ``num_padding`` zero columns after them: ``[rows, num_tokens]``, or ``[num_tokens]`` when
    there is one row."""
    if not chunks and decodes.position_rows == 1:  # decodes with LLaMA's rope: most steps
        return int_tensor(decodes.positions + [0] * num_padding)
    num_rows = {len(r.positions) for r in chunks}
    if len(decodes):
        num_rows.add(decodes.position_rows)
    if len(num_rows) > 1:
        raise ValueError(f"requests of one step have positions of {sorted(num_rows)} rows")
    rows = num_rows.pop() if num_rows else 1
    flat: list[list[int]] = [decodes.positions + [] for _ in range(rows)]
    for r in chunks:
        for row, values in zip(flat, r.positions, strict=True):
            if len(values) != len(r.token_ids):
                raise ValueError(f"request {r.request_id} has {len(r.token_ids)} tokens but "
                                 f"{len(values)} positions")
            row.extend(values)
    for row in flat:
        row.extend([0] * num_padding)
    positions = host_tensor(flat, torch.long)
    return positions[0] if rows == 1 else positions


def _check_output_rows(hidden: torch.Tensor, output_rows: OutputRows) -> None:
    if hidden.shape[0] != len(output_rows.index):
        raise RuntimeError(
            f"the model returned {hidden.shape[0]} rows for {len(output_rows.index)} output "
            "rows: its decoder must read the forward context's output_rows "
            "(models/forward_context.py), or its runner must not set them")


def _may_differ_between_ranks(error: BaseException) -> bool:
    """Errors that one rank may raise while the others do not (memory, the device): under
    tensor parallelism they cannot be contained. Others come from the step's inputs, which
    every rank has alike, so every rank raises them at the same point."""
    return (isinstance(error, MemoryError | torch.OutOfMemoryError)
            or "CUDA" in str(error) or "out of memory" in str(error).lower())


def split_by_tokens(hashes: list[str], tokens: Mapping[str, int], ranks: int) -> dict[str, int]:
    """Which rank encodes each image: the largest first, each to the rank with the fewest
    tokens so far (ties to the lower rank), the same on every rank."""
    load = [0] * ranks
    owner = {}
    for h in sorted(hashes, key=lambda h: (-tokens[h], h)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[h] = rank
        load[rank] += tokens[h]
    return owner


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
