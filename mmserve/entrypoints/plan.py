"""``mmserve plan MODEL``: the memory plan a launch would make, without loading any weight.

It reads config.json, the processor files and the safetensors headers, and calls the engine's
own start-up planning (``engine/startup.py``: ``plan_for``) with no weights loaded: the model
is built on the meta device (sizes without data) and the profile batch is dry-run there.

How close it is to a launch: on the CPU the weights and activations are the engine's own
figures (the engine measures the same dry run), so the block counts agree exactly when the
available RAM is the same; only the RAM, which changes from moment to moment, is an
estimate. On a GPU the engine measures the CUDA allocator, which also sees kernel workspaces
and rounds allocations up, so those two figures are estimates there.

The engine's modules are imported when a plan is made, not when the ``mmserve`` command builds
its parser (see ``serve_args.py``).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmserve.config import EngineConfig, require_model_dir

if TYPE_CHECKING:
    from mmserve.engine.memory_plan import MemoryPlan


def checkpoint_bytes(model_dir: str) -> tuple[int, int]:
    """(number of tensors, bytes of tensor data) from the safetensors headers alone."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    count = total = 0
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                count += 1
                total += end - start
    return count, total


def make_plan(config: EngineConfig, device: str, memory_bytes: int | None = None,
              ) -> tuple[MemoryPlan, dict[str, Any]]:
    """The engine's plan for ``config`` on ``device``, from files and a meta-device dry run.

    ``memory_bytes`` plans for a device of that size instead of asking this machine.
    Returns the plan and facts about the checkpoint.
    """
    from transformers import AutoConfig

    from mmserve.engine.startup import plan_for
    from mmserve.processing.registry import family_for
    from mmserve.worker import memory_profiler

    require_model_dir(config.model)
    hf_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
    dtype = config.torch_dtype
    family = family_for(config.model, hf_config, config.mm_processor_kwargs,
                        config.max_image_size)
    num_tensors, file_bytes = checkpoint_bytes(config.model)
    estimated: tuple[str, ...] = ()
    if memory_bytes is None:
        memory_bytes = memory_profiler.device_memory(torch.device(device))
        if device == "cpu":
            estimated = ("memory_bytes",)  # available RAM moves until the engine starts
    plan = plan_for(config, hf_config, family, device, memory_bytes,
                    estimated=estimated).plan
    facts = {"checkpoint_tensors": num_tensors, "checkpoint_bytes": file_bytes,
             "dtype": str(dtype).removeprefix("torch."),
             "tokens_per_image": family.max_tokens_per_item,
             "limit_mm_per_prompt": config.limit_mm_per_prompt,
             "max_image_size": config.max_image_size}
    return plan, facts


def _run(args: argparse.Namespace) -> int:
    from mmserve.engine.memory_plan import InfeasiblePlanError, feasible_pairs
    from mmserve.entrypoints.engine_args import engine_kwargs

    model = args.model_path or args.model
    if model is None:
        print("mmserve plan: pass MODEL, a local Hugging Face checkpoint directory.",
              file=sys.stderr)
        return 2
    kwargs = engine_kwargs(args)
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        # Planning for a GPU from a machine without one: size it from --device-memory and
        # take the dtype a GPU would pick.
        if args.device_memory is None:
            print("mmserve plan: no CUDA device here; pass --device-memory BYTES to plan for a "
                  "GPU of that size.", file=sys.stderr)
            return 2
        if kwargs["dtype"] == "auto":
            kwargs["dtype"] = "bfloat16"
        kwargs["device"] = "cpu"
    try:
        config = EngineConfig(model=model, **kwargs)
        plan, facts = make_plan(config, device, args.device_memory)
    except (InfeasiblePlanError, ValueError, FileNotFoundError, OSError) as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"mmserve plan: {exc}", file=sys.stderr)
        return 1
    pairs = feasible_pairs(plan)
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "checkpoint": facts,
                          "feasible": [{"max_model_len": n, "max_num_seqs": s}
                                       for n, s in pairs]}, indent=2))
        return 0
    print(plan.summary())
    print(f"  checkpoint: {facts['checkpoint_tensors']} tensors, "
          f"{facts['checkpoint_bytes']} bytes on disk (headers only; no weight was loaded), "
          f"served as {facts['dtype']}; {facts['tokens_per_image']} tokens per image")
    size = config.max_image_size
    print(f"  images: at most {config.limit_mm_per_prompt} per prompt"
          + (f", the largest {size[0]}x{size[1]}" if size else ""))
    print("  estimates: " + (", ".join(plan.estimated) or "none")
          + "; everything else is what the engine computes for the same settings")
    print("\nfeasible pairs: max_num_seqs sequences of max_model_len fit in the KV cache at once")
    print(f"  {'max_model_len':>13}  {'max_num_seqs':>12}")
    for length, seqs in pairs:
        print(f"  {length:>13}  {seqs:>12}")
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from mmserve.entrypoints.engine_args import add_engine_args

    p = sub.add_parser("plan", help="print the memory plan a launch would make (no weights "
                       "are loaded)")
    p.add_argument("model_path", metavar="MODEL", nargs="?",
                   help="local Hugging Face checkpoint directory (or --model)")
    p.add_argument("--device-memory", type=int,
                   help="plan for a device with this many bytes (default: this machine's)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_engine_args(p)
    p.set_defaults(func=_run)
