"""Quantize stage: calibrate the adapted graphs with aimet-torch, measure perplexity live, export for the compilers.

Entry point: `run(adapt_dir, options, out_dir, state) -> QuantizeResult`. Steps: FP reference over the
eval text (points labelled "fp"), quantsim built for the preset and target arch, the recipe's weight-encoding
algorithms (aimet's AdaScale, SeqMSE), weights folded, activation encodings calibrated through the same host
KV-cache runner Genie's loop mirrors (AR-N prefill + AR-1 steps), quantized evaluation (points labelled
"quant"), then export.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import compute, forked, layout, stages
from ..errors import UserError
from ..evaluate import (
    DEFAULT_WINDOW,
    Comparison,
    EvalPlan,
    LogitsFn,
    Reference,
    auto_eval_tokens,
    compare,
    eval_ids,
    load_corpus,
    read_plan,
)
from ..forked import Forked
from ..fsutil import atomic_write_json
from ..graph import lora_inputs, store
from ..graph.decoder import io_names
from ..graph.exported import write_test_vectors
from ..graph.half_weights import widen_while_computing
from ..graph.kv_cache import KVCacheRunner, TorchGraph
from ..progress import Laps, StateLike, peak_rss_mb, trim_heap
from ..recipe_rules import refusal
from ..results import AdapterKept, QuantizeResult
from ..shape import DecoderShape
from ..stage_options import RECIPE_STEPS, ROTATION_STEPS, QuantizeOptions, rotates, widens
from ..stages import load_card, load_graphs
from ..targets import find_soc
from . import adascale, export, int8_budget, omniquant, simulate, spinquant
from .fast_qdq import fast_fake_quantize
from .layer_training import Prefill
from .presets import check_overrides, int8_budget_of, preset, takes_4bit_head, takes_int8_budget, with_head

# bumped when the exported graphs change shape or meaning: an older stage output is then redone
FORMAT = stages.QUANTIZE.format  # bumped in core/stages.py when the output changes meaning
# the tokenizer, and the graphs' names and I/O (the exported graphs are the adapted ones, quantized)
COPIED_FILES = (layout.TOKENIZER, "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                layout.GRAPHS)


@compute.plain_convolutions
@fast_fake_quantize()
def run(adapt_dir: Path, options: QuantizeOptions, out_dir: Path, state: StateLike) -> QuantizeResult:
    pre, target = with_head(preset(options.precision), options.lm_head_bits), find_soc(options.target)
    lap = Laps()

    state.progress(0.0, "loading the adapted model")
    simulate.import_aimet()  # before the model exists: see import_aimet
    device = compute.resolve(options.device)
    # a 16-bit checkpoint's weights stay 16-bit (and fold into their integer codes) unless a recipe step rewrites
    # or trains them; each module computes in float32 (graph/half_weights.py), for the model's life: it is this
    # stage's alone, and is let go before the export's last pass
    model, inv_freq = store.load(adapt_dir, widen=widens(options.recipe))
    widen_while_computing(model)
    validate(options, model.spec)
    check_overrides(options.overrides, model)  # before any calibration: a typo must not cost a run
    model.to(device)
    ar, cl, graph_list = adapt_graphs(adapt_dir)
    spec = model.spec
    plan = _eval_plan(adapt_dir, options, cl)
    reference = _reference(adapt_dir, plan)
    ids = reference.ids if reference else eval_ids(_tokenizer(adapt_dir), plan)
    calib = calibration(adapt_dir, options)
    lap("load")
    if "spinquant" in RECIPE_STEPS[options.recipe]:
        state.progress(0.01, "SpinQuant: rotating the float weights (aimet-torch)")
        spinquant.apply(model)
        lap("spinquant")

    adapters = lora_inputs.saved_values(adapt_dir)  # switchable LoRA adapters: the inputs each fills
    base_inputs = lora_inputs.values(lora_inputs.saved_slots(adapt_dir), None) if adapters else {}

    def runner(m: torch.nn.Module) -> KVCacheRunner:
        r = KVCacheRunner.over(m, ar, cl, inv_freq)
        r.extra = base_inputs  # the base model: the eval and every recipe step run it
        return r

    fp_run = runner(model)
    fp_ref, ref = _fp_reference(adapt_dir, fp_run, ids, reference, plan, state)
    del reference  # its mapping of the logits file: the quantized eval reads them afresh
    vectors = _vector_feeds(fp_run, calib[0], ar)
    fp_out = [TorchGraph(model)(f) for f in vectors]
    lap("fp_reference")
    overrides, kept = options.overrides, None
    if budget := int8_budget_of(options.precision, options.int8_budget):
        kept = int8_budget.choose(model, partial(fp_run.score, decode_tokens=0), calib, ar, pre, budget,
                                  options.overrides, state.sub(0.15, 0.19))
        overrides = kept.overrides(options.overrides)
        lap("int8_budget")

    state.progress(0.19, f"building the {pre.name} quantsim for {target.soc} ({target.dsp_arch})")
    dummy = tuple(vectors[0][n].to(device) for n in io_names(spec.layers, model.extra_inputs)[0])  # where it is
    sim = simulate.build(model, dummy, pre, target, overrides, adapters)
    del dummy  # the prompt graph's feeds (its KV inputs: ~60 MB on a 1B model) go with the export's first graph
    lap("build_sim")
    _apply_recipe(sim, calib, runner, options, device, state, lap)
    sim.model.to(device)  # the quantizers a recipe replaced were made on the CPU: where the model is
    state.check()
    state.progress(0.45, "quantizing weights")
    simulate.fold(sim)
    lap("fold_weights")
    state.progress(0.5, f"calibrating activations on {sum(map(len, calib))} tokens")
    q_run = runner(sim.model)
    beside = forked.worth_forking(sim.model, device)
    sim.compute_encodings(partial(_calibrate, sim=sim, q_run=q_run, calib=_with_adapters(calib, adapters),
                                  decode=options.calib_decode, beside=beside, state=state), None)
    q_run.extra = base_inputs  # the eval's: the base model
    lap("calibrate")

    # from here on the large objects are held by `held` alone, so that the export can let them go
    held = _Held(model, sim, fp_run, q_run, vectors, fp_out, fp_ref, ref)
    del model, sim, fp_run, q_run, vectors, fp_out, fp_ref
    cmp, files = _evaluate_and_export(held, adapt_dir, ids, plan, options, graph_list, beside, out_dir, state, lap)
    rows = export.write_manifest(out_dir, files) if files else []
    lora_kept = _lora_kept(out_dir / f"{graph_list[-1]}.encodings", adapt_dir)
    res = QuantizeResult(
        precision=pre.name, target=target.soc, dsp_arch=target.dsp_arch, recipe=options.recipe,
        rotated=rotates(options.recipe), lm_head_bits=overrides.weight_bits("lm_head", pre.head_bits),
        kept_int8=kept.kept if kept else [], int8_share=kept.share if kept else None,
        ppl_fp=cmp.ref_ppl, ppl_quant=cmp.test_ppl, ratio=cmp.test_ppl / cmp.ref_ppl,
        top1_agreement=cmp.top1_agreement, max_abs_logit_diff=cmp.max_abs_logit_diff, eval_tokens=cmp.tokens,
        calib_tokens=sum(map(len, calib)), per_window=cmp.per_window, graphs=graph_list, files=rows,
        steps=lap.steps, peak_rss_mb=round(peak_rss_mb()), step_peak_rss_mb=lap.peaks, device=device,
        lora_kept=lora_kept)
    atomic_write_json(out_dir / layout.QUANTIZE_RESULT, res.model_dump())
    state.progress(1.0, f"{pre.name}: PPL {res.ppl_quant:.3f} vs FP {res.ppl_fp:.3f} (×{res.ratio:.4f})")
    return res


def _lora_kept(enc_file: Path, adapt_dir: Path) -> list[AdapterKept]:
    """What the quantized weights kept of each merged LoRA adapter; none where the adapter files are not at hand
    (a cluster worker has the adapt stage, not the adapters): the inspector reads them where they are."""
    from .. import lora_effect

    if not lora_effect.merged(adapt_dir) or not enc_file.is_file():
        return []
    try:
        return lora_effect.kept(lora_effect.effects(enc_file, adapt_dir))
    except UserError:
        return []


def _fp_reference(adapt_dir: Path, fp_run: KVCacheRunner, ids: list[int], reference: Reference | None,
                  plan: EvalPlan, state: StateLike) -> tuple[LogitsFn, list[torch.Tensor]]:
    """The float model's logits over the eval text, for the quantized eval: the adapt stage's when it scored the
    same text, else scored here and kept in the returned list (the model is quantized in place afterwards)."""
    ref: list[torch.Tensor] = []
    if reference:
        state.progress(0.02, "FP reference: the adapt stage's logits")
        compare(ids, reference, window=plan.window, state=state.sub(0.02, 0.05), labels=("fp", "quant"))
        return Reference(adapt_dir), ref
    state.progress(0.02, "FP reference")

    def fp_logits(w: Sequence[int]) -> torch.Tensor:
        ref.append(fp_run.score(w, plan.decode_tokens))
        return ref[-1]

    compare(ids, fp_logits, window=plan.window, state=state.sub(0.02, 0.15), labels=("fp", "quant"))
    it = iter(ref)
    return (lambda _w: next(it)), ref


def _apply_recipe(sim: Any, calib: list[list[int]], runner: Callable[[torch.nn.Module], KVCacheRunner],
                  options: QuantizeOptions, device: str, state: StateLike, lap: Laps) -> None:
    """The recipe's weight-encoding steps on the quantsim (AdaScale, OmniQuant, SeqMSE), between 0.2 and 0.45 of
    the stage, a share each."""

    def prefill(m: torch.nn.Module, ids: Sequence[int]) -> None:
        """One calibration sequence through `m` as Genie feeds it: what every recipe's layer capture runs."""
        runner(m).prefill(ids)

    steps = tuple(s for s in RECIPE_STEPS[options.recipe] if s not in ROTATION_STEPS)
    for i, step in enumerate(steps):
        share = state.sub(0.2 + 0.25 * i / len(steps), 0.2 + 0.25 * (i + 1) / len(steps))
        with compute.seeded(options.seed, device):
            if step == "adascale":
                adascale.apply(sim, calib, prefill, options.adascale_iterations, share)
            elif step == "omniquant":
                omniquant.apply(sim, calib, prefill, options.omniquant_iterations, share)
            else:
                share.progress(0.0, "SeqMSE: searching weight encodings layer by layer")
                _seq_mse(sim, calib, prefill, options)
        lap(step)


Run = tuple[list[int], dict[str, torch.Tensor] | None]  # a calibration sequence, and the extra inputs it runs with


def _with_adapters(calib: list[list[int]], adapters: dict[str, dict[str, torch.Tensor]]) -> list[Run]:
    """Each sequence with one switchable adapter's inputs in turn (each adapter at least once): the encodings of
    what the adapters' branches compute then hold every adapter's range."""
    if not adapters:
        return [(seq, None) for seq in calib]
    inputs = list(adapters.values())
    return [(calib[k % len(calib)], inputs[k % len(inputs)]) for k in range(max(len(calib), len(inputs)))]


def _calibrate(_model: torch.nn.Module, _args: object, *, sim: Any, q_run: KVCacheRunner, calib: list[Run],
               decode: int, beside: bool, state: StateLike) -> None:
    """AIMET's forward pass: the activation encodings observed on the calibration sequences; with a core to spare,
    the second half of them in a forked copy of this process, the first here, each on one core, the copy's observed
    minima and maxima then merged into these (the same encodings: min/max merge exactly)."""
    observers = simulate.min_max_observers(sim.model) if beside and len(calib) > 1 else None
    if observers is None:
        _calibrate_on(q_run, calib, decode, state, 0.5, 0.6)
        return
    half = (len(calib) + 1) // 2
    with tempfile.TemporaryDirectory(prefix="npustudio-calibration-") as tmp:
        seen = str(Path(tmp) / "observed.safetensors")
        child = Forked(partial(_calibrate_part, q_run, calib[half:], decode, observers, seen),
                       "the calibration of the second half")
        try:
            with forked.one_thread():
                _calibrate_on(q_run, calib[:half], decode, state, 0.5, 0.6)
            child.result(state)
        finally:
            child.stop()
        simulate.merge_observed(observers, seen)


@dataclass
class _Held:
    """The stage's large objects after calibration, held here alone: the export lets them go (`release`) before
    its last pass, which is what keeps a 1B model's quantize within 7 GB."""

    model: torch.nn.Module
    sim: Any
    fp_run: KVCacheRunner
    q_run: KVCacheRunner
    vectors: list[dict[str, torch.Tensor]]  # each graph's feeds, and the float model's outputs on them
    fp_out: list[dict[str, torch.Tensor]]
    fp_ref: LogitsFn
    ref: list[torch.Tensor]

    def release(self) -> None:
        """The models and what holds them (the runners hold the model, the closures the runners) let go."""
        del self.sim, self.model, self.fp_run, self.q_run, self.vectors, self.fp_out


def _evaluate_and_export(held: _Held, adapt_dir: Path, ids: list[int], plan: EvalPlan, options: QuantizeOptions,
                         graph_list: list[str], beside: bool, out_dir: Path, state: StateLike, lap: Laps
                         ) -> tuple[Comparison, list[Path]]:
    """The quantized model's eval against the float reference, and the export of its graphs (in forked copies
    beside the eval when there is a core to spare, else after it): the comparison and the files written."""
    label = "quant" if options.recipe == "plain" else f"quant+{options.recipe}"
    if options.export:
        (out_dir / layout.TEST_VECTORS).mkdir(exist_ok=True)
    exports: list[Forked] = []
    if options.export and beside:
        # each graph exported in a forked copy of this process while this one evaluates: the traces are
        # single-threaded (default model, 2 cores: the evaluation then the export took 62 s, side by side 40 s)
        state.progress(0.6, "exporting the graphs beside the evaluation")
        exports = [Forked(partial(_export_graph, held.sim, f, fo, name, out_dir), f"the export of {name}")
                   for f, fo, name in zip(held.vectors, held.fp_out, graph_list, strict=True)]
    try:
        # calibrated: its encodings stay as they are from here on. Beside the exports the evaluation gets one
        # thread: OpenMP's waiting threads spin (default model, 2 cores: 57 s with two threads, 37 s with one)
        with simulate.frozen(held.sim.model), (forked.one_thread() if exports else contextlib.nullcontext()):
            cmp = compare(ids, held.fp_ref, partial(held.q_run.score, decode_tokens=plan.decode_tokens),
                          window=plan.window, state=state.sub(0.6, 0.8), labels=("fp", label))
        # the FP logits of the whole eval text, in memory or mapped from the adapt stage's file (each page read
        # stays in this process's memory while mapped: 131 MB on a 1B model): let go before the export peaks
        held.ref.clear()
        del held.fp_ref
        held.fp_run.release()  # and the runners' KV caches (67 MB each on a 1B model)
        held.q_run.release()
        gc.collect()
        lap("quant_eval")
        files: list[Path] = []
        if exports:
            state.progress(0.8, "exporting ONNX + encodings")
            files = [Path(f) for b in exports for f in b.result(state)]
            lap("export_after_eval")
    finally:
        for b in exports:
            b.stop()
    held.sim.model.cpu()  # the export (and its bit-for-bit checks) run where CI runs them
    with export.Blobs(out_dir / layout.WEIGHTS) as blobs:
        if options.export and not exports:
            files = _export_here(held, graph_list, out_dir, blobs, state)
        if exports:  # graphs exported in forked copies wrote side files; the graphs written here point at blobs
            export.share_weights([f for f in files if f.suffix == ".onnx"], blobs)
        if files:
            files.append(out_dir / layout.WEIGHTS)
            for f in COPIED_FILES:
                if (adapt_dir / f).is_file():
                    shutil.copy2(adapt_dir / f, out_dir / f)
                    files.append(out_dir / f)
            lap("export")
    return cmp, files


def _export_here(held: _Held, graph_list: list[str], out_dir: Path, blobs: export.Blobs, state: StateLike
                 ) -> list[Path]:
    """The graphs traced in this process, then written as QDQ graphs once the models are let go."""
    state.progress(0.8, "exporting ONNX + encodings")
    traced: list[export.Traced] = []
    for name in graph_list:
        state.check()
        # each graph's feeds and float outputs are let go once written: the next graph's trace is the export's
        # peak, and the prompt graph's (its logits and the whole KV cache, twice) held ~0.3 GB of it on a 1B model
        traced.append(_trace_with_vectors(held.sim, held.vectors.pop(0), held.fp_out.pop(0), name, out_dir, blobs))
        gc.collect()
    # the QDQ pass reads the traced graphs and the weights on disk: the model goes first (its float weights are
    # 5 GB on a 1B model; the pass adds the largest table and its integers to whatever is still held)
    held.release()
    gc.collect()
    trim_heap()
    state.progress(0.9, "writing the quantized (QDQ) graphs")
    files: list[Path] = []
    for t, name in zip(traced, graph_list, strict=True):
        state.check()
        files += [*export.write_qdq(t, blobs), _vector_file(out_dir, name)]
    return files


def _calibrate_on(q_run: KVCacheRunner, seqs: list[Run], decode: int, state: StateLike, start: float,
                  end: float) -> None:
    for i, (seq, extra) in enumerate(seqs):
        state.check()
        if extra is not None:
            q_run.extra = extra
        q_run.score(seq, decode)
        state.progress(start + (end - start) * (i + 1) / len(seqs))


def _calibrate_part(q_run: KVCacheRunner, seqs: list[Run], decode: int, observers: dict[str, Any],
                    path: str) -> None:
    """In a forked child: calibrate on `seqs`, then write what the observers saw to `path`."""
    from ..progress import State

    _calibrate_on(q_run, seqs, decode, State(), 0.0, 1.0)
    simulate.save_observed(observers, path)


def _trace_with_vectors(sim: Any, feeds: dict[str, torch.Tensor], fp_out: dict[str, torch.Tensor], name: str,
                        out_dir: Path, blobs: export.Blobs | None = None) -> export.Traced:
    """One graph traced (its float ONNX and encodings written, its weights to `blobs` or its side file) and its
    test vectors: the feeds, the float model's outputs and the quantsim's."""
    traced = export.trace_graph(sim, feeds, name, out_dir, blobs)
    with simulate.frozen(sim.model):
        qo = TorchGraph(sim.model)(feeds)
    write_test_vectors(_vector_file(out_dir, name), feeds, fp_out, qo)
    return traced


def _export_graph(sim: Any, feeds: dict[str, torch.Tensor], fp_out: dict[str, torch.Tensor], name: str,
                  out_dir: Path) -> list[str]:
    """All of one graph's exported files (in a forked child: their paths, as JSON)."""
    t = _trace_with_vectors(sim, feeds, fp_out, name, out_dir)
    return [str(f) for f in [*export.write_qdq(t), _vector_file(out_dir, name)]]


def _vector_file(out_dir: Path, graph: str) -> Path:
    return out_dir / layout.TEST_VECTORS / f"{graph}.npz"


def adapt_graphs(adapt_dir: Path) -> tuple[int, int, list[str]]:
    """AR, CL and the names of the prompt and token graphs, as the adapt stage wrote them."""
    specs = {g.kind: g for g in load_graphs(adapt_dir)}
    return specs["prompt"].ar, specs["prompt"].cl, [specs["prompt"].name, specs["token"].name]


def validate(options: QuantizeOptions, shape: DecoderShape) -> None:
    """Refuse options this model cannot be quantized with, before any weight is read."""
    if (why := refusal(options.recipe, shape)) is not None:
        raise why
    if options.int8_budget and not takes_int8_budget(options.precision):
        raise UserError(f"--int8-budget keeps some 4-bit weights at 8 bits, and at {options.precision} no weight is "
                        "4-bit.", "Add --precision w4a16, or leave --int8-budget out.")
    for field, flag, users in (("adascale_iterations", "--adascale-iterations", ("adascale", "spinquant_adascale")),
                               ("omniquant_iterations", "--omniquant-iterations", ("omniquant",)),
                               ("seq_mse_candidates", "seq_mse_candidates", ("seqmse",))):
        if getattr(options, field) != QuantizeOptions.model_fields[field].default and options.recipe not in users:
            raise UserError(f"{flag} sets a step of the {' or '.join(users)} recipe, and the recipe is "
                            f"{options.recipe}: it would change nothing but the stage's record.",
                            f"Add --recipe {users[0]}, or leave {flag} out.")
    if options.lm_head_bits == 4 and not takes_4bit_head(options.precision):
        raise UserError(f"--lm-head-bits 4 puts the LM head in 4-bit LPBQ blocks, and {options.precision} has no "
                        "blocks (4-bit weights without them do not run exactly on the HTP).",
                        "Add --precision w4a16, or leave --lm-head-bits out.")


def resolved(options: QuantizeOptions, adapt_dir: Path) -> QuantizeOptions:
    """`options` with the values the stage comes to in place of its defaults: the target by its part number, the
    int8 budget the precision takes, and the eval as `_eval_plan` makes it from the adapt stage's (unset fields are
    the adapt stage's plan). The stage key hashes these: `npustudio run` passed its eval corpus ("default") where
    `npustudio quantize` left it unset, the same eval, and the quantize stage (2-5 min on the default model) was
    redone for nothing."""
    plan = _eval_plan(adapt_dir, options, adapt_graphs(adapt_dir)[1])
    return options.model_copy(update={
        "target": find_soc(options.target).soc, "int8_budget": int8_budget_of(options.precision, options.int8_budget),
        "eval_corpus": plan.corpus, "eval_chars": plan.chars,
        "eval_tokens": plan.tokens, "window": plan.window, "decode_tokens": plan.decode_tokens})


def _eval_plan(adapt_dir: Path, o: QuantizeOptions, cl: int) -> EvalPlan:
    """The adapt stage's eval plan with this stage's overrides (the same plan for `resolved(o)` as for `o`)."""
    adapted = read_plan(adapt_dir)
    params = load_card(adapt_dir).params
    base = adapted or EvalPlan(tokens=auto_eval_tokens(params), window=min(DEFAULT_WINDOW, cl))
    upd: dict[str, Any] = {k: v for k, v in (("corpus", o.eval_corpus), ("chars", o.eval_chars),
                                              ("window", o.window and min(o.window, cl)),
                                              ("decode_tokens", o.decode_tokens))
                            if v is not None and v != getattr(base, k)}
    if o.eval_tokens is not None:
        upd["tokens"] = o.eval_tokens
    elif {"corpus", "chars"} & upd.keys():
        upd["tokens"] = auto_eval_tokens(params)
    return base.model_copy(update=upd)


def _reference(adapt_dir: Path, plan: EvalPlan) -> Reference | None:
    """The adapt stage's float logits when `plan` is its eval."""
    if plan == read_plan(adapt_dir) and (adapt_dir / "reference_logits.safetensors").is_file():
        return Reference(adapt_dir)
    return None


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)


def calibration(adapt_dir: Path, options: QuantizeOptions) -> list[list[int]]:
    """The token sequences the stage calibrates with for `options`, cut to the adapted graphs' context (the
    tokenizer, ~50 MB for a 128k vocabulary, is let go before the quantsim's peak)."""
    ids = _tokenizer(adapt_dir)(load_corpus(options.calib_corpus, "calib"))["input_ids"]
    return _sequences(ids, options, adapt_graphs(adapt_dir)[1])


def _sequences(ids: list[int], o: QuantizeOptions, cl: int) -> list[list[int]]:
    n = min(o.calib_len, cl)
    seqs = [ids[i:i + n] for i in range(0, len(ids), n)][: o.calib_samples]
    seqs = [s for s in seqs if len(s) > 1]
    if not seqs:
        raise UserError("The calibration text is shorter than two tokens.", "Use a longer calibration text.")
    return seqs


def _vector_feeds(r: KVCacheRunner, seq: list[int], ar: int) -> list[dict[str, torch.Tensor]]:
    """Feeds of one AR-N step (empty cache) and one AR-1 step right after it, from real text."""
    r.reset()
    first = {k: v.cpu().clone() for k, v in r.feeds(seq[:ar], ar).items()}
    r.step(seq[:ar], ar)
    second = {k: v.cpu().clone() for k, v in r.feeds([seq[min(ar, len(seq) - 1)]], 1).items()}
    return [first, second]


def _seq_mse(sim: Any, calib: list[list[int]], prefill: Prefill, o: QuantizeOptions) -> None:
    from aimet_torch.seq_mse import apply_seq_mse

    apply_seq_mse(sim, calib[:2], num_candidates=o.seq_mse_candidates, forward_fn=prefill)
