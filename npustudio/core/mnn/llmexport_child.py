"""MNN's exporter (`llmexport`), run as `python -m npustudio.core.mnn.llmexport_child ARGS…` in its own process.

Two things of the installed packages are not run as shipped:
- `llmexport`'s package cannot be imported (its script imports `utils.*` from its own folder), so its script is run
  with that folder on the path, as its authors run it;
- MNN's converter imports `MNN.tools.utils.log`, which shells out to `pip install` a logging SDK and sends the
  machine's id to a remote log store: that module is replaced by one without a logger before anything imports
  it (MNN's converter then skips its logging), so an export never installs or sends anything.
The Hugging Face libraries are told to stay offline: the exporter reads only the folder it is given.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path


def script() -> Path:
    """llmexport's own script, in its installed folder."""
    spec = importlib.util.find_spec("llmexport")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llmexport is not installed: run `bash packaging/bootstrap.sh`")
    return Path(next(iter(spec.submodule_search_locations))) / "llmexport.py"


def main(argv: list[str]) -> None:
    from ..forked import die_with_parent

    die_with_parent()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    quiet_log = types.ModuleType("MNN.tools.utils.log")
    quiet_log.mnn_logger = None  # type: ignore[attr-defined]
    sys.modules["MNN.tools.utils.log"] = quiet_log
    path = script()
    sys.path.insert(0, str(path.parent))
    sys.argv = [str(path), *argv]
    # run as its authors run it (`python llmexport.py …`); not runpy, whose restoring of sys.argv fails once MNN's
    # converter has replaced it
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})
    finally:  # a packaged app starts this module through runpy (`-m`), which then puts sys.argv[0] back
        sys.argv = [str(path), *argv]


if __name__ == "__main__":
    main(sys.argv[1:])
