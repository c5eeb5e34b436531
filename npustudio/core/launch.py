"""The argv that runs one of this package's device programs in a fresh, isolated interpreter.

What the virtual device starts for a phone's runtime (genie-t2t-run, MNN's llm_demo): `-I` (no PYTHON* variables,
no user site, neither the current folder nor a script's on sys.path), then this very package's folder appended to
sys.path (it shadows nothing) and the module's `main` called on the arguments. No CLI module, settings file or
shell is involved. A packaged app is its own interpreter, whose launcher runs `-m MODULE` as python does.
"""

from __future__ import annotations

import sys
from pathlib import Path

# a constant: the folder and the module come as arguments, and the module is one of this package's (`isolated`)
LAUNCH = ("import sys, importlib; sys.path.append(sys.argv.pop(1)); "
          "sys.exit(importlib.import_module(sys.argv.pop(1)).main(sys.argv[1:]))")
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def isolated(module: str, *args: str) -> list[str]:
    """`module`'s `main(args)` in a new interpreter; `module` is a name inside this package, never a user's."""
    if not module.startswith("npustudio."):
        raise ValueError(f"{module} is not one of this package's modules")
    if getattr(sys, "frozen", False):
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-I", "-c", LAUNCH, str(PACKAGE_PARENT), module, *args]
