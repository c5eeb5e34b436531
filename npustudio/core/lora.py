"""LoRA adapters (PEFT's `adapter_config.json` + `adapter_model.safetensors`) merged into a base model's float
weights before adaptation: the graphs, the quantization and the bundle are then the fine-tuned model's.

Read without pickle (safetensors only) and checked before any weight of the base is touched: what PEFT would
compute differently from a plain merge (DoRA, replaced modules, embedding adapters, fan-in-fan-out layers) is
refused, never approximated. The merge is PEFT's own arithmetic, W += weight * scaling * (B @ A), in float32.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .errors import UserError
from .fsutil import sha256_file
from .stage_options import LoraAdapter

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PICKLED = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
# `base_model.model.<module>.lora_A.weight` (PEFT strips the adapter's own name when it saves; some tools keep it)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_UNSUPPORTED = {"use_dora": "DoRA (weight-decomposed) adapters", "fan_in_fan_out": "fan-in-fan-out (Conv1D) layers"}


@dataclass
class Adapter:
    """One adapter as read: its settings and, per base module, the pair (A, B) and the scale PEFT applies."""

    folder: Path
    base: str | None  # the base model it was trained on, as its config names it
    rank: int
    alpha: float
    modules: dict[str, tuple[Any, Any, float]]  # module name -> (A [r, in], B [out, r], scaling), float32
    bytes: int

    @property
    def name(self) -> str:
        return self.folder.name


def parse(arg: str) -> LoraAdapter:
    """`DIR` or `DIR=WEIGHT` (the CLI's `--lora`): the weight multiplies the adapter's update (1 by default)."""
    path, _, tail = arg.rpartition("=")
    if path and tail:
        try:
            return LoraAdapter(path=path, weight=float(tail))
        except ValueError:
            pass
    return LoraAdapter(path=arg)


def label(a: LoraAdapter) -> str:
    """An adapter as the views name it: its folder, and its weight when not 1."""
    return Path(a.path).name + (f" ×{a.weight:g}" if a.weight != 1 else "")


def resolved(adapters: tuple[LoraAdapter, ...], base_names: list[str], base_bytes: float | None = None
             ) -> tuple[LoraAdapter, ...]:
    """Each adapter by its absolute folder and the hash of its two files (a changed adapter makes the stages stale),
    read and checked up front (`read`; the base it names against `base_names`)."""
    out = []
    for a in adapters:
        folder = Path(a.path).expanduser().resolve()
        _same_base(read(folder, base_bytes), base_names)
        digest = sha256_file(folder / CONFIG)[:16] + sha256_file(folder / WEIGHTS)[:16]
        out.append(a.model_copy(update={"path": str(folder), "sha256": digest}))
    return tuple(out)


def read(folder: Path, base_bytes: float | None = None) -> Adapter:
    """The adapter in `folder`, refused with what is wrong when it cannot be merged exactly. `base_bytes`: the base
    model's weights in bytes; an adapter larger than them is no low-rank adapter (or not this model's)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"The LoRA adapter {folder} is not a folder.",
                        f"Give --lora the folder PEFT saved the adapter in (with {CONFIG} and {WEIGHTS}).")
    if not (folder / WEIGHTS).is_file():
        pickled = next((p for p in PICKLED if (folder / p).is_file()), None)
        if pickled:
            raise UserError(f"The LoRA adapter {folder} holds its weights as {pickled}, a pickle: loading it could run "
                            "any code, so NPU Studio never does.",
                            "Save the adapter again with PEFT's `save_pretrained(..., safe_serialization=True)` "
                            f"(it writes {WEIGHTS}).")
        raise UserError(f"The LoRA adapter folder {folder} has no {WEIGHTS}.",
                        "Give the folder PEFT's save_pretrained wrote.")
    if not (folder / CONFIG).is_file():
        raise UserError(f"The LoRA adapter folder {folder} has no {CONFIG}.", "Give the folder PEFT's save_pretrained "
                        "wrote: its config says the rank and scale the weights are applied with.")
    size = (folder / WEIGHTS).stat().st_size
    if base_bytes is not None and size > base_bytes:
        raise UserError(f"The LoRA adapter {folder.name} is {size / 2**20:,.0f} MiB, more than the whole base model "
                        f"({base_bytes / 2**20:,.0f} MiB): it is no low-rank update of this model.",
                        "Check that the adapter was trained for this model.")
    cfg = _config(folder)
    rank, alpha = cfg["r"], float(cfg.get("lora_alpha", cfg["r"]))
    return Adapter(folder=folder, base=cfg.get("base_model_name_or_path"), rank=rank, alpha=alpha,
                   modules=_pairs(folder, cfg), bytes=size)


def _config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{folder / CONFIG} cannot be read as JSON ({e}).", "Save the adapter again with PEFT.") from e
    if not isinstance(cfg, dict):
        raise UserError(f"{folder / CONFIG} is not an adapter config (no JSON object).", "Save the adapter again "
                        "with PEFT.")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise UserError(f"{folder.name} is a {kind or 'untyped'} adapter; NPU Studio merges LoRA adapters only.",
                        "Give a LoRA adapter (peft_type LORA).")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise UserError(f"{folder.name} uses {what}: its update is not a plain low-rank sum, and merging it as one "
                            "would change the model.", "Give a plain LoRA adapter.")
    if cfg.get("modules_to_save"):
        raise UserError(f"{folder.name} replaces whole modules ({', '.join(cfg['modules_to_save'])}) beside its "
                        "low-rank updates; NPU Studio merges low-rank updates only.",
                        "Train the adapter without modules_to_save.")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise UserError(f"{folder.name} has rank {r!r}: a LoRA rank is a whole number of 1 or more.",
                        "Save the adapter again with PEFT.")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise UserError(f"{folder.name} has lora_alpha {alpha!r}: it must be a number.", "Save the adapter again.")
    return cfg


def _scaling(cfg: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scale for one module: alpha / r (alpha / sqrt(r) with rsLoRA), the per-module patterns applied."""
    alpha = float(cfg.get("lora_alpha", cfg["r"]))
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            alpha = float(value)
    return alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _pairs(folder: Path, cfg: dict[str, Any]) -> dict[str, tuple[Any, Any, float]]:
    import torch
    from safetensors import SafetensorError, safe_open

    found: dict[str, dict[str, Any]] = {}
    try:
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            for key in f.keys():  # safe_open has no __iter__
                m = _KEY.match(key)
                if m is None:
                    what = ("an embedding adapter" if "lora_embedding" in key else "a tensor that is no low-rank pair")
                    raise UserError(f"{folder.name} holds {key}, {what}; NPU Studio merges the low-rank updates of "
                                    "linear layers only.", "Train the adapter on linear layers only (target_modules).")
                t = f.get_tensor(key).to(torch.float32)
                if not torch.isfinite(t).all():
                    raise UserError(f"{folder.name}'s tensor {key} holds NaN or infinite values: merged, it would "
                                    "break every answer.", "Train or save the adapter again.")
                found.setdefault(m["module"], {})[m["ab"]] = t
    except SafetensorError as e:
        raise UserError(f"{folder / WEIGHTS} is not a readable safetensors file ({e}).",
                        "Save the adapter again with PEFT.") from e
    if not found:
        raise UserError(f"{folder.name} holds no LoRA weights.", "Save the adapter again with PEFT.")
    pairs = {}
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise UserError(f"{folder.name} has lora_{''.join(ab)} for {module} but not its pair.",
                            "Save the adapter again with PEFT.")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise UserError(f"{folder.name}'s update of {module} has shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                            "which are no low-rank pair.", "Save the adapter again with PEFT.")
        pairs[module] = (a, b, _scaling(cfg, module, a.shape[0]))
    return pairs


def names_match(adapter_base: str | None, base_names: list[str]) -> bool:
    """Whether the base an adapter names is this model: the last part of its name against the model's names (a
    hub id, a folder, a GGUF file); an adapter that names no base is taken as it is."""
    if not adapter_base:
        return True

    def norm(s: str) -> str:
        return re.sub(r"[^a-z0-9]", "", Path(s.rstrip("/")).name.lower().removesuffix(".gguf"))

    want = norm(adapter_base)
    return any(norm(n) == want or (want and want in norm(n)) for n in base_names if n)


def _same_base(ad: Adapter, base_names: list[str]) -> None:
    if not names_match(ad.base, base_names):
        raise UserError(f"The LoRA adapter {ad.name} was trained on {ad.base}; this model is {base_names[0]}.",
                        "Use the adapter with the model it was trained on. If it is this model under another name, "
                        "set base_model_name_or_path in its adapter_config.json.")


def merge(model: Any, adapters: tuple[LoraAdapter, ...], base_names: list[str]) -> list[dict[str, Any]]:
    """Merge each adapter into `model`'s weights (a transformers *ForCausalLM), in float32 and stored back in the
    weight's dtype; refused, before any weight changes, when an adapter is for another base or targets a module the
    model lacks or shapes it differently. Returns what was merged (for the stage's record)."""
    import torch

    params = dict(model.named_parameters())
    read_ = [(a, read(Path(a.path))) for a in adapters]
    check(model, [ad for _a, ad in read_], base_names)
    merged = []
    with torch.no_grad():
        for a, ad in read_:
            for module, (lo_a, lo_b, scale) in ad.modules.items():
                w = params[f"{module}.weight"]
                w.copy_((w.to(torch.float32) + (a.weight * scale) * (lo_b @ lo_a)).to(w.dtype))
            merged.append({"adapter": ad.name, "weight": a.weight, "rank": ad.rank, "alpha": ad.alpha,
                           "modules": len(ad.modules), "bytes": ad.bytes})
    return merged


@dataclass
class Switchable:
    """An adapter kept apart from the model (a graph input Genie fills): its name in the bundle, as read, and the
    weight its update is applied with."""

    name: str
    adapter: Adapter
    weight: float


NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def switchable(model: Any, adapters: tuple[LoraAdapter, ...], base_names: list[str]) -> list[Switchable]:
    """The adapters to keep switchable, read and checked against `model` (as `merge` checks them)."""
    out = [Switchable(n, read(Path(a.path)), a.weight) for n, a in zip(switch_names(adapters), adapters, strict=True)]
    check(model, [s.adapter for s in out], base_names)
    return out


def switch_names(adapters: tuple[LoraAdapter, ...]) -> list[str]:
    """Each switchable adapter's name: its folder's, which must be a name a phone's path and Genie's config take,
    and unique (refused up front, naming the clash)."""
    names = [Path(a.path).name for a in adapters]
    for n in names:
        if not NAME.match(n) or names.count(n) > 1:
            why = "names two of them" if names.count(n) > 1 else "is not a plain name"
            raise UserError(f"A switchable adapter is named by its folder, and {n!r} {why}: the bundle keeps each "
                            "adapter in a folder of that name and the chat picks it by it.",
                            "Put each adapter in a folder of its own with a plain name (letters, digits, . _ -).")
    return names


@contextmanager
def applied(model: Any, adapter: Adapter, weight: float = 1.0) -> Iterator[None]:
    """`model` computing as PEFT's unmerged model does with `adapter` (each module's output plus weight * scale *
    B(A x)), by forward hooks: no weight changes, so a 16-bit model is its own base again after the block."""
    modules = dict(model.named_modules())
    handles = []
    for name, (a, b, scale) in adapter.modules.items():
        def hook(_m: Any, args: tuple[Any, ...], out: Any, a: Any = a, b: Any = b, s: float = scale * weight) -> Any:
            x = args[0]
            return out + ((x.to(a.dtype) @ a.t().to(x.device)) @ b.t().to(x.device)).to(out.dtype) * s
        handles.append(modules[name].register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def check(model: Any, adapters: list[Adapter], base_names: list[str]) -> None:
    """Refuse, naming why, an adapter for another base, or one that targets a module `model` (a transformers
    *ForCausalLM) lacks or shapes differently, or its lm_head when the head shares the token embedding."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    for ad in adapters:
        _same_base(ad, base_names)
        for module, (lo_a, lo_b, _s) in ad.modules.items():
            w = params.get(f"{module}.weight")
            if w is None:
                raise UserError(f"The LoRA adapter {ad.name} updates {module}, which this model does not have: it was "
                                "trained for another architecture.", "Use an adapter trained on this model.")
            if tuple(w.shape) != (lo_b.shape[0], lo_a.shape[1]):
                raise UserError(f"The LoRA adapter {ad.name} updates {module} as a {lo_b.shape[0]}x{lo_a.shape[1]} "
                                f"weight; this model's is {w.shape[0]}x{w.shape[1]}: it was trained for another "
                                "model.", "Use an adapter trained on this model.")
            if tied and module.endswith("lm_head"):
                raise UserError(f"The LoRA adapter {ad.name} updates lm_head, which this model shares with its token "
                                "embedding: merged, it would change the embedding too.",
                                "Train the adapter without lm_head in target_modules.")


def refuse_switching(name: str, bundle: Path) -> NoReturn:
    """A run asked for adapter `name` of a bundle that carries none switchable: its adapters, if any, were merged."""
    raise UserError(f"The bundle {bundle} has no switchable LoRA adapter {name!r}: it answers as its model, with any "
                    "adapters it was built with merged in, so there is nothing to switch at run time.",
                    "Build the bundle with the adapters kept switchable: npustudio run --model MODEL --lora "
                    "ADAPTER_DIR [--lora ADAPTER_DIR ...] --lora-switchable --project PROJECT; then chat with --bundle "
                    "PROJECT/stages/bundle --lora NAME (NAME: the adapter's folder name).")
