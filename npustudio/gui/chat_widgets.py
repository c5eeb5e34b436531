"""The chat panel's widgets: message bubbles drawn from Markdown (code blocks shaded), the transcript that scrolls
to the newest, the input box (Enter sends, Shift+Enter breaks the line) and each answer's header of figures."""

from __future__ import annotations

from PySide6.QtCore import QSizeF, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QKeyEvent, QTextCursor, QTextFormat, QWheelEvent
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QPlainTextEdit,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from ..core.chat import Turn
from ..display import human_number

CODE_BACKGROUND = QColor("#eef0f3")
BUBBLE = {"user": "background: #dbeafe", "model": "background: #ffffff; border: 1px solid #d8dce2"}


class _Body(QTextBrowser):
    """A message's text, as tall as its content: the transcript scrolls, not each bubble."""

    def __init__(self) -> None:
        super().__init__()
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setOpenExternalLinks(True)
        self.setStyleSheet("background: transparent")
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit(self.document().size())

    def _fit(self, size: QSizeF) -> None:
        self.setFixedHeight(int(size.height()) + 4)

    def wheelEvent(self, e: QWheelEvent) -> None:  # the transcript scrolls, not the bubble
        e.ignore()


class Bubble(QFrame):
    """One message: who said it (with the answer's rate), then its text."""

    def __init__(self, role: str, header: str, text: str = "") -> None:
        super().__init__()
        self.role, self.text = role, text
        self.setObjectName("bubble")
        self.setStyleSheet(f"#bubble {{ {BUBBLE[role]}; border-radius: 8px }}")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 4, 8, 6)
        lay.setSpacing(0)
        self.header = QLabel(header)
        self.header.setStyleSheet("color: #555; font-size: 8pt")
        self.body = _Body()
        lay.addWidget(self.header)
        lay.addWidget(self.body)
        self._render = QTimer(self)  # tokens come faster than a redraw is worth: at most every 50 ms
        self._render.setSingleShot(True)
        self._render.setInterval(50)
        self._render.timeout.connect(self._draw)
        self._draw()

    def append(self, piece: str) -> None:
        self.text += piece
        if not self._render.isActive():
            self._render.start()

    def _draw(self) -> None:
        if self.role == "user":
            self.body.setPlainText(self.text)
            return
        self.body.setMarkdown(hard_breaks(self.text))
        shade_code(self.body)

    def plain(self) -> str:
        return f"{self.header.text()}: {self.text}"


def hard_breaks(markdown: str) -> str:
    """Every line break of an answer kept as a break: Markdown joins lines that a single newline separates into
    one paragraph, and a model's short lines (a poem, steps, an address) ran together. Code blocks are left as
    they are (their lines are kept anyway, and a trailing backslash would show in them)."""
    out, fence = [], ""
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        mark = line.lstrip()[:3]
        if mark in ("```", "~~~") and (not fence or mark == fence):
            fence = "" if fence else mark
        elif not fence and line.strip() and i + 1 < len(lines) and lines[i + 1].strip():
            line = line.rstrip() + "  "  # Markdown's hard line break
        out.append(line)
    return "\n".join(out)


class ChatInput(QPlainTextEdit):
    """The message box: several lines; Enter sends (`submitted`), Shift+Enter starts a new line."""

    submitted = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.setPlaceholderText("Ask something… (Enter sends, Shift+Enter: a new line)")
        self.setTabChangesFocus(True)
        lines = 3
        self.setFixedHeight(self.fontMetrics().lineSpacing() * lines + 2 * int(self.document().documentMargin())
                            + 2 * self.frameWidth() + 2)

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            e.accept()
            return
        super().keyPressEvent(e)


def shade_code(view: QTextBrowser) -> None:
    """Code blocks of rendered Markdown on a grey ground, wrapped to the bubble (a narrow dock)."""
    doc = view.document()
    block = doc.begin()
    cur = QTextCursor(doc)
    while block.isValid():
        fmt = block.blockFormat()
        if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
            fmt.setBackground(CODE_BACKGROUND)
            fmt.setNonBreakableLines(False)
            cur.setPosition(block.position())
            cur.setBlockFormat(fmt)
        block = block.next()


class Transcript(QScrollArea):
    """The chat's messages, newest at the bottom; follows a streaming answer while the view is at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        inner = QWidget()
        self.lay = QVBoxLayout(inner)
        self.lay.setContentsMargins(4, 4, 4, 4)
        self.lay.setSpacing(6)
        self.lay.addStretch(1)
        self.setWidget(inner)
        self.bubbles: list[Bubble] = []
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self._at_end = True
        self.verticalScrollBar().valueChanged.connect(
            lambda v: setattr(self, "_at_end", v >= self.verticalScrollBar().maximum() - 4))

    def clear(self) -> None:
        for b in self.bubbles:
            self.lay.removeWidget(b)
            b.deleteLater()
        self.bubbles = []
        self._at_end = True

    def add(self, role: str, header: str, text: str = "") -> Bubble:
        b = Bubble(role, header, text)
        self.lay.addWidget(b)
        self.bubbles.append(b)
        return b

    def show_turn(self, t: Turn) -> None:
        self.add("user", "You", t.user)
        self.add("model", answer_header(t), t.assistant)

    def _follow(self, _lo: int, hi: int) -> None:
        if self._at_end:
            self.verticalScrollBar().setValue(hi)

    def toPlainText(self) -> str:  # the name QPlainTextEdit had: every message
        return "\n".join(b.plain() for b in self.bubbles)


def figures(t: Turn) -> str:
    """What the runner measured for an answer (Genie's profile, MNN's calls timed: the only source of figures: the
    window's own clock counted the model's loading into a "first token after" that disagreed with the profile's
    TTFT), worded alike in the status line and the answer's header; "" when there are none (an answer stopped
    early)."""
    parts = [f"{human_number(t.generation_tok_s)} tok/s"] if t.generation_tok_s else []
    if t.tokens_per_call is not None:
        parts.append(f"{human_number(t.tokens_per_call)} tokens per call")
    if t.ttft_s is not None:
        parts.append(f"TTFT {human_number(t.ttft_s)} s (the runner's)")
    if t.wait_s is not None:
        parts.append(f"first words after {human_number(t.wait_s)} s here (with loading)")
    return ", ".join(parts)


def tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def answer_header(t: Turn) -> str:
    shown = figures(t)
    return f"Model ({t.runner})" + (f" · {shown}" if shown else "") + (" · stopped" if t.stopped else "")
