"""The desktop window: the Model step reads a model off the GUI thread and shows its card and fit."""

from __future__ import annotations

from pathlib import Path

from npustudio.gui.app import STEPS, MainWindow


def test_model_step_shows_card_and_fit(qtbot, tiny_llama: Path) -> None:
    w = MainWindow()
    qtbot.addWidget(w)
    assert [w.steps.item(i).text() for i in range(w.steps.count())] == list(STEPS)
    page = w.model_page
    page.source.setText(str(tiny_llama))
    page.read.click()
    assert not page.read.isEnabled()  # busy while the worker runs
    qtbot.waitUntil(lambda: page.read.isEnabled(), timeout=30_000)
    values = {page.card.item(r, 0).text(): page.card.item(r, 1).text() for r in range(page.card.rowCount())}
    assert values["layers"] == "2" and values["family"] == "Llama"
    assert [page.fit.item(r, 0).text() for r in range(page.fit.rowCount())] == ["w8a16", "w4a16"]


def test_model_step_shows_the_error_and_the_fix(qtbot, tmp_path: Path) -> None:
    w = MainWindow()
    qtbot.addWidget(w)
    w.model_page.source.setText(str(tmp_path / "missing.gguf"))
    w.model_page.read.click()
    qtbot.waitUntil(lambda: w.model_page.read.isEnabled(), timeout=10_000)
    assert "No model at" in w.model_page.status.text() and "Fix:" in w.model_page.status.text()
