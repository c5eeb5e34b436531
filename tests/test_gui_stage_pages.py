"""The pages of the wizard's steps (Model, Target, Adapt, Quantize, Compile) and their run strip: a failed stage,
the options each page takes from core, the context fields, the decode roofline, Run and Redo, late progress."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QMessageBox

from npustudio.core import stages
from npustudio.core.errors import UserError
from npustudio.core.project import Project
from npustudio.gui.app import MainWindow
from tests.conftest import done, item_at, make_tiny_model, present
from tests.gui_helpers import marks, run_page, stage_asked, table_dict


def test_a_failed_stage_shows_the_problem_and_the_fix(qtbot: Any, tmp_path: Path) -> None:
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    m = w.model_page
    m.kind.button(2).setChecked(True)
    m.source.setText(str(tmp_path / "missing.gguf"))
    with qtbot.waitSignal(m.strip.finished, timeout=30_000) as blocker:
        m.strip.run.click()
    assert blocker.args == [False] and "No model at" in m.strip.status.text()
    box = w.findChild(QMessageBox, "error_dialog")
    assert box is not None and "How to fix it" in box.informativeText()
    assert marks(w)[0] == "todo"


def test_the_pages_take_each_options_range_default_and_choices_from_core(qtbot: Any, tmp_path: Path) -> None:
    """The window declares no option of its own (gui/fields.py reads core/stage_options.py): CL had 1024 in four
    places under three ranges (the CLI's 2-131072, the Adapt page's 64-32768, the Model page's 128-32768)."""
    from npustudio.core import stage_options as so

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    q, c = w.quantize_page, w.compile_page
    for box, model, name in ((w.model_page.cl, so.AdaptOptions, "cl"), (w.adapt_page.cl, so.AdaptOptions, "cl"),
                             (w.adapt_page.ar, so.AdaptOptions, "ar"), (q.calib_samples, so.QuantizeOptions,
                             "calib_samples"), (q.calib_len, so.QuantizeOptions, "calib_len"),
                             (c.verify, so.CompileOptions, "verify_tokens")):
        assert (box.minimum(), box.maximum()) == so.int_range(model, name), name
        assert box.value() == getattr(model(), name) and box.toolTip() == model.model_fields[name].description, name
    assert w.model_page.cl.maximum() == so.MAX_CONTEXT
    assert tuple(q.precision.itemData(i) for i in range(q.precision.count())) == so.PRECISION_NAMES
    assert q.options().target == so.QuantizeOptions().target  # no target chosen yet: the field's default
    assert c.options().embedding_lut == so.CompileOptions().embedding_lut  # the table leaves the graphs by default
    c.lut.setChecked(False)
    assert not c.options().embedding_lut


def test_the_context_fields_stop_at_what_the_read_model_takes(qtbot: Any, tmp_path: Path) -> None:
    """Issue 65: with a model trained for 256 tokens read, Adapt still offered the default CL 1024, and its Run was
    refused with a fix naming `--cl`, which the window has not got. The context fields of Model and Adapt now stop
    at 256 and say why; a model without that limit gets the field's whole range back."""
    from npustudio.core import pipeline
    from npustudio.core import stage_options as so
    from npustudio.core.progress import State
    from npustudio.core.stage_options import AdaptOptions

    short = make_tiny_model(tmp_path / "short", "llama64", max_position_embeddings=256)
    p = Project.open(tmp_path / "proj")
    pipeline.intake(p, str(short), 1024, State())
    w = MainWindow(p.root, watch_devices=False)
    qtbot.addWidget(w)
    for box in (w.adapt_page.cl, w.model_page.cl):
        assert box.maximum() == 256 and box.value() == 256
        assert "At most 256: the model was trained for 256 tokens" in box.toolTip()
    assert w.adapt_page.options().cl == 256  # what Run would use

    longer = make_tiny_model(tmp_path / "long", "llama64", max_position_embeddings=4096)
    pipeline.intake(p, str(longer), 1024, State())
    w.refresh()
    assert w.adapt_page.cl.maximum() == min(4096, so.int_range(AdaptOptions, "cl")[1])
    assert w.adapt_page.cl.value() == 1024 and "At most 256" not in w.adapt_page.cl.toolTip()


def test_the_target_page_and_the_profiles_show_one_decode_roofline_for_a_built_bundle(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """They once disagreed for the same target (420.3 vs 369.2 tok/s): one estimated from the fit, the other from
    the largest binary. Both now take the bundle's token-graph binaries and its context."""
    import re
    import shutil

    import pyqtgraph as pg

    from npustudio.core.genie.meta import read_metadata

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    bundle = root / "stages" / "bundle"
    meta = read_metadata(bundle)
    w.go("Target")
    w.target_page.select(meta.target.soc)
    shown = table_dict(w.target_page.details)["Decode bound, w8a16"]
    target_figure = float(present(re.search(r"≤ ([\d.]+) tok/s", shown), "decode bound").group(1))
    assert "measured: the bundle's token graph" in shown
    assert "as built for the simulator" in shown  # not taken for a phone's weight-shared build
    assert w.profiles.roof is not None and w.profiles.roof["decode_tok_s_bound"] == target_figure
    line = next(i for i in w.profiles.rates.getPlotItem().items if isinstance(i, pg.InfiniteLine))
    assert round(10 ** line.value(), 1) == target_figure  # drawn on the rates' log axis
    assert f"{target_figure} tok/s" in line.label.textItem.toPlainText()
    token_bins = sum(f.stat().st_size for f in bundle.glob("token_*.bin"))  # what one generated token reads
    expected = meta.target.memory_gb_s * 1e9 / (token_bins + meta.decoder.kv_bytes_per_token * meta.context_length)
    assert target_figure == round(expected, 1)
    w4 = table_dict(w.target_page.details)["Decode bound, w4a16"]
    assert "estimate" in w4  # no bundle of that precision

    # issue 65: the Model page said other figures for the same bundle without saying why. It shows the Target
    # page's, for the project's target, named in its header, each saying whether it is measured or estimated
    from npustudio.gui.pages.model import DECODE, FIT_COLUMNS

    assert w.project is not None
    assert w.project.choices().target_soc == meta.target.soc
    fit, col = w.model_page.fit, FIT_COLUMNS.index(DECODE)

    def header(i: int) -> str:
        return present(fit.horizontalHeaderItem(i), f"header of column {i}").text()

    # the page leads with its answer: at 1024x700 the last columns are behind the table's own scroll
    assert [header(i) for i in range(3)] == ["Precision", "Fits", "Phone RAM needed"]
    assert header(col) == f"Decode bound ({meta.target.soc})"
    by = {item_at(fit, r, 0).text(): item_at(fit, r, col).text() for r in range(fit.rowCount())}
    assert by["w8a16"] == f"{target_figure:,.0f} tok/s (measured)"
    w4_figure = float(present(re.search(r"≤ ([\d.]+) tok/s", w4), "decode bound").group(1))
    assert by["w4a16"] == f"{w4_figure:,.0f} tok/s (estimate)"


def test_redo_on_each_stage_page_reruns_its_stage_with_force(qtbot: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Run skips an unchanged stage; Redo passes force=True to the pipeline (the CLI's --force)."""
    from npustudio.core import isolated

    asked: list[tuple[str, bool]] = []

    def fake_run(fn: Any, *args: Any, state: Any, **kw: Any) -> Any:
        asked.append((stage_asked(fn, args), fn.keywords["force"]))
        raise UserError("not run in this test", "")

    monkeypatch.setattr(isolated, "run", fake_run)
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    for page in (w.adapt_page, w.quantize_page, w.compile_page):
        assert not page.strip.redo.isHidden()
        for button in (page.strip.run, page.strip.redo):
            with qtbot.waitSignal(page.strip.finished, timeout=10_000):
                button.click()
    assert asked == [("adapt", False), ("adapt", True), ("quantize", False), ("quantize", True),
                     ("compile_and_bundle", False), ("compile_and_bundle", True)]


def test_run_on_a_page_keeps_the_options_the_page_does_not_show(
        qtbot: Any, genie_project: Project, tmp_path: Path) -> None:
    """A project made outside the window (by the pipeline, as the CLI makes it) from a model folder, with options
    the pages do not show (calibration decode steps, eval sizes): Run on each stage's page finds the stage current
    and redoes nothing. The pages built their options from their own fields and the defaults, and the project did
    not remember its model, so Run on Adapt adapted the embedded default model instead."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    p = Project.open(root, create=False)
    specs: tuple[stages.StageSpec[Any, Any], ...] = (stages.ADAPT, stages.QUANTIZE, stages.COMPILE, stages.BUNDLE)
    ran = {s.name: done(p, s).record.started for s in specs}
    assert done(p, stages.QUANTIZE).options.calib_decode == 4  # not the default 8
    assert p.choices().model == str(genie_project.root.parent / "m")
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    for page in (w.adapt_page, w.quantize_page, w.compile_page):
        run_page(qtbot, page)
    assert {s.name: done(p, s).record.started for s in specs} == ran
    assert marks(w)[:5] == ["done"] * 5  # Deploy: whether another test deployed the shared project


def test_a_late_progress_message_keeps_stopping_and_a_push_states_one_rate(
        qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a progress message that arrives after Cancel (or Stop and quit) leaves "Stopping…" on the page; a
    finished push shows the same rate on the Deploy page and on the device panel's bar (49 beside 498 MB/s); the
    settings' QNN SDK, adb and MNN Android runtime fields have a Browse… button that fills them."""
    import threading

    from npustudio.core.device.deploy import DeployResult
    from npustudio.gui import settings_dialog
    from npustudio.gui.widgets import RunStrip

    strip = RunStrip()
    qtbot.addWidget(strip)
    go = threading.Event()
    job = strip.start(lambda state: go.wait(10), lambda _r: None, "Quantizing")
    # issue 65: the bar stood empty for ~25 s while the stage loaded its libraries: it is busy until the first figure
    assert strip.bar.maximum() == 0
    job.progress.emit(0.0, "loading AIMET")
    qtbot.wait(50)
    assert strip.bar.maximum() == 0 and strip.status.text() == "loading AIMET"
    strip.cancel.click()
    job.progress.emit(0.4, "Calibrating 3 of 4")  # sent before the stage reached its safe point
    qtbot.wait(50)
    assert strip.status.text().startswith("Stopping") and strip.bar.value() == 400 and strip.bar.maximum() == 1000
    with qtbot.waitSignal(job.finished, timeout=10_000):
        go.set()

    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    d = w.deploy_page
    d._partial("push", {"bytes": 9_000_000, "total": 10_000_000, "rate": 498e6, "eta_s": 0.0})
    d.finish(DeployResult(device="emulator-5554", remote_dir="/data/local/tmp/x", files=[], bytes_sent=10_000_000,
                          bytes_skipped=0, seconds=0.2, rate_mb_s=49.0))
    assert "at 49 MB/s" in d.strip.status.text() and "at 49 MB/s" in w.devices.push.format()
    assert "498" not in w.devices.push.format()

    picked = {"dir": str(tmp_path / "qairt"), "file": str(tmp_path / "adb")}
    monkeypatch.setattr(settings_dialog.QFileDialog, "getExistingDirectory", lambda *a, **k: picked["dir"])
    monkeypatch.setattr(settings_dialog.QFileDialog, "getOpenFileName", lambda *a, **k: (picked["file"], ""))
    dlg = w.open_settings()
    dlg.sdk_browse.click()
    dlg.adb_browse.click()
    assert (dlg.sdk.text(), dlg.adb.text()) == (picked["dir"], picked["file"])
    dlg.reject()
    # the MNN Android runtime's folder: browsed, saved, and where the deploy looks (MNN_ANDROID_ROOT)
    from npustudio.core import settings as user_settings

    monkeypatch.setenv("MNN_ANDROID_ROOT", "")  # put back after the test: accepting the dialog sets it
    dlg = w.open_settings()
    dlg.mnn_browse.click()
    assert dlg.mnn.text() == picked["dir"]
    dlg.accept()
    assert user_settings.load().mnn_android_root == picked["dir"] == os.environ["MNN_ANDROID_ROOT"]


def test_a_pages_form_shows_the_options_a_stage_ran_with_and_reads_them_back(qtbot: Any) -> None:
    """A page's widgets are bound to its options model's fields (`Form`): showing the options a stage ran with and
    reading the widgets back gives those options again, each widget starts at its field's default, and a widget
    bound to a field the model does not have is refused when the page is built, not when a user runs it."""
    from PySide6.QtWidgets import QSpinBox

    from npustudio.core.stage_options import CompileOptions, QuantizeOptions
    from npustudio.gui.fields import Form

    form = Form(QuantizeOptions)
    for w in (form.combo("precision"), form.combo("recipe"), form.spin("calib_len"), form.combo("lm_head_bits")):
        qtbot.addWidget(w)
    assert QuantizeOptions(**form.values()) == QuantizeOptions()
    ran = QuantizeOptions(precision="w4a16", recipe="seqmse", calib_len=96, lm_head_bits=4)
    form.show(ran)
    assert QuantizeOptions(**form.values()) == ran
    checks = Form(CompileOptions)
    lut = checks.check("embedding_lut", "Embedding table on the CPU")
    qtbot.addWidget(lut)
    assert lut.isChecked() == CompileOptions().embedding_lut and lut.toolTip()
    checks.show(CompileOptions(embedding_lut=not CompileOptions().embedding_lut))
    assert checks.values() == {"embedding_lut": not CompileOptions().embedding_lut}
    with pytest.raises(ValueError, match="QuantizeOptions has no field 'calib_lenght'"):
        form.bind("calib_lenght", QSpinBox())
