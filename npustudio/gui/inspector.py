"""The per-layer encodings inspector: a layers × roles heatmap, a sortable/filterable table of every tensor,
and the per-channel (or per-block) scales of the selected one. All numbers come from core.graph.encodings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QColor, QFontMetrics
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSplitter,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from ..core.graph.encodings import EncodingsTable, TensorRow

ROLES = ("embedding", "norm", "q", "k", "v", "o", "gate", "up", "down", "kv-cache", "activation", "lm_head")
COLUMNS = (("name", "Tensor"), ("layer", "Layer"), ("role", "Role"), ("kind", "Kind"), ("bitwidth", "Bits"),
           ("granularity", "Granularity"), ("channels", "Channels"), ("scale_min", "Scale min"),
           ("scale_max", "Scale max"), ("scale_spread", "Spread"), ("range_min", "Range min"),
           ("range_max", "Range max"), ("sqnr_db", "SQNR dB"), ("flags", "Flags"))
METRICS = {"sqnr": "weight SQNR, dB (lowest: most damage)", "weight_bits": "weight bits",
           "activation_bits": "activation bits", "spread": "scale spread (log10, max)",
           "range": "range width (log10, max)"}
_KIND = {"weight_bits": "param", "sqnr": "param", "activation_bits": "activation"}  # rows a metric reads
FLAGGED = QColor("#f8d7da")
Index = QModelIndex | QPersistentModelIndex


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
        known = [r for r in self.rows if getattr(r, key) is not None]  # rows without a value last, either way
        known.sort(key=value, reverse=order == Qt.SortOrder.DescendingOrder)
        self.rows[:] = known + [r for r in self.rows if getattr(r, key) is None]
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
        if role == Qt.ItemDataRole.ToolTipRole and r.flags:
            return "\n".join(r.flags)
        return None


class TensorFilter(QSortFilterProxyModel):
    """Text (in the name), role and flagged-only filters; sorting by the raw values."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.role, self.flagged_only = "", "", False

    def sort(self, column: int, order: Qt.SortOrder = Qt.SortOrder.AscendingOrder) -> None:
        if self.sourceModel() is not None:  # a header clicked before any encodings are loaded
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

    def filterAcceptsRow(self, source_row: int, source_parent: Index) -> bool:
        r: TensorRow = self.sourceModel().rows[source_row]
        return ((not self.text or self.text in r.name.lower()) and (not self.role or r.role == self.role)
                and (not self.flagged_only or bool(r.flags)))


def heat(table: EncodingsTable, metric: str) -> tuple[np.ndarray, list[int], list[str]]:
    """(roles × layers) values of `metric` over the roles the layers have, NaN where a layer lacks one."""
    def shown(r: TensorRow) -> bool:  # rows the metric reads: a role without any stays off the grid
        if r.layer is None or _KIND.get(metric, r.kind) != r.kind:
            return False
        return metric != "sqnr" or (r.sqnr_db is not None and math.isfinite(r.sqnr_db))

    layers = sorted({r.layer for r in table.rows if r.layer is not None})
    roles = [x for x in ROLES if any(r.role == x and shown(r) for r in table.rows)]
    grid = np.full((len(roles), len(layers)), np.nan)
    col = {layer: i for i, layer in enumerate(layers)}
    worst = min if metric == "sqnr" else max  # a cell shows its most damaged tensor
    for r in table.rows:
        if r.role not in roles or not shown(r):
            continue
        v = {"weight_bits": float(r.bitwidth), "activation_bits": float(r.bitwidth), "sqnr": r.sqnr_db or 0.0,
             "spread": math.log10(max(r.scale_spread, 1.0)),
             "range": math.log10(max(r.range_max - r.range_min, 1e-12))}[metric]
        i, j = roles.index(r.role), col[r.layer]
        grid[i, j] = v if np.isnan(grid[i, j]) else worst(grid[i, j], v)
    return grid, layers, roles


class Inspector(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.table_: EncodingsTable | None = None
        lay = QVBoxLayout(self)
        bar = QHBoxLayout()
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
        self.title = QLabel("No encodings loaded.")
        for w in (QLabel("Colour:"), self.colour_by, self.search, self.role, self.flagged):
            bar.addWidget(w)
        lay.addWidget(self.title)
        lay.addLayout(bar)
        split = QSplitter(Qt.Orientation.Vertical)
        self.heatmap = pg.PlotWidget()
        self.heatmap.setLabel("bottom", "layer")
        self.image = pg.ImageItem()
        self.heatmap.addItem(self.image)
        self.heatmap.invertY(True)
        # room for the longest role name: pyqtgraph drops a label that overflows the axis (only 6 of 10 showed)
        self.heatmap.getAxis("left").setWidth(QFontMetrics(self.font()).horizontalAdvance("activation") + 16)
        self.colorbar: Any = None
        self.heat_grid, self.heat_roles = np.zeros((0, 0)), list[str]()
        split.addWidget(self.heatmap)
        self.view = QTableView()
        self.view.setSortingEnabled(True)
        self.view.setSelectionBehavior(QTableView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QTableView.SelectionMode.SingleSelection)
        self.view.verticalHeader().setDefaultSectionSize(20)
        self.view.horizontalHeader().setResizeContentsPrecision(60)  # column widths from the first rows only
        self.proxy = TensorFilter()
        self.view.setModel(self.proxy)
        split.addWidget(self.view)
        self.detail = pg.PlotWidget()
        self.detail.setLabel("left", "scale")
        self.detail_label = QLabel("Select a tensor to see its scales per channel or block.")
        det = QWidget()
        dl = QVBoxLayout(det)
        dl.setContentsMargins(0, 0, 0, 0)
        dl.addWidget(self.detail_label)
        dl.addWidget(self.detail, 1)
        split.addWidget(det)
        split.setSizes([300, 280, 170])
        lay.addWidget(split, 1)
        self.colour_by.currentIndexChanged.connect(self._draw_heat)
        self.search.textChanged.connect(lambda t: self.proxy.set(text=t))
        self.role.currentIndexChanged.connect(lambda _i: self.proxy.set(role=self.role.currentData()))
        self.flagged.toggled.connect(lambda on: self.proxy.set(flagged_only=on))

    def clear(self) -> None:
        """No encodings: another project is open, or this one has none yet."""
        self.table_ = None
        self.proxy.setSourceModel(TensorModel([]))
        self.image.clear()
        self.heat_grid, self.heat_roles = np.zeros((0, 0)), []
        self.detail.clear()
        self.title.setText("No encodings loaded.")

    def load(self, table: EncodingsTable) -> None:
        self.table_ = table
        self.proxy.setSourceModel(TensorModel(table.rows))
        self.view.selectionModel().currentRowChanged.connect(self._select)
        self.view.resizeColumnsToContents()
        flagged = sum(bool(r.flags) for r in table.rows)
        self.title.setText(f"{table.path.rsplit('/', 1)[-1]} (schema {table.version}): {len(table.rows)} tensors, "
                           f"{len(table.layers)} layer groups, {flagged} flagged")
        self._draw_heat()

    def visible_rows(self) -> list[TensorRow]:
        """The rows in the table's current order and filter (what a person sees)."""
        src = self.proxy.sourceModel()
        return [src.rows[self.proxy.mapToSource(self.proxy.index(i, 0)).row()] for i in range(self.proxy.rowCount())]

    def sort_by(self, column: str, descending: bool = True) -> None:
        col = [k for k, _ in COLUMNS].index(column)
        self.view.sortByColumn(col, Qt.SortOrder.DescendingOrder if descending else Qt.SortOrder.AscendingOrder)

    def _draw_heat(self) -> None:
        if self.table_ is None:
            return
        metric = self.colour_by.currentData()
        grid, layers, roles = heat(self.table_, metric)
        self.heatmap.getAxis("left").setTicks([[(i + 0.5, r) for i, r in enumerate(roles)]])
        self.heat_grid, self.heat_roles = grid, roles
        if not np.isfinite(grid).any():  # nothing to colour (no SQNR figures in this table)
            self.image.clear()
            return
        # a layer without a role's tensor is painted as the harmless end of the scale, never as damage
        empty = np.nanmax(grid) if metric == "sqnr" else np.nanmin(grid)
        img = np.nan_to_num(grid.T, nan=empty)
        self.image.setImage(img, autoLevels=True)
        self.image.setColorMap(pg.colormap.get("viridis"))
        if self.colorbar is None:
            self.colorbar = pg.ColorBarItem(colorMap=pg.colormap.get("viridis"), interactive=False)
            self.colorbar.setImageItem(self.image, insert_in=self.heatmap.getPlotItem())
        lo, hi = float(np.nanmin(grid)), float(np.nanmax(grid))
        self.colorbar.setLevels((lo, hi if hi > lo else lo + 1))
        step = max(1, len(layers) // 15)
        self.heatmap.getAxis("bottom").setTicks([[(j + 0.5, str(layer)) for j, layer in enumerate(layers)][::step]])

    def _select(self, current: QModelIndex, _prev: QModelIndex) -> None:
        if not current.isValid():
            return
        r: TensorRow = self.proxy.sourceModel().rows[self.proxy.mapToSource(current).row()]
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
