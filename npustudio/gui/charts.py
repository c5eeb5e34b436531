"""The live perplexity chart: the FP line and the quantized points per eval window, drawn as they arrive."""

from __future__ import annotations

from typing import Any

import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

pg.setConfigOptions(antialias=True, background="w", foreground="k")


COLOURS = {"fp": "#1f77b4", "quant": "#d62728", "quant+seqmse": "#2ca02c", "adapted": "#ff7f0e"}


class PplChart(QWidget):
    """Feed it the stage's `ppl` partials; it keeps one series per label (fp, quant, quant+seqmse, adapted)."""

    def __init__(self) -> None:
        super().__init__()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.plot = pg.PlotWidget()
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

    def clear(self) -> None:
        for item in self.items.values():
            self.plot.removeItem(item)
            self.legend.removeItem(item)
        self.series.clear()
        self.running.clear()
        self.items.clear()
        self.summary.setText("")

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
