"""Qwen family: Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm). Same weight names as Llama."""

from npustudio.core.families import FamilyRecipe

QWEN2 = FamilyRecipe(name="qwen2", display="Qwen2", model_types=("qwen2",), qkv_bias=True, sliding_window=True)
QWEN3 = FamilyRecipe(name="qwen3", display="Qwen3", model_types=("qwen3",), attention_bias=True, qk_norm=True,
                     sliding_window=True)
