"""A bundle's metadata.json: what it was built from and for, read back by the runners, the chat and deploy
(without the bundle stage's own imports), and the form it takes on a phone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .. import layout
from ..errors import UserError
from ..fsutil import read_json
from ..results import IOEncoding, validated
from ..shape import DecoderSpec
from ..targets import Soc


class GraphMeta(BaseModel):
    name: str
    ar: int = Field(gt=0)
    cl: int = Field(0, ge=0)


class BundleMeta(BaseModel):
    """A bundle's metadata.json: what it was built from and for, and what a host runner, the chat and deploy
    need. Read through `read_metadata`, checked once: a damaged file is a clear message, never a KeyError deep in
    a runner. Fields a bundle of an earlier version may lack have defaults; unknown ones pass through."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    family: str | None = None
    target: Soc
    context_length: int = Field(gt=0)
    graphs: list[GraphMeta] = Field(min_length=1)
    io_encodings: dict[str, IOEncoding] = Field(default_factory=dict)
    backend: str = "ort-qnn"
    weight_shared: bool = False
    optimize: str = "phone"  # quick: graphs compiled for a check on the simulator, which deploy keeps off phones
    versions: dict[str, Any] = Field(default_factory=dict)
    decoder: DecoderSpec
    rope_inv_freq: list[float] = Field(default_factory=list)
    eos_ids: list[int] = Field(min_length=1)
    bos_id: int | None = None
    question: str = ""
    chat_template: str | None = None
    runtime_files: list[str] = Field(default_factory=list)
    runtime_missing: list[str] = Field(default_factory=list)
    project_compile_dir: str | None = None
    decoding: str = "basic"  # Genie's dialog type: basic (one token per call) or spd (a draft model proposes)
    draft: dict[str, Any] | None = None  # the draft model of an spd bundle (`draft.describe`)
    lora_adapters: list[str] = Field(default_factory=list)  # switchable LoRA adapters, by name (`chat --lora NAME`)
    lora_inputs: dict[str, list[int]] = Field(default_factory=dict)  # their graph inputs' shapes (strength included)


def read_metadata(bundle_dir: Path) -> BundleMeta:
    """A bundle's metadata.json, checked; a UserError saying the folder is not a (whole) bundle otherwise."""
    bundle_dir = Path(bundle_dir)
    fix = "Pass a bundle folder written by `npustudio bundle` (rebuild a damaged one: `npustudio bundle --project " \
          "P --force`)."
    if not bundle_dir.is_dir():
        what = "a file" if bundle_dir.exists() else "missing"
        raise UserError(f"{bundle_dir} is not a bundle folder (it is {what}).", fix)
    if not (bundle_dir / layout.METADATA).exists():
        raise UserError(f"{bundle_dir} is not an NPU Studio bundle: it has no {layout.METADATA}.", fix)
    data = read_json(bundle_dir / layout.METADATA, f"bundle description ({layout.METADATA})", fix)
    if not isinstance(data, dict):
        raise UserError(f"{bundle_dir / layout.METADATA} is damaged: it holds a JSON {type(data).__name__}, not the "
                        "bundle's description.", fix)
    return validated(bundle_dir / layout.METADATA, data, BundleMeta, fix)


HOST_ONLY_FIELDS = frozenset({"project_compile_dir"})  # what only this computer uses: the CPU preview's prepared graphs
FREE_TEXT_FIELDS = ("chat_template", "question")  # the model's and the user's text, kept as it is


def phone_metadata(data: dict[str, Any], keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """metadata.json as it goes to a phone: no path of this computer (the user's name, folder layout). The host-only
    fields are left out (but those in `keep`: the virtual device, which is this computer, answers with the CPU
    preview of the project's graphs), and any other absolute path (a model folder given as `model`, QNN_SDK_ROOT
    among the versions) is cut to its last part, which still names the model or the SDK build."""
    drop = HOST_ONLY_FIELDS - keep

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v if k in keep else clean(v) for k, v in value.items() if k not in drop}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, str) and _host_path(value):
            return re.split(r"[\\/]", value.rstrip("\\/"))[-1] or "(a folder of the computer)"
        return value

    return {k: v if k in FREE_TEXT_FIELDS or k in keep else clean(v) for k, v in data.items() if k not in drop}


def _host_path(text: str) -> bool:
    """An absolute path of this computer (POSIX, ~, or Windows), not free text."""
    return "\n" not in text and bool(re.match(r"^(/[^/]|~[/\\]|[A-Za-z]:[\\/]|\\\\)", text))
