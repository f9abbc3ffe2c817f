"""What a step's outputs cost to cross from the engine core to the server's front end.

The core pickles what each step did to each request (``CoreOutput``s: the token, finishes,
log-probabilities) on its stepping thread's behalf (``core_process.py``); this times that,
and the front end's unpickling, for a decode step of ``--requests`` requests (one new token
each): as named tuples, as the plain tuples the core sends, and, for comparison, as the
``RequestOutput``s (text and all) the core sent before the front end made the outputs.

    python benchmarks/core_messages.py --requests 256
"""

from __future__ import annotations

import argparse
import pickle
import time

from mmserve.engine.output_processor import CoreOutput
from mmserve.outputs import RequestOutput


def best_ms(fn, repeats: int = 5, number: int = 100) -> float:
    """The fastest of ``repeats`` runs of ``number`` calls, per call, in milliseconds."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e3)
    return min(runs)


def row(name: str, dump, load) -> None:
    data = dump()
    print(f"{name:<20} {best_ms(dump):16.3f}   {best_ms(lambda: load(data)):22.3f}   "
          f"{len(data):5d}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    args = p.parse_args()
    n = args.requests
    core = [CoreOutput(str(i), [17], None, None, 0) for i in range(n)]
    outputs = [RequestOutput(str(i), "", [17], 100, new_text=" word", new_token_ids=[17])
               for i in range(n)]
    print(f"{n} outputs          pickle (core) ms   unpickle (front end) ms   bytes")
    row("request outputs", lambda: pickle.dumps(outputs, protocol=5), pickle.loads)
    row("core, named tuples", lambda: pickle.dumps(core, protocol=5), pickle.loads)
    row("core, plain tuples", lambda: pickle.dumps([tuple(o) for o in core], protocol=5),
        lambda data: [CoreOutput._make(v) for v in pickle.loads(data)])


if __name__ == "__main__":
    main()
