"""What the pages and panels use of the main window: `StudioWindow`, a protocol that `app.MainWindow` meets.

The pages (gui/pages/*.py), the chat and the device panel are handed the window and read from it only what is
named here; mypy checks both sides: a page reaching for something else fails, and so does a `MainWindow` that
stops providing it. Read-only properties: no page or panel sets anything on the window."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the panels import this module: their classes are named for the checker only
    from PySide6.QtWidgets import QDockWidget

    from ..core.device import DeviceInfo
    from ..core.project import Project
    from ..core.settings import Settings


class DeviceConsole(Protocol):
    """The device panel as the pages and the chat use it: its log, Genie's output, the push's progress."""

    def log(self, text: str) -> None: ...

    def genie_log(self, line: str) -> None: ...

    def stream(self, text: str) -> None: ...

    def show_push(self, data: dict) -> None: ...

    def push_done(self, sent: int, rate_mb_s: float) -> None: ...

    def genie_level(self) -> str:
        """How much of Genie's own log to show (error, warn, info, verbose)."""


class ChatTarget(Protocol):
    """The chat panel as Deploy uses it."""

    def use_device(self, serial: str) -> None: ...

    def ask(self, text: str) -> None: ...


class ProfileSink(Protocol):
    """The Genie profiles view as the chat uses it."""

    def add_json(self, label: str, text: str) -> None: ...


class StudioWindow(Protocol):
    @property
    def project(self) -> Project | None:
        """The open project (None before one is opened)."""

    @property
    def settings(self) -> Settings:
        """The user's settings (device, cluster, default target and precision, virtual preview)."""

    @property
    def device(self) -> DeviceInfo | None:
        """The phone picked in the device panel, if any."""

    @property
    def devices(self) -> DeviceConsole:
        """The device panel: Deploy logs its push there, the chat streams Genie's answer into its log."""

    @property
    def chat(self) -> ChatTarget:
        """The chat panel: Deploy points it at the phone it deployed to and asks the bundle's question."""

    @property
    def chat_dock(self) -> QDockWidget:
        """The chat's dock: raised when a question is asked."""

    @property
    def profiles(self) -> ProfileSink:
        """The Genie profiles: each chat answer's profile is added there."""
