"""The stages' options, declared once: each field's default, bounds, choices and help.

The CLI derives its flags from these fields (cli/args.py `option`) and the window its spin and combo boxes
(gui/fields.py), so a default or a bound changes here and both follow. Light on purpose: pydantic, the standard
library and the core's light helpers (the SoC table, the HTP's part limit), never torch,
onnx or transformers, not even through another module (pyproject.toml's import contracts and
tests/test_contracts.py hold it), so `npustudio devices` or a `--help` does not pay for torch. Each stage
re-exports its own model (`core.adapt.AdaptOptions` …).

The bounds are what the pipeline accepts, one per idea:
- a context of tokens (CL, and every count of tokens that is cut to fit one: eval window, AR-1 steps, calibration
  sequence, verification tokens): at most `MAX_CONTEXT`; CL at least 2, since adapt needs 1 ≤ AR < CL (it says so
  for the pair, and refuses a CL over what the model was trained for);
- the prompt step AR: 1 to `MAX_AR`;
- a part's HTP allocation: over 0, at most the HTP's per-graph limit (core/parts.py).
"""

from __future__ import annotations

import fnmatch
from copy import copy
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer
from pydantic.fields import FieldInfo

from .parts import DEFAULT_MAX_PART_MB, HTP_GRAPH_LIMIT_KB
from .targets import DEFAULT_SOC, find_soc

# tokens: the longest KV cache NPU Studio builds (Llama 3.x's trained context); no phone holds a longer one, so a
# larger value is a typo (--cl 1e8)
MAX_CONTEXT = 131_072
MAX_AR = 4096  # tokens per prompt step: the AR-N graph's activations grow with AR × CL
MAX_EVAL_TOKENS = 10_000_000  # tokens scored: hours of evaluation on the default model; more is a typo
MAX_PART_MB = HTP_GRAPH_LIMIT_KB / 1024  # the HTP refuses a graph over 2 GiB
MAX_PARTS = 1024
MAX_CHARS = 2**31 - 1
MAX_CALIB_SAMPLES = 100_000
MAX_BUDGET_S = 10**7  # seconds: four months

# the eval windows (see core/evaluate.py, which reads them here)
DEFAULT_WINDOW = 512
# AR-1 steps at the end of each eval window: the token graph proven at 16 cache positions per window. It is the
# prompt graph's module at another shape, so more steps add time (an AR-1 step of the quantsim costs ~0.25 s on the
# default model, a sixth of an AR-128 chunk) rather than evidence: at 64, 256 of the default eval's 1862 positions
# were AR-1 steps, 61 s of the quantize stage's 78-s eval.
DEFAULT_DECODE = 16



class PrecisionSpec(BaseModel):
    """One precision, declared once: the quantize preset (core/quantize/presets.py), the fit estimate's bits per
    weight (core/model_fit.py), the label the CLI and the window show and what it cost a real model all derive from
    it. Every one keeps 16-bit activations, an 8-bit KV cache and a 16-bit embedding table."""

    model_config = ConfigDict(frozen=True)

    name: str
    weight_bits: int  # the decoder layers' weights
    block_size: int | None = None  # None: one scale per output channel; else LPBQ blocks along the input channels
    note: str
    # quantized/float perplexity of SmolLM2-135M-Instruct (`npustudio run --precision P --json`, its quantize stage's
    # ratio, 2 cores; 4-bit weights with the default int8 budget): shown beside the estimates
    ppl_ratio_default_model: float
    # the same with the LM head in the layers' LPBQ blocks (`--lm-head-bits 4`); None: the head stays 8-bit here
    ppl_ratio_4bit_head: float | None = None

    @property
    def takes_4bit_head(self) -> bool:
        """A 4-bit LM head needs LPBQ blocks: per-channel int4 without blocks runs several steps off on the HTP
        simulator."""
        return self.block_size is not None


PRECISIONS: dict[str, PrecisionSpec] = {s.name: s for s in (  # best quality first
    PrecisionSpec(name="w8a16", weight_bits=8, note="int8 weights, 16-bit activations (best quality)",
                  ppl_ratio_default_model=1.0069),
    PrecisionSpec(name="w4a16", weight_bits=4, block_size=64, note="int4 weight blocks, 16-bit activations (smallest)",
                  ppl_ratio_default_model=1.213, ppl_ratio_4bit_head=1.421),
)}
Precision = Literal["w8a16", "w4a16"]  # PRECISIONS' names, as the type the options' field validates
PRECISION_NAMES: tuple[str, ...] = get_args(Precision)
if PRECISION_NAMES != tuple(PRECISIONS):  # pragma: no cover - a declaration edited in one place only
    raise ImportError(f"stage_options: Precision {PRECISION_NAMES} and PRECISIONS {tuple(PRECISIONS)} differ")
PRECISION_NOTES = {name: s.note for name, s in PRECISIONS.items()}
# the weight-encoding recipes of the quantize stage, each a sequence of aimet-torch's own PTQ algorithms
# (core/quantize/__init__.py runs the steps): a rotation of the float weights before the quantsim is built, then
# the steps that choose weight encodings before activations are calibrated
Recipe = Literal["plain", "seqmse", "adascale", "omniquant", "spinquant", "spinquant_adascale"]
RECIPE_NAMES: tuple[str, ...] = get_args(Recipe)
RECIPE_STEPS: dict[str, tuple[str, ...]] = {
    "plain": (), "seqmse": ("seq_mse",), "adascale": ("adascale",), "omniquant": ("omniquant",),
    "spinquant": ("spinquant",), "spinquant_adascale": ("spinquant", "adascale")}
ROTATION_STEPS = ("spinquant",)  # the steps on the float model, before the quantsim exists
RECIPE_NOTES = {"plain": "min-max weight encodings (fastest)",
                "seqmse": "SeqMSE: each weight's encodings searched against its layer's output",
                "adascale": "AdaScale: each decoder layer's weight scales learned against the float layer",
                "omniquant": "OmniQuant: each decoder layer's weight clipping and equivalent channel scales learned "
                             "against the float layer",
                "spinquant": "SpinQuant: Hadamard rotations of the residual stream and of each head's values, folded "
                             "into the weights",
                "spinquant_adascale": "SpinQuant's rotations, then AdaScale"}


def rotates(recipe: str) -> bool:
    """Whether `recipe` rotates the residual stream itself (then no second rotation, and the float weights the
    quantizer sees are no longer the adapted ones)."""
    return any(s in ROTATION_STEPS for s in RECIPE_STEPS[recipe])


def widens(recipe: str) -> bool:
    """Whether the quantize stage holds a 16-bit model in float32 whole for `recipe`: its steps rewrite or train
    the weights (the plain recipe keeps them as stored, then as int codes)."""
    return bool(RECIPE_STEPS[recipe])


Backend = Literal["ort-qnn", "qairt", "mnn"]
BACKEND_NOTES = {"ort-qnn": "QNN context binaries for Genie, on the embedded simulator",
                 "qairt": "QNN context binaries for Genie, by Qualcomm's SDK (QNN_SDK_ROOT)",
                 "mnn": "an MNN model for MNN's LLM runtime (a phone's CPU/GPU, or this computer), made from the "
                        "float model"}
Device = Literal["auto", "cpu", "cuda"]  # where a stage's torch work runs (core/compute.py)
DEVICES: tuple[str, ...] = get_args(Device)
DEFAULT_QUESTION = "What is the capital of France?"
MNN_BLOCK = 128  # MNN's 4-bit block, as its LLM exports ship


class StageOptions(BaseModel):
    """A stage's options. Defaults are validated like given values: the stage key hashes the dumped options, and an
    int default of a float field (compile's max_part_mb: 1843) hashed unlike the CLI's parsed 1843.0, so
    `npustudio compile` redid a compile the window had done."""

    model_config = ConfigDict(validate_default=True)


def _known_soc(v: str | None) -> str | None:
    """A SoC of the table (core/targets.py), as given: an unknown one is the table's UserError, before any work."""
    if v is not None:
        find_soc(v)
    return v


class LoraAdapter(BaseModel):
    """A LoRA adapter merged into the model before adaptation (core/lora.py): its folder, the weight its update is
    merged with, and (once resolved) the hash of its files, so a changed adapter makes the stages stale."""

    model_config = ConfigDict(frozen=True)
    path: str
    weight: float = Field(1.0, allow_inf_nan=False, description="the factor the adapter's update is merged with")
    sha256: str | None = None


class AdaptOptions(StageOptions):
    ar: int = Field(128, ge=1, le=MAX_AR, description="tokens per prompt-processing step (AR-N graph)")
    cl: int = Field(1024, ge=2, le=MAX_CONTEXT, description="context length: KV-cache entries")
    eval_corpus: str = "default"
    eval_chars: int | None = Field(None, ge=1, le=MAX_CHARS)
    eval_tokens: int | None = Field(None, ge=2, le=MAX_EVAL_TOKENS,
                                    description="tokens of the eval text scored (default: sized to the model, at "
                                                "least 256)")
    window: int = Field(DEFAULT_WINDOW, ge=2, le=MAX_CONTEXT)
    decode_tokens: int = Field(DEFAULT_DECODE, ge=0, le=MAX_CONTEXT,
                               description="AR-1 steps at the end of each eval window")
    device: Device = Field("auto", description="where the proof runs (auto: the CUDA GPU when torch sees one)")
    accept_mismatch: bool = Field(False, description="keep adapted graphs that fail the equivalence gate")
    lora: tuple[LoraAdapter, ...] = Field((), description="LoRA adapters merged into the model first, in order")
    lora_switchable: bool = Field(False, description="keep the LoRA adapters apart from the model, as graph inputs "
                                                     "Genie fills with the adapter a dialog applies")

    @model_serializer(mode="wrap")
    def _without_empty_lora(self, handler: Any) -> Any:
        """No adapter leaves the dump (and so the stage key) as it was before adapters existed: a project made by
        an earlier release is found current, not redone."""
        out = handler(self)
        if isinstance(out, dict) and not out.get("lora"):
            out.pop("lora", None)
        if isinstance(out, dict) and not out.get("lora_switchable"):
            out.pop("lora_switchable", None)
        return out


class IntakeOptions(StageOptions):
    """The model stage's (intake): the context length the phone fit is estimated at, the one adapt builds."""

    cl: int = copy(AdaptOptions.model_fields["cl"])  # type: ignore[assignment]  # adapt's field: default, bounds


class Overrides(BaseModel):
    """Per-module bitwidths (mixed precision): read by `core.quantize.presets.load_overrides`."""

    weights: dict[str, int] = Field(default_factory=dict)
    activations: dict[str, int] = Field(default_factory=dict)

    def weight_bits(self, module: str, default: int) -> int:
        return _match(self.weights, module, default)

    def activation_bits(self, module: str, default: int) -> int:
        return _match(self.activations, module, default)


def _match(table: dict[str, int], name: str, default: int) -> int:
    """The last matching pattern wins, so a file can say `layers.*` first and refine after."""
    bits = default
    for pattern, b in table.items():
        if fnmatch.fnmatchcase(name, pattern):
            bits = b
    return bits


INT8_BUDGET_PROBES = 2  # calibration sequences --int8-budget scores each group on (one prompt-graph call each)
# the int8 budget a 4-bit precision takes unless one is given: on the default model it moves plain w4a16's perplexity
# ratio from 1.338 to 1.213 for about a minute of measuring, and keeps >= 95 % of the decoder's linear weights int4
DEFAULT_INT8_BUDGET = 0.05


class QuantizeOptions(StageOptions):
    precision: Precision = Field(cast(Precision, PRECISION_NAMES[0]),  # the best quality
                                 description="; ".join(f"{k}: {v}" for k, v in PRECISION_NOTES.items()))
    target: str = Field(DEFAULT_SOC, description="target SoC")
    recipe: Recipe = Field("plain", description="weight-encoding recipe: "
                                                + "; ".join(f"{k}: {v}" for k, v in RECIPE_NOTES.items()))
    adascale_iterations: int = Field(150, ge=1, le=100_000, description="AdaScale optimizer steps per decoder "
                                                                         "layer")
    omniquant_iterations: int = Field(150, ge=1, le=100_000, description="OmniQuant optimizer steps per decoder "
                                                                           "layer")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="where the recipes' random draws start (AdaScale mixes "
                      "float and quantized layer inputs at random): the same seed gives the same encodings")
    int8_budget: float | None = Field(
        None, ge=0.0, le=0.5, description="w4a16: the share of the decoder's linear weights that may stay int8, given "
        "to the layers' attention or MLP weights whose 4 bits move the model's output most (measured on the "
        f"calibration text; default {DEFAULT_INT8_BUDGET:g} at w4a16, 0 to keep every one int4)")
    lm_head_bits: Literal[4, 8] = Field(
        8, description="w4a16: the LM head's weight bits: 8, one scale per output channel, as Qualcomm's own w4a16 "
        "recipe keeps it; 4, in the layers' LPBQ blocks: the head's bytes about halved (the largest single weight of "
        "a small model), at a perplexity cost (the default model x1.42 against x1.21)")
    seq_mse_candidates: int = Field(20, ge=1, description="grid points per weight in the SeqMSE search")
    calib_corpus: str = "default"
    calib_samples: int = Field(4, ge=1, le=MAX_CALIB_SAMPLES, description="calibration sequences")
    # cut to the context length; a sequence of one token calibrates nothing
    calib_len: int = Field(256, ge=2, le=MAX_CONTEXT, description="tokens per calibration sequence")
    calib_decode: int = Field(8, ge=0, le=MAX_CONTEXT, description="AR-1 steps at the end of each calibration "
                                                                   "sequence")
    overrides: Overrides = Field(default_factory=Overrides, description="per-module bitwidths (mixed precision)")
    # the perplexity eval: unset fields take the adapt stage's plan, whose float logits are then reused
    eval_corpus: str | None = Field(None, description="eval text (default: the adapt stage's)")
    eval_chars: int | None = Field(None, ge=1, le=MAX_CHARS)
    eval_tokens: int | None = Field(None, ge=2, le=MAX_EVAL_TOKENS)
    window: int | None = Field(None, ge=2, le=MAX_CONTEXT)
    decode_tokens: int | None = Field(None, ge=0, le=MAX_CONTEXT, description="AR-1 steps at the end of each eval "
                                                                              "window")
    export: bool = True
    device: Device = Field("auto", description="where calibration, SeqMSE and the evaluations run (auto: the "
                                               "CUDA GPU when torch sees one)")

    check_target = field_validator("target")(_known_soc)


class CompileOptions(StageOptions):
    backend: Backend = Field("ort-qnn", description="; ".join(f"{k}: {v}" for k, v in BACKEND_NOTES.items()))
    target: str | None = Field(None, description="SoC; default: the quantize stage's target")
    verify_tokens: int = Field(128, ge=0, le=MAX_CONTEXT, description="eval tokens run through the compiled graphs "
                                                                      "on the simulator (0: skip; ~0.6 s each)")
    verify_decode: int = Field(4, ge=0, le=MAX_CONTEXT, description="of which the last ones run as AR-1 steps")
    prompt_check_budget_s: float = Field(
        900, ge=0, le=MAX_BUDGET_S,
        description="the prompt graph runs on the simulator when its estimated time there is under this many "
                    "seconds (an LPBQ layer at 128 tokens is ~6x slower there than int8); over it, only the token "
                    "graph's steps are checked, and the record says so")
    parts: int = Field(0, ge=0, le=MAX_PARTS, description="contexts the model is split into (0: as many as needed)")
    max_part_mb: float = Field(DEFAULT_MAX_PART_MB, gt=0, le=MAX_PART_MB,
                               description="largest estimated HTP allocation of one part's graph, MiB (the HTP "
                                           "refuses graphs over 2 GiB)")
    optimize: Literal["phone", "quick"] = Field(
        "phone", description="phone: QNN's longest graph finalization, the fastest graphs on the NPU; quick: its "
                             "default, about twice as fast to compile, the same results: for a check on the "
                             "simulator (deploy refuses such a bundle for a phone; qairt always builds for one)")
    weight_sharing: bool = Field(False, description="one binary per part holding the prompt and token graphs, "
                                                    "weights once: for a phone (the x86 simulator cannot load it)")
    embedding_lut: bool = Field(True, description="the token-embedding table as Genie's lookup table on the CPU, "
                                                  "not in the NPU graphs (ort-qnn; each graph of the first part "
                                                  "would hold the 16-bit table)")
    eval_corpus: str = "default"

    check_target = field_validator("target")(_known_soc)


class Sampler(BaseModel):
    greedy: bool = Field(True, description="deterministic: the same answer on the phone, simulator and preview")
    temp: float = Field(0.8, ge=0)
    top_k: int = Field(40, ge=1)
    top_p: float = Field(0.95, gt=0, le=1)
    seed: int = Field(42, ge=0)


class BundleOptions(StageOptions):
    sampler: Sampler = Field(default_factory=Sampler)
    question: str = Field(DEFAULT_QUESTION, description="the sample prompt's question")
    n_threads: int = Field(2, ge=1)
    prompt_graphs: bool = Field(True, description="include the AR-N prompt graphs; without them Genie reads a "
                                                  "prompt one token at a time through the AR-1 graphs, and the "
                                                  "bundle holds half the contexts (what lets a model over ~3 GB "
                                                  "of contexts load on the HTP simulator)")
    draft: str | None = Field(None, description="a compiled project whose smaller model drafts for this one "
                                                "(Genie's draft-model decoding, `spd`): same tokenizer, compiled "
                                                "with --no-embedding-lut")
    decoding: Literal["basic", "spd", "lade", "ssd-q1", "eaglet"] | None = Field(
        None, description="how the phone decodes: basic (one token per call) or spd (a draft model proposes, the "
                          "target checks; the default with --draft); lade, ssd-q1 and eaglet are refused with what "
                          "they lack")
    draft_len: int = Field(4, ge=1, le=32, description="tokens the draft proposes per target call")
    draft_key: str | None = Field(None, description="the draft's compile record (set by the pipeline: a draft "
                                                    "compiled again makes the bundle stale)")


class MnnOptions(StageOptions):
    """The MNN back-end (`compile --backend mnn`): MNN's exporter quantizes the float model's linear weights in
    blocks, then the MNN model is checked against the float model on this computer."""

    bits: Literal[4, 8] = Field(4, description="weight bits of the decoder's linear layers")
    block: int | None = Field(None, ge=0, le=4096,
                              description="weights per quantization block (0: one scale per output channel; "
                                          f"default: {MNN_BLOCK}, or the largest power of two below it that "
                                          "divides every layer's inputs)")
    lm_head_bits: Literal[4, 8] = Field(8, description="bits of the LM head (and the embedding tied to it), one "
                                                       "scale per row at 8")
    method: Literal["hqq", "plain"] = Field("hqq", description="how MNN's exporter picks each block's scale and "
                                                               "offset: hqq (Half-Quadratic Quantization, fitted to "
                                                               "the weights, no data needed; the default model's "
                                                               "perplexity x1.207 at 4 bits against x1.290) or "
                                                               "plain (the block's min and max)")
    eval_corpus: str = "default"
    eval_tokens: int | None = Field(None, ge=2, le=MAX_EVAL_TOKENS,
                                    description="tokens of the eval text scored (default: sized to the model)")
    window: int = Field(DEFAULT_WINDOW, ge=2, le=MAX_CONTEXT)
    max_ppl_ratio: float = Field(1.5, gt=1.0, le=100,
                                 description="the stage fails when the MNN model's perplexity is more than this "
                                             "times the float model's")
    question: str = Field(DEFAULT_QUESTION, description="the sample prompt's question")
    answer_tokens: int = Field(16, ge=1, le=MAX_CONTEXT, description="greedy tokens compared with the float model")
    sampler: Sampler = Field(default_factory=Sampler, description="how MNN's runtime picks tokens on a phone "
                                                                  "(written into the model's config.json); the "
                                                                  "check and the chat on this computer are greedy")


OPTION_MODELS: tuple[type[BaseModel], ...] = (AdaptOptions, QuantizeOptions, CompileOptions, BundleOptions, Sampler,
                                              MnnOptions)


# ---------------------------------------------------------------- what a front end reads from a field
@dataclass(frozen=True)
class Bounds:
    """A number field's range: `lo`/`hi` (None: unbounded), `lo_open`: the field says gt (more than lo)."""

    lo: float | None
    hi: float | None
    lo_open: bool = False
    hi_open: bool = False


def bounds(model: type[BaseModel], name: str) -> Bounds:
    """The ge/gt/le/lt the field `name` of `model` declares."""
    lo = hi = None
    lo_open = hi_open = False
    for m in model.model_fields[name].metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        if getattr(m, "lt", None) is not None:
            hi, hi_open = m.lt, True
    return Bounds(lo, hi, lo_open, hi_open)


def int_range(model: type[BaseModel], name: str) -> tuple[int, int]:
    """A whole-number field's closed range [lo, hi] (an open end moved in by one); both ends must be declared."""
    b = bounds(model, name)
    if b.lo is None or b.hi is None:
        raise ValueError(f"{model.__name__}.{name} declares no range")
    return int(b.lo) + b.lo_open, int(b.hi) - b.hi_open


def choices(model: type[BaseModel], name: str) -> tuple[Any, ...] | None:
    """The values a Literal field allows (None: not a Literal)."""
    ann = model.model_fields[name].annotation
    return get_args(ann) if get_origin(ann) is Literal else None


def default(model: type[BaseModel], name: str) -> Any:
    """The field's default (a factory's value for a mutable one)."""
    f: FieldInfo = model.model_fields[name]
    return f.get_default(call_default_factory=True)


def help_of(model: type[BaseModel], name: str) -> str | None:
    return model.model_fields[name].description


Options = TypeVar("Options", bound=BaseModel)


def user_value(options: BaseModel, name: str) -> Any:
    """The value the user gave for `name` (a flag, a page's field, a setting), None where they left it unset: an
    unset option is the plan's to decide (`planned`), a given one never is."""
    return getattr(options, name) if name in options.model_fields_set else None


def planned(options: Options, **values: Any) -> Options:
    """`options` with the plan's `values` for those the user left unset: the one place "unset means the plan
    decides" is written."""
    return options.model_copy(update={k: v for k, v in values.items() if k not in options.model_fields_set})


class ServeOptions(BaseModel):
    """`npustudio serve`: where the OpenAI-compatible endpoint listens and how many requests may wait."""

    host: str = Field("127.0.0.1", description="address to listen on (beyond loopback only with NPUSTUDIO_API_KEY "
                                               "set: clients then send it as their API key)")
    port: int = Field(18181, ge=0, le=65535, description="port (0: any free one; 18181 is GenieX's `geniex serve` "
                                                         "port, so clients written for it find this one)")
    max_waiting: int = Field(16, ge=0, le=1024, description="requests that may wait for the model (it answers one "
                                                            "at a time); more get HTTP 429")
