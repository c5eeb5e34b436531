"""The window's background jobs (gui/worker.py): a job's outcome arrives after it stops running, a cancelled read's
late result is dropped, and a stage child still busy when the app quits ends quietly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt

from npustudio.core.errors import UserError


def test_a_job_is_no_longer_running_when_its_outcome_arrives(qtbot: Any) -> None:
    """The chat's Send button asks, as an answer arrives, whether the answer's job still runs: it must hear no
    (on a loaded machine the window once kept Send disabled after an answer)."""
    import threading

    from npustudio.gui import worker

    go = threading.Event()  # the job ends once a slot listens

    def answering(state: Any) -> int:
        go.wait(10)
        return 42

    def failing(state: Any) -> None:
        go.wait(10)
        raise UserError("The bundle is gone.", "Bundle again.")

    for fn, signal, expect in ((answering, "done", (42,)),
                               (failing, "failed", ("The bundle is gone.", "Bundle again."))):
        go.clear()
        seen: list[tuple[tuple[Any, ...], bool]] = []
        job = worker.start(fn)
        # heard in the worker thread at the moment of the emit, as a slow GUI thread could hear it
        getattr(job, signal).connect(lambda *a, job=job, seen=seen: seen.append((a, job.running)),
                                     Qt.ConnectionType.DirectConnection)
        with qtbot.waitSignal(job.finished, timeout=10_000):
            go.set()
        assert seen == [(expect, False)]


def test_a_read_whose_result_arrives_after_its_cancel_is_dropped(qtbot: Any) -> None:
    """A view's read that finishes just as the view moves on (another project, the window closing) queues its
    result behind the cancel: the result is dropped on the GUI thread, `finished` still comes. A stage's result is
    never dropped this way."""
    import threading

    from npustudio.gui import worker

    go = threading.Event()

    def reading(_state: Any) -> int:
        go.wait(10)
        return 42  # no safe point: the read ends with a result although it was cancelled

    for read, expect in ((True, []), (False, [42])):
        go.clear()
        got: list[int] = []
        job = worker.start(reading, "Reading", read=read, done=got.append)
        job.cancel()
        with qtbot.waitSignal(job.finished, timeout=10_000):
            go.set()
        qtbot.wait(50)
        assert got == expect


CLOSE_WHILE_BUSY = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from npustudio.core import isolated
from npustudio.gui import worker
from tests.test_gui_worker import busy_without_safe_points

if __name__ == "__main__":
    app = QApplication([])
    worker.start(lambda s: isolated.run(busy_without_safe_points, state=s), "Quantizing")
    QTimer.singleShot(2000, lambda: (worker.cancel_all(wait_ms=300), app.quit()))
    app.exec()
"""


def busy_without_safe_points(state: Any) -> None:
    """A stage step that never reaches a safe point for a while (as AIMET's export can)."""
    import time

    time.sleep(30)


def test_a_stage_still_running_when_the_window_closes_ends_quietly(tmp_path: Path) -> None:
    """The app quits while its stage child is busy: the child is ended, with no traceback printed (it printed
    `the stage process ended with no result (exit -15)` and `Signal source has been deleted`)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", CLOSE_WHILE_BUSY], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "has been deleted" not in res.stderr, res.stderr
