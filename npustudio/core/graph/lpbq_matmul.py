"""Block-quantized (LPBQ) 1×1 convolutions rewritten as the MatMul form onnxruntime-qnn compiles.

w4a16's weights are int4 in blocks of 64 input channels, each block's scale an integer (uint8) times a float
per-output-channel scale: aimet exports `DQ(w_q INT4 [N, K, 1, 1], DQ(block_scales, channel_scale, axis 0),
axis 1, block_size 64) -> Conv`. onnxruntime-qnn 2.7 refuses every such Conv after its NHWC layout pass, but
fuses the same encoding into QNN's BLOCKWISE_EXPANSION when the layer is a MatMul with a prequantized int4
weight `[K, N]` blocked along axis 0 (measured: all nodes on the HTP, ~4 bits per weight in the binary, the
simulator within 1 LSB of a numpy reference). So each LPBQ Conv over `x [1, K, A, B]` becomes

    DQ(x) -> Transpose(0,2,3,1) -> Q/DQ(x's encoding) -> MatMul(w [K, N]) -> Q/DQ(y's encoding)
          -> Transpose(0,3,1,2) -> the Conv's old output (read by y's own Q)

The two transposes move quantized values only and the Q/DQ pairs around them carry the very encodings of `x`
and `y`, so the graph computes exactly what the Conv computed: same integers, same scales, same rounding.
The transposed int4 weights, block scales and zero points go to a weights file of their own beside the
prepared graphs (`LPBQ_WEIGHTS`), written once for the prompt and token graphs that share them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..errors import UserError

LPBQ_WEIGHTS = "weights_lpbq.bin"
_ALIGN = 64
# Input-channel block counts whose LPBQ MatMul crashes the x86 HTP simulator of onnxruntime-qnn 2.7.0 (SIGSEGV in
# the first run of the context; measured at 1, 32 and 128 tokens, several outputs widths and weights: the count
# alone decides, and 1-6, 10-12, 15-18 and 20-160 run). SmolLM2-135M's 576 channels are 9 blocks, Qwen2-0.5B's
# 896 are 14. Such a layer gets zero input channels up to the next safe count (`_safe_blocks`).
SIMULATOR_UNSAFE_BLOCKS = frozenset({7, 8, 9, 13, 14, 19})


def _safe_blocks(blocks: int) -> int:
    while blocks in SIMULATOR_UNSAFE_BLOCKS:
        blocks += 1
    return blocks


def _unpack4(raw: bytes, count: int, signed: bool) -> np.ndarray:
    """ONNX 4-bit storage (two values a byte, the first in the low nibble) -> one value a byte."""
    b = np.frombuffer(raw, np.uint8)
    v = np.empty(b.size * 2, np.uint8)
    v[0::2], v[1::2] = b & 0x0F, b >> 4
    v = v[:count]
    return ((v.astype(np.int8) << 4) >> 4) if signed else v


def _pack4(a: np.ndarray) -> bytes:
    flat = (a.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


class Store:
    """The transposed LPBQ tensors of one compile run: one file, each source tensor written once."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LPBQ_WEIGHTS
        self._file: IO[bytes] | None = None
        self._written: dict[tuple[str, str, int], tuple[int, int, int]] = {}  # source -> offset, length, dtype

    @contextmanager
    def open(self) -> Iterator[Store]:
        with open(self.path, "wb") as f:
            self._file = f
            try:
                yield self
            finally:
                self._file = None

    @property
    def tensors(self) -> int:
        return len(self._written)

    def put(self, key: tuple[str, str, int], dims: list[int], dtype: int, data: Callable[[], bytes]) -> Any:
        """An initializer of `dims`/`dtype` whose bytes `data()` makes, stored in the file once per `key`: the
        token graph's weights are the prompt graph's, so they are neither read nor transposed again."""
        from onnx import TensorProto

        assert self._file is not None, "Store.open() first"
        if key not in self._written:
            raw = data()
            pos = self._file.tell()
            pad = (-pos) % _ALIGN
            self._file.write(b"\0" * pad)
            self._file.write(raw)
            self._written[key] = (pos + pad, len(raw), dtype)
        offset, length, dt = self._written[key]
        t = TensorProto()
        t.name, t.data_type = key[0], dt
        t.dims.extend(dims)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", LPBQ_WEIGHTS), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        return t


def _source(t: Any) -> tuple[str, int]:
    """Where an initializer's bytes are: its weights file and offset, or inline."""
    from onnx import TensorProto

    if t.data_location != TensorProto.EXTERNAL:
        return "inline:" + t.name, 0
    info = {e.key: e.value for e in t.external_data}
    return info["location"], int(info.get("offset", 0))


def _raw(t: Any, folder: Path) -> bytes:
    """An initializer's stored bytes (inline or external)."""
    from onnx import TensorProto

    if t.data_location != TensorProto.EXTERNAL:
        if not t.raw_data:
            from onnx import numpy_helper

            return bytes(numpy_helper.to_array(t).tobytes())
        return bytes(t.raw_data)
    info = {e.key: e.value for e in t.external_data}
    offset, length = int(info.get("offset", 0)), int(info["length"])
    with open(folder / info["location"], "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise UserError(f"The weights file {info['location']} is shorter than the graph says.",
                        "Re-run the quantize stage.")
    return data


def _matrix(t: Any, folder: Path) -> np.ndarray:
    """A [N, X, 1, 1] weight-side tensor as an [N, X] array of its stored values (4-bit ones unpacked)."""
    from onnx import TensorProto, helper

    data = _raw(t, folder)
    dims = [int(d) for d in t.dims]
    count = math.prod(dims)
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4):
        a = _unpack4(data, count, signed=t.data_type == TensorProto.INT4)
    else:
        a = np.frombuffer(data, helper.tensor_dtype_to_np_dtype(t.data_type), count)
    return a.reshape(dims[0], -1)


def _transposed(store: Store, t: Any, folder: Path, name: str, rows: int = 0, fill: int = 0) -> Any:
    """Initializer `t` ([N, X, 1, 1]) as `name` [X + rows, N], same dtype and values, in the store; the `rows`
    added at the end hold `fill`."""
    from onnx import TensorProto

    def data() -> bytes:
        at = np.ascontiguousarray(_matrix(t, folder).T)
        if rows:
            at = np.concatenate([at, np.full((rows, at.shape[1]), fill, at.dtype)])
        return _pack4(at) if t.data_type in (TensorProto.INT4, TensorProto.UINT4) else at.tobytes()

    n = int(t.dims[0])
    return store.put((name, *_source(t)), [math.prod(int(d) for d in t.dims) // n + rows, n], t.data_type, data)


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _zero_channels(g: Any, base: str, count: int, xs: str, xz: str) -> list[Any]:
    """`count` zero input channels after `base`'s transposed input, between Q/DQ pairs of its encoding (zero is a
    whole step of any such grid: the zero point)."""
    from onnx import helper
    from onnx import numpy_helper as nh

    if not count:
        return []
    g.initializer.append(nh.from_array(np.array([0, 0, 0, 0, 0, 0, 0, count], np.int64), base + "_x_pads"))
    return [helper.make_node("Pad", [base + "_x_t_dq", base + "_x_pads"], [base + "_x_p"], name=base + "_x_p",
                             mode="constant"),
            helper.make_node("QuantizeLinear", [base + "_x_p", xs, xz], [base + "_x_p_q"], name=base + "_x_p_q"),
            helper.make_node("DequantizeLinear", [base + "_x_p_q", xs, xz], [base + "_x_p_dq"], name=base + "_x_p_dq")]


def rewrite(g: Any, folder: Path, store: Store) -> int:
    """Rewrite every LPBQ 1×1 Conv of graph `g` (weights read from `folder`) as the MatMul form; return how many.
    A Conv that is block-quantized in a form this rewrite does not know is refused by name."""
    inits = {t.name: t for t in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    done = 0
    dropped: set[str] = set()
    for conv in [n for n in g.node if n.op_type == "Conv"]:
        w_dq = prod.get(conv.input[1])
        if w_dq is None or w_dq.op_type != "DequantizeLinear" or _attr(w_dq, "block_size") is None:
            continue  # per-channel int8 (the LM head at w4a16): HTP takes it as a Conv
        s_dq, x_dq, y_q = _lpbq_form(g, conv, w_dq, prod, readers, inits)
        w = inits[w_dq.input[0]]
        block = int(_attr(w_dq, "block_size"))
        blocks = int(w.dims[1]) // block
        extra = _safe_blocks(blocks) - blocks  # zero blocks: zero weights (scale 1) times zero inputs
        w_t = _transposed(store, w, folder, w.name + "_kn", extra * block)
        sc_t = _transposed(store, inits[s_dq.input[0]], folder, s_dq.input[0] + "_kn", extra, fill=1)
        zp_t = _transposed(store, inits[w_dq.input[2]], folder, w_dq.input[2] + "_kn", extra)
        for t in (w_t, sc_t, zp_t):
            if t.name not in inits:
                g.initializer.append(t)
                inits[t.name] = t
        new = _matmul_nodes(g, conv, (w_t.name, sc_t.name, zp_t.name), block, extra, s_dq, x_dq, y_q)
        at = list(g.node).index(conv)
        g.node.remove(conv)
        for k, node in enumerate(new):
            g.node.insert(at + k, node)
        for old in (w_dq, s_dq):
            if all(r is conv or r is w_dq for r in readers.get(old.output[0], [])):
                g.node.remove(old)
                dropped.update(old.input)
        done += 1
    used = {i for n in g.node for i in n.input}
    for name in dropped - used:
        if name in inits:
            g.initializer.remove(inits.pop(name))
    return done


def _lpbq_form(g: Any, conv: Any, w_dq: Any, prod: dict[str, Any], readers: dict[str, list[Any]],
               inits: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The block-quantized Conv's scale DequantizeLinear, input DequantizeLinear and output QuantizeLinear, checked
    to be the LPBQ form the rewrite knows; any other form refused by the Conv's name."""
    from onnx import TensorProto

    where = f"{conv.name} in {g.name}"
    s_dq = prod.get(w_dq.input[1])
    x_dq = prod.get(conv.input[0])
    ys = readers.get(conv.output[0], [])
    if (s_dq is None or s_dq.op_type != "DequantizeLinear" or len(w_dq.input) < 3
            or w_dq.input[0] not in inits or s_dq.input[0] not in inits or w_dq.input[2] not in inits):
        raise UserError(f"The block-quantized weight of {where} is not in the LPBQ form (int4 blocks under "
                        "integer block scales and a float per-channel scale).", "Re-run the quantize stage.")
    if len(conv.input) > 2 and conv.input[2]:
        raise UserError(f"{where} has a bias; the ort-qnn back-end compiles block-quantized (w4a16) layers as "
                        "MatMul, which has none.", "Quantize this model with --precision w8a16, or compile "
                        "with --backend qairt and the QAIRT SDK (QNN_SDK_ROOT).")
    if (x_dq is None or x_dq.op_type != "DequantizeLinear" or len(ys) != 1 or ys[0].op_type != "QuantizeLinear"
            or _attr(conv, "group", 1) != 1 or list(_attr(conv, "kernel_shape", [1, 1])) != [1, 1]
            or any(_attr(conv, k) and set(_attr(conv, k)) != {v} for k, v in (("strides", 1), ("dilations", 1),
                                                                                ("pads", 0)))
            or _attr(w_dq, "axis") != 1 or _attr(s_dq, "axis", 1) != 0):
        raise UserError(f"{where} is block-quantized but not a plain quantized 1×1 convolution.",
                        "Quantize this model with --precision w8a16 (report the model: its adapted graph is "
                        "not of the expected form).")
    w = inits[w_dq.input[0]]
    if w.data_type != TensorProto.INT4 or len(w.dims) != 4 or list(w.dims[2:]) != [1, 1]:
        raise UserError(f"The block-quantized weight of {where} is not int4 [out, in, 1, 1].",
                        "Re-run the quantize stage.")
    return s_dq, x_dq, ys[0]


def _matmul_nodes(g: Any, conv: Any, weights: tuple[str, str, str], block: int, extra: int, s_dq: Any, x_dq: Any,
                  y_q: Any) -> list[Any]:
    """The nodes that replace `conv`: its int4 weight [K, N] (`weights`: weight, block scales, zero points, padded
    by `extra` zero blocks) dequantized under the per-channel scale, times the input transposed to [.., K]."""
    from onnx import helper

    w_t, sc_t, zp_t = weights
    base = conv.output[0]
    xs, xz = x_dq.input[1], x_dq.input[2]
    ysc, yzp = y_q.input[1], y_q.input[2]
    return [
        helper.make_node("DequantizeLinear", [sc_t, *s_dq.input[1:]], [base + "_lpbq_scale"],
                         name=base + "_lpbq_scale_dq", axis=1),
        helper.make_node("DequantizeLinear", [w_t, base + "_lpbq_scale", zp_t], [base + "_lpbq_w"],
                         name=base + "_lpbq_w_dq", axis=0, block_size=block),
        helper.make_node("Transpose", [conv.input[0]], [base + "_x_t"], name=base + "_x_t", perm=[0, 2, 3, 1]),
        helper.make_node("QuantizeLinear", [base + "_x_t", xs, xz], [base + "_x_t_q"], name=base + "_x_t_q"),
        helper.make_node("DequantizeLinear", [base + "_x_t_q", xs, xz], [base + "_x_t_dq"],
                         name=base + "_x_t_dq"),
        *_zero_channels(g, base, extra * block, xs, xz),
        helper.make_node("MatMul", [base + ("_x_p_dq" if extra else "_x_t_dq"), base + "_lpbq_w"], [base + "_mm"],
                         name=conv.name),
        helper.make_node("QuantizeLinear", [base + "_mm", ysc, yzp], [base + "_mm_q"], name=base + "_mm_q"),
        helper.make_node("DequantizeLinear", [base + "_mm_q", ysc, yzp], [base + "_mm_dq"],
                         name=base + "_mm_dq"),
        helper.make_node("Transpose", [base + "_mm_dq"], [base], name=base + "_y_t", perm=[0, 3, 1, 2]),
    ]
