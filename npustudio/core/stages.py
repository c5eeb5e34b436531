"""Every stage of the pipeline, declared once: what it needs, what it makes, how the wizard shows it.

The pipeline, the CLI and the window read these declarations (the order, the stage before each one, the command
that redoes it, the wizard's steps); nothing else lists the stages. Light on purpose (no torch): `npustudio
devices` and the window's first paint import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from . import layout, results
from .models import ArchCard
from .results import AdaptResult, BundleResult, CompileResult, GraphSpec, IntakeResult, MnnResult, QuantizeResult
from .stage_options import (
    AdaptOptions,
    BundleOptions,
    CompileOptions,
    IntakeOptions,
    MnnOptions,
    QuantizeOptions,
    StageOptions,
)

O = TypeVar("O", bound=StageOptions)
R = TypeVar("R", bound=BaseModel)
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class StageSpec(Generic[O, R]):
    """One stage, typed by its options model `options` (what `pipeline.run_stage` takes for it) and its result
    model `result` (what its record and `result_file` in its folder hold: `project.record(spec)`, `load`).
    `requires` is the stage whose output it is made from (its record keys that stage's key, so redoing that stage
    makes this one stale); `format` is bumped when the stage's output changes meaning (older outputs are then
    redone, not misread)."""

    name: str
    what: str  # the output in the user's words: "The project has no intact {what} yet."
    command: str  # the `npustudio` command that (re)does it
    options: type[O]
    result: type[R]
    result_file: str
    requires: str | None = None
    format: int | None = None
    remote: bool = False  # may run on a Ray cluster
    reads: tuple[str, ...] = ()  # the earlier stages' folders its body reads (sent to a cluster worker)
    libraries: tuple[str, ...] = ()  # what its body imports first: a new cluster worker imports them early
    # its cost on the reference 2-core machine: (MiB of libraries and buffers, bytes per parameter, seconds,
    # seconds per million parameters); see `host_cost`
    host_rates: tuple[float, float, float, float] | None = None

    def load(self, stage_dir: Path) -> R:
        """The stage's result read back from its folder (a UserError, saying how to redo it, when it is missing or
        damaged)."""
        return self.read(stage_dir, self.result_file, self.result)

    def read(self, stage_dir: Path, file: str, model: type[M]) -> M:
        """Another file the stage keeps in its folder, as `model`, with the same errors as `load`."""
        return results.load(stage_dir, file, model, self.name, self.command)


MODEL = StageSpec("model", "model record", "run", IntakeOptions, IntakeResult, layout.MODEL_RESULT)
# host rates: memory per parameter from the Llama-3.2-1B-shaped runs, 1.24 B parameters: adapt 6,782 MB, quantize
# 8,014 MB at w8a16 and 8,031 MB at w4a16 -- one rate serves both since w4a16's export keeps its LPBQ block scales
# as bytes --, compile 5,883 MB peak RSS; the Qwen3-1.7B shape, 1.72 B: adapt 8,820, quantize 10,913, compile 7,078
ADAPT = StageSpec("adapt", "adapted model", "adapt", AdaptOptions, AdaptResult, layout.ADAPT_RESULT,
                  requires="model", remote=True,
                  libraries=("torch", "transformers", "onnx"),
                  host_rates=(1400, 4.6, 50, 0.05))
QUANTIZE = StageSpec("quantize", "quantized model", "quantize", QuantizeOptions, QuantizeResult,
                     layout.QUANTIZE_RESULT, requires="adapt", format=7,
                     remote=True, reads=("adapt",),
                     libraries=("torch", "transformers", "onnx", "onnxruntime", "aimet_torch"),
                     host_rates=(1600, 5.5, 150, 0.35))
COMPILE = StageSpec("compile", "compiled graphs", "compile", CompileOptions, CompileResult,
                    layout.COMPILE_RESULT, requires="quantize", format=1,
                    remote=True, reads=("quantize", "adapt"),
                    libraries=("torch", "transformers", "onnx", "onnxruntime"),  # compile never needs aimet
                    # time: the two w4a16 runs measured alone, Llama-3.2-1B shape 955 s, Qwen3-4B shape 2,952 s
                    # (its simulator check 4 token steps of 194 s); memory above one part: host_cost
                    host_rates=(2200, 3.2, 70, 0.72))
BUNDLE = StageSpec("bundle", "Genie bundle", "bundle", BundleOptions, BundleResult, layout.BUNDLE_RESULT,
                   requires="compile", format=1,
                   reads=("compile", "adapt"))

# the MNN back-end (`compile --backend mnn`): made from the float model beside the Genie stages, not after them
MNN = StageSpec("mnn", "MNN model", "compile --backend mnn", MnnOptions, MnnResult, layout.MNN_RESULT,
                requires="model", format=2,
                libraries=("torch", "transformers", "MNN"))

SPECS: tuple[StageSpec[Any, Any], ...] = (MODEL, ADAPT, QUANTIZE, COMPILE, BUNDLE, MNN)  # in the order they run
BY_NAME = {s.name: s for s in SPECS}
NAMES = tuple(BY_NAME)
UPSTREAM = {s.name: s.requires for s in SPECS if s.requires}


@dataclass(frozen=True)
class Step:
    """A step of the window's guided flow: the stages it runs (none for a choice or an action on the phone)."""

    name: str
    stages: tuple[str, ...] = ()
    choice: str | None = None  # the project choice that marks a step without a stage done
    free: bool = False  # may be done before the steps above it (Model and Target, in either order)


STEPS: tuple[Step, ...] = (Step("Model", ("model",), free=True), Step("Target", choice="target", free=True),
                           Step("Adapt", ("adapt",)), Step("Quantize", ("quantize",)),
                           Step("Compile", ("compile", "bundle")), Step("Deploy", choice="deployed"))
STEP_NAMES = tuple(s.name for s in STEPS)


def spec(name: str) -> StageSpec[Any, Any]:
    """The stage called `name` (a KeyError names the known ones)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}: the stages are {', '.join(NAMES)}") from None


def load_card(adapt_dir: Path) -> ArchCard:
    """The architecture card the adapt stage keeps beside its graphs."""
    return ADAPT.read(adapt_dir, layout.CARD, ArchCard)


def load_graphs(adapt_dir: Path) -> list[GraphSpec]:
    """The adapted graphs' shapes (the quantize stage copies the file, so its folder serves too)."""
    return ADAPT.read(adapt_dir, layout.GRAPHS, results.Graphs).root
