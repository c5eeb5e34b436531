"""Run a deployed MNN model on a device with MNN's `llm_demo`: the prompt goes as a file, the answer streams back.

`llm_demo config.json prompt.txt N` reads one prompt a line, applies the model's chat template itself, answers at
most N tokens and ends with its figures between rules of `#` (`mnn.llm_demo` is the virtual device's). The prompt
never appears in the shell line. A prompt llm_demo would read as something else (several lines, a first `#`) is
refused, not changed. Known failures (no llm_demo, a library missing, a model it cannot load) are explained.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from .. import layout
from ..errors import UserError
from ..mnn.llm_demo import RULE_CLOSE, RULE_OPEN
from ..mnn.runtime import Timings
from . import client, remote_shell

PROGRAM = "llm_demo"
_PROMPT_FILE = "prompt file is "
_FIGURE = re.compile(r"^\s*(prompt tokens num|decode tokens num|prefill time|decode time) = ([\d.]+)", re.M)

FAILURES: remote_shell.Failures = [
    (r"llm_demo: (inaccessible or not found|not found)|llm_demo: No such file",
     "MNN's llm_demo is not on the device.",
     "Point NPU Studio at an MNN Android build (MNN_ANDROID_ROOT, or Settings > MNN Android runtime) and deploy "
     "again: the model's folder then carries llm_demo and its libraries."),
    (r"CANNOT LINK EXECUTABLE|library \"?[\w.+-]+\.so\"? not found|dlopen failed|cannot locate symbol",
     "A library llm_demo needs is missing on the device, or is from another MNN build.",
     "Deploy llm_demo with the libraries of the same MNN Android build (MNN_ANDROID_ROOT) again."),
    (r"Exec format error|wrong ELF class|not executable: (32|64)-bit",
     "llm_demo is built for another CPU.", "Use an arm64-v8a build of MNN (project/android/build_64)."),
    (r"LLM init error|Unable to open llm_config|tokenizer file not found|load.*fail",
     "MNN could not load the model on the device (a file of it is missing or from another MNN version).",
     "Deploy the model again; use an llm_demo built from MNN 3.x, the version that exported it."),
]


@dataclass
class Output:
    """An llm_demo stream, read: the log before the answer, the answer, and the figures' block (when it came)."""

    begun: bool = False
    ended: bool = False
    answer: str = ""
    before: list[str] = field(default_factory=list)
    figures: Timings | None = None  # llm_demo's own counters


class Reader:
    """llm_demo's output fed as it streams; only the answer goes on to `on_answer`, as it comes (what could still
    be the start of the figures' rule is held back until the next piece says otherwise)."""

    _MARK = "\n" + RULE_OPEN + "\n"

    def __init__(self, on_answer: Callable[[str], None] = lambda _s: None) -> None:
        self.on_answer = on_answer
        self.out = Output()
        self._pending = ""
        self._tail = ""

    def feed(self, text: str) -> None:
        if self.out.ended:
            self._tail += text
            return
        self._pending += text
        if not self.out.begun:
            at = self._pending.find(_PROMPT_FILE)
            nl = self._pending.find("\n", at) if at >= 0 else -1
            if nl < 0:
                return
            self.out.before = [ln for ln in self._pending[:at].splitlines() if ln.strip()]
            self.out.begun, self._pending = True, self._pending[nl + 1:]
        end = self._pending.find(self._MARK)
        if end >= 0:
            self._emit(self._pending[:end])
            self.out.ended, self._tail, self._pending = True, self._pending[end:], ""
            return
        keep = next((k for k in range(min(len(self._MARK), len(self._pending)), 0, -1)
                     if self._MARK.startswith(self._pending[-k:])), 0)
        self._emit(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _emit(self, text: str) -> None:
        if text:
            self.out.answer += text
            self.on_answer(text)

    def close(self) -> Output:
        if self.out.begun and not self.out.ended:
            self._emit(self._pending)
        elif not self.out.begun:
            self.out.before = [ln for ln in self._pending.splitlines() if ln.strip()]
        self._pending = ""
        if self.out.ended and RULE_CLOSE in self._tail:
            got = {k: float(v) for k, v in _FIGURE.findall(self._tail)}
            self.out.figures = Timings(int(got.get("prompt tokens num", 0)), int(got.get("decode tokens num", 0)),
                                       got.get("prefill time", 0.0), got.get("decode time", 0.0))
        self.out.answer = self.out.answer.removesuffix("\n")
        return self.out


def read(output: str) -> Output:
    r = Reader()
    r.feed(output)
    return r.close()


def check_prompt(prompt: str) -> str:
    """The prompt as llm_demo will read it (one line), or refused: it would read several lines as several prompts
    and skip a line that starts with `#`."""
    if not prompt.strip():
        raise UserError("The prompt is empty.", "Type a question.")
    if "\n" in prompt or "\r" in prompt:
        raise UserError("MNN's llm_demo reads one prompt per line: a prompt of several lines would be answered as "
                        "several questions.", "Put the question on one line.")
    if prompt.startswith("#"):
        raise UserError("MNN's llm_demo skips a prompt that starts with '#'.", "Start the question otherwise.")
    return prompt


def explain(output: str, out: Output | None = None) -> UserError | None:
    """None when llm_demo answered (its figures' block came); a failure explained, with the device's last lines.
    `out`: the output already read."""
    out = out or read(output)
    if out.figures is not None:
        return None
    said = [ln.strip() for ln in (out.before if out.begun else output.splitlines()) if ln.strip()]
    return remote_shell.explained(output, said, FAILURES, PROGRAM, "Check the device's free memory and that "
                                  "llm_demo matches the MNN version of the model.")


class MnnRun(BaseModel):
    text: str
    output: str
    status: str  # complete | stopped
    prompt_tokens: int = 0
    answer_tokens: int = 0
    prefill_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    seconds: float


def run(serial: str, remote_dir: str, prompt: str, on_output: Callable[[str], None], max_tokens: int,
        stop: threading.Event | None = None) -> MnnRun:
    """Ask `prompt` of the MNN model deployed in `remote_dir`; `on_output` gets llm_demo's raw output as it comes
    (feed it to a `Reader` for the answer alone)."""
    prompt = check_prompt(prompt)
    d = client().device(serial=serial)
    d.sync.push((prompt + "\n").encode("utf-8"), posixpath.join(remote_dir, layout.PROMPT_FILE), mode=0o644)
    own = d.sync.exists(posixpath.join(remote_dir, PROGRAM))  # deployed with the model, else the device's
    q = shlex.quote
    line = (f"cd {q(remote_dir)} && {remote_shell.PID_ECHO} && LD_LIBRARY_PATH={q(remote_dir)}:$LD_LIBRARY_PATH "
            f"exec {'./' if own else ''}{PROGRAM} {layout.MNN_CONFIG} {layout.PROMPT_FILE} {int(max_tokens)} 2>&1")
    t0 = time.perf_counter()
    output, stopped = remote_shell.stream(d, line, on_output, stop)
    out = read(output)
    if not stopped and (err := explain(output, out)) is not None:
        raise err
    f = out.figures or Timings(0, 0, 0.0, 0.0)
    return MnnRun(text=out.answer, output=output, status="stopped" if stopped else "complete",
                  prompt_tokens=f.prompt_tokens, answer_tokens=f.answer_tokens, prefill_s=f.prefill_s,
                  prefill_tok_s=f.prefill_tok_s, decode_tok_s=f.decode_tok_s,
                  seconds=round(time.perf_counter() - t0, 3))
