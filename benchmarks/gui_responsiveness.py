"""How responsive the window stays while a stage runs: the longest GUI event-loop stall and the update rates.

Opens the main window (offscreen unless QT_QPA_PLATFORM says otherwise) on a fresh project, runs the Adapt step,
then clicks Quantize and measures while it runs:
- event-loop stalls: a 10 ms QTimer's late ticks (max, p99, count over 50 ms);
- progress updates that reached the GUI per second, and the PPL points drawn;
- the chart's own ceiling: points pushed into the live PPL chart as fast as it redraws (updates/s);
- switching projects (File → Recent): how long each open blocks the window, and the stalls while it settles;
- closing the window during a stage (Quantize redone; "Stop and quit"): the seconds until it closes, the stalls
  meanwhile, and whether the project kept its last good stage and no scratch folder;
- quitting right after opening a finished project (a new window on it, closed 0.2 s later while the inspector's
  encodings read runs): how long the close holds the GUI thread, and when the cancelled reads have ended;
- opening a finished project as `npustudio gui --project` does (devices watched) and the seconds after it: the
  stalls while the window's background reads run, each named with the jobs that were running;
- a chat turn with a finished project's bundle, on this computer's Genie and then on the virtual device
  (deployed first): the stalls while the answer comes.
Prints JSON. `--model tiny` (default, ~1 min) uses a small random Llama; `--model default` the real SmolLM2.
`--quick` skips the Adapt/Quantize timings: the project switch, then the window closed during Adapt, then (with
`--finished PROJECT`, a project through Quantize) the quit right after opening that project and the opening
itself, and (when PROJECT has a bundle) the chat turns; `--chat desktop,device` picks the runners.

    python benchmarks/gui_responsiveness.py [--model tiny|default|PATH] [--quick] [--finished PROJECT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TICK_MS = 10
STALL_MS = 50


class StallMeter:
    """A QTimer that notes how late each tick comes: lateness is time the event loop could not run."""

    def __init__(self) -> None:
        from PySide6.QtCore import QTimer

        self.gaps: list[float] = []
        self.where: list[tuple[int, float, str]] = []
        self.step = ""
        self.timer = QTimer()
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(self._tick)
        self.last = self.t0 = 0.0
        self.gc_ms: list[float] = []
        self._gc_t0 = 0.0
        import gc

        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        """Time every cyclic-GC pass of the GUI process: a full one over torch's objects is a stall."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_ms.append((time.perf_counter() - self._gc_t0) * 1000)

    def start(self) -> None:
        self.gaps.clear()
        self.where.clear()
        self.gc_ms.clear()
        self.last = self.t0 = time.perf_counter()
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        gap = (now - self.last) * 1000 - TICK_MS
        self.gaps.append(gap)
        if gap > STALL_MS:  # what the stage was doing when the loop stalled, and which background jobs ran
            from npustudio.gui import worker

            jobs = ", ".join(sorted({j.name for j in worker.running()}))
            self.where.append((round(gap), round(now - self.t0, 1),  # when, in s from the start
                               f"{self.step} [{jobs}]" if jobs else self.step))
        self.last = now

    def summary(self) -> dict[str, float]:
        g = sorted(self.gaps) or [0.0]
        return {"ticks": len(self.gaps), "max_stall_ms": round(max(g), 1),
                "p99_stall_ms": round(g[int(0.99 * (len(g) - 1))], 1),
                "stalls_over_50ms": sum(x > STALL_MS for x in g), "stalls_during": self.where[:10],
                "gc_passes": len(self.gc_ms), "gc_max_ms": round(max(self.gc_ms, default=0.0), 1)}


def chart_ceiling(seconds: float = 2.0) -> float:
    """Updates per second the live PPL chart sustains when points arrive back to back (drawn and painted)."""
    from PySide6.QtWidgets import QApplication

    from npustudio.gui.charts import PplChart

    chart = PplChart()
    chart.resize(800, 500)
    chart.show()
    app = QApplication.instance()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        chart.add({"window": n % 64, "fp_ppl": 14 + n % 7, "quant_ppl": 14.2 + n % 5, "fp_ppl_running": 14.6,
                   "quant_ppl_running": 14.7})
        chart.plot.repaint()
        app.processEvents()
        n += 1
    chart.close()
    return round(n / (time.perf_counter() - t0), 1)


def settle(app: object, seconds: float) -> None:
    """Let the event loop run (what the window does after an action) for `seconds`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        app.processEvents()  # type: ignore[attr-defined]
        time.sleep(0.002)


def switch_projects(app: object, w: object, meter: StallMeter, other: Path) -> dict[str, object]:
    """Open `other` and come back, as File → Recent does: each open runs on the GUI thread (its pages redraw
    from the manifest; the inspector's read goes to a child), so its time is a stall."""
    first = w.project.root  # type: ignore[attr-defined]
    out: dict[str, object] = {}
    for name, folder in (("to_other", other), ("back", first)):
        meter.step = f"opening {Path(folder).name}"
        meter.start()
        t0 = time.perf_counter()
        opened = w.open_project(folder)  # type: ignore[attr-defined]
        blocked = (time.perf_counter() - t0) * 1000
        settle(app, 1.5)
        meter.stop()
        if not opened:
            raise SystemExit(f"could not open {folder}")
        out[name] = {"open_blocked_ms": round(blocked, 1), **meter.summary()}
    return out


def close_during_stage(app: object, w: object, meter: StallMeter, page: object, name: str) -> dict[str, object]:
    """Start `page`'s stage (Redo: it runs even when current), close the window once it reports progress,
    answer "Stop and quit", and wait for the window to go: what a person quitting mid-stage sees."""
    from npustudio.core import layout, stages
    from npustudio.core.project import Project

    root = w.project.root  # type: ignore[attr-defined]
    before = Project.open(root, create=False).record(stages.spec(name))
    meter.step = f"{name} starting"
    meter.start()
    page.strip.redo.click()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    while page.strip.bar.value() == 0 and time.perf_counter() - t0 < 600:  # type: ignore[attr-defined]
        app.processEvents()  # type: ignore[attr-defined]
        time.sleep(0.002)
    started = time.perf_counter() - t0
    meter.step = "closing"
    t1 = time.perf_counter()
    w.close()  # type: ignore[attr-defined]
    box = w.quit_box  # type: ignore[attr-defined]
    asked = box is not None and box.isVisible()
    if asked:
        next(b for b in box.buttons() if b.text() == "Stop and quit").click()
    while w.isVisible() and time.perf_counter() - t1 < 600:  # type: ignore[attr-defined]
        app.processEvents()  # type: ignore[attr-defined]
        time.sleep(0.002)
    closed = time.perf_counter() - t1
    meter.stop()
    after = Project.open(root, create=False).record(stages.spec(name))
    stages_dir = root / layout.STAGES_DIR
    return {"stage": name, "seconds_until_progress": round(started, 1), "asked_before_quitting": asked,
            "seconds_to_close": round(closed, 2), "closed": not w.isVisible(), **meter.summary(),  # type: ignore
            "kept_last_good": after is not None if before is not None else None,
            "scratch_left": sorted(p.name for p in stages_dir.iterdir() if p.name.endswith(".partial"))}


def quit_after_opening(app: object, root: Path, after_s: float = 0.2) -> dict[str, object]:
    """Open the finished project `root` in a new window and quit `after_s` later, as a person who opened the wrong
    project does: the ms the close holds the GUI thread (it once waited there for the encodings read, 6.5-16 s),
    whether it asked first (nothing but reads runs, so it must not), and the seconds until the reads it cancelled
    have ended (their child processes are ended, not waited out)."""
    from npustudio.gui import worker
    from npustudio.gui.app import MainWindow

    w = MainWindow(root, watch_devices=False)
    w.resize(1440, 900)
    w.show()
    settle(app, after_s)
    reads = sorted(j.name for j in worker.running())
    t0 = time.perf_counter()
    w.close()
    blocked = (time.perf_counter() - t0) * 1000
    asked = w.quit_box is not None
    t1 = time.perf_counter()
    while worker.running() and time.perf_counter() - t1 < 120:
        app.processEvents()  # type: ignore[attr-defined]
        time.sleep(0.002)
    return {"running_at_close": reads, "close_blocked_ms": round(blocked, 1), "asked_before_quitting": asked,
            "closed": not w.isVisible(), "seconds_until_jobs_ended": round(time.perf_counter() - t1, 2)}


def opening(app: object, root: Path, seconds: float = 8.0) -> tuple[object, dict[str, object]]:
    """Open the finished project `root` as `npustudio gui --project` does (devices watched: the adb server is
    started and the device list read; the inspector's read and the pages' own), then let it settle for `seconds`:
    the ms the window's construction blocks, and the stalls meanwhile, named with the jobs running then."""
    from npustudio.gui.app import MainWindow, freeze_startup_objects

    meter = StallMeter()
    t0 = time.perf_counter()
    w = MainWindow(root)
    w.resize(1366, 768)
    w.show()
    freeze_startup_objects()  # as `main` does
    blocked = (time.perf_counter() - t0) * 1000
    meter.step = "after opening"
    meter.start()
    settle(app, seconds)
    meter.stop()
    return w, {"open_blocked_ms": round(blocked, 1), "settled_s": seconds, **meter.summary()}


def chat_turn(app: object, w: object, runner: str, question: str = "What is the capital of France?",
              timeout_s: float = 1800) -> dict[str, object]:
    """Ask `question` in the chat panel with `runner` (desktop: this computer's Genie; device: the virtual device,
    started first, the bundle deployed there as the chat does) and wait for the answer: the stalls meanwhile."""
    chat = w.chat  # type: ignore[attr-defined]
    meter = StallMeter()
    if runner == "device" and w.device is None:  # type: ignore[attr-defined]
        meter.step = "starting the virtual device"
        meter.start()
        w.devices.start_virtual.click()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        while w.device is None and time.perf_counter() - t0 < 120:  # type: ignore[attr-defined]
            app.processEvents()  # type: ignore[attr-defined]
            time.sleep(0.002)
        settle(app, 1.0)
        meter.stop()
        if w.device is None:  # type: ignore[attr-defined]
            raise SystemExit("the virtual device did not come up")
        started = meter.summary()
    else:
        started = None
    chat.runner.setCurrentIndex(chat.runner.findData(runner))
    meter.step = f"chat on {runner}"
    meter.start()
    t0 = time.perf_counter()
    chat.ask(question)
    while chat.busy and time.perf_counter() - t0 < timeout_s:
        app.processEvents()  # type: ignore[attr-defined]
        time.sleep(0.002)
    secs = time.perf_counter() - t0
    settle(app, 0.5)
    meter.stop()
    if chat.busy:
        chat.stop()
        raise SystemExit(f"no answer from {runner} in {timeout_s:.0f} s")
    out: dict[str, object] = {"runner": runner, "seconds": round(secs, 1), "answer": chat.last_answer[:80],
                              "status": chat.stats.text()[:160], **meter.summary()}
    if started is not None:
        out["starting_virtual_device"] = started
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--quick", action="store_true",
                    help="no Adapt/Quantize timings: the project switch, then the window closed during Adapt")
    ap.add_argument("--finished", type=Path, default=None,
                    help="with --quick: a project through Quantize, opened and quit at once (copied first)")
    ap.add_argument("--chat", default="desktop,device",
                    help="with --finished: the chat runners to time a turn on (desktop, device; '' for none)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="baseline: leave start-up objects to the cyclic GC, as before the app froze them")
    a = ap.parse_args()

    import torch
    from PySide6.QtWidgets import QApplication

    from npustudio.gui.app import MainWindow, freeze_startup_objects

    torch.set_num_threads(2)
    app = QApplication.instance() or QApplication([])
    tmp = Path(tempfile.mkdtemp(prefix="npustudio-gui-bench-"))
    os.environ["XDG_CONFIG_HOME"] = str(tmp / "config")  # never the user's recent projects
    os.environ["XDG_DATA_HOME"] = str(tmp / "data")  # nor the user's virtual device
    model = a.model
    if model == "tiny":
        from tests.conftest import make_tiny_model

        model = str(make_tiny_model(tmp / "model", "llama64"))
    w = MainWindow(tmp / "proj", watch_devices=False)
    w.resize(1440, 900)
    w.show()
    w.project.choose(model=model, target="SM8750")
    w.refresh()
    if not a.no_gc_freeze:
        freeze_startup_objects()  # as `npustudio` does once its window is up
    meter = StallMeter()
    out: dict[str, object] = {"model": a.model, "qt_platform": os.environ["QT_QPA_PLATFORM"],
                              "tick_ms": TICK_MS, "gc_freeze": not a.no_gc_freeze}

    def run(page: object, name: str, setup: object = None) -> None:
        counts = {"progress": 0, "points": 0}
        done = {"ok": None}
        if setup:
            setup()  # type: ignore[operator]
        meter.start()
        t0 = time.perf_counter()
        page.strip.finished.connect(lambda ok: done.__setitem__("ok", ok))  # type: ignore[attr-defined]
        page.strip.run.click()  # type: ignore[attr-defined]
        job = page.strip.job  # type: ignore[attr-defined]
        job.progress.connect(lambda *_: counts.__setitem__("progress", counts["progress"] + 1))
        job.progress.connect(lambda _f, msg: setattr(meter, "step", msg))
        job.partial.connect(lambda k, _d: counts.__setitem__("points", counts["points"] + (k == "ppl")))
        while done["ok"] is None:
            app.processEvents()
            time.sleep(0.002)
        secs = time.perf_counter() - t0
        meter.step = "showing the result"
        for _ in range(20):  # the result is drawn after the job's finished signal
            app.processEvents()
            time.sleep(0.01)
        meter.stop()
        if not done["ok"]:
            raise SystemExit(f"{name} failed: {page.strip.status.text()}")  # type: ignore[attr-defined]
        out[name] = {"seconds": round(secs, 1), **meter.summary(),
                     "progress_updates_hz": round(counts["progress"] / secs, 1), "ppl_points": counts["points"]}

    tiny = a.model == "tiny"

    def adapt_setup() -> None:
        if tiny:
            w.adapt_page.ar.setValue(32)
            w.adapt_page.cl.setValue(128)

    def quant_setup() -> None:
        if tiny:
            w.quantize_page.calib_samples.setValue(2)
            w.quantize_page.calib_len.setValue(64)

    other = tmp / "other-project"
    from npustudio.core.project import Project

    Project.open(other)  # an empty project to switch to
    if a.quick:
        out["switch_project"] = switch_projects(app, w, meter, other)
        adapt_setup()
        out["close_during_stage"] = close_during_stage(app, w, meter, w.adapt_page, "adapt")
        if a.finished:
            import shutil

            finished = tmp / "finished"
            shutil.copytree(a.finished, finished)  # the window writes nothing there, but never the caller's
            out["quit_after_opening"] = quit_after_opening(app, finished)
            win, out["opening"] = opening(app, finished)
            from npustudio.core import layout

            if (finished / layout.STAGES_DIR / "bundle" / layout.GENIE_CONFIG).is_file():
                for runner in filter(None, a.chat.split(",")):
                    out[f"chat_{runner}"] = chat_turn(app, win, runner)
            win.close()  # type: ignore[attr-defined]
            from npustudio.gui import worker

            worker.cancel_all(wait_ms=30_000)  # the virtual device stops, as `main` waits for it
        print(json.dumps(out, indent=2))
        return 0
    run(w.adapt_page, "adapt", adapt_setup)
    run(w.quantize_page, "quantize", quant_setup)
    out["chart_max_updates_hz"] = chart_ceiling()
    out["switch_project"] = switch_projects(app, w, meter, other)
    q = out["quantize"]
    out["targets"] = {"max_stall_ms<=50": q["max_stall_ms"] <= STALL_MS,  # type: ignore[index]
                      "chart_updates_hz>=10": out["chart_max_updates_hz"] >= 10}  # type: ignore[operator]
    out["close_during_stage"] = close_during_stage(app, w, meter, w.quantize_page, "quantize")
    out["quit_after_opening"] = quit_after_opening(app, w.project.root)  # it kept its last good Quantize
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
