"""The phone side of a project: deploy its bundle, chat with it, ask its sample question, its decode bound."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from .. import layout, stages
from ..errors import UserError
from ..fsutil import refuse_link
from ..genie.meta import read_metadata
from ..genie.profile import Summary as ProfileSummary

if TYPE_CHECKING:
    from ..chat import ChatSession, Engine
    from ..genie.adapters import Choice
    from ..targets import Soc
from ..progress import State, StateLike
from ..project import Deployed, Project
from .status import _require, stale_reasons


def deploy(project: Project, dev: Any, state: StateLike, force: bool = False) -> Any:
    """Push the project's bundle to `dev` and record it, with the bundle it was, so the project knows it is
    deployed (from the window or the CLI alike) and when a newer bundle makes that stale."""
    import time

    from ..device import deploy as device_deploy

    brec = _require(project, stages.BUNDLE)
    folder = project.stage_dir(stages.BUNDLE.name)
    recorded = {f.name: (fr.bytes, fr.mtime_ns, fr.sha256) for fr in brec.record.outputs
                if fr.mtime_ns is not None and (f := project.root / fr.path).parent == folder}
    res = device_deploy.deploy(folder, dev, state, force=force, recorded=recorded)
    project.choose(deployed=Deployed(device=res.device, remote_dir=res.remote_dir, bundle=brec.record.key,
                                     at=time.time()))
    return res


MNN_REMOTE_SUFFIX = "-mnn"  # the MNN model's device folder is the project's name with this: beside its Genie bundle
MNN_HOST_ONLY = ("export_args.json",)  # the exporter's record of its run, with this computer's paths: not for a phone


def deploy_mnn(stage_dir: Path, dev: Any, state: StateLike, force: bool = False) -> Any:
    """Push the MNN stage's model, with MNN's Android runtime (`mnn.android`) when the user has one, to `dev`.
    A phone needs that runtime, and is refused before any byte moves without it; the virtual device answers
    llm_demo itself (MNN's runtime on this computer)."""
    from ..device import deploy as device_deploy
    from ..mnn import android, config_check

    stage_dir = Path(stage_dir)
    record = stages.MNN.load(stage_dir)  # "not an MNN model" before anything else
    files = device_deploy.folder_files(stage_dir / layout.MNN_MODEL, MNN_HOST_ONLY.__contains__, "the MNN model",
                                       "Export the model again: `npustudio compile --backend mnn --project P "
                                       "--force`.")
    _as_recorded(stage_dir / layout.MNN_MODEL, record.files)
    config_check.check(stage_dir / layout.MNN_MODEL / layout.MNN_CONFIG)
    root = android.configured()
    if root is None and not dev.virtual:
        raise UserError(f"{dev.serial} needs MNN's Android runtime (llm_demo and its libraries) to run the MNN "
                        "model, and NPU Studio cannot download it.",
                        f"Set {android.ENV} (or Settings > MNN Android runtime) to {android.BUILD_HINT}.")
    runtime = android.runtime_files(root) if root is not None else []
    clash = sorted({p.name for p in runtime} & {p.name for p in files})
    if clash:
        raise UserError(f"The MNN runtime folder {root} holds files named as the model's ({', '.join(clash)}).",
                        "Point it at the build folder with llm_demo and its libraries only.")
    rdir = device_deploy.remote_dir(stage_dir, MNN_REMOTE_SUFFIX)
    return device_deploy.deploy_files(files + runtime, rdir, dev, state, force)


def _as_recorded(folder: Path, recorded: list[dict[str, Any]]) -> None:
    """UserError naming the first file of the MNN model that is missing, added or changed since the stage made it
    (its size, and its sha256 where the record has one)."""
    from ..fsutil import sha256_file

    fix = "Make the model again: `npustudio compile --backend mnn --project P --force`."
    want = {f["file"]: f for f in recorded}
    have = {p.name for p in folder.iterdir() if p.is_file() or p.is_symlink()} if folder.is_dir() else set()
    for name in sorted(want.keys() - have):
        raise UserError(f"The MNN model in {folder} is incomplete: {name} is missing.", fix)
    for name in sorted(have - want.keys() - set(MNN_HOST_ONLY)):
        raise UserError(f"The MNN model in {folder} holds {name}, which the stage did not make.",
                        f"Remove {name} from the folder, or {fix[0].lower()}{fix[1:]}")
    for name, f in sorted(want.items()):
        p = folder / name
        size = p.lstat().st_size
        if size != f["bytes"] or ("sha256" in f and not p.is_symlink() and sha256_file(p) != f["sha256"]):
            raise UserError(f"{name} in the MNN model {folder} changed since the stage made it "
                            f"({size:,} bytes, recorded {f['bytes']:,}" +
                            (")." if size != f["bytes"] else "; its content differs)."), fix)


def open_chat(bundle: Path, where: Literal["device", "desktop", "preview", "mnn"], serial: str | None = None,
              system: str | None = None, state: StateLike | None = None, apart: bool = False,
              lora: Choice | None = None) -> ChatSession:
    """A chat over a bundle, with its history, on the runner `open_engine` gives."""
    from .. import chat

    return chat.ChatSession(Path(bundle), open_engine(bundle, where, serial, state, apart, lora), system=system)


def open_engine(bundle: Path, where: Literal["device", "desktop", "preview", "mnn"], serial: str | None = None,
                state: StateLike | None = None, apart: bool = False, lora: Choice | None = None) -> Engine:
    """The runner for a bundle: on a device (the bundle deployed there first: nothing moves when it is there
    already, and a project's bundle is recorded as deployed), with real Genie on this computer (`apart`: in a child
    process at a lower CPU priority), or with the CPU preview; `mnn`: the MNN stage's model (`bundle` is that
    stage's folder) run by MNN's runtime on this computer, or by llm_demo on the device `serial` (deployed there
    first). `lora`: the bundle's switchable LoRA adapter the answers come with (none: the base model)."""
    from .. import chat, device
    from ..device import deploy as device_deploy

    bundle = Path(bundle)
    if where == "mnn":
        if serial is None:
            return chat.MnnEngine(bundle)
        dev = device.pick(serial)
        pushed = deploy_mnn(bundle, dev, state or State())
        return chat.MnnDeviceEngine(dev.serial, bundle, pushed.remote_dir)
    read_metadata(bundle)  # "not a bundle" before "no device"
    if where == "device":
        dev = device.pick(serial)
        project = project_of_bundle(bundle)
        if project is not None:
            deploy(project, dev, state or State())
        else:
            device_deploy.deploy(bundle, dev, state or State())
        return chat.DeviceEngine(dev.serial, bundle, virtual=dev.virtual, lora=lora)
    return chat.DesktopEngine(bundle, preview=where == "preview", apart=apart, lora=lora)


def decode_bounds(project: Project, target: Soc) -> list[tuple[str, dict[str, float], str]]:
    """The decode roofline on `target` per precision of the model's fit: (precision, roofline, basis), by one
    definition (`FitEstimate.decode_bound`: the bytes a generated token reads over the memory bandwidth). The
    precision the project's bundle is current for is measured from that bundle's token graph
    (`profile.bundle_roofline`, the figure the profiles show); the others are the fit's estimate. The Model and
    Target pages both show these."""
    from ..genie import profile

    rec = project.record(stages.MODEL)
    if rec is None:
        return []
    intake = rec.result
    built = None
    quant, bundle = project.record(stages.QUANTIZE), project.record(stages.BUNDLE)
    if quant and bundle and stages.BUNDLE.name not in stale_reasons(project):
        built = quant.result.precision
    out = []
    for f in intake.fit:
        if f.precision == built:
            folder = project.stage_dir(stages.BUNDLE.name)
            try:
                # a bundle built for the simulator (one binary per graph, quick finalization) reads other bytes
                # than a phone's weight-shared build: the default model's w4a16 token graph 154.6 MB here against
                # 98.5 MB estimated for a phone. Said, so the figure is not taken for the phone's
                form = "" if read_metadata(folder).weight_shared else " (as built for the simulator; a phone's " \
                    "weight-shared build reads other bytes)"
                out.append((f.precision, profile.bundle_roofline(folder, target),
                            f"measured: the bundle's token graph and its KV cache{form}"))
                continue
            except UserError:  # a bundle folder damaged since: the estimate still holds
                pass
        bound = f.decode_bound(target.soc)
        out.append((f.precision, {"memory_gb_s": target.memory_gb_s, "decode_tok_s_bound": bound,
                                  "bytes_per_token": round(target.memory_gb_s * 1e9 / bound)},
                    f"estimate: the weights on the HTP and the KV cache at CL {f.context_length}"))
    return out


def project_of_bundle(folder: Path) -> Project | None:
    """The project whose bundle stage `folder` is, if it is one."""
    root = layout.project_of_stage(folder)
    is_bundle = root is not None and Path(folder).resolve().name == stages.BUNDLE.name
    return Project.open(root, create=False) if root is not None and is_bundle else None


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

    from .. import device
    from ..device import remote_genie
    from ..genie import profile as genie_profile
    from ..genie import t2t

    state = state or State()
    folder = project.stage_dir(stages.BUNDLE.name)
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
        meta = read_metadata(folder)
        return SampleAnswer(device=dev.serial, virtual=dev.virtual, question=meta.question, answer=res.text,
                            stopped_after_tokens=max_tokens if res.status == "stopped" or dev.virtual else None,
                            deploy={"bytes_sent": pushed.bytes_sent, "bytes_skipped": pushed.bytes_skipped},
                            profile=res.profile_path, profile_summary=summary)
    finally:
        if started is not None:
            device.stop_virtual(started)
