"""Which decoder weights stay int8 at w4a16 when a share of them may (`--int8-budget`), measured on the model.

Four bits do not cost every layer alike: on the default model the last decoder layer alone (3.3 % of the decoder's
linear weights) holds a third of w4a16's perplexity cost. Each layer's attention and MLP weights (a group) are put
on the preset's 4-bit grid alone, the rest of the model in float, and scored by how far the calibration text's
next-token distributions move (KL divergence from the float model's); the groups that move them most per weight
are kept int8 until the budget is spent. One prompt-graph call on each of the first two calibration sequences per
group, each group's weights restored afterwards: no second copy of the model. (Four whole sequences took 12 s a group
on the default model; the two calls pick the same groups in a quarter of the time.) A probe of layer i's weights
replays what the layers before it returned for the reference calls rather than running them again: the same KL
divergences in 0.64 of the time on the default model (benchmarks/int8_budget_bench.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from ..graph.half_weights import widened
from ..graph.ops import Conv1x1
from ..progress import StateLike
from ..stage_options import INT8_BUDGET_PROBES, Overrides
from .presets import Preset

GROUP = re.compile(r"^(layers\.\d+\.(?:attn|mlp))\.")


@dataclass(frozen=True)
class Choice:
    kept: list[str]  # the groups kept int8 ("layers.29.mlp"), most sensitive first
    share: float  # of the decoder's linear weights wider than the preset's: the groups kept and the overrides' own
    kl: dict[str, float]  # each group's KL divergence when it alone is at 4 bits

    def overrides(self, user: Overrides) -> Overrides:
        """The user's overrides after the kept groups: the user's patterns come last, so they win."""
        return Overrides(weights={f"{g}.*": 8 for g in self.kept} | user.weights, activations=user.activations)


def on_grid(w: torch.Tensor, preset: Preset) -> torch.Tensor:
    """`w` (out, in, 1, 1) quantized and dequantized by the quantsim's own weight quantizer for the preset (aimet's
    LPBQ blocks, or one scale per output channel), with the min-max encodings the `plain` recipe gives it, in
    float32: the probe measures the grid the model will get."""
    from .simulate import weight_quantizer

    w = widened(w)  # a 16-bit weight's grid is computed on its float32 values, as the quantsim's
    q = weight_quantizer(w, preset.weight_bits, preset.block_size).to(w.device)
    with q.compute_encodings():
        q(w)
    return q(w).as_subclass(torch.Tensor).detach()


def groups(model: torch.nn.Module, wide: Callable[[str], bool]) -> dict[str, list[Conv1x1]]:
    """Each layer's attention and MLP 1x1 convolutions that are at the preset's width (`wide(name)`: already wider)."""
    out: dict[str, list[Conv1x1]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Conv1x1) and (g := GROUP.match(name)) and not wide(name):
            out.setdefault(g[1], []).append(m)
    return out


@contextmanager
def recording(layers: Sequence[torch.nn.Module]) -> Iterator[list[Any]]:
    """What each layer returns in one model call, in order."""
    out: list[Any] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: out.append(o)) for m in layers]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def replaying(layers: Sequence[torch.nn.Module], outputs: Sequence[Any]) -> Iterator[None]:
    """`layers` return `outputs` (what they returned for the same call) instead of computing them again: a probe
    of layer i's weights need not run the unchanged layers before it, about half the model on average."""
    for m, o in zip(layers, outputs, strict=False):
        m.forward = lambda *_a, _o=o, **_k: _o
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)


def choose(model: torch.nn.Module, logits: Callable[[Sequence[int]], torch.Tensor], calib: Sequence[Sequence[int]],
           tokens: int, preset: Preset, budget: float, overrides: Overrides, state: StateLike) -> Choice:
    """The groups to keep int8 within `budget` (a share of the decoder's linear weights), most KL per weight first,
    scored on the first `tokens` of the first calibration sequences (`tokens`: the prompt graph's, one call each)."""
    calib = [list(s[:tokens]) for s in calib[:INT8_BUDGET_PROBES]]
    sizes = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, Conv1x1) and GROUP.match(n)}
    total = sum(sizes.values())

    def wide(table: Overrides, name: str) -> bool:
        return table.weight_bits(name, preset.weight_bits) > preset.weight_bits

    def wider(table: Overrides) -> int:
        """How many of the decoder's linear weights `table` keeps wider than the preset."""
        return sum(n for name, n in sizes.items() if wide(table, name))

    spent = wider(overrides)
    # a group larger than what is left of the budget can never be kept: not measured (a tiny model's all are)
    every = groups(model, partial(wide, overrides))
    size = {g: sum(m.weight.numel() for m in mods) for g, mods in every.items()}
    todo = {g: mods for g, mods in every.items() if spent + size[g] <= budget * total}
    layers = list(getattr(model, "layers", []))
    layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    with torch.no_grad():
        ref, outs = [], []
        for s in calib if todo else []:
            with recording(layers) as out:
                ref.append(torch.log_softmax(logits(s).float(), -1))
            outs.append(out if len(out) == len(layers) else [])  # not one call per sequence: nothing replayed
        kl: dict[str, float] = {}
        for i, (g, mods) in enumerate(todo.items()):
            state.check()
            state.progress(i / len(todo), f"int8 budget: {g} at {preset.weight_bits} bits alone")
            first = layer_of[id(mods[0])]  # the layers before the group's give what they gave the reference
            kept = [m._parameters["weight"] for m in mods]  # put back as they were (a 16-bit one stays 16-bit)
            try:
                for m in mods:
                    m._parameters["weight"] = torch.nn.Parameter(on_grid(m.weight, preset), requires_grad=False)
                total_kl = 0.0
                for s, r, out in zip(calib, ref, outs, strict=True):
                    with replaying(layers[:first], out):
                        total_kl += float(torch.nn.functional.kl_div(torch.log_softmax(logits(s).float(), -1), r,
                                                                     log_target=True, reduction="batchmean"))
                kl[g] = total_kl / len(calib)
            finally:
                for m, w in zip(mods, kept, strict=True):
                    m._parameters["weight"] = w
    chosen: list[str] = []
    for g in sorted(kl, key=lambda g: kl[g] / size[g], reverse=True):
        if spent + size[g] <= budget * total:
            chosen.append(g)
            spent += size[g]
    choice = Choice(kept=sorted(chosen, key=lambda g: -kl[g]), share=0.0, kl={g: round(v, 6) for g, v in kl.items()})
    # the share as the quantsim will see it: a user's pattern that sets a kept module back to 4 bits wins
    return replace(choice, share=wider(choice.overrides(overrides)) / total if total else 0.0)
