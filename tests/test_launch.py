"""What a user runs, run as they run it: the installed console script and the desktop file's command, each as a
process. The window tests read the main window back from inside that process (tests/launch_observer) and close it
as a person would; the process must then end on its own."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from npustudio import __version__
from npustudio.cli import build_parser
from tests.conftest import subcommands

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = BIN / "npustudio"
OBSERVER = Path(__file__).resolve().parent / "launch_observer"
COMMANDS = sorted(subcommands(build_parser()))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("NPUSTUDIO_DEBUG", None)
    return env | extra


@pytest.fixture
def window_env(adb_server: list[str]) -> None:
    """The window's device panel starts an adb server: the module's private one, never the developer's."""


def _open_window(argv: list[str], tmp_path: Path) -> dict[str, object]:
    """Start `argv` as a process, wait for its main window, close it; the window's title."""
    report = tmp_path / "window.json"
    env = _env(NPUSTUDIO_TEST_WINDOW_REPORT=str(report),
               PYTHONPATH=os.pathsep.join(filter(None, [str(OBSERVER), os.environ.get("PYTHONPATH")])))
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert report.is_file(), f"no main window was shown\n{res.stdout}\n{res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    return json.loads(report.read_text())


def test_the_console_script_is_installed() -> None:
    assert SCRIPT.is_file(), f"{SCRIPT} missing: the package's console script is not installed"


def test_npustudio_with_no_arguments_opens_the_window(tmp_path: Path, window_env: None) -> None:
    win = _open_window([str(SCRIPT)], tmp_path)
    assert win["class"] == "MainWindow" and str(win["title"]).startswith("NPU Studio")


def test_npustudio_gui_opens_the_given_project(tmp_path: Path, window_env: None) -> None:
    from npustudio.core.project import Project

    project = Project.open(tmp_path / "my project").root
    win = _open_window([str(SCRIPT), "gui", "--project", str(project)], tmp_path)
    assert str(project) in str(win["title"]), win


def test_the_desktop_files_command_opens_the_window(tmp_path: Path, window_env: None) -> None:
    entry = configparser.ConfigParser(interpolation=None)
    entry.read(ROOT / "packaging" / "npustudio.desktop", encoding="utf-8")
    argv = shlex.split(entry["Desktop Entry"]["Exec"])
    argv = [a for a in argv if not (a.startswith("%") and len(a) == 2)]  # %f %u …: what a launcher fills in
    assert argv[0] == "npustudio", "the desktop file must start the installed command (found on PATH)"
    win = _open_window([str(BIN / argv[0]), *argv[1:]], tmp_path)
    assert str(win["title"]).startswith("NPU Studio")


def test_version_is_printed() -> None:
    res = subprocess.run([str(SCRIPT), "--version"], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"npustudio {__version__}"


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_commands_help_runs_as_a_process(command: str) -> None:
    argv = [str(SCRIPT), *([command] if command else []), "--help"]
    res = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: npustudio{' ' + command if command else ''}"), res.stdout
    assert "Traceback" not in res.stderr, res.stderr


def desktop_exec_argv(value: str) -> list[str]:
    """An Exec value read as a desktop launcher reads it (Desktop Entry 1.5): the string escapes first, then the
    arguments, a double-quoted one with `"`, `` ` ``, `$` and `\\` escaped by a backslash; field codes dropped."""
    value = re.sub(r"\\(.)", lambda m: {"s": " ", "n": "\n", "t": "\t", "r": "\r"}.get(m[1], m[1]), value)
    argv, cur, quoted, i, started = [], "", False, 0, False
    while i < len(value):
        c = value[i]
        if quoted and c == "\\":
            cur, i = cur + value[i + 1], i + 2
            continue
        if c == '"':
            quoted, started = not quoted, True
        elif c == " " and not quoted:
            if started:
                argv.append(cur)
            cur, started = "", False
        else:
            cur, started = cur + c, True
        i += 1
    if started:
        argv.append(cur)
    return [a.replace("%%", "%") for a in argv if not re.fullmatch(r"%[a-zA-Z]", a)]


def test_the_shipped_desktop_file_is_the_menu_entrys_text() -> None:
    from npustudio.core import desktop_entry

    assert (ROOT / "packaging" / "npustudio.desktop").read_text() == desktop_entry.text(["npustudio", "gui"])


@pytest.mark.parametrize("argv", [["/opt/my apps/np$u \"studio\"/bin/npustudio", "gui"],
                                  ["/a\\b/`x`/100%/npustudio", "gui"], ["/plain/npustudio", "gui"]])
def test_an_exec_line_reads_back_as_the_same_command(argv: list[str]) -> None:
    from npustudio.core import desktop_entry

    assert desktop_exec_argv(desktop_entry.exec_value(argv)) == argv


def test_desktop_entry_install_gives_a_menu_entry_that_opens_the_window(tmp_path: Path, window_env: None) -> None:
    """The venv route: `npustudio desktop-entry install` writes the user's entry, whose Exec (this installation's
    launcher by absolute path) opens the window as a process; `remove` takes the entry and its icons away."""
    data = tmp_path / "my data"
    env = _env(XDG_DATA_HOME=str(data))
    res = subprocess.run([str(SCRIPT), "desktop-entry", "install"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    entry_file = data / "applications" / "npustudio.desktop"
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str  # type: ignore[assignment,method-assign]
    entry.read(entry_file, encoding="utf-8")
    fields = entry["Desktop Entry"]
    argv = desktop_exec_argv(fields["Exec"])
    assert Path(argv[0]).is_absolute() and Path(argv[0]) == SCRIPT, argv
    assert fields["TryExec"] == str(SCRIPT) and fields["Icon"] == "npustudio"
    icon = data / "icons" / "hicolor" / "256x256" / "apps" / "npustudio.png"
    assert icon.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(entry_file) in res.stderr
    win = _open_window(argv, tmp_path)
    assert str(win["title"]).startswith("NPU Studio")

    res = subprocess.run([str(SCRIPT), "desktop-entry", "remove"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert not entry_file.exists() and not icon.exists()
    res = subprocess.run([str(SCRIPT), "desktop-entry", "remove"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "No menu entry to remove" in res.stderr, res.stderr


def test_desktop_entry_keeps_an_entry_it_did_not_write(tmp_path: Path) -> None:
    entry_file = tmp_path / "applications" / "npustudio.desktop"
    entry_file.parent.mkdir(parents=True)
    entry_file.write_text("[Desktop Entry]\nType=Application\nName=NPU Studio\nExec=/opt/npustudio/AppRun\n")
    before = entry_file.read_bytes()
    for action in ("install", "remove"):
        res = subprocess.run([str(SCRIPT), "desktop-entry", action], env=_env(XDG_DATA_HOME=str(tmp_path)),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "was not written by `npustudio desktop-entry`" in res.stderr, res.stderr
        assert entry_file.read_bytes() == before


def test_desktop_entry_install_where_it_cannot_write_says_where(tmp_path: Path) -> None:
    """XDG_DATA_HOME a file, or a read-only folder: a plain message naming the place and what to do (it ended
    "failed unexpectedly: NotADirectoryError")."""
    a_file = tmp_path / "data"
    a_file.write_text("not a folder")
    res = subprocess.run([str(SCRIPT), "desktop-entry", "install"], env=_env(XDG_DATA_HOME=str(a_file)),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"cannot be written under {a_file}" in res.stderr, res.stderr
    assert "XDG_DATA_HOME" in res.stderr and "unexpectedly" not in res.stderr


def test_the_packaged_launcher_runs_a_module_as_python_m_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packaged app is its own interpreter: the pipeline's helper processes (`python -m MODULE`: each graph's
    compile, the virtual device's genie-t2t-run) start it with `-m`, which its launcher must run as python does
    (the frozen compile stage died with "invalid choice: 'npustudio…'" when `-m` reached the CLI)."""
    from npustudio.core.genie import t2t

    res = subprocess.run([sys.executable, str(ROOT / "packaging" / "launcher.py"), "-m", "npustudio.core.genie.t2t",
                          "--help"], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("usage: genie-t2t-run"), res.stderr
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert t2t.command("-c", "cfg.json") == [sys.executable, "-m", "npustudio.core.genie.t2t", "-c", "cfg.json"]


def test_a_desktop_without_qts_x11_libraries_is_told_the_packages_before_qt_aborts(tmp_path: Path) -> None:
    """Qt aborts the process when its X11 plugin cannot load, naming a package that is often not the missing one:
    the window's command says which libraries are missing and the exact packages, and exits cleanly."""
    from npustudio.core import desktop_libs

    # a plugin linked to a library that is then taken away: what ldd reports on a fresh desktop
    (tmp_path / "dep.c").write_text("int npus_dep(void) { return 1; }\n")
    (tmp_path / "plugin.c").write_text("int npus_dep(void);\nint plugin(void) { return npus_dep(); }\n")
    cc = ["gcc", "-shared", "-fPIC"]
    subprocess.run([*cc, "-Wl,-soname,libnpus-dep2.so.7", "-o", str(tmp_path / "libnpus-dep2.so.7"),
                    str(tmp_path / "dep.c")], check=True)
    subprocess.run([*cc, "-o", str(tmp_path / "libqxcb.so"), str(tmp_path / "plugin.c"), str(tmp_path /
                    "libnpus-dep2.so.7")], check=True)
    (tmp_path / "libnpus-dep2.so.7").unlink()
    env_before = dict(os.environ)
    try:
        os.environ["QT_QPA_PLATFORM"] = "xcb"
        assert desktop_libs.missing(tmp_path / "libqxcb.so") == ["libnpus-dep2.so.7"]
        os.environ["QT_QPA_PLATFORM"] = "offscreen"  # a window that does not use X11 needs none of them
        assert desktop_libs.missing(tmp_path / "libqxcb.so") == []
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert desktop_libs.package_of("libnpus-dep2.so.7") == "libnpus-dep2-7"
    assert desktop_libs.package_of("libxcb-icccm.so.4") == "libxcb-icccm4"

    os.environ["QT_QPA_PLATFORM"] = "xcb"
    try:
        real = desktop_libs.missing()
    finally:
        os.environ.update(env_before)
    if not real:
        pytest.skip("this computer has every library Qt's X11 plugin links to")
    res = subprocess.run([str(SCRIPT), "gui"], env=_env(QT_QPA_PLATFORM="xcb", DISPLAY=":99"), capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stderr
    assert f"lacks: {', '.join(real)}." in res.stderr and "sudo apt-get install" in res.stderr
    assert " ".join(desktop_libs.package_of(x) for x in real) in res.stderr and "Traceback" not in res.stderr
