"""The project folder: stages are skipped when unchanged, rerun when changed, and survive being killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from npustudio.core.errors import UserError
from npustudio.core.progress import Cancelled, State
from npustudio.core.project import MANIFEST, Project


def _write_stage(value: str, calls: list[str]):
    def fn(out: Path) -> dict:
        calls.append(value)
        (out / "result.txt").write_text(value)
        (out / "sub").mkdir()
        (out / "sub" / "more.bin").write_bytes(value.encode() * 10)
        return {"value": value}

    return fn


def test_stage_outputs_are_recorded_with_hashes_and_skipped_when_unchanged(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")
    calls: list[str] = []
    rec, ran = p.run_stage("demo", {"model": "m1"}, {"x": 1}, _write_stage("a", calls))
    assert ran and rec.status == "done" and rec.result == {"value": "a"}
    assert sorted(o.path for o in rec.outputs) == ["stages/demo/result.txt", "stages/demo/sub/more.bin"]
    assert all(len(o.sha256) == 64 and o.bytes > 0 for o in rec.outputs)
    assert (p.root / "stages/demo/result.txt").read_text() == "a"

    rec2, ran2 = p.run_stage("demo", {"model": "m1"}, {"x": 1}, _write_stage("b", calls))
    assert not ran2 and calls == ["a"] and rec2.result == {"value": "a"}

    _, ran3 = p.run_stage("demo", {"model": "m1"}, {"x": 2}, _write_stage("c", calls))  # options changed
    assert ran3 and (p.root / "stages/demo/result.txt").read_text() == "c"
    _, ran4 = p.run_stage("demo", {"model": "m2"}, {"x": 2}, _write_stage("d", calls))  # inputs changed
    assert ran4 and calls == ["a", "c", "d"]
    assert p.verify("demo") == []


def test_deleted_output_makes_the_stage_rerun(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")
    calls: list[str] = []
    p.run_stage("demo", {}, {}, _write_stage("a", calls))
    (p.root / "stages/demo/result.txt").unlink()
    _, ran = p.run_stage("demo", {}, {}, _write_stage("a", calls))
    assert ran and calls == ["a", "a"]


def test_failed_or_cancelled_stage_keeps_the_last_good_outputs(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")
    p.run_stage("demo", {}, {"x": 1}, _write_stage("good", []))

    def boom(out: Path) -> dict:
        (out / "result.txt").write_text("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        p.run_stage("demo", {}, {"x": 2}, boom)
    state = State()

    def cancelled(out: Path) -> dict:
        state.cancel()
        state.check()
        return {}

    with pytest.raises(Cancelled):
        p.run_stage("demo", {}, {"x": 3}, cancelled)
    m = p.load()
    assert m.stages["demo"].result == {"value": "good"}
    assert m.attempts["demo"].status == "cancelled"
    assert (p.root / "stages/demo/result.txt").read_text() == "good"
    assert not list((p.root / "stages").glob(".demo.*"))


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from npustudio.core.project import Project
    p = Project.open(sys.argv[1])
    def fn(out):
        (out / "result.txt").write_text("partial")
        Path(sys.argv[2]).write_text("inside")
        time.sleep(60)
        return {}
    p.run_stage("demo", {}, {"x": 2}, fn)
""")


def test_stage_killed_midway_leaves_the_project_intact_and_reruns_cleanly(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    p = Project.open(root)
    p.run_stage("demo", {}, {"x": 1}, _write_stage("good", []))
    manifest_before = (root / MANIFEST).read_text()
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root), str(flag)])
    deadline = time.time() + 60
    while not flag.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "the stage never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    assert (root / MANIFEST).read_text() == manifest_before
    assert (root / "stages/demo/result.txt").read_text() == "good"
    assert Project.open(root).load().stages["demo"].result == {"value": "good"}
    rec, ran = p.run_stage("demo", {}, {"x": 2}, _write_stage("new", []))
    assert ran and rec.result == {"value": "new"}
    assert (root / "stages/demo/result.txt").read_text() == "new"
    assert not (root / "stages/.demo.partial").exists()


def test_kill_between_the_swap_renames_is_recovered(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")
    p.run_stage("demo", {}, {}, _write_stage("good", []))
    os.replace(p.stage_dir("demo"), p.root / "stages/.demo.old")  # as if killed after the first rename
    _, ran = p.run_stage("demo", {}, {}, _write_stage("x", []))
    assert not ran and (p.root / "stages/demo/result.txt").read_text() == "good"


def test_damaged_manifest_and_foreign_folders_give_clear_errors(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")
    (p.root / MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match=r"manifest .* is damaged"):
        Project.open(p.root)
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(UserError, match="not empty and is not an NPU Studio project"):
        Project.open(other)
    assert (other / "cat.jpg").read_bytes() == b"\xff\xd8"
    with pytest.raises(UserError, match="not an NPU Studio project"):
        Project.open(tmp_path / "missing", create=False)


def test_manifest_is_plain_json_with_stage_records(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")
    p.run_stage("demo", {"model": "m"}, {"x": 1}, _write_stage("a", []))
    data = json.loads((p.root / MANIFEST).read_text())
    rec = data["stages"]["demo"]
    assert data["schema_version"] == 1
    assert rec["inputs"] == {"model": "m"} and rec["options"] == {"x": 1}
    assert rec["seconds"] >= 0 and rec["peak_rss_mb"] > 0 and rec["status"] == "done"


def test_two_processes_cannot_run_stages_on_one_project_at_once(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")

    def nested(out: Path) -> dict:
        with pytest.raises(UserError, match="Another NPU Studio process"):
            Project(p.root).run_stage("other", {}, {}, _write_stage("x", []))
        return {}

    # flock is per open file description: a second open in this process conflicts like another process would
    p.run_stage("demo", {}, {}, nested)


def test_state_maps_substeps_and_reports_partials() -> None:
    events = []
    s = State()
    s.subscribe(events.append)
    sub = s.sub(0.5, 1.0)
    sub.progress(0.5, "half of the second half")
    sub.partial("ppl", window=0, fp_ppl=12.0)
    assert s.fraction == pytest.approx(0.75) and s.message == "half of the second half"
    assert s.partials[0].data == {"window": 0, "fp_ppl": 12.0}
    s.cancel()
    with pytest.raises(Cancelled):
        sub.progress(0.9)
