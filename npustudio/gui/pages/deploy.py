"""Deploy: the bundle's contents, whether it fits the selected device, the push with progress; then ask it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QPushButton

from ...core import device, pipeline, stages
from ...core.device import deploy
from ...core.errors import UserError
from ...core.genie.meta import read_metadata
from ...display import human_bytes
from ..widgets import BAD, GOOD, Page, fill, show_error, status_label, table
from ..window import StudioWindow


class DeployPage(Page):
    title = "Deploy"
    why = ("Pushes the Genie bundle to the selected device over adb (only changed files; an interrupted push resumes) "
           "and asks it the sample question. With no phone, start the virtual device in the device panel.")

    def __init__(self, window: StudioWindow) -> None:
        super().__init__(window)
        self.target = status_label("No device selected.")
        self.target.setWordWrap(True)
        self.form.addRow("Device:", self.target)
        self.compat = table(["Check", "Result"])
        self.compat.setMaximumHeight(120)
        self.lay.addWidget(self.compat)
        self.add_strip("Deploy", redo=True)
        self.strip.redo.setToolTip("Push every file again, even those already on the device")
        self.ask = QPushButton("Ask the sample question in the chat panel")
        self.ask.setEnabled(False)
        self.lay.addWidget(self.ask)
        self.files = table(["Bundle file", "Size", "Pushed"])
        self.lay.addWidget(self.files, 1)
        self.strip.run.clicked.connect(lambda: self.start())
        self.ask.clicked.connect(self._ask)
        self.pushed: dict[str, bool] = {}

    @property
    def bundle(self) -> Path:
        return self.project.stage_dir(stages.BUNDLE.name)

    def refresh(self) -> None:
        """The files and the fit, and the deploy the project records (made here or by `npustudio deploy`): a
        reopened project's step list ticked Deploy while this page said it had not run."""
        self.device_changed()
        d = self.project.choices().deployed
        said = f"Deployed to {d.device}:{d.remote_dir}" if d else ""
        if d and not self.strip.busy and not self.strip.status.text().startswith(said):  # keep a push's figures
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.at)) if d.at else "earlier"
            self.strip.status.setText(f"{said} ({when}).")
        dev = self.window_.device
        self.ask.setEnabled(d is not None and dev is not None and d.device == dev.serial)

    def device_changed(self) -> None:
        """The selected device or the bundle changed: show the files and whether it fits."""
        dev = self.window_.device
        try:  # what deploy will send: the phone's files, not the bundle stage's own record
            files = deploy.local_files(self.bundle) if self.bundle.is_dir() else []
        except UserError as e:  # a link in the bundle: deploy refuses it, and says so here already
            files = []
            self.strip.status.setText(e.problem)
        fill(self.files, [(p.name, human_bytes(p.stat().st_size), "yes" if self.pushed.get(p.name) else "")
                          for p in files])
        ok = False
        if dev is None:
            self.target.setText("No device selected: pick one in the device panel, or start the virtual device.")
            fill(self.compat, [])
        else:
            kind = f"virtual device, answers with {dev.answers_with}" if dev.virtual else "phone"
            self.target.setText(f"{dev.serial}: {dev.model or '?'} — {dev.soc} {dev.product} ({kind})")
            if not files:
                fill(self.compat, [("Bundle", "none yet: run the Compile step")], [BAD])
            else:
                try:
                    problems = device.compatibility(dev, self.bundle)
                except UserError as e:
                    problems = [(e.problem, e.fix)]
                if problems:
                    fill(self.compat, [(p, f) for p, f in problems], [BAD] * len(problems))
                else:
                    meta = read_metadata(self.bundle)
                    rows = [("Compatible", f"bundle for {meta.target.soc} ({meta.target.dsp_arch}) fits {dev.serial}"),
                            *self._decoding()]
                    fill(self.compat, rows, [GOOD] * len(rows))
                    ok = True
        self.strip.run.setEnabled(ok and not self.strip.busy)
        self.strip.redo.setEnabled(ok and not self.strip.busy)

    def _decoding(self) -> list[tuple[str, str]]:
        """How the phone will decode, with the bundle stage's estimate of its rate per mode."""
        rec = self.project.record(stages.BUNDLE)
        if rec is None:
            return []
        b = rec.result
        how = (f"draft model, {b.draft_len} proposals per target call" if b.decoding == "spd"
               else "one token per call")
        rates = ", ".join(f"{mode} {rate:,.0f} tok/s" for mode, rate in b.phone_decode_tok_s.items())
        return [("Decoding", how + (f"; phone estimate: {rates}" if rates else ""))]

    def start(self, force: bool = False) -> None:
        dev, folder, project = self.window_.device, self.bundle, self.project
        if dev is None:
            return

        def work(state: Any) -> deploy.DeployResult:
            return pipeline.deploy(project, dev, state, force=force)

        self.window_.devices.log(f"Deploying {folder} to {dev.serial}…")
        self.strip.start(work, self.finish, f"Deploying to {dev.serial}", on_partial=self._partial)
        self._project = project

    def _partial(self, kind: str, data: dict) -> None:
        if kind == "push":
            eta = f", {data['eta_s']:.0f} s left" if data.get("eta_s") is not None else ""
            self.strip.status.setText(f"Pushed {human_bytes(data['bytes'])} of {human_bytes(data['total'])} at "
                                      f"{data['rate'] / 1e6:.0f} MB/s{eta}")
            self.window_.devices.show_push(data)
        elif kind == "warning":
            self.window_.devices.log(f"Warning: {data['message']}")

    def finish(self, r: deploy.DeployResult) -> None:
        self.pushed = {f["file"]: f["sent"] for f in r.files}
        msg = (f"Deployed to {r.device}:{r.remote_dir}: {human_bytes(r.bytes_sent)} sent"
               + (f" at {r.rate_mb_s:.0f} MB/s" if r.bytes_sent else "")
               + f", {human_bytes(r.bytes_skipped)} already there.")
        self.window_.devices.log(msg)
        self.window_.devices.push_done(r.bytes_sent, r.rate_mb_s)  # one figure: the result's, on bar and page
        self.window_.chat.use_device(r.device)
        self.changed.emit()
        self.strip.status.setText(msg)
        self.ask.setEnabled(True)

    def clear_results(self) -> None:
        super().clear_results()
        self.pushed = {}  # another project's files: a same-named file of this one was marked pushed

    def _ask(self) -> None:
        try:
            meta = read_metadata(self.bundle)
        except UserError as e:
            show_error(self, e.problem, e.fix)
            return
        self.window_.chat.ask(meta.question)
