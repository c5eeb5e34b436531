"""Compile stage: the quantized graphs -> QNN HTP context binaries, verified on the HTP simulator.

Entry point: `run(quant_dir, adapt_dir, options, out_dir, state) -> CompileResult`.
Back-ends: `ort-qnn` (embedded: onnxruntime-qnn and its x86 HTP simulator) and `qairt` (the QAIRT
SDK's tools, when `QNN_SDK_ROOT` is set; see `qairt.py`). Quantization comes from the quantize stage's
AIMET encodings, never from a calibration of its own.

For the simulator each graph gets its own binary (a weight-shared binary crashes Genie and ORT on x86).
Verification runs the compiled AR-N and AR-1 graphs with the host KV-cache runner over the start of the
eval text and compares them with the same graphs on the CPU, which reproduce the quantsim exactly
(checked on the quantize stage's test vectors here too): the AR-1 steps from the CPU's prompt cache, and the
simulator's prompt cache against that cache.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import layout, parts, stages
from ..errors import UserError
from ..evaluate import load_corpus, max_abs_diff, nll
from ..fsutil import atomic_write_json, link_or_copy
from ..graph import compile_process, embedding_lut, graph_io, lora_inputs, lpbq_matmul, ort_qnn, store
from ..graph.exported import read_test_vectors
from ..graph.kv_cache import Cache, KVCacheRunner
from ..graph.ort_graph import OrtGraph, cpu_session
from ..progress import Laps, StateLike, peak_rss_mb
from ..results import Compiled, CompileResult, IOEncoding, Verification
from ..spawned import Spawned
from ..stage_options import CompileOptions
from ..stages import load_graphs
from ..targets import find_soc
from . import split

FORMAT = stages.COMPILE.format  # bumped in core/stages.py when the output changes meaning
KEEP_SESSIONS_BYTES = 2**30  # verification keeps a graph's sessions open below this much weight
# seconds per weight of one 128-token call on the x86 HTP simulator (SmolLM2-135M: the AR-128 graph took 36 s with
# 134 M int8 weights at w8a16, 187 s with 116 M int4 LPBQ weights and the 28 M int8 LM head at w4a16)
SIM_SECONDS_PER_WEIGHT = {"int8": 0.268e-6, "int4": 1.54e-6}
# below this much weight the graphs compile side by side, each in a process of its own, while the CPU checks run:
# QNN's compile of a graph uses one core (the default model: AR-128 65 s, AR-1 22 s, one after the other); a 1B
# model's compile holds ~6 GB per graph, so those stay one at a time
SIDE_BY_SIDE_BYTES = 2**30


def resolved(options: CompileOptions, quant_dir: Path) -> CompileOptions:
    """`options` with the values the stage comes to in place of its defaults: the target, by default the quantize
    stage's, by its part number; the embedding table in the graphs for qairt. The stage key hashes these, so the
    same work asked for by any front end has one key."""
    update: dict[str, Any] = {"target": find_soc(options.target or stages.QUANTIZE.load(quant_dir).target).soc}
    if options.backend == "qairt":  # the SDK's converter keeps the table in the graph: the record says so
        update["embedding_lut"] = False
    return options.model_copy(update=update)


def _prepare(quant_dir: Path, graphs: list[str], prep: Path, embedding_table_out: bool, state: StateLike
             ) -> dict[str, IOEncoding]:
    """The quantize stage's QDQ graphs made into what QNN compiles (in `prep`): uint16 I/O from the AIMET
    encodings, w4a16's blocks as MatMuls, and the embedding table out of the graphs when Genie is to look it up.
    Returns the graphs' I/O encodings, the same for every graph."""
    prep.mkdir(exist_ok=True)
    link_or_copy(quant_dir / layout.WEIGHTS, prep / layout.WEIGHTS)  # the prepared graphs read these weights
    io: dict[str, IOEncoding] = {}
    with lpbq_matmul.Store(prep).open() as lpbq:  # w4a16's block-quantized layers as the MatMuls QNN takes
        for i, g in enumerate(graphs):
            state.progress(0.05 * i, f"preparing {g}: uint16 I/O from the AIMET encodings")
            enc = graph_io.prepare(quant_dir / f"{g}_qdq.onnx", quant_dir / f"{g}.encodings", prep / f"{g}.onnx",
                                   lpbq)
            _check_same_io(io, enc, g)
            io.update(enc)
    if not lpbq.tensors:
        lpbq.path.unlink()
    if embedding_table_out:  # Genie reads the table's rows from a file on the CPU
        state.progress(0.08, "the embedding table out of the graphs, into Genie's lookup table")
        for i, g in enumerate(graphs):
            rows = embedding_lut.cut(prep / f"{g}.onnx", prep / layout.EMBEDDING_LUT if i == 0 else None)
            _check_same_io(io, {embedding_lut.INPUT: rows}, g)
            io[embedding_lut.INPUT] = rows
        io.pop(embedding_lut.IDS, None)
    _check_kv_tied(io)
    return io


def run(quant_dir: Path, adapt_dir: Path, options: CompileOptions, out_dir: Path, state: StateLike) -> CompileResult:
    if options.backend == "qairt":
        from . import qairt

        if options.parts > 1:
            raise UserError("Splitting a model into parts is built for the ort-qnn back-end only.",
                            "Compile with `--backend ort-qnn`, or without --parts.")

        return qairt.run(quant_dir, options, out_dir, state)
    if options.backend != "ort-qnn":
        raise UserError(f"Unknown compile back-end {options.backend!r}.", "Use `ort-qnn` or `qairt`.")
    qres = stages.QUANTIZE.load(quant_dir)
    target = find_soc(options.target or qres.target)
    graphs = qres.graphs
    lap = Laps()
    steps = lap.steps

    prep = out_dir / layout.PREPARED
    io = _prepare(quant_dir, graphs, prep, options.embedding_lut, state)
    spec, _ = store.load_spec(adapt_dir)
    shapes = load_graphs(quant_dir)
    ars, cl = {s.name: s.ar for s in shapes}, shapes[0].cl
    sizes = split.part_model(prep, graphs, spec, ars, cl)
    limit = int(options.max_part_mb * 2**20)
    ranges = parts.plan(sizes, limit, options.parts)
    lap("prepare")
    shared = options.weight_sharing
    side_by_side = not shared and (os.cpu_count() or 1) > 1 and (prep / layout.WEIGHTS).stat().st_size < \
        SIDE_BY_SIDE_BYTES
    recut: list[str] = []
    checked: dict[str, Any] = {}
    while True:
        names, cut = _cut(prep, graphs, ranges, spec.hidden, ars, state)
        cut_io = io | {name: IOEncoding(dtype="float32") for name in cut}
        try:
            if side_by_side:
                checks = partial(_cpu_checks, quant_dir, adapt_dir, prep, graphs, cut_io, options, names)
                compiled, checked = _compile_side_by_side(prep, out_dir, names, target, options.optimize, state,
                                                          checks)
                lap("compile_side_by_side")
            else:
                compiled = _compile_parts(prep, out_dir, graphs, names, target, shared, options.optimize, state, lap)
            break
        except ort_qnn.GraphTooLarge as e:  # QNN's own estimate is over the HTP's limit: one more part
            if options.parts or len(ranges) == spec.layers:
                raise UserError(f"QNN refused {e.graph}: {e.reason}", "Use a shorter context length (--cl), "
                                "w4a16, or fewer layers per part (more --parts).") from e
            recut.append(f"{e.graph}: {e.reason}; cut into {len(ranges) + 1} parts instead")
            state.progress(0.1, recut[-1])
            _clear(prep, out_dir, names)
            ranges = parts.plan(sizes, limit, len(ranges) + 1)
    n_parts = len(ranges)
    io = cut_io
    estimate = {p: parts.kb(sizes.estimate(r)) for ps in names.values() for p, r in zip(ps, ranges, strict=True)}
    for c in compiled:
        c.estimated_alloc_kb = estimate[c.graph]

    verification = Verification()
    if options.verify_tokens > 0:
        if "vectors" not in checked:
            state.progress(0.45, "checking the prepared graphs against the quantsim's test vectors")
            checked["vectors"] = _check_vectors(quant_dir, prep, graphs, io)
            lap("verify_vectors")
        verification.vs_quantsim_test_vectors = checked["vectors"]
        if shared:
            verification.simulator = ("not run: weight-shared binaries do not load on the x86 HTP simulator "
                                      "(they are for a phone)")
        else:
            on_sim = verify_on_simulator(quant_dir, adapt_dir, prep, out_dir, graphs, io, target, options,
                                         state.sub(0.5, 1.0), names, cpu=checked.get("cpu"))
            verification = Verification.model_validate(verification.model_dump() | on_sim)
            lap("verify_simulator")
    res = CompileResult(backend="ort-qnn", target=target.soc, soc_model=target.soc_model,
                        dsp_arch=target.dsp_arch, optimize=options.optimize,
                        graphs=compiled, parts=n_parts, weight_shared=shared, recut=recut,
                        nodes_on_cpu=sum(len(c.nodes_on_cpu) for c in compiled), io=io,
                        verification=verification, steps=steps, peak_rss_mb=round(peak_rss_mb()),
                        step_peak_rss_mb=lap.peaks)
    atomic_write_json(out_dir / layout.COMPILE_RESULT, res.model_dump())
    return res


def _cut(prep: Path, graphs: list[str], ranges: list[range], hidden: int, ars: dict[str, int],
         state: StateLike) -> tuple[dict[str, list[str]], list[str]]:
    """Each graph's part names (the graph itself when one part is enough) and the tensors passed between parts."""
    if len(ranges) == 1:
        return {g: [g] for g in graphs}, []
    names: dict[str, list[str]] = {}
    cut: list[str] = []
    for g in graphs:
        state.progress(0.08, f"splitting {g} into {len(ranges)} parts")
        names[g], cut = split.split(prep, g, ranges, hidden, ars[g])
    return names, cut


def _clear(prep: Path, out_dir: Path, names: dict[str, list[str]]) -> None:
    """Drop a cut that QNN refused: its part graphs and whatever was compiled from them."""
    for ps in names.values():
        for p in ps:
            if p not in names:  # a part, not the whole graph
                (prep / f"{p}.onnx").unlink(missing_ok=True)
            for f in out_dir.glob(f"{p}*"):
                f.unlink()


def _compile_parts(prep: Path, out_dir: Path, graphs: list[str], names: dict[str, list[str]], target: Any,
                   shared: bool, optimize: str, state: StateLike, lap: Laps) -> list[Compiled]:
    """Compile every part of every graph, part by part (the prompt and token graph of a part together, so a
    weight-shared binary holds both); name the QNN graphs inside the binaries when there are several parts."""
    n_parts = len(names[graphs[0]])
    compiled: list[Compiled] = []
    hold: list[Any] = []  # the sessions of a context being shared, until its last graph
    todo = [(names[g][i], ("last" if g == graphs[-1] else "on") if shared else "")
            for i in range(n_parts) for g in graphs]
    for i, (g, share) in enumerate(todo):
        state.check()
        state.progress(0.1 + 0.3 * i / len(todo), f"compiling {g} for {target.soc} ({target.dsp_arch})")
        c = ort_qnn.compile_graph(prep / f"{g}.onnx", g, out_dir, target, share, hold, optimize)
        _refuse_cpu_nodes(g, c)
        compiled.append(c)
        lap(f"compile_{g}")
        if share == "on":
            continue  # a shared binary is written when its part's last graph is compiled
        hold.clear()
        for m in compiled[-len(graphs):] if share else [c]:
            m.bin_bytes = c.bin_bytes
            if n_parts > 1:  # Genie orders the parts by the QNN graph names inside the binaries
                split.name_graph(out_dir / m.context_onnx, m.graph)
    return compiled


def _compile_side_by_side(prep: Path, out_dir: Path, names: dict[str, list[str]], target: Any, optimize: str,
                          state: StateLike, checks: Callable[[], dict[str, Any]] | None
                          ) -> tuple[list[Compiled], dict[str, Any]]:
    """Every part of every graph compiled at once, each in a process of its own, while `checks` (the CPU-side
    verification, which needs no binary) runs here; the compiled graphs in part order, and what `checks` found."""
    n_parts = len(next(iter(names.values())))
    todo = [names[g][i] for i in range(n_parts) for g in names]
    state.progress(0.1, f"compiling {', '.join(todo)} side by side for {target.soc} ({target.dsp_arch})")
    # the prompt graph's compile is the long one (AR-128 activations): the token graph's yields the CPU to it
    # (default model, side by side with the CPU checks: 37.9 and 41.1 s at equal priority, 34.7 and 31.5 s so)
    prompts = set(next(iter(names.values())))
    running = [compile_process.Running(prep / f"{g}.onnx", g, out_dir, target, optimize, 0 if g in prompts else 5)
               for g in todo]
    try:
        found = checks() if checks else {}
        compiled = [r.result(state) for r in running]
    finally:
        for r in running:
            r.stop()
    for g, c in zip(todo, compiled, strict=True):
        _refuse_cpu_nodes(g, c)
        if n_parts > 1:  # Genie orders the parts by the QNN graph names inside the binaries
            split.name_graph(out_dir / c.context_onnx, c.graph)
    return compiled, found


def _cpu_checks(quant_dir: Path, adapt_dir: Path, prep: Path, graphs: list[str], io: dict[str, IOEncoding],
                o: CompileOptions, names: dict[str, list[str]]) -> dict[str, Any]:
    """The verification's CPU half: the prepared graphs against the quantsim's test vectors, and the simulator
    check's reference run, over the same CPU sessions (opening one takes ~2.5 s on the default model; below
    SIDE_BY_SIDE_BYTES, which this runs under, the sessions are kept open anyway)."""
    if o.verify_tokens <= 0:
        return {}
    session = functools.cache(cpu_session)
    return {"vectors": _check_vectors(quant_dir, prep, graphs, io, session),
            "cpu": _on_cpu(_VerifyText(quant_dir, adapt_dir, o), prep, graphs, io, names, session)}


def _refuse_cpu_nodes(g: str, c: Compiled) -> None:
    if c.nodes_on_cpu:
        listing = "; ".join(f"{n.op_type} {n.name}" + (f" ({n.reason})" if n.reason else "")
                            for n in c.nodes_on_cpu[:10])
        raise UserError(f"{len(c.nodes_on_cpu)} nodes of {g} would run on the CPU, not the NPU: {listing}.",
                        "These ops have no quantized HTP implementation as exported; report this model.")


def _check_same_io(seen: dict[str, IOEncoding], new: dict[str, IOEncoding], graph: str) -> None:
    """Genie refuses graphs whose same-named tensors are quantized differently (AR-N vs AR-1)."""
    for name, enc in new.items():
        if name in seen and seen[name] != enc:
            raise UserError(f"{name} is quantized differently in {graph} ({enc}) than in the other graph "
                            f"({seen[name]}).", "Re-run the quantize stage: both graphs come from one quantsim.")


def _check_kv_tied(io: dict[str, IOEncoding]) -> None:
    for name, enc in io.items():
        if name.startswith("past_") and name.endswith("_in"):
            out = io.get(name[:-3] + "_out")
            if out is not None and out != enc:
                raise UserError(f"{name} and its _out are quantized differently ({enc} vs {out}).",
                                "Re-run the quantize stage: the KV cache needs tied encodings.")


def _check_vectors(quant_dir: Path, prep: Path, graphs: list[str], io: dict[str, IOEncoding],
                   session: Callable[[Path], Any] = cpu_session) -> dict[str, float]:
    """The prepared graph on the CPU, fed the test-vector inputs, against the quantsim's outputs."""
    out = {}
    for g in graphs:
        tv = read_test_vectors(quant_dir / layout.TEST_VECTORS / f"{g}.npz")
        graph = OrtGraph(session(prep / f"{g}.onnx"), io, prep / layout.EMBEDDING_LUT)
        got = graph({k: torch.from_numpy(v) for k, v in tv["in"].items()})
        ref = torch.from_numpy(tv["quant"]["logits"])
        out[f"{g}_max_abs_logit_diff"] = round(max_abs_diff(got["logits"][0], ref[0]), 5)
        out[f"{g}_top1_agreement"] = round(float((got["logits"].argmax(-1) == ref.argmax(-1)).float().mean()), 4)
    return out


class _VerifyText:
    """The start of the eval text and what the host KV-cache runner needs to score it through compiled graphs."""

    def __init__(self, quant_dir: Path, adapt_dir: Path, o: CompileOptions) -> None:
        from transformers import AutoTokenizer

        self.spec, self.inv_freq = store.load_spec(adapt_dir)
        slots = lora_inputs.saved_slots(adapt_dir)  # switchable LoRA adapters: verified as the base (all zeros)
        self.extra = lora_inputs.values(slots, None) if slots else {}
        prompt_spec = load_graphs(quant_dir)[0]
        self.ar_n, self.cl = prompt_spec.ar, prompt_spec.cl
        tok = AutoTokenizer.from_pretrained(str(quant_dir), trust_remote_code=False)
        n = min(o.verify_tokens + o.verify_decode, self.cl - self.ar_n)
        self.ids: list[int] = tok(load_corpus(o.eval_corpus, "eval"))["input_ids"][:n]
        if len(self.ids) < 2:
            raise UserError("The verification text is shorter than two tokens.", "Use a longer eval corpus.")
        self.decode = min(o.verify_decode, len(self.ids) - 1)

    def prefill(self, graph: str, make: Callable[[str], Any]) -> tuple[_Scored, Cache]:
        """The prompt graph over the text but its last `decode` tokens, in AR-N chunks from an empty cache, and the
        cache it leaves."""
        fns = split.OneAtATime({self.ar_n: partial(make, graph)})
        runner = KVCacheRunner(self.spec, self.cl, fns.graphs(), self.inv_freq)
        runner.extra = self.extra
        logits = runner.prefill(self.ids[:len(self.ids) - self.decode])
        cache = runner.snapshot()
        fns.release()
        return _Scored(self.ar_n, logits, fns.per_call()[self.ar_n]), cache

    def steps(self, graph: str, make: Callable[[str], Any], cache: Cache) -> _Scored:
        """The token graph's AR-1 steps over the last `decode` tokens, going on from `cache`."""
        fns = split.OneAtATime({1: partial(make, graph)})
        runner = KVCacheRunner(self.spec, self.cl, fns.graphs(), self.inv_freq)
        runner.extra = self.extra
        runner.resume(cache)
        logits = torch.cat([runner.step([t], 1) for t in self.ids[len(self.ids) - self.decode:]])
        fns.release()
        return _Scored(1, logits, fns.per_call()[1])


@dataclass
class _Scored:
    """One graph's part of a verification run."""

    ar: int
    logits: torch.Tensor
    seconds_per_call: float


@dataclass
class _Run:
    """The verification text through both graphs: the prompt graph's chunks, then the token graph's steps."""

    prompt: _Scored
    cache: Cache  # what the prompt graph left: where the token graph's steps go on from
    steps: _Scored | None

    @property
    def logits(self) -> torch.Tensor:
        return torch.cat([self.prompt.logits] + ([self.steps.logits] if self.steps else []))

    def per_call(self) -> dict[int, float]:
        """Seconds per call of each graph, by its AR."""
        return {s.ar: s.seconds_per_call for s in (self.prompt, self.steps) if s}


def _chains(folder: Path, names: dict[str, list[str]], keep: bool, open_part: Callable[[Path], OrtGraph]
            ) -> Callable[[str], split.Chain]:
    """A graph as the chain of its parts' sessions (opened when first called)."""
    return lambda g: split.Chain([partial(open_part, folder / f"{p}.onnx") for p in names[g]], keep)


def _graph_names(graphs: list[str], parts: dict[str, list[str]] | None) -> dict[str, list[str]]:
    return {g: (parts or {}).get(g, [g]) for g in graphs}


def _keep_sessions(prep: Path) -> bool:
    """A large model's parts are opened one at a time, per call (the CPU session of a 1B graph alone holds several
    GB); a small one keeps its sessions open between calls."""
    return (prep / layout.WEIGHTS).stat().st_size < KEEP_SESSIONS_BYTES


def _on_cpu(text: _VerifyText, prep: Path, graphs: list[str], io: dict[str, IOEncoding],
            parts: dict[str, list[str]] | None, session: Callable[[Path], Any] = cpu_session) -> _Run:
    """The verification text through the prepared graphs on the CPU (= the quantsim), the token graph's steps
    going on from the prompt graph's cache."""
    lut = prep / layout.EMBEDDING_LUT
    make = _chains(prep, _graph_names(graphs, parts), _keep_sessions(prep), lambda f: OrtGraph(session(f), io, lut))
    prompt, cache = text.prefill(graphs[0], make)
    return _Run(prompt, cache, text.steps(graphs[1], make, cache) if text.decode else None)


def _simulator(out_dir: Path, names: dict[str, list[str]], keep: bool, io: dict[str, IOEncoding], target: Any
               ) -> Callable[[str], split.Chain]:
    lut = out_dir / layout.PREPARED / layout.EMBEDDING_LUT
    return _chains(out_dir, names, keep, lambda f: OrtGraph(ort_qnn.context_session(f, target), io, lut))


def _steps_on_simulator(text: _VerifyText, graph: str, out_dir: Path, names: dict[str, list[str]], keep: bool,
                        io: dict[str, IOEncoding], target: Any, cache: Cache) -> _Scored:
    """The token graph's steps on the HTP simulator (in a process of its own: see `verify_on_simulator`)."""
    return text.steps(graph, _simulator(out_dir, names, keep, io, target), cache)


def verify_on_simulator(quant_dir: Path, adapt_dir: Path, prep: Path, out_dir: Path, graphs: list[str],
                        io: dict[str, IOEncoding], target: Any, o: CompileOptions, state: StateLike,
                        parts: dict[str, list[str]] | None = None, cpu: _Run | None = None) -> dict[str, Any]:
    """The compiled graphs (each as its `parts`, run in turn) on the HTP simulator against the prepared graphs on
    the CPU (= the quantsim; `cpu`: that run when done already), through the host KV-cache runner over the start
    of the eval text: NLL, top-1, max |Δlogit|, and the prompt graph's KV cache against the quantsim's.

    Each graph is checked from the quantsim's inputs: the token graph's steps go on from the CPU's prompt cache,
    and the simulator's prompt cache is compared with that cache directly (in quantization steps), which checks
    the hand-over between the graphs. So the token graph's steps need not wait for the prompt graph's: below
    KEEP_SESSIONS_BYTES, on more than one core, they run in a process of their own at the same time (the
    simulator runs one call at a time per process; default model: 56 -> 39-46 s)."""
    text = _VerifyText(quant_dir, adapt_dir, o)
    names, keep = _graph_names(graphs, parts), _keep_sessions(prep)
    prompt_s = prompt_seconds_on_simulator(prep, names[graphs[0]])
    if prompt_s > o.prompt_check_budget_s and text.decode:
        return _token_steps_only(text, prep, out_dir, graphs, names, keep, io, target, state, prompt_s, cpu)
    if cpu is None:
        state.progress(0.0, f"running {len(text.ids)} tokens through the graphs on the CPU")
        cpu = _on_cpu(text, prep, graphs, io, parts)
        state.check()
    state.progress(0.5, f"running {len(text.ids)} tokens through the graphs on the HTP simulator (slow)")
    beside = text.decode > 0 and keep and (os.cpu_count() or 1) > 1
    child = Spawned(partial(_steps_on_simulator, text, graphs[1], out_dir, names, keep, io, target, cpu.cache),
                    f"the simulator run of {graphs[1]}") if beside else None
    try:
        sim = _simulator(out_dir, names, keep, io, target)
        prompt, cache = text.prefill(graphs[0], sim)
        state.check()
        steps = child.result(state) if child else text.steps(graphs[1], sim, cpu.cache) if text.decode else None
        state.check()
    finally:
        if child:
            child.stop()
    htp = _Run(prompt, cache, steps)
    ids = text.ids
    c, h = cpu.logits, htp.logits
    nll_cpu, nll_htp = nll(c, ids) / (len(ids) - 1), nll(h, ids) / (len(ids) - 1)
    return {"tokens": len(ids), "prefill_ar": text.ar_n, "decode_steps": text.decode,
            "nll_quantsim_cpu": round(nll_cpu, 5), "nll_htp": round(nll_htp, 5),
            "nll_diff": round(nll_htp - nll_cpu, 5),
            "top1_agreement": round(float((c.argmax(-1) == h.argmax(-1)).float().mean()), 4),
            "max_abs_logit_diff": round(max_abs_diff(c, h), 4),
            "kv_cache_max_diff_steps": _cache_diff_steps(htp.cache, cpu.cache, io),
            "seconds_per_call_htp": htp.per_call(), "seconds_per_call_cpu": cpu.per_call()}


def prompt_seconds_on_simulator(prep: Path, part_names: list[str]) -> float:
    """The estimated seconds of one call of the prompt graph (all its parts) on the x86 HTP simulator, from its
    int4 (LPBQ) and other quantized weights (`SIM_SECONDS_PER_WEIGHT`)."""
    import math

    import onnx

    total = 0.0
    for name in part_names:
        model = onnx.load(str(prep / f"{name}.onnx"), load_external_data=False)
        for t in model.graph.initializer:
            n = math.prod(t.dims) if len(t.dims) else 1
            if t.data_type == onnx.TensorProto.INT4:
                total += n * SIM_SECONDS_PER_WEIGHT["int4"]
            elif t.data_type == onnx.TensorProto.INT8:
                total += n * SIM_SECONDS_PER_WEIGHT["int8"]
    return total


def _token_steps_only(text: _VerifyText, prep: Path, out_dir: Path, graphs: list[str], names: dict[str, list[str]],
                      keep: bool, io: dict[str, IOEncoding], target: Any, state: StateLike, prompt_s: float,
                      on_cpu: _Run | None) -> dict[str, Any]:
    """The bounded check: the prompt graph only on the CPU (`on_cpu` when that ran already), and the token graph's
    steps on the simulator going on from that (quantsim) cache, scored over those steps alone."""
    if on_cpu is None or on_cpu.steps is None:
        state.progress(0.0, f"prompt graph over {len(text.ids) - text.decode} tokens on the CPU")
        on_cpu = _on_cpu(text, prep, graphs, io, {g: names[g] for g in graphs})
        state.check()
    cpu, cache = on_cpu.steps, on_cpu.cache
    assert cpu is not None
    state.progress(0.5, f"the token graph's {text.decode} steps on the HTP simulator (slow)")
    htp = text.steps(graphs[1], _simulator(out_dir, names, keep, io, target), cache)
    ids = text.ids[len(text.ids) - text.decode:]
    c, h = cpu.logits, htp.logits
    nll_cpu, nll_htp = nll(c, ids) / max(1, len(ids) - 1), nll(h, ids) / max(1, len(ids) - 1)
    return {"simulator": f"the prompt graph was compiled but not run on the simulator (its one call is estimated at "
                         f"{prompt_s / 60:.0f} min there, over --prompt-check-budget): the token graph's "
                         f"{text.decode} steps were checked, going on from the quantsim's prompt cache",
            "tokens": len(ids), "prefill_ar": text.ar_n, "decode_steps": text.decode,
            "nll_quantsim_cpu": round(nll_cpu, 5), "nll_htp": round(nll_htp, 5),
            "nll_diff": round(nll_htp - nll_cpu, 5),
            "top1_agreement": round(float((c.argmax(-1) == h.argmax(-1)).float().mean()), 4),
            "max_abs_logit_diff": round(max_abs_diff(c, h), 4),
            "seconds_per_call_htp": {1: htp.seconds_per_call}, "seconds_per_call_cpu": {1: cpu.seconds_per_call}}


def _cache_diff_steps(got: Cache, ref: Cache, io: dict[str, IOEncoding]) -> float:
    """The largest difference between two caches' entries, in quantization steps of the graph's KV outputs."""
    worst = 0.0
    for kind, tensors in (("key", zip(got.k, ref.k, strict=True)), ("value", zip(got.v, ref.v, strict=True))):
        for i, (a, b) in enumerate(tensors):
            worst = max(worst, float((a - b).abs().max()) / io[f"past_{kind}_{i}_out"].scale)
    return round(worst, 2)
