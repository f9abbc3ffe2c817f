"""Python's cycle collector beside a running engine.

A process that has imported torch and transformers and loaded a model tracks about half a
million container objects (modules, parameters, the libraries' own), and nearly all of them
live as long as the process. Each full collection walks every one: with 256 requests
decoding on a tiny model, one took 240 ms in the middle of a step, stalling every request
(a full collection comes every hundred or so such steps). Once an engine has started, its
objects are moved out of the collector's sight (``gc.freeze``), after a collection so that
no garbage is frozen with them; collections then walk only what was made since.

Frozen objects are never collected, so an engine's ``close`` gives them back to the
collector (``thaw``), and so does the interpreter's exit, whose last collection finds them
(extension libraries report objects still alive at exit as leaks).
"""

from __future__ import annotations

import atexit
import gc

_thaw_at_exit = False


def freeze_long_lived() -> None:
    """Collect what is garbage now, then freeze every object alive (start-up's)."""
    global _thaw_at_exit
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit:
        atexit.register(gc.unfreeze)
        _thaw_at_exit = True


def thaw() -> None:
    """Give the frozen objects back to the collector (an engine closing: its model and
    caches may be held by reference cycles). Another engine still running in the process
    loses nothing but the shorter collections."""
    gc.unfreeze()
