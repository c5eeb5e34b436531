"""aimet's per-tensor and per-channel quantize-dequantize through plain tensor ops: the same numbers, faster on a
CPU.

aimet runs a per-tensor quantizer through `torch.fake_quantize_per_tensor_affine` and a per-channel one (an int8
weight: w8a16's layers, the LM head) through `torch.fake_quantize_per_channel_affine`, whose CPU kernels also
write the gradient mask. Per tensor the kernel is scalar: 4.4 ns per element on this machine against 0.13 ns for
the same arithmetic as five vectorized tensor ops, and half of every quantsim forward of the default model (498
of 986 ms of an AR-128 step: the attention scores alone are 3.5 M elements per layer). Per channel it is 1.9x
(a Llama-3.2-1B shape's 263 M-parameter int8 head, 2 cores: 1.02 s against 0.54 s), paid by every forward whose
weights are not folded yet (a learner's capture of a layer's inputs). Both kernels compute
`(clamp(zero_point + nearbyint(x * (1 / scale)), qmin, qmax) - zero_point) * scale` in float32 (the product of
an integer below 2^17 and a float32 scale is exact in the double they use, so rounding it to float32 is the
float32 product); the ops below do the same steps in the same order, so the results are bit-identical
(tests/test_quantize_ops.py checks them against the kernels, rounding ties included). Anything else (gradients,
other dtypes, torch.compile/export) still goes to aimet's own call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def per_tensor_qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
                   ) -> torch.Tensor:
    """`torch.fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax)` of a float32 tensor, forward only."""
    return _qdq(x, scale.reshape(()).to(torch.float32), zero_point.reshape(()).to(torch.float32), qmin, qmax)


def per_channel_qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, qmin: int,
                    qmax: int) -> torch.Tensor:
    """`torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, qmin, qmax)` of a float32 tensor,
    forward only."""
    shape = [1] * x.dim()
    shape[axis] = -1
    return _qdq(x, scale.to(torch.float32).reshape(shape), zero_point.to(torch.float32).reshape(shape), qmin, qmax)


def _qdq(x: torch.Tensor, sc: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    return torch.mul(x, 1.0 / sc).round_().add_(zp).clamp_(qmin, qmax).sub_(zp).mul_(sc)


def _plain(x: torch.Tensor, tb: Any) -> bool:
    """A call the plain ops may take: float32, no gradient wanted, not traced by a compiler or an export (asked of
    aimet's `torch_builtins`, `tb`)."""
    return not (x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled())
                or tb._torch_compiler_is_exporting() or tb._torch_compiler_is_compiling())


@contextlib.contextmanager
def fast_fake_quantize() -> Iterator[None]:
    """aimet's per-tensor and per-channel fake quantization through `per_tensor_qdq` and `per_channel_qdq` for
    the duration."""
    from aimet_torch.quantization.affine.backends import torch_builtins as tb

    per_tensor, per_channel = tb._call_torch_fake_quantize_per_tensor, tb._call_torch_fake_quantize_per_channel

    def tensor_call(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> Any:
        if not _plain(x, tb):
            return per_tensor(x, scale, zero_point, qmin, qmax)
        return per_tensor_qdq(x, scale, zero_point, qmin, qmax)

    def channel_call(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, qmin: int,
                     qmax: int) -> Any:
        if not _plain(x, tb):
            return per_channel(x, scale, zero_point, axis, qmin, qmax)
        return per_channel_qdq(x, scale, zero_point, axis, qmin, qmax)

    tb._call_torch_fake_quantize_per_tensor = tensor_call
    tb._call_torch_fake_quantize_per_channel = channel_call
    try:
        yield
    finally:
        tb._call_torch_fake_quantize_per_tensor = per_tensor
        tb._call_torch_fake_quantize_per_channel = per_channel
