"""The Deploy page and the device panel: a device's properties, the device console with Genie's log, a recorded
deploy shown when the project is reopened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from npustudio.core.device import DeviceInfo
from npustudio.core.project import Project
from npustudio.gui.app import MainWindow
from tests.gui_helpers import fully_shown, marks, table_dict


def test_the_device_properties_read_whole_without_scrolling_at_1366x768(qtbot: Any, tmp_path: Path) -> None:
    """The properties table showed two rows and both scrollbars: it is now as tall as its rows, values wrapped,
    and the console still has room below it."""
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1366, 768)
    w.show()
    w.device_dock.raise_()
    w.devices._show([DeviceInfo(serial="emulator-5554", state="device", model="Galaxy S24", soc="SM8650",
                                product="Snapdragon 8 Gen 3", soc_model=57, dsp_arch="v75", ram_bytes=12 * 2**30,
                                free_bytes=100 * 2**30, android="14")])
    qtbot.wait(100)
    t = w.devices.details
    assert table_dict(t)["RAM"] == "12.9 GB" and t.rowCount() == 9
    assert not t.verticalScrollBar().isVisible() and not t.horizontalScrollBar().isVisible()
    port = t.viewport().rect()
    for r in range(t.rowCount()):
        for col in range(2):  # every cell whole in view, its text within its width
            rect = t.visualRect(t.model().index(r, col))
            assert port.contains(rect), (r, col, rect, port)
    assert fully_shown(t) and w.devices.console.height() >= 100


def test_the_device_console_shows_genies_log_at_the_level_picked_beside_the_answer(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """Real Genie (HTP simulator) answers in the chat; at log level info the console holds Genie's own log lines
    as well as the answer, and none of them gets into the answer."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    assert [w.devices.log_level.itemText(i) for i in range(w.devices.log_level.count())] == \
        ["error", "warn", "info", "verbose"]
    w.devices.log_level.setCurrentIndex(w.devices.log_level.findData("info"))
    w.chat.runner.setCurrentIndex(w.chat.runner.findData("desktop"))
    with qtbot.waitSignal(w.chat.answered, timeout=300_000) as got:
        w.chat.ask("Hello")
    turn = got.args[0]
    console = w.devices.console.toPlainText()
    assert "GenieDialog_create" in console and turn.assistant.split()[0] in console
    assert "GenieDialog" not in turn.assistant and "GenieDialog" not in w.chat.transcript.bubbles[-1].text


def test_a_recorded_deploy_shows_as_done_on_the_step_and_its_page_when_reopened(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """A deploy the manifest records (from the window or `npustudio deploy`) ticks Deploy when the project is
    reopened, and the Deploy and Target pages say what was done rather than "Not run yet in this project"."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    p = Project.open(root, create=False)
    p.choose(deployed={"device": "emulator-5554", "remote_dir": "/data/local/tmp/npustudio/proj",
                       "bundle": p.load().stages["bundle"].key, "at": 1_700_000_000.0})
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    assert marks(w) == ["done"] * 6
    assert w.deploy_page.strip.status.text().startswith("Deployed to emulator-5554:/data/local/tmp/npustudio/proj")
    assert w.target_page.strip.status.text() == f"Target set: {p.choices().target}."

    # a chat turn on another device deploys there first (core records it): once the answer is in, the page says so
    # (it kept naming the earlier device until the project was reopened)
    p.choose(deployed={"device": "127.0.0.1:40215", "remote_dir": "/data/local/tmp/npustudio/proj",
                       "bundle": p.load().stages["bundle"].key, "at": 1_700_000_100.0})
    w.chat.answered.emit(None)
    assert w.deploy_page.strip.status.text().startswith("Deployed to 127.0.0.1:40215:/data/local/tmp/npustudio/proj")
