"""What a step's outputs cost to cross from the engine core to the server's front end.

The core pickles each step's ``RequestOutput``s on its stepping thread (``core_process.py``);
this times that, and the front end's unpickling, for a decode step of ``--requests`` requests
(one new token each), as dataclasses and as the tuples of their fields the core sends.

    python benchmarks/core_messages.py --requests 256
"""

from __future__ import annotations

import argparse
import pickle
import time

from mmserve.engine.core_process import output_values
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    args = p.parse_args()
    outputs = [RequestOutput(str(i), "", [17], 100, new_text=" word", new_token_ids=[17])
               for i in range(args.requests)]
    as_objects = pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL)
    as_tuples = pickle.dumps([output_values(o) for o in outputs],
                             protocol=pickle.HIGHEST_PROTOCOL)
    print(f"{args.requests} outputs   pickle (core) ms   unpickle (front end) ms   bytes")
    print(f"dataclasses   {best_ms(lambda: pickle.dumps(outputs, protocol=5)):16.3f}"
          f"   {best_ms(lambda: pickle.loads(as_objects)):22.3f}   {len(as_objects):5d}")
    print(f"tuples        "
          f"{best_ms(lambda: pickle.dumps([output_values(o) for o in outputs], 5)):16.3f}"
          f"   {best_ms(lambda: [RequestOutput(*v) for v in pickle.loads(as_tuples)]):22.3f}"
          f"   {len(as_tuples):5d}")


if __name__ == "__main__":
    main()
