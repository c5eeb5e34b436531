"""The chat panel: its status line and input, the answer's figures, chats renamed, deleted, regenerated and edited,
Markdown bubbles, the runners and what each needs, Stop and quitting mid-answer, and the Serve bar's endpoint."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, cast

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QMessageBox

from npustudio.core.chat import Turn
from npustudio.core.project import Project
from npustudio.display import human_number
from npustudio.gui.app import MainWindow


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
