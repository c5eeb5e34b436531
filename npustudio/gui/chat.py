"""The chat panel: talk to the deployed model on the selected device, or to the bundle on this computer.

Messages are bubbles (the model's answers drawn from Markdown, code blocks shaded); tokens stream into the
last one as they arrive. Send and Stop stay in view; Stop always works (it sets the turn's stop event, which
every runner honours). The last answer can be regenerated and the last message edited; a project keeps several
chats, picked from the list at the top (core.chat keeps them). Tokens/s and TTFT come from Genie's profile (for
MNN, from its own calls, timed).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ..core import chat, layout, pipeline, stages
from ..core.chat import ChatSession, Turn
from ..core.errors import UserError
from ..core.genie.adapters import Choice
from ..core.genie.meta import read_metadata
from . import worker
from .chat_widgets import Bubble, ChatInput, Transcript, figures, tokens
from .serve_bar import ServeBar, Target
from .widgets import StatusLine, show_error
from .window import StudioWindow

RUNNERS = (("device", "The selected device"), ("desktop", "This computer: Genie on the HTP simulator (slow)"),
           ("preview", "This computer: CPU preview (fast, not Genie)"),
           ("mnn", "This computer: MNN (CPU), the MNN back-end's model"),
           ("mnn-device", "The selected device: MNN's llm_demo (one question a chat)"))
MNN_RUNNERS = ("mnn", "mnn-device")  # chat with the MNN stage's model rather than the Genie bundle
DEVICE_RUNNERS = ("device", "mnn-device")  # need the device picked in the device panel
class ChatPanel(QWidget):
    answered = Signal(object)  # Turn

    def __init__(self, window: StudioWindow) -> None:
        super().__init__()
        self.window_ = window
        self.session: ChatSession | None = None
        self._key: tuple[Any, ...] | None = None
        self.stop_event: threading.Event | None = None
        self.job: worker.Job | None = None
        self.editing = False  # Send replaces the last message and its answer
        self._build()
        self.send_btn.clicked.connect(self.send)
        self.input.submitted.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.copy_btn.clicked.connect(self.copy)
        self.new_btn.clicked.connect(self.new_chat)
        self.rename_btn.clicked.connect(lambda: self.rename_chat())
        self.delete_btn.clicked.connect(lambda: self.delete_chat())
        self.regen_btn.clicked.connect(self.regenerate)
        self.edit_btn.clicked.connect(self.edit_last)
        self.chats.activated.connect(lambda i: self.pick(self.chats.itemData(i)))
        self.runner.currentIndexChanged.connect(lambda _i: self.reload())
        self.adapter.currentIndexChanged.connect(lambda _i: self.reload())
        self.rename_box: QInputDialog | None = None
        self.delete_box: QMessageBox | None = None
        self.last_answer = ""
        self._answer: Bubble | None = None
        self._t0, self._pieces = 0.0, 0
        self._stopping = False  # Stop was pressed: the status line says so until the turn ends
        self._first: float | None = None  # when the first piece of the answer came
        self._regenerated: str | None = None  # the answer a Regenerate replaces, to say when it came back the same
        self._device_next = False  # a device was deployed to during a turn: the chat switches to it after
        self.greedy = False  # the runner picks the likeliest token every time (`_note_greedy`)
        self._tick = QTimer(self)  # the status line counts while Genie reads the prompt (minutes on the simulator)
        self._tick.setInterval(500)
        self._tick.timeout.connect(self._show_progress)
        self._enable()

    def _build(self) -> None:
        """The panel's widgets, top to bottom: the chat list, runner, system prompt, transcript, input, buttons."""
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 4, 6, 4)
        lay.setSpacing(4)
        top = QHBoxLayout()
        self.chats = QComboBox()
        self.chats.setToolTip("This project's chats, newest first")
        self.chats.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.chats.setMinimumContentsLength(10)
        self.new_btn = QToolButton()
        self.new_btn.setText("New")  # tool buttons: as wide as their word, the list keeps its room
        self.new_btn.setToolTip("Start a new chat; this one stays in the list")
        self.rename_btn = QToolButton()
        self.rename_btn.setText("Rename…")
        self.rename_btn.setToolTip("Give this chat a name of its own in the list")
        self.delete_btn = QToolButton()
        self.delete_btn.setText("Delete…")
        self.delete_btn.setToolTip("Forget this chat (asks first)")
        top.addWidget(self.chats, 1)
        for b in (self.new_btn, self.rename_btn, self.delete_btn):
            top.addWidget(b)
        self.runner = QComboBox()
        for k, label in RUNNERS:
            self.runner.addItem(label, k)
        self.adapter = QComboBox()  # shown for a bundle with switchable LoRA adapters: which one answers
        self.adapter.setToolTip("The bundle's LoRA adapter the model answers with (switched at run time)")
        self.adapter.hide()
        self.system = QLineEdit()
        self.system.setPlaceholderText("system prompt (optional)")
        self.transcript = Transcript()
        self.transcript.setMinimumHeight(120)  # the first thing to give up height, never the input or Send
        self.input = ChatInput()
        self.send_btn = QPushButton("Send")
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setEnabled(False)
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.setToolTip("Ask the last message again; the new answer replaces the last one")
        self.edit_btn = QPushButton("Edit last")
        self.edit_btn.setToolTip("Change the last message; Send replaces it and its answer")
        self.copy_btn = QPushButton("Copy answer")
        self.stats = StatusLine()
        lay.addLayout(top)
        lay.addWidget(self.runner)
        lay.addWidget(self.adapter)
        lay.addWidget(self.system)
        lay.addWidget(self.transcript, 1)
        lay.addWidget(self.stats)
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_btn)
        buttons.addWidget(self.stop_btn)
        buttons.addStretch(1)
        row.addLayout(buttons)
        lay.addLayout(row)
        row2 = QHBoxLayout()
        row2.addWidget(self.regen_btn)
        row2.addWidget(self.edit_btn)
        row2.addStretch(1)
        row2.addWidget(self.copy_btn)
        lay.addLayout(row2)
        self.serve_bar = ServeBar(self._serve_target)
        lay.addWidget(self.serve_bar)

    @property
    def busy(self) -> bool:
        return self.job is not None and self.job.running

    def use_device(self, serial: str) -> None:
        """Chat with the device just deployed to; a running turn keeps its runner and the switch waits for its end
        (the combo changed under a running answer, naming a runner that was not the one answering)."""
        if self.busy:
            self._device_next = True
            return
        self._device_next = False
        self.runner.setCurrentIndex(0)
        self.reload()

    def _after_turn(self) -> None:
        if self._device_next:
            self.use_device("")

    def _runner_key(self) -> tuple[Any, ...] | None:
        project = self.window_.project
        kind = self.runner.currentData()
        mnn = kind in MNN_RUNNERS
        if project is None or not (self._folder(project, kind) / (layout.MNN_RESULT if mnn else
                                                                  layout.GENIE_CONFIG)).is_file():
            return None
        dev = self.window_.device
        on_device = kind in DEVICE_RUNNERS
        if on_device and dev is None:
            return None
        return (str(project.root), kind, dev.serial if on_device and dev else None, self.adapter.currentData())

    def _serve_target(self) -> Target | None:
        """What `npustudio serve` would serve for the runner picked here (None: nothing to serve yet)."""
        key, project = self._runner_key(), self.window_.project
        if key is None or project is None:
            return None
        kind = key[1]
        return self._folder(project, kind), "mnn" if kind in MNN_RUNNERS else kind, key[2], key[3]

    @staticmethod
    def _folder(project: Any, kind: str) -> Path:
        """What the runner `kind` chats with: the MNN stage's folder, else the Genie bundle."""
        return project.stage_dir(stages.MNN.name if kind in MNN_RUNNERS else stages.BUNDLE.name)

    def _list_adapters(self) -> None:
        """The adapter list of the project's bundle, kept on the one picked while the bundle still has it; hidden
        when the bundle has none to switch (or the runner is MNN's)."""
        project, kind = self.window_.project, self.runner.currentData()
        names: list[str] = []
        if project is not None and kind not in MNN_RUNNERS:
            try:
                names = read_metadata(project.stage_dir(stages.BUNDLE.name)).lora_adapters
            except UserError:  # no bundle yet: the status line says so
                names = []
        picked = self.adapter.currentData()
        if [self.adapter.itemData(i) for i in range(1, self.adapter.count())] != names:
            with QSignalBlocker(self.adapter):
                self.adapter.clear()
                self.adapter.addItem("Base model (no LoRA adapter)", None)
                for n in names:
                    self.adapter.addItem(f"LoRA adapter: {n}", n)
                self.adapter.setCurrentIndex(max(0, self.adapter.findData(picked)) if picked in names else 0)
        self.adapter.setVisible(bool(names))

    def _history(self) -> chat.ChatHistory | None:
        project = self.window_.project
        return chat.history(project.stage_dir(stages.BUNDLE.name)) if project is not None else None

    def reload(self) -> None:
        """Show this project's chats and the current one (the session itself is made on the first message)."""
        if self.busy:
            return
        self._list_adapters()
        key = self._runner_key()
        if key != self._key:
            self.session, self._key = None, key
        if self.serve_bar.served is not None and self.serve_bar.served != self._serve_target():
            self.serve_bar.stop()  # it served another project's model, or another runner
        self._set_editing(False)
        self.stats.setText(self._ready_text(key))
        hist = self._history()
        if hist is None:
            self.transcript.clear()
            self.chats.clear()
            self._enable()
            return
        self._show_chat(hist)
        self._note_greedy(key)
        self.system.setText(hist.current.system or "")
        self.last_answer = hist.current.turns[-1].assistant if hist.current.turns else ""

    def _note_greedy(self, key: tuple[Any, ...] | None) -> None:
        """Regenerate's tooltip says when it cannot bring another answer (greedy decoding)."""
        tip = "Ask the last message again; the new answer replaces the last one"
        project = self.window_.project  # not None with a key (`_runner_key`): said for mypy
        if key is not None and project is not None and key[1] == "mnn-device":  # as the phone's config.json says
            self.greedy = chat.mnn_samples_greedily(project.stage_dir(stages.MNN.name))
        else:
            self.greedy = key is not None and project is not None and chat.samples_greedily(
                project.stage_dir(stages.BUNDLE.name), key[1] in ("preview", "mnn"))  # the CPU preview and MNN: greedy
        if self.greedy:
            tip += (". This runner decodes greedily (the likeliest token every time): the same messages bring the "
                    "same answer; edit the message for another one")
        self.regen_btn.setToolTip(tip)

    def _missing(self) -> tuple[str, str]:
        """What the picked runner lacks, and how to get it in this window (its status line and Send's refusal)."""
        kind = self.runner.currentData()
        if self.window_.project is None:
            return "No project is open.", "Open or create one (File menu)."
        if kind in DEVICE_RUNNERS and self.window_.device is None:
            return "No device is picked.", "Pick a device in the device panel, or choose a runner on this computer."
        if kind in MNN_RUNNERS:
            return ("No MNN model yet.", "Make it on the Compile step with \"MNN for a phone's CPU or GPU\", or chat "
                    "with the Genie bundle (another runner).")
        return "No bundle yet.", "Build it on the Compile step."

    def _ready_text(self, key: tuple[Any, ...] | None) -> str:
        if key is None:
            problem, fix = self._missing()
            return f"{problem} {fix}"
        return f"Ready: {self.runner.currentText()}" + (f" ({key[2]})" if key[2] else "") + "."

    def _enable(self) -> None:
        """Buttons follow what can be done now: nothing but Stop while an answer comes."""
        busy = self.busy
        has_turn = bool(self.transcript.bubbles)
        self.send_btn.setEnabled(not busy and self._runner_key() is not None)  # the status line says what lacks
        self.stop_btn.setEnabled(busy)
        for b in (self.new_btn, self.chats, self.rename_btn, self.delete_btn):
            b.setEnabled(not busy and self.window_.project is not None)
        self.regen_btn.setEnabled(not busy and has_turn)
        self.edit_btn.setEnabled(not busy and has_turn)
        self.runner.setEnabled(not busy)  # the runner answering stays the one named
        self.adapter.setEnabled(not busy)

    def ask(self, text: str) -> None:
        self.input.setPlainText(text)
        self.send()

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.busy:
            return
        self._start(text, replace_last=self.editing)

    def regenerate(self) -> None:
        """The last message asked again; its answer is replaced when the new one is in."""
        turns = self._turns()
        if turns and not self.busy:
            self._start(turns[-1].user, replace_last=True)
            self._regenerated = turns[-1].assistant

    def edit_last(self) -> None:
        """The last message into the input box (again: back to a new message)."""
        turns = self._turns()
        if self.editing or not turns:
            self._set_editing(False)
            self.input.clear()
            return
        self.input.setPlainText(turns[-1].user)
        self.input.setFocus()
        self._set_editing(True)

    def _set_editing(self, on: bool) -> None:
        self.editing = on
        self.send_btn.setText("Resend" if on else "Send")
        self.edit_btn.setText("Cancel edit" if on else "Edit last")
        if on:
            self.stats.setText("Editing your last message: Resend replaces it and its answer.")

    def _turns(self) -> list[Turn]:
        if self.session is not None:
            return self.session.turns
        hist = self._history()
        return hist.current.turns if hist is not None else []

    def _start(self, text: str, replace_last: bool) -> None:
        key, project = self._runner_key(), self.window_.project  # a key: a project (said for mypy)
        if key is None or project is None:
            show_error(self, *self._missing())
            return
        if key != self._key:
            self.session, self._key = None, key
        kind, serial, adapter = key[1], key[2], key[3]
        bundle, system = self._folder(project, kind), self.system.text().strip() or None
        self.window_.chat_dock.raise_()  # the answer is to be seen (the device panel shares its place)
        self.stop_event = threading.Event()
        stop = self.stop_event
        self.input.clear()
        self._set_editing(False)
        if replace_last:  # the last message and its answer give way to the new ones
            for b in self.transcript.bubbles[-2:]:
                b.hide()
        elif kind == "mnn-device":  # llm_demo keeps no conversation: each question is a chat of its own
            self.transcript.clear()
        self.transcript.add("user", "You", text)
        self._answer = self.transcript.add("model", "Model: answering…")
        self._t0, self._pieces, self._first, self._regenerated = time.monotonic(), 0, None, None
        self._stopping = False
        self._tick.start()
        self._show_progress()
        self.window_.devices.log(f"> {text}")
        self.window_.devices.log("")  # the answer streams into a line of its own
        session = self.session
        level = self.window_.devices.genie_level()

        def work(state: Any) -> tuple[ChatSession, Turn]:
            nonlocal session
            if session is None:  # Genie away from the window; MNN's model on this computer or on the device
                session = pipeline.open_chat(bundle, "mnn" if kind in MNN_RUNNERS else kind, serial, system,
                                             apart=True, lora=Choice(name=adapter))
            session.system = system
            if session.engine.one_question and session.turns and not replace_last:
                session.clear()  # a new chat for this question; the earlier ones stay in the list
            turn = session.send(text, lambda s: state.partial("text", text=s), stop, replace_last=replace_last,
                                on_log=lambda line: state.partial("log", line=line), log_level=level)
            return session, turn

        self.job = worker.start(work, "Chat", partial=self._piece, done=self._done, failed=self._failed,
                                cancelled=self._cancelled)
        self._enable()

    def _show_progress(self) -> None:
        """While an answer comes: the seconds spent on the prompt, then the pieces so far and their rate."""
        now = time.monotonic()
        if self._stopping:
            self.stats.setText(f"Stopping… ({tokens(self._pieces)} kept)")
        elif self._first is None:
            self.stats.setText(f"processing the prompt… {now - self._t0:.0f} s")
        else:
            self.stats.setText(f"answering: {tokens(self._pieces)} so far, {now - self._t0:.0f} s (the rate and TTFT "
                               "follow from the runner's own figures)")

    def _piece(self, kind: str, data: dict) -> None:
        if kind == "log":  # Genie's own log: to the device console, never into the answer
            self.window_.devices.genie_log(data["line"])
            return
        if kind != "text":
            return
        self._pieces += 1
        if self._first is None:
            self._first = time.monotonic()
        self._show_progress()
        if self._answer is not None:
            self._answer.append(data["text"])
        self.window_.devices.stream(data["text"])

    def _end_turn(self) -> None:
        self._tick.stop()
        self.window_.devices.stream("\n")

    def _done(self, result: tuple[ChatSession, Turn]) -> None:
        self.session, turn = result
        self.last_answer = turn.assistant
        self._end_turn()
        shown = figures(turn)
        if turn.stopped:  # what is known of a stopped answer: its tokens so far, and the profile's figures if any
            shown = f"stopped after {tokens(self._pieces)}" + (f"; {shown}" if shown else "")
        elif not shown:
            shown = f"{tokens(self._pieces)} (no profile from this runner)"
        if self._regenerated is not None and turn.assistant == self._regenerated and not turn.stopped:
            shown += (". The same answer: greedy decoding gives the same text for the same messages" if self.greedy
                      else ". The same answer as before")
        self._regenerated = None
        self.stats.setText(f"{turn.runner}: {shown}")
        if self.session.last_profile:
            self.window_.profiles.add_json(f"chat {len(self.session.turns)} ({turn.runner})", self.session.last_profile)
        self._show_chat(self.session.history)
        self._after_turn()
        self.answered.emit(turn)

    def _show_chat(self, hist: chat.ChatHistory) -> None:
        """Redraw from the saved chat: what is on screen is what was kept (a replaced answer is gone)."""
        self.transcript.clear()
        self.chats.clear()
        for c in hist.listed():
            self.chats.addItem(c.title, c.id)
            self.chats.setItemData(self.chats.count() - 1, f"{datetime.fromtimestamp(c.created):%d %b %Y %H:%M}, "
                                   f"{len(c.turns)} message(s)", Qt.ItemDataRole.ToolTipRole)
        self.chats.setCurrentIndex(self.chats.findData(hist.current_id))
        for t in hist.current.turns:
            self.transcript.show_turn(t)
        self._answer = None
        self._enable()
        if note := hist.notice():
            self.stats.setText(note)

    def _failed(self, problem: str, fix: str) -> None:
        self._end_turn()
        self._redraw()
        self.stats.setText(f"Failed: {problem}")
        show_error(self, problem, fix)
        self._after_turn()

    def _cancelled(self) -> None:
        """Stopped before an answer began (while the bundle was being deployed, say)."""
        self._end_turn()
        self._redraw()
        self.stats.setText("Stopped before the answer began.")
        self._after_turn()

    def _redraw(self) -> None:
        hist = self.session.history if self.session is not None else self._history()
        if hist is not None:
            self._show_chat(hist)
        else:
            self._enable()

    def stop(self) -> None:
        if self.stop_event is not None:
            self.stop_event.set()
        if self.job is not None:
            self.job.cancel()
        if self.busy:
            self._stopping = True
            self._show_progress()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.last_answer)

    def pick(self, chat_id: str) -> None:
        """Show another of this project's chats; the next message continues it."""
        hist = self._history()
        if self.busy or hist is None or chat_id is None:
            return
        try:
            hist.pick(chat_id)
            hist.save()
        except UserError as e:
            show_error(self, e.problem, e.fix)
        self._after_history_change()

    def new_chat(self) -> None:
        """A new, empty chat; the one on screen stays in the list."""
        hist = self._history()
        if self.busy or hist is None:
            return
        hist.new()
        hist.save()
        self._after_history_change()

    def rename_chat(self, name: str | None = None) -> None:
        """Name the chat on screen; without `name`, ask for it (a window-modal box: the event loop runs on)."""
        hist = self._history()
        if self.busy or hist is None:
            return
        if name is None:
            box = QInputDialog(self)
            box.setWindowTitle("Rename the chat")
            box.setLabelText("Name in the chat list (empty: its first question):")
            box.setTextValue(hist.current.title if hist.current.name else "")
            box.textValueSelected.connect(self.rename_chat)
            box.open()
            self.rename_box = box
            return
        try:
            hist.rename(hist.current_id, name)
            hist.save()
        except UserError as e:
            show_error(self, e.problem, e.fix)
        self._after_history_change()

    def delete_chat(self, confirmed: bool = False) -> None:
        """Forget the chat on screen once the person says so; the newest other chat is shown instead."""
        hist = self._history()
        if self.busy or hist is None:
            return
        if not confirmed:
            box = QMessageBox(QMessageBox.Icon.Question, "Delete the chat",
                              f"Delete the chat “{hist.current.title}” and its {len(hist.current.turns)} "
                              "message(s)? This cannot be undone.", QMessageBox.StandardButton.Cancel, self)
            box.addButton("Delete", QMessageBox.ButtonRole.DestructiveRole).clicked.connect(
                lambda: self.delete_chat(confirmed=True))
            box.open()
            self.delete_box = box
            return
        try:
            hist.delete(hist.current_id)
            hist.save()
        except UserError as e:
            show_error(self, e.problem, e.fix)
        self._after_history_change()

    def _after_history_change(self) -> None:
        if self.session is not None:
            self.session.reload()
        self.reload()
