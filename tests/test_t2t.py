"""genie-t2t-run's protocol (core/genie/t2t.py): what the writer frames the reader reads back, a phone's output is
read the same way, and the virtual device starts the runner itself, never a CLI module. No model, no adb server."""

from __future__ import annotations

import io
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from npustudio.core import launch
from npustudio.core.device import phone_shell
from npustudio.core.device.virtual import VirtualDevice
from npustudio.core.genie import t2t
from tests.conftest import subcommands

AWKWARD = ["[END]", "[END]\n", "[BEGIN]: ", "[PROMPT]: ", "[EN", "[", "]", "\n", "\r\n", "é", "日本語", "🚀",
           "error: not a failure, a word of the answer\n", "<|im_end|>"]


def _written(prompt: str, pieces: list[str], before: list[str], during: list[str], returned: bool = True) -> str:
    """What the runner writes for one query, stdout and stderr as one stream (as over adb)."""
    stream = io.StringIO()
    w = t2t.Writer(prompt, stream, stream)
    for line in before:
        w.log(line)
    for i, piece in enumerate(pieces):
        w.text(piece)
        if i < len(during):
            w.log(during[i])  # logged while answering: held until the answer has ended
    w.end(returned)
    return stream.getvalue()


def _read(stream: str, size: int, prompt: str | None) -> tuple[list[str], list[str], t2t.Output]:
    text: list[str] = []
    logs: list[str] = []
    r = t2t.Reader(text.append, logs.append, prompt)
    for i in range(0, len(stream), size):
        r.feed(stream[i:i + size])
    return text, logs, r.close()


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.one_of(st.sampled_from(AWKWARD), st.text(max_size=6)), max_size=8).map("".join),
       pieces=st.lists(st.one_of(st.sampled_from(AWKWARD), st.text(max_size=8)), max_size=12),
       size=st.sampled_from([1, 2, 5, 4096]))
@example(prompt="say [BEGIN]: and [END]\n\n[BEGIN]: twice", pieces=["Paris", "[END]", " is\n", "[EN", "D] [END]"],
         size=1)
@example(prompt="", pieces=[], size=1)
@example(prompt="Q", pieces=["a[END]", "\n[PROMPT]: x\n", "ünï 🚀 [END]"], size=3)
def test_what_the_writer_frames_the_reader_reads_back_whole(prompt: str, pieces: list[str], size: int) -> None:
    """The framing has no escape: the answer may hold `[END]`, a prompt `[BEGIN]: `, either brackets, newlines and
    any text. The reader, given the prompt, skips its echo exactly and ends the answer at the last `[END]`, so the
    answer comes back as written, whatever the chunking, and Genie's log lines come apart from it."""
    before, during = ["Genie Logger created with level : 3", "GenieDialog_create [GenieDialog.cpp:143]"], \
        ["[INFO] query in progress", "[WARN] something (with brackets)"]
    stream = _written(prompt, pieces, before, during)
    text, logs, out = _read(stream, size, prompt)
    assert "".join(text) == out.answer == "".join(pieces)
    assert (out.begun, out.ended) == (True, True)
    assert logs == out.before + out.after == before + during[:len(pieces)]
    assert t2t.read(stream, prompt) == out


def test_a_query_that_did_not_return_has_no_end_and_keeps_what_came_after_begin() -> None:
    """No `[END]` after a failed query: everything after `[BEGIN]: ` is the answer so far (where the device's failure
    is, for `remote_genie.explain`), and the reader says the run did not end."""
    stream = _written("Q", ["Par", "is [END] so far"], ["loading"], ["Failed to query"], returned=False)
    out = t2t.read(stream, "Q")
    assert (out.begun, out.ended) == (True, False)
    assert out.answer == "Paris [END] so far" + "\nFailed to query\n" and out.before == ["loading"]


def test_a_phones_output_splits_into_the_answer_and_genies_log_lines() -> None:
    """Qualcomm's genie-t2t-run over adb (stdout and stderr together; the prompt echoed over several lines): the log
    lines before and after the answer go to the log, the prompt's echo to neither, and the answer stays whole,
    whatever the chunking, with or without the prompt known."""
    prompt = "<|im_start|>user\nHi\n\nthere<|im_end|>\n<|im_start|>assistant\n"
    out = ("Genie Logger created with level : 3\nEntering GenieDialog_create [GenieDialog.cpp:143]\n"
           f"[PROMPT]: {prompt}\n\n[BEGIN]: Hello, **world**\n[END]\nGenieDialog_free done\n")
    for known in (prompt, None, "another prompt"):
        for size in (1, 3, 7, len(out)):
            text, logs, res = _read(out, size, known)
            assert "".join(text) == res.answer == "Hello, **world**\n", (known, size)
            assert logs == ["Genie Logger created with level : 3",
                            "Entering GenieDialog_create [GenieDialog.cpp:143]", "GenieDialog_free done"], (known, size)


def test_the_cli_and_the_device_take_the_flags_from_one_list() -> None:
    """`npustudio genie-run` has exactly `t2t.FLAGS` (and the CLI's --debug); a device line may give each but
    --preview (the virtual device's mode decides it); Qualcomm's flags are among them."""
    from npustudio.cli import build_parser

    sub = subcommands(build_parser())["genie-run"]
    names = {o for a in sub._actions for o in a.option_strings}
    assert names == {n for f in t2t.FLAGS for n in f.names} | {"-h", "--help", "--debug"}
    assert set(t2t.device_flags()) == names - {"--preview", "--debug"}
    assert {n for f in t2t.FLAGS if f.qualcomm for n in f.names} == \
        {"-c", "--config", "-p", "--prompt", "--prompt_file", "--profile", "--log", "-l", "--lora"}


@pytest.fixture
def phone(tmp_path: Path) -> Iterator[VirtualDevice]:
    vd = VirtualDevice(tmp_path / "phone").start()
    yield vd
    vd.stop()


def _shell(vd: VirtualDevice, line: str) -> str:
    """One `adb shell LINE` on the device, without an adb server."""
    out = bytearray()
    inbox: queue.Queue[bytes | None] = queue.Queue()

    def write(b: bytes) -> bool:
        out.extend(b)
        return True

    phone_shell.serve(vd, line, write, inbox, threading.Event())
    inbox.put(None)
    return out.decode()


def test_the_devices_genie_t2t_run_starts_the_runner_and_no_cli_module(phone: VirtualDevice,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The host process a device line's genie-t2t-run starts: an isolated interpreter that runs `t2t.main` (never
    `npustudio.cli`, its settings or its other commands), each argument its own argv item, file options inside the
    sandbox, --preview only from the device's mode."""
    seen: list[list[str]] = []

    def spawn(_s: phone_shell.Session, argv: list[str], _env: dict[str, str], _r: bool,
              _readable: tuple[Path, ...] = ()) -> int:
        seen.append(argv)
        return 0

    monkeypatch.setattr(phone_shell.Session, "spawn", spawn)
    tmp = phone.root / "data/local/tmp"
    assert _shell(phone, "cd /data/local/tmp && genie-t2t-run -c genie_config.json -p 'a; rm -rf / $(x)' "
                         "--prompt_file p.txt --profile out.json --log info --max-tokens 4 --raw") == ""
    argv = seen.pop()
    assert argv[:6] == [sys.executable, "-I", "-c", launch.LAUNCH, str(Path(t2t.__file__).resolve().parents[3]),
                        "npustudio.core.genie.t2t"]
    assert argv[6:] == ["-c", str(tmp / "genie_config.json"), "-p", "a; rm -rf / $(x)", "--prompt_file",
                        str(tmp / "p.txt"), "--profile", str(tmp / "out.json"), "--log", "info", "--max-tokens", "4",
                        "--raw"]
    assert not any("npustudio.cli" in a or a == "-m" for a in argv)
    assert "--preview" in _shell(phone, "genie-t2t-run --preview -p hi") and not seen  # refused, nothing started
    assert "Permission denied" in _shell(phone, "genie-t2t-run -c /system/../../etc/passwd") and not seen
    phone.preview = True
    _shell(phone, "genie-t2t-run -c genie_config.json -p hi")
    assert seen.pop()[6:] == ["--preview", "-c", str(tmp / "genie_config.json"), "-p", "hi"]


def test_the_command_the_device_starts_is_this_packages_runner(tmp_path: Path) -> None:
    """`t2t.command` runs this very package's `main` (not whatever `npustudio` an isolated interpreter would import
    first): its help names genie-t2t-run, and a refusal is `error:`/`fix:` lines and exit 2, as the CLI says it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # as the device gives it: no PYTHONPATH
    res = subprocess.run(t2t.command("--help"), capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.startswith("usage: genie-t2t-run"), res.stderr
    res = subprocess.run(t2t.command("-c", str(tmp_path / "genie_config.json"), "-p", "hi"), capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.startswith("error: No Genie config at") and "\nfix: " in res.stderr
