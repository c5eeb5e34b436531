"""How much each quantized weight lost: the SQNR in dB of the quantized tensor against the float one.

The float weights are the adapted model's (`stages/adapt/decoder.safetensors` of the project the `.encodings` file
belongs to: the exported graphs hold the weights already on their grid); the grid is the tensor's encoding as the
file states it (AIMET 1.0.0: q = clamp(round(x/scale) - offset, 0, 2^bw - 1), x' = (q + offset)·scale, per tensor,
per output channel or per block of input channels). Activations have no stored float values to compare with, so
their rows carry no figure. Each weight is read a slab of rows at a time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import layout
from ..errors import UserError

if TYPE_CHECKING:
    from .encodings import TensorRow

_ROWS = 4096  # rows of a weight quantized at once


def weights(enc_file: Path, rows: list[TensorRow]) -> dict[str, float]:
    """SQNR (dB) per weight row of `rows` whose float values the adapted model holds (inf: no error at all)."""
    from safetensors import safe_open


    quant_dir = Path(enc_file).resolve().parent
    floats = quant_dir.parent / "adapt" / layout.DECODER_WEIGHTS  # the project's adapt stage
    if not floats.is_file():
        raise UserError(f"SQNR needs the float weights: {Path(enc_file).name} is not in a project's quantize stage "
                        f"(no {floats}).", "Point at an .encodings file under <project>/stages/quantize.")
    result = quant_dir / layout.QUANTIZE_RESULT
    if result.is_file() and json.loads(result.read_text()).get("rotated"):
        raise UserError("These weights were rotated before quantizing: the adapted float weights are not what was "
                        "quantized, so an SQNR against them would mislead.", "Read the table without --sqnr.")
    out: dict[str, float] = {}
    with safe_open(str(floats), framework="np") as f:
        names = set(f.keys())
        for r in rows:
            name = r.name if r.name in names else "embed.weight" if r.name == "lm_head.weight" else None
            if r.kind != "param" or name not in names or any("scale" in x or "bitwidth" in x for x in r.flags):
                continue
            db = _sqnr(f.get_slice(name), r)
            if db is not None:
                out[r.name] = db
    return out


def _sqnr(x: Any, r: TensorRow) -> float | None:
    """`x`: a safetensors slice (shape and row slabs)."""
    shape = tuple(x.get_shape())
    n_rows = shape[0] if len(shape) > 1 else 1
    width = math.prod(shape) // n_rows
    scales = np.asarray(r.scales, dtype=np.float64)
    offsets = np.asarray(r.offsets or [r.offset], dtype=np.float64)
    if r.granularity == "tensor":
        scales, offsets = scales[:1].reshape(1, 1), offsets[:1].reshape(1, 1)
    elif r.granularity == "channel" and len(scales) == n_rows:
        scales = scales.reshape(-1, 1)
        offsets = offsets.reshape(-1, 1) if len(offsets) == n_rows else offsets[:1].reshape(1, 1)
    elif r.granularity == "block" and len(scales) % n_rows == 0 and width % (len(scales) // n_rows) == 0:
        blocks = len(scales) // n_rows
        scales = np.repeat(scales.reshape(n_rows, blocks), width // blocks, axis=1)
        offsets = offsets[:1].reshape(1, 1)
    else:
        return None  # an encoding whose shape does not match the tensor: nothing sound to say
    top = 2.0**r.bitwidth - 1
    signal = noise = 0.0
    for a in range(0, n_rows, _ROWS):
        w = np.asarray(x[a:min(a + _ROWS, n_rows)] if len(shape) > 1 else x[:], dtype=np.float64).reshape(-1, width)
        s = scales[a:a + _ROWS] if scales.shape[0] > 1 else scales
        o = offsets[a:a + _ROWS] if offsets.shape[0] > 1 else offsets
        q = np.clip(np.round(w / s) - o, 0, top)
        signal += float(np.sum(w * w))
        noise += float(np.sum((w - (q + o) * s) ** 2))
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else None
