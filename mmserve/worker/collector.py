"""Python's cycle collector beside a running engine.

A process that has imported torch and transformers and loaded a model tracks about half a
million container objects (modules, parameters, the libraries' own), and nearly all of them
live as long as the process. Each full collection walks every one: with 256 requests
decoding on a tiny model, one took 240 ms in the middle of a step, stalling every request
(a full collection comes every hundred or so such steps). Once an engine has started, its
objects are moved out of the collector's sight (``gc.freeze``), after a collection so that
no garbage is frozen with them; collections then walk only what was made since.

Freezing is process-wide: it also takes the caller's objects alive then, and frozen objects
are never collected, even once they are garbage in a reference cycle. So the engines that
froze are counted, and when one of them closes (``thaw``) everything frozen goes back to the
collector for a full collection, then what is left is frozen again if other engines still
run; so it also goes back at the interpreter's exit, whose last collection then finds it
(extension libraries report objects still alive at exit as leaks).
"""

from __future__ import annotations

import atexit
import gc
import threading

# Reentrant: a collection (an automatic one, set off by any allocation) may run an unclosed
# engine's finalizer, which closes it and thaws, on a thread already holding the lock.
_lock = threading.RLock()
_holders = 0  # engines of this process that froze and have not closed
_thaw_at_exit = False


def freeze_long_lived() -> None:
    """Collect what is garbage now, then freeze every object alive (start-up's), for one
    more engine (``thaw`` when it closes)."""
    global _holders, _thaw_at_exit
    gc.collect()  # outside the lock: what it finalizes may be an engine that thaws
    with _lock:
        _holders += 1  # first: an engine finalized in here then thaws to a count above 0,
        # and so freezes again what its thaw gave back
        gc.freeze()
        if not _thaw_at_exit:
            atexit.register(gc.unfreeze)
            _thaw_at_exit = True


def freeze_again() -> None:
    """Freeze what start-up made since ``freeze_long_lived`` (a tensor-parallel worker's KV
    cache and captured graphs, built on the engine's later calls), for the same holder."""
    gc.freeze()


def holders() -> int:
    """Engines of this process that froze and have not closed."""
    return _holders


def thaw() -> None:
    """An engine that froze has closed: give the frozen objects back to the collector (its
    model and caches may be held by reference cycles) and collect; while other engines of
    the process run, freeze what is left again (one full collection at the close, where
    their frozen start-up would otherwise keep every closed engine's cycles for good)."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        gc.unfreeze()
    gc.collect()  # outside the lock: what it finalizes may be an engine that thaws
    with _lock:
        if _holders > 0:
            gc.freeze()
