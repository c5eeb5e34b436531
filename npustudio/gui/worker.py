"""Long work off the GUI thread: a core `State` turned into Qt signals, throttled, with cancel.

Every stage, deploy, device query and chat turn goes through `start()`, so the GUI thread only ever
draws: progress is emitted at most every `THROTTLE_S`, partial results (PPL points) as they come,
and a `UserError`'s problem and fix reach the window unchanged.

Nothing here is waited for on the GUI thread: closing the window cancels every job (`cancel_all`) and returns;
`main` waits for them once the window is gone. A *read* (`start(read=True)`: the inspector's encodings, a
weight histogram) is for one view only: cancelled when that view closes or switches projects, and a result that
arrives after its cancel is dropped, never drawn into a view that has moved on.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal
from shiboken6 import isValid

from ..core.errors import UserError
from ..core.progress import Cancelled, Partial, Progress, State

THROTTLE_S = 0.05
_live: set[Job] = set()  # jobs running now: kept alive until they finish, cancelled when the window closes


class Job(QObject):
    progress = Signal(float, str)
    partial = Signal(str, dict)
    done = Signal(object)
    failed = Signal(str, str)  # problem, fix
    cancelled = Signal()
    finished = Signal()

    def __init__(self, fn: Callable[[State], Any], name: str = "", read: bool = False) -> None:
        super().__init__()
        self.fn, self.name, self.read = fn, name, read
        self.state = State()
        self.state.subscribe(self._on_event)
        self._last = 0.0
        self._message = ""
        self.running = False

    def cancel(self) -> None:
        self.state.cancel()

    def _on_event(self, ev: Progress | Partial) -> None:  # worker thread
        if isinstance(ev, Partial):
            self.partial.emit(ev.kind, dict(ev.data))
            return
        now = time.monotonic()
        if now - self._last >= THROTTLE_S or ev.fraction >= 1.0 or ev.message != self._message:
            self._last, self._message = now, ev.message  # a new step's message always gets through
            self.progress.emit(ev.fraction, ev.message)

    def _emit(self, name: str, *args: Any) -> None:
        """Emit unless the window (and this QObject with it) is gone: a job still running when the window
        closed ends after Qt deleted its objects, and nobody listens any more."""
        try:
            if isValid(self):
                getattr(self, name).emit(*args)
        except RuntimeError:  # "Signal source has been deleted": deleted between the check and the emit
            pass

    def run(self) -> None:  # worker thread
        outcome: tuple[Any, ...] = ("cancelled",)
        try:
            outcome = ("done", self.fn(self.state))
        except Cancelled:
            pass
        except Exception as e:  # shown as a dialog, never a crash of the window
            if self.state.cancelled:  # whatever stopped a cancelled job (the app quitting kills its child)
                pass
            elif isinstance(e, UserError):
                outcome = ("failed", e.problem, e.fix)
            else:
                traceback.print_exc()
                outcome = ("failed", f"{self.name or 'The task'} failed: {e.__class__.__name__}: {e}",
                           "This is a bug in NPU Studio; the project keeps its last good state.")
        finally:
            # not running any more before anyone hears the outcome: the GUI thread handles `done` at once, and a
            # slot that asks whether the job still runs (the chat's Send button) must hear no
            self.running = False
            self._emit(*outcome)
            self._emit("finished")


class _Runnable(QRunnable):
    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def run(self) -> None:
        self.job.run()


_DROPPED_WHEN_CANCELLED = ("done", "failed", "partial", "progress")  # what a cancelled read no longer shows


def start(fn: Callable[[State], Any], name: str = "", read: bool = False, **slots: Callable[..., Any]) -> Job:
    """Run `fn(state)` in the thread pool; `slots` connect signals by name (done=..., failed=...). With `read`,
    the job only reads for a view: once cancelled, its results are dropped on the GUI thread as they arrive
    (`cancelled` and `finished` still come)."""
    job = Job(fn, name, read)
    for sig, slot in slots.items():
        getattr(job, sig).connect(_unless_cancelled(job, slot) if read and sig in _DROPPED_WHEN_CANCELLED else slot)
    job.running = True
    _live.add(job)
    job.finished.connect(lambda: _live.discard(job))
    QThreadPool.globalInstance().start(_Runnable(job))
    return job


def _unless_cancelled(job: Job, slot: Callable[..., Any]) -> Callable[..., Any]:
    """`slot`, skipped when `job` was cancelled before the signal reached the GUI thread: a read that finished
    just as its view switched projects queues its `done` behind the switch."""
    def deliver(*args: Any) -> None:
        if not job.state.cancelled:
            slot(*args)

    return deliver


def cancel_all(wait_ms: int = 0) -> bool:
    """Ask every running job to stop. The window calls it as it closes and does not wait (a read that was still
    starting its child process held the close 6.5-16 s); `main` waits up to `wait_ms` once the window is gone,
    so the settings write finishes. True when all ended."""
    for job in list(_live):
        job.cancel()
    if wait_ms <= 0:
        return not running()
    return QThreadPool.globalInstance().waitForDone(wait_ms)


def running() -> list[Job]:
    return [j for j in _live if j.running]
