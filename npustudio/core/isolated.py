"""Run a stage in a child process, with its progress, partial results and cancel carried over as if in-process.

Why: AIMET's quantsim build and the ONNX export hold the GIL for hundreds of milliseconds in C++, which would
freeze any thread that shares the interpreter (the GUI's event loop). In a spawned child the stage has its
own interpreter; the caller passes a `State` and sees the same events, the same `Cancelled` and the same
`UserError` (problem and fix) as when calling the stage directly. The child ends itself if its parent dies.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import quiet
from .errors import UserError
from .progress import Cancelled, State, StateLike

_POLL_S = 0.05


def run(fn: Callable[..., Any], *args: Any, state: StateLike, pass_state: bool = True, nice: int = 10,
        grace_s: float | None = None) -> Any:
    """`fn(*args, state)` (or `fn(*args)`) in a spawned process; `fn` must be a module-level function (it is
    pickled by name) and its result picklable. The child runs `nice`r than its caller: on a 2-core machine the
    export's threads otherwise take the window's CPU (stalls of 61-86 ms on the default model).

    Without `pass_state`, `fn` has no safe point to stop at (a read): once `state` is cancelled the child is
    ended where it is and `Cancelled` raised at once, instead of waiting seconds for a result nobody wants.
    With `grace_s`, a child that has not stopped `grace_s` after the cancel is ended the same way: for work whose
    safe points may be minutes apart (Genie reads a whole prompt before it looks at an abort)."""
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    cancel = ctx.Event()
    proc = ctx.Process(target=_child, args=(fn, args, pass_state, events, cancel, os.getpid(), nice), daemon=True,
                       name=f"npustudio-{getattr(fn, '__name__', 'stage')}")
    proc.start()
    asked: float | None = None  # when the cancel was passed on
    try:
        while True:
            if state.cancelled:
                cancel.set()
                asked = asked or time.monotonic()
                if not pass_state or (grace_s is not None and time.monotonic() - asked > grace_s):
                    _end(proc)
                    raise Cancelled("stopped by the user")
            try:
                kind, payload = events.get(timeout=_POLL_S)
            except queue.Empty:
                if not proc.is_alive():
                    if cancel.is_set() or state.cancelled:  # stopped on request (or killed as the app quit)
                        raise Cancelled("stopped by the user") from None
                    raise RuntimeError(f"the stage process ended with no result (exit {proc.exitcode})") from None
                continue
            if kind == "progress":
                state.progress(*payload)  # raises Cancelled once the user asked; `finally` waits for the child
            elif kind == "partial":
                state.partial(payload[0], **payload[1])
            elif kind == "done":
                return payload
            elif kind == "cancelled":
                raise Cancelled("stopped by the user")
            elif kind == "user_error":
                raise UserError(*payload)
            else:
                import sys

                sys.stderr.write(payload)  # the child's traceback, for a bug report
                raise RuntimeError(payload.splitlines()[0])
    finally:
        cancel.set()
        proc.join(timeout=60 if grace_s is None else grace_s)
        if proc.is_alive():
            _end(proc)


def _end(proc: Any) -> None:
    """End a child now: SIGTERM, then SIGKILL if it is still there a second later."""
    proc.terminate()
    proc.join(timeout=1)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)


def _child(fn: Callable[..., Any], args: tuple[Any, ...], pass_state: bool, events: Any, cancel: Any,
           parent: int, nice: int) -> None:
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    quiet.libraries()
    state = State()

    def forward(ev: Any) -> None:
        if hasattr(ev, "fraction"):
            events.put(("progress", (ev.fraction, ev.message)))
        else:
            events.put(("partial", (ev.kind, ev.data)))

    state.subscribe(forward)

    def watch() -> None:  # the user's cancel, or the parent gone (window killed): stop at the next safe point
        # polled, not cancel.wait(): a process that exits inside Event.wait leaves the parent's set() hanging
        while not cancel.is_set() and os.getppid() == parent:
            time.sleep(0.1)
        state.cancel()

    threading.Thread(target=watch, daemon=True).start()
    try:
        result = fn(*args, state) if pass_state else fn(*args)
    except Cancelled:
        events.put(("cancelled", None))
    except UserError as e:
        events.put(("user_error", (e.problem, e.fix)))
    except BaseException as e:
        events.put(("error", f"{e.__class__.__name__}: {e}\n{traceback.format_exc()}"))
    else:
        events.put(("done", result))
    events.close()
    events.join_thread()
