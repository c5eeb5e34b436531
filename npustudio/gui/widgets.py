"""Pieces every page shares: the Run/Cancel/progress strip, read-only tables, the error dialog."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPaintEvent
from PySide6.QtWidgets import (
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from ..core.errors import UserError
from . import worker
from .window import StudioWindow

if TYPE_CHECKING:
    from ..core.project import Project
    from ..core.stages import O, R, StageSpec

T = TypeVar("T")
GOOD, BAD, WARN = QColor("#d7f5dd"), QColor("#f8d7da"), QColor("#fff3cd")


def show_error(parent: QWidget, problem: str, fix: str) -> QMessageBox:
    """The core's plain explanation and fix, in a window-modal box that does not block the event loop."""
    box = QMessageBox(QMessageBox.Icon.Warning, "NPU Studio", problem, QMessageBox.StandardButton.Ok, parent)
    box.setObjectName("error_dialog")
    if fix:
        box.setInformativeText(f"How to fix it: {fix}")
    box.open()
    return box


def status_label(text: str = "") -> QLabel:
    """A line of status text that wraps and never widens its panel (a long message grew the window off-screen)."""
    label = QLabel(text)
    label.setWordWrap(True)
    label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
    label.setMinimumWidth(120)
    return label


class StatusLine(QLabel):
    """One line of status that keeps its height: a long message is elided (whole in the tooltip) instead of
    wrapping, so what sits below it (the chat's input box) never moves while an answer's figures change."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(120)
        self.setFixedHeight(self.fontMetrics().height() + 4)

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(text)

    def paintEvent(self, _e: QPaintEvent) -> None:
        painter = QPainter(self)
        shown = self.fontMetrics().elidedText(" ".join(self.text().split()), Qt.TextElideMode.ElideRight,
                                              self.contentsRect().width())
        painter.drawText(self.contentsRect(), int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter), shown)


def with_note(button: QWidget, note: str) -> QWidget:
    """A check box or radio button with a short name and its explanation wrapped below it (Qt's buttons do not
    wrap, and a sentence-long one set the window's minimum width)."""
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(0, 0, 0, 0)
    lay.setSpacing(0)
    lay.addWidget(button)
    text = status_label(note)
    text.setStyleSheet("color: palette(mid); margin-left: 22px")
    lay.addWidget(text)
    return box


def scrolled(page: QWidget, across: bool = True) -> QScrollArea:
    """A page in a scroll area: its content sets no minimum width for the window (1366×768 screens). With
    `across` False it scrolls up and down only: it keeps its content's width and gives up only its height (a
    side panel that must leave room for a dock below it)."""
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    area.setWidget(page)
    if not across:
        area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        area.setMinimumWidth(page.minimumSizeHint().width() + area.verticalScrollBar().sizeHint().width())
    return area


def table(headers: Sequence[str], stretch_last: bool = True) -> QTableWidget:
    t = QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(list(headers))
    t.horizontalHeader().setStretchLastSection(stretch_last)
    t.verticalHeader().setVisible(False)
    t.verticalHeader().setDefaultSectionSize(22)
    t.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    t.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
    return t


class TabsSizedToShown(QTabWidget):
    """Tabs as tall as the one shown: a QTabWidget is as tall as its tallest tab, so in a scrolling page the
    encodings inspector's heatmap and table made the perplexity tab ~1,250 px tall, its chart's axis out of view."""

    def __init__(self) -> None:
        super().__init__()
        self.currentChanged.connect(lambda _i: self.updateGeometry())

    def _with_bar(self, inner: QSize) -> QSize:
        bar = self.tabBar().sizeHint()
        return QSize(max(inner.width(), bar.width()), inner.height() + bar.height() + 4)

    def sizeHint(self) -> QSize:
        w = self.currentWidget()
        return super().sizeHint() if w is None else self._with_bar(w.sizeHint())

    def minimumSizeHint(self) -> QSize:
        w = self.currentWidget()
        return super().minimumSizeHint() if w is None else self._with_bar(w.minimumSizeHint())


def fill(t: QTableWidget, rows: Sequence[Sequence[Any]], colours: Sequence[QColor | None] | None = None) -> None:
    t.setRowCount(len(rows))
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            item = QTableWidgetItem("—" if v is None else str(v))
            if len(item.text()) > 24:  # a long name may be shortened to fit its column: whole on hover
                item.setToolTip(item.text())
            colour = colours[i] if colours else None
            if colour is not None:
                item.setBackground(colour)
            t.setItem(i, j, item)
    t.resizeColumnsToContents()
    t.horizontalHeader().setStretchLastSection(True)


def fit_rows(t: QTableWidget) -> None:
    """A short property table as tall as its rows, long values wrapped: read whole, with no scrollbar either way
    (a maximum height left the device's properties two rows and both scrollbars). Call it after each `fill`; it
    follows the table's width by itself once called."""
    head = t.horizontalHeader()
    if not t.property("fits_rows"):
        t.setProperty("fits_rows", True)
        t.setWordWrap(True)
        t.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        t.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        t.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        head.sectionResized.connect(lambda *_: fit_rows(t))
    head.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
    head.setStretchLastSection(True)
    t.resizeRowsToContents()
    t.setFixedHeight(head.height() + sum(t.rowHeight(r) for r in range(t.rowCount())) + 2 * t.frameWidth())


def cells(t: QTableWidget) -> list[list[str]]:
    """What a person reads in a table (tests assert on it)."""
    return [[item.text() if (item := t.item(r, c)) else "" for c in range(t.columnCount())]
            for r in range(t.rowCount())]


class RunStrip(QWidget):
    """Run, Redo and Cancel buttons, a progress bar and a status line, wired to one `worker.Job` at a time.

    Run skips a stage whose inputs and options are unchanged; Redo (shown when a page asks for it) runs it
    again anyway, as the CLI's --force does."""

    finished = Signal(bool)  # True when the job succeeded

    def __init__(self, label: str = "Run", redo: bool = False) -> None:
        super().__init__()
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.run = QPushButton(label)
        self.redo = QPushButton("Redo")
        self.redo.setToolTip("Run the stage again even though its inputs and options are unchanged")
        self.redo.setVisible(redo)
        self.cancel = QPushButton("Cancel")
        self.cancel.setEnabled(False)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setTextVisible(False)
        self.status = status_label()
        lay.addWidget(self.run)
        lay.addWidget(self.redo)
        lay.addWidget(self.cancel)
        lay.addWidget(self.bar, 1)
        self.job: worker.Job | None = None
        self.cancel.clicked.connect(self._cancel)

    def start(self, fn: Callable[[Any], Any], on_done: Callable[[Any], None], name: str,
              on_partial: Callable[[str, dict], None] | None = None) -> worker.Job:
        self.run.setEnabled(False)
        self.redo.setEnabled(False)
        self.cancel.setEnabled(True)
        self.bar.setRange(0, 0)  # busy until the stage says how far it is: its libraries alone load for ~25 s
        self.status.setText(f"{name}…")
        self._on_done = on_done
        slots: dict[str, Any] = {"progress": self._progress, "done": self._done, "failed": self._failed,
                                 "cancelled": self._cancelled}
        if on_partial:
            slots["partial"] = on_partial
        self.job = worker.start(fn, name, **slots)
        return self.job

    @property
    def busy(self) -> bool:
        return self.job is not None and self.job.running

    def _cancel(self) -> None:
        if self.job:
            self.job.cancel()
            self.cancel.setEnabled(False)
            self.status.setText("Stopping at the next safe point…")

    def _progress(self, fraction: float, message: str) -> None:
        """The bar and the stage's message; once Cancel (or Stop and quit) is pressed, "Stopping…" stays: a message
        the stage sent before it reached its safe point arrived after it and overwrote it."""
        if fraction > 0 or self.bar.maximum():
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(fraction * 1000))
        if message and not (self.job is not None and self.job.state.cancelled):
            self.status.setText(message)

    def _reset(self) -> None:
        self.bar.setRange(0, 1000)
        self.run.setEnabled(True)
        self.redo.setEnabled(True)
        self.cancel.setEnabled(False)
        self.job = None

    def _done(self, result: Any) -> None:
        self.bar.setValue(1000)
        self._reset()
        self._on_done(result)
        self.finished.emit(True)

    def _failed(self, problem: str, fix: str) -> None:
        self._reset()
        self.status.setText(f"Failed: {problem}")
        show_error(self, problem, fix)
        self.finished.emit(False)

    def _cancelled(self) -> None:
        self._reset()
        self.bar.setValue(0)
        self.status.setText("Cancelled. The project keeps its last good state.")
        self.finished.emit(False)


@runtime_checkable
class ShowsResults(Protocol):
    """A widget that draws a project's results (a chart, the inspector): a page switching projects clears it."""

    def clear_results(self) -> None: ...


class Page(QWidget):
    """A wizard page: a title, a short why, an options form, the run strip and a results area."""

    changed = Signal()  # a stage finished: the window refreshes the step list

    title = ""
    why = ""

    def __init__(self, window: StudioWindow) -> None:
        super().__init__()
        self.window_ = window
        self.lay = QVBoxLayout(self)
        head = QLabel(f"<h2>{self.title}</h2><p>{self.why}</p>")
        head.setWordWrap(True)
        head.setTextFormat(Qt.TextFormat.RichText)
        self.lay.addWidget(head)
        self.form = QFormLayout()
        # a field goes below its label where the page is narrow (1024x700 beside the docks): side by side, the
        # longest label and the widest field made pages of 600-700 px that scrolled sideways
        self.form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self.lay.addLayout(self.form)

    def add_strip(self, label: str = "Run", redo: bool = False) -> RunStrip:
        """The run strip; with `redo`, its Redo button calls `self.start(force=True)`."""
        self.strip = RunStrip(label, redo)
        if redo:
            self.strip.redo.clicked.connect(lambda: self.start(force=True))
        self.lay.addWidget(self.strip)
        self.lay.addWidget(self.strip.status)
        return self.strip

    @property
    def project(self) -> Project:
        """The window's open project. The pages show and run a project's steps, so they are used once one is open
        (`MainWindow.refresh` draws none before); reaching here without one is a bug of the caller, said plainly
        rather than as an `AttributeError` of None further on."""
        project = self.window_.project
        if project is None:
            raise RuntimeError(f"{type(self).__name__} used with no project open")
        return project

    def unless_refused(self, make: Callable[[], T]) -> T | None:
        """What `make` builds (a stage's options), or None once the user was shown why it is refused."""
        try:
            return make()
        except UserError as e:
            show_error(self, e.problem, e.fix)
            return None

    def run(self, spec: StageSpec[O, R], options: O, name: str, force: bool = False,
            model: str | None = None) -> None:
        """Run a stage of the open project from this page, as every page does: in a spawned process (AIMET and the
        ONNX export hold the GIL for hundreds of ms), on the cluster the settings name where the stage may run
        there, its progress on the strip, its perplexity points on the page's chart and its result to `finish`.
        `name` is what the strip says meanwhile ("Quantizing")."""
        from ..core import pipeline

        project = self.project
        cluster = self.window_.settings.cluster if spec.remote else None  # None: here

        def work(state: Any) -> R:
            return pipeline.run_stage(project, spec, options, state, force=force, cluster=cluster, model=model,
                                      where="child").result

        self.strip.start(work, self.finish, name, on_partial=self.ppl_point)

    def start(self, force: bool = False) -> None:
        """Run the page's stage (`force`: again, though its inputs and options are unchanged); the Redo button of
        `add_strip(redo=True)` calls it, so a page with a Redo button defines it."""
        raise NotImplementedError(f"{type(self).__name__} runs no stage")

    def refresh(self) -> None:
        """Show what the project already holds (called on open and after any stage)."""

    def clear_results(self) -> None:
        """Forget what the page showed of another project: tables, charts, the status line (`refresh` then draws
        this project's)."""
        for t in self.findChildren(QTableWidget):
            t.setRowCount(0)
        for w in self.findChildren(QWidget):
            if isinstance(w, ShowsResults):
                w.clear_results()
        if hasattr(self, "strip"):
            self.strip.bar.setValue(0)
            self.strip.status.setStyleSheet("")
            self.strip.status.setText("Not run yet in this project.")

    def show_result(self, result: Any) -> None:
        """Draw a stage's result record."""

    def finish(self, result: Any) -> None:
        """A run ended well: show it, and let the window tick the step."""
        self.show_result(result)
        self.changed.emit()

    def ppl_point(self, kind: str, data: dict) -> None:
        """A stage's partial result: perplexity points go to the page's live chart."""
        if kind == "ppl" and hasattr(self, "chart"):
            self.chart.add(data)
