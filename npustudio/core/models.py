"""Model intake: what a model is (its architecture card, audited against what its family implements) and loading
it. Where it comes from is core/model_source.py, the checks before transformers reads it core/model_checks.py,
whether it fits a phone core/model_fit.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config_audit import audit as audit_options
from .errors import UserError
from .families import recipe_for
from .fsutil import sha256_file
from .model_checks import check_chat_template, check_config_files, check_sizes
from .model_source import (
    ModelSource,
)
from .shape import DecoderShape


# ---------------------------------------------------------------- architecture card
class ArchCard(DecoderShape):
    """A model's architecture as its config states it, audited (core/config_audit.py) before any weight loads."""

    architecture: str
    source: str
    params: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    sliding_window: int | None = None
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    stored_bits: int = 32  # bits per float weight as the checkpoint holds them (16: bf16/fp16, kept so by adapt)


def _rope(config: Any) -> tuple[float, dict[str, Any] | None]:
    rp = dict(getattr(config, "rope_parameters", None) or {})
    theta = rp.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not rp:
        rp = dict(legacy)
    scaling = rp if rp and rp.get("rope_type", rp.get("type", "default")) != "default" else None
    return float(theta), scaling


def param_count(c: Any) -> int:
    """Parameters from the config alone (no weights loaded)."""
    hd = head_dim_of(c)
    d, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    h, kv = c.num_attention_heads, c.num_key_value_heads
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d
    if getattr(c, "attention_bias", False) or c.model_type == "qwen2":
        attn += h * hd + 2 * kv * hd
    if c.model_type == "qwen3":
        attn += 2 * hd
    layer = attn + 3 * d * i + 2 * d
    emb = v * d
    return emb + c.num_hidden_layers * layer + d + (0 if c.tie_word_embeddings else emb)


def head_dim_of(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _ids(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(t) for t in (x if isinstance(x, list | tuple) else [x])]


def architecture_of(config: Any) -> str:
    """The model class name; GGUF configs carry none, so take transformers' causal-LM class for the type."""
    named = getattr(config, "architectures", None)
    arch = named[0] if isinstance(named, list) and named and isinstance(named[0], str) else ""
    if not arch:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, f"{config.model_type}ForCausalLM")
    return arch


def make_card(config: Any, tokenizer: Any, source: ModelSource) -> ArchCard:
    arch = architecture_of(config)
    recipe = recipe_for(config.model_type, arch)
    theta, _ = _rope(config)
    options = audit_options(config, recipe)
    eos = _ids(config.eos_token_id)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in eos:
        eos.append(int(tok_eos))
    bos = config.bos_token_id if config.bos_token_id is not None else getattr(tokenizer, "bos_token_id", None)
    for t in eos + ([] if bos is None else [bos]):
        if not 0 <= int(t) < config.vocab_size:
            raise UserError(f"The tokenizer's {'eos' if t in eos else 'bos'} token id {t} is outside the model's "
                            f"vocabulary of {config.vocab_size}.", "Use the tokenizer that comes with the model.")
    return ArchCard(
        family=recipe.display, model_type=config.model_type,
        architecture=arch, source=source.label,
        layers=config.num_hidden_layers, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=head_dim_of(config), hidden=config.hidden_size, intermediate=config.intermediate_size,
        vocab=config.vocab_size, params=param_count(config), rope_theta=theta, rope_scaling=options.rope_scaling,
        tied_embeddings=bool(config.tie_word_embeddings),
        max_position=int(getattr(config, "max_position_embeddings", 0) or 0),
        rms_norm_eps=float(config.rms_norm_eps),
        qkv_bias=options.qkv_bias, qk_norm=options.qk_norm, o_bias=options.o_bias, mlp_bias=options.mlp_bias,
        activation=options.activation, sliding_window=options.sliding_window, rotary_dim=options.rotary_dim,
        attention_multiplier=options.attention_multiplier, embedding_multiplier=options.embedding_multiplier,
        residual_multiplier=options.residual_multiplier, logits_scaling=options.logits_scaling,
        nope_layers=options.nope_layers, qk_norm_full=options.qk_norm_full, post_norms=options.post_norms,
        bos_id=None if bos is None else int(bos), eos_ids=eos,
        chat_template=getattr(tokenizer, "chat_template", None), stored_bits=stored_bits(config, source),
    )


def stored_bits(config: Any, source: ModelSource) -> int:
    """16 when the checkpoint's weights are all bf16 or all fp16 (`stored_dtype`), else 32."""
    return 32 if stored_dtype(config, source) == "float32" else 16


def stored_dtype(config: Any, source: ModelSource) -> str:
    """The dtype that holds every weight of the checkpoint exactly: the one its safetensors share, float32 when they
    mix (norms kept in float32 beside bf16 weights) or for a GGUF file (dequantized to float32 as it loads). Read
    from the files' headers, not the config: a config naming bfloat16 over float32 tensors made transformers'
    `dtype="auto"` round them. A folder without weights (`npustudio info` on a config) goes by its config."""
    if source.gguf_file or source.path is None:
        return "float32"
    kinds = _safetensors_float_dtypes(Path(source.path))
    if not kinds:
        kinds = {str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).removeprefix("torch.")}
    names = {_SAFETENSORS_DTYPES.get(k, k) for k in kinds}
    return names.pop() if len(names) == 1 and names <= {"bfloat16", "float16"} else "float32"


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def _safetensors_float_dtypes(folder: Path) -> set[str]:
    """The float dtypes of the tensors in the folder's safetensors files, from their headers alone."""
    out: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 0 < n < 100_000_000 else {}
        except (OSError, ValueError):
            continue
        out |= {str(meta.get("dtype")) for name, meta in header.items()
                if name != "__metadata__" and isinstance(meta, dict) and str(meta.get("dtype")).startswith(("F", "BF"))}
    return out


def _gguf_error(path: Path, e: Exception) -> UserError:
    root: BaseException = e
    while root.__cause__ is not None or root.__context__ is not None:  # the innermost error says what failed
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    if isinstance(e, ImportError) or isinstance(root, ImportError):  # not the file: this installation
        cause = f"; caused by {root.__class__.__name__}: {str(root)[:200]}" if root is not e else ""
        return UserError(f"Reading {path.name} needs a part of this installation that cannot be imported "
                         f"({e.__class__.__name__}: {str(e).splitlines()[0][:160]}{cause}).",
                         "Reinstall NPU Studio (bash packaging/bootstrap.sh). In a packaged build this is a "
                         "packaging fault: rebuild it, or report it with the output of `--debug`.")
    return UserError(f"{path} is not a readable GGUF file ({e.__class__.__name__}: {str(e)[:120]}).",
                     "The file is damaged or incomplete: download it again.")


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF signature).",
                        "Pass a .gguf model file, or download it again if it is damaged.")
    try:  # transformers' own header reader: the tensor table without the vocabulary (10 ms, not gguf's 2 s)
        from transformers.integrations.gguf.reader import GgufHeader

        h = GgufHeader.from_file(str(path))
        end = h.data_start + max((t.offset + t.nbytes for t in h.tensors), default=0)
    except Exception as e:
        raise _gguf_error(path, e) from e
    if end > path.stat().st_size:
        raise UserError(f"{path} is truncated: its tensors end at byte {end:,} but the file has "
                        f"{path.stat().st_size:,} bytes.", "The download was cut short: download it again.")


_gguf_metadata: dict[tuple[str, int, int], Any] = {}


def _read_gguf_metadata_once() -> None:
    """transformers parses a GGUF's metadata, its whole vocabulary in Python (2.2 s for the default model's 49k
    tokens), for the config, again for the tokenizer and again inside each model load: here once per file and
    process (the model stage and adapt share it), every caller getting its own copy of the same result."""
    import copy

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    real = gguf_utils.load_gguf_checkpoint
    if getattr(real, "read_once", False):
        return

    def once(path: str, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
        if return_tensors or args or kwargs:
            return real(path, return_tensors, *args, **kwargs)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if key not in _gguf_metadata:
            _gguf_metadata.clear()  # one file's at a time: a 128k vocabulary is tens of MB of strings
            _gguf_metadata[key] = real(path, False)
        return copy.deepcopy(_gguf_metadata[key])

    once.read_once = True  # type: ignore[attr-defined]
    setattr(gguf_utils, "load_gguf_checkpoint", once)  # noqa: B010  (a module attribute its callers import late)


@contextlib.contextmanager
def _one_tensor_name_map() -> Iterator[None]:
    """gguf's GGUF-to-HF tensor name table built once for a model load, not once per module: transformers maps
    the names of every submodule of the model in turn, each time building the whole table for all layers anew
    (4.5 s of the default model's 9-s load). The table is only read (`get_name`)."""
    import gguf

    real = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(real)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = real


def refusable(e: BaseException) -> bool:
    """Whether reading a file failed on its content: any Exception, or a Rust library's panic (tokenizers on a
    damaged tokenizer.json: "range end index 16 out of range"), which pyo3 raises as a BaseException; never Ctrl-C
    or an exit."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def load_config_and_tokenizer(source: ModelSource) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    assert source.path is not None, "download() the hub source first"
    if source.gguf_file:
        gpath = Path(source.path) / source.gguf_file
        _check_gguf(gpath)
        _read_gguf_metadata_once()
        try:
            config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False)
        except ValueError as e:
            if "not supported" in str(e).lower() or "architecture" in str(e).lower():
                raise UserError(f"The GGUF file {gpath.name} holds an architecture NPU Studio cannot read: {e}",
                                "Use a Llama- or Qwen-family model.") from e
            raise _gguf_error(gpath, e) from e
        except Exception as e:
            raise _gguf_error(gpath, e) from e
        recipe_for(config.model_type, architecture_of(config))
        check_sizes(config, gpath.name)
        try:
            tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False)
        except BaseException as e:  # no tokenizer in the file, or one transformers cannot build
            if not refusable(e):
                raise
            raise UserError(f"The GGUF file {gpath.name} holds no tokenizer transformers can use "
                            f"({e.__class__.__name__}: {' '.join(str(e).split())[:200]}).",
                            "Use a GGUF converted with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it), "
                            "or the model's Hugging Face folder.") from e
        check_chat_template(tok, gpath.name)
        return config, tok
    check_config_files(Path(source.path))
    try:
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise UserError(f"The config.json in {source.path} names a model type transformers does not know: {e}",
                        "Use a Llama- or Qwen-family model, or update transformers.") from e
    except Exception as e:  # the JSON is valid (checked above): transformers refuses its values
        raise UserError(f"The config.json in {source.path} cannot be used by transformers: {e.__class__.__name__}: "
                        f"{' '.join(str(e).split())[:200]}",
                        "Download config.json again from the model's repository.") from e
    recipe_for(config.model_type, architecture_of(config))
    check_sizes(config, "config.json")
    try:
        tok = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False)
    except BaseException as e:
        if not refusable(e):
            raise
        raise UserError(f"The tokenizer in {source.path} cannot be loaded ({e.__class__.__name__}: {e}).",
                        "Copy tokenizer.json (and tokenizer_config.json) from the model's repository.") from e
    check_chat_template(tok, source.path)
    return config, tok


def read_card(source: ModelSource) -> ArchCard:
    config, tok = load_config_and_tokenizer(source)
    return make_card(config, tok, source)


@dataclass
class LoadedModel:
    source: ModelSource
    model: Any  # a transformers *ForCausalLM in eval mode, fp32
    tokenizer: Any
    card: ArchCard


def load(source: ModelSource, dtype: Any = None, keep_16bit: bool = False) -> LoadedModel:
    """Load weights (fp32 by default; with `keep_16bit`, a bf16 or fp16 checkpoint's in its own dtype, for a caller
    that computes through `graph.half_weights`). GGUF weights are dequantized by transformers' GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes through the State
    config, tok = load_config_and_tokenizer(source)
    card = make_card(config, tok, source)
    dtype = dtype or torch.float32
    if source.path is None:
        raise ValueError("load() takes a resolved source (a local folder or file)")
    if source.gguf_file:
        try:
            with _one_tensor_name_map():
                model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=dtype,
                                                             trust_remote_code=False)
        except Exception as e:  # the file itself passed _check_gguf: this is the loader or the environment
            raise UserError(f"Loading the weights of {source.gguf_file} failed ({e.__class__.__name__}: "
                            f"{str(e)[:200]}).", "Repair NPU Studio's environment with "
                            "`bash packaging/bootstrap.sh`; if it persists, download the file again.") from e
    else:
        try:
            # in the stored dtype first, widened after: loading a bf16 checkpoint as fp32 directly held the
            # mapped bf16 file and the whole fp32 copy at once (1B model: peak 7.8 GB instead of 6.4 GB)
            stored = getattr(torch, stored_dtype(config, source))
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=stored, use_safetensors=True,
                                                         trust_remote_code=False)
            if not (keep_16bit and model.dtype in (torch.bfloat16, torch.float16)):
                model = model.to(dtype)
        except Exception as e:
            raise UserError(f"The weights in {source.path} cannot be loaded ({e.__class__.__name__}: "
                            f"{str(e)[:200]}).", "Download the model again; the safetensors may be damaged.") from e
    model.eval()
    return LoadedModel(source=source, model=model, tokenizer=tok, card=card)


def fingerprint(source: ModelSource) -> dict[str, Any]:
    """What identifies the model's content, for the project manifest (changes => stages rerun)."""
    return {"kind": source.kind, "spec": source.spec, "files": {f.name: sha256_file(f) for f in files(source)}}


def files(source: ModelSource) -> list[Path]:
    """The files that make the model (config, tokenizer, weights; or the GGUF): what is hashed, what a cluster
    worker is sent."""
    assert source.path is not None
    d = Path(source.path)
    return [d / source.gguf_file] if source.gguf_file else sorted(
        f for f in d.iterdir() if f.is_file() and (f.suffix in (".json", ".safetensors", ".model", ".jinja")))
