"""Engine configuration: one frozen dataclass built by the CLI, the Python API and the server."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")
# A step's token budget by device (max_num_batched_tokens="auto"). On a GPU a step that mixes
# prompt chunks and decodes runs eagerly, its host launching the same kernels whatever its
# size, so fewer, larger prompt steps keep the GPU busy (vLLM's server takes 8192 on GPUs of
# 70 GiB or more, its Python API 16384); on the CPU a step's time grows with its tokens, and
# decodes would wait behind long steps.
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 2048
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def flag(default: Any, help: str, *, choices: Sequence[str] | None = None,
         parse: Callable[[str], Any] | None = None) -> Any:
    """A field that every front door also takes as a flag (``entrypoints/engine_args.py``).

    The flag is the field's name with dashes (``--max-model-len``). Its value is read as the
    field's type (``int``, ``float`` or ``str``, ``None`` aside), or by ``parse`` (text ->
    value, a ``ValueError`` telling the user what to write) where the type is a union of
    those. A ``bool`` field is a switch: ``--NAME`` turns on one that defaults to off,
    ``--no-NAME`` turns off one that defaults to on (vLLM's ``--no-enable-prefix-caching``).
    A ``bool | None`` field defaulting to ``None`` is a switch the engine decides unless told:
    ``--NAME`` and ``--no-NAME`` both exist (``--async-scheduling``).
    """
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse})


def int_or_auto(text: str) -> int | None:
    """An integer, or ``auto`` (None: the memory plan decides)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {text!r}") from None


def mm_limit_text(text: str) -> int | dict:
    """``limit_mm_per_prompt`` as typed on a command line: an image count, or vLLM's JSON form;
    checked at once, so that a typo is a usage error, not a traceback at start-up."""
    value: int | str = int(text) if text.strip().lstrip("-").isdigit() else text
    parse_mm_limit(value)
    return json.loads(text) if isinstance(value, str) else value


_MM_KWARGS_USAGE = ('mm_processor_kwargs must be a JSON object of image-processor settings, '
                    'such as \'{"do_normalize": false}\'')


def mm_processor_kwargs_text(text: str) -> dict[str, Any] | None:
    """``mm_processor_kwargs`` as typed on a command line: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"{_MM_KWARGS_USAGE}, got {text!r} (not JSON).") from None
    return check_mm_processor_kwargs(value)


def check_mm_processor_kwargs(value: Any) -> dict[str, Any] | None:
    """A copy of ``value`` when it is a dict with string keys (None when empty or None);
    otherwise a ``ValueError``. Which keys the image processor takes is checked at start-up."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{_MM_KWARGS_USAGE}, got {type(value).__name__} {value!r}.")
    bad = [key for key in value if not isinstance(key, str)]
    if bad:
        raise ValueError(f"{_MM_KWARGS_USAGE}; its keys must be strings, got {bad!r}.")
    return copy.deepcopy(value) or None


# How a chat template takes each message's content (``chat_template_content_format``).
CONTENT_FORMATS = ("auto", "string", "openai")
SCHEDULING_POLICIES = ("fcfs", "priority")
# How an embedding pools the prompt's final hidden states (``SamplingParams.pooling``):
# its last token's, the mean of all, or its first token's (vLLM's LAST, MEAN and CLS).
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine. Fields left as ``None`` are decided at start-up.

    Each setting is declared here once, with its help: the command line, the server, ``bench``
    and ``plan`` take it as ``--name-with-dashes`` (see ``flag``), the Python API as a keyword.
    Names follow vLLM's engine arguments so that habits carry over.
    """

    model: str
    dtype: str = flag("auto", "weights' and activations' dtype; auto: bfloat16 on GPUs and "
                      "CPUs that have it, else float16 (GPU) or float32 (CPU)",
                      choices=("auto", *_DTYPES))
    device: str = flag("auto", "auto = cuda when a CUDA device is visible", choices=DEVICES)
    enforce_eager: bool = flag(False, "no CUDA graphs for decode batches")
    cpu_threads: int | str | None = flag(
        None, "compute threads on the CPU, or auto (default): one per core this process may "
        "use (torch's thread count at most), one fewer for each core other processes keep "
        "busy, checked twice a second", parse=int_or_auto)
    seed: int = flag(0, "seed of torch and of the runner's sampling")
    generation_config: str = flag(
        "auto", "default sampling parameters of requests that leave them out (temperature, "
        "top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens): 'auto' "
        "(the checkpoint's generation_config.json), 'vllm' (mmserve's own), or a folder "
        "holding a generation_config.json")
    async_scheduling: bool | None = flag(
        None, "schedule each step while the one before computes, the runner's steps on a "
        "thread (or in the worker processes) of their own; outputs are the same. Default "
        "(auto): on for GPUs, off on the CPU, where the model's kernels and the scheduler "
        "share the same cores")
    # Parallelism.
    tensor_parallel_size: int = flag(
        1, "ranks the decoder is split across (one worker process each, joined by "
        "torch.distributed: NCCL on GPUs, one per GPU; gloo on the CPU, sharing its cores); "
        "every rank holds the whole vision tower and encodes its share of a step's images")
    distributed_executor_backend: str = flag(
        "auto", "where the model runs: 'uni' (in the engine's process), 'mp' (worker "
        "processes, one per rank, as tensor parallelism needs); auto: uni for one rank, mp "
        "for more", choices=("auto", "uni", "mp"))
    mm_encoder_tp_mode: str = flag(
        "data", "how tensor parallelism runs the vision tower: 'data' (a whole copy on every "
        "rank, each encoding its share of a step's images) or 'weights' (its layers split "
        "like the decoder's, every rank on every image)", choices=("data", "weights"))
    worker_timeout: float = flag(
        300.0, "seconds a tensor-parallel worker may take to answer one step (or a collective "
        "to complete) before the engine stops with an error naming it")
    # Scheduling. ``None`` or "auto": sized by the memory plan at start-up.
    max_model_len: int | str | None = flag(
        None, "longest sequence (prompt + output), or auto (default): what the KV cache "
        "holds, capped at the model's limit", parse=int_or_auto)
    max_num_seqs: int | str | None = flag(
        None, "most requests running at once, or auto (default): 256, or how many sequences "
        "of --max-model-len fit", parse=int_or_auto)
    max_num_batched_tokens: int | str | None = flag(
        None, "token budget of one engine step, decodes and prefill chunks together, or auto "
        f"(default): {GPU_BATCHED_TOKENS} on a GPU, {CPU_BATCHED_TOKENS} on the CPU",
        parse=int_or_auto)
    scheduler_delay_factor: float = flag(
        0.0, "while requests decode, admit waiting ones only once the oldest has waited this "
        "many times the last prompt step's duration (as vLLM's option of that name): fewer, "
        "larger prompt steps interrupt the decodes; 0 admits them at once")
    scheduling_policy: str = flag(
        "fcfs", "which waiting request is admitted first and which running one is preempted "
        "first: fcfs (arrival order; the newest is preempted) or priority (a request's "
        "priority, lower first, then arrival; the lowest priority is preempted), as vLLM's",
        choices=SCHEDULING_POLICIES)
    pooling_type: str | None = flag(
        None, "how an embedding (LLM.embed, /v1/embeddings) pools the prompt's final hidden "
        "states: last (its last token's), mean (every token's mean) or cls (its first "
        "token's), as vLLM's --pooler-config pooling_type; mean and cls compute every prompt "
        "token (no prefix-cache hits for such requests). Default: what a sentence-transformers "
        "checkpoint's modules.json declares, else last", choices=POOLING_TYPES)
    normalize_embeddings: bool | None = flag(
        None, "L2-normalize embeddings where a request does not say (LLM.embed's and "
        "/v1/embeddings' normalize), as vLLM's --pooler-config normalize. Default: on, but "
        "for a sentence-transformers checkpoint without a Normalize module")
    # LoRA adapters (models/lora.py).
    enable_lora: bool = flag(
        False, "run requests with LoRA adapters (PEFT's format, on the language model's "
        "projections): LLM.generate's lora_request, the server's --lora-modules")
    max_loras: int = flag(
        1, "LoRA adapters held at once, each in a slot of its own that the memory plan "
        "counts: requests of more adapters than this wait until a slot's requests end")
    max_lora_rank: int = flag(16, "the highest rank of an adapter the slots hold")
    # KV cache.
    block_size: int = flag(16, "tokens per KV-cache block")
    enable_prefix_caching: bool = flag(
        True, "prefix caching (reuse the KV blocks of a prompt prefix seen before, images "
        "included)")
    kv_cache_memory: int | None = flag(
        None, "bytes of KV cache, set directly instead of sized from the memory budget")
    gpu_memory_utilization: float | None = flag(
        None, "share of the device's memory to use: of a GPU's total memory (default 0.9, or "
        "$MMSERVE_GPU_MEMORY_UTILIZATION), or of the RAM available at start-up on the CPU "
        "(default 0.8)")
    single_user_mode: bool = flag(
        False, "max-num-seqs 1, and the whole KV cache for that one sequence")
    # Multimodal. ``limit_mm_per_prompt`` is taken in vLLM's forms: an image count, or
    # ``{"image": N}`` or ``{"image": {"count": N, "width": W, "height": H}}`` (also as JSON
    # text); it is stored as the count, and the size, the largest image the memory plan must
    # provision for, as ``max_image_size`` (width, height), which is derived, not a flag.
    limit_mm_per_prompt: int | dict | str = flag(
        4, 'most images in one prompt: N, or JSON as in vLLM: \'{"image": N}\' or '
        '\'{"image": {"count": N, "width": W, "height": H}}\' (W x H: the largest image to '
        "provision memory for)", parse=mm_limit_text)
    max_image_size: tuple[int, int] | None = None
    encoder_cache_size: int | None = flag(
        None, "encoder cache reserve in embedding tokens (default: auto, from the encoder "
        "budget); beyond it, image embeddings no request needs may stay in free KV blocks")
    encoder_cache_eviction: str = flag(
        "queue-aware", "which cached image embeddings go first when space is needed: "
        "'queue-aware' (those no waiting request shows, then the rest; oldest first in each) "
        "or 'lru' (oldest first)", choices=("queue-aware", "lru"))
    encoder_cache_borrowing: bool = flag(
        True, "let image embeddings no running request needs stay cached in KV blocks that "
        "are free (given back the moment the KV cache needs them); off: drop them when the "
        "encoder cache reserve is full")
    max_image_pixels: int = flag(50_000_000, "largest image accepted, in pixels: width "
                                 "times height")
    # Keyword arguments for the checkpoint's image processor on every call, as vLLM's
    # ``--mm-processor-kwargs``: a dict in the Python API, a JSON object on the command line.
    # Stored as a dict (a copy; None when empty): the config is compared, never hashed. Keys the
    # image processor does not take are refused when the engine starts (``InputProcessor``).
    mm_processor_kwargs: dict[str, Any] | None = flag(
        None, 'keyword arguments for the image processor, as a JSON object: \'{"do_normalize": '
        "false}' (each image's cache hash includes them)", parse=mm_processor_kwargs_text)
    # Read and compiled when the engine starts (``processing/chat_template.py``); the config
    # keeps the value as given, so that a front door passes it on unchanged.
    chat_template: str | None = flag(
        None, "the Jinja chat template that renders chat messages, in place of the "
        "checkpoint's own: the path of a file holding it, or the template's text itself "
        "(a value with no '{', '}' or line break must name an existing file)")
    # ``processing/chat_template.py``'s ``content_format``.
    chat_template_content_format: str = flag(
        "auto", "how the chat template takes each message's content: openai, a list of parts "
        "(text and images), as vision-language templates do; string, the text alone, as text "
        "models' templates (Qwen2.5's, with its tools) do; auto: openai where the template "
        "loops over a message's content", choices=CONTENT_FORMATS)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "cpu_threads", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value == "auto":
                object.__setattr__(self, name, None)
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}.")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (on for GPUs, off "
                             f"on the CPU), got {self.async_scheduling!r}.")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}.")
        if self.single_user_mode and self.max_num_seqs not in (None, 1):
            raise ValueError(f"single_user_mode runs one sequence but max_num_seqs="
                             f"{self.max_num_seqs}; drop one of the two.")

        def positive(name: str, value: int | None) -> None:
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value}.")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory", "encoder_cache_size", "max_image_pixels", "cpu_threads",
                     "tensor_parallel_size", "max_loras", "max_lora_rank"):
            positive(name, getattr(self, name))
        ranks = self.tensor_parallel_size
        if self.distributed_executor_backend not in ("auto", "uni", "mp"):
            raise ValueError(f"distributed_executor_backend must be 'auto', 'uni' or 'mp', got "
                             f"{self.distributed_executor_backend!r}.")
        if self.distributed_executor_backend == "uni" and ranks > 1:
            raise ValueError(f"tensor_parallel_size={ranks} runs one worker process per rank; "
                             "distributed_executor_backend='uni' runs one rank in this "
                             "process: use 'mp' (or auto).")
        if self.mm_encoder_tp_mode not in ("data", "weights"):
            raise ValueError(f"mm_encoder_tp_mode must be 'data' or 'weights', got "
                             f"{self.mm_encoder_tp_mode!r}.")
        if self.normalize_embeddings not in (None, True, False):
            raise ValueError(f"normalize_embeddings must be true, false or None (as the "
                             f"checkpoint says), got {self.normalize_embeddings!r}.")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", got {self.scheduling_policy!r}.")
        if not (self.scheduler_delay_factor >= 0 and math.isfinite(self.scheduler_delay_factor)):
            raise ValueError("scheduler_delay_factor must be a finite number >= 0, got "
                             f"{self.scheduler_delay_factor!r}.")
        if not self.worker_timeout > 0:
            raise ValueError(f"worker_timeout must be positive seconds, got "
                             f"{self.worker_timeout}.")
        if ranks > 1 and self.resolved_device == "cuda" and torch.cuda.device_count() < ranks:
            raise ValueError(f"tensor_parallel_size={ranks} needs {ranks} GPUs, one per rank; "
                             f"torch sees {torch.cuda.device_count()}.")
        object.__setattr__(self, "mm_processor_kwargs",
                           check_mm_processor_kwargs(self.mm_processor_kwargs))
        if isinstance(self.chat_template, os.PathLike):
            object.__setattr__(self, "chat_template", os.fspath(self.chat_template))
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be a file's path or a template's text, got "
                             f"{type(self.chat_template).__name__}.")
        count, size = parse_mm_limit(self.limit_mm_per_prompt)
        object.__setattr__(self, "limit_mm_per_prompt", count)
        if size is not None:
            object.__setattr__(self, "max_image_size", size)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}.")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' "
                             "(or 'auto'), or install a CUDA build of torch.")
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens",
                               GPU_BATCHED_TOKENS if self.resolved_device == "cuda"
                               else CPU_BATCHED_TOKENS)

    @property
    def lora_slots(self) -> tuple[int, int] | None:
        """The model's LoRA slots, ``(max_loras, max_lora_rank)``; None without LoRA."""
        return (self.max_loras, self.max_lora_rank) if self.enable_lora else None

    @property
    def worker_processes(self) -> bool:
        """Whether the model runs in worker processes (``MultiprocExecutor``)."""
        return self.distributed_executor_backend == "mp" or self.tensor_parallel_size > 1

    @property
    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` picks cuda when torch sees a CUDA device."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def schedules_ahead(self) -> bool:
        """``async_scheduling`` resolved: ``None`` (auto) is on for CUDA, off on the CPU."""
        if self.async_scheduling is None:
            return self.resolved_device == "cuda"
        return self.async_scheduling

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' and activations' dtype (``auto``: bfloat16 on GPUs and CPUs with it)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.resolved_device == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def pooler_config_kwargs(value: str | dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--pooler-config`` (JSON text, or its dict) as ``EngineConfig`` fields:
    ``pooling_type`` ("LAST", "MEAN" or "CLS", any case) -> ``pooling_type``, ``normalize`` ->
    ``normalize_embeddings``; other keys are refused, saying what is taken."""
    try:
        config = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ValueError(f"pooler_config is not valid JSON ({e}); write it as vLLM's, e.g. "
                         '\'{"pooling_type": "MEAN", "normalize": true}\'') from None
    if not isinstance(config, dict):
        raise ValueError("pooler_config must be a JSON object, e.g. "
                         '{"pooling_type": "MEAN", "normalize": true}')
    unknown = sorted(set(config) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config takes pooling_type and normalize; mmserve does not "
                         f"take {', '.join(map(repr, unknown))}.")
    kwargs: dict[str, Any] = {}
    pooling = config.get("pooling_type")
    if pooling is not None:
        if not (isinstance(pooling, str) and pooling.lower() in POOLING_TYPES):
            raise ValueError(f"pooler_config's pooling_type must be one of "
                             f"{', '.join(t.upper() for t in POOLING_TYPES)}, got {pooling!r}.")
        kwargs["pooling_type"] = pooling.lower()
    if config.get("normalize") is not None:
        if not isinstance(config["normalize"], bool):
            raise ValueError("pooler_config's normalize must be true or false.")
        kwargs["normalize_embeddings"] = config["normalize"]
    return kwargs


# sentence-transformers' pooling modes (its Pooling module's config.json) that are vLLM's
# LAST, MEAN and CLS.
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_cls_token": "cls"}


def checkpoint_pooling(model_dir: str) -> tuple[str | None, bool | None]:
    """The pooling mode and normalization a sentence-transformers checkpoint declares, as
    vLLM reads them: its ``modules.json``'s Pooling module's mode (``last``, ``mean``,
    ``cls``, or the ``pooling_mode_*`` name of another that mmserve does not compute), and
    whether a Normalize module is among them; ``(None, None)`` for a checkpoint without a
    Pooling module. A file that cannot be read so is a ``ValueError`` naming it."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path) as f:
            modules = json.load(f)
        kinds = {m.get("type"): m for m in modules if isinstance(m, dict)}
        pooling_module = kinds.get("sentence_transformers.models.Pooling")
        if pooling_module is None:
            return None, None
        path = os.path.join(model_dir, str(pooling_module.get("path") or ""), "config.json")
        with open(path) as f:
            modes = json.load(f)
        chosen = [k for k, on in modes.items() if k.startswith("pooling_mode_") and on is True]
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} does not read as a sentence-transformers checkpoint's "
                         f"({type(e).__name__}: {e}): mend it, remove modules.json, or set both "
                         "--pooling-type and --[no-]normalize-embeddings") from None
    normalize = "sentence_transformers.models.Normalize" in kinds
    if len(chosen) != 1:
        return ("+".join(chosen) or "pooling_mode_none"), normalize
    return _ST_POOLING_MODES.get(chosen[0], chosen[0]), normalize


def resolved_pooling(config: EngineConfig) -> tuple[str, bool]:
    """An embedding's pooling type and default normalization: as ``config`` sets them, else
    as a sentence-transformers checkpoint declares them (``checkpoint_pooling``), else the
    last token's state, normalized. A declared mode mmserve does not compute is a
    ``ValueError`` unless ``pooling_type`` is set."""
    pooling, normalize = config.pooling_type, config.normalize_embeddings
    if pooling is not None and normalize is not None:
        return pooling, normalize
    declared, declared_normalize = checkpoint_pooling(config.model)
    if pooling is None:
        if declared is not None and declared not in POOLING_TYPES:
            raise ValueError(
                f"the checkpoint's sentence-transformers pooling ({declared}, modules.json) is "
                f"not one mmserve computes ({', '.join(POOLING_TYPES)}): set --pooling-type "
                "(pooling_type) to embed another way")
        pooling = declared or "last"
    if normalize is None:
        normalize = declared_normalize is not False
    return pooling, normalize


def require_model_dir(model: str) -> None:
    """Raise ``FileNotFoundError`` saying what mmserve loads when ``model`` is not a
    directory (transformers would take it for a name on the Hub, which mmserve never asks)."""
    if not os.path.isdir(model):
        raise FileNotFoundError(
            f"model directory not found: {model!r}; mmserve loads local Hugging Face "
            "checkpoints (config.json, *.safetensors, tokenizer and processor files).")


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 matmul (AVX512-BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_mm_limit(value: Any) -> tuple[int, tuple[int, int] | None]:
    """``limit_mm_per_prompt`` in any of vLLM's forms -> (images per prompt, largest image's
    (width, height) or None)."""
    usage = ('limit_mm_per_prompt must be an image count or JSON such as \'{"image": 2}\' or '
             '\'{"image": {"count": 2, "width": 1024, "height": 1024}}\'')
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{usage}, got {value!r}.") from None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"image"})
        if unknown:
            what = "video is not supported yet" if "video" in unknown else "unknown modality"
            raise ValueError(f"limit_mm_per_prompt: {what} ({', '.join(unknown)}); mmserve "
                             'takes images only: \'{"image": N}\'.')
        value = value.get("image", 0)
    size = None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"count", "width", "height"})
        if unknown or "count" not in value:
            raise ValueError(f'{usage}; the "image" object takes "count", "width" and '
                             f'"height", got {sorted(value)}.')
        if ("width" in value) != ("height" in value):
            raise ValueError('limit_mm_per_prompt: give both "width" and "height" of the '
                             "largest image, or neither.")
        if "width" in value:
            width, height = value["width"], value["height"]
            if not all(_is_int(v) and v > 0 for v in (width, height)):
                raise ValueError("limit_mm_per_prompt: width and height must be positive "
                                 f"integers, got {width!r} x {height!r}.")
            size = (width, height)
        value = value["count"]
    if not _is_int(value) or value < 0:
        raise ValueError(f"{usage}; the count must be an integer >= 0, got {value!r}.")
    return value, size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
