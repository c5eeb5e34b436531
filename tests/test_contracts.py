"""Project-wide rules: import contracts (Qt-free core, layers), mypy on the core, ruff, the README's two commands."""

from __future__ import annotations

import re
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


def test_the_core_starts_no_cli_module_either() -> None:
    """The contracts see imports only: a core module that ran `python -m npustudio.cli ...` in a child (the virtual
    device's genie-t2t-run did) would depend on the CLI unseen. No core file names a CLI module at all."""
    named = [str(f.relative_to(ROOT)) for f in (ROOT / "npustudio" / "core").rglob("*.py")
             if re.search(r"npustudio[./]cli\b", f.read_text(encoding="utf-8"))]
    assert named == []


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
