"""The desktop runner: a bundle run by the real libGenie on the HTP simulator, or a fast CPU preview.

`run(config_path, prompt, on_text, ...)` is what genie-t2t-run on this computer (`t2t`: `npustudio genie-run`
and the virtual device's `genie-t2t-run`) and the chat panel call. Text arrives through `on_text` as Genie
produces it; `stop` (a threading.Event) aborts a query from any thread; the profile JSON Genie writes
is saved where asked.

The preview runs the same quantized graphs (the compile stage's prepared graphs, uint16 I/O with the
same encodings) on onnxruntime's CPU EP through the host KV-cache loop, with greedy sampling; its profile
has Genie's shape and says `"runner": "preview (CPU)"`. It is not the HTP: use it for interactive chat.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from .. import layout
from ..errors import UserError
from ..fsutil import atomic_write_text
from ..progress import State
from . import adapters, libgenie
from . import config as genie_config

if TYPE_CHECKING:
    from .meta import BundleMeta

OnText = Callable[[str], None]
STOP_GRACE_S = 1.0  # how long Genie has to take an abort before its child process is ended (Stop within 2 s)


class RunResult(BaseModel):
    text: str
    status: str  # complete | aborted | context-full (the prompt plus answer filled the context)
    runner: str  # genie (HTP simulator) | preview (CPU)
    seconds: float
    profile: str | None = None


def run(config_path: Path, prompt: str, on_text: OnText, profile_path: Path | None = None, log_level: str = "error",
        on_log: Callable[[str], None] | None = None, stop: threading.Event | None = None,
        max_tokens: int | None = None, preview: bool = False,
        on_query: Callable[[], None] | None = None, lora: adapters.Choice | None = None) -> RunResult:
    """`on_query` is called once the runner is loaded and starts on the prompt: the wait a person sees splits there
    into loading and reading the prompt. `lora`: the bundle's switchable adapter to answer with (none: the base)."""
    if not prompt:
        raise UserError("The prompt is empty.", "Give a prompt with -p or --prompt_file.")
    genie_config.check_prompt(prompt)
    if profile_path is not None:
        check_output_file(Path(profile_path), "--profile")
    lora = lora or adapters.Choice()
    if lora.name is not None:
        adapters.check(Path(config_path).parent, _metadata(Path(config_path).parent), lora)
    if preview:
        return _preview(Path(config_path), prompt, on_text, profile_path, stop, max_tokens, lora)
    return _genie(Path(config_path), prompt, on_text, profile_path, log_level, on_log, stop, max_tokens, on_query,
                  lora)


def run_apart(config_path: Path, prompt: str, on_text: OnText, stop: threading.Event | None = None,
              max_tokens: int | None = None, log_level: str = "error",
              on_log: Callable[[str], None] | None = None, on_query: Callable[[], None] | None = None,
              lora: adapters.Choice | None = None) -> RunResult:
    """`run` with real Genie in a child process at a lower CPU priority (`isolated.run`), its text and log
    arriving here as Genie produces them and `stop` aborting it there. For the window: in its process the HTP
    simulator's threads took both cores at the window's own priority for minutes, and the tokenizer's load held
    the GIL, and its event loop stalled 60-150 ms a dozen times per answer (the default model, 2 cores)."""
    from ..isolated import run as run_isolated
    from ..progress import Cancelled

    state = State.stopped_by(stop) if stop is not None else State()  # the caller's Stop cancels the child
    streamed: list[str] = []

    def forward(ev: Any) -> None:
        kind = getattr(ev, "kind", None)
        if kind == "text":
            streamed.append(ev.data["text"])
            on_text(ev.data["text"])
        elif kind == "log" and on_log is not None:
            on_log(ev.data["line"])
        elif kind == "query" and on_query is not None:
            on_query()

    state.subscribe(forward)
    t0 = time.perf_counter()
    try:
        result: RunResult = run_isolated(_run_in_child, Path(config_path), prompt, max_tokens, log_level,
                                         on_log is not None, lora, state=state, grace_s=STOP_GRACE_S)
    except Cancelled:  # Genie did not take the abort in time (it reads a whole prompt first): its child was ended
        return RunResult(text="".join(streamed), status="aborted", runner="genie (HTP simulator)",
                         seconds=round(time.perf_counter() - t0, 3))
    return result


def _run_in_child(config_path: Path, prompt: str, max_tokens: int | None, log_level: str, with_log: bool,
                  lora: adapters.Choice | None, state: State) -> RunResult:
    """`run_apart`'s child: the parent's stop arrives as `state`'s cancel, which Genie's abort watcher waits on."""
    return run(config_path, prompt, lambda s: state.partial("text", text=s), stop=state.stop_event,
               max_tokens=max_tokens, log_level=log_level,
               on_log=(lambda line: state.partial("log", line=line)) if with_log else None,
               on_query=lambda: state.partial("query"), lora=lora)


def until_done(work: Callable[[], Any], stop: threading.Event, on_stop: Callable[[], None] | None = None) -> Any:
    """`work()` in a thread while this one waits: Ctrl-C sets `stop` (Genie aborts and the run returns what it
    has; `on_stop` says so) instead of being lost, as a KeyboardInterrupt raised inside Genie's ctypes callback is.
    Waits on an Event, not Thread.join: an interrupted join can report a live thread as finished (Python 3.11), and
    leaving while Genie still runs crashes the interpreter at exit."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="npustudio-generate", daemon=True).start()
    while not done.is_set():
        try:
            done.wait(0.1)
        except KeyboardInterrupt:
            if not stop.is_set():
                stop.set()
                if on_stop is not None:
                    on_stop()
    if "error" in box:
        raise box["error"]
    return box["value"]


def check_output_file(path: Path, what: str) -> None:
    """Before any work: the file a run will write can be written (checked first, so a failed write after a
    long run cannot hide the run's own result or error)."""
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; it must name a file to write.", f"Give {what} a file name.")
    if not path.parent.is_dir():
        raise UserError(f"{what} {path}: the folder {path.parent} does not exist.", "Create it or pick another place.")


def _genie(config_path: Path, prompt: str, on_text: OnText, profile_path: Path | None, log_level: str,
           on_log: Callable[[str], None] | None, stop: threading.Event | None, max_tokens: int | None,
           on_query: Callable[[], None] | None = None, lora: adapters.Choice | None = None) -> RunResult:
    cfg = genie_config.absolute(genie_config.read(config_path), config_path.parent)
    try:
        meta: BundleMeta | None = _metadata(config_path.parent)
    except UserError:  # a bundle made elsewhere has no metadata: Genie says what it finds
        meta = None
    shared = meta is not None and meta.weight_shared
    if shared:
        raise UserError("This bundle's binaries are weight-shared, for a phone: the x86 HTP simulator cannot "
                        "load them (Genie and onnxruntime crash on it).",
                        "Deploy it to a phone, use --preview here, or compile without weight sharing.")
    level = libgenie.LOG_LEVELS.get(log_level)
    if level is None:
        raise UserError(f"Unknown log level {log_level!r}.", "Use error, warn, info or verbose.")
    t0 = time.perf_counter()
    dialog = libgenie.Dialog(json.dumps(cfg), log_level=level,
                             on_log=(lambda _lv, line: on_log(line)) if on_log else None)
    pieces: list[str] = []
    watch = _Aborter(dialog, stop)
    try:
        if meta is not None:
            adapters.apply(dialog, meta, lora or adapters.Choice())
        # Genie refuses a query outright ("Context Size was exceeded") when prompt + its token budget
        # exceed the context, and its default budget is the whole context: give it the room that is left
        room = _room(cfg, prompt)
        dialog.set_max_tokens(min(max_tokens, room) if max_tokens else room)

        def text(s: str, _code: str) -> None:
            if s:
                pieces.append(s)
                on_text(s)

        if on_query is not None:
            on_query()
        status = 1 if stop is not None and stop.is_set() else dialog.query(prompt, text)
    finally:
        watch.end()  # before the dialog is freed: no abort may reach a freed handle
        dialog.close()  # ends the profile's query events
        profile = dialog.profile_json()
        dialog.free_profile()
    aborted = status == 1 or (stop is not None and stop.is_set())
    failed = status not in (0, 1, 4) and not aborted
    if profile and profile_path:
        try:
            atomic_write_text(Path(profile_path), profile)
        except (OSError, UserError) as e:
            if not failed:  # else Genie's own error below is what the user needs to see
                raise UserError(f"Genie ran, but its profile could not be written to {profile_path}: {e}",
                                "Give --profile a file in a writable folder.") from e
    if failed:
        raise libgenie.GenieError("Genie's query failed", status, dialog.log)
    outcome = "aborted" if aborted else "context-full" if status == 4 else "complete"
    return RunResult(text="".join(pieces), status=outcome, runner="genie (HTP simulator)",
                     seconds=round(time.perf_counter() - t0, 3), profile=profile)


class _Aborter:
    """Abort a dialog whenever `stop` is set, again every 50 ms: Genie keeps no abort sent before its query
    started, and reads a whole prompt before it looks at one. `end()` before the dialog is freed."""

    def __init__(self, dialog: libgenie.Dialog, stop: threading.Event | None) -> None:
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        if stop is not None:
            def watch() -> None:
                while not self.done.is_set():
                    if stop.wait(0.05):
                        dialog.abort()
                        self.done.wait(0.05)
            self.thread = threading.Thread(target=watch, daemon=True)
            self.thread.start()

    def end(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()


def run_each(config_path: Path, prompts: list[str], max_tokens: int,
             stop: threading.Event | None = None) -> tuple[list[RunResult], str | None]:
    """Each prompt's answer from one loaded dialog, reset between prompts, and the profile of them all: a check
    over several prompts loads the binaries once, not once per prompt (minutes on the simulator at real size).
    `stop` aborts the query under way and raises `Cancelled` (a bundle's draft check took 8 runs Ctrl-C ignored)."""
    from ..progress import Cancelled

    cfg = genie_config.absolute(genie_config.read(config_path), config_path.parent)
    dialog = libgenie.Dialog(json.dumps(cfg), log_level=libgenie.LOG_LEVELS["error"])
    results: list[RunResult] = []
    watch = _Aborter(dialog, stop)
    try:
        for prompt in prompts:
            if stop is not None and stop.is_set():
                raise Cancelled("stopped by the user")
            genie_config.check_prompt(prompt)
            pieces: list[str] = []
            t0 = time.perf_counter()
            dialog.set_max_tokens(min(max_tokens, _room(cfg, prompt)))
            status = dialog.query(prompt, partial(_collect, pieces))
            if stop is not None and stop.is_set():
                raise Cancelled("stopped by the user")
            if status not in (0, 4):
                raise libgenie.GenieError("Genie's query failed", status, dialog.log)
            results.append(RunResult(text="".join(pieces), status="context-full" if status == 4 else "complete",
                                     runner="genie (HTP simulator)", seconds=round(time.perf_counter() - t0, 3)))
            dialog.reset()
    finally:
        watch.end()
        dialog.close()
        profile = dialog.profile_json()
        dialog.free_profile()
    return results, profile


def _collect(into: list[str], text: str, _code: str) -> None:
    into.append(text)


def _room(cfg: dict[str, Any], prompt: str) -> int:
    from tokenizers import Tokenizer

    size = int(cfg["dialog"]["context"]["size"])
    tok = Tokenizer.from_file(cfg["dialog"]["tokenizer"]["path"])
    n = 1 + len(tok.encode(prompt, add_special_tokens=False).ids)  # Genie prepends BOS
    if n >= size:
        raise UserError(f"The prompt is {n} tokens; the model's context holds {size}.",
                        "Shorten the prompt (or the chat history).")
    if cfg["dialog"].get("type") == "spd":
        # the target checks the draft's tokens with its widest graph, whose cache holds the context less its width:
        # past that, libGenie 1.21 aborts the whole process (measured on the HTP simulator), so the answer stops there
        size -= _check_width(cfg)
        if n >= size:
            raise UserError(f"The prompt is {n} tokens; with draft-model decoding the context holds {size}.",
                            "Shorten the prompt (or the chat history), or use a bundle without a draft.")
    return size - n


def _check_width(cfg: dict[str, Any]) -> int:
    """The widest graph of an spd dialog's target (its binaries' AR, from the bundle's metadata beside them)."""
    target = next(e for e in cfg["dialog"]["engine"] if e.get("role") == "target")
    folder = Path(target["model"]["binary"]["ctx-bins"][0]).parent
    return max(g.ar for g in _metadata(folder).graphs)


class TextPieces:
    """An answer's tokens turned into text as they come, handed on a whole UTF-8 character at a time (a token may
    end inside one): the CPU preview's and MNN's streams."""

    def __init__(self, tok: Any, on_text: OnText) -> None:
        self.tok, self.on_text = tok, on_text
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.text()
        if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
            self.on_text(text[len(self.shown):])
            self.shown = text

    def text(self) -> str:
        return str(self.tok.decode(self.ids, skip_special_tokens=False))


class Preview:
    """The bundle's quantized graphs on the CPU, kept loaded between queries (chat)."""

    def __init__(self, bundle_dir: Path, lora: adapters.Choice | None = None) -> None:
        import torch
        from transformers import PreTrainedTokenizerFast

        from ..graph.kv_cache import KVCacheRunner
        from ..graph.ort_graph import OrtGraph, cpu_session

        t0 = self.origin = time.perf_counter()  # profile times count from here, as Genie's do from create
        meta = _metadata(bundle_dir)
        prepared = Path(meta.project_compile_dir) / layout.PREPARED if meta.project_compile_dir else None
        if prepared is None or not prepared.is_dir():
            raise UserError(f"The preview needs the project that built this bundle "
                            f"({prepared or 'its compile folder'} is missing).",
                            "Run without --preview (real Genie), or rebuild the bundle from its project.")
        graphs = {g.ar: OrtGraph(cpu_session(prepared / f"{g.name}.onnx"), meta.io_encodings,
                                 prepared / layout.EMBEDDING_LUT) for g in meta.graphs}
        self.runner = KVCacheRunner(meta.decoder, meta.context_length, graphs,  # type: ignore[arg-type]
                                    torch.tensor(meta.rope_inv_freq))
        self.runner.extra = adapters.feeds(bundle_dir, meta, lora or adapters.Choice())
        self.tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle_dir / layout.TOKENIZER))
        self.bos, self.eos = meta.bos_id, set(meta.eos_ids)
        warm = meta.eos_ids[0] if meta.bos_id is None else meta.bos_id
        self.runner.prefill([warm])  # each graph's first run is slow (ORT's allocations): pay it in init,
        self.runner.step([warm], 1)  # as Genie pays its graph setup, not in the first answer's rate
        self.runner.reset()
        self.init_us = int((time.perf_counter() - t0) * 1e6)

    def query(self, prompt: str, on_text: OnText, stop: threading.Event | None = None,
              max_tokens: int | None = None) -> tuple[str, dict[str, Any], bool]:
        """Greedy answer to `prompt` (BOS prepended, as Genie does); returns text, profile event, aborted."""
        r = self.runner
        ids = ([] if self.bos is None else [self.bos]) + self.tok(prompt, add_special_tokens=False)["input_ids"]
        room = r.cl - r.ar_prompt - len(ids)
        if room <= 0:
            raise UserError(f"The prompt ({len(ids)} tokens) does not fit the context ({r.cl}).",
                            "Shorten the prompt or the history.")
        limit = min(max_tokens or room, room)
        t0 = time.perf_counter()
        r.reset()
        last = r.prefill(ids)[-1]
        ttft = time.perf_counter() - t0
        pieces = TextPieces(self.tok, on_text)
        out = pieces.ids
        aborted = False
        t_gen = time.perf_counter()
        while len(out) < limit:
            if stop is not None and stop.is_set():
                aborted = True
                break
            tok = int(last.argmax())
            if tok in self.eos:
                break
            pieces.add(tok)
            last = r.step([tok], 1)[-1]
        gen = time.perf_counter() - t_gen
        stop_t = time.perf_counter()
        event = {"type": "GenieDialog_query", "duration": int((stop_t - t0) * 1e6),
                 "start": int((t0 - self.origin) * 1e6), "stop": int((stop_t - self.origin) * 1e6),
                 "num-prompt-tokens": {"value": len(ids), "unit": ""},
                 "prompt-processing-rate": {"value": round(len(ids) / max(ttft, 1e-9), 3), "unit": "toks/sec"},
                 "time-to-first-token": {"value": int(ttft * 1e6), "unit": "us"},
                 "num-generated-tokens": {"value": len(out), "unit": ""},
                 "token-generation-rate": {"value": round(len(out) / max(gen, 1e-9), 3), "unit": "toks/sec"},
                 "token-generation-time": {"value": int(gen * 1e6), "unit": "us"}}
        return pieces.text(), event, aborted

    def profile(self, events: list[dict[str, Any]]) -> str:
        create = {"type": "GenieDialog_create", "duration": self.init_us, "start": 0, "stop": self.init_us,
                  "init-time": {"value": self.init_us, "unit": "us"}}
        return json.dumps({"header": {"header_version": {"major": 0, "minor": 1, "patch": 0},
                                      "artifact_type": "GENIE_PROFILE"},
                           "metadata": {"timestamp": int(time.time() * 1e6), "runner": "preview (CPU)"},
                           "components": [{"name": "dialog0", "type": "dialog", "events": [create, *events]}]})


def _preview(config_path: Path, prompt: str, on_text: OnText, profile_path: Path | None,
             stop: threading.Event | None, max_tokens: int | None, lora: adapters.Choice) -> RunResult:
    t0 = time.perf_counter()
    pv = Preview(config_path.parent, lora)
    text, event, aborted = pv.query(prompt, on_text, stop, max_tokens)
    profile = pv.profile([event])
    if profile_path:
        atomic_write_text(Path(profile_path), profile)
    return RunResult(text=text, status="aborted" if aborted else "complete", runner="preview (CPU)",
                     seconds=round(time.perf_counter() - t0, 3), profile=profile)


def _metadata(bundle_dir: Path) -> BundleMeta:
    from .meta import read_metadata

    return read_metadata(bundle_dir)
