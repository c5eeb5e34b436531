"""Mistral family: Mistral 7B v0.1-v0.3, Mistral-Nemo and other MistralForCausalLM checkpoints.

Llama's weight names; the architecture adds a sliding attention window, exact here while it covers the
context (Genie builds a full causal mask, so a narrower window is refused at intake).
"""

from npustudio.core.families import FamilyRecipe

RECIPE = FamilyRecipe(name="mistral", display="Mistral", model_types=("mistral",), sliding_window=True)
