"""The settings file and the settings dialog: a file that cannot be used, the Hugging Face token kept in the
keyring, the cluster switch that sends the heavy stages to a Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from npustudio.core.errors import UserError
from npustudio.gui.app import MainWindow
from tests.gui_helpers import stage_asked


def test_a_settings_file_that_cannot_be_used_is_named_and_kept(qtbot: Any, tmp_path: Path) -> None:
    """The window still starts (with the defaults) and says why; its recent-projects write would have replaced the
    user's file with the defaults. Saving the preferences on purpose writes it again."""
    from PySide6.QtCore import QThreadPool

    from npustudio.core import settings

    f = settings.path()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text('{"default_precison": "w4a16"}')
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    shown = w.statusBar().currentMessage()
    for words in ("Default settings in use", str(f), "unknown key 'default_precison'",
                  "Did you mean 'default_precision'?"):
        assert words in shown, shown
    assert w.open_project(tmp_path / "q")
    assert QThreadPool.globalInstance().waitForDone(10_000)
    assert f.read_text() == '{"default_precison": "w4a16"}'
    w.open_settings().accept()
    assert QThreadPool.globalInstance().waitForDone(10_000)
    assert settings.load().recent_projects[0] == str((tmp_path / "q").resolve())
    assert not w.statusBar().currentMessage()


def test_token_dialog_checks_with_the_hub_and_stores_only_in_the_keyring(
        qtbot: Any, tmp_path: Path, memory_keyring: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from npustudio.core import settings
    from tests.fake_hub import FakeHub

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    with FakeHub({}, gated={"meta/llama": "hf_good_token_123"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        dlg = w.open_settings()
        assert dlg.token.echoMode() == dlg.token.EchoMode.Password
        dlg.token.setText("hf_wrong")
        dlg.check_save.click()
        qtbot.waitUntil(lambda: "does not accept" in dlg.token_status.text(), timeout=15_000)
        assert memory_keyring.store == {}
        dlg.token.setText("hf_good_token_123")
        dlg.check_save.click()
        qtbot.waitUntil(lambda: "saved in the system keyring" in dlg.token_status.text(), timeout=15_000)
    assert "tester" in dlg.token_status.text() and dlg.token.text() == ""
    assert memory_keyring.store == {("npustudio", "huggingface"): "hf_good_token_123"}
    dlg.preview.setChecked(True)
    dlg.accept()
    saved = settings.path().read_text()
    assert json.loads(saved)["virtual_preview"] is True and "hf_good" not in saved
    assert "hf_good" not in caplog.text and "hf_wrong" not in caplog.text


def test_the_cluster_switch_in_settings_sends_the_heavy_stages_to_that_cluster(qtbot: Any, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings: a wrong address is said and nothing is saved; with the switch on, adapt, quantize and compile
    are asked to run on the cluster (what the CLI's --cluster does)."""
    from npustudio.core import isolated, settings

    asked: list[tuple[str, str | None]] = []

    def fake_run(fn: Any, *args: Any, state: Any, **kw: Any) -> Any:
        c = fn.keywords["cluster"]
        asked.append((stage_asked(fn, args), c and c.address))
        raise UserError("not run in this test", "")

    monkeypatch.setattr(isolated, "run", fake_run)
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    dlg = w.open_settings()
    dlg.cluster_address.setText("my-gpu-box")
    dlg.use_cluster.setChecked(True)
    dlg.accept()
    assert "is not a Ray cluster address" in dlg.cluster_status.text() and dlg.isVisible()
    assert not settings.path().exists() or not json.loads(settings.path().read_text()).get("use_cluster")
    dlg.cluster_address.setText("10.0.0.5:6379")
    dlg.accept()
    assert json.loads(settings.path().read_text())["cluster_address"] == "10.0.0.5:6379"
    for page in (w.adapt_page, w.quantize_page, w.compile_page):
        with qtbot.waitSignal(page.strip.finished, timeout=10_000):
            page.strip.run.click()
    assert asked == [("adapt", "10.0.0.5:6379"), ("quantize", "10.0.0.5:6379"), ("compile_and_bundle", "10.0.0.5:6379")]
    w.settings.use_cluster = False  # the switch off: here again
    with qtbot.waitSignal(w.quantize_page.strip.finished, timeout=10_000):
        w.quantize_page.strip.run.click()
    assert asked[-1] == ("quantize", None)
