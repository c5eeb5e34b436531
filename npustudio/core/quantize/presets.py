"""Precision presets and per-layer overrides: which bitwidth each tensor of the adapted decoder gets.

A preset says what the HTP runs well; an override file lets a user keep sensitive layers wider
(mixed precision) without touching code. Override file (JSON):
    {"weights": {"layers.0.mlp.down": 8, "layers.*.attn.o": 8}, "activations": {"layers.1.mlp.down": 16}}
Patterns are shell globs over module names of the adapted decoder (see `npustudio encodings`). A pattern
that matches no module is an error naming it and the closest names: a typo would silently lose the mixed
precision.
"""

from __future__ import annotations

import difflib
import fnmatch
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import UserError
from ..fsutil import check_keys, read_json
from ..stage_options import DEFAULT_INT8_BUDGET, PRECISIONS
from ..stage_options import Overrides as Overrides  # re-exported: a quantize option, declared there


class Preset(BaseModel):
    name: str
    weight_bits: int
    block_size: int | None = None  # None: per output channel; else LPBQ blocks along input channels
    head_bits: int = 8  # the LM head stays int8 per channel: int4 there costs the most perplexity
    activation_bits: int = 16
    kv_bits: int = 8
    embedding_bits: int = 16  # the table is a Gather on the HTP: per tensor, so 16-bit keeps it exact


PRESETS: dict[str, Preset] = {name: Preset(name=name, weight_bits=s.weight_bits, block_size=s.block_size)
                               for name, s in PRECISIONS.items()}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"Unknown precision {name!r}.", f"Use one of: {', '.join(PRESETS)}.")
    return PRESETS[name]


def takes_int8_budget(precision: str) -> bool:
    """Whether `precision` has 4-bit weights for `--int8-budget` to widen (the stage, the CLI and the window ask)."""
    return preset(precision).weight_bits < 8


def takes_4bit_head(precision: str) -> bool:
    """Whether `--lm-head-bits 4` applies at `precision` (`PrecisionSpec.takes_4bit_head`)."""
    preset(precision)  # an unknown name refused as the stage refuses it
    return PRECISIONS[precision].takes_4bit_head


def with_head(p: Preset, lm_head_bits: int) -> Preset:
    """`p` with the LM head at `lm_head_bits` (an override file's `lm_head` pattern still wins)."""
    return p.model_copy(update={"head_bits": lm_head_bits})


def int8_budget_of(precision: str, given: float | None) -> float:
    """The int8 budget a quantize run at `precision` spends: the one given, else the default where it has 4-bit
    weights (`--int8-budget` left out, or a project made before the option had a default)."""
    if given is not None:
        return given
    return DEFAULT_INT8_BUDGET if takes_int8_budget(precision) else 0.0


ALLOWED = {"weights": (4, 8, 16), "activations": (8, 16)}
NOTE = "_about"  # an override file's note for people (the shipped ones say why they exist); not read


def load_overrides(path: str | Path | None) -> Overrides:
    if not path:
        return Overrides()
    p = Path(path).expanduser()
    fix = 'Write JSON like {"weights": {"layers.0.mlp.down": 8}, "activations": {}}.'
    if not p.is_file():
        raise UserError(f"No override file at {p}.", fix)
    data = read_json(p, "override file", fix)
    check_keys(data, [*Overrides.model_fields, NOTE], p, "override file", fix)
    if isinstance(data, dict):
        data.pop(NOTE, None)
    try:
        ov = Overrides.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{p} has the wrong shape: {e.errors()[0]['msg']} at "
                        f"{'.'.join(str(x) for x in e.errors()[0]['loc'])}.", fix) from e
    for kind, allowed in ALLOWED.items():
        for pattern, bits in getattr(ov, kind).items():
            if bits not in allowed:
                raise UserError(f"{p}: {kind} bitwidth {bits} for {pattern!r} is not supported.",
                                f"Use one of {', '.join(map(str, allowed))} for {kind}.")
    return ov


def override_targets(model: Any) -> dict[str, list[str]]:
    """The module names each section of an override file can name: weights are the 1x1 convolutions and the
    embedding table; activations are the leaf ops (each gets its own quantizers in the quantsim)."""
    from ..graph.ops import Conv1x1

    mods = list(model.named_modules())
    return {"weights": [n for n, m in mods if isinstance(m, Conv1x1)] + ["embed"],
            "activations": [n for n, m in mods if n and not any(True for _ in m.children())]}


def check_overrides(ov: Overrides, model: Any) -> None:
    """Every pattern must match some module of `model` (the adapted decoder): else a UserError naming it."""
    targets = override_targets(model)
    for kind, names in targets.items():
        for pattern in getattr(ov, kind):
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
            raise UserError(f"The override pattern {pattern!r} ({kind}) matches no module of the adapted model.",
                            (f"Did you mean {', '.join(repr(c) for c in close)}? " if close else "")
                            + f"{kind.capitalize()} module names look like {names[0]!r} "
                            "(`npustudio encodings` lists them); shell globs like 'layers.*.mlp.down' work.")
