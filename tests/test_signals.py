"""Signals, as a user's system sends them to the console script: SIGTERM stops a stage as Ctrl-C does, and a CLI
killed outright leaves none of its children running."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

from npustudio.core import layout
from npustudio.core.project import Project
from tests.conftest import NPUSTUDIO, running, wait_until


def _scratch(project: Path) -> list[Path]:
    stages = project / layout.STAGES_DIR
    return [d for d in stages.iterdir() if d.name.endswith(layout.SCRATCH_SUFFIX)] if stages.is_dir() else []


def test_sigterm_stops_a_stage_like_ctrl_c(tiny_llama: Path, tmp_path: Path) -> None:
    """`kill PID` during `npustudio adapt`: the stage stops, says so, exits 130 and leaves no `.partial` folder (it
    was cut off with no word, its scratch folder left behind)."""
    proj = tmp_path / "p"
    proc = subprocess.Popen([NPUSTUDIO, "adapt", str(tiny_llama), "--project", str(proj), "--cl", "128", "--ar", "32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _scratch(proj) or proc.poll() is not None, 300)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "stopped; the project keeps its last finished stages." in err
    assert _scratch(proj) == []


def test_a_cli_killed_outright_leaves_no_compile_running(genie_project: Project, tmp_path: Path) -> None:
    """`kill -9` of `npustudio compile` as its per-graph compiles start: they end with it, and none goes on to write
    its binary into the dead stage's folder (they compiled on, unseen, until their graph was done)."""
    proj = tmp_path / "p"
    shutil.copytree(genie_project.root, proj)
    proc = subprocess.Popen([NPUSTUDIO, "compile", "--project", str(proj), "--force"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    marker = "npustudio.core.graph.compile_process"
    try:
        wait_until(lambda: running(marker) or proc.poll() is not None, 600)
        assert proc.poll() is None, proc.communicate()
        proc.kill()
        proc.wait()
        killed = time.time()
        wait_until(lambda: not running(marker), 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    later = [p for p in (proj / layout.STAGES_DIR).rglob("*") if p.is_file() and p.stat().st_mtime > killed]
    assert later == []
