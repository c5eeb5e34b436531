"""Project-wide rules: import contracts (Qt-free core, layers), mypy on the core, ruff, the README's two commands."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QT = ("PySide6", "pyqtgraph", "superqt", "qtpy", "PyQt5", "PyQt6")


def test_the_import_contracts_hold() -> None:
    """pyproject.toml's import-linter contracts: no Qt in the core, the layers, stages that do not import each other."""
    r = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_mypy_passes_on_the_core() -> None:
    """The type hints of npustudio/core are checked (settings in pyproject.toml), pydantic's plugin included."""
    r = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_importing_every_core_module_loads_no_qt() -> None:
    mods = sorted({".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                   for f in (ROOT / "npustudio" / "core").rglob("*.py")})
    code = ("import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in mods)
            + f"bad = [m for m in sys.modules if m.split('.')[0] in {QT!r}]\nprint(bad)\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_is_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout


def test_readme_has_exactly_two_newcomer_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- commands -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S)
    assert block, "README must hold the commands block"
    cmds = [c for c in block.group(1).strip().splitlines() if c.strip() and not c.startswith("#")]
    assert len(cmds) == 2
    assert "npustudio run" in cmds[0] and "pytest" in cmds[1]
    assert cmds[1].strip() in (ROOT / ".ci" / "run").read_text()


def test_the_stages_and_the_wizard_steps_are_listed_only_in_core_stages() -> None:
    """Adding a stage (a new back-end) means one declaration: no other module keeps its own list of the stages
    or of the wizard's steps (a tuple, list, set or dict of two or more of their names)."""
    import ast

    from npustudio.core import stages

    names = set(stages.NAMES) | set(stages.STEP_NAMES)
    lists = []
    for f in sorted((ROOT / "npustudio").rglob("*.py")) + sorted((ROOT / "plugins").rglob("*.py")):
        if f == ROOT / "npustudio" / "core" / "stages.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else \
                node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else []
            words = [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(words) >= 2 and len(words) == len(items) and set(words) <= names:
                lists.append(f"{f.relative_to(ROOT)}:{node.lineno} {words}")
    assert not lists, lists


def test_npustudio_devices_does_not_import_torch(tmp_path: Path) -> None:
    """`npustudio devices` lists phones: it must not pay torch's seconds of import. Run as a process with no adb
    (no binary, a port nothing serves, so no server is started): it says so (exit 2), and `-X importtime` lists every
    module it imported."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free now; nothing serves it
    env = {k: v for k, v in os.environ.items() if k != "NPUSTUDIO_DEBUG"} | {
        "ADBUTILS_ADB_PATH": str(tmp_path / "no-adb"), "ANDROID_ADB_SERVER_PORT": str(port)}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "npustudio.cli", "devices"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2 and "adb" in r.stderr, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "npustudio.cli.devices" in imported  # the listing is real
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "transformers", "onnx", "onnxruntime", "aimet_torch")}
    assert not heavy, sorted(heavy)[:10]
