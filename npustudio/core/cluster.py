"""Run one heavy stage on a Ray cluster and bring its folder back as if it had run here.

Why: a 1B-4B model's calibration and compilation outgrow a laptop. The stage runs in a Ray actor through the same
entry point as a local run. Nothing assumes a shared file system: the stage's input folders travel to the worker
in chunks, each checked by its SHA-256 on arrival, and the output folder comes back the same way into the local
scratch folder that the project swaps in atomically. Progress, partial results and cancel are the `State`'s,
pulled across the cluster a few times a second (Ray Client has no streaming actor methods).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import platform
import shutil
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import stages
from .errors import UserError
from .progress import Cancelled, State, StateLike

CHUNK = 16 * 2**20  # bytes per transfer call
WINDOW = 4  # chunks in flight each way: at most 64 MiB of a file in memory on either side
POLL_S = 0.2  # how often the stage's events are pulled
REACH_S = 5.0  # an unreachable address is told within this (plus Ray's own connect)
HANDSHAKE_S = 3.0  # a listener that does not answer a gRPC handshake within this is not a Ray head
# a Ray head's GCS (and Ray Client's server) speak gRPC: HTTP/2, whose server answers a client's connection
# preface with a SETTINGS frame first. Ray itself retries for ever against anything else that listens
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS
H2_SETTINGS = 4
START_S = 120.0  # a worker that cannot be placed this long is reported, not waited for
STOP_S = 60.0  # after a cancel, how long the stage has to reach its next safe point
IDLE_S = 120.0  # a worker kept for a next stage ends itself after this long unused
VERSIONED = ("npustudio", "torch", "aimet-torch", "onnxruntime-qnn", "transformers", "ray")

StageFn = Callable[[dict[str, Path], Any, Path, StateLike], dict[str, Any]]


@dataclass(frozen=True)
class Cluster:
    """Where heavy stages go: a Ray cluster's address; `install`: Ray's runtime_env installs this computer's
    versions of NPU Studio's requirements (`pins()`) on the workers first (they need their package index)."""

    address: str
    install: bool = False

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True)
class Job:
    """One stage for the cluster: `fn(inputs, args, out, state)` (module-level, importable on the workers) with
    `inputs` the local folders (or some files of one folder) it reads, by name; each arrives on the worker as a
    folder of that name. `device` is the stage's torch device choice: cuda (or auto on a cluster with GPUs) asks
    for a GPU worker."""

    stage: str
    fn: StageFn
    inputs: Mapping[str, Path | list[Path]]
    args: Any
    device: str = "cpu"


def versions() -> dict[str, str]:
    """What must match between this computer and the workers for a stage to give the same files."""
    from importlib import metadata

    found = {"python": ".".join(platform.python_version_tuple()[:2])}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def pins() -> list[str]:
    """NPU Studio's requirements at the versions installed here; the window's Qt is left out (workers show none)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires("npustudio") or []:
        req = Requirement(text)
        if req.marker is None and not req.name.lower().startswith(("pyside6", "pyqtgraph")):
            out.append(f"{req.name}=={metadata.version(req.name).split('+')[0]}")
    return out


def host_port(address: str) -> tuple[str, int]:
    """`HOST:PORT` or `ray://HOST:PORT` (Ray Client), else a UserError saying what is expected (a URL such as
    http://HOST:PORT is named as one: its scheme would otherwise be looked up as a host)."""
    rest = address.strip().removeprefix("ray://")
    if "://" in rest or "/" in rest:  # http://HOST:8265 (the dashboard's URL) otherwise reached DNS as a host name
        raise UserError(f"{address!r} is a URL; a Ray cluster address is HOST:PORT, not a URL.",
                        "Give HOST:PORT as `ray start --head` printed it (e.g. 10.0.0.5:6379, the GCS port, not the "
                        "dashboard's 8265), or ray://HOST:10001 for Ray Client.")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{address!r} is not a Ray cluster address.",
                        "Give HOST:PORT as `ray start --head` printed it (e.g. 10.0.0.5:6379), or ray://HOST:10001 "
                        "for Ray Client.")
    return host.strip("[]"), int(port)


def check_reachable(address: str) -> None:
    """A clear UserError within `REACH_S` when nothing answers at `address` (Ray itself retries for a minute),
    and within `HANDSHAKE_S` more when something answers that is no Ray head (Ray would retry for ever)."""
    host, port = host_port(address)
    try:
        conn = socket.create_connection((host, port), timeout=REACH_S)
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        raise UserError(f"Cannot reach a Ray cluster at {address} ({why}).",
                        f"Check that the head runs there (`ray status --address {host}:{port}` on it) and that "
                        f"port {port} is open from this computer; start one with `ray start --head "
                        f"--port={port}`.") from e
    with conn:
        wrong = _not_grpc(conn)
    if wrong:
        client = address.strip().startswith("ray://")
        raise UserError(f"{address} answers, but not as a {'Ray Client server' if client else 'Ray head'} "
                        f"({wrong}).",
                        "Give the address `ray start --head` printed: HOST:PORT of the head's GCS (6379 unless "
                        "--port said otherwise; the dashboard's 8265 is not it), or ray://HOST:10001 for Ray Client.")


def _not_grpc(conn: socket.socket) -> str | None:
    """None when the listener on `conn` answers an HTTP/2 connection preface with a SETTINGS frame, as a gRPC
    server does at once; else what it did instead, in words."""
    deadline = time.monotonic() + HANDSHAKE_S
    got = b""
    try:
        conn.sendall(H2_PREFACE)
        while len(got) < 9:  # a frame header: length (3), type, flags, stream id (4)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            data = conn.recv(9 - len(got))
            if not data:
                return f"it closed the connection after {len(got)} bytes" if got else "it closed the connection"
            got += data
    except TimeoutError:
        pass
    except OSError as e:
        return f"the connection failed: {(e.strerror or str(e)).lower()}"
    if not got:
        return f"it sent nothing in {HANDSHAKE_S:g} s"
    if len(got) == 9 and got[3] == H2_SETTINGS and int.from_bytes(got[5:9], "big") & 0x7FFFFFFF == 0:
        return None
    if got.startswith(b"HTTP/"):
        with contextlib.suppress(OSError):  # the rest of an HTTP/1 status line, for the message
            conn.settimeout(0.5)
            got += conn.recv(200)
        status = got.split(b"\r")[0].decode("ascii", "replace")
        return f"it speaks HTTP/1: {status!r}"
    return f"its first bytes are {got[:16]!r}, not an HTTP/2 SETTINGS frame"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def connect(address: str) -> None:
    """Join the cluster at `address` as a driver (once per process and address)."""
    check_reachable(address)
    local = not address.startswith("ray://") and _loopback(host_port(address)[0])
    if local:  # Ray would replace 127.0.0.1 by this computer's outward address, where that head does not listen
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = not local and ray_constants.ENABLE_RAY_CLUSTER
    if ray.is_initialized():
        if getattr(connect, "address", None) == address:
            return
        ray.shutdown()
    kw: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False, "configure_logging": False}
    if local:
        kw["_node_ip_address"] = "127.0.0.1"  # a cluster on this computer: the driver listens on loopback only
    try:
        ray.init(address=address, **kw)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        raise UserError(f"{address} answers, but not as a Ray cluster ({e}).",
                        "Check the address and port that `ray start --head` printed.") from e
    connect.address = address  # type: ignore[attr-defined]


SCRATCH_PREFIX = "npustudio-stage-"


def scratch_root() -> Path:
    """A new worker's scratch folder, named after its process. A worker ended with its driver or its node (killed,
    so it never emptied its folder) left its inputs and outputs behind, gigabytes on a real model: the folders of
    processes that are gone are removed first."""
    for old in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = old.name.removeprefix(SCRATCH_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Worker:
    """The stage's side on the cluster: a scratch folder, the stage run in a thread, its events kept to be pulled."""

    def __init__(self, libraries: tuple[str, ...]) -> None:
        self.root = scratch_root()
        self.events: list[tuple[Any, ...]] = []
        self.state = State()
        self.state.subscribe(self._keep)
        self.used = time.monotonic()
        self.running = False  # a stage in progress: never idle, however long it goes without a call
        self.warm = _importing(libraries)
        threading.Thread(target=self._end_when_idle, daemon=True).start()

    def reset(self, libraries: tuple[str, ...]) -> None:
        """Ready for the next stage: an empty folder, no events, a new State, the stage's libraries loading."""
        self.warm.join()
        self.warm = _importing(libraries)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir()
        self.events = []
        self.state = State()
        self.state.subscribe(self._keep)
        self.used = time.monotonic()

    def _end_when_idle(self) -> None:
        """A worker kept for the next stage holds its CPUs (or GPU): it ends itself after `IDLE_S` unused. Never
        while a stage runs, however long no call gets through (a driver on a slow link, a C++ pass of the export
        holding the GIL on a loaded node): the stage's own end marks the worker used again."""
        while self.running or time.monotonic() - self.used < IDLE_S:
            time.sleep(5)
        shutil.rmtree(self.root, ignore_errors=True)
        os._exit(0)

    def _keep(self, ev: Any) -> None:
        self.events.append(("progress", ev.fraction, ev.message) if hasattr(ev, "fraction")
                           else ("partial", ev.kind, ev.data))

    def versions(self) -> dict[str, str]:
        return versions()

    def where(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pid(self) -> int:
        return os.getpid()

    def write(self, rel: str, offset: int, data: bytes, digest: str) -> int:
        self.used = time.monotonic()
        if hashlib.sha256(data).hexdigest() != digest:
            raise OSError(f"{rel} arrived damaged at byte {offset} (SHA-256 differs)")
        path = self._inside(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        return len(data)

    def run(self, fn: StageFn, names: list[str], args: Any, threads: int) -> None:
        """The stage, to its end; its outcome is the last event."""
        self.warm.join()  # a library half-imported by that thread is not importable from this one
        import torch

        torch.set_num_threads(threads)
        out = self.root / "out"
        out.mkdir()
        self.running = True
        try:
            if self.state.cancelled:
                raise Cancelled("stopped by the user")
            result = fn({n: self.root / "in" / n for n in names}, args, out, self.state)
        except Cancelled:
            self.events.append(("cancelled",))
        except UserError as e:
            self.events.append(("user_error", e.problem, e.fix))
        except BaseException as e:
            self.events.append(("error", f"{e.__class__.__name__}: {e}", traceback.format_exc()))
        else:
            files = [(str(f.relative_to(out)), f.stat().st_size, _sha256(f)) for f in sorted(out.rglob("*"))
                     if f.is_file()]
            self.events.append(("done", result, files))
        finally:
            self.running = False
            self.used = time.monotonic()

    def pull(self, start: int) -> list[tuple[Any, ...]]:
        self.used = time.monotonic()
        return self.events[start:]

    def cancel(self) -> None:
        self.state.cancel()

    def read(self, rel: str, offset: int, size: int) -> tuple[bytes, str]:
        with open(self._inside("out/" + rel), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        return data, hashlib.sha256(data).hexdigest()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _inside(self, rel: str) -> Path:
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"{rel} is outside the stage's folder")
        return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(inputs: Mapping[str, Path | list[Path]]) -> list[tuple[Path, str]]:
    """(local file, its path on the worker) for every input file."""
    out = []
    for name, src in inputs.items():
        if isinstance(src, list):
            out += [(f, f"in/{name}/{f.name}") for f in src]
        else:
            out += [(f, f"in/{name}/{f.relative_to(src)}") for f in sorted(src.rglob("*")) if f.is_file()]
    return out


@dataclass
class Transfer:
    """Bytes moved and the seconds it took, each way (for the benchmark and the record's message)."""

    sent_bytes: int = 0
    sent_s: float = 0.0
    received_bytes: int = 0
    received_s: float = 0.0


def run(target: Cluster, job: Job, out: Path, state: StateLike, cpus: int | None = None) -> dict[str, Any]:
    """`job` on the `target` cluster; its output files land in `out`. Returns the stage's result (the bytes
    moved each way go out as a "transfer" partial). Raises what a local run raises: `Cancelled`, `UserError`
    (also for a worker that died or a version skew), or RuntimeError with the worker's traceback for a bug."""
    import ray

    address = target.address
    connect(address)
    cpus = cpus or _largest_node_cpus()
    has_gpu = bool(ray.cluster_resources().get("GPU"))
    if job.device == "cuda" and not has_gpu:
        raise UserError(f"The cluster at {address} has no GPU for the {job.stage} stage.",
                        "Add a GPU worker to the cluster, or choose --device cpu (or auto).")
    gpu = job.device == "cuda" or (job.device == "auto" and has_gpu)
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": 1 if gpu else 0, "max_concurrency": 4,
                               "max_restarts": 0}
    if target.install:
        options["runtime_env"] = {"pip": {"packages": pins(), "pip_check": False}}
        state.progress(0.0, f"{job.stage}: setting up the workers' packages (first time: minutes)")
    key = (address, cpus, options["num_gpus"], target.install)
    libraries = LIBRARIES.get(job.stage, LIBRARIES["quantize"])
    worker: Any = _kept(key, libraries) or ray.remote(Worker).options(**options).remote(libraries)
    transfer = Transfer()
    with _failures(job.stage, address):
        try:
            node = _started(worker, address, START_S * (10 if target.install else 1))
            _same_versions(ray.get(worker.versions.remote()), address)
            state.progress(0.0, f"{job.stage}: sending the inputs to {node}")
            _send(worker, _files(job.inputs), state, transfer)
            result, files = _follow(worker, job, cpus, state.sub(0.05, 0.95))
            state.progress(0.95, f"{job.stage}: bringing the results back from {node}")
            _receive(worker, files, out, state, transfer)
        except BaseException:
            with contextlib.suppress(Exception):
                ray.get(worker.close.remote(), timeout=30)
            ray.kill(worker)
            raise
    _KEPT[key] = worker  # the next stage (run: adapt, quantize, compile) finds its libraries loaded
    state.partial("transfer", **vars(transfer))
    return result


_KEPT: dict[tuple[Any, ...], Any] = {}


def _kept(key: tuple[Any, ...], libraries: tuple[str, ...]) -> Any:
    """The worker an earlier stage of this process left with these resources, emptied; None if there is none (or it
    ended meanwhile). Any other kept worker is ended."""
    import ray

    worker = _KEPT.pop(key, None)
    release()  # one kept worker at most: another one's CPUs or GPU may be what the new one needs
    if worker is None:
        return None
    try:
        ray.get(worker.reset.remote(libraries), timeout=30)
    except Exception:
        with contextlib.suppress(Exception):
            ray.kill(worker)
        return None
    return worker


def release() -> None:
    """End the workers kept for a next stage (they also end after `IDLE_S` unused, or with this process)."""
    import ray

    while _KEPT:
        _, worker = _KEPT.popitem()
        with contextlib.suppress(Exception):
            ray.get(worker.close.remote(), timeout=30)
            ray.kill(worker)


# what each stage loads first (its declaration's `libraries`), imported by a new worker while the inputs arrive
# (seconds a stage would otherwise wait for: torch ~3 s, aimet ~4 s on 2 cores)
LIBRARIES = {s.name: s.libraries for s in stages.SPECS if s.remote}


def _importing(libraries: tuple[str, ...]) -> threading.Thread:
    def load() -> None:
        import importlib

        for name in libraries:
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    return t


def _largest_node_cpus() -> int:
    import ray

    return max([int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")] or [1]) or 1


def _started(worker: Any, address: str, wait_s: float) -> str:
    import ray

    ref = worker.where.remote()
    ready, _ = ray.wait([ref], timeout=wait_s)
    if not ready:
        raise UserError(f"No node of the cluster at {address} could take the stage within {wait_s:.0f} s.",
                        "Check the free CPUs and GPUs with `ray status`, or run the stage here without --cluster.")
    return str(ray.get(ref))


def _same_versions(theirs: dict[str, str], address: str) -> None:
    mine = versions()
    differ = {k: (mine[k], theirs.get(k, "not installed")) for k in mine if theirs.get(k) != mine[k]}
    if differ:
        listed = "; ".join(f"{k} {a} here, {b} there" for k, (a, b) in differ.items())
        pins = " ".join(f"{k}=={a}" for k, (a, _b) in differ.items() if k != "python")
        raise UserError(f"The workers of the cluster at {address} run other versions: {listed}.",
                        f"Install this computer's versions on the workers (`pip install {pins}`, or let Ray do it: "
                        "--cluster-install), so the stage gives the files it gives here.")


def _pipelined(calls: Iterator[Any], handle: Callable[[Any], None]) -> None:
    """Keep `WINDOW` remote calls in flight; results are handled in the order the calls were made."""
    import ray

    pending: list[Any] = []
    for ref in calls:
        pending.append(ref)
        if len(pending) >= WINDOW:
            handle(ray.get(pending.pop(0)))
    for ref in pending:
        handle(ray.get(ref))


def _send(worker: Any, files: list[tuple[Path, str]], state: StateLike, t: Transfer) -> None:
    total = sum(f.stat().st_size for f, _ in files) or 1
    t0 = time.perf_counter()

    def chunks() -> Iterator[Any]:
        for path, rel in files:
            with open(path, "rb") as f:
                offset = 0
                while True:
                    data = f.read(CHUNK)
                    if not data and offset:
                        break
                    yield worker.write.remote(rel, offset, data, hashlib.sha256(data).hexdigest())
                    offset += len(data)
                    if not data:
                        break

    def sent(n: int) -> None:
        t.sent_bytes += n
        state.progress(0.05 * t.sent_bytes / total)

    _pipelined(chunks(), sent)
    t.sent_s = time.perf_counter() - t0


def _follow(worker: Any, job: Job, cpus: int, state: StateLike) -> tuple[dict[str, Any], list[Any]]:
    """Run the stage remotely, replaying its events into `state`; a local cancel becomes a remote one."""
    import ray

    done = worker.run.remote(job.fn, list(job.inputs), job.args, cpus)
    seen, asked = 0, False
    try:
        while True:
            for ev in ray.get(worker.pull.remote(seen)):
                seen += 1
                kind = ev[0]
                if kind == "progress":
                    state.progress(ev[1], ev[2])
                elif kind == "partial":
                    state.partial(ev[1], **ev[2])
                elif kind == "done":
                    return ev[1], ev[2]
                elif kind == "cancelled":
                    raise Cancelled("stopped by the user")
                elif kind == "user_error":
                    raise UserError(ev[1], ev[2])
                else:
                    import sys

                    sys.stderr.write(ev[2])  # the worker's traceback, for a bug report
                    raise RuntimeError(f"on the cluster: {ev[1]}")
            if state.cancelled and not asked:
                worker.cancel.remote()
                asked = True
            ray.wait([done], timeout=POLL_S)
    except BaseException:
        if not asked:  # stopped here (Ctrl-C, the window's Stop): the worker stops at its next safe point
            with contextlib.suppress(Exception):
                worker.cancel.remote()
                ray.wait([done], timeout=STOP_S)
        raise


def _receive(worker: Any, files: list[tuple[str, int, str]], out: Path, state: StateLike, t: Transfer) -> None:
    total = sum(size for _, size, _ in files) or 1
    t0 = time.perf_counter()
    for rel, size, digest in files:
        path = (out / rel).resolve()
        if not path.is_relative_to(out.resolve()):
            raise RuntimeError(f"the worker named a file outside the stage's folder: {rel}")
        path.parent.mkdir(parents=True, exist_ok=True)
        whole = hashlib.sha256()
        with open(path, "wb") as f:
            def write(reply: tuple[bytes, str], f: Any = f, whole: Any = whole, rel: str = rel) -> None:
                data, chunk_digest = reply
                if hashlib.sha256(data).hexdigest() != chunk_digest:
                    raise UserError(f"{rel} came back from the cluster damaged.", "Run the stage again.")
                f.write(data)
                whole.update(data)
                t.received_bytes += len(data)
                state.progress(0.95 + 0.05 * t.received_bytes / total)

            _pipelined((worker.read.remote(rel, o, CHUNK) for o in range(0, size, CHUNK)), write)
        if whole.hexdigest() != digest:
            raise UserError(f"{rel} came back from the cluster with other content than the worker wrote.",
                            "Run the stage again.")
    t.received_s = time.perf_counter() - t0


@contextlib.contextmanager
def _failures(stage: str, address: str) -> Iterator[None]:
    """Ray's failures in the user's terms: the project keeps its last good state either way."""
    import ray

    try:
        yield
    except ray.exceptions.RuntimeEnvSetupError as e:
        if "No space left on device" in str(e):  # Ray copies a worker's virtualenv whole for the runtime_env
            raise UserError(f"A worker of {address} ran out of disk while Ray set up NPU Studio's requirements "
                            "there: for --cluster-install Ray first copies the virtualenv the workers run in "
                            "(torch's alone is gigabytes) into its session folder.",
                            "Free that much disk on the workers (Ray's temp folder, /tmp/ray unless `ray start "
                            "--temp-dir` moved it), or install the versions there yourself and run without "
                            "--cluster-install.") from e
        raise UserError(f"Ray could not install NPU Studio's requirements on the workers of {address} "
                        f"({_first_line(e)}).",
                        "Check that the workers reach their package index, or install the versions there yourself "
                        "and run without --cluster-install.") from e
    except ray.exceptions.RayActorError as e:
        if "No module named 'npustudio'" in str(e):
            raise UserError(f"NPU Studio is not installed on the workers of the cluster at {address}.",
                            "Install it there with this computer's versions (`bash packaging/bootstrap.sh`), then "
                            "run the command again.") from e
        raise UserError(f"The cluster worker running the {stage} stage stopped before it finished "
                        f"({_first_line(e)}).",
                        "The project keeps its last good state; run the command again (`ray status` shows the "
                        "cluster's nodes and memory).") from e
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else None
        if isinstance(cause, UserError):
            raise cause from e
        raise UserError(f"The cluster could not take the {stage} stage's files ({_first_line(e)}).",
                        "Check the workers' free disk space, then run the command again.") from e


def _first_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return next((s for s in reversed(lines) if "Error" in s), lines[0] if lines else e.__class__.__name__)


