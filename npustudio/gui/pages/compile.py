"""Compile: QNN HTP context binaries (embedded simulator or the QAIRT SDK), checked on the simulator,
then the Genie bundle validated by the real libGenie; or, as a second target, an MNN model made from the float
model and checked against it."""

from __future__ import annotations

from functools import partial
from typing import Any

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QLineEdit,
    QRadioButton,
    QToolButton,
)

from ...core import isolated, pipeline, stages
from ...core.compile import qairt
from ...core.errors import UserError
from ...core.project import Done
from ...core.results import BundleResult, CompileResult, MnnResult
from ...core.stage_options import BACKEND_NOTES, BundleOptions, CompileOptions, MnnOptions
from ...display import human_bytes
from ..fields import Form
from ..widgets import Page, fill, table, with_note
from ..window import StudioWindow


def sdk_found() -> tuple[str | None, str]:
    """(version, where) of the QAIRT SDK, or (None, why not)."""
    try:
        root = qairt.sdk_root()
        return qairt.sdk_version(root), str(root)
    except UserError as e:
        return None, e.problem


QNN_COLUMNS = ["Graph", "Context binary", "Size", "Ops on the NPU", "Compile time"]
MNN_COLUMNS = ["MNN model", "File", "Size"]


class CompilePage(Page):
    title = "Compile"
    why = ("Compiles the quantized graphs into Hexagon context binaries (every op must land on the NPU), runs them "
           "on the HTP simulator against the quantsim, and writes the Genie bundle.")

    def __init__(self, window: StudioWindow) -> None:
        super().__init__(window)
        self.backend = QButtonGroup(self)
        self.embedded = QRadioButton("Embedded: onnxruntime-qnn + HTP simulator")
        self.embedded.setToolTip("No SDK needed: compiled and checked on the x86 HTP simulator")
        self.sdk = QRadioButton()
        self.backend.addButton(self.embedded, 0)
        self.backend.addButton(self.sdk, 1)
        self.embedded.setChecked(True)
        self.mnn = QRadioButton("MNN for a phone's CPU or GPU (made from the float model)")
        self.mnn.setToolTip(BACKEND_NOTES["mnn"] + ": for phones without a Hexagon NPU")
        self.backend.addButton(self.mnn, 2)
        self.fields = Form(CompileOptions)
        self.verify = self.fields.spin("verify_tokens", step=32)
        self.form.addRow("Back-end:", self.embedded)
        self.form.addRow("", self.sdk)
        self.mnn_fields = Form(MnnOptions)
        self.mnn_bits = self.mnn_fields.combo("bits", {4: "4-bit weight blocks, LM head 8-bit", 8: "8-bit weights"})
        self.form.addRow("", with_note(self.mnn, "MNN's exporter and runtime, for phones without a Hexagon NPU; "
                                                 "checked against the float model on this computer."))
        self.form.addRow("MNN weights:", self.mnn_bits)
        self.share = self.fields.check("weight_sharing", "Weight sharing (for a phone)")
        self.form.addRow("Verify on the simulator (tokens):", self.verify)
        self.form.addRow("", with_note(self.share, "One binary per part holding the prompt and token graphs, weights "
                                                   "once. The simulator and the virtual device cannot load it."))
        self.quick = QCheckBox("Quick compile (for the simulator)")
        self.form.addRow("", with_note(self.quick, "QNN's default graph finalization: about twice as fast, the same "
                                                   "answers; deploy to a phone asks for a compile for the phone."))
        self.lut = self.fields.check("embedding_lut", "Embedding table on the CPU (Genie's lookup table)")
        self.form.addRow("", with_note(self.lut, "Keeps the 16-bit table out of the NPU contexts, where each graph of "
                                                 "the first part would hold it; Genie copies each token's row in."))
        self.draft = QLineEdit()
        self.draft.setReadOnly(True)
        self.draft.setPlaceholderText("none: one token per NPU call")
        self.draft.setToolTip(BundleOptions.model_fields["draft"].description or "")
        pick = QToolButton()
        pick.setText("Choose…")
        pick.clicked.connect(self._pick_draft)
        self.no_draft = QToolButton()
        self.no_draft.setText("None")
        self.no_draft.clicked.connect(lambda: self.set_draft(None))
        self.bundle_fields = Form(BundleOptions)
        self.draft_len = self.bundle_fields.spin("draft_len")
        row = QHBoxLayout()
        row.addWidget(self.draft, 1)
        row.addWidget(pick)
        row.addWidget(self.no_draft)
        self.form.addRow("Draft model (faster decoding):", row)
        self.form.addRow("Draft's proposals per call:", self.draft_len)
        self.add_strip("Compile and bundle", redo=True)
        self.binaries = table(QNN_COLUMNS)
        self.results = table(["Result", "Value"])
        self.lay.addWidget(self.binaries, 1)
        self.lay.addWidget(self.results, 1)
        self.strip.run.clicked.connect(lambda: self.start())
        self.mnn.toggled.connect(self._backend_chosen)
        self.find_sdk()
        self._backend_chosen(False)

    def find_sdk(self) -> None:
        version, where = sdk_found()
        if version:
            self.sdk.setText(f"QAIRT SDK {version} at {where}")
            self.sdk.setEnabled(True)
        else:  # the reason as the tooltip: a radio button does not wrap, and the page would scroll sideways
            self.sdk.setText("QAIRT SDK: not found (hover for why)")
            self.sdk.setToolTip(where)
            self.sdk.setEnabled(False)

    def _pick_draft(self) -> None:
        """A compiled project of a smaller model with this one's tokenizer, from the projects beside this one."""
        start = str(self.project.root.parent)
        folder = QFileDialog.getExistingDirectory(self, "The draft model's project (compiled, same tokenizer)", start)
        if folder:
            self.set_draft(folder)

    def set_draft(self, folder: str | None) -> None:
        """Draft-model decoding needs graphs that take token ids: the lookup-table choice follows the draft."""
        self.draft.setText(folder or "")
        self.draft_len.setEnabled(folder is not None)
        self.no_draft.setEnabled(folder is not None)
        self.lut.setEnabled(folder is None and not self.mnn.isChecked())
        if folder:
            self.lut.setChecked(False)

    def bundle_options(self) -> BundleOptions:
        return self.project.rerun_options(stages.BUNDLE, **self.bundle_fields.values(), draft=self.draft.text() or None)

    def options(self) -> CompileOptions:
        return self.project.rerun_options(stages.COMPILE, **self.fields.values(),
                                          backend="qairt" if self.sdk.isChecked() else "ort-qnn",
                                          optimize="quick" if self.quick.isChecked() else "phone")

    def _backend_chosen(self, mnn: bool) -> None:
        """MNN takes its own options; the QNN ones stay out of its way (and its result is shown when it has one)."""
        self.mnn_bits.setEnabled(mnn)
        for box in (self.verify, self.share, self.quick, self.lut, self.draft, self.draft_len):
            box.setEnabled(not mnn)
        if not mnn:
            self.set_draft(self.draft.text() or None)
        self.strip.run.setText("Export to MNN and check" if mnn else "Compile and bundle")
        if self.window_.project is not None:
            self.refresh()

    def start(self, force: bool = False) -> None:
        if self.mnn.isChecked():
            self._start_mnn(force)
            return
        project, opts, bopts = self.project, self.unless_refused(self.options), self.unless_refused(self.bundle_options)
        if opts is None or bopts is None:
            return
        cluster = self.window_.settings.cluster  # None: here

        def work(state: Any) -> tuple[CompileResult, BundleResult]:
            # the two stages in one process: the bundle's libGenie check follows the compile with no new start
            run = partial(pipeline.compile_and_bundle, boptions=bopts, force=force, cluster=cluster)
            made: tuple[Done[CompileOptions, CompileResult], Done[BundleOptions, BundleResult]] = isolated.run(
                run, project, opts, state=state)
            return made[0].result, made[1].result

        self.strip.start(work, self.finish, "Compiling")

    def _start_mnn(self, force: bool) -> None:
        opts = self.unless_refused(lambda: self.project.rerun_options(stages.MNN, **self.mnn_fields.values()))
        if opts is not None:
            self.run(stages.MNN, opts, "Exporting to MNN", force=force)

    def show_result(self, result: tuple[CompileResult, BundleResult] | MnnResult) -> None:
        if isinstance(result, MnnResult):
            self._show_mnn(result)
        else:
            self._show(*result)

    def refresh(self) -> None:
        self.find_sdk()
        crec, brec, mrec = (self.project.record(stages.COMPILE), self.project.record(stages.BUNDLE),
                            self.project.record(stages.MNN))
        if self.mnn.isChecked():
            if mrec:
                self.mnn_fields.show(mrec.options)
                self._show_mnn(mrec.result)
            else:
                fill(self.binaries, [])
                fill(self.results, [])
                self.strip.status.setText("No MNN model yet.")
        elif crec:
            bo = brec.options if brec else None
            self.set_draft(bo.draft if bo else None)
            if bo is not None:
                self.bundle_fields.show(bo)
            o = crec.options
            self.fields.show(o)
            (self.sdk if o.backend == "qairt" and self.sdk.isEnabled() else self.embedded).setChecked(True)
            self._show(crec.result, brec.result if brec else None)

    def _columns(self, names: list[str]) -> None:
        self.binaries.setColumnCount(len(names))
        self.binaries.setHorizontalHeaderLabels(names)

    def _show_mnn(self, r: MnnResult) -> None:
        self._columns(MNN_COLUMNS)
        fill(self.binaries, [(f"{r.bits}-bit", f["file"], human_bytes(f["bytes"])) for f in r.files])
        fill(self.results, [
            ("MNN model", r.folder),
            ("Weights", f"{r.bits}-bit in blocks of {r.block or 'a row'}{' (HQQ)' if r.method == 'hqq' else ''}, "
                        f"LM head {r.lm_head_bits}-bit"),
            ("Perplexity vs the float model", f"{r.mnn_ppl:.3f} vs {r.fp_ppl:.3f} (x{r.ppl_ratio:.3f})"),
            ("Top-1 agreement", f"{r.top1_agreement:.3f} over {r.eval.tokens} tokens"),
            ("Greedy answer", f"{r.agreeing_prefix} of {len(r.answer_fp)} tokens as the float model's: "
                              f"{r.answer_text}"),
            ("Speed on this computer", f"prompt {r.prefill_tok_s:.0f} tok/s, decode {r.decode_tok_s:.1f} tok/s "
                                       f"({r.threads} threads)"),
            ("Made by", r.exporter)])
        self.strip.status.setText(f"MNN model of {human_bytes(r.model_bytes)}, perplexity x{r.ppl_ratio:.3f} of "
                                  "the float model's.")

    def _show(self, c: CompileResult, b: BundleResult | None) -> None:
        self._columns(QNN_COLUMNS)
        s = pipeline.compile_summary(c)
        fill(self.binaries, [(x.graph, x.file, human_bytes(x.bytes), f"{x.nodes_on_qnn:,}",
                              f"{x.compile_seconds:.0f} s") for x in s.binaries])
        v = s.verification
        rows: list[tuple[str, Any]] = [
            ("Target", f"{s.target} (Hexagon {s.dsp_arch}, soc_model {s.soc_model})"),
            ("Back-end", s.backend), ("Ops left on the CPU", s.nodes_on_cpu),
            ("Contexts", f"{s.parts} part{'s' if s.parts > 1 else ''}"
                         + (", weight-shared (for a phone)" if s.weight_shared else ", one binary per graph"))]
        t = v.vs_quantsim_test_vectors
        for g in (k.removesuffix("_top1_agreement") for k in t if k.endswith("_top1_agreement")):
            rows.append((f"{g} on the CPU vs quantsim", f"top-1 {t[f'{g}_top1_agreement']:.3f}, "
                         f"max |Δ logit| {t[f'{g}_max_abs_logit_diff']:.3f}"))
        if v.simulator:
            rows.append(("HTP simulator check", v.simulator))
        elif v.tokens and v.nll_htp is not None:
            rows += [("HTP simulator vs quantsim", f"NLL {v.nll_htp:.3f} vs {v.nll_quantsim_cpu:.3f} "
                      f"(Δ {v.nll_diff:+.3f}) over {v.tokens} tokens"),
                     ("Top-1 agreement on the simulator", f"{v.top1_agreement:.3f}")]
            if v.kv_cache_max_diff_steps is not None:
                rows.append(("Prompt graph's KV cache on the simulator",
                             f"within {v.kv_cache_max_diff_steps:g} quantization steps of the quantsim's"))
        else:
            rows.append(("HTP simulator check", "skipped (0 tokens)"))
        if b:
            rows += [("Genie bundle", str(self.project.stage_dir(stages.BUNDLE.name))),
                     ("Validated by libGenie", "yes" if b.validated else "no"),
                     ("Genie API", b.genie_api)]
            if b.decoding == "spd":
                check = b.spd_check or {}
                rows.append(("Decoding", f"draft model, {b.draft_len} proposals per target call"
                             + (f"; greedy answers unchanged on {check.get('prompts', 1)} prompts, "
                                f"{check['tokens_per_target_call']} tokens per target call"
                                if check.get("tokens_per_target_call") else "")))
            if b.phone_decode_tok_s:
                rows.append(("Phone decode estimate", ", ".join(f"{mode} {rate:,.0f} tok/s"
                                                                for mode, rate in b.phone_decode_tok_s.items())))
        fill(self.results, rows)
        self.strip.status.setText(f"{len(s.binaries)} context binaries, {s.nodes_on_cpu} ops on the CPU"
                                  + (", bundle validated by libGenie." if b and b.validated else "."))
