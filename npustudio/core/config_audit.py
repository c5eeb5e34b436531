"""The intake audit: every config option that changes a checkpoint's math, against what its family implements.

An option is either implemented (recorded on the architecture card, built by the adaptation, written into
the Genie config and proven by the adapt stage's equivalence gate) or refused here, before any stage runs,
naming the option, its value and what to do. The declarations below and the recipes' flags
(core/families.py) are the one source of truth: `support_table()` renders the table in docs/pipeline.md from them.

What Genie does with each RoPE scaling was measured by dumping the cos/sin tables the x86 libGenie feeds
the graphs (its `debug.dump-tensors`): `linear`, `llama3`, `yarnrope` (all seven keys required, `dim` the
rotary dims, `attn-factor` multiplied by 1 + 0.1·ln(factor)) and `longrope` (long factors when the context
exceeds `original-max-position-embeddings`, else short; attention factor from `factor`) equal transformers'
tables to the uint16 step. Genie's attention mask is always fully causal (its `longcontext` sliding window
evicts cache entries once the context is full; it does not narrow the mask), so a sliding window narrower
than the context cannot run under it. Partial rotary: Genie's `rope-dim` is the number of rotary frequencies
(the tables' width; its longrope factor lists must have that length), its frequencies theta^(-i/rope-dim): with
`rope-dim` half the rotated dims they equal transformers' partial tables, measured the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .errors import UserError
from .families import FamilyRecipe, recipes

# hidden_act -> what the decoder builds (transformers' gelu_new and gelu_pytorch_tanh are the same tanh formula)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}

# transformers rope_type -> how it runs under Genie (the table's wording)
ROPE_TYPES = {
    "default": "plain RoPE",
    "llama3": "Genie `llama3`",
    "linear": "Genie `linear`",
    "yarn": "Genie `yarnrope`",
    "longrope": "Genie `longrope`; context ≤ `original_max_position_embeddings` (short factors)",
    "dynamic": "plain RoPE: dynamic NTK scales nothing up to `max_position_embeddings`, which bounds the context",
}

# Options of other architectures that change the math where they exist. transformers ignores them for
# these families, so a checkpoint that sets them was trained as something else: refused. Key -> neutral values.
FOREIGN: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),  # Gemma 2
    "query_pre_attn_scalar": (None,),
    "embedding_multiplier": (None, 1, 1.0), "residual_multiplier": (None, 1, 1.0),  # Granite
    "attention_multiplier": (None,), "logits_scaling": (None, 1, 1.0),
    "scale_emb": (None,), "scale_depth": (None,), "dim_model_base": (None,),  # MiniCPM
    "logit_scale": (None, 1, 1.0),  # Cohere
    "layer_norm_eps": (None,), "layer_norm_epsilon": (None,), "norm_type": (None, "rms_norm", "rmsnorm"),
    "use_parallel_residual": (None, False), "parallel_attn": (None, False),
    "clip_qkv": (None,), "qk_layernorm": (None, False), "alibi": (None, False),
}


class Options(BaseModel):
    """A checkpoint's math-changing options, as the adaptation builds them."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    activation: str  # silu | gelu | gelu_tanh
    sliding_window: int | None  # tokens a query sees; None: full causal attention
    rope_scaling: dict[str, Any] | None  # transformers' parameters, completed with the defaults it applies
    rotary_dim: int | None = None  # partial rotary: the head dims RoPE rotates; None: all of them
    attention_multiplier: float | None = None  # Granite's attention scale; None: 1/sqrt(head_dim)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    nope_layers: list[int] = []  # layers that do not rotate q/k (SmolLM3's no_rope_layers zeros)
    qk_norm_full: bool = False  # the q/k norm spans the whole projection (OLMo 2)
    post_norms: bool = False  # post-norm blocks (OLMo 2)


def _refuse(option: str, value: Any, why: str, fix: str) -> UserError:
    return UserError(f"The model's config sets {option}={value!r}: {why}", fix)


def _set(config: Any, key: str) -> Any:
    return getattr(config, key, None)


def audit(config: Any, recipe: FamilyRecipe) -> Options:
    """Check every math-changing option of `config` against `recipe`; the options as built, or UserError."""
    arch = recipe.display
    qc = _set(config, "quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else getattr(qc, "quant_method", "?")
        raise _refuse("quantization_config", {"quant_method": method},
                      "the weights are pre-quantized, which NPU Studio does not read.",
                      "Use the model's float (fp16/bf16/fp32) safetensors release; NPU Studio quantizes for the NPU.")
    foreign = dict(FOREIGN)
    if not recipe.attention_bias:
        foreign["attention_bias"] = (None, False)
    if not recipe.mlp_bias:
        foreign["mlp_bias"] = (None, False)
    if not recipe.sliding_window:
        foreign |= {"sliding_window": (None,), "use_sliding_window": (None, False)}
    if recipe.multipliers:
        for key in MULTIPLIERS:
            foreign.pop(key)
    for key, neutral in foreign.items():
        value = _set(config, key)
        if value not in neutral:
            raise _refuse(key, value, f"the {arch} architecture has no such option (transformers ignores it for "
                          f"{arch} too), so these weights were most likely trained as another architecture.",
                          "Use a checkpoint whose model_type matches its architecture, or a supported family.")
    act = _set(config, "hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise _refuse("hidden_act", act, "this activation is not implemented for the NPU graphs (supported: "
                      f"{', '.join(ACTIVATIONS)}).", "Use a model with one of the supported activations.")
    attention_bias = recipe.attention_bias and bool(_set(config, "attention_bias"))
    return Options(qkv_bias=recipe.qkv_bias or attention_bias, o_bias=attention_bias,
                   mlp_bias=recipe.mlp_bias and bool(_set(config, "mlp_bias")),
                   qk_norm=recipe.qk_norm or recipe.qk_norm_full, qk_norm_full=recipe.qk_norm_full,
                   post_norms=recipe.post_norms,
                   activation=ACTIVATIONS[act], sliding_window=_window(config, recipe),
                   rope_scaling=_rope(config), rotary_dim=_rotary_dim(config, recipe),
                   nope_layers=_nope_layers(config, recipe), **_multipliers(config, recipe))


MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def _multipliers(config: Any, recipe: FamilyRecipe) -> dict[str, float]:
    """Granite's constants, each folded exactly by the adaptation (transformers applies all four, 1.0 included:
    the attention scale is attention_multiplier, never 1/sqrt(head_dim))."""
    if not recipe.multipliers:
        return {}
    out = {}
    for key in MULTIPLIERS:
        value = _set(config, key)
        value = 1.0 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value == 0:
            raise _refuse(key, value, "it must be a finite number other than 0.",
                          "The configuration is damaged: download it again, or fix the named field.")
        out[key] = float(value)
    return out


def _nope_layers(config: Any, recipe: FamilyRecipe) -> list[int]:
    """SmolLM3's `no_rope_layers`: one flag per layer, 1 = the layer uses RoPE, 0 = NoPE (transformers'
    `use_rope = no_rope_layers[layer_idx]`); the NoPE layers' indices. The graph leaves their q/k unrotated while
    Genie feeds the same cos/sin inputs, which is exact."""
    flags = _set(config, "no_rope_layers")
    if flags is None or (not recipe.no_rope_layers and isinstance(flags, list | tuple) and set(flags) <= {1}):
        return []
    if not recipe.no_rope_layers:
        raise _refuse("no_rope_layers", flags, f"transformers' {recipe.display} rotates q/k in every layer and "
                      "ignores this list, so these weights were most likely trained as another architecture.",
                      "Use a checkpoint whose model_type matches its architecture, or a supported family.")
    layers = config.num_hidden_layers
    if not isinstance(flags, list | tuple) or len(flags) < layers or any(f not in (0, 1) for f in flags[:layers]):
        raise _refuse("no_rope_layers", flags, f"it must hold 1 (RoPE) or 0 (NoPE) for each of the {layers} "
                      "layers.", "The configuration is damaged: download it again, or fix the named field.")
    nope = [i for i in range(layers) if not flags[i]]
    if len(nope) == layers:
        raise _refuse("no_rope_layers", flags, "no layer uses RoPE, so the graphs would have no use for the cos/sin "
                      "inputs Genie binds by name.", "Use a model with at least one RoPE layer.")
    return nope


def _partial(config: Any) -> float:
    rp = dict(_set(config, "rope_parameters") or _set(config, "rope_scaling") or {})
    return float(rp.get("partial_rotary_factor", _set(config, "partial_rotary_factor")) or 1.0)


def _rotary_dim(config: Any, recipe: FamilyRecipe) -> int | None:
    """The head dims RoPE rotates, as transformers computes them (int(head_dim · factor)); None: the whole head."""
    factor = _partial(config)
    if factor == 1.0:
        return None
    hd = _set(config, "head_dim") or config.hidden_size // config.num_attention_heads
    dim = int(hd * factor)
    if not recipe.partial_rotary:
        raise _refuse("partial_rotary_factor", factor, f"transformers' {recipe.display} rotates whole heads and "
                      "ignores this factor, so these weights were most likely trained as another architecture.",
                      "Use a checkpoint whose model_type matches its architecture, or a supported family.")
    if not 0 < factor < 1 or dim % 2 or dim < 2:
        raise _refuse("partial_rotary_factor", factor, f"RoPE over {dim} of the {hd} head dims needs an even "
                      "number of dims between 2 and the head dim.", "Fix the model's config.json.")
    return dim


def _window(config: Any, recipe: FamilyRecipe) -> int | None:
    if not recipe.sliding_window:
        return None
    window = _set(config, "sliding_window")
    kinds = set(_set(config, "layer_types") or [])
    if kinds - {"full_attention", "sliding_attention"}:
        raise _refuse("layer_types", sorted(kinds), "only full and sliding-window attention layers are implemented.",
                      "Use a model whose layers all use standard attention.")
    if kinds and "sliding_attention" not in kinds:
        return None  # e.g. Qwen2 with use_sliding_window false: every layer attends to the whole context
    return int(window) if window else None


def _rope(config: Any) -> dict[str, Any] | None:
    rp = dict(_set(config, "rope_parameters") or _set(config, "rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise _refuse("rope_scaling.rope_type", kind, "Genie has no equivalent of this RoPE scaling "
                      f"(supported: {', '.join(ROPE_TYPES)}).", "Use a model with a supported RoPE scaling.")
    if kind == "default":
        return None
    out = {k: v for k, v in rp.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    out["rope_type"] = kind
    if kind in ("yarn", "longrope"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        orig = rp.get("original_max_position_embeddings") or _set(config, "original_max_position_embeddings")
        if not orig:
            raise _refuse("rope_scaling", rp, f"{kind} needs original_max_position_embeddings.",
                          "Fix the model's config.json.")
        out["original_max_position_embeddings"] = int(orig)
        if out.get("factor") is None:
            out["factor"] = config.max_position_embeddings / int(orig)
        _, out["attention_factor"] = ROPE_INIT_FUNCTIONS[kind](config, None)  # transformers' own default rules
        out["attention_factor"] = float(out["attention_factor"])
    if kind == "yarn":
        if out["factor"] < 1:
            raise _refuse("rope_scaling.factor", out["factor"], "a yarn factor below 1 is not supported.",
                          "Use a model with a yarn factor of 1 or more.")
        if rp.get("truncate", True) is False:
            raise _refuse("rope_scaling.truncate", False, "Genie's yarnrope always rounds the correction range.",
                          "Use a model with the standard yarn (truncate true).")
        out.setdefault("beta_fast", 32.0)
        out.setdefault("beta_slow", 1.0)
        out["beta_fast"], out["beta_slow"] = float(out["beta_fast"] or 32.0), float(out["beta_slow"] or 1.0)
    if kind == "longrope":
        derived = math.sqrt(1 + math.log(out["factor"]) / math.log(out["original_max_position_embeddings"])) \
            if out["factor"] > 1 else 1.0
        if abs(out["attention_factor"] - derived) > 1e-6:
            raise _refuse("rope_scaling.attention_factor", out["attention_factor"], "Genie's longrope derives the "
                          f"attention factor from the scaling factor ({derived:.6f}) and takes no other.",
                          "Use a model with longrope's default attention factor.")
    return out


def max_context(card: Any) -> tuple[int | None, str]:
    """The longest context the model takes exactly, and why (None: no limit read from its config): its trained
    length, a sliding window (Genie's mask is fully causal) or LongRoPE's short range. The window's context fields
    stop there instead of letting a run be refused for a flag the window has not got."""
    limits = [(card.max_position, f"the model was trained for {card.max_position} tokens")] if card.max_position \
        else []
    if getattr(card, "sliding_window", None) is not None:
        limits.append((card.sliding_window, f"the model attends to the last {card.sliding_window} tokens only"))
    rs = card.rope_scaling or {}
    if rs.get("rope_type") == "longrope":
        orig = rs["original_max_position_embeddings"]
        limits.append((orig, f"LongRoPE keeps one RoPE table up to {orig} tokens"))
    return min(limits) if limits else (None, "")


def check_context(card: Any, cl: int) -> None:
    """The options whose support depends on the context length (`card` is an ArchCard)."""
    window = getattr(card, "sliding_window", None)
    if window is not None and window < cl:
        raise _refuse("sliding_window", window, f"a query may only see the last {window} tokens, but Genie builds a "
                      f"fully causal attention mask over the context of {cl}, so the model would see more than it "
                      "was trained to.", f"Use --cl {window} or less (the window then covers the whole context and "
                      "the model is exact).")
    rs = card.rope_scaling or {}
    if rs.get("rope_type") == "longrope" and cl > rs["original_max_position_embeddings"]:
        orig = rs["original_max_position_embeddings"]
        raise _refuse("rope_scaling.rope_type", "longrope", f"above {orig} tokens LongRoPE switches from its short "
                      "to its long factors with the length of each sequence, which static graphs with one RoPE "
                      "table (and Genie) cannot follow.",
                      f"Use --cl {orig} or less (the short factors then hold for the whole context, exactly).")


# ---------------------------------------------------------------- the support table (docs/pipeline.md)
@dataclass(frozen=True)
class Row:
    option: str
    cell: Any  # (recipe) -> "yes" | "yes (always)" | "refused" | "—" (the architecture has no such option)
    how: str


def _has(attr: str) -> Any:
    return lambda r: "yes" if getattr(r, attr) else "—"


YES, REFUSED = (lambda r: "yes"), (lambda r: "refused")

ROWS = (
    Row("q/k/v biases", lambda r: "yes (always)" if r.qkv_bias else "yes" if r.attention_bias else "—",
        "`attention_bias` (Qwen2: always)"),
    Row("o_proj bias", _has("attention_bias"), "`attention_bias`"),
    Row("MLP biases", _has("mlp_bias"), "`mlp_bias`"),
    Row("q/k RMSNorm", lambda r: "yes (always)" if r.qk_norm else "—", "per head, before RoPE"),
    Row("q/k RMSNorm over the whole projection", lambda r: "yes (always)" if r.qk_norm_full else "—",
        "all heads at once (the per-head convs joined, normed, split), before RoPE"),
    Row("post-norm blocks", lambda r: "yes (always)" if r.post_norms else "—",
        "no norm before attention/MLP; RMSNorm on each one's output before the residual add"),
    Row("`hidden_act` " + ", ".join(ACTIVATIONS), YES, "tanh GELU as x·sigmoid(…), erf GELU as the HTP's Gelu"),
    Row("other activations", REFUSED, "not implemented"),
    *(Row(f"RoPE `{k}`", YES, v) for k, v in ROPE_TYPES.items()),
    Row("other RoPE types", REFUSED, "no Genie equivalent"),
    Row("`partial_rotary_factor` < 1", lambda r: "yes" if r.partial_rotary else "—",
        "RoPE over the first `rotary_dim` of each head, the rest passed through; Genie's `rope-dim` is half of it"),
    Row("NoPE layers (`no_rope_layers`)", _has("no_rope_layers"),
        "q/k not rotated in those layers; Genie's cos/sin inputs unchanged (exact)"),
    Row("sliding window ≥ context", _has("sliding_window"), "exact: the window covers the whole context"),
    Row("sliding window < context", lambda r: "refused" if r.sliding_window else "—",
        "Genie builds a fully causal mask"),
    Row("tied / untied embeddings", YES, "`tie_word_embeddings`"),
    Row("embedding/attention/residual multipliers, `logits_scaling`", lambda r: "yes (always)" if r.multipliers
        else "—", "folded exactly into the weights: table, q, o/down, final norm"),
    Row("soft-capping, LayerNorm, parallel residual", REFUSED, "other architectures' options"),
    Row("pre-quantized weights", REFUSED, "`quantization_config`: give the float release"),
)


def support_table(families: list[FamilyRecipe] | None = None) -> str:
    """Family × option as a Markdown table, rendered from the recipes and the audit's declarations."""
    if families is None:
        families = recipes()
    head = "| option | " + " | ".join(r.display for r in families) + " | how |"
    sep = "|---" * (len(families) + 2) + "|"
    body = [f"| {row.option} | " + " | ".join(row.cell(r) for r in families) + f" | {row.how} |" for row in ROWS]
    notes = [f"Refused at intake: **{r.display}** ({', '.join(r.model_types)}): {r.refused}."
             for r in recipes(refused=True)]
    return "\n".join([head, sep, *body, *([""] if notes else []), *notes])
