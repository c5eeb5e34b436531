"""Each stage run on a project: skipped when its inputs and options are unchanged, here or on a Ray cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal

import platformdirs

from .. import adapt as adapt_stage
from .. import compile as compile_stage
from .. import host_cost, isolated, layout, lora, model_fit, model_source, models, parts, stages
from .. import mnn as mnn_stage
from .. import quantize as quantize_stage
from ..cluster import Cluster, Job
from ..config_audit import check_context
from ..errors import UserError
from ..fsutil import atomic_write_json
from ..genie import bundle as bundle_stage
from ..genie import decoding
from ..progress import StateLike, free_big_blocks_at_once
from ..project import Done, Project, StageRecord
from ..results import BundleResult, CompileResult, IntakeResult, StageOptions
from ..stage_options import (
    AdaptOptions,
    BundleOptions,
    CompileOptions,
    LoraAdapter,
    MnnOptions,
    QuantizeOptions,
    widens,
)
from ..stages import O, R
from .status import _require

# a stage's body where it runs (here, or on a cluster worker): (its inputs' folders, its arguments, the output folder,
# the state) -> its result as JSON
Body = Callable[[dict[str, Path], tuple[Any, ...], Path, StateLike], dict[str, Any]]
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


def resolve(model: str) -> model_source.ModelSource:
    return model_source.download(model_source.resolve_source(model))


def describe(source: model_source.ModelSource, cl: int, ar: int = adapt_stage.AdaptOptions().ar,
             max_part_mb: float = parts.DEFAULT_MAX_PART_MB) -> IntakeResult:
    """A model's card, its fit on phones at context `cl` (parts cut for AR-`ar` graphs under `max_part_mb`) and
    what each stage will cost this computer: what the model stage records and `npustudio info` shows."""
    card = models.read_card(source)
    check_context(card, cl)
    return IntakeResult(source=source, card=card, fit=model_fit.fit_table(card, cl, ar, max_part_mb),
                        host=host_cost.estimate(card, gguf=bool(source.gguf_file)))


def check_lora(model: str, folder: str, weight: float = 1.0) -> LoraAdapter:
    """An adapter picked for `model` (a model spec), read and checked as adapt will before its weights load (the
    window's Model page: refused when picked, not minutes later)."""
    source = model_source.resolve_source(model)
    return lora.resolved((LoraAdapter(path=folder, weight=weight),), lora_bases(source))[0]


def lora_report(source: model_source.ModelSource, card: models.ArchCard, adapters: tuple[LoraAdapter, ...]
                ) -> list[dict[str, Any]]:
    """What `info --lora` shows of each adapter, read and checked against the model as adapt will (its weights'
    shapes are checked when they load, at the start of adapt)."""
    out = []
    for a in lora.resolved(adapters, lora_bases(source), _weight_bytes(card)):
        ad = lora.read(Path(a.path))
        out.append({"adapter": a.path, "weight": a.weight, "base": ad.base, "rank": ad.rank, "alpha": ad.alpha,
                    "modules": len(ad.modules), "bytes": ad.bytes})
    return out


def intake(project: Project, model: str, cl: int, state: StateLike,
           force: bool = False) -> tuple[model_source.ModelSource, StageRecord]:
    state.progress(0.0, f"reading {model}")
    source = resolve(model)
    fp = models.fingerprint(source)

    def fn(out: Path) -> dict[str, Any]:
        res = describe(source, cl)
        atomic_write_json(out / layout.MODEL_RESULT, res.model_dump())  # the card, the fit and the host cost
        return res.model_dump()

    rec, _ = project.run_stage(INTAKE, inputs={"model": fp}, options={"cl": cl}, fn=fn, force=force)
    # what the project is made from is the model now, from the CLI too: the window reopens it and reruns with it
    project.choose(model=source.spec, cl=cl)
    state.progress(1.0, "model read")
    return source, rec


def adapt(project: Project, model: str, options: adapt_stage.AdaptOptions, state: StateLike,
          force: bool = False, cluster: Cluster | None = None,
          later: quantize_stage.QuantizeOptions | None = None) -> StageRecord:
    """Adapt `model` into the project; `force` redoes it even when the inputs and options are unchanged;
    `cluster` runs it on that Ray cluster; `later`: the quantize options the job goes on with, refused here
    already where the model cannot take them."""
    source, mrec = intake(project, model, options.cl, state.sub(0.0, 0.05))
    card = Done.of(stages.MODEL, mrec).result.card
    adapt_stage.validate(options, card)  # before any weight is loaded
    if later is not None:
        quantize_stage.validate(later, card)
    options = adapt_stage.resolved(options, card)  # one key for the same work, whichever front end asks
    options = options.model_copy(update={"lora": lora.resolved(options.lora, lora_bases(source), _weight_bytes(card))})
    if options.lora_switchable:
        lora.switch_names(options.lora)
    inputs: dict[str, Path | list[Path]] = {"model": models.files(source)}
    for i, a in enumerate(options.lora):  # sent to a cluster worker with the model's files
        inputs[f"lora{i}"] = [Path(a.path) / lora.CONFIG, Path(a.path) / lora.WEIGHTS]

    def fn(out: Path) -> dict[str, Any]:
        return _on(cluster, "adapt", _adapt_body, inputs, (source, card, options), out, state.sub(0.05, 1.0),
                   options.device)

    rec, _ = project.run_stage(stages.ADAPT.name, inputs={"model": mrec.inputs["model"]},
                               options=options.model_dump(), fn=fn, force=force, ran_on=_ran_on(cluster))
    ch = project.choices()  # what the model is made with, from the CLI too: the window shows it
    if (ch.lora, ch.lora_switchable) != (options.lora, options.lora_switchable):
        project.choose(lora=options.lora, lora_switchable=options.lora_switchable)
    return rec


def _adapt_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    """The adapt stage where it runs (here or on a cluster worker, whose memory is then the one checked)."""
    source, card, options = args
    host_cost.check_fits(card, "adapt", gguf=bool(source.gguf_file))
    free_big_blocks_at_once()
    state.progress(0.0, "loading weights")
    lm = models.load(source.model_copy(update={"path": str(inputs["model"])}), keep_16bit=True)
    here = tuple(a.model_copy(update={"path": str(inputs[f"lora{i}"])}) for i, a in enumerate(options.lora))
    if options.lora_switchable:  # kept apart, as graph inputs: the gate proves the graphs with each and with none
        switch = lora.switchable(lm.model, here, lora_bases(source))
        return adapt_stage.run(lm, options, out, state.sub(0.1, 1.0), switch).model_dump()
    if options.lora:  # merged before adaptation: the equivalence gate then proves the graphs against base + adapters
        state.progress(0.08, f"merging {len(options.lora)} LoRA adapter(s)")
        lora.merge(lm.model, here, lora_bases(source))
    return adapt_stage.run(lm, options, out, state.sub(0.1, 1.0)).model_dump()


def lora_bases(source: model_source.ModelSource) -> list[str]:
    """The names a LoRA adapter's base may be given by for this model: its label first (said in a refusal)."""
    names = [source.label, source.spec, source.repo_id or "", source.gguf_file or ""]
    return names + ([Path(source.path).name] if source.path else [])


def _weight_bytes(card: models.ArchCard) -> float:
    """The base's weights in bytes, as stored: an adapter larger than that is no low-rank update of it."""
    return card.params * card.stored_bits / 8


def quantize(project: Project, options: quantize_stage.QuantizeOptions, state: StateLike,
             force: bool = False, cluster: Cluster | None = None) -> StageRecord:
    """Quantize the project's adapted graphs (the adapt stage must have finished)."""
    up = _require(project, stages.ADAPT)  # before reading its graphs
    quantize_stage.validate(options, stages.load_card(project.stage_dir(stages.ADAPT.name)))
    options = quantize_stage.resolved(options, project.stage_dir(stages.ADAPT.name))  # one key for the same work
    rec = _made_from(project, stages.QUANTIZE, _quantize_body, up, options, state, force, cluster)
    project.choose(target=options.target)  # what the stage was made for is the target now, from the CLI too
    return rec


def compile_graphs(project: Project, options: compile_stage.CompileOptions, state: StateLike,
                   force: bool = False, cluster: Cluster | None = None) -> StageRecord:
    """Compile the quantized graphs to QNN HTP context binaries and verify them on the simulator."""
    up = _require(project, stages.QUANTIZE)  # before reading its options
    options = compile_stage.resolved(options, project.stage_dir(stages.QUANTIZE.name))  # one key for the same work
    return _made_from(project, stages.COMPILE, _compile_body, up, options, state, force, cluster)


def bundle(project: Project, options: bundle_stage.BundleOptions, state: StateLike,
           force: bool = False) -> StageRecord:
    """Write the Genie bundle (config, binaries, tokenizer, metadata), validated by libGenie. A draft project
    (draft-model decoding) is named by its absolute folder and its compile record: compiled again, it makes the
    bundle stale."""
    options = bundle_resolved(project, options)
    return _made_from(project, stages.BUNDLE, _bundle_body, _require(project, stages.COMPILE), options, state, force,
                      None)


def bundle_resolved(project: Project, options: bundle_stage.BundleOptions) -> bundle_stage.BundleOptions:
    """The bundle's options as its key holds them, refused up front when they cannot be built: the decoding mode
    (implied by the draft, so one key for the same work) and the draft's absolute folder and compile record."""
    decoding.resolve(options.decoding, options.draft)
    options = options.model_copy(update={"decoding": None})
    if options.draft:
        folder = Path(options.draft).expanduser().resolve()
        if folder == project.root.resolve():
            raise UserError("The draft project is this project itself: a model drafting for itself proposes exactly "
                            "what it checks, and gains nothing.", "Name another project, with a smaller model.")
        rec = Project.open(folder, create=False).record(stages.COMPILE) if folder.is_dir() else None
        if rec is None:
            raise UserError(f"The draft project {folder} has no finished compile stage.",
                            f"Take the draft model through the compile stage first (`npustudio run MODEL --project "
                            f"{folder} --no-embedding-lut`).")
        options = options.model_copy(update={"draft": str(folder), "draft_key": rec.record.key})
    return options


def mnn(project: Project, options: mnn_stage.MnnOptions, state: StateLike, force: bool = False,
        model: str | None = None) -> StageRecord:
    """The MNN back-end: the project's float model (read again, so an edited model is seen) exported by MNN's
    exporter and checked against the float model on this computer."""
    adapted = project.record(stages.ADAPT)
    if adapted is not None and adapted.options.lora:
        raise UserError("This project's model has LoRA adapters merged; the MNN back-end exports the base model "
                        "without them, which would answer differently.",
                        "Use the Genie bundle for the fine-tuned model, or make the MNN model in a project without "
                        "adapters.")
    choices, prev = project.choices(), project.record(stages.MODEL)
    # at the context length the model was read for: another would make the Genie stages stale
    cl = prev.options.cl if prev is not None else choices.cl
    source, mrec = intake(project, model or choices.model, cl, state.sub(0.0, 0.02))
    card = Done.of(stages.MODEL, mrec).result.card
    options = mnn_stage.resolved(options, card)  # before any weight is loaded; one key for the same work

    def fn(out: Path) -> dict[str, Any]:
        # the float model in memory, as adapt, but widened whole
        host_cost.check_fits(card, "adapt", gguf=bool(source.gguf_file), whole_float32=True)
        free_big_blocks_at_once()
        return mnn_stage.run(source, card, options, out, state.sub(0.02, 1.0),
                             final_dir=project.stage_dir(stages.MNN.name), context_length=cl).model_dump()

    rec, _ = project.run_stage(stages.MNN.name, inputs={stages.MODEL.name: mrec.key, "format": stages.MNN.format},
                               options=options.model_dump(), fn=fn, force=force)
    return rec


def _made_from(project: Project, spec: stages.StageSpec[Any, Any], body: Body, up: Done[Any, Any],
               options: StageOptions, state: StateLike, force: bool, cluster: Cluster | None) -> StageRecord:
    """A stage made from the one before it: its record keys that stage's key and its own output format (redoing
    the earlier stage, or a new format, makes it stale); its `body` reads `spec.reads`' folders, here or on the
    cluster when the stage may run there (a module-level function: a cluster worker unpickles it by name). `up`:
    the intact record of the stage it requires (`_require`, checked once by the caller, which reads that stage's
    folder before this)."""
    assert spec.requires is not None
    where = cluster if spec.remote else None

    def fn(out: Path) -> dict[str, Any]:
        inputs = {s: project.stage_dir(s) for s in spec.reads}
        return _on(where, spec.name, body, inputs, (_card(project), options), out, state,
                   getattr(options, "device", "cpu"))

    rec, _ = project.run_stage(spec.name, inputs={spec.requires: up.record.key, "format": spec.format},
                               options=options.model_dump(), fn=fn, force=force, ran_on=_ran_on(where))
    return rec


def _quantize_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    card, options = args
    if card is not None:  # a recipe that trains or rewrites the weights widens a 16-bit model whole
        host_cost.check_fits(card, "quantize", whole_float32=widens(options.recipe))
        if options.export:
            ar = quantize_stage.adapt_graphs(inputs["adapt"])[0]
            host_cost.check_disk(out, "quantize", host_cost.quantize_disk_bytes(card, options.precision, ar,
                                                                                options.int8_budget))
    free_big_blocks_at_once()
    return quantize_stage.run(inputs["adapt"], options, out, state).model_dump()


def _compile_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    card, options = args
    if card is not None:
        host_cost.check_fits(card, "compile")
    free_big_blocks_at_once()
    return compile_stage.run(inputs["quantize"], inputs["adapt"], options, out, state).model_dump()


def _bundle_body(inputs: dict[str, Path], args: tuple[Any, ...], out: Path, state: StateLike) -> dict[str, Any]:
    _card, options = args
    res = bundle_stage.run(inputs["compile"], inputs["adapt"], options, out, state)
    return res.model_dump() | {"folder": str(inputs["compile"].parent / stages.BUNDLE.name)}


def _on(cluster: Cluster | None, stage: str, body: Any, inputs: Mapping[str, Path | list[Path]], args: Any, out: Path,
        state: StateLike, device: str = "cpu") -> dict[str, Any]:
    """`body` here, or on the Ray cluster at `cluster` (the inputs sent, the output folder brought back)."""
    if cluster is None:
        here = {k: v if isinstance(v, Path) else v[0].parent for k, v in inputs.items()}
        return body(here, args, out, state)
    from .. import cluster as ray_cluster

    return ray_cluster.run(cluster, Job(stage, body, inputs, args, device), out, state)


def _ran_on(cluster: Cluster | None) -> str | None:
    return None if cluster is None else f"Ray cluster at {cluster.address}"


def _card(project: Project) -> models.ArchCard | None:
    rec = project.record(stages.MODEL)
    return rec.result.card if rec is not None else None


def run_stage(project: Project, spec: stages.StageSpec[O, R], options: O, state: StateLike, *,
              force: bool = False, cluster: Cluster | None = None, model: str | None = None,
              where: Literal["here", "child"] = "here") -> Done[O, R]:
    """Any stage, by its declaration: the one call the window, the CLI and the main job make. `where="child"`
    runs it in a spawned process (the window: AIMET and the ONNX export hold the GIL for hundreds of ms), with
    progress, partial results and cancel carried across; `cluster` sends a stage that may run there to Ray."""
    if type(options) is not spec.options:
        raise TypeError(f"the {spec.name} stage takes {spec.options.__name__}, not {type(options).__name__}")
    if where == "child":
        done: Done[O, R] = isolated.run(partial(run_stage, force=force, cluster=cluster, model=model), project,
                                        spec, options, state=state)
        return done
    match options:  # the options' type is the stage's (checked above)
        case AdaptOptions():
            rec = adapt(project, model or project.choices().model, options, state, force=force, cluster=cluster)
        case QuantizeOptions():
            rec = quantize(project, options, state, force=force, cluster=cluster)
        case CompileOptions():
            rec = compile_graphs(project, options, state, force=force, cluster=cluster)
        case BundleOptions():
            rec = bundle(project, options, state, force=force)
        case MnnOptions():
            rec = mnn(project, options, state, force=force, model=model)
        case _:
            raise ValueError(f"{spec.name} is not run with options: it is read by `intake`")
    return Done.of(spec, rec)


def compile_and_bundle(project: Project, options: compile_stage.CompileOptions, state: StateLike,
                       boptions: bundle_stage.BundleOptions | None = None, force: bool = False,
                       cluster: Cluster | None = None
                       ) -> tuple[Done[CompileOptions, CompileResult], Done[BundleOptions, BundleResult]]:
    """Compile (+ simulator check), then the libGenie-validated bundle: the wizard's Compile step."""
    crec = compile_graphs(project, options, state.sub(0.0, 0.9), force=force, cluster=cluster)
    brec = bundle(project, boptions or bundle_stage.BundleOptions(), state.sub(0.9, 1.0), force=force)
    return Done.of(stages.COMPILE, crec), Done.of(stages.BUNDLE, brec)
