"""SpinQuant's rotations from aimet-torch (`aimet_torch.spinquant`), on the adapted decoder.

aimet's `apply_spinquant` finds a Hugging Face model's blocks by class and rewrites its `nn.Linear` layers: it folds
each RMSNorm's gain into the layers that read it, adds R1 (a Hadamard matrix of the hidden size, over the residual
stream: embedding, q/k/v, o, gate/up, down, LM head) and R2 (a Hadamard matrix of the head size per head, between
v and o) as transforms and merges them into the weights. The float model is unchanged; the weights' outlier
channels are spread, so 4-bit blocks along the input channels lose less. This adapter hands aimet the adapted
decoder's 1x1 convolutions as the Linear layers of Llama-shaped blocks (one Linear for all heads of q, k or v),
lets aimet's own `_apply_spinquant_to_decoder_stack` run on them and writes the merged weights back.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch import nn

from ..recipe_rules import refusal


def _linear(convs: Sequence[Any]) -> nn.Linear:
    """One Linear holding the convolutions' weights stacked by output channel (views where there is one)."""
    w = torch.cat([c.weight.detach().reshape(c.weight.shape[0], -1) for c in convs])
    biases = [c.bias for c in convs]
    with torch.device("meta"):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=biases[0] is not None)
    lin.weight = nn.Parameter(w)
    if biases[0] is not None:
        lin.bias = nn.Parameter(torch.cat([b.detach() for b in biases]))
    return lin


def _write_back(lin: nn.Linear, convs: Sequence[Any]) -> None:
    sizes = [c.weight.shape[0] for c in convs]
    bias = lin.bias.detach().split(sizes) if lin.bias is not None else [None] * len(convs)
    for c, w, b in zip(convs, lin.weight.detach().split(sizes), bias, strict=True):
        c.weight = nn.Parameter(w.reshape(c.weight.shape).to(c.weight.dtype).contiguous())
        if b is not None:
            c.bias = nn.Parameter(b.to(c.bias.dtype).contiguous())


@torch.no_grad()
def apply(model: Any, r1: bool = True, r2: bool = True) -> None:
    """Rotate `model` (a StaticDecoder) in place with aimet's SpinQuant. The LM head gets its own weight: a tied
    head is untied, as aimet requires."""
    from aimet_torch.experimental.transforms.transform_config import LlamaBlockInterface
    from aimet_torch.spinquant.spinquant_optimizer import SpinQuant

    spec = model.spec
    if (why := refusal("spinquant", spec)) is not None:
        raise why
    layers = []  # (the aimet-facing block, its Linear for each group of our convolutions)
    for layer in model.layers:
        groups = {"q_proj": layer.attn.q, "k_proj": layer.attn.k, "v_proj": layer.attn.v, "o_proj": [layer.attn.o],
                  "gate_proj": [layer.mlp.gate], "up_proj": [layer.mlp.up], "down_proj": [layer.mlp.down]}
        lin = {name: _linear(convs) for name, convs in groups.items()}
        block = SimpleNamespace(
            self_attn=SimpleNamespace(**{k: lin[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj")}),
            mlp=SimpleNamespace(**{k: lin[k] for k in ("gate_proj", "up_proj", "down_proj")}),
            input_layernorm=layer.input_norm, post_attention_layernorm=layer.post_norm)
        layers.append((LlamaBlockInterface(block), block, groups))
    backbone = SimpleNamespace(embed_tokens=model.embed, norm=model.norm,
                               config=SimpleNamespace(head_dim=spec.head_dim))
    head = _linear([model.lm_head])
    with mock.patch.object(SpinQuant, "_get_blocks", staticmethod(lambda _m: [b for b, _, _ in layers])):
        SpinQuant._apply_spinquant_to_decoder_stack(backbone, head, enable_r1=r1, enable_r2=r2)
    for _, block, groups in layers:
        for name, convs in groups.items():
            part = block.self_attn if hasattr(block.self_attn, name) else block.mlp
            _write_back(getattr(part, name), convs)
    _write_back(head, [model.lm_head])
    model.embed.weight = nn.Parameter(backbone.embed_tokens.weight.detach().contiguous())
