"""LoRA adapters on the engine's side: a request's adapter checked when it is made
(``LoRAChecker``), and the runner's ``max_loras`` slots handed to the adapters of running
requests (``LoRASlots``), which the scheduler asks before it admits a request."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from mmserve.config import EngineConfig
from mmserve.errors import AdapterUnavailableError, InvalidInputError
from mmserve.lora_request import LoRARequest
from mmserve.models.lora import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter

# Adapters whose check passed, remembered so that their files' headers are not read again
# for every request.
_CHECKED_ADAPTERS = 256


def prompt_lora(prompt: dict[str, Any] | str) -> LoRARequest | None:
    """The adapter a prompt runs with (its ``lora_request``, which the front doors set)."""
    lora = prompt.get("lora_request") if isinstance(prompt, dict) else None
    if lora is not None and not isinstance(lora, LoRARequest):
        raise InvalidInputError(f"lora_request must be a LoRARequest, got "
                                f"{type(lora).__name__}.", param="lora_request")
    return lora


class LoRAChecker:
    """Checks a request's adapter against the model when the request is made: its config,
    and its tensors' names and shapes from the file's header (``models/lora.py``'s
    ``read_adapter`` without the data); an adapter whose files are as they were when it last
    passed is not read again. Thread-safe: a server makes requests on several threads."""

    def __init__(self, text_config, max_rank: int) -> None:
        self.text_config = text_config
        self.max_rank = max_rank
        self._passed: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, lora: LoRARequest) -> None:
        key = (lora, _stamp(lora.lora_path))
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return
        try:
            read_adapter(lora.lora_name, lora.lora_path, self.text_config, self.max_rank)
        except AdapterError as e:
            raise AdapterUnavailableError(str(e), param="lora_request") from e
        if key[1] is None:
            return  # (files that were not there a moment ago: checked again next time)
        with self._lock:
            self._passed[key] = None
            while len(self._passed) > _CHECKED_ADAPTERS:
                self._passed.popitem(last=False)


def _stamp(folder: str) -> tuple | None:
    """When and how large an adapter's two files are (None: one is not there)."""
    try:
        return tuple((s.st_mtime_ns, s.st_size) for s in (
            os.stat(os.path.join(folder, name)) for name in (CONFIG_FILE, WEIGHTS_FILE)))
    except OSError:
        return None


def lora_checker(config: EngineConfig, hf_config) -> LoRAChecker | None:
    """The checker of an engine's requests' adapters (None: it runs none)."""
    if not config.enable_lora:
        return None
    return LoRAChecker(hf_config.text_config, config.max_lora_rank)


def check_adapters(model: str, adapters: Sequence[tuple[str, str]], max_rank: int) -> None:
    """``AdapterError`` naming the first of ``adapters`` (name, folder) that cannot run on
    the checkpoint at ``model`` (a server's --lora-modules before the weights load, or one it
    is asked to load)."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(model, local_files_only=True).text_config
    for name, path in adapters:
        read_adapter(name, path, text_config, max_rank)


class LoRASlots:
    """Which adapter each of the runner's ``max_loras`` slots holds, and how many running
    requests use it. A request takes its adapter's slot when it is admitted and gives it back
    when it stops running (finished or preempted); an adapter without a slot takes the one
    whose adapter has been unused longest, and waits while every slot is in use."""

    def __init__(self, max_loras: int) -> None:
        self.adapters: list[LoRARequest | None] = [None] * max_loras
        self.users = [0] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0

    def _slot_of(self, lora: LoRARequest) -> int | None:
        for slot, held in enumerate(self.adapters):
            if held == lora:
                return slot
        return None

    def _free_slot(self) -> int | None:
        free = [slot for slot, users in enumerate(self.users) if users == 0]
        return min(free, key=self._last_used.__getitem__) if free else None

    def available(self, lora: LoRARequest) -> bool:
        """Whether a request of ``lora`` could be admitted now."""
        return self._slot_of(lora) is not None or self._free_slot() is not None

    def acquire(self, lora: LoRARequest) -> tuple[int, bool]:
        """A slot for a request of ``lora`` (``available`` must have said so), and whether
        the adapter is to be loaded into it first."""
        slot = self._slot_of(lora)
        load = slot is None
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire without a slot available"
            self.adapters[slot] = lora
        self.users[slot] += 1
        return slot, load

    def forget(self, slot: int) -> None:
        """The runner could not load the slot's adapter: the next request of it takes a slot
        anew and loads it (this one is free once its requests have failed)."""
        self.adapters[slot] = None

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        assert self.users[slot] >= 0, f"LoRA slot {slot} released more often than taken"
        self._clock += 1
        self._last_used[slot] = self._clock
