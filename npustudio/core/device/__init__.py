"""Android devices over adb: list, follow plug/unplug, read what a deploy needs, check a bundle fits.

Built on adbutils and the adb server it ships (or `ADBUTILS_ADB_PATH`). The server port comes from
`ANDROID_ADB_SERVER_PORT` (default 5037), so tests and the virtual device can use a private server.
Every call into adb is a request to the server; nothing user-given is spliced into a shell line.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .. import layout
from ..errors import UserError
from ..targets import APP_RAM_SHARE, KNOWN_SOCS, RUNTIME_RAM_BYTES, fits_phone_ram

DEFAULT_PORT = 5037
REMOTE_ROOT = "/data/local/tmp/npustudio"


class DeviceInfo(BaseModel):
    serial: str
    state: str
    virtual: bool = False
    model: str = ""
    soc: str = ""
    product: str = ""  # e.g. "Snapdragon 8 Elite"
    soc_model: int | None = None
    dsp_arch: str = ""
    android: str = ""
    ram_bytes: int | None = None
    free_bytes: int | None = None  # under /data/local/tmp
    runner: str = ""  # a virtual device's: "genie" (HTP simulator) or "preview" (CPU), fixed when it starts

    @property
    def answers_with(self) -> str:
        """How this device runs a bundle, in words."""
        if not self.virtual:
            return "Genie on the phone's NPU"
        return {"preview": "the CPU preview (restart the virtual device to change)",
                "genie": "Genie on the HTP simulator (restart the virtual device to change)"}.get(
                    self.runner, "Genie on the HTP simulator")


def server_port() -> int:
    """The adb server's port from ANDROID_ADB_SERVER_PORT (checked before adbutils is imported: it reads the
    variable at import and fails with a bare ValueError)."""
    text = os.environ.get("ANDROID_ADB_SERVER_PORT", str(DEFAULT_PORT))
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise UserError(f"ANDROID_ADB_SERVER_PORT is {text!r}, not a TCP port number (1 to 65535).",
                        f"Unset it (adb then uses {DEFAULT_PORT}) or set it to a port number.")
    return port


def adb_path() -> str:
    server_port()
    import adbutils

    path = os.environ.get("ADBUTILS_ADB_PATH") or adbutils.adb_path()
    if not path or not Path(path).is_file():
        raise UserError("No adb binary was found.", "Reinstall adbutils (bootstrap.sh) or set ADBUTILS_ADB_PATH.")
    return path


def client(ping: bool = True) -> Any:
    """An adbutils client for the adb server, started first if none runs (`ping=False`: the caller has just
    talked to it; the check costs a connection and adbutils' 10 ms close)."""
    port = server_port()
    import adbutils

    adb = adbutils.AdbClient(host="127.0.0.1", port=port, socket_timeout=30)
    if not ping:
        return adb
    try:
        adb.server_version()
        return adb
    except Exception:
        pass
    try:
        subprocess.run([adb_path(), "-P", str(port), "start-server"], check=True, capture_output=True, timeout=30)
        adb.server_version()
    except (OSError, subprocess.SubprocessError, Exception) as e:
        raise UserError(f"The adb server on port {port} could not be started ({e}).",
                        "Check that nothing else holds the port, or run `adb start-server` yourself.") from e
    return adb


def devices() -> list[DeviceInfo]:
    """Every device the adb server sees; details for those that are online."""
    adb = client()
    try:
        rows = adb.list()
    except Exception as e:
        raise UserError(f"The adb server stopped answering ({e}).", "Restart it: `adb kill-server`, then retry.") from e
    out = []
    for r in rows:
        if r.state == "device":
            try:
                out.append(info(r.serial))
                continue
            except UserError:
                pass
        out.append(DeviceInfo(serial=r.serial, state=r.state))
    return out


def _shell(d: Any, args: list[str], timeout: float = 20) -> str:
    return str(d.shell(args, timeout=timeout)).strip()


def info(serial: str) -> DeviceInfo:
    adb = client()
    try:
        d = adb.device(serial=serial)
        props = {k: _shell(d, ["getprop", k]) for k in
                 ("ro.soc.model", "ro.product.model", "ro.build.version.release", "ro.npustudio.virtual",
                  "ro.npustudio.runner")}
        meminfo = _shell(d, ["cat", "/proc/meminfo"])
        df = _shell(d, ["df", "-k", "/data/local/tmp"])
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"Device {serial} did not answer ({e}).", "Check the cable and that USB debugging is "
                        "allowed, then run `npustudio devices`.") from e
    soc_name = props["ro.soc.model"].upper()
    s = KNOWN_SOCS.get(soc_name)
    return DeviceInfo(serial=serial, state="device", virtual=props["ro.npustudio.virtual"] == "1",
                      model=props["ro.product.model"], soc=soc_name, product=s.product if s else "unknown SoC",
                      soc_model=s.soc_model if s else None, dsp_arch=s.dsp_arch if s else "",
                      android=props["ro.build.version.release"], ram_bytes=_mem_total(meminfo),
                      free_bytes=_df_free(df), runner=props["ro.npustudio.runner"])


def _mem_total(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def _df_free(df: str) -> int | None:
    """Available KiB from `df -k` (toybox and GNU print the same columns; long names may wrap a line)."""
    lines = [ln for ln in df.splitlines() if ln.strip()]
    if len(lines) < 2:
        return None
    fields = " ".join(lines[1:]).split()
    nums = [f for f in fields if f.isdigit()]
    return int(nums[2]) * 1024 if len(nums) >= 3 else None


def pick(serial: str | None) -> DeviceInfo:
    """The device to use: the one named, else the only phone attached, else the only device."""
    online = [d for d in devices() if d.state == "device"]
    if serial:
        for d in online:
            if d.serial == serial:
                return d
        raise UserError(f"Device {serial} is not connected.", "Run `npustudio devices` to see what is attached.")
    if not online:
        raise UserError("No device is connected.", "Attach a phone with USB debugging on, or start the virtual "
                        "device: `npustudio virtual-device`.")
    phones = [d for d in online if not d.virtual]
    choice = phones if phones else online
    if len(choice) > 1:
        raise UserError(f"{len(choice)} devices are connected.", "Pick one with --device SERIAL.")
    return choice[0]


def compatibility(dev: DeviceInfo, bundle_dir: Path) -> list[tuple[str, str]]:
    """(problem, fix) pairs that stop this bundle from running on this device; empty when it fits."""
    from ..genie.meta import read_metadata

    meta = read_metadata(bundle_dir)
    problems = []
    want = meta.target
    if not dev.dsp_arch:
        problems.append((f"{dev.serial} reports SoC {dev.soc or '?'}, which has no known Hexagon NPU.",
                         "Use a Snapdragon phone from the SoC table (SM8550, SM8650, SM8750, SM8850)."))
    elif dev.dsp_arch != want.dsp_arch:
        problems.append((f"The bundle was compiled for {want.soc} ({want.dsp_arch}); {dev.serial} has "
                         f"{dev.soc} ({dev.dsp_arch}).",
                         f"Recompile for this phone: `npustudio quantize --target {dev.soc}` then compile and "
                         "bundle again."))
    size = sum(p.stat().st_size for p in bundle_dir.iterdir() if p.is_file())
    size += sum(p.stat().st_size for p in (bundle_dir / layout.LORA_BUNDLE).rglob("*.raw"))  # switchable adapters
    bins = sum(p.stat().st_size for p in bundle_dir.glob("*.bin"))
    bins += sum(p.stat().st_size for p in bundle_dir.glob(layout.EMBEDDING_LUT))  # Genie's lookup table: RAM too
    if dev.free_bytes is not None and dev.free_bytes < size:
        problems.append((f"{dev.serial} has {dev.free_bytes / 1e9:.2f} GB free under /data/local/tmp; the bundle "
                         f"needs {size / 1e9:.2f} GB.", "Free space on the phone, then deploy again."))
    need = bins + RUNTIME_RAM_BYTES
    if dev.ram_bytes is not None and not fits_phone_ram(need, dev.ram_bytes):
        drafted = sum(p.stat().st_size for p in bundle_dir.glob(f"{layout.DRAFT_PREFIX}*.bin"))
        split = (f" ({(need - drafted) / 1e9:.2f} GB of it the target and runtime, {drafted / 1e9:.2f} GB the draft "
                 "model)") if drafted else ""
        problems.append((f"{dev.serial} has {dev.ram_bytes / 1e9:.1f} GB RAM, of which an app may use about "
                         f"{APP_RAM_SHARE * dev.ram_bytes / 1e9:.1f} GB; this bundle needs about {need / 1e9:.2f} "
                         f"GB{split}.",
                         ("Bundle without the draft (`npustudio bundle --project P --decoding basic`), use a "
                          "smaller draft, or a phone with more memory.") if drafted else
                         "Use a smaller model or w4a16, or a phone with more memory."))
    if not dev.virtual and meta.optimize != "phone":
        problems.append(("The bundle's graphs were compiled for a quick check on the simulator, not optimized for a "
                         "phone's NPU.", "Compile them for the phone, then bundle and deploy again: `npustudio "
                         "compile --project P --optimize phone`, `npustudio bundle --project P`."))
    if not dev.virtual and meta.runtime_missing:
        problems.append(("The bundle has no QNN runtime for a phone (genie-t2t-run, libGenie.so, ...).",
                         "Set QNN_SDK_ROOT to a QAIRT SDK and run `npustudio bundle` again."))
    return problems


class Watcher:
    """Follows plug/unplug in a worker thread; `stop()` ends it promptly (the GUI's device panel uses it)."""

    def __init__(self, on_change: Callable[[list[str], list[str]], None], interval: float = 0.5,
                 on_error: Callable[[UserError], None] | None = None) -> None:
        self.on_change, self.interval, self.on_error = on_change, interval, on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="adb-watcher", daemon=True)
        self.seen: set[str] = set()

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Without `wait` the thread ends on its own after the adb call it may be in (a window closing must not
        wait for it; the thread is a daemon)."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                now = {r.serial for r in client().list() if r.state == "device"}
            except Exception as e:
                if self.on_error:
                    self.on_error(e if isinstance(e, UserError) else
                                  UserError(f"The adb server stopped answering ({e}).", "It will be restarted."))
                now = set()
            added, removed = sorted(now - self.seen), sorted(self.seen - now)
            if added or removed:
                self.seen = now
                self.on_change(added, removed)
            self._stop.wait(self.interval)


def start_virtual(root: Path | None = None, port: int = 0, soc_name: str = "SM8750", preview: bool = False) -> Any:
    """Start a virtual device in this process and have the adb server connect to it."""
    import platformdirs

    from .virtual import VirtualDevice

    root = root or platformdirs.user_data_path("npustudio") / "virtual-device"
    vd = VirtualDevice(root, port=port, soc_name=soc_name, preview=preview).start()
    res = str(client().connect(vd.serial, timeout=15))
    if "authenticate" in res:  # the device takes only this user's adb keys (~/.android/adbkey.pub)
        stop_virtual(vd)
        raise UserError(f"The adb server on port {server_port()} signs with a key that is not this user's adb key, "
                        "so the virtual device refused it.", "Restart the adb server as this user "
                        f"(`adb -P {server_port()} kill-server`), then start the virtual device again.")
    if "connected" not in res or "failed" in res:
        vd.stop()
        raise UserError(f"The adb server did not connect to the virtual device: {res}", "Restart adb and retry.")
    return vd


def stop_virtual(vd: Any) -> None:
    """Disconnect the adb server from a virtual device (if it still answers) and stop the device."""
    try:
        client().disconnect(vd.serial)
    except Exception:  # the server may be gone already; the device stops either way
        pass
    vd.stop()
