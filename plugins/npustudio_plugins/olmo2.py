"""OLMo 2 family: OLMo-2 1B/7B/13B (Olmo2ForCausalLM), post-norm blocks and q/k RMSNorm over the whole projection.

transformers' OLMo 2 has no norm before the attention or the MLP: each reads the residual stream itself, and its
output is RMS-normed (`post_attention_layernorm`, `post_feedforward_layernorm`) before the residual add. q and k
are RMS-normed over the whole projection (all heads at once, `q_norm`/`k_norm` of heads·head_dim), before RoPE.
Both are built exactly by the static decoder (spec.post_norms, spec.qk_norm_full); Genie's config is Llama's.
"""

from dataclasses import dataclass
from typing import Any

from npustudio.core.families import FamilyRecipe, LayerWeights, bias


@dataclass(frozen=True)
class Olmo2Recipe(FamilyRecipe):
    """Llama's weight names, no input norm, and the MLP's output norm."""

    def layer(self, hf_layer: Any) -> LayerWeights:
        a, m = hf_layer.self_attn, hf_layer.mlp
        return LayerWeights(
            q=a.q_proj.weight.data, k=a.k_proj.weight.data, v=a.v_proj.weight.data, o=a.o_proj.weight.data,
            gate=m.gate_proj.weight.data, up=m.up_proj.weight.data, down=m.down_proj.weight.data,
            input_norm=None, post_norm=hf_layer.post_attention_layernorm.weight.data,
            post_ff_norm=hf_layer.post_feedforward_layernorm.weight.data,
            q_bias=bias(a.q_proj), k_bias=bias(a.k_proj), v_bias=bias(a.v_proj), o_bias=bias(a.o_proj),
            q_norm=a.q_norm.weight.data, k_norm=a.k_norm.weight.data,
        )


RECIPE = Olmo2Recipe(name="olmo2", display="OLMo 2", model_types=("olmo2",), attention_bias=True,
                     qk_norm_full=True, post_norms=True)
