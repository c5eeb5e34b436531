"""A menu entry for this installation (freedesktop.org Desktop Entry 1.5): the venv route's `npustudio` is not on a
desktop launcher's PATH, so the user's entry starts this installation's own launcher by absolute path, and its
icon goes into the user's hicolor theme. The shipped `packaging/npustudio.desktop` is this same text with the
command found on PATH (`text(["npustudio", "gui"])`), so the two cannot drift apart."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .fsutil import atomic_write_bytes, atomic_write_text

FILE_NAME = "npustudio.desktop"
ICON_NAME = "npustudio"
RESOURCES = Path(__file__).resolve().parents[2] / "resources"
ICONS = {"256x256": RESOURCES / "npustudio-256.png", "64x64": RESOURCES / "npustudio-64.png",
         "scalable": RESOURCES / "npustudio.svg"}
MARK = "X-NPUStudio-Installation"  # whose entry it is: `remove` takes away only an entry this command wrote
FIELDS = {"Type": "Application", "Version": "1.5", "Name": "NPU Studio", "GenericName": "LLM to phone NPU",
          "Comment": "Put a Hugging Face LLM onto a phone's Hexagon NPU under Qualcomm Genie",
          "Icon": ICON_NAME, "Terminal": "false", "Categories": "Development;Science;",
          "Keywords": "LLM;NPU;Qualcomm;Genie;QNN;Android;"}
_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")  # the spec's characters that oblige an argument to be quoted


@dataclass(frozen=True)
class Written:
    entry: Path
    icons: list[Path]
    exec_argv: list[str]
    replaced: str | None  # the installation whose entry this one replaced, if another's


def launcher() -> list[str]:
    """The command that opens the window from this installation: the frozen app's own executable, or the
    console script beside this interpreter (a venv's bin/, not resolved: the link is what keeps the venv)."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    script = Path(sys.executable).parent / "npustudio"
    if not (script.is_file() and os.access(script, os.X_OK)):
        raise UserError(f"This installation has no `npustudio` command beside its Python ({script} is missing), so "
                        "a menu entry would have nothing to start.",
                        "Install NPU Studio with its commands (bash packaging/bootstrap.sh), then run "
                        "`.venv/bin/npustudio desktop-entry install`.")
    return [str(script.absolute()), "gui"]


def exec_value(argv: list[str]) -> str:
    """`argv` as an Exec value: an argument with a reserved character is double-quoted with `"`, `` ` ``, `$` and
    `\\` backslash-escaped inside; `%` doubled (field codes); then the string escape of every backslash."""
    def arg(a: str) -> str:
        a = a.replace("%", "%%")
        if not a or _RESERVED & set(a):
            a = '"' + "".join("\\" + c if c in '"`$\\' else c for c in a) + '"'
        return a

    return _string(" ".join(arg(a) for a in argv))


def _string(v: str) -> str:
    """A value of type string: backslash and the control characters escaped (a line break would end the line)."""
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def text(argv: list[str], installation: str | None = None) -> str:
    fields: dict[str, str] = {}
    for k, v in FIELDS.items():
        fields[k] = v
        if k == "Comment":  # what it starts, where a reader looks for it
            fields["Exec"] = exec_value(argv)
            if Path(argv[0]).is_absolute():
                fields["TryExec"] = _string(argv[0])  # a launcher hides the entry once that program is gone
    if installation:
        fields[MARK] = _string(installation)
    return "[Desktop Entry]\n" + "".join(f"{k}={v}\n" for k, v in fields.items())


def data_home() -> Path:
    """$XDG_DATA_HOME when it is an absolute path (the spec ignores a relative one), else ~/.local/share."""
    env = os.environ.get("XDG_DATA_HOME", "")
    return Path(env) if env and Path(env).is_absolute() else Path.home() / ".local" / "share"


def entry_path() -> Path:
    return data_home() / "applications" / FILE_NAME


def _owner(entry: Path) -> str | None:
    """The installation named in an existing entry (None: not written by this command)."""
    for line in entry.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(MARK + "="):
            return line.split("=", 1)[1]  # compared as written: `install` writes it the same way
    return None


def _check_platform() -> None:
    if not sys.platform.startswith("linux"):
        raise UserError("Desktop entries are for Linux desktops (freedesktop.org); this is " + sys.platform + ".",
                        "Start NPU Studio with `npustudio` here.")


def install() -> Written:
    """Write the user's entry for this installation (replacing one this command wrote for any installation) and
    its icons. An entry of the same name that this command did not write (a package's, an AppImage's) is kept."""
    _check_platform()
    entry, here, argv = entry_path(), sys.prefix, launcher()  # refused before anything is written
    replaced = None
    if entry.exists():
        owner = _owner(entry)
        if owner is None:
            raise UserError(f"{entry} exists and was not written by `npustudio desktop-entry` (a package or an "
                            "AppImage may have put it there), so it is left as it is.",
                            f"Remove {entry} yourself if it is no longer wanted, then install again.")
        replaced = owner if owner != _string(here) else None
    icons = []
    for src in ICONS.values():
        if not src.is_file():
            raise UserError(f"This installation has no icon {src}.",
                            "Reinstall NPU Studio (bash packaging/bootstrap.sh) from its source folder.")
    try:
        for size, src in ICONS.items():
            dest = data_home() / "icons" / "hicolor" / size / "apps" / (ICON_NAME + src.suffix)
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(dest, src.read_bytes())
            icons.append(dest)
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(entry, text(argv, here))
    except OSError as e:  # XDG_DATA_HOME a file, read-only, full: say where, not "failed unexpectedly"
        where = Path(e.filename) if e.filename else data_home()
        raise UserError(f"The desktop entry cannot be written under {data_home()}: {where}: "
                        f"{e.strerror or e}.", "Point XDG_DATA_HOME at a writable folder (or unset it to use "
                        "~/.local/share), then install again.") from e
    return Written(entry, icons, argv, replaced)


def remove() -> Path | None:
    """Remove the entry this command wrote (for any installation) and its icons; None when there was none."""
    _check_platform()
    entry = entry_path()
    if not entry.exists():
        return None
    if _owner(entry) is None:
        raise UserError(f"{entry} was not written by `npustudio desktop-entry`, so it is left as it is.",
                        f"Remove {entry} yourself if it is no longer wanted.")
    entry.unlink()
    for size, src in ICONS.items():
        (data_home() / "icons" / "hicolor" / size / "apps" / (ICON_NAME + src.suffix)).unlink(missing_ok=True)
    return entry
