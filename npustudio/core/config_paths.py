"""The files a runtime's config names, each checked to be inside the model's own folder before the runtime opens it.

A runtime opens whatever its config names: Genie the ctx-bins, tokenizer and LUT of genie_config.json, MNN the
`llm_model`, `llm_weight`, `tokenizer_file`, `llm_config`… of config.json, resolved against the config's folder
(or its `base_dir`). A pushed or edited config naming `../../etc/passwd` would make the runtime read a file of the
computer or phone it runs on. One rule for every runtime: a name that is a path (has a separator, or names an entry
of the folder) must resolve, through links, to a file inside the folder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# MNN's config keys that hold a file or folder name (its llmconfig.hpp: base_dir + value), at any depth
MNN_PATH_KEY = re.compile(r"(^|_)(dir|model|weight|weights|file|config|path|bin)$")


def strings(config: Any, where: str = "", key: Callable[[str], bool] = lambda _k: True) -> Iterator[tuple[str, str]]:
    """(where, value) of each string in `config` under a key `key` accepts ("a.b[0]" says where)."""
    if isinstance(config, dict):
        for k, v in config.items():
            at = f"{where}.{k}" if where else str(k)
            if isinstance(v, str):
                if key(str(k)):
                    yield at, v
            else:
                yield from strings(v, at, key)
    elif isinstance(config, list):
        for i, v in enumerate(config):
            at = f"{where}[{i}]"
            if isinstance(v, str):
                if key(where.rsplit(".", 1)[-1]):
                    yield at, v
            else:
                yield from strings(v, at, key)


def leaves_folder(value: str, folder: Path) -> bool:
    """Whether `value`, read as a file name in `folder`, names something outside it. A plain word that names no
    entry ("basic", "QnnHtp") is not a file name; C opens a name only up to its first NUL."""
    name = value.split("\0", 1)[0]
    if not name.strip():
        return False
    p = folder / name
    try:
        named = "/" in name or "\\" in name or name.strip() in (".", "..") or p.is_symlink() or p.exists()
    except OSError:  # too long to be a file name
        return False
    if not named:
        return False
    try:
        real = p.resolve()
    except (OSError, RuntimeError):  # a link loop
        return True
    return folder != real and folder not in real.parents


def first_outside(config: Any, folder: Path,
                  key: Callable[[str], bool] = lambda _k: True) -> tuple[str, str] | None:
    """(where, value) of the first string of `config` (under a key `key` accepts) naming a file outside `folder`."""
    folder = Path(folder).resolve()
    return next(((at, v) for at, v in strings(config, key=key) if leaves_folder(v, folder)), None)


def mnn_key(k: str) -> bool:
    return bool(MNN_PATH_KEY.search(k))
