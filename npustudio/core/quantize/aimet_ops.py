"""Quantized definitions of the adapted decoder's own ops, registered with aimet-torch's QuantizationMixin.

aimet-torch's QuantizationSimModel only wraps module types it knows; the adapted decoder's elementary ops
(core/graph/ops.py) are ours, so each is registered here the way aimet-torch registers its own
`aimet_torch.nn.modules.custom` ops. Importing this module performs the registration (idempotent).
RMSNorm is wrapped as a whole (its internals stay float: they run in fp16 on the HTP).
"""

from __future__ import annotations

from typing import Any

import torch
from aimet_torch.nn import QuantizationMixin, QuantizedConv2d
from aimet_torch.nn.true_quant import _DispatchMixin

from ..graph import ops
from ..graph.decoder import Neg

# pylint: disable=abstract-method


def _binary(module_cls: type[torch.nn.Module], fn: object) -> type:
    """Quantized twin of a two-input elementwise/matmul op: quantizers on both inputs and the output."""
    qcls = type(f"Quantized{module_cls.__name__}", (_DispatchMixin, QuantizationMixin, module_cls),
                {"__quant_init__": QuantizationMixin.__binary__, "_builtin_torch_fn": fn, "__module__": __name__})
    return QuantizationMixin.implements(module_cls)(qcls)


QuantizedMatMul = _binary(ops.MatMul, torch.matmul)
QuantizedAdd = _binary(ops.Add, torch.add)
QuantizedMul = _binary(ops.Mul, torch.mul)


@QuantizationMixin.implements(ops.Concat)
class QuantizedConcat(_DispatchMixin, QuantizationMixin, ops.Concat):
    _builtin_torch_fn = torch.cat

    def _is_dispatch_necessary(self) -> bool:
        return True


@QuantizationMixin.implements(Neg)
class QuantizedNeg(_DispatchMixin, QuantizationMixin, Neg):
    _builtin_torch_fn = torch.neg


@QuantizationMixin.implements(ops.RMSNorm)
class QuantizedRMSNorm(QuantizationMixin, ops.RMSNorm):
    input_quantizers: Any  # aimet's ModuleLists (torch types a Module attribute as Tensor | Module)
    output_quantizers: Any
    param_quantizers: Any
    _patch_quantized_parameters: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizers[0]:
            x = self.input_quantizers[0](x)
        with self._patch_quantized_parameters():
            out = super().forward(x)
        if self.output_quantizers[0]:
            out = self.output_quantizers[0](out)
        return out


@QuantizationMixin.implements(ops.Conv1x1)
class QuantizedConv1x1(QuantizedConv2d, ops.Conv1x1):
    """A 1x1 conv is a Conv2d to aimet: same quantizers, so weights can be per output channel."""

    param_quantizers: Any  # aimet's ModuleDict (torch types a Module attribute as Tensor | Module)
