"""Turn the quantize stage's QDQ graph into the graph QNN compiles for Genie.

Genie feeds and reads quantized tensors, so the graph I/O must be uint16/uint8 with the exact encodings
of the quantsim. aimet's QDQ export has float I/O with a QuantizeLinear after each input and a
DequantizeLinear before each output; this module
- drops the input Q nodes (the input becomes the quantized tensor, its DQ stays), taking the encoding
  of an input aimet left float (the cos/sin tables) from the `.encodings` file;
- makes each output the quantized tensor (a DQ copy feeds internal consumers);
- gives an op whose output encoding is narrower than its inputs' (the 8-bit KV entries computed from
  16-bit activations) a 16-bit output over the same range first, so QNN builds the op quantized and
  converts, instead of running it in float with its weights dequantized on the CPU.
The weights are not loaded: external data keeps pointing at the quantize stage's `weights.bin`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import UserError
from . import lpbq_matmul
from .lpbq_matmul import Store

# ops that only move data: ORT's QDQ selectors accept them with any (equal) in/out types
_DATA_MOVEMENT = {"Reshape", "Transpose", "Concat", "Split", "Gather", "Squeeze", "Unsqueeze", "Slice", "Tile",
                  "Expand", "Identity", "Flatten"}


class IOEncoding(BaseModel):
    """How Genie (or any host) quantizes a graph input or dequantizes an output: float = (q - zp) * scale."""

    dtype: str  # uint8 | uint16 | int32
    scale: float = 1.0
    zero_point: int = 0


def prepare(src: Path, encodings_file: Path, dst: Path, lpbq: Store | None = None) -> dict[str, IOEncoding]:
    """Write the Genie-ready graph of `src` to `dst` (same folder as the weights); return the I/O encodings.
    Block-quantized (LPBQ) convolutions become MatMuls (`lpbq_matmul`) when `lpbq` takes their weights."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper
    from onnx import numpy_helper as nh

    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    known = activation_encodings(encodings_file)
    inits = {t.name: t for t in g.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in g.node if n.op_type == "Constant" and n.attribute}

    def arr(name: str) -> Any:
        t = inits.get(name) or consts.get(name)
        if t is None:
            raise UserError(f"The graph {src.name} has no value for {name!r}.", "Re-run the quantize stage.")
        return nh.to_array(t)

    def qparams(q: Any) -> tuple[float, int, int]:
        zp = arr(q.input[2])
        return float(arr(q.input[1])), int(zp), helper.np_dtype_to_tensor_dtype(zp.dtype)

    def add_params(base: str, scale: float, zp: int, elem: int) -> tuple[str, str]:
        s, z = base + "_io_scale", base + "_io_zero_point"
        g.initializer.append(nh.from_array(np.array(scale, np.float32), s))
        g.initializer.append(nh.from_array(np.array(zp, helper.tensor_dtype_to_np_dtype(elem)), z))
        inits[s], inits[z] = g.initializer[-2], g.initializer[-1]
        return s, z

    # tensor -> the nodes reading it, in graph order, kept up to date as nodes are renamed, removed and added:
    # scanning all nodes for each of the ~120 graph inputs and outputs took 3.3 of the 4.5 s a graph took
    nodes = list(g.node)  # held: a node's Python object (and id) lasts only as long as something refers to it
    position = {id(n): i for i, n in enumerate(nodes)}
    readers: dict[str, list[Any]] = defaultdict(list)
    for n in nodes:
        for i in dict.fromkeys(n.input):
            readers[i].append(n)

    def rename_uses(old: str, new: str, skip: Any = None) -> None:
        moved = [n for n in readers.pop(old, []) if n is not skip]
        if skip is not None and old in skip.input:
            readers[old] = [skip]
        for n in moved:
            for k, v in enumerate(n.input):
                if v == old:
                    n.input[k] = new
        readers[new] = sorted({id(n): n for n in readers[new] + moved}.values(), key=lambda n: position[id(n)])

    def remove(node: Any) -> None:
        for i in dict.fromkeys(node.input):
            readers[i] = [n for n in readers[i] if n is not node]
        g.node.remove(node)

    result: dict[str, IOEncoding] = {}
    # -- inputs ------------------------------------------------------------------------------
    for inp in g.input:
        x = inp.name
        for ident in [n for n in readers[x] if n.op_type == "Identity" and n.input[0] == x]:
            rename_uses(ident.output[0], x)
            remove(ident)
        if inp.type.tensor_type.elem_type != TensorProto.FLOAT:
            result[x] = IOEncoding(dtype=_np_name(inp.type.tensor_type.elem_type))
            continue
        qs = [n for n in readers[x] if n.op_type == "QuantizeLinear" and n.input[0] == x]
        if qs:
            params = {qparams(q) for q in qs}
            if len(params) > 1:
                raise UserError(f"Input {x} is quantized two different ways in {src.name}.",
                                "Re-run the quantize stage; each input needs one encoding.")
            scale, zp, elem = params.pop()
            s_name, z_name = qs[0].input[1], qs[0].input[2]
            for q in qs:
                rename_uses(q.output[0], x)
                remove(q)
        elif x in known:
            scale, zp = known[x].scale, known[x].zero_point
            elem = TensorProto.UINT16 if known[x].dtype == "uint16" else TensorProto.UINT8
            s_name, z_name = add_params(x, scale, zp, elem)
        else:
            raise UserError(f"Input {x} of {src.name} has no quantization encoding.",
                            "Re-run the quantize stage with this version of NPU Studio.")
        floats = [n for n in readers[x] if n.op_type != "DequantizeLinear"]
        if floats:  # consumers that read the input as float read its dequantized value
            dq_out = x + "_io_dq"
            for n in floats:
                for k, v in enumerate(n.input):
                    if v == x:
                        n.input[k] = dq_out
            g.node.insert(0, helper.make_node("DequantizeLinear", [x, s_name, z_name], [dq_out], name=dq_out))
            dq = g.node[0]
            nodes.append(dq)
            position[id(dq)] = -len(position)  # before every node added earlier
            readers[dq_out] = floats
            readers[x] = [dq] + [n for n in readers[x] if n.op_type == "DequantizeLinear"]
        inp.type.tensor_type.elem_type = elem
        result[x] = IOEncoding(dtype=_np_name(elem), scale=scale, zero_point=zp)

    # -- outputs -----------------------------------------------------------------------------
    prod = {o: n for n in g.node for o in n.output}
    for out in g.output:
        y = out.name
        dq = prod.get(y)
        q = prod.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if dq is None or q is None or q.op_type != "QuantizeLinear":
            raise UserError(f"Output {y} of {src.name} is not quantized.", "Re-run the quantize stage.")
        scale, zp, elem = qparams(q)
        internal = [n for n in readers[y] if n is not dq]
        q.output[0] = y
        dq.input[0] = y
        dq.output[0] = y + "_io_dq"
        if internal:
            rename_uses(y, y + "_io_dq", skip=dq)
            dq.input[0] = y
        else:
            remove(dq)
        out.type.tensor_type.elem_type = elem
        result[y] = IOEncoding(dtype=_np_name(elem), scale=scale, zero_point=zp)

    _widen_narrowing_ops(g, arr, qparams, add_params)
    if lpbq is not None:
        lpbq_matmul.rewrite(g, src.parent, lpbq)
    tmp = dst.with_name(dst.name + ".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(dst)
    return result


def _widen_narrowing_ops(g: Any, arr: Any, qparams: Any, add_params: Any) -> None:
    """op(16-bit inputs) -> Q8  ==>  op -> Q16 -> DQ16 -> Q8 over the same range (a lossless QNN Convert)."""
    from onnx import TensorProto, helper

    prod = {o: n for n in g.node for o in n.output}
    cons: dict[str, list[Any]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            cons[i].append(n)
    for q in [n for n in g.node if n.op_type == "QuantizeLinear"]:
        op = prod.get(q.input[0])
        if op is None or op.op_type in ("DequantizeLinear", "QuantizeLinear") or op.op_type in _DATA_MOVEMENT:
            continue
        scale, zp, elem = qparams(q)
        if elem != TensorProto.UINT8:
            continue
        ins = [prod[i] for i in op.input if i in prod and prod[i].op_type == "DequantizeLinear"]
        acts = [d for d in ins if d.input[0] in prod and qparams(d)[2] == TensorProto.UINT16]
        if not acts:
            continue
        mid = q.input[0]
        s16, z16 = add_params(mid + "_w16", scale * 255.0 / 65535.0, zp * 257, TensorProto.UINT16)
        q16 = helper.make_node("QuantizeLinear", [mid, s16, z16], [mid + "_w16_q"], name=mid + "_w16_q")
        dq16 = helper.make_node("DequantizeLinear", [mid + "_w16_q", s16, z16], [mid + "_w16"], name=mid + "_w16_dq")
        q.input[0] = mid + "_w16"
        at = list(g.node).index(q)
        g.node.insert(at, dq16)
        g.node.insert(at, q16)


def activation_encodings(path: Path) -> dict[str, IOEncoding]:
    """Per-tensor activation encodings of an `.encodings` file (by tensor name), as a host quantizes with them.

    Read with the quantize stage's encodings reader (1.0.0 and legacy, clear errors on malformed files).
    """
    from . import encodings

    return {r.name: IOEncoding(dtype="uint16" if r.bitwidth > 8 else "uint8", scale=r.scale_min,
                               zero_point=-r.offset)
            for r in encodings.read(path, kinds=("activation",)).rows if r.granularity == "tensor"}


def _np_name(elem: int) -> str:
    from onnx import helper

    return str(helper.tensor_dtype_to_np_dtype(elem))
