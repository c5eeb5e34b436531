"""Export the calibrated quantsim, one graph per AR (prompt AR-N, token AR-1), in the two forms the compilers read.

- `{graph}.onnx` + `{graph}.encodings` (AIMET schema 1.0.0): float graph + encodings, for the QAIRT SDK
  (`qairt-converter --quantization_overrides`);
- `{graph}_qdq.onnx`: quantized weights + QuantizeLinear/DequantizeLinear pairs, for onnxruntime-qnn.
Every large tensor goes to one shared external-data file, `weights.bin`, stored once by content as it is
written (`Blobs`): the two graphs share their weights, and a tied embedding/LM head is one blob.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from .. import layout
from ..fsutil import atomic_write_json
from ..graph.decoder import io_names
from ..graph.half_weights import wide_value
from ..progress import trim_heap
from . import simulate
from .simulate import packed_encoding

_MIN_EXTERNAL = 1024  # bytes: smaller tensors stay inside the .onnx


def export_graph(sim: Any, feeds: dict[str, torch.Tensor], name: str, out: Path,
                 blobs: Blobs | None = None) -> list[Path]:
    """`name`.onnx + .encodings and `name`_qdq.onnx for one graph shape (given by `feeds`), from ONE trace; their
    weights go to `blobs`, or to each graph's side file (`side_file`)."""
    return write_qdq(trace_graph(sim, feeds, name, out, blobs), blobs)


@dataclass
class Traced:
    """A graph traced from the quantsim, its float form and encodings written: all the QDQ form needs. It holds
    no weights (they are on disk), so the model can be let go before the QDQ pass (`write_qdq`)."""

    graph: Any  # onnx.ModelProto, weights external
    enc_map: dict[str, Any]
    float_onnx: Path
    enc_file: Path
    qdq_onnx: Path


def trace_graph(sim: Any, feeds: dict[str, torch.Tensor], name: str, out: Path,
                blobs: Blobs | None = None) -> Traced:
    """`name`.onnx + .encodings for one graph shape (given by `feeds`), its weights written to `blobs` (or its
    side file); `write_qdq` then writes `name`_qdq.onnx from the same trace.

    aimet's two public exporters (`sim.onnx.export`, `aimet_torch.onnx.export`) each trace the model; they run the
    same steps up to the traced graph and its tensor→encoding map, then write it two ways. We trace once and write
    both: the export takes 0.58x the time. What differs is reproduced: the QDQ form needs int32 bias encodings
    (concretized for the trace when the model has biases); the 1.0.0 file lists no int32 ones, as
    `sim.onnx.export(encoding_version="1.0.0")` does not. tests/test_quantize.py checks both files against
    aimet's own exporters.
    """
    import onnx
    from aimet_torch import onnx as aonnx
    from aimet_torch.quantization.base import QuantizerBase
    from aimet_torch.utils import patch_attr

    trim_heap()  # what the evaluation freed goes back to the system before the export's peak

    layers = sim.model.spec.layers
    ins, outs = io_names(layers, sim.model.extra_inputs)
    args = tuple(feeds[n] for n in ins)
    kw: dict[str, Any] = {"input_names": ins, "output_names": outs, "dynamo": False, "opset_version": 21}
    float_onnx, qdq_onnx, enc_file = out / f"{name}.onnx", out / f"{name}_qdq.onnx", out / f"{name}.encodings"
    model = sim.model
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        # the trace is a forward pass: with autograd on, every layer's saved activations stayed alive until the
        # output was dropped (+1.3 GB at the stage's peak on a 1B model, AR-128 over CL 1024)
        stack.enter_context(torch.no_grad())
        real = stack.enter_context(_stand_ins(model))
        stack.enter_context(aonnx._temporarily_unfold_param_quantizers(model))
        biased = _has_bias(model)
        if biased:  # its extra forward pass holds ~1.4 GB on the default model: only where needed
            stack.enter_context(aonnx._concretize_int32_bias_quantizers(model, args, None))
        stack.enter_context(aonnx._temporarily_convert_activation_to(model, signed=False))
        stack.enter_context(lean_lpbq_dicts())
        # aimet re-quantizes every parameter here, holding two extra copies of each (the 1 GB embedding table of
        # a 1B model: 2 GB more at the export's peak). The folded conv weights are already on their grid
        # (simulate.fold) and come out bit-identical; the embedding's asymmetric 16-bit grid and int32 biases do
        # not, so only they are re-quantized, in place, a slab of rows at a time (idempotent for the next graph)
        _requantize_in_place(model)
        stack.enter_context(aonnx._remove_fp16_quantizers(model))
        stack.enter_context(aonnx._remove_fp16_quantized_parameters(model))
        store = stack.enter_context(_or_side_file(blobs, float_onnx))
        quantizers = {n for n, q in model.named_modules() if isinstance(q, QuantizerBase)}
        stack.enter_context(patch_attr(aonnx._onnx, "export", _weights_outside(
            aonnx._onnx.export, real, store, inline=lambda name: name.rpartition(".")[0] in quantizers)))
        graph, enc_map = aonnx._to_onnx(model, args, str(float_onnx), **kw, propagate_int32_encodings=False)
    onnx.save(graph, str(float_onnx))
    with lean_lpbq_dicts():
        data = sim.onnx._to_json(enc_map, "1.0.0", aonnx._get_all_constants(graph))
    data["param_encodings"] = [e for e in data["param_encodings"] if not _int32(e)]
    _add_input_encodings(data, simulate.input_quantizers(sim.model))
    atomic_write_json(enc_file, data)
    del data
    return Traced(graph, _compact(enc_map), float_onnx, enc_file, qdq_onnx)


def write_qdq(t: Traced, blobs: Blobs | None = None) -> list[Path]:
    """`name`_qdq.onnx from a traced graph and the weights on disk (no torch model needed), its quantized weights
    written to `blobs` (or its side file); the graph's files."""
    import aimet_torch
    import onnx
    from aimet_torch import onnx as aonnx
    from aimet_torch.utils import patch_attr

    out = t.qdq_onnx.parent
    utils = _aimet_onnx_utils()
    # its LPBQ encodings are `LeanLPBQ`s already (`_compact`): aimet's own dicts would list every block's scale
    with _or_side_file(blobs, t.qdq_onnx) as store:
        with patch_attr(utils, "_quantize_const", partial(_lean_quantize_const, utils._quantize_const, store)):
            qdq = aonnx._to_onnx_qdq(t.graph, t.enc_map, prequantize_constants=True, base_dir=str(out))
        t.graph = None
        qdq = _weights_outside_proto(qdq, store)
    trim_heap()
    aonnx._remove_intermediate_identity_nodes(qdq, base_dir=str(out))
    aonnx._remove_dangling_nodes_and_initializers(qdq)
    prop = qdq.metadata_props.add()
    prop.key, prop.value = "producer", f"aimet-torch {aimet_torch.__version__}"
    onnx.save(qdq, str(t.qdq_onnx))
    del qdq
    return [t.float_onnx, t.enc_file, t.qdq_onnx]


def lean_lpbq_dicts() -> contextlib.AbstractContextManager[Any]:
    """`GroupedBlockEncoding.to_qnn_encoding_dict` replaced by `_lean_lpbq_dict` for the `with` block (the trace and
    the .encodings file; the QDQ pass reads `LeanLPBQ`s).

    Not aimet's `patch_attr`: on leaving it deletes the class's own method and, finding the inherited
    `AffineEncoding` one, never puts it back, so every later LPBQ encoding of the process (aimet's own exporters'
    too) came out as a 4-bit PER_BLOCK one."""
    from unittest import mock

    from aimet_torch.quantization.affine.encoding import GroupedBlockEncoding

    return mock.patch.object(GroupedBlockEncoding, "to_qnn_encoding_dict",
                             _lean_lpbq_dict(GroupedBlockEncoding.to_qnn_encoding_dict))


def _lean_lpbq_dict(to_dict: Any) -> Any:
    """LPBQ's `to_qnn_encoding_dict` without its Python lists of every block's float scale.

    - 2.1.0, asked by aimet's trace (`_to_onnx`) only to derive the per-tensor encodings of data-movement and
      rescaling ops: an LPBQ weight's (it has an axis, its scale is no float) is never propagated there, yet
      aimet builds it as (out, blocks, 1, 1)-deep nested lists of every block scale (~2.2 GB at the export's
      peak for a 1B model's 15 million blocks). The stand-in has the same keys, and a token unique to the
      encoding where the lists were, so two encodings stay unequal.
    - 2.1.0 for the QDQ pass: see `LeanLPBQ`, which the traced graph keeps instead of aimet's encoding.
    - 1.0.0 (the .encodings file): aimet lists every block's float scale and offset first (the per-tensor
      format), then replaces them by the per-channel ones (~650 MB of Python floats churned per graph). The
      same dict is built directly.
    tests/test_quantize.py checks all three against aimet's own exporters."""
    def lean(self: Any, encoding_version: str | None = None) -> Any:
        if not _grouped(self):
            return to_dict(self, encoding_version)
        channel_axis, block_axis = self._safe_get_channel_and_block_axis()
        if encoding_version == "2.1.0":
            token = f"LPBQ encoding {id(self)}: block scales not listed for the trace"
            return _lpbq_dict(self, channel_axis, block_axis, token, token)
        if encoding_version == "1.0.0" and self.block_size[block_axis] != -1:
            scale = self.per_channel_scale.flatten().tolist()
            return {"dtype": "INT", "bw": self.decompressed_bw, "is_sym": self.symmetry, "scale": scale,
                    "offset": [-(2 ** (self.decompressed_bw - 1))] * len(scale), "enc_type": "LPBQ",
                    "block_size": self.block_size[block_axis], "compressed_bw": self.bitwidth,
                    "per_block_int_scale": self.per_block_int_scale.to(torch.int32).flatten().tolist()}
        return to_dict(self, encoding_version)

    return lean


def _lpbq_dict(enc: Any, channel_axis: int, block_axis: int, x: Any, x_scale: Any) -> dict[str, Any]:
    """The 2.1.0 dict of an LPBQ encoding `enc` (or a `LeanLPBQ`) with block scales `x` under channel scales
    `x_scale`."""
    return {"output_dtype": f"{'' if enc.signed else 'u'}int{enc.bitwidth}",
            "y_scale": {"x": x, "x_scale": x_scale, "axis": channel_axis},
            "axis": block_axis, "block_size": enc.block_size[block_axis]}


@dataclass
class LeanLPBQ:
    """An LPBQ weight's encoding as the QDQ pass reads it, kept from a graph's trace to its QDQ pass with its
    block scales as the small integers they are (one byte a block where they fit).

    The QDQ pass builds each weight's DequantizeLinear scales from the 2.1.0 dict with `np.array`: here the same
    values as numpy arrays of the dtypes `np.array` gives aimet's lists (int64 block scales, float32 channel
    scales), where aimet lists every block's float scale, then its integer one, for all of a graph's weights at
    once. aimet's encoding object, and the quantizer the trace made for it, hold four float tensors of every block:
    ~240 MB per graph of a Llama-3.2-1B-shaped model at w4a16, and the first graph's were still held during the
    second graph's trace, the export's peak."""

    signed: bool
    bitwidth: int
    block_size: tuple[int, ...]
    channel_axis: int
    block_axis: int
    block_scales: torch.Tensor
    channel_scales: torch.Tensor

    @classmethod
    def of(cls, enc: Any) -> LeanLPBQ:
        channel_axis, block_axis = enc._safe_get_channel_and_block_axis()
        fits_a_byte = 2 ** (enc.decompressed_bw - enc.bitwidth) <= torch.iinfo(torch.uint8).max
        return cls(bool(enc.signed), int(enc.bitwidth), tuple(enc.block_size), channel_axis, block_axis,
                   enc.per_block_int_scale.to(torch.uint8 if fits_a_byte else torch.int64),
                   enc.per_channel_scale.detach().flatten().to(torch.float32).clone())

    def to_qnn_encoding_dict(self, encoding_version: str | None = None) -> dict[str, Any]:
        if encoding_version != "2.1.0":
            raise ValueError(f"a traced LPBQ encoding is kept for the QDQ pass (2.1.0) only, not {encoding_version}")
        return _lpbq_dict(self, self.channel_axis, self.block_axis, self.block_scales.to(torch.int64).numpy(),
                          self.channel_scales.numpy())


def _compact(enc_map: dict[str, Any]) -> dict[str, Any]:
    """A trace's tensor -> (encoding, is_param) map with its LPBQ encodings as `LeanLPBQ` (those `_lean_lpbq_dict`
    writes itself; the others stay aimet's)."""
    from aimet_torch.quantization.affine.encoding import GroupedBlockEncoding

    return {name: (LeanLPBQ.of(e) if isinstance(e, GroupedBlockEncoding) and _grouped(e) else e, is_param)
            for name, (e, is_param) in enc_map.items()}


def _grouped(enc: Any) -> bool:
    """Whether an LPBQ encoding really groups blocks under channel scales (the ones `_lean_lpbq_dict` and `LeanLPBQ`
    write themselves; aimet writes the others as plain affine encodings)."""
    return not all(g == 1 for g in enc.block_grouping) and not enc.zero_point_shift


@contextlib.contextmanager
def _stand_ins(model: Any) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Within: every weight matrix of `model` (the parameters of two dims or more but the embedding table, which
    the export re-quantizes in place) replaced by a stand-in of its shape that takes no memory: one small float,
    its own, expanded; a folded weight's stand-in carries its encoding. The other parameters (norm gains, biases:
    small, and de-duplicated by value as they were) are float32 ones. Yields `real`: a stand-in's float32 values
    (its folded ones, for a weight held packed or in 16 bits), made when asked; any other tensor as it is.

    The trace's forward computes with the stand-ins (the graph and its encodings do not depend on weight values;
    one weight at a time is made contiguous by its convolution), so the export never holds the model in float32:
    a 4B model's packed weights are 4 GB, in float32 16. A tensor the exporter folded from a stand-in would be
    neither, and is refused."""
    from aimet_torch.quantization.base import QuantizerBase
    from aimet_torch.quantization.tensor import DequantizedTensor

    makers: dict[int, Callable[[], torch.Tensor]] = {}
    marks: set[float] = set()
    held: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for m in model.modules():
        if isinstance(m, QuantizerBase):  # its min/max are the encodings the trace records
            continue
        for n, p in list(m._parameters.items()):
            if p is None:
                continue
            held.append((m, n, p))
            if m is model.embed or n == "bias" or p.dim() < 2:
                m._parameters[n] = torch.nn.Parameter(wide_value(m, n, p), requires_grad=p.requires_grad)
                continue
            mark = (len(marks) + 1) * 2.0**-24  # no constant of the graph is one of these
            marks.add(mark)
            stand_in = torch.tensor(mark).expand(p.shape)
            encoding = packed_encoding(m, n) if not p.is_floating_point() else getattr(p, "encoding", None)
            if encoding is not None:
                stand_in = stand_in.as_subclass(DequantizedTensor)
                stand_in.encoding = encoding
            makers[stand_in.untyped_storage().data_ptr()] = partial(wide_value, m, n, p)
            m._parameters[n] = torch.nn.Parameter(stand_in, requires_grad=False)

    def real(t: torch.Tensor) -> torch.Tensor:
        make = makers.get(t.untyped_storage().data_ptr())
        if make is None:
            flat = t.detach().reshape(-1)
            if t.is_floating_point() and flat.numel() > 1 and float(flat[0]) in marks and bool((flat == flat[0]).all()):
                raise RuntimeError(f"the ONNX export folded a weight into a constant of shape {tuple(t.shape)}")
            return t
        value = make().as_subclass(torch.Tensor)
        if value.shape == t.shape:
            return value
        # a view the exporter folded: the same values when it only adds or drops dims of 1
        if [d for d in value.shape if d != 1] != [d for d in t.shape if d != 1]:
            raise RuntimeError(f"the ONNX export rearranged a weight {tuple(value.shape)} -> {tuple(t.shape)}")
        return value.reshape(t.shape)

    try:
        yield real
    finally:
        for m, n, p in held:
            m._parameters[n] = p


@torch.no_grad()
def _requantize_in_place(model: Any) -> None:
    """What aimet's `_apply_qdq_to_model_parameters` does to the embedding table and the biases, into their own
    storage (the export is the model's last use; the next graph's export finds them on the grid already)."""
    for module in model.modules():
        quantizers = getattr(module, "param_quantizers", {})
        for name, quantizer in quantizers.items():
            if quantizer is None or not (module is model.embed or name == "bias"):
                continue
            param = getattr(module, name)
            simulate.qdq_by_slabs(param, quantizer, into=param.data.as_subclass(torch.Tensor))


def _weights_outside(trace: Any, real: Callable[[torch.Tensor], torch.Tensor], blobs: Blobs,
                     inline: Callable[[str], bool]) -> Any:
    """aimet's trace (torch's TorchScript exporter) serializes every weight into the protobuf, parses it back
    and serializes it again: 3-4 copies of the weights at once, the stage's memory peak. Traced with
    `export_params=False`, the weights stay graph inputs; the tensors torch would have written (after its
    constant folding and de-duplication, so the same names and values) are caught on the way and written
    straight from memory to `blobs`, each as `real` gives its values (the trace ran on `_stand_ins`). aimet's
    graph passes after the trace then also work on a graph of a few MB instead of copying the weights.

    The quantizers' own tensors (named after the quantizer; a per-channel scale: vocab floats) stay inside the
    graph (`inline`): aimet drops them with the Identity nodes that mark encodings, and in the weights file they
    would stay as blobs no graph reads."""
    from aimet_torch.utils import patch_attr

    def traced(model: Any, args: Any, f: str, **kw: Any) -> Any:
        params: dict[str, torch.Tensor] = {}
        dedupe = torch._C._jit_pass_onnx_deduplicate_initializers

        def keep(*a: Any) -> Any:
            out = dedupe(*a)
            params.update(cast(dict[str, torch.Tensor], out))
            return out

        with patch_attr(torch._C, "_jit_pass_onnx_deduplicate_initializers", keep):
            out = trace(model, args, f, **kw, export_params=False)
        attach_weights(Path(f), params, real, blobs, inline)
        params.clear()
        trim_heap()
        return out

    return traced


def attach_weights(path: Path, params: dict[str, torch.Tensor],
                   real: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, blobs: Blobs | None = None,
                   inline: Callable[[str], bool] = lambda name: False) -> None:
    """Turn the graph inputs of `path` named in `params` into initializers; the large ones (but those `inline`
    keeps in the graph) go to `blobs` (or `NAME.onnx.data`), written one tensor at a time from the tensors' own
    memory (or `real(tensor)`'s, made for the write and let go after it)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    inputs = list(proto.graph.input)
    weights = [i.name for i in inputs if i.name in params]
    with _or_side_file(blobs, path) as store:
        for name in weights:
            t = real(params[name]).detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy()
            init = onnx.TensorProto(name=name, dims=list(t.shape), data_type=_ONNX_DTYPE[t.dtype])
            if raw.nbytes < _MIN_EXTERNAL or inline(name):
                init.raw_data = raw.tobytes()
            else:
                store.point(init, raw)
            proto.graph.initializer.append(init)
    del proto.graph.input[:]
    proto.graph.input.extend(i for i in inputs if i.name not in params)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(proto, str(tmp))
    os.replace(tmp, path)


def side_file(onnx_path: Path) -> Path:
    """`NAME.onnx.data`: where a graph exported on its own (in a forked copy of the stage) keeps its weights until
    `share_weights` folds them into weights.bin."""
    return onnx_path.with_name(onnx_path.name + ".data")


class Blobs:
    """A weights file that holds each large tensor's bytes once, by content, as they are written: the prompt and
    token graphs' copies of a weight, or a tied embedding and LM head, are one blob. Each blob starts 64-byte
    aligned, so it can be memory-mapped as an array. Written straight to weights.bin, a 4B model's export needs
    its 20.8 GB of weights on disk; written per graph and folded afterwards, it needed ~55 GB."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index: dict[bytes, tuple[int, int]] = {}  # sha-256 -> (offset, length)
        self.written = self.saved = 0
        self._fh: Any = None

    def __enter__(self) -> Blobs:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def put(self, raw: Any) -> tuple[int, int]:
        """Store `raw` (bytes, or a contiguous array's memory) unless the same bytes are stored; their offset and
        length. Flushed at once: the QDQ pass reads the float weights back while it writes the quantized ones."""
        view = memoryview(raw).cast("B")
        key = hashlib.sha256(view).digest()
        if key in self.index:
            self.saved += view.nbytes
            return self.index[key]
        if self._fh is None:  # the file exists once something is stored in it
            self._fh = open(self.path, "wb")  # closed by __exit__
        self._fh.write(b"\0" * (-self._fh.tell() % 64))
        self.index[key] = (self._fh.tell(), view.nbytes)
        self._fh.write(view)
        self._fh.flush()
        self.written += view.nbytes
        return self.index[key]

    def point(self, tensor: Any, raw: Any) -> None:
        """Store `raw` and make the TensorProto `tensor` refer to it."""
        _point_at(tensor, self.path.name, *self.put(raw))


def _or_side_file(blobs: Blobs | None, onnx_path: Path) -> contextlib.AbstractContextManager[Blobs]:
    """`blobs`, left open for the graphs still to come, or `onnx_path`'s own side file, closed after the `with`."""
    return contextlib.nullcontext(blobs) if blobs is not None else Blobs(side_file(onnx_path))


def _point_at(tensor: Any, location: str, offset: int, length: int) -> None:
    """Make `tensor` refer to `length` bytes at `offset` of `location` (onnx's `set_external_data` wants
    the bytes inline first, which would put them in the protobuf's memory)."""
    import onnx

    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


_ONNX_DTYPE = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.uint16: 4, torch.int16: 5, torch.int32: 6,
               torch.int64: 7, torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16}


def _weights_outside_proto(proto: Any, blobs: Blobs) -> Any:
    """Write the large tensors still inside `proto` to `blobs` and return a compact copy of it: aimet's passes
    after the QDQ one copy every initializer (+1.8 GB on a 1B model), and a protobuf keeps the memory of
    cleared bytes until it is dropped."""
    import onnx

    for t in _initializers(proto):
        if t.HasField("raw_data") and len(t.raw_data) >= _MIN_EXTERNAL:
            blobs.point(t, t.raw_data)
    compact = onnx.ModelProto()
    compact.ParseFromString(proto.SerializeToString())
    return compact


def _aimet_onnx_utils() -> Any:
    from aimet_torch.common.onnx import _utils

    return _utils


def _put_ir(blobs: Blobs, tensor: Any) -> Any:
    """Store an onnx_ir tensor's bytes; an onnx_ir tensor that points at them. A whole-byte array is stored from
    its own memory (`tobytes` copies it: the LM head's integers, 0.4 GB on a 4B model); a 4-bit one is packed."""
    import onnx_ir

    arr = tensor.numpy() if tensor.dtype.bitwidth >= 8 else None
    whole = arr is not None and arr.flags.c_contiguous and arr.dtype.byteorder in "=|<"
    offset, length = blobs.put(arr if whole else tensor.tobytes())
    return onnx_ir.ExternalTensor(blobs.path.name, offset, length, tensor.dtype, shape=tensor.shape,
                                  name=tensor.name, base_dir=str(blobs.path.parent))


def _lean_quantize_const(aimets: Any, blobs: Blobs, const: Any, name: str, y_scale: Any, y_zero_point: Any,
                         axis: Any, block_size: Any, output_dtype: str, per_block_int_scale: Any, opset: Any) -> Any:
    """aimet's `_quantize_const`, computed a slab of rows at a time into the integer array.

    aimet divides the whole fp32 weight in float64 (an int64 zero point is added) and rounds and clips it
    in new arrays: about 6x the weight at once, 6 GB for a 1B model's 1 GB LM head. Same operations, same
    dtypes per element, so the same integers (tests compare with aimet's own export). The result goes
    straight to the weights file and the weight's memory-mapped bytes are released: the pass then holds one
    weight at a time, not all of them quantized (+1.8 GB on a 1B model, twice: in the graph and its proto)."""
    import numpy as np

    u = _aimet_onnx_utils()
    unsigned, _, bits = output_dtype.partition("int")
    if per_block_int_scale is not None or not bits.isdigit():
        return aimets(const, name, y_scale, y_zero_point, axis, block_size, output_dtype, per_block_int_scale, opset)
    arr = u.to_array_ir(const).astype(np.float32, copy=False)
    lo, hi = (0, 2 ** int(bits) - 1) if unsigned else (-(2 ** (int(bits) - 1)), 2 ** (int(bits) - 1) - 1)
    scale = u._broadcast(y_scale.astype(np.float32), arr.ndim, axis=axis, block_size=block_size)
    zero = (u._broadcast(y_zero_point, arr.ndim, axis=axis, block_size=block_size) if y_zero_point is not None
            else np.zeros(scale.shape, dtype=np.int32))
    if np.any(scale == 0.0):  # aimet's own message
        return aimets(const, name, y_scale, y_zero_point, axis, block_size, output_dtype, per_block_int_scale, opset)
    out = np.empty(arr.shape, dtype=np.min_scalar_type(lo if lo < 0 else hi))
    if arr.ndim == 0:
        out[...] = (arr / scale + zero).round().clip(lo, hi)
    else:
        scale, zero = np.broadcast_to(scale, arr.shape), np.broadcast_to(zero, arr.shape)
        step = max(1, (1 << 22) // max(1, arr[0].size))
        for i in range(0, arr.shape[0], step):
            out[i:i + step] = (arr[i:i + step] / scale[i:i + step] + zero[i:i + step]).round().clip(lo, hi)
    del arr
    if hasattr(const.const_value, "release"):  # an external tensor: unmap its bytes
        const.const_value.release()
    value = opset.DequantizeLinear.make_arr(out, dtype=output_dtype, name=name)
    del out
    if value.const_value.nbytes >= _MIN_EXTERNAL:
        value.const_value = _put_ir(blobs, value.const_value)  # the graph holds no copy of the quantized weights
    return value


def _has_bias(model: torch.nn.Module) -> bool:
    from aimet_torch.nn import QuantizationMixin

    return any(isinstance(m, QuantizationMixin) and getattr(m, "bias", None) is not None for m in model.modules())


def _int32(e: dict[str, Any]) -> bool:
    return int(e.get("bw", 0)) == 32


def _add_input_encodings(data: dict[str, Any], quantizers: dict[str, Any]) -> None:
    """Name the encodings of graph inputs that aimet's export leaves implicit (it lists none for an input
    that only feeds a Concat), so a compiler can quantize every input exactly as the quantsim did."""
    have = {e["name"] for e in data["activation_encodings"]}
    for name, q in quantizers.items():
        if name in have:
            continue
        data["activation_encodings"].append({
            "name": name, "dtype": "INT", "bw": int(q.bitwidth), "is_sym": bool(q.symmetric),
            "scale": [float(q.get_scale().detach())], "offset": [int(q.get_offset().detach())],
            "enc_type": "PER_TENSOR"})


def share_weights(onnx_files: list[Path], blobs: Blobs) -> None:
    """Move the large initializers of `onnx_files` that are not in `blobs` yet (those of graphs exported in a
    forked copy of the stage, in their side files) into it, then delete the side files.

    Read a tensor at a time, float graphs first and each file's blobs in the order they were written, so the
    weights file comes out as the stage writes it in one process: blob for blob, byte for byte. Each .onnx
    changed is rewritten atomically."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    for f in sorted(onnx_files, key=lambda f: f.stem.endswith("_qdq")):
        model = onnx.load(str(f), load_external_data=False)
        outside = [(ExternalDataInfo(t), t) for t in _initializers(model) if uses_external_data(t)]
        moved = [(info, t) for info, t in outside if info.location != blobs.path.name]
        for info, t in sorted(moved, key=lambda it: (it[0].location, it[0].offset or 0)):
            with open(f.parent / info.location, "rb") as fh:
                fh.seek(info.offset or 0)
                raw = fh.read(info.length) if info.length else fh.read()
            blobs.point(t, raw)
            del raw
        if moved:
            tmp = f.with_name(f.name + ".tmp")
            onnx.save(model, str(tmp))
            os.replace(tmp, f)
        del model
    for f in onnx_files:  # only now: a QDQ graph may still have read its float twin's side file
        side_file(f).unlink(missing_ok=True)


def _initializers(model: Any) -> list[Any]:
    out = list(model.graph.initializer)
    for node in model.graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                out.append(a.t)
    return out


def write_manifest(out: Path, files: list[Path]) -> list[dict[str, Any]]:
    rows = [{"file": p.relative_to(out).as_posix(), "bytes": p.stat().st_size} for p in sorted(files)]
    atomic_write_json(out / layout.EXPORTED_FILES, rows)
    return rows

