"""A Ray head on this computer that listens on loopback only, for the cluster tests and benchmark."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sysconfig
import time
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Ray turns 127.0.0.1 into the machine's outward address unless clusters are off for this host: then every
# server of the head (GCS, raylet, agents, Ray Client) binds to loopback. Its workers run at niceness 15 by
# default: on a machine shared with the local run they are compared with, that measures the scheduler, not Ray
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
START_S = 90  # a head that is not ready by then is reported
READY = "will now block forever"  # what `ray start --block` prints once the head's processes run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def loopback_head(cpus: int, temp_dir: Path) -> Iterator[str]:
    """Start a head (`cpus` CPUs, no GPU, no dashboard), yield its address, stop it and only it.

    `ray stop` would stop every Ray process of this user on the machine (another test run's head, a developer's
    own cluster): the head runs in the foreground (`--block`) in a process group of its own, which is ended."""
    port = free_port()
    temp_dir.mkdir(parents=True, exist_ok=True)
    python = layered_venv(temp_dir / "venv")
    log = open(temp_dir / "head.log", "w+")  # closed below, after the head is gone
    head = subprocess.Popen(
        [str(python), "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         f"--num-cpus={cpus}", "--num-gpus=0",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"],
        env=os.environ | ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_listening(head, port, log)
        yield f"127.0.0.1:{port}"
    finally:
        _end_group(head)
        log.close()


def layered_venv(root: Path) -> Path:
    """A virtualenv of its own that imports this one's packages; its python. The head and its workers run in it:
    for a `pip` runtime_env (--cluster-install) Ray copies the workers' virtualenv whole, which for this one is
    8 GB of torch and CUDA libraries (a CI disk filled up with it), and a layered one is a few kilobytes."""
    if not (root / "bin" / "python").exists():
        venv.create(root, with_pip=False, symlinks=True)
    here = sysconfig.get_paths()["purelib"]
    there = Path(sysconfig.get_paths(vars={"base": str(root), "platbase": str(root)})["purelib"])
    # addsitedir, not a bare path line: it also reads this venv's own .pth files (the editable npustudio)
    (there / "layered_on.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return root / "bin" / "python"


def _wait_listening(head: subprocess.Popen[bytes], port: int, log: Any) -> None:
    """Until `ray start` has started every process of the head (it says so, then blocks)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        if head.poll() is not None:
            raise RuntimeError(f"ray start failed: {text[-2000:]}")
        if READY in text:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the Ray head on 127.0.0.1:{port} was not ready within {START_S} s: {text[-2000:]}")


def _end_group(head: subprocess.Popen[bytes]) -> None:
    """Kill the head's process group at once, as `ray stop --force` would (a graceful stop drains for 30 s)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait()
