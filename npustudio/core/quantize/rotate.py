"""Rotate the residual stream by a random orthogonal matrix, folded into the weights (QuaRot / SpinQuant's idea).

For an orthogonal Q the float model is unchanged: the stream h becomes Qᵀh, every layer that reads it
(through an RMSNorm, whose gain is first folded into the reader) takes W·diag(g)·Q, every layer that
writes to it takes Qᵀ·W, the embedding table E·Q. RMSNorm commutes with Q (it only divides by the norm).
What changes is the shape of the weights seen by the quantizer: the stream's few outlier channels are
spread over all channels, so the weights that read the stream have no outlier input columns left and
4-bit blocks along the input channels lose much less. The KV cache (k/v conv outputs) is not rotated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..graph.decoder import StaticDecoder


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal matrix (float64), reproducible from the seed."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@torch.no_grad()
def rotate_residual(model: StaticDecoder, seed: int = 0) -> None:
    """Rotate `model`'s residual stream in place. The LM head gets its own weight (the tie is broken: the
    final norm's gain is folded into the head, not into the embedding)."""
    if model.spec.post_norms:  # a norm on a block's output sits between the writer and the stream: no fold
        raise UserError("Rotating the residual stream is not implemented for post-norm blocks (OLMo 2): their "
                        "output norms' gains cannot be folded through the rotation.", "Quantize without --rotate.")
    d = model.spec.hidden
    q = random_orthogonal(d, seed)

    # (Any: a ModuleList hands out plain Modules, whose .weight torch types as Tensor | Module)
    def reads(conv: Any, gain: torch.Tensor) -> None:
        w = conv.weight.double().reshape(conv.weight.shape[0], d)
        conv.weight = nn.Parameter(((w * gain) @ q).float().reshape(conv.weight.shape))

    def writes(conv: Any) -> None:
        w = conv.weight.double().reshape(d, -1)
        conv.weight = nn.Parameter((q.t() @ w).float().reshape(conv.weight.shape))

    def unit(norm: Any) -> torch.Tensor:
        gain = norm.weight.double().clone()
        norm.weight = nn.Parameter(torch.ones_like(norm.weight))
        return gain

    for layer in model.blocks:
        gain = unit(layer.input_norm)
        for conv in (*layer.attn.q, *layer.attn.k, *layer.attn.v):
            reads(conv, gain)
        writes(layer.attn.o)
        gain = unit(layer.post_norm)
        reads(layer.mlp.gate, gain)
        reads(layer.mlp.up, gain)
        writes(layer.mlp.down)
    reads(model.lm_head, unit(model.norm))  # before the embedding: a tied head still reads the old table
    model.embed.weight = nn.Parameter((model.embed.weight.double() @ q).float())
