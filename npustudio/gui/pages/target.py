"""Target: the phone's SoC, picked from the SoC table or read from the connected device."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QComboBox, QPushButton

from ... import display
from ...core import device, pipeline
from ...core.targets import DEFAULT_SOC, KNOWN_SOCS, find_soc
from ..widgets import Page, fill, table
from ..window import StudioWindow


class TargetPage(Page):
    title = "Target"
    why = ("The phone's Snapdragon decides the Hexagon architecture the graphs are quantized and compiled for. "
           "Pick it, or read it from the connected device.")

    def __init__(self, window: StudioWindow) -> None:
        super().__init__(window)
        self.soc = QComboBox()
        for s in KNOWN_SOCS.values():
            self.soc.addItem(f"{s.soc} — {s.product} (Hexagon {s.dsp_arch})", s.soc)
        self.detect = QPushButton("Detect from the connected device")
        self.form.addRow("SoC:", self.soc)
        self.form.addRow("", self.detect)
        self.add_strip("Use this target")
        self.strip.bar.hide()
        self.strip.cancel.hide()
        self.details = table(["Property", "Value"])
        self.lay.addWidget(self.details, 1)
        self.soc.currentIndexChanged.connect(lambda _i: self._show())
        self.detect.clicked.connect(self._detect)
        self.strip.run.clicked.connect(self.use)
        self._show()

    def selected(self) -> str:
        return str(self.soc.currentData())

    def select(self, name: str) -> None:
        i = self.soc.findData(name)
        if i >= 0:
            self.soc.setCurrentIndex(i)

    def use(self) -> None:
        self.project.choose(target=self.selected())
        self.strip.status.setText(f"Target set: {self.selected()}.")
        self.changed.emit()

    def refresh(self) -> None:
        chosen = self.project.choices().target
        self.select(chosen or self.window_.settings.default_target or DEFAULT_SOC)
        self._show()
        if chosen:  # the step is ticked: the page says so too (it said "Not run yet" on a reopened project)
            self.strip.status.setText(f"Target set: {chosen}.")

    def _detect(self) -> None:
        serial = self.window_.device.serial if self.window_.device else None

        def work(_state: Any) -> str:
            d = device.pick(serial)
            if d.soc not in KNOWN_SOCS:
                from ...core.errors import UserError

                raise UserError(f"{d.serial} reports the SoC {d.soc or 'nothing'}, which is not in the SoC table.",
                                "Pick the closest target by hand (same Hexagon version).")
            return d.soc

        def found(name: str) -> None:
            self.select(name)
            self.use()
            self.strip.status.setText(f"Detected {name} on the connected device; target set.")

        self.strip.start(work, found, "Asking the device for its SoC")

    def _show(self) -> None:
        s = find_soc(self.selected())
        rows: list[tuple[str, Any]] = [("SoC", s.soc), ("Product", s.product), ("Hexagon (dsp_arch)", s.dsp_arch),
                                       ("QNN soc_model", s.soc_model), ("Memory bandwidth", f"{s.memory_gb_s} GB/s")]
        for precision, r, basis in pipeline.decode_bounds(self.project, s) if self.window_.project else []:
            rows.append((f"Decode bound, {precision}", f"≤ {r['decode_tok_s_bound']} tok/s "
                         f"({display.human_bytes(r['bytes_per_token'])} read per token; {basis})"))
        fill(self.details, rows)
