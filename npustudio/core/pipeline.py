"""The stages wired to a project: each one is skipped when its inputs and options are unchanged.

Used by both the CLI and the GUI, so they run exactly the same thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import platformdirs

from . import adapt as adapt_stage
from . import models
from . import quantize as quantize_stage
from .errors import UserError
from .fsutil import atomic_write_json
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
    arec = project.record("adapt")
    if arec is None or arec.status != "done" or project.verify("adapt"):
        raise UserError(f"The project {project.root} has no intact adapted model yet.",
                        f"Run `npustudio adapt --project {project.root}` first (or `npustudio run`).")

    def fn(out: Path) -> dict[str, Any]:
        return quantize_stage.run(project.stage_dir("adapt"), options, out, state).model_dump()

    rec, _ = project.run_stage("quantize", inputs={"adapt": arec.key}, options=options.model_dump(), fn=fn)
    return rec


def run_all(project_dir: Path, model: str = "default", options: adapt_stage.AdaptOptions | None = None,
            state: StateLike | None = None, qoptions: quantize_stage.QuantizeOptions | None = None
            ) -> dict[str, Any]:
    """The main job on the embedded defaults: intake -> adapt (+ equivalence) -> quantize + export."""
    options = options or adapt_stage.AdaptOptions()
    qoptions = qoptions or quantize_stage.QuantizeOptions()
    state = state or State()
    project = Project.open(project_dir)
    rec = adapt(project, model, options, state.sub(0.0, 0.4))
    qrec = quantize(project, qoptions, state.sub(0.4, 1.0))
    m = project.load()
    return {
        "project": str(project.root),
        "model": m.stages["model"].result["card"]["source"],
        "adapt": adapt_summary(rec.result),
        "quantize": quantize_summary(qrec.result, project.stage_dir("quantize")),
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
    return {"precision": r["precision"], "target": r["target"], "seq_mse": r["seq_mse"], "ppl_fp": r["ppl_fp"],
            "ppl_quant": r["ppl_quant"], "ratio": r["ratio"], "top1_agreement": r["top1_agreement"],
            "eval_tokens": r["eval_tokens"], "folder": str(folder), "files": r["files"], "steps": r["steps"]}
