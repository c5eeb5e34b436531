"""The static decoder in the form Genie runs on the HTP.

One set of weights serves every graph: AR and CL are only the shapes of the inputs, so the AR-N
(prompt) and AR-1 (token) graphs are the same module traced at two shapes.

Graph I/O (exactly what Genie binds by name):
  inputs   input_ids (1,N) int32, attention_mask (1,1,N,CL) additive, position_ids_cos/_sin (1,1,N,rd/2)
           (rd: the head dims RoPE rotates, hd unless the model's RoPE is partial),
           past_key_{l}_in (KV,1,hd,CL-N), past_value_{l}_in (KV,1,CL-N,hd)
  outputs  logits (1,N,V), past_key_{l}_out (KV,1,hd,N), past_value_{l}_out (KV,1,N,hd)  (new entries only)
Inside, the residual stream is channel-first (1,D,1,N) so every Linear is a 1x1 Conv2d, and q/k/v are
single-head convs (SHA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from pydantic import BaseModel
from torch import nn

from ..families import FamilyRecipe
from ..shape import DecoderShape, DecoderSpec
from .half_weights import widened
from .ops import ACTIVATIONS, Add, Concat, Conv1x1, MatMul, Mul, RMSNorm, Rope

Linear = Callable[[Conv1x1, torch.Tensor], torch.Tensor]  # how a block applies one of its 1x1 convs to an input


def plain(conv: Conv1x1, x: torch.Tensor) -> torch.Tensor:
    return conv(x)


class Neg(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


class Attention(nn.Module):
    """`rope` False: a NoPE layer (SmolLM3), whose q/k are not rotated; the cos/sin inputs serve the other layers."""

    def __init__(self, spec: DecoderSpec, rope: bool = True) -> None:
        super().__init__()
        s = spec
        hd, kv, g = s.head_dim, s.kv_heads, s.heads // s.kv_heads
        self.hd, self.kv, self.g = hd, kv, g
        z = torch.zeros
        self.q = nn.ModuleList(Conv1x1(z(hd, s.hidden), z(hd) if s.qkv_bias else None) for _ in range(s.heads))
        self.k = nn.ModuleList(Conv1x1(z(hd, s.hidden), z(hd) if s.qkv_bias else None) for _ in range(kv))
        self.v = nn.ModuleList(Conv1x1(z(hd, s.hidden), z(hd) if s.qkv_bias else None) for _ in range(kv))
        self.full_norm = s.qk_norm and s.qk_norm_full  # OLMo 2: over the joined heads (1, H*hd, 1, N), channel axis
        self.q_join = Concat(dim=1) if self.full_norm else None
        self.k_join = Concat(dim=1) if self.full_norm else None
        self.q_norm = RMSNorm(z(s.heads * hd if self.full_norm else hd), s.rms_norm_eps,
                              dim=1 if self.full_norm else -1) if s.qk_norm else None
        self.k_norm = RMSNorm(z(kv * hd if self.full_norm else hd), s.rms_norm_eps,
                              dim=1 if self.full_norm else -2) if s.qk_norm else None
        rd = s.rope_dim
        self.q_rope = Rope(dim=-1, rotary_dim=rd, head_dim=hd) if rope else None  # q is (KV, G*N, hd)
        self.k_rope = Rope(dim=-2, rotary_dim=rd, head_dim=hd) if rope else None  # k (KV, 1, hd, N): Genie's layout
        self.k_cat = Concat(dim=3)
        self.v_cat = Concat(dim=2)
        self.qk = MatMul()
        self.mask_add = Add()
        self.softmax = nn.Softmax(dim=-1)
        self.pv = MatMul()
        self.o = Conv1x1(z(s.hidden, s.heads * hd), z(s.hidden) if s.o_bias else None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], mask: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor, lin: Linear = plain) -> tuple[torch.Tensor, ...]:
        n = x.shape[-1]
        hd, kv, g = self.hd, self.kv, self.g
        cos_q, sin_q, cos_k, sin_k = rope
        qs, ks, vs = (cast(list[Conv1x1], list(c)) for c in (self.q, self.k, self.v))
        # (1,hd,1,N) per head -> q (KV, G*N, hd); k (KV,1,hd,N); v (KV,1,N,hd)
        v = torch.stack([lin(vs[j], x).reshape(hd, n).t().reshape(1, n, hd) for j in range(kv)])
        if self.q_join is not None and self.k_join is not None and self.q_norm is not None and self.k_norm is not None:
            # the norm over the whole projection: the heads joined on the channel axis, normed, then split as below
            qa = self.q_norm(self.q_join(*[lin(c, x) for c in qs]))  # (1, H*hd, 1, N), head h = j*G + i
            q = qa.reshape(kv, g, hd, n).transpose(2, 3).reshape(kv, g * n, hd)
            k = self.k_norm(self.k_join(*[lin(c, x) for c in ks])).reshape(kv, 1, hd, n)
        else:
            q = torch.stack([torch.cat([lin(qs[j * g + i], x).reshape(hd, n).t() for i in range(g)], 0)
                             for j in range(kv)])
            k = torch.stack([lin(ks[j], x).reshape(1, hd, n) for j in range(kv)])
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        if self.q_rope is not None and self.k_rope is not None:
            q = self.q_rope(q, cos_q, sin_q)
            k = self.k_rope(k, cos_k, sin_k)
        keys = self.k_cat(past_k, k).reshape(kv, hd, -1)  # (KV, hd, CL)
        vals = self.v_cat(past_v, v).reshape(kv, -1, hd)  # (KV, CL, hd)
        scores = self.qk(q, keys).reshape(1, kv * g, n, -1)  # the mask broadcasts over one axis only (HTP)
        p = self.softmax(self.mask_add(scores, mask)).reshape(kv, g * n, -1)
        o = self.pv(p, vals)  # (KV, G*N, hd) -> heads in order -> (1, H*hd, 1, N)
        o = o.reshape(kv * g, n, hd).permute(0, 2, 1).reshape(1, kv * g * hd, 1, n)
        return lin(self.o, o), k, v


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        z = torch.zeros
        i, d = spec.intermediate, spec.hidden
        self.gate = Conv1x1(z(i, d), z(i) if spec.mlp_bias else None)
        self.up = Conv1x1(z(i, d), z(i) if spec.mlp_bias else None)
        self.down = Conv1x1(z(d, i), z(d) if spec.mlp_bias else None)
        self.act = ACTIVATIONS[spec.activation]()
        self.mul = Mul()

    def forward(self, x: torch.Tensor, lin: Linear = plain) -> torch.Tensor:
        return lin(self.down, self.mul(self.act(lin(self.gate, x)), lin(self.up, x)))


class Layer(nn.Module):
    """Pre-norm (input_norm before the attention, post_norm before the MLP) or, with `spec.post_norms` (OLMo 2),
    post-norm: the attention and the MLP read the stream itself, post_norm and mlp_norm norm their outputs before
    each residual add."""

    def __init__(self, spec: DecoderSpec, rope: bool = True) -> None:
        super().__init__()
        z = torch.zeros(spec.hidden)
        self.input_norm = None if spec.post_norms else RMSNorm(z, spec.rms_norm_eps, dim=1)
        self.attn = Attention(spec, rope)
        self.attn_add = Add()
        self.post_norm = RMSNorm(z, spec.rms_norm_eps, dim=1)
        self.mlp = MLP(spec)
        self.mlp_norm = RMSNorm(z, spec.rms_norm_eps, dim=1) if spec.post_norms else None
        self.mlp_add = Add()

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, ...], mask: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor, lin: Linear = plain) -> tuple[torch.Tensor, ...]:
        if self.mlp_norm is not None:  # post-norm
            a, k, v = self.attn(h, rope, mask, past_k, past_v, lin)
            h = self.attn_add(h, self.post_norm(a))
            h = self.mlp_add(h, self.mlp_norm(self.mlp(h, lin)))
            return h, k, v
        assert self.input_norm is not None
        a, k, v = self.attn(self.input_norm(h), rope, mask, past_k, past_v, lin)
        h = self.attn_add(h, a)
        h = self.mlp_add(h, self.mlp(self.post_norm(h), lin))
        return h, k, v


class Branches(nn.Module):
    """What adds to some convs' outputs from extra graph inputs (LoRA adapters as inputs): `names` are those
    inputs, after the KV cache's; `linears(decoder, inputs)` says how each layer applies its convs in one call."""

    names: list[str]

    def linears(self, decoder: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[int], Linear]:
        raise NotImplementedError


class StaticDecoder(nn.Module):
    branches: Branches | None

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.branches = None
        s = spec
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.cos_cat = Concat(dim=-1)
        self.sin_cat = Concat(dim=-1)
        self.sin_neg = Neg()
        self.layers = nn.ModuleList(Layer(s, rope=i not in s.nope_layers) for i in range(s.layers))
        self.norm = RMSNorm(torch.zeros(s.hidden), s.rms_norm_eps, dim=1)
        self.lm_head = Conv1x1(torch.zeros(s.vocab, s.hidden))
        if s.tied_embeddings:
            self.tie()

    def tie(self) -> None:
        """Tied LM head: one storage for the embedding table and the head (stored once on disk too)."""
        w = self.embed.weight
        self.lm_head.weight = nn.Parameter(w.data.view(w.shape[0], w.shape[1], 1, 1))

    @property
    def blocks(self) -> list[Layer]:
        """The decoder layers, typed (an nn.ModuleList yields plain Modules)."""
        return [cast(Layer, m) for m in self.layers]

    @property
    def extra_inputs(self) -> list[str]:
        """The inputs after the KV cache's (none unless branches are attached)."""
        return list(self.branches.names) if self.branches is not None else []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids_cos: torch.Tensor,
                position_ids_sin: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        past, extra = rest[:2 * self.spec.layers], dict(zip(self.extra_inputs, rest[2 * self.spec.layers:],
                                                           strict=True))
        n = input_ids.shape[1]
        g = self.spec.heads // self.spec.kv_heads
        cos2 = self.cos_cat(position_ids_cos, position_ids_cos)[0, 0]  # (N, rd)
        sin2 = self.sin_cat(self.sin_neg(position_ids_sin), position_ids_sin)[0, 0]
        rope = (cos2.repeat(g, 1), sin2.repeat(g, 1), cos2.t(), sin2.t())
        h = self.embed(input_ids).permute(0, 2, 1).reshape(1, -1, 1, n)  # (1, D, 1, N)
        kv_out: list[torch.Tensor] = []
        linear = self.branches.linears(self, extra) if self.branches is not None else None
        for i, layer in enumerate(self.layers):
            # without branches a block is called as before them: what wraps or replays a block sees its five inputs
            more = (linear(i),) if linear is not None else ()
            h, k, v = layer(h, rope, attention_mask, past[2 * i], past[2 * i + 1], *more)
            kv_out += [k, v]
        logits = self.lm_head(self.norm(h)).reshape(1, -1, n).transpose(1, 2)
        return (logits, *kv_out)


# ------------------------------------------------------------------ building from a HF model
def spec_from(card: Any, hf_model: Any) -> DecoderSpec:
    rot = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
    shape = {k: getattr(card, k) for k in DecoderShape.model_fields}
    return DecoderSpec(**shape, rope_attention_scaling=float(getattr(rot, "attention_scaling", 1.0) or 1.0))


@torch.no_grad()
def adapt_weights(spec: DecoderSpec, recipe: FamilyRecipe, hf_model: Any) -> StaticDecoder:
    """The static form of a HF model, sharing its weight storage (no second copy of a multi-GB model).

    Convs are views of the HF Linear weights (a Linear's (out, in) is a 1x1 conv's (out, in, 1, 1); a head is a
    run of rows). Only what is rescaled is new memory: the 1/sqrt(hd) softmax scale (Granite: its attention
    multiplier) folded into q (or, with a q-norm, into its gain, which would undo a scaled weight), and Granite's
    constants: the residual multiplier into o_proj and down_proj (weights and biases: a block's output is scaled
    before it joins the stream), the embedding multiplier into the table, and 1/logits_scaling into the final
    norm's gain (with a tied table, 1/embedding_multiplier too, undoing the table's scale for the head: the norm's
    gain scales the head's input: (W·m)·(g/(m·s) ⊙ x̂) = W·(g ⊙ x̂)/s, one table kept).
    A rescaled tensor is computed and kept in float32 (a 16-bit product would round); the views keep the HF
    weights' own dtype, which a 16-bit checkpoint's model computes with through `half_weights`.
    The HF model must not be changed afterwards.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on the meta device; constants (buffers) real
        m = StaticDecoder(spec)
    emb = spec.embedding_multiplier
    table = recipe.embedding(hf_model)
    _share(m.embed, "weight", _scaled(table, emb))
    for layer, hf_layer in zip(m.blocks, recipe.layers(hf_model), strict=True):
        w = recipe.layer(hf_layer)
        if (layer.input_norm is None) != (w.input_norm is None) or (layer.mlp_norm is None) != (w.post_ff_norm is None):
            raise ValueError("the block's norms (pre- or post-norm) do not match the card's options")
        if layer.input_norm is not None and w.input_norm is not None:
            _share(layer.input_norm, "weight", w.input_norm)
        if layer.mlp_norm is not None and w.post_ff_norm is not None:
            _share(layer.mlp_norm, "weight", w.post_ff_norm)
        _share(layer.post_norm, "weight", w.post_norm)
        for field, conv, rows, sc in linear_places(spec, layer):
            wt, b = getattr(w, field), getattr(w, f"{field}_bias")
            _share(conv, "weight", _scaled(_conv(wt[rows]), sc))
            if field in ("q", "k", "v"):  # a head's rows; its bias rows when the weights have biases
                if b is not None:
                    _share(conv, "bias", _scaled(b[rows], sc))
                continue
            if (conv.bias is None) != (b is None):  # never drop (or invent) a bias silently
                raise ValueError(f"the {field} bias of the weights does not match the card's options")
            if b is not None:
                _share(conv, "bias", _scaled(b, sc))
        at = layer.attn
        if at.q_norm is not None and at.k_norm is not None:
            if w.q_norm is None or w.k_norm is None:
                raise ValueError("the card says q/k norm; the weights have none")
            _share(at.q_norm, "weight", _scaled(w.q_norm, _softmax_scale(spec)))
            _share(at.k_norm, "weight", w.k_norm)
    norm = recipe.final_norm(hf_model)
    head_scale = 1.0 / spec.logits_scaling / (emb if spec.tied_embeddings else 1.0)
    _share(m.norm, "weight", _scaled(norm, head_scale))
    if spec.tied_embeddings:
        m.tie()
    else:
        _share(m.lm_head, "weight", _conv(recipe.lm_head(hf_model)))
    left = [n for n, p in m.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"the {spec.family} recipe left {left[:3]} without weights")
    return m.eval()


def _softmax_scale(spec: DecoderSpec) -> float:
    """1/sqrt(hd), or Granite's attention multiplier: folded into q (with a q-norm, into its gain)."""
    return 1.0 / math.sqrt(spec.head_dim) if spec.attention_multiplier is None else spec.attention_multiplier


def linear_places(spec: DecoderSpec, layer: Layer) -> list[tuple[str, Conv1x1, slice, float]]:
    """Where each Linear of a HF layer lands in the static layer: (LayerWeights field, conv, the rows of the HF
    weight it takes, the factor folded into it). q/k/v take one head's rows per conv; o_proj and down_proj carry
    the residual multiplier. `adapt_weights` shares the weights by it and `weight_places` says it for a view."""
    hd, res = spec.head_dim, spec.residual_multiplier
    at, mlp = layer.attn, layer.mlp
    q_scale = 1.0 if spec.qk_norm else _softmax_scale(spec)
    out: list[tuple[str, Conv1x1, slice, float]] = []
    for field, heads, sc in (("q", at.q, q_scale), ("k", at.k, 1.0), ("v", at.v, 1.0)):
        out += [(field, cast(Conv1x1, conv), slice(h * hd, (h + 1) * hd), sc) for h, conv in enumerate(heads)]
    for field, conv in (("o", at.o), ("gate", mlp.gate), ("up", mlp.up), ("down", mlp.down)):
        out.append((field, conv, slice(None), res if field in ("o", "down") else 1.0))
    return out


class Place(BaseModel):
    """Rows of a HF Linear weight as the static decoder holds them: in graph tensor `tensor`, times `factor`."""

    tensor: str
    rows: tuple[int, int]
    factor: float


def weight_places(spec: DecoderSpec, recipe: FamilyRecipe, hf_model: Any, m: StaticDecoder) -> dict[str, list[Place]]:
    """Each HF Linear weight (by parameter name) -> where its rows are in `m`'s graph tensors, found by memory: the
    tensor a recipe reads is the parameter or a run of its rows (a fused qkv). A weight a recipe copies or
    rearranges is left out: where its rows went is not known."""
    params = [(n, p) for n, p in hf_model.named_parameters(remove_duplicate=False) if p.dim() == 2]
    names = {id(mod): n for n, mod in m.named_modules()}

    def source(t: torch.Tensor) -> tuple[str, int] | None:
        for n, p in params:
            start, row = p.data_ptr(), p.stride(0) * p.element_size()
            if p.dtype == t.dtype and p.shape[1] == t.shape[1] and start <= t.data_ptr() < start + p.shape[0] * row:
                return n, (t.data_ptr() - start) // row
        return None

    out: dict[str, list[Place]] = {}
    for layer, hf_layer in zip(m.blocks, recipe.layers(hf_model), strict=True):
        w = recipe.layer(hf_layer)
        for field, conv, rows, sc in linear_places(spec, layer):
            found = source(getattr(w, field))
            if found is not None:
                name, first = found
                a, b, _ = rows.indices(getattr(w, field).shape[0])
                out.setdefault(name, []).append(Place(tensor=f"{names[id(conv)]}.weight", rows=(first + a, first + b),
                                                      factor=sc))
    if not spec.tied_embeddings and (found := source(recipe.lm_head(hf_model))) is not None:
        out.setdefault(found[0], []).append(Place(tensor="lm_head.weight", rows=(found[1], found[1] +
                                                  recipe.lm_head(hf_model).shape[0]), factor=1.0))
    return out


def _conv(w: torch.Tensor) -> torch.Tensor:
    """A Linear weight (out, in) as a 1x1 conv weight (out, in, 1, 1): a view, no copy."""
    return w.reshape(*w.shape, 1, 1)


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    """`t` times `scale`, computed in float32 (new memory); `t` itself when the scale is 1."""
    return t if scale == 1.0 else widened(t) * scale


def _share(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` (same storage: float32, or the 16 bits a checkpoint holds) the module's parameter `name`."""
    old = getattr(module, name)
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"{name} of {type(module).__name__}: shape {tuple(tensor.shape)} != {tuple(old.shape)}")
    if not tensor.is_floating_point() or tensor.dtype == torch.float64:
        tensor = tensor.float()
    setattr(module, name, nn.Parameter(tensor.detach(), requires_grad=False))


def io_names(layers: int, extra: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """The graph's input and output names in the forward's order; `extra`: the inputs after the KV cache's."""
    ins = ["input_ids", "attention_mask", "position_ids_cos", "position_ids_sin"]
    outs = ["logits"]
    for i in range(layers):
        ins += [f"past_key_{i}_in", f"past_value_{i}_in"]
        outs += [f"past_key_{i}_out", f"past_value_{i}_out"]
    return ins + list(extra), outs


def io_shapes(spec: DecoderSpec, ar: int, cl: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    hd, kv, rd = spec.head_dim, spec.kv_heads, spec.rope_dim
    ins = {"input_ids": [1, ar], "attention_mask": [1, 1, ar, cl],
           "position_ids_cos": [1, 1, ar, rd // 2], "position_ids_sin": [1, 1, ar, rd // 2]}
    outs = {"logits": [1, ar, spec.vocab]}
    for i in range(spec.layers):
        ins[f"past_key_{i}_in"] = [kv, 1, hd, cl - ar]
        ins[f"past_value_{i}_in"] = [kv, 1, cl - ar, hd]
        outs[f"past_key_{i}_out"] = [kv, 1, hd, ar]
        outs[f"past_value_{i}_out"] = [kv, 1, ar, hd]
    return ins, outs


def graph_names(ar: int, cl: int, parts: int = 1) -> dict[str, list[str]]:
    return {"prompt": [f"prompt_ar{ar}_cl{cl}_{i}_of_{parts}" for i in range(1, parts + 1)],
            "token": [f"token_ar1_cl{cl}_{i}_of_{parts}" for i in range(1, parts + 1)]}
