"""An MNN model's config.json (and the llm_config.json it names) checked before MNN's runtime opens a file it names.

MNN reads every model file as `base_dir + value` (its llmconfig.hpp), `base_dir` being the config's folder unless the
config sets one: `"tokenizer_file": "../../etc/passwd"` would have it read a file of the computer (or phone) it runs
on. Every such value must name a file inside the model folder (`config_paths`), as a Genie bundle's must.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config_paths import first_outside, leaves_folder, mnn_key
from ..errors import UserError
from ..fsutil import read_json

FIX = ("An MNN model's config names only files inside its folder: make the model again with "
       "`npustudio compile --backend mnn --project P`.")


def outside(config: Path) -> tuple[str, str, str] | None:
    """(file, key, value) of the first file name in the model's config.json or llm_config.json that leads out of the
    model folder; None when all stay inside. UserError for a config that is not readable JSON."""
    folder = Path(config).resolve().parent
    data: Any = read_json(Path(config), "MNN config", FIX)
    found = first_outside(data, folder, mnn_key)
    if found is not None:
        return Path(config).name, *found
    name = data.get("llm_config", "llm_config.json") if isinstance(data, dict) else "llm_config.json"
    base = data.get("base_dir", "") if isinstance(data, dict) else ""
    if not isinstance(name, str) or not isinstance(base, str) or leaves_folder(base + name, folder):
        return None  # a non-string: MNN takes its default; a path out was named above already
    llm_config = folder / (base + name)
    try:
        if not llm_config.is_file():
            return None
    except OSError as e:  # a name the file system cannot hold (too long): MNN would not open it either
        raise UserError(f"The MNN model's config.json names {(base + name)[:80]!r} as its llm_config, which this "
                        f"system cannot open ({e.strerror}).", FIX) from e
    found = first_outside(read_json(llm_config, "MNN llm_config", FIX), folder, mnn_key)
    return (llm_config.name, *found) if found is not None else None


def check(config: Path) -> None:
    """UserError naming the file and key when the config names a file outside the model folder."""
    found = outside(config)
    if found is not None:
        file, key, value = found
        raise UserError(f"The MNN model's {file} names {value!r} under '{key}', which is outside the model folder "
                        f"{Path(config).resolve().parent}.", FIX)
