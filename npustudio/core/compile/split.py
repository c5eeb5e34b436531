"""Models too large for one HTP context (< 4 GB) are cut into parts along the residual stream.

Part i of n holds a run of decoder layers (the first also the embedding, the last the final norm and
the LM head) and is its own graph `…_{i}_of_{n}`; the residual stream between parts is a float graph
I/O named `residual_{k}` (k = the last layer before the cut). It stays float because it is float inside
the graph too (the attention-sink token reaches ~2e4 there, which no 16-bit grid over the ordinary
tokens' range can hold). Genie orders a model's parts by the `_{i}_of_{n}` ending of the QNN graph
names; the onnxruntime-qnn EP names its graphs after a hash, so `name_graph` renames the graph inside
the context binary (checked by the real libGenie: a two-part bundle answers token for token like the
one-part bundle of the same model).
"""

from __future__ import annotations

import functools
import gc
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import parts
from ..errors import UserError
from ..fsutil import atomic_write_bytes
from ..graph.ort_graph import OrtGraph
from ..progress import trim_heap

SHARED_INPUTS = ("attention_mask", "position_ids_cos", "position_ids_sin")


# bytes per element by ONNX type; 4-bit types as 8: the binary stores them two to a byte, but QNN's own allocation
# estimate, which the HTP's per-graph limit applies to, counts them wider (see core/parts.py)
_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2, 21: 1, 22: 1}
_LAYER = re.compile(r"(?:^|/)layers[./](\d+)[./]")
_HEAD = re.compile(r"^/?(?:lm_head|norm)[./]")


def part_model(prepared: Path, graphs: list[str], spec: Any, ars: dict[str, int], cl: int) -> parts.PartModel:
    """The HTP estimate (core/parts.py) of the prepared graphs, from their real tensors: each initializer goes
    with the decoder layer of the nodes that read it, the embedding's with the first part, the final norm's and
    the LM head's with the last; graph I/O likewise. The larger graph (the prompt graph) sets each figure."""
    import onnx

    best: parts.PartModel | None = None
    for g in graphs:
        model = onnx.load(str(prepared / f"{g}.onnx"), load_external_data=False)
        home: dict[str, int | str] = {}  # tensor -> layer index, "first" or "last": where its first reader is
        for node in model.graph.node:
            m = _LAYER.search(node.name)
            where = int(m.group(1)) if m else "last" if _HEAD.match(node.name) else "first"
            for x in node.input:
                home.setdefault(x, where)
        size: dict[int | str, float] = dict.fromkeys([*range(spec.layers), "first", "last", "each"], 0.0)
        for t in model.graph.initializer:
            size[home.get(t.name, "first")] += parts.weight_bytes(_numel(t.dims) * _BYTES.get(t.data_type, 4))
        for vi in [*model.graph.input, *model.graph.output]:
            tt = vi.type.tensor_type
            m = re.fullmatch(r"past_(?:key|value)_(\d+)_(?:in|out)", vi.name)
            where = int(m.group(1)) if m else {"input_ids": "first", "inputs_embeds": "first",
                                               "logits": "last"}.get(vi.name, "each")
            size[where] += _numel([d.dim_value for d in tt.shape.dim]) * _BYTES.get(tt.elem_type, 4)
        ar = ars[g]
        size["each"] += 2 * 4 * spec.hidden * ar  # the float residual passed between parts, in and out
        size["each"] += 2 * 2 * max(spec.heads * ar * cl, ar * spec.intermediate, ar * spec.hidden)
        pm = parts.PartModel(first=int(size["first"]), layers=[int(size[k]) for k in range(spec.layers)],
                             last=int(size["last"]), each=int(size["each"]))
        if best is None or pm.total > best.total:
            best = pm
    assert best is not None
    return best


def _numel(dims: Any) -> int:
    return math.prod(int(d) for d in dims) if len(dims) else 1


def base_name(graph: str) -> str:
    return re.sub(r"_\d+_of_\d+$", "", graph)


def split(prepared: Path, graph: str, ranges: list[range], hidden: int, ar: int) -> tuple[list[str], list[str]]:
    """Write `graph`'s parts (one per range of layers) beside it, sharing its weights file; return their names in
    order and the residual tensors passed between them."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.utils import Extractor

    model = onnx.load(str(prepared / f"{graph}.onnx"), load_external_data=False)
    g = model.graph
    count = len(ranges)
    cuts = {}  # last layer before a cut -> the residual tensor there, renamed
    producers = {n.name: n for n in g.node}
    for r in ranges[:-1]:
        k = r[-1]
        node = producers.get(f"/layers.{k}/mlp_add/Add")
        if node is None:
            raise UserError(f"{graph} has no residual add after layer {k} to cut at.",
                            "Re-run the quantize stage with this version (the graph's layout is older).")
        old, new = node.output[0], f"residual_{k}"
        for n in g.node:
            n.input[:] = [new if x == old else x for x in n.input]
            n.output[:] = [new if x == old else x for x in n.output]
        g.value_info.append(helper.make_tensor_value_info(new, TensorProto.FLOAT, [1, hidden, 1, ar]))
        cuts[k] = new
    inputs = [i.name for i in g.input]
    tokens = next(n for n in inputs if n in ("input_ids", "inputs_embeds"))  # token ids, or their embeddings
    outputs = [o.name for o in g.output]

    def kv(names: list[str], r: range, end: str) -> list[str]:
        return [n for n in names if (m := re.fullmatch(rf"past_(?:key|value)_(\d+)_{end}", n)) and int(m[1]) in r]

    base, names = base_name(graph), []
    for i, r in enumerate(ranges):
        first, last = i == 0, i == count - 1
        ins = ([tokens] if first else [cuts[r[0] - 1]]) + [n for n in SHARED_INPUTS if n in inputs]
        outs = (["logits"] if last else [cuts[r[-1]]]) + kv(outputs, r, "out")
        sub = Extractor(model).extract_model(ins + kv(inputs, r, "in"), outs)
        name = f"{base}_{i + 1}_of_{count}"
        sub.graph.name = name
        onnx.save(sub, str(prepared / f"{name}.onnx"))
        names.append(name)
    return names, list(cuts.values())


def name_graph(ctx_onnx: Path, name: str) -> None:
    """Rename a compiled graph's QNN graph, inside its context binary and in its EPContext node, to
    `name` padded to the hashed name's length (the name is a length-prefixed string in the binary;
    keeping the length keeps every offset)."""
    import onnx

    from ..graph.ort_qnn import context_node

    old_name, bin_name = context_node(ctx_onnx)
    old = old_name.encode()
    tail = re.search(r"_\d+_of_\d+$", name)
    head, end = (name[: tail.start()], tail.group(0)) if tail else (name, "")
    new = (head + "_" * (len(old) - len(head) - len(end)) + end).encode()
    if len(new) != len(old):
        raise UserError(f"The graph name {name!r} is longer than onnxruntime-qnn's ({len(old)} characters).",
                        "Use a shorter graph name.")
    binary = ctx_onnx.parent / bin_name
    data = binary.read_bytes()
    if data.count(old) == 0:
        raise UserError(f"{binary.name} does not hold the graph {old_name}.", "Re-run the compile stage.")
    atomic_write_bytes(binary, data.replace(old, new))
    model = onnx.load(str(ctx_onnx))
    for node in model.graph.node:
        if node.name == old_name:
            node.name = new.decode()
            for a in node.attribute:
                if a.name == "partition_name":
                    a.s = new
    atomic_write_bytes(ctx_onnx, model.SerializeToString())


class Chain:
    """`GraphFn` over the parts of one graph, run in order, each fed what it names (the KV-cache runner sees one
    graph). With `keep=False` each part's session is opened for its call and closed after it, so only one part
    is in memory at a time (a large model's verification); otherwise all stay open."""

    def __init__(self, parts: list[Callable[[], OrtGraph]], keep: bool = True) -> None:
        self.makers, self.keep = parts, keep
        self.open = [make() for make in parts] if keep else []

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        known: dict[str, Any] = dict(feeds)
        out: dict[str, torch.Tensor] = {}
        for i, make in enumerate(self.makers):
            p = self.open[i] if self.keep else make()
            res = p({x: known[x] for x in p.inputs})
            known.update(res)
            out.update(res)
            if not self.keep:
                del p
                _release()
        return out


def _release() -> None:
    """Give what closed sessions freed back to the system (glibc keeps freed pages otherwise)."""
    gc.collect()
    trim_heap()


class OneAtATime:
    """The graph functions of a KV-cache runner, only one of them loaded at a time: a large model's prompt and
    token graphs do not both fit in memory (their sessions hold the weights). The runner's schedule, prefill
    chunks then AR-1 steps, loads each once."""

    def __init__(self, makers: dict[int, Callable[[], Any]]) -> None:
        self.makers = makers
        self.live: tuple[int, Any] | None = None
        self.calls = dict.fromkeys(makers, 0)
        self.seconds = dict.fromkeys(makers, 0.0)

    def graphs(self) -> dict[int, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
        return {ar: functools.partial(self._call, ar) for ar in self.makers}

    def _call(self, ar: int, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.live is None or self.live[0] != ar:
            self.release()
            self.live = (ar, self.makers[ar]())
        t0 = time.perf_counter()
        out = self.live[1](feeds)
        self.seconds[ar] += time.perf_counter() - t0
        self.calls[ar] += 1
        return out

    def release(self) -> None:
        self.live = None
        _release()

    def per_call(self) -> dict[int, float]:
        """Seconds per call of each graph, its loading not counted."""
        return {ar: round(self.seconds[ar] / max(self.calls[ar], 1), 3) for ar in self.makers}
