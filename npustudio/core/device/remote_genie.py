"""Run a deployed bundle on a device with genie-t2t-run: the prompt goes as a file, output streams back.

The prompt is pushed to the device as `prompt.txt` and passed with `--prompt_file`; it never appears in
the shell line, which holds only fixed words and quoted paths we made. Output chunks reach the caller as
adb delivers them. `stop` closes the stream and kills the remote process (its pid is the first line the
command prints). The profile JSON is pulled back. Known failures map to a plain explanation and a fix.
"""

from __future__ import annotations

import posixpath
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .. import layout
from ..errors import UserError
from ..fsutil import atomic_write_bytes
from ..genie import t2t
from . import client, remote_shell

# (pattern in genie-t2t-run's output, explanation, fix)
FAILURES: remote_shell.Failures = [
    (r"Failed to find available PD",
     "The bundle's contexts together do not fit in one HTP protection domain (Genie loads every context of a "
     "dialog into one ~3 GiB address space; more parts do not help).",
     "Compile with --weight-sharing (each part's weights once, the phone's form), or quantize at w4a16 (half the "
     "weight bytes), then bundle and deploy again; `npustudio run` without --precision plans this for you."),
    (r"\b5005\b", "The context binary does not fit this device (QNN error 5005: VTCM or model/device mismatch).",
     "Compile for this phone's SoC (`--target`), with the QNN SDK version the phone runs."),
    (r"\b5000\b", "The phone's QNN runtime is older than the one that compiled the binary, or the binary is for "
     "another device (QNN error 5000).", "Deploy the runtime of the SDK that compiled the bundle "
     "(set QNN_SDK_ROOT and bundle again), or compile for this phone."),
    (r"\b1008\b", "The binary was built for another Hexagon architecture (QNN error 1008).",
     "Compile for this phone's SoC: `npustudio quantize --target <SoC>` then compile and bundle."),
    (r"\b1007\b", "QNN could not use a context binary (error 1007: wrong context or graph index).",
     "Rebuild the bundle; make sure genie_config.json lists the binaries of this bundle."),
    (r"\b1002\b|could not create op", "The NPU could not build an operation of the graph (QNN error 1002).",
     "Compile with this version of NPU Studio; a verbose log (`--log verbose`) names the op."),
    (r"cannot locate symbol|library \"?[\w.]+\.so\"? not found|No such file or directory.*\.so|"
     r"dlopen failed", "A runtime library is missing on the device.",
     "Deploy a bundle that carries the QNN runtime (set QNN_SDK_ROOT, `npustudio bundle`, deploy again)."),
    (r"genie-t2t-run: (not found|No such file)|: not found", "genie-t2t-run is not on the device.",
     "Set QNN_SDK_ROOT, rebuild the bundle so it carries genie-t2t-run, and deploy again."),
    (r"Exec format error|wrong ELF class", "The runtime files are for another CPU architecture.",
     "Use the aarch64-android files of the QAIRT SDK."),
    (r"Could not create dialog|GenieDialog_create.*fail|Failed to create dialog",
     "Genie could not load the model (usually a library, architecture or SDK version mismatch).",
     "Check that the runtime and the binaries come from the same QAIRT SDK and target SoC."),
]


class DeviceRun(BaseModel):
    text: str
    output: str
    status: str  # complete | stopped | failed
    profile_path: str | None = None
    seconds: float


PROFILE_LIMIT = 64 * 2**20  # bytes: a Genie profile is a few KB; a device answering more is not sending one


def _read_at_most(d: Any, path: str, limit: int) -> bytes | None:
    """A device file's bytes, None when it holds more than `limit`: the stream is closed there rather than read
    into memory to its end (a device's file may be anything, /dev/zero included)."""
    data = bytearray()
    for chunk in d.sync.iter_content(path):
        data += chunk
        if len(data) > limit:
            return None  # leaving the loop closes adbutils' connection
    return bytes(data)


def explain(output: str, prompt: str | None = None) -> UserError | None:
    """None when genie-t2t-run answered: `[BEGIN]: `, the answer, `[END]`, and no `error:` line after it. Anything
    else is a failure (the legacy adb shell carries no exit status, and genie-t2t-run ends only a query that
    returned with `[END]`): a known one explained, every one with the device's own last lines. `prompt`, the
    prompt sent, tells its echo from the device's words (`t2t.Reader`)."""
    out = t2t.read(output, prompt)
    if out.begun and out.ended and not any(line.lower().startswith("error:") for line in out.after):
        return None
    # where the device says what went wrong: not the echo of the prompt, not the answer
    log = "\n".join(out.before + (out.after if out.ended else [out.answer])) if out.begun else output
    said = [line.strip() for line in log.splitlines() if line.strip() and not line.startswith(t2t.PROMPT)]
    return remote_shell.explained(log, said, FAILURES, "genie-t2t-run",
                                  "Look at Genie's own messages: on the device, `genie-t2t-run -c genie_config.json "
                                  "-p hi --log verbose` in the bundle's folder (`adb shell`), or on this computer "
                                  "`npustudio genie-run -c BUNDLE/genie_config.json -p hi --log verbose`.")


def answer(output: str, prompt: str | None = None) -> str:
    """The generated text between `[BEGIN]: ` and `[END]` (`t2t.Reader`)."""
    return t2t.read(output, prompt).answer


def run(serial: str, remote_dir: str, prompt: str, on_output: Callable[[str], None],
        stop: threading.Event | None = None, profile_to: Path | None = None, log: str = "error",
        max_tokens: int | None = None, extra: list[str] | None = None) -> DeviceRun:
    """`max_tokens` is for the virtual device only: its genie-t2t-run (our desktop runner) takes
    `--max-tokens`; a phone's genie-t2t-run has no such flag (stop it with `stop` instead). `extra`: more of
    genie-t2t-run's arguments (`-l NAME,lora_alpha,STRENGTH`), each quoted."""
    if log not in t2t.LOG_LEVELS:
        raise UserError(f"Unknown log level {log!r}.", f"Use {', '.join(t2t.LOG_LEVELS)}.")
    d = client().device(serial=serial)
    d.sync.push(prompt.encode("utf-8"), posixpath.join(remote_dir, layout.PROMPT_FILE), mode=0o644)
    # the bundle's own genie-t2t-run when it carries the runtime, else the device's; the line keeps to what
    # a phone's sh and the virtual device's shell both take (no `if`, no `[`)
    own = d.sync.exists(posixpath.join(remote_dir, "genie-t2t-run"))
    q = shlex.quote
    line = (f"cd {q(remote_dir)} && {remote_shell.PID_ECHO} && "
            f"LD_LIBRARY_PATH={q(remote_dir)}:$LD_LIBRARY_PATH ADSP_LIBRARY_PATH={q(remote_dir)} "
            f"exec {'./genie-t2t-run' if own else 'genie-t2t-run'} -c genie_config.json "
            f"--prompt_file {layout.PROMPT_FILE} --profile {layout.PROFILE_FILE} --log {log}"
            + (f" --max-tokens {int(max_tokens)}" if max_tokens else "")
            + "".join(f" {q(x)}" for x in extra or []) + " 2>&1")
    t0 = time.perf_counter()
    d.shell(["rm", "-f", posixpath.join(remote_dir, layout.PROFILE_FILE)], timeout=30)
    output, stopped = remote_shell.stream(d, line, on_output, stop)
    profile_path = None
    if not stopped and profile_to is not None:
        try:  # read, then written atomically: a pull would write through a link planted at profile_to
            data = _read_at_most(d, posixpath.join(remote_dir, layout.PROFILE_FILE), PROFILE_LIMIT)
        except Exception:
            data = None
        if data is not None:
            atomic_write_bytes(Path(profile_to), data)
            profile_path = str(profile_to)
    status = "stopped" if stopped else "complete"
    if not stopped:
        err = explain(output, prompt)
        if err is not None:
            raise err
    return DeviceRun(text=answer(output, prompt), output=output, status=status, profile_path=profile_path,
                     seconds=round(time.perf_counter() - t0, 3))
