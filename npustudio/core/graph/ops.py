"""Elementary ops as modules, one instance per use, so quantization sees (and encodes) each of them.

Functional `torch.matmul`/`softmax`/`+` inside a forward are invisible to a quantization simulator:
it only wraps modules. Reshapes and transposes stay functional (they move data, they do not compute).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class MatMul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Mul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


class Concat(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs, dim=self.dim)


class Conv1x1(nn.Conv2d):
    """A Linear layer as a 1x1 convolution over (1, C, 1, N): lets HTP encode weights per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_f, in_f = weight.shape
        super().__init__(in_f, out_f, kernel_size=1, bias=bias is not None)
        with torch.no_grad():
            self.weight.copy_(weight.reshape(out_f, in_f, 1, 1))
            if bias is not None and self.bias is not None:
                self.bias.copy_(bias)


class RMSNorm(nn.Module):
    """RMSNorm that stays finite and exact in fp16 on the HTP (float subgraphs run in fp16 there).

    Plain x² overflows fp16 for the residual stream's |x|≈2e4 outliers, and pre-dividing by a constant
    underflows for ordinary tokens. RMSNorm is scale-invariant, so divide by m = max|x| first:
        y = w · (x/m) / sqrt(mean((x/m)²) + eps/m²)
    which equals w · x / sqrt(mean(x²) + eps) exactly. The HTP divides by multiplying with the
    reciprocal, and 1/m is subnormal in fp16 (flushed to zero) once m > 16384: the attention-sink
    token's norm came out 0. So x/m is taken as (x·r)·r with r = 1/sqrt(m) ≥ 2^-8, and every
    intermediate stays a normal fp16 number.
    """

    def __init__(self, weight: torch.Tensor, eps: float, dim: int) -> None:
        super().__init__()
        self.eps = float(eps)
        self.dim = dim
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.abs().amax(self.dim, keepdim=True).clamp_min(1e-4)
        r = torch.rsqrt(m)
        xr = x * r  # |xr| ≤ sqrt(m) ≤ 256
        hs = xr * r  # x/m
        ms = (hs * hs).mean(self.dim, keepdim=True) + (self.eps / m) / m
        w = self.weight.reshape([-1 if d == (self.dim % x.dim()) else 1 for d in range(x.dim())])
        return xr * (torch.rsqrt(ms) * r) * w


class Rope(nn.Module):
    """Rotary embedding x·cos + rotate_half(x)·sin, with cos/sin given as graph inputs (tables from the host).

    `dim` is the head-dim axis of x; cos2/sin2 are tables as wide as the rotated dims (sin2 carries the
    rotate-half sign). Partial rotary (`rotary_dim` < `head_dim`, as transformers' Phi-3): the first rotary_dim
    dims of each head are rotated, the rest passed through unchanged.
    """

    def __init__(self, dim: int, rotary_dim: int | None = None, head_dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.rotary_dim = rotary_dim if rotary_dim is not None and rotary_dim != head_dim else None
        self.swap = Concat(dim)
        self.mul_cos = Mul()
        self.mul_sin = Mul()
        self.add = Add()
        self.keep = Concat(dim) if self.rotary_dim else None

    def forward(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim and self.keep is not None:
            rot, rest = torch.split(x, [self.rotary_dim, x.shape[self.dim] - self.rotary_dim], dim=self.dim)
            return self.keep(self.rotate(rot, cos2, sin2), rest)
        return self.rotate(x, cos2, sin2)

    def rotate(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        half = x.shape[self.dim] // 2
        x1, x2 = torch.split(x, half, dim=self.dim)
        return self.add(self.mul_cos(x, cos2), self.mul_sin(self.swap(x2, x1), sin2))


class SiLU(nn.Module):
    """x·sigmoid(x) as Sigmoid + Mul modules: each output gets its own encoding (an exported SiLU leaves the
    sigmoid output float between quantized ops, which the HTP cannot build)."""

    def __init__(self) -> None:
        super().__init__()
        self.sigmoid = nn.Sigmoid()
        self.mul = Mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mul(x, self.sigmoid(x))


class GeluTanh(nn.Module):
    """The tanh GELU (transformers' gelu_new / gelu_pytorch_tanh) from quantizable modules, using
    0.5·(1 + tanh(z)) = sigmoid(2z):  x·sigmoid(x·(2c + 2c·0.044715·x²)),  c = sqrt(2/π)."""

    def __init__(self) -> None:
        super().__init__()
        c = math.sqrt(2.0 / math.pi)
        self.register_buffer("a", torch.tensor(2.0 * c))
        self.register_buffer("b", torch.tensor(2.0 * c * 0.044715))
        self.square = Mul()
        self.scale = Mul()
        self.shift = Add()
        self.inner = Mul()
        self.sigmoid = nn.Sigmoid()
        self.mul = Mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.inner(x, self.shift(self.scale(self.square(x, x), self.b), self.a))
        return self.mul(x, self.sigmoid(z))


# the erf GELU (transformers' gelu) is torch's own module: one Gelu op, which the HTP runs natively
ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiLU, "gelu": nn.GELU, "gelu_tanh": GeluTanh}
