"""A stage in a child process looks like one in-process: events, result, UserError and cancel all come through."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest

from npustudio.core import isolated
from npustudio.core.errors import UserError
from npustudio.core.progress import Cancelled, Partial, Progress, State
from tests.conftest import wait_until


def counting(n: int, state: State) -> int:
    for i in range(n):
        state.partial("ppl", window=i, fp_ppl=10.0 + i)
        state.progress((i + 1) / n, f"window {i + 1}/{n}")
    return n * 10


def failing(state: State) -> None:
    raise UserError("The model folder has no tokenizer.", "Copy tokenizer.json into it.")


def endless(state: State) -> None:
    while True:
        state.progress(0.5, "working")
        time.sleep(0.02)


def test_events_and_result_come_back() -> None:
    st = State()
    seen: list[Progress | Partial] = []
    st.subscribe(seen.append)
    assert isolated.run(counting, 3, state=st) == 30
    assert [e.data["window"] for e in seen if isinstance(e, Partial)] == [0, 1, 2]
    assert [e.message for e in seen if isinstance(e, Progress)][-1] == "window 3/3" and st.fraction == 1.0


def test_user_error_keeps_problem_and_fix() -> None:
    with pytest.raises(UserError) as e:
        isolated.run(failing, state=State())
    assert e.value.problem == "The model folder has no tokenizer." and e.value.fix == "Copy tokenizer.json into it."


def test_cancel_stops_the_child() -> None:
    st = State()
    st.subscribe(lambda ev: st.cancel())  # the user presses Cancel as soon as the stage reports anything
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        isolated.run(endless, state=st)
    assert time.perf_counter() - t0 < 60


def niceness(state: State) -> int:
    import os

    return os.nice(0)


def test_the_stage_runs_at_a_lower_priority_than_the_window() -> None:
    """So a busy stage cannot take the CPU the window's event loop needs."""
    import os

    assert isolated.run(niceness, state=State()) == min(19, os.nice(0) + 10)
    assert isolated.run(niceness, state=State(), nice=0) == os.nice(0)


def test_a_forked_child_works_on_the_parents_objects_beside_it() -> None:
    """The quantize stage exports each graph in a forked copy of itself while it evaluates: the child sees the
    parent's objects, runs torch after the parent's thread pool ran (GNU OpenMP's pool hung a forked child's first
    parallel op), and its result, its UserError and its crash come back."""
    import os

    import torch

    from npustudio.core.forked import Forked

    held = torch.randn(256, 512)
    (held @ held.T).sum()  # the parent's OpenMP pool has run

    deadline = State()
    watchdog = __import__("threading").Timer(120, deadline.cancel)  # a hung child fails the test, not CI
    watchdog.start()
    try:
        child = Forked(lambda: [float((held @ held.T).trace()), os.getpid()], "a product")
        here = float((held @ held.T).trace())  # the parent goes on meanwhile
        value, pid = child.result(deadline)
        assert value == pytest.approx(here, rel=1e-5) and pid != os.getpid()

        with pytest.raises(UserError) as e:
            Forked(lambda: failing(State()), "a failing step").result(deadline)
        assert e.value.fix == "Copy tokenizer.json into it."

        with pytest.raises(RuntimeError, match="a crash ended with exit 3"):
            Forked(lambda: os._exit(3), "a crash").result(deadline)
    finally:
        watchdog.cancel()


def test_stopping_kills_the_forked_child() -> None:
    import os

    from npustudio.core.forked import Forked

    st = State()
    child = Forked(lambda: time.sleep(600), "a long step")
    pid = child.pid
    assert pid is not None
    st.cancel()
    with pytest.raises(Cancelled):
        child.result(st)
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(pid, os.WNOHANG)


def test_a_spawned_child_works_beside_its_parent_and_reports_back() -> None:
    """The compile stage runs the token graph's simulator steps in a fresh interpreter beside the prompt graph's:
    the result (tensors too), the UserError and the crash (with its last words) come back."""
    import os
    from functools import partial

    import torch

    from npustudio.core.spawned import Spawned
    from npustudio.core.targets import find_soc

    deadline = State()
    watchdog = __import__("threading").Timer(120, deadline.cancel)  # a hung child fails the test, not CI
    watchdog.start()
    try:
        pid = Spawned(os.getpid, "a pid")
        values = Spawned(partial(torch.arange, 5), "a range")
        assert torch.equal(values.result(deadline), torch.arange(5)) and pid.result(deadline) != os.getpid()

        with pytest.raises(UserError) as e:
            Spawned(partial(find_soc, "SM0000"), "a lookup").result(deadline)
        assert "SM0000" in e.value.problem

        with pytest.raises(RuntimeError, match="a crash ended with exit 3"):
            Spawned(partial(os._exit, 3), "a crash").result(deadline)
    finally:
        watchdog.cancel()


def test_stopping_kills_the_spawned_child() -> None:
    from functools import partial

    from npustudio.core.spawned import Spawned

    st = State()
    child = Spawned(partial(time.sleep, 600), "a long step")
    proc = child.proc
    assert proc is not None
    st.cancel()
    with pytest.raises(Cancelled):
        child.result(st)
    assert proc.poll() is not None


_KILLED_PARENT = """
import sys, time
from functools import partial
from npustudio.core.forked import Forked
from npustudio.core.spawned import Spawned
children = [Forked(partial(time.sleep, 600), "forked"), Spawned(partial(time.sleep, 600), "spawned")]
print(children[0].pid, children[1].proc.pid, flush=True)
time.sleep(600)
"""


def test_a_stage_killed_outright_leaves_no_child_and_no_file_behind(tmp_path: Path) -> None:
    """A stage process killed with SIGKILL (an out-of-memory kill, `kill -9`) cannot clean up: its forked and
    spawned helpers die with it, and what they would have handed back had no name in the temporary folder."""
    import os
    import signal
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"TMPDIR": str(tmp)})
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
        for pid in pids:  # each child is in its step (asleep), so it has asked to die with its parent
            wait_until(partial(_asleep, pid), 120)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    for pid in pids:
        wait_until(partial(_gone, pid), 120)
    assert list(tmp.iterdir()) == []


def _asleep(pid: int) -> bool:
    return Path(f"/proc/{pid}/wchan").read_text().endswith("nanosleep")


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def deaf(state: State) -> None:
    """Work with no safe point for minutes, as Genie reading a long prompt: it never looks at the cancel."""
    import os

    state.partial("pid", pid=os.getpid())
    time.sleep(600)


def test_a_child_deaf_to_the_cancel_is_ended_after_its_grace() -> None:
    """Window III: Stop while the desktop Genie reads a prompt was ignored for minutes. With `grace_s` the child
    that has not stopped by then is ended, and the caller gets `Cancelled` at once."""
    import os
    import threading

    state = State()
    pids: list[int] = []
    state.subscribe(lambda ev: pids.append(ev.data["pid"]) if isinstance(ev, Partial) else None)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            isolated.run(deaf, state=state, grace_s=0.5)
        except BaseException as e:
            outcome.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_until(lambda: pids, 60)
    state.cancel()
    caller.join(timeout=60)  # the child sleeps 600 s: only its end lets the caller return
    assert not caller.is_alive() and isinstance(outcome[0], Cancelled)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
