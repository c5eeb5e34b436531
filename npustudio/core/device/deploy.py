"""Deploy a bundle to a device: incremental, atomic per file, resumable, with progress.

Files go to `/data/local/tmp/npustudio/<bundle>/`. Each is pushed under a temporary name and renamed
when complete, then recorded in the device-side manifest (`.npustudio-manifest.json`: size, mtime,
sha256; itself pushed under a temporary name and renamed in the same shell line as the files it records).
A file whose size and mtime on the device match the manifest and whose sha256 matches the local file is
skipped, so an unchanged re-push sends nothing and an interrupted deploy resumes at the first file that
was not recorded (files of 8 MB or more are recorded as soon as they land, while the push goes on).

Built to keep up with stock `adb push` over the same adb server (benchmarks/push_bench.py): one `sync:`
connection for the manifest read, the listing and every file; TCP_NODELAY and TCP_QUICKACK (a small
write or reply otherwise waits out a 40 ms delayed ACK); each file is read in 256 KiB blocks that leave
in one `sendmsg` of 64 KiB DATA packets laid out once per buffer, while the block is still in the CPU's
cache (4 MiB blocks, read ahead by a thread, were ~10% slower); a file whose sha256 is not known yet
(the deploy cache, or the project's record of its bundle) is hashed from the blocks already sent, on a
thread of its own, so it is still read once; and, as stock adb does, the device's answer to a file is
read behind the stream by a second thread, so no file waits for a round trip.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import queue
import shlex
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .. import layout
from ..errors import UserError
from ..fsutil import MiB, TooLarge, atomic_write_json, read_at_most, sha256_file
from ..progress import Cancelled, StateLike
from . import REMOTE_ROOT, DeviceInfo, client, compatibility

_MANIFEST_EVERY = 8 * 1024 * 1024  # files at least this large are recorded as soon as they are on the device
SYNC_CHUNK = 64 * 1024  # the sync protocol's largest DATA packet (stock adb sends these too)
_BLOCK = 4 * SYNC_CHUNK  # read and sent at a time: 256 KiB stays in the CPU's cache from the read to the send
_HASH_AHEAD = 16  # blocks sent and not hashed yet, at most
_DATA_FULL = b"DATA" + struct.pack("<I", SYNC_CHUNK)
_RENAMED = "npustudio-renamed"  # the rename line's last word: its absence means a mv failed


class DeployResult(BaseModel):
    device: str
    remote_dir: str
    files: list[dict[str, Any]]
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    rate_mb_s: float


def remote_dir(bundle_dir: Path, suffix: str = "") -> str:
    """The device folder of a bundle (or of another stage's folder, told apart by `suffix`)."""
    name = Path(bundle_dir).resolve().name
    if Path(bundle_dir).resolve().parent.name == layout.STAGES_DIR:  # a project's bundle: name it after the project
        name = Path(bundle_dir).resolve().parents[1].name
    return posixpath.join(REMOTE_ROOT, _safe_name(name) + suffix)


def _safe_name(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("._")
    return keep or "bundle"


def local_files(bundle_dir: Path) -> list[Path]:
    """What the device needs: the bundle's files (with the phone runtime when the bundle carries it), never the
    chat history that `chat --bundle DIR` keeps in a bare bundle folder, nor the unreadable ones it set aside
    (the user's conversations stay on this computer)."""
    def host_only(name: str) -> bool:
        return (name == layout.BUNDLE_RESULT  # the bundle stage's record stays here
                or name == layout.CHAT_HISTORY or fnmatch.fnmatchcase(name, layout.CHAT_HISTORY_ASIDE))

    fix = "Remove the link, or rebuild the bundle with `npustudio bundle`."
    files = folder_files(Path(bundle_dir), host_only, "the bundle", fix,
                         "Build one with `npustudio bundle --project P`.")
    adapters = Path(bundle_dir) / layout.LORA_BUNDLE  # switchable LoRA adapters: a folder of files each
    if adapters.is_symlink():
        raise UserError(f"{adapters} is a link, not the bundle's own adapter folder; nothing was deployed.", fix)
    if adapters.is_dir():
        for sub in sorted(adapters.iterdir()):
            if sub.is_symlink():
                raise UserError(f"{sub} is a link, not one of the bundle's adapters; nothing was deployed.", fix)
            if sub.is_dir() and not sub.name.startswith("."):
                files += folder_files(sub, lambda _n: False, "the bundle's adapter", fix)
    return files


def remote_name(path: Path, root: Path | None) -> str:
    """A file's name in the device folder: its path under `root` (a bundle's adapter files keep their folders),
    else its own name (a runtime library, the metadata's phone copy)."""
    if root is not None and path.is_relative_to(root):
        return path.relative_to(root).as_posix()
    return path.name


def folder_files(folder: Path, host_only: Callable[[str], bool], what: str, link_fix: str,
                 folder_fix: str | None = None) -> list[Path]:
    """The plain files of `folder` that go to a device, less hidden ones and those `host_only` keeps here.

    A link is refused, wherever it points: deploy sends only what the folder itself holds (a link to a file
    outside, e.g. /etc/shadow, would otherwise land on the phone readable by anyone)."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise UserError(f"{folder} cannot be read as {what} ({e.strerror}).", folder_fix or link_fix) from e
    files = []
    for p in entries:
        if p.name.startswith(".") or host_only(p.name):
            continue
        if p.is_symlink():
            raise UserError(f"{p.name} in {what} {folder} is a link (to {os.readlink(p)}), not a file of {what}; "
                            "nothing was deployed.", link_fix)
        if p.is_file():
            files.append(p)
    return files


class _HashCache:
    """sha256 of local files keyed by (size, mtime): a re-deploy does not re-read gigabytes.

    Only a cache: whatever is wrong with its file (damaged, huge, a link, a folder, unwritable) costs hashing again
    and, when it cannot be written, one warning through `warn`; it never turns a finished deploy into a failure."""

    LIMIT = 64 * MiB  # ~400,000 files; the cache forgets files that are gone, so a larger one is not ours

    def __init__(self, warn: Callable[[str], None]) -> None:
        import platformdirs

        self.path = platformdirs.user_cache_path("npustudio") / "sha256.json"
        self.warn = warn
        self.changed = False
        try:  # not through a link (it could name /dev/zero), nor a FIFO
            data = json.loads(read_at_most(self.path, self.LIMIT, follow=False))
        except (OSError, ValueError, RecursionError, UserError, TooLarge):
            data = {}
        self.data: dict[str, list[Any]] = {  # a damaged cache only costs hashing again
            k: v for k, v in (data.items() if isinstance(data, dict) else ()) if isinstance(v, list) and len(v) == 3}

    def cached(self, p: Path, st: os.stat_result) -> str | None:
        """The digest if this file (same size and mtime) was hashed before, else None."""
        hit = self.data.get(str(p.resolve()))
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return str(hit[2])
        return None

    def get(self, p: Path, st: os.stat_result) -> str:
        digest = self.cached(p, st)
        if digest is None:
            digest = sha256_file(p)
            self.put(p, st, digest)
        return digest

    def put(self, p: Path, st: os.stat_result, digest: str) -> None:
        self.data[str(p.resolve())] = [st.st_size, st.st_mtime_ns, digest]
        self.changed = True

    def save(self) -> None:
        """Write it back without the files gone or changed since they were hashed (it would grow forever)."""
        if not self.changed:
            return
        self.data = {k: v for k, v in self.data.items() if _unchanged(k, v)}
        why = ("it is a symbolic link, and NPU Studio never writes through one" if self.path.is_symlink() else
               "it is a folder" if self.path.is_dir() else None)
        if why is None:
            try:
                atomic_write_json(self.path, self.data)
                return
            except (OSError, UserError) as e:
                why = e.problem if isinstance(e, UserError) else str(e.strerror or e)
        self.warn(f"the deploy's hash cache {self.path} was not updated ({why}): the next deploy hashes the files "
                  "again. Remove it and NPU Studio writes a fresh one.")


def _unchanged(path: str, entry: list[Any]) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return entry[:2] == [st.st_size, st.st_mtime_ns]


class _Progress:
    """Bytes, rate and ETA of the push, reported through the state at most every 0.1 s; the cancel point."""

    def __init__(self, state: StateLike, total: int, t0: float) -> None:
        self.state, self.done, self.total, self.t0 = state, 0, total, t0
        self.last = 0.0

    def advance(self, n: int) -> None:
        self.state.check()
        self.done += n
        now = time.perf_counter()
        if now - self.last > 0.1 or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-6)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            self.state.progress(self.done / max(self.total, 1),
                                f"{self.done / 1e6:.0f}/{self.total / 1e6:.0f} MB at {rate / 1e6:.0f} MB/s, "
                                f"ETA {eta:.0f} s")
            self.state.partial("push", bytes=self.done, total=self.total, rate=rate, eta_s=eta)


class _Sync:
    """One `sync:` connection (adbutils opens one per call, each with a server round trip and a 10 ms close).

    TCP_NODELAY: a SEND header, a small file and its DONE are small writes that would otherwise wait out the
    host's 40 ms delayed ACK (the manifest took 45 ms to write). Sends block (a stalled device is given up after
    `_STALL_S`); the reader of the replies is ended by `abort`."""

    def __init__(self, adb: Any, serial: str) -> None:
        self._t = adb.make_connection(timeout=30)
        self._t.send_command(f"host:transport:{serial}")
        self._t.check_okay()
        self._t.send_command("sync:")
        self._t.check_okay()
        self.sock: socket.socket = self._t.conn
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _STALL_S, 0))
        except (OSError, struct.error):
            pass  # a platform without it: a stalled device waits until it is unplugged

    def close(self) -> None:
        """QUIT, then close without adbutils' 10 ms wait (QUIT ends the device's side)."""
        try:
            self.sock.sendall(b"QUIT" + struct.pack("<I", 0))
        except OSError:
            pass
        self.sock.close()

    def abort(self) -> None:
        """Break the connection off, waking a thread blocked reading it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if _QUICKACK is not None:  # ACK at once: the server holds a second small reply (Nagle) until our
                self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)  # ACK of the first, delayed 40 ms
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the device closed the sync connection")
            buf += chunk
        return bytes(buf)

    def _request(self, rid: bytes, path: str) -> None:
        raw = path.encode()
        self.sock.sendall(rid + struct.pack("<I", len(raw)) + raw)

    def stat(self, path: str) -> tuple[int, int, int]:
        """(mode, size, mtime) of a device path; mode 0 where there is nothing."""
        self._request(b"STAT", path)
        head = self._read(16)
        if head[:4] != b"STAT":
            raise ConnectionError(f"unexpected sync reply {head[:4]!r}")
        mode, size, mtime = struct.unpack("<3I", head[4:])
        return mode, size, mtime

    def listdir(self, path: str) -> dict[str, tuple[int, int, int]]:
        """name -> (mode, size, mtime) of a device folder's entries (empty where there is no folder)."""
        self._request(b"LIST", path)
        out: dict[str, tuple[int, int, int]] = {}
        while True:
            head = self._read(20)
            if head[:4] == b"DONE":
                return out
            if head[:4] != b"DENT":
                raise ConnectionError(f"unexpected sync reply {head[:4]!r}")
            mode, size, mtime, n = struct.unpack("<4I", head[4:])
            out[self._read(n).decode("utf-8", errors="replace")] = (mode, size, mtime)

    def recv(self, path: str, limit: int) -> bytes | None:
        """A device file's bytes; None where the device refused (adbd then ends the sync service) or sent more
        than `limit` bytes (the rest is not read: the caller starts a new connection, as after a refusal)."""
        self._request(b"RECV", path)
        data = bytearray()
        while True:
            head = self._read(8)
            rid, n = head[:4], struct.unpack("<I", head[4:])[0]
            if rid == b"DATA":
                data += self._read(n)
                if len(data) > limit:
                    return None
            elif rid == b"DONE":
                return bytes(data)
            elif rid == b"FAIL":
                self._read(n)
                return None
            else:
                raise ConnectionError(f"unexpected sync reply {rid!r}")

    def reply(self) -> str | None:
        """The device's answer to a SEND: None for OKAY, else its message."""
        head = self._read(8)
        rid, n = head[:4], struct.unpack("<I", head[4:])[0]
        if rid == b"OKAY":
            return None
        return self._read(n).decode("utf-8", errors="replace") if n and rid == b"FAIL" else rid.decode("latin-1")

    def send_bytes(self, data: bytes, dst: str, mode: int = 0o644) -> None:
        """A small file in one write, waiting for the device's answer."""
        self.sock.sendall(b"".join(_small_file(data, dst, mode)))
        refusal = self.reply()
        if refusal is not None:
            raise _Refused(dst, refusal)


_STALL_S = 30  # a send that makes no progress for this long means the device is gone
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux; it does not stick, so set before each read


@dataclass
class _Item:
    """One file to push."""

    name: str
    path: Path
    size: int
    mtime_ns: int
    digest: str | None  # None: hashed while it is read for the push
    tmp: str
    mode: int
    record: bool  # renamed and recorded as soon as the device has it (not only at the end)


class _Buffer:
    """A block's memory, reused, with its DATA packets laid out once: a full block leaves in one `sendmsg` of
    these pieces, without a Python loop over its 64 packets (that loop held the GIL the virtual device needs)."""

    def __init__(self) -> None:
        self.data = bytearray(_BLOCK)
        view = memoryview(self.data)
        self.frames: list[bytes | memoryview] = []
        for off in range(0, _BLOCK, SYNC_CHUNK):
            self.frames += [_DATA_FULL, view[off:off + SYNC_CHUNK]]

    def packets(self, n: int) -> list[bytes | memoryview]:
        """DATA packets of the first `n` bytes."""
        if n == _BLOCK:
            return self.frames
        view, out = memoryview(self.data), list[bytes | memoryview]()
        for off in range(0, n, SYNC_CHUNK):
            piece = view[off:min(off + SYNC_CHUNK, n)]
            out += [b"DATA" + struct.pack("<I", len(piece)), piece]
        return out


class _Hasher:
    """sha256 of the blocks already sent, on a thread of its own: a file pushed for the first time is still read
    once, and its hashing (2 GB/s on one core) does not hold up the socket. The sender takes its buffers from
    here while it hashes; each comes back once hashed, so the hasher lags the socket by `_HASH_AHEAD` at most."""

    def __init__(self) -> None:
        self.free: queue.Queue[_Buffer] = queue.Queue()
        self.made = 0  # made as needed: a small file needs one (each is a block to zero)
        self.jobs: queue.Queue[tuple[Any, _Buffer | None, int] | None] = queue.Queue()
        self.digests: queue.Queue[str] = queue.Queue()
        self.h = hashlib.sha256()
        threading.Thread(target=self._run, name="deploy-hash", daemon=True).start()

    def buffer(self) -> _Buffer:
        if self.free.empty() and self.made < _HASH_AHEAD:
            self.made += 1
            return _Buffer()
        return self.free.get()

    def begin(self) -> None:
        """A new file: the blocks added from now on are its."""
        self.h = hashlib.sha256()

    def add(self, buf: _Buffer, n: int) -> None:
        """Hash the first `n` bytes of `buf` into the file's digest, then give the buffer back."""
        self.jobs.put((self.h, buf, n))

    def digest(self) -> str:
        """The file's sha256, once every block added is in it."""
        self.jobs.put((self.h, None, 0))
        return self.digests.get()

    def close(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            h, buf, n = job
            if buf is None:
                self.digests.put(h.hexdigest())
            else:
                h.update(memoryview(buf.data)[:n])
                self.free.put(buf)


def _fill(f: Any, buf: _Buffer) -> int:
    """Read up to a block into `buf` (fewer bytes only at the end of the file)."""
    view, n = memoryview(buf.data), 0
    while n < _BLOCK and (got := f.readinto(view[n:])):
        n += got
    return n


def _sendmsg_all(sock: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
    """Every piece, in as few syscalls as the socket takes (one, usually): a block's 64 DATA packets and their
    headers go out without being copied into one buffer."""
    if not hasattr(sock, "sendmsg"):  # Windows
        sock.sendall(b"".join(pieces))
        return
    n = sock.sendmsg(pieces[:1000])  # IOV_MAX is 1024
    if n == sum(map(len, pieces)):
        return
    views, i = [memoryview(p) for p in pieces], 0  # sent in part: go on from where it stopped
    while True:
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if i == len(views):
            return
        if n:
            views[i] = views[i][n:]
        n = sock.sendmsg(views[i:i + 1000])


class _Refused(UserError):
    """The device answered FAIL to a file (adbd then ends the sync service)."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"The device refused {posixpath.basename(name)}: {why}.",
                         "Check free space and permissions under /data/local/tmp.")


@dataclass
class _Sent:
    """A file whose DONE has gone out: the finisher reads the device's answer to it."""

    name: str
    tmp: str
    entry: dict[str, Any] | None  # its manifest record; None for the manifest itself
    checkpoint: bool = False  # rename and record it (and what came before) as soon as the device has it


class _Finisher:
    """Reads the device's answer to each pushed file behind the stream, as stock adb does, so no file waits for a
    round trip; at a checkpoint (a large file landed) renames what arrived and records it in the manifest, over
    connections of its own while the stream goes on, so that what finished survives a deploy that breaks off."""

    def __init__(self, adb: Any, sync: _Sync, serial: str, rdir: str, manifest: dict[str, Any]) -> None:
        self.adb, self.sync, self.serial, self.rdir, self.manifest = adb, sync, serial, rdir, manifest
        self.jobs: queue.Queue[_Sent | None] = queue.Queue()
        self.pending: list[tuple[str, str]] = []  # (name, temporary name): on the device, not yet renamed
        self.error: BaseException | None = None
        self._own: _Sync | None = None
        self._thread = threading.Thread(target=self._run, name="deploy-finish", daemon=True)
        self._thread.start()

    def expect(self, sent: _Sent) -> None:
        self.jobs.put(sent)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> list[tuple[str, str]]:
        """Wait for the answers to everything sent; what is still to rename, in the order it was sent."""
        self.jobs.put(None)
        self._thread.join()
        self.check()
        return self.pending

    def stop(self) -> BaseException | None:
        """After the push broke off: let a checkpoint under way complete (the sync connection is closed, so no
        more answers come); what went wrong here, if anything."""
        self.jobs.put(None)
        self._thread.join(10)
        return self.error

    def _run(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                refusal = self.sync.reply()
                if refusal is not None:
                    raise _Refused(job.name, refusal)
                self.pending.append((job.name, job.tmp))
                if job.entry is not None:
                    self.manifest[job.name] = job.entry
                if job.checkpoint:
                    if self._own is None:
                        self._own = _Sync(self.adb, self.serial)
                    tmp = _manifest_tmp(self.rdir, "checkpoint")
                    self._own.send_bytes(_manifest_bytes(self.manifest), tmp)
                    _rename(self.adb, self.serial, self.rdir, [*self.pending, (layout.DEVICE_MANIFEST, tmp)])
                    self.pending = []
        except BaseException as e:
            self.error = e
        finally:
            if self._own is not None:
                self._own.close()


def _push(sync: _Sync, items: list[_Item], finisher: _Finisher, progress: _Progress, hashes: _HashCache,
          manifest: dict[str, Any], rdir: str) -> int:
    """Stream every file over `sync`, then the manifest that records them all (under a temporary name: it is
    renamed with the files); returns the bytes of the files. The device's answers are read by `finisher`."""
    manifest = dict(manifest)
    own = _Buffer()  # a file whose digest is known is read into this one block after block
    hasher = _Hasher() if any(it.digest is None for it in items) else None
    sent = 0
    try:
        for it in items:
            fd = os.open(it.path, os.O_RDONLY | os.O_NOFOLLOW)  # a link swapped in is refused
            with open(fd, "rb", buffering=0) as f:
                hashing = hasher if it.digest is None else None
                if hashing is not None:
                    hashing.begin()
                head: list[bytes | memoryview] = [_send_header(it.tmp, it.mode)]
                total = 0
                while True:
                    buf = hashing.buffer() if hashing is not None else own
                    n = _fill(f, buf)
                    total += n
                    pieces = [*head, *buf.packets(n)]
                    head = []
                    last = n < _BLOCK
                    if last:
                        st = os.fstat(fd)
                        if total != it.size or st.st_size != it.size or st.st_mtime_ns != it.mtime_ns:
                            raise UserError(f"{it.name} changed while it was pushed.", "Deploy again.")
                        mtime = int(time.time())
                        pieces.append(b"DONE" + struct.pack("<I", mtime))
                    finisher.check()
                    _sendmsg_all(sync.sock, pieces)
                    if hashing is not None:
                        hashing.add(buf, n)
                    sent += n
                    progress.advance(n)
                    if last:
                        break
            digest = hashing.digest() if hashing is not None else it.digest
            assert digest is not None
            if hashing is not None:
                hashes.put(it.path, st, digest)
            manifest[it.name] = {"size": it.size, "mtime": mtime, "sha256": digest}
            finisher.expect(_Sent(it.name, it.tmp, manifest[it.name], it.record))
        tmp = _manifest_tmp(rdir, "end")  # everything is out: the manifest that records it follows
        _sendmsg_all(sync.sock, _small_file(_manifest_bytes(manifest), tmp, 0o644))
        finisher.expect(_Sent(layout.DEVICE_MANIFEST, tmp, None))
        return sent
    finally:
        if hasher is not None:
            hasher.close()


def _send_header(dst: str, mode: int) -> bytes:
    spec = f"{dst},{stat.S_IFREG | mode}".encode()
    return b"SEND" + struct.pack("<I", len(spec)) + spec


def _small_file(data: bytes, dst: str, mode: int) -> list[bytes]:
    """SEND, DATA packets and DONE of a file held in memory."""
    out = [_send_header(dst, mode)]
    for off in range(0, len(data), SYNC_CHUNK):
        piece = data[off:off + SYNC_CHUNK]
        out += [b"DATA" + struct.pack("<I", len(piece)), piece]
    return [*out, b"DONE" + struct.pack("<I", int(time.time()))]


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()


def _manifest_tmp(rdir: str, which: str) -> str:
    """The manifest's temporary names: one for the checkpoints during a push, one for its end (both may be in
    flight at once)."""
    return posixpath.join(rdir, f"{layout.DEVICE_MANIFEST}.{which}.part")


def deploy(bundle_dir: Path, dev: DeviceInfo, state: StateLike, force: bool = False,
           recorded: dict[str, tuple[int, int, str]] | None = None) -> DeployResult:
    """Push the bundle's files that the device lacks. `recorded`: name -> (size, mtime_ns, sha256) as a project
    recorded its bundle's files; a file still at that size and mtime is not hashed again."""
    bundle_dir = Path(bundle_dir)
    files = local_files(bundle_dir)  # refused before any byte moves, as are:
    problems = compatibility(dev, bundle_dir)
    if problems:
        raise UserError(" ".join(p for p, _ in problems), " ".join(f for _, f in problems))
    with tempfile.TemporaryDirectory(prefix="npustudio-deploy-") as scratch:
        # the virtual device is this computer: its CPU preview reads the project's graphs by their path
        keep = frozenset({"project_compile_dir"}) if dev.virtual else frozenset()
        files = [_for_phone(p, Path(scratch), keep) if p.name == layout.METADATA else p for p in files]
        recorded = dict(recorded or {})
        for p in files:  # the phone's metadata copy: digested here (a few KB), never hashed by path into the cache
            if p.parent == Path(scratch):
                st = p.stat()
                recorded[p.name] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        return deploy_files(files, remote_dir(bundle_dir), dev, state, force, recorded, root=bundle_dir)


def _for_phone(metadata: Path, scratch: Path, keep: frozenset[str] = frozenset()) -> Path:
    """The bundle's metadata.json as the phone gets it: a copy in `scratch` without this computer's paths, or the
    file itself when it holds none."""
    from ..genie.meta import phone_metadata

    raw = json.loads(metadata.read_text(encoding="utf-8"))  # a JSON object: compatibility() read it
    clean = phone_metadata(raw, keep)
    if clean == raw:
        return metadata
    copy = scratch / layout.METADATA
    atomic_write_json(copy, clean)
    return copy


def deploy_files(files: list[Path], rdir: str, dev: DeviceInfo, state: StateLike, force: bool = False,
                 recorded: dict[str, tuple[int, int, str]] | None = None, root: Path | None = None
                 ) -> DeployResult:
    """Push `files` (distinct names) into the device folder `rdir` as a bundle's are: what the device lacks, each
    file atomically, the manifest last. A file under `root` keeps its folders there (`remote_name`)."""
    adb = client(ping=False)  # `dev` was just read from the server
    hashes = _HashCache(lambda message: state.partial("warning", message=message))
    sync: _Sync | None = None
    try:
        sync = _Sync(adb, dev.serial)
        remote_manifest, readable = _read_manifest(sync, rdir)
        if not readable:  # adbd ends the sync service after a refused RECV
            sync.abort()
            sync = _Sync(adb, dev.serial)
        on_device = sync.listdir(rdir)
        for sub in sorted({posixpath.dirname(remote_name(p, root)) for p in files} - {""}):
            on_device |= {posixpath.join(sub, n): e for n, e in sync.listdir(posixpath.join(rdir, sub)).items()}
    except UserError:
        raise
    except Exception as e:
        if sync is not None:
            sync.abort()
        raise UserError(f"Device {dev.serial} stopped answering ({e}).", "Reconnect it and deploy again: "
                        "finished files are kept.") from e

    todo: list[_Item] = []
    rows, skipped = [], 0
    for p in files:
        st, name = p.stat(), remote_name(p, root)
        known = (recorded or {}).get(name)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns) and hashes.cached(p, st) != known[2]:
            hashes.put(p, st, known[2])
        have, there = remote_manifest.get(name), on_device.get(name)
        same = (not force and have is not None and there is not None and there[1] == st.st_size == have["size"]
                and there[2] == have["mtime"] and have.get("sha256") == hashes.get(p, st))  # hashed only then
        if same:
            skipped += st.st_size
            rows.append({"file": name, "bytes": st.st_size, "sent": False})
        else:
            mode = 0o644 if name.endswith((".json", ".txt", ".bin")) else 0o755
            todo.append(_Item(name, p, st.st_size, st.st_mtime_ns, hashes.cached(p, st),
                              posixpath.join(rdir, posixpath.dirname(name), f".{posixpath.basename(name)}.part"),
                              mode, st.st_size >= _MANIFEST_EVERY))
    if todo:
        todo[-1].record = False  # the last file is recorded at the end, with the small ones
    total = sum(it.size for it in todo)
    t0 = time.perf_counter()
    sent = 0
    finisher: _Finisher | None = None
    try:
        if todo:
            finisher = _Finisher(adb, sync, dev.serial, rdir, dict(remote_manifest))
            sent = _push(sync, todo, finisher, _Progress(state, total, t0), hashes, remote_manifest, rdir)
            _rename(adb, dev.serial, rdir, finisher.finish())  # the files, then the manifest that records them
            rows += [{"file": it.name, "bytes": it.size, "sent": True} for it in todo]
        sync.close()
    except BaseException as e:
        sync.abort()
        why = finisher.stop() if finisher is not None else None
        if isinstance(why, _Refused) and why is not e and not isinstance(e, Cancelled):
            raise why from e  # the device refused a file, then closed the connection: that is the news
        if isinstance(e, (UserError, Cancelled)) or not isinstance(e, Exception):
            raise
        raise UserError(f"The push to {dev.serial} broke off ({e}).",
                        "Reconnect the device and run the same deploy again: it resumes where it stopped.") from e
    finally:
        hashes.save()
    secs = time.perf_counter() - t0
    state.progress(1.0, f"deployed to {dev.serial}:{rdir}")
    return DeployResult(device=dev.serial, remote_dir=rdir, files=sorted(rows, key=lambda r: r["file"]),
                        bytes_sent=sent, bytes_skipped=skipped, seconds=round(secs, 3),
                        rate_mb_s=round(sent / 1e6 / secs, 1) if sent and secs > 0 else 0.0)


_MANIFEST_LIMIT = 64 * MiB  # a manifest is ~150 bytes a file; more is not one (a damaged or hostile device)


def _read_manifest(sync: _Sync, rdir: str) -> tuple[dict[str, Any], bool]:
    """The device-side manifest ({} where there is none or it is damaged: that only costs a full re-push), and
    whether the connection is still usable."""
    path = posixpath.join(rdir, layout.DEVICE_MANIFEST)
    if not stat.S_ISREG(sync.stat(path)[0]):
        return {}, True
    raw = sync.recv(path, _MANIFEST_LIMIT)
    if raw is None:
        return {}, False
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return {}, True
    return ({k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}), True


_LINE_MAX = 3000  # bytes of one shell line (older adbd take 4 KiB service names)


def _rename(adb: Any, serial: str, rdir: str, pending: list[tuple[str, str]]) -> None:
    """Give the pushed files their names: one shell call for all (more only past `_LINE_MAX`), each name quoted,
    never spliced into the line; the line ends with an echo, so a mv that failed is noticed."""
    moves = [f"mv -f {shlex.quote(tmp)} {shlex.quote(posixpath.join(rdir, name))}" for name, tmp in pending]
    while moves:
        line: list[str] = []
        while moves and (not line or sum(len(m) + 4 for m in line) + len(moves[0]) < _LINE_MAX):
            line.append(moves.pop(0))
        out = _shell(adb, serial, " && ".join([*line, f"echo {_RENAMED}"]))
        if not out:  # not even an error message: the device went away
            raise ConnectionError("the device closed the shell without an answer")
        if _RENAMED not in out:
            raise UserError(f"The device could not rename the pushed files: {out.strip() or 'no answer'}.",
                            "Check free space and permissions under /data/local/tmp, then deploy again.")


def _shell(adb: Any, serial: str, line: str) -> str:
    """A shell command's output, on one connection (adbutils' shell costs two and a 10 ms close)."""
    c = adb.make_connection(timeout=60)
    try:
        c.send_command(f"host:transport:{serial}")
        c.check_okay()
        c.send_command(f"shell:{line}")
        c.check_okay()
        out = bytearray()
        while True:
            if _QUICKACK is not None:
                c.conn.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
            if not (chunk := c.conn.recv(65536)):
                break
            out += chunk
        return out.decode("utf-8", errors="replace")
    finally:
        c.conn.close()
