"""Quantize: AIMET calibration with the live perplexity chart, then the encodings inspector on the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from ...core import host_cost, isolated, pipeline, stages
from ...core.errors import UserError
from ...core.graph import encodings as enc
from ...core.graph import sqnr
from ...core.progress import about_duration
from ...core.quantize.presets import int8_budget_of, load_overrides, takes_4bit_head, takes_int8_budget
from ...core.results import QuantizeResult, RecipeCost
from ...core.stage_options import PRECISION_NOTES, RECIPE_NOTES, QuantizeOptions, bounds, choices, help_of
from ...display import adapter_kept, human_bytes, kept_int8
from .. import worker
from ..charts import PplChart
from ..fields import Form, default
from ..inspector import Inspector
from ..settings_dialog import device_choice
from ..widgets import Page, TabsSizedToShown, fill, table
from ..window import StudioWindow


def _file_row(edit: QLineEdit, title: str, filt: str, parent: QWidget) -> QWidget:
    w = QWidget()
    lay = QHBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 0)
    b = QPushButton("Browse…")
    lay.addWidget(edit, 1)
    lay.addWidget(b)

    def browse() -> None:
        path, _ = QFileDialog.getOpenFileName(parent, title, filter=filt,
                                              options=QFileDialog.Option.DontUseNativeDialog)
        if path:
            edit.setText(path)

    b.clicked.connect(browse)
    return w


NO_OVERRIDES = "optional: per-module bitwidth overrides (JSON)"


def _recipe_label(name: str, cost: RecipeCost | None = None) -> str:
    """A recipe as the choice shows it: what it does and, for a chosen model, what it adds here."""
    extra = ""
    if cost and cost.refused:
        return f"{name} — not for this model: {cost.refused}"
    if cost and cost.seconds:
        mem = f", +{human_bytes(cost.ram_bytes)} memory" if cost.ram_bytes else ""
        extra = f" (+{about_duration(cost.seconds)}{mem} here, estimated)"
    return f"{name} — {RECIPE_NOTES[name]}{extra}"


class QuantizePage(Page):
    title = "Quantize"
    why = ("AIMET simulates the NPU's integer arithmetic and calibrates the encodings on sample text; the chart "
           "shows the quantized perplexity per eval window beside the FP line as calibration runs.")

    def __init__(self, window: StudioWindow) -> None:
        super().__init__(window)
        self.fields = Form(QuantizeOptions)  # the precision first: showing it resets the LM head's width
        self.precision = self.fields.combo("precision", {p: f"{p} — {n}" for p, n in PRECISION_NOTES.items()})
        self.recipe = self.fields.combo("recipe", {r: _recipe_label(r) for r in RECIPE_NOTES})
        self.recipe.setToolTip("How the weight encodings are found: Qualcomm's algorithms from aimet-torch, "
                               "slower and better at w4a16")
        # its long labels (and the estimates added to them) must not widen the page: the popup shows them whole
        self.recipe.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.recipe.setMinimumContentsLength(16)
        self.calib_samples = self.fields.spin("calib_samples")
        self.calib_len = self.fields.spin("calib_len", step=64)
        self.calib = QLineEdit(default(QuantizeOptions, "calib_corpus"))
        self.calib.setToolTip("default (offline text), a UTF-8 text file, or datasets:ID")
        self.overrides = QLineEdit()
        self.overrides.setPlaceholderText(NO_OVERRIDES)
        self.int8_budget = QSpinBox()  # a share, shown in percent
        self.int8_budget.setRange(0, round(100 * (bounds(QuantizeOptions, "int8_budget").hi or 0)))
        self.int8_budget.setPrefix("int8 budget ")
        self.int8_budget.setSuffix(" %")
        self.int8_budget.setToolTip(help_of(QuantizeOptions, "int8_budget") or "")
        heads = choices(QuantizeOptions, "lm_head_bits") or ()
        self.lm_head_bits = self.fields.combo("lm_head_bits", {b: "4-bit blocks, as the layers" if b == 4
                                                               else f"{b}-bit per channel" for b in heads})
        self.lm_head_bits.setToolTip(help_of(QuantizeOptions, "lm_head_bits") or "")
        self._budgets: dict[str, int] = {}  # the budget last shown per precision, kept while another is chosen
        self._budget_of: str | None = None
        self.precision.currentIndexChanged.connect(self._budget_applies)
        self._budget_applies()
        self.device = self.fields.bind("device", device_choice(window.settings.device))
        weights = QWidget()  # the head's width beside the precision: one row, so the charts stay in view
        wl = QHBoxLayout(weights)
        wl.setContentsMargins(0, 0, 0, 0)
        wl.addWidget(self.precision, 1)
        wl.addWidget(QLabel("LM head:"))
        wl.addWidget(self.lm_head_bits)
        self.precision.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.precision.setMinimumContentsLength(16)
        self.form.addRow("Precision:", weights)
        self.form.addRow("Recipe:", self.recipe)
        self.form.addRow("Calibration sequences:", self.calib_samples)
        self.form.addRow("Tokens per sequence:", self.calib_len)
        self.form.addRow("Calibration text:", _file_row(self.calib, "Calibration text", "Text (*.txt)", self))
        mixed = _file_row(self.overrides, "Overrides", "JSON (*.json)", self)
        mixed.layout().addWidget(self.int8_budget)  # type: ignore[union-attr]
        self.form.addRow("Mixed precision:", mixed)
        self.form.addRow("Compute on:", self.device)
        self.add_strip("Quantize", redo=True)
        self.tabs = TabsSizedToShown()
        live = QWidget()
        ll = QHBoxLayout(live)
        self.chart = PplChart()
        self.results = table(["Result", "Value"])
        self.results.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        ll.addWidget(self.chart, 3)
        ll.addWidget(self.results, 2)
        self.inspector = Inspector()
        self.inspector.graph_chosen.connect(self.load_encodings)
        self.tabs.addTab(live, "Live perplexity")
        self.tabs.addTab(self.inspector, "Encodings inspector")
        self.lay.addWidget(self.tabs, 1)
        self.strip.run.clicked.connect(lambda: self.start())
        self._loaded: tuple[str, int] | None = None
        self._reads = 0  # encodings reads started: a result is shown only if no later read started
        self._read_job: worker.Job | None = None

    def options(self) -> QuantizeOptions:
        target = self.project.choices().target_soc
        shown = dict(self.fields.values(), target=target,
                     calib_corpus=self.calib.text().strip() or default(QuantizeOptions, "calib_corpus"),
                     int8_budget=self.int8_budget.value() / 100 if self.int8_budget.isEnabled() else 0.0)
        if path := self.overrides.text().strip():  # else the last run's overrides (its file may be anywhere)
            shown["overrides"] = load_overrides(path)
        return self.project.rerun_options(stages.QUANTIZE, **shown)

    def start(self, force: bool = False) -> None:
        opts = self.unless_refused(self.options)
        if opts is None:
            return
        self.chart.clear_results()
        self.tabs.setCurrentIndex(0)
        self.run(stages.QUANTIZE, opts, "Quantizing", force=force)

    def refresh(self) -> None:
        self.show_recipe_costs()
        self._budgets.clear()  # a budget typed for another project's run is not this one's
        rec = self.project.record(stages.QUANTIZE)
        if rec:
            o = rec.options
            self.fields.show(o)
            self.int8_budget.setValue(round(100 * int8_budget_of(o.precision, o.int8_budget)))
            self.calib.setText(o.calib_corpus)
            n = len(o.overrides.weights) + len(o.overrides.activations)
            self.overrides.setPlaceholderText(f"the last run's {n} override pattern{'s' * (n != 1)}, kept unless a "
                                              "file is chosen" if n else NO_OVERRIDES)
            self.show_result(rec.result)
        else:
            self.precision.setCurrentIndex(max(0, self.precision.findData(self.window_.settings.default_precision)))
            self.overrides.setPlaceholderText(NO_OVERRIDES)

    def _budget_applies(self) -> None:
        """The int8 budget widens 4-bit weights: at a precision without them there is nothing to widen. A precision
        chosen shows the budget it had when it was left, else its own default."""
        precision = self.precision.currentData()
        if self._budget_of is not None:
            self._budgets[self._budget_of] = self.int8_budget.value()
        self._budget_of = precision
        self.int8_budget.setEnabled(takes_int8_budget(precision))
        self.lm_head_bits.setEnabled(takes_4bit_head(precision))
        if not self.lm_head_bits.isEnabled():  # without LPBQ blocks the head stays at its default width
            self.lm_head_bits.setCurrentIndex(self.lm_head_bits.findData(default(QuantizeOptions, "lm_head_bits")))
        self.int8_budget.setValue(self._budgets.get(precision, round(100 * int8_budget_of(precision, None))))

    def show_recipe_costs(self) -> None:
        """Each recipe's estimated extra time and memory for the chosen model on this computer, beside its name."""
        rec = self.project.record(stages.MODEL)
        costs = {c.recipe: c for c in host_cost.recipe_costs(rec.result.card)} if rec else {}
        items = self.recipe.model()
        for i in range(self.recipe.count()):
            name = self.recipe.itemData(i)
            text = _recipe_label(name, costs.get(name))
            if self.recipe.itemText(i) != text:  # a new text lays the page out again
                self.recipe.setItemText(i, text)
            refused = bool(name in costs and costs[name].refused)
            items.item(i).setEnabled(not refused)  # type: ignore[attr-defined]
            if refused and self.recipe.currentIndex() == i:
                self.recipe.setCurrentIndex(self.recipe.findData("plain"))

    def show_result(self, r: QuantizeResult) -> None:
        folder = self.project.stage_dir(stages.QUANTIZE.name)
        s = pipeline.quantize_summary(r, folder)
        if not self.chart.series:
            self.chart.extend(list(r.per_window))
        rows = [("Precision / target", f"{s.precision} / {s.target}{'' if s.recipe == 'plain' else ' + ' + s.recipe}"
                                      f"{' + rotation' if s.rotated else ''}{', ' + s.lm_head if s.lm_head else ''}"),
                ("Perplexity FP", f"{s.ppl_fp:.3f}"), ("Perplexity quantized", f"{s.ppl_quant:.3f}"),
                ("Ratio", f"×{s.ratio:.4f}"), ("Top-1 agreement", f"{s.top1_agreement:.3f}")]
        if s.int8_share is not None:
            rows.append(("Kept int8 (budget)", kept_int8(s.kept_int8, s.int8_share)))
        rows += [(f"LoRA adapter {k.adapter}", adapter_kept(k)) for k in s.lora_kept]
        rows += [(f["file"], human_bytes(f["bytes"])) for f in s.files]
        fill(self.results, rows)
        head = self.results.horizontalHeader()  # the values whole; long file names shortened in the middle
        head.setStretchLastSection(False)
        head.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        head.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        self.strip.status.setText(f"{s.precision}: PPL {s.ppl_quant:.3f} vs FP {s.ppl_fp:.3f} "
                                  f"(×{s.ratio:.4f}).")
        graphs = r.graphs
        if graphs:
            self.inspector.set_graphs([folder / f"{g}.encodings" for g in graphs])
            self.load_encodings(self.inspector.graph.currentData())

    def clear_results(self) -> None:
        super().clear_results()
        self._loaded = None
        self._reads += 1  # a read still running for the previous project is not shown
        self._cancel_read()

    def _cancel_read(self) -> None:
        """End the encodings read in flight (its child process is killed): its result would not be shown."""
        if self._read_job is not None:
            self._read_job.cancel()
            self._read_job = None

    def load_encodings(self, path: Path) -> None:
        """Read the table in a child process (parsing 10 MB of JSON holds the GIL ~0.1 s), then show it; once per
        file."""
        key = (str(path), path.stat().st_mtime_ns if path.is_file() else 0)
        if key == self._loaded:
            return
        self._loaded = key
        self._cancel_read()  # another graph picked: the previous graph's read is not shown
        self._reads += 1
        read = self._reads
        self.inspector.title.setText(f"Reading {path.name}…")

        # only the latest read is shown: a read started before a switch to another project and back has the same
        # key as the one started on coming back, and drawing both put the table on the GUI thread twice
        def show(table: Any) -> None:  # unless another project (or export) was opened meanwhile
            if self._reads == read:
                self.inspector.load(table)

        def failed(problem: str, fix: str) -> None:
            if self._reads == read:
                self.inspector.title.setText(f"{problem} {fix}")

        self._read_job = worker.start(lambda s: isolated.run(read_with_sqnr, path, state=s, pass_state=False),
                                      "Reading encodings", read=True, done=show, failed=failed)


def read_with_sqnr(path: Path) -> enc.EncodingsTable:
    """The table with each weight's SQNR; without it where the float weights cannot serve (rotated weights)."""
    try:
        return sqnr.annotated(path)
    except UserError:
        return enc.read(path)
