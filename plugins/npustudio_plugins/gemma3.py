"""Gemma 3 family (270M, 1B and the text tower of the larger ones: Gemma3ForCausalLM), refused at intake.

Its sliding-window layers rotate q and k with one RoPE base (`rope_local_base_freq`, 10,000 in every Gemma 3
release) and its full-attention layers with another (`rope_theta`, 1,000,000). Genie's positional encoding
computes one pair of cos/sin tables, of one base, and feeds it to every layer of every graph; no graph Genie
runs can rotate by both, and neither table can be computed from the other inside the graph. The rest of the
architecture (the (1 + weight) RMSNorms, four per layer, the √hidden embedding scale, query_pre_attn_scalar,
tanh GeGLU) would fold into weights the way Granite's multipliers do; the two bases cannot.
"""

from npustudio.core.families import FamilyRecipe

RECIPE = FamilyRecipe(
    name="gemma3", display="Gemma 3", model_types=("gemma3_text", "gemma3"),
    refused=("its sliding-window layers rotate with one RoPE base (rope_local_base_freq: 10,000 in its releases) "
             "and its full-attention layers with another (rope_theta: 1,000,000), while Genie feeds every layer the "
             "cos/sin tables of one base, so no graph Genie runs computes both exactly"),
    refused_fix="Use a model of a supported family (`npustudio info` lists them), e.g. Llama-3.2-1B, Qwen3-1.7B or "
                "SmolLM2.")
