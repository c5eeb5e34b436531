"""What GenieX needs to find and load a bundle, written into the same metadata.json Genie's bundle carries.

GenieX (Qualcomm's successor to Genie) loads the same QNN context binaries through its own pipeline, and detects a
model only by metadata.json: a `model_id` whose prefix picks the pipeline, and `model_files`, one entry per
compiled graph (`[phase_]arN_clM_S_of_T`) with its inputs and outputs (shape, dtype, quantization). It reads the
binaries, tokens, RoPE and sampler from genie_config.json as Genie does. NPU Studio's own fields stay beside
these in the one file (GenieX reads only its keys; ours do not collide), so bundles made before stay readable.

Shapes are the graphs' own, but for the KV cache: GenieX reads its head count from a key's first axis and its
head size from the third ([heads, 1, head_dim, kv_len]; values [heads, 1, kv_len, head_dim]), where our graphs
put the batch of 1 first ([1, heads, ...]). The two layouts are the same bytes, so the cache is described in
GenieX's order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..models import ArchCard
from ..results import CompileResult, IOEncoding

# model_type -> GenieX's pipeline prefix (its models/dispatch.h). The pipelines are the same spec-driven decoder for
# these (the RoPE and tokens from genie_config.json); Qwen2 is Qwen2.5's architecture, Phi-3 Phi-3.5's.
PIPELINES = {"llama": "llama_v3_", "qwen2": "qwen2_5_", "qwen3": "qwen3_", "phi3": "phi_3_5_"}
_KV = re.compile(r"past_(key|value)_\d+_(in|out)")
_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 10: "float16"}


def model_id(card: ArchCard) -> str | None:
    """GenieX's `model_id` for this model, or None where GenieX has no pipeline for its architecture."""
    prefix = PIPELINES.get(card.model_type)
    if prefix is None:
        return None
    name = Path(str(card.source).split(" (")[0].rstrip("/\\")).name or card.model_type  # "X (embedded default)"
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or card.model_type
    return prefix + slug


def metadata(card: ArchCard, comp: CompileResult, compile_dir: Path, graphs: list[str]) -> dict[str, Any]:
    """The keys GenieX reads in metadata.json, for the compiled graphs the bundle holds (`graphs`)."""
    files = {g: _graph_io(compile_dir / "prepared" / f"{g}.onnx", comp.io) for g in graphs}
    out: dict[str, Any] = {"model_files": files, "genie": {"supports_vision": False}}
    if (mid := model_id(card)) is not None:
        out["model_id"] = mid
    return out


def note(card: ArchCard, drafted: bool = False) -> str | None:
    """What a person should know when GenieX cannot load the bundle."""
    if drafted:
        return ("GenieX runs one engine, not Genie's draft-model dialog: this bundle is for Genie (metadata.json "
                "names no GenieX model_id). A bundle without --draft loads in both.")
    if card.model_type in PIPELINES:
        return None
    return (f"GenieX has no pipeline for the {card.family} architecture ({card.model_type}): this bundle runs on "
            f"Genie; GenieX would not load it (it loads {', '.join(sorted(PIPELINES))} models).")


def _graph_io(onnx_file: Path, io: dict[str, IOEncoding]) -> dict[str, Any]:
    import onnx

    model = onnx.load(str(onnx_file), load_external_data=False)  # the graph's I/O only, not its weights

    def tensor(v: Any) -> dict[str, Any]:
        shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
        if _KV.fullmatch(v.name) and len(shape) == 4 and shape[0] == 1:
            shape = [shape[1], 1, shape[2], shape[3]]
        enc = io.get(v.name)
        entry: dict[str, Any] = {"shape": shape,
                                 "dtype": enc.dtype if enc else _ONNX_DTYPES.get(v.type.tensor_type.elem_type, "?")}
        if enc is not None and enc.dtype != "int32":
            entry["quantization_parameters"] = {"scale": enc.scale, "offset": -enc.zero_point}
        return entry

    return {"inputs": {v.name: tensor(v) for v in model.graph.input},
            "outputs": {v.name: tensor(v) for v in model.graph.output}}
