"""What each stage hands on: its result record, typed, and `load` to read one from the stage's folder.

The stages never import each other: compile reads the quantize stage's record and the bundle the compile
stage's through their declarations (`core/stages.py`: `spec.load(stage_dir)`, `project.record(spec)`), which name
these models; the pipeline, the window and the CLI read every record as them (the project's manifest keeps each
one as JSON). Light on purpose (pydantic and the model card only): the declarations are read at the window's
first paint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, ValidationInfo, field_validator

from .errors import UserError
from .fsutil import read_json
from .model_fit import FitEstimate
from .model_source import ModelSource
from .models import ArchCard
from .shape import DecoderSpec
from .stage_options import DEFAULT_DECODE, DEFAULT_WINDOW
from .stage_options import StageOptions as StageOptions  # re-exported: declared with the options models


class EvalPlan(BaseModel):
    """Which tokens an evaluation scores and how: the adapt stage's proof and the quantize stage's perplexity
    share one plan, so the float model's logits are computed once (by adapt) and read back by quantize."""

    corpus: str = "default"
    chars: int | None = None
    tokens: int = Field(description="tokens scored (the start of the corpus)")
    window: int = DEFAULT_WINDOW
    decode_tokens: int = DEFAULT_DECODE


class IOEncoding(BaseModel):
    """How Genie (or any host) quantizes a graph input or dequantizes an output: float = (q - zp) * scale."""

    dtype: str  # uint8 | uint16 | int32
    scale: float = 1.0
    zero_point: int = 0


class CpuNode(BaseModel):
    op_type: str
    name: str
    reason: str = ""


class Compiled(BaseModel):
    graph: str
    context_onnx: str
    context_bin: str
    bin_bytes: int
    seconds: float
    nodes_on_qnn: int
    nodes_on_cpu: list[CpuNode]
    estimated_alloc_kb: int | None = None  # our estimate of the HTP allocation (core/parts.py)
    qnn_alloc_kb: int | None = None  # QNN's own, when its log states it


class StageCost(BaseModel):
    stage: str
    peak_ram_bytes: int
    seconds: float


class RecipeCost(BaseModel):
    recipe: str
    seconds: float  # added to the quantize stage's estimate
    ram_bytes: int = 0  # added to the quantize stage's peak
    refused: str = ""  # why this model cannot take the recipe (recipe_rules), else empty


class HostEstimate(BaseModel):
    """For any precision: the stages hold float weights whatever the target bitwidth."""

    stages: list[StageCost]
    recipes: list[RecipeCost] = []
    int8_budget_seconds: float = 0.0  # added to the quantize stage by --int8-budget at w4a16
    quantize_disk_bytes: dict[str, int] = {}  # precision -> what the quantize stage writes (`quantize_disk_bytes`)
    peak_ram_bytes: int
    seconds: float
    machine_ram_bytes: int | None
    cpus: int
    fits: bool
    note: str = "estimate from rates measured on a 2-core machine; the real figures depend on the machine"




class IntakeResult(BaseModel):
    """The model stage: where the model came from, its architecture card, the phone fit and the host cost."""

    source: ModelSource
    card: ArchCard
    fit: list[FitEstimate]
    host: HostEstimate


class TensorSpec(BaseModel):
    name: str
    shape: list[int]
    dtype: str


class GraphSpec(BaseModel):
    name: str
    kind: str  # prompt | token
    ar: int
    cl: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class Equivalence(BaseModel):
    max_abs_logit_diff: float
    top1_agreement: float
    positions: int
    windows: int
    prefill_ar: int
    decode_steps: int
    ref_logit_range: float = 0.0


class Gate(BaseModel):
    """The equivalence gate's verdict: passed, or failed and accepted by the user (shown in red)."""

    passed: bool
    accepted_mismatch: bool
    min_top1: float
    max_logit_diff: float  # the allowed max |Δlogit|: a fraction of the reference's logit range


class AdaptResult(BaseModel):
    spec: DecoderSpec
    graphs: list[GraphSpec]
    equivalence: Equivalence
    ppl_fp: float  # the original model
    ppl_adapted: float
    eval_tokens: int
    per_window: list[dict[str, float]]
    eval_plan: EvalPlan | None = None
    device: str = "cpu"
    gate: Gate | None = None
    # switchable LoRA adapters: by name, the graphs fed each adapter's inputs against the model computing with it
    lora_equivalence: dict[str, Equivalence] = {}


class AdapterKept(BaseModel):
    """What quantization kept of one merged LoRA adapter (`lora_effect`): of its modules, how many have most of their
    update under half a quantization step (flagged), and the smallest share at least half a step of any module."""

    adapter: str
    modules: int
    flagged: int
    kept_min: float | None


class QuantizeResult(BaseModel):
    precision: str
    target: str
    dsp_arch: str
    recipe: str = "plain"  # the weight-encoding recipe (stage_options.RECIPE_STEPS)
    rotated: bool = False
    lm_head_bits: int = 8  # as quantized: --lm-head-bits, or the override file's `lm_head` pattern
    kept_int8: list[str] = Field(default_factory=list, description="the groups `--int8-budget` kept at 8 bits, most "
                                                                    "sensitive first")
    int8_share: float | None = Field(None, description="with --int8-budget: the decoder's linear weights kept wider")
    ppl_fp: float
    ppl_quant: float
    ratio: float
    top1_agreement: float
    max_abs_logit_diff: float
    eval_tokens: int
    calib_tokens: int
    per_window: list[dict[str, float]]
    graphs: list[str]
    files: list[dict[str, Any]]
    steps: dict[str, float]  # seconds per step
    peak_rss_mb: float
    step_peak_rss_mb: dict[str, float] = Field(default_factory=dict, description="peak RSS as each step ended")
    device: str = "cpu"
    lora_kept: list[AdapterKept] = Field(default_factory=list, description="each merged LoRA adapter, as quantized")


class Verification(BaseModel):
    """What compile checked: each prepared graph against the quantsim's test vectors, then the binaries on the HTP
    simulator against the quantsim over `tokens` eval tokens, or why that did not run (`simulator`)."""

    model_config = ConfigDict(extra="allow")  # a back-end's own findings (qairt: sdk_version, binary_check …)
    vs_quantsim_test_vectors: dict[str, float] = Field(default_factory=dict)
    simulator: str | None = Field(None, description="why the simulator check did not run")
    tokens: int | None = None
    prefill_ar: int | None = None
    decode_steps: int | None = None
    nll_quantsim_cpu: float | None = None
    nll_htp: float | None = None
    nll_diff: float | None = None
    top1_agreement: float | None = None
    max_abs_logit_diff: float | None = None
    kv_cache_max_diff_steps: float | None = Field(
        None, description="the prompt graph's KV cache on the simulator against the quantsim's, largest difference "
                          "in quantization steps (the token graph's steps go on from the quantsim's cache)")
    seconds_per_call_htp: dict[int, float] = Field(default_factory=dict, description="per graph, by its AR")
    seconds_per_call_cpu: dict[int, float] = Field(default_factory=dict, description="per graph, by its AR")


class CompileResult(BaseModel):
    backend: str
    target: str
    soc_model: int | None
    dsp_arch: str
    optimize: str = Field("phone", description="what QNN finalized the graphs for: phone, or quick (the simulator)")
    graphs: list[Compiled]
    parts: int = 1
    weight_shared: bool = False
    recut: list[str] = Field(default_factory=list, description="QNN refused a cut as too large: what was redone")
    nodes_on_cpu: int
    io: dict[str, IOEncoding]
    verification: Verification = Field(default_factory=Verification)
    steps: dict[str, float]
    peak_rss_mb: float
    step_peak_rss_mb: dict[str, float] = Field(default_factory=dict, description="peak RSS as each step ended")


class BundleResult(BaseModel):
    folder: str
    target: str
    dsp_arch: str
    files: list[dict[str, Any]]
    genie_api: str
    validated: bool
    runtime_files: list[str]
    runtime_missing: list[str]
    context_bytes: int = 0
    embedding_lut_bytes: int = Field(0, description="Genie's embedding lookup table (CPU memory, not in the contexts)")
    notes: list[str] = Field(default_factory=list, description="what a person should know before running it")
    decoding: str = Field("basic", description="Genie's dialog: basic, or spd (a draft model proposes tokens)")
    draft_len: int | None = None
    spd_check: dict[str, Any] | None = Field(None, description="the draft-model dialog's greedy answer compared with "
                                                               "the target's alone on the same binaries")
    phone_decode_tok_s: dict[str, float] = Field(
        default_factory=dict, description="the phone's estimated decode rate per decoding mode (roofline over the "
                                          "binaries each token reads; spd at the tokens per target call measured)")

    @field_validator("folder")
    @classmethod
    def _where_it_is_read(cls, v: str, info: ValidationInfo) -> str:
        """Read from its folder (`load`), the bundle is that folder: it was written into a scratch folder, then
        moved."""
        here = (info.context or {}).get("stage_dir")
        return str(Path(here).resolve()) if here is not None else v


class MnnResult(BaseModel):
    """The MNN back-end: the model folder MNN's LLM runtime loads, and how it measured against the float model on
    this computer (perplexity over the eval text read one token at a time, as a phone decodes; the greedy answer
    through MNN's own prompt and decode path)."""

    folder: str
    files: list[dict[str, Any]]
    model_bytes: int = Field(description="llm.mnn + its weights (+ a separate embedding file, if any)")
    bits: int
    block: int
    lm_head_bits: int
    method: str = "plain"  # a record made before the choice existed was plain
    exporter: str = Field(description="llmexport and MNN versions")
    eval: EvalPlan
    fp_ppl: float
    mnn_ppl: float
    ppl_ratio: float
    top1_agreement: float
    max_abs_logit_diff: float
    prompt_tokens: int
    answer_fp: list[int] = Field(description="the float model's greedy tokens")
    answer_mnn: list[int] = Field(description="MNN's greedy tokens through its prompt and decode path")
    answer_text: str
    agreeing_prefix: int = Field(description="leading tokens of the two answers that are the same")
    prefill_tok_s: float
    decode_tok_s: float
    threads: int
    notes: list[str] = Field(default_factory=list)
    # what a chat with it needs (the model's tokenizer is saved beside its folder)
    context_length: int = Field(gt=0, description="tokens a chat keeps: the project's context length")
    chat_template: str | None = None
    bos_id: int | None = None
    eos_ids: list[int] = Field(default_factory=list)


Record = TypeVar("Record", bound=BaseModel)


def load(stage_dir: Path, file: str, model: type[Record], stage: str, command: str) -> Record:
    """`stage_dir/file` as `model`; a clear UserError when it is missing or damaged, saying that `npustudio
    {command}` rewrites it."""
    path = Path(stage_dir) / file
    fix = f"Run `npustudio {command} --project P --force` to rewrite it."
    if not path.is_file():
        raise UserError(f"{stage_dir} holds no {stage} result ({file} is missing).", fix)
    return validated(path, read_json(path, f"the {stage} stage's result ({file})", fix), model, fix,
                     context={"stage_dir": Path(stage_dir)})


def validated(path: Path, data: Any, model: type[Record], fix: str, context: dict[str, Any] | None = None) -> Record:
    """`data`, read from `path`, as `model`; a UserError naming the file and its first wrong field otherwise."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        first = e.errors()[0]
        raise UserError(f"{path} is damaged: {'.'.join(map(str, first['loc']))}: {first['msg']}.", fix) from e


class Graphs(RootModel[list[GraphSpec]]):
    """The adapted graphs' shapes, as the adapt stage keeps them (the quantize stage copies the file)."""
