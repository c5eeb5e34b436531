"""The commands of the virtual device's shell, in Python: what the pipeline sends and a person types on a phone.

Every path is a device path resolved inside the sandbox (`VirtualDevice.host_path`); only `/data/local/tmp`
is writable, as for the shell user of a phone. Messages follow toybox's. `genie-t2t-run` is the desktop
runner (`genie.t2t`: real Genie on the HTP simulator, or the preview), started as a host child in an isolated
interpreter (`t2t.command`) with an allow-listed environment (never the device line's LD_*, PYTHON* or
QNN_SDK_ROOT), its path options mapped into the sandbox. `llm_demo` is MNN's runtime the same way
(`mnn.llm_demo`, started by `launch.isolated`).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..genie import t2t
from ..launch import isolated
from .phone_shell import Call, Program, Stopped

VIRTUAL_FILES = {"/proc/meminfo": Path("/proc/meminfo")}  # the host's: the device's RAM is this machine's


def commands() -> dict[str, Program]:
    return {"cat": cat, "cd": cd, "chmod": chmod, "df": df, "echo": echo, "env": env, "exit": exit_,
            "export": export,
            "genie-t2t-run": genie_t2t_run, "getprop": getprop, "kill": kill, "llm_demo": llm_demo, "ls": ls,
            "mkdir": mkdir, "mv": mv,
            "pwd": pwd, "rm": rm, "touch": touch}


def _options(call: Call, allowed: str) -> tuple[set[str], list[str]] | None:
    """Single-letter options (`-rf`), then operands; None (after saying so) for an unknown option."""
    opts: set[str] = set()
    rest = list(call.args)
    while rest and rest[0].startswith("-") and rest[0] != "-":
        arg = rest.pop(0)
        if arg == "--":
            break
        for ch in arg[1:]:
            if ch not in allowed:
                call.error(f"Unknown option '{ch}'")
                return None
            opts.add(ch)
    return opts, rest


def _path(call: Call, arg: str, follow: bool = True) -> Path | None:
    try:
        return call.path(arg, follow=follow)
    except PermissionError:
        call.error(f"{arg}: Permission denied")
        return None


def _writable(call: Call, arg: str, follow: bool = True, itself: bool = True) -> Path | None:
    """The sandbox path of `arg` if the shell user may change it (under /data/local/tmp)."""
    p = _path(call, arg, follow)
    if p is not None and not call.device.writable(p, itself=itself):
        call.error(f"{arg}: Permission denied")
        return None
    return p


class _Abort(Exception):
    """Ends the whole command with `status` from inside a per-path action (a bad mode, a closed pipe)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _each(call: Call, args: Iterable[str], act: Callable[[str, Path], int | None],
          resolve: Callable[[Call, str], Path | None] = _path) -> int:
    """`act(arg, path)` for every argument, as toybox does: an argument whose path does not resolve (said already)
    or whose action fails makes the exit status 1 and the others still run; an OSError is said as `arg: reason`."""
    status = 0
    for arg in args:
        p = resolve(call, arg)
        if p is None:
            status = 1
            continue
        try:
            status = act(arg, p) or status
        except OSError as e:
            status = call.error(f"{arg}: {e.strerror}")
        except _Abort as e:
            return e.status
    return status


def _device_path(call: Call, arg: str) -> str:
    return posixpath.normpath(posixpath.join(call.shell.cwd, arg))


# -- shell built-ins ----------------------------------------------------------------------------
def cd(call: Call) -> int:
    target = call.args[0] if call.args else call.env.get("HOME", "/")
    p = _path(call, target)
    if p is None:
        return 1
    if not p.is_dir():
        return call.error(f"{target}: {'Not a directory' if p.exists() else 'No such file or directory'}")
    call.shell.cwd = _device_path(call, target)
    return 0


def echo(call: Call) -> int:
    args = list(call.args)
    newline = not (args and args[0] == "-n")
    call.write(" ".join(args[0 if newline else 1:]) + ("\n" if newline else ""))
    return 0


def env(call: Call) -> int:
    if call.args:
        return call.error("running a command through env is not supported on the virtual device")
    call.write("".join(f"{k}={v}\n" for k, v in sorted(call.env.items())))
    return 0


def export(call: Call) -> int:
    """`export NAME=value` or `export NAME` (a shell variable): the programs started after it see it."""
    shell = call.shell
    for arg in call.args:
        name, eq, value = arg.partition("=")
        if not (name.isascii() and name.isidentifier()):
            return call.error(f"{arg}: is not an identifier")
        if eq:
            shell.vars.pop(name, None)
            shell.env[name] = value
        elif name in shell.vars:
            shell.env[name] = shell.vars.pop(name)
    if not call.args:
        call.write("".join(f"export {k}={v}\n" for k, v in sorted(shell.env.items())))
    return 0


def pwd(call: Call) -> int:
    call.write(call.shell.cwd + "\n")
    return 0


def exit_(call: Call) -> int:
    raise Stopped(int(call.args[0]) if call.args and call.args[0].isdigit() else call.shell.status)


def kill(call: Call) -> int:
    """Signals only the processes this device started (by the pids it gave them)."""
    args, sig = list(call.args), signal.SIGTERM
    if args and args[0] == "-s" and len(args) > 1:
        args[:2] = ["-" + args[1]]
    if args and args[0].startswith("-"):
        spec = args.pop(0)[1:].upper().removeprefix("SIG")
        try:
            sig = signal.Signals(int(spec)) if spec.isdigit() else signal.Signals["SIG" + spec]
        except (KeyError, ValueError):
            return call.error(f"Unknown signal '{spec}'")
    if not args:
        return call.error("Need a pid")
    status = 0
    for a in args:
        proc = call.device.processes.get(int(a)) if a.isdigit() else None
        if proc is None or proc.poll() is not None:
            status = call.error(f"{a}: No such process")
            continue
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            status = call.error(f"{a}: No such process")
    return status


# -- files --------------------------------------------------------------------------------------
def cat(call: Call) -> int:
    if not call.args:
        return call.error("reading standard input is not supported on the virtual device")

    def send(_arg: str, p: Path) -> None:
        with open(p, "rb") as f:
            while chunk := f.read(65536):
                if not call.write(chunk):
                    raise _Abort(1)

    return _each(call, call.args, send, lambda c, arg: VIRTUAL_FILES.get(_device_path(c, arg)) or _path(c, arg))


def ls(call: Call) -> int:
    parsed = _options(call, "al1d")
    if parsed is None:
        return 1
    opts, paths = parsed
    shown = 0

    def show(arg: str, p: Path) -> int:
        nonlocal shown
        try:
            st = p.lstat()
        except OSError:
            return call.error(f"{arg}: No such file or directory")
        if stat.S_ISDIR(st.st_mode) and "d" not in opts:
            names = sorted(os.listdir(p))
            if "a" in opts:
                names = [".", "..", *names]
            else:
                names = [n for n in names if not n.startswith(".")]
            if len(paths) > 1:
                call.write(("\n" if shown else "") + f"{arg}:\n")
            if "l" in opts:
                call.write(f"total {sum(_lstat(p / n).st_blocks for n in names) // 2}\n")
            call.write("".join(_entry(p / n, n, "l" in opts) for n in names))
        else:
            call.write(_entry(p, arg, "l" in opts))
        shown += 1
        return 0

    return _each(call, paths or ["."], show)


def _lstat(p: Path) -> os.stat_result:
    try:
        return p.lstat()
    except OSError:
        return os.stat_result((0,) * 10)


def _entry(p: Path, name: str, long: bool) -> str:
    if not long:
        return name + "\n"
    st = _lstat(p)
    link = f" -> {os.readlink(p)}" if stat.S_ISLNK(st.st_mode) else ""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(st.st_mtime))
    return f"{stat.filemode(st.st_mode)} {st.st_nlink:>2} shell shell {st.st_size:>9} {when} {name}{link}\n"


def rm(call: Call) -> int:
    parsed = _options(call, "frR")
    if parsed is None:
        return 1
    opts, paths = parsed

    def remove(arg: str, p: Path) -> int:
        if not p.is_symlink() and not p.exists():
            return 0 if "f" in opts else call.error(f"{arg}: No such file or directory")
        if not call.device.writable(p, itself=False):
            return call.error(f"{arg}: Permission denied")
        if p.is_dir() and not p.is_symlink():
            if not opts & {"r", "R"}:
                return call.error(f"{arg}: Is a directory")
            shutil.rmtree(p)
        else:
            p.unlink()
        return 0

    return _each(call, paths, remove, lambda c, arg: _path(c, arg, follow=False))


def mv(call: Call) -> int:
    parsed = _options(call, "f")
    if parsed is None:
        return 1
    _opts, paths = parsed
    if len(paths) < 2:
        return call.error("Needs 2 arguments")
    *sources, target = paths
    into = _path(call, target)
    if into is None:
        return 1
    if len(sources) > 1 and not into.is_dir():
        return call.error(f"{target}: Not a directory")
    status = 0
    for src in sources:
        s = _writable(call, src, follow=False, itself=False)
        dst_arg = posixpath.join(target, posixpath.basename(src.rstrip("/"))) if into.is_dir() else target
        d = _writable(call, dst_arg, follow=False, itself=False) if s is not None else None
        if s is None or d is None:
            status = 1
            continue
        try:
            os.replace(s, d)
        except OSError as e:
            status = call.error(f"{src}: {e.strerror}")
    return status


def mkdir(call: Call) -> int:
    parsed = _options(call, "p")
    if parsed is None:
        return 1
    opts, paths = parsed
    return _each(call, paths, lambda _arg, p: p.mkdir(parents="p" in opts, exist_ok="p" in opts), _writable)


def touch(call: Call) -> int:
    option = next((arg for arg in call.args if arg.startswith("-")), None)
    if option is not None:  # before any file is touched
        return call.error(f"Unknown option '{option[1:]}'")
    return _each(call, call.args, lambda _arg, p: p.touch(), _writable)


def chmod(call: Call) -> int:
    if len(call.args) < 2:
        return call.error("Needs 2 arguments")
    spec, *paths = call.args

    def change(_arg: str, p: Path) -> None:
        mode = _mode(spec, stat.S_IMODE(p.stat().st_mode))
        if mode is None:
            raise _Abort(call.error(f"bad mode '{spec}'"))
        p.chmod(mode & 0o777)  # no set-id or sticky bits in the sandbox

    return _each(call, paths, change, _writable)


def _mode(spec: str, current: int) -> int | None:
    """An octal mode, or one symbolic clause such as +x, u+rw, go-w, a=r."""
    if spec.isdigit() and all(c in "01234567" for c in spec):
        return int(spec, 8)
    who, _, rest = spec.partition(next((c for c in spec if c in "+-="), "?"))
    op = spec[len(who)] if len(who) < len(spec) else ""
    if not op or set(who) - set("ugoa") or set(rest) - set("rwx"):
        return None
    bits = sum({"r": 4, "w": 2, "x": 1}[c] for c in set(rest))
    mask = sum({"u": 0o700, "g": 0o070, "o": 0o007}[w] for w in set(who.replace("a", "ugo") or "ugo"))
    value = (bits * 0o111) & mask
    return {"+": current | value, "-": current & ~value, "=": (current & ~mask) | value}[op]


def df(call: Call) -> int:
    parsed = _options(call, "k")
    if parsed is None:
        return 1
    _opts, paths = parsed
    lines = ["Filesystem          1K-blocks      Used Available Use% Mounted on"]

    def usage(arg: str, p: Path) -> int:
        if not p.exists():
            return call.error(f"{arg}: No such file or directory")
        v = os.statvfs(p)
        total, free = v.f_blocks * v.f_frsize // 1024, v.f_bavail * v.f_frsize // 1024
        used = total - v.f_bfree * v.f_frsize // 1024
        mount = "/data" if _device_path(call, arg).startswith("/data") else "/"
        lines.append(f"npustudio-sandbox {total:>11} {used:>9} {free:>9} {100 * used // max(total, 1):>3}% {mount}")
        return 0

    status = _each(call, paths or ["/data"], usage)
    call.write("\n".join(lines) + "\n")
    return status


# -- the phone ----------------------------------------------------------------------------------
def getprop(call: Call) -> int:
    props = call.device.props
    if not call.args:
        call.write("".join(f"[{k}]: [{v}]\n" for k, v in sorted(props.items())))
    else:
        default = call.args[1] if len(call.args) > 1 else ""
        call.write(props.get(call.args[0], default) + "\n")
    return 0


def genie_t2t_run(call: Call) -> int:
    """genie-t2t-run on this computer (`genie.t2t`) in place of the phone's, started by its own argv (no shell, no
    CLI); the options a device line may give are `t2t.device_flags()`, and its file options must stay in the
    sandbox."""
    flags = t2t.device_flags()
    argv = t2t.command(*(["--preview"] if call.device.preview else []))
    args: Iterator[str] = iter(call.args)
    config: Path | None = None
    for a in args:
        flag = flags.get(a)
        if flag is None:
            return call.error(f"unknown option {a}")
        if flag.takes == "switch":
            argv.append(a)
            continue
        value = next(args, None)
        if value is None:
            return call.error(f"option {a} needs a value")
        if flag.takes in ("input", "output"):
            p = _writable(call, value) if flag.takes == "output" else _path(call, value)
            if p is None:
                return 1
            value = str(p)
            if a in ("-c", "--config"):
                config = p
        argv += [a, value]
    # the SDK's own x86 libGenie, when the user has one, is the runner's only need from this computer
    sdk = {"QNN_SDK_ROOT": os.environ["QNN_SDK_ROOT"]} if os.environ.get("QNN_SDK_ROOT") else {}
    return call.spawn(argv, sdk, _preview_graphs(config) if call.device.preview and config is not None else ())


def _preview_graphs(config: Path) -> tuple[Path, ...]:
    """The CPU preview answers with the prepared graphs of the project that built the bundle, on this computer (the
    virtual device is this computer): the one folder it may read besides the sandbox, read-only, and only when it is
    an NPU Studio compile stage's `prepared` folder (a pushed metadata.json names it, so it is checked, not
    trusted)."""
    from .. import layout
    from ..errors import UserError
    from ..genie.meta import read_metadata

    try:
        compile_dir = read_metadata(config.parent).project_compile_dir
    except UserError:
        return ()
    if not compile_dir:
        return ()
    prepared = Path(compile_dir).resolve() / layout.PREPARED
    if prepared.is_dir() and (prepared.parent / layout.COMPILE_RESULT).is_file():
        return (prepared,)
    return ()


def llm_demo(call: Call) -> int:
    """MNN's llm_demo on this computer (`mnn.llm_demo`: MNN's own runtime) in place of the phone's, with the phone
    program's arguments (`config.json [prompt.txt [max_tokens [no-thinking]]]`); its two files must be in the
    sandbox, read only."""
    if len(call.args) > 4:
        return call.error("too many arguments: llm_demo config.json [prompt.txt [max_tokens [no-thinking]]]")
    argv = isolated("npustudio.core.mnn.llm_demo")
    for i, a in enumerate(call.args):
        if i < 2:
            p = _path(call, a)
            if p is None:
                return 1
            if i == 0 and p.is_file() and (named := _config_outside(p)) is not None:
                file, key, value = named
                return call.error(f"{file}: '{key}' names {value!r}, outside the model's folder")
            a = str(p)
        argv.append(a)
    return call.spawn(argv, {})


def _config_outside(config: Path) -> tuple[str, str, str] | None:
    """Where an MNN config names a file outside its model folder (`mnn.config_check`); a config that is no readable
    JSON is left to llm_demo, which says so as the phone's does."""
    from ..errors import UserError
    from ..mnn import config_check

    try:
        return config_check.outside(config)
    except UserError:
        return None
