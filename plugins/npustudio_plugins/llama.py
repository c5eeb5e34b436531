"""Llama family: Llama 2/3/3.x, SmolLM/SmolLM2, TinyLlama and other LlamaForCausalLM checkpoints."""

from npustudio.core.families import FamilyRecipe

RECIPE = FamilyRecipe(name="llama", display="Llama", model_types=("llama",), attention_bias=True, mlp_bias=True)
