"""Save and load the adapted decoder: safetensors weights + a JSON spec, readable without transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..fsutil import atomic_write_json
from .decoder import DecoderSpec, StaticDecoder

WEIGHTS = "decoder.safetensors"
SPEC = "decoder.json"
INV_FREQ = "rope.inv_freq"


def save(model: StaticDecoder, inv_freq: torch.Tensor, folder: Path) -> list[Path]:
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.spec.tied_embeddings:
        sd.pop("lm_head.weight")  # same storage as embed.weight: stored once
    sd[INV_FREQ] = inv_freq.float().contiguous()
    save_file(sd, str(folder / WEIGHTS))
    atomic_write_json(folder / SPEC, model.spec.model_dump())
    return [folder / WEIGHTS, folder / SPEC]


def load(folder: Path) -> tuple[StaticDecoder, torch.Tensor]:
    folder = Path(folder)
    if not (folder / WEIGHTS).is_file() or not (folder / SPEC).is_file():
        raise UserError(f"{folder} holds no adapted model ({WEIGHTS}, {SPEC}).", "Run the adapt stage first.")
    spec = DecoderSpec.model_validate(json.loads((folder / SPEC).read_text()))
    # The file's tensors become the parameters (assign=True on a meta-device model): no second copy, and
    # the weights stay a private copy-on-write mapping of the file until a stage changes them (halves the
    # stage's memory at load; the adapt stage's file is never written).
    sd = load_file(str(folder / WEIGHTS))
    inv_freq = sd.pop(INV_FREQ)
    with torch.device("meta"):
        model = StaticDecoder(spec)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    allowed = {"lm_head.weight"} if spec.tied_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise UserError(f"The adapted weights in {folder} do not match their spec "
                        f"(missing {sorted(set(missing) - allowed)[:3]}, unexpected {unexpected[:3]}).",
                        "Rerun the adapt stage.")
    if spec.tied_embeddings:
        model.tie()
    return model.eval(), inv_freq


def load_spec(folder: Path) -> tuple[DecoderSpec, torch.Tensor]:
    """The spec and RoPE frequencies only (what a host runner needs), without reading the weights."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / WEIGHTS).is_file() or not (folder / SPEC).is_file():
        raise UserError(f"{folder} holds no adapted model ({WEIGHTS}, {SPEC}).", "Run the adapt stage first.")
    spec = DecoderSpec.model_validate(json.loads((folder / SPEC).read_text()))
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        inv_freq = f.get_tensor(INV_FREQ)
    return spec, inv_freq
