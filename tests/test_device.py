"""Devices end to end through the real adb server (private port) against the virtual device."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npustudio.core import chat, device, layout, pipeline
from npustudio.core.device import deploy, remote_genie
from npustudio.core.device.phone_shell import Call, Program
from npustudio.core.device.virtual import VirtualDevice
from npustudio.core.errors import UserError
from npustudio.core.fsutil import atomic_write_json
from npustudio.core.progress import State
from npustudio.core.project import Project
from tests.conftest import running, wait_until


def _connect(vd: VirtualDevice) -> None:
    assert "connected" in str(device.client().connect(vd.serial, timeout=15))


@pytest.fixture(scope="module")
def vdev(adb_server: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualDevice]:
    vd = VirtualDevice(tmp_path_factory.mktemp("phone")).start()
    _connect(vd)
    yield vd
    device.client().disconnect(vd.serial)
    vd.stop()


@pytest.fixture(scope="module")
def bundle(genie_project: Project) -> Path:
    return genie_project.stage_dir("bundle")


@contextlib.contextmanager
def _genie(vd: VirtualDevice, program: Program) -> Iterator[None]:
    """Replace the virtual device's genie-t2t-run (tests of the run plumbing, not of Genie)."""
    real = vd.programs["genie-t2t-run"]
    vd.programs["genie-t2t-run"] = program
    try:
        yield
    finally:
        vd.programs["genie-t2t-run"] = real


def test_stock_adb_sees_the_virtual_device_and_can_shell_push_pull(vdev: VirtualDevice, adb_server: list[str],
                                                                  tmp_path: Path) -> None:
    listing = subprocess.run([*adb_server, "devices"], capture_output=True, text=True, timeout=30).stdout
    assert f"{vdev.serial}\tdevice" in listing
    s = [*adb_server, "-s", vdev.serial]
    assert subprocess.run([*s, "shell", "getprop", "ro.soc.model"], capture_output=True, text=True).stdout == "SM8750\n"
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(300_000))  # several 64 KiB sync chunks
    assert subprocess.run([*s, "push", str(src), "/data/local/tmp/t/a.bin"], capture_output=True).returncode == 0
    assert (vdev.root / "data/local/tmp/t/a.bin").read_bytes() == src.read_bytes()
    back = tmp_path / "b.bin"
    assert subprocess.run([*s, "pull", "/data/local/tmp/t/a.bin", str(back)], capture_output=True).returncode == 0
    assert back.read_bytes() == src.read_bytes()


def test_the_sandbox_cannot_be_left_through_sync(vdev: VirtualDevice, adb_server: list[str], tmp_path: Path) -> None:
    outside = tmp_path / "secret.txt"
    outside.write_text("host file")
    bad = f"/../../../../../../..{outside}"
    res = subprocess.run([*adb_server, "-s", vdev.serial, "pull", bad, str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert res.returncode != 0 and not (tmp_path / "x").exists()


def test_devices_json_shows_the_virtual_device_with_its_soc(vdev: VirtualDevice) -> None:
    res = subprocess.run([sys.executable, "-m", "npustudio.cli", "devices", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    d = next(x for x in json.loads(res.stdout) if x["serial"] == vdev.serial)
    assert (d["virtual"], d["soc"], d["dsp_arch"], d["soc_model"], d["android"]) == (True, "SM8750", "v79", 69, "15")
    assert d["ram_bytes"] > 1e9 and d["free_bytes"] > 1e8


def _remote(vd: VirtualDevice, bundle: Path) -> Path:
    return vd.host_path(deploy.remote_dir(bundle))


def _as_phone_gets(p: Path) -> bytes:
    """A bundle file's bytes as deploy sends them to the virtual device: metadata.json without this computer's
    paths but the project's graphs' folder (its CPU preview answers with them)."""
    if p.name != layout.METADATA:
        return p.read_bytes()
    from npustudio.core.genie.meta import phone_metadata

    clean = phone_metadata(json.loads(p.read_text(encoding="utf-8")), frozenset({"project_compile_dir"}))
    with tempfile.TemporaryDirectory() as d:
        atomic_write_json(Path(d) / "m.json", clean)
        return (Path(d) / "m.json").read_bytes()


def test_deploy_pushes_once_then_sends_nothing(vdev: VirtualDevice, bundle: Path) -> None:
    dev = device.info(vdev.serial)
    first = deploy.deploy(bundle, dev, State(), force=True)
    needed = [p for p in bundle.iterdir() if p.is_file() and p.name != layout.BUNDLE_RESULT]  # host-side record
    assert first.bytes_sent == sum(len(_as_phone_gets(p)) for p in needed)
    for p in needed:
        assert (_remote(vdev, bundle) / p.name).read_bytes() == _as_phone_gets(p)
    assert not (_remote(vdev, bundle) / layout.BUNDLE_RESULT).exists()
    assert not [p for p in _remote(vdev, bundle).iterdir() if p.name.endswith(".part")]
    res = subprocess.run([sys.executable, "-m", "npustudio.cli", "deploy", str(bundle), "--device", vdev.serial,
                          "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert again["bytes_sent"] == 0 and again["bytes_skipped"] == first.bytes_sent
    assert {f["file"] for f in again["files"]} == {f["file"] for f in first.files}


def test_a_projects_bundle_is_deployed_with_the_digests_it_recorded(vdev: VirtualDevice, genie_project: Project,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle stage hashed its files already: a project's first deploy takes their sha256 from its record
    instead of hashing them again (0.6 -> 0.47 s for the default model's 473 MB), and the device's manifest
    holds the right ones. A bare folder, with nothing recorded, is hashed while it is pushed."""
    hashers: list[deploy._Hasher] = []
    real = deploy._Hasher

    def counted() -> deploy._Hasher:
        hashers.append(real())
        return hashers[-1]

    monkeypatch.setattr(deploy, "_Hasher", counted)
    dev = device.info(vdev.serial)
    pipeline.deploy(genie_project, dev, State(), force=True)
    assert hashers == []
    folder = genie_project.stage_dir("bundle")
    manifest = json.loads((_remote(vdev, folder) / layout.DEVICE_MANIFEST).read_text())
    for p in deploy.local_files(folder):
        assert (_remote(vdev, folder) / p.name).read_bytes() == _as_phone_gets(p), p.name
        assert manifest[p.name]["sha256"] == hashlib.sha256(_as_phone_gets(p)).hexdigest(), p.name
    (Path(os.environ["XDG_CACHE_HOME"]) / "npustudio" / "sha256.json").unlink()  # a fresh computer's cache
    deploy.deploy(folder, dev, State(), force=True)
    assert len(hashers) == 1


def test_a_device_killed_mid_push_resumes_on_the_next_deploy(adb_server: list[str], bundle: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "phone"
    vd = VirtualDevice(root).start()
    _connect(vd)
    dev = device.info(vd.serial)
    real_advance = deploy._Progress.advance
    sent = {"n": 0}
    manifest = _remote(vd, bundle) / layout.DEVICE_MANIFEST

    def advance_then_unplug(self: deploy._Progress, n: int) -> None:
        real_advance(self, n)
        sent["n"] += n
        if sent["n"] > 700_000 and not vd.stopping.is_set():  # the second binary is out: the phone goes away,
            wait_until(manifest.exists, 10)  # once the files that landed before are recorded (behind the stream)
            vd.stop()

    monkeypatch.setattr(deploy._Progress, "advance", advance_then_unplug)
    monkeypatch.setattr(deploy, "_MANIFEST_EVERY", 0)  # record every file (by default: files >= 8 MB)
    with pytest.raises(UserError) as e:
        deploy.deploy(bundle, dev, State(), force=True)
    assert "broke off" in e.value.problem and "resumes" in e.value.fix
    monkeypatch.setattr(deploy._Progress, "advance", real_advance)
    device.client().disconnect(vd.serial)
    vd2 = VirtualDevice(root, port=vd.port).start()  # plugged back in
    _connect(vd2)
    try:
        res = deploy.deploy(bundle, device.info(vd2.serial), State())
        total = sum(p.stat().st_size for p in deploy.local_files(bundle))
        assert 0 < res.bytes_sent < total and res.bytes_skipped > 0  # finished files were not sent again
        for p in deploy.local_files(bundle):
            got = (_remote(vd2, bundle) / p.name).read_bytes()
            assert hashlib.sha256(got).digest() == hashlib.sha256(_as_phone_gets(p)).digest(), p.name
    finally:
        device.client().disconnect(vd2.serial)
        vd2.stop()


def test_a_bundle_for_another_arch_is_refused_before_any_byte_moves(adb_server: list[str], bundle: Path,
                                                                    tmp_path: Path) -> None:
    vd = VirtualDevice(tmp_path / "old", soc_name="SM8650").start()
    _connect(vd)
    try:
        dev = device.info(vd.serial)
        assert (dev.soc, dev.dsp_arch) == ("SM8650", "v75")
        with pytest.raises(UserError) as e:
            deploy.deploy(bundle, dev, State())
        assert "compiled for SM8750 (v79)" in e.value.problem and "--target SM8650" in e.value.fix
        assert not (tmp_path / "old/data/local/tmp/npustudio").exists()
    finally:
        device.client().disconnect(vd.serial)
        vd.stop()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.one_of(
    st.text(min_size=1, max_size=200),
    st.sampled_from(["'\"; touch /data/local/tmp/PWNED; echo \"'", "$(touch /data/local/tmp/PWNED)",
                     "`touch /data/local/tmp/PWNED`", "a && touch /data/local/tmp/PWNED", "x\n; rm -rf /\n",
                     "nul\0byte", "ünïcödé 🚀 \\n literal", "x" * 100_000])))
def test_the_device_receives_exactly_the_prompt_and_runs_nothing_else(vdev: VirtualDevice, bundle: Path,
                                                                       prompt: str) -> None:
    def answer_ok(call: Call) -> int:
        call.path(call.args[call.args.index("--prompt_file") + 1]).read_bytes()  # there, in the sandbox
        call.write("[BEGIN]: ok[END]\n")
        return 0

    rdir = deploy.remote_dir(bundle)
    vdev.host_path(rdir).mkdir(parents=True, exist_ok=True)
    with _genie(vdev, answer_ok):
        res = remote_genie.run(vdev.serial, rdir, prompt, lambda _s: None)
    assert res.text == "ok"
    assert (vdev.host_path(rdir) / layout.PROMPT_FILE).read_bytes() == prompt.encode("utf-8")
    assert not (vdev.root / "data/local/tmp/PWNED").exists()


@pytest.mark.parametrize("line,words", [
    ("Failed to find available PD for contextId 1", "one HTP protection domain"),
    ("QnnContext_createFromBinary failed with error 5005", "does not fit this device"),
    ("Failed to load context: error 5000", "older than the one that compiled"),
    ("Error 1008: arch mismatch", "another Hexagon architecture"),
    ("Graph execute failed 1007", "error 1007"),
    ("Failed to finalize graph 1002 could not create op", "could not build an operation"),
    ('CANNOT LINK EXECUTABLE "genie-t2t-run": library "libQnnHtp.so" not found', "runtime library is missing"),
    ("Failed to create dialog", "could not load the model"),
])
def test_known_failures_are_explained(vdev: VirtualDevice, bundle: Path, line: str, words: str) -> None:
    def fail(call: Call) -> int:
        call.write(line + "\n")
        return 1

    with _genie(vdev, fail), pytest.raises(UserError) as e:
        remote_genie.run(vdev.serial, deploy.remote_dir(bundle), "hi", lambda _s: None)
    assert words in e.value.problem and e.value.fix


def test_stop_closes_the_stream_and_kills_the_remote_process(vdev: VirtualDevice, bundle: Path) -> None:
    marker = f"npustudio-looping-{uuid.uuid4().hex}"  # found in the process list: its pid is its sandbox's own
    looping = [sys.executable, "-c", "import os, sys, time\n"  # a host process the device starts and must end
               "sys.stdout.write('[BEGIN]: ')\n"
               "while True:\n    sys.stdout.write('tok'); sys.stdout.flush(); time.sleep(0.05)\n", marker]
    stop = threading.Event()
    got: list[str] = []

    def on_out(s: str) -> None:
        got.append(s)
        if "tok" in "".join(got):
            stop.set()

    t0 = time.monotonic()
    with _genie(vdev, looping):
        res = remote_genie.run(vdev.serial, deploy.remote_dir(bundle), "hi", on_out, stop=stop)
    assert res.status == "stopped" and time.monotonic() - t0 < 20
    wait_until(lambda: not running(marker), 10)


def test_chat_on_the_virtual_device_streams_an_answer_with_real_genie(vdev: VirtualDevice, bundle: Path,
                                                                      tmp_path: Path) -> None:
    deploy.deploy(bundle, device.info(vdev.serial), State())
    session = chat.ChatSession(bundle, chat.DeviceEngine(vdev.serial, bundle), system="You are helpful.",
                               history_file=tmp_path / "h.json")
    pieces: list[str] = []
    turn = session.send("Hello", pieces.append)  # this random tiny model answers "o o o ..." to it
    streamed = "".join(pieces)
    assert len(pieces) > 1 and streamed.strip().startswith("o o")  # token by token, not all at the end
    assert "[BEGIN]" not in streamed and "[END]" not in streamed and "[INFO]" not in streamed
    assert turn.assistant == streamed.strip() and turn.runner == f"device {vdev.serial}"
    saved = json.loads((tmp_path / "h.json").read_text())
    assert saved["system"] == "You are helpful." and saved["turns"][0]["user"] == "Hello"
    session.turns = [chat.Turn(user="Hi", assistant="Yo", runner="x")]
    prompt2 = session.prompt_for("And then?")  # the history goes into the next prompt, in the template
    assert "You are helpful." in prompt2 and "user\nHi" in prompt2 and "assistant\nYo" in prompt2
    session.turns = [chat.Turn(user="old " * 30, assistant="x", runner="x"), *session.turns]
    prompt3 = session.prompt_for("And then?")  # too long for CL 128: the oldest turn is dropped
    assert "old" not in prompt3 and "user\nHi" in prompt3


def test_chat_on_the_virtual_device_passes_genies_log_apart_from_the_answer(vdev: VirtualDevice, bundle: Path,
                                                                           tmp_path: Path) -> None:
    """At log level info the device's genie-t2t-run logs Genie's loading steps: they reach `on_log` line by line,
    and the answer streams without them."""
    deploy.deploy(bundle, device.info(vdev.serial), State())
    session = chat.ChatSession(bundle, chat.DeviceEngine(vdev.serial, bundle), history_file=tmp_path / "h.json")
    pieces: list[str] = []
    logs: list[str] = []
    turn = session.send("Hello", pieces.append, on_log=logs.append, log_level="info")
    assert any("GenieDialog_create" in line for line in logs), logs[:5]
    assert not any(line.startswith("[PROMPT]") for line in logs)
    streamed = "".join(pieces)
    assert "GenieDialog" not in streamed and turn.assistant == streamed.strip()


def test_watcher_follows_plug_and_unplug_and_stops(adb_server: list[str], tmp_path: Path) -> None:
    events: list[tuple[list[str], list[str]]] = []
    w = device.Watcher(lambda a, r: events.append((a, r)), interval=0.2).start()
    vd = VirtualDevice(tmp_path / "w").start()
    try:
        _connect(vd)
        wait_until(lambda: any(vd.serial in a for a, _ in events), 10)
        device.client().disconnect(vd.serial)
        wait_until(lambda: any(vd.serial in r for _, r in events), 10)
    finally:
        vd.stop()
        t0 = time.monotonic()
        w.stop()
        assert time.monotonic() - t0 < 2


def test_a_missing_adb_is_said_plainly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", "5317")  # no server there
    monkeypatch.setenv("ADBUTILS_ADB_PATH", str(tmp_path / "no-adb"))
    with pytest.raises(UserError) as e:
        device.devices()
    assert "No adb binary" in e.value.problem or "could not be started" in e.value.problem


def test_chat_on_the_desktop_preview_reports_tokens_per_second(bundle: Path, tmp_path: Path) -> None:
    session = chat.ChatSession(bundle, chat.DesktopEngine(bundle, preview=True, max_tokens=8),
                               history_file=tmp_path / "h.json")
    first = session.send("Hello", lambda _s: None)
    second = session.send("And then?", lambda _s: None)
    assert first.generation_tok_s and first.generation_tok_s > 0 and first.ttft_s is not None
    assert second.runner == "desktop preview on the CPU"
    again = chat.ChatSession(bundle, chat.DesktopEngine(bundle, preview=True), history_file=tmp_path / "h.json")
    assert [t.user for t in again.turns] == ["Hello", "And then?"]  # history survives a restart


def test_a_history_saved_before_several_chats_reads_as_one_chat_and_stays_readable(tmp_path: Path) -> None:
    """The file's old shape ({system, turns}) is the current chat; a new chat keeps the old one under `others`,
    and the file's top level stays that shape for whatever reads it as before."""
    f = tmp_path / "chat_history.json"
    f.write_text(json.dumps({"system": "Be brief.", "turns": [{"user": "Hi", "assistant": "Yo", "runner": "x"}]}))
    hist = chat.ChatHistory.load(f)
    assert [(c.title, c.system, [t.user for t in c.turns]) for c in hist.chats] == [("Hi", "Be brief.", ["Hi"])]
    old = hist.current.id
    assert chat.ChatHistory.load(f).current.id == old  # the same chat at every read: it can be picked
    assert hist.new() is hist.new()  # an empty chat is reused, not piled up
    hist.current.turns.append(chat.Turn(user="Second question here", assistant="A", runner="x"))
    hist.save()
    data = json.loads(f.read_text())
    assert [t["user"] for t in data["turns"]] == ["Second question here"] and data["system"] == "Be brief."
    back = chat.ChatHistory.load(f)
    assert [c.title for c in back.listed()] == ["Second question here", "Hi"]
    back.pick(old)
    back.save()
    assert chat.ChatHistory.load(f).current.turns[0].assistant == "Yo"
    with pytest.raises(UserError, match="no longer"):
        back.pick("gone")
    f.write_text('{"turns": [{"user": "Hi"')  # cut short (a disk filled, an editor crashed): nothing is lost
    damaged = chat.ChatHistory.load(f)
    assert damaged.current.turns == [] and not f.exists()
    assert damaged.set_aside is not None and damaged.set_aside.read_text() == '{"turns": [{"user": "Hi"'
    assert damaged.set_aside.name in (damaged.notice() or "")
    damaged.current.turns.append(chat.Turn(user="New", assistant="A", runner="x"))
    damaged.save()
    assert damaged.set_aside.read_text() == '{"turns": [{"user": "Hi"' and chat.ChatHistory.load(f).notice() is None


def test_a_chat_can_be_renamed_and_deleted_and_the_file_says_so(tmp_path: Path) -> None:
    """A name given to a chat replaces its first question in the list, survives a save and a read, and an empty
    name gives the question back; deleting the current chat shows the newest other one, deleting the last leaves
    one empty chat; an unknown chat is a UserError."""
    f = tmp_path / "chat_history.json"
    hist = chat.ChatHistory.load(f)
    hist.current.turns.append(chat.Turn(user="First question", assistant="A", runner="x", at=1.0))
    first = hist.current.id
    hist.current.created = 1.0
    hist.new().turns.append(chat.Turn(user="Second question", assistant="B", runner="x"))
    second = hist.current.id
    hist.rename(first, "  Paris   trip ")
    hist.save()
    back = chat.ChatHistory.load(f)
    assert [c.title for c in back.listed()] == ["Second question", "Paris trip"]
    with pytest.raises(UserError, match="too long"):
        back.rename(first, "x" * 81)
    back.rename(first, "")
    assert back._find(first).title == "First question"
    back.rename(second, "Mine")
    back.save()
    assert json.loads(f.read_text())["name"] == "Mine"  # the current chat keeps the file's top-level shape
    back = chat.ChatHistory.load(f)
    assert back.delete(second).id == first and back.current_id == first
    back.save()
    again = chat.ChatHistory.load(f)
    assert [c.id for c in again.chats] == [first] and again.current.turns[0].user == "First question"
    left = again.delete(first)
    assert left.turns == [] and left.id != first and len(again.chats) == 1
    with pytest.raises(UserError, match="no longer"):
        again.delete(first)
    again.save()
    assert chat.ChatHistory.load(f).current.turns == []


def test_a_bundle_that_samples_greedily_is_said_to(tmp_path: Path) -> None:
    """Regenerating an answer of a greedy bundle brings the same text: the chat says so. Genie's greedy flag or a
    top-k of 1 is greedy, the CPU preview always is, sampling is not, and an unreadable config claims nothing."""
    cfg = tmp_path / "genie_config.json"
    for sampler, greedy in (({"greedy": True, "top-k": 1}, True), ({"top-k": 1}, True),
                            ({"top-k": 40, "temp": 0.8}, False)):
        cfg.write_text(json.dumps({"dialog": {"sampler": sampler}}))
        assert chat.samples_greedily(tmp_path) is greedy
        assert chat.samples_greedily(tmp_path, preview=True)
    cfg.write_text("{")
    assert not chat.samples_greedily(tmp_path)
