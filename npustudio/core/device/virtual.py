"""The virtual device: the device side of the adb transport, for the real adb server to `adb connect` to.

A product feature (shown as "virtual" in device lists) and the test rig. It is a phone, not a door into
this computer: it listens on 127.0.0.1 only; it asks for adb's RSA authentication (AUTH TOKEN, then the
host's signature checked against this user's adb keys, `adbauth`) before it answers anything; its
`shell:` is a small interpreter of phone commands written in Python (`phone_shell`, `phone_commands`),
never a host shell; and every path, in the shell and in `sync:`, is a device path resolved inside the
sandbox folder that stands for the phone's file system (`/data/local/tmp` is the only writable place, as
for a phone's shell user; `..` above its root and links that lead out of it are refused).

The wire protocol (aosp adb/protocol.txt, SYNC.TXT): CNXN with no features, so the host uses legacy
`shell:` and sync v1; OPEN/OKAY/WRTE/CLSE streams where every WRTE is acknowledged before the next;
`sync:` serves STAT, LIST, SEND (DATA <= 64 KiB, DONE + mtime), RECV and QUIT. `getprop` answers the
configured props (SM8750, Android 15 by default), `genie-t2t-run` is the desktop runner (real Genie on
the HTP simulator, or the fast preview when the device was started in preview mode) and `llm_demo` is MNN's
runtime on this computer (`mnn.llm_demo`).
"""

from __future__ import annotations

import itertools
import os
import posixpath
import queue
import re
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from ..targets import DEFAULT_SOC, find_soc
from . import adbauth, confine, phone_commands, phone_shell
from .phone_shell import HOME, Program

A_CNXN, A_OPEN, A_OKAY, A_CLSE, A_WRTE, A_AUTH = 0x4E584E43, 0x4E45504F, 0x59414B4F, 0x45534C43, 0x45545257, 0x48545541
A_VERSION = 0x01000001
MAX_PAYLOAD = 256 * 1024
SYNC_DATA_MAX = 64 * 1024
SYNC_PATH_MAX = 1024
VIRTUAL_DEVICE_NAME = "npustudio_virtual"
RUNNER_PROP = "ro.npustudio.runner"  # how the virtual device answers: "genie" (HTP simulator) or "preview" (CPU)
RESERVED_PORTS = range(5554, 5586)  # the adb server scans these for emulators
RUNTIMES = ("genie-t2t-run", "llm_demo")  # a phone's runtime programs, answered by this computer's stand-ins
# a locale name, never a path: glibc reads a locale named by a path from that file
_LOCALE = re.compile(r"C|POSIX|[A-Za-z]{2,8}(_[A-Za-z0-9]{2,8})?(\.[A-Za-z0-9-]{1,20})?(@[A-Za-z0-9]{1,20})?")


def default_props(soc_name: str = DEFAULT_SOC) -> dict[str, str]:
    s = find_soc(soc_name)
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
        self.online = False  # the host proved it holds an allowed key
        self.token: bytes | None = None
        self.failed_auths = 0

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
                if magic != cmd ^ 0xFFFFFFFF or length > MAX_PAYLOAD:
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

    def _ask_for_auth(self) -> None:
        self.token = adbauth.new_token()
        self.send(A_AUTH, adbauth.AUTH_TOKEN, 0, self.token)

    def _handle(self, cmd: int, a0: int, a1: int, data: bytes) -> None:
        if cmd == A_CNXN:
            self.max_payload = min(a1, MAX_PAYLOAD)
            if self.online:
                self.send(A_CNXN, A_VERSION, MAX_PAYLOAD, self.device.banner().encode())
            else:
                self._ask_for_auth()
        elif cmd == A_AUTH:
            if self.online or a0 != adbauth.AUTH_SIGNATURE:
                return  # AUTH RSAPUBLICKEY: a phone would ask its user; this one trusts only the user's adb keys
            if self.token is not None and adbauth.verify(self.token, data, adbauth.allowed_keys()):
                self.online, self.token = True, None
                self.send(A_CNXN, A_VERSION, MAX_PAYLOAD, self.device.banner().encode())
            else:  # the host tries its next key on a new token, then sends its public key and gives up
                self.failed_auths += 1
                if self.failed_auths > 16:
                    raise ConnectionError("too many failed signatures")
                self._ask_for_auth()
        elif not self.online:
            raise ConnectionError("not authenticated")  # nothing is served before AUTH
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
        """A fault in the device's own code is said on the stream: an empty answer would look like success."""
        try:
            handler(stream)
        except Exception as e:  # any fault of a service ends only that stream, said to its reader
            stream.write(f"virtual device: internal error ({type(e).__name__}: {e}); the command did not run to its "
                         "end. Please report it with the device log.\n".encode())
            raise
        finally:
            stream.close()


class VirtualDevice:
    """A loopback adb device. `start()` listens on 127.0.0.1:`port` (0 = any free port outside 5554-5585)."""

    def __init__(self, root: Path, port: int = 0, soc_name: str = DEFAULT_SOC, preview: bool = False,
                 props: dict[str, str] | None = None, programs: dict[str, Program] | None = None) -> None:
        """`programs` adds to or replaces the shell's commands (name -> Python callable, or a host argv the
        device runs in its sandbox); tests put a scripted genie-t2t-run there."""
        if port in RESERVED_PORTS:
            raise UserError(f"Port {port} is one the adb server scans for emulators.",
                            "Pick a port outside 5554-5585.")
        self.root = Path(root).resolve()
        self.port, self.preview = port, preview
        self.props = default_props(soc_name) | {RUNNER_PROP: "preview" if preview else "genie"} | (props or {})
        self.programs: dict[str, Program] = phone_commands.commands() | (programs or {})
        self.processes: dict[int, subprocess.Popen[bytes]] = {}  # device pid -> host child, for `kill`
        self._pids = itertools.count(1000)
        self.stopping = threading.Event()
        self._server: socket.socket | None = None
        self._connections: list[_Connection] = []
        self.unconfined = confine.why_not()  # None: every host program runs confined to the sandbox (`confine`)

    @property
    def notice(self) -> str | None:
        """What a person starting this device must know: its programs cannot be confined on this computer."""
        if self.unconfined is None:
            return None
        return (f"The virtual device's programs run unconfined: {self.unconfined}. Device paths are still checked "
                "one by one, but a runtime may open files its config names outside the sandbox.")

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
        for proc in list(self.processes.values()):
            _kill(proc)

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
        for folder in ("bin", "lib64"):
            (self.root / "system" / folder).mkdir(parents=True, exist_ok=True)
        for stale in ("bin/getprop", "bin/genie-t2t-run", "build.prop"):  # shell scripts of earlier versions
            (self.root / "system" / stale).unlink(missing_ok=True)

    def host_path(self, device_path: str, cwd: str = "/", follow: bool = True) -> Path:
        """The sandbox file a device path names (relative ones from `cwd`). PermissionError where it would
        leave the sandbox: `..` above its root, or a link on the way (the last one too, with `follow`)
        that leads out of it."""
        if "\0" in device_path:
            raise PermissionError(device_path)
        parts: list[str] = []
        for comp in posixpath.join(cwd, device_path).split("/"):
            if comp == "..":
                if not parts:
                    raise PermissionError(device_path)
                parts.pop()
            elif comp not in ("", "."):
                parts.append(comp)
        p = self.root.joinpath(*parts)
        follow = follow or device_path.endswith(("/", "/.", "/..")) or not parts  # "link/" names its target
        try:
            real = p.resolve() if follow else p.parent.resolve() / p.name
        except (OSError, RuntimeError) as e:  # a link loop
            raise PermissionError(device_path) from e
        if real != self.root and self.root not in real.parents:
            raise PermissionError(device_path)
        return real

    def confined(self, argv: list[str], cwd: Path, readable: tuple[Path, ...] = ()) -> list[str]:
        """`argv` as the device runs it: inside the sandbox at the operating-system level where it can be, with
        `readable` folders of this computer (chosen by this computer's code, never by a device line) read-only."""
        if self.unconfined is not None:
            return argv
        return confine.command(argv, self.root, self.root / "data" / "local" / "tmp", cwd, readable)

    def writable(self, p: Path, itself: bool = True) -> bool:
        """Whether the shell user may change this sandbox path: /data/local/tmp (`itself`) and below."""
        tmp = self.root / "data" / "local" / "tmp"
        return (itself and p == tmp) or tmp in p.parents

    def base_env(self) -> dict[str, str]:
        """The environment of the device's shell, in device paths: nothing of this computer's."""
        return {"HOME": HOME, "PATH": "/system/bin", "LD_LIBRARY_PATH": "/system/lib64", "TMPDIR": HOME}

    def host_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment of a host child the device starts, built from an allow-list, never copied from the
        device's: HOME and TMPDIR as sandbox folders, a fixed PATH, and well-formed LANG/LC_* values. A device line
        can set anything (and push any file), so LD_*, PYTHON*, QNN_SDK_ROOT and the rest would let it load its own
        code into a process on this computer; on the device side they keep their meaning (`env` shows them)."""
        home = str(self.host_path(HOME))
        out = {"HOME": self._inside(env.get("HOME", HOME), home), "TMPDIR": self._inside(env.get("TMPDIR", HOME), home),
               "PATH": str(self.host_path("/system/bin"))}
        out |= {k: v for k, v in env.items() if (k == "LANG" or k.startswith("LC_")) and _LOCALE.fullmatch(v)}
        return out

    def _inside(self, device_path: str, default: str) -> str:
        """The sandbox folder a device path names, or `default` for one that is not an absolute path inside it."""
        if not device_path.startswith("/"):
            return default
        try:
            return str(self.host_path(device_path))
        except PermissionError:
            return default

    def new_pid(self) -> int:
        return next(self._pids)

    def lookup(self, name: str, cwd: str) -> tuple[Program | None, int]:
        """The program a command name runs, else the shell's status for it (127 not found, 126 not allowed).
        A file is never run: a bundle's own genie-t2t-run or an MNN model folder's own llm_demo (for a phone's CPU) is
        answered by the device's."""
        if "/" not in name:
            prog = self.programs.get(name)
            return (prog, 0) if prog is not None else (None, 127)
        path = posixpath.normpath(posixpath.join(cwd, name))
        base = posixpath.basename(path)
        if posixpath.dirname(path) == "/system/bin" and base in self.programs:
            return self.programs[base], 0
        try:
            p = self.host_path(path)
        except PermissionError:
            return None, 126
        if not p.exists():
            return None, 127
        if base in RUNTIMES and p.is_file():
            return self.programs[base], 0
        return None, 126

    # -- services ----------------------------------------------------------------------------
    def service(self, name: str) -> Callable[[_Stream], None] | None:
        if name.startswith("shell:"):
            command = name[len("shell:"):]
            return lambda s: phone_shell.serve(self, command, s.write, s.inbox, s.closed)
        if name == "sync:":
            return self._sync
        return None

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
            if length > SYNC_PATH_MAX:
                s.write(_fail("path too long"))
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
            st = os.lstat(self.host_path(path, follow=False))  # adbd's STAT is an lstat
        except OSError:
            return struct.pack("<3I", 0, 0, 0)
        return struct.pack("<3I", st.st_mode & 0xFFFFFFFF, min(st.st_size, 0xFFFFFFFF), int(st.st_mtime))

    def _list(self, path: str) -> bytes:
        out = bytearray()
        try:
            folder = self.host_path(path)
            names = [".", "..", *sorted(os.listdir(folder))]
        except OSError:
            folder, names = Path(), []  # nothing listed, not even . and ..
        for name in names:
            try:
                st = os.lstat(folder / name)
            except OSError:
                continue
            raw = name.encode()
            out += b"DENT" + struct.pack("<4I", st.st_mode & 0xFFFFFFFF, min(st.st_size, 0xFFFFFFFF),
                                         int(st.st_mtime), len(raw)) + raw
        return bytes(out + b"DONE" + b"\0" * 16)

    def _recv(self, s: _Stream, path: str) -> bool:
        try:
            f = open(self.host_path(path), "rb")
        except OSError as e:
            return s.write(_fail(f"open failed: {getattr(e, 'strerror', None) or 'permission denied'}"))
        with f:
            while chunk := f.read(SYNC_DATA_MAX):
                if not s.write(b"DATA" + struct.pack("<I", len(chunk)) + chunk):
                    return False
        return s.write(b"DONE" + struct.pack("<I", 0))

    def _send(self, s: _Stream, spec: str, need: Callable[[int], bytes | None]) -> bool:
        """A file under /data/local/tmp (mode without set-id bits); links and other places are refused."""
        path, _, mode_s = spec.rpartition(",")
        full_mode = int(mode_s) if mode_s.isdigit() else stat.S_IFREG | 0o644
        mode = full_mode & 0o777
        why = "permission denied"
        try:
            target: Path | None = self.host_path(path or spec, follow=False)
        except PermissionError:
            target = None
        if target is not None and not self.writable(target, itself=False):
            target = None
        elif target is not None and (stat.S_ISLNK(full_mode) or target.is_dir()):
            target, why = None, "links are not supported on the virtual device" if stat.S_ISLNK(full_mode) \
                else "is a directory"
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
                        return s.write(_fail(f"cannot write {path}: {why}"))
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


def _kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
