"""Project-wide rules: import contracts (Qt-free core, layers), mypy, ruff, the README's two commands."""

from __future__ import annotations

import ast
import operator
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


def test_mypy_passes_on_the_package_the_plugins_and_the_tests() -> None:
    """The type hints of npustudio/core, npustudio/gui, npustudio/cli, plugins and tests are checked (settings in
    pyproject.toml), pydantic's plugin included."""
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
            if len(words) >= 2 and len(words) == len(items) and set(words) <= names and isinstance(node, ast.expr):
                lists.append(f"{f.relative_to(ROOT)}:{node.lineno} {words}")
    assert not lists, lists


# the calls that name a stage: a string literal there is a stage name written a second time
STAGE_CALLS = {"record", "stage_dir", "rerun_options", "options_as", "run_stage", "stage_cost", "spec", "_require",
               "stage_status", "scratch_dir", "old_dir"}


def stage_name_literals(source: str, names: set[str]) -> list[int]:
    """The lines where `source` names a stage by a string literal: an argument of a call in STAGE_CALLS, or a
    comparison of a stage's name with one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn in STAGE_CALLS and any(isinstance(a, ast.Constant) and a.value in names for a in node.args):
                found.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any((isinstance(x, ast.Name) and x.id == "name")
                        or (isinstance(x, ast.Attribute) and x.attr == "name") for x in sides)
            if named and any(isinstance(x, ast.Constant) and x.value in names for x in sides):
                found.append(node.lineno)
    return found


def test_a_stage_is_named_by_its_declaration_never_by_a_string_literal() -> None:
    """`project.record("quantize")` in a view re-spells a name core/stages.py declares: renaming or adding a stage
    must be one edit. The scanner finds a planted literal (so the check can fail), and none in the package."""
    from npustudio.core import stages

    names = set(stages.NAMES)
    planted = ("rec = project.record('quantize')\nok = project.record(stages.QUANTIZE.name)\n"
               "if spec.name == 'bundle': pass\n")
    assert stage_name_literals(planted, names) == [1, 3]
    found = [f"{f.relative_to(ROOT)}:{line}" for f in sorted((ROOT / "npustudio").rglob("*.py"))
             if f != ROOT / "npustudio" / "core" / "stages.py"
             for line in stage_name_literals(f.read_text(), names)]
    assert not found, found


def test_a_stage_runs_only_with_its_own_options_model(tmp_path: Path) -> None:
    """Each declaration names its options model, and `run_stage` dispatches on it: options of another stage (a page
    wired to the wrong spec) are refused naming both before anything is written, and no two stages share a model."""
    from npustudio.core import pipeline, stages
    from npustudio.core.progress import State
    from npustudio.core.project import Project
    from npustudio.core.stage_options import AdaptOptions

    assert len({s.options for s in stages.SPECS}) == len(stages.SPECS)
    project = Project.open(tmp_path / "p")
    with pytest.raises(TypeError, match="the quantize stage takes QuantizeOptions, not AdaptOptions"):
        pipeline.run_stage(project, stages.QUANTIZE, AdaptOptions(), State())  # type: ignore[misc]  # mypy refuses it too
    assert not (tmp_path / "p" / "stages").exists() or not any((tmp_path / "p" / "stages").iterdir())


# ---------------------------------------------------------------- each option declared once (core/stage_options.py)
FRONT_ENDS = ("npustudio/gui", "npustudio/cli")
# calls that set a widget's or a flag's range or value: a literal there re-declares what an options field holds
SETTERS = {"setRange", "setValue", "setMinimum", "setMaximum", "int_in", "number_in", "spin"}
CHOICE_SETTERS = {"addItem", "addItems"}


def _const(node: ast.AST) -> Any:
    """The value of a literal or of arithmetic on literals (2**31 - 1), else None."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _const(node.operand)
        return -v if isinstance(v, int | float) else None
    if isinstance(node, ast.BinOp):
        a, b = _const(node.left), _const(node.right)
        if isinstance(a, int | float) and isinstance(b, int | float):
            ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow,
                   ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}
            return ops[type(node.op)](a, b) if type(node.op) in ops else None
    return None


def _declared() -> tuple[set[float], set[float], set[str], set[str], set[float]]:
    """(numbers, bounds, choices, SoC names, rule constants) the core declares: every number an options field holds
    as its default or bound (bar 0, 1 and 2, which mean none, one and a pair everywhere), the bounds alone, the Literal
    fields' values, the SoC table's names, and the phone-fit rule's share of RAM and typical phone."""
    from npustudio.core import stage_options as so
    from npustudio.core.model_fit import TYPICAL_PHONE_RAM_GB
    from npustudio.core.targets import APP_RAM_SHARE, KNOWN_SOCS

    numbers: set[float] = set()
    limits: set[float] = set()
    choices: set[str] = set()
    for model in so.OPTION_MODELS:
        for name, f in model.model_fields.items():
            if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                numbers.add(f.default)
            b = so.bounds(model, name)
            limits |= {x for x in (b.lo, b.hi) if x is not None}
            # a Literal's words (a number choice, MNN's 4 or 8 bits, is among the numbers when it is a default)
            choices |= {c for c in so.choices(model, name) or () if isinstance(c, str)}
    big = {n for n in numbers | limits if abs(n) > 2}
    return big, limits & big, choices, set(KNOWN_SOCS), {APP_RAM_SHARE, TYPICAL_PHONE_RAM_GB}


def redeclared(root: Path) -> list[str]:
    """`file:line: what` for each literal under the GUI and the CLI that re-declares an option's default, bound or
    choices, a SoC name, or the phone-fit rule."""
    numbers, limits, choices, socs, rules = _declared()

    def number(node: ast.AST, among: set[float] = numbers) -> bool:
        v = _const(node)
        return isinstance(v, int | float) and not isinstance(v, bool) and v in among

    def soc_text(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and any(s in node.value for s in socs)

    found = []
    for folder in FRONT_ENDS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(root)

            def flag(node: ast.AST, what: str, _where: Path = where) -> None:
                found.append(f"{_where}:{getattr(node, 'lineno', '?')}: {what}")

            for stmt in tree.body:  # a bound as a module constant of its own: MAX_CONTEXT = 131072
                if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None and number(stmt.value,
                                                                                                      limits):
                    flag(stmt, f"module constant {ast.unparse(stmt)}")
            for node in ast.walk(tree):
                if soc_text(node):
                    flag(node, f"SoC name in {node.value!r}")  # type: ignore[attr-defined]
                if isinstance(node, ast.Compare):  # the phone-fit rule: ram <= 0.5 * phone
                    for sub in ast.walk(node):
                        v = _const(sub)
                        if isinstance(sub, ast.Constant) and isinstance(v, int | float) and v in rules:
                            flag(sub, f"fit rule {ast.unparse(node)}")
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                call = ast.unparse(node)
                if fn in SETTERS:
                    for a in node.args:
                        if number(a):
                            flag(node, f"{call}")
                if fn == "get" and len(node.args) == 2 and number(node.args[1]):  # choices().get("cl", 1024)
                    flag(node, f"default in {call}")
                for k in node.keywords:
                    if k.arg == "default" and (number(k.value) or soc_text(k.value)):
                        flag(node, f"default= in {call}")
                    if k.arg == "choices":
                        for c in ast.walk(k.value):
                            if isinstance(c, ast.Constant) and c.value in choices:
                                flag(node, f"choices= in {call}")
                                break
                if fn in CHOICE_SETTERS:
                    if any(isinstance(c, ast.Constant) and c.value in choices for a in node.args for c in ast.walk(a)):
                        flag(node, f"choices in {call}")
    return sorted(set(found), key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_the_window_and_the_cli_take_every_option_from_its_options_field() -> None:
    """A default, bound or choice of a stage option, a SoC name and the phone-fit rule are declared in the core
    (core/stage_options.py, core/targets.py): the GUI and the CLI read them there (gui/fields.py, cli/args.py
    `option`). Found in the code before this rule: CL 1024 in four places under three ranges, the calibration
    spins, verify_tokens 128, the precision list, `0.5 * ram`, "SM8750"."""
    found = redeclared(ROOT)
    assert not found, "re-declared in a front end, read it from core instead:\n" + "\n".join(found)


def test_the_detector_sees_a_redeclared_option(tmp_path: Path) -> None:
    """The scan above finds each kind of re-declaration (so its passing means something)."""
    page = tmp_path / "npustudio" / "gui" / "page.py"
    page.parent.mkdir(parents=True)
    (tmp_path / "npustudio" / "cli").mkdir()
    page.write_text("MAX = 131072\n"
                    "box.setRange(2, 131072)\nbox.setValue(1024)\nspin(1, 256, 4)\nch.get('cl', 1024)\n"
                    "p.add_argument('--soc', default='SM8750')\nint_in(1, 2**31 - 1)\n"
                    "combo.addItems(['w8a16', 'w4a16'])\nok = need <= 0.5 * ram\n"
                    "bar.setRange(0, 1000)\nbar.setValue(0)\nx = min(a, default=0)\n")
    lines = sorted({f.split(":")[1] for f in redeclared(tmp_path)}, key=int)
    assert lines == ["1", "2", "3", "4", "5", "6", "7", "8", "9"], lines


def test_each_precision_is_declared_once_and_the_stage_the_fit_and_the_cli_follow_it() -> None:
    """`stage_options.PRECISIONS` is the one declaration: the quantize presets, the fit estimate's bits and figures,
    the 4-bit head rule and the CLI's choices and help all read it."""
    from npustudio.cli.main import build_parser
    from npustudio.core import model_fit, models
    from npustudio.core.quantize.presets import PRESETS, takes_4bit_head
    from npustudio.core.stage_options import DEFAULT_INT8_BUDGET, PRECISION_NAMES, PRECISIONS
    from tests.conftest import subcommands

    card = models.ArchCard(family="Llama", model_type="llama", architecture="LlamaForCausalLM", source="test",
                           layers=2, heads=4, kv_heads=2, head_dim=64, hidden=256, intermediate=512, vocab=1000,
                           params=1_000_000, rope_theta=10000.0, rope_scaling=None, tied_embeddings=True,
                           max_position=1024, rms_norm_eps=1e-5, qkv_bias=False, qk_norm=False, bos_id=1,
                           eos_ids=[2], chat_template=None)
    assert PRECISION_NAMES == tuple(PRECISIONS) == tuple(PRESETS)
    for name, p in PRECISIONS.items():
        assert (PRESETS[name].weight_bits, PRESETS[name].block_size) == (p.weight_bits, p.block_size)
        assert takes_4bit_head(name) == (p.block_size is not None)
        fit = model_fit.fit_estimate(card, name, 256)
        assert fit.ppl_ratio_default_model == p.ppl_ratio_default_model
        assert (fit.with_4bit_head is not None) == p.takes_4bit_head
        per_weight = p.weight_bits if p.block_size is None else (
            (1 - DEFAULT_INT8_BUDGET) * (p.weight_bits + 4 / p.block_size) + DEFAULT_INT8_BUDGET * 8)
        assert model_fit.WEIGHT_BITS[name]["layer"] == pytest.approx(per_weight)
    quantize_help = subcommands(build_parser())["quantize"].format_help()
    assert f"{{{','.join(PRECISION_NAMES)}}}" in quantize_help
    assert all(p.note.split(" (")[0] in " ".join(quantize_help.split()) for p in PRECISIONS.values())


@pytest.mark.parametrize("module", ["stage_options", "stages", "results"])
def test_the_stage_declarations_import_nothing_heavy(module: str) -> None:
    """core/stage_options.py, the stages' declarations and their result models run on pydantic and the standard
    library: the CLI's parser, `npustudio devices` and the window's first paint read them without torch (the
    import contract in pyproject.toml says the same of stage_options for the import graph)."""
    code = (f"import sys; import npustudio.core.{module}\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    third = {m for m in ast.literal_eval(r.stdout) if not m.startswith("_")} - {"npustudio"}
    assert third <= {"pydantic", "pydantic_core", "typing_extensions", "annotated_types", "typing_inspection"}, third


def test_a_stage_is_read_back_as_its_declaration_types_it(tmp_path: Path) -> None:
    """Each declaration names its result model and file: `project.record(spec)` gives the options and the result
    typed (a stage's record read as another's is refused by the type checker), and a record that does not read
    as its stage's model is a message that names the stage and the command that redoes it, not a traceback."""
    from npustudio.core import stages
    from npustudio.core.errors import UserError
    from npustudio.core.project import Project
    from npustudio.core.stage_options import QuantizeOptions

    assert len({s.result for s in stages.SPECS}) == len({s.result_file for s in stages.SPECS}) == len(stages.SPECS)
    p = Project.open(tmp_path / "p")
    assert p.record(stages.QUANTIZE) is None
    p.run_stage(stages.QUANTIZE.name, inputs={}, options={"seed": 3}, fn=lambda out: {"precision": "w8a16"})
    assert p.rerun_options(stages.QUANTIZE) == QuantizeOptions(seed=3)  # the options read typed, the rest default
    with pytest.raises(UserError) as e:
        p.record(stages.QUANTIZE)
    assert "record of its quantize stage is damaged" in e.value.problem and "npustudio quantize" in e.value.fix
    with pytest.raises(UserError) as e:
        stages.QUANTIZE.load(tmp_path / "nowhere")
    assert "quantize.json is missing" in e.value.problem and "npustudio quantize --project P --force" in e.value.fix


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


def test_the_figures_page_is_what_the_kept_benchmark_results_render(tmp_path: Path) -> None:
    """docs/figures.md is rendered from benchmarks/results/ (`benchmarks/figures_page.py`), never typed: a result
    kept without rendering, or a page edited by hand, fails here, as the script run as a process says."""
    script = ROOT / "benchmarks" / "figures_page.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert list((ROOT / "benchmarks" / "results").glob("*.json")), "no kept benchmark result"
    edited = tmp_path / "figures.md"
    edited.write_text((ROOT / "docs" / "figures.md").read_text() + "\n| a figure | typed by hand |\n")
    stale = subprocess.run([sys.executable, str(script), "--check", "--page", str(edited)], capture_output=True,
                           text=True, cwd=ROOT)
    assert stale.returncode == 1 and "figures.md is not what benchmarks/results/ renders" in stale.stderr
