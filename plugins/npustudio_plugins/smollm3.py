"""SmolLM3 family: SmolLM3-3B (SmolLM3ForCausalLM), Llama's weights with NoPE layers.

transformers' SmolLM3 reads `no_rope_layers` as one flag per layer, 1 where the layer uses RoPE and 0 where it
does not (by default every fourth layer is NoPE). The static decoder leaves q/k unrotated in the NoPE layers while
Genie feeds the same cos/sin inputs to every layer, which is exact: Genie's config is Llama's.
"""

from npustudio.core.families import FamilyRecipe

RECIPE = FamilyRecipe(name="smollm3", display="SmolLM3", model_types=("smollm3",), attention_bias=True,
                      mlp_bias=True, sliding_window=True, no_rope_layers=True)
