"""The CUDA runner: Triton paged attention, the CUDA allocator as memory meter, decode graphs.

Everything that turns a SchedulerOutput into a forward pass stays in the device-agnostic base
(``model_runner.py``); this class only decides what differs on a GPU: the attention
backend and its metadata, loading weights while measuring memory, measuring the profile run's
peak, and capturing CUDA graphs for decode-only batches.

Importing this module does not touch CUDA or Triton, so it is harmless on a CPU-only machine.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from mmserve.models.forward_context import OutputRows, forward_context
from mmserve.step import SchedulerOutput
from mmserve.worker.model_runner import CPUModelRunner, EncoderPixels, ModelRunner

logger = logging.getLogger(__name__)

# Decode batch sizes captured as CUDA graphs (vLLM's default list); a decode batch runs in the
# smallest captured size that holds it, with padding sequences that compute nothing.
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, *range(8, 257, 8))


def runner_class(device: str) -> type[ModelRunner]:
    """The runner for a resolved device name (``EngineConfig.resolved_device``)."""
    runners: dict[str, type[ModelRunner]] = {"cpu": CPUModelRunner, "cuda": CUDAModelRunner}
    if device not in runners:
        raise ValueError(f"no runner for device {device!r}; choose one of {sorted(runners)}")
    return runners[device]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured sizes up to the first one that holds ``max_num_seqs`` decodes."""
    sizes = [s for s in CUDA_GRAPH_BATCH_SIZES if s < max_num_seqs]
    larger = [s for s in CUDA_GRAPH_BATCH_SIZES if s >= max_num_seqs]
    return sizes + larger[:1]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= ``num_seqs``; None when the batch is larger than all."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class CUDAModelRunner(ModelRunner):
    """Triton kernels on the GPU; decode-only batches replay CUDA graphs unless eager."""

    device = torch.device("cuda")
    defer_sampled_tokens = True  # the next step launches while this one's tokens come over
    launches_asynchronously = True  # kernels are queued on a stream: launch returns at once

    def __init__(
        self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int
    ) -> None:
        super().__init__(model, num_blocks, block_size, dtype, seed)
        from mmserve.kernels.triton_attention import triton_paged_attention
        from mmserve.kernels.triton_kv_cache import triton_write_kv_cache

        self.attention = triton_paged_attention
        self.write_kv = triton_write_kv_cache
        # Filled by capture_model; empty means every batch runs eagerly.
        self.graph_sizes: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.max_blocks_per_seq = 0
        self._static: dict[str, torch.Tensor] = {}  # graph inputs, shared by all sizes

    # ------------------------------------------------------------ memory
    def close(self) -> None:
        """``ModelRunner.close``, and the CUDA graphs, their outputs (which live in the graphs'
        memory pool) and static inputs: once no graph holds the pool, ``release_memory``
        returns it to the driver."""
        self.graphs.clear()
        self.graph_outputs.clear()
        self._static = {}
        self.graph_sizes = []
        super().close()

    @classmethod
    def release_memory(cls) -> None:
        """The CUDA allocator's cached blocks back to the driver, once the device is idle, and
        cuBLAS's workspaces (allocator blocks that ``empty_cache`` leaves to their handles):
        the next engine's profile run then measures the same peak as this one's did."""
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()

    @classmethod
    def load_model(cls, model_dir: str, hf_config, dtype: torch.dtype,
                   lora_slots: tuple[int, int] | None = None) -> tuple[nn.Module, int]:
        """Load onto the GPU; the weight bytes are what the CUDA allocator gained meanwhile."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model, _ = super().load_model(model_dir, hf_config, dtype, lora_slots)
        torch.cuda.synchronize()
        weight_bytes = torch.cuda.memory_allocated() - before
        logger.info("model weights take %.3f GiB on %s", weight_bytes / 2**30,
                    torch.cuda.get_device_name())
        return model, weight_bytes

    def measure_profile_peak(self, batch: SchedulerOutput, encoder_pixels: EncoderPixels) -> int:
        """Run ``self.profile_run(batch, encoder_pixels)``; return the CUDA allocator's peak
        above its start.

        The memory planner subtracts this from the budget as the activations' worst case. Cached
        but unused allocator blocks are released first so that they are not counted, and so are
        cuBLAS's workspaces, which the run then allocates again: counted by every engine alike,
        also by one that starts while another engine of the process holds them.
        """
        self.release_memory()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        self.profile_run(batch, encoder_pixels)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    # ------------------------------------------------------------ inputs
    def _attention_metadata(self, request_ids: list[str], query_lens: list[int],
                            seq_lens: list[int]):
        """Triton metadata; decode-only batches are padded to a captured graph size with
        sequences that have no query tokens (slot -1: they write and attend to nothing)."""
        from mmserve.kernels.triton_attention import TritonAttentionMetadata

        bs = self.block_size
        tables = self.block_tables.rows(request_ids, -(-max(seq_lens, default=1) // bs))
        padded = None
        if self.graph_sizes and len(query_lens) == sum(query_lens):  # decodes only
            padded = padded_batch_size(len(request_ids), self.graph_sizes)
        meta = TritonAttentionMetadata.build(
            query_lens, seq_lens, tables, bs, self.device, num_seqs_padded=padded,
            max_blocks=self.max_blocks_per_seq if padded is not None else None)
        return meta, 0 if padded is None else padded - len(request_ids)

    # ------------------------------------------------------------ forward
    def _forward(self, positions: torch.Tensor, embeds: torch.Tensor, meta,
                 output_rows: OutputRows | None = None, lora=None) -> torch.Tensor:
        graph = None
        # (A step with output rows has prompt rows: never a graph's decode-only batch. The
        # graphs hold no adapter: a step where rows run with one runs eagerly.)
        if (lora is None and meta.max_query_len == 1
                and meta.block_tables.shape[1] == self.max_blocks_per_seq):
            graph = self.graphs.get(meta.num_seqs)  # _prepare_inputs padded to this size
        if graph is None:
            with forward_context(meta, self.attention, output_rows, lora):
                return self.model(positions, embeds)
        self.fill_graph_inputs(positions, embeds, meta)
        graph.replay()
        return self.graph_outputs[meta.num_seqs]

    def fill_graph_inputs(self, positions: torch.Tensor, embeds: torch.Tensor, meta) -> None:
        """Copy a decode batch padded to a captured size into the graphs' static inputs."""
        n = meta.num_seqs
        static = self._static
        # positions: [rows, n], or [n] for one row (viewed as [1, n]).
        static["positions"][:, :n].copy_(positions.view(-1, n))
        static["embeds"][:n].copy_(embeds)
        static["slot_mapping"][:n].copy_(meta.slot_mapping)
        static["query_start_loc"][:n + 1].copy_(meta.query_start_loc)
        static["seq_lens"][:n].copy_(meta.seq_lens)
        static["block_tables"][:n].copy_(meta.block_tables)

    @torch.inference_mode()
    def capture_model(self, max_num_seqs: int, max_model_len: int,
                      position_rows: int = 1) -> None:
        """Capture one CUDA graph of the decoder per decode batch size, largest first, for
        positions of ``position_rows`` rows (3 for M-RoPE).

        Larger graphs are captured first so that smaller ones reuse their memory pool. Call
        this after the KV cache is allocated: the graphs hold its address.
        """
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        sizes = graph_batch_sizes(max_num_seqs)
        self.allocate_graph_inputs(sizes[-1], max_model_len, position_rows)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(sizes):
            self.graph_forward(size)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.graph_outputs[size] = self.graph_forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.graph_sizes = sizes
        logger.info("captured %d CUDA graphs for decode batches of 1..%d in %.1f s (%.3f GiB)",
                    len(sizes), sizes[-1], time.perf_counter() - start,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def allocate_graph_inputs(self, max_batch_size: int, max_model_len: int,
                              position_rows: int = 1) -> None:
        """The static input buffers every graph reads, sized for the largest batch; positions
        are ``[position_rows, max_batch_size]`` (the graphs read ``[size]`` of row 0 when there
        is one row, as LLaMA's rope takes them).

        They start as a dummy decode: each sequence has one token at position 0 whose slot is
        -1, so a capture run writes nothing into the KV cache.
        """
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        dev = self.device
        hidden = self.model.embed_tokens(torch.zeros(1, dtype=torch.long, device=dev)).shape[-1]
        self._static = {
            "positions": torch.zeros(position_rows, max_batch_size, dtype=torch.long,
                                     device=dev),
            "embeds": torch.zeros(max_batch_size, hidden, dtype=self.dtype, device=dev),
            "slot_mapping": torch.full((max_batch_size,), -1, dtype=torch.long, device=dev),
            "query_start_loc": torch.arange(max_batch_size + 1, dtype=torch.int32, device=dev),
            "seq_lens": torch.ones(max_batch_size, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(max_batch_size, self.max_blocks_per_seq,
                                        dtype=torch.int32, device=dev),
        }

    def graph_forward(self, size: int) -> torch.Tensor:
        """The decoder over the first ``size`` rows of the static inputs: what a graph holds."""
        from mmserve.kernels.triton_attention import TritonAttentionMetadata

        static = self._static
        meta = TritonAttentionMetadata(
            slot_mapping=static["slot_mapping"][:size],
            query_start_loc=static["query_start_loc"][:size + 1],
            seq_lens=static["seq_lens"][:size],
            block_tables=static["block_tables"][:size],
            max_query_len=1,
            padded=True,  # replays batches of up to ``size``, padded to it
        )
        positions = static["positions"][:, :size]  # [rows, size]
        if positions.shape[0] == 1:
            positions = positions[0]  # [size]
        with forward_context(meta, self.attention):
            return self.model(positions, static["embeds"][:size])
