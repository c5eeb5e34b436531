"""The window on the real default model (SmolLM2-135M): every wizard step clicked through as a user would (each
stage computed for real, its page showing the numbers), the bundle deployed to the virtual device started from the
device panel, and the chat answer read. With NPUSTUDIO_SCREENSHOTS=DIR (under Xvfb: QT_QPA_PLATFORM=xcb) every page
and panel is saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from PySide6.QtGui import QStandardItemModel

from npustudio.core import settings
from npustudio.gui.app import MainWindow
from npustudio.gui.widgets import cells
from tests.gui_helpers import marks, run_page, shot, table_dict

pytestmark = pytest.mark.real


def test_wizard_on_the_default_model_to_a_chat_answer(qtbot: Any, default_project: Path, adb_server: Any) -> None:
    s = settings.load()
    s.virtual_preview = True  # the virtual device answers with the CPU preview: Genie on the simulator is ~8 s/token
    settings.save(s)
    w = MainWindow(default_project, watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1366, 768)  # a laptop screen: the window and its docks fit it
    w.show()
    assert marks(w) == ["todo", "todo"] + ["locked"] * 4 and w.steps.currentRow() == 0

    run_page(qtbot, w.model_page)  # the embedded default is preselected
    card = table_dict(w.model_page.card)
    assert card["layers"] == "30" and card["params"] == "134,515,008"
    assert cells(w.model_page.fit)[0][0] == "w8a16" and "phones with" in cells(w.model_page.fit)[0][1]  # the answer
    shot(w, "1_model")

    w.go("Target")
    assert w.target_page.selected() == "SM8750"
    assert "tok/s" in table_dict(w.target_page.details)["Decode bound, w8a16"]
    w.target_page.strip.run.click()
    assert marks(w) == ["done", "done", "todo", "locked", "locked", "locked"]
    shot(w, "2_target")

    w.go("Adapt")
    run_page(qtbot, w.adapt_page, timeout=900_000)
    a = table_dict(w.adapt_page.results)
    assert a["Perplexity: original / adapted"].startswith("14.659") and float(
        a["Top-1 agreement with the original"]) >= 0.999
    assert len(w.adapt_page.chart.series["adapted"]) == 4  # one point per eval window, drawn as they came
    shot(w, "3_adapt")

    w.go("Quantize")
    # SpinQuant's recipes need a Hadamard matrix of the hidden size, which 576 has not: greyed, with the reason
    recipe = w.quantize_page.recipe
    items = cast(QStandardItemModel, recipe.model())  # a combo box's own model
    for name, takes in (("spinquant", False), ("spinquant_adascale", False), ("adascale", True)):
        i = recipe.findData(name)
        assert items.item(i).isEnabled() is takes, name
        assert ("hidden size is 576" in recipe.itemText(i)) is not takes, recipe.itemText(i)
    run_page(qtbot, w.quantize_page, timeout=1_200_000)
    q = table_dict(w.quantize_page.results)
    assert q["Precision / target"] == "w8a16 / SM8750" and float(q["Ratio"].lstrip("×")) <= 1.01
    assert len(w.quantize_page.chart.series["quant"]) == 4 and len(w.quantize_page.chart.series["fp"]) == 4
    ins = w.quantize_page.inspector
    qtbot.waitUntil(lambda: ins.table_ is not None, timeout=120_000)
    assert ins.table_ is not None
    assert len(ins.table_.rows) > 30 * 19 and ins.heat_grid.shape[1] == 30
    shot(w, "4_quantize")
    w.quantize_page.tabs.setCurrentIndex(1)
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_sqnr"))  # the real model's activations too
    assert ins.heat_grid.shape[1] == 30 and "kv-cache" in ins.heat_roles
    ins.sort_by("scale_spread")
    ins.view.selectRow(0)
    shot(w, "5_inspector")

    w.go("Compile")
    w.compile_page.verify.setValue(0)  # the simulator check of the default model has its own test (~3 min)
    w.compile_page.quick.setChecked(True)  # what `npustudio run` picks with no phone: its test reuses this compile
    run_page(qtbot, w.compile_page, timeout=1_200_000)
    c = table_dict(w.compile_page.results)
    assert c["Ops left on the CPU"] == "0" and c["Validated by libGenie"] == "yes"
    assert [r[0] for r in cells(w.compile_page.binaries)] == ["prompt_ar128_cl1024_1_of_1", "token_ar1_cl1024_1_of_1"]
    assert marks(w) == ["done"] * 5 + ["todo"]
    shot(w, "6_compile")

    # Deploy: the virtual device from the device panel, the bundle pushed, the sample question asked
    w.go("Deploy")
    d = w.deploy_page
    w.devices.start_virtual.click()
    qtbot.waitUntil(lambda: w.device is not None and w.device.virtual, timeout=60_000)
    assert cells(d.compat)[0][0] == "Compatible"
    run_page(qtbot, d, timeout=300_000)
    assert len(cells(d.files)) >= 7 and {r[2] for r in cells(d.files)} == {"yes"}
    with qtbot.waitSignal(w.chat.answered, timeout=300_000) as answered:
        d.ask.click()
    turn = answered.args[0]
    assert "Paris" in turn.assistant and "Paris" in w.chat.transcript.toPlainText()
    assert "preview" not in turn.assistant  # the runner's banner is not part of the answer
    assert "Paris" in w.devices.console.toPlainText()
    assert turn.generation_tok_s and turn.generation_tok_s > 0
    shot(w, "7_deploy_chat")
    w.profile_dock.show()
    assert cells(w.profiles.table)[0][1] == "preview (CPU)" and cells(w.profiles.table)[0][8] != "—"
    shot(w, "8_profiles")
    dlg = w.open_settings()
    qtbot.waitExposed(dlg)
    shot(dlg, "9_settings")
    dlg.reject()
    w.close()
