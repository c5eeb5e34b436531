"""The virtual device's shell: a small, strict interpreter for the phone commands NPU Studio and a person use.

It is never a host shell. A line is commands joined by `&&`, `;` or newlines; a command is leading
`NAME=value` assignments, words, and optionally `2>&1` (a no-op: the legacy adb shell carries one merged
stream). Words may be quoted ('…', "…", \\x) and hold `$NAME`, `${NAME}`, `$?` and `$$`; `exec` runs the
command in place of the shell. Pipes, redirections, globs, `$(…)`, backquotes, `if` and the rest of sh are
answered with a syntax error; a command that is not in the device's table with "inaccessible or not
found" (mksh's words, the shell of Android). The commands themselves are in `phone_commands`.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Union

SH = "/system/bin/sh"
HOME = "/data/local/tmp"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_REFUSED = set("|<>()`*?[]{}")  # sh syntax the device does not take (unquoted)
# loader variables that make a program load a library it never asked for: the programs the device runs are host
# processes, so it refuses to start one under them, as a phone's linker refuses a library it may not load
LOADER_INJECTION = ("LD_PRELOAD", "LD_AUDIT")


class ShellSyntaxError(Exception):
    pass


@dataclass
class Word:
    """A word as typed: parts ("lit" unquoted text, "q" quoted text, "var" a $NAME to expand)."""

    parts: list[tuple[str, str]] = field(default_factory=list)


Token = Union[Word, str]  # noqa: UP007 (a str is an operator: "&&", ";", "\n", "2>&1")


def lex(line: str) -> list[Token]:
    toks: list[Token] = []
    word: Word | None = None
    i, n = 0, len(line)

    def add(kind: str, text: str) -> None:
        nonlocal word
        if word is None:
            word = Word()
        if word.parts and word.parts[-1][0] == kind != "var":
            word.parts[-1] = (kind, word.parts[-1][1] + text)
        else:
            word.parts.append((kind, text))

    def end() -> None:
        nonlocal word
        if word is not None:
            toks.append(word)
            word = None

    while i < n:
        c = line[i]
        if c in " \t\r":
            end()
            i += 1
        elif c in "\n;":
            end()
            toks.append(c)
            i += 1
        elif c == "&":
            if not line.startswith("&&", i):
                raise ShellSyntaxError("'&' is not supported on the virtual device")
            end()
            toks.append("&&")
            i += 2
        elif c == "'":
            j = line.find("'", i + 1)
            if j < 0:
                raise ShellSyntaxError("unterminated quoted string")
            add("q", line[i + 1:j])
            i = j + 1
        elif c == '"':
            i = _double_quoted(line, i + 1, add)
        elif c == "\\":
            if i + 1 < n and line[i + 1] != "\n":
                add("q", line[i + 1])
            i += 2
        elif c == "$":
            i = _dollar(line, i, add)
        elif c == "#" and word is None:
            j = line.find("\n", i)
            i = n if j < 0 else j
        elif c == "2" and word is None and line.startswith("2>&1", i) and (i + 4 == n or line[i + 4] in " \t\r\n;&"):
            toks.append("2>&1")
            i += 4
        elif c in _REFUSED:
            raise ShellSyntaxError(f"'{c}' is not supported on the virtual device")
        else:
            add("lit", c)
            i += 1
    end()
    return toks


def _double_quoted(line: str, i: int, add: Callable[[str, str], None]) -> int:
    add("q", "")  # "" is a word even when empty
    while i < len(line):
        c = line[i]
        if c == '"':
            return i + 1
        if c == "\\" and i + 1 < len(line) and line[i + 1] in '$`"\\\n':
            if line[i + 1] != "\n":
                add("q", line[i + 1])
            i += 2
        elif c == "$":
            i = _dollar(line, i, add)
        elif c == "`":
            raise ShellSyntaxError("'`' is not supported on the virtual device")
        else:
            add("q", c)
            i += 1
    raise ShellSyntaxError("unterminated quoted string")


def _dollar(line: str, i: int, add: Callable[[str, str], None]) -> int:
    nxt = line[i + 1:i + 2]
    if nxt in ("$", "?"):
        add("var", nxt)
        return i + 2
    if nxt == "(":
        raise ShellSyntaxError("'$(' is not supported on the virtual device")
    if nxt == "{":
        j = line.find("}", i + 2)
        if j < 0 or not _NAME.fullmatch(line[i + 2:j]):
            raise ShellSyntaxError(f"{line[i:j + 1 if j >= 0 else len(line)]}: bad substitution")
        add("var", line[i + 2:j])
        return j + 1
    m = _NAME.match(line, i + 1)
    if m:
        add("var", m.group())
        return m.end()
    add("lit", "$")
    return i + 1


@dataclass
class Command:
    assigns: list[tuple[str, Word]] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)
    after_and: bool = False  # joined to the previous command by && (runs only if that one succeeded)

    def empty(self) -> bool:
        return not self.assigns and not self.words


def parse(tokens: list[Token]) -> list[Command]:
    cmds: list[Command] = []
    cur = Command()
    for t in tokens:
        if isinstance(t, Word):
            assign = _assignment(t) if not cur.words else None
            if assign:
                cur.assigns.append(assign)
            else:
                cur.words.append(t)
        elif t == "2>&1":
            if cur.empty():
                raise ShellSyntaxError("'2>&1' unexpected")
        elif t == "\n" and cur.empty():
            continue  # blank lines, and a line that ends in && goes on on the next one
        else:
            if cur.empty():
                raise ShellSyntaxError(f"'{t}' unexpected")
            cmds.append(cur)
            cur = Command(after_and=t == "&&")
    if cur.after_and and cur.empty():
        raise ShellSyntaxError("unexpected end of line after '&&'")
    if not cur.empty():
        cmds.append(cur)
    return cmds


def _assignment(w: Word) -> tuple[str, Word] | None:
    if not w.parts or w.parts[0][0] != "lit":
        return None
    lead = ""
    for kind, text in w.parts:
        if kind != "lit":
            break
        lead += text
    m = _ASSIGN.match(lead)
    if not m:
        return None
    rest, skip = lead[m.end():], len(lead)
    parts, consumed = [], 0
    for kind, text in w.parts:  # the value: what follows NAME= in the unquoted lead, then the other parts
        if consumed < skip and kind == "lit":
            consumed += len(text)
            continue
        parts.append((kind, text))
    return m.group(1), Word(([("lit", rest)] if rest else []) + parts)


Program = Union[Callable[["Call"], int], list[str]]  # noqa: UP007


class DeviceHost(Protocol):
    """What the shell and its commands need of the device they run on (the virtual device is the one there is):
    its sandbox's paths, the environments and confinement of the host programs it starts, its processes."""

    preview: bool
    props: dict[str, str]
    processes: dict[int, subprocess.Popen[bytes]]

    def base_env(self) -> dict[str, str]: ...

    def confined(self, argv: list[str], cwd: Path, readable: tuple[Path, ...] = ()) -> list[str]: ...

    def host_env(self, env: dict[str, str]) -> dict[str, str]: ...

    def host_path(self, device_path: str, cwd: str = "/", follow: bool = True) -> Path: ...

    def lookup(self, name: str, cwd: str) -> tuple[Program | None, int]: ...

    def new_pid(self) -> int: ...

    def writable(self, p: Path, itself: bool = True) -> bool: ...


class Stopped(Exception):
    """The host closed the stream, or the shell ran `exit` or `exec`."""


@dataclass
class Call:
    """One command being run: what a program sees of the device."""

    shell: Session
    name: str
    args: list[str]
    env: dict[str, str]
    replaces_shell: bool = False  # run with exec: the child takes the shell's pid

    @property
    def device(self) -> DeviceHost:
        return self.shell.device

    @property
    def closed(self) -> threading.Event:
        return self.shell.closed

    def write(self, data: str | bytes) -> bool:
        return self.shell.write(data)

    def error(self, message: str, status: int = 1) -> int:
        self.write(f"{self.name}: {message}\n")
        return status

    def path(self, device_path: str, follow: bool = True) -> Path:
        """The sandbox file for a device path, relative to the shell's folder (PermissionError outside)."""
        return self.device.host_path(device_path, cwd=self.shell.cwd, follow=follow)

    def spawn(self, argv: list[str], extra_env: dict[str, str] | None = None, readable: tuple[Path, ...] = ()) -> int:
        """Run a host program for the device: in the sandbox folder, with an environment built from an allow-list
        (`VirtualDevice.host_env`) plus `extra_env`, which comes from this computer, never from the device line.
        Under LD_PRELOAD or LD_AUDIT it is not started: said as Android's linker says a link failure."""
        injected = next((k for k in LOADER_INJECTION if self.env.get(k)), None)
        if injected is not None:
            self.write(f'CANNOT LINK EXECUTABLE "{self.name}": {injected} is not honoured on this device\n')
            return 1
        return self.shell.spawn(argv, self.device.host_env(self.env) | (extra_env or {}), self.replaces_shell,
                                readable)


class Session:
    """One `shell:` stream: its folder, variables and pid, the child it runs, and its output."""

    def __init__(self, device: DeviceHost, write: Callable[[bytes], bool], inbox: queue.Queue[bytes | None],
                 closed: threading.Event) -> None:
        self.device, self._write, self.closed = device, write, closed
        self.cwd = HOME
        self.env = device.base_env()
        self.vars: dict[str, str] = {}
        self.status = 0
        self.pid = device.new_pid()
        self.terminal = False  # interactive: a phone's tty turns \n into \r\n
        self.child: subprocess.Popen[bytes] | None = None
        self.typed: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, args=(inbox,), daemon=True).start()

    def _read(self, inbox: queue.Queue[bytes | None]) -> None:
        """Input from the host: Ctrl-C goes to the running child, a closed stream stops it."""
        while True:
            data = inbox.get()
            if data is None:
                self.closed.set()
                self._signal_child(signal.SIGTERM)
                self.typed.put(None)
                return
            if b"\x03" in data and self.child is not None:
                self._signal_child(signal.SIGINT)
                continue
            self.typed.put(data)

    def _signal_child(self, sig: int) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def write(self, data: str | bytes) -> bool:
        raw = data.encode("utf-8", errors="replace") if isinstance(data, str) else data
        if self.terminal:
            raw = raw.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
        return not self.closed.is_set() and self._write(raw)

    # -- running lines -----------------------------------------------------------------------
    def run(self, line: str) -> int:
        try:
            commands = parse(lex(line))
        except ShellSyntaxError as e:
            self.write(f"{SH}: syntax error: {e}\n")
            self.status = 1
            return 1
        for cmd in commands:
            if cmd.after_and and self.status != 0:
                continue
            self.status = self._command(cmd)
        return self.status

    def expand(self, w: Word) -> str:
        out = []
        for kind, text in w.parts:
            if kind != "var":
                out.append(text)
            elif text == "$":
                out.append(str(self.pid))
            elif text == "?":
                out.append(str(self.status))
            else:
                out.append(self.vars.get(text, self.env.get(text, "")))
        return "".join(out)

    def _command(self, cmd: Command) -> int:
        assigns = {name: self.expand(value) for name, value in cmd.assigns}
        words = [self.expand(w) for w in cmd.words]
        if not words:  # NAME=value alone sets a shell variable (exported ones stay exported)
            for k, v in assigns.items():
                (self.env if k in self.env else self.vars)[k] = v
            return 0
        replaces = words[0] == "exec"
        if replaces:
            words = words[1:]
            if not words:
                return 0
        name, args = words[0], words[1:]
        program, status = self.device.lookup(name, self.cwd)
        if program is None:
            why = "inaccessible or not found" if status == 127 else "can't execute: Permission denied"
            self.write(f"{SH}: {name}: {why}\n")
            result = status
        else:
            call = Call(self, name, args, self.env | assigns, replaces)
            result = call.spawn([*program, *args]) if isinstance(program, list) else program(call)
        if replaces:
            raise Stopped(result)
        return result

    def spawn(self, argv: list[str], env: dict[str, str], replaces_shell: bool,
              readable: tuple[Path, ...] = ()) -> int:
        """A host child in the shell's folder; its output streams to the host; the host closing the stream or
        `kill` of its pid ends its whole process group."""
        cwd = self.device.host_path(self.cwd)
        pid = self.pid if replaces_shell else self.device.new_pid()
        proc = subprocess.Popen(self.device.confined(argv, cwd, readable), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.child = proc
        self.device.processes[pid] = proc
        try:
            if self.closed.is_set():
                self._signal_child(signal.SIGTERM)
            assert proc.stdout is not None
            fd = proc.stdout.fileno()
            while chunk := os.read(fd, 65536):
                if not self.write(chunk):
                    self._signal_child(signal.SIGTERM)
                    break
        finally:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._signal_child(signal.SIGKILL)
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
            self.device.processes.pop(pid, None)
            self.child = None
        return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode

    # -- an interactive shell (`adb shell` with no command) --------------------------------------
    def interactive(self) -> None:
        self.terminal = True
        line = bytearray()
        prompt = f"{self.device.props['ro.product.device']}:{{}} $ "
        self.write(prompt.format(self.cwd))
        while True:
            data = self.typed.get()
            if data is None:
                return
            for b in data:
                if b in (0x0D, 0x0A):
                    self.write(b"\n")
                    try:
                        self.run(line.decode("utf-8", errors="replace"))
                    except Stopped:
                        return
                    line.clear()
                    self.write(prompt.format(self.cwd))
                elif b in (0x7F, 0x08):
                    if line:
                        line.pop()
                        self.write(b"\b \b")
                elif b == 0x03:
                    line.clear()
                    self.write("^C\n" + prompt.format(self.cwd))
                elif b == 0x04:
                    if not line:
                        return
                else:
                    line.append(b)
                    self.write(bytes([b]))


def serve(device: DeviceHost, command: str, write: Callable[[bytes], bool], inbox: queue.Queue[bytes | None],
          closed: threading.Event) -> None:
    """The `shell:` service: run `command`, or an interactive shell when it is empty."""
    session = Session(device, write, inbox, closed)
    try:
        if command.strip():
            session.run(command)
        else:
            session.interactive()
    except Stopped:
        pass
