"""Whether this Linux desktop has the X11 libraries Qt's window needs, asked before Qt is: without them Qt aborts
the process, and its message names the wrong package ("xcb-cursor0 or libxcb-cursor0 is needed"), whatever is
actually missing."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import UserError


def xcb_plugin() -> Path | None:
    """Qt's X11 platform plugin inside the installed PySide6 (found without importing Qt)."""
    spec = importlib.util.find_spec("PySide6")
    for root in (spec.submodule_search_locations or []) if spec else []:
        plugin = Path(root) / "Qt" / "plugins" / "platforms" / "libqxcb.so"
        if plugin.is_file():
            return plugin
    return None


def missing(plugin: Path | None = None) -> list[str]:
    """The shared libraries the X11 plugin links to that the loader cannot find (empty where the window will not
    use X11: another QT_QPA_PLATFORM, Wayland, not Linux)."""
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if not sys.platform.startswith("linux") or platform not in ("", "xcb") or (
            not platform and os.environ.get("XDG_SESSION_TYPE") == "wayland"):
        return []
    plugin = plugin or xcb_plugin()
    ldd = shutil.which("ldd")
    if plugin is None or ldd is None:
        return []
    out = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=60).stdout
    return sorted({m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", out, re.M)})


def package_of(library: str) -> str:
    """The Debian/Ubuntu package that ships a library (their naming rule: libxcb-icccm.so.4 -> libxcb-icccm4,
    libxkbcommon-x11.so.0 -> libxkbcommon-x11-0)."""
    base, _, version = library.partition(".so.")
    version = version.split(".")[0]
    return base + ("-" if base[-1:].isdigit() else "") + version if version else base


def check() -> None:
    """A UserError naming the libraries and the packages to install, before Qt would abort the process."""
    libs = missing()
    if libs:
        raise UserError(f"The window cannot start: Qt's X11 platform needs libraries this system lacks: "
                        f"{', '.join(libs)}.",
                        f"Install them (Debian/Ubuntu): sudo apt-get install {' '.join(package_of(x) for x in libs)}. "
                        "Every command of the CLI works without them.")
