"""The heavy stages on a Ray cluster: a head started here on loopback only, the tiny model's quantize and compile
run on it and give the files a local run gives; cancel, an unreachable address, a killed worker, version skew."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from npustudio.core import cluster, pipeline, stages
from npustudio.core.cluster import Cluster
from npustudio.core.compile import CompileOptions
from npustudio.core.errors import UserError
from npustudio.core.progress import Cancelled, Partial, Progress, State
from npustudio.core.project import Project
from npustudio.core.quantize import QuantizeOptions
from tests.conftest import done, raw_record, wait_until

from .ray_head import free_port, loopback_head

# what conftest.genie_pipeline ran locally: the same options give the same files
QUANTIZE = QuantizeOptions(precision="w8a16", calib_samples=2, calib_len=64, calib_decode=4, eval_chars=1500,
                           window=128, decode_tokens=8)
COMPILE = CompileOptions(verify_tokens=64)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with loopback_head(cpus=2, temp_dir=tmp_path_factory.mktemp("ray")) as address:
        yield address
        import ray

        ray.shutdown()


def _copy(project: Project, root: Path) -> Project:
    shutil.copytree(project.root, root)
    return Project.open(root, create=False)


def _hashes(p: Project, stage: str) -> dict[str, str]:
    """Every output file's hash, but the stage's own record (its timings and peak memory differ on every run)."""
    rec = raw_record(p, stage)
    return {Path(f.path).name: f.sha256 for f in rec.outputs if Path(f.path).name != f"{stage}.json"}


def _ray_processes() -> list[psutil.Process]:
    names = ("gcs_server", "raylet", "ray::")
    return [p for p in psutil.process_iter(["name", "cmdline"])
            if any(n in (p.info["name"] or "") or n in " ".join(p.info["cmdline"] or []) for n in names)]


def test_quantize_and_compile_on_the_cluster_give_the_local_files(head: str, genie_project: Project,
                                                                  tmp_path: Path) -> None:
    p = _copy(genie_project, tmp_path / "p")
    events: list[Progress | Partial] = []
    st = State()
    st.subscribe(events.append)
    qrec = pipeline.quantize(p, QUANTIZE, st, force=True, cluster=Cluster(head))
    assert qrec.ran_on == f"Ray cluster at {head}"
    assert _hashes(p, "quantize") == _hashes(genie_project, "quantize")  # encodings, graphs, weights.bin
    local = done(genie_project, stages.QUANTIZE).record
    assert qrec.result["ratio"] == local.result["ratio"]
    assert qrec.result["files"] == local.result["files"]
    assert qrec.key == local.key and qrec.options == local.options  # the same record, apart from ran_on
    # the live perplexity points and the progress crossed the cluster as in a local run
    ppl = [e.data for e in events if isinstance(e, Partial) and e.kind == "ppl"]
    assert "quant_ppl" not in ppl[0] and "quant_ppl" in ppl[-1]  # the FP line first, then quantized points
    assert any(isinstance(e, Progress) and "sending the inputs" in e.message for e in events)
    moved = next(e.data for e in events if isinstance(e, Partial) and e.kind == "transfer")
    assert moved["sent_bytes"] > 0 and moved["received_bytes"] == sum(
        f.bytes for f in qrec.outputs)

    crec = pipeline.compile_graphs(p, COMPILE, State(), force=True, cluster=Cluster(head))
    assert crec.ran_on == f"Ray cluster at {head}"
    # QNN writes other bytes into a context binary on every compile, here too (its graph name hashes the
    # model's path, tensor ids change): the binaries are compared by what the HTP simulator computes with them
    lrec = done(genie_project, stages.COMPILE).record
    assert {Path(f.path).name: f.bytes for f in crec.outputs if f.path.endswith(".bin")} == \
        {Path(f.path).name: f.bytes for f in lrec.outputs if f.path.endswith(".bin")}
    same = ("parts", "nodes_on_cpu", "io")
    assert {k: crec.result[k] for k in same} == {k: lrec.result[k] for k in same}
    assert [g | {"seconds": 0} for g in crec.result["graphs"]] == [g | {"seconds": 0} for g in lrec.result["graphs"]]
    checked = ("vs_quantsim_test_vectors", "nll_quantsim_cpu", "nll_htp", "top1_agreement", "max_abs_logit_diff")
    assert {k: crec.result["verification"][k] for k in checked} == \
        {k: lrec.result["verification"][k] for k in checked}
    assert not p.changed("compile")  # the next stage (bundle) takes it as it takes a local run's

    # nothing of the cluster listens beyond this computer
    listening = []
    for proc in _ray_processes():
        try:
            listening += [(proc.info["name"], c.laddr.ip) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue  # a worker that ended meanwhile
    assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _n, ip in listening), listening


def test_adapt_on_the_cluster_sends_only_the_models_files_and_gives_the_local_graphs(head: str,
                                                                                    genie_project: Project,
                                                                                    tmp_path: Path) -> None:
    from npustudio.core.adapt import AdaptOptions

    p = _copy(genie_project, tmp_path / "p")
    folder = Path(done(p, stages.MODEL).result.source.path or "")
    (folder / "notes.bin").write_bytes(b"\0" * 4096)  # not part of the model: stays here
    events: list[Progress | Partial] = []
    st = State()
    st.subscribe(events.append)
    try:
        rec = pipeline.adapt(p, str(folder), AdaptOptions(ar=32, cl=128, eval_chars=1500, window=128,
                                                          decode_tokens=8), st, force=True,
                             cluster=Cluster(head, install=True))  # Ray sets the workers' packages up from our pins
    finally:
        (folder / "notes.bin").unlink()
    assert rec.ran_on == f"Ray cluster at {head}"
    assert any(isinstance(e, Progress) and "setting up the workers' packages" in e.message for e in events)
    assert _hashes(p, "adapt") == _hashes(genie_project, "adapt")
    moved = next(e.data for e in events if isinstance(e, Partial) and e.kind == "transfer")
    assert moved["sent_bytes"] == sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _run_until(p: Project, head: str, when: str, act: object) -> BaseException | None:
    """Quantize on the cluster in a thread; call `act(state)` once an event of kind `when` arrived; the error."""
    st = State()
    seen = threading.Event()
    st.subscribe(lambda e: seen.set() if isinstance(e, Partial) and e.kind == when else None)
    caught: list[BaseException] = []

    def work() -> None:
        try:
            pipeline.quantize(p, QUANTIZE, st, force=True, cluster=Cluster(head))
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=work)
    t.start()
    assert seen.wait(600), "the stage never reported"
    act(st)  # type: ignore[operator]
    t.join(600)
    assert not t.is_alive()
    return caught[0] if caught else None


def test_cancel_mid_quantize_stops_the_worker_and_keeps_the_last_good_state(head: str, genie_project: Project,
                                                                            tmp_path: Path) -> None:
    p = _copy(genie_project, tmp_path / "p")
    before = _hashes(p, "quantize")
    cluster.release()  # the workers earlier tests left for a next stage: the stage's worker is then the only one
    err = _run_until(p, head, "ppl", lambda st: st.cancel())
    assert isinstance(err, Cancelled)
    assert _hashes(p, "quantize") == before and not p.changed("quantize")
    assert p.load().attempts["quantize"].status == "cancelled"
    _no_worker_left()


def _workers() -> list[psutil.Process]:
    return [q for q in _ray_processes() if "ray::Worker" in " ".join(q.info["cmdline"] or [])]


def _no_worker_left() -> None:
    deadline = time.monotonic() + 30
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _workers()


def test_a_killed_worker_is_said_and_the_project_keeps_its_last_good_state(head: str, genie_project: Project,
                                                                          tmp_path: Path) -> None:
    p = _copy(genie_project, tmp_path / "p")
    before = _hashes(p, "quantize")
    cluster.release()

    killed: list[int] = []

    def kill(_st: State) -> None:
        for w in _workers():
            killed.append(w.pid)
            os.kill(w.pid, signal.SIGKILL)

    err = _run_until(p, head, "ppl", kill)
    assert isinstance(err, UserError), err
    assert "stopped before it finished" in err.problem and "run the command again" in err.fix
    assert _hashes(p, "quantize") == before and not p.changed("quantize")
    assert p.load().attempts["quantize"].status == "failed"
    # killed, the worker could not empty its scratch folder (the project's inputs): the next worker removes it
    left = [d for pid in killed for d in Path(tempfile.gettempdir()).glob(f"{cluster.SCRATCH_PREFIX}{pid}-*")]
    assert left and all((d / "in").is_dir() for d in left)
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in killed), 30)
    new = cluster.scratch_root()  # what a new worker does first
    assert not any(d.exists() for d in left)
    shutil.rmtree(new)


def test_a_worker_disk_filled_by_the_install_is_said_as_such() -> None:
    """What Ray said when --cluster-install's copy of the workers' virtualenv filled a CI disk."""
    import ray

    said = ("shutil.Error: [('/w/.venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcufft.so.12', '/tmp/ray/x', "
            "\"[Errno 28] No space left on device: '/w/.venv/.../libcufft.so.12' -> '/tmp/ray/x'\")]")
    with pytest.raises(UserError) as e, cluster._failures("adapt", "10.0.0.5:6379"):
        raise ray.exceptions.RuntimeEnvSetupError(said)
    assert "10.0.0.5:6379 ran out of disk" in e.value.problem
    assert "Free that much disk" in e.value.fix and "without --cluster-install" in e.value.fix


def test_other_versions_on_the_workers_are_refused_before_any_work(head: str, genie_project: Project,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    p = _copy(genie_project, tmp_path / "p")
    here = cluster.versions()
    monkeypatch.setattr(cluster, "versions", lambda: here | {"torch": "9.9.9"})  # this side differs
    with pytest.raises(UserError) as e:
        pipeline.quantize(p, QUANTIZE, State(), force=True, cluster=Cluster(head))
    assert f"torch 9.9.9 here, {here['torch']} there" in e.value.problem
    assert "pip install torch==9.9.9" in e.value.fix
    assert p.load().attempts["quantize"].status == "failed" and not p.changed("quantize")


def test_an_unreachable_cluster_is_said_with_its_address(genie_project: Project, tmp_path: Path) -> None:
    p = _copy(genie_project, tmp_path / "p")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    res = subprocess.run([sys.executable, "-m", "npustudio.cli", "quantize", "--project", str(p.root),
                          "--cluster", address, "--force"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert f"Cannot reach a Ray cluster at {address}" in res.stderr and "ray start --head" in res.stderr
    assert "Traceback" not in res.stderr
    bad = subprocess.run([sys.executable, "-m", "npustudio.cli", "compile", "--project", str(p.root),
                          "--cluster", "my-cluster"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is not a Ray cluster address" in bad.stderr


class _NotRay:
    """A loopback listener that is no Ray head: it accepts and sends `reply` (nothing: stays silent). It stops by
    itself: each connection is closed after `limit_s`, and leaving the `with` closes the listener."""

    def __init__(self, reply: bytes, limit_s: float = 60.0) -> None:
        self.reply, self.limit_s = reply, limit_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.done = threading.Event()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            with contextlib.suppress(OSError):
                conn.settimeout(5)
                conn.recv(4096)
                conn.sendall(self.reply)
            self.done.wait(self.limit_s)  # silent (or after the reply): holds the connection open, as a hung server

    def __enter__(self) -> _NotRay:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


NOT_RAY = {"silent": (b"", "it sent nothing in 3 s"),
           "http": (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    "it speaks HTTP/1: 'HTTP/1.1 400 Bad Request'"),
           "garbage": (b"SSH-2.0-OpenSSH_9.6\r\n", "not an HTTP/2 SETTINGS frame")}


@pytest.mark.parametrize("kind", ["silent", "http"])
def test_something_else_at_the_address_is_told_from_a_ray_head_within_seconds(kind: str, tmp_path: Path) -> None:
    """Ray's own connect retried for ever against a listener that is no Ray head (killed after 623 s)."""
    reply, why = NOT_RAY[kind]
    env = os.environ | {f"XDG_{k}_HOME": str(tmp_path / k) for k in ("CONFIG", "DATA", "CACHE", "STATE")}
    with _NotRay(reply) as other:
        t0 = time.monotonic()
        try:
            res = subprocess.run([sys.executable, "-m", "npustudio.cli", "adapt", "default", "--project",
                                  str(tmp_path / "p"), "--cluster", other.address], capture_output=True, text=True,
                                 timeout=60, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`--cluster {other.address}` still ran after 60 s")
        took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    assert f"error: {other.address} answers, but not as a Ray head ({why})" in " ".join(res.stderr.split())
    assert "fix: Give the address `ray start --head` printed" in res.stderr and "Traceback" not in res.stderr
    assert took < 30, took  # the process starting on a loaded machine, plus the 3 s handshake


@pytest.mark.parametrize("kind", NOT_RAY)
def test_the_handshake_check_names_what_answered(kind: str) -> None:
    reply, why = NOT_RAY[kind]
    with _NotRay(reply) as other:
        for address, what in ((other.address, "a Ray head"), (f"ray://{other.address}", "a Ray Client server")):
            t0 = time.monotonic()
            with pytest.raises(UserError) as e:
                cluster.check_reachable(address)
            assert e.value.problem.startswith(f"{address} answers, but not as {what} (") and why in e.value.problem
            assert time.monotonic() - t0 < cluster.HANDSHAKE_S + 2


def test_a_ray_head_passes_the_handshake_check(head: str) -> None:
    """The check must not refuse a real head's GCS (gRPC: a SETTINGS frame answers the preface)."""
    cluster.check_reachable(head)


def test_a_worker_kept_for_the_next_stage_never_ends_itself_while_a_stage_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle end is for a kept worker nobody uses; a stage that goes long without a call must run on."""
    ended = threading.Event()

    def end(_code: int) -> None:
        ended.set()
        threading.Event().wait()  # the idle thread (a daemon) stops here instead of ending this process

    monkeypatch.setattr(cluster.os, "_exit", end)
    worker = cluster.Worker(cluster.LIBRARIES["compile"])
    started, release = threading.Event(), threading.Event()

    def stage(_inputs: dict, _args: object, _out: Path, _state: object) -> dict:
        started.set()
        release.wait(60)
        return {}

    t = threading.Thread(target=worker.run, args=(stage, [], None, 1))
    t.start()
    assert started.wait(120)
    monkeypatch.setattr(cluster, "IDLE_S", 0.0)  # every moment now counts as idle
    time.sleep(7)  # longer than the idle check's 5 s
    assert not ended.is_set()
    release.set()
    t.join(60)
    assert worker.events[-1][0] == "done"
    assert ended.wait(30)  # once the stage is over, the unused worker ends itself
