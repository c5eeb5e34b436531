"""Model: the embedded default, a local folder, a GGUF file or a hub id; its card and whether it fits a phone."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSignalBlocker
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QTableWidgetItem,
    QWidget,
)

from ... import display
from ...core import lora, model_fit, model_source, pipeline, stages
from ...core.errors import UserError
from ...core.progress import about_duration
from ...core.project import Done
from ...core.results import HostEstimate, IntakeResult
from ...core.stage_options import AdaptOptions, LoraAdapter
from ...core.targets import DEFAULT_SOC, find_soc, fits_phone_ram
from ..fields import limit_context, spin
from ..widgets import BAD, GOOD, WARN, Page, fill, show_error, status_label, table
from ..window import StudioWindow

NO_ADAPTER = "none: the model as it is"
KINDS = (("default", "Embedded default"), ("hf_dir", "Local folder"), ("gguf", "GGUF file"),
         ("hub", "Hugging Face hub id"))



DECODE = "Decode bound"
DECODE_MEANS = ("Upper bound on the phone's decode speed: the bytes one generated token reads (the weights on the HTP "
                "and the KV cache over the whole context) over the target SoC's memory bandwidth. Measured from the "
                "bundle for the precision it is built at, estimated for the others; the Target page shows the same.")
# the answer first (does it fit, and in how much RAM): at 1024x700 the last columns are behind the table's scroll
FIT_COLUMNS = ("Precision", "Fits", "Phone RAM needed", DECODE, "PPL cost (default model)", "Weights", "KV cache",
               "Parts", "Bundle (phone)", "MNN model (CPU/GPU)")


class ModelPage(Page):
    title = "Model"
    why = ("Pick the causal LLM to put on the phone. Its architecture card and a memory estimate per precision "
           "tell at a glance whether it fits.")

    def __init__(self, window: StudioWindow) -> None:
        super().__init__(window)
        self.kind = QButtonGroup(self)
        kinds = QWidget()
        kl = QGridLayout(kinds)  # two by two: in one row they widened the page past a 1024x700 window
        kl.setContentsMargins(0, 0, 0, 0)
        for i, (_k, label) in enumerate(KINDS):
            b = QRadioButton(label)
            b.setToolTip("SmolLM2-135M-Instruct, shipped with NPU Studio" if _k == "default" else "")
            self.kind.addButton(b, i)
            kl.addWidget(b, i // 2, i % 2)
        self.kind.button(0).setChecked(True)
        self.source = QLineEdit()
        self.source.setPlaceholderText("a model folder, a .gguf file, or org/name")
        self.browse = QPushButton("Browse…")
        row = QWidget()
        rl = QHBoxLayout(row)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.source, 1)
        rl.addWidget(self.browse)
        self.cl = spin(AdaptOptions, "cl", step=128)  # the context the adapt stage builds: its field's range
        self.form.addRow("Source:", kinds)
        self.form.addRow("", row)
        self.adapters = QLabel(NO_ADAPTER)
        self.adapters.setWordWrap(True)
        self.add_adapter = QPushButton("Add LoRA adapter…")
        self.add_adapter.setToolTip("A folder PEFT saved (adapter_config.json, adapter_model.safetensors): merged "
                                    "into the model's weights before adaptation, or kept switchable")
        self.clear_adapters = QPushButton("Remove adapters")
        self.switchable = QCheckBox("Switchable")
        self.switchable.setToolTip("Keep the adapters apart from the model: one bundle answers as the base model or "
                                   "with any of them, picked in the chat, instead of merged into the weights")
        lora_row = QWidget()
        ll = QHBoxLayout(lora_row)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(self.adapters, 1)
        ll.addWidget(self.switchable)
        ll.addWidget(self.add_adapter)
        ll.addWidget(self.clear_adapters)
        self.form.addRow("Fine-tune:", lora_row)
        self.form.addRow("Context length (for the estimate):", self.cl)
        self.add_strip("Read model", redo=True)
        self.card = table(["Property", "Value"])
        self.fit = table(list(FIT_COLUMNS))
        self._decode_header().setToolTip(DECODE_MEANS)
        self.lay.addWidget(self.card, 3)
        self.lay.addWidget(self.fit, 1)
        self.advice = status_label()  # the precision the main job would choose, and why
        self.advice.setWordWrap(True)
        self.lay.addWidget(self.advice)
        self.host = status_label()
        self.host.setWordWrap(True)
        self.lay.addWidget(self.host)
        self.kind.idToggled.connect(self._kind_changed)
        self.browse.clicked.connect(self._browse)
        self.add_adapter.clicked.connect(self._pick_adapter)
        self.clear_adapters.clicked.connect(lambda: self.set_adapters(()))
        self.switchable.toggled.connect(self._switchable_changed)
        self.strip.run.clicked.connect(lambda: self.start())
        self._kind_changed(0, True)
        self.fits: list[model_fit.FitEstimate] = []

    def spec(self) -> str:
        k = KINDS[self.kind.checkedId()][0]
        return "default" if k == "default" else self.source.text().strip()

    def set_spec(self, spec: str) -> None:
        if spec == "default":
            self.kind.button(0).setChecked(True)
            return
        self.kind.button([k for k, _label in KINDS].index(model_source.source_kind(spec))).setChecked(True)
        self.source.setText(spec)

    def _kind_changed(self, i: int, on: bool) -> None:
        if on:
            k = KINDS[i][0]
            self.source.setEnabled(k != "default")
            self.browse.setEnabled(k in ("hf_dir", "gguf"))

    def _browse(self) -> None:
        k = KINDS[self.kind.checkedId()][0]
        opts = QFileDialog.Option.DontUseNativeDialog
        if k == "hf_dir":
            path = QFileDialog.getExistingDirectory(self, "Model folder", options=opts)
        else:
            path, _ = QFileDialog.getOpenFileName(self, "GGUF file", filter="GGUF (*.gguf)", options=opts)
        if path:
            self.source.setText(path)

    def _pick_adapter(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "LoRA adapter folder",
                                                options=QFileDialog.Option.DontUseNativeDialog)
        if path:
            self.add(path)

    def add(self, folder: str) -> None:
        """One more adapter, checked now (a pickle, NaN weights, another base's are refused here, not at adapt)."""
        have = self.project.choices().lora
        try:
            added = pipeline.check_lora(self.spec() or "default", folder)
        except UserError as e:
            show_error(self, e.problem, e.fix)
            return
        self.set_adapters((*have, added))

    def set_adapters(self, adapters: tuple[LoraAdapter, ...]) -> None:
        """The project's adapters (the adapt stage redoes itself when they change)."""
        self.project.choose(lora=adapters)
        self._show_adapters(adapters)
        self.changed.emit()

    def _switchable_changed(self, on: bool) -> None:
        if on != self.project.choices().lora_switchable:
            self.project.choose(lora_switchable=on)
            self.changed.emit()

    def _show_adapters(self, adapters: tuple[LoraAdapter, ...]) -> None:
        self.adapters.setText(", ".join(lora.label(a) for a in adapters) or NO_ADAPTER)
        self.adapters.setToolTip("\n".join(a.path for a in adapters))
        self.clear_adapters.setEnabled(bool(adapters))
        self.switchable.setEnabled(bool(adapters))
        with QSignalBlocker(self.switchable):
            self.switchable.setChecked(self.project.choices().lora_switchable)

    def start(self, force: bool = False) -> None:
        spec, cl, project = self.spec(), self.cl.value(), self.project
        if not spec:
            self.strip.status.setText("Type a model folder, a .gguf file or a hub id first.")
            return

        def work(state: Any) -> IntakeResult:
            _src, rec = pipeline.intake(project, spec, cl, state, force=force)
            return Done.of(stages.MODEL, rec).result

        self.strip.start(work, self.finish, f"Reading {spec}")

    def refresh(self) -> None:
        ch = self.project.choices()
        self.set_spec(ch.model)
        self._show_adapters(ch.lora)
        limit_context(self.cl, self.project)
        self.cl.setValue(ch.cl)
        rec = self.project.record(stages.MODEL)
        if rec:
            self.show_result(rec.result)

    def show_result(self, result: IntakeResult) -> None:
        card = result.card
        self.fits = result.fit
        rows = [(k, display.format_value(v)) for k, v in card.model_dump().items() if k != "chat_template"]
        rows.append(("chat template", "yes" if card.chat_template else "no"))
        fill(self.card, rows)
        self.show_fit()
        self.show_host(result.host)
        self.strip.status.setText(f"{card.source}: {card.family}, {card.params / 1e6:.1f} M parameters")

    def show_host(self, h: HostEstimate) -> None:
        """What the stages will cost this computer (an estimate, said so)."""
        per = ", ".join(f"{s.stage} {display.human_bytes(s.peak_ram_bytes)} ~{max(1, round(s.seconds / 60))} min"
                        for s in h.stages)
        verdict = "fits this computer's memory" if h.fits else "needs more memory than this computer has"
        recipes = ", ".join(f"{r.recipe} +{about_duration(r.seconds)}" for r in h.recipes if r.seconds)
        disk = display.per_precision(h.quantize_disk_bytes)
        self.host.setText(f"This computer, estimated: {per} — {verdict}."
                          + (f" Quantize recipes add: {recipes}." if recipes else "")
                          + (f" Quantize writes {disk} to disk." if disk else ""))
        self.host.setStyleSheet("" if h.fits else "color: #b00020;")

    def _decode_header(self) -> QTableWidgetItem:
        item = self.fit.horizontalHeaderItem(FIT_COLUMNS.index(DECODE))
        assert item is not None  # `table` labels every column
        return item

    def _decode_bounds(self) -> tuple[str, dict[str, str]]:
        """The project's target and the decode bound per precision as the Target page shows it (the bundle's
        figure for the precision it is built at, the estimate for the others)."""
        project = self.window_.project
        soc = project.choices().target_soc if project is not None else DEFAULT_SOC
        if project is None:
            return soc, {}
        return soc, {p: f"{r['decode_tok_s_bound']:,.0f} tok/s ({basis.partition(':')[0]})"
                     for p, r, basis in pipeline.decode_bounds(project, find_soc(soc))}

    def show_fit(self) -> None:
        """Colour each precision by whether it fits (core's rule, `fits_phone_ram`): the selected device's RAM if
        one is picked, else a typical phone (`model_fit.TYPICAL_PHONE_RAM_GB`)."""
        dev = self.window_.device
        ram = dev.ram_bytes if dev is not None and dev.ram_bytes else None
        rows, colours = [], []
        soc, bounds = self._decode_bounds()
        self._decode_header().setText(f"{DECODE} ({soc})")
        for f in self.fits:
            if dev is not None and ram:  # `ram` is the device's: said for mypy
                ok = fits_phone_ram(f.phone_ram_bytes, ram)
                verdict = f"{'fits' if ok else 'too large for'} {dev.serial} ({display.human_bytes(ram)})"
            else:
                ok = f.min_phone_ram_gb is not None and f.min_phone_ram_gb <= model_fit.TYPICAL_PHONE_RAM_GB
                verdict = (f"phones with ≥ {f.min_phone_ram_gb} GB" if f.min_phone_ram_gb
                           else "too large for the listed phones")
            colours.append(GOOD if ok else WARN if f.min_phone_ram_gb else BAD)
            ratio = f.ppl_ratio_default_model
            rows.append((f.precision, verdict, display.human_bytes(f.phone_ram_bytes),
                         bounds.get(f.precision, f"{f.decode_bound(soc):,.0f} tok/s (estimate)"),
                         f"×{ratio:.3f}" if ratio else "—",
                         display.human_bytes(f.weight_bytes), display.human_bytes(f.kv_cache_bytes),
                         f.parts, display.human_bytes(f.context_bytes_phone), display.human_bytes(f.mnn_bytes)))
        fill(self.fit, rows, colours)
        if self.fits:
            phone, sim = (model_fit.plan(self.fits, where) for where in ("phone", "simulator"))
            heads = [n for f in self.fits if (n := display.four_bit_head_note(f))]
            self.advice.setText(f"Recommended: {phone.precision} for a phone ({phone.why.partition(': ')[2]}); "
                                f"{sim.precision} on this computer's simulator ({sim.why.partition(': ')[2]})."
                                + "".join(f" {h}." for h in heads))
