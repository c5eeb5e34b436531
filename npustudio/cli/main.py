"""Headless entry points for every stage. `npustudio` with no arguments opens the desktop app."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from .. import __version__
from ..core import layout, quiet
from ..core.errors import UserError
from ..core.genie import t2t
from ..core.progress import Cancelled
from ..core.stage_options import user_value
from . import account, devices, genie, serve, stages
from .args import (
    adapt_args,
    cluster_arg,
    compile_args,
    decoding_args,
    device_arg,
    given,
    int_in,
    lora_arg,
    max_part_arg,
    option,
    quantize_args,
)
from .console import err

if TYPE_CHECKING:
    from ..core.settings import Settings


def build_parser(prefs: Settings | None = None) -> argparse.ArgumentParser:
    """The commands; a stage option's default and help come from the stage's options model, and the defaults the
    window's settings change (precision, target, device) from `prefs`, by default the settings the window writes
    (a UserError when that file cannot be used)."""
    from ..core import settings as user_settings

    prefs = prefs if prefs is not None else user_settings.load()
    p = argparse.ArgumentParser(prog="npustudio", description=__doc__)
    c = _Commands(p.add_subparsers(dest="cmd"), prefs)
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _model_commands(c)
    _run_command(c)
    _build_commands(c)
    _phone_commands(c)
    _account_commands(c)
    return p


class _Commands:
    """Where the sub-commands are added, with the window's preferences as their defaults."""

    def __init__(self, sub: Any, prefs: Settings) -> None:
        self.sub, self.prefs = sub, prefs

    def add(self, name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        s: argparse.ArgumentParser = self.sub.add_parser(name, help=help, description=help)
        s.set_defaults(fn=fn)
        # also after the command; SUPPRESS keeps `npustudio --debug CMD` from being reset by the sub-parser
        s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback of an unexpected error")
        return s

    def preferred(self, s: argparse.ArgumentParser) -> None:
        """The window's preferences are the CLI's defaults too."""
        names = {a.dest for a in s._actions}
        s.set_defaults(**{k: v for k, v in (("precision", self.prefs.default_precision),
                                            ("target", self.prefs.default_target), ("device", self.prefs.device))
                          if k in names})


def _force_arg(s: argparse.ArgumentParser, help: str = "redo the stage even when its inputs and options are unchanged"
               ) -> None:
    s.add_argument("--force", action="store_true", help=help)


def _json_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _model_commands(c: _Commands) -> None:
    """Reading a model, and the stages that make its graphs."""
    from ..core.stage_options import AdaptOptions

    s = c.add("info", stages.cmd_info, "architecture card and phone-fit estimate of a model")
    s.add_argument("model", type=given, help="default | HF folder | file.gguf | org/name")
    option(s, AdaptOptions, "cl", help="context length for the KV-cache estimate")
    option(s, AdaptOptions, "ar", help="prompt step size (AR-N graph), for the parts estimate")
    lora_arg(s)
    max_part_arg(s)
    _json_arg(s)

    s = c.add("adapt", stages.cmd_stage, "adapt a model to Genie's static graphs and prove it equivalent")
    s.add_argument("model", nargs="?", type=given, default="default")
    s.add_argument("--project", type=given, required=True, help="project folder (created if new)")
    adapt_args(s)
    device_arg(s)
    cluster_arg(s, "the stage")
    _force_arg(s)
    _json_arg(s)
    c.preferred(s)

    s = c.add("quantize", stages.cmd_stage, "calibrate and quantize the adapted graphs with AIMET, then export them")
    s.add_argument("--project", type=given, required=True, help="project folder with an adapted model")
    quantize_args(s)
    device_arg(s)
    cluster_arg(s, "the stage")
    _force_arg(s)
    _json_arg(s)
    c.preferred(s)

    s = c.add("encodings", stages.cmd_encodings, "per-tensor table of an AIMET .encodings file")
    s.add_argument("file", type=given)
    s.add_argument("--flagged", action="store_true", help="only tensors with a flag")
    s.add_argument("--sqnr", action="store_true", help="each tensor's quantization error (SQNR, dB): weights "
                                                       "against the float weights of the file's project, "
                                                       "activations over a short eval; the worst first")
    s.add_argument("--against", type=given, default=None, metavar="BEFORE.encodings",
                   help="what changed from another run's encodings (another project's: a recipe, an override file): "
                        "each tensor's SQNR in both, the most damaged by the change first")
    s.add_argument("--lora", action="store_true", help="what quantization keeps of each merged LoRA adapter: per "
                                                       "module its rank and scale, the graph weights holding it and "
                                                       "the share of its update at least half a quantization step")
    _json_arg(s)


def _run_command(c: _Commands) -> None:
    """The whole job."""
    s = c.add("run", stages.cmd_run, "the whole job on the embedded defaults")
    s.add_argument("--model", type=given, default="default")
    s.add_argument("--project", type=given, default=None,
                   help="project folder (default: the per-user default project)")
    adapt_args(s)
    quantize_args(s)
    compile_args(s, job=True)
    decoding_args(s)
    device_arg(s)
    cluster_arg(s, "adapt, quantize and compile")
    _force_arg(s, "redo every stage even when its inputs and options are unchanged")
    s.add_argument("--no-ask", action="store_true", help="stop at the verified bundle (skip the Genie question)")
    _json_arg(s)
    c.preferred(s)
    if user_value(c.prefs, "default_precision") is None:  # neither the flag nor the settings: the job plans it
        s.set_defaults(precision=None)
        next(x for x in s._actions if x.dest == "precision").help = (
            "w8a16 or w4a16 (default: the best quality whose bundle loads where the job deploys, from the model's "
            "fit; said before the long stages)")


def _build_commands(c: _Commands) -> None:
    """The compiled graphs and their bundle."""
    from ..core.stage_options import BundleOptions

    s = c.add("compile", stages.cmd_stage, "compile the quantized graphs to QNN HTP context binaries and verify them "
            "(or, with --backend mnn, export the float model to MNN and check it)")
    s.add_argument("--project", type=given, required=True)
    s.add_argument("--model", type=given, default=None,
                   help="with --backend mnn: the model to export (default: the project's, else the embedded one)")
    compile_args(s)
    cluster_arg(s, "the stage")
    _force_arg(s)
    _json_arg(s)

    s = c.add("bundle", stages.cmd_stage, "write the Genie bundle (config, binaries, tokenizer), validated by libGenie")
    s.add_argument("--project", type=given, required=True)
    option(s, BundleOptions, "question")
    s.add_argument("--sample", action="store_true", help="sample (top-k/top-p) instead of greedy decoding")
    s.add_argument("--token-graphs-only", action="store_true",
                   help="leave the AR-N prompt graphs out: half the contexts (a model over ~3 GB of them loads on "
                        "the HTP simulator), the prompt read one token at a time")
    decoding_args(s)
    _force_arg(s)
    _json_arg(s)


def _phone_commands(c: _Commands) -> None:
    """Running a bundle: on this computer, on a device, behind an HTTP endpoint."""
    from ..core.stage_options import ServeOptions
    from ..core.targets import DEFAULT_SOC

    s = c.add("genie-run", genie.cmd_genie_run, "run a bundle with the real Genie on the HTP simulator "
            "(genie-t2t-run compatible)")
    t2t.add_flags(s)

    s = c.add("profile", genie.cmd_profile, "read a Genie profile JSON: init, TTFT, rates; roofline with --bundle")
    s.add_argument("file", type=given)
    s.add_argument("--bundle", type=given, default=None, help="the bundle folder, for a roofline estimate")
    _json_arg(s)

    s = c.add("devices", devices.cmd_devices, "adb devices with SoC, NPU arch, Android, RAM and free space")
    _json_arg(s)

    s = c.add("virtual-device", devices.cmd_virtual_device, "start a virtual phone the adb server connects to")
    s.add_argument("--port", type=int_in(0, 65535, skip=range(5554, 5586)), default=0,
                   help="TCP port on 127.0.0.1 (not 5554-5585; 0 = any)")
    s.add_argument("--soc", default=DEFAULT_SOC, help="the SoC it reports (ro.soc.model)")
    s.add_argument("--preview", action="store_true", help="answer with the fast CPU preview instead of real Genie")
    s.add_argument("--root", type=given, default=None, help="folder holding its file system")

    s = c.add("deploy", devices.cmd_deploy, "push a bundle (or a project's MNN model, stages/mnn) to a device "
            "(incremental, resumable)")
    s.add_argument("bundle", type=given, help="a bundle folder, or a project's stages/mnn folder (with MNN's "
                                              "Android runtime from MNN_ANDROID_ROOT)")
    s.add_argument("--device", default=None, help="serial (default: the only phone, else the only device)")
    s.add_argument("--force", action="store_true", help="push every file again")
    _json_arg(s)

    s = c.add("chat", genie.cmd_chat, "chat with a bundle on a device or on this computer")
    s.add_argument("prompt", nargs="?", default=None, help="one question (omit for an interactive chat)")
    genie.runner_args(s)
    s.add_argument("--system", default=None, help="system prompt")
    s.add_argument("--new", action="store_true",
                   help="start a new conversation (the earlier ones stay in the project's chat list)")

    s = c.add("serve", serve.cmd_serve, "an OpenAI-compatible HTTP endpoint (/v1/chat/completions, /v1/completions, "
            "/v1/models) over a bundle on a device or on this computer")
    genie.runner_args(s)
    for name in ("host", "port", "max_waiting"):
        option(s, ServeOptions, name)


def _account_commands(c: _Commands) -> None:
    """The token, the window and its menu entry."""
    s = c.add("token", account.cmd_token, "store, check or delete the Hugging Face token (system keyring only)")
    s.add_argument("action", choices=["set", "delete", "status"])

    s = c.add("gui", account.cmd_gui, "open the desktop application")
    s.add_argument("--project", type=given, default=None, help="project folder to open (default: the last one)")

    s = c.add("desktop-entry", account.cmd_desktop_entry,
            "add NPU Studio to the desktop's application menu (this installation), or take it away")
    s.add_argument("action", choices=["install", "remove"])


def main(argv: list[str] | None = None) -> int:
    """A settings file that cannot be used stops every command (its defaults would not be the user's); without a
    command the window opens and says it itself (see core/settings.py)."""
    from ..core import settings as user_settings

    try:
        prefs, refused = user_settings.load(), None
        prefs.apply()  # the tool folders of Settings, as the window applies them (MNN's runtime, the QNN SDK, adb)
    except UserError as e:
        prefs, refused = user_settings.Settings(), e
    args = build_parser(prefs).parse_args(argv)
    if getattr(args, "debug", False):
        os.environ[quiet.DEBUG_ENV] = "1"
    quiet.libraries()
    if not getattr(args, "fn", None):
        return account.cmd_gui(args)
    # SIGTERM (a session logging out, `kill`, a service manager) stops a command as Ctrl-C does: at the stage's next
    # safe point, its partial output removed, said on the way out; not cut off mid-write with no word
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if refused is not None:
            raise refused
        return args.fn(args)
    except UserError as e:
        err.print(f"[bold red]error:[/] {escape(e.problem)}")
        if e.fix:
            err.print(f"[bold]fix:[/] {escape(e.fix)}")
        return 2
    except (Cancelled, KeyboardInterrupt):
        err.print("stopped; the project keeps its last finished stages.")
        return 130
    except Exception as e:  # a bug, or an input nothing checks yet: a short message; the traceback goes to a log
        return _unexpected(args, e, sys.argv[1:] if argv is None else argv)


def _unexpected(a: argparse.Namespace, e: BaseException, argv: list[str]) -> int:
    """Say what failed and where, write the traceback to a log file (the project's `logs/`, else the per-user log
    folder) and print it only with --debug. Exit 1: a UserError (exit 2) is what a handled bad input gives."""
    import traceback

    from ..core.project import STAGE_NOTE

    tb = "".join(traceback.format_exception(e))
    stage = next((n.removeprefix(STAGE_NOTE) for n in getattr(e, "__notes__", []) if n.startswith(STAGE_NOTE)),
                 None)
    where = f"`npustudio {a.cmd}`" + (f" in the {stage} stage" if stage else "")
    first = (str(e).strip().splitlines() or [""])[0][:300]
    log = _write_log(a, argv, tb)
    err.print(f"[bold red]error:[/] {escape(where)} failed unexpectedly: {e.__class__.__name__}"
              + (f": {escape(first)}" if first else ""))
    err.print(f"The traceback is in {escape(str(log))}." if log else "The traceback could not be written to a log.")
    err.print("[bold]fix:[/] this is a bug in NPU Studio or an input it does not check yet: please report it with "
              "the log. A project keeps its last finished stages." + ("" if getattr(a, "debug", False) else
                                                                          " (--debug prints the traceback)"))
    if getattr(a, "debug", False):
        err.print(tb, markup=False, highlight=False)
    return 1


def _write_log(a: argparse.Namespace, argv: list[str], tb: str) -> Path | None:
    import platform
    import time

    import platformdirs

    from ..core.fsutil import atomic_write_text, refuse_link

    folders = []
    project = getattr(a, "project", None)
    if project and (Path(project).expanduser() / layout.MANIFEST).is_file():
        folders.append(Path(project).expanduser() / layout.LOGS_DIR)
    folders.append(platformdirs.user_log_path("npustudio"))
    name = f"npustudio-{a.cmd}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    text = (f"npustudio {__version__}, Python {platform.python_version()}, {platform.platform()}\n"
            f"command: npustudio {' '.join(argv)}\n\n{tb}")
    for folder in folders:
        try:
            refuse_link(folder)
            atomic_write_text(folder / name, text)
            return folder / name
        except (OSError, UserError):
            continue
    return None
