"""A device program run over an adb shell line, its output streamed back as it comes, and stoppable.

The line starts with `echo NPUSTUDIO_PID=$$` and then `exec`s the program, so the first line names the process
to kill on stop (the legacy adb shell carries no exit status and no signal); `stop` closes the stream from any
thread and then kills that process. What both device runners (Genie's genie-t2t-run, MNN's llm_demo) share.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections.abc import Callable
from typing import Any

from ..errors import UserError

# (pattern in a device program's output, explanation, fix)
Failures = list[tuple[str, str, str]]

PID_ECHO = "echo NPUSTUDIO_PID=$$"
_PID = re.compile(rb"^NPUSTUDIO_PID=(\d+)\n")


def stream(d: Any, line: str, on_text: Callable[[str], None], stop: threading.Event | None = None) -> tuple[str, bool]:
    """Run `line` (which starts with `PID_ECHO && ... exec PROGRAM`) on adbutils' device `d`; each piece of its
    output, decoded, goes to `on_text`. Returns the whole output and whether `stop` ended it."""
    conn = d.shell(line, stream=True)
    pending, pid, parts = bytearray(), None, []
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split between chunks waits
    if stop is not None:  # stop closes the stream from any thread; the read below then ends
        threading.Thread(target=_close_when_set, args=(stop, conn), daemon=True).start()
    try:
        while True:
            try:
                chunk = conn.conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if pid is None:
                pending += chunk
                if b"\n" not in pending:
                    continue
                m = _PID.match(bytes(pending))
                pid = int(m.group(1)) if m else -1
                chunk = bytes(pending[m.end():]) if m else bytes(pending)
            text = decoder.decode(chunk)
            if text:
                parts.append(text)
                on_text(text)
    finally:
        _close(conn)
    stopped = stop is not None and stop.is_set()
    if stopped and pid and pid > 0:  # the stream is closed; make sure the process is gone too
        try:
            d.shell(["kill", str(pid)], timeout=10)
        except Exception:
            pass
    return "".join(parts), stopped


def _close_when_set(stop: threading.Event, conn: Any) -> None:
    stop.wait()
    _close(conn)


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:
        pass


def explained(log: str, said: list[str], failures: Failures, program: str, fix: str) -> UserError:
    """A device program's failure: the first of `failures` whose pattern is in `log`, else that `program` failed;
    either with the device's own last lines (`said`)."""
    tail = " | ".join(line[:300] for line in said[-5:])
    for pattern, problem, known_fix in failures:
        if re.search(pattern, log, re.IGNORECASE):
            return UserError(problem + (f" The device said: {tail}" if tail else ""), known_fix)
    return UserError(f"{program} failed on the device" + (f": {tail}" if tail else "."), fix)
