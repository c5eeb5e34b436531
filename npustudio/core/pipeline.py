"""The stages wired to a project: each one is skipped when its inputs and options are unchanged.

Used by both the CLI and the GUI, so they run exactly the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import platformdirs

from . import adapt as adapt_stage
from . import compile as compile_stage
from . import models
from . import quantize as quantize_stage
from .errors import UserError
from .fsutil import atomic_write_json
from .genie import bundle as bundle_stage
from .progress import State, StateLike
from .project import Project, StageRecord


def default_project_dir() -> Path:
    return platformdirs.user_data_path("npustudio") / "projects" / "default"


def resolve(model: str) -> models.ModelSource:
    return models.download(models.resolve_source(model))


def intake(project: Project, model: str, cl: int, state: StateLike) -> tuple[models.ModelSource, StageRecord]:
    state.progress(0.0, f"reading {model}")
    source = resolve(model)
    fp = models.fingerprint(source)

    def fn(out: Path) -> dict[str, Any]:
        card = models.read_card(source)
        fits = models.fit_table(card, cl)
        atomic_write_json(out / "card.json", card.model_dump())
        atomic_write_json(out / "fit.json", [f.model_dump() for f in fits])
        return {"source": source.model_dump(), "card": card.model_dump(), "fit": [f.model_dump() for f in fits]}

    rec, _ = project.run_stage("model", inputs={"model": fp}, options={"cl": cl}, fn=fn)
    state.progress(1.0, "model read")
    return source, rec


def adapt(project: Project, model: str, options: adapt_stage.AdaptOptions, state: StateLike) -> StageRecord:
    source, mrec = intake(project, model, options.cl, state.sub(0.0, 0.05))

    def fn(out: Path) -> dict[str, Any]:
        st = state.sub(0.05, 1.0)
        st.progress(0.0, "loading weights")
        lm = models.load(source)
        return adapt_stage.run(lm, options, out, st.sub(0.1, 1.0)).model_dump()

    rec, _ = project.run_stage("adapt", inputs={"model": mrec.inputs["model"]}, options=options.model_dump(), fn=fn)
    return rec


def quantize(project: Project, options: quantize_stage.QuantizeOptions, state: StateLike) -> StageRecord:
    """Quantize the project's adapted graphs (the adapt stage must have finished)."""
    arec = _require(project, "adapt", "adapt", "adapted model")

    def fn(out: Path) -> dict[str, Any]:
        return quantize_stage.run(project.stage_dir("adapt"), options, out, state).model_dump()

    rec, _ = project.run_stage("quantize", inputs={"adapt": arec.key, "format": quantize_stage.FORMAT},
                               options=options.model_dump(), fn=fn)
    return rec


STAGES = ("model", "adapt", "quantize", "compile", "bundle")


def stage_status(project: Project) -> dict[str, str | None]:
    """Per stage: "done" (outputs intact), "changed" (outputs edited or gone), "failed"/"cancelled" (last
    attempt, nothing good yet), or None (never run): what the wizard shows and unlocks by."""
    m = project.load()
    out: dict[str, str | None] = {}
    for name in STAGES:
        rec, att = m.stages.get(name), m.attempts.get(name)
        if rec is not None and rec.status == "done":
            out[name] = "changed" if project.changed(name) else "done"
        else:
            out[name] = att.status if att is not None else None
    return out


def _require(project: Project, stage: str, command: str, what: str | None = None) -> StageRecord:
    """The record of an earlier stage that finished and whose outputs are intact; else say what to run."""
    rec = project.record(stage)
    if rec is None or rec.status != "done" or project.verify(stage):
        raise UserError(f"The project {project.root} has no intact {what or stage + ' stage'} yet.",
                        f"Run `npustudio {command} --project {project.root}` first (or `npustudio run`).")
    return rec


def compile_graphs(project: Project, options: compile_stage.CompileOptions, state: StateLike) -> StageRecord:
    """Compile the quantized graphs to QNN HTP context binaries and verify them on the simulator."""
    qrec = _require(project, "quantize", "quantize")

    def fn(out: Path) -> dict[str, Any]:
        return compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"), options, out,
                                 state).model_dump()

    rec, _ = project.run_stage("compile", inputs={"quantize": qrec.key, "format": compile_stage.FORMAT},
                               options=options.model_dump(), fn=fn)
    return rec


def bundle(project: Project, options: bundle_stage.BundleOptions, state: StateLike) -> StageRecord:
    """Write the Genie bundle (config, binaries, tokenizer, metadata), validated by libGenie."""
    crec = _require(project, "compile", "compile")

    def fn(out: Path) -> dict[str, Any]:
        res = bundle_stage.run(project.stage_dir("compile"), project.stage_dir("adapt"), options, out, state)
        return res.model_dump() | {"folder": str(project.stage_dir("bundle"))}

    rec, _ = project.run_stage("bundle", inputs={"compile": crec.key, "format": bundle_stage.FORMAT},
                               options=options.model_dump(), fn=fn)
    return rec


def compile_and_bundle(project: Project, options: compile_stage.CompileOptions, state: StateLike,
                       boptions: bundle_stage.BundleOptions | None = None) -> tuple[StageRecord, StageRecord]:
    """Compile (+ simulator check), then the libGenie-validated bundle: the wizard's Compile step."""
    crec = compile_graphs(project, options, state.sub(0.0, 0.9))
    brec = bundle(project, boptions or bundle_stage.BundleOptions(), state.sub(0.9, 1.0))
    return crec, brec


def ask_on_device(project: Project, serial: str | None = None, max_tokens: int = 16, on_text: Any = None,
                  state: StateLike | None = None) -> dict[str, Any]:
    """Deploy the bundle (to the virtual device when no phone is attached) and ask its sample prompt there.

    genie-t2t-run has no token limit of its own, so the answer is stopped after `max_tokens` pieces.
    """
    import threading

    from . import device
    from .chat import answer_stream
    from .device import deploy, run
    from .genie import profile as genie_profile

    state = state or State()
    folder = project.stage_dir("bundle")
    started = None
    try:
        try:
            dev = device.pick(serial)
        except UserError:
            if serial:
                raise
            started = device.start_virtual()
            dev = device.info(started.serial)
        state.progress(0.0, f"deploying to {dev.serial}")
        pushed = deploy.deploy(folder, dev, state.sub(0.0, 0.3))
        prompt = (folder / bundle_stage.SAMPLE_PROMPT).read_text(encoding="utf-8")
        prof = project.root / "runs" / "sample_profile.json"
        prof.parent.mkdir(exist_ok=True)
        stop = threading.Event()
        pieces: list[str] = []

        def answer(s: str) -> None:
            pieces.append(s)
            if on_text:
                on_text(s)
            if len(pieces) >= max_tokens and not dev.virtual:
                stop.set()

        text = answer_stream(answer)  # genie-t2t-run's output: only what comes between [BEGIN]: and [END]

        state.progress(0.3, f"asking on {dev.serial} (Genie on the HTP simulator for the virtual device: slow)")
        # the virtual device's runner stops by itself after max_tokens (and so writes its profile);
        # a phone's genie-t2t-run has no limit: it is stopped once enough text has arrived
        res = run.run(dev.serial, pushed.remote_dir, prompt, text, stop=stop, profile_to=prof,
                      max_tokens=max_tokens if dev.virtual else None)
        summary = genie_profile.summarize(genie_profile.read(prof)).model_dump() if res.profile_path else None
        meta = json.loads((folder / bundle_stage.METADATA).read_text())
        return {"device": dev.serial, "virtual": dev.virtual, "question": meta["question"], "answer": res.text,
                "stopped_after_tokens": max_tokens if res.status == "stopped" or dev.virtual else None,
                "deploy": {"bytes_sent": pushed.bytes_sent, "bytes_skipped": pushed.bytes_skipped},
                "profile": res.profile_path, "profile_summary": summary}
    finally:
        if started is not None:
            device.stop_virtual(started)


def run_all(project_dir: Path, model: str = "default", options: adapt_stage.AdaptOptions | None = None,
            state: StateLike | None = None, qoptions: quantize_stage.QuantizeOptions | None = None,
            coptions: compile_stage.CompileOptions | None = None, ask: bool = True,
            on_text: Any = None) -> dict[str, Any]:
    """The main job on the embedded defaults: intake -> adapt (+ equivalence) -> quantize + export ->
    compile (+ simulator check) -> bundle (libGenie-validated) -> deploy to a device (the virtual one when
    no phone is attached) -> the sample prompt there, streamed."""
    options = options or adapt_stage.AdaptOptions()
    qoptions = qoptions or quantize_stage.QuantizeOptions()
    coptions = coptions or compile_stage.CompileOptions()
    state = state or State()
    project = Project.open(project_dir)
    rec = adapt(project, model, options, state.sub(0.0, 0.3))
    qrec = quantize(project, qoptions, state.sub(0.3, 0.7))
    crec, brec = compile_and_bundle(project, coptions, state.sub(0.7, 0.9))
    sample = None
    if ask:
        sample = ask_on_device(project, on_text=on_text, state=state.sub(0.9, 1.0))
    m = project.load()
    return {
        "project": str(project.root),
        "model": m.stages["model"].result["card"]["source"],
        "adapt": adapt_summary(rec.result),
        "quantize": quantize_summary(qrec.result, project.stage_dir("quantize")),
        "compile": compile_summary(crec.result),
        "bundle": {"folder": brec.result["folder"], "validated": brec.result["validated"],
                   "files": brec.result["files"], "genie_api": brec.result["genie_api"]},
        "sample": sample,
        "stages": {n: {"seconds": round(s.seconds, 2), "peak_rss_mb": round(s.peak_rss_mb)}
                   for n, s in m.stages.items()},
    }


def adapt_summary(r: dict[str, Any]) -> dict[str, Any]:
    """What the CLI and GUI show of an adapt result (one shape for both)."""
    eq = r["equivalence"]
    return {"top1_agreement": eq["top1_agreement"], "max_abs_logit_diff": eq["max_abs_logit_diff"],
            "positions": eq["positions"], "prefill_ar": eq["prefill_ar"], "decode_steps": eq["decode_steps"],
            "ppl_fp": r["ppl_fp"], "ppl_adapted": r["ppl_adapted"], "eval_tokens": r["eval_tokens"],
            "graphs": [g["name"] for g in r["graphs"]]}


def quantize_summary(r: dict[str, Any], folder: Path) -> dict[str, Any]:
    return {"precision": r["precision"], "target": r["target"], "seq_mse": r["seq_mse"],
            "rotated": r.get("rotated", False), "ppl_fp": r["ppl_fp"],
            "ppl_quant": r["ppl_quant"], "ratio": r["ratio"], "top1_agreement": r["top1_agreement"],
            "eval_tokens": r["eval_tokens"], "folder": str(folder), "files": r["files"], "steps": r["steps"]}


def compile_summary(r: dict[str, Any]) -> dict[str, Any]:
    return {"backend": r["backend"], "target": r["target"], "dsp_arch": r["dsp_arch"], "soc_model": r["soc_model"],
            "nodes_on_cpu": r["nodes_on_cpu"], "parts": r.get("parts", 1),
            "weight_shared": r.get("weight_shared", r["backend"] == "qairt"),
            "binaries": [{"graph": g["graph"], "file": g["context_bin"], "bytes": g["bin_bytes"],
                          "nodes_on_qnn": g["nodes_on_qnn"], "compile_seconds": g["seconds"]} for g in r["graphs"]],
            "verification": r["verification"], "steps": r["steps"]}
