"""Per-user settings (the platform config dir): recent projects, tool paths, defaults.

Qt-free so the CLI could share them; written atomically; a damaged file falls back to defaults
instead of keeping the app from starting. The HF token is never here: it lives in the keyring.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import platformdirs
from pydantic import BaseModel, Field, ValidationError

from .cluster import Cluster
from .compute import Device
from .errors import UserError
from .fsutil import atomic_write_text
from .targets import DEFAULT_SOC

log = logging.getLogger(__name__)

MAX_RECENT = 8


class Settings(BaseModel):
    recent_projects: list[str] = Field(default_factory=list)
    qnn_sdk_root: str = ""  # empty: the QNN_SDK_ROOT environment variable, if any
    adb_path: str = ""  # empty: adb on PATH, else the one adbutils ships
    default_target: str = DEFAULT_SOC
    default_precision: str = "w8a16"
    virtual_preview: bool = Field(False, description="the virtual device answers with the CPU preview (fast)")
    device: Device = Field("auto", description="where adapt and quantize run their torch work (auto: a CUDA GPU "
                                               "when there is one)")

    cluster_address: str = Field("", description="Ray cluster address: HOST:PORT as `ray start --head` prints it, or "
                                                 "ray://HOST:10001")
    use_cluster: bool = Field(False, description="run the heavy stages (adapt, quantize, compile) on the cluster")
    cluster_install: bool = Field(False, description="Ray installs this computer's versions of NPU Studio's "
                                                     "requirements on the workers first")

    @property
    def cluster(self) -> Cluster | None:
        """Where the heavy stages run: the cluster when the switch is on and an address is set, else None (here)."""
        address = self.cluster_address.strip()
        return Cluster(address, install=self.cluster_install) if self.use_cluster and address else None

    def remember(self, project: Path | str) -> None:
        p = str(Path(project).expanduser().resolve())
        self.recent_projects = [p, *[r for r in self.recent_projects if r != p]][:MAX_RECENT]

    def apply(self) -> None:
        """Point the tools at the configured paths, unless the environment already says otherwise."""
        if self.qnn_sdk_root and not os.environ.get("QNN_SDK_ROOT"):
            os.environ["QNN_SDK_ROOT"] = self.qnn_sdk_root
        if self.adb_path and not os.environ.get("ADBUTILS_ADB_PATH"):
            os.environ["ADBUTILS_ADB_PATH"] = self.adb_path


def path() -> Path:
    return platformdirs.user_config_path("npustudio") / "settings.json"


def load() -> Settings:
    try:
        return Settings.model_validate_json(path().read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError):
        return Settings()


_WRITING = threading.Lock()


def save(s: Settings, where: Path | None = None) -> None:
    """Written atomically, never through a link; a file that cannot be written is said (stderr), and the app
    goes on with the settings in memory. `where`: the settings file as `path()` gave it when the save was asked
    for (the window writes in a thread, later). One write at a time, each of `s` as it is when its turn comes, so
    the last write holds the newest settings."""
    try:
        with _WRITING:
            # only what someone set: a default left alone stays a default (the job plans an unset precision)
            atomic_write_text(where or path(), s.model_dump_json(indent=2, exclude_unset=True) + "\n")
    except (OSError, UserError) as e:
        log.warning("Settings not saved: %s", e)
