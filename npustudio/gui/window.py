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
    from .chat import ChatPanel
    from .devices import DevicePanel
    from .profile_view import ProfileView


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
    def devices(self) -> DevicePanel:
        """The device panel: Deploy logs its push there, the chat streams Genie's answer into its log."""

    @property
    def chat(self) -> ChatPanel:
        """The chat panel: Deploy points it at the phone it deployed to and asks the bundle's question."""

    @property
    def chat_dock(self) -> QDockWidget:
        """The chat's dock: raised when a question is asked."""

    @property
    def profiles(self) -> ProfileView:
        """The Genie profiles: each chat answer's profile is added there."""
