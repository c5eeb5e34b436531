"""Adapt: the static AR-N/AR-1 graphs Genie runs, proven equivalent to the original model."""

from __future__ import annotations

from ...core import pipeline, stages
from ...core.results import AdaptResult
from ...core.stage_options import AdaptOptions
from ..charts import PplChart
from ..fields import Form, limit_context
from ..widgets import BAD, Page, fill, table, with_note
from ..window import StudioWindow


class AdaptPage(Page):
    title = "Adapt"
    why = ("Rewrites the model into the fixed-shape graphs the NPU runs (prompt graph AR-N and token graph AR-1 over "
           "a KV cache of CL entries) and checks they give the original model's next-token logits.")

    def __init__(self, window: StudioWindow) -> None:
        super().__init__(window)
        self.fields = Form(AdaptOptions)
        self.ar = self.fields.spin("ar", step=32)
        self.cl = self.fields.spin("cl", step=128)
        self.form.addRow("Prompt tokens per step (AR):", self.ar)
        self.form.addRow("Context length (CL):", self.cl)
        self.accept_mismatch = self.fields.check("accept_mismatch", "Keep graphs that fail the equivalence gate")
        self.form.addRow("", with_note(self.accept_mismatch, "They will not answer like the original model."))
        self.add_strip("Adapt", redo=True)
        self.chart = PplChart()
        self.results = table(["Check", "Value"])
        self.lay.addWidget(self.chart, 2)
        self.lay.addWidget(self.results, 1)
        self.strip.run.clicked.connect(lambda: self.start())

    def options(self) -> AdaptOptions:
        return self.project.rerun_options(stages.ADAPT, **self.fields.values(), device=self.window_.settings.device,
                                          lora=self.project.choices().lora,  # picked on the Model page
                                          lora_switchable=self.project.choices().lora_switchable)

    def start(self, force: bool = False) -> None:
        opts = self.unless_refused(self.options)
        if opts is None:
            return
        self.chart.clear_results()
        self.strip.status.setStyleSheet("")
        self.run(stages.ADAPT, opts, "Adapting", force=force, model=self.project.choices().model)

    def refresh(self) -> None:
        rec = self.project.record(stages.ADAPT)
        ch = self.project.choices()
        limit_context(self.cl, self.project)
        if rec:
            self.fields.show(rec.options)
            self.show_result(rec.result)
        else:
            self.cl.setValue(ch.cl)

    def show_result(self, r: AdaptResult) -> None:
        rec = self.project.record(stages.ADAPT) if self.project else None
        s = pipeline.adapt_summary(r, rec.options.lora if rec else ())
        if not self.chart.series:
            self.chart.extend(list(r.per_window))
        accepted = s.gate == "failed, accepted"
        rows = [
            ("Equivalence gate", s.gate),
            ("Top-1 agreement with the original", f"{s.top1_agreement:.4f}"),
            ("Max |Δ logit|", f"{s.max_abs_logit_diff:.2e}"),
            ("Positions compared", f"{s.positions} (prefill AR-{s.prefill_ar}, {s.decode_steps} AR-1 steps)"),
            ("Perplexity: original / adapted", f"{s.ppl_fp:.3f} / {s.ppl_adapted:.3f}"),
            ("Graphs", ", ".join(s.graphs)),
        ] + ([("LoRA adapters merged", ", ".join(s.lora))] if s.lora else []) + [
            ("LoRA adapter, switchable", line) for line in s.switchable]
        fill(self.results, rows, [BAD if accepted and i < 3 else None for i in range(len(rows))])
        if accepted:
            self.strip.status.setStyleSheet("color: #b00020; font-weight: bold")
            self.strip.status.setText(f"Adapted WITHOUT equivalence: top-1 {s.top1_agreement:.4f}, max |Δ logit| "
                                      f"{s.max_abs_logit_diff:.2e}. The mismatch was accepted; this model will "
                                      "not answer like the original.")
        else:
            self.strip.status.setStyleSheet("")
            self.strip.status.setText(f"Adapted: top-1 {s.top1_agreement:.4f}, FP perplexity {s.ppl_fp:.3f}.")
