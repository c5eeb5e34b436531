"""Genie profiles as charts: a timeline per run (dialog create, then each query split into prompt processing
and generation), bars for TTFT and the two rates with several runs side by side, and the decode roofline.

Readable on a 1366x768 screen: runs are numbered on the charts (the table names them: long names overlapped
under the bars and were cut beside the timeline), one colour key above the charts instead of a legend over the
bars and a title cut short, and the rates on a log axis so a phone's 5 tok/s shows beside a 400 tok/s roofline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyqtgraph as pg
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from ..core import layout
from ..core.errors import UserError
from ..core.genie import profile
from ..display import human_number
from .charts import Chart
from .widgets import StatusLine, fill, show_error, table

CREATE, PROMPT, GENERATE, ROOF = "#8c8c8c", "#1f77b4", "#2ca02c", "#d62728"


def key(colour: str, name: str) -> str:
    return f'<span style="color:{colour}">■</span> {name}'


def spans(p: profile.Profile) -> list[tuple[str, float, float]]:
    """(phase, start s, end s) relative to the run's first event: create, prompt processing, generation."""
    t0 = min((e.start_us for e in p.events if e.start_us is not None), default=0)
    out = []
    for e in p.events:
        if e.start_us is None or e.stop_us is None:
            continue
        a, b = (e.start_us - t0) / 1e6, (e.stop_us - t0) / 1e6
        if e.type == "GenieDialog_create":
            out.append(("create", a, b))
        elif e.type == "GenieDialog_query":
            mid = min(b, a + e.ttft_us / 1e6) if e.ttft_us is not None else b
            out.append(("prompt", a, mid))
            if mid < b:
                out.append(("generate", mid, b))
    return out


class ProfileView(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.runs: list[tuple[str, profile.Profile, profile.Summary]] = []
        self.roof: dict[str, float] | None = None
        lay = QVBoxLayout(self)
        top = QHBoxLayout()
        self.open_btn = QPushButton("Open profile…")
        self.clear_btn = QPushButton("Clear")
        self.note = StatusLine("Profiles of chat turns and deploy runs appear here; open Genie --profile files too.")
        top.addWidget(self.open_btn)
        top.addWidget(self.clear_btn)
        top.addWidget(self.note, 1)
        lay.addLayout(top)
        self.key = QLabel("   ".join([key(CREATE, "dialog create"), key(PROMPT, "prompt processing"),
                                        key(GENERATE, "generation"),
                                        f'<span style="color:{ROOF}">- - -</span> decode roofline'])
                          + "   · runs by number, named in the table below")
        self.key.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)  # one line, never widening
        lay.addWidget(self.key)
        charts = QHBoxLayout()
        self.timeline = Chart(title="Timeline per run")
        self.timeline.setLabel("bottom", "seconds from the run's first event")
        self.timeline.setLabel("left", "run")
        self.ttft = Chart(title="Time to first token (s)")
        self.ttft.setLabel("bottom", "run")
        self.rates = Chart(title="Tokens per second")
        self.rates.setLabel("bottom", "run")
        self.rates.getAxis("left").setLogMode(False, True)  # bars drawn in log10: the axis labels 1, 10, 100…
        for chart in (self.timeline, self.ttft, self.rates):
            chart.setMinimumHeight(170)  # readable axes and labels; the dock scrolls when it is lower
        charts.addWidget(self.timeline, 2)
        charts.addWidget(self.ttft, 1)
        charts.addWidget(self.rates, 1)
        lay.addLayout(charts, 1)
        self.table = table(["Run", "Runner", "Init s", "TTFT s", "Prompt tok", "Prompt tok/s", "Gen tok",
                            "Gen tok/s", "Decode bound tok/s"])
        self.table.setMaximumHeight(110)  # a header and four runs: the charts keep the height
        lay.addWidget(self.table)
        self.open_btn.clicked.connect(self._open)
        self.clear_btn.clicked.connect(self.clear)

    def set_roofline(self, bundle: Path | None) -> None:
        try:
            self.roof = profile.bundle_roofline(bundle) if bundle and bundle.is_dir() else None
        except (UserError, ValueError, KeyError):
            self.roof = None
        self._draw()

    def add(self, label: str, p: profile.Profile) -> None:
        self.runs.append((label, p, profile.summarize(p)))
        self._draw()

    def add_json(self, label: str, text: str) -> None:
        self.add(label, profile.parse(text, label))

    def add_file(self, path: Path) -> None:
        self.add(Path(path).name, profile.read(Path(path)))

    def clear(self) -> None:
        self.runs.clear()
        self._draw()

    def forget_runs(self) -> None:
        """Another project is opened: no runs, and no drawing until its roofline is set (`clear` drew, then
        `set_roofline` drew again); the charts' zoom goes with them."""
        self.runs.clear()
        for chart in (self.timeline, self.ttft, self.rates):
            chart.fit()

    def keep_project_sample(self, project_root: Path) -> str | None:
        """The project's own profile of its sample answer (`npustudio run` writes it) kept as its first run, drawn
        with the roofline; a file that cannot be read is left out and its problem returned for the status line."""
        path = Path(project_root) / layout.RUNS_DIR / layout.SAMPLE_PROFILE
        if not path.is_file():
            return None
        try:
            p = profile.read(path)
        except UserError as e:
            return f"{path} was not shown in Profiles: {e.problem}"
        self.runs.append(("sample answer (npustudio run)", p, profile.summarize(p)))
        return None

    def _open(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Genie profile", filter="JSON (*.json)",
                                              options=QFileDialog.Option.DontUseNativeDialog)
        if path:
            try:
                self.add_file(Path(path))
            except UserError as e:
                show_error(self, e.problem, e.fix)

    def _draw(self) -> None:
        for w in (self.timeline, self.ttft, self.rates):
            w.clear()
        step = max(1, math.ceil(len(self.runs) / 12))  # at most ~12 numbers under a chart
        labels = [(i, str(i + 1)) for i in range(len(self.runs))][::step]
        colours = {"create": CREATE, "prompt": PROMPT, "generate": GENERATE}
        for i, (_label, p, _s) in enumerate(self.runs):
            for phase, a, b in spans(p):  # create on the upper lane, queries on the lower one
                y = i + 0.18 if phase == "create" else i - 0.18
                bar = pg.BarGraphItem(x0=[a], width=[max(b - a, 1e-3)], y=[y], height=0.32, brush=colours[phase])
                self.timeline.addItem(bar)
        self.timeline.getAxis("left").setTicks([labels])
        xs = list(range(len(self.runs)))
        ttft = [s.ttft_s or 0.0 for _l, _p, s in self.runs]
        self.ttft.addItem(pg.BarGraphItem(x=xs, height=ttft, width=0.6, brush=PROMPT))
        self.ttft.getAxis("bottom").setTicks([labels])
        prompt = [s.prompt_tok_s for _l, _p, s in self.runs]
        gen = [s.generation_tok_s for _l, _p, s in self.runs]
        roof = self.roof
        bound = roof["decode_tok_s_bound"] if roof else None
        known = [v for v in (*prompt, *gen, bound) if v]
        base = math.floor(math.log10(min(known))) if known else 0  # bars rise from the decade below the lowest
        for shift, values, colour in ((-0.18, prompt, PROMPT), (0.18, gen, GENERATE)):
            shown = [(x + shift, math.log10(v)) for x, v in zip(xs, values, strict=True) if v]
            if shown:
                self.rates.addItem(pg.BarGraphItem(x=[x for x, _v in shown], y0=base, y1=[v for _x, v in shown],
                                                   width=0.35, brush=colour))
        if roof and bound:
            self.rates.addItem(pg.InfiniteLine(pos=math.log10(bound), angle=0,
                                               pen=pg.mkPen(ROOF, style=pg.QtCore.Qt.PenStyle.DashLine),
                                               label=f"{bound} tok/s (phone, {roof['memory_gb_s']} GB/s)",
                                               labelOpts={"position": 0.02, "anchors": [(0, 0), (0, 0)],
                                                          "color": ROOF}))  # below the line: never cut at the top
        self.rates.getAxis("bottom").setTicks([labels])
        fill(self.table, [(f"{i + 1}: {lbl}", s.runner, _r(s.init_s), _r(s.ttft_s), s.prompt_tokens,
                           _r(s.prompt_tok_s), s.generated_tokens, _r(s.generation_tok_s), _r(bound))
                          for i, (lbl, _p, s) in enumerate(self.runs)])


def _r(v: Any) -> Any:
    """A figure to the digits that matter (157.0962 → 157, 0.81134 → 0.811)."""
    return None if v is None else human_number(v)
