"""Progress, partial results and cooperative cancel for a running stage, with no Qt in it.

The GUI adapts a `State` to signals, the CLI to rich progress bars: both only subscribe.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class Cancelled(Exception):
    """Raised inside a stage when the user asked it to stop."""


@dataclass(frozen=True)
class Progress:
    fraction: float
    message: str


@dataclass(frozen=True)
class Partial:
    """A partial result, e.g. kind="ppl" with {"label": "fp", "window": 2, "ppl": 14.1}."""

    kind: str
    data: dict[str, Any]


Listener = Callable[[Progress | Partial], None]


@dataclass
class State:
    """Carries a stage's progress out and the user's cancel request in.

    Stages call `check()` at safe points; `progress()` rate-limits nothing itself: listeners decide
    how often to redraw. Fractions can be nested with `sub(lo, hi)` so a step reports 0..1 locally.
    """

    listeners: list[Listener] = field(default_factory=list)
    _cancel: threading.Event = field(default_factory=threading.Event)
    fraction: float = 0.0
    message: str = ""
    partials: list[Partial] = field(default_factory=list)

    @classmethod
    def stopped_by(cls, stop: threading.Event) -> State:
        """A state whose cancel request is `stop` itself: whoever holds the Event (a chat's Stop) cancels it."""
        return cls(_cancel=stop)

    @property
    def stop_event(self) -> threading.Event:
        """The cancel request as an Event, for code that waits on one (Genie's abort watcher)."""
        return self._cancel

    def subscribe(self, fn: Listener) -> None:
        self.listeners.append(fn)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check(self) -> None:
        if self._cancel.is_set():
            raise Cancelled("stopped by the user")

    def progress(self, fraction: float, message: str | None = None) -> None:
        self.fraction = min(1.0, max(0.0, fraction))
        if message is not None:
            self.message = message
        self._emit(Progress(self.fraction, self.message))
        self.check()

    def partial(self, kind: str, **data: Any) -> None:
        p = Partial(kind, data)
        self.partials.append(p)
        self._emit(p)

    def sub(self, lo: float, hi: float) -> SubState:
        return SubState(self, lo, hi)

    def _emit(self, event: Progress | Partial) -> None:
        for fn in list(self.listeners):
            fn(event)


@dataclass
class SubState:
    """A view of a State that maps its own 0..1 onto [lo, hi] of the parent."""

    parent: State | SubState
    lo: float
    hi: float

    @property
    def cancelled(self) -> bool:
        return self.parent.cancelled

    def check(self) -> None:
        self.parent.check()

    @property
    def stop_event(self) -> threading.Event:
        return self.parent.stop_event

    def progress(self, fraction: float, message: str | None = None) -> None:
        f = min(1.0, max(0.0, fraction))
        self.parent.progress(self.lo + (self.hi - self.lo) * f, message)

    def partial(self, kind: str, **data: Any) -> None:
        self.parent.partial(kind, **data)

    def sub(self, lo: float, hi: float) -> SubState:
        return SubState(self, lo, hi)


StateLike = State | SubState


class Timer:
    """Wall time and peak RSS of a block, for stage records and benchmarks."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_TRIM_DEFAULT = 128 * 2**10  # glibc's trim threshold, kept while its mmap threshold is set
_BIG_BLOCK = 2**20  # what free_big_blocks_at_once sets
_REUSED_BLOCK = 32 * 2**20  # glibc's largest threshold on 64-bit systems
_threshold: int | None = None  # the threshold set here, if any (glibc cannot be asked)


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (it has the two knobs below), else None. Looked up once (find_library asks
    ldconfig, ~1.4 ms a call here) rather than at every trim_heap."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def free_big_blocks_at_once() -> None:
    """Make glibc give every block of 1 MB or more back to the system as soon as it is freed.

    glibc's default threshold rises to 32 MB after the first large free, so a stage's 16-64 MB temporaries (a slab
    of the LM head being quantized, an AR-128 step's logits) went to the heap, where freed pages stay counted until
    a trim: +730 MB at the fold's peak on a Llama-3.2-1B-shaped model. At 4 MB the quantsim's 1-4 MB per-layer
    temporaries (an AR-128 step's hidden states, KV rows and their quantized copies) still went to the heap and
    fragmented it: one calibration step of a Llama-3.2-1B-width model left +55 MB per layer unreturned (+450 MB
    with 4 layers, +810 MB with 8, the calibration's peak on the 16-layer model); at 1 MB the step's peak is
    +280 MB whatever the depth (fp32 model +270). A no-op where there is no glibc."""
    _set_threshold(_BIG_BLOCK)


def _set_threshold(size: int, trim: int = _TRIM_DEFAULT) -> None:
    global _threshold
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, size)
        libc.mallopt(_M_TRIM_THRESHOLD, trim)
        _threshold = size


@contextlib.contextmanager
def heap_blocks_reused() -> Iterator[None]:
    """Let the heap keep and reuse blocks of up to 32 MB for the duration (as glibc's default does), then trim it.

    With free_big_blocks_at_once each 1-32 MB temporary is a fresh mapping whose pages the kernel faults in and
    zeroes on every use: aimet's search for the grid a weight already lies on makes dozens per weight, and the
    weight fold of the default model took 31.8 s instead of 13.0 s (sys time 45 s of the quantize stage). Those
    temporaries are freed before the next weight, so the heap does not grow by more than one weight's set."""
    before = _threshold
    if before is None or before >= _REUSED_BLOCK:
        yield
        return
    _set_threshold(_REUSED_BLOCK, trim=2 * _REUSED_BLOCK)  # and the heap's top is not given back after each one
    try:
        yield
    finally:
        _set_threshold(before)
        trim_heap()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc keeps them after big temporary buffers are
    freed, so RSS stays at its high-water mark). A no-op where there is no glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class Laps:
    """Wall time per named step, for a stage's result: `lap("calibrate")` closes the step begun at the last lap.

    `peaks` holds the process's peak RSS (MB) as each step ended: the first step whose figure reaches the
    stage's peak is where the memory went."""

    def __init__(self) -> None:
        import time

        self._clock = time.perf_counter
        self._t = self._clock()
        self.steps: dict[str, float] = {}
        self.peaks: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = self._clock()
        self.steps[name] = round(now - self._t, 2)
        self.peaks[name] = round(peak_rss_mb())
        self._t = now


def about_duration(seconds: float) -> str:
    """An estimated or remaining time as people read it: "~40 s", "~12 min"."""
    return f"~{seconds / 60:.0f} min" if seconds >= 90 else f"~{seconds:.0f} s"
