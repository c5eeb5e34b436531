"""Save and load the adapted decoder: safetensors weights + a JSON spec, readable without transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import layout
from ..errors import UserError
from ..fsutil import atomic_write_json
from ..shape import DecoderSpec
from . import lora_inputs
from .decoder import StaticDecoder
from .half_weights import widened

INV_FREQ = "rope.inv_freq"


def save(model: StaticDecoder, inv_freq: torch.Tensor, folder: Path) -> list[Path]:
    sd = dict(model.state_dict())
    if model.spec.tied_embeddings:
        sd.pop("lm_head.weight")  # same storage as embed.weight: stored once
    sd[INV_FREQ] = inv_freq.float()
    write_tensors(folder / layout.DECODER_WEIGHTS, sd)
    atomic_write_json(folder / layout.DECODER_SPEC, model.spec.model_dump())
    return [folder / layout.DECODER_WEIGHTS, folder / layout.DECODER_SPEC]


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written one tensor at a time from the tensors' own memory (atomically).

    safetensors' `save_file` first turns every tensor into a bytes object (a second copy of a multi-GB model)
    and refuses tensors that share storage, which the adapted decoder's views of the HF weights do.
    """
    names = {v: k for k, v in _DTYPES.items()}
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for t in tensors.values():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load(folder: Path, widen: bool = True) -> tuple[StaticDecoder, torch.Tensor]:
    """The adapted decoder and its RoPE frequencies; `widen`: 16-bit weights as float32 (else as stored, for a
    caller that computes under `half_weights.computing_in_fp32`)."""
    folder = Path(folder)
    if not (folder / layout.DECODER_WEIGHTS).is_file() or not (folder / layout.DECODER_SPEC).is_file():
        raise UserError(f"{folder} holds no adapted model ({layout.DECODER_WEIGHTS}, {layout.DECODER_SPEC}).",
                        "Run the adapt stage first.")
    spec = DecoderSpec.model_validate(json.loads((folder / layout.DECODER_SPEC).read_text()))
    # The tensors read become the parameters (assign=True on a meta-device model): one copy of the weights
    sd = read_tensors(folder / layout.DECODER_WEIGHTS, widen=widen)
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
    if slots := lora_inputs.saved_slots(folder):  # switchable LoRA adapters: their graph inputs and branches
        lora_inputs.attach(model, slots)
    return model.eval(), inv_freq


def load_spec(folder: Path) -> tuple[DecoderSpec, torch.Tensor]:
    """The spec and RoPE frequencies only (what a host runner needs), without reading the weights."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / layout.DECODER_WEIGHTS).is_file() or not (folder / layout.DECODER_SPEC).is_file():
        raise UserError(f"{folder} holds no adapted model ({layout.DECODER_WEIGHTS}, {layout.DECODER_SPEC}).",
                        "Run the adapt stage first.")
    spec = DecoderSpec.model_validate(json.loads((folder / layout.DECODER_SPEC).read_text()))
    with safe_open(str(folder / layout.DECODER_WEIGHTS), framework="pt") as f:
        inv_freq = f.get_tensor(INV_FREQ)
    return spec, inv_freq


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}


def read_tensors(path: Path, widen: bool = False) -> dict[str, torch.Tensor]:
    """A safetensors file read into one private tensor each, without a memory mapping (`widen`: 16-bit floats as
    float32, each as it is read, so the file's 16-bit copy never exists whole).

    safetensors' own loader maps the file and keeps the mapping alive while any tensor of it lives: after
    the quantize stage has replaced the weights by their quantized copies, the mapped originals (5 GB on a
    1B model) still counted in its memory. Plain reads into empty tensors cost one copy and nothing after.
    """
    bad = UserError(f"{path} is not a complete safetensors file.", "Rerun the adapt stage.")
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise bad
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad from e
        out: dict[str, torch.Tensor] = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            t = torch.empty(meta["shape"], dtype=_DTYPES[meta["dtype"]])
            buf = t.reshape(-1).view(torch.uint8).numpy().data
            if end - start != len(buf) or 8 + n + end > size:
                raise bad
            f.seek(8 + n + start)
            got = 0
            while got < len(buf):  # one read returns at most ~2 GB
                k = f.readinto(buf[got:])
                if not k:
                    raise bad
                got += k
            out[name] = widened(t) if widen else t
    return out
