"""``LoRARequest``: the adapter a request runs with, as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.errors import InvalidInputError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter, in PEFT's format (a folder of ``adapter_config.json`` and
    ``adapter_model.safetensors``), that a request's decoder runs with.

    As vLLM's: ``lora_name`` names it (a server's ``--lora-modules`` name is the ``model``
    clients send) and ``lora_int_id`` is a positive integer; requests of one adapter (the
    same name, id and path) share its slot and its prefix-cache blocks. ``lora_path`` is read
    when the adapter takes a slot, and again whenever it takes one back after other adapters
    took its own; its files must not change while an engine runs it (its prefix-cache blocks
    would then mix the two)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidInputError("LoRARequest's lora_name must be a non-empty string.",
                                    param="lora_request")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise InvalidInputError(f"LoRARequest's lora_int_id must be a positive integer "
                                    f"(vLLM's rule), got {self.lora_int_id!r}.",
                                    param="lora_request")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidInputError("LoRARequest's lora_path must be the adapter's folder.",
                                    param="lora_request")

    @property
    def identity(self) -> tuple[str, int, str]:
        """What tells it from other adapters: its name, id and path."""
        return (self.lora_name, self.lora_int_id, self.lora_path)
