"""Per-user settings (the platform config dir): recent projects, tool paths, defaults.

Qt-free so the CLI shares them; written atomically; read bounded (`SETTINGS_LIMIT`). The HF token is never here: it
lives in the keyring.

A settings file that cannot be used (not JSON, an unknown key such as a typo, a value the model refuses) is a
UserError naming the file and the key (`load`), never quietly replaced by the defaults, since that lost the user's
choices without a word. What each front end does with it:

- the CLI takes its defaults (precision, target, device) from here, so every command stops with the problem and its
  fix (exit 2) rather than run at defaults the user did not choose;
- the window still starts, with the defaults, and says on its status bar that the file was not used and why; it does
  not write the file (recent projects) while it is refused, until the user saves the preferences on purpose.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import platformdirs
from pydantic import BaseModel, Field, ValidationError, field_validator

from .cluster import Cluster
from .compute import Device
from .errors import UserError
from .fsutil import MiB, atomic_write_text, check_keys, read_json
from .stage_options import PRECISION_NAMES  # the presets' names, light (models imports torch)
from .targets import DEFAULT_SOC, KNOWN_SOCS, find_soc

log = logging.getLogger(__name__)

MAX_RECENT = 8
SETTINGS_LIMIT = 1 * MiB  # the file is a few hundred bytes; more is not a settings file
FIX = "Correct it, or delete it: the window writes a new one with the defaults."


class Settings(BaseModel):
    recent_projects: list[str] = Field(default_factory=list)
    qnn_sdk_root: str = ""  # empty: the QNN_SDK_ROOT environment variable, if any
    adb_path: str = ""  # empty: adb on PATH, else the one adbutils ships
    mnn_android_root: str = ""  # empty: the MNN_ANDROID_ROOT environment variable, if any
    default_target: str = DEFAULT_SOC
    default_precision: str = PRECISION_NAMES[0]  # the best quality
    virtual_preview: bool = Field(False, description="the virtual device answers with the CPU preview (fast)")
    device: Device = Field("auto", description="where adapt and quantize run their torch work (auto: a CUDA GPU "
                                               "when there is one)")

    cluster_address: str = Field("", description="Ray cluster address: HOST:PORT as `ray start --head` prints it, or "
                                                 "ray://HOST:10001")
    use_cluster: bool = Field(False, description="run the heavy stages (adapt, quantize, compile) on the cluster")
    cluster_install: bool = Field(False, description="Ray installs this computer's versions of NPU Studio's "
                                                     "requirements on the workers first")

    @field_validator("default_precision")
    @classmethod
    def _known_precision(cls, v: str) -> str:
        """A precision the CLI and the window offer: another one failed later, in quantize, far from its cause."""
        if v not in PRECISION_NAMES:
            raise ValueError(f"not a precision NPU Studio knows (use one of: {', '.join(PRECISION_NAMES)})")
        return v

    @field_validator("qnn_sdk_root", "adb_path", "mnn_android_root")
    @classmethod
    def _a_path(cls, v: str) -> str:
        """A folder or file name: a NUL byte (no path holds one) stopped the window with "ValueError"."""
        if "\0" in v:
            raise ValueError("holds a NUL byte, which no file name has")
        return v

    @field_validator("default_target")
    @classmethod
    def _known_target(cls, v: str) -> str:
        """A SoC NPU Studio knows, for the same reason."""
        try:
            find_soc(v)
        except UserError:
            raise ValueError(f"not a target SoC NPU Studio knows (use one of: {', '.join(KNOWN_SOCS)})") from None
        return v

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
        if self.mnn_android_root and not os.environ.get("MNN_ANDROID_ROOT"):
            os.environ["MNN_ANDROID_ROOT"] = self.mnn_android_root
        if self.adb_path and not os.environ.get("ADBUTILS_ADB_PATH"):
            os.environ["ADBUTILS_ADB_PATH"] = self.adb_path


def path() -> Path:
    return platformdirs.user_config_path("npustudio") / "settings.json"


def load(where: Path | None = None) -> Settings:
    """The settings in the file (the defaults when there is none), or a UserError naming the file and what is wrong:
    not readable JSON, larger than `SETTINGS_LIMIT`, an unknown key (with the closest valid one), or a key whose
    value the model refuses."""
    where = where or path()
    if not os.path.lexists(where):
        return Settings()
    data = read_json(where, "settings file", FIX, limit=SETTINGS_LIMIT)
    if not isinstance(data, dict):
        raise UserError(f"{where} holds a JSON {type(data).__name__}, not NPU Studio's settings (an object).", FIX)
    check_keys(data, Settings.model_fields, where, "settings", FIX)
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(map(str, first["loc"]))
        why = first.get("ctx", {}).get("error") or first["msg"]
        raise UserError(f"{where}: {key} is {first.get('input')!r}: {str(why).rstrip('.')}.", FIX) from e


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
