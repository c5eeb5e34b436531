"""What quantization keeps of each merged LoRA adapter, module by module.

A merged adapter lives on only as the change it made to the float weights (ΔW = weight · scale · B·A). Once the
weights are quantized, an entry of ΔW smaller than half its channel's (or block's) quantization step can round away:
an adapter whose update is mostly that small is no longer on the phone, whatever the merge did. Per adapter and base
module this says the adapter's rank and scale, its A/B shapes, the graph weights that hold it (the places the adapt
stage recorded: q/k/v heads, the folded softmax or residual scales), their encoding, the update's size against the
merged weight, and the share of its entries at least half a step.

Read from the adapter files (checked to be the ones merged), the adapt stage's `lora_places.json` and float weights,
and the quantize stage's `.encodings`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from . import layout, lora, stages
from .errors import UserError
from .fsutil import read_json, sha256_file
from .graph.encodings import TensorRow, read
from .results import AdapterKept
from .stage_options import LoraAdapter

KEPT_FLAG = 0.5  # below this share of entries at least half a step, most of the update can round away
_ROWS = 4096


class AdapterTensor(BaseModel):
    """One adapter's update of one base module, as the quantized graphs hold it."""

    adapter: str
    module: str  # the base model's module, as the adapter names it
    layer: int | None
    role: str  # of the graph weights holding it (q, k, v, o, gate, up, down, lm_head; q+k+v for a fused qkv)
    rank: int
    scale: float  # the merge weight times PEFT's alpha / r
    a_shape: list[int]
    b_shape: list[int]
    tensors: list[str]  # the graph weights holding its rows
    bitwidth: int | None
    granularity: str | None
    update_ratio: float | None  # ‖ΔW‖ / ‖W‖ over those weights (W: the merged float weights)
    kept: float | None  # share of ΔW's entries at least half the quantization step of their channel or block
    steps_rms: float | None  # ΔW's root mean square in quantization steps
    flags: list[str] = []


def adapt_dir_of(enc_file: Path) -> Path:
    """The adapt stage beside the quantize stage that `enc_file` (an `.encodings`) belongs to."""
    return Path(enc_file).resolve().parent.parent / stages.ADAPT.name


def merged(adapt_dir: Path) -> bool:
    """Whether the adapt stage in `adapt_dir` merged LoRA adapters (not kept them switchable: then the weights hold
    none of their update, and their precision is their inputs' encodings)."""
    return (adapt_dir / layout.LORA_PLACES).is_file() and not (adapt_dir / layout.LORA_SLOTS).is_file()


def effects(enc_file: str | Path, adapt_dir: Path | None = None) -> list[AdapterTensor]:
    """Each merged adapter's modules against `enc_file` (a quantize stage's `.encodings`; `adapt_dir`: the adapt stage
    it was made from, by default the one beside it in its project); empty when no adapter was merged."""
    from safetensors import safe_open

    enc_file = Path(enc_file).resolve()
    adapt_dir = adapt_dir or adapt_dir_of(enc_file)
    places_file = adapt_dir / layout.LORA_PLACES
    if not merged(adapt_dir):
        return []
    recorded = read_json(places_file, "record of merged LoRA adapters", "Run adapt again.")
    adapters = [LoraAdapter.model_validate(a) for a in recorded["adapters"]]
    places: dict[str, list[dict[str, Any]]] = recorded["places"]
    table = read(enc_file, kinds=("param",))
    rows = {r.name: r for r in table.rows}
    out: list[AdapterTensor] = []
    with safe_open(str(adapt_dir / layout.DECODER_WEIGHTS), framework="pt") as floats:
        stored = set(floats.keys())
        for a in adapters:
            ad = _unchanged(a)
            for module, (lo_a, lo_b, scaling) in ad.modules.items():
                scale = a.weight * scaling
                out.append(_module(ad.name, module, lo_a, lo_b, scale, places.get(f"{module}.weight", []), rows,
                                   floats, stored))
    return out


def kept(rows: list[AdapterTensor]) -> list[AdapterKept]:
    """Per adapter, in the order merged: its modules, how many are flagged and the smallest share kept."""
    out: dict[str, AdapterKept] = {}
    for r in rows:
        k = out.setdefault(r.adapter, AdapterKept(adapter=r.adapter, modules=0, flagged=0, kept_min=None))
        k.modules += 1
        k.flagged += bool(r.flags)
        if r.kept is not None:
            k.kept_min = r.kept if k.kept_min is None else min(k.kept_min, r.kept)
    return list(out.values())


def _unchanged(a: LoraAdapter) -> lora.Adapter:
    folder = Path(a.path)
    digest = (sha256_file(folder / lora.CONFIG)[:16] + sha256_file(folder / lora.WEIGHTS)[:16]
              if (folder / lora.CONFIG).is_file() and (folder / lora.WEIGHTS).is_file() else None)
    if digest != a.sha256:
        raise UserError(f"The LoRA adapter {folder.name} is not the one merged into these graphs: "
                        f"{'its files changed' if digest else 'its folder ' + str(folder) + ' is gone'} since adapt.",
                        "Run adapt again with the adapter as it is now (and quantize after it), or put the merged "
                        "adapter back.")
    return lora.read(folder)


def _module(adapter: str, module: str, lo_a: Any, lo_b: Any, scale: float, places: list[dict[str, Any]],
            rows: dict[str, TensorRow], floats: Any, stored: set[str]) -> AdapterTensor:
    import torch

    from .graph.sqnr import WeightGrid

    delta = (lo_b @ lo_a) * scale  # (out, in), float32: the update the merge added
    held = [p for p in places if p["tensor"] in rows and p["tensor"] in stored]
    first = rows[held[0]["tensor"]] if held else None
    roles = "+".join(dict.fromkeys(rows[p["tensor"]].role for p in held))
    base = AdapterTensor(adapter=adapter, module=module, layer=first.layer if first else None,
                         role=roles, rank=int(lo_a.shape[0]), scale=scale,
                         a_shape=list(lo_a.shape), b_shape=list(lo_b.shape), tensors=[p["tensor"] for p in held],
                         bitwidth=first.bitwidth if first else None, granularity=first.granularity if first else None,
                         update_ratio=None, kept=None, steps_rms=None)
    if not held:
        base.flags.append("not traced: the family's recipe rearranges this weight, so where its rows went is not "
                          "known" if not places else "its graph weights have no encoding in this file")
        return base
    d2 = w2 = steps2 = 0.0
    kept = total = 0
    for p in held:
        r0, r1 = p["rows"]
        d = delta[r0:r1].to(torch.float64).numpy() * p["factor"]
        weight = WeightGrid.of(floats.get_slice(p["tensor"]), rows[p["tensor"]])
        if weight is None or weight.n_rows != d.shape[0] or weight.width != d.shape[1]:
            base.flags.append(f"{p['tensor']}: its encoding does not fit its shape")
            continue
        for a in range(0, weight.n_rows, _ROWS):
            w, s, _o = weight.rows(a, _ROWS)
            part = d[a:a + len(w)]
            d2 += float(np.sum(part * part))
            w2 += float(np.sum(w * w))
            ratio = np.abs(part) / s
            steps2 += float(np.sum(ratio * ratio))
            kept += int(np.sum(ratio >= 0.5))
            total += part.size
    if total:
        base.update_ratio = math.sqrt(d2 / w2) if w2 > 0 else None
        base.kept = kept / total
        base.steps_rms = math.sqrt(steps2 / total)
        if base.kept < KEPT_FLAG:
            base.flags.append(f"{1 - base.kept:.0%} of the update is under half a quantization step: rounding can "
                              "erase it (more weight bits for these tensors, or a stronger adapter)")
    return base
