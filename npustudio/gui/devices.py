"""The device panel: hot-plugged adb devices (the virtual one marked), their details, push progress and a
console where Genie's answer streams as it arrives, with Genie's own log lines (at the level picked above it)
in grey beside it. All adb traffic runs off the GUI thread."""

from __future__ import annotations

from html import escape
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QFont, QTextCharFormat
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ..core import device
from ..core.device import DeviceInfo
from ..display import human_bytes
from . import worker
from .widgets import fill, fit_rows, show_error, status_label, table
from .window import StudioWindow

VIRTUAL = QColor("#e8e0f8")
LOG_LEVELS = ("error", "warn", "info", "verbose")  # Genie's, as genie-t2t-run --log takes them
LOG_COLOUR = "#6b7280"


class _Bridge(QObject):
    """Carries the watcher thread's plug/unplug callback onto the GUI thread."""

    changed = Signal(list, list)
    error = Signal(str)


class DevicePanel(QWidget):
    selected = Signal(object)  # DeviceInfo or None

    def __init__(self, window: StudioWindow) -> None:
        super().__init__()
        self.window_ = window
        self.devices: list[DeviceInfo] = []
        self.virtual: Any = None  # the virtual device this window started
        lay = QVBoxLayout(self)
        self.list = QListWidget()
        self.list.setMaximumHeight(110)
        row = QHBoxLayout()
        self.refresh_btn = QPushButton("Refresh")
        self.start_virtual = QPushButton("Start virtual device")
        self.start_virtual.setToolTip("An adb device on this computer whose genie-t2t-run is the real Genie on the "
                                      "HTP simulator (or the CPU preview, see Settings)")
        self.stop_virtual = QPushButton("Stop it")
        self.stop_virtual.setEnabled(False)
        for b in (self.refresh_btn, self.start_virtual, self.stop_virtual):
            row.addWidget(b)
        self.status = status_label("Looking for devices…")
        self.details = table(["Property", "Value"])
        fit_rows(self.details)
        self.push = QProgressBar()
        self.push.setRange(0, 1000)
        self.reset_push()
        self.current_serial: str | None = None
        self.console = QPlainTextEdit()
        self.console.setReadOnly(True)
        self.console.setMaximumBlockCount(5000)
        self.console.setFont(QFont("monospace", 9))
        self._after_log = False  # the next piece of an answer starts a line of its own
        lay.addWidget(self.list)
        lay.addLayout(row)
        lay.addWidget(self.status)
        lay.addWidget(self.details)
        lay.addWidget(QLabel("Push:"))
        lay.addWidget(self.push)
        self.log_level = QComboBox()
        for level in LOG_LEVELS:
            self.log_level.addItem(level, level)
        self.log_level.setToolTip("How much of Genie's own log the console shows with each answer "
                                  "(genie-t2t-run's --log)")
        head = QHBoxLayout()
        head.addWidget(QLabel("Console: answers, and Genie's log at"), 1)
        head.addWidget(self.log_level)
        lay.addLayout(head)
        lay.addWidget(self.console, 1)
        self.list.currentRowChanged.connect(self._select)
        self.refresh_btn.clicked.connect(self.refresh)
        self.start_virtual.clicked.connect(self._start_virtual)
        self.stop_virtual.clicked.connect(self._stop_virtual)
        self._bridge = _Bridge()
        self._bridge.changed.connect(lambda _a, _r: self.refresh())
        self._bridge.error.connect(self.status.setText)
        self.watcher: device.Watcher | None = None
        self._querying = False

    def watch(self) -> None:
        """Follow plug/unplug (the adb server is started if needed, off the GUI thread)."""
        if self.watcher is None:
            self.watcher = device.Watcher(lambda a, r: self._bridge.changed.emit(a, r),
                                          on_error=lambda e: self._bridge.error.emit(str(e))).start()

    def close_down(self) -> None:
        """The window closes: stop following plug/unplug and stop the virtual device, neither waited for here (an
        adb call in progress held the close); `main` waits for the virtual device's stop once the window is gone."""
        if self.watcher is not None:
            self.watcher.stop(wait=False)
            self.watcher = None
        if self.virtual is not None:
            vd, self.virtual = self.virtual, None
            worker.start(lambda _s: device.stop_virtual(vd), "Stopping the virtual device")

    def refresh(self) -> None:
        if self._querying:
            return
        self._querying = True
        worker.start(lambda _s: device.devices(), "Listing devices", read=True, done=self._show, failed=self._failed,
                     finished=lambda: setattr(self, "_querying", False))

    @property
    def current(self) -> DeviceInfo | None:
        i = self.list.currentRow()
        return self.devices[i] if 0 <= i < len(self.devices) else None

    def _show(self, devs: list[DeviceInfo]) -> None:
        keep = self.current.serial if self.current else None
        self.devices = devs
        self.list.blockSignals(True)
        self.list.clear()
        for d in devs:
            label = (f"{d.serial} — {d.model or '?'} ({d.soc or d.state})" + ("  [virtual]" if d.virtual else "")
                     if d.state == "device" else f"{d.serial} — {d.state}")
            item = QListWidgetItem(label)
            if d.virtual:
                item.setBackground(VIRTUAL)
            if d.state != "device":
                item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsSelectable)
            self.list.addItem(item)
        self.list.blockSignals(False)
        online = [i for i, d in enumerate(devs) if d.state == "device"]
        pick = next((i for i, d in enumerate(devs) if d.serial == keep), None)
        if pick is None and online:
            phones = [i for i in online if not devs[i].virtual]
            pick = (phones or online)[0]
        self.status.setText(f"{len(online)} device(s) online." if devs else
                            "No device. Attach a phone with USB debugging on, or start the virtual device.")
        if pick is not None:
            self.list.setCurrentRow(pick)
        self._select(self.list.currentRow())

    def _failed(self, problem: str, fix: str) -> None:
        self.status.setText(f"{problem} {fix}")

    def _select(self, i: int) -> None:
        d = self.devices[i] if 0 <= i < len(self.devices) and self.devices[i].state == "device" else None
        if d is None or self.current_serial != d.serial:
            self.reset_push()  # another device (or none): the last push's bar is not about it
        self.current_serial = d.serial if d else None
        if d is None:
            fill(self.details, [])
            fit_rows(self.details)
        else:
            fill(self.details, [
                ("Serial", d.serial), ("Kind", "virtual device (this computer)" if d.virtual else "phone"),
                ("Answers with", d.answers_with),
                ("Model", d.model), ("SoC", f"{d.soc} — {d.product}"),
                ("Hexagon", f"{d.dsp_arch} (soc_model {d.soc_model})" if d.dsp_arch else "none known"),
                ("Android", d.android), ("RAM", human_bytes(d.ram_bytes) if d.ram_bytes else "?"),
                ("Free in /data/local/tmp", human_bytes(d.free_bytes) if d.free_bytes else "?")])
        fit_rows(self.details)
        self.selected.emit(d)

    def _start_virtual(self) -> None:
        preview = self.window_.settings.virtual_preview
        self.start_virtual.setEnabled(False)
        self.status.setText("Starting the virtual device…")

        def started(vd: Any) -> None:
            self.virtual = vd
            self.stop_virtual.setEnabled(True)
            how = "CPU preview" if preview else "Genie on the HTP simulator"
            self.log(f"Virtual device {vd.serial} started ({how}).")
            if vd.notice:
                self.log(vd.notice)
            self.refresh()

        def failed(problem: str, fix: str) -> None:
            self.start_virtual.setEnabled(True)
            show_error(self, problem, fix)

        worker.start(lambda _s: device.start_virtual(preview=preview), "Starting the virtual device",
                     done=started, failed=failed)

    def _stop_virtual(self) -> None:
        vd, self.virtual = self.virtual, None
        self.stop_virtual.setEnabled(False)
        if vd is None:
            return

        def stopped(_r: Any) -> None:
            self.start_virtual.setEnabled(True)
            self.log(f"Virtual device {vd.serial} stopped.")
            self.refresh()

        worker.start(lambda _s: device.stop_virtual(vd), "Stopping the virtual device", done=stopped)

    def forget_project(self) -> None:
        """Another project is opened: the last push's bar and the console (its deploy log, its model's answers)
        were about the previous one."""
        self.reset_push()
        self.console.clear()
        self._after_log = False

    def reset_push(self) -> None:
        self.push.setValue(0)
        self.push.setFormat("no push running")

    def show_push(self, data: dict) -> None:
        self.push.setValue(int(1000 * data["bytes"] / max(data["total"], 1)))
        self.push.setFormat(f"{human_bytes(data['bytes'])} / {human_bytes(data['total'])} at "
                            f"{data['rate'] / 1e6:.0f} MB/s")

    def push_done(self, sent: int, rate_mb_s: float) -> None:
        """The finished push's figure, the one the Deploy page states: the bar kept the last live rate (498 MB/s
        beside the page's 49: the result counts the push to its end, the device's writes included)."""
        self.push.setValue(1000)
        self.push.setFormat(f"{human_bytes(sent)} sent at {rate_mb_s:.0f} MB/s" if sent else "nothing to send")

    def genie_level(self) -> str:
        """How much of Genie's own log the console shows with each answer (the level picked above it)."""
        return str(self.log_level.currentData())

    def log(self, text: str) -> None:
        self.console.appendPlainText(text)

    def genie_log(self, line: str) -> None:
        """One of Genie's own log lines, in grey: the answer stands out from it."""
        self.console.appendHtml(f'<span style="color:{LOG_COLOUR}; white-space:pre">{escape(line)}</span>')
        self._after_log = True

    def stream(self, text: str) -> None:
        """Genie's answer, piece by piece, without forcing a new line per token (after a log line, the answer
        goes on on a line of its own)."""
        cur = self.console.textCursor()
        cur.movePosition(cur.MoveOperation.End)
        if self._after_log:
            cur.insertBlock()
            self._after_log = False
        cur.setCharFormat(QTextCharFormat())  # not the grey of the log line before it
        cur.insertText(text)
        self.console.setTextCursor(cur)
        self.console.ensureCursorVisible()
