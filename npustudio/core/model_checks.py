"""A checkpoint's configs and tokenizer checked before transformers reads them: JSON objects that name no code of
their own (`auto_map` refused: transformers is always called with trust_remote_code=False), sizes a decoder can
have, finite numbers, a chat template that renders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeGuard

from .errors import UserError
from .fsutil import read_json


def json_text(v: Any) -> str:
    """A config value as its file shows it, cut short."""

    text = json.dumps(v, allow_nan=True)
    return text if len(text) <= 60 else text[:57] + "..."


def check_config_files(folder: Path) -> None:
    """Before transformers reads the folder: its configs are JSON objects that do not name the model's own
    code (`auto_map`, which transformers would offer to run)."""
    fix = "Download config.json (and tokenizer_config.json) again from the model's repository."
    for name in ("config.json", "tokenizer_config.json"):
        f = folder / name
        if name != "config.json" and not f.exists():
            continue
        data = read_json(f, f"model {name}", fix)
        if not isinstance(data, dict):
            raise UserError(f"{f} holds a JSON {type(data).__name__}, not a model configuration.", fix)
        if name == "config.json":
            check_numbers(data, f"{f}", present_only=True)  # before transformers divides by them
            for key in ("architectures", "model_type"):  # the names NPU Studio picks the family by
                v = data.get(key)
                ok = isinstance(v, str) if key == "model_type" else (
                    isinstance(v, list) and all(isinstance(x, str) for x in v))
                if v is not None and not ok:
                    want = "a name" if key == "model_type" else "a list of class names"
                    raise UserError(f"{f}: {key} is {json_text(v)}; it must be {want}.", fix)
        if "auto_map" in data:
            code = data["auto_map"]
            names = ", ".join(map(str, code.values() if isinstance(code, dict) else [code]))[:120]
            raise UserError(f"{f} names the model's own Python code (auto_map: {names}); NPU Studio never runs "
                            "code that comes with a model.",
                            "Use a model whose architecture transformers ships (the Llama, Qwen2 and Qwen3 families), "
                            "without auto_map.")


# What a decoder's config may hold: beyond these no phone (or this machine) could hold the model, and
# non-positive values are damage. Checked before anything is sized from them.
SIZE_LIMITS = {"num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 1 << 20,
               "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 4_000_000,
               "head_dim": 4096, "max_position_embeddings": 1 << 24}
OPTIONAL_SIZES = ("head_dim", "max_position_embeddings")


def check_sizes(config: Any, where: str) -> None:
    """Refuse sizes a model cannot have, naming the field, before a card or a layer is built from them."""
    fix = "The configuration is damaged or not a decoder LLM's: download it again, or fix the named field."
    for field, hi in SIZE_LIMITS.items():
        v = getattr(config, field, None)
        if v is None and field in OPTIONAL_SIZES:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise UserError(f"{where}: {field} is {v!r}; a model needs a whole number from 1 to {hi:,}.", fix)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv}).",
                        fix)
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise UserError(f"{where}: hidden_size ({config.hidden_size}) is not a multiple of num_attention_heads "
                        f"({heads}), and there is no head_dim.", fix)
    check_numbers(config, where)


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_numbers(config: Any, where: str, present_only: bool = False) -> None:
    """Refuse values no model can have, naming the field: `present_only`, the sizes in the raw config.json (before
    transformers fills defaults and divides by them); else a RoPE base, scaling factor or RMSNorm epsilon that is
    not a finite positive number (a NaN base passed intake and made every logit NaN), a bos/eos id outside the
    vocabulary. `config` is a config object or the config.json dict."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    fix = "The configuration is damaged: download it again, or fix the named field."
    if present_only:
        for field, hi in SIZE_LIMITS.items():
            v = get(field)
            # not a number at all: transformers' own type check says so
            if _number(v) and (not math.isfinite(v) or v != int(v) or not 1 <= v <= hi):
                raise UserError(f"{where}: {field} is {v!r}; a model needs a whole number from 1 to {hi:,}.", fix)
        return  # the rest once the family is known: an unsupported architecture is said first
    floats = [("rope_theta", get("rope_theta")), ("rms_norm_eps", get("rms_norm_eps"))]
    for key in ("rope_parameters", "rope_scaling"):
        rp = get(key)
        if isinstance(rp, dict):
            floats += [(f"{key}.{k}", rp.get(k)) for k in ("rope_theta", "factor")]
    for field, v in floats:
        if v is not None and (not _number(v) or not math.isfinite(v) or v <= 0):
            raise UserError(f"{where}: {field} is {v!r}; it must be a finite number above 0.", fix)
    vocab = get("vocab_size")
    vocab = vocab if _number(vocab) and math.isfinite(vocab) else None
    for field in ("bos_token_id", "eos_token_id"):
        v = get(field)
        for t in v if isinstance(v, list | tuple) else [] if v is None else [v]:
            if not _number(t) or not math.isfinite(t) or t != int(t) or t < 0 or (vocab is not None and t >= vocab):
                span = f"from 0 to {int(vocab) - 1} (vocab_size is {vocab})" if vocab is not None else "of 0 or more"
                raise UserError(f"{where}: {field} is {v!r}; a token id is a whole number {span}.", fix)


def check_chat_template(tokenizer: Any, where: str) -> None:
    """A chat template that the jinja sandbox stops (it reaches for Python internals) is refused at intake."""
    if not getattr(tokenizer, "chat_template", None):
        return
    from jinja2.exceptions import SecurityError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                      add_generation_prompt=True)
    except SecurityError as e:
        raise UserError(f"The chat template of {where} tries something a chat template may not do (stopped by "
                        f"the sandbox: {str(e)[:160]}).", "Use the model's original tokenizer_config.json / "
                        "chat_template.jinja, or a model you trust.") from e
    except Exception:  # a template that needs more than one user message is not a security problem
        pass
