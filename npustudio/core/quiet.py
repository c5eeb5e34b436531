"""Keep other libraries' noise out of what people read: their deprecation warnings and progress bars say nothing a
user can act on, and in a CI log or a pipe each bar redraw is a line of its own.

`libraries()` is called by the CLI and by every stage's child process; `NPUSTUDIO_DEBUG=1` (the CLI's --debug)
leaves everything as the libraries print it.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

DEBUG_ENV = "NPUSTUDIO_DEBUG"

# (category, message regex, module regex): warnings raised inside torch/aimet/transformers about their own APIs
_WARNINGS = (
    (FutureWarning, "", r"torch(\.|$)"),
    (DeprecationWarning, "", r"(torch|aimet_torch|transformers|onnx|onnxscript)(\.|$)"),
    (UserWarning, "", r"aimet_torch(\.|$)"),
    (UserWarning, ".*TF32 acceleration on top of oneDNN", ""),
)


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def libraries() -> None:
    """Silence third-party warnings and progress bars in this process (and the environment its children inherit)."""
    if debugging():
        return
    for category, message, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    # read by huggingface_hub and transformers (whose bars follow the hub's switch) when they are imported, also in
    # a spawned child
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # bars that call tqdm directly (transformers' GGUF loader: one redraw per tensor), read when tqdm is imported
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if "tqdm" in sys.modules:  # imported already (torch imports it), so its environment was read before
        _tqdm_off_by_default()
    if "transformers" in sys.modules:  # already imported: its switches, not the environment
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()


def _tqdm_off_by_default() -> None:
    """Every tqdm bar made from now on is off unless its caller turns it on (what TQDM_DISABLE does when it is
    set before tqdm is imported)."""
    from tqdm import std

    init = std.tqdm.__init__
    if getattr(init, "off_by_default", False):
        return

    def off(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("disable", True)
        init(self, *args, **kwargs)

    off.off_by_default = True  # type: ignore[attr-defined]
    std.tqdm.__init__ = off
