"""The chat panel: talk to the deployed model on the selected device, or to the bundle on this computer.

Tokens stream in as they arrive; Stop always works (it sets the turn's stop event, which every runner
honours); tokens/s and TTFT come from Genie's profile; history is saved per project by core.chat.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ..core import layout, pipeline
from ..core.chat import ChatSession, Turn, clear_history, saved_turns
from . import worker
from .widgets import show_error, status_label

RUNNERS = (("device", "The selected device"), ("desktop", "This computer: Genie on the HTP simulator (slow)"),
           ("preview", "This computer: CPU preview (fast, not Genie)"))


class ChatPanel(QWidget):
    answered = Signal(object)  # Turn

    def __init__(self, window: Any) -> None:
        super().__init__()
        self.window_ = window
        self.session: ChatSession | None = None
        self._key: tuple[Any, ...] | None = None
        self.stop_event: threading.Event | None = None
        self.job: worker.Job | None = None
        lay = QVBoxLayout(self)
        self.runner = QComboBox()
        for k, label in RUNNERS:
            self.runner.addItem(label, k)
        self.system = QLineEdit()
        self.system.setPlaceholderText("system prompt (optional)")
        self.transcript = QPlainTextEdit()
        self.transcript.setReadOnly(True)
        self.input = QLineEdit()
        self.input.setPlaceholderText("Ask something…")
        self.send_btn = QPushButton("Send")
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setEnabled(False)
        self.copy_btn = QPushButton("Copy answer")
        self.new_btn = QPushButton("New chat")
        self.stats = status_label()
        lay.addWidget(self.runner)
        lay.addWidget(self.system)
        lay.addWidget(self.transcript, 1)
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.send_btn)
        row.addWidget(self.stop_btn)
        lay.addLayout(row)
        row2 = QHBoxLayout()
        row2.addStretch(1)
        row2.addWidget(self.copy_btn)
        row2.addWidget(self.new_btn)
        lay.addLayout(row2)
        lay.addWidget(self.stats)
        self.send_btn.clicked.connect(self.send)
        self.input.returnPressed.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.copy_btn.clicked.connect(self.copy)
        self.new_btn.clicked.connect(self.new_chat)
        self.runner.currentIndexChanged.connect(lambda _i: self.reload())
        self.last_answer = ""
        self._t0, self._pieces = 0.0, 0
        self._first: float | None = None  # when the first piece of the answer came
        self._tick = QTimer(self)  # the status line counts while Genie reads the prompt (minutes on the simulator)
        self._tick.setInterval(500)
        self._tick.timeout.connect(self._show_progress)

    @property
    def busy(self) -> bool:
        return self.job is not None and self.job.running

    def use_device(self, serial: str) -> None:
        self.runner.setCurrentIndex(0)
        self.reload()

    def _runner_key(self) -> tuple[Any, ...] | None:
        project = self.window_.project
        if project is None or not (project.stage_dir("bundle") / layout.GENIE_CONFIG).is_file():
            return None
        kind = self.runner.currentData()
        dev = self.window_.device
        if kind == "device" and dev is None:
            return None
        return (str(project.root), kind, dev.serial if kind == "device" and dev else None)

    def reload(self) -> None:
        """Show the saved history of this project (the session itself is made on the first message)."""
        if self.busy:
            return
        key = self._runner_key()
        if key != self._key:
            self.session, self._key = None, key
        self.transcript.clear()
        project = self.window_.project
        if project is None:
            return
        for t in saved_turns(project.stage_dir("bundle")):
            self._show_turn(t)
        if key is None:
            self.stats.setText("No bundle yet (Compile step)." if self.runner.currentData() != "device"
                               or self.window_.device else "Pick a device in the device panel.")
        else:
            self.stats.setText(f"Ready: {self.runner.currentText()}"
                               + (f" ({key[2]})" if key[2] else "") + ".")

    def _show_turn(self, t: Turn) -> None:
        self.transcript.appendPlainText(f"You: {t.user}")
        self.transcript.appendPlainText(f"Model ({t.runner}): {t.assistant}" + (" [stopped]" if t.stopped else ""))
        self.transcript.appendPlainText("")

    def ask(self, text: str) -> None:
        self.input.setText(text)
        self.send()

    def send(self) -> None:
        text = self.input.text().strip()
        if not text or self.busy:
            return
        key = self._runner_key()
        if key is None:
            show_error(self, "There is nothing to chat with yet.",
                       "Build the bundle (Compile step) and pick a device, or choose 'This computer'.")
            return
        if key != self._key:
            self.session, self._key = None, key
        project, kind, serial = self.window_.project, key[1], key[2]
        bundle, system = project.stage_dir("bundle"), self.system.text().strip() or None
        self.stop_event = threading.Event()
        stop = self.stop_event
        self.input.clear()
        self.transcript.appendPlainText(f"You: {text}")
        self.transcript.appendPlainText("Model: ")
        self.send_btn.setEnabled(False)
        self.stop_btn.setEnabled(True)
        self._t0, self._pieces, self._first = time.monotonic(), 0, None
        self._tick.start()
        self._show_progress()
        self.window_.devices.log(f"> {text}")
        self.window_.devices.log("")  # the answer streams into a line of its own
        session = self.session

        def work(state: Any) -> tuple[ChatSession, Turn]:
            nonlocal session
            if session is None:
                session = pipeline.open_chat(bundle, kind, serial, system)
            session.system = system
            turn = session.send(text, lambda s: state.partial("text", text=s), stop)
            return session, turn

        self.job = worker.start(work, "Chat", partial=self._piece, done=self._done, failed=self._failed)

    def _show_progress(self) -> None:
        """While an answer comes: the seconds spent on the prompt, then the pieces so far and their rate."""
        now = time.monotonic()
        if self._first is None:
            self.stats.setText(f"processing the prompt… {now - self._t0:.0f} s")
        else:
            rate = (self._pieces - 1) / (now - self._first) if self._pieces > 1 and now > self._first else 0.0
            self.stats.setText(f"answering: {self._pieces} tokens, {rate:.1f} tok/s (first after "
                               f"{self._first - self._t0:.1f} s)")

    def _piece(self, kind: str, data: dict) -> None:
        if kind != "text":
            return
        self._pieces += 1
        if self._first is None:
            self._first = time.monotonic()
        self._show_progress()
        cur = self.transcript.textCursor()
        cur.movePosition(cur.MoveOperation.End)
        cur.insertText(data["text"])
        self.transcript.setTextCursor(cur)
        self.transcript.ensureCursorVisible()
        self.window_.devices.stream(data["text"])

    def _end_turn(self) -> None:
        self._tick.stop()
        self.transcript.appendPlainText("")
        self.send_btn.setEnabled(True)
        self.stop_btn.setEnabled(False)
        self.window_.devices.stream("\n")

    def _done(self, result: tuple[ChatSession, Turn]) -> None:
        self.session, turn = result
        self.last_answer = turn.assistant
        self._end_turn()
        rate = f"{turn.generation_tok_s:.2f} tok/s" if turn.generation_tok_s else "rate ?"
        ttft = f"TTFT {turn.ttft_s:.2f} s" if turn.ttft_s is not None else ""
        self.stats.setText(f"{turn.runner}: {rate} {ttft}" + (" (stopped)" if turn.stopped else ""))
        if self.session.last_profile:
            self.window_.profiles.add_json(f"chat {len(self.session.turns)} ({turn.runner})", self.session.last_profile)
        self.answered.emit(turn)

    def _failed(self, problem: str, fix: str) -> None:
        self._end_turn()
        self.stats.setText(f"Failed: {problem}")
        show_error(self, problem, fix)

    def stop(self) -> None:
        if self.stop_event is not None:
            self.stop_event.set()
        if self.job is not None:
            self.job.cancel()
        self.stats.setText("stopping…")

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.last_answer)

    def new_chat(self) -> None:
        if self.busy:
            return
        project = self.window_.project
        if project is None:
            return
        clear_history(project.stage_dir("bundle"))
        if self.session is not None:
            self.session.turns = []
        self.transcript.clear()
        self.last_answer = ""
