"""The stages wired to a project: each one is skipped when its inputs and options are unchanged.

Used by both the CLI and the GUI, so they run exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import platformdirs
from pydantic import BaseModel

from . import adapt as adapt_stage
from . import compile as compile_stage
from . import host_cost, layout, models, parts, stages
from . import quantize as quantize_stage
from .cluster import Cluster, Job
from .config_audit import check_context
from .errors import UserError
from .fsutil import atomic_write_json, refuse_link
from .genie import bundle as bundle_stage
from .genie.profile import Summary as ProfileSummary

if TYPE_CHECKING:
    from .chat import ChatSession
    from .targets import Soc
from .progress import State, StateLike, free_big_blocks_at_once
from .project import Manifest, Project, StageRecord
from .results import AdaptResult, BundleResult, CompileResult, IntakeResult, QuantizeResult, Verification

INTAKE = stages.MODEL.name  # the stage that reads the model: its record, not work worth a project folder


def default_project_dir() -> Path:
    return platformdirs.user_data_path("npustudio") / "projects" / "default"


@contextmanager
def opened(project_dir: Path | str) -> Iterator[Project]:
    """The project for a command that may create it: when the command fails before any stage but reading the
    model ran in a project it created, the folder is left as it was (a new folder removed, an empty one emptied
    again): an option refused after the model stage (`--ar 64 --cl 32`) left a new project behind."""
    root = Path(project_dir).expanduser().resolve()
    existed, fresh = root.exists(), not (root / layout.MANIFEST).exists()
    project = Project.open(root)
    try:
        yield project
    except BaseException:
        if fresh:
            project.remove_if_unused(existed, cheap=(INTAKE,))
        raise


def resolve(model: str) -> models.ModelSource:
    return models.download(models.resolve_source(model))


def describe(source: models.ModelSource, cl: int, ar: int = adapt_stage.AdaptOptions().ar,
             max_part_mb: float = parts.DEFAULT_MAX_PART_MB) -> IntakeResult:
    """A model's card, its fit on phones at context `cl` (parts cut for AR-`ar` graphs under `max_part_mb`) and
    what each stage will cost this computer: what the model stage records and `npustudio info` shows."""
    card = models.read_card(source)
    check_context(card, cl)
    return IntakeResult(source=source, card=card, fit=models.fit_table(card, cl, ar, max_part_mb),
                        host=host_cost.estimate(card, gguf=bool(source.gguf_file)))


def intake(project: Project, model: str, cl: int, state: StateLike,
           force: bool = False) -> tuple[models.ModelSource, StageRecord]:
    state.progress(0.0, f"reading {model}")
    source = resolve(model)
    fp = models.fingerprint(source)

    def fn(out: Path) -> dict[str, Any]:
        res = describe(source, cl)
        atomic_write_json(out / layout.MODEL_RESULT, res.model_dump())  # the card, the fit and the host cost
        return res.model_dump()

    rec, _ = project.run_stage(INTAKE, inputs={"model": fp}, options={"cl": cl}, fn=fn, force=force)
    state.progress(1.0, "model read")
    return source, rec


def adapt(project: Project, model: str, options: adapt_stage.AdaptOptions, state: StateLike,
          force: bool = False, cluster: Cluster | None = None) -> StageRecord:
    """Adapt `model` into the project; `force` redoes it even when the inputs and options are unchanged;
    `cluster` runs it on that Ray cluster."""
    source, mrec = intake(project, model, options.cl, state.sub(0.0, 0.05))
    card = mrec.result_as(IntakeResult).card
    adapt_stage.validate(options, card)  # before any weight is loaded
    options = adapt_stage.resolved(options, card)  # one key for the same work, whichever front end asks
    inputs: dict[str, Path | list[Path]] = {"model": models.files(source)}

    def fn(out: Path) -> dict[str, Any]:
        return _on(cluster, "adapt", _adapt_body, inputs, (source, card, options), out, state.sub(0.05, 1.0),
                   options.device)

    rec, _ = project.run_stage("adapt", inputs={"model": mrec.inputs["model"]}, options=options.model_dump(), fn=fn,
                               force=force, ran_on=_ran_on(cluster))
    return rec


def _adapt_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    """The adapt stage where it runs (here or on a cluster worker, whose memory is then the one checked)."""
    source, card, options = args
    host_cost.check_fits(card, "adapt", gguf=bool(source.gguf_file))
    free_big_blocks_at_once()
    state.progress(0.0, "loading weights")
    lm = models.load(source.model_copy(update={"path": str(inputs["model"])}))
    return adapt_stage.run(lm, options, out, state.sub(0.1, 1.0)).model_dump()


def quantize(project: Project, options: quantize_stage.QuantizeOptions, state: StateLike,
             force: bool = False, cluster: Cluster | None = None) -> StageRecord:
    """Quantize the project's adapted graphs (the adapt stage must have finished)."""
    arec = _require(project, stages.ADAPT)
    options = quantize_stage.resolved(options, project.stage_dir("adapt"))  # one key for the same work

    def fn(out: Path) -> dict[str, Any]:
        return _on(cluster, "quantize", _quantize_body, {s: project.stage_dir(s) for s in stages.QUANTIZE.reads},
                   (_card(project), options), out, state, options.device)

    rec, _ = project.run_stage("quantize", inputs={"adapt": arec.key, "format": quantize_stage.FORMAT},
                               options=options.model_dump(), fn=fn, force=force, ran_on=_ran_on(cluster))
    project.choose(target=options.target)  # what the stage was made for is the target now, from the CLI too
    return rec


def _quantize_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    card, options = args
    if card is not None:
        host_cost.check_fits(card, "quantize")
    free_big_blocks_at_once()
    return quantize_stage.run(inputs["adapt"], options, out, state).model_dump()


def _on(cluster: Cluster | None, stage: str, body: Any, inputs: Mapping[str, Path | list[Path]], args: Any, out: Path,
        state: StateLike, device: str = "cpu") -> dict[str, Any]:
    """`body` here, or on the Ray cluster at `cluster` (the inputs sent, the output folder brought back)."""
    if cluster is None:
        here = {k: v if isinstance(v, Path) else v[0].parent for k, v in inputs.items()}
        return body(here, args, out, state)
    from . import cluster as ray_cluster

    return ray_cluster.run(cluster, Job(stage, body, inputs, args, device), out, state)


def _ran_on(cluster: Cluster | None) -> str | None:
    return None if cluster is None else f"Ray cluster at {cluster.address}"


def _card(project: Project) -> models.ArchCard | None:
    rec = project.record("model")
    return rec.result_as(IntakeResult).card if rec is not None and rec.status == "done" else None


def stage_status(project: Project) -> dict[str, str | None]:
    """Per stage: "done" (outputs intact and current), "stale" (made from an earlier stage's output or a choice that
    has since changed: `stale_reasons` says which), "changed" (outputs edited or gone), "failed"/"cancelled" (last
    attempt, nothing good yet), or None (never run): what the wizard shows and unlocks by."""
    return _status(project, project.load())[0]


def _status(project: Project, m: Manifest) -> tuple[dict[str, str | None], dict[str, str]]:
    """`stage_status` and `stale_reasons` from one reading of the manifest `m`."""
    stale = _stale(m)
    out: dict[str, str | None] = {}
    for name in stages.NAMES:
        rec, att = m.stages.get(name), m.attempts.get(name)
        if rec is not None and rec.status == "done":
            out[name] = "changed" if project.changed(name) else "stale" if name in stale else "done"
        else:
            out[name] = att.status if att is not None else None
    return out, stale


class WizardStep(BaseModel):
    name: str
    state: Literal["done", "todo", "locked"]
    reason: str = ""  # why a step that ran is to be redone ("the target is now SM8650 …")


def wizard_steps(project: Project) -> list[WizardStep]:
    """The guided flow's steps (`stages.STEPS`): done, to do (unlocked) or locked. A free step (Model, Target) can
    be done in any order; each other step needs every step before it done. A stage whose output is stale or
    edited is to do again; a choice step is done once chosen (the target also by a finished quantize stage, which
    was made for one), Deploy once the current bundle is on a device."""
    m = project.load()
    st, stale = _status(project, m)
    brec = m.stages.get(stages.BUNDLE.name)
    deployed = m.choices.get("deployed") or {}
    deploy_done = bool(brec and deployed.get("bundle") == brec.key) and st[stages.BUNDLE.name] == "done"
    out: list[WizardStep] = []
    for step in stages.STEPS:
        if step.stages:
            done = all(st[s] == "done" for s in step.stages)
            why = next((stale[s] for s in step.stages if s in stale), "")
            edited = next((s for s in step.stages if st[s] == "changed"), None)
            if edited:
                why = f"files of the {edited} stage were edited or removed"
        elif step.choice == "deployed":
            done = deploy_done
            why = "the bundle changed since it was deployed" if deployed and brec and not deploy_done else ""
        else:
            done, why = step.choice in m.choices or st[stages.QUANTIZE.name] == "done", ""
        reachable = step.free or all(s.state == "done" for s in out)
        out.append(WizardStep(name=step.name, state="done" if done and reachable else
                              "todo" if reachable else "locked", reason=why))
    return out


def deploy(project: Project, dev: Any, state: StateLike, force: bool = False) -> Any:
    """Push the project's bundle to `dev` and record it, with the bundle it was, so the project knows it is
    deployed (from the window or the CLI alike) and when a newer bundle makes that stale."""
    import time

    from .device import deploy as device_deploy

    brec = _require(project, stages.BUNDLE)
    folder = project.stage_dir("bundle")
    recorded = {f.name: (fr.bytes, fr.mtime_ns, fr.sha256) for fr in brec.outputs
                if fr.mtime_ns is not None and (f := project.root / fr.path).parent == folder}
    res = device_deploy.deploy(folder, dev, state, force=force, recorded=recorded)
    project.choose(deployed={"device": res.device, "remote_dir": res.remote_dir, "bundle": brec.key,
                             "at": time.time()})
    return res


def open_chat(bundle: Path, where: Literal["device", "desktop", "preview"], serial: str | None = None,
              system: str | None = None, state: StateLike | None = None) -> ChatSession:
    """A chat over a bundle: on a device (the bundle deployed there first: nothing moves when it is there already,
    and a project's bundle is recorded as deployed), with real Genie on this computer, or with the CPU preview."""
    from . import chat, device
    from .device import deploy as device_deploy

    bundle = Path(bundle)
    bundle_stage.read_metadata(bundle)  # "not a bundle" before "no device"
    engine: chat.Engine
    if where == "device":
        dev = device.pick(serial)
        project = project_of_bundle(bundle)
        if project is not None:
            deploy(project, dev, state or State())
        else:
            device_deploy.deploy(bundle, dev, state or State())
        engine = chat.DeviceEngine(dev.serial, bundle)
    else:
        engine = chat.DesktopEngine(bundle, preview=where == "preview")
    return chat.ChatSession(bundle, engine, system=system)


def decode_bounds(project: Project, target: Soc) -> list[tuple[str, dict[str, float], str]]:
    """The decode roofline on `target` per precision of the model's fit: (precision, roofline, basis). The
    precision the project's bundle is current for is measured from that bundle (`profile.bundle_roofline`, the
    figure the profiles show); the others are estimated from the fit at the chosen context length."""
    from .genie import profile

    rec = project.record("model")
    if rec is None or rec.status != "done":
        return []
    intake, cl = rec.result_as(IntakeResult), int(rec.options.get("cl", 1024))
    built = None
    quant, bundle = project.record("quantize"), project.record("bundle")
    if quant and bundle and bundle.status == "done" and "bundle" not in stale_reasons(project):
        built = quant.result_as(QuantizeResult).precision
    out = []
    for f in intake.fit:
        if f.precision == built:
            try:
                out.append((f.precision, profile.bundle_roofline(project.stage_dir("bundle"), target),
                            "the bundle's binaries"))
                continue
            except UserError:  # a bundle folder damaged since: the estimate still holds
                pass
        out.append((f.precision, profile.roofline(target, f.weight_bytes, intake.card.kv_bytes_per_token, cl),
                    "estimate"))
    return out


def project_of_bundle(folder: Path) -> Project | None:
    """The project whose bundle stage `folder` is, if it is one."""
    root = layout.project_of_stage(folder)
    return Project.open(root, create=False) if root is not None and Path(folder).resolve().name == "bundle" else None


def stale_reasons(project: Project) -> dict[str, str]:
    """The finished stages whose output no longer follows from the project as it is, each with the reason in plain
    words: the stage before was redone (the record keys its inputs by the earlier stage's key), or the user has
    since chosen another context length or target."""
    return _stale(project.load())


def _stale(m: Manifest) -> dict[str, str]:
    target = m.choices.get("target")
    out: dict[str, str] = {}
    for name, up in stages.UPSTREAM.items():
        rec, prev = m.stages.get(name), m.stages.get(up)
        if rec is None or rec.status != "done":
            continue
        if up in out:
            out[name] = f"the {up} stage it was made from is out of date"
        elif prev is None or prev.status != "done":
            out[name] = f"the {up} stage it was made from is gone"
        elif name == "adapt" and rec.inputs.get("model") != prev.inputs.get("model"):
            out[name] = f"another model was read ({prev.result_as(IntakeResult).source.spec})"
        elif name == "adapt" and rec.options.get("cl") != prev.options.get("cl"):
            out[name] = f"the context length is now {prev.options.get('cl')} (adapted for {rec.options.get('cl')})"
        elif name != "adapt" and rec.inputs.get(up) != prev.key:
            out[name] = f"the {up} stage was run again since"
        elif name == "quantize" and target and rec.options.get("target") != target:
            out[name] = f"the target is now {target} (quantized for {rec.options.get('target')})"
    return out


def _require(project: Project, spec: stages.StageSpec) -> StageRecord:
    """The record of an earlier stage that finished and whose outputs are intact; else say what to rerun."""
    rec = project.record(spec.name)
    rerun = f"npustudio {spec.command} --project {project.root}"
    if spec is stages.ADAPT and rec is not None:
        rerun = f"npustudio adapt {rec.inputs.get('model', {}).get('spec', 'MODEL')} --project {project.root}"
    if rec is None or rec.status != "done":
        raise UserError(f"The project {project.root} has no intact {spec.what} yet.",
                        f"Run `{rerun}` first (or `npustudio run`).")
    changed = project.changed(spec.name)
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise UserError(f"The {spec.what} in {project.root} was changed after the {spec.name} stage wrote it "
                        f"({shown}).", f"Rerun that stage: `{rerun}` (it redoes the stage), then this command again.")
    return rec


def compile_graphs(project: Project, options: compile_stage.CompileOptions, state: StateLike,
                   force: bool = False, cluster: Cluster | None = None) -> StageRecord:
    """Compile the quantized graphs to QNN HTP context binaries and verify them on the simulator."""
    qrec = _require(project, stages.QUANTIZE)
    options = compile_stage.resolved(options, project.stage_dir("quantize"))  # one key for the same work

    def fn(out: Path) -> dict[str, Any]:
        inputs = {s: project.stage_dir(s) for s in stages.COMPILE.reads}
        return _on(cluster, "compile", _compile_body, inputs, (_card(project), options), out, state)

    rec, _ = project.run_stage("compile", inputs={"quantize": qrec.key, "format": compile_stage.FORMAT},
                               options=options.model_dump(), fn=fn, force=force, ran_on=_ran_on(cluster))
    return rec


def _compile_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    card, options = args
    if card is not None:
        host_cost.check_fits(card, "compile")
    free_big_blocks_at_once()
    return compile_stage.run(inputs["quantize"], inputs["adapt"], options, out, state).model_dump()


def bundle(project: Project, options: bundle_stage.BundleOptions, state: StateLike,
           force: bool = False) -> StageRecord:
    """Write the Genie bundle (config, binaries, tokenizer, metadata), validated by libGenie."""
    crec = _require(project, stages.COMPILE)

    def fn(out: Path) -> dict[str, Any]:
        res = bundle_stage.run(project.stage_dir("compile"), project.stage_dir("adapt"), options, out, state)
        return res.model_dump() | {"folder": str(project.stage_dir("bundle"))}

    rec, _ = project.run_stage("bundle", inputs={"compile": crec.key, "format": bundle_stage.FORMAT},
                               options=options.model_dump(), fn=fn, force=force)
    return rec


def compile_and_bundle(project: Project, options: compile_stage.CompileOptions, state: StateLike,
                       boptions: bundle_stage.BundleOptions | None = None,
                       force: bool = False, cluster: Cluster | None = None) -> tuple[StageRecord, StageRecord]:
    """Compile (+ simulator check), then the libGenie-validated bundle: the wizard's Compile step."""
    crec = compile_graphs(project, options, state.sub(0.0, 0.9), force=force, cluster=cluster)
    brec = bundle(project, boptions or bundle_stage.BundleOptions(), state.sub(0.9, 1.0), force=force)
    return crec, brec


class SampleAnswer(BaseModel):
    """The sample prompt asked on a device after `npustudio run`."""

    device: str
    virtual: bool
    question: str
    answer: str
    stopped_after_tokens: int | None
    deploy: dict[str, int]  # bytes_sent, bytes_skipped
    profile: str | None
    profile_summary: ProfileSummary | None


def ask_on_device(project: Project, serial: str | None = None, max_tokens: int = 16, on_text: Any = None,
                  state: StateLike | None = None) -> SampleAnswer:
    """Deploy the bundle (to the virtual device when no phone is attached) and ask its sample prompt there.

    genie-t2t-run has no token limit of its own, so the answer is stopped after `max_tokens` pieces.
    """
    import threading

    from . import device
    from .device import remote_genie
    from .genie import profile as genie_profile
    from .genie import t2t

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
        pushed = deploy(project, dev, state.sub(0.0, 0.3))
        prompt = (folder / layout.SAMPLE_PROMPT).read_text(encoding="utf-8")
        prof = project.root / layout.RUNS_DIR / layout.SAMPLE_PROFILE
        refuse_link(prof.parent)
        prof.parent.mkdir(exist_ok=True)
        stop = threading.Event()
        pieces: list[str] = []

        def answer(s: str) -> None:
            pieces.append(s)
            if on_text:
                on_text(s)
            if len(pieces) >= max_tokens and not dev.virtual:
                stop.set()

        reader = t2t.Reader(answer, prompt=prompt)  # genie-t2t-run's output: only the answer, to `answer`

        state.progress(0.3, f"asking on {dev.serial} (Genie on the HTP simulator for the virtual device: slow)")
        # the virtual device's runner stops by itself after max_tokens (and so writes its profile);
        # a phone's genie-t2t-run has no limit: it is stopped once enough text has arrived
        try:
            res = remote_genie.run(dev.serial, pushed.remote_dir, prompt, reader.feed, stop=stop, profile_to=prof,
                                   max_tokens=max_tokens if dev.virtual else None)
        finally:
            reader.close()
        summary = genie_profile.summarize(genie_profile.read(prof)) if res.profile_path else None
        meta = bundle_stage.read_metadata(folder)
        return SampleAnswer(device=dev.serial, virtual=dev.virtual, question=meta.question, answer=res.text,
                            stopped_after_tokens=max_tokens if res.status == "stopped" or dev.virtual else None,
                            deploy={"bytes_sent": pushed.bytes_sent, "bytes_skipped": pushed.bytes_skipped},
                            profile=res.profile_path, profile_summary=summary)
    finally:
        if started is not None:
            device.stop_virtual(started)


class AdaptSummary(BaseModel):
    """What the CLI and the window show of an adapt result (one shape for both)."""

    gate: Literal["passed", "failed, accepted", "not run"]
    top1_agreement: float
    max_abs_logit_diff: float
    positions: int
    prefill_ar: int
    decode_steps: int
    ppl_fp: float
    ppl_adapted: float
    eval_tokens: int
    graphs: list[str]


class QuantizeSummary(BaseModel):
    precision: str
    target: str
    seq_mse: bool
    rotated: bool
    ppl_fp: float
    ppl_quant: float
    ratio: float
    top1_agreement: float
    eval_tokens: int
    folder: str
    files: list[dict[str, Any]]
    steps: dict[str, float]


class BinarySummary(BaseModel):
    graph: str
    file: str
    bytes: int
    nodes_on_qnn: int
    compile_seconds: float
    estimated_alloc_kb: int | None


class CompileSummary(BaseModel):
    backend: str
    target: str
    dsp_arch: str
    soc_model: int | None
    optimize: str
    nodes_on_cpu: int
    parts: int
    weight_shared: bool
    binaries: list[BinarySummary]
    htp_graph_limit_kb: int
    recut: list[str]
    verification: Verification
    steps: dict[str, float]


class BundleSummary(BaseModel):
    folder: str
    validated: bool
    files: list[dict[str, Any]]
    genie_api: str


class StageFigures(BaseModel):
    seconds: float
    peak_rss_mb: int


class RunSummary(BaseModel):
    """`npustudio run`: every stage's summary, the sample answer and what each stage cost."""

    project: str
    model: str
    adapt: AdaptSummary
    quantize: QuantizeSummary
    compile: CompileSummary
    bundle: BundleSummary
    sample: SampleAnswer | None
    stages: dict[str, StageFigures]
    plan: models.Plan | None = None


def run_all(project_dir: Path, model: str = "default", options: adapt_stage.AdaptOptions | None = None,
            state: StateLike | None = None, qoptions: quantize_stage.QuantizeOptions | None = None,
            coptions: compile_stage.CompileOptions | None = None, ask: bool = True,
            on_text: Any = None, force: bool = False, cluster: Cluster | None = None) -> RunSummary:
    """The main job on the embedded defaults: intake -> adapt (+ equivalence) -> quantize + export ->
    compile (+ simulator check) -> bundle (libGenie-validated) -> deploy to a device (the virtual one when
    no phone is attached) -> the sample prompt there, streamed. `cluster`: adapt, quantize and compile run on
    that Ray cluster."""
    options = options or adapt_stage.AdaptOptions()
    qoptions = qoptions or quantize_stage.QuantizeOptions()
    coptions = coptions or compile_stage.CompileOptions()
    if "optimize" not in coptions.model_fields_set:
        coptions = coptions.model_copy(update={"optimize": graphs_for(ask)})
    state = state or State()
    with opened(project_dir) as project:
        rec = adapt(project, model, options, state.sub(0.0, 0.3), force=force, cluster=cluster)
    chosen, qoptions, coptions, boptions = job_plan(project, qoptions, coptions)
    state.partial("plan", message=chosen.why)
    qrec = quantize(project, qoptions, state.sub(0.3, 0.7), force=force, cluster=cluster)
    crec, brec = compile_and_bundle(project, coptions, state.sub(0.7, 0.9), boptions, force=force, cluster=cluster)
    sample = None
    if ask:
        sample = ask_on_device(project, on_text=on_text, state=state.sub(0.9, 1.0))
    m = project.load()
    b = brec.result_as(BundleResult)
    return RunSummary(
        project=str(project.root),
        model=m.stages["model"].result_as(IntakeResult).card.source,
        adapt=adapt_summary(rec.result_as(AdaptResult)),
        quantize=quantize_summary(qrec.result_as(QuantizeResult), project.stage_dir("quantize")),
        compile=compile_summary(crec.result_as(CompileResult)),
        bundle=BundleSummary(folder=b.folder, validated=b.validated, files=b.files, genie_api=b.genie_api),
        sample=sample,
        stages={n: StageFigures(seconds=round(s.seconds, 2), peak_rss_mb=round(s.peak_rss_mb))
                for n, s in m.stages.items()},
        plan=chosen,
    )


def job_plan(project: Project, qoptions: quantize_stage.QuantizeOptions, coptions: compile_stage.CompileOptions
             ) -> tuple[models.Plan, quantize_stage.QuantizeOptions, compile_stage.CompileOptions,
                        bundle_stage.BundleOptions]:
    """What the main job builds so that the bundle loads where it goes (`models.plan` over the model's recorded
    fit): the precision unless the user chose one, weight sharing for a phone unless told, and for the simulator the
    prompt graphs only when its contexts fit one protection domain with them."""
    fit = project.record("model").result_as(IntakeResult).fit  # type: ignore[union-attr]
    destination: Literal["phone", "simulator"] = "phone" if coptions.optimize == "phone" else "simulator"
    given = qoptions.precision if "precision" in qoptions.model_fields_set else None
    chosen = models.plan(fit, destination, given)
    qoptions = qoptions.model_copy(update={"precision": chosen.precision})
    if "weight_sharing" not in coptions.model_fields_set:
        coptions = coptions.model_copy(update={"weight_sharing": chosen.weight_sharing})
    return chosen, qoptions, coptions, bundle_stage.BundleOptions(prompt_graphs=chosen.prompt_graphs)


def graphs_for(ask: bool) -> Literal["phone", "quick"]:
    """What the main job compiles for: the phone it deploys to when one is attached, else the simulator check
    (QNN's quicker finalization: the same logits; deploy refuses such a bundle for a phone, with the fix)."""
    if not ask:
        return "quick"
    from . import device

    try:
        return "quick" if device.pick(None).virtual else "phone"
    except UserError:
        return "quick"  # no device: the job deploys to the virtual one


def adapt_summary(r: AdaptResult) -> AdaptSummary:
    eq, gate = r.equivalence, r.gate
    verdict: Literal["passed", "failed, accepted", "not run"] = (
        "passed" if gate and gate.passed else "failed, accepted" if gate and gate.accepted_mismatch else "not run")
    return AdaptSummary(gate=verdict, top1_agreement=eq.top1_agreement, max_abs_logit_diff=eq.max_abs_logit_diff,
                        positions=eq.positions, prefill_ar=eq.prefill_ar, decode_steps=eq.decode_steps,
                        ppl_fp=r.ppl_fp, ppl_adapted=r.ppl_adapted, eval_tokens=r.eval_tokens,
                        graphs=[g.name for g in r.graphs])


def quantize_summary(r: QuantizeResult, folder: Path) -> QuantizeSummary:
    return QuantizeSummary(precision=r.precision, target=r.target, seq_mse=r.seq_mse, rotated=r.rotated,
                           ppl_fp=r.ppl_fp, ppl_quant=r.ppl_quant, ratio=r.ratio, top1_agreement=r.top1_agreement,
                           eval_tokens=r.eval_tokens, folder=str(folder), files=r.files, steps=r.steps)


def compile_summary(r: CompileResult) -> CompileSummary:
    return CompileSummary(
        backend=r.backend, target=r.target, dsp_arch=r.dsp_arch, soc_model=r.soc_model,
        optimize=r.optimize, nodes_on_cpu=r.nodes_on_cpu, parts=r.parts,
        weight_shared=r.weight_shared or r.backend == "qairt",
        binaries=[BinarySummary(graph=g.graph, file=g.context_bin, bytes=g.bin_bytes, nodes_on_qnn=g.nodes_on_qnn,
                                compile_seconds=g.seconds, estimated_alloc_kb=g.estimated_alloc_kb)
                  for g in r.graphs],
        htp_graph_limit_kb=parts.HTP_GRAPH_LIMIT_KB, recut=r.recut, verification=r.verification, steps=r.steps)
