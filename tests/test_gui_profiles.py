"""The profiles dock: Genie's profiles drawn and tabled, read at a laptop's dock size, the project's own sample
answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from npustudio.core import layout
from npustudio.core.errors import UserError
from npustudio.core.project import Project
from npustudio.gui.app import MainWindow
from npustudio.gui.widgets import cells


def test_profile_view_draws_a_real_genie_profile(qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    from npustudio.core.genie import host
    from npustudio.gui.profile_view import ProfileView, spans

    bundle = genie_project.stage_dir("bundle")
    prof = tmp_path / "p.json"
    host.run(bundle / "genie_config.json", "Hello there", lambda s: None, profile_path=prof, max_tokens=4)
    view = ProfileView()
    qtbot.addWidget(view)
    view.set_roofline(bundle)
    view.add_file(prof)
    view.add_file(prof)  # two runs side by side
    rows = cells(view.table)
    assert len(rows) == 2 and rows[0][1] == "genie" and float(rows[0][3]) > 0 and rows[0][8] != "—"
    phases = [p for p, _a, _b in spans(view.runs[0][1])]
    assert phases[0] == "create" and "prompt" in phases and "generate" in phases
    bad = tmp_path / "bad.json"
    bad.write_text('{"components": 3}')
    with pytest.raises(UserError, match="not a Genie profile"):
        view.add_file(bad)


def test_the_profiles_read_at_1366x768_with_a_phones_rate_beside_the_roofline(qtbot: Any) -> None:
    """At the dock's size on a 1366x768 screen: run names under the bars overlapped (now numbers, the table names
    them), the legend covered the bars, the timeline's title was cut, a 5 tok/s bar was a line next to a 420 tok/s
    roofline (now a log axis), and the table showed 0.677123 s."""
    import math

    import pyqtgraph as pg

    from npustudio.core.genie.profile import Event, Profile
    from npustudio.gui.profile_view import ProfileView

    def run(rate: float) -> Profile:
        return Profile(runner="genie", events=[
            Event(type="GenieDialog_create", component="d", start_us=0, stop_us=677_123, init_time_us=677_123),
            Event(type="GenieDialog_query", component="d", start_us=700_000, stop_us=9_000_000, ttft_us=2_103_456,
                  prompt_tokens=40, prompt_rate=412.345, generated_tokens=30, generation_rate=rate)])

    view = ProfileView()
    qtbot.addWidget(view)
    view.resize(1003, 345)  # the dock's size on that screen
    view.show()
    view.roof = {"decode_tok_s_bound": 420.3, "memory_gb_s": 77.0}
    for i, rate in enumerate((5.0, 6.5, 5.5)):
        view.add(f"chat {i + 1} (device R5CX21A9ZZK, Genie on the phone)", run(rate))
    qtbot.wait(100)
    for chart in (view.ttft, view.rates):
        assert chart.getAxis("bottom")._tickLevels == [[(0, "1"), (1, "2"), (2, "3")]]
    assert cells(view.table)[0][0].startswith("1: chat 1") and cells(view.table)[0][2:4] == ["0.677", "2.10"]
    assert view.rates.getPlotItem().legend is None
    title = view.timeline.getPlotItem().titleLabel
    assert title.item.boundingRect().width() <= view.timeline.width() - 20
    lo, hi = view.rates.getPlotItem().vb.viewRange()[1]
    bars = [i for i in view.rates.getPlotItem().items if isinstance(i, pg.BarGraphItem)]
    gen = min(bars, key=lambda b: b.boundingRect().height())  # the 5 tok/s bars: a fifth of the height at least
    assert gen.boundingRect().height() / (hi - lo) > 0.2
    line = next(i for i in view.rates.getPlotItem().items if isinstance(i, pg.InfiniteLine))
    assert math.isclose(10 ** line.value(), 420.3) and lo <= line.value() <= hi

    one = ProfileView()  # one run: its axes read "run (x0.001)" under a "1" (pyqtgraph's SI prefix on no unit)
    qtbot.addWidget(one)
    one.resize(1003, 345)
    one.show()
    one.add("chat 1 (device 127.0.0.1:5555)", run(0.05))
    qtbot.wait(100)
    for chart in (one.timeline, one.ttft, one.rates):
        for side in ("left", "bottom"):
            assert "(x" not in chart.getAxis(side).labelString(), (chart, side)


def test_profiles_show_the_projects_own_sample_answer_and_say_when_it_is_unreadable(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """Issue 65: the profiles dock ignored the project's `runs/sample_profile.json` (written by `npustudio run`).
    Opening a project shows it as its first run; a damaged one is named in the status line, the window opens."""
    import shutil

    from npustudio.core.genie import host

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    runs = root / layout.RUNS_DIR
    runs.mkdir(exist_ok=True)
    bundle = root / "stages" / "bundle"
    host.run(bundle / layout.GENIE_CONFIG, "Hello", lambda _s: None, profile_path=runs / layout.SAMPLE_PROFILE,
             preview=True, max_tokens=4)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    assert [label for label, _p, _s in w.profiles.runs] == ["sample answer (npustudio run)"]
    assert w.profiles.table.rowCount() == 1 and w.profiles.runs[0][2].generated_tokens

    (runs / layout.SAMPLE_PROFILE).write_text("{not json")
    assert w.open_project(root)
    assert w.profiles.runs == [] and w.profiles.table.rowCount() == 0
    assert "sample_profile.json was not shown in Profiles" in w.statusBar().currentMessage()
