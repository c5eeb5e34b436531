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

from ..errors import UserError
from ..results import IOEncoding
from . import lpbq_matmul
from .lpbq_matmul import Store

# ops that only move data: ORT's QDQ selectors accept them with any (equal) in/out types
_DATA_MOVEMENT = {"Reshape", "Transpose", "Concat", "Split", "Gather", "Squeeze", "Unsqueeze", "Slice", "Tile",
                  "Expand", "Identity", "Flatten"}


def prepare(src: Path, encodings_file: Path, dst: Path, lpbq: Store | None = None) -> dict[str, IOEncoding]:
    """Write the Genie-ready graph of `src` to `dst` (same folder as the weights); return the I/O encodings.
    Block-quantized (LPBQ) convolutions become MatMuls (`lpbq_matmul`) when `lpbq` takes their weights."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    ed = _GraphEdit(model.graph, src.name)
    known = activation_encodings(encodings_file)
    result = {inp.name: ed.quantized_input(inp, known) for inp in model.graph.input}
    prod = {o: n for n in model.graph.node for o in n.output}
    result |= {out.name: ed.quantized_output(out, prod) for out in model.graph.output}
    _widen_narrowing_ops(model.graph, ed.arr, ed.qparams, ed.add_params)
    if lpbq is not None:
        lpbq_matmul.rewrite(model.graph, src.parent, lpbq)
    tmp = dst.with_name(dst.name + ".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(dst)
    return result


class _GraphEdit:
    """Graph `g` of the file `name`, its inputs and outputs made quantized, with an index of each tensor's readers
    kept up to date as nodes are renamed, removed and added: scanning all nodes for each of the ~120 graph inputs
    and outputs took 3.3 of the 4.5 s a graph took."""

    def __init__(self, g: Any, name: str) -> None:
        self.g, self.name = g, name
        self.inits = {t.name: t for t in g.initializer}
        self.consts = {n.output[0]: n.attribute[0].t for n in g.node if n.op_type == "Constant" and n.attribute}
        self.nodes = list(g.node)  # held: a node's Python object (and id) lasts only as long as something refers to it
        self.position = {id(n): i for i, n in enumerate(self.nodes)}
        self.readers: dict[str, list[Any]] = defaultdict(list)
        for n in self.nodes:
            for i in dict.fromkeys(n.input):
                self.readers[i].append(n)

    def arr(self, name: str) -> Any:
        from onnx import numpy_helper as nh

        t = self.inits.get(name) or self.consts.get(name)
        if t is None:
            raise UserError(f"The graph {self.name} has no value for {name!r}.", "Re-run the quantize stage.")
        return nh.to_array(t)

    def qparams(self, q: Any) -> tuple[float, int, int]:
        from onnx import helper

        zp = self.arr(q.input[2])
        return float(self.arr(q.input[1])), int(zp), helper.np_dtype_to_tensor_dtype(zp.dtype)

    def add_params(self, base: str, scale: float, zp: int, elem: int) -> tuple[str, str]:
        import numpy as np
        from onnx import helper
        from onnx import numpy_helper as nh

        s, z = base + "_io_scale", base + "_io_zero_point"
        self.g.initializer.append(nh.from_array(np.array(scale, np.float32), s))
        self.g.initializer.append(nh.from_array(np.array(zp, helper.tensor_dtype_to_np_dtype(elem)), z))
        self.inits[s], self.inits[z] = self.g.initializer[-2], self.g.initializer[-1]
        return s, z

    def rename_uses(self, old: str, new: str, skip: Any = None) -> None:
        moved = [n for n in self.readers.pop(old, []) if n is not skip]
        if skip is not None and old in skip.input:
            self.readers[old] = [skip]
        for n in moved:
            for k, v in enumerate(n.input):
                if v == old:
                    n.input[k] = new
        self.readers[new] = sorted({id(n): n for n in self.readers[new] + moved}.values(),
                                   key=lambda n: self.position[id(n)])

    def remove(self, node: Any) -> None:
        for i in dict.fromkeys(node.input):
            self.readers[i] = [n for n in self.readers[i] if n is not node]
        self.g.node.remove(node)

    def quantized_input(self, inp: Any, known: dict[str, Any]) -> IOEncoding:
        """Graph input `inp` made its quantized type: its QuantizeLinear readers removed (or its encoding from
        `known`), float readers fed a DequantizeLinear of it."""
        from onnx import TensorProto

        x, readers = inp.name, self.readers
        for ident in [n for n in readers[x] if n.op_type == "Identity" and n.input[0] == x]:
            self.rename_uses(ident.output[0], x)
            self.remove(ident)
        if inp.type.tensor_type.elem_type != TensorProto.FLOAT:
            return IOEncoding(dtype=_np_name(inp.type.tensor_type.elem_type))
        qs = [n for n in readers[x] if n.op_type == "QuantizeLinear" and n.input[0] == x]
        if qs:
            params = {self.qparams(q) for q in qs}
            if len(params) > 1:
                raise UserError(f"Input {x} is quantized two different ways in {self.name}.",
                                "Re-run the quantize stage; each input needs one encoding.")
            scale, zp, elem = params.pop()
            s_name, z_name = qs[0].input[1], qs[0].input[2]
            for q in qs:
                self.rename_uses(q.output[0], x)
                self.remove(q)
        elif x in known:
            scale, zp = known[x].scale, known[x].zero_point
            elem = TensorProto.UINT16 if known[x].dtype == "uint16" else TensorProto.UINT8
            s_name, z_name = self.add_params(x, scale, zp, elem)
        else:
            raise UserError(f"Input {x} of {self.name} has no quantization encoding.",
                            "Re-run the quantize stage with this version of NPU Studio.")
        self._dequantize_for_floats(x, s_name, z_name)
        inp.type.tensor_type.elem_type = elem
        return IOEncoding(dtype=_np_name(elem), scale=scale, zero_point=zp)

    def _dequantize_for_floats(self, x: str, s_name: str, z_name: str) -> None:
        """Readers of input `x` that read it as float read its dequantized value."""
        from onnx import helper

        floats = [n for n in self.readers[x] if n.op_type != "DequantizeLinear"]
        if not floats:
            return
        dq_out = x + "_io_dq"
        for n in floats:
            for k, v in enumerate(n.input):
                if v == x:
                    n.input[k] = dq_out
        self.g.node.insert(0, helper.make_node("DequantizeLinear", [x, s_name, z_name], [dq_out], name=dq_out))
        dq = self.g.node[0]
        self.nodes.append(dq)
        self.position[id(dq)] = -len(self.position)  # before every node added earlier
        self.readers[dq_out] = floats
        self.readers[x] = [dq] + [n for n in self.readers[x] if n.op_type == "DequantizeLinear"]

    def quantized_output(self, out: Any, prod: dict[str, Any]) -> IOEncoding:
        """Graph output `out` made its QuantizeLinear's output; readers inside the graph keep the float value."""
        y = out.name
        dq = prod.get(y)
        q = prod.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if dq is None or q is None or q.op_type != "QuantizeLinear":
            raise UserError(f"Output {y} of {self.name} is not quantized.", "Re-run the quantize stage.")
        scale, zp, elem = self.qparams(q)
        internal = [n for n in self.readers[y] if n is not dq]
        q.output[0] = y
        dq.input[0] = y
        dq.output[0] = y + "_io_dq"
        if internal:
            self.rename_uses(y, y + "_io_dq", skip=dq)
            dq.input[0] = y
        else:
            self.remove(dq)
        out.type.tensor_type.elem_type = elem
        return IOEncoding(dtype=_np_name(elem), scale=scale, zero_point=zp)


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
