"""The main window, driven as a user would (pytest-qt, offscreen): a tiny model through every wizard step to a chat
answer from the virtual device and reopened; the steps list; the window, its pages and charts on a laptop screen;
opening, switching and remembering projects; quitting while a stage or a read runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox, QTableWidget

from npustudio.core import stages
from npustudio.core.device import DeviceInfo
from npustudio.core.project import Project
from npustudio.gui.app import STEPS, MainWindow
from npustudio.gui.widgets import cells
from tests.conftest import done, make_tiny_model, present
from tests.gui_helpers import fully_shown, marks, run_page, shot, small_table, table_dict


def test_tiny_model_through_the_whole_wizard_to_a_chat_answer(qtbot: Any, tmp_path: Path, adb_server: Any) -> None:
    model = make_tiny_model(tmp_path / "m", "llama64")
    w = MainWindow(tmp_path / "proj", watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    assert marks(w) == ["todo", "todo", "locked", "locked", "locked", "locked"]

    # Model: a local folder -> card and fit
    m = w.model_page
    m.kind.button(1).setChecked(True)
    m.source.setText(str(model))
    run_page(qtbot, m)
    card = table_dict(m.card)
    assert card["layers"] == "2" and card["head_dim"] == "64" and card["family"] == "Llama"
    assert [r[0] for r in cells(m.fit)] == ["w8a16", "w4a16"]
    from npustudio.gui.pages.model import FIT_COLUMNS

    col = {name: i for i, name in enumerate(FIT_COLUMNS)}
    assert "phones with" in cells(m.fit)[0][col["Fits"]]
    assert cells(m.fit)[1][col["PPL cost (default model)"]].startswith("×1.2")  # w4a16's, measured on the default
    assert m.advice.text().startswith("Recommended: w8a16 for a phone")
    mnn = {r[0]: r[col["MNN model (CPU/GPU)"]] for r in cells(m.fit)}  # the MNN model at each weight width
    assert mnn["w8a16"].endswith(("KB", "MB")) and mnn["w4a16"] != mnn["w8a16"]
    assert "This computer, estimated: adapt" in m.host.text()
    assert " at w8a16, " in m.host.text() and "to disk." in m.host.text()  # the quantize stage's output
    shot(w, "tiny_model")

    # Target: picked from the SoC table
    w.go("Target")
    w.target_page.select("SM8650")
    assert "v75" in table_dict(w.target_page.details)["Hexagon (dsp_arch)"]
    w.target_page.select("SM8750")
    w.target_page.strip.run.click()
    assert w.project is not None
    assert w.project.choices().target == "SM8750"
    assert marks(w)[:3] == ["done", "done", "todo"]

    # Adapt at AR-32 / CL-128: equivalence shown, the PPL chart drew both series
    w.go("Adapt")
    w.adapt_page.ar.setValue(32)
    w.adapt_page.cl.setValue(128)
    run_page(qtbot, w.adapt_page)
    res = table_dict(w.adapt_page.results)
    assert float(res["Top-1 agreement with the original"]) >= 0.999
    assert set(w.adapt_page.chart.series) == {"fp", "adapted"}

    # Quantize: cancelled as soon as the first PPL point arrives -> the project keeps no quantize stage
    q = w.quantize_page
    w.go("Quantize")
    # each recipe says what it adds to this model's quantize stage here, before anything runs
    labels = {q.recipe.itemData(i): q.recipe.itemText(i) for i in range(q.recipe.count())}
    assert q.recipe.currentData() == "plain" and "estimated" not in labels["plain"]
    assert all(name in labels[r] and "here, estimated)" in labels[r]
               for r, name in (("adascale", "AdaScale"), ("omniquant", "OmniQuant")))
    # the int8 budget widens 4-bit weights: off at w8a16, where there are none, and part of the options at w4a16
    assert q.precision.currentData() == "w8a16" and not q.int8_budget.isEnabled()
    q.precision.setCurrentIndex(q.precision.findData("w4a16"))  # w4a16 shows its default budget, 5 %
    assert q.int8_budget.isEnabled() and q.int8_budget.text() == "int8 budget 5 %"
    assert q.options().int8_budget == 0.05
    # the LM head joins the 4-bit blocks only when asked, and only where there are blocks
    assert q.lm_head_bits.isEnabled() and q.options().lm_head_bits == 8
    q.lm_head_bits.setCurrentIndex(q.lm_head_bits.findData(4))
    assert q.options().lm_head_bits == 4 and q.lm_head_bits.currentText() == "4-bit blocks, as the layers"
    shot(w, "tiny_quantize_int8_budget")
    q.precision.setCurrentIndex(q.precision.findData("w8a16"))
    assert not q.lm_head_bits.isEnabled() and q.options().lm_head_bits == 8
    q.precision.setCurrentIndex(q.precision.findData("w4a16"))
    q.int8_budget.setValue(10)
    assert q.options().int8_budget == 0.1
    q.precision.setCurrentIndex(q.precision.findData("w8a16"))
    assert q.options().int8_budget == 0.0
    q.precision.setCurrentIndex(q.precision.findData("w4a16"))  # back: the budget the user set, not the default
    assert q.int8_budget.text() == "int8 budget 10 %"
    q.precision.setCurrentIndex(q.precision.findData("w8a16"))
    q.calib_samples.setValue(2)
    q.calib_len.setValue(64)
    points: list[dict] = []

    def first_point(kind: str, data: dict) -> None:
        points.append(data)
        if len(points) == 1:
            q.strip.cancel.click()

    with qtbot.waitSignal(q.strip.finished, timeout=120_000) as blocker:
        q.strip.run.click()
        assert q.strip.job is not None
        q.strip.job.partial.connect(first_point)
    assert blocker.args == [False] and "Cancelled" in q.strip.status.text()
    proj = Project.open(tmp_path / "proj", create=False)
    assert "quantize" not in proj.load().stages and proj.load().attempts["quantize"].status == "cancelled"
    assert not proj.stage_dir("quantize").exists() and marks(w)[3] == "todo"

    # ... and run again to the end: FP line and quantized points, results, the inspector on the export
    run_page(qtbot, q)
    assert {"fp", "quant"} <= set(q.chart.series) and len(q.chart.series["quant"]) >= 1
    r = table_dict(q.results)
    assert r["Precision / target"] == "w8a16 / SM8750" and r["Ratio"].startswith("×")
    qtbot.waitUntil(lambda: q.inspector.table_ is not None, timeout=30_000)
    assert q.inspector.table_ is not None
    assert q.inspector.proxy.rowCount() == len(q.inspector.table_.rows) > 0
    shot(w, "tiny_quantize")

    # Compile and bundle (no simulator check: covered by the compile tests)
    w.go("Compile")
    w.compile_page.verify.setValue(0)
    run_page(qtbot, w.compile_page)
    c = table_dict(w.compile_page.results)
    assert c["Ops left on the CPU"] == "0" and c["Validated by libGenie"] == "yes"
    assert c["Target"].startswith("SM8750 (Hexagon v79")
    assert len(cells(w.compile_page.binaries)) == 2
    assert marks(w) == ["done"] * 5 + ["todo"]

    # the second target from the same project: an MNN model of its float model, checked against it
    cp = w.compile_page
    cp.mnn.setChecked(True)
    assert not cp.verify.isEnabled() and cp.mnn_bits.isEnabled() and "No MNN model" in cp.strip.status.text()
    run_page(qtbot, cp)
    r = table_dict(cp.results)
    assert r["Weights"] == "4-bit in blocks of 128 (HQQ), LM head 8-bit"
    assert r["Perplexity vs the float model"].startswith(f"{done(w.project, stages.MNN).result.mnn_ppl:.3f} vs ")
    assert "llm.mnn.weight" in [row[1] for row in cells(cp.binaries)]
    shot(w, "tiny_compile_mnn")
    assert marks(w) == ["done"] * 5 + ["todo"]  # the Genie steps are untouched
    cp.embedded.setChecked(True)
    assert table_dict(cp.results)["Validated by libGenie"] == "yes" and cp.verify.isEnabled()
    # ... and the chat panel talks to it through MNN's runtime on this computer
    panel = w.chat
    panel.runner.setCurrentIndex(panel.runner.findData("mnn"))
    assert panel.stats.text().startswith("Ready: This computer: MNN")
    with qtbot.waitSignal(panel.answered, timeout=120_000) as got:
        panel.ask("Hello")
    assert got.args[0].runner == "MNN on this computer (CPU)" and got.args[0].generation_tok_s
    assert "tok/s" in panel.stats.text()
    panel.runner.setCurrentIndex(panel.runner.findData("device"))

    # Deploy: a v75 phone is refused for this v79 bundle; the virtual device (SM8750) started from the panel fits
    w.go("Deploy")
    d = w.deploy_page
    assert "No device selected" in d.target.text() and not d.strip.run.isEnabled()
    w.set_device(DeviceInfo(serial="R5CX", state="device", model="Galaxy S24", soc="SM8650",
                            product="Snapdragon 8 Gen 3", soc_model=57, dsp_arch="v75", ram_bytes=12 * 2**30,
                            free_bytes=100 * 2**30))
    assert "compiled for SM8750" in cells(d.compat)[0][0] and not d.strip.run.isEnabled()
    w.devices.start_virtual.click()
    qtbot.waitUntil(lambda: w.device is not None and w.device.virtual, timeout=60_000)
    assert "[virtual]" in w.devices.list.currentItem().text()
    assert cells(d.compat)[0][0] == "Compatible" and d.strip.run.isEnabled()
    assert cells(d.compat)[1][0] == "Decoding" and "one token per call; phone estimate: basic" in cells(d.compat)[1][1]
    run_page(qtbot, d, timeout=120_000)
    assert {r[2] for r in cells(d.files)} == {"yes"} and "sent" in d.strip.status.text()
    assert w.devices.push.value() == 1000
    assert table_dict(w.devices.details)["Answers with"].startswith("Genie on the HTP simulator (restart")
    assert "answers with Genie on the HTP simulator" in d.target.text()
    assert marks(w) == ["done"] * 6

    # Ask: the answer streams into the chat panel and the device console; history saved; profile charted; the
    # window keeps its width (a long status line once pushed Send and Stop off a laptop screen)
    width = w.width()
    assert w.chat.stats.text().startswith("Ready:")  # not "Pick a device" once one is picked
    with qtbot.waitSignal(w.chat.answered, timeout=300_000) as answered:
        d.ask.click()
        assert w.chat.stats.text().startswith("processing the prompt…")  # before the first token, it counts
    turn = answered.args[0]
    assert w.width() == width
    assert w.device is not None
    assert turn.runner == f"device {w.device.serial}" and turn.assistant
    assert "What is the capital of France?" in w.chat.transcript.toPlainText()
    assert turn.assistant[:20] in w.chat.transcript.toPlainText()
    assert w.devices.console.toPlainText().strip()
    hist = json.loads((tmp_path / "proj" / "chat_history.json").read_text())
    assert hist["turns"][-1]["assistant"] == turn.assistant  # after the MNN chat's turn above
    assert w.profiles.runs and cells(w.profiles.table)[0][1] == "genie"
    shot(w, "tiny_deploy_chat")
    # the MNN model on the same virtual device, through its llm_demo: deployed on the first question, each
    # question a chat of its own (llm_demo keeps no conversation), the earlier chats still listed
    panel.runner.setCurrentIndex(panel.runner.findData("mnn-device"))
    assert panel.stats.text().startswith("Ready: The selected device: MNN")
    chats, genie_chat = panel.chats.count(), panel.chats.currentData()
    for question in ("Hello", "And then?"):
        with qtbot.waitSignal(panel.answered, timeout=300_000) as got:
            panel.ask(question)
        assert got.args[0].runner == f"MNN llm_demo on device {w.device.serial}" and got.args[0].generation_tok_s
    assert panel.chats.count() == chats + 2 and "What is the capital" not in panel.transcript.toPlainText()
    assert (Path(w.devices.virtual.root) / "data/local/tmp/npustudio/proj-mnn" / "llm.mnn.weight").is_file()
    shot(w, "tiny_deploy_chat_mnn")
    panel.runner.setCurrentIndex(panel.runner.findData("device"))
    panel.pick(genie_chat)  # back to the Genie chat, which the reopened window shows
    w.devices.stop_virtual.click()  # the push bar is about a device that is gone: it resets
    qtbot.waitUntil(lambda: w.devices.push.value() == 0, timeout=60_000)
    assert w.devices.push.format() == "no push running"
    w.close()

    # Reopen: every step shows done, the window resumes on the last step, results and the chat are back
    w2 = MainWindow(tmp_path / "proj", watch_devices=False)
    qtbot.addWidget(w2)
    assert marks(w2) == ["done"] * 6 and w2.steps.currentRow() == 5
    assert float(table_dict(w2.adapt_page.results)["Top-1 agreement with the original"]) >= 0.999
    assert w2.quantize_page.precision.currentData() == "w8a16" and w2.quantize_page.calib_samples.value() == 2
    assert w2.target_page.selected() == "SM8750"
    w2.chat.runner.setCurrentIndex(2)  # this computer (no device selected here)
    assert "You: What is the capital of France?" in w2.chat.transcript.toPlainText()

    # Another target: the quantize step and everything after it are to be redone, and the window says why
    w2.go("Target")
    w2.target_page.select("SM8650")
    w2.target_page.strip.run.click()
    assert marks(w2) == ["done", "done", "done", "todo", "locked", "locked"]
    item = w2.steps.item(STEPS.index("Quantize"))
    assert item.text().startswith("↻") and "SM8650" in item.toolTip() and "SM8750" in item.toolTip()
    assert "Out of date: the target is now SM8650" in w2.quantize_page.strip.status.text()

    # File → New project: a folder that does not exist yet is created, and nothing of this project stays on screen
    dialog = w2._new_project()
    dialog.name.setText("second")
    dialog.location.setText(str(tmp_path / "new" / "place"))
    dialog.create_button.click()
    assert not dialog.problem.text() and not dialog.isVisible()
    assert w2.project is not None
    assert w2.project.root == (tmp_path / "new" / "place" / "second").resolve()
    assert marks(w2) == ["todo", "todo", "locked", "locked", "locked", "locked"]
    for page in w2.pages:
        for t in page.findChildren(QTableWidget):
            assert t.rowCount() == 0 or t in (w2.target_page.details, w2.deploy_page.compat), (page.title, cells(t))
    assert not w2.adapt_page.chart.series and not w2.quantize_page.chart.series
    assert w2.quantize_page.inspector.table_ is None and w2.quantize_page.inspector.proxy.rowCount() == 0
    assert not w2.profiles.runs and "Not run yet" in w2.compile_page.strip.status.text()


def test_the_window_fits_a_1366x768_laptop_screen_with_both_docks(qtbot: Any, tmp_path: Path) -> None:
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    w.profile_dock.show()
    w.show()
    assert w.tabifiedDockWidgets(w.chat_dock) == [w.device_dock] and w.chat_dock.isVisible()  # one column, tabs
    hint = w.minimumSizeHint()
    assert hint.width() <= 1366 and hint.height() <= 768, hint
    for page in w.pages:  # each page fits beside the docks' column without a sideways scroll
        assert page.minimumSizeHint().width() <= 1366 - 360 - w.steps.width(), page.title
    longest = max(STEPS, key=w.fontMetrics().horizontalAdvance)
    assert w.fontMetrics().horizontalAdvance("↻ " + longest) < w.steps.width()  # step names shown whole
    # on that screen the profiles get room for their charts below the wizard, and the chat beside them keeps the
    # full height: its messages had ~140 px (~70 with the profiles open) and Send and Stop went out of view
    w.resize(1366, 768)
    w.profile_dock.hide()
    w.profile_dock.show()
    qtbot.waitUntil(lambda: w.profile_dock.height() >= 250)
    c = w.chat
    qtbot.waitUntil(lambda: c.transcript.viewport().height() >= 300)
    for part in (c.send_btn, c.stop_btn, c.input, c.stats, c.regen_btn):
        assert fully_shown(part), part
    assert w.profile_dock.geometry().right() < w.chat_dock.geometry().left()  # below the wizard, not the chat
    w.device_dock.raise_()  # the device panel, in its tab, whole
    qtbot.waitUntil(lambda: w.device_dock.isVisible())
    assert w.devices.height() >= w.devices.minimumSizeHint().height()


def test_the_first_window_keeps_its_title_bar_and_status_line_on_the_screen(qtbot: Any, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A window manager frames the window after it is shown (a 20 px title bar at 1366×768): the window then
    shrinks so its frame fits the free area; the status line was under the screen's edge until maximised."""
    from PySide6.QtCore import QRect

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    room = w.screen().availableGeometry()
    w.resize(room.width(), room.height())
    # what openbox reports once it has framed the window: 1 px sides, a 20 px title bar, a 5 px bottom edge
    monkeypatch.setattr(w, "frameGeometry", lambda: QRect(room.x(), room.y(), w.width() + 2, w.height() + 25))
    w.fit_screen()
    assert (w.width(), w.height()) == (room.width() - 2, room.height() - 25)
    assert w.pos() == room.topLeft()


@pytest.mark.parametrize("size", [(1366, 768), (1024, 700)])
def test_every_page_and_the_inspector_fit_the_window_without_a_sideways_scroll(
        qtbot: Any, tmp_path: Path, size: tuple[int, int]) -> None:
    """Issue 65: with encodings loaded and the inspector's tab open, the Quantize page was 207 px wider than its
    view at 1366x768 (the inspector's controls in one row, its title on one line) and scrolled sideways, cutting
    the colour bar, the filters and Compare; at 1024x700 the Model, Adapt, Quantize and Compile pages did too
    (a form's longest label beside its widest field). Every page now fits its view at both sizes."""
    from PySide6.QtWidgets import QScrollArea, QTabWidget

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    w.resize(*size)
    w.show()
    qtbot.waitExposed(w)
    ins = w.quantize_page.inspector
    ins.set_graphs([tmp_path / "prompt_ar128_cl4096_1_of_1.encodings", tmp_path / "token_ar1_cl4096_1_of_1.encodings"])
    ins.load(small_table(tmp_path / "quantize"))
    tabs = ins.parentWidget()
    while not isinstance(tabs, QTabWidget):
        tabs = present(tabs, "tab widget around the inspector").parentWidget()

    def fits(page: Any) -> None:
        qtbot.wait(100)
        area = page.parentWidget()
        while not isinstance(area, QScrollArea):
            area = area.parentWidget()
        assert page.width() <= area.viewport().width() and not area.horizontalScrollBar().isVisible(), page.title

    for name, page in zip(STEPS, w.pages, strict=True):
        w.go(name)
        fits(page)
    w.go("Quantize")
    tabs.setCurrentIndex([tabs.tabText(i) for i in range(tabs.count())].index("Encodings inspector"))
    ins.title.setText("Reading prompt_ar128_cl1024_1_of_1.encodings…")  # one word to Qt: it widened the page
    fits(w.quantize_page)
    assert ins.title.toolTip() == ins.title.text()  # whole on hover where it is cut
    assert ins.isVisible()
    view = present(w.quantize_page.parentWidget(), "the Quantize page's view")
    for part in (ins.compare, ins.flagged, ins.search, ins.colour_by):  # the controls inside the page's view
        assert part.mapTo(w.quantize_page, part.rect().topRight()).x() <= view.width(), part


def _wheel(chart: Any, up: bool, ctrl: bool = False) -> None:
    """One notch of the mouse wheel over the middle of `chart`, as Qt delivers it (to the chart's viewport)."""
    from PySide6.QtCore import QPoint, QPointF
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    port = chart.viewport()
    at = QPointF(port.width() / 2, port.height() / 2)
    mods = Qt.KeyboardModifier.ControlModifier if ctrl else Qt.KeyboardModifier.NoModifier
    QApplication.sendEvent(port, QWheelEvent(at, port.mapToGlobal(at), QPoint(0, 0), QPoint(0, 120 if up else -120),
                                             Qt.MouseButton.NoButton, mods, Qt.ScrollPhase.NoScrollPhase, False))


def test_the_wheel_over_a_chart_scrolls_its_page_and_ctrl_wheel_zooms_it(qtbot: Any, tmp_path: Path) -> None:
    """The wheel over any chart zoomed the chart, so a page could not be scrolled past its charts. Now the plain
    wheel scrolls the page or dock the chart sits in and leaves the view alone; Ctrl+wheel zooms, which shows
    "Reset view"; that button fits the data again (autorange on both axes) and goes away."""
    from PySide6.QtWidgets import QScrollArea

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1366, 768)
    w.show()
    w.go("Quantize")
    q = w.quantize_page
    q.chart.extend([{"window": i, "fp_ppl": 14.0 + i % 3, "quant_ppl": 14.5 + i % 4} for i in range(20)])
    q.inspector.image.setImage(np.arange(24.0).reshape(6, 4))  # something to zoom into and fit again
    w.profiles.rates.plot([0, 1, 2], [30.0, 10.0, 20.0])
    w.profile_dock.show()
    qtbot.waitUntil(lambda: w.profile_dock.height() >= 250)
    w.profiles.setMinimumHeight(600)  # the profiles fit their dock at 1366x768: taller, the dock scrolls

    def scroll_area(chart: Any) -> QScrollArea:
        p = chart.parentWidget()
        while not isinstance(p, QScrollArea):
            p = p.parentWidget()
        return p

    charts = {"live perplexity": q.chart.plot, "inspector heatmap": q.inspector.heatmap,
              "tokens per second": w.profiles.rates}
    for name, chart in charts.items():
        if name == "inspector heatmap":
            q.tabs.setCurrentWidget(q.inspector)
        qtbot.wait(50)
        area = scroll_area(chart)
        bar = area.verticalScrollBar()
        assert bar.maximum() > 0, f"{name}: its page does not scroll at this size; the test proves nothing"
        vb = chart.getPlotItem().vb
        chart.grab()  # drawn, as on screen: pyqtgraph applies the data's autorange as the chart is drawn (the
        # heatmap's tab, just shown, lies below the page's fold at this size)
        home = vb.viewRange()
        assert not np.allclose(home, [[0, 1], [0, 1]]), name
        start = min(bar.value(), bar.maximum() - 1)  # room to scroll down
        bar.setValue(start)
        _wheel(chart, up=False)
        assert vb.viewRange() == home, f"{name}: the wheel zoomed the chart"
        assert bar.value() > start, f"{name}: the wheel did not scroll the page"
        assert not chart.reset_view.isVisible()
        _wheel(chart, up=True, ctrl=True)
        zoomed = vb.viewRange()
        assert zoomed != home and zoomed[0][1] - zoomed[0][0] < home[0][1] - home[0][0], f"{name}: Ctrl+wheel"
        assert chart.reset_view.isVisible() and chart.reset_view.text() == "Reset view"
        assert chart.rect().contains(chart.reset_view.geometry())
        chart.reset_view.click()
        assert vb.autoRangeEnabled() == [True, True] and not chart.reset_view.isVisible()
        chart.grab()
        assert np.allclose(vb.viewRange(), home), name  # fitted again as it is drawn


def test_an_out_of_date_step_locked_by_an_earlier_one_opens_to_say_why(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """Another target makes Quantize out of date, and Compile with it; Compile is locked until Quantize is redone,
    but a click on it opens its page, which says why it is out of date (the item was disabled: the reason could not
    be read)."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    p = Project.open(root, create=False)
    # deployed before the target changed (as another test may have left the shared project): the device still
    # holds this very bundle, so Deploy has nothing to explain and stays shut
    p.choose(deployed={"device": "emulator-5554", "remote_dir": "/data/local/tmp/x",
                       "bundle": done(p, stages.BUNDLE).record.key, "at": 0.0})
    p.choose(target="SM8650")
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    assert w.step_state("Quantize") == "todo" and w.step_state("Compile") == "locked"
    item = w.steps.item(STEPS.index("Compile"))
    assert item.text() == "↻ Compile" and "out of date" in item.toolTip()
    qtbot.mouseClick(w.steps.viewport(), Qt.MouseButton.LeftButton, pos=w.steps.visualItemRect(item).center())
    assert w.stack.currentIndex() == STEPS.index("Compile")
    status = w.compile_page.strip.status.text()
    assert status.startswith("Out of date: the quantize stage it was made from is out of date"), status
    assert "Run the steps before it" in status
    locked = w.steps.item(STEPS.index("Deploy"))  # locked, and nothing to explain: stays shut
    assert not locked.flags() & Qt.ItemFlag.ItemIsEnabled


def test_a_folder_that_is_not_a_project_is_refused_untouched(qtbot: Any, tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("my notes")
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    assert not w.open_project(tmp_path)
    assert w.project is not None
    assert w.project.root == (tmp_path / "p").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "p"]


def test_opening_a_project_remembers_it_in_recent_projects_written_off_the_gui_thread(
        qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings write is synced to disk: on the GUI thread it blocked a project switch while the disk was busy.
    The project still comes first in File → Recent, on screen at once and in the settings file."""
    import threading

    from npustudio.core import settings

    writes: list[tuple[bool, list[str]]] = []
    real_save = settings.save

    def save(s: settings.Settings, where: Path | None = None) -> None:
        writes.append((threading.current_thread() is threading.main_thread(), list(s.recent_projects)))
        real_save(s, where)

    monkeypatch.setattr(settings, "save", save)
    w = MainWindow(tmp_path / "a", watch_devices=False)
    qtbot.addWidget(w)
    assert w.open_project(tmp_path / "b")
    b = str((tmp_path / "b").resolve())
    assert w.recent_menu.actions()[0].text() == b  # the menu at once
    qtbot.waitUntil(lambda: settings.load().recent_projects[:1] == [b], timeout=10_000)
    assert writes and not any(on_gui for on_gui, _ in writes)
    assert writes[-1][1][:2] == [b, str((tmp_path / "a").resolve())]


def test_opening_another_project_resets_every_view_of_the_last_one(qtbot: Any, tmp_path: Path) -> None:
    """Issue 37: project B opened after A shows nothing of A: the inspector's filters, colouring, sort and zoom,
    the live perplexity chart's points and zoom, the deploy push's bar, figures and console, the profiles' runs
    and zoom."""
    from npustudio.core.genie.profile import Event, Profile

    w = MainWindow(tmp_path / "a", watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    ins, q, d = w.quantize_page.inspector, w.quantize_page, w.deploy_page
    ins.load(small_table(tmp_path / "a-export"))
    ins.search.setText("down")
    ins.role.setCurrentIndex(ins.role.findData("down"))
    ins.flagged.setChecked(True)
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("range"))
    ins.sort_by("sqnr_db")
    charts = [ins.heatmap, ins.detail, ins.hist, q.chart.plot, w.profiles.timeline, w.profiles.ttft, w.profiles.rates]
    q.chart.extend([{"window": i, "fp_ppl": 14.0 + i, "quant_ppl": 14.5 + i} for i in range(5)])
    d._partial("push", {"bytes": 5_000_000, "total": 10_000_000, "rate": 49e6, "eta_s": 1.0})
    d.pushed = {"genie_config.json": True}
    w.devices.log("Deploying A's bundle…")
    w.profiles.add("chat 1", Profile(runner="genie", events=[Event(
        type="GenieDialog_query", component="d", start_us=0, stop_us=1_000_000, ttft_us=200_000, prompt_tokens=4,
        prompt_rate=20.0, generated_tokens=8, generation_rate=10.0)]))
    for c in charts:  # zoomed by hand, as a drag or Ctrl+wheel does
        c.getPlotItem().vb.setRange(xRange=(0.2, 0.3), yRange=(0.2, 0.3), padding=0)
        c.getPlotItem().vb.sigRangeChangedManually.emit([True, True])
    assert ins.visible_rows() and w.devices.push.value() > 0 and w.profiles.runs

    assert w.open_project(tmp_path / "b")
    assert ins.table_ is None and ins.visible_rows() == []
    assert (ins.search.text(), ins.role.currentIndex(), ins.flagged.isChecked(), ins.colour_by.currentIndex()) == \
        ("", 0, False, 0)
    assert (ins.proxy.text, ins.proxy.role, ins.proxy.flagged_only) == ("", "", False)
    assert ins.view.horizontalHeader().sortIndicatorSection() == -1
    for c in charts:
        assert c.getPlotItem().vb.autoRangeEnabled() == [True, True] and not c.reset_view.isVisibleTo(c)
    assert q.chart.series == {} and q.chart.items == {} and q.chart.summary.text() == ""
    assert d.strip.bar.value() == 0 and not d.strip.status.text().startswith("Pushed") and d.pushed == {}
    assert w.devices.push.value() == 0 and w.devices.push.format() == "no push running"
    assert "A's bundle" not in w.devices.console.toPlainText()
    assert w.profiles.runs == [] and w.profiles.table.rowCount() == 0


def test_closing_the_window_cancels_the_running_stage_cleanly(qtbot: Any, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "llama64")
    w = MainWindow(tmp_path / "proj", watch_devices=False)
    qtbot.addWidget(w)
    assert w.project is not None
    w.project.choose(model=str(model), target="SM8750")
    w.refresh()
    w.go("Adapt")
    w.adapt_page.strip.run.click()
    qtbot.waitUntil(lambda: w.adapt_page.strip.bar.value() > 0, timeout=60_000)
    w.show()
    w.close()  # asks first: Cancel keeps the window and the stage running
    box = w.quit_box
    assert box is not None and box.isVisible() and "Adapt is still running" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert w.isVisible() and w.busy()
    w.close()
    assert w.quit_box is not None
    stop = next(b for b in w.quit_box.buttons() if b.text() == "Stop and quit")
    stop.click()  # the window says so and stays live while the stage reaches its next safe point
    assert "Stopping" in w.adapt_page.strip.status.text() and w.isVisible()
    qtbot.waitUntil(lambda: not w.isVisible(), timeout=120_000)
    assert not w.busy()
    proj = Project.open(tmp_path / "proj", create=False)
    assert "adapt" not in proj.load().stages and proj.load().attempts["adapt"].status == "cancelled"
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "proj" / "stages").iterdir())


def slow_encodings_read(path: Path) -> Any:
    """The inspector's read, seconds slower (a large export on a busy disk): it runs in the read's child process."""
    import time

    from npustudio.gui.pages.quantize import read_with_sqnr

    time.sleep(12)
    return read_with_sqnr(path)


def _finished_project_with_a_slow_read(qtbot: Any, genie_project: Project, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> tuple[MainWindow, Any]:
    """A copy of the finished tiny project, opened while its encodings read is still running."""
    import shutil

    from npustudio.gui import worker
    from npustudio.gui.pages import quantize

    monkeypatch.setattr(quantize, "read_with_sqnr", slow_encodings_read)
    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    job = next(j for j in worker.running() if j.name == "Reading encodings")
    return w, job


def test_quitting_right_after_opening_a_finished_project_does_not_wait_for_the_encodings_read(
        qtbot: Any, genie_project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the window waited on the GUI thread for the inspector's encodings read: quitting soon after opening
    a finished project froze the window 6.5-16 s, with no question and no word. The close returns at once, the
    read's child process is ended rather than waited out, and what it would have read is never drawn."""
    import time

    w, job = _finished_project_with_a_slow_read(qtbot, genie_project, tmp_path, monkeypatch)
    t0 = time.perf_counter()
    w.close()
    blocked = time.perf_counter() - t0
    assert not w.isVisible() and w.quit_box is None  # nothing to ask: only a read was running
    assert blocked < 0.05, f"the close held the GUI thread {blocked * 1000:.0f} ms"
    assert job.state.cancelled
    qtbot.waitUntil(lambda: not job.running, timeout=6_000)  # well before the read's 12 s: its child was ended
    qtbot.wait(100)
    assert w.quantize_page.inspector.table_ is None


def test_switching_projects_cancels_the_previous_projects_encodings_read(
        qtbot: Any, genie_project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another project opened while the inspector still reads this one's encodings: the read is cancelled (its
    child ended), not left to run on and load a table the window has moved on from."""
    w, job = _finished_project_with_a_slow_read(qtbot, genie_project, tmp_path, monkeypatch)
    assert w.open_project(tmp_path / "other")
    assert job.state.cancelled
    qtbot.waitUntil(lambda: not job.running, timeout=6_000)
    qtbot.wait(100)
    assert w.quantize_page.inspector.table_ is None and "No encodings" in w.quantize_page.inspector.title.text()


def test_the_responsiveness_benchmark_measures_a_project_switch_and_quitting_mid_stage(
        tmp_path: Path, genie_project: Project) -> None:
    """`benchmarks/gui_responsiveness.py --quick` opens another project and back, then quits during Adapt, then
    quits right after opening a finished project, then opens it and asks its bundle a question on this computer's
    Genie and on the virtual device: it reports what it measured (no timing is judged here), that the window asked
    when a stage ran, did not when only the encodings read did, closed and left no scratch, and both answers."""
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    res = subprocess.run([sys.executable, "-X", "faulthandler",  # a crash shows where each thread was
                          str(root / "benchmarks" / "gui_responsiveness.py"), "--quick",
                          "--finished", str(genie_project.root)],
                         capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen", "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-6000:]
    out = json.loads(res.stdout)
    for leg in ("to_other", "back"):
        assert out["switch_project"][leg]["open_blocked_ms"] > 0 and out["switch_project"][leg]["ticks"] > 0
    close = out["close_during_stage"]
    assert close["stage"] == "adapt" and close["asked_before_quitting"] and close["closed"]
    assert close["scratch_left"] == [] and close["kept_last_good"] is None  # a first run: nothing to keep
    quit_ = out["quit_after_opening"]
    assert "Reading encodings" in quit_["running_at_close"] and quit_["close_blocked_ms"] > 0
    assert quit_["closed"] and not quit_["asked_before_quitting"] and quit_["seconds_until_jobs_ended"] >= 0
    assert out["opening"]["open_blocked_ms"] > 0 and out["opening"]["ticks"] > 0
    for runner, said in (("desktop", "desktop Genie on the HTP simulator: "), ("device", "device 127.0.0.1:")):
        turn = out[f"chat_{runner}"]
        assert turn["runner"] == runner and turn["ticks"] > 0 and turn["status"].startswith(said), turn
        assert "tok/s" in turn["status"], turn  # an answer came, with Genie's profile
    assert out["chat_device"]["starting_virtual_device"]["ticks"] > 0
    assert "Traceback" not in res.stderr


def test_qt_calls_do_not_drain_the_reference_count_of_none(qtbot: Any) -> None:
    """PySide6 6.12.0 dropped a reference to None per call: on Python 3.11 a long session aborted."""
    import sys

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    assert app is not None
    before = sys.getrefcount(None)
    for _ in range(5000):
        app.processEvents()
    assert sys.getrefcount(None) - before > -100
