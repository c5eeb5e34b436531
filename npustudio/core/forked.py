"""A function run in a forked copy of this process, beside work this process goes on with.

For work that needs objects only this process holds (a calibrated quantsim cannot be handed to a fresh
interpreter) and a core of its own. The child runs torch on one thread: GNU OpenMP's thread pool does not
survive a fork (the child's first parallel op hung). It never returns into its caller's code: its outcome
goes as JSON to an anonymous file (`Outcome`) and it ends with `os._exit`; on Linux it is killed when the
thread that forked it ends, so a killed stage leaves no child running and no file behind. Only where
`os.fork` exists (`available`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import UserError
from .progress import StateLike

_POLL_S = 0.05
# below this much float weight a stage forks copies of itself to work beside it (the default model: 0.5 GB; a 1B
# model's 5 GB stays in one process, its peak tuned)
BESIDE_BYTES = 2**30


def available() -> bool:
    return hasattr(os, "fork") and sys.platform == "linux"


def worth_forking(model: Any, device: str) -> bool:
    """Whether a stage forks copies of itself to work beside it: on a CPU with a core to spare, for a model under
    BESIDE_BYTES of weights, with memory for the copies (they share the weights until written, but allocate their
    own: the quantize stage's traces and QDQ pass 1.3 GB more in all on the default model's 0.54 GB)."""
    from .host_cost import available_ram

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    free = available_ram()
    return (device == "cpu" and available() and (os.cpu_count() or 1) > 1
            and weights < BESIDE_BYTES and free is not None and free > 4 * weights)


def child_env() -> dict[str, str]:
    """The environment of a fresh interpreter started beside this one: it imports this very package first (a
    cluster worker may hold it only on its own sys.path)."""
    root = str(Path(__file__).resolve().parents[2])
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}


class Outcome:
    """Where a child leaves its outcome: an anonymous temporary file, inherited by the child (forked, or started
    with `pass_fds`) and read back here once it has ended. It has no name on disk, so nothing of it is left
    behind whichever process is killed, and no other process can put something else in its place."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        self.fd = self.file.fileno()

    def read(self) -> bytes:
        self.file.seek(0)
        return self.file.read()

    def close(self) -> None:
        self.file.close()


def leave(fd: int, data: bytes) -> None:
    """The child's side of an `Outcome`: write it to the inherited file."""
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# `python -m MODULE ARGS` that first asks to die with its parent, before the seconds its imports take: a parent
# killed meanwhile (`kill -9` of the CLI) left its compiles running; one already gone ends it at once
_BOOT = ("import ctypes, os, runpy, sys\n"
         "try:\n    ctypes.CDLL(None).prctl(1, 9)\nexcept (OSError, AttributeError):\n    pass\n"
         "parent, module = int(sys.argv[1]), sys.argv[2]\n"
         "if os.getppid() != parent:\n    os._exit(1)\n"
         "sys.argv = [sys.argv[0], *sys.argv[3:]]\n"
         "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


class Started:
    """`python -m module *args FD` in a fresh interpreter (an argument list, no shell) that imports this very
    package (`child_env`) and leaves its outcome in the `Outcome` whose descriptor FD it inherits; its stderr is
    kept for the error that says it failed."""

    def __init__(self, module: str, args: list[str], what: str, stdin: Any = subprocess.DEVNULL) -> None:
        self.what = what
        self._out = Outcome()
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(os.getpid()), module, *args, str(self._out.fd)],
                                     stdin=stdin,
                                     stdout=subprocess.DEVNULL, stderr=self._err, pass_fds=(self._out.fd,),
                                     env=child_env())

    def outcome(self, state: StateLike) -> bytes:
        """What the child left once it ended; its crash raised here as a RuntimeError with its last stderr lines.
        The user's stop (`state.check`) kills it. The child's files go either way."""
        try:
            while self.proc.poll() is None:
                state.check()
                time.sleep(_POLL_S)
            out = self._out.read() if self.proc.returncode == 0 else b""
            if not out:
                self._err.seek(0)
                last = self._err.read().decode(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{self.what} ended with exit {self.proc.returncode} and no result: "
                                   + " | ".join(last))
            return out
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill the child if it still runs, and let its files go."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()
        self._out.close()


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the thread that started it ends (a stage killed mid-way)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the child ends on its own


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the duration, while a forked child works on the other core: OpenMP's waiting
    threads spin, and a third busy thread on two cores slowed everything down."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Forked:
    """`fn()` (its result JSON-serializable) started in a forked child; `result` waits for it."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.name = name
        self._out = Outcome()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                die_with_parent()
                import torch

                torch.set_num_threads(1)
                leave(self._out.fd, json.dumps(outcome(fn)).encode())
                code = 0
            finally:
                os._exit(code)
        self.pid: int | None = pid

    def result(self, state: StateLike) -> Any:
        """What `fn` returned; its UserError, or its failure as a RuntimeError, raised here. The user's stop
        (`state.check`) kills the child."""
        try:
            while True:
                assert self.pid is not None
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.pid = None
                    break
                state.check()
                time.sleep(_POLL_S)
            code = os.waitstatus_to_exitcode(status)
            text = self._out.read() if code == 0 else b""
            if not text:
                raise RuntimeError(f"{self.name} ended with exit {code} and no result")
            out = json.loads(text)
        finally:
            self.stop()
        return unpack(out, self.name)

    def stop(self) -> None:
        """Kill the child if it still runs, and let its file go."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = None
        self._out.close()


def unpack(out: dict[str, Any], name: str) -> Any:
    """The result in a child's outcome (as `outcome` writes it); its UserError, or its failure as a RuntimeError,
    raised here."""
    if "user_error" in out:
        raise UserError(*out["user_error"])
    if "error" in out:
        sys.stderr.write(out.get("traceback", ""))  # the child's traceback, for a bug report
        raise RuntimeError(f"{name} failed: {out['error']}")
    return out["result"]


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"result": fn()}
    except UserError as e:
        return {"user_error": [e.problem, e.fix]}
    except BaseException as e:
        return {"error": f"{e.__class__.__name__}: {e}", "traceback": traceback.format_exc()}
