"""A function run in a fresh interpreter, beside work this process goes on with.

For work that must not share this process's native state: two HTP simulator sessions in one process run one
call at a time (the default model's AR-128 call and four AR-1 steps: 56 s in one process, 39 s in two). Started
with `subprocess`, not multiprocessing: a stage may itself run in a daemonic multiprocessing child, which may
not start children of its own. The function and its arguments go to the child as a pickle on its stdin (an
anonymous file), and the outcome comes back as one in an `Outcome`: only this package's processes write or
read them, never a user's, and neither has a name on disk. The child dies with the thread that started it
(Linux), so a killed stage leaves none running and no file behind.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from .forked import Started, die_with_parent, leave, outcome, unpack
from .progress import StateLike


class Spawned(Started):
    """`fn()` (a module-level function or a partial of one; its result picklable) started in a fresh interpreter;
    `result` waits for it."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        with tempfile.TemporaryFile() as given:
            given.write(pickle.dumps(fn))
            given.seek(0)
            super().__init__(__name__, [], name, stdin=given)

    def result(self, state: StateLike) -> Any:
        """What `fn` returned; its UserError, or its failure as a RuntimeError, raised here. The user's stop
        (`state.check`) kills the child."""
        return unpack(pickle.loads(self.outcome(state)), self.what)


def main(fd: str) -> None:
    die_with_parent()
    import torch

    torch.set_num_threads(1)  # the work beside the caller's: one core
    leave(int(fd), pickle.dumps(outcome(pickle.loads(sys.stdin.buffer.read()))))


if __name__ == "__main__":
    main(sys.argv[1])
