"""SpinQuant's rotations from aimet-torch (`aimet_torch.spinquant`), on the adapted decoder.

aimet's `apply_spinquant` finds a Hugging Face model's blocks by class and rewrites its `nn.Linear` layers: it folds
each RMSNorm's gain into the layers that read it, adds R1 (a Hadamard matrix of the hidden size, over the residual
stream: embedding, q/k/v, o, gate/up, down, LM head) and R2 (a Hadamard matrix of the head size per head, between
v and o) as transforms and merges them into the weights. The float model is unchanged; the weights' outlier
channels are spread, so 4-bit blocks along the input channels lose less. This adapter hands aimet the adapted
decoder's 1x1 convolutions as the Linear layers of Llama-shaped blocks (one Linear for all heads of q, k or v)
and runs the steps of aimet's `_apply_spinquant_to_decoder_stack` with aimet's own functions, a layer at a time
(R1 and R2 are fixed Hadamard matrices, the same for every layer), writing each layer's merged weights back into
the mapped ones before the next: at once, a Llama-3.2-1B shape peaked at 14.4 GB.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..recipe_rules import refusal


def _linear(convs: Sequence[Any]) -> nn.Linear:
    """One Linear holding the convolutions' weights stacked by output channel: a view of a lone convolution's
    (aimet's norm fusion and merge replace a Linear's weight, never write into it)."""
    parts = [c.weight.detach().reshape(c.weight.shape[0], -1) for c in convs]
    w = parts[0] if len(parts) == 1 else torch.cat(parts)
    biases = [c.bias for c in convs]
    with torch.device("meta"):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=biases[0] is not None)
    lin.weight = nn.Parameter(w)
    if biases[0] is not None:
        lin.bias = nn.Parameter(torch.cat([b.detach() for b in biases]))
    return lin


def _write_back(lin: nn.Linear, convs: Sequence[Any]) -> None:
    """The merged weights into the convolutions' own (copy-on-write mapped) tensors: no second copy stays."""
    sizes = [c.weight.shape[0] for c in convs]
    bias = lin.bias.detach().split(sizes) if lin.bias is not None else [None] * len(convs)
    for c, w, b in zip(convs, lin.weight.detach().split(sizes), bias, strict=True):
        c.weight.data.copy_(w.reshape(c.weight.shape))
        if b is not None:
            c.bias.data.copy_(b)


@torch.no_grad()
def apply(model: Any, r1: bool = True, r2: bool = True) -> None:
    """Rotate `model` (a StaticDecoder) in place with aimet's SpinQuant. The LM head gets its own weight (a tied
    head is untied, as aimet requires)."""
    from aimet_torch.experimental.transforms.transform_config import LlamaBlockInterface
    from aimet_torch.experimental.transforms.transformed_layers import TransformationMixin
    from aimet_torch.spinquant.spinquant_optimizer import SpinQuant as Sq

    spec = model.spec
    if (why := refusal("spinquant", spec)) is not None:
        raise why
    device = model.lm_head.weight.device
    for layer in model.layers:  # aimet's order for each block: fuse the norms, add R1 and R2, merge
        groups = {"q_proj": layer.attn.q, "k_proj": layer.attn.k, "v_proj": layer.attn.v, "o_proj": [layer.attn.o],
                  "gate_proj": [layer.mlp.gate], "up_proj": [layer.mlp.up], "down_proj": [layer.mlp.down]}
        lin = {name: _linear(convs) for name, convs in groups.items()}
        attn = SimpleNamespace(**{k: lin[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj")})
        mlp = SimpleNamespace(**{k: lin[k] for k in ("gate_proj", "up_proj", "down_proj")})
        block = LlamaBlockInterface(SimpleNamespace(self_attn=attn, mlp=mlp, input_layernorm=layer.input_norm,
                                                    post_attention_layernorm=layer.post_norm))
        Sq._fuse_norm_layer_into_linears(block.input_norm, list(block.qkv_layers()))
        Sq._fuse_norm_layer_into_linears(block.post_attention_norm, list(block.gate_up_layers()))
        Sq._convert_block_layers_to_transformed([block])
        if r1:
            Sq._apply_r1_to_decoder_stack(spec.hidden, None, None, [block], device)
        if r2:
            Sq._apply_r2_to_decoder_stack(spec.head_dim, [block], device)
        Sq._merge_and_revert_block_layers([block])
        for name, convs in groups.items():
            _write_back(getattr(attn if hasattr(attn, name) else mlp, name), convs)
    head = _linear([model.lm_head])
    Sq._fuse_norm_layer_into_linears(model.norm, [head])
    if r1:  # the head first: a tied head reads the table the embedding is about to lose
        embed, head_t = TransformationMixin.from_module(model.embed), TransformationMixin.from_module(head)
        Sq._apply_r1_to_decoder_stack(spec.hidden, embed, head_t, [], device)
        model.lm_head.weight = nn.Parameter(Sq._merge_transforms_and_recover_original_layer(head_t).weight.detach()
                                            .reshape(model.lm_head.weight.shape).contiguous())
        model.embed.weight.data.copy_(Sq._merge_transforms_and_recover_original_layer(embed).weight.detach())
    else:
        model.lm_head.weight = nn.Parameter(head.weight.detach().reshape(model.lm_head.weight.shape).contiguous())
