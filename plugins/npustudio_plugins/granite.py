"""Granite family: IBM Granite 3.x dense models (GraniteForCausalLM), Llama's weights and four constants.

transformers' Granite scales the embeddings by `embedding_multiplier`, takes `attention_multiplier` as the
attention scale (in place of 1/sqrt(head_dim)), scales each block's output by `residual_multiplier` before it
joins the residual stream, and divides the logits by `logits_scaling`. Each is folded exactly into the weights
by the adaptation (core/graph/decoder.py), so the graphs and Genie's config are Llama's.
"""

from npustudio.core.families import FamilyRecipe

RECIPE = FamilyRecipe(name="granite", display="Granite", model_types=("granite",), attention_bias=True,
                      mlp_bias=True, multipliers=True)
