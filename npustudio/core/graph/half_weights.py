"""Weights held narrower than they are computed with: the 16 bits a checkpoint stores them in, or the integer codes
of a quantized weight; each module computes with float32 copies made for the length of its forward.

A bf16 checkpoint widened to float32 doubles the memory its weights take (a 4B model: 8 GB -> 16 GB) and changes
no value: every bf16 number is a float32 number. The adapt and quantize stages keep the checkpoint's own tensors
and widen one module's weights at a time, for the length of that module's forward, so the arithmetic is
float32's and the results are those of the widened model, bit for bit. A quantized weight is held the same way
as its integer codes (one byte a weight), with a function that gives back its float32 values exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

HALF = (torch.bfloat16, torch.float16)
# module.__dict__ key: parameter name -> the function that gives its float32 values from what is held
UNPACK = "_npustudio_unpack"


def widened(t: torch.Tensor) -> torch.Tensor:
    """`t` as float32 when it is held in 16 bits (a new tensor), else `t` itself."""
    return t.float() if t.dtype in HALF else t


def hold_packed(module: nn.Module, name: str, held: torch.Tensor, unpack: Callable[[torch.Tensor], torch.Tensor]
                ) -> None:
    """Hold `module.name` as `held` (its integer codes), `unpack(held)` giving its float32 values back."""
    module._parameters[name] = nn.Parameter(held, requires_grad=False)
    module.__dict__.setdefault(UNPACK, {})[name] = unpack


def _packed(module: nn.Module, name: str, p: torch.Tensor) -> bool:
    """Whether `module.name`, held as `p`, is integer codes `hold_packed` registered."""
    return name in module.__dict__.get(UNPACK, {}) and not p.is_floating_point()


def narrow(module: nn.Module) -> dict[str, nn.Parameter]:
    """`module`'s own parameters that are held narrower than float32 (16-bit or packed), by name."""
    return {n: p for n, p in module._parameters.items()
            if p is not None and (p.dtype in HALF or _packed(module, n, p))}


def wide_value(module: nn.Module, name: str, p: torch.Tensor) -> torch.Tensor:
    """The float32 values of `module.name`, held as `p` (16-bit or packed)."""
    return module.__dict__[UNPACK][name](p) if _packed(module, name, p) else p.float()


def widen_module(module: nn.Module) -> dict[str, nn.Parameter]:
    """Replace `module`'s narrow parameters by float32 ones; returns what was held, for `restore_module`."""
    held = narrow(module)
    for n, p in held.items():
        module._parameters[n] = nn.Parameter(wide_value(module, n, p), requires_grad=False)
    return held


def restore_module(module: nn.Module, held: dict[str, nn.Parameter]) -> None:
    module._parameters.update(held)


def widen_while_computing(*models: nn.Module) -> list[RemovableHandle]:
    """From now on (until the handles are removed), each module whose own parameters are held narrow runs its
    forward with float32 copies of them, made when it starts and dropped when it returns, so at most one module's
    widened weights exist at a time. Every module with parameters is watched, so a weight packed later (the
    quantize stage's fold) is widened too; aimet's quantized modules share the hooks of the modules they replace.
    The hooks hold no reference to the models."""
    handles = []

    def widen(module: nn.Module, _args: object) -> None:
        if type(module) is not nn.Embedding:  # a plain lookup copies rows: they are widened as they come out
            module.__dict__["_held_narrow"] = widen_module(module)

    def restore(module: nn.Module, _args: object, out: object) -> object:
        restore_module(module, module.__dict__.pop("_held_narrow", {}))
        if type(module) is nn.Embedding and isinstance(out, torch.Tensor) and out.dtype in HALF:
            return out.float()  # the rows of the widened table, without widening the table (a 4B model's: 1.6 GB)
        return None

    seen: set[int] = set()
    for model in models:
        for m in model.modules():
            if id(m) in seen or not m._parameters:
                continue
            seen.add(id(m))
            handles.append(m.register_forward_pre_hook(widen))
            handles.append(m.register_forward_hook(restore, always_call=True))
    return handles


@contextlib.contextmanager
def computing_in_fp32(*models: nn.Module) -> Iterator[None]:
    """`widen_while_computing` for the length of the `with` block."""
    handles = widen_while_computing(*models)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
