"""The per-layer encodings inspector: a layers × roles heatmap (a click on a cell selects its tensor), a
sortable/filterable table of every tensor, the per-channel (or per-block) scales of the selected one and a
histogram of its float values against its quantization grid and clip range. A chooser switches between the
graphs' .encodings (prompt, token). All numbers come from core.graph (encodings, sqnr).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QPersistentModelIndex,
    QSortFilterProxyModel,
    Qt,
    Signal,
)
from PySide6.QtGui import QColor, QCursor, QFontMetrics, QResizeEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTableView,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from ..core import lora_effect
from ..core.graph import sqnr
from ..core.graph.encodings import EncodingsTable, TensorRow
from ..core.graph.sqnr import SqnrChange
from . import worker
from .charts import Chart
from .widgets import fill, show_error, table

ROLES = ("embedding", "norm", "q", "k", "v", "o", "gate", "up", "down", "kv-cache", "activation", "lm_head")
COLUMNS = (("name", "Tensor"), ("layer", "Layer"), ("role", "Role"), ("kind", "Kind"), ("bitwidth", "Bits"),
           ("granularity", "Granularity"), ("channels", "Channels"), ("scale_min", "Scale min"),
           ("scale_max", "Scale max"), ("scale_spread", "Spread"), ("range_min", "Range min"),
           ("range_max", "Range max"), ("sqnr_db", "SQNR dB"), ("flags", "Flags"))
METRICS = {"sqnr": "weight SQNR, dB (lowest: most damage)",
           "activation_sqnr": "activation SQNR, dB (lowest: most damage)", "weight_bits": "weight bits",
           "activation_bits": "activation bits", "spread": "scale spread (log10, max)",
           "range": "range width (log10, max)"}
_KIND = {"weight_bits": "param", "sqnr": "param", "activation_bits": "activation",  # rows a metric reads
         "activation_sqnr": "activation"}
_DB = ("sqnr", "activation_sqnr")  # metrics in dB: the lowest is the worst
FLAGGED = QColor("#f8d7da")
Index = QModelIndex | QPersistentModelIndex
NAME_WIDTH = 360  # px at most for the frozen name column: a long name is elided in the middle, whole in its tooltip
FLAGS_WIDTH = 420  # px at most for the flags: longer ones are whole in the tooltip
ROW_HEIGHT = 20


class TensorModel(QAbstractTableModel):
    def __init__(self, rows: list[TensorRow]) -> None:
        super().__init__()
        self.rows = rows

    def sort(self, column: int, order: Qt.SortOrder = Qt.SortOrder.AscendingOrder) -> None:
        """One Python sort by the raw value (a proxy sort would call data() for every comparison)."""
        key = COLUMNS[column][0]

        def value(r: TensorRow) -> Any:
            v = getattr(r, key)
            return len(v) if key == "flags" else v

        self.layoutAboutToBeChanged.emit()
        # the selection (and any other persistent index) follows its tensor, not its row number: after a sort the
        # highlight and the detail pane still show the same tensor
        held = [(i, self.rows[i.row()]) for i in self.persistentIndexList()]
        known = [r for r in self.rows if getattr(r, key) is not None]  # rows without a value last, either way
        known.sort(key=value, reverse=order == Qt.SortOrder.DescendingOrder)
        self.rows[:] = known + [r for r in self.rows if getattr(r, key) is None]
        at = {id(r): n for n, r in enumerate(self.rows)}
        for index, r in held:
            self.changePersistentIndex(index, self.index(at[id(r)], index.column()))
        self.layoutChanged.emit()

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008 (Qt API)
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return COLUMNS[section][1]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        r = self.rows[index.row()]
        key = COLUMNS[index.column()][0]
        v = getattr(r, key)
        if role == Qt.ItemDataRole.DisplayRole:
            if key == "flags":
                return "; ".join(v)
            if isinstance(v, float):
                return f"{v:.4g}"
            return "—" if v is None else str(v)
        if role == Qt.ItemDataRole.BackgroundRole and r.flags:
            return FLAGGED
        if role == Qt.ItemDataRole.ToolTipRole and (key == "name" or r.flags):
            return "\n".join(([r.name] if key == "name" else []) + r.flags)
        return None


class FrozenNameTable(QTableView):
    """The tensor table with the name column frozen at its left edge (Qt's frozen-column pattern: a second view
    over the same model and selection, showing that column only). The table is wider than the window: sorting by
    SQNR or flags, at its right end, scrolled the names off-screen and left rows of figures without a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.verticalHeader().setDefaultSectionSize(ROW_HEIGHT)
        self.names = QTableView(self)
        self.names.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.names.verticalHeader().hide()
        self.names.verticalHeader().setDefaultSectionSize(ROW_HEIGHT)
        self.names.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        self.names.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.names.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.names.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.names.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # both ends tell tensors apart
        self.names.setStyleSheet("QTableView { border: none; }")
        self.viewport().stackUnder(self.names)
        self.names.verticalScrollBar().valueChanged.connect(self.verticalScrollBar().setValue)
        self.verticalScrollBar().valueChanged.connect(self.names.verticalScrollBar().setValue)
        self.horizontalHeader().sectionResized.connect(lambda i, _old, new: self._resized(i, new))

    def setModel(self, model: Any) -> None:
        super().setModel(model)
        self.names.setModel(model)
        self.names.setSelectionModel(self.selectionModel())  # one selection: a click on a name selects its row
        model.modelReset.connect(self._only_names)
        model.layoutChanged.connect(self._only_names)
        self._only_names()

    def setSortingEnabled(self, enable: bool) -> None:
        super().setSortingEnabled(enable)
        self.names.setSortingEnabled(enable)  # the name header sorts too

    def setSelectionBehavior(self, behavior: QAbstractItemView.SelectionBehavior) -> None:
        super().setSelectionBehavior(behavior)
        self.names.setSelectionBehavior(behavior)

    def _only_names(self) -> None:
        for c in range(1, self.model().columnCount()):
            self.names.setColumnHidden(c, True)
        self.names.setColumnWidth(0, self.columnWidth(0))
        self._place()

    def _resized(self, column: int, width: int) -> None:
        if column == 0:
            self.names.setColumnWidth(0, width)
            self._place()

    def resizeEvent(self, e: QResizeEvent) -> None:
        super().resizeEvent(e)
        self._place()

    def _place(self) -> None:
        f = self.frameWidth()
        self.names.setGeometry(self.verticalHeader().width() + f, f, self.columnWidth(0),
                               self.viewport().height() + self.horizontalHeader().height())

    def scrollTo(self, index: Index, hint: QAbstractItemView.ScrollHint = QAbstractItemView.ScrollHint.EnsureVisible
                 ) -> None:
        """Rows only for the name column (it never scrolls sideways); a cell of another column is brought out from
        under the frozen names."""
        if index.column() > 0:
            super().scrollTo(index, hint)
        else:
            # `sibling`, not `siblingAtColumn`: a QPersistentModelIndex has only the former
            super().scrollTo(index.sibling(index.row(), max(0, self.horizontalHeader().logicalIndexAt(0))), hint)


class TensorFilter(QSortFilterProxyModel):
    """Text (in the name), role and flagged-only filters; sorting by the raw values."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.role, self.flagged_only = "", "", False

    def sort(self, column: int, order: Qt.SortOrder = Qt.SortOrder.AscendingOrder) -> None:
        if self.sourceModel() is not None and column >= 0:  # a header clicked before any encodings are loaded;
            # -1: the sort indicator cleared for another project
            self.sourceModel().sort(column, order)  # rows stay in the source's order, filtered here

    def set(self, text: str | None = None, role: str | None = None, flagged_only: bool | None = None) -> None:
        self.beginFilterChange()
        if text is not None:
            self.text = text.lower()
        if role is not None:
            self.role = role
        if flagged_only is not None:
            self.flagged_only = flagged_only
        self.endFilterChange(QSortFilterProxyModel.Direction.Rows)

    def tensors(self) -> TensorModel:
        """The source model: a `TensorModel` (`Inspector` sets one before any row is filtered or read)."""
        src = self.sourceModel()
        if not isinstance(src, TensorModel):
            raise TypeError(f"TensorFilter over {type(src).__name__}, not a TensorModel")
        return src

    def filterAcceptsRow(self, source_row: int, source_parent: Index) -> bool:
        r = self.tensors().rows[source_row]
        return ((not self.text or self.text in r.name.lower()) and (not self.role or r.role == self.role)
                and (not self.flagged_only or bool(r.flags)))


def heat(table: EncodingsTable, metric: str) -> tuple[np.ndarray, list[int], list[str], dict[tuple[int, int], str]]:
    """(roles × layers) values of `metric` over the roles the layers have, NaN where a layer lacks one, and the
    tensor each cell shows (its worst)."""
    def shown(r: TensorRow) -> bool:  # rows the metric reads: a role without any stays off the grid
        if r.layer is None or _KIND.get(metric, r.kind) != r.kind:
            return False
        return metric not in _DB or (r.sqnr_db is not None and math.isfinite(r.sqnr_db))

    layers = sorted({r.layer for r in table.rows if r.layer is not None})
    rows = [r for r in table.rows if shown(r)]  # once: the table is drawn on the GUI thread
    present = {r.role for r in rows}
    roles = [x for x in ROLES if x in present]
    row_of = {x: i for i, x in enumerate(roles)}
    grid = np.full((len(roles), len(layers)), np.nan)
    col = {layer: i for i, layer in enumerate(layers)}
    worse = (lambda a, b: a < b) if metric in _DB else (lambda a, b: a > b)  # a cell shows its most damaged
    names: dict[tuple[int, int], str] = {}
    for r in rows:
        if r.layer is None or r.role not in row_of:  # `shown` holds a layer: said for mypy
            continue
        v = {"weight_bits": float(r.bitwidth), "activation_bits": float(r.bitwidth), "sqnr": r.sqnr_db or 0.0,
             "activation_sqnr": r.sqnr_db or 0.0,
             "spread": math.log10(max(r.scale_spread, 1.0)),
             "range": math.log10(max(r.range_max - r.range_min, 1e-12))}[metric]
        i, j = row_of[r.role], col[r.layer]
        if np.isnan(grid[i, j]) or worse(v, grid[i, j]):
            grid[i, j], names[i, j] = v, r.name
    return grid, layers, roles, names


def colour_levels(lo: float, hi: float) -> tuple[float, float]:
    """The colour bar's range: the data's; one value alone sits mid-bar (an all-8-bit map is not "8 to 9")."""
    return (lo, hi) if hi > lo else (lo - 0.5, lo + 0.5)


def colour_ticks(metric: str, grid: np.ndarray) -> list[list[tuple[float, str]]] | None:
    """Bit widths are a few whole values: the bar names exactly those present; other metrics: the axis's own."""
    if metric.endswith("_bits") or np.nanmin(grid) == np.nanmax(grid):
        values = np.unique(grid[np.isfinite(grid)])
        return [[(float(v), f"{v:g}") for v in values]]
    return None


def _cell_value(metric: str, r: TensorRow) -> str:
    """The figure a heatmap cell's colour stands for, in the unit a person reads (the grid holds log10 for the
    spread and range colourings)."""
    if metric in _DB:
        return f"{r.sqnr_db:.1f} dB"
    if metric in ("weight_bits", "activation_bits"):
        return f"{r.bitwidth} bits"
    if metric == "spread":
        return f"×{r.scale_spread:.3g}"
    return f"[{r.range_min:.4g}, {r.range_max:.4g}] (width {r.range_max - r.range_min:.4g})"


class TitleLabel(QLabel):
    """A title that wraps and never widens its panel: a file name longer than its line (one word to Qt) widened
    the Quantize page past a 1024x700 window; cut there, it is whole in the tooltip."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(160)
        self.setText(text)

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(text)


class Inspector(QWidget):
    graph_chosen = Signal(object)  # Path of the .encodings picked in the graph chooser

    def __init__(self) -> None:
        super().__init__()
        self.table_: EncodingsTable | None = None
        lay = QVBoxLayout(self)
        self._controls(lay)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self._heatmap_chart())
        split.addWidget(self._tensor_table())
        split.addWidget(self._details())
        split.setSizes([260, 220, 240])
        split.setChildrenCollapsible(False)
        lay.addWidget(split, 1)
        self.colour_by.currentIndexChanged.connect(self._draw_heat)
        self.search.textChanged.connect(lambda t: self.proxy.set(text=t))
        self.role.currentIndexChanged.connect(lambda _i: self.proxy.set(role=self.role.currentData()))
        self.flagged.toggled.connect(lambda on: self.proxy.set(flagged_only=on))

    def _controls(self, lay: QVBoxLayout) -> None:
        """What is loaded and Compare; which graph, coloured by what; the filters."""
        bar = QHBoxLayout()  # which graph, coloured by what
        self.graph = QComboBox()
        self.graph.setToolTip("Which graph's encodings: the prompt graph (AR-N) or the token graph (AR-1)")
        self.graph.activated.connect(lambda i: self.graph_chosen.emit(self.graph.itemData(i)))
        bar.addWidget(self.graph, 1)
        self.colour_by = QComboBox()
        for k, label in METRICS.items():
            self.colour_by.addItem(label, k)
        self.search = QLineEdit()
        self.search.setPlaceholderText("filter by tensor name")
        self.role = QComboBox()
        self.role.addItem("all roles", "")
        for r in ROLES:
            self.role.addItem(r, r)
        self.flagged = QCheckBox("flagged only")
        self.compare = QPushButton("Compare with another run…")
        self.compare.setToolTip("What another quantize run (another project's recipe or override file) did to each "
                                "tensor: its SQNR in both runs, the most damaged by the change first")
        self.compare.setEnabled(False)
        self.compare.clicked.connect(self._compare_clicked)
        self.adapters = QPushButton("LoRA adapters…")
        self.adapters.setToolTip("What quantization keeps of each merged LoRA adapter: per module its rank and scale, "
                                 "the graph weights holding it and the share of its update at least half a "
                                 "quantization step (a click on a row selects its weight here)")
        self.adapters.setVisible(False)
        self.adapters.clicked.connect(self.show_adapters)
        self.adapters_dialog: AdaptersDialog | None = None
        self.changes: ChangesDialog | None = None
        self._compare_job: worker.Job | None = None
        self.title = TitleLabel("No encodings loaded.")
        bar.addWidget(QLabel("Colour:"))
        bar.addWidget(self.colour_by, 1)
        # the controls in rows, the combos free to shrink (their full text in the list): in one row they took
        # 990 px and pushed the page 207 px past a 1366x768 window
        for combo in (self.graph, self.colour_by, self.role):
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(10)
        filters = QHBoxLayout()
        filters.addWidget(self.search, 1)
        for w in (self.role, self.flagged):
            filters.addWidget(w)
        head = QHBoxLayout()  # what is loaded, and the comparison with another run of it
        head.addWidget(self.title, 1)
        head.addWidget(self.adapters)
        head.addWidget(self.compare)
        lay.addLayout(head)
        lay.addLayout(bar)
        lay.addLayout(filters)

    def _heatmap_chart(self) -> Chart:
        """Each layer's tensors by role, coloured by the chosen metric; a click selects the tensor."""
        self.heatmap = Chart()
        self.heatmap.setLabel("bottom", "layer")
        self.image = pg.ImageItem()
        self.heatmap.addItem(self.image)
        self.heatmap.invertY(True)
        # room for the longest role name: pyqtgraph drops a label that overflows the axis (only 6 of 10 showed)
        self.heatmap.getAxis("left").setWidth(QFontMetrics(self.font()).horizontalAdvance("activation") + 16)
        self.colorbar: Any = None
        self.heat_grid, self.heat_roles = np.zeros((0, 0)), list[str]()
        self.heat_names: dict[tuple[int, int], str] = {}
        self.heatmap.scene().sigMouseClicked.connect(self._heat_clicked)
        self.heatmap.scene().sigMouseMoved.connect(self._heat_hover)
        return self.heatmap

    def _tensor_table(self) -> FrozenNameTable:
        self.view = FrozenNameTable()
        self.view.setSortingEnabled(True)
        self.view.setSelectionBehavior(QTableView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QTableView.SelectionMode.SingleSelection)
        self.view.horizontalHeader().setResizeContentsPrecision(60)  # column widths from the first rows only
        self.proxy = TensorFilter()
        self.view.setModel(self.proxy)
        self.view.selectionModel().currentRowChanged.connect(self._select)  # once: the proxy stays, its source changes
        return self.view

    def _details(self) -> QWidget:
        """The selected tensor's scales per channel or block, and its weights' histogram."""
        self.detail = Chart()
        self.detail.setLabel("left", "scale")
        self.detail.setMinimumHeight(160)  # the scales of 64 channels need that much to be told apart
        self.hist = Chart()
        self.hist.setLabel("left", "values")
        self.hist.setLabel("bottom", "float value")
        self.hist.setMinimumHeight(160)
        self.hist_data: sqnr.WeightHistogram | None = None
        self._hist_job: worker.Job | None = None
        self.hist_label = QLabel("")
        self.hist_label.setWordWrap(True)
        self.detail_label = QLabel("Select a tensor to see its scales per channel or block.")
        self.detail_label.setWordWrap(True)
        det = QWidget()
        dl = QVBoxLayout(det)
        dl.setContentsMargins(0, 0, 0, 0)
        dl.addWidget(self.detail_label)
        plots = QHBoxLayout()
        plots.addWidget(self.detail, 1)
        plots.addWidget(self.hist, 1)
        dl.addLayout(plots, 1)
        dl.addWidget(self.hist_label)
        return det

    def clear_results(self) -> None:
        """No encodings: another project is open, or this one has none yet. Its filters, colouring, sort and each
        plot's zoom go back to their defaults too: the last project's hid rows of this one and kept its axes."""
        self.table_ = None
        self._cancel_histogram()
        self.proxy.setSourceModel(TensorModel([]))
        self.search.setText("")
        self.role.setCurrentIndex(0)
        self.flagged.setChecked(False)
        self.colour_by.setCurrentIndex(0)
        self.view.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        self.view.names.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        self.image.clear()
        self.heat_grid, self.heat_roles, self.heat_names = np.zeros((0, 0)), [], {}
        self.heatmap.getAxis("left").setTicks([[]])
        self.heatmap.getAxis("bottom").setTicks(None)
        self.heatmap.setToolTip("")
        self.detail.clear()
        self.detail.setLabel("bottom", "")
        self.detail_label.setText("Select a tensor to see its scales per channel or block.")
        self.hist.clear()
        self.hist.show()
        self.hist_data = None
        self.hist_label.setText("")
        for chart in (self.heatmap, self.detail, self.hist):
            chart.fit()
        self.graph.clear()
        self.compare.setEnabled(False)
        self.adapters.setVisible(False)
        self.title.setText("No encodings loaded.")

    def set_graphs(self, files: list[Path]) -> None:
        """The graphs whose encodings can be shown (prompt and token graph); the first is shown until another is
        picked."""
        current = self.graph.currentData()
        self.graph.clear()
        for f in files:
            self.graph.addItem(f.stem, f)
        self.graph.setCurrentIndex(max(0, self.graph.findData(current)))

    def load(self, table: EncodingsTable) -> None:
        self.table_ = table
        self.compare.setEnabled(True)
        self.adapters.setVisible(lora_effect.merged(lora_effect.adapt_dir_of(Path(table.path))))
        self.proxy.setSourceModel(TensorModel(table.rows))
        self.view.resizeColumnsToContents()
        self._widths(table.rows)
        flagged = sum(bool(r.flags) for r in table.rows)
        self.title.setText(f"{table.path.rsplit('/', 1)[-1]} (schema {table.version}): {len(table.rows)} tensors, "
                           f"{len(table.layers)} layer groups, {flagged} flagged")
        self._draw_heat()

    def _compare_clicked(self) -> None:
        """Compare, or cancel the comparison running (it reads both runs' graphs: ~40 s on the default model)."""
        if self._compare_job is not None:
            self._compare_job.cancel()
            self.compare.setEnabled(False)
            self.compare.setText("Stopping…")
            return
        self._pick_other_run()

    def _pick_other_run(self) -> None:
        """The file dialog opens where the other runs are: the folder holding this project (its sibling projects)."""
        shown = Path(self.table_.path) if self.table_ is not None else None
        start = str(shown.resolve().parents[3]) if shown is not None and len(shown.resolve().parents) > 3 else ""
        path, _ = QFileDialog.getOpenFileName(self, "The encodings of the run to compare with", start,
                                              "AIMET encodings (*.encodings)")
        if path:
            self.compare_with(Path(path))

    def compare_with(self, before: Path) -> None:
        """Each tensor's SQNR in `before` (another run's encodings, against its own project's float weights) and
        in the shown encodings, computed off the GUI thread, then shown the most damaged first."""
        if self.table_ is None:
            return
        after = Path(self.table_.path)
        self.compare.setText("Cancel comparison")
        shown = self.title.text()

        def progress(fraction: float, message: str) -> None:
            self.title.setText(f"Comparing with {_run_name(before)}: {message} ({fraction:.0%})")

        def done(rows: list[SqnrChange]) -> None:
            self._compare_finished(shown)
            self.changes = ChangesDialog(rows, before, after, self)
            self.changes.show()

        def failed(problem: str, fix: str) -> None:
            self._compare_finished(shown)
            show_error(self, problem, fix)

        self._compare_job = worker.start(lambda state: sqnr.changes(before, after, state), "Comparing runs",
                                         read=True, progress=progress, done=done, failed=failed,
                                         cancelled=lambda: self._compare_finished(shown))

    def show_adapters(self) -> None:
        """The merged adapters' modules (`lora_effect.effects`), read off the GUI thread, in a dialog whose rows
        select their graph weight here."""
        if self.table_ is None:
            return
        path = Path(self.table_.path)

        def done(rows: list[lora_effect.AdapterTensor]) -> None:
            self.adapters.setEnabled(True)
            self.adapters_dialog = AdaptersDialog(rows, path, self)
            self.adapters_dialog.chosen.connect(self.select_tensor)
            self.adapters_dialog.show()

        def failed(problem: str, fix: str) -> None:
            self.adapters.setEnabled(True)
            show_error(self, problem, fix)

        self.adapters.setEnabled(False)
        worker.start(lambda _state: lora_effect.effects(path), "Reading the LoRA adapters", read=True, done=done,
                     failed=failed, cancelled=lambda: self.adapters.setEnabled(True))

    def _compare_finished(self, title: str) -> None:
        self._compare_job = None
        self.title.setText(title)
        self.compare.setText("Compare with another run…")
        self.compare.setEnabled(self.table_ is not None)

    def _widths(self, rows: list[TensorRow]) -> None:
        """The name and flags columns from every row, not the first 60 `resizeColumnsToContents` reads (the
        flagged rows sit further down: their flags were cut to the header's width), each within a bound."""
        fm = QFontMetrics(self.view.font())
        pad = 3 * fm.horizontalAdvance("M")
        for key, bound, texts in (("name", NAME_WIDTH, {r.name for r in rows}),
                                  ("flags", FLAGS_WIDTH, {"; ".join(r.flags) for r in rows if r.flags})):
            col = [k for k, _ in COLUMNS].index(key)
            longest = sorted(texts, key=len)[-64:]  # the widest text is among the longest: measuring all 3,000+
            widest = max((fm.horizontalAdvance(t) for t in longest), default=0) + pad  # names held the GUI 30 ms
            self.view.setColumnWidth(col, max(self.view.columnWidth(col), min(widest, bound)))

    def visible_rows(self) -> list[TensorRow]:
        """The rows in the table's current order and filter (what a person sees)."""
        src = self.proxy.tensors()
        return [src.rows[self.proxy.mapToSource(self.proxy.index(i, 0)).row()] for i in range(self.proxy.rowCount())]

    def sort_by(self, column: str, descending: bool = True) -> None:
        col = [k for k, _ in COLUMNS].index(column)
        self.view.sortByColumn(col, Qt.SortOrder.DescendingOrder if descending else Qt.SortOrder.AscendingOrder)

    def _draw_heat(self) -> None:
        if self.table_ is None:
            return
        metric = self.colour_by.currentData()
        grid, layers, roles, names = heat(self.table_, metric)
        self.heatmap.getAxis("left").setTicks([[(i + 0.5, r) for i, r in enumerate(roles)]])
        self.heat_grid, self.heat_roles, self.heat_names = grid, roles, names
        if not np.isfinite(grid).any():  # nothing to colour (no SQNR figures in this table)
            self.image.clear()
            return
        # a layer without a role's tensor is painted as the harmless end of the scale, never as damage
        empty = np.nanmax(grid) if metric in _DB else np.nanmin(grid)
        img = np.nan_to_num(grid.T, nan=empty)
        self.image.setImage(img, autoLevels=True)
        self.image.setColorMap(pg.colormap.get("viridis"))
        if self.colorbar is None:
            self.colorbar = pg.ColorBarItem(colorMap=pg.colormap.get("viridis"), interactive=False)
            self.colorbar.setImageItem(self.image, insert_in=self.heatmap.getPlotItem())
        lo, hi = float(np.nanmin(grid)), float(np.nanmax(grid))
        self.colorbar.setLevels(colour_levels(lo, hi))
        self.colorbar.axis.setTicks(colour_ticks(metric, grid))
        step = max(1, len(layers) // 15)
        self.heatmap.getAxis("bottom").setTicks([[(j + 0.5, str(layer)) for j, layer in enumerate(layers)][::step]])

    def _heat_cell(self, scene_pos: Any) -> tuple[int, int] | None:
        """The (role, layer) cell of the heatmap at a scene position, if one shows a tensor there."""
        vb = self.heatmap.getPlotItem().vb
        if not vb.sceneBoundingRect().contains(scene_pos):
            return None
        pt = vb.mapSceneToView(scene_pos)
        cell = (math.floor(pt.y()), math.floor(pt.x()))
        return cell if cell in self.heat_names else None

    def _heat_clicked(self, ev: Any) -> None:
        """A click on a cell selects the tensor it shows in the table (filters that hide it are lifted)."""
        cell = self._heat_cell(ev.scenePos())
        if cell is not None:
            self.select_tensor(self.heat_names[cell])

    def _heat_hover(self, scene_pos: Any) -> None:
        """The cell under the mouse in a tooltip: its tensor, role, layer and the figure its colour stands for (a
        colour alone said which cell was bad, not which tensor nor how bad)."""
        cell = self._heat_cell(scene_pos)
        if cell is None or self.table_ is None:
            text = ""
        else:
            r = self.table_.by_name(self.heat_names[cell])
            metric = self.colour_by.currentData()
            text = (f"{r.name}\n{r.role}, layer {r.layer}\n{METRICS[metric]}: {_cell_value(metric, r)}"
                    + "".join(f"\n{f}" for f in r.flags))
        if text != self.heatmap.toolTip():
            self.heatmap.setToolTip(text)
            if text:
                QToolTip.showText(QCursor.pos(), text, self.heatmap)
            else:
                QToolTip.hideText()

    def select_tensor(self, name: str) -> None:
        """Select `name`'s row in the table and show its detail."""
        if name not in [r.name for r in self.visible_rows()]:
            self.search.setText("")
            self.role.setCurrentIndex(0)
            self.flagged.setChecked(False)
        row = next(i for i, r in enumerate(self.visible_rows()) if r.name == name)
        self.view.selectRow(row)
        self.view.scrollTo(self.proxy.index(row, 0))

    def selected(self) -> TensorRow | None:
        rows = self.view.selectionModel().selectedRows() if self.view.selectionModel() else []
        return self.proxy.tensors().rows[self.proxy.mapToSource(rows[0]).row()] if rows else None

    def _select(self, current: QModelIndex, _prev: QModelIndex) -> None:
        if not current.isValid():
            return
        r = self.proxy.tensors().rows[self.proxy.mapToSource(current).row()]
        self.show_detail(r)

    def show_detail(self, r: TensorRow) -> None:
        self.detail.clear()
        unit = {"channel": "channel", "block": "block (channel-major)", "tensor": "tensor"}[r.granularity]
        xs = np.arange(len(r.scales))
        self.detail.plot(xs, np.asarray(r.scales), pen=pg.mkPen("#1f77b4"), symbol="o" if len(xs) < 64 else None,
                         symbolSize=5)
        self.detail.setLabel("bottom", unit)
        flags = f" — {'; '.join(r.flags)}" if r.flags else ""
        self.detail_label.setText(
            f"{r.name}: {r.bitwidth}-bit {'symmetric' if r.symmetric else 'asymmetric'} per {unit}, "
            f"{len(r.scales)} scale(s) {r.scale_min:.3g}…{r.scale_max:.3g} (×{r.scale_spread:.1f}), offset {r.offset}, "
            f"range [{r.range_min:.4g}, {r.range_max:.4g}]{flags}")
        self.detail_points = len(r.scales)
        self._histogram(r)

    def _cancel_histogram(self) -> None:
        if self._hist_job is not None:
            self._hist_job.cancel()  # a read: what it finds is dropped
            self._hist_job = None

    def _histogram(self, r: TensorRow) -> None:
        """The weight's float values against its grid, read off the GUI thread (a large weight is sampled)."""
        self._cancel_histogram()
        self.hist.clear()
        self.hist_data = None
        if r.kind != "param" or self.table_ is None:  # no plot: an empty one kept the last weight's axes
            self.hist.hide()
            self.hist_label.setText(f"{r.name} is an activation: no stored values to draw a histogram of (its "
                                    f"range, [{r.range_min:.4g}, {r.range_max:.4g}], is in the table).")
            return
        self.hist.fit()  # the next weight's own axes, not the last one's
        self.hist.show()
        self.hist_label.setText("Reading the float weights…")
        path, name = Path(self.table_.path), r.name

        def show(h: sqnr.WeightHistogram | None) -> None:
            cur = self.selected()
            if cur is None or cur.name != name:  # another tensor was picked meanwhile
                return
            if h is None:
                self.hist_label.setText("The adapted model holds no float values for this tensor.")
                return
            self.draw_histogram(h)

        def failed(problem: str, fix: str) -> None:
            self.hist_label.setText(f"No histogram: {problem}")

        self._hist_job = worker.start(lambda _s: sqnr.histogram(path, r), "Reading weights", read=True, done=show,
                                      failed=failed)

    def draw_histogram(self, h: sqnr.WeightHistogram) -> None:
        self.hist_data = h
        self.hist.clear()
        self.hist.show()
        self.hist.plot(h.edges, h.counts, stepMode="center", fillLevel=0, brush=pg.mkBrush("#1f77b455"),
                       pen=pg.mkPen("#1f77b4"))
        for x in (h.clip_low, h.clip_high):
            self.hist.addItem(pg.InfiniteLine(x, angle=90, pen=pg.mkPen("#d62728", width=2)))
        if h.grid:  # the representable values, as ticks along the bottom
            top = max(h.counts) or 1
            self.hist.addItem(pg.ScatterPlotItem(h.grid, [0.0] * len(h.grid), symbol="|", size=8,
                                                 pen=pg.mkPen("#444"), brush=None))
            self.hist.setYRange(0, top * 1.05)
        sample = f"{h.values:,} of {h.of:,} values" if h.values < h.of else f"{h.values:,} values"
        self.hist_label.setText(
            f"Histogram: {sample}; red lines: the clip range [{h.clip_low:.4g}, {h.clip_high:.4g}]"
            + (f", ticks: the {len(h.grid)} grid values" if h.grid else " (widest over channels)")
            + f"; {h.clipped:.2%} beyond their own channel's range.")


class ChangesDialog(QDialog):
    """What another run changed (`sqnr.changes`), tensor by tensor: the SQNR of each in both runs, the
    most damaged by the change first, and how many gained or lost."""

    def __init__(self, rows: list[SqnrChange], before: Path, after: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("SQNR: what the run changed")
        self.rows = rows
        lay = QVBoxLayout(self)
        lost = sum(1 for r in rows if r.change_db is not None and r.change_db < -0.01)
        gained = sum(1 for r in rows if r.change_db is not None and r.change_db > 0.01)
        self.summary = QLabel(f"{_run_name(after)} against {_run_name(before)}: {len(rows)} tensors in both, "
                              f"{lost} lost and {gained} gained more than 0.01 dB (the most damaged first).")
        self.summary.setWordWrap(True)
        self.summary.setToolTip(f"after: {after}\nbefore: {before}")
        lay.addWidget(self.summary)
        self.table = table(["Tensor", "Kind", "SQNR before (dB)", "SQNR after (dB)", "Change (dB)"])

        def db(v: float | None) -> str | None:
            return None if v is None else "∞" if math.isinf(v) else f"{v:.2f}"

        fill(self.table, [(r.name, r.kind, db(r.before_db), db(r.after_db),
                           None if r.change_db is None else f"{r.change_db:+.2f}") for r in rows])
        lay.addWidget(self.table, 1)
        self.resize(820, 520)


class AdaptersDialog(QDialog):
    """Each merged adapter's modules as the quantized graphs hold them; a row flagged when most of its update is
    under half a quantization step. Selecting a row emits its first graph weight (the inspector shows its encoding)."""

    chosen = Signal(str)

    def __init__(self, rows: list[lora_effect.AdapterTensor], enc_file: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("LoRA adapters: what quantization keeps")
        self.rows = rows
        lay = QVBoxLayout(self)
        flagged = sum(bool(r.flags) for r in rows)
        names = sorted({r.adapter for r in rows})
        self.summary = QLabel(f"{_run_name(enc_file)}: {len(names)} adapter(s) ({', '.join(names)}) over "
                              f"{len(rows)} modules; {flagged} flagged. \"≥ ½ step\": the share of the update's "
                              "entries at least half a quantization step of their channel — smaller ones can round "
                              "away.")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        self.table = table(["Adapter", "Module", "Layer", "Role", "Rank", "Scale", "Graph weights", "Bits",
                            "‖ΔW‖/‖W‖", "≥ ½ step", "Flags"])
        fill(self.table, [(r.adapter, r.module, r.layer, r.role, r.rank, f"{r.scale:g}", ", ".join(r.tensors),
                           None if r.bitwidth is None else f"{r.bitwidth} ({r.granularity})",
                           None if r.update_ratio is None else f"{r.update_ratio:.2%}",
                           None if r.kept is None else f"{r.kept:.1%}", "; ".join(r.flags)) for r in rows],
             [FLAGGED if r.flags else None for r in rows])
        self.table.currentCellChanged.connect(self._picked)
        lay.addWidget(self.table, 1)
        self.resize(min(1280, parent.width() if parent is not None else 1280), 420)

    def _picked(self, row: int, *_: int) -> None:
        if 0 <= row < len(self.rows) and self.rows[row].tensors:
            self.chosen.emit(self.rows[row].tensors[0])


def _run_name(encodings_file: Path) -> str:
    """A run's encodings as a person tells them apart: its project's name (a project's quantize stage) and file."""
    stage = encodings_file.parent
    where = stage.parent.parent.name if stage.parent.name == "stages" else stage.name
    return f"{where}/{encodings_file.name}"
