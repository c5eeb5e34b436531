"""An onnxruntime session over a Genie-ready graph, callable by the host KV-cache runner.

The graph's I/O is quantized (uint8/uint16); the runner speaks float. Feeds are quantized and outputs
dequantized with the graph's own I/O encodings, exactly as Genie does on the phone, so the same loop
drives the compiled context on the HTP simulator and the prepared graph on the CPU (fast preview).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import layout
from ..errors import UserError
from ..results import IOEncoding
from . import embedding_lut

# Genie rounds its RoPE tables down into their encoding (measured: floor(x/scale) + zero point matches its
# tables to the bit), everything else it hands over as the graph made it
FLOORED = ("position_ids_cos", "position_ids_sin")


def quantize(x: np.ndarray, enc: IOEncoding, floor: bool = False) -> np.ndarray:
    if enc.dtype not in ("uint8", "uint16"):
        return x.astype(enc.dtype)
    hi = 255 if enc.dtype == "uint8" else 65535
    q = (np.floor if floor else np.rint)(x.astype(np.float64) / enc.scale) + enc.zero_point
    return np.clip(q, 0, hi).astype(enc.dtype)


def dequantize(q: np.ndarray, enc: IOEncoding) -> np.ndarray:
    if enc.dtype not in ("uint8", "uint16"):
        return q.astype(np.float32)
    return ((q.astype(np.float32) - enc.zero_point) * enc.scale).astype(np.float32)


class OrtGraph:
    """`GraphFn` over a session whose I/O follows `io` (name -> encoding). A graph that starts from
    `inputs_embeds` is fed the `lut`'s rows of the token ids, as Genie feeds it (`embedding_lut`)."""

    def __init__(self, session: Any, io: dict[str, IOEncoding], lut: Path | None = None) -> None:
        self.session, self.io = session, io
        self.outputs = [o.name for o in session.get_outputs()]
        names = [i.name for i in session.get_inputs()]
        self.lut: np.ndarray | None = None
        if embedding_lut.INPUT in names:
            shape = next(i.shape for i in session.get_inputs() if i.name == embedding_lut.INPUT)
            if lut is None or not lut.is_file():
                raise UserError(f"These graphs start from token embeddings, and their lookup table "
                                f"{lut or layout.EMBEDDING_LUT} is missing.", "Re-run the compile stage.")
            self.lut = embedding_lut.load(lut, io[embedding_lut.INPUT], int(shape[-1]))
        # what a caller feeds: token ids where the graph reads their embeddings
        self.inputs = [embedding_lut.IDS if n == embedding_lut.INPUT else n for n in names]
        self.calls, self.seconds = 0, 0.0

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import time

        q = {n: quantize(t.numpy(), self.io[n], n in FLOORED) for n, t in feeds.items()
             if not (self.lut is not None and n == embedding_lut.IDS)}
        if self.lut is not None:
            q[embedding_lut.INPUT] = self.lut[feeds[embedding_lut.IDS].numpy().astype(np.int64)]
        t0 = time.perf_counter()
        out = self.session.run(self.outputs, q)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return {n: torch.from_numpy(dequantize(v, self.io[n])) for n, v in zip(self.outputs, out, strict=True)}


def cpu_session(model: Path, threads: int = 0) -> Any:
    """The prepared graph on onnxruntime's CPU EP (the fast preview; the compiled graph's reference)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
