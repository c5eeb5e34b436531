"""The window on the real default model (SmolLM2-135M): open the project the default run left, walk every step as
a user would (each page shows the real numbers), deploy to the virtual device from the device panel and read the
chat answer. With NPUSTUDIO_SCREENSHOTS=DIR (under Xvfb: QT_QPA_PLATFORM=xcb) every page and panel is saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from npustudio.core import settings
from npustudio.gui.app import STEPS, MainWindow
from npustudio.gui.widgets import cells
from tests.test_gui import marks, run_page, shot, table_dict

pytestmark = pytest.mark.real


def test_wizard_on_the_default_model_to_a_chat_answer(qtbot: Any, default_run: tuple[Path, dict],
                                                      adb_server: Any) -> None:
    proj, _summary = default_run
    s = settings.load()
    s.virtual_preview = True  # the virtual device answers with the CPU preview: Genie on the simulator is ~8 s/token
    settings.save(s)
    w = MainWindow(proj, watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1600, 1000)
    w.show()
    assert marks(w) == ["done"] * 5 + ["todo"]  # the CLI run took it through the bundle
    assert w.steps.currentRow() == STEPS.index("Deploy")  # resumes at the first step not done

    w.go("Model")
    card = table_dict(w.model_page.card)
    assert card["layers"] == "30" and card["params"] == "134,515,008"
    assert cells(w.model_page.fit)[0][0] == "w8a16" and "phones with" in cells(w.model_page.fit)[0][5]
    shot(w, "1_model")

    w.go("Target")
    assert w.target_page.selected() == "SM8750"
    assert "tok/s" in table_dict(w.target_page.details)["Decode bound, w8a16"]
    w.target_page.strip.run.click()
    assert marks(w) == ["done"] * 5 + ["todo"]
    shot(w, "2_target")

    w.go("Adapt")
    a = table_dict(w.adapt_page.results)
    assert a["Perplexity: original / adapted"].startswith("14.659") and float(
        a["Top-1 agreement with the original"]) >= 0.999
    shot(w, "3_adapt")

    w.go("Quantize")
    q = table_dict(w.quantize_page.results)
    assert q["Precision / target"] == "w8a16 / SM8750" and float(q["Ratio"].lstrip("×")) <= 1.01
    ins = w.quantize_page.inspector
    qtbot.waitUntil(lambda: ins.table_ is not None, timeout=60_000)
    assert len(ins.table_.rows) > 30 * 19 and ins.heat_grid.shape[1] == 30
    shot(w, "4_quantize")
    w.quantize_page.tabs.setCurrentIndex(1)
    ins.sort_by("scale_spread")
    ins.view.selectRow(0)
    shot(w, "5_inspector")

    w.go("Compile")
    c = table_dict(w.compile_page.results)
    assert c["Ops left on the CPU"] == "0" and c["Validated by libGenie"] == "yes"
    assert [r[0] for r in cells(w.compile_page.binaries)] == ["prompt_ar128_cl1024_1_of_1", "token_ar1_cl1024_1_of_1"]
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
