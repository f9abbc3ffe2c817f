"""The engine flags, derived from ``EngineConfig``'s fields: every front door (``caption``,
``serve``, ``plan``, ``bench``) adds them with ``add_engine_args`` and builds its config with
``engine_kwargs``. A setting is declared once, on its field (``config.flag``); nothing here
names one, but vLLM's ``--pooler-config``, read into two of them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Callable
from typing import Any

from mmserve.config import EngineConfig, pooler_config_kwargs


def engine_fields() -> list[dataclasses.Field]:
    """The fields that are flags: those declared with ``config.flag`` (not ``model``, which
    each front door takes its own way, nor the derived ``max_image_size``)."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def option(f: dataclasses.Field) -> str:
    """The flag's spelling: ``--max-model-len``; ``--no-NAME`` for a switch that is on by
    default."""
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The ``engine`` group of flags: ``--model``, then one flag per ``EngineConfig`` field."""
    g = parser.add_argument_group("engine", "the fields of EngineConfig (mmserve/config.py), "
                                  "named as in vLLM")
    g.add_argument("--model", help="local Hugging Face checkpoint directory "
                   "(default: the bundled demo model)")
    for f in engine_fields():
        help = f.metadata["help"]
        if _is_auto_switch(f):  # --NAME, --no-NAME, or neither for auto
            g.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                           action=argparse.BooleanOptionalAction, help=help)
            continue
        if isinstance(f.default, bool):
            off = f.default
            g.add_argument(option(f), dest=f.name, action="store_false" if off else "store_true",
                           help=f"turn off {help}" if off else help)
            continue
        if f.default is not None:  # a None default is described by the help itself
            help += " (default: %(default)s)"
        g.add_argument(option(f), dest=f.name, type=_reader(f), default=f.default,
                       choices=f.metadata["choices"], help=help)
    g.add_argument("--pooler-config", type=_pooler_config, default=None,
                   help="vLLM's spelling of --pooling-type and --[no-]normalize-embeddings: "
                   '\'{"pooling_type": "MEAN", "normalize": true}\'')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments (all but ``model``) from parsed flags, vLLM's
    ``--pooler-config`` among them (a ``ValueError`` where it and a flag of its own
    disagree)."""
    kwargs = {f.name: getattr(args, f.name, f.default) for f in engine_fields()}
    for name, value in (getattr(args, "pooler_config", None) or {}).items():
        if kwargs[name] is not None and kwargs[name] != value:
            raise ValueError(f"--pooler-config and --{name.replace('_', '-')} disagree; give "
                             "one of them.")
        kwargs[name] = value
    return kwargs


def _pooler_config(text: str) -> dict[str, Any]:
    try:
        return pooler_config_kwargs(text)
    except ValueError as e:  # argparse shows this message as a usage error
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as command-line text: what
    a front door passes on to an ``mmserve serve`` it starts."""
    argv: list[str] = []
    values = engine_kwargs(args)  # (--pooler-config's as the flags of its fields)
    for f in engine_fields():
        value = values[f.name]
        if value == f.default:
            continue
        if _is_auto_switch(f):
            name = f.name.replace("_", "-")
            argv.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(f.default, bool):
            argv.append(option(f))
        else:
            text = ("auto" if value is None else
                    json.dumps(value) if isinstance(value, dict) else str(value))
            argv += [option(f), text]
    return argv


def _is_auto_switch(f: dataclasses.Field) -> bool:
    """A switch whose default (None) the engine decides: on, off, or auto."""
    return f.default is None and typing.get_type_hints(EngineConfig)[f.name] == (bool | None)


def _reader(f: dataclasses.Field) -> Callable[[str], Any]:
    """Flag text -> field value: ``parse`` from the field's metadata, else its type."""
    parse = f.metadata["parse"]
    if parse is None:
        hint = typing.get_type_hints(EngineConfig)[f.name]
        kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
        if len(kinds) != 1 or kinds[0] not in (int, float, str):
            raise TypeError(f"EngineConfig.{f.name}: a flag of type {hint} needs parse=")
        return kinds[0]

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # argparse shows this message as a usage error
            raise argparse.ArgumentTypeError(str(e)) from None

    return read
