"""The main job (`npustudio run`): its plan, then every stage, then the answer on a device."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .. import adapt as adapt_stage
from .. import compile as compile_stage
from .. import model_fit, stages
from .. import quantize as quantize_stage
from ..cluster import Cluster
from ..errors import UserError
from ..genie import bundle as bundle_stage
from ..genie import draft
from ..progress import State, StateLike
from ..project import Done, Project
from ..stage_options import planned, user_value
from .execute import adapt, bundle_resolved, compile_and_bundle, opened, quantize
from .phone import ask_on_device
from .status import _require
from .summaries import (
    RunSummary,
    StageFigures,
    adapt_summary,
    bundle_summary,
    compile_summary,
    quantize_summary,
)


def run_all(project_dir: Path, model: str = "default", options: adapt_stage.AdaptOptions | None = None,
            state: StateLike | None = None, qoptions: quantize_stage.QuantizeOptions | None = None,
            coptions: compile_stage.CompileOptions | None = None, ask: bool = True,
            on_text: Any = None, force: bool = False, cluster: Cluster | None = None,
            boptions: bundle_stage.BundleOptions | None = None) -> RunSummary:
    """The main job on the embedded defaults: intake -> adapt (+ equivalence) -> quantize + export ->
    compile (+ simulator check) -> bundle (libGenie-validated) -> deploy to a device (the virtual one when
    no phone is attached) -> the sample prompt there, streamed. `cluster`: adapt, quantize and compile run on
    that Ray cluster. `boptions`: the bundle's decoding (a draft project), checked before the first stage."""
    options = options or adapt_stage.AdaptOptions()
    qoptions = qoptions or quantize_stage.QuantizeOptions()
    coptions = coptions or compile_stage.CompileOptions()
    boptions = boptions or bundle_stage.BundleOptions()
    coptions = planned(coptions, optimize=graphs_for(ask))
    state = state or State()
    with opened(project_dir) as project:
        boptions, coptions = _decoding_planned(project, boptions, coptions)
        rec = adapt(project, model, options, state.sub(0.0, 0.3), force=force, cluster=cluster, later=qoptions)
    if boptions.draft:  # the pair's tokens, context and graph widths, before quantizing and compiling
        draft.check_adapted(project.stage_dir(stages.ADAPT.name), draft.open_model(Path(boptions.draft)),
                            boptions.draft_len)
    chosen, qoptions, coptions, boptions = job_plan(project, qoptions, coptions, boptions)
    state.partial("plan", message=chosen.why)
    qrec = quantize(project, qoptions, state.sub(0.3, 0.7), force=force, cluster=cluster)
    crec, brec = compile_and_bundle(project, coptions, state.sub(0.7, 0.9), boptions, force=force, cluster=cluster)
    sample = None
    if ask:
        sample = ask_on_device(project, on_text=on_text, state=state.sub(0.9, 1.0))
    m = project.load()
    adapted = Done.of(stages.ADAPT, rec)
    return RunSummary(
        project=str(project.root),
        model=Done.of(stages.MODEL, m.stages[stages.MODEL.name]).result.card.source,
        adapt=adapt_summary(adapted.result, adapted.options.lora),
        quantize=quantize_summary(Done.of(stages.QUANTIZE, qrec).result, project.stage_dir(stages.QUANTIZE.name)),
        compile=compile_summary(crec.result),
        bundle=bundle_summary(brec.result),
        sample=sample,
        stages={n: StageFigures(seconds=round(s.seconds, 2), peak_rss_mb=round(s.peak_rss_mb))
                for n, s in m.stages.items()},
        plan=chosen,
    )


def _decoding_planned(project: Project, boptions: bundle_stage.BundleOptions,
                      coptions: compile_stage.CompileOptions
                      ) -> tuple[bundle_stage.BundleOptions, compile_stage.CompileOptions]:
    """A draft refused before hours of stages rather than after; with one, the target's graphs take token ids
    (Genie's speculative dialogs refuse the embedding lookup table) unless the user asked for the table."""
    boptions = bundle_resolved(project, boptions)
    if boptions.draft:
        if user_value(coptions, "embedding_lut"):
            raise UserError("Draft-model decoding cannot use the embedding lookup table: Genie's speculative dialogs "
                            "refuse it.", "Leave --embedding-lut out (or give --no-embedding-lut) with --draft.")
        coptions = planned(coptions, embedding_lut=False)
    return boptions, coptions


def job_plan(project: Project, qoptions: quantize_stage.QuantizeOptions, coptions: compile_stage.CompileOptions,
             boptions: bundle_stage.BundleOptions | None = None
             ) -> tuple[model_fit.Plan, quantize_stage.QuantizeOptions, compile_stage.CompileOptions,
                        bundle_stage.BundleOptions]:
    """What the main job builds so that the bundle loads where it goes (`model_fit.plan` over the model's recorded
    fit): the precision unless the user chose one, weight sharing for a phone unless told, and for the simulator the
    prompt graphs only when its contexts fit one protection domain with them."""
    fit = _require(project, stages.MODEL).result.fit
    destination: Literal["phone", "simulator"] = "phone" if coptions.optimize == "phone" else "simulator"
    chosen = model_fit.plan(fit, destination, user_value(qoptions, "precision"))
    qoptions = planned(qoptions, precision=chosen.precision)
    coptions = planned(coptions, weight_sharing=chosen.weight_sharing)
    boptions = boptions or bundle_stage.BundleOptions()
    if boptions.draft and not chosen.prompt_graphs:
        raise UserError(f"Draft-model decoding checks the draft's tokens with the target's prompt graph, but this "
                        f"model's bundle leaves it out to load on the HTP simulator ({chosen.why}).",
                        "Deploy to a phone (attach one), or leave --draft out.")
    return chosen, qoptions, coptions, boptions.model_copy(update={"prompt_graphs": chosen.prompt_graphs})


def graphs_for(ask: bool) -> Literal["phone", "quick"]:
    """What the main job compiles for: the phone it deploys to when one is attached, else the simulator check
    (QNN's quicker finalization: the same logits; deploy refuses such a bundle for a phone, with the fix)."""
    if not ask:
        return "quick"
    from .. import device

    try:
        return "quick" if device.pick(None).virtual else "phone"
    except UserError:
        return "quick"  # no device: the job deploys to the virtual one
