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

import itertools
import math
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..fsutil import atomic_write_bytes
from .ort_graph import OrtGraph

SHARED_INPUTS = ("attention_mask", "position_ids_cos", "position_ids_sin")


def weight_bytes(onnx_path: Path) -> int:
    """Bytes of the initializers a graph holds (inline or in its external data)."""
    import onnx

    total = 0
    for t in onnx.load(str(onnx_path), load_external_data=False).graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return total


def part_count(weights: int, layers: int, max_bytes: int, forced: int = 0) -> int:
    n = forced or max(1, math.ceil(weights / max_bytes))
    if n > layers:
        raise UserError(f"{n} parts were asked for, but the model has only {layers} layers to share among them.",
                        f"Use at most {layers} parts.")
    return n


def layer_ranges(layers: int, parts: int) -> list[range]:
    """Layers shared as evenly as possible, earlier parts taking the remainder."""
    sizes = [layers // parts + (i < layers % parts) for i in range(parts)]
    return [range(b - n, b) for n, b in zip(sizes, itertools.accumulate(sizes), strict=True)]


def base_name(graph: str) -> str:
    return re.sub(r"_\d+_of_\d+$", "", graph)


def split(prepared: Path, graph: str, parts: int, layers: int, hidden: int, ar: int) -> tuple[list[str], list[str]]:
    """Write `graph`'s parts beside it (sharing its weights file); return their names in order and the
    residual tensors passed between them."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.utils import Extractor

    model = onnx.load(str(prepared / f"{graph}.onnx"), load_external_data=False)
    g = model.graph
    ranges = layer_ranges(layers, parts)
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
    outputs = [o.name for o in g.output]

    def kv(names: list[str], r: range, end: str) -> list[str]:
        return [n for n in names if (m := re.fullmatch(rf"past_(?:key|value)_(\d+)_{end}", n)) and int(m[1]) in r]

    base, names = base_name(graph), []
    for i, r in enumerate(ranges):
        first, last = i == 0, i == parts - 1
        ins = (["input_ids"] if first else [cuts[r[0] - 1]]) + [n for n in SHARED_INPUTS if n in inputs]
        outs = (["logits"] if last else [cuts[r[-1]]]) + kv(outputs, r, "out")
        sub = Extractor(model).extract_model(ins + kv(inputs, r, "in"), outs)
        name = f"{base}_{i + 1}_of_{parts}"
        sub.graph.name = name
        onnx.save(sub, str(prepared / f"{name}.onnx"))
        names.append(name)
    return names, list(cuts.values())


def name_graph(ctx_onnx: Path, name: str) -> None:
    """Rename a compiled graph's QNN graph, inside its context binary and in its EPContext node, to
    `name` padded to the hashed name's length (the name is a length-prefixed string in the binary;
    keeping the length keeps every offset)."""
    import onnx

    from .ort_qnn import context_node

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
    """`GraphFn` over the parts of one graph, run in order, each fed what it names (the KV-cache runner
    sees one graph)."""

    def __init__(self, parts: list[OrtGraph]) -> None:
        self.parts = parts

    @property
    def calls(self) -> int:
        return self.parts[0].calls

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        known: dict[str, Any] = dict(feeds)
        out: dict[str, torch.Tensor] = {}
        for p in self.parts:
            res = p({i.name: known[i.name] for i in p.session.get_inputs()})
            known.update(res)
            out.update(res)
        return out
