"""The desktop window, driven as a user would (pytest-qt, offscreen): a tiny model through every wizard step to a
chat answer from the virtual device, cancel mid-stage, reopen, the token dialog, the inspector, the profile view."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QImage, QPainter
from PySide6.QtWidgets import QApplication, QMessageBox, QTableWidget

from npustudio.core import layout
from npustudio.core.chat import Turn
from npustudio.core.device import DeviceInfo
from npustudio.core.errors import UserError
from npustudio.core.project import Project
from npustudio.display import human_number
from npustudio.gui.app import STEPS, MainWindow
from npustudio.gui.widgets import cells
from tests.conftest import done, item_at, make_tiny_model, present

SHOTS = os.environ.get("NPUSTUDIO_SCREENSHOTS")  # set to a folder to keep a PNG of every page and panel


def shot(w: Any, name: str) -> None:
    if SHOTS:
        from PySide6.QtWidgets import QApplication

        QApplication.processEvents()  # a plot's axes size themselves on their first paint
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        w.grab().save(str(Path(SHOTS) / f"{name}.png"))


def run_page(qtbot: Any, page: Any, timeout: int = 300_000) -> None:
    """Click the page's Run button and wait for the job; fail with what the page says when it failed."""
    with qtbot.waitSignal(page.strip.finished, timeout=timeout) as blocker:
        page.strip.run.click()
    assert blocker.args == [True], page.strip.status.text()


def marks(w: MainWindow) -> list[str]:
    return [w.step_state(s) for s in STEPS]


def table_dict(t: Any) -> dict[str, str]:
    return {r[0]: r[1] for r in cells(t)}


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
    assert proj.record("quantize") is None and proj.load().attempts["quantize"].status == "cancelled"
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
    assert r["Perplexity vs the float model"].startswith(f"{done(w.project, 'mnn').result['mnn_ppl']:.3f} vs ")
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


def test_a_failed_stage_shows_the_problem_and_the_fix(qtbot: Any, tmp_path: Path) -> None:
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    m = w.model_page
    m.kind.button(2).setChecked(True)
    m.source.setText(str(tmp_path / "missing.gguf"))
    with qtbot.waitSignal(m.strip.finished, timeout=30_000) as blocker:
        m.strip.run.click()
    assert blocker.args == [False] and "No model at" in m.strip.status.text()
    box = w.findChild(QMessageBox, "error_dialog")
    assert box is not None and "How to fix it" in box.informativeText()
    assert marks(w)[0] == "todo"


def fully_shown(w: Any) -> bool:
    """Nothing of `w` is cut off or out of view."""
    return w.isVisible() and w.visibleRegion().boundingRect().size() == w.size()


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


def test_the_perplexity_tab_is_as_tall_as_itself_not_as_the_inspector(qtbot: Any, tmp_path: Path) -> None:
    """A tab widget is as tall as its tallest tab: the inspector's heatmap and table made the Quantize page's
    perplexity chart ~1,250 px tall in a scrolling page, its axis out of view; it now sizes to the tab shown."""
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    tabs = w.quantize_page.tabs
    inspector = present(tabs.widget(1), "second tab").sizeHint().height()
    assert tabs.currentIndex() == 0 and tabs.sizeHint().height() < inspector
    tabs.setCurrentIndex(1)  # the inspector, when shown, gets its room
    assert tabs.sizeHint().height() >= inspector
    from npustudio.gui.widgets import fill

    long_name = "test_vectors/prompt_ar128_cl1024_1_of_1.npz"  # shortened in the middle to fit: whole on hover
    fill(w.quantize_page.results, [(long_name, "135.9 KB")])
    assert item_at(w.quantize_page.results, 0, 0).toolTip() == long_name


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


def test_the_chat_status_line_never_moves_the_input_and_enter_sends(qtbot: Any, tmp_path: Path) -> None:
    """A long status line wrapped and pushed the input box down as an answer's figures changed: it stays one
    line (elided, whole in its tooltip). The input takes several lines: Shift+Enter breaks the line, Enter sends."""
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1366, 768)
    w.show()
    c = w.chat
    qtbot.waitExposed(w)
    y, h = c.input.mapTo(c, c.input.rect().topLeft()).y(), c.stats.height()
    long = "device emulator-5554: 3.05 tok/s, TTFT 2.10 s (Genie's profile), stopped after 120 tokens " * 3
    c.stats.setText(long)
    qtbot.wait(50)
    assert c.stats.height() == h and c.input.mapTo(c, c.input.rect().topLeft()).y() == y
    assert c.stats.text() == long and c.stats.toolTip() == long
    c.input.setFocus()
    qtbot.keyClicks(c.input, "line one")
    qtbot.keyClick(c.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(c.input, "line two")
    assert c.input.toPlainText() == "line one\nline two"
    with qtbot.waitSignal(c.input.submitted, timeout=1_000):
        qtbot.keyClick(c.input, Qt.Key.Key_Return)
    assert c.input.toPlainText() == "line one\nline two"  # nothing to chat with here: the message is kept


def test_the_chats_figures_come_from_genies_profile_worded_alike_live_and_final(qtbot: Any, tmp_path: Path) -> None:
    """The live line said "first after 20.5 s" (the window's clock, the model's loading included) and the final one
    "TTFT 2.10 s" (Genie's profile): figures now come from the profile only, rounded alike in the status line and
    the answer's header. A stopped answer without a rate says what is known ("rate ?" before); a regenerated
    answer that came back the same says why (greedy decoding)."""
    import time
    from types import SimpleNamespace

    from npustudio.core import chat as core_chat

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    c = w.chat
    c._t0 = time.monotonic() - 20.5
    c._piece("text", {"text": "Paris"})
    live = c.stats.text()
    assert live.startswith("answering: 1 token so far") and "first after" not in live and "tok/s" not in live
    hist = core_chat.ChatHistory.load(tmp_path / "h.json")

    def done(turn: Turn, regenerated: str | None = None) -> str:
        hist.current.turns[:] = [turn]
        c._regenerated = regenerated
        session = SimpleNamespace(last_profile=None, history=hist, turns=hist.current.turns)  # what _done reads
        c._done((cast(core_chat.ChatSession, session), turn))
        return c.stats.text()

    measured = Turn(user="Q", assistant="Paris", runner="device x", generation_tok_s=3.04811, ttft_s=2.1034)
    assert done(measured) == "device x: 3.05 tok/s, TTFT 2.10 s (the runner's)"
    assert c.transcript.bubbles[-1].header.text() == "Model (device x) · 3.05 tok/s, TTFT 2.10 s (the runner's)"
    # what the person waited, beside the runner's own TTFT, each labelled: 20.5 s of loading and prompt read 2.10
    waited = measured.model_copy(update={"wait_s": 20.5})
    assert done(waited) == ("device x: 3.05 tok/s, TTFT 2.10 s (the runner's), first words after 20.5 s here "
                            "(with loading)")
    stopped = Turn(user="Q", assistant="Par", runner="device x", stopped=True)
    assert done(stopped) == "device x: stopped after 1 token"
    c.greedy = True
    assert "greedy decoding gives the same text" in done(measured, regenerated="Paris")
    assert "greedy" not in done(measured, regenerated="Lyon")


def test_a_chat_is_renamed_and_deleted_from_the_chat_panel(qtbot: Any, tmp_path: Path) -> None:
    """Rename… names the chat in the list (asked in a box); Delete… asks, then forgets it and shows the newest
    other chat; both are in the saved history."""
    from npustudio.core import chat as core_chat

    root = tmp_path / "p"
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    hist = core_chat.ChatHistory.load(root / "chat_history.json")
    hist.current.turns.append(Turn(user="Older question", assistant="A", runner="x"))
    hist.current.created = 1.0
    hist.new().turns.append(Turn(user="Newer question", assistant="B", runner="x"))
    hist.save()
    c = w.chat
    c.reload()
    assert c.chats.currentText() == "Newer question" and c.rename_btn.isEnabled() and c.delete_btn.isEnabled()
    c.rename_btn.click()
    assert c.rename_box is not None and c.rename_box.isVisible()
    c.rename_box.setTextValue("My trip")
    c.rename_box.accept()
    assert c.chats.currentText() == "My trip"
    assert core_chat.ChatHistory.load(root / "chat_history.json").current.title == "My trip"
    c.delete_btn.click()
    assert c.delete_box is not None and "My trip" in c.delete_box.text()
    next(b for b in c.delete_box.buttons() if b.text() == "Delete").click()
    assert [c.chats.itemText(i) for i in range(c.chats.count())] == ["Older question"]
    assert [b.text for b in c.transcript.bubbles] == ["Older question", "A"]
    saved = core_chat.ChatHistory.load(root / "chat_history.json")
    assert [ch.title for ch in saved.chats] == ["Older question"]


def test_a_folder_that_is_not_a_project_is_refused_untouched(qtbot: Any, tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("my notes")
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    assert not w.open_project(tmp_path)
    assert w.project is not None
    assert w.project.root == (tmp_path / "p").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "p"]


def test_a_settings_file_that_cannot_be_used_is_named_and_kept(qtbot: Any, tmp_path: Path) -> None:
    """The window still starts (with the defaults) and says why; its recent-projects write would have replaced the
    user's file with the defaults. Saving the preferences on purpose writes it again."""
    from PySide6.QtCore import QThreadPool

    from npustudio.core import settings

    f = settings.path()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text('{"default_precison": "w4a16"}')
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    shown = w.statusBar().currentMessage()
    for words in ("Default settings in use", str(f), "unknown key 'default_precison'",
                  "Did you mean 'default_precision'?"):
        assert words in shown, shown
    assert w.open_project(tmp_path / "q")
    assert QThreadPool.globalInstance().waitForDone(10_000)
    assert f.read_text() == '{"default_precison": "w4a16"}'
    w.open_settings().accept()
    assert QThreadPool.globalInstance().waitForDone(10_000)
    assert settings.load().recent_projects[0] == str((tmp_path / "q").resolve())
    assert not w.statusBar().currentMessage()


def test_token_dialog_checks_with_the_hub_and_stores_only_in_the_keyring(
        qtbot: Any, tmp_path: Path, memory_keyring: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from npustudio.core import settings
    from tests.fake_hub import FakeHub

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    with FakeHub({}, gated={"meta/llama": "hf_good_token_123"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        dlg = w.open_settings()
        assert dlg.token.echoMode() == dlg.token.EchoMode.Password
        dlg.token.setText("hf_wrong")
        dlg.check_save.click()
        qtbot.waitUntil(lambda: "does not accept" in dlg.token_status.text(), timeout=15_000)
        assert memory_keyring.store == {}
        dlg.token.setText("hf_good_token_123")
        dlg.check_save.click()
        qtbot.waitUntil(lambda: "saved in the system keyring" in dlg.token_status.text(), timeout=15_000)
    assert "tester" in dlg.token_status.text() and dlg.token.text() == ""
    assert memory_keyring.store == {("npustudio", "huggingface"): "hf_good_token_123"}
    dlg.preview.setChecked(True)
    dlg.accept()
    saved = settings.path().read_text()
    assert json.loads(saved)["virtual_preview"] is True and "hf_good" not in saved
    assert "hf_good" not in caplog.text and "hf_wrong" not in caplog.text


def test_inspector_filters_sorts_and_details_a_real_export(qtbot: Any, genie_project: Project) -> None:
    from npustudio.core.graph import encodings, sqnr
    from npustudio.gui.inspector import Inspector

    f = next(genie_project.stage_dir("quantize").glob("prompt_*.encodings"))
    table = sqnr.annotated(f)
    ins = Inspector()
    qtbot.addWidget(ins)
    ins.sort_by("scale_spread")  # a header clicked before anything is loaded is a no-op
    ins.load(table)
    assert ins.proxy.rowCount() == len(table.rows)
    ins.role.setCurrentIndex(ins.role.findData("kv-cache"))
    kv = ins.visible_rows()
    assert kv and {r.role for r in kv} == {"kv-cache"} and {r.bitwidth for r in kv} == {8}
    ins.role.setCurrentIndex(0)
    ins.search.setText("mlp.down")
    assert all("mlp.down" in r.name for r in ins.visible_rows()) and ins.visible_rows()
    ins.search.setText("")
    ins.sort_by("scale_spread", descending=True)
    spreads = [r.scale_spread for r in ins.visible_rows()]
    assert spreads == sorted(spreads, reverse=True)
    ins.view.selectRow(0)
    top = ins.visible_rows()[0]
    assert top.name in ins.detail_label.text() and ins.detail_points == top.channels
    for metric in range(ins.colour_by.count()):  # every colouring draws a layers x roles grid
        ins.colour_by.setCurrentIndex(metric)
        assert ins.heat_grid.shape[1] == 2
    grids, shows = {}, {}
    for key in ("weight_bits", "activation_bits", "sqnr", "activation_sqnr"):
        ins.colour_by.setCurrentIndex(ins.colour_by.findData(key))
        grids[key] = {role: ins.heat_grid[i] for i, role in enumerate(ins.heat_roles)}
        shows[key] = {table.by_name(n).kind for n in ins.heat_names.values()}
    assert list(grids["weight_bits"]["q"]) == [8, 8]  # the int8 weights, not the 16-bit activations around them
    assert "norm" not in grids["sqnr"] and "activation" not in grids["sqnr"]  # no weight there: no row
    assert list(grids["activation_bits"]["kv-cache"]) == [8, 8]
    assert all(30 < db < 60 for db in grids["sqnr"]["down"])  # int8 per channel: about 40 dB
    # activations (a conv's output has its role): the 8-bit KV cache is where they lose the most; no weight mixed in
    assert shows["activation_sqnr"] == {"activation"} and shows["sqnr"] == {"param"}
    assert all(30 < db < 55 for db in grids["activation_sqnr"]["kv-cache"])
    assert all(db > 60 for role in ("activation", "down") for db in grids["activation_sqnr"][role])
    ins.sort_by("sqnr_db", descending=False)  # the most damaged weight first
    assert ins.visible_rows()[0].sqnr_db == min(r.sqnr_db for r in table.rows if r.sqnr_db is not None)
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("range"))  # every role has activations
    ins.resize(1000, 800)
    ins.show()
    qtbot.waitExposed(ins)
    qtbot.wait(200)  # layout settles
    img = QImage(10, 10, QImage.Format.Format_ARGB32)
    painter = QPainter(img)
    drawn = [text for _rect, _flags, text in ins.heatmap.getAxis("left").generateDrawSpecs(painter)[2]]
    painter.end()
    assert sorted(drawn) == sorted(ins.heat_roles) and "activation" in drawn  # every row is labelled
    ins.load(encodings.read(f))  # without SQNR figures (rotated weights): the SQNR colouring draws nothing
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("sqnr"))
    assert ins.heat_roles == []


def test_the_inspector_shows_what_another_run_changed(qtbot: Any, genie_project: Project,
                                                      genie_project_w4: Project) -> None:
    """Issue 41: the inspector sets the run it shows against another project's (here w4a16 against w8a16 of the same
    model): each tensor's SQNR in both, the most damaged by the change first; 4-bit blocks lose against int8 rows."""
    from npustudio.core.graph import encodings
    from npustudio.gui.inspector import Inspector

    after = next(genie_project_w4.stage_dir("quantize").glob("prompt_*.encodings"))
    before = next(genie_project.stage_dir("quantize").glob("prompt_*.encodings"))
    ins = Inspector()
    qtbot.addWidget(ins)
    assert not ins.compare.isEnabled()  # nothing to compare before a run is shown
    ins.load(encodings.read(after))
    assert ins.compare.isEnabled()
    title = ins.title.text()
    # issue 65: a comparison (~40 s on the default model) says how far it is and can be cancelled
    ins.compare_with(before)
    assert ins.compare.text() == "Cancel comparison" and ins.compare.isEnabled()
    qtbot.waitUntil(lambda: ins.title.text().startswith(f"Comparing with {genie_project.root.name}/"), timeout=60_000)
    ins.compare.click()
    qtbot.waitUntil(lambda: ins.compare.text() == "Compare with another run…", timeout=120_000)
    qtbot.wait(200)
    assert ins.changes is None and ins.title.text() == title and ins.compare.isEnabled()
    ins.compare_with(before)
    qtbot.waitUntil(lambda: ins.changes is not None, timeout=180_000)
    assert ins.changes is not None and ins.compare.isEnabled()
    rows = ins.changes.rows
    changes = [r.change_db for r in rows if r.change_db is not None]
    assert changes == sorted(changes) and changes[0] < -10  # int4 against int8: far less signal to noise
    down = next(r for r in rows if r.name == "layers.0.mlp.down.weight")
    assert down.after_db is not None and down.before_db is not None and down.after_db < down.before_db - 10
    assert ins.changes.table.rowCount() == len(rows) and ins.changes.table.item(0, 0).text() == rows[0].name
    assert " lost and " in ins.changes.summary.text() and "the most damaged first" in ins.changes.summary.text()
    shot(ins.changes, "inspector_run_changes")


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
    assert proj.record("adapt") is None and proj.load().attempts["adapt"].status == "cancelled"
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "proj" / "stages").iterdir())


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


def stage_asked(fn: Any, args: tuple[Any, ...]) -> str:
    """What a page asked the child process to run: a stage by its declaration (run_stage's spec), or a step."""
    return args[1].name if fn.func.__name__ == "run_stage" else fn.func.__name__


def test_redo_on_each_stage_page_reruns_its_stage_with_force(qtbot: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Run skips an unchanged stage; Redo passes force=True to the pipeline (the CLI's --force)."""
    from npustudio.core import isolated

    asked: list[tuple[str, bool]] = []

    def fake_run(fn: Any, *args: Any, state: Any, **kw: Any) -> Any:
        asked.append((stage_asked(fn, args), fn.keywords["force"]))
        raise UserError("not run in this test", "")

    monkeypatch.setattr(isolated, "run", fake_run)
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    for page in (w.adapt_page, w.quantize_page, w.compile_page):
        assert not page.strip.redo.isHidden()
        for button in (page.strip.run, page.strip.redo):
            with qtbot.waitSignal(page.strip.finished, timeout=10_000):
                button.click()
    assert asked == [("adapt", False), ("adapt", True), ("quantize", False), ("quantize", True),
                     ("compile_and_bundle", False), ("compile_and_bundle", True)]


def test_the_cluster_switch_in_settings_sends_the_heavy_stages_to_that_cluster(qtbot: Any, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings: a wrong address is said and nothing is saved; with the switch on, adapt, quantize and compile
    are asked to run on the cluster (what the CLI's --cluster does)."""
    from npustudio.core import isolated, settings

    asked: list[tuple[str, str | None]] = []

    def fake_run(fn: Any, *args: Any, state: Any, **kw: Any) -> Any:
        c = fn.keywords["cluster"]
        asked.append((stage_asked(fn, args), c and c.address))
        raise UserError("not run in this test", "")

    monkeypatch.setattr(isolated, "run", fake_run)
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    dlg = w.open_settings()
    dlg.cluster_address.setText("my-gpu-box")
    dlg.use_cluster.setChecked(True)
    dlg.accept()
    assert "is not a Ray cluster address" in dlg.cluster_status.text() and dlg.isVisible()
    assert not settings.path().exists() or not json.loads(settings.path().read_text()).get("use_cluster")
    dlg.cluster_address.setText("10.0.0.5:6379")
    dlg.accept()
    assert json.loads(settings.path().read_text())["cluster_address"] == "10.0.0.5:6379"
    for page in (w.adapt_page, w.quantize_page, w.compile_page):
        with qtbot.waitSignal(page.strip.finished, timeout=10_000):
            page.strip.run.click()
    assert asked == [("adapt", "10.0.0.5:6379"), ("quantize", "10.0.0.5:6379"), ("compile_and_bundle", "10.0.0.5:6379")]
    w.settings.use_cluster = False  # the switch off: here again
    with qtbot.waitSignal(w.quantize_page.strip.finished, timeout=10_000):
        w.quantize_page.strip.run.click()
    assert asked[-1] == ("quantize", None)


CLOSE_WHILE_BUSY = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from npustudio.core import isolated
from npustudio.gui import worker
from tests.test_gui import busy_without_safe_points

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


def test_an_answer_in_markdown_shows_as_formatted_text_with_shaded_code(qtbot: Any) -> None:
    from npustudio.gui.chat_widgets import CODE_BACKGROUND, Bubble

    b = Bubble("model", "Model")
    qtbot.addWidget(b)
    b.resize(320, 200)
    b.append("Use **this**:\n\n```python\nx = 1\n")  # streamed: drawn within 50 ms, not per token
    b.append("```\n\nDone.")
    qtbot.waitUntil(lambda: "Done." in b.body.toPlainText(), timeout=2_000)
    shown = b.body.toPlainText()
    assert "Use this:" in shown and "**" not in shown and "```" not in shown and "x = 1" in shown
    doc = b.body.document()
    code = doc.findBlock(shown.index("x = 1"))
    assert code.blockFormat().background().color() == CODE_BACKGROUND
    assert doc.findBlock(shown.index("Done.")).blockFormat().background().style() == Qt.BrushStyle.NoBrush
    assert b.body.height() >= doc.size().height()  # the whole message shows, no scroll inside a bubble
    poem = Bubble("model", "Model", "Roses are red,\nviolets are blue.\n\n```\ncode one\ncode two\n```")
    qtbot.addWidget(poem)
    poem._draw()
    lines = poem.body.toPlainText().splitlines()  # single line breaks kept (Markdown joined them into one line)
    assert lines[:2] == ["Roses are red,", "violets are blue."] and "code one" in lines and "code two" in lines
    user = Bubble("user", "You", "**not markdown**")
    qtbot.addWidget(user)
    assert user.body.toPlainText() == "**not markdown**"  # what the user typed, as typed


def test_chat_regenerates_edits_and_keeps_several_chats_per_project(qtbot: Any, genie_project: Project,
                                                                   tmp_path: Path) -> None:
    """On the CPU preview: an answer regenerated or a message edited replaces the last turn (on screen and in
    the saved history); New chat starts another, the list picks either back, and a reopened window has both."""
    import shutil

    root = tmp_path / "proj"  # a copy: the shared project keeps no chat
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    c = w.chat
    c.runner.setCurrentIndex(c.runner.findData("preview"))
    assert c.stats.text().startswith("Ready:") and not c.regen_btn.isEnabled() and not c.edit_btn.isEnabled()

    def answer(click: Any) -> Turn:
        t0 = time.monotonic()
        with qtbot.waitSignal(c.answered, timeout=120_000) as got:
            click()
            assert not c.send_btn.isEnabled() and c.stop_btn.isEnabled() and c.stop_btn.isVisible()
        assert c.send_btn.isEnabled() and not c.stop_btn.isEnabled()
        assert "tok/s" in c.stats.text() and "rate ?" not in c.stats.text()
        turn = got.args[0]
        assert turn.wait_s is not None and 0 < turn.wait_s < time.monotonic() - t0  # the wait as the person saw it
        assert f"first words after {human_number(turn.wait_s)} s here" in c.stats.text()
        return turn

    first = answer(lambda: c.ask("Hello"))
    saved = lambda: json.loads((root / "chat_history.json").read_text())  # noqa: E731
    assert [t["user"] for t in saved()["turns"]] == ["Hello"]
    assert "decodes greedily" in c.regen_btn.toolTip()  # the CPU preview: the same messages, the same answer
    again = answer(c.regen_btn.click)
    assert again.user == "Hello" and again.at > first.at
    assert again.assistant == first.assistant and "greedy decoding gives the same text" in c.stats.text()
    assert [(t["user"], t["at"]) for t in saved()["turns"]] == [("Hello", again.at)]  # replaced, not added
    assert [b.role for b in c.transcript.bubbles] == ["user", "model"]
    assert c.transcript.bubbles[1].text == again.assistant

    c.edit_btn.click()
    assert c.input.toPlainText() == "Hello" and c.send_btn.text() == "Resend"
    c.input.setPlainText("Hi there")
    edited = answer(c.send_btn.click)
    assert [t["user"] for t in saved()["turns"]] == ["Hi there"] and c.send_btn.text() == "Send"
    assert "Hi there" in c.transcript.toPlainText() and "You: Hello" not in c.transcript.toPlainText()

    c.new_btn.click()
    assert not c.transcript.bubbles and c.chats.count() == 2 and c.stats.text().startswith("Ready:")
    answer(lambda: c.ask("Second chat"))
    assert c.chats.count() == 2 and c.chats.currentText().startswith("Second chat")
    older = next(i for i in range(c.chats.count()) if c.chats.itemText(i).startswith("Hi there"))
    c.chats.activated.emit(older)
    assert [b.text for b in c.transcript.bubbles] == ["Hi there", edited.assistant]
    assert c.stats.text().startswith("Ready:")  # not the other chat's last rate
    w.close()

    w2 = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w2)
    w2.chat.runner.setCurrentIndex(w2.chat.runner.findData("preview"))
    titles = sorted(w2.chat.chats.itemText(i) for i in range(w2.chat.chats.count()))
    assert titles == ["Hi there", "Second chat"] and w2.chat.chats.currentText().startswith("Hi there")
    follow = w2.chat
    with qtbot.waitSignal(follow.answered, timeout=120_000):
        follow.ask("And then?")  # continues the picked chat
    hist = saved()
    assert [t["user"] for t in hist["turns"]] == ["Hi there", "And then?"]
    assert [[t["user"] for t in o["turns"]] for o in hist["others"]] == [["Second chat"]]


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


def test_inspector_cell_click_graph_chooser_and_weight_histogram(qtbot: Any, genie_project: Project,
                                                                tmp_path: Path) -> None:
    """A click on a heatmap cell selects the tensor it shows (even one the filter hid); the selected weight's
    float values are drawn against its clip range; the token graph's encodings can be picked; the scale plot
    is tall enough to read."""
    import shutil

    from PySide6.QtCore import QPointF
    from safetensors.numpy import load_file

    from npustudio.core.graph import encodings

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1366, 768)
    w.show()
    w.go("Quantize")
    q = w.quantize_page
    q.tabs.setCurrentWidget(q.inspector)
    ins = q.inspector
    qtbot.waitUntil(lambda: ins.table_ is not None, timeout=60_000)
    assert [ins.graph.itemText(i) for i in range(ins.graph.count())] == \
        [f.stem for f in (root / "stages" / "quantize").glob("*.encodings") if f.stem.startswith("prompt")] + \
        [f.stem for f in (root / "stages" / "quantize").glob("*.encodings") if f.stem.startswith("token")]
    assert present(ins.table_, "encodings table").path.endswith(ins.graph.itemText(0) + ".encodings")
    ins.graph.setCurrentIndex(1)  # the token graph, as a click on the list does
    ins.graph.activated.emit(1)
    qtbot.waitUntil(lambda: present(ins.table_, "encodings table").path.endswith(ins.graph.itemText(1) + ".encodings"),
                    timeout=60_000)
    assert ins.graph.currentIndex() == 1 and ins.graph.itemText(1) in ins.title.text()

    ins.colour_by.setCurrentIndex(ins.colour_by.findData("spread"))
    qtbot.wait(200)
    assert ins.detail.height() >= 160 and ins.hist.height() >= 160
    i, j = ins.heat_roles.index("down"), 1
    want = ins.heat_names[i, j]
    ins.search.setText("embed")  # hides the cell's tensor from the table
    vb = ins.heatmap.getPlotItem().vb
    at = ins.heatmap.mapFromScene(vb.mapViewToScene(QPointF(j + 0.5, i + 0.5)))
    qtbot.mouseClick(ins.heatmap.viewport(), Qt.MouseButton.LeftButton, pos=at)
    selected = ins.selected()
    assert selected is not None and selected.name == want and "layers.1.mlp.down" in want
    assert ins.search.text() == "" and want in ins.detail_label.text()

    qtbot.waitUntil(lambda: ins.hist_data is not None, timeout=30_000)
    h = present(ins.hist_data, "weight histogram")
    row = present(ins.selected(), "selected tensor")
    stored = load_file(str(root / "stages" / "adapt" / "decoder.safetensors"))[want]
    assert h.values == h.of == stored.size  # a tiny weight is read whole
    assert list(np.histogram(stored.astype(np.float64), bins=np.asarray(h.edges))[0]) == h.counts
    assert h.clip_low < 0 < h.clip_high and h.clipped < 0.01  # int8 per channel from min/max: next to no clipping
    offsets = row.offsets if len(row.offsets) == len(row.scales) else [row.offset] * len(row.scales)
    widest = max((255 + o) * s for s, o in zip(row.scales, offsets, strict=True))  # x' = (q + offset)·scale
    assert row.bitwidth == 8 and abs(h.clip_high - widest) < 1e-6 * widest
    assert "clip range" in ins.hist_label.text()
    act = next(r.name for r in encodings.read(present(ins.table_, "encodings table").path).rows
               if r.kind == "activation")
    ins.select_tensor(act)
    assert ins.hist_data is None and "activation" in ins.hist_label.text()


def test_the_target_page_and_the_profiles_show_one_decode_roofline_for_a_built_bundle(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """They once disagreed for the same target (420.3 vs 369.2 tok/s): one estimated from the fit, the other from
    the largest binary. Both now take the bundle's token-graph binaries and its context."""
    import re
    import shutil

    import pyqtgraph as pg

    from npustudio.core.genie.meta import read_metadata

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    bundle = root / "stages" / "bundle"
    meta = read_metadata(bundle)
    w.go("Target")
    w.target_page.select(meta.target.soc)
    shown = table_dict(w.target_page.details)["Decode bound, w8a16"]
    target_figure = float(present(re.search(r"≤ ([\d.]+) tok/s", shown), "decode bound").group(1))
    assert "measured: the bundle's token graph" in shown
    assert "as built for the simulator" in shown  # not taken for a phone's weight-shared build
    assert w.profiles.roof is not None and w.profiles.roof["decode_tok_s_bound"] == target_figure
    line = next(i for i in w.profiles.rates.getPlotItem().items if isinstance(i, pg.InfiniteLine))
    assert round(10 ** line.value(), 1) == target_figure  # drawn on the rates' log axis
    assert f"{target_figure} tok/s" in line.label.textItem.toPlainText()
    token_bins = sum(f.stat().st_size for f in bundle.glob("token_*.bin"))  # what one generated token reads
    expected = meta.target.memory_gb_s * 1e9 / (token_bins + meta.decoder.kv_bytes_per_token * meta.context_length)
    assert target_figure == round(expected, 1)
    w4 = table_dict(w.target_page.details)["Decode bound, w4a16"]
    assert "estimate" in w4  # no bundle of that precision

    # issue 65: the Model page said other figures for the same bundle without saying why. It shows the Target
    # page's, for the project's target, named in its header, each saying whether it is measured or estimated
    from npustudio.gui.pages.model import DECODE, FIT_COLUMNS

    assert w.project is not None
    assert w.project.choices().target_soc == meta.target.soc
    fit, col = w.model_page.fit, FIT_COLUMNS.index(DECODE)

    def header(i: int) -> str:
        return present(fit.horizontalHeaderItem(i), f"header of column {i}").text()

    # the page leads with its answer: at 1024x700 the last columns are behind the table's own scroll
    assert [header(i) for i in range(3)] == ["Precision", "Fits", "Phone RAM needed"]
    assert header(col) == f"Decode bound ({meta.target.soc})"
    by = {item_at(fit, r, 0).text(): item_at(fit, r, col).text() for r in range(fit.rowCount())}
    assert by["w8a16"] == f"{target_figure:,.0f} tok/s (measured)"
    w4_figure = float(present(re.search(r"≤ ([\d.]+) tok/s", w4), "decode bound").group(1))
    assert by["w4a16"] == f"{w4_figure:,.0f} tok/s (estimate)"


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


def test_a_finished_stages_perplexity_windows_are_drawn_once(qtbot: Any) -> None:
    """A record's windows go into the chart together (one redraw per window took ~0.3 s when a project opened)."""
    from npustudio.gui.charts import PplChart

    chart = PplChart()
    qtbot.addWidget(chart)
    chart.extend([{"window": i, "fp_ppl": 14.0 + i, "quant_ppl": 14.5 + i, "fp_ppl_running": 14.2,
                   "quant_ppl_running": 14.6} for i in range(70)])
    assert chart.redraws == 1
    assert len(chart.series["fp"]) == len(chart.series["quant"]) == 70
    xs, ys = chart.items["quant"].getData()
    assert list(xs) == list(range(70)) and ys[-1] == 14.5 + 69
    assert "ratio quant/fp" in chart.summary.text()


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


def test_run_on_a_page_keeps_the_options_the_page_does_not_show(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """A project made outside the window (by the pipeline, as the CLI makes it) from a model folder, with options
    the pages do not show (calibration decode steps, eval sizes): Run on each stage's page finds the stage current
    and redoes nothing. The pages built their options from their own fields and the defaults, and the project did
    not remember its model, so Run on Adapt adapted the embedded default model instead."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    p = Project.open(root, create=False)
    ran = {s: done(p, s).started for s in ("adapt", "quantize", "compile", "bundle")}
    assert done(p, "quantize").options["calib_decode"] == 4  # not the default 8
    assert p.choices().model == str(genie_project.root.parent / "m")
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    for page in (w.adapt_page, w.quantize_page, w.compile_page):
        run_page(qtbot, page)
    assert {s: done(p, s).started for s in ran} == ran
    assert marks(w)[:5] == ["done"] * 5  # Deploy: whether another test deployed the shared project


def test_the_chat_is_ready_as_soon_as_compile_has_built_the_bundle(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """The chat said "No bundle yet (Compile step)." after Compile had built one, until the window was reopened:
    a finished stage redraws it with the rest of the window."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    bundle = root / "stages" / "bundle"
    bundle.rename(tmp_path / "bundle")  # as before Compile ran
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.chat.runner.setCurrentIndex(w.chat.runner.findData("preview"))
    assert w.chat.stats.text().startswith("No bundle yet")
    (tmp_path / "bundle").rename(bundle)  # what Compile leaves, then the page tells the window
    w.compile_page.changed.emit()
    assert w.chat.stats.text().startswith("Ready: This computer: CPU preview")


def test_a_deploy_during_a_chat_turn_switches_the_runner_only_after_it(qtbot: Any, genie_project: Project) -> None:
    """Issue 65: a device deployed to while the CPU preview answered switched the chat's runner combo mid-answer, so
    it named a runner that was not the one answering. The combo is locked during a turn; the switch to the device
    comes once the answer is in."""
    w = MainWindow(genie_project.root, watch_devices=False)
    qtbot.addWidget(w)
    c = w.chat
    c.runner.setCurrentIndex(c.runner.findData("preview"))
    with qtbot.waitSignal(c.answered, timeout=120_000) as got:
        c.ask("Hello")
        assert c.busy and not c.runner.isEnabled()
        c.use_device("emulator-5554")  # what the Deploy page does when its push ends
        assert c.runner.currentData() == "preview"
    assert "preview" in got.args[0].runner  # the runner named when the turn began answered it
    assert c.runner.isEnabled() and c.runner.currentIndex() == 0  # the device, now that the answer is in


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


def test_the_context_fields_stop_at_what_the_read_model_takes(qtbot: Any, tmp_path: Path) -> None:
    """Issue 65: with a model trained for 256 tokens read, Adapt still offered the default CL 1024, and its Run was
    refused with a fix naming `--cl`, which the window has not got. The context fields of Model and Adapt now stop
    at 256 and say why; a model without that limit gets the field's whole range back."""
    from npustudio.core import pipeline
    from npustudio.core import stage_options as so
    from npustudio.core.progress import State
    from npustudio.core.stage_options import AdaptOptions

    short = make_tiny_model(tmp_path / "short", "llama64", max_position_embeddings=256)
    p = Project.open(tmp_path / "proj")
    pipeline.intake(p, str(short), 1024, State())
    w = MainWindow(p.root, watch_devices=False)
    qtbot.addWidget(w)
    for box in (w.adapt_page.cl, w.model_page.cl):
        assert box.maximum() == 256 and box.value() == 256
        assert "At most 256: the model was trained for 256 tokens" in box.toolTip()
    assert w.adapt_page.options().cl == 256  # what Run would use

    longer = make_tiny_model(tmp_path / "long", "llama64", max_position_embeddings=4096)
    pipeline.intake(p, str(longer), 1024, State())
    w.refresh()
    assert w.adapt_page.cl.maximum() == min(4096, so.int_range(AdaptOptions, "cl")[1])
    assert w.adapt_page.cl.value() == 1024 and "At most 256" not in w.adapt_page.cl.toolTip()


def test_a_runner_with_nothing_to_answer_says_what_to_make_before_send(qtbot: Any, genie_project: Project) -> None:
    """Issue 65: the MNN runner of a project with a Genie bundle only let Send start, then a modal said to build
    the bundle and pick a device. The status line now says what this runner lacks and how to make it in the window,
    Send waits for it, and Enter's refusal gives the same fix."""
    w = MainWindow(genie_project.root, watch_devices=False)
    qtbot.addWidget(w)
    c = w.chat
    c.runner.setCurrentIndex(c.runner.findData("mnn"))
    assert c.stats.text().startswith("No MNN model yet. Make it on the Compile step")
    assert not c.send_btn.isEnabled()
    c.input.setPlainText("Hello")
    c.send()
    box = w.findChild(QMessageBox, "error_dialog")
    assert box is not None and box.text() == "No MNN model yet." and "Compile step" in box.informativeText()
    assert "bundle" not in box.informativeText().split("or chat")[0]  # not the Genie bundle's fix
    box.close()
    c.runner.setCurrentIndex(c.runner.findData("device"))  # no device picked here
    assert c.stats.text().startswith("No device is picked.") and not c.send_btn.isEnabled()
    c.runner.setCurrentIndex(c.runner.findData("preview"))
    assert c.stats.text().startswith("Ready:") and c.send_btn.isEnabled()


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
                       "bundle": done(p, "bundle").key, "at": 0.0})
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


def small_export(folder: Path) -> Path:
    """A graph's export without a pipeline run: an .encodings file of 72 long-named 16-bit activations (the last
    four a down projection per layer, layer 2's range ×50 wider than the others': flagged), the float ONNX graph
    that makes them and a test-vector step, as the quantize stage writes them beside each other."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from npustudio.core import layout

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"/model/layers.{k % 4}/a_rather_long_module_path/of_the_kind/real_exports_have/Conv_output_{k}"
             for k in range(68)] + [f"/layers.{i}/mlp/down/Conv_output_0" for i in range(4)]
    scales = [0.01] * 70 + [0.5, 0.01]  # layer 2's down projection (the 71st row) is the wide one
    acts = [{"name": n, "dtype": "INT", "bw": 16, "is_sym": False, "scale": [s], "offset": [-32768],
             "enc_type": "PER_TENSOR"} for n, s in zip(names, scales, strict=True)]
    f = folder / "prompt_1_of_1.encodings"
    f.write_text(json.dumps({"version": "1.0.0", "activation_encodings": acts, "param_encodings": []}))
    gains = [numpy_helper.from_array(np.full((1, 64), 1.0 + i / 10, np.float32), f"g{i}") for i in range(len(names))]
    nodes = [helper.make_node("Mul", ["x", f"g{i}"], [n]) for i, n in enumerate(names)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info(names[0], TensorProto.FLOAT, [1, 64])], gains)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
              str(f.with_suffix(".onnx")))
    (folder / layout.TEST_VECTORS).mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    vectors = {"in/x": rng.normal(size=(1, 64)).astype(np.float32)}  # numpy's stub reads **vectors as allow_pickle
    np.savez(folder / layout.TEST_VECTORS / f"{f.stem}.npz", **vectors)  # type: ignore[arg-type]
    return f


def small_table(folder: Path) -> Any:
    """`small_export`'s table with each activation's SQNR, as the inspector's read makes it (no weights here)."""
    from npustudio.core.graph import encodings, sqnr

    f = small_export(folder)
    table = encodings.read(f)
    db = sqnr.activations(f, table.rows)
    for r in table.rows:
        r.sqnr_db = db.get(r.name)
    return table


def name_at_left(view: Any, row: int) -> str | None:
    """What a person reads at the table's left edge on `row` (whichever view is drawn on top there)."""
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QTableView

    pt = view.viewport().geometry().topLeft() + QPoint(4, view.rowViewportPosition(row) + 5)
    w = view.childAt(pt)
    while w is not None and not isinstance(w, QTableView):
        w = w.parentWidget()
    assert w is not None, f"no table view at row {row}"
    idx = w.indexAt(w.viewport().mapFromGlobal(view.mapToGlobal(pt)))
    return idx.data() if idx.isValid() else None


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


def test_the_inspector_keeps_names_in_view_shows_flags_and_the_heatmaps_figures(qtbot: Any, tmp_path: Path) -> None:
    """Issue 37: the names stay at the table's left however far it is scrolled and whatever it is sorted by; the
    flags column is as wide as the flags (the flagged rows are past the first 60); a flagged activation has the
    SQNR the heatmap colours it by; an activation draws no histogram (the last weight's stayed on its axes); a
    heatmap cell's tooltip names its tensor, role, layer and figure."""
    from PySide6.QtCore import QPointF
    from PySide6.QtGui import QFontMetrics

    from npustudio.core.graph.sqnr import WeightHistogram
    from npustudio.gui.inspector import COLUMNS, Inspector

    table = small_table(tmp_path / "quantize")
    wide = table.by_name("/layers.2/mlp/down/Conv_output_0")
    assert wide.flags and "wider" in wide.flags[0] and table.rows.index(wide) > 60
    ins = Inspector()
    qtbot.addWidget(ins)
    ins.resize(800, 900)
    ins.show()
    qtbot.waitExposed(ins)
    ins.load(table)
    qtbot.wait(50)
    col = {k: i for i, (k, _) in enumerate(COLUMNS)}
    bar = ins.view.horizontalScrollBar()
    assert bar.maximum() > 0  # wider than the view: it scrolls sideways
    bar.setValue(bar.maximum())
    ins.sort_by("sqnr_db", descending=False)  # the SQNR header is at the right end
    qtbot.wait(50)
    first = ins.visible_rows()[0]
    assert first.name == wide.name  # the most damaged first: the wide range
    assert name_at_left(ins.view, 0) == first.name
    assert ins.proxy.index(0, 0).data(Qt.ItemDataRole.ToolTipRole).startswith(first.name)
    assert ins.proxy.index(1, 0).data(Qt.ItemDataRole.ToolTipRole) == ins.visible_rows()[1].name  # elided: whole

    fm = QFontMetrics(ins.view.font())
    assert ins.view.columnWidth(col["flags"]) >= fm.horizontalAdvance("; ".join(wide.flags))

    shown = ins.proxy.index(0, col["sqnr_db"]).data()
    assert shown != "—" and wide.sqnr_db is not None
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_sqnr"))
    cell = (ins.heat_roles.index("down"), 2)
    assert ins.heat_names[cell] == wide.name and shown == f"{ins.heat_grid[cell]:.4g}"

    ins.draw_histogram(WeightHistogram(counts=[1, 3, 1], edges=[-1000.0, -1, 1, 1000.0], clip_low=-1000.0,
                                       clip_high=1000.0, grid=[], clipped=0.0, values=5, of=5))
    assert ins.hist.isVisibleTo(ins)
    ins.view.selectRow(0)
    assert ins.hist_data is None and not ins.hist.isVisibleTo(ins)
    assert "activation" in ins.hist_label.text() and "no stored values" in ins.hist_label.text()

    qtbot.wait(200)  # the heatmap's view fits the new grid
    vb = ins.heatmap.getPlotItem().vb
    ins.heatmap.scene().sigMouseMoved.emit(vb.mapViewToScene(QPointF(cell[1] + 0.5, cell[0] + 0.5)))
    tip = ins.heatmap.toolTip()
    assert wide.name in tip and "down, layer 2" in tip and f"{wide.sqnr_db:.1f} dB" in tip
    ins.heatmap.scene().sigMouseMoved.emit(vb.mapViewToScene(QPointF(-5, -5)))  # off the cells: no tip
    assert ins.heatmap.toolTip() == ""

    # issue 65: a sort keeps the highlight on the tensor the detail pane shows
    ins.select_tensor(wide.name)
    assert ins.selected() == wide
    for column, descending in (("name", False), ("scale_spread", True), ("layer", True)):
        ins.sort_by(column, descending)
        assert ins.selected() == wide and ins.detail_label.text().startswith(f"{wide.name}:")
        rows = ins.view.selectionModel().selectedRows()
        assert len(rows) == 1 and ins.visible_rows()[rows[0].row()] == wide

    # the colour bar spans the data: a map of one bit width is that width, not "8 to 9"
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_bits"))
    bits = {r.bitwidth for r in table.rows if r.kind == "activation" and r.layer is not None}
    assert len(bits) == 1
    (only,) = bits
    lo, hi = ins.colorbar.levels()
    assert lo < only < hi and hi - lo == 1
    assert ins.colorbar.axis._tickLevels == [[(float(only), f"{only:g}")]]
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_sqnr"))
    assert ins.colorbar.levels() == (float(np.nanmin(ins.heat_grid)), float(np.nanmax(ins.heat_grid)))
    assert ins.colorbar.axis._tickLevels is None


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


def test_a_late_progress_message_keeps_stopping_and_a_push_states_one_rate(
        qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a progress message that arrives after Cancel (or Stop and quit) leaves "Stopping…" on the page; a
    finished push shows the same rate on the Deploy page and on the device panel's bar (49 beside 498 MB/s); the
    settings' QNN SDK, adb and MNN Android runtime fields have a Browse… button that fills them."""
    import threading

    from npustudio.core.device.deploy import DeployResult
    from npustudio.gui import settings_dialog
    from npustudio.gui.widgets import RunStrip

    strip = RunStrip()
    qtbot.addWidget(strip)
    go = threading.Event()
    job = strip.start(lambda state: go.wait(10), lambda _r: None, "Quantizing")
    # issue 65: the bar stood empty for ~25 s while the stage loaded its libraries: it is busy until the first figure
    assert strip.bar.maximum() == 0
    job.progress.emit(0.0, "loading AIMET")
    qtbot.wait(50)
    assert strip.bar.maximum() == 0 and strip.status.text() == "loading AIMET"
    strip.cancel.click()
    job.progress.emit(0.4, "Calibrating 3 of 4")  # sent before the stage reached its safe point
    qtbot.wait(50)
    assert strip.status.text().startswith("Stopping") and strip.bar.value() == 400 and strip.bar.maximum() == 1000
    with qtbot.waitSignal(job.finished, timeout=10_000):
        go.set()

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    d = w.deploy_page
    d._partial("push", {"bytes": 9_000_000, "total": 10_000_000, "rate": 498e6, "eta_s": 0.0})
    d.finish(DeployResult(device="emulator-5554", remote_dir="/data/local/tmp/x", files=[], bytes_sent=10_000_000,
                          bytes_skipped=0, seconds=0.2, rate_mb_s=49.0))
    assert "at 49 MB/s" in d.strip.status.text() and "at 49 MB/s" in w.devices.push.format()
    assert "498" not in w.devices.push.format()

    picked = {"dir": str(tmp_path / "qairt"), "file": str(tmp_path / "adb")}
    monkeypatch.setattr(settings_dialog.QFileDialog, "getExistingDirectory", lambda *a, **k: picked["dir"])
    monkeypatch.setattr(settings_dialog.QFileDialog, "getOpenFileName", lambda *a, **k: (picked["file"], ""))
    dlg = w.open_settings()
    dlg.sdk_browse.click()
    dlg.adb_browse.click()
    assert (dlg.sdk.text(), dlg.adb.text()) == (picked["dir"], picked["file"])
    dlg.reject()
    # the MNN Android runtime's folder: browsed, saved, and where the deploy looks (MNN_ANDROID_ROOT)
    from npustudio.core import settings as user_settings

    monkeypatch.setenv("MNN_ANDROID_ROOT", "")  # put back after the test: accepting the dialog sets it
    dlg = w.open_settings()
    dlg.mnn_browse.click()
    assert dlg.mnn.text() == picked["dir"]
    dlg.accept()
    assert user_settings.load().mnn_android_root == picked["dir"] == os.environ["MNN_ANDROID_ROOT"]


def test_the_pages_take_each_options_range_default_and_choices_from_core(qtbot: Any, tmp_path: Path) -> None:
    """The window declares no option of its own (gui/fields.py reads core/stage_options.py): CL had 1024 in four
    places under three ranges (the CLI's 2-131072, the Adapt page's 64-32768, the Model page's 128-32768)."""
    from npustudio.core import stage_options as so

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    q, c = w.quantize_page, w.compile_page
    for box, model, name in ((w.model_page.cl, so.AdaptOptions, "cl"), (w.adapt_page.cl, so.AdaptOptions, "cl"),
                             (w.adapt_page.ar, so.AdaptOptions, "ar"), (q.calib_samples, so.QuantizeOptions,
                             "calib_samples"), (q.calib_len, so.QuantizeOptions, "calib_len"),
                             (c.verify, so.CompileOptions, "verify_tokens")):
        assert (box.minimum(), box.maximum()) == so.int_range(model, name), name
        assert box.value() == getattr(model(), name) and box.toolTip() == model.model_fields[name].description, name
    assert w.model_page.cl.maximum() == so.MAX_CONTEXT
    assert tuple(q.precision.itemData(i) for i in range(q.precision.count())) == so.PRECISION_NAMES
    assert q.options().target == so.QuantizeOptions().target  # no target chosen yet: the field's default
    assert c.options().embedding_lut == so.CompileOptions().embedding_lut  # the table leaves the graphs by default
    c.lut.setChecked(False)
    assert not c.options().embedding_lut


def test_stop_on_this_computers_genie_says_stopping_ends_the_turn_and_quitting_asks(qtbot: Any, genie_project: Project,
                                                                                 tmp_path: Path) -> None:
    """Window III: Stop while the desktop Genie worked showed no "Stopping…" (the progress line overwrote it) and
    quitting during an answer asked nothing. Now the line says it until the turn ends, nothing of the child is left,
    and closing the window mid-answer asks first, as during a stage."""
    import multiprocessing
    import shutil
    import signal

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    c = w.chat
    c.runner.setCurrentIndex(c.runner.findData("desktop"))
    c.ask("Tell me a long story about a river.")  # fits the tiny model's 128 tokens (six times it did not)
    assert c.busy
    # Genie's child held still while the window is closed and kept: the tiny model's whole answer takes about a
    # second, and a loaded machine once spent that long drawing the question (CI: the turn had ended before Cancel)
    qtbot.waitUntil(lambda: any("run_in_child" in p.name for p in multiprocessing.active_children()), timeout=30_000)
    child = next(p for p in multiprocessing.active_children() if "run_in_child" in p.name)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGSTOP)
    try:
        w.close()  # asks first: Cancel keeps the window and the answer coming
        box = w.quit_box
        assert box is not None and box.isVisible() and "The chat's answer is still running" in box.text()
        box.button(QMessageBox.StandardButton.Cancel).click()
        qtbot.wait(300)
        assert w.isVisible() and c.busy
    finally:
        os.kill(child.pid, signal.SIGCONT)
    c.stop_btn.click()
    assert c.stats.text().startswith("Stopping…")
    qtbot.wait(700)  # the progress line ticks every 500 ms: it keeps saying so
    assert c.stats.text().startswith("Stopping…") or not c.busy
    qtbot.waitUntil(lambda: not c.busy, timeout=60_000)
    assert "stopped" in c.stats.text() and not c.stats.text().startswith(("Stopping", "processing")), c.stats.text()
    assert not [p for p in multiprocessing.active_children() if "run_in_child" in p.name]  # Genie's child is gone
    w.close()
    assert not w.isVisible()


def test_the_chat_panel_serves_its_runner_to_the_openai_client_and_stops_it(qtbot: Any, genie_project: Project,
                                                                            tmp_path: Path) -> None:
    """Serve in the chat panel starts the OpenAI-compatible endpoint for the picked runner (the CPU preview):
    the URL is shown, the copied snippet talks to it with the official client, and Stop serving (or another
    runner) closes the port."""
    import shutil
    import socket

    from openai import OpenAI

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    c = w.chat
    c.runner.setCurrentIndex(c.runner.findData("preview"))
    bar = c.serve_bar
    bar.port = 0  # any free port: the test never takes the real one
    assert bar.toggle.text() == "Serve" and not bar.copy_btn.isEnabled()
    bar.toggle.click()
    qtbot.waitUntil(lambda: bar.serving, timeout=120_000)
    url = bar.url.text()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1") and bar.toggle.text() == "Stop serving"
    bar.copy_btn.click()
    snippet = QApplication.clipboard().text()
    assert f'base_url="{url}"' in snippet and 'model="proj"' in snippet
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    got = client.chat.completions.create(model="proj", messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    assert got.choices[0].finish_reason == "length" and got.usage is not None and got.usage.completion_tokens == 3
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    c.runner.setCurrentIndex(c.runner.findData("desktop"))  # another runner: the server of the last one stops
    qtbot.waitUntil(lambda: not bar.serving and bar.toggle.text() == "Serve", timeout=30_000)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
