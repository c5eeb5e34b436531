"""The virtual device: the device side of the adb transport, for the real adb server to `adb connect` to.

A product feature (shown as "virtual" in device lists) and the test rig. It listens on 127.0.0.1 only and
speaks the adb wire protocol (aosp adb/protocol.txt, SYNC.TXT): CNXN without AUTH and with no features,
so the host uses legacy `shell:` and sync v1; OPEN/OKAY/WRTE/CLSE streams where every WRTE is
acknowledged before the next; `shell:` runs `/bin/sh` inside a sandbox folder that stands for the
phone's file system (`/data/local/tmp` is a real folder under it); `sync:` serves STAT, LIST, SEND
(DATA ≤ 64 KiB, DONE + mtime), RECV and QUIT. `getprop` answers the configured props (SM8750, Android
15 by default) and `genie-t2t-run` is the desktop runner (real Genie on the HTP simulator, or the fast
preview when the device was started in preview mode).
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..targets import DEFAULT_SOC, soc

A_CNXN, A_OPEN, A_OKAY, A_CLSE, A_WRTE, A_AUTH = 0x4E584E43, 0x4E45504F, 0x59414B4F, 0x45534C43, 0x45545257, 0x48545541
A_VERSION = 0x01000001
MAX_PAYLOAD = 256 * 1024
SYNC_DATA_MAX = 64 * 1024
VIRTUAL_DEVICE_NAME = "npustudio_virtual"
RESERVED_PORTS = range(5554, 5586)  # the adb server scans these for emulators


def default_props(soc_name: str = DEFAULT_SOC) -> dict[str, str]:
    s = soc(soc_name)
    return {"ro.soc.model": s.soc, "ro.soc.manufacturer": "QTI", "ro.product.model": "NPU Studio virtual device",
            "ro.product.name": VIRTUAL_DEVICE_NAME, "ro.product.device": VIRTUAL_DEVICE_NAME,
            "ro.product.manufacturer": "NPU Studio", "ro.build.version.release": "15",
            "ro.build.version.sdk": "35", "ro.product.cpu.abi": "arm64-v8a", "ro.npustudio.virtual": "1"}


def _packet(cmd: int, arg0: int, arg1: int, data: bytes = b"") -> bytes:
    return struct.pack("<6I", cmd, arg0, arg1, len(data), 0, cmd ^ 0xFFFFFFFF) + data


class _Stream:
    """One adb stream: data from the host arrives on `inbox`; `write` sends WRTE and waits for the OKAY."""

    def __init__(self, conn: _Connection, local_id: int, remote_id: int) -> None:
        self.conn, self.local_id, self.remote_id = conn, local_id, remote_id
        self.inbox: queue.Queue[bytes | None] = queue.Queue()
        self.acked = threading.Event()
        self.closed = threading.Event()

    def write(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            if self.closed.is_set():
                return False
            chunk, view = bytes(view[: self.conn.max_payload]), view[self.conn.max_payload:]
            self.acked.clear()
            self.conn.send(A_WRTE, self.local_id, self.remote_id, chunk)
            while not self.acked.wait(0.2):
                if self.closed.is_set() or self.conn.dead.is_set():
                    return False
        return True

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.inbox.put(None)
            self.conn.send(A_CLSE, self.local_id, self.remote_id)
            self.conn.streams.pop(self.local_id, None)


class _Connection:
    def __init__(self, device: VirtualDevice, sock: socket.socket) -> None:
        self.device, self.sock = device, sock
        self.lock = threading.Lock()
        self.streams: dict[int, _Stream] = {}
        self.next_id = 1
        self.max_payload = 4096
        self.dead = threading.Event()

    def send(self, cmd: int, a0: int, a1: int, data: bytes = b"") -> None:
        try:
            with self.lock:
                self.sock.sendall(_packet(cmd, a0, a1, data))
        except OSError:
            self.dead.set()

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return bytes(buf)

    def serve(self) -> None:
        try:
            while not self.device.stopping.is_set():
                cmd, a0, a1, length, _check, magic = struct.unpack("<6I", self._recv_exact(24))
                if magic != cmd ^ 0xFFFFFFFF:
                    break
                data = self._recv_exact(length) if length else b""
                self._handle(cmd, a0, a1, data)
        except (ConnectionError, OSError):
            pass
        finally:
            self.dead.set()
            for s in list(self.streams.values()):
                s.closed.set()
                s.inbox.put(None)
            self.sock.close()

    def _handle(self, cmd: int, a0: int, a1: int, data: bytes) -> None:
        if cmd == A_CNXN:
            self.max_payload = min(a1, MAX_PAYLOAD)
            self.send(A_CNXN, A_VERSION, MAX_PAYLOAD, self.device.banner().encode())
        elif cmd == A_OPEN:
            service = data.rstrip(b"\0").decode("utf-8", errors="replace")
            local = self.next_id
            self.next_id += 1
            stream = _Stream(self, local, a0)
            handler = self.device.service(service)
            if handler is None:
                self.send(A_CLSE, 0, a0)
                return
            self.streams[local] = stream
            self.send(A_OKAY, local, a0)
            threading.Thread(target=self._run, args=(handler, stream), daemon=True).start()
        elif cmd == A_WRTE:
            s = self.streams.get(a1)
            if s is not None:
                s.inbox.put(data)
                self.send(A_OKAY, a1, a0)
        elif cmd == A_OKAY:
            s = self.streams.get(a1)
            if s is not None:
                s.acked.set()
        elif cmd == A_CLSE:
            s = self.streams.pop(a1, None)
            if s is not None:
                s.closed.set()
                s.inbox.put(None)

    @staticmethod
    def _run(handler: Callable[[_Stream], None], stream: _Stream) -> None:
        try:
            handler(stream)
        finally:
            stream.close()


class VirtualDevice:
    """A loopback adb device. `start()` listens on 127.0.0.1:`port` (0 = any free port outside 5554-5585)."""

    def __init__(self, root: Path, port: int = 0, soc_name: str = DEFAULT_SOC, preview: bool = False,
                 props: dict[str, str] | None = None) -> None:
        if port in RESERVED_PORTS:
            raise UserError(f"Port {port} is one the adb server scans for emulators.",
                            "Pick a port outside 5554-5585.")
        self.root = Path(root).resolve()
        self.port, self.preview = port, preview
        self.props = default_props(soc_name) | (props or {})
        self.stopping = threading.Event()
        self._server: socket.socket | None = None
        self._connections: list[_Connection] = []

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def serial(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> VirtualDevice:
        self._prepare_sandbox()
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for attempt in range(40):
            try:
                srv.bind(("127.0.0.1", self.port))
            except OSError as e:
                if self.port and attempt < 39:  # a device on this port was just stopped: give it a moment
                    time.sleep(0.1)
                    continue
                raise UserError(f"Cannot listen on 127.0.0.1:{self.port}: {e.strerror}.",
                                "Pick another port with --port.") from e
            if srv.getsockname()[1] not in RESERVED_PORTS:
                break
            srv.close()
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.listen(8)
        srv.settimeout(0.2)
        self._server, self.port = srv, srv.getsockname()[1]
        threading.Thread(target=self._accept, name="virtual-device", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every connection (to the host it looks like a phone unplugged)."""
        self.stopping.set()
        if self._server is not None:
            self._server.close()
        for c in self._connections:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        assert self._server is not None
        while not self.stopping.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.stopping.is_set():
                sock.close()
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
            conn = _Connection(self, sock)
            self._connections = [c for c in self._connections if not c.dead.is_set()] + [conn]
            threading.Thread(target=conn.serve, daemon=True).start()

    def banner(self) -> str:
        p = self.props
        return (f"device::ro.product.name={p['ro.product.name']};ro.product.model={p['ro.product.model']};"
                f"ro.product.device={p['ro.product.device']};features=")

    # -- the sandbox -------------------------------------------------------------------------
    def _prepare_sandbox(self) -> None:
        (self.root / "data" / "local" / "tmp").mkdir(parents=True, exist_ok=True)
        bin_dir = self.root / "system" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        props = "\n".join(f"{k}={v}" for k, v in sorted(self.props.items()))
        prop_file = shlex.quote(str(self.root / "system" / "build.prop"))
        (self.root / "system" / "build.prop").write_text(props + "\n")
        _script(bin_dir / "getprop", "#!/bin/sh\n"
                f"if [ $# -eq 0 ]; then sed 's/^\\([^=]*\\)=\\(.*\\)$/[\\1]: [\\2]/' {prop_file}; exit 0; fi\n"
                f'grep -m1 "^$1=" {prop_file} | cut -d= -f2-\n')
        runner = [sys.executable, "-m", "npustudio.cli", "genie-run"] + (["--preview"] if self.preview else [])
        _script(bin_dir / "genie-t2t-run", "#!/bin/sh\nexec " + " ".join(map(shlex.quote, runner)) + ' "$@"\n')

    def host_path(self, device_path: str) -> Path:
        """A device path inside the sandbox; anything that would leave it is refused."""
        p = (self.root / device_path.lstrip("/")).resolve()
        if p != self.root and self.root not in p.parents:
            raise PermissionError(device_path)
        return p

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANDROID_")}
        env["PATH"] = f"{self.root / 'system' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env["NPUSTUDIO_DEVICE_ROOT"] = str(self.root)
        return env

    # -- services ----------------------------------------------------------------------------
    def service(self, name: str) -> Callable[[_Stream], None] | None:
        if name.startswith("shell:"):
            return lambda s: self._shell(s, name[len("shell:"):])
        if name == "sync:":
            return self._sync
        return None

    def _to_sandbox(self, cmd: str) -> str:
        """Device paths in a command line point into the sandbox (the device's file system)."""
        return cmd.replace("/data/local/tmp", str(self.root / "data" / "local" / "tmp"))

    def _shell(self, s: _Stream, cmd: str) -> None:
        argv = ["/bin/sh", "-c", self._to_sandbox(cmd)] if cmd.strip() else ["/bin/sh", "-i"]
        proc = subprocess.Popen(argv, cwd=self.root / "data" / "local" / "tmp", env=self._env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)

        def feed() -> None:
            while True:
                data = s.inbox.get()
                if data is None:  # the host closed the stream: stop the command like adbd does
                    _kill(proc)
                    return
                if b"\x03" in data and cmd.strip():
                    _kill(proc, signal.SIGINT)
                    continue
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(data)
                    proc.stdin.flush()
                except OSError:
                    return

        threading.Thread(target=feed, daemon=True).start()
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if not s.write(chunk):
                _kill(proc)
                break
        proc.wait()

    def _sync(self, s: _Stream) -> None:
        buf = bytearray()

        def need(n: int) -> bytes | None:
            while len(buf) < n:
                data = s.inbox.get()
                if data is None:
                    return None
                buf.extend(data)
            out = bytes(buf[:n])
            del buf[:n]
            return out

        while True:
            head = need(8)
            if head is None:
                return
            rid, length = head[:4], struct.unpack("<I", head[4:])[0]
            if rid == b"QUIT":
                return
            arg = need(length) if rid in (b"STAT", b"LIST", b"SEND", b"RECV") else b""
            if arg is None:
                return
            path = arg.decode("utf-8", errors="replace")
            if rid == b"STAT":
                s.write(b"STAT" + self._stat(path))
            elif rid == b"LIST":
                s.write(self._list(path))
            elif rid == b"RECV":
                if not self._recv(s, path):
                    return
            elif rid == b"SEND":
                if not self._send(s, path, need):
                    return
            else:
                s.write(_fail(f"unknown sync request {rid!r}"))
                return

    def _stat(self, path: str) -> bytes:
        try:
            st = os.stat(self.host_path(path))
        except (OSError, PermissionError):
            return struct.pack("<3I", 0, 0, 0)
        return struct.pack("<3I", st.st_mode & 0xFFFFFFFF, min(st.st_size, 0xFFFFFFFF), int(st.st_mtime))

    def _list(self, path: str) -> bytes:
        out = bytearray()
        try:
            folder = self.host_path(path)
            names = sorted(os.listdir(folder))
        except (OSError, PermissionError):
            names, folder = [], self.root
        for name in [".", "..", *names]:
            try:
                st = os.stat(folder / name)
            except OSError:
                continue
            raw = name.encode()
            out += b"DENT" + struct.pack("<4I", st.st_mode & 0xFFFFFFFF, min(st.st_size, 0xFFFFFFFF),
                                         int(st.st_mtime), len(raw)) + raw
        return bytes(out + b"DONE" + b"\0" * 16)

    def _recv(self, s: _Stream, path: str) -> bool:
        try:
            f = open(self.host_path(path), "rb")
        except (OSError, PermissionError) as e:
            return s.write(_fail(f"open failed: {getattr(e, 'strerror', None) or 'permission denied'}"))
        with f:
            while chunk := f.read(SYNC_DATA_MAX):
                if not s.write(b"DATA" + struct.pack("<I", len(chunk)) + chunk):
                    return False
        return s.write(b"DONE" + struct.pack("<I", 0))

    def _send(self, s: _Stream, spec: str, need: Callable[[int], bytes | None]) -> bool:
        path, _, mode_s = spec.rpartition(",")
        try:
            target = self.host_path(path or spec)
            mode = int(mode_s or "0o644") & 0o777 if mode_s.isdigit() else 0o644
        except PermissionError:
            target, mode = None, 0o644
        tmp = None
        f = None
        if target is not None:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.sync-{os.getpid()}-{time.monotonic_ns()}")
                f = open(tmp, "wb")
            except OSError:
                f = None
        try:
            while True:
                head = need(8)
                if head is None:
                    return False  # the host went away mid-push: leave the old file untouched
                rid, n = head[:4], struct.unpack("<I", head[4:])[0]
                if rid == b"DATA":
                    if n > SYNC_DATA_MAX:
                        s.write(_fail("data chunk too large"))
                        return False
                    data = need(n)
                    if data is None:
                        return False
                    if f is not None:
                        f.write(data)
                elif rid == b"DONE":
                    if f is None or tmp is None or target is None:
                        return s.write(_fail(f"cannot write {path}: permission denied"))
                    f.close()
                    os.chmod(tmp, mode)
                    os.utime(tmp, (n, n))
                    os.replace(tmp, target)
                    tmp = None
                    return s.write(b"OKAY" + struct.pack("<I", 0))
                else:
                    s.write(_fail(f"unexpected {rid!r} during SEND"))
                    return False
        finally:
            if f is not None and not f.closed:
                f.close()
            if tmp is not None and tmp.exists():
                tmp.unlink()


def _fail(msg: str) -> bytes:
    raw = msg.encode()
    return b"FAIL" + struct.pack("<I", len(raw)) + raw


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _kill(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
