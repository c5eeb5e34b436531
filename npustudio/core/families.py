"""Model-family recipes, discovered from the `npustudio.families` entry point group.

A recipe says which Hugging Face `model_type`s it adapts, where their weights live, and which of the
config's math-changing options its architecture has (the intake audit, core/config_audit.py, checks a
checkpoint against it, and the support table in docs/pipeline.md is rendered from it). The adaptation itself is
generic (core/adapt). Third-party packages add families by declaring the same entry point.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .errors import UserError

if TYPE_CHECKING:  # annotations only: the model card reads a family's recipe without torch
    import torch

ENTRY_POINT_GROUP = "npustudio.families"


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors in Hugging Face orientation (Linear weights are (out, in))."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor | None  # None: no norm before the attention (OLMo 2's post-norm blocks)
    post_norm: torch.Tensor  # before the MLP; in a post-norm block, on the attention's output
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm on q/k before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None  # on the MLP's output before the residual add (post-norm blocks)


def bias(lin: Any) -> torch.Tensor | None:
    return None if getattr(lin, "bias", None) is None else lin.bias.data


@dataclass(frozen=True)
class FamilyRecipe:
    """How to read one family's decoder weights, and which optional parts its architecture has.

    Llama naming is the default; a family with other weight names overrides `layer`. The flags say what
    transformers' class for the family builds (and so what the config may switch on); everything else a
    config could set that changes the math is refused at intake.
    """

    name: str
    display: str
    model_types: tuple[str, ...]
    attention_bias: bool = False  # honours config.attention_bias: biases on q/k/v and o_proj
    mlp_bias: bool = False  # honours config.mlp_bias: biases on gate/up/down
    qkv_bias: bool = False  # q/k/v biases always there (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: bool = False  # honours config.sliding_window (exact while the window covers the context)
    partial_rotary: bool = False  # honours partial_rotary_factor: RoPE over the first part of each head (Phi-3)
    multipliers: bool = False  # embedding/attention/residual multipliers and logits_scaling (Granite)
    no_rope_layers: bool = False  # honours no_rope_layers: layers whose q/k are not rotated (SmolLM3)
    qk_norm_full: bool = False  # RMSNorm of q and of k over the whole projection (all heads at once; OLMo 2)
    post_norms: bool = False  # post-norm blocks: RMSNorm on the attention's and MLP's outputs, none before (OLMo 2)
    refused: str = ""  # why no checkpoint of the family can run exactly under Genie: intake refuses it, saying so
    refused_fix: str = ""

    def layer(self, hf_layer: Any) -> LayerWeights:
        a, m = hf_layer.self_attn, hf_layer.mlp
        qn = getattr(a, "q_norm", None)
        kn = getattr(a, "k_norm", None)
        return LayerWeights(
            q=a.q_proj.weight.data, k=a.k_proj.weight.data, v=a.v_proj.weight.data, o=a.o_proj.weight.data,
            gate=m.gate_proj.weight.data, up=m.up_proj.weight.data, down=m.down_proj.weight.data,
            input_norm=hf_layer.input_layernorm.weight.data,
            post_norm=hf_layer.post_attention_layernorm.weight.data,
            q_bias=bias(a.q_proj), k_bias=bias(a.k_proj), v_bias=bias(a.v_proj),
            q_norm=None if qn is None else qn.weight.data,
            k_norm=None if kn is None else kn.weight.data,
            o_bias=bias(a.o_proj), gate_bias=bias(m.gate_proj), up_bias=bias(m.up_proj),
            down_bias=bias(m.down_proj),
        )

    def embedding(self, hf_model: Any) -> torch.Tensor:
        return hf_model.model.embed_tokens.weight.data

    def final_norm(self, hf_model: Any) -> torch.Tensor:
        return hf_model.model.norm.weight.data

    def lm_head(self, hf_model: Any) -> torch.Tensor:
        return hf_model.lm_head.weight.data

    def layers(self, hf_model: Any) -> list[Any]:
        return list(hf_model.model.layers)


@cache
def registry() -> dict[str, FamilyRecipe]:
    """model_type -> recipe, from every installed plugin."""
    out: dict[str, FamilyRecipe] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        recipe = ep.load()
        if not isinstance(recipe, FamilyRecipe):
            raise TypeError(f"entry point {ep.name} ({ep.value}) is not a FamilyRecipe")
        for mt in recipe.model_types:
            out[mt] = recipe
    return out


def recipe_for(model_type: str, architecture: str = "") -> FamilyRecipe:
    reg = registry()
    if model_type not in reg:
        names = ", ".join(r.display for r in recipes()) or "none (no plugin installed)"
        what = f"{architecture} ({model_type})" if architecture else model_type
        raise UserError(
            f"The model architecture {what} is not supported yet; supported families: {names}.",
            "Pick a model of a supported family, or install a plugin that adds this family "
            f"(entry point group '{ENTRY_POINT_GROUP}').",
        )
    recipe = reg[model_type]
    if recipe.refused:
        what = f"{architecture} ({model_type})" if architecture else model_type
        raise UserError(f"{recipe.display} models ({what}) cannot run exactly on the NPU under Genie: "
                        f"{recipe.refused}.", recipe.refused_fix)
    return recipe


def recipes(refused: bool = False) -> list[FamilyRecipe]:
    """Each installed recipe once, by display name: the families that run, or (`refused`) those refused at
    intake."""
    return sorted({id(r): r for r in registry().values() if bool(r.refused) == refused}.values(),
                  key=lambda r: r.display)
