"""The desktop application: the wizard (Model · Target · Adapt · Quantize · Compile · Deploy) in the centre, the
device and chat panels docked beside it, Genie profiles below. A thin view: all work is in npustudio.core and
runs off the GUI thread (gui.worker)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from PySide6.QtCore import QSize, Qt, QThreadPool, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QIcon, QMoveEvent, QShowEvent
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QStackedWidget,
    QWidget,
)

from ..core import desktop_entry, layout, pipeline, stages
from ..core import settings as user_settings
from ..core.device import DeviceInfo
from ..core.errors import UserError
from ..core.project import Project
from ..core.stages import STEP_NAMES
from . import worker
from .chat import ChatPanel
from .devices import DevicePanel
from .new_project import NewProjectDialog
from .pages import PAGES, AdaptPage, CompilePage, DeployPage, ModelPage, QuantizePage, TargetPage
from .profile_view import ProfileView
from .settings_dialog import SettingsDialog
from .widgets import Page, scrolled, show_error

STEPS = STEP_NAMES
P = TypeVar("P", bound=Page)
ICON = desktop_entry.ICONS["scalable"]


class MainWindow(QMainWindow):
    def __init__(self, project: Path | str | None = None, watch_devices: bool = True) -> None:
        super().__init__()
        self.setWindowTitle("NPU Studio")
        if ICON.is_file():
            self.setWindowIcon(QIcon(str(ICON)))
        screen = QApplication.primaryScreen()
        room = screen.availableGeometry().size() if screen else QSize(1440, 900)
        self.resize(min(1440, room.width()), min(900, room.height()))
        QThreadPool.globalInstance().setMaxThreadCount(max(6, QThreadPool.globalInstance().maxThreadCount()))
        self.settings, self.settings_refused = self._load_settings()
        self.settings.apply()
        self.project: Project | None = None
        self.device: DeviceInfo | None = None
        self._stopping_to_quit = False
        self.quit_box: QMessageBox | None = None
        self._settings_saves = 0
        self._fitted = self._fit_pending = False

        central = QWidget()
        lay = QHBoxLayout(central)
        self.steps = QListWidget()
        self.steps.setFixedWidth(self.fontMetrics().horizontalAdvance("↻ Quantize") + 36)  # full names, a fixed width
        self.steps.setIconSize(QSize(16, 16))
        self.stack = QStackedWidget()
        self.pages = [cls(self) for cls in PAGES]
        for name, page in zip(STEPS, self.pages, strict=True):
            self.steps.addItem(QListWidgetItem(name))
            self.stack.addWidget(scrolled(page))
            page.changed.connect(self.refresh)
        lay.addWidget(self.steps)
        lay.addWidget(self.stack, 1)
        self.setCentralWidget(central)
        self.steps.currentRowChanged.connect(self._go)
        # by class, each typed as its page (unpacked from the list they were all `Page`s to the checker)
        self.model_page, self.target_page = self._page(ModelPage), self._page(TargetPage)
        self.adapt_page, self.quantize_page = self._page(AdaptPage), self._page(QuantizePage)
        self.compile_page, self.deploy_page = self._page(CompilePage), self._page(DeployPage)

        self.devices = DevicePanel(self)
        self.chat = ChatPanel(self)
        # a chat on a device deploys the bundle there first: the Deploy page says so once the answer is in
        self.chat.answered.connect(lambda _turn: self.deploy_page.refresh())
        self.profiles = ProfileView()
        # the right column runs the window's full height: the profiles open below the wizard, never below the chat
        # (they left its messages ~70 px and pushed Send and Stop out of view at 1366x768)
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.setCorner(Qt.Corner.TopRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.device_dock = self._dock("Devices", self.devices, Qt.DockWidgetArea.RightDockWidgetArea)
        # scrolls up and down only on a screen lower than its controls; at 768 px it needs none
        self.chat_dock = self._dock("Chat", scrolled(self.chat, across=False), Qt.DockWidgetArea.RightDockWidgetArea)
        # the chat and the device panel share the column as tabs: each gets the whole height (both stacked left the
        # messages ~165 px and the device properties two rows); Deploy with no device picked raises the devices, a
        # question raises the chat
        self.tabifyDockWidget(self.device_dock, self.chat_dock)
        self.chat_dock.raise_()
        # in a scroll area: its charts keep a readable height, the window its fit on a laptop screen
        self.profile_dock = self._dock("Genie profiles", scrolled(self.profiles),
                                       Qt.DockWidgetArea.BottomDockWidgetArea)
        self.profile_dock.hide()
        self.profile_dock.visibilityChanged.connect(self._give_profiles_room)
        self.devices.selected.connect(self.set_device)
        self._menus()
        if self.settings_refused:
            e = self.settings_refused
            self.statusBar().showMessage(f"Default settings in use, not your file: {e.problem} {e.fix} Until then "
                                         "this window leaves the file as it is (saving the preferences replaces it).")
        self.open_project(Path(project) if project else self._last_project())
        if watch_devices:
            self.devices.watch()
            self.devices.refresh()

    def _page(self, cls: type[P]) -> P:
        return next(p for p in self.pages if isinstance(p, cls))

    def _give_profiles_room(self, visible: bool) -> None:
        """Opened, the profiles dock takes 45% of the height below the wizard: its charts readable without
        scrolling (the page above scrolls meanwhile); the chat beside them keeps the full height."""
        if visible:
            self.resizeDocks([self.profile_dock], [int(self.height() * 0.45)], Qt.Orientation.Vertical)

    def _dock(self, title: str, w: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        d = QDockWidget(title, self)
        d.setObjectName(title)
        d.setWidget(w)
        self.addDockWidget(area, d)
        return d

    def _menus(self) -> None:
        bar = self.menuBar()
        f = bar.addMenu("&File")
        self._action(f, "&New project…", self._new_project, "Ctrl+N")
        self._action(f, "&Open project…", self._open_project, "Ctrl+O")
        self.recent_menu = f.addMenu("Recent projects")
        f.addSeparator()
        self._action(f, "&Quit", self.close, "Ctrl+Q")
        v = bar.addMenu("&View")
        for d in (self.device_dock, self.chat_dock, self.profile_dock):
            v.addAction(d.toggleViewAction())
        s = bar.addMenu("&Settings")
        self._action(s, "&Preferences and Hugging Face token…", self.open_settings)

    def _action(self, menu: QMenu, text: str, slot: Callable[..., object], shortcut: str | None = None) -> QAction:
        a = QAction(text, self)
        if shortcut:
            a.setShortcut(shortcut)
        a.triggered.connect(slot)
        menu.addAction(a)
        return a

    def _last_project(self) -> Path:
        for r in self.settings.recent_projects:
            if (Path(r) / layout.MANIFEST).is_file():
                return Path(r)
        return pipeline.default_project_dir()

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        for r in self.settings.recent_projects:
            self._action(self.recent_menu, r, lambda _c=False, p=r: self.open_project(Path(p)))

    # ----- projects -----
    def open_project(self, folder: Path) -> bool:
        if self.busy():
            show_error(self, "A task is still running.", "Cancel it or wait for it, then open the project.")
            return False
        try:
            project = Project.open(folder)
        except UserError as e:
            show_error(self, e.problem, e.fix)
            return False
        self.project = project
        for page in self.pages:  # nothing of the previous project stays on screen
            page.clear_results()
        self.profiles.forget_runs()  # drawn once, with this project's roofline, by refresh()
        unread = self.profiles.keep_project_sample(project.root)
        self.devices.forget_project()
        self.settings.remember(project.root)
        self._save_settings()
        self._fill_recent()
        self.setWindowTitle(f"NPU Studio — {project.root}")
        self.refresh()  # the steps, every page and the profiles' roofline, from this project
        first = next((i for i, name in enumerate(STEPS) if self.step_state(name) != "done"), len(STEPS) - 1)
        self.steps.setCurrentRow(first)  # resume where it stopped
        if unread:
            self.statusBar().showMessage(unread)
        return True

    @staticmethod
    def _load_settings() -> tuple[user_settings.Settings, UserError | None]:
        """The user's settings; a file that cannot be used leaves the defaults and the reason: the window starts
        anyway, says so, and keeps the file for the user to correct (see core/settings.py)."""
        try:
            return user_settings.load(), None
        except UserError as e:
            return user_settings.Settings(), e

    def _save_settings(self) -> None:
        """Write the settings (the recent projects) in the thread pool: the write is synced to disk, and an fsync
        on the GUI thread blocked a project switch for 0.04-1.4 s while other programs wrote to the disk. Each
        write takes the settings as they are when it runs (`settings.save` writes one at a time), so the file ends
        with the newest; `main` waits for it once the window has closed (`worker.cancel_all`). Not while the
        user's file is refused: it would replace their settings with the defaults without a word."""
        if self.settings_refused:
            return
        where = user_settings.path()
        self._settings_saves += 1
        made = self._settings_saves

        def write(_state: Any) -> None:
            if made == self._settings_saves:  # else a later save is queued: it writes the same, newer settings
                user_settings.save(self.settings, where)

        worker.start(write, "Saving the settings")

    def _new_project(self) -> NewProjectDialog:
        where = self.project.root.parent if self.project else pipeline.default_project_dir().parent
        d = NewProjectDialog(self, where)
        d.accepted.connect(lambda: self.open_project(d.folder()))
        d.open()
        return d

    def _open_project(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a project folder",
                                                  options=QFileDialog.Option.DontUseNativeDialog)
        if folder:
            self.open_project(Path(folder))

    def refresh(self) -> None:
        """Redraw the step list (done / unlocked / locked) and every page from the project."""
        if self.project is None:
            return
        steps = pipeline.wizard_steps(self.project)
        marks = {"done": "✓ ", "todo": "● ", "locked": "○ "}
        for i, step in enumerate(steps):
            item = self.steps.item(i)
            item.setText(("↻ " if step.reason else marks[step.state]) + step.name)
            item.setToolTip(f"Out of date: {step.reason}. Run it again." if step.reason else "")
            item.setData(Qt.ItemDataRole.UserRole, step.state)
            flags = item.flags()
            # an out-of-date step opens even while an earlier one locks it: its page says why it is out of date
            openable = step.state != "locked" or bool(step.reason)
            item.setFlags(flags | Qt.ItemFlag.ItemIsEnabled if openable else flags & ~Qt.ItemFlag.ItemIsEnabled)
        for page, step in zip(self.pages, steps, strict=True):
            if not page.strip.busy:
                page.refresh()
                if step.reason:
                    then = "Run the steps before it, then this one, again" if step.state == "locked" else \
                        "Run this step again"
                    page.strip.status.setText(f"Out of date: {step.reason}. {then}.")
        self.profiles.set_roofline(self.project.stage_dir(stages.BUNDLE.name))
        if not self.chat.busy:  # a bundle just built: the chat is ready ("No bundle yet" stayed until a restart)
            self.chat.reload()

    def step_state(self, name: str) -> str:
        return str(self.steps.item(STEPS.index(name)).data(Qt.ItemDataRole.UserRole))

    def go(self, name: str) -> None:
        self.steps.setCurrentRow(STEPS.index(name))

    def _go(self, row: int) -> None:
        if row >= 0:
            self.stack.setCurrentIndex(row)
            if STEPS[row] == "Deploy" and self.device is None:  # a device to pick first: its panel to the front
                self.device_dock.raise_()

    def set_device(self, dev: DeviceInfo | None) -> None:
        self.device = dev
        self.model_page.show_fit()
        self.deploy_page.refresh()
        if not self.chat.busy:
            self.chat.reload()

    def busy(self) -> bool:
        """A stage is running (a background read, such as the inspector's, does not hold the window)."""
        return any(page.strip.busy for page in self.pages)

    def open_settings(self) -> SettingsDialog:
        d = SettingsDialog(self, self.settings)
        d.finished.connect(lambda _r: self.compile_page.find_sdk())
        d.accepted.connect(self._settings_saved)
        d.open()
        return d

    def _settings_saved(self) -> None:
        """The user saved the preferences on purpose: the file holds this window's settings again."""
        if self.settings_refused:
            self.settings_refused = None
            self.statusBar().clearMessage()
            self._save_settings()  # the recent projects too

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if not self._fitted:  # the window manager frames the window some time after it is shown (a move)
            self._fitted = True
            self._fit_pending = True
            QTimer.singleShot(5000, lambda: setattr(self, "_fit_pending", False))  # no window manager: no frame

    def moveEvent(self, event: QMoveEvent) -> None:
        super().moveEvent(event)
        if self._fit_pending and self.frameGeometry() != self.geometry():
            self._fit_pending = False
            self.fit_screen()

    def fit_screen(self) -> None:
        """Keep the whole first window on the screen, title bar included: `resize` sizes the inside, so a window
        as tall as the free area put the status line under the screen's edge at 1366×768."""
        screen = self.screen()
        if screen is None or self.isMaximized() or self.isFullScreen():
            return
        room, frame = screen.availableGeometry(), self.frameGeometry()
        w = min(self.width(), room.width() - (frame.width() - self.width()))
        h = min(self.height(), room.height() - (frame.height() - self.height()))
        if (w, h) != (self.width(), self.height()):
            self.resize(w, h)
        if not room.contains(self.frameGeometry()):
            self.move(room.topLeft())

    def closeEvent(self, event: QCloseEvent) -> None:
        """With a stage running, ask first (`quit_box`); then cancel what runs and close without waiting for it:
        waiting here for the inspector's encodings read froze the window 6.5-16 s with no word on screen. What
        must finish (the settings write) is waited for by `main` once the window is gone."""
        if (self.busy() or self.chat.busy) and not self._stopping_to_quit:
            event.ignore()
            self.quit_box = self._ask_to_quit()
            return
        self.chat.stop()
        self.chat.serve_bar.stop()
        worker.cancel_all()
        self.devices.close_down()
        super().closeEvent(event)

    def _ask_to_quit(self) -> QMessageBox:
        running = ", ".join([p.title for p in self.pages if p.strip.busy] + (["The chat's answer"] if self.chat.busy
                                                                               else []))
        box = QMessageBox(QMessageBox.Icon.Question, "NPU Studio", f"{running} is still running.",
                          QMessageBox.StandardButton.Cancel, self)
        box.setObjectName("quit_dialog")
        box.setInformativeText("Stop it and quit? The project keeps its last finished stages.")
        stop = box.addButton("Stop and quit", QMessageBox.ButtonRole.AcceptRole)
        stop.clicked.connect(self._stop_and_quit)
        box.open()  # window-modal, the event loop runs on
        return box

    def _stop_and_quit(self) -> None:
        """Ask the stage to stop at its next safe point ("Stopping…" on its page) and close once it has: the window
        keeps drawing meanwhile instead of waiting inside closeEvent."""
        self._stopping_to_quit = True
        self.chat.stop()
        for page in self.pages:
            if page.strip.busy:
                page.strip.cancel.click()
        self.statusBar().showMessage("Stopping the running stage, then quitting…")

        def close_when_stopped() -> None:
            if self.busy() or self.chat.busy:
                QTimer.singleShot(100, close_when_stopped)
            else:
                self.close()

        close_when_stopped()


def freeze_startup_objects() -> None:
    """Put what exists once the window is up (torch's ~240k objects) out of the cyclic GC's reach: a full
    collection walks them all, 118 ms on this machine, a visible freeze each time it triggers."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    app = QApplication.instance() or QApplication(sys.argv[:1] + list(argv or []))
    app.setApplicationName("NPU Studio")
    project = next((a for a in (argv or []) if not a.startswith("-")), None)
    w = MainWindow(project)
    w.show()
    freeze_startup_objects()
    code = app.exec()
    worker.cancel_all(wait_ms=30_000)  # the window is gone: the settings write and the virtual device's stop end
    return code
