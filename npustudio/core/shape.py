"""The decoder's shape and options: what an architecture card reads from a config and the static decoder is built
from. One model for both, so a field added for a new family reaches the card, the adapted graphs and the bundle.
Plain pydantic (no torch): a bundle's metadata carries the spec, and reading it must stay light."""

from __future__ import annotations

from pydantic import BaseModel


class DecoderShape(BaseModel):
    family: str
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    rms_norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"  # silu | gelu | gelu_tanh
    rotary_dim: int | None = None  # RoPE over the first rotary_dim of each head, the rest passed through; None: all
    attention_multiplier: float | None = None  # the attention scale (Granite); None: 1/sqrt(head_dim)
    embedding_multiplier: float = 1.0  # the embeddings scaled (Granite)
    residual_multiplier: float = 1.0  # each block's output scaled before it joins the residual stream (Granite)
    logits_scaling: float = 1.0  # the logits divided (Granite)
    qk_norm_full: bool = False  # the q/k norm spans the whole projection (all heads at once, OLMo 2), not a head
    post_norms: bool = False  # post-norm blocks (OLMo 2): no input norm; the attention's and MLP's outputs normed
    nope_layers: list[int] = []  # the layers whose q/k are not rotated (SmolLM3's NoPE layers); the rest use RoPE

    @property
    def rope_dim(self) -> int:
        """The head dims RoPE rotates (the cos/sin tables are half as wide)."""
        return self.rotary_dim or self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache one token adds: K and V of every layer, 8-bit (the encoding the quantize stage gives it)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


MASK_VALUE = -100.0  # additive mask for excluded positions; Genie ran with it (recipes/genie_x86)


class DecoderSpec(DecoderShape):
    """Everything needed to rebuild the static decoder from its weights file (no transformers needed)."""

    rope_attention_scaling: float = 1.0
    mask_value: float = MASK_VALUE
