"""A Ray head on this computer that listens on loopback only, for the cluster tests and benchmark."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# Ray turns 127.0.0.1 into the machine's outward address unless clusters are off for this host: then every
# server of the head (GCS, raylet, agents, Ray Client) binds to loopback
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    ray = Path(sys.executable).with_name("ray")
    return subprocess.run([str(ray), *args], env=os.environ | ENV, capture_output=True, text=True, timeout=timeout,
                          check=False)


@contextlib.contextmanager
def loopback_head(cpus: int, temp_dir: Path) -> Iterator[str]:
    """Start a head (`cpus` CPUs, no GPU, no dashboard), yield its address, stop it."""
    port = free_port()
    started = ray_cli("start", "--head", f"--port={port}", f"--num-cpus={cpus}", "--num-gpus=0",
                      "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                      f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}")
    if started.returncode:
        raise RuntimeError(f"ray start failed: {started.stderr[-2000:]}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        ray_cli("stop", "--force")
