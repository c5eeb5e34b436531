"""Loaded by a process a launch test starts (this folder is on its PYTHONPATH): when the application's event loop
starts, wait for its main window to be shown, write its title to NPUSTUDIO_TEST_WINDOW_REPORT and close it the way
a person does (a close event), so the process must end by itself. Nothing here runs in the product."""

from __future__ import annotations

import json
import os
import sys

REPORT = os.environ.get("NPUSTUDIO_TEST_WINDOW_REPORT")


def _install() -> None:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QMainWindow

    exec_ = QApplication.exec

    def exec_and_observe(app: QApplication) -> int:
        timer = QTimer(app)

        def look() -> None:
            shown = [w for w in QApplication.topLevelWidgets() if isinstance(w, QMainWindow) and w.isVisible()]
            if not shown:
                return
            timer.stop()
            w = shown[0]
            report = {"title": w.windowTitle(), "class": type(w).__name__, "argv": sys.argv,
                      "width": w.width(), "height": w.height()}
            with open(str(REPORT), "w", encoding="utf-8") as f:
                json.dump(report, f)
            w.close()

        timer.timeout.connect(look)
        timer.start(50)
        return exec_()  # QCoreApplication::exec is static

    # the stubs declare the static QApplication.exec(); the product calls app.exec(), which binds this to the app
    QApplication.exec = exec_and_observe  # type: ignore[assignment]


if REPORT:
    _install()
