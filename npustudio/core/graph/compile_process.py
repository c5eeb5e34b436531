"""One graph compiled by QNN in a process of its own, so that several compile at once.

QNN's compile of a graph runs on one core, and its log (where the estimate of a graph too large for the HTP is
read) goes to the process's stderr, which `ort_qnn.compile_graph` captures: two compiles cannot share one process.
The child is started with an argument list (no shell) and writes its outcome as JSON to an anonymous file it
inherits (`forked.Outcome`); on Linux it dies with the thread that started it, so a killed stage leaves no
compile running and no file behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..forked import Started, die_with_parent, leave, unpack
from ..progress import StateLike
from ..results import Compiled
from ..targets import Soc
from .ort_qnn import GraphTooLarge, compile_graph


class Running(Started):
    """A compile started in its own process; `result` waits for it."""

    def __init__(self, onnx: Path, graph: str, out_dir: Path, target: Soc, optimize: str, nice: int = 0) -> None:
        """`nice`: how much lower the compile's CPU priority is (the compiles off the critical path yield to the
        one on it)."""
        self.graph = graph
        super().__init__(__name__, [str(onnx), graph, str(out_dir), target.model_dump_json(), optimize, str(nice)],
                         f"the compile of {graph}")

    def result(self, state: StateLike) -> Compiled:
        """The compiled graph; QNN's refusal (GraphTooLarge), a UserError or the child's crash raised here. The
        user's stop (`state.check`) kills the compile."""
        r = json.loads(self.outcome(state))
        if "too_large" in r:
            raise GraphTooLarge(*r["too_large"])
        return Compiled.model_validate(unpack(r, self.what))


def main(argv: list[str]) -> None:
    onnx, graph, out_dir, target, optimize, nice, result = argv
    die_with_parent()
    if int(nice) and hasattr(os, "nice"):
        os.nice(int(nice))
    out: dict[str, Any]
    try:
        out = {"result": compile_graph(Path(onnx), graph, Path(out_dir), Soc.model_validate_json(target),
                                       optimize=optimize).model_dump()}
    except GraphTooLarge as e:
        out = {"too_large": [e.graph, e.reason]}
    except UserError as e:
        out = {"user_error": [e.problem, e.fix]}
    leave(int(result), json.dumps(out).encode())


if __name__ == "__main__":
    main(sys.argv[1:])
