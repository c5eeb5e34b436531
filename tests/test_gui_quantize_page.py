"""The Quantize page: its live perplexity chart and tab, and the encodings inspector (filters, sorting, details,
the heatmap, the weight histogram, a comparison with another run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtGui import QImage, QPainter

from npustudio.core.project import Project
from npustudio.gui.app import MainWindow
from tests.conftest import item_at, present
from tests.gui_helpers import shot, small_table


def test_the_perplexity_tab_is_as_tall_as_itself_not_as_the_inspector(qtbot: Any, tmp_path: Path) -> None:
    """A tab widget is as tall as its tallest tab: the inspector's heatmap and table made the Quantize page's
    perplexity chart ~1,250 px tall in a scrolling page, its axis out of view; it now sizes to the tab shown."""
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    tabs = w.quantize_page.tabs
    inspector = present(tabs.widget(1), "second tab").sizeHint().height()
    assert tabs.currentIndex() == 0 and tabs.sizeHint().height() < inspector
    tabs.setCurrentIndex(1)  # the inspector, when shown, gets its room
    assert tabs.sizeHint().height() >= inspector
    from npustudio.gui.widgets import fill

    long_name = "test_vectors/prompt_ar128_cl1024_1_of_1.npz"  # shortened in the middle to fit: whole on hover
    fill(w.quantize_page.results, [(long_name, "135.9 KB")])
    assert item_at(w.quantize_page.results, 0, 0).toolTip() == long_name


def test_a_finished_stages_perplexity_windows_are_drawn_once(qtbot: Any) -> None:
    """A record's windows go into the chart together (one redraw per window took ~0.3 s when a project opened)."""
    from npustudio.gui.charts import PplChart

    chart = PplChart()
    qtbot.addWidget(chart)
    chart.extend([{"window": i, "fp_ppl": 14.0 + i, "quant_ppl": 14.5 + i, "fp_ppl_running": 14.2,
                   "quant_ppl_running": 14.6} for i in range(70)])
    assert chart.redraws == 1
    assert len(chart.series["fp"]) == len(chart.series["quant"]) == 70
    xs, ys = chart.items["quant"].getData()
    assert list(xs) == list(range(70)) and ys[-1] == 14.5 + 69
    assert "ratio quant/fp" in chart.summary.text()


def test_inspector_filters_sorts_and_details_a_real_export(qtbot: Any, genie_project: Project) -> None:
    from npustudio.core.graph import encodings, sqnr
    from npustudio.gui.inspector import Inspector

    f = next(genie_project.stage_dir("quantize").glob("prompt_*.encodings"))
    table = sqnr.annotated(f)
    ins = Inspector()
    qtbot.addWidget(ins)
    ins.sort_by("scale_spread")  # a header clicked before anything is loaded is a no-op
    ins.load(table)
    assert ins.proxy.rowCount() == len(table.rows)
    ins.role.setCurrentIndex(ins.role.findData("kv-cache"))
    kv = ins.visible_rows()
    assert kv and {r.role for r in kv} == {"kv-cache"} and {r.bitwidth for r in kv} == {8}
    ins.role.setCurrentIndex(0)
    ins.search.setText("mlp.down")
    assert all("mlp.down" in r.name for r in ins.visible_rows()) and ins.visible_rows()
    ins.search.setText("")
    ins.sort_by("scale_spread", descending=True)
    spreads = [r.scale_spread for r in ins.visible_rows()]
    assert spreads == sorted(spreads, reverse=True)
    ins.view.selectRow(0)
    top = ins.visible_rows()[0]
    assert top.name in ins.detail_label.text() and ins.detail_points == top.channels
    for metric in range(ins.colour_by.count()):  # every colouring draws a layers x roles grid
        ins.colour_by.setCurrentIndex(metric)
        assert ins.heat_grid.shape[1] == 2
    grids, shows = {}, {}
    for key in ("weight_bits", "activation_bits", "sqnr", "activation_sqnr"):
        ins.colour_by.setCurrentIndex(ins.colour_by.findData(key))
        grids[key] = {role: ins.heat_grid[i] for i, role in enumerate(ins.heat_roles)}
        shows[key] = {table.by_name(n).kind for n in ins.heat_names.values()}
    assert list(grids["weight_bits"]["q"]) == [8, 8]  # the int8 weights, not the 16-bit activations around them
    assert "norm" not in grids["sqnr"] and "activation" not in grids["sqnr"]  # no weight there: no row
    assert list(grids["activation_bits"]["kv-cache"]) == [8, 8]
    assert all(30 < db < 60 for db in grids["sqnr"]["down"])  # int8 per channel: about 40 dB
    # activations (a conv's output has its role): the 8-bit KV cache is where they lose the most; no weight mixed in
    assert shows["activation_sqnr"] == {"activation"} and shows["sqnr"] == {"param"}
    assert all(30 < db < 55 for db in grids["activation_sqnr"]["kv-cache"])
    assert all(db > 60 for role in ("activation", "down") for db in grids["activation_sqnr"][role])
    ins.sort_by("sqnr_db", descending=False)  # the most damaged weight first
    assert ins.visible_rows()[0].sqnr_db == min(r.sqnr_db for r in table.rows if r.sqnr_db is not None)
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("range"))  # every role has activations
    ins.resize(1000, 800)
    ins.show()
    qtbot.waitExposed(ins)
    qtbot.wait(200)  # layout settles
    img = QImage(10, 10, QImage.Format.Format_ARGB32)
    painter = QPainter(img)
    drawn = [text for _rect, _flags, text in ins.heatmap.getAxis("left").generateDrawSpecs(painter)[2]]
    painter.end()
    assert sorted(drawn) == sorted(ins.heat_roles) and "activation" in drawn  # every row is labelled
    ins.load(encodings.read(f))  # without SQNR figures (rotated weights): the SQNR colouring draws nothing
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("sqnr"))
    assert ins.heat_roles == []


def test_the_inspector_shows_what_another_run_changed(qtbot: Any, genie_project: Project,
                                                      genie_project_w4: Project) -> None:
    """Issue 41: the inspector sets the run it shows against another project's (here w4a16 against w8a16 of the same
    model): each tensor's SQNR in both, the most damaged by the change first; 4-bit blocks lose against int8 rows."""
    from npustudio.core.graph import encodings
    from npustudio.gui.inspector import Inspector

    after = next(genie_project_w4.stage_dir("quantize").glob("prompt_*.encodings"))
    before = next(genie_project.stage_dir("quantize").glob("prompt_*.encodings"))
    ins = Inspector()
    qtbot.addWidget(ins)
    assert not ins.compare.isEnabled()  # nothing to compare before a run is shown
    ins.load(encodings.read(after))
    assert ins.compare.isEnabled()
    title = ins.title.text()
    # issue 65: a comparison (~40 s on the default model) says how far it is and can be cancelled
    ins.compare_with(before)
    assert ins.compare.text() == "Cancel comparison" and ins.compare.isEnabled()
    qtbot.waitUntil(lambda: ins.title.text().startswith(f"Comparing with {genie_project.root.name}/"), timeout=60_000)
    ins.compare.click()
    qtbot.waitUntil(lambda: ins.compare.text() == "Compare with another run…", timeout=120_000)
    qtbot.wait(200)
    assert ins.changes is None and ins.title.text() == title and ins.compare.isEnabled()
    ins.compare_with(before)
    qtbot.waitUntil(lambda: ins.changes is not None, timeout=180_000)
    assert ins.changes is not None and ins.compare.isEnabled()
    rows = ins.changes.rows
    changes = [r.change_db for r in rows if r.change_db is not None]
    assert changes == sorted(changes) and changes[0] < -10  # int4 against int8: far less signal to noise
    down = next(r for r in rows if r.name == "layers.0.mlp.down.weight")
    assert down.after_db is not None and down.before_db is not None and down.after_db < down.before_db - 10
    assert ins.changes.table.rowCount() == len(rows) and ins.changes.table.item(0, 0).text() == rows[0].name
    assert " lost and " in ins.changes.summary.text() and "the most damaged first" in ins.changes.summary.text()
    shot(ins.changes, "inspector_run_changes")


def test_inspector_cell_click_graph_chooser_and_weight_histogram(qtbot: Any, genie_project: Project,
                                                                tmp_path: Path) -> None:
    """A click on a heatmap cell selects the tensor it shows (even one the filter hid); the selected weight's
    float values are drawn against its clip range; the token graph's encodings can be picked; the scale plot
    is tall enough to read."""
    import shutil

    from PySide6.QtCore import QPointF
    from safetensors.numpy import load_file

    from npustudio.core.graph import encodings

    root = tmp_path / "proj"
    shutil.copytree(genie_project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.resize(1366, 768)
    w.show()
    w.go("Quantize")
    q = w.quantize_page
    q.tabs.setCurrentWidget(q.inspector)
    ins = q.inspector
    qtbot.waitUntil(lambda: ins.table_ is not None, timeout=60_000)
    assert [ins.graph.itemText(i) for i in range(ins.graph.count())] == \
        [f.stem for f in (root / "stages" / "quantize").glob("*.encodings") if f.stem.startswith("prompt")] + \
        [f.stem for f in (root / "stages" / "quantize").glob("*.encodings") if f.stem.startswith("token")]
    assert present(ins.table_, "encodings table").path.endswith(ins.graph.itemText(0) + ".encodings")
    ins.graph.setCurrentIndex(1)  # the token graph, as a click on the list does
    ins.graph.activated.emit(1)
    qtbot.waitUntil(lambda: present(ins.table_, "encodings table").path.endswith(ins.graph.itemText(1) + ".encodings"),
                    timeout=60_000)
    assert ins.graph.currentIndex() == 1 and ins.graph.itemText(1) in ins.title.text()

    ins.colour_by.setCurrentIndex(ins.colour_by.findData("spread"))
    qtbot.wait(200)
    assert ins.detail.height() >= 160 and ins.hist.height() >= 160
    i, j = ins.heat_roles.index("down"), 1
    want = ins.heat_names[i, j]
    ins.search.setText("embed")  # hides the cell's tensor from the table
    vb = ins.heatmap.getPlotItem().vb
    at = ins.heatmap.mapFromScene(vb.mapViewToScene(QPointF(j + 0.5, i + 0.5)))
    qtbot.mouseClick(ins.heatmap.viewport(), Qt.MouseButton.LeftButton, pos=at)
    selected = ins.selected()
    assert selected is not None and selected.name == want and "layers.1.mlp.down" in want
    assert ins.search.text() == "" and want in ins.detail_label.text()

    qtbot.waitUntil(lambda: ins.hist_data is not None, timeout=30_000)
    h = present(ins.hist_data, "weight histogram")
    row = present(ins.selected(), "selected tensor")
    stored = load_file(str(root / "stages" / "adapt" / "decoder.safetensors"))[want]
    assert h.values == h.of == stored.size  # a tiny weight is read whole
    assert list(np.histogram(stored.astype(np.float64), bins=np.asarray(h.edges))[0]) == h.counts
    assert h.clip_low < 0 < h.clip_high and h.clipped < 0.01  # int8 per channel from min/max: next to no clipping
    offsets = row.offsets if len(row.offsets) == len(row.scales) else [row.offset] * len(row.scales)
    widest = max((255 + o) * s for s, o in zip(row.scales, offsets, strict=True))  # x' = (q + offset)·scale
    assert row.bitwidth == 8 and abs(h.clip_high - widest) < 1e-6 * widest
    assert "clip range" in ins.hist_label.text()
    act = next(r.name for r in encodings.read(present(ins.table_, "encodings table").path).rows
               if r.kind == "activation")
    ins.select_tensor(act)
    assert ins.hist_data is None and "activation" in ins.hist_label.text()


def name_at_left(view: Any, row: int) -> str | None:
    """What a person reads at the table's left edge on `row` (whichever view is drawn on top there)."""
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QTableView

    pt = view.viewport().geometry().topLeft() + QPoint(4, view.rowViewportPosition(row) + 5)
    w = view.childAt(pt)
    while w is not None and not isinstance(w, QTableView):
        w = w.parentWidget()
    assert w is not None, f"no table view at row {row}"
    idx = w.indexAt(w.viewport().mapFromGlobal(view.mapToGlobal(pt)))
    return idx.data() if idx.isValid() else None


def test_the_inspector_keeps_names_in_view_shows_flags_and_the_heatmaps_figures(qtbot: Any, tmp_path: Path) -> None:
    """Issue 37: the names stay at the table's left however far it is scrolled and whatever it is sorted by; the
    flags column is as wide as the flags (the flagged rows are past the first 60); a flagged activation has the
    SQNR the heatmap colours it by; an activation draws no histogram (the last weight's stayed on its axes); a
    heatmap cell's tooltip names its tensor, role, layer and figure."""
    from PySide6.QtCore import QPointF
    from PySide6.QtGui import QFontMetrics

    from npustudio.core.graph.sqnr import WeightHistogram
    from npustudio.gui.inspector import COLUMNS, Inspector

    table = small_table(tmp_path / "quantize")
    wide = table.by_name("/layers.2/mlp/down/Conv_output_0")
    assert wide.flags and "wider" in wide.flags[0] and table.rows.index(wide) > 60
    ins = Inspector()
    qtbot.addWidget(ins)
    ins.resize(800, 900)
    ins.show()
    qtbot.waitExposed(ins)
    ins.load(table)
    qtbot.wait(50)
    col = {k: i for i, (k, _) in enumerate(COLUMNS)}
    bar = ins.view.horizontalScrollBar()
    assert bar.maximum() > 0  # wider than the view: it scrolls sideways
    bar.setValue(bar.maximum())
    ins.sort_by("sqnr_db", descending=False)  # the SQNR header is at the right end
    qtbot.wait(50)
    first = ins.visible_rows()[0]
    assert first.name == wide.name  # the most damaged first: the wide range
    assert name_at_left(ins.view, 0) == first.name
    assert ins.proxy.index(0, 0).data(Qt.ItemDataRole.ToolTipRole).startswith(first.name)
    assert ins.proxy.index(1, 0).data(Qt.ItemDataRole.ToolTipRole) == ins.visible_rows()[1].name  # elided: whole

    fm = QFontMetrics(ins.view.font())
    assert ins.view.columnWidth(col["flags"]) >= fm.horizontalAdvance("; ".join(wide.flags))

    shown = ins.proxy.index(0, col["sqnr_db"]).data()
    assert shown != "—" and wide.sqnr_db is not None
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_sqnr"))
    cell = (ins.heat_roles.index("down"), 2)
    assert ins.heat_names[cell] == wide.name and shown == f"{ins.heat_grid[cell]:.4g}"

    ins.draw_histogram(WeightHistogram(counts=[1, 3, 1], edges=[-1000.0, -1, 1, 1000.0], clip_low=-1000.0,
                                       clip_high=1000.0, grid=[], clipped=0.0, values=5, of=5))
    assert ins.hist.isVisibleTo(ins)
    ins.view.selectRow(0)
    assert ins.hist_data is None and not ins.hist.isVisibleTo(ins)
    assert "activation" in ins.hist_label.text() and "no stored values" in ins.hist_label.text()

    qtbot.wait(200)  # the heatmap's view fits the new grid
    vb = ins.heatmap.getPlotItem().vb
    ins.heatmap.scene().sigMouseMoved.emit(vb.mapViewToScene(QPointF(cell[1] + 0.5, cell[0] + 0.5)))
    tip = ins.heatmap.toolTip()
    assert wide.name in tip and "down, layer 2" in tip and f"{wide.sqnr_db:.1f} dB" in tip
    ins.heatmap.scene().sigMouseMoved.emit(vb.mapViewToScene(QPointF(-5, -5)))  # off the cells: no tip
    assert ins.heatmap.toolTip() == ""

    # issue 65: a sort keeps the highlight on the tensor the detail pane shows
    ins.select_tensor(wide.name)
    assert ins.selected() == wide
    for column, descending in (("name", False), ("scale_spread", True), ("layer", True)):
        ins.sort_by(column, descending)
        assert ins.selected() == wide and ins.detail_label.text().startswith(f"{wide.name}:")
        rows = ins.view.selectionModel().selectedRows()
        assert len(rows) == 1 and ins.visible_rows()[rows[0].row()] == wide

    # the colour bar spans the data: a map of one bit width is that width, not "8 to 9"
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_bits"))
    bits = {r.bitwidth for r in table.rows if r.kind == "activation" and r.layer is not None}
    assert len(bits) == 1
    (only,) = bits
    lo, hi = ins.colorbar.levels()
    assert lo < only < hi and hi - lo == 1
    assert ins.colorbar.axis._tickLevels == [[(float(only), f"{only:g}")]]
    ins.colour_by.setCurrentIndex(ins.colour_by.findData("activation_sqnr"))
    assert ins.colorbar.levels() == (float(np.nanmin(ins.heat_grid)), float(np.nanmax(ins.heat_grid)))
    assert ins.colorbar.axis._tickLevels is None
