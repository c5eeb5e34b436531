"""Weights held in the 16 bits a checkpoint stores them in, computed with in float32.

A bf16 checkpoint widened to float32 doubles the memory its weights take (a 4B model: 8 GB -> 16 GB) and changes
no value: every bf16 number is a float32 number. The adapt stage keeps the checkpoint's own tensors and widens
one module's weights at a time, for the length of that module's forward, so the arithmetic is float32's and
the results are those of the widened model, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)


def widened(t: torch.Tensor) -> torch.Tensor:
    """`t` as float32 when it is held in 16 bits (a new tensor), else `t` itself."""
    return t.float() if t.dtype in HALF else t


@contextlib.contextmanager
def computing_in_fp32(*models: nn.Module) -> Iterator[None]:
    """Within: each module whose own parameters are 16-bit runs its forward with float32 copies of them, made
    when it starts and dropped when it returns, so at most one module's widened weights exist at a time."""
    handles = []

    def widen(module: nn.Module, _args: object) -> None:
        held = {n: p for n, p in module._parameters.items() if p is not None and p.dtype in HALF}
        module.__dict__["_held_half"] = held
        for n, p in held.items():
            module._parameters[n] = nn.Parameter(p.float(), requires_grad=False)

    def restore(module: nn.Module, _args: object, _out: object) -> None:
        module._parameters.update(module.__dict__.pop("_held_half", {}))

    seen: set[int] = set()
    for model in models:
        for m in model.modules():
            if id(m) in seen or not any(p.dtype in HALF for p in m.parameters(recurse=False)):
                continue
            seen.add(id(m))
            handles.append(m.register_forward_pre_hook(widen))
            handles.append(m.register_forward_hook(restore, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
