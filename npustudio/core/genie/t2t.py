"""genie-t2t-run, the protocol: the flags it takes, the framed output it writes, and the reader of that output.

A phone runs Qualcomm's genie-t2t-run; the virtual device (for a device line's `genie-t2t-run`) and
`npustudio genie-run` run this one (`main`, `run`): the real Genie on the HTP simulator, or the CPU preview.
Both take Qualcomm's flags (`FLAGS`: -c/--config, -p/--prompt, --prompt_file, --profile, --log; this one adds
--max-tokens, --raw and --preview) and write the answer framed as Qualcomm's does, on stdout:

    [PROMPT]: <the prompt>\\n\\n[BEGIN]: <the answer>[END]\\n

with Genie's log on stderr. Over adb the two are one stream, so the log comes before `[PROMPT]` (this runner
writes `[PROMPT]`/`[BEGIN]` at the first token) and what Genie logs while answering waits until after `[END]`;
`[END]` ends only a query that returned, so a reader never takes a failure for an answer (`Writer`).

`Reader` splits such a stream, ours or a phone's, into the answer and the log lines, as it arrives. The framing
has no escape: a prompt may hold `[BEGIN]: ` and an answer `[END]`. The reader given the prompt skips its echo
exactly; the answer ends at the last `[END]` that ends a line (a run asks one query; one inside a line is text):
text after such an `[END]` is held until a later one makes it answer or the end of the stream (`close`) makes it
log, so an answer that says `[END]` arrives whole, its rest once the stream has ended.

The virtual device starts this module's `main` in an isolated interpreter (`command`); its file flags are
mapped into the device's sandbox there (`core/device/phone_commands.py`), from `FLAGS`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from .. import layout
from ..errors import UserError
from .libgenie import LOG_LEVELS as _LEVELS

OnText = Callable[[str], None]

PROMPT, BEGIN, END = "[PROMPT]: ", "[BEGIN]: ", "[END]"
LOG_LEVELS = tuple(_LEVELS)  # error, warn, info, verbose: --log's values, Genie's levels
MAX_TOKENS = 131072  # --max-tokens' bound: no phone holds a longer KV cache; larger values are typos


# -- the flags ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One option of genie-t2t-run. `takes`: what its value is (nothing for a switch; `input` a file it reads,
    `output` a file it writes: paths a device maps into its sandbox). `qualcomm`: Qualcomm's genie-t2t-run has it
    too (a phone's takes it). `device_line`: a device's shell line may give it (the virtual device sets
    --preview itself, from the mode it was started in)."""

    names: tuple[str, ...]
    help: str
    takes: Literal["switch", "text", "input", "output"] = "text"
    qualcomm: bool = True
    device_line: bool = True


def _given(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (give a path)")
    return text


def _count(text: str) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (use 1 to {MAX_TOKENS})") from None
    if not 1 <= v <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{v} is out of range (use 1 to {MAX_TOKENS})")
    return v


_count.__name__ = "number"  # argparse names the type in its messages

FLAGS = (
    Flag(("-c", "--config"), f"the bundle's {layout.GENIE_CONFIG}", "input"),
    Flag(("-p", "--prompt"), "the prompt"),
    Flag(("--prompt_file",), "prompt text file (real newlines)", "input"),
    Flag(("--profile",), "write Genie's profile JSON here", "output"),
    Flag(("--log",), "Genie's log level, on stderr"),
    Flag(("-l", "--lora"), f"answer with the bundle's LoRA adapter: NAME, or NAME,{layout.LORA_ALPHA},STRENGTH "
         "(0 to 1)"),
    Flag(("--max-tokens",), "stop after N generated tokens", qualcomm=False),
    Flag(("--raw",), "send the prompt exactly as given (genie-t2t-run's way); by default a prompt that is not "
         "already in the model's chat template is put into it", "switch", qualcomm=False),
    Flag(("--preview",), "fast preview: the quantized graphs on the CPU, not Genie", "switch", qualcomm=False,
         device_line=False),
)
HELP = Flag(("-h", "--help"), "show this help message and exit", "switch")


def device_flags() -> dict[str, Flag]:
    """Each name a device's shell line may pass to genie-t2t-run (help included), with its flag."""
    return {name: f for f in (*FLAGS, HELP) if f.device_line for name in f.names}


def add_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`FLAGS` on a parser: `npustudio genie-run`'s and this runner's own (`parser`)."""
    extra: dict[str, dict[str, Any]] = {
        "--config": {"type": _given, "required": True}, "--prompt_file": {"type": _given},
        "--profile": {"type": _given}, "--log": {"default": "error", "choices": LOG_LEVELS},
        "--max-tokens": {"type": _count}}
    for f in FLAGS:
        kw: dict[str, Any] = {"action": "store_true"} if f.takes == "switch" else {"default": None}
        p.add_argument(*f.names, help=f.help, **(kw | extra.get(f.names[-1], {})))
    return p


def parser(prog: str = "genie-t2t-run") -> argparse.ArgumentParser:
    return add_flags(argparse.ArgumentParser(prog=prog, description="Run a Genie bundle (genie-t2t-run compatible): "
                                             "the answer framed on stdout, Genie's log on stderr."))


# -- writing ------------------------------------------------------------------------------------
class Writer:
    """The framing, written as Genie answers: `[PROMPT]`/`[BEGIN]` at the first piece of text, the text as it
    comes, and `end`: `[END]` after a query that returned, a bare newline after one that did not. Log lines go to
    `err` until the answer begins, then wait until it has ended (over adb both are one stream)."""

    def __init__(self, prompt: str, out: TextIO, err: TextIO) -> None:
        self.prompt, self.out, self.err = prompt, out, err
        self.begun = False
        self.held: list[str] = []

    def begin(self) -> None:
        if not self.begun:
            self.begun = True
            self.out.write(f"{PROMPT}{self.prompt}\n\n{BEGIN}")
            self.out.flush()

    def text(self, s: str) -> None:
        self.begin()
        self.out.write(s)
        self.out.flush()

    def log(self, line: str) -> None:
        if self.begun:
            self.held.append(line)
        else:
            self.say(line)

    def say(self, line: str) -> None:
        """One line of ours on stderr (never held)."""
        self.err.write(line + "\n")
        self.err.flush()

    def end(self, returned: bool) -> None:
        if returned:
            self.begin()
            self.out.write(END + "\n")
        elif self.begun:
            self.out.write("\n")
        self.out.flush()
        for line in self.held:
            self.say(line)
        self.held = []


# -- running ------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> int:
    """The runner, on `parser()`'s arguments: the exit status (130 when stopped). The answer alone reaches stdout:
    QNN's and Genie's native banners go to /dev/null (their log comes through Genie's logger), and so does their
    stderr outside --log verbose, while our lines keep stderr. Ctrl-C (SIGINT, a device's too) stops the answer."""
    import contextlib
    import ctypes

    from ..native_io import fd_redirected
    from . import adapters, host
    from .config import as_chat_prompt, check_prompt, read_prompt_file

    prompt = read_prompt_file(Path(a.prompt_file)) if a.prompt_file else a.prompt or ""
    check_prompt(prompt)
    if a.profile:
        host.check_output_file(Path(a.profile), "--profile")
    if not a.raw:
        prompt = as_chat_prompt(Path(a.config).parent, prompt)
    lora = adapters.parse(a.lora)  # before any work: a bad -l is a message, not a half-run
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(os.fdopen(os.dup(stack.enter_context(fd_redirected(1))), "w", encoding="utf-8"))
        err = sys.stderr
        if a.log != "verbose":
            err = stack.enter_context(os.fdopen(os.dup(stack.enter_context(fd_redirected(2))), "w",
                                                encoding="utf-8"))
        w = Writer(prompt, out, err)
        if a.preview:  # before [BEGIN]: over adb, stderr and stdout arrive as one stream
            w.say("preview: the quantized graphs on the CPU, not Genie on the HTP")
        res = None
        try:
            res = host.until_done(lambda: host.run(
                Path(a.config), prompt, w.text, Path(a.profile) if a.profile else None, log_level=a.log,
                on_log=w.log, stop=stop, max_tokens=a.max_tokens, preview=a.preview, lora=lora),
                stop, lambda: w.say("\nstopping…"))
        finally:
            ctypes.CDLL(None).fflush(None)  # native buffers to /dev/null before [END] ends the answer
            w.end(res is not None)
        if res.status == "aborted":
            w.say("aborted")
            return 130
        if res.status == "context-full":
            w.say("Genie stopped: the prompt and the answer filled the model's context. Shorten the prompt.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """genie-t2t-run on this computer, as the virtual device runs it: a refusal is `error:`/`fix:` lines on
    stderr and exit 2, as `npustudio` says it; an unexpected failure one `error:` line and exit 1."""
    from .. import quiet

    a = parser().parse_args(argv)
    quiet.libraries()
    try:
        return run(a)
    except UserError as e:
        print(f"error: {e.problem}" + (f"\nfix: {e.fix}" if e.fix else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aborted", file=sys.stderr)
        return 130
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"error: genie-t2t-run failed unexpectedly: {e.__class__.__name__}" + (f": {first}" if first else ""),
              file=sys.stderr)
        return 1


def command(*args: str) -> list[str]:
    """The argv that runs `main(args)` in a fresh, isolated interpreter importing this very package: what the
    virtual device starts for genie-t2t-run (`launch.isolated`)."""
    from ..launch import isolated

    return isolated(__name__, *args)


# -- reading ------------------------------------------------------------------------------------
@dataclass
class Output:
    """A genie-t2t-run stream, read (`Reader.close`, `read`): `answer` is what came between `[BEGIN]: ` and the
    last `[END]` (everything after `[BEGIN]: ` when no `[END]` came); `before` and `after` are the log lines on
    either side, without the prompt's echo."""

    begun: bool = False
    ended: bool = False
    answer: str = ""
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)


def _ignore(_s: str) -> None:
    pass


class Reader:
    """genie-t2t-run's one stream (stdout and stderr together), read as it arrives: `feed` each piece of text,
    `close` at the end of the stream. The answer streams to `on_text`, the log lines before and after it to
    `on_log` a line at a time (blank ones left out); the prompt's echo goes to neither. `prompt` (the prompt as
    sent) lets the reader skip its echo exactly, whatever it holds; without it (or when the echo differs) the
    echo ends at the first `[BEGIN]: `. Text after an `[END]` is held until it is known to be answer or log."""

    def __init__(self, on_text: OnText | None = None, on_log: OnText | None = None,
                 prompt: str | None = None) -> None:
        self._on_text, self._on_log = on_text or _ignore, on_log or _ignore
        self._echo = None if prompt is None else PROMPT + prompt
        self._where: Literal["before", "echo", "answer", "after"] = "before"
        self._echoed = False  # the exact echo was skipped: the lines after it are log again
        self._buf = ""
        self._scan = 0  # after an [END]: where in the held text a later one may start
        self._answer: list[str] = []
        self.output = Output()

    def __call__(self, s: str) -> None:
        self.feed(s)

    def feed(self, s: str) -> None:
        self._buf += s
        while self._step():
            pass

    def close(self) -> Output:
        """The end of the stream: what is still held is settled (after an `[END]`: the log)."""
        o, buf, self._buf = self.output, self._buf, ""
        if self._where == "answer":
            if buf == END:  # the stream's last word
                o.ended = True
            else:
                self._text(buf)
        elif self._where == "after":
            o.ended = True
            if buf.endswith(END):  # a later [END], the stream's last word: what came between was answer
                self._text(END + buf[:-len(END)])
            else:
                self._lines(buf + "\n", o.after)
        elif self._where == "before":
            self._lines(buf + "\n", o.before)
        self._where = "before"
        o.answer = "".join(self._answer)
        return o

    def _text(self, s: str) -> None:
        if s:
            self._answer.append(s)
            self._on_text(s)

    def _lines(self, text: str, into: list[str]) -> str:
        """Each whole line of `text` to the log; returns the unfinished rest."""
        *whole, rest = text.split("\n")
        for line in whole:
            line = line.rstrip("\r")
            if line.strip():
                into.append(line)
                self._on_log(line)
        return rest

    def _step(self) -> bool:
        """One move through the stream; False when more text is needed."""
        buf = self._buf
        if self._where == "before":
            b = buf.find(BEGIN)
            p = -1 if self._echoed else (0 if buf.startswith(PROMPT) else buf.find("\n" + PROMPT) + 1 or -1)
            if p >= 0 and (b < 0 or p < b):  # the echo starts a line
                self._lines(buf[:p], self.output.before)
                self._buf, self._where = buf[p:], "echo"
                return True
            if b < 0:
                self._buf = self._lines(buf, self.output.before)  # an unfinished line may yet hold a marker
                return False
            self._lines(buf[:b] + "\n", self.output.before)
            self._buf, self._where, self.output.begun = buf[b + len(BEGIN):], "answer", True
            return True
        if self._where == "echo":
            echo = self._echo
            if echo is not None and not self._echoed:
                if buf.startswith(echo):
                    self._buf, self._echoed, self._where = buf[len(echo):], True, "before"
                    return True
                if echo.startswith(buf):
                    return False  # the echo so far: wait for the rest
                self._echo = None  # not our prompt's echo: it ends at the first [BEGIN]
            b = buf.find(BEGIN)
            if b < 0:
                return False
            self._buf, self._where, self.output.begun = buf[b + len(BEGIN):], "answer", True
            return True
        e, decided = _end(buf, self._scan)
        if self._where == "answer":
            if e < 0:  # the end of a piece may be the start of the marker: held until the next one
                keep = len(END) if decided is None else \
                    next((k for k in range(len(END) - 1, 0, -1) if buf.endswith(END[:k])), 0)
                self._text(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._text(buf[:e])
            self._buf, self._where = buf[e + len(END):], "after"
            return True
        if e < 0:  # after an [END]: answer if another [END] follows, else the log
            self._scan = max(0, len(buf) - (len(END) if decided is None else len(END) - 1))
            return False
        self._text(END + buf[:e])
        self._buf, self._scan = buf[e + len(END):], 0
        return True


def _end(text: str, start: int = 0) -> tuple[int, bool | None]:
    """Where the next `[END]` that ends a line is in `text` (from `start`), else -1, with None when `text` ends with
    an `[END]` that may yet (the next character a newline) or may not end a line. One inside a line is text."""
    i = start
    while (e := text.find(END, i)) >= 0:
        after = e + len(END)
        if after == len(text):
            return -1, None
        if text[after] in "\r\n":
            return e, True
        i = after
    return -1, False


def read(output: str, prompt: str | None = None) -> Output:
    """A whole genie-t2t-run stream, read."""
    r = Reader(prompt=prompt)
    r.feed(output)
    return r.close()


if __name__ == "__main__":  # `command` in a packaged app
    sys.exit(main(sys.argv[1:]))
