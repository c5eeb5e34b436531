"""Deploy's push as a user sees it, through the real adb server against the virtual device: exact bytes,
the device-side manifest, a changed file re-sent, names the device shell must not misread, refusals."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from npustudio.core import device, layout
from npustudio.core.device import deploy
from npustudio.core.device.virtual import VirtualDevice
from npustudio.core.errors import UserError
from npustudio.core.genie.meta import phone_metadata
from npustudio.core.progress import Cancelled, State
from npustudio.core.shape import DecoderSpec
from npustudio.core.targets import find_soc

SPEC = DecoderSpec(family="Llama", model_type="llama", layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64,
                   intermediate=128, vocab=384, rms_norm_eps=1e-5, tied_embeddings=True, qkv_bias=False, qk_norm=False)


@pytest.fixture(scope="module")
def vdev(adb_server: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualDevice]:
    vd = VirtualDevice(tmp_path_factory.mktemp("phone")).start()
    assert "connected" in str(device.client().connect(vd.serial, timeout=15))
    yield vd
    device.client().disconnect(vd.serial)
    vd.stop()


def _bundle(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """A folder deploy accepts: what its compatibility check reads, and `files`. Named after the test, so each
    test has its own folder on the device."""
    folder = tmp_path / tmp_path.name
    folder.mkdir(parents=True)
    (folder / layout.METADATA).write_text(json.dumps({
        "target": find_soc("SM8750").model_dump(), "context_length": 128, "graphs": [{"name": "g", "ar": 1}],
        "decoder": SPEC.model_dump(), "eos_ids": [2]}))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def _on_device(vd: VirtualDevice, bundle: Path) -> Path:
    return vd.host_path(deploy.remote_dir(bundle))


def _check_landed(vd: VirtualDevice, bundle: Path) -> dict[str, dict[str, int | str]]:
    """Every file of the bundle is on the device with its bytes, no temporary file is left, and the manifest
    records each with its size, the mtime the device gave it and its sha256. Returns the manifest."""
    remote = _on_device(vd, bundle)
    manifest = json.loads((remote / layout.DEVICE_MANIFEST).read_text())
    for p in deploy.local_files(bundle):
        there = remote / p.name
        assert there.read_bytes() == p.read_bytes(), p.name
        assert manifest[p.name] == {"size": p.stat().st_size, "mtime": int(there.stat().st_mtime),
                                    "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}, p.name
    assert not [q.name for q in remote.iterdir() if q.name.endswith(".part")]
    return manifest


def test_files_of_every_size_land_exactly_and_the_manifest_records_them(vdev: VirtualDevice, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deploy, "_BLOCK", 3 * deploy.SYNC_CHUNK)  # several blocks per file without big files
    monkeypatch.setattr(deploy, "_MANIFEST_EVERY", 4 * deploy.SYNC_CHUNK)  # and checkpoints during the push
    chunk = deploy.SYNC_CHUNK
    bundle = _bundle(tmp_path, {
        "empty.txt": b"", "one.bin": b"x", "chunk.bin": os.urandom(chunk), "block.bin": os.urandom(3 * chunk),
        "two_blocks.bin": os.urandom(6 * chunk), "odd.bin": os.urandom(10 * chunk + 123),
        "tokenizer.json": os.urandom(5000)})
    res = deploy.deploy(bundle, device.info(vdev.serial), State(), force=True)
    assert res.bytes_sent == sum(p.stat().st_size for p in deploy.local_files(bundle))
    assert {r["file"] for r in res.files if r["sent"]} == {p.name for p in deploy.local_files(bundle)}
    _check_landed(vdev, bundle)


def test_a_changed_file_is_sent_again_and_only_it(vdev: VirtualDevice, tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(300_000), "b.bin": os.urandom(200_000)})
    dev = device.info(vdev.serial)
    deploy.deploy(bundle, dev, State(), force=True)
    same_size = os.urandom(200_000)
    (bundle / "b.bin").write_bytes(same_size)  # same size, new bytes, new mtime
    again = deploy.deploy(bundle, dev, State())
    assert [r["file"] for r in again.files if r["sent"]] == ["b.bin"] and again.bytes_sent == 200_000
    assert (_on_device(vdev, bundle) / "b.bin").read_bytes() == same_size
    _check_landed(vdev, bundle)
    assert deploy.deploy(bundle, dev, State()).bytes_sent == 0


def test_chat_histories_and_host_paths_stay_on_this_computer(vdev: VirtualDevice, tmp_path: Path) -> None:
    """`chat --bundle DIR` keeps its history (and set-aside unreadable ones) in a bare bundle folder, and the
    metadata names this computer's folders: none of it may reach the phone; the local metadata keeps them (the
    CPU preview reads `project_compile_dir`)."""
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(3000)})
    meta = json.loads((bundle / layout.METADATA).read_text())
    home = tmp_path / "home" / "alice"
    compile_dir = str(home / "proj" / layout.STAGES_DIR / "compile")
    meta |= {"project_compile_dir": compile_dir, "model": str(home / "models" / "Tiny-1B"),
             "versions": {"torch": "2.8.0", "qnn_sdk_build": "/opt/qcom/qairt/2.31.0"},
             "question": "What is in /etc?"}
    (bundle / layout.METADATA).write_text(json.dumps(meta))
    (bundle / layout.CHAT_HISTORY).write_text(json.dumps({"chats": [{"messages": [
        {"role": "user", "content": "my bank PIN is 1234"}]}]}))
    (bundle / "chat_history.unreadable-20260101-120000.json").write_text('{"chats": [ my PIN')
    (bundle / "chat_history.unreadable-20260101-120000-2.json").write_text("{")
    dev = device.info(vdev.serial)
    res = deploy.deploy(bundle, dev, State(), force=True)
    remote = _on_device(vdev, bundle)
    assert sorted(q.name for q in remote.iterdir() if not q.name.startswith(".")) == ["a.bin", layout.METADATA]
    assert sorted(r["file"] for r in res.files) == ["a.bin", layout.METADATA]
    manifest = json.loads((remote / layout.DEVICE_MANIFEST).read_text())
    assert sorted(manifest) == ["a.bin", layout.METADATA]
    pushed = (remote / layout.METADATA).read_text()
    assert str(home / "models") not in pushed and "/opt/qcom" not in pushed and "PIN" not in pushed
    on_phone = json.loads(pushed)
    # the virtual device is this computer: it keeps the project's graphs' path, which its CPU preview answers with;
    # every other path of this computer is cut, and a phone's copy holds none (below)
    assert on_phone == meta | {"model": "Tiny-1B", "versions": {"torch": "2.8.0", "qnn_sdk_build": "2.31.0"}}
    assert "project_compile_dir" not in phone_metadata(meta)
    assert phone_metadata(meta) == {k: v for k, v in on_phone.items() if k != "project_compile_dir"}
    assert on_phone["question"] == "What is in /etc?"  # free text is no path
    assert json.loads((bundle / layout.METADATA).read_text())["project_compile_dir"] == compile_dir
    assert manifest[layout.METADATA]["sha256"] == hashlib.sha256(pushed.encode()).hexdigest()
    assert deploy.deploy(bundle, dev, State()).bytes_sent == 0  # the phone's copy counts as up to date


def test_a_file_changed_on_the_device_is_sent_again(vdev: VirtualDevice, tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(100_000)})
    dev = device.info(vdev.serial)
    deploy.deploy(bundle, dev, State(), force=True)
    (_on_device(vdev, bundle) / "a.bin").write_bytes(b"truncated")
    assert deploy.deploy(bundle, dev, State()).bytes_sent == 100_000
    _check_landed(vdev, bundle)


@pytest.mark.parametrize("name", ["it's a \"test\" file.bin", "$HOME;touch PWNED`x` && y.bin", "-rf.bin",
                                  "tab\tand\\backslash.txt", "ünï cödé.json"])
def test_names_the_device_shell_could_misread_are_renamed_as_they_are(vdev: VirtualDevice, tmp_path: Path,
                                                                       name: str) -> None:
    bundle = _bundle(tmp_path, {name: os.urandom(70_000), "z.bin": b"last"})
    deploy.deploy(bundle, device.info(vdev.serial), State(), force=True)
    _check_landed(vdev, bundle)
    assert not list(vdev.root.rglob("PWNED"))


def test_many_files_are_renamed_over_several_shell_lines(vdev: VirtualDevice, tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, {f"{i:03d}_{'n' * 120}.txt": os.urandom(100 + i) for i in range(60)})
    deploy.deploy(bundle, device.info(vdev.serial), State(), force=True)
    _check_landed(vdev, bundle)


def test_a_file_the_device_refuses_is_named_and_nothing_is_recorded(vdev: VirtualDevice, tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(50_000), "b.bin": os.urandom(50_000)})
    (_on_device(vdev, bundle) / ".a.bin.part").mkdir(parents=True)  # its temporary name is taken by a folder
    with pytest.raises(UserError) as e:
        deploy.deploy(bundle, device.info(vdev.serial), State(), force=True)
    assert "refused a.bin" in e.value.problem and "directory" in e.value.problem
    assert not (_on_device(vdev, bundle) / layout.DEVICE_MANIFEST).exists()
    (_on_device(vdev, bundle) / ".a.bin.part").rmdir()
    deploy.deploy(bundle, device.info(vdev.serial), State())  # the next deploy sends it
    _check_landed(vdev, bundle)


class _CancelAtFirstProgress(State):
    def progress(self, fraction: float, message: str | None = None) -> None:
        super().progress(fraction, message)
        self.cancel()


def test_a_cancelled_push_says_so_leaves_no_half_file_and_the_next_one_finishes(
        vdev: VirtualDevice, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deploy, "_BLOCK", 2 * deploy.SYNC_CHUNK)
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(20 * deploy.SYNC_CHUNK)})
    with pytest.raises(Cancelled):
        deploy.deploy(bundle, device.info(vdev.serial), _CancelAtFirstProgress(), force=True)
    assert not (_on_device(vdev, bundle) / "a.bin").exists()
    total = sum(p.stat().st_size for p in deploy.local_files(bundle))
    assert deploy.deploy(bundle, device.info(vdev.serial), State()).bytes_sent == total
    _check_landed(vdev, bundle)


def test_a_bundle_compiled_quickly_for_the_simulator_is_kept_off_a_phone_with_the_fix(tmp_path: Path) -> None:
    """`npustudio run` without a phone compiles with QNN's quicker finalization: fine on the virtual device, but a
    phone is told to get graphs compiled for it (they run faster there) rather than silently given the others."""
    folder = _bundle(tmp_path, {"a.bin": b"x"})
    meta = json.loads((folder / layout.METADATA).read_text())
    (folder / layout.METADATA).write_text(json.dumps(meta | {"optimize": "quick"}))
    sm8750 = {"soc": "SM8750", "soc_model": 69, "dsp_arch": "v79", "ram_bytes": 16 * 2**30, "free_bytes": 2**40}
    phone = device.DeviceInfo(serial="p", state="device", **sm8750)
    virtual = device.DeviceInfo(serial="v", state="device", virtual=True, **sm8750)
    problems = device.compatibility(phone, folder)
    assert [p for p, _ in problems if "quick check on the simulator" in p]
    assert any("--optimize phone" in fix for _, fix in problems)
    assert device.compatibility(virtual, folder) == []
    (folder / layout.METADATA).write_text(json.dumps(meta))  # an earlier bundle, or one compiled for a phone
    assert not [p for p, _ in device.compatibility(phone, folder) if "simulator" in p]


def test_a_file_changed_while_it_is_pushed_is_refused_and_not_recorded(vdev: VirtualDevice, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deploy, "_BLOCK", 2 * deploy.SYNC_CHUNK)
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(10 * deploy.SYNC_CHUNK)})
    real_advance = deploy._Progress.advance

    def advance_then_rewrite(self: deploy._Progress, n: int) -> None:
        real_advance(self, n)
        if self.done == n:  # the first block is out: the file is rebuilt under the push
            (bundle / "a.bin").write_bytes(os.urandom(11 * deploy.SYNC_CHUNK))

    monkeypatch.setattr(deploy._Progress, "advance", advance_then_rewrite)
    with pytest.raises(UserError) as e:
        deploy.deploy(bundle, device.info(vdev.serial), State(), force=True)
    assert "a.bin changed while it was pushed" in e.value.problem
    assert not (_on_device(vdev, bundle) / "a.bin").exists()
    assert not (_on_device(vdev, bundle) / layout.DEVICE_MANIFEST).exists()
    monkeypatch.setattr(deploy._Progress, "advance", real_advance)
    deploy.deploy(bundle, device.info(vdev.serial), State())  # the next deploy sends what the file is now
    _check_landed(vdev, bundle)


def test_the_hash_cache_forgets_files_that_are_gone_and_shrugs_off_damage(vdev: VirtualDevice,
                                                                          tmp_path: Path) -> None:
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "npustudio" / "sha256.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text('{"x": 1, "/nowhere/at/all.bin": [1, 2, "ab"]}')  # a damaged entry and a file long gone
    dev = device.info(vdev.serial)
    old = _bundle(tmp_path / "old", {"a.bin": os.urandom(1000)})
    deploy.deploy(old, dev, State(), force=True)
    assert sorted(json.loads(cache.read_text())) == sorted(str(p.resolve()) for p in deploy.local_files(old))
    shutil.rmtree(old)
    new = _bundle(tmp_path / "new", {"b.bin": os.urandom(1000)})
    deploy.deploy(new, dev, State(), force=True)
    assert sorted(json.loads(cache.read_text())) == sorted(str(p.resolve()) for p in deploy.local_files(new))


@pytest.mark.parametrize("bad", ["link", "folder", "garbage", "huge"])
def test_a_hash_cache_it_cannot_use_never_turns_a_finished_deploy_into_a_failure(
        vdev: VirtualDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    """The files are on the device either way: a cache that is a link or a folder costs a warning (exit 0), a
    damaged or huge one is ignored and written afresh."""
    from npustudio.cli import main

    cache = Path(os.environ["XDG_CACHE_HOME"]) / "npustudio" / "sha256.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    if bad == "link":
        cache.symlink_to(target)
    elif bad == "folder":
        cache.mkdir()
    elif bad == "garbage":
        cache.write_bytes(b"\xff{[" * 100)
    else:
        with open(cache, "wb") as f:  # sparse: larger than the cache is ever read
            f.truncate(deploy._HashCache.LIMIT + 1)
    try:
        bundle = _bundle(tmp_path, {"a.bin": os.urandom(5000)})
        rc = main(["deploy", str(bundle), "--device", vdev.serial])
        text = capsys.readouterr().err
        assert rc == 0, text
        _check_landed(vdev, bundle)
        assert "Traceback" not in text and "failed" not in text, text
        if bad in ("link", "folder"):
            assert "warning:" in text and "hash cache" in text and "was not updated" in text, text
            assert target.read_text() == "{}"  # nothing written through the link
        else:
            assert "warning" not in text, text
            assert sorted(json.loads(cache.read_text())) == sorted(str(p.resolve()) for p in deploy.local_files(bundle))
    finally:
        if cache.is_symlink() or cache.is_file():
            cache.unlink()
        elif cache.is_dir():
            cache.rmdir()


@pytest.mark.parametrize("manifest", ["[" * 100_000 + "]" * 100_000, '{"a.bin": "not an entry"}',
                                      '{"x": 1}' + " " * (64 * 2**20)])
def test_a_device_manifest_too_deep_damaged_or_huge_costs_a_full_push_only(vdev: VirtualDevice, tmp_path: Path,
                                                                            manifest: str) -> None:
    """Whatever the device's manifest holds, it is read at most 64 MiB deep and the deploy ends, every file sent."""
    bundle = _bundle(tmp_path, {"a.bin": os.urandom(3000)})
    remote = _on_device(vdev, bundle)
    remote.mkdir(parents=True)
    (remote / layout.DEVICE_MANIFEST).write_text(manifest)
    (remote / "a.bin").write_bytes(b"x" * 3000)  # the same size: the manifest's entry is what decides
    res = deploy.deploy(bundle, device.info(vdev.serial), State())
    assert res.bytes_skipped == 0
    _check_landed(vdev, bundle)


def test_a_phone_without_memory_for_the_draft_is_refused_before_the_push_naming_the_figures(vdev: VirtualDevice,
                                                                                            tmp_path: Path) -> None:
    """A draft-model bundle needs the draft's binaries in RAM beside the target's: a phone where the target alone
    would fit is refused before anything is sent, with the target's and the draft's share and the way out."""
    folder = _bundle(tmp_path, {})
    for name, size in (("shared_1_of_1.bin", 1_500_000_000), ("draft_shared_1_of_1.bin", 600_000_000)):
        with open(folder / name, "wb") as f:
            f.truncate(size)  # sparse: the figures without the disk
    info = device.info(vdev.serial)
    phone = info.model_copy(update={"ram_bytes": 4 * 10**9, "free_bytes": 2**40, "virtual": False})
    problems = [p for p in device.compatibility(phone, folder) if "RAM" in p[0]]
    assert len(problems) == 1, problems
    said, fix = problems[0]
    assert "an app may use about 2.0 GB; this bundle needs about 2.37 GB" in said, said
    assert "1.77 GB of it the target and runtime, 0.60 GB the draft model" in said, said
    assert "--decoding basic" in fix, fix
    (folder / "draft_shared_1_of_1.bin").unlink()
    assert not [p for p in device.compatibility(phone, folder) if "RAM" in p[0]]
