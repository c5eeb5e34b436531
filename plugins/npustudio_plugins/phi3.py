"""Phi-3 family: Phi-3 / Phi-3.5 mini and medium and Phi-4-mini (Phi3ForCausalLM), whose q/k/v and gate/up are
fused; Phi-4-mini rotates the first 3/4 of each head (`partial_rotary_factor` 0.75)."""

from dataclasses import dataclass
from typing import Any

from npustudio.core.families import FamilyRecipe, LayerWeights


@dataclass(frozen=True)
class Phi3Recipe(FamilyRecipe):
    """Splits `qkv_proj` into q, k, v (rows in that order) and `gate_up_proj` into gate, up (halves)."""

    def layer(self, hf_layer: Any) -> LayerWeights:
        a, m = hf_layer.self_attn, hf_layer.mlp
        hd, heads, kv = a.head_dim, a.config.num_attention_heads, a.num_key_value_heads
        qkv = a.qkv_proj.weight.data
        q, k, v = qkv.split([heads * hd, kv * hd, kv * hd])
        gate, up = m.gate_up_proj.weight.data.chunk(2)
        return LayerWeights(q=q, k=k, v=v, o=a.o_proj.weight.data, gate=gate, up=up, down=m.down_proj.weight.data,
                            input_norm=hf_layer.input_layernorm.weight.data,
                            post_norm=hf_layer.post_attention_layernorm.weight.data)


RECIPE = Phi3Recipe(name="phi3", display="Phi-3", model_types=("phi3",), sliding_window=True, partial_rotary=True)
