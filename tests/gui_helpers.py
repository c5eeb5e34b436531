"""What the desktop window's tests share (tests/test_gui_*.py): clicking a page's Run and waiting for it, the steps'
marks, a table read as a dict, whether a widget is whole on screen, a small encodings export for the inspector, and
a PNG of a page when NPUSTUDIO_SCREENSHOTS names a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from npustudio.gui.app import STEPS, MainWindow
from npustudio.gui.widgets import cells

SHOTS = os.environ.get("NPUSTUDIO_SCREENSHOTS")  # set to a folder to keep a PNG of every page and panel


def shot(w: Any, name: str) -> None:
    if SHOTS:
        from PySide6.QtWidgets import QApplication

        QApplication.processEvents()  # a plot's axes size themselves on their first paint
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        w.grab().save(str(Path(SHOTS) / f"{name}.png"))


def run_page(qtbot: Any, page: Any, timeout: int = 300_000) -> None:
    """Click the page's Run button and wait for the job; fail with what the page says when it failed."""
    with qtbot.waitSignal(page.strip.finished, timeout=timeout) as blocker:
        page.strip.run.click()
    assert blocker.args == [True], page.strip.status.text()


def marks(w: MainWindow) -> list[str]:
    return [w.step_state(s) for s in STEPS]


def table_dict(t: Any) -> dict[str, str]:
    return {r[0]: r[1] for r in cells(t)}


def fully_shown(w: Any) -> bool:
    """Nothing of `w` is cut off or out of view."""
    return w.isVisible() and w.visibleRegion().boundingRect().size() == w.size()


def stage_asked(fn: Any, args: tuple[Any, ...]) -> str:
    """What a page asked the child process to run: a stage by its declaration (run_stage's spec), or a step."""
    return args[1].name if fn.func.__name__ == "run_stage" else fn.func.__name__


def small_export(folder: Path) -> Path:
    """A graph's export without a pipeline run: an .encodings file of 72 long-named 16-bit activations (the last
    four a down projection per layer, layer 2's range ×50 wider than the others': flagged), the float ONNX graph
    that makes them and a test-vector step, as the quantize stage writes them beside each other."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from npustudio.core import layout

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"/model/layers.{k % 4}/a_rather_long_module_path/of_the_kind/real_exports_have/Conv_output_{k}"
             for k in range(68)] + [f"/layers.{i}/mlp/down/Conv_output_0" for i in range(4)]
    scales = [0.01] * 70 + [0.5, 0.01]  # layer 2's down projection (the 71st row) is the wide one
    acts = [{"name": n, "dtype": "INT", "bw": 16, "is_sym": False, "scale": [s], "offset": [-32768],
             "enc_type": "PER_TENSOR"} for n, s in zip(names, scales, strict=True)]
    f = folder / "prompt_1_of_1.encodings"
    f.write_text(json.dumps({"version": "1.0.0", "activation_encodings": acts, "param_encodings": []}))
    gains = [numpy_helper.from_array(np.full((1, 64), 1.0 + i / 10, np.float32), f"g{i}") for i in range(len(names))]
    nodes = [helper.make_node("Mul", ["x", f"g{i}"], [n]) for i, n in enumerate(names)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info(names[0], TensorProto.FLOAT, [1, 64])], gains)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
              str(f.with_suffix(".onnx")))
    (folder / layout.TEST_VECTORS).mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    vectors = {"in/x": rng.normal(size=(1, 64)).astype(np.float32)}  # numpy's stub reads **vectors as allow_pickle
    np.savez(folder / layout.TEST_VECTORS / f"{f.stem}.npz", **vectors)  # type: ignore[arg-type]
    return f


def small_table(folder: Path) -> Any:
    """`small_export`'s table with each activation's SQNR, as the inspector's read makes it (no weights here)."""
    from npustudio.core.graph import encodings, sqnr

    f = small_export(folder)
    table = encodings.read(f)
    db = sqnr.activations(f, table.rows)
    for r in table.rows:
        r.sqnr_db = db.get(r.name)
    return table
