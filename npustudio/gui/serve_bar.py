"""The chat panel's server row: start and stop the OpenAI-compatible endpoint (`core/serve.py`, what
`npustudio serve` runs) for the chat's runner, and show its URL with a client snippet ready to copy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLineEdit, QPushButton, QToolButton, QWidget

from ..core import serve
from ..core.genie.adapters import Choice
from ..core.stage_options import ServeOptions
from . import worker
from .widgets import show_error

Where = Literal["device", "desktop", "preview", "mnn"]
# the bundle (or MNN folder), the runner, the device's serial, the bundle's switchable LoRA adapter answering
Target = tuple[Path, Where, "str | None", "str | None"]


class ServeBar(QWidget):
    def __init__(self, target: Callable[[], Target | None], parent: QWidget | None = None) -> None:
        """`target`: what the chat would talk to now, or None when there is nothing to serve yet."""
        super().__init__(parent)
        self.target = target
        self.port = ServeOptions.model_fields["port"].default
        self.background: serve.Background | None = None
        self.served: Target | None = None  # what the running server serves
        self.job: worker.Job | None = None
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.toggle = QPushButton("Serve")
        self.toggle.setToolTip("An OpenAI-compatible endpoint on this computer (127.0.0.1) for this runner: the "
                               "same client code then talks to the model on the phone")
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.url.setPlaceholderText("not serving")
        self.copy_btn = QToolButton()
        self.copy_btn.setText("Copy snippet")
        self.copy_btn.setToolTip("A Python snippet for the openai client, pointed at this server")
        self.copy_btn.setEnabled(False)
        lay.addWidget(self.toggle)
        lay.addWidget(self.url, 1)
        lay.addWidget(self.copy_btn)
        self.toggle.clicked.connect(self._clicked)
        self.copy_btn.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.snippet()))

    @property
    def serving(self) -> bool:
        return self.background is not None and self.background.running

    def _clicked(self) -> None:
        if self.background is not None:
            self.stop()
        elif self.job is None:
            self.start()

    def start(self) -> None:
        target = self.target()
        if target is None:
            show_error(self, "There is nothing to serve yet.",
                       "Build the bundle (Compile step) and pick a device, or choose 'This computer'.")
            return
        bundle, where, serial, adapter = target
        port = self.port
        self.served = target

        def work(state: Any) -> serve.Background:
            bg = serve.Background(serve.open_server(bundle, where, serial, state, lora=Choice(name=adapter)),
                                  "127.0.0.1", port)
            bg.start()
            return bg

        self.toggle.setEnabled(False)
        self.url.setText("starting…")
        self.job = worker.start(work, "Server", done=self._started, failed=self._failed)

    def _started(self, bg: serve.Background) -> None:
        self.job, self.background = None, bg
        self.url.setText(bg.url or "")
        self.toggle.setText("Stop serving")
        self.toggle.setEnabled(True)
        self.copy_btn.setEnabled(True)

    def _failed(self, problem: str, fix: str) -> None:
        self.job, self.served = None, None
        self._reset()
        show_error(self, problem, fix)

    def stop(self) -> None:
        """End the server and any answer it is giving (the window closing calls it too)."""
        if self.background is not None:
            self.background.stop()
        self.background, self.served = None, None
        self._reset()

    def _reset(self) -> None:
        self.url.clear()
        self.toggle.setText("Serve")
        self.toggle.setEnabled(True)
        self.copy_btn.setEnabled(False)

    def snippet(self) -> str:
        if self.background is None:
            return ""
        model = self.background.server.model_id
        return (f'from openai import OpenAI\n\nclient = OpenAI(base_url="{self.background.url}", api_key="none")\n'
                f'stream = client.chat.completions.create(model="{model}", stream=True,\n'
                f'    messages=[{{"role": "user", "content": "Hello"}}])\n'
                'for chunk in stream:\n    print(chunk.choices[0].delta.content or "", end="", flush=True)\n')
