"""The virtual device is a phone, not a door into this computer; deploy and the runner never follow a link out.

Through the real adb server on a private port (and a raw adb client for what the server would never send).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from npustudio.core import device
from npustudio.core.device import adbauth, deploy, phone_shell
from npustudio.core.device.phone_shell import Call
from npustudio.core.device.virtual import A_AUTH, A_CNXN, A_OKAY, A_OPEN, A_VERSION, A_WRTE, VirtualDevice
from npustudio.core.errors import UserError
from npustudio.core.genie import config as genie_config
from npustudio.core.genie import host
from npustudio.core.progress import State
from npustudio.core.project import Project


@pytest.fixture(scope="module")
def phone(adb_server: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualDevice]:
    mp = pytest.MonkeyPatch()
    mp.setenv("NPUSTUDIO_HOST_MARKER", "host-secret-4711")  # in this process's environment while the device runs
    vd = VirtualDevice(tmp_path_factory.mktemp("phone")).start()
    assert "connected" in str(device.client().connect(vd.serial, timeout=15))
    yield vd
    device.client().disconnect(vd.serial)
    vd.stop()
    mp.undo()


def _sh(adb: list[str], vd: VirtualDevice, *args: str) -> str:
    res = subprocess.run([*adb, "-s", vd.serial, "shell", *args], capture_output=True, text=True, timeout=60)
    return res.stdout + res.stderr


# -- a raw adb client: what the adb server never sends ---------------------------------------------
def _send(s: socket.socket, cmd: int, a0: int, a1: int, data: bytes = b"") -> None:
    s.sendall(struct.pack("<6I", cmd, a0, a1, len(data), 0, cmd ^ 0xFFFFFFFF) + data)


def _recv(s: socket.socket) -> tuple[int, int, bytes] | None:
    """The next packet (command, arg0, payload), or None when the device closed the connection."""
    buf = b""
    try:
        while len(buf) < 24:
            chunk = s.recv(24 - len(buf))
            if not chunk:
                return None
            buf += chunk
        cmd, a0, _a1, n, _check, _magic = struct.unpack("<6I", buf)
        data = b""
        while len(data) < n:
            chunk = s.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
    except ConnectionResetError:
        return None
    return cmd, a0, data


def _hello(vd: VirtualDevice) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", vd.port), timeout=10)
    _send(s, A_CNXN, A_VERSION, 256 * 1024, b"host::\0")
    pkt = _recv(s)
    assert pkt is not None and pkt[:2] == (A_AUTH, adbauth.AUTH_TOKEN) and len(pkt[2]) == 20  # no CNXN yet
    return s, pkt[2]


def _keys(home: Path) -> rsa.RSAPrivateKey:
    """An adb key pair where adb keeps it (HOME/.android/adbkey and adbkey.pub)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (home / ".android").mkdir(parents=True)
    (home / ".android/adbkey").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.TraditionalOpenSSL,
                                                             serialization.NoEncryption()))
    (home / ".android/adbkey.pub").write_text(adbauth.encode_public_key(key.public_key(), "me@here") + "\n")
    return key


def test_a_raw_client_without_the_users_key_gets_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ANDROID_USER_HOME", raising=False)
    monkeypatch.delenv("ADB_VENDOR_KEYS", raising=False)
    allowed = _keys(tmp_path / "home")
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    vd = VirtualDevice(tmp_path / "phone").start()
    try:
        s, _token = _hello(vd)  # no key at all: a shell request ends the connection unanswered
        _send(s, A_OPEN, 1, 0, b"shell:touch /data/local/tmp/owned\0")
        assert _recv(s) is None
        s.close()

        s, token = _hello(vd)  # a wrong key: a new token; offering that key is not trusted either
        _send(s, A_AUTH, adbauth.AUTH_SIGNATURE, 0, adbauth.sign(stranger, token))
        again = _recv(s)
        assert again is not None and again[:2] == (A_AUTH, adbauth.AUTH_TOKEN) and again[2] != token
        pub = adbauth.encode_public_key(stranger.public_key(), "evil@host").encode() + b"\0"
        _send(s, A_AUTH, adbauth.AUTH_RSAPUBLICKEY, 0, pub)
        _send(s, A_OPEN, 1, 0, b"sync:\0")
        assert _recv(s) is None
        s.close()
        assert not (vd.root / "data/local/tmp/owned").exists()

        s, token = _hello(vd)  # the user's own key: the device comes online and answers
        _send(s, A_AUTH, adbauth.AUTH_SIGNATURE, 0, adbauth.sign(allowed, token))
        online = _recv(s)
        assert online is not None and online[0] == A_CNXN and online[2].startswith(b"device::")
        _send(s, A_OPEN, 1, 0, b"shell:echo hi\0")
        assert (p := _recv(s)) is not None and p[0] == A_OKAY
        assert (p := _recv(s)) is not None and (p[0], p[2]) == (A_WRTE, b"hi\n")
        s.close()
    finally:
        vd.stop()


def test_an_adb_server_with_another_key_sees_an_unauthorized_device(adb_server: list[str], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # this user has no adb key: the server's key is a stranger's
    monkeypatch.delenv("ANDROID_USER_HOME", raising=False)
    monkeypatch.delenv("ADB_VENDOR_KEYS", raising=False)
    vd = VirtualDevice(tmp_path / "phone").start()
    try:
        assert "failed to authenticate" in str(device.client().connect(vd.serial, timeout=15))
        listing = subprocess.run([*adb_server, "devices"], capture_output=True, text=True, timeout=30).stdout
        assert f"{vd.serial}\tunauthorized" in listing
        assert "unauthorized" in _sh(adb_server, vd, "echo", "hi")
    finally:
        device.client().disconnect(vd.serial)
        vd.stop()
    with pytest.raises(UserError) as e:
        device.start_virtual(tmp_path / "phone2")
    assert "not this user's adb key" in e.value.problem and "kill-server" in e.value.fix


# -- the shell: phone commands, inside the sandbox ---------------------------------------------------
def test_the_shell_runs_phone_commands_only_and_inside_its_sandbox(phone: VirtualDevice, adb_server: list[str],
                                                                   tmp_path: Path) -> None:
    mark = f"/tmp/npustudio-{uuid.uuid4().hex}"
    secret = tmp_path / "secret.txt"
    secret.write_text("host file\n")
    (phone.root / "data/local/tmp/out").symlink_to(secret)  # a link someone left in the sandbox
    assert "id: inaccessible or not found" in _sh(adb_server, phone, "id")
    for line in (f"touch {mark}", f"mkdir -p {mark}", f"echo x > {mark}", f"echo $(touch {mark})",
                 f"`touch {mark}`", f"ls | touch {mark}", f"sh -c 'touch {mark}'", f"/bin/touch {mark}",
                 f"cd / && touch {mark[1:]}"):
        out = _sh(adb_server, phone, line)
        assert "Permission denied" in out or "not supported" in out or "not found" in out, (line, out)
    assert not os.path.exists(mark) and not (phone.root / mark.lstrip("/")).exists()
    assert "root:" not in _sh(adb_server, phone, "cat /etc/passwd")
    for escape in ("cat ../../../../etc/passwd", f"cat /data/local/tmp/../../../..{secret}", "cat out",
                   "ls ../../../..", "rm -rf ../../../../tmp"):
        out = _sh(adb_server, phone, escape)
        assert "Permission denied" in out and "host file" not in out, (escape, out)
    pulled = subprocess.run([*adb_server, "-s", phone.serial, "pull", "/data/local/tmp/out", str(tmp_path / "p")],
                            capture_output=True, timeout=60)
    assert pulled.returncode != 0 and not (tmp_path / "p").exists()
    assert secret.read_text() == "host file\n"
    assert set(_sh(adb_server, phone, "ls /").split()) == {"data", "system"}


def test_the_device_environment_has_nothing_of_this_computer(phone: VirtualDevice, adb_server: list[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_marker_not_for_the_phone")
    env = dict(line.split("=", 1) for line in _sh(adb_server, phone, "env").splitlines())
    assert env == {"HOME": "/data/local/tmp", "PATH": "/system/bin", "LD_LIBRARY_PATH": "/system/lib64",
                   "TMPDIR": "/data/local/tmp"}
    # what a program the device starts on this computer gets: the same, in sandbox folders
    monkeypatch.setitem(phone.programs, "genie-t2t-run", ["/usr/bin/env"])
    child = dict(line.split("=", 1) for line in _sh(adb_server, phone, "X=1 genie-t2t-run").splitlines())
    # an allow-list: not even the device's own LD_LIBRARY_PATH (bubblewrap adds PWD, its working sandbox folder)
    assert set(child) - {"PWD"} == {"HOME", "PATH", "TMPDIR"}
    assert all(v.startswith(str(phone.root)) for v in child.values()), child
    assert "hf_marker" not in str(child) and "host-secret-4711" not in str(child)


def _evil_library(tmp_path: Path, marker: Path) -> Path:
    """A shared library whose constructor writes `marker` (a file on this computer) when any process loads it; also
    an audit library (la_version), so LD_AUDIT would load it too."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on this machine to build the library a device user would push")
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n'
                   f'__attribute__((constructor)) static void owned(void) {{ FILE *f = fopen("{marker}", "a"); '
                   'if (f) { fputs("ran on the host\\n", f); fclose(f); } }\n'
                   'unsigned int la_version(unsigned int v) { return v; }\n')
    lib = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True, timeout=120)
    return lib


def test_a_pushed_library_never_loads_into_a_process_on_this_computer(phone: VirtualDevice, adb_server: list[str],
                                                                     tmp_path: Path) -> None:
    """genie-t2t-run is a host process: loader variables from the device line are refused the way a phone's linker
    says it, and nothing of the device line but locale names reaches that process's environment."""
    marker = tmp_path / "owned"
    lib = _evil_library(tmp_path, marker)
    s = [*adb_server, "-s", phone.serial]
    pushed = subprocess.run([*s, "push", str(lib), "/data/local/tmp/evil.so"], capture_output=True, timeout=60)
    assert pushed.returncode == 0, pushed.stderr
    run = "genie-t2t-run -c genie_config.json -p hi; echo rc=$?"
    for line in (f"LD_PRELOAD=/data/local/tmp/evil.so {run}",
                 f"cd /data/local/tmp && LD_LIBRARY_PATH=/data/local/tmp LD_AUDIT=evil.so {run}",
                 f"export LD_PRELOAD=/data/local/tmp/evil.so; {run}",
                 f"LD_AUDIT=/data/local/tmp/evil.so; export LD_AUDIT; exec {run}",
                 "cd /data/local/tmp && touch genie-t2t-run && LD_PRELOAD=evil.so exec ./genie-t2t-run -p hi"):
        out = _sh(adb_server, phone, line)
        assert 'CANNOT LINK EXECUTABLE "' in out and "is not honoured on this device" in out, (line, out)
        assert "rc=1" in out or "rc=" not in out, (line, out)
        assert not marker.exists(), (line, out)
    # the deploy's own line still runs, and what reaches the host process comes from this computer or the allow-list
    seen: list[dict[str, str]] = []

    def spawn(_self: object, _argv: list[str], env: dict[str, str], _replaces: bool,
              _readable: tuple[Path, ...] = ()) -> int:
        seen.append(env)
        return 0

    mp = pytest.MonkeyPatch()
    mp.setattr(phone_shell.Session, "spawn", spawn)
    mp.delenv("QNN_SDK_ROOT", raising=False)
    try:
        out = _sh(adb_server, phone, "cd /data/local/tmp && LD_LIBRARY_PATH=/data/local/tmp:$LD_LIBRARY_PATH "
                  "ADSP_LIBRARY_PATH=/data/local/tmp PYTHONPATH=/data/local/tmp PYTHONSTARTUP=evil.so "
                  "QNN_SDK_ROOT=/data/local/tmp LANG=en_US.UTF-8 LC_ALL=/data/local/tmp/evil.so "
                  "HOME=/data/local/tmp/h exec genie-t2t-run -c genie_config.json -p hi; echo rc=$?")
    finally:
        mp.undo()
    assert out == "" and len(seen) == 1, out
    tmp = str(phone.root / "data/local/tmp")
    assert seen[0] == {"HOME": f"{tmp}/h", "TMPDIR": tmp, "PATH": str(phone.root / "system/bin"),
                       "LANG": "en_US.UTF-8"}
    assert not marker.exists()


def test_kill_reaches_the_devices_own_processes_only(phone: VirtualDevice, adb_server: list[str],
                                                     tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert "No such process" in _sh(adb_server, phone, "kill", "-9", str(bystander.pid))
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    # the device's own programs end on `kill`: test_device_confinement.test_a_killed_device_program_leaves_nothing


def test_the_stock_adb_still_pushes_lists_and_pulls(phone: VirtualDevice, adb_server: list[str],
                                                    tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("payload")
    s = [*adb_server, "-s", phone.serial]
    assert subprocess.run([*s, "push", str(src), "/data/local/tmp/x/a.txt"], capture_output=True).returncode == 0
    assert "a.txt" in subprocess.run([*s, "ls", "/data/local/tmp/x"], capture_output=True, text=True).stdout
    assert "-rw-r--r--" in _sh(adb_server, phone, "ls -l /data/local/tmp/x")
    out = _sh(adb_server, phone, "cd /data/local/tmp/x && mv -f a.txt b.txt && cat b.txt && rm b.txt && ls")
    assert out == "payload"
    pushed = subprocess.run([*s, "push", str(src), "/system/a.txt"], capture_output=True, text=True)
    assert pushed.returncode != 0 and not (phone.root / "system/a.txt").exists()  # a phone's /system is read-only


# -- deploy and the runner never follow a link out of the bundle --------------------------------------
def test_deploy_refuses_a_bundle_with_a_link_to_a_file_outside(phone: VirtualDevice, tmp_path: Path,
                                                               genie_project: Project) -> None:
    shadow = tmp_path / "shadow"
    shadow.write_text("root:secret-hash:19000::::::\n")
    shadow.chmod(0o600)
    bundle = tmp_path / "linky"
    bundle.mkdir()
    shutil.copy(genie_project.stage_dir("bundle") / "metadata.json", bundle / "metadata.json")
    (bundle / "genie_config.json").write_text("{}")
    (bundle / "model.bin").symlink_to(shadow)
    dev = device.info(phone.serial)
    with pytest.raises(UserError) as e:
        deploy.deploy(bundle, dev, State())
    assert "model.bin" in e.value.problem and "link" in e.value.problem
    remote = phone.host_path(deploy.remote_dir(bundle))
    assert not remote.exists()  # nothing moved, not even the bundle's real files
    (bundle / "model.bin").unlink()
    assert deploy.deploy(bundle, dev, State()).bytes_sent > 0  # the same bundle without the link deploys
    assert sorted(p.name for p in remote.iterdir() if not p.name.startswith(".")) == ["genie_config.json",
                                                                                      "metadata.json"]


def test_the_runner_refuses_config_paths_outside_the_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "tokenizer.json").write_text("{}")
    (bundle / "m.bin").write_bytes(b"\0")
    (bundle / "out.bin").symlink_to("/etc/passwd")

    def config(ctx_bins: list[str], tokenizer: str = "tokenizer.json", **extra: object) -> Path:
        c = {"dialog": {"version": 1, "type": "basic", "tokenizer": {"version": 1, "path": tokenizer},
                        "engine": {"backend": {"type": "QnnHtp"},
                                   "model": {"type": "binary", "binary": {"ctx-bins": ctx_bins, **extra}}}}}
        (bundle / "genie_config.json").write_text(json.dumps(c))
        return bundle / "genie_config.json"

    for bins, tokenizer, extra, named in [(["../../../../etc/passwd"], "tokenizer.json", {}, "../../../../etc/passwd"),
                                          (["m.bin"], "/etc/passwd", {}, "/etc/passwd"),
                                          (["out.bin"], "tokenizer.json", {}, "out.bin"),  # a link in the bundle
                                          (["m.bin"], "tokenizer.json", {"fcb": ["../s.bin"]}, "../s.bin")]:
        with pytest.raises(UserError) as e:
            host.run(config(bins, tokenizer, **extra), "hi", lambda _s: None)
        assert named in e.value.problem and "outside the bundle" in e.value.problem
    good = json.loads(config(["m.bin"]).read_text())
    resolved = genie_config.absolute(good, bundle)["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    assert resolved == [str((bundle / "m.bin").resolve())]


def test_a_bundles_genie_t2t_run_is_not_run_on_this_computer(phone: VirtualDevice, adb_server: list[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = phone.root / "data/local/tmp/rt"
    folder.mkdir(exist_ok=True)
    for name in ("genie-t2t-run", "evil"):  # pushed files, e.g. a phone runtime: never executed here
        (folder / name).write_text("#!/bin/sh\ntouch /tmp/npustudio-ran\n")
        (folder / name).chmod(0o755)
    calls: list[list[str]] = []

    def runner_(call: Call) -> int:
        calls.append(call.args)
        return 0

    monkeypatch.setitem(phone.programs, "genie-t2t-run", runner_)
    assert "Permission denied" in _sh(adb_server, phone, "cd /data/local/tmp/rt && ./evil")
    _sh(adb_server, phone, "cd /data/local/tmp/rt && ./genie-t2t-run --log info")
    assert calls == [["--log", "info"]] and not os.path.exists("/tmp/npustudio-ran")


def test_file_commands_go_on_past_a_bad_path_and_refuse_bad_input_before_acting(phone: VirtualDevice,
                                                                                adb_server: list[str]) -> None:
    """As toybox does: a path that fails is said and the others are still done (exit 1); an unknown option or a
    bad mode changes nothing."""
    tmp = phone.root / "data/local/tmp"
    out = _sh(adb_server, phone, "cd /data/local/tmp && touch a b && rm a missing b; echo rc=$?")
    assert "missing: No such file or directory" in out and "rc=1" in out
    assert not (tmp / "a").exists() and not (tmp / "b").exists()
    out = _sh(adb_server, phone, "cd /data/local/tmp && touch c -x; echo rc=$?")
    assert "Unknown option 'x'" in out and "rc=1" in out and not (tmp / "c").exists()
    out = _sh(adb_server, phone, "cd /data/local/tmp && touch d && chmod 0600 d && chmod u+q d; echo rc=$?")
    assert "bad mode 'u+q'" in out and "rc=1" in out and (tmp / "d").stat().st_mode & 0o777 == 0o600
    out = _sh(adb_server, phone, "cd /data/local/tmp && mkdir e e; ls -d e; echo rc=$?")
    assert "e: File exists" in out and "rc=0" in out  # the ls after it ran


def test_a_fault_in_the_devices_own_code_is_said_not_an_empty_success(phone: VirtualDevice,
                                                                      adb_server: list[str]) -> None:
    """A device command that fails inside the virtual device answers with what went wrong, never with nothing."""
    mp = pytest.MonkeyPatch()
    mp.setattr(phone_shell.Session, "spawn", lambda *_a: 1 // 0)
    try:
        out = _sh(adb_server, phone, "cd /data/local/tmp && genie-t2t-run -c genie_config.json -p hi")
    finally:
        mp.undo()
    assert "virtual device: internal error (ZeroDivisionError" in out, out
