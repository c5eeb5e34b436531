"""What the project's stages are: done, stale (and why), edited; the wizard's steps derived from them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from .. import stages
from ..errors import UserError
from ..project import Done, Manifest, Project
from ..stages import O, R


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
    deployed = m.choices.deployed
    pushed = bool(brec and deployed and deployed.bundle == brec.key)  # the bundle on the device is the current one
    out: list[WizardStep] = []
    for step in stages.STEPS:
        if step.stages:
            done = all(st[s] == "done" for s in step.stages)
            why = next((stale[s] for s in step.stages if s in stale), "")
            edited = next((s for s in step.stages if st[s] == "changed"), None)
            if edited:
                why = f"files of the {edited} stage were edited or removed"
        elif step.choice == "deployed":
            done = pushed and st[stages.BUNDLE.name] == "done"
            why = "the bundle changed since it was deployed" if deployed and brec and not pushed else ""
        else:
            done, why = m.choices.chosen(step.choice or "") or st[stages.QUANTIZE.name] == "done", ""
        reachable = step.free or all(s.state == "done" for s in out)
        out.append(WizardStep(name=step.name, state="done" if done and reachable else
                              "todo" if reachable else "locked", reason=why))
    return out


def stale_reasons(project: Project) -> dict[str, str]:
    """The finished stages whose output no longer follows from the project as it is, each with the reason in plain
    words: the stage before was redone (the record keys its inputs by the earlier stage's key), or the user has
    since chosen another context length or target."""
    return _stale(project.load())


def _stale(m: Manifest) -> dict[str, str]:
    target = m.choices.target
    out: dict[str, str] = {}
    for name, up in stages.UPSTREAM.items():
        rec, prev = m.stages.get(name), m.stages.get(up)
        if rec is None or rec.status != "done":
            continue
        if up in out:
            out[name] = f"the {up} stage it was made from is out of date"
        elif prev is None or prev.status != "done":
            out[name] = f"the {up} stage it was made from is gone"
        elif name == stages.ADAPT.name and rec.inputs.get("model") != prev.inputs.get("model"):
            out[name] = f"another model was read ({Done.of(stages.MODEL, prev).result.source.spec})"
        elif name == stages.ADAPT.name and (cl := Done.of(stages.ADAPT, rec).options.cl) != (
                now := Done.of(stages.MODEL, prev).options.cl):
            out[name] = f"the context length is now {now} (adapted for {cl})"
        elif name != stages.ADAPT.name and rec.inputs.get(up) != prev.key:
            out[name] = f"the {up} stage was run again since"
        elif name == stages.QUANTIZE.name and target and (
                made_for := Done.of(stages.QUANTIZE, rec).options.target) != target:
            out[name] = f"the target is now {target} (quantized for {made_for})"
    return out


def _require(project: Project, spec: stages.StageSpec[O, R]) -> Done[O, R]:
    """The record of an earlier stage that finished and whose outputs are intact; else say what to rerun (outputs
    edited since are said before a record that does not read as the stage's)."""
    raw = project.load().stages.get(spec.name)
    rerun = f"npustudio {spec.command} --project {project.root}"
    if spec == stages.ADAPT and raw is not None:
        rerun = f"npustudio adapt {raw.inputs.get('model', {}).get('spec', 'MODEL')} --project {project.root}"
    if raw is None or raw.status != "done":
        raise UserError(f"The project {project.root} has no intact {spec.what} yet.",
                        f"Run `{rerun}` first (or `npustudio run`).")
    changed = project.changed(spec.name)
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise UserError(f"The {spec.what} in {project.root} was changed after the {spec.name} stage wrote it "
                        f"({shown}).", f"Rerun that stage: `{rerun}` (it redoes the stage), then this command again.")
    return Done.of(spec, raw)
