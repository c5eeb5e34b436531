"""LoRA adapters as graph inputs, so that one compiled binary serves a base model and every adapter of it.

This is Genie's "lora-version 1" (input weights): its HTP engine takes every graph input whose name holds "lora" as
an adapter weight. `GenieDialog_applyLora(NAME)` reads `<adapter path>/<input name>.raw` (float32) into each such
input, quantized with that input's own encoding, and writes the adapter's strength into the input named by the
config's `alpha-tensor-name`. Nothing in the binary changes, so no SDK tool is needed to make it: the adapter is data.

Per adapted HF Linear (a *slot*), the graph computes u = alpha * (B @ (A @ x)) beside the base conv(s) and adds
u's rows to the convs that hold the Linear's rows (a head of q, k or v, a part of a fused qkv). A slot's A is
(rank, in) and B (out, rank), rank the largest of the adapters that update it; an adapter of a smaller rank is
zero-padded, one that leaves a slot out is zeros there, and all zeros is the base model exactly. What the static
graph folds into a conv (the softmax scale into q, Granite's residual multiplier) and PEFT's scale
(alpha/r times the adapter's weight) are folded into B's rows, so the graph itself holds no adapter's number.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from pydantic import BaseModel
from torch import nn

from .. import layout
from ..errors import UserError
from ..fsutil import atomic_write_json
from ..lora import Adapter
from .decoder import Branches, Linear, Place, StaticDecoder, plain
from .ops import Add, Conv1x1, MatMul, Mul

ALPHA = layout.LORA_ALPHA  # the strength input
_LAYER = re.compile(r"^layers\.(\d+)\.")


class Slot(BaseModel):
    """One HF Linear an adapter may update: its graph inputs' shapes and where its rows are in the graph."""

    module: str  # the HF module, as PEFT names it (`model.layers.0.self_attn.q_proj`)
    rank: int
    in_features: int
    out_features: int
    places: list[Place]

    @property
    def layer(self) -> int:
        return int(cast(re.Match[str], _LAYER.match(self.places[0].tensor))[1])

    @property
    def a(self) -> str:
        return "lora_a_" + re.sub(r"\W", "_", self.module)

    @property
    def b(self) -> str:
        return "lora_b_" + re.sub(r"\W", "_", self.module)


def slots(adapters: list[Adapter], places: dict[str, list[Place]]) -> list[Slot]:
    """The slots the adapters need (each module any of them updates, at the largest rank among them), `places` the
    graph's (`decoder.weight_places`); refused when an updated Linear's rows are not all traced into a block."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for ad in adapters:
        for module, (a, b, _s) in ad.modules.items():
            r, (out_f, in_f) = a.shape[0], (b.shape[0], a.shape[1])
            shapes[module] = (max(r, shapes.get(module, (0,))[0]), in_f, out_f)
    out = []
    for module, (r, in_f, out_f) in sorted(shapes.items(), key=lambda kv: _order(kv[0])):
        where = places.get(f"{module}.weight", [])
        covered = sorted(p.rows for p in where)
        if not where or any(not _LAYER.match(p.tensor) for p in where) or not _contiguous(covered, out_f):
            raise UserError(f"The LoRA adapters update {module}, whose rows NPU Studio cannot trace into the decoder "
                            "blocks' graph weights: it cannot keep that update switchable.",
                            "Merge the adapter instead (leave switchable adapters off), or train it on the attention "
                            "and MLP projections only.")
        out.append(Slot(module=module, rank=r, in_features=in_f, out_features=out_f, places=where))
    return out


def _order(module: str) -> tuple[int, str]:
    m = re.search(r"\.(\d+)\.", module)
    return (int(m[1]) if m else -1, module)


def _contiguous(rows: list[tuple[int, int]], n: int) -> bool:
    end = 0
    for a, b in rows:
        if a != end:
            return False
        end = b
    return end == n


def names(slots_: list[Slot]) -> list[str]:
    """The graph inputs the slots add, in the forward's order: each slot's A and B, then the strength."""
    return [n for s in slots_ for n in (s.a, s.b)] + [ALPHA]


def shapes(slots_: list[Slot]) -> dict[str, list[int]]:
    """The inputs' shapes, in the forward's order."""
    out = {n: v for s in slots_ for n, v in ((s.a, [s.rank, s.in_features]), (s.b, [s.out_features, s.rank]))}
    return out | {ALPHA: [1]}


def values(slots_: list[Slot], adapter: Adapter | None, weight: float = 1.0) -> dict[str, torch.Tensor]:
    """What the inputs hold for `adapter` at `weight` (None: the base model, all zeros), float32: exactly the
    `.raw` files Genie reads, and what our own runners feed."""
    out: dict[str, torch.Tensor] = {}
    for s in slots_:
        a, b = torch.zeros(s.rank, s.in_features), torch.zeros(s.out_features, s.rank)
        pair = adapter.modules.get(s.module) if adapter is not None else None
        if pair is not None:
            lo_a, lo_b, scale = pair
            r = lo_a.shape[0]
            a[:r] = lo_a
            b[:, :r] = lo_b * (scale * weight)
            for p in s.places:
                b[p.rows[0]:p.rows[1]] *= p.factor
        out[s.a], out[s.b] = a, b
    out[ALPHA] = torch.ones(1)
    return out


class LoraBranches(Branches):
    """The slots' arithmetic, as modules the quantizer sees (one MatMul pair and Mul per slot, one Add per conv).
    Convs are found by name: the quantizer replaces the modules themselves."""

    def __init__(self, slots_: list[Slot]) -> None:
        super().__init__()
        self.slots = slots_
        self.names = names(slots_)
        self.a_mm = nn.ModuleList(MatMul() for _ in slots_)
        self.b_mm = nn.ModuleList(MatMul() for _ in slots_)
        self.strength = nn.ModuleList(Mul() for _ in slots_)
        self.adds = nn.ModuleDict()
        self.at: dict[str, list[tuple[int, tuple[int, int], str]]] = {}  # conv -> [(slot, rows, its Add's key)]
        for i, s in enumerate(slots_):
            for j, p in enumerate(s.places):
                key = f"{i}_{j}"
                self.adds[key] = Add()
                self.at.setdefault(p.tensor.removesuffix(".weight"), []).append((i, p.rows, key))

    def linears(self, decoder: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[int], Linear]:
        convs = {id(m): self.at[n] for n, m in decoder.named_modules() if n in self.at}
        done: dict[int, torch.Tensor] = {}  # a slot's u, computed once per call (its convs share the input)
        layers = {s.layer for s in self.slots}

        def apply(conv: Conv1x1, x: torch.Tensor) -> torch.Tensor:
            y, n = conv(x), x.shape[-1]
            for i, (r0, r1), key in convs.get(id(conv), []):
                if i not in done:
                    s = self.slots[i]
                    t = self.a_mm[i](inputs[s.a], x.reshape(s.in_features, n))  # (rank, N)
                    done[i] = self.strength[i](self.b_mm[i](inputs[s.b], t), inputs[ALPHA])  # (out, N)
                y = self.adds[key](y, done[i][r0:r1].reshape(1, r1 - r0, 1, n))
            return y

        return lambda layer: apply if layer in layers else plain


def attach(decoder: StaticDecoder, slots_: list[Slot]) -> StaticDecoder:
    """`decoder` with the slots' inputs and branches (its weights unchanged)."""
    decoder.branches = LoraBranches(slots_)
    return decoder


def save(folder: Path, slots_: list[Slot], adapters: dict[str, dict[str, torch.Tensor]]) -> None:
    """The slots and each adapter's input values, beside the adapted weights (each file written atomically)."""
    from safetensors.torch import save_file

    (folder / layout.LORA_INPUTS).mkdir(exist_ok=True)
    for name, vals in adapters.items():
        path = folder / layout.LORA_INPUTS / f"{name}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: v.contiguous() for k, v in vals.items()}, str(tmp))
        os.replace(tmp, path)
    atomic_write_json(folder / layout.LORA_SLOTS, {"slots": [s.model_dump() for s in slots_],
                                                   "adapters": list(adapters)})


def saved_slots(folder: Path) -> list[Slot]:
    """The adapt stage's slots (none: its adapters, if any, were merged)."""
    path = Path(folder) / layout.LORA_SLOTS
    if not path.is_file():
        return []
    return [Slot.model_validate(s) for s in json.loads(path.read_text())["slots"]]


def saved_values(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each switchable adapter's input values, by adapter name, in the order adapt was given them."""
    from safetensors.torch import load_file

    path = Path(folder) / layout.LORA_SLOTS
    if not path.is_file():
        return {}
    names_ = json.loads(path.read_text())["adapters"]
    return {n: load_file(str(Path(folder) / layout.LORA_INPUTS / f"{n}.safetensors")) for n in names_}
