"""The desktop application. For now: the Model step (architecture card and phone fit); the other wizard
steps are listed and come with the next issues. A thin view: all work is core.models, run off the GUI thread.
"""

from __future__ import annotations

import sys
from typing import Any

from PySide6.QtCore import QObject, QRunnable, Qt, QThreadPool, Signal
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QMainWindow,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

STEPS = ("Model", "Target", "Adapt", "Quantize", "Compile", "Deploy")


class _Signals(QObject):
    done = Signal(object)
    failed = Signal(str)


class CardJob(QRunnable):
    """Reads a model's card and fit off the GUI thread."""

    def __init__(self, spec: str, cl: int) -> None:
        super().__init__()
        self.spec, self.cl = spec, cl
        self.signals = _Signals()

    def run(self) -> None:
        from ..core import models
        from ..core.errors import UserError

        try:
            src = models.download(models.resolve_source(self.spec))
            card = models.read_card(src)
            self.signals.done.emit((card, models.fit_table(card, self.cl)))
        except UserError as e:
            self.signals.failed.emit(str(e))
        except Exception as e:  # shown to the user, never a crash of the window
            self.signals.failed.emit(f"{e.__class__.__name__}: {e}")


class ModelPage(QWidget):
    def __init__(self) -> None:
        super().__init__()
        lay = QVBoxLayout(self)
        row = QHBoxLayout()
        self.source = QLineEdit("default")
        self.source.setPlaceholderText("default, a model folder, a .gguf file, or org/name")
        self.read = QPushButton("Read model")
        row.addWidget(QLabel("Model:"))
        row.addWidget(self.source, 1)
        row.addWidget(self.read)
        lay.addLayout(row)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        self.card = QTableWidget(0, 2)
        self.card.setHorizontalHeaderLabels(["Property", "Value"])
        self.card.horizontalHeader().setStretchLastSection(True)
        lay.addWidget(self.card, 2)
        self.fit = QTableWidget(0, 5)
        self.fit.setHorizontalHeaderLabels(["Precision", "Weights", "KV cache", "Parts", "Phone RAM"])
        self.fit.horizontalHeader().setStretchLastSection(True)
        lay.addWidget(self.fit, 1)
        for table in (self.card, self.fit):
            table.verticalHeader().setVisible(False)
            table.verticalHeader().setDefaultSectionSize(22)
            table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.read.clicked.connect(self.start)

    def start(self) -> None:
        self.read.setEnabled(False)
        self.status.setText(f"Reading {self.source.text()}…")
        job = CardJob(self.source.text().strip(), 1024)
        job.signals.done.connect(self.show_card)
        job.signals.failed.connect(self.show_error)
        QThreadPool.globalInstance().start(job)

    def show_card(self, result: tuple[Any, list[Any]]) -> None:
        from ..core.models import format_value, human_bytes

        card, fits = result
        rows = [(k, v) for k, v in card.model_dump().items() if k != "chat_template"]
        rows.append(("chat template", "yes" if card.chat_template else "no"))
        self.card.setRowCount(len(rows))
        for i, (k, v) in enumerate(rows):
            self.card.setItem(i, 0, QTableWidgetItem(k))
            self.card.setItem(i, 1, QTableWidgetItem(format_value(v)))
        self.fit.setRowCount(len(fits))
        for i, f in enumerate(fits):
            tier = f"≥ {f.min_phone_ram_gb} GB phones" if f.min_phone_ram_gb else "too large for listed phones"
            for j, v in enumerate((f.precision, human_bytes(f.weight_bytes), human_bytes(f.kv_cache_bytes),
                                   str(f.parts), f"{human_bytes(f.phone_ram_bytes)} ({tier})")):
                self.fit.setItem(i, j, QTableWidgetItem(v))
        self.status.setText(f"{card.source}: {card.family}, {card.params / 1e6:.1f} M parameters")
        self.read.setEnabled(True)

    def show_error(self, message: str) -> None:
        self.status.setText(message)
        self.read.setEnabled(True)


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("NPU Studio")
        self.resize(1000, 700)
        central = QWidget()
        lay = QHBoxLayout(central)
        self.steps = QListWidget()
        for s in STEPS:
            self.steps.addItem(s)
        for i in range(1, len(STEPS)):  # later steps are not built yet: shown, not clickable
            item = self.steps.item(i)
            item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEnabled)
        self.steps.setCurrentRow(0)
        self.steps.setMaximumWidth(160)
        lay.addWidget(self.steps)
        self.model_page = ModelPage()
        lay.addWidget(self.model_page, 1)
        self.setCentralWidget(central)


def main(argv: list[str] | None = None) -> int:
    app = QApplication.instance() or QApplication(sys.argv[:1] + list(argv or []))
    w = MainWindow()
    w.show()
    return app.exec()
