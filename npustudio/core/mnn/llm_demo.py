"""MNN's `llm_demo` on this computer: what the virtual device runs for a phone's, with MNN's own runtime (`MNN.llm`).

The phone's program, from MNN's sources (transformers/llm/engine/demo/llm_demo.cpp), is
`llm_demo config.json [prompt.txt [max_token_number [no-thinking]]]`: it loads the model, reads the prompt file one
prompt a line (empty lines and lines starting with `#` skipped), answers each through MNN's `response` (MNN applies
the model's chat template and samples as config.json says), streaming the answer, and ends with a block of figures
between rules of `#`. This program takes the same arguments and prints the same lines, so the host reads a phone
and the virtual device alike (`device.remote_mnn`). The Python binding prints a debug line around each answer on
the process's own stdout; those lines are taken out of the stream, as the phone's program prints none.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from pathlib import Path

RULE_OPEN = "#" * 33
RULE_CLOSE = "#" * 34
_BINDING_LINE = re.compile(rb"\[MNNLLM\] response: [^\n]*\n")
_PREFIX = b"[MNNLLM] response: "


class _StdoutFilter:
    """fd 1 through a pipe, copied to the real stdout as it comes, without the binding's debug lines."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self.out = os.dup(1)
        r, w = os.pipe()
        os.dup2(w, 1)
        os.close(w)
        self.r = r
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        pending = b""
        while chunk := os.read(self.r, 65536):
            pending = _BINDING_LINE.sub(b"", pending + chunk)
            keep = _partial(pending)
            os.write(self.out, pending[: len(pending) - keep])
            pending = pending[len(pending) - keep:]
        os.write(self.out, pending)

    def close(self) -> None:
        sys.stdout.flush()
        _libc().fflush(None)
        os.dup2(self.out, 1)  # the pipe's last writer closes: the copy ends
        self.thread.join()
        os.close(self.r)
        os.close(self.out)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _unbuffered_c_stdout() -> None:
    """MNN writes the answer through C's stdout, which a pipe makes fully buffered: unbuffered, each piece leaves
    as it is made (the phone's program, on an adb shell, streams too)."""
    libc = _libc()
    libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 2, 0)  # _IONBF


def _partial(data: bytes) -> int:
    """How many trailing bytes may be the start of a debug line still arriving (held back, not shown)."""
    at = data.rfind(b"[")
    if at < 0:
        return 0
    tail = data[at:]
    return len(tail) if (_PREFIX.startswith(tail) or tail.startswith(_PREFIX)) and b"\n" not in tail else 0


def loaded(llm: object) -> bool:
    """Whether `MNN.llm`'s `load()` worked (it returns nothing; its context's status stays NOT_LOADED, -1)."""
    return int(llm._c_obj.get_context().get("status", -1)) != -1  # type: ignore[attr-defined]


def _say(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        _say("Usage: llm_demo config.json <prompt.txt>\n")
        return 0
    config = args[0]
    _say(f"config path is {config}\n")
    if len(args) < 2:  # the phone's program would chat on its terminal, which an adb shell line does not give
        print("error: give a prompt file: llm_demo config.json prompt.txt", file=sys.stderr)
        return 1
    _unbuffered_c_stdout()
    import MNN.llm as mnn_llm

    if not Path(config).is_file():
        print("LLM init error", file=sys.stderr)  # what the phone's program says; it, too, exits 0
        return 0
    from ..errors import UserError
    from .config_check import check

    try:
        check(Path(config))  # never a file outside the model folder, whatever the config names
    except UserError as e:
        print(f"{e.problem}\nLLM init error", file=sys.stderr)
        return 1
    llm = mnn_llm.create(config)
    llm.set_config({"tmp_path": "tmp"})
    llm.load()  # the binding returns nothing: a failed load leaves the context's status at NOT_LOADED
    if not loaded(llm):
        print("LLM init error", file=sys.stderr)
        return 0
    max_tokens = -1
    if len(args) >= 3:
        try:
            max_tokens = int(args[2])
        except ValueError:
            max_tokens = 0  # C++'s stream extraction of a non-number
    if len(args) >= 5:
        _say("Set not thinking, only valid for Qwen3\n")
        llm.set_config({"jinja": {"context": {"enable_thinking": False}}})
    prompt_file = args[1]
    _say(f"prompt file is {prompt_file}\n")
    try:
        lines = Path(prompt_file).read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError:
        lines = []
    prompts = [line.removesuffix("\r") for line in lines if line.removesuffix("\r")]
    if not prompts:
        return 1
    llm.set_config({"async": False} | ({"max_new_tokens": max_tokens} if max_tokens >= 0 else {}))
    totals = {"prompt_len": 0, "gen_seq_len": 0, "prefill_us": 0, "decode_us": 0, "sample_us": 0}
    for prompt in prompts:
        if prompt.startswith("#"):
            continue
        shown = _StdoutFilter()
        try:
            llm.response(prompt, True)
        finally:
            shown.close()
        llm._c_obj.set_context({"generate_str": ""})  # read back unchecked by the binding: see runtime.MnnModel
        ctx = llm._c_obj.get_context()
        for k in totals:
            totals[k] += int(ctx.get(k, 0))
    prefill_s, decode_s = totals["prefill_us"] / 1e6, totals["decode_us"] / 1e6
    _say(f"\n{RULE_OPEN}\n"
         f"prompt tokens num = {totals['prompt_len']}\n"
         f"decode tokens num = {totals['gen_seq_len']}\n"
         f"prefill time = {prefill_s:.2f} s\n"
         f" decode time = {decode_s:.2f} s\n"
         f" sample time = {totals['sample_us'] / 1e6:.2f} s\n"
         f"prefill speed = {totals['prompt_len'] / prefill_s if prefill_s else 0.0:.2f} tok/s\n"
         f" decode speed = {totals['gen_seq_len'] / decode_s if decode_s else 0.0:.2f} tok/s\n"
         f"{RULE_CLOSE}\n")
    return 0


if __name__ == "__main__":  # `launch.isolated` in a packaged app
    sys.exit(main(sys.argv[1:]))
