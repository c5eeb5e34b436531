"""The stages wired to a project, in rooms: `execute` (each stage run, skipped when its inputs and options are
unchanged), `status` (done, stale, the wizard's steps), `phone` (deploy, chat, ask), `summaries` (what the views
show of each result) and `job` (the main job). Used by both the CLI and the GUI, so they run exactly the same
thing."""

from ..results import IntakeResult
from .execute import (
    INTAKE,
    adapt,
    bundle,
    check_lora,
    compile_and_bundle,
    compile_graphs,
    default_project_dir,
    describe,
    intake,
    lora_report,
    opened,
    quantize,
    resolve,
    run_stage,
)
from .job import graphs_for, job_plan, run_all
from .phone import (
    SampleAnswer,
    ask_on_device,
    decode_bounds,
    deploy,
    deploy_mnn,
    open_chat,
    open_engine,
    project_of_bundle,
)
from .status import WizardStep, _require, stage_status, stale_reasons, wizard_steps
from .summaries import (
    AdaptSummary,
    BinarySummary,
    BundleSummary,
    CompileSummary,
    QuantizeSummary,
    RunSummary,
    StageFigures,
    adapt_summary,
    bundle_summary,
    compile_summary,
    quantize_summary,
    summary,
)

__all__ = [
    "INTAKE", "AdaptSummary", "BinarySummary", "BundleSummary", "CompileSummary", "IntakeResult", "QuantizeSummary",
    "RunSummary", "SampleAnswer", "StageFigures", "WizardStep", "_require", "adapt", "adapt_summary", "ask_on_device",
    "bundle", "bundle_summary", "check_lora", "compile_and_bundle", "compile_graphs", "compile_summary",
    "decode_bounds", "default_project_dir", "deploy", "deploy_mnn", "describe", "graphs_for", "intake", "job_plan",
    "lora_report", "open_chat", "open_engine", "opened", "project_of_bundle", "quantize", "quantize_summary", "resolve",
    "run_all", "run_stage", "stage_status", "stale_reasons", "summary", "wizard_steps",
]
