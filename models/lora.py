"""LoRA adapters on the decoder's projections, several of them in one batch.

An adapter is PEFT's folder: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``)
and ``adapter_model.safetensors`` holding, for some of the language model's projections
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``),
``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``): the layer computes
``W x + scaling * B (A x)``. The vision tower and the projector are never adapted here (nor
are they by vLLM's LLaVA and Qwen2-VL): an adapter that changes them is refused, so that an
image's encoder output stays the same whatever adapter reads it.

``attach_lora`` wraps each decoder layer's four projection layers (merged q/k/v and
gate/up, o and down) in a ``LoRALinear`` that holds ``max_loras`` slots: ``A``
``[slots, shards * max_rank, in]`` and each shard's ``B`` ``[slots, out, max_rank]``, zeros
until an adapter is loaded into a slot (its rank padded with zeros, ``scaling`` folded into
``B``). A step's rows are grouped by slot (``LoRARows``, in the forward context); each group
adds ``(x A^T) B^T`` to its rows' outputs, after the base layer (packed or not) computed them.
Under tensor parallelism a rank's slots hold its share, as the base layer's windows say: its
rows of ``B`` in a column-parallel layer, its columns of ``A`` in a row-parallel one (whose
partial sums the all-reduce adds with the base layer's).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.models.forward_context import get_forward_context
from mmserve.models.layers import MergedLinear
from mmserve.models.parallel import Window

# The checkpoint projections an adapter may change: name -> (the decoder layer's module, the
# wrapped layer's attribute).
TARGETS = {
    "q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"), "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"), "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
# The language model's projections in a PEFT key, whatever prefix the checkpoint's layout
# gives them (``base_model.model.model.language_model.``, ``base_model.model.language_model.
# model.``, ``base_model.model.model.``).
_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<target>[a-z_]+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
_VISION = re.compile(r"vision|visual|projector")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot run on this model, saying why."""


@dataclass
class Adapter:
    """An adapter read for a model: ``weights[(layer, target)] = (A, B)``, ``B`` scaled
    (none where only its files' headers were read)."""

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(text_config) -> dict[str, tuple[int, int]]:
    """Each target's (in, out) features in the model of ``text_config``."""
    from mmserve.models.llama import head_dim_of

    hidden, d = text_config.hidden_size, head_dim_of(text_config)
    heads = text_config.num_attention_heads
    kv = (getattr(text_config, "num_key_value_heads", None) or heads) * d
    inter = text_config.intermediate_size
    return {"q_proj": (hidden, heads * d), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * d, hidden), "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_adapter(name: str, path: str | Path, text_config, max_rank: int,
                 dtype: torch.dtype | None = None) -> Adapter:
    """The adapter at ``path`` checked against the model of ``text_config``: its config, and
    every tensor's name and shape from the file's header. With a ``dtype`` its tensors are
    read too (in that dtype, ``B`` scaled); without, ``weights`` holds none. ``AdapterError``
    names what does not fit."""
    folder = Path(path)
    config = _adapter_config(name, folder)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"LoRA adapter {name!r}: adapter_config.json's r must be a "
                           f"positive integer, got {rank!r}.")
    alpha = config.get("lora_alpha", 8)  # (PEFT's default)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got "
                           f"{alpha!r}.")
    unsupported = {
        "use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out layers (GPT-2's)",
        "modules_to_save": "modules_to_save (whole layers saved beside the adapter)",
        "alpha_pattern": "a per-module lora_alpha (alpha_pattern)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterError(f"LoRA adapter {name!r}: {what} are not supported; train it "
                               f"without {key}.")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {name!r}: bias={config['bias']!r} adapters are not "
                           "supported (bias 'none' only).")
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {folder} (the "
                           ".bin format is not read; save it with safetensors).")
    shapes = target_shapes(text_config)
    num_layers = text_config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, object]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or _VISION.search(m["prefix"]) or m["target"] not in TARGETS:
                    raise AdapterError(
                        f"LoRA adapter {name!r} changes {key}, which mmserve does not adapt "
                        f"(the language model's {', '.join(TARGETS)} only, never the vision "
                        "tower or the projector); train it on those modules alone.")
                layer = int(m["layer"])
                if layer >= num_layers:
                    raise AdapterError(f"LoRA adapter {name!r} changes layer {layer}, but "
                                       f"the model has {num_layers}; it is another model's.")
                found.setdefault((layer, m["target"]), {})[m["ab"]] = f.get_slice(key)
            weights = {}
            for (layer, target), pair in sorted(found.items()):
                if set(pair) != {"A", "B"}:
                    raise AdapterError(f"LoRA adapter {name!r}: layer {layer}'s {target} has "
                                       f"lora_{''.join(pair)} without its other half.")
                a_shape, b_shape = pair["A"].get_shape(), pair["B"].get_shape()
                in_f, out_f = shapes[target]
                r = a_shape[0] if len(a_shape) == 2 else -1
                if list(a_shape) != [r, in_f] or list(b_shape) != [out_f, r]:
                    raise AdapterError(
                        f"LoRA adapter {name!r}: layer {layer}'s {target} has lora_A "
                        f"{list(a_shape)} and lora_B {list(b_shape)}, the model needs "
                        f"[r, {in_f}] and [{out_f}, r]; it is another model's.")
                if r > max_rank:
                    raise AdapterError(f"LoRA adapter {name!r} has rank {r}, above "
                                       f"max_lora_rank={max_rank}; raise --max-lora-rank.")
                if dtype is None:
                    continue
                # PEFT's scaling: alpha over the rank (its square root with rsLoRA), the
                # module's own rank where rank_pattern gives it one.
                scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
                a = pair["A"][:].to(torch.float32)
                b = pair["B"][:].to(torch.float32) * scaling
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise AdapterError(f"LoRA adapter {name!r}: layer {layer}'s {target} "
                                       "holds values that are not finite.")
                weights[(layer, target)] = (a.to(dtype), b.to(dtype))
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 (a file that does not read, whatever the reason)
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} does not read as "
                           f"safetensors ({e}).") from e
    if not found:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights.")
    return Adapter(weights)


def _adapter_config(name: str, folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {folder} (a PEFT "
                           "adapter's folder holds it and adapter_model.safetensors).")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {file} does not read as JSON ({e}).") from e
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {file} is not a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r} is a {config['peft_type']} adapter; only "
                           "LoRA adapters run.")
    return config


@dataclass(frozen=True)
class LoRARows:
    """A step's rows by adapter slot: ``(slot, rows)`` for the flat batch's ``num_rows`` rows
    (padding included; ``rows`` None: all of them), and for the rows that leave the pass
    (``OutputRows``), which the last layer computes alone after its attention."""

    num_rows: int
    groups: list[tuple[int, torch.Tensor | None]]
    num_output_rows: int = -1
    output_groups: list[tuple[int, torch.Tensor | None]] | None = None

    def groups_for(self, n: int) -> list[tuple[int, torch.Tensor | None]]:
        """The groups of an input of ``n`` rows: the whole batch's, or the output rows'
        (never as many: output rows are named only where some rows are not sampled)."""
        if n == self.num_rows:
            return self.groups
        if n == self.num_output_rows and self.output_groups is not None:
            return self.output_groups
        raise RuntimeError(f"a LoRA layer got {n} rows; the step has {self.num_rows} and "
                           f"{self.num_output_rows} output rows")


class LoRALinear(nn.Module):
    """A projection layer (merged or not) and its adapters' slots: ``base(x)`` plus, for each
    slot's rows, ``(x A^T) B^T`` in each shard's output columns."""

    def __init__(self, base: nn.Linear, max_loras: int, max_rank: int) -> None:
        super().__init__()
        shards = (base.shards if isinstance(base, MergedLinear)
                  else {"": base.out_features})
        # Under tensor parallelism, the part of an adapter's tensors this rank holds: each
        # shard's output rows of ``B`` (a column-parallel layer's), or the input columns of
        # ``A`` (a row-parallel layer's, whose partial sums the caller all-reduces with the
        # base layer's). Read off the base layer before a CPU kernel replaces it.
        windows = getattr(base, "shard_windows", {})
        weight = getattr(base, "checkpoint_windows", {}).get("weight")
        self.output_windows: list[Window | None] = [windows.get(name) for name in shards]
        self.input_window: Window | None = (
            weight if weight is not None and weight.dim == 1 else None)
        self.base = base
        self.max_rank = max_rank
        self.shard_names = list(shards)
        sizes = list(shards.values())
        self.columns = [slice(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        dtype, device = base.weight.dtype, base.weight.device
        self.register_buffer("lora_a", torch.zeros(
            max_loras, len(sizes) * max_rank, base.in_features, dtype=dtype, device=device))
        for i, size in enumerate(sizes):
            self.register_buffer(f"lora_b{i}", torch.zeros(max_loras, size, max_rank,
                                                           dtype=dtype, device=device))
        # Each slot's shards an adapter changes (the others stay zeros and are skipped).
        self.active: list[list[int]] = [[] for _ in range(max_loras)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = get_forward_context().lora
        if rows is None:
            return y
        r = self.max_rank
        for slot, index in rows.groups_for(x.shape[0]):
            active = self.active[slot]
            if not active:
                continue
            xs = x if index is None else x.index_select(0, index)
            xa = xs @ self.lora_a[slot].t()  # [rows, shards * rank]
            for i in active:
                xa_i, b_t = xa[:, i * r:(i + 1) * r], getattr(self, f"lora_b{i}")[slot].t()
                cols = self.columns[i]
                if index is None:  # into the output's columns, in place (no delta tensor)
                    y[:, cols].addmm_(xa_i, b_t)
                else:  # added into its rows in one pass (no gather of theirs first)
                    y[:, cols].index_add_(0, index, xa_i @ b_t)
        return y

    def set_slot(self, slot: int, shards: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these shards' ``(A, B)`` (``""``: an unmerged layer's), the
        others zeros."""
        r = self.max_rank
        self.lora_a[slot].zero_()
        active = []
        for i, shard in enumerate(self.shard_names):
            b_slot = getattr(self, f"lora_b{i}")[slot]
            b_slot.zero_()
            if shard not in shards:
                continue
            a, b = shards[shard]
            if self.input_window is not None:
                a = self.input_window.read(a)
            if self.output_windows[i] is not None:
                b = self.output_windows[i].read(b)
            self.lora_a[slot, i * r:i * r + a.shape[0]].copy_(a)
            b_slot[:, :b.shape[1]].copy_(b)
            active.append(i)
        self.active[slot] = active


class LoRAState:
    """The model's ``LoRALinear`` layers by decoder layer."""

    def __init__(self, layers: list[dict[str, LoRALinear]], max_loras: int,
                 max_rank: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.max_rank = max_rank

    def load(self, slot: int, adapter: Adapter) -> None:
        for index, modules in enumerate(self.layers):
            by_module: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            for target, (_, attr) in TARGETS.items():
                pair = adapter.weights.get((index, target))
                if pair is not None:
                    shard = target if target in modules[attr].shard_names else ""
                    by_module.setdefault(attr, {})[shard] = pair
            for attr, module in modules.items():
                module.set_slot(slot, by_module.get(attr, {}))

    @contextmanager
    def profiling(self) -> Iterator[None]:
        """Slot 0 computes every shard meanwhile (zeros, or its adapter's): a profile run's
        worst case, whatever the slot holds."""
        saved = [[list(m.active[0]) for m in modules.values()] for modules in self.layers]
        for modules in self.layers:
            for module in modules.values():
                module.active[0] = list(range(len(module.columns)))
        try:
            yield
        finally:
            for modules, actives in zip(self.layers, saved, strict=True):
                for module, active in zip(modules.values(), actives, strict=True):
                    module.active[0] = active

    def clear(self, slot: int) -> None:
        for modules in self.layers:
            for module in modules.values():
                module.set_slot(slot, {})


def attach_lora(model: nn.Module, max_loras: int, max_rank: int) -> LoRAState:
    """Wrap every decoder layer's projections in ``LoRALinear``s of ``max_loras`` empty slots
    (the model's ``lora`` attribute then holds them). A merged gate/up layer no longer asks
    for its activation to be fused into it: an adapter adds to its sums first."""
    from mmserve.models.llama import DecoderLayer

    layers = []
    for layer in (m for m in model.modules() if isinstance(m, DecoderLayer)):
        modules = {}
        for owner, attr in dict.fromkeys(TARGETS.values()):
            parent = getattr(layer, owner)
            base = getattr(parent, attr)
            if getattr(base, "fused_activation", None) is not None:
                base.fused_activation = None
            wrapped = LoRALinear(base, max_loras, max_rank)
            setattr(parent, attr, wrapped)
            modules[attr] = wrapped
        layers.append(modules)
    if not layers:
        raise AdapterError(f"{type(model).__name__} has no decoder layers LoRA adapters run on")
    state = LoRAState(layers, max_loras, max_rank)
    model.lora = state
    return state


def adapter_slot_bytes(model: nn.Module) -> int:
    """The memory ``attach_lora``'s slots take in ``model`` (this rank's share of them)."""
    return sum(b.numel() * b.element_size() for m in model.modules()
               if isinstance(m, LoRALinear) for b in m.buffers(recurse=False))
