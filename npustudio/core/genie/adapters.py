"""Choosing a bundle's switchable LoRA adapter at run time: in real Genie, in the CPU preview, on a device.

A bundle built with `--lora-switchable` carries each adapter as the `.raw` files of Genie's input-weight LoRA
(lora-version 1, `graph.lora_inputs`). Genie writes an adapter's strength into the graphs' strength input only
when it applies an adapter while another is applied (libGenie 1.21: the first `GenieDialog_applyLora` of a dialog
loads the weights and leaves the strength input as it found it), so the strength is always set after applying:
`GenieDialog_setLoraStrength`, as genie-t2t-run's `-l NAME,TENSOR,VALUE` does. The base model is an adapter at
strength 0 (its branch multiplied by an exact zero), not whatever the strength input's memory held.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from .. import layout
from ..errors import UserError

if TYPE_CHECKING:
    from .libgenie import Dialog
    from .meta import BundleMeta

ALPHA = layout.LORA_ALPHA


class Choice(BaseModel):
    """The adapter a run answers with (None: the base model) and its strength (Genie's alpha, 0 to 1)."""

    name: str | None = None
    strength: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)


def parse(text: str | None) -> Choice:
    """genie-t2t-run's `-l NAME[,TENSOR,VALUE]` (TENSOR: the strength input, lora_alpha in NPU Studio's bundles)."""
    if not text:
        return Choice()
    name, *rest = text.split(",")
    if rest and (len(rest) != 2 or rest[0] != ALPHA):
        raise UserError(f"-l {text!r}: give NAME, or NAME,{ALPHA},STRENGTH.",
                        f"For example -l math or -l math,{ALPHA},0.5.")
    try:
        return Choice(name=name, strength=float(rest[1]) if rest else 1.0)
    except ValueError as e:
        raise UserError(f"-l {text!r}: the strength must be a number from 0 to 1.",
                        f"For example -l {name},{ALPHA},0.5.") from e


def check(bundle_dir: Path, meta: BundleMeta, choice: Choice) -> None:
    """Refuse an adapter the bundle does not carry, naming those it does (or why it has none)."""
    if choice.name is None or choice.name in meta.lora_adapters:
        return
    if meta.lora_adapters:
        raise UserError(f"The bundle {bundle_dir} has no LoRA adapter {choice.name!r}; it has "
                        f"{', '.join(meta.lora_adapters)}.", "Pick one of those, or leave --lora out (the base model).")
    from ..lora import refuse_switching

    refuse_switching(choice.name, bundle_dir)


def apply(dialog: Dialog, meta: BundleMeta, choice: Choice) -> None:
    """Set up a fresh dialog of a bundle with switchable adapters to answer as `choice` says."""
    if not meta.lora_adapters:
        return
    dialog.apply_lora(choice.name or meta.lora_adapters[0])
    dialog.set_lora_strength(ALPHA, choice.strength if choice.name else 0.0)


def t2t_flag(meta: BundleMeta, choice: Choice) -> list[str]:
    """genie-t2t-run's arguments for `choice` on a device."""
    if not meta.lora_adapters:
        return []
    name, strength = (choice.name, choice.strength) if choice.name else (meta.lora_adapters[0], 0.0)
    return ["-l", f"{name},{ALPHA},{strength:g}"]


def feeds(bundle_dir: Path, meta: BundleMeta, choice: Choice) -> dict[str, Any]:
    """What a host runner feeds the graphs' adapter inputs to answer as Genie does with `choice`, read from the
    bundle's own files (none for a bundle without switchable adapters)."""
    import numpy as np
    import torch

    if not meta.lora_adapters:
        return {}
    name = choice.name or meta.lora_adapters[0]
    out = {}
    for tensor, shape in meta.lora_inputs.items():
        if tensor == ALPHA:
            out[tensor] = torch.tensor([choice.strength if choice.name else 0.0])
        else:
            raw = np.fromfile(Path(bundle_dir) / layout.LORA_BUNDLE / name / f"{tensor}.raw", dtype="<f4")
            out[tensor] = torch.from_numpy(raw.reshape(shape))
    return out
