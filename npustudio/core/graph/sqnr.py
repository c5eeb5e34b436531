"""How much each quantized weight lost: the SQNR in dB of the quantized tensor against the float one.

The float weights are the adapted model's (`stages/adapt/decoder.safetensors` of the project the `.encodings` file
belongs to: the exported graphs hold the weights already on their grid); the grid is the tensor's encoding as the
file states it (AIMET 1.0.0: q = clamp(round(x/scale) - offset, 0, 2^bw - 1), x' = (q + offset)·scale, per tensor,
per output channel or per block of input channels). Each weight is read a slab of rows at a time.

An activation has no stored float values, so a short eval makes them: the graph's float ONNX (the exported
weights, no activation quantizers) runs on onnxruntime's CPU over the stage's test-vector step (real text), and
each tensor an activation encoding names is put through that encoding alone. The figure is the error that one
quantizer adds to a float input, not the error accumulated from the quantizers before it: the one a person
changes by giving that tensor more bits. A tensor that carried no signal in that step (the empty KV cache of a
prompt step) has no figure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from .. import layout
from ..errors import UserError
from ..fsutil import read_json
from ..progress import State, StateLike
from .encodings import EncodingsTable, TensorRow, read

_ROWS = 4096  # rows of a weight quantized at once


def weights(enc_file: Path, rows: list[TensorRow]) -> dict[str, float]:
    """SQNR (dB) per weight row of `rows` whose float values the adapted model holds (inf: no error at all)."""
    from safetensors import safe_open

    floats = _floats(enc_file)
    out: dict[str, float] = {}
    with safe_open(str(floats), framework="pt") as f:
        names = set(f.keys())
        for r in rows:
            name = _stored_name(r, names)
            if name is None:
                continue
            db = _sqnr(f.get_slice(name), r)
            if db is not None:
                out[r.name] = db
    return out


def activations(enc_file: Path, rows: list[TensorRow]) -> dict[str, float]:
    """SQNR (dB) per activation row of `rows`, from a CPU run of the graph `enc_file` belongs to over its test
    vectors (empty when the quantize stage wrote neither beside it: e.g. a copied .encodings file)."""
    import onnx

    enc_file = Path(enc_file).resolve()
    graph, vectors = enc_file.with_suffix(".onnx"), enc_file.parent / layout.TEST_VECTORS / f"{enc_file.stem}.npz"
    # a flag for a range far wider than the other layers' is exactly where the figure is wanted; only an encoding
    # without a grid (NaN or non-positive scales, a bad bitwidth or offset: its range is NaN) has none
    acts = [r for r in rows if r.kind == "activation" and r.granularity == "tensor"
            and math.isfinite(r.range_min) and math.isfinite(r.range_max)]
    if not (graph.is_file() and vectors.is_file() and acts):
        return {}
    from .exported import read_test_vectors

    model = onnx.load(str(graph), load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    made = {o for n in model.graph.node for o in n.output}
    listed = {o.name for o in model.graph.output}
    for r in acts:
        if r.name in made and r.name not in listed:
            model.graph.output.append(onnx.ValueInfoProto(name=r.name))
            listed.add(r.name)
    feeds = read_test_vectors(vectors)["in"]
    values = dict(feeds) | _run(model, graph.parent, {k: v for k, v in feeds.items() if k in inputs})
    out: dict[str, float] = {}
    for r in acts:
        if r.name in values:
            db = _activation_sqnr(values[r.name], r)
            if db is not None:
                out[r.name] = db
    return out


def _run(model: Any, folder: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `model` (its external weights are in `folder`) on onnxruntime's CPU, unoptimised so each
    named tensor is computed as the graph states it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _activation_sqnr(x: np.ndarray, r: TensorRow) -> float | None:
    """SQNR of `x` put through `r`'s per-tensor grid."""
    v = np.asarray(x, dtype=np.float64)
    signal = float(np.sum(v * v))
    noise = float(np.sum((v - _on_grid(v, float(r.scales[0]), float(r.offsets[0]), 2.0**r.bitwidth - 1)) ** 2))
    return None if signal == 0 else _db(signal, noise)


def _on_grid(x: np.ndarray, s: Any, o: Any, top: float) -> np.ndarray:
    """`x` quantized and dequantized as the file states it: q = clamp(round(x/s) - o, 0, top), x' = (q + o)·s."""
    return (np.clip(np.round(x / s) - o, 0, top) + o) * s


def _db(signal: float, noise: float) -> float | None:
    """10·log10(signal/noise); inf without noise, None without signal to compare with."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else None


def _floats(enc_file: Path) -> Path:
    """The adapted model's float weights for an .encodings file of a project's quantize stage."""
    quant_dir = Path(enc_file).resolve().parent
    floats = quant_dir.parent / "adapt" / layout.DECODER_WEIGHTS  # the project's adapt stage
    if not floats.is_file():
        raise UserError(f"SQNR needs the float weights: {Path(enc_file).name} is not in a project's quantize stage "
                        f"(no {floats}).", "Point at an .encodings file under <project>/stages/quantize.")
    result = quant_dir / layout.QUANTIZE_RESULT
    if result.is_file() and json.loads(result.read_text()).get("rotated"):
        raise UserError("These weights were rotated before quantizing: the adapted float weights are not what was "
                        "quantized, so an SQNR against them would mislead.", "Read the table without --sqnr.")
    return floats


def _stored_name(r: TensorRow, names: set[str]) -> str | None:
    """The float tensor an encodings row quantizes (the tied LM head is the embedding), if it is a weight."""
    name = r.name if r.name in names else "embed.weight" if r.name == "lm_head.weight" else None
    if r.kind != "param" or name not in names or any("scale" in x or "bitwidth" in x for x in r.flags):
        return None
    return name


def _grid(r: TensorRow, n_rows: int, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Scales and offsets broadcastable over the tensor as (rows, width), or None when the encoding's shape does
    not match the tensor (nothing sound to say then)."""
    scales = np.asarray(r.scales, dtype=np.float64)
    offsets = np.asarray(r.offsets or [r.offset], dtype=np.float64)
    if r.granularity == "tensor":
        return scales[:1].reshape(1, 1), offsets[:1].reshape(1, 1)
    if r.granularity == "channel" and len(scales) == n_rows:
        return scales.reshape(-1, 1), offsets.reshape(-1, 1) if len(offsets) == n_rows else offsets[:1].reshape(1, 1)
    if r.granularity == "block" and len(scales) % n_rows == 0 and width % (len(scales) // n_rows) == 0:
        blocks = len(scales) // n_rows
        return np.repeat(scales.reshape(n_rows, blocks), width // blocks, axis=1), offsets[:1].reshape(1, 1)
    return None


class WeightGrid:
    """A stored weight read as (rows, width) slabs beside its encoding's scales and offsets: what the SQNR and the
    histogram both walk."""

    def __init__(self, x: Any, scales: np.ndarray, offsets: np.ndarray, n_rows: int, width: int, top: float) -> None:
        self.x, self.scales, self.offsets, self.n_rows, self.width, self.top = x, scales, offsets, n_rows, width, top

    @classmethod
    def of(cls, x: Any, r: TensorRow) -> WeightGrid | None:
        """`x`: a safetensors slice; None when `r`'s encoding does not fit its shape."""
        shape = tuple(x.get_shape())
        n_rows = shape[0] if len(shape) > 1 else 1
        width = math.prod(shape) // n_rows
        grid = _grid(r, n_rows, width)
        return None if grid is None else cls(x, *grid, n_rows, width, 2.0**r.bitwidth - 1)

    def rows(self, a: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows a..a+n as float64 (rows, width), with their scales and offsets."""
        src = self.x[a:min(a + n, self.n_rows)] if self.n_rows > 1 else self.x[:]
        w = src.double().numpy().reshape(-1, self.width)  # the adapted weights may be bf16: numpy has none
        s = self.scales[a:a + len(w)] if self.scales.shape[0] > 1 else self.scales
        o = self.offsets[a:a + len(w)] if self.offsets.shape[0] > 1 else self.offsets
        return w, s, o


def _sqnr(x: Any, r: TensorRow) -> float | None:
    """`x`: a safetensors slice (shape and row slabs)."""
    weight = WeightGrid.of(x, r)
    if weight is None:
        return None
    signal = noise = 0.0
    for a in range(0, weight.n_rows, _ROWS):
        w, s, o = weight.rows(a, _ROWS)
        signal += float(np.sum(w * w))
        noise += float(np.sum((w - _on_grid(w, s, o, weight.top)) ** 2))
    return _db(signal, noise)


class WeightHistogram(BaseModel):
    """A weight's float values against its quantization grid, for the inspector's histogram."""

    counts: list[int]
    edges: list[float]  # len(counts) + 1
    clip_low: float  # the lowest and highest value any channel (block) of the encoding can represent
    clip_high: float
    grid: list[float]  # the representable values, when one grid serves the whole tensor and has few levels
    clipped: float  # fraction of the values outside their own channel's (block's) clip range
    values: int  # how many values were read (a sample of rows for a large tensor)
    of: int  # how many the tensor has


SAMPLE_VALUES = 2**20  # read at most about this many values of a large weight (evenly spread slabs of rows)


def histogram(enc_file: Path, r: TensorRow, bins: int = 120) -> WeightHistogram | None:
    """`r`'s float values (the adapted model's) binned, with its encoding's clip range and grid; None for an
    activation or a weight the adapted model does not hold as such."""
    from safetensors import safe_open

    if r.kind != "param":
        return None
    with safe_open(str(_floats(enc_file)), framework="pt") as f:
        name = _stored_name(r, set(f.keys()))
        if name is None:
            return None
        weight = WeightGrid.of(f.get_slice(name), r)
        if weight is None:
            return None
        n_rows, width, scales, offsets, top = weight.n_rows, weight.width, weight.scales, weight.offsets, weight.top
        if n_rows * width <= SAMPLE_VALUES:
            take, starts = n_rows, [0]
        else:  # slabs of up to 64 rows, evenly spread over the tensor
            take = max(1, min(64, SAMPLE_VALUES // width))
            slabs = max(1, SAMPLE_VALUES // (take * width))
            starts = sorted({int(v) for v in np.linspace(0, n_rows - take, num=slabs)})
        parts, outside = [], 0
        for a in starts:
            w, s, o = weight.rows(a, take)
            lo, hi = o * s, (top + o) * s
            outside += int(np.sum((w < lo - s / 2) | (w > hi + s / 2)))  # beyond half a step: clipped
            parts.append(w.ravel())
    vals = np.concatenate(parts)
    all_lo, all_hi = offsets * scales, (top + offsets) * scales
    clip_low, clip_high = float(np.min(all_lo)), float(np.max(all_hi))
    span = (min(float(vals.min()), clip_low), max(float(vals.max()), clip_high))
    counts, edges = np.histogram(vals, bins=bins, range=span)
    one = scales.size == 1 and offsets.size == 1
    levels = ((np.arange(top + 1) + float(offsets.flat[0])) * float(scales.flat[0])).tolist() if one and top < 256 \
        else []
    return WeightHistogram(counts=counts.tolist(), edges=edges.tolist(), clip_low=clip_low, clip_high=clip_high,
                           grid=levels, clipped=outside / max(vals.size, 1), values=int(vals.size),
                           of=n_rows * width)


def annotated(path: str | Path, state: StateLike | None = None) -> EncodingsTable:
    """The encodings table of `path` with each tensor's SQNR (`weights`, `activations`); `state` hears each step
    and may cancel between them."""
    state = state or State()
    state.progress(0.0, f"reading {Path(path).name}")
    table = read(path)
    p = Path(table.path)
    state.progress(0.1, "weight SQNR")
    db = weights(p, table.rows)
    state.progress(0.4, "activation SQNR (the graph on its eval text)")
    db |= activations(p, table.rows)
    state.progress(1.0)
    for r in table.rows:
        r.sqnr_db = db.get(r.name)
    return table


class SqnrChange(BaseModel):
    name: str
    kind: str
    before_db: float | None
    after_db: float | None
    change_db: float | None  # after - before; None where either has no finite figure


SHAPE_FIELDS = ("model_type", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def same_model_and_graph(before: Path, after: Path) -> None:
    """A UserError naming both when two runs' encodings are of different models (their adapt stages' cards) or
    different graphs (the prompt and the token graph, other AR/CL)."""
    if before.name != after.name:
        raise UserError(f"{before.name} and {after.name} encode different graphs: their tensors cannot be compared.",
                        f"Compare {after.name} with the other run's file of the same name.")
    cards = []
    for f in (before, after):
        card_file = Path(f).resolve().parent.parent / "adapt" / layout.CARD
        data = read_json(card_file, "model card", "Point at an .encodings file under <project>/stages/quantize.") \
            if card_file.is_file() else None
        if not isinstance(data, dict):
            raise UserError(f"{f} is not in a project's quantize stage (no {card_file}): its model is unknown.",
                            "Point at an .encodings file under <project>/stages/quantize.")
        cards.append(data)
    a, b = cards
    if differ := [k for k in SHAPE_FIELDS if a.get(k) != b.get(k)]:
        what = ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in differ[:3])
        raise UserError(f"The two runs quantized different models: {a.get('source')} ({before}) and {b.get('source')} "
                        f"({after}) differ in {what}.", "Compare runs of the same model (another recipe, precision "
                        "or override file on the same adapted graphs).")


def changes(before: str | Path, after: str | Path, state: StateLike | None = None) -> list[SqnrChange]:
    """What another quantize run (a recipe, an override file) did to each tensor both files encode: their SQNR
    side by side, each against its own project's float weights and eval, the most damaged by the change first.
    Refused (before any SQNR is computed) for another model or another graph: their tensors share names, not
    meaning."""
    same_model_and_graph(Path(before), Path(after))
    state = state or State()
    old = {r.name: r for r in annotated(before, state.sub(0.0, 0.5)).rows}
    rows = []
    for r in annotated(after, state.sub(0.5, 1.0)).rows:
        o = old.get(r.name)
        if o is None:
            continue
        a, b = o.sqnr_db, r.sqnr_db
        change = b - a if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) else None
        rows.append(SqnrChange(name=r.name, kind=r.kind, before_db=a, after_db=b, change_db=change))
    return sorted(rows, key=lambda c: (c.change_db is None, c.change_db or 0.0))
