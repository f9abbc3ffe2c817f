"""Errors every layer may raise: a leaf module, so sampling parameters, processing, the engine
and the front doors share one class without importing each other."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """A request the engine refuses, with a message that says what to change. ``param`` names
    the offending field (OpenAI's error body carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidInputError):
    """A prompt longer than the model's context (``max_model_len``): its text already, before
    it was tokenized, or its tokens, images' included. The Responses API's ``truncation:
    "auto"`` drops a conversation's earliest turns on it."""

    def __reduce__(self) -> tuple:  # (crosses from the engine core's process intact)
        return type(self), (str(self), self.param)


class AdapterUnavailableError(InvalidInputError):
    """A request's LoRA adapter that cannot run (its files, its config, another model's
    shapes), saying why: the caller's input in the Python API; a server's own adapter's fault
    where the request only named it."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more (its steps keep failing for requests that had run
    fine, or it was shut down); in-flight requests cannot finish."""
