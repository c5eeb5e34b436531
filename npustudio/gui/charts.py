"""Every chart of the window (`Chart`), and the live perplexity chart: the FP line and the quantized points per
eval window, drawn as they arrive."""

from __future__ import annotations

from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QAbstractScrollArea, QApplication, QLabel, QPushButton, QVBoxLayout, QWidget

pg.setConfigOptions(antialias=True, background="w", foreground="k")


class Chart(pg.PlotWidget):
    """A pyqtgraph plot that sits in a scrolling page: the wheel scrolls the page (pyqtgraph zoomed the chart
    under the pointer instead, so a page could not be scrolled past its charts); Ctrl+wheel zooms. Once the view
    is zoomed or panned by hand a "Reset view" button shows in its top right corner, in place of pyqtgraph's small
    "A" that showed only under the pointer; it fits the data again and goes away."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        plot = self.getPlotItem()
        plot.hideButtons()
        for side in ("left", "bottom"):  # no chart has units to prefix: a run number read "1" under "run (x0.001)"
            plot.getAxis(side).enableAutoSIPrefix(False)
        self.reset_view = QPushButton("Reset view", self)
        self.reset_view.setObjectName("reset_view")
        self.reset_view.setToolTip("Fit the chart to its data again. Ctrl+wheel zooms, dragging pans; the wheel "
                                   "alone scrolls the page.")
        self.reset_view.setCursor(Qt.CursorShape.ArrowCursor)
        self.reset_view.adjustSize()
        self.reset_view.hide()
        self.reset_view.clicked.connect(self.fit)
        plot.vb.sigRangeChangedManually.connect(self._changed_by_hand)
        plot.vb.sigResized.connect(self._place_reset)

    def fit(self) -> None:
        """Back to pyqtgraph's autorange on both axes: the whole data, as before any zoom or pan."""
        self.getPlotItem().enableAutoRange()
        self.reset_view.hide()

    def _changed_by_hand(self, *_: Any) -> None:
        self._place_reset()
        self.reset_view.show()

    def _place_reset(self, *_: Any) -> None:
        """In the plot area's top right corner: clear of the title and the axes."""
        vb = self.getPlotItem().vb
        corner = self.mapFromScene(vb.sceneBoundingRect().topRight())
        self.reset_view.move(corner.x() - self.reset_view.width() - 4, corner.y() + 4)

    def wheelEvent(self, ev: QWheelEvent) -> None:
        """Ctrl+wheel zooms; the plain wheel is handed to the scroll area the chart sits in (not left to Qt to pass
        up: it does so only for wheel events from the system, so handing it over behaves the same for all)."""
        if ev.modifiers() & Qt.KeyboardModifier.ControlModifier:
            super().wheelEvent(ev)
            return
        area = self._scroll_area()
        if area is None:
            ev.ignore()  # no page to scroll: the parents may use it
            return
        port = area.viewport()
        QApplication.sendEvent(port, QWheelEvent(port.mapFromGlobal(ev.globalPosition()), ev.globalPosition(),
                                                 ev.pixelDelta(), ev.angleDelta(), ev.buttons(), ev.modifiers(),
                                                 ev.phase(), ev.inverted(), ev.source()))
        ev.accept()

    def _scroll_area(self) -> QAbstractScrollArea | None:
        """The nearest scrolling parent: the page or dock the chart is in."""
        w = self.parentWidget()
        while w is not None and not isinstance(w, QAbstractScrollArea):
            w = w.parentWidget()
        return w


COLOURS = {"fp": "#1f77b4", "quant": "#d62728", "quant+seqmse": "#2ca02c", "adapted": "#ff7f0e"}


class PplChart(QWidget):
    """Feed it the stage's `ppl` partials; it keeps one series per label (fp, quant, quant+seqmse, adapted)."""

    def __init__(self) -> None:
        super().__init__()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.plot = Chart()
        self.plot.setLabel("bottom", "eval window")
        self.plot.setLabel("left", "perplexity")
        self.plot.showGrid(x=True, y=True, alpha=0.3)
        self.legend = self.plot.addLegend(offset=(10, 10))
        self.summary = QLabel("")
        lay.addWidget(self.plot, 1)
        lay.addWidget(self.summary)
        self.series: dict[str, dict[int, float]] = {}
        self.running: dict[str, float] = {}
        self.items: dict[str, Any] = {}
        self.redraws = 0

    def clear_results(self) -> None:
        for item in self.items.values():
            self.plot.removeItem(item)
            self.legend.removeItem(item)
        self.series.clear()
        self.running.clear()
        self.items.clear()
        self.summary.setText("")
        self.plot.fit()  # the next points' range, not a zoom on the last ones

    def add(self, data: dict[str, Any]) -> None:
        """One `ppl` partial: {"window": i, "fp_ppl": …, "quant_ppl": …, "fp_ppl_running": …}."""
        self.extend([data])

    def extend(self, points: list[dict[str, Any]]) -> None:
        """Several `ppl` partials (a finished stage's windows), drawn once: drawing after each of a record's 70
        windows took ~0.3 s of the GUI thread when a project was opened."""
        for data in points:
            w = int(data.get("window", 0))
            for key, v in data.items():
                if key.endswith("_ppl_running"):
                    self.running[key.removesuffix("_ppl_running")] = float(v)
                elif key.endswith("_ppl"):
                    self.series.setdefault(key.removesuffix("_ppl"), {})[w] = float(v)
        if points:
            self._draw()

    def _draw(self) -> None:
        for label, pts in self.series.items():
            xs = sorted(pts)
            ys = [pts[x] for x in xs]
            colour = COLOURS.get(label, "#555555")
            if label not in self.items:
                if label == "fp":
                    self.items[label] = self.plot.plot(xs, ys, pen=pg.mkPen(colour, width=2), name="FP")
                else:
                    self.items[label] = self.plot.plot(xs, ys, pen=None, symbol="o", symbolSize=9,
                                                       symbolBrush=colour, name=label)
            else:
                self.items[label].setData(xs, ys)
        last = max((max(p) for p in self.series.values() if p), default=0)
        step = max(1, -(-last // 8))  # whole eval windows only, at most ~8 labels
        self.plot.getAxis("bottom").setTickSpacing(major=step, minor=step)
        self.redraws += 1
        parts = [f"{k}: PPL {v:.3f}" for k, v in self.running.items()]
        fp = self.running.get("fp")
        for k, v in self.running.items():
            if k != "fp" and fp:
                parts.append(f"ratio {k}/fp ×{v / fp:.4f}")
        self.summary.setText("   ".join(parts))
