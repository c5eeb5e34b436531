"""What the CLI and the window show of each stage's result (one shape for both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from .. import model_fit, parts, stages
from ..lora import label
from ..project import Done, Project
from ..quantize.presets import takes_4bit_head
from ..results import (
    AdapterKept,
    AdaptResult,
    BundleResult,
    CompileResult,
    MnnResult,
    QuantizeResult,
    Verification,
)
from ..stage_options import LoraAdapter
from .phone import SampleAnswer


class AdaptSummary(BaseModel):
    """What the CLI and the window show of an adapt result (one shape for both)."""

    gate: Literal["passed", "failed, accepted", "not run"]
    top1_agreement: float
    max_abs_logit_diff: float
    positions: int
    prefill_ar: int
    decode_steps: int
    ppl_fp: float
    ppl_adapted: float
    eval_tokens: int
    graphs: list[str]
    lora: list[str] = []  # the LoRA adapters merged first: "folder" or "folder ×weight"
    switchable: list[str] = []  # the LoRA adapters kept switchable, each with its proof: "name: top-1 …, max |Δ| …"


class QuantizeSummary(BaseModel):
    precision: str
    target: str
    recipe: str
    rotated: bool
    kept_int8: list[str] = []
    int8_share: float | None = None
    lm_head: str | None = Field(None, description="the LM head's width where it is a choice (w4a16)")
    ppl_fp: float
    ppl_quant: float
    ratio: float
    top1_agreement: float
    eval_tokens: int
    folder: str
    files: list[dict[str, Any]]
    steps: dict[str, float]
    lora_kept: list[AdapterKept] = []


class BinarySummary(BaseModel):
    graph: str
    file: str
    bytes: int
    nodes_on_qnn: int
    compile_seconds: float
    estimated_alloc_kb: int | None


class CompileSummary(BaseModel):
    backend: str
    target: str
    dsp_arch: str
    soc_model: int | None
    optimize: str
    nodes_on_cpu: int
    parts: int
    weight_shared: bool
    binaries: list[BinarySummary]
    htp_graph_limit_kb: int
    recut: list[str]
    verification: Verification
    steps: dict[str, float]


class BundleSummary(BaseModel):
    folder: str
    target: str = ""
    validated: bool
    files: list[dict[str, Any]]
    genie_api: str
    context_bytes: int = 0
    embedding_lut_bytes: int = 0
    runtime_missing: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    decoding: str = "basic"
    draft_len: int | None = None
    spd_check: dict[str, Any] | None = None
    phone_decode_tok_s: dict[str, float] = Field(default_factory=dict)


class StageFigures(BaseModel):
    seconds: float
    peak_rss_mb: int


class RunSummary(BaseModel):
    """`npustudio run`: every stage's summary, the sample answer and what each stage cost."""

    project: str
    model: str
    adapt: AdaptSummary
    quantize: QuantizeSummary
    compile: CompileSummary
    bundle: BundleSummary
    sample: SampleAnswer | None
    stages: dict[str, StageFigures]
    plan: model_fit.Plan | None = None


def adapt_summary(r: AdaptResult, lora: tuple[LoraAdapter, ...] = ()) -> AdaptSummary:
    """`lora`: the adapters the stage merged (its record's options)."""
    eq, gate = r.equivalence, r.gate
    verdict: Literal["passed", "failed, accepted", "not run"] = (
        "passed" if gate and gate.passed else "failed, accepted" if gate and gate.accepted_mismatch else "not run")
    return AdaptSummary(gate=verdict, top1_agreement=eq.top1_agreement, max_abs_logit_diff=eq.max_abs_logit_diff,
                        positions=eq.positions, prefill_ar=eq.prefill_ar, decode_steps=eq.decode_steps,
                        ppl_fp=r.ppl_fp, ppl_adapted=r.ppl_adapted, eval_tokens=r.eval_tokens,
                        graphs=[g.name for g in r.graphs],
                        lora=[] if r.lora_equivalence else [label(a) for a in lora],
                        switchable=[f"{n}: top-1 {e.top1_agreement:.4f}, max |Δ logit| {e.max_abs_logit_diff:.2e}"
                                    for n, e in r.lora_equivalence.items()])


def quantize_summary(r: QuantizeResult, folder: Path) -> QuantizeSummary:
    return QuantizeSummary(precision=r.precision, target=r.target, recipe=r.recipe, rotated=r.rotated,
                           kept_int8=r.kept_int8, int8_share=r.int8_share,
                           lm_head=f"LM head {r.lm_head_bits}-bit" if takes_4bit_head(r.precision) else None,
                           ppl_fp=r.ppl_fp, ppl_quant=r.ppl_quant,
                           ratio=r.ratio, top1_agreement=r.top1_agreement,
                           eval_tokens=r.eval_tokens, folder=str(folder), files=r.files, steps=r.steps,
                           lora_kept=r.lora_kept)


def compile_summary(r: CompileResult) -> CompileSummary:
    return CompileSummary(
        backend=r.backend, target=r.target, dsp_arch=r.dsp_arch, soc_model=r.soc_model,
        optimize=r.optimize, nodes_on_cpu=r.nodes_on_cpu, parts=r.parts,
        weight_shared=r.weight_shared or r.backend == "qairt",
        binaries=[BinarySummary(graph=g.graph, file=g.context_bin, bytes=g.bin_bytes, nodes_on_qnn=g.nodes_on_qnn,
                                compile_seconds=g.seconds, estimated_alloc_kb=g.estimated_alloc_kb)
                  for g in r.graphs],
        htp_graph_limit_kb=parts.HTP_GRAPH_LIMIT_KB, recut=r.recut, verification=r.verification, steps=r.steps)


def bundle_summary(r: BundleResult) -> BundleSummary:
    return BundleSummary(folder=r.folder, validated=r.validated, files=r.files, genie_api=r.genie_api,
                         context_bytes=r.context_bytes, embedding_lut_bytes=r.embedding_lut_bytes,
                         runtime_missing=r.runtime_missing, notes=r.notes, decoding=r.decoding, draft_len=r.draft_len,
                         spd_check=r.spd_check, phone_decode_tok_s=r.phone_decode_tok_s, target=r.target)


def summary(done: Done[Any, Any], project: Project) -> BaseModel:
    """What the views show of a finished stage's record: one shape per stage (told by its result's type), for the
    tables and `--json`."""
    match done.result:
        case AdaptResult():
            return adapt_summary(done.result, done.options.lora)
        case QuantizeResult():
            return quantize_summary(done.result, project.stage_dir(stages.QUANTIZE.name))
        case CompileResult():
            return compile_summary(done.result)
        case BundleResult():
            return bundle_summary(done.result)
        case MnnResult():
            return done.result  # its record is already what a person reads
    raise TypeError(f"the {done.record.name} stage has no summary: its record is read by `info`")
