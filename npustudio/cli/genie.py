"""Genie on this computer and chats: genie-run (genie-t2t-run compatible), profile, chat."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

from rich.markup import escape
from rich.table import Table

from ..core import layout, stages
from ..core.errors import UserError
from ..core.genie import adapters
from ..core.genie.adapters import Choice
from ..core.genie.meta import read_metadata
from .args import given
from .console import err, live_state, out, print_json, until_done


def cmd_genie_run(a: argparse.Namespace) -> int:
    """genie-t2t-run on this computer (`core/genie/t2t.py`: its flags, framing and runner)."""
    from ..core.genie import t2t

    return t2t.run(a)


def cmd_profile(a: argparse.Namespace) -> int:
    from ..core.genie import profile

    prof = profile.read(Path(a.file))
    summary = profile.summarize(prof).model_dump()
    roof = profile.bundle_roofline(Path(a.bundle)) if a.bundle else None
    if a.json:
        print_json({"summary": summary, "events": [e.model_dump() for e in prof.events], "roofline": roof})
        return 0
    from ..display import human_number as n

    t = Table(title=f"{a.file}  ({summary['runner']})", show_header=False)
    for k, v in summary.items():
        t.add_row(k, "—" if v is None else n(v) if isinstance(v, float) else str(v))
    if roof:
        t.add_row("decode roofline (tok/s)", f"{n(roof['decode_tok_s_bound'])} at {n(roof['memory_gb_s'])} GB/s")
    out.print(t)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    import threading

    from ..core import pipeline

    bundle, where, lora = runner_of(a)
    if a.mnn and a.device is not None and a.prompt is None:  # before the model is pushed there
        raise UserError("MNN's llm_demo on a device answers one question on its own (it keeps no conversation).",
                        'Give the question on the command line: npustudio chat --mnn --device SERIAL "QUESTION".')
    with live_state() as st:
        session = pipeline.open_chat(bundle, where, a.device, a.system, st, lora=lora)
    engine = session.engine
    if note := session.history.notice():
        err.print(f"[yellow]{escape(note)}[/]")
    if a.new or engine.one_question:  # each of its questions is a chat of its own (the earlier ones stay listed)
        session.clear()

    def ask(text: str) -> bool:
        """One turn; Ctrl-C stops the answer (kept in the history as stopped). False when it was stopped."""
        stop = threading.Event()

        def show(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        turn = until_done(lambda: session.send(text, show, stop), stop)
        rate = f", {turn.generation_tok_s:.2f} tok/s" if turn.generation_tok_s else ""
        if turn.tokens_per_call is not None:
            rate += f", {turn.tokens_per_call:.2f} tokens per target call"
        if turn.ttft_s is not None:
            rate += f", TTFT {turn.ttft_s:.2f} s (the runner's)"
        if turn.wait_s is not None:
            rate += f", first words after {turn.wait_s:.2f} s here"
        err.print(f"\n[dim]({engine.name}{rate}{', stopped' if turn.stopped else ''})[/]")
        return not turn.stopped

    if a.prompt:
        return 0 if ask(a.prompt) else 130
    err.print(f"chatting with {bundle} on {engine.name}; empty line or Ctrl-D ends, Ctrl-C stops an answer")
    while True:
        try:
            line = _line("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        ask(line)


Where = Literal["device", "desktop", "preview", "mnn"]


def runner_of(a: argparse.Namespace) -> tuple[Path, Where, Choice]:
    """The bundle, the runner `chat` and `serve` were asked for (one of --device, --desktop, --preview, --mnn) and
    the bundle's switchable LoRA adapter to answer with (--lora), checked against the bundle before any work."""
    if sum((a.preview, a.desktop, a.mnn, a.device is not None and not a.mnn)) > 1:
        raise UserError("Pick one runner: --device, --desktop, --preview or --mnn (with --device: on that device).",
                        "Leave the others out.")
    bundle = Path(a.bundle) if a.bundle else default_bundle(stages.MNN.name if a.mnn else stages.BUNDLE.name)
    lora = adapters.parse(a.lora)
    if lora.name is not None:
        if a.mnn:
            from ..core.lora import refuse_switching

            refuse_switching(lora.name, bundle)
        adapters.check(bundle, read_metadata(bundle), lora)
    where: Where = "mnn" if a.mnn else "preview" if a.preview else "desktop" if a.desktop else "device"
    return bundle, where, lora


def runner_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--bundle", type=given, default=None, help="bundle folder (default: the default project's)")
    s.add_argument("--device", default=None, help="adb serial")
    s.add_argument("--lora", default=None, metavar="NAME[,lora_alpha,STRENGTH]",
                   help="answer with the bundle's LoRA adapter NAME (a bundle built with --lora-switchable), at "
                        "STRENGTH 0 to 1 (default 1); without it the base model answers")
    s.add_argument("--desktop", action="store_true", help="real Genie on this computer's HTP simulator")
    s.add_argument("--preview", action="store_true", help="the fast CPU preview on this computer")
    s.add_argument("--mnn", action="store_true", help="the MNN model (`compile --backend mnn`) run by MNN's runtime "
                   "on this computer, or with --device by MNN's llm_demo on that device (one question, deployed "
                   "first; a phone needs MNN_ANDROID_ROOT); --bundle is then the project's stages/mnn folder")


def _line(prompt: str) -> str:
    """One message typed (or piped) into the chat. From a pipe or a file it is read at most `PROMPT_LIMIT`
    characters deep: `input()` reads to the newline, and /dev/zero or an endless stream has none."""
    from ..core.genie.config import PROMPT_LIMIT

    if sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(PROMPT_LIMIT + 1)
    if not line:
        raise EOFError
    if len(line) > PROMPT_LIMIT:
        raise UserError(f"A message on the chat's input is longer than {PROMPT_LIMIT // 2**20} MiB (is the input a "
                        "device or an endless stream?); no model's context holds that much.",
                        "Pipe in text, one message a line.")
    return line.removesuffix("\n")


def default_bundle(stage: str = "bundle") -> Path:
    """The default project's Genie bundle, or its MNN model's stage folder (`stage="mnn"`)."""
    from ..core import pipeline
    from ..core.project import Project

    b = Project(pipeline.default_project_dir()).stage_dir(stage)
    if stage == stages.MNN.name and not (b / layout.MNN_RESULT).is_file():
        raise UserError("No MNN model given and the default project has none.", "Pass --bundle "
                        "PROJECT/stages/mnn, or run `npustudio compile --backend mnn --project "
                        f"{pipeline.default_project_dir()}` first.")
    if stage != stages.MNN.name and not (b / layout.GENIE_CONFIG).is_file():
        raise UserError("No bundle given and the default project has none.", "Pass --bundle DIR, or run "
                        "`npustudio run` first.")
    return b
