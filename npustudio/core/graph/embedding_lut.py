"""The token-embedding table taken out of the NPU graph, into the lookup table Genie reads on the CPU.

A Gather over the 16-bit table is the largest tensor of a model's first part, and every graph of that part carries
it (the prompt and the token graph each hold their weights where binaries are not weight-shared): a
Llama-3.2-1B's 525 MB twice, more than its int4 decoder layers. Genie takes the table as a `lut` file instead
(the dialog's `embedding` block): the graph then starts from `inputs_embeds` (the Gather's quantized output, with
its encoding), and Genie copies each token's row into it as stored. The rows are computed by the graph's own ops
on onnxruntime's CPU (the table's dequantization, the Gather, the output's quantization), so the file holds, bit
for bit, what the graph produced inside; the phone's HTP memory holds no table at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..fsutil import atomic_write_bytes, atomic_writer
from ..results import IOEncoding

INPUT = "inputs_embeds"  # the name Genie's qnn-htp engine looks for in the first part's inputs
IDS = "input_ids"
_CHUNK = 8192  # token ids per call when the rows are computed


def cut(graph: Path, lut: Path | None = None) -> IOEncoding:
    """Make `graph` (a prepared graph, rewritten in place) start from `inputs_embeds`: its `input_ids` -> Gather
    -> QuantizeLinear become that quantized input (the DequantizeLinear after it stays). With `lut`, first write
    there every token's row as the graph computed it. Returns the new input's encoding."""
    import onnx
    from onnx import helper
    from onnx import numpy_helper as nh

    model = onnx.load(str(graph), load_external_data=False)
    g = model.graph
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    gathers = [n for n in readers.get(IDS, []) if n.op_type == "Gather" and list(n.input[1:]) == [IDS]]
    quants = readers.get(gathers[0].output[0], []) if len(gathers) == 1 else []
    if len(readers.get(IDS, [])) != 1 or len(quants) != 1 or quants[0].op_type != "QuantizeLinear":
        raise UserError(f"{graph.name} does not start with one quantized embedding lookup of the token ids.",
                        "Re-run the quantize stage with this version of NPU Studio.")
    gather, q = gathers[0], quants[0]
    inits = {t.name: t for t in g.initializer}
    scale, zp = (nh.to_array(inits[x]) for x in q.input[1:3])
    if scale.size != 1 or zp.dtype not in (np.uint8, np.uint16):
        raise UserError(f"The embedding output of {graph.name} is not quantized per tensor to 8 or 16 bits.",
                        "Re-run the quantize stage with this version of NPU Studio.")
    enc = IOEncoding(dtype=str(zp.dtype), scale=float(scale), zero_point=int(zp))
    ids = next(i for i in g.input if i.name == IDS)
    ar = ids.type.tensor_type.shape.dim[-1].dim_value
    width, chain = _table(g, gather, inits)
    elem = helper.np_dtype_to_tensor_dtype(zp.dtype)
    if lut is not None:
        _write_rows(model, graph.parent, [*chain, gather, q], (q.output[0], elem, width), lut)

    for n in readers.get(q.output[0], []):
        n.input[:] = [INPUT if x == q.output[0] else x for x in n.input]
    g.node.remove(q)
    g.node.remove(gather)
    g.input.remove(ids)
    g.input.insert(0, helper.make_tensor_value_info(INPUT, elem, [1, ar, width]))
    _prune(g)
    atomic_write_bytes(graph, model.SerializeToString())
    return enc


def _table(g: Any, gather: Any, inits: dict[str, Any]) -> tuple[int, list[Any]]:
    """The table's row length, and the nodes between its initializer and the Gather (its dequantization)."""
    producers = {o: n for n in g.node for o in n.output}
    name, chain = gather.input[0], list[Any]()
    while name not in inits and name in producers:
        chain.insert(0, producers[name])
        name = producers[name].input[0]
    if name not in inits or len(inits[name].dims) != 2:
        raise UserError("The embedding lookup does not read a 2-D table.", "Re-run the quantize stage.")
    return int(inits[name].dims[1]), chain


def _write_rows(model: Any, folder: Path, lookup: list[Any], out: tuple[str, int, int], lut: Path) -> None:
    """Every token's row as the graph computes it: the lookup's nodes (`lookup`: the table's dequantization, the
    Gather, the QuantizeLinear; `out`: its output's name, type and row length) on onnxruntime's CPU over all
    ids."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    used = {x for n in lookup for x in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]
    vocab = next(int(t.dims[0]) for t in inits if len(t.dims) == 2)
    name, elem, width = out
    sub = helper.make_model(
        helper.make_graph(lookup, "embedding_lookup", [helper.make_tensor_value_info(IDS, TensorProto.INT32, [1, "n"])],
                          [helper.make_tensor_value_info(name, elem, [1, "n", width])], inits),
        opset_imports=model.opset_import, ir_version=model.ir_version)
    tmp = folder / f".{lut.name}.lookup.onnx"  # beside the weights file its external data names
    onnx.save(sub, str(tmp))
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        session = ort.InferenceSession(str(tmp), so, providers=["CPUExecutionProvider"])
        with atomic_writer(lut) as f:  # a chunk at a time: a 1B's table is 525 MB
            for s in range(0, vocab, _CHUNK):
                ids = np.arange(s, min(s + _CHUNK, vocab), dtype=np.int32)[None]
                f.write(np.ascontiguousarray(session.run(None, {IDS: ids})[0][0]).tobytes())
    finally:
        tmp.unlink(missing_ok=True)


def _prune(g: Any) -> None:
    """Drop the nodes and initializers nothing reads any more (the table and its dequantization)."""
    outputs = {o.name for o in g.output}
    while True:
        read = {x for n in g.node for x in n.input} | outputs
        dead = [n for n in g.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    read = {x for n in g.node for x in n.input}
    for t in [t for t in g.initializer if t.name not in read]:
        g.initializer.remove(t)


def load(path: Path, enc: IOEncoding, width: int) -> np.ndarray:
    """The lookup table at `path` (layout.EMBEDDING_LUT: the input's quantized rows, token-major, native byte
    order) as a read-only (vocab, width) array of the input's dtype, mapped."""
    rows = np.memmap(path, dtype=np.dtype(enc.dtype), mode="r")
    if rows.size % width:
        raise UserError(f"{path} does not hold rows of {width} values.", "Re-run the compile stage.")
    return rows.reshape(-1, width)
