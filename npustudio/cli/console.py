"""The two consoles (answers on stdout, everything else on stderr), the live progress bar, and Ctrl-C."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..core.progress import Partial, State
from ..core.progress import Progress as ProgressEvent

# Without a terminal (a CI log, a pipe) rich assumes 80 columns and wraps a table's cells mid-word ("kv-c / ache"):
# there a table takes the width its cells need, up to LOG_WIDTH, and a long line stays one line
LOG_WIDTH = 240


def _console(stream: Any, **kw: Any) -> Console:
    tty = stream.isatty()
    return Console(soft_wrap=not tty, width=None if tty else LOG_WIDTH, **kw)


err = _console(sys.stderr, stderr=True)
out = _console(sys.stdout)


def until_done(work: Callable[[], Any], stop: Any) -> Any:
    """`work()` in a thread while this one waits; Ctrl-C stops it (`host.until_done`) and says so."""
    from ..core.genie import host

    return host.until_done(work, stop, lambda: err.print("\n[dim]stopping…[/]"))


def print_json(obj: Any) -> None:
    """Strict JSON (a NaN or infinity, e.g. a flagged encoding, becomes null: jq and others reject NaN)."""
    sys.stdout.write(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n")


def _finite(obj: Any) -> Any:
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


@contextmanager
def live_state(quiet: bool = False) -> Iterator[State]:
    """A State drawn as a rich progress bar on stderr; perplexity points (unless `quiet`) and warnings are printed
    as they arrive."""
    state = State()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err, transient=True, disable=quiet) as bar:
        task = bar.add_task("starting", total=1.0)

        def on(ev: ProgressEvent | Partial) -> None:
            if isinstance(ev, ProgressEvent):
                bar.update(task, completed=ev.fraction, description=ev.message[:60])
            elif ev.kind == "ppl" and not quiet:
                vals = ", ".join(f"{k} {v:.3f}" for k, v in ev.data.items()
                                 if k.endswith("_ppl") or k == "max_abs_logit_diff")
                err.print(f"  window {ev.data['window']}: {vals}")
            elif ev.kind == "warning":  # something the run went on without (a cache it could not write): said always
                err.print(f"[bold yellow]warning:[/] {escape(ev.data['message'])}")
            elif ev.kind == "plan":  # what the job chose before its long stages: said always
                err.print(f"[bold]plan:[/] {escape(ev.data['message'])}")

        state.subscribe(on)
        yield state


@contextmanager
def stdout_is_for(json_only: bool) -> Iterator[None]:
    """With --json, stdout carries only the JSON: anything a library prints goes to stderr."""
    if not json_only:
        yield
        return
    from ..core.native_io import fd_redirected

    with fd_redirected(1, 2), redirect_stdout(sys.stderr):
        yield
