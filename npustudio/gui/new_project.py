"""File → New project: a name and where to put it; the folder is created (a folder picker only opens existing ones)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QWidget,
)

from ..core import layout


class NewProjectDialog(QDialog):
    def __init__(self, parent: QWidget, location: Path) -> None:
        super().__init__(parent)
        self.setWindowTitle("New project")
        form = QFormLayout(self)
        self.name = QLineEdit()
        self.name.setPlaceholderText("e.g. llama-1b-w8")
        self.location = QLineEdit(str(location))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.location, 1)
        row.addWidget(browse)
        form.addRow("Project name:", self.name)
        form.addRow("Create in:", row)
        self.problem = QLabel("")
        self.problem.setWordWrap(True)
        self.problem.setStyleSheet("color: #b00020")
        form.addRow(self.problem)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.create_button = buttons.addButton("Create", QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self.name.textChanged.connect(lambda _t: self.problem.setText(""))

    def folder(self) -> Path:
        return Path(self.location.text().strip()).expanduser() / self.name.text().strip()

    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Create the project in", self.location.text(),
                                             options=QFileDialog.Option.DontUseNativeDialog)
        if d:
            self.location.setText(d)

    def _accept(self) -> None:
        """A new or empty folder becomes the project; an existing project or a folder of other files is refused."""
        name, f = self.name.text().strip(), self.folder()
        if not name or name in (".", "..") or "/" in name:
            self.problem.setText("Give the project a name (a folder name, without '/').")
        elif (f / layout.MANIFEST).is_file():
            self.problem.setText(f"{f} is already a project: open it with File → Open project.")
        elif f.exists() and (not f.is_dir() or any(f.iterdir())):
            self.problem.setText(f"{f} already exists and holds other files: pick another name.")
        else:
            try:
                f.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                self.problem.setText(f"Cannot create {f}: {e.strerror or e}. Pick another place.")
                return
            self.accept()
