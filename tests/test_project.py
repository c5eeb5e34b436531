"""The project folder: stages are skipped when unchanged, rerun when changed, and survive being killed."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from npustudio.core.errors import UserError
from npustudio.core.layout import MANIFEST
from npustudio.core.progress import Cancelled, Partial, Progress, State
from npustudio.core.project import Project, StageFn
from tests.conftest import raw_record


def _write_stage(value: str, calls: list[str]) -> StageFn:
    def fn(out: Path) -> dict[str, Any]:
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
    assert p.changed("demo") == []


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

    def fills_the_disk(out: Path) -> dict:
        (out / "weights.bin").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "weights.bin"))

    with pytest.raises(UserError, match="filled up while the demo stage") as e:
        p.run_stage("demo", {}, {"x": 2}, fills_the_disk)
    assert "GB are free" in e.value.problem and "Free space" in e.value.fix
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


def test_a_records_options_read_back_typed_with_the_defaults_for_what_an_older_record_lacks(tmp_path: Path) -> None:
    from npustudio.core import stages
    from npustudio.core.stage_options import AdaptOptions, IntakeOptions

    p = Project.open(tmp_path / "proj")
    rec, _ = p.run_stage("adapt", {"model": "m"}, {"ar": 16, "cl": 256}, _write_stage("a", []))
    o = p.rerun_options(stages.ADAPT)  # the record's options, typed (its made-up result is no AdaptResult)
    assert (o.ar, o.cl, o.accept_mismatch) == (16, 256, AdaptOptions().accept_mismatch)
    assert IntakeOptions.model_validate(rec.options).cl == 256 and IntakeOptions().cl == AdaptOptions().cl


def test_an_old_project_file_with_plain_dict_choices_loads_and_is_written_back_as_it_was(tmp_path: Path) -> None:
    """Choices were a free dict: a file with a key this version does not know, or a pick it now refuses, still
    opens; the unknown key is kept, the refused pick dropped, and an unpicked field is not written."""
    from npustudio.core.project import Deployed
    from npustudio.core.stage_options import AdaptOptions

    root = tmp_path / "proj"
    root.mkdir()
    old: dict[str, Any] = {
        "schema_version": 1, "created": "2025-01-01T00:00:00Z", "stages": {}, "attempts": {},
        "choices": {"model": "m", "target": "SM8650", "from_a_newer_version": {"x": 1},
                    "deployed": {"device": "emulator-5554", "remote_dir": "/data/local/tmp/p", "bundle": "k",
                                 "at": 1.5}}}
    (root / MANIFEST).write_text(json.dumps(old, indent=2) + "\n")
    p = Project.open(root, create=False)
    ch = p.choices()
    assert (ch.model, ch.target, ch.cl) == ("m", "SM8650", AdaptOptions().cl)  # cl: not picked, the default
    assert ch.deployed == Deployed(device="emulator-5554", remote_dir="/data/local/tmp/p", bundle="k", at=1.5)
    assert ch.chosen("target") and not ch.chosen("cl")
    p.save(p.load())
    assert json.loads((root / MANIFEST).read_text())["choices"] == old["choices"]  # the same JSON object
    p.choose(cl=512)
    assert json.loads((root / MANIFEST).read_text())["choices"] == {**old["choices"], "cl": 512}

    old["choices"] = {"target": "SM0000", "cl": "long", "model": "m"}  # a SoC no longer in the table, a bad value
    (root / MANIFEST).write_text(json.dumps(old))
    ch = Project.open(root, create=False).choices()
    assert (ch.model, ch.target, ch.cl) == ("m", None, AdaptOptions().cl)


def test_choosing_an_unknown_target_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    from npustudio.core.stage_options import QuantizeOptions

    p = Project.open(tmp_path / "proj")
    p.choose(target="SM8650")
    before = (p.root / MANIFEST).read_text()
    with pytest.raises(UserError, match="Unknown target SoC 'SM1234'") as e:
        p.choose(target="SM1234")
    assert "SM8750" in e.value.fix
    with pytest.raises(UserError, match="Not a valid project choice"):
        p.choose(cl="long")
    with pytest.raises(TypeError, match="not a project choice: tagret"):
        p.choose(tagret="SM8650")
    assert (p.root / MANIFEST).read_text() == before
    assert p.choices().target == "SM8650"
    assert Project.open(tmp_path / "new").choices().target_soc == QuantizeOptions().target  # nothing picked


def test_two_processes_cannot_run_stages_on_one_project_at_once(tmp_path: Path) -> None:
    p = Project.open(tmp_path / "proj")

    def nested(out: Path) -> dict:
        with pytest.raises(UserError, match="Another NPU Studio process"):
            Project(p.root).run_stage("other", {}, {}, _write_stage("x", []))
        return {}

    # flock is per open file description: a second open in this process conflicts like another process would
    p.run_stage("demo", {}, {}, nested)


def test_state_maps_substeps_and_reports_partials() -> None:
    events: list[Progress | Partial] = []
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


def test_an_output_edited_in_place_at_the_same_size_reruns_its_stage_and_blocks_the_next(tmp_path: Path) -> None:
    from npustudio.core import pipeline, stages

    p = Project.open(tmp_path / "proj")
    calls: list[str] = []
    p.run_stage("adapt", {"model": {"spec": "org/m"}}, {}, _write_stage("a", calls))
    out = p.root / "stages/adapt/result.txt"
    out.write_text("z")  # same size, other content: only a hash tells
    assert p.changed("adapt") == ["stages/adapt/result.txt"]
    with pytest.raises(UserError) as e:  # the next stage says what changed and what to rerun
        pipeline._require(p, stages.ADAPT)
    assert "stages/adapt/result.txt" in e.value.problem and "npustudio adapt org/m --project" in e.value.fix
    _, ran = p.run_stage("adapt", {"model": {"spec": "org/m"}}, {}, _write_stage("a", calls))
    assert ran and calls == ["a", "a"] and out.read_text() == "a"  # rerun, not skipped
    assert raw_record(p, "adapt").status == "done" and not p.changed("adapt")  # no longer blocks the next


def test_unchanged_outputs_are_not_rehashed_and_force_redoes_a_stage(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from npustudio.core import project as project_mod

    p = Project.open(tmp_path / "proj")
    calls: list[str] = []
    p.run_stage("demo", {}, {}, _write_stage("a", calls))
    hashed: list[str] = []
    real = project_mod.sha256_file

    def sha256_file(f: Path) -> str:
        hashed.append(str(f))
        return real(f)

    monkeypatch.setattr(project_mod, "sha256_file", sha256_file)
    assert not p.run_stage("demo", {}, {}, _write_stage("b", calls))[1]
    assert hashed == []  # same size and mtime as recorded: a stat, no re-read
    f = p.root / "stages/demo/result.txt"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # touched, content unchanged
    assert not p.run_stage("demo", {}, {}, _write_stage("b", calls))[1]
    assert hashed == [str(f)]
    project_mod._hashes.clear()  # as in a new process: the new mtime is in the manifest now
    assert not p.run_stage("demo", {}, {}, _write_stage("b", calls))[1]
    assert hashed == [str(f)]
    _, ran = p.run_stage("demo", {}, {}, _write_stage("c", calls), force=True)
    assert ran and calls == ["a", "c"] and f.read_text() == "c"


def test_links_planted_in_a_project_never_let_it_write_outside(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    p = Project.open(tmp_path / "proj")
    lock = p.root / ".lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(victim)
    with pytest.raises(UserError, match=r"\.lock is a symbolic link"):
        p.run_stage("demo", {}, {}, _write_stage("a", []))
    assert victim.read_text() == "precious"
    lock.unlink()

    outside = tmp_path / "outside"
    outside.mkdir()
    (p.root / "stages").mkdir(exist_ok=True)
    (p.root / "stages/demo").symlink_to(outside)
    with pytest.raises(UserError, match="symbolic link"):
        p.run_stage("demo", {}, {}, _write_stage("a", []))
    assert list(outside.iterdir()) == []
    (p.root / "stages/demo").unlink()

    m = p.root / MANIFEST
    m.rename(tmp_path / "real_manifest.json")
    m.symlink_to(tmp_path / "real_manifest.json")
    before = (tmp_path / "real_manifest.json").read_text()
    with pytest.raises(UserError, match="symbolic link"):
        Project.open(p.root)
    with pytest.raises(UserError, match="symbolic link"):
        p.choose(model="x")
    assert (tmp_path / "real_manifest.json").read_text() == before


def test_a_json_write_that_fails_midway_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    from npustudio.core.fsutil import atomic_write_json

    path = tmp_path / "x.encodings"
    data = {"param_encodings": [{"name": "w", "per_block_int_scale": [[1, 2], [3, 4]]}], "version": "1.0.0"}
    atomic_write_json(path, data)
    assert path.read_text() == json.dumps(data, indent=2) + "\n"  # streamed, the same text as before
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": list(range(100_000)), "b": object()})  # fails after writing a lot
    assert json.loads(path.read_text()) == data
    assert [p.name for p in tmp_path.iterdir()] == ["x.encodings"]


@pytest.mark.parametrize("command", ["adapt", "quantize", "compile"])
def test_a_stage_run_from_the_window_is_not_redone_by_the_same_cli_command(command: str) -> None:
    """The window sends the core's default options, the CLI builds its own from the flags: with no flags the two
    must hash to the same stage key, or `npustudio compile` redoes a 10-minute compile the window just did."""
    from npustudio.cli import args
    from npustudio.cli.main import build_parser
    from npustudio.core.adapt import AdaptOptions
    from npustudio.core.compile import CompileOptions
    from npustudio.core.fsutil import sha256_json
    from npustudio.core.quantize import QuantizeOptions

    build, model = {"adapt": (args.adapt_options, AdaptOptions), "quantize": (args.quantize_options, QuantizeOptions),
                    "compile": (args.compile_options, CompileOptions)}[command]
    a = build_parser().parse_args([command, "--project", "p"] + (["model"] if command == "adapt" else []))
    assert sha256_json(build(a).model_dump()) == sha256_json(model().model_dump())
