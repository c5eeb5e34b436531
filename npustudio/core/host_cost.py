"""What a model will cost this computer before anything runs: peak memory and time per stage, estimated.

The rates were measured on a 2-core, 24 GB machine (NPU Studio's reference) with the default model and random
models of Llama-3.2-1B's shapes (`benchmarks/scale_bench.py`): memory grows with the parameters (the stages keep
the float32 weights in memory, the quantize stage its quantized copy of the largest tables too), time with the
parameters and, for compile, with the weight bytes the HTP compiler builds. Times scale with the CPU count.
They are estimates, labelled as such wherever they are shown; the memory check refuses a stage this computer
cannot hold instead of letting the system's out-of-memory killer end it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from . import stages
from .errors import UserError
from .results import HostEstimate, RecipeCost, StageCost

REFERENCE_CPUS = 2
MB = 2**20
# stage -> (MiB of libraries and buffers, bytes per parameter, seconds, seconds per million parameters) on 2 cores:
# each stage's own declaration (core/stages.py) holds its figures and where they were measured
RATES: dict[str, tuple[float, float, float, float]] = {s.name: s.host_rates for s in stages.SPECS if s.host_rates}
# the weight-encoding recipes, from benchmarks/recipe_bench.py on 2 cores. AdaScale (its quantizer compiled) fitted
# to the Llama-3.2-1B shape: 2,838 s at 150 steps a layer over 4 x 256 calibration tokens, its captures of each
# layer's inputs (computed through that layer only) ~540 s of it, at the rate one capture measured; the default
# model (106 M decoder parameters, 30 layers, smaller matrices) took 548 s against the 352 s these rates say.
# OmniQuant 1,049 s at 150 steps a layer on the default model (one capture of the float inputs), SeqMSE 1,160 s at
# 20 candidates (that one beside another job: ~0.3 of it taken off). Seconds per million decoder parameters
ADASCALE_S_PER_MPARAM_STEP = 0.0158
ADASCALE_CAPTURE_S_PER_MPARAM_TOKEN = 5.7e-5  # a prompt pass through the decoder's layers up to the one captured
# one layer's AdaScale training state (its learned per-weight scales, their gradients and Adam moments, what the
# backward keeps): bytes per parameter of one decoder layer, beside the stage's own peak (1B shape 13,750 MiB
# against the plain stage's 8,082 and the inputs held; default model 3,129 MiB)
ADASCALE_BYTES_PER_LAYER_PARAM = 80.0
OMNIQUANT_S_PER_MPARAM_STEP = 0.065
SEQMSE_S_PER_MPARAM_CANDIDATE = 0.45
# SpinQuant merges a hidden x hidden rotation into every weight: seconds per million parameters per 1,000 hidden
# (0.040-0.046 measured beside a 2-core job on 128M and 256M models of hidden 1,024 and 2,048; alone, a Llama-3.2-1B
# shape took 72 s: 0.028)
SPINQUANT_S_PER_MPARAM_KHIDDEN = 0.03
# --int8-budget's float calls, per million parameters a call computes per token (default model: 65 s for 122 whole
# calls of 128 tokens; replaying the layers before each probed one, 0.64 of that, as the call count here predicts)
PROBE_S_PER_MPARAM_TOKEN = 3.0e-5
GGUF_EXTRA_BYTES_PER_PARAM = 4.0  # transformers dequantizes a GGUF file into a second float copy while loading
# the adapt stage holds a 16-bit checkpoint's weights as stored, 2 bytes each fewer than the float32 its rate counts,
# but for those it rescales (`rescaled_params`), kept in float32 (bf16, peak RSS against this estimate: Llama-3.2-1B
# shape 4,867 MiB against 4,592; Qwen3-4B shape 10,648 against 11,373; Phi-4-mini shape 12,350 against 11,488;
# widened whole, the 1B shape took 6,574)
HALF_SAVES_BYTES_PER_PARAM = 2.0
# the quantize stage of a 16-bit checkpoint on the plain recipe holds its weights as stored until the fold, then as
# int8 codes, and exports from stand-ins; the int8 LM head's quantize-dequantize makes float32 copies of the
# embedding table (MiB, bytes per parameter, bytes more per table parameter), fitted to three w4a16 runs with the
# default int8 budget: the Llama-3.2-1B shape's 6,178 MiB (widened whole: 8,002), the Qwen3-4B shape's 11,921 MiB
# (12,087 in a run alone, 3,162 s: its time is within 10 % of the rates above and the int8 budget's) and the
# Phi-4-mini shape's 13,532 MiB (a 200k vocabulary: 615 M table parameters, the others' 263 M and 389 M)
QUANTIZE_16BIT_RATES = (1870.0, 1.756, 8.94)
# the compile stage gives the HTP compiler one part of a graph at a time: beyond the size one part holds (the
# Llama-3.2-1B shape, 1.24 B parameters, compiles in one part) its memory grows only with what the simulator check
# loads, all of a graph's part contexts (the Qwen3-4B shape in 3 parts: 7,642 MiB peak RSS, the 3.2 B/param of one
# part would say 14,476)
COMPILE_ONE_PART_PARAMS = 1.24e9
COMPILE_BYTES_PER_PARAM_BEYOND = 0.63
# the AIMET 1.0.0 .encodings file lists each LPBQ block's integer scale: 12.8 bytes a block (the Qwen3-4B shape at
# w4a16: 692 MB a graph)
LPBQ_ENCODINGS_BYTES_PER_BLOCK = 12.8


def machine_ram() -> int | None:
    """Physical memory of this computer (None where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def available_ram() -> int | None:
    """Memory the system can give out now without swapping (Linux's MemAvailable; None where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def stage_cost(stage: str, card: Any, gguf: bool = False, cpus: int | None = None,
               whole_float32: bool = False) -> StageCost:
    """One stage's estimate (the same at w8a16 and w4a16: the float weights dominate either way). `whole_float32`:
    the float model held widened whole (the MNN export, a quantize recipe that trains or rewrites weights), where
    adapt and quantize keep a 16-bit checkpoint's own tensors."""
    base, per_param, secs, per_mparam = RATES[stage]
    params = card.params
    ram = base * MB + per_param * params
    if stage == "adapt" and gguf:
        ram += GGUF_EXTRA_BYTES_PER_PARAM * params
    elif stage == "adapt" and card.stored_bits == 16 and not whole_float32:
        ram -= HALF_SAVES_BYTES_PER_PARAM * (params - rescaled_params(card))
    elif stage == "quantize" and card.stored_bits == 16 and not whole_float32:
        base_mb, per_param, per_table_param = QUANTIZE_16BIT_RATES
        ram = base_mb * MB + per_param * params + per_table_param * card.vocab * card.hidden
    elif stage == "compile" and params > COMPILE_ONE_PART_PARAMS:
        ram = (base * MB + per_param * COMPILE_ONE_PART_PARAMS
               + COMPILE_BYTES_PER_PARAM_BEYOND * (params - COMPILE_ONE_PART_PARAMS))
    scale = REFERENCE_CPUS / max(1, min(cpus or os.cpu_count() or 1, 16))
    return StageCost(stage=stage, peak_ram_bytes=int(ram), seconds=round((secs + per_mparam * params / 1e6) * scale))


def rescaled_params(card: Any) -> int:
    """The weights the adapt stage rescales, so holds as new float32 tensors whatever the checkpoint's dtype: q
    (the softmax scale, unless a q-norm's gain takes it), o and down (Granite's residual multiplier), the embedding
    table (its embedding multiplier)."""
    q = 0 if card.qk_norm else card.heads * card.head_dim * card.hidden
    out = (card.heads * card.head_dim * card.hidden + card.hidden * card.intermediate
           if card.residual_multiplier != 1.0 else 0)
    table = card.vocab * card.hidden if card.embedding_multiplier != 1.0 else 0
    return card.layers * (q + out) + table


def _decoder_params(card: Any) -> int:
    """The weights a recipe learns or searches, and what its time and memory grow with: all but the embedding
    table (a lookup)."""
    return max(0, card.params - card.vocab * card.hidden)


def recipe_seconds(recipe: str, card: Any, options: Any = None, cpus: int | None = None) -> float:
    """What a weight-encoding recipe adds to the quantize stage: each step's time grows with the decoder's weights
    (all but the embedding table), the tokens it reads and, for AdaScale, its optimizer steps per layer."""
    from .stage_options import RECIPE_STEPS, QuantizeOptions

    o = options or QuantizeOptions()
    decoder_m = _decoder_params(card) / 1e6
    tokens = o.calib_samples * o.calib_len
    per = {"adascale": ADASCALE_S_PER_MPARAM_STEP * decoder_m * o.adascale_iterations  # a capture a layer, after
           + ADASCALE_CAPTURE_S_PER_MPARAM_TOKEN * decoder_m * tokens * (1 + (card.layers + 1) / 2),  # the float one
           "omniquant": OMNIQUANT_S_PER_MPARAM_STEP * decoder_m * o.omniquant_iterations
           + ADASCALE_CAPTURE_S_PER_MPARAM_TOKEN * decoder_m * tokens,
           "seq_mse": SEQMSE_S_PER_MPARAM_CANDIDATE * decoder_m * o.seq_mse_candidates,
           "spinquant": SPINQUANT_S_PER_MPARAM_KHIDDEN * card.params / 1e6 * card.hidden / 1000}
    scale = REFERENCE_CPUS / max(1, min(cpus or os.cpu_count() or 1, 16))
    steps = RECIPE_STEPS[recipe]
    return max(1, round(sum(per[step] for step in steps) * scale)) if steps else 0


def int8_budget_seconds(card: Any, cpus: int | None = None) -> float:
    """`--int8-budget`'s measurement, per probe sequence: one prompt-graph call of the whole float model for the
    reference, then one per layer's attention and MLP that runs the layers from its own on and the LM head (the
    layers before it are replayed): on average half the decoder."""
    from .stage_options import INT8_BUDGET_PROBES, AdaptOptions

    head = card.vocab * card.hidden
    whole = card.params - (0 if card.tied_embeddings else head)  # the embedding table is a lookup: no work
    decoder, n = whole - head, card.layers
    mparams = INT8_BUDGET_PROBES * (whole + decoder * (n + 1) + 2 * n * head) / 1e6  # summed over the calls
    scale = REFERENCE_CPUS / max(1, min(cpus or os.cpu_count() or 1, 16))
    return round(PROBE_S_PER_MPARAM_TOKEN * mparams * AdaptOptions().ar * scale, 1)


def recipe_ram(recipe: str, card: Any, options: Any = None) -> int:
    """What a recipe holds beside the quantize stage's own peak: AdaScale keeps every layer's float inputs of each
    calibration call (the stream, the mask, the layer's KV cache) and one layer's quantized ones, in float32, and
    one layer's training state, OmniQuant the float inputs alone; SpinQuant the rotated embedding table and LM head
    beside the ones they replace; and every recipe but plain widens a 16-bit model to float32 whole."""
    from .stage_options import RECIPE_STEPS, AdaptOptions, QuantizeOptions, widens

    steps = RECIPE_STEPS[recipe]
    ram = 2 * 4 * card.vocab * card.hidden if "spinquant" in steps else 0
    if widens(recipe) and card.stored_bits == 16:  # a 16-bit model widened whole
        ram += (stage_cost(stages.QUANTIZE.name, card, whole_float32=True).peak_ram_bytes
                - stage_cost(stages.QUANTIZE.name, card).peak_ram_bytes)
    held = max([{"adascale": card.layers + 1, "omniquant": card.layers}.get(s, 0) for s in steps], default=0)
    if not held:
        return ram
    o, shape = options or QuantizeOptions(), AdaptOptions()
    calls = o.calib_samples * -(-min(o.calib_len, shape.cl) // shape.ar)
    per_call = 4 * (card.hidden * shape.ar + shape.ar * shape.cl + 2 * card.kv_heads * card.head_dim * shape.cl)
    training = ADASCALE_BYTES_PER_LAYER_PARAM * _decoder_params(card) / card.layers
    return max(ram, int(held * calls * per_call + (training if "adascale" in steps else 0)))


def recipe_costs(card: Any, cpus: int | None = None) -> list[RecipeCost]:
    """Every recipe's extra time and memory for `card` at the quantize stage's default options."""
    from .recipe_rules import refusal
    from .stage_options import RECIPE_NAMES

    return [RecipeCost(recipe=r, seconds=recipe_seconds(r, card, cpus=cpus), ram_bytes=recipe_ram(r, card),
                       refused=why.problem if (why := refusal(r, card)) else "") for r in RECIPE_NAMES]


def estimate(card: Any, gguf: bool = False) -> HostEstimate:
    from .model_fit import WEIGHT_BITS

    cpus = os.cpu_count() or 1
    stages = [stage_cost(s, card, gguf, cpus) for s in RATES]
    peak = max(s.peak_ram_bytes for s in stages)
    ram = machine_ram()
    return HostEstimate(stages=stages, peak_ram_bytes=peak,
                        recipes=recipe_costs(card, cpus), int8_budget_seconds=int8_budget_seconds(card, cpus),
                        quantize_disk_bytes={p: quantize_disk_bytes(card, p) for p in WEIGHT_BITS},
                        seconds=round(sum(s.seconds for s in stages)), machine_ram_bytes=ram, cpus=cpus,
                        fits=ram is None or peak <= ram)


def check_fits(card: Any, stage: str, gguf: bool = False, whole_float32: bool = False) -> None:
    """Refuse a stage whose estimated peak memory is over this computer's RAM (before loading anything)."""
    ram = machine_ram()
    need = stage_cost(stage, card, gguf, whole_float32=whole_float32).peak_ram_bytes
    if ram is not None and need > ram:
        raise UserError(f"The {stage} stage of this {card.params / 1e9:.1f} B-parameter model needs about "
                        f"{need / 2**30:.1f} GiB of memory (an estimate); this computer has {ram / 2**30:.1f} GiB.",
                        "Use a machine with more memory, a smaller model, or run the heavy stages on a computer "
                        "that has it.")


def quantize_disk_bytes(card: Any, precision: str, ar: int | None = None, int8_budget: float | None = None) -> int:
    """What the quantize stage writes: weights.bin, the float32 weights (the float graphs the QAIRT SDK reads) and
    the quantized ones (the QDQ graphs onnxruntime-qnn reads), each stored once for the prompt and token graphs (a
    tied table is two there: the embedding on its 16-bit grid, the LM head on its 8-bit one); at 4 bits also the two
    graphs' .encodings files, which list every LPBQ block's integer scale of the weights left int4 (`int8_budget`:
    the share kept int8, the stage's default unless given); the test vectors, about three of the prompt graph's
    float32 logits (`ar` tokens, the adapt stage's default unless given). Qwen3-4B shape at w4a16: 22.42 GB
    written, 22.36 estimated."""
    from .model_fit import WEIGHT_BITS, _layer_params, weight_bytes
    from .stage_options import DEFAULT_INT8_BUDGET, AdaptOptions

    ar = ar or AdaptOptions().ar
    share = DEFAULT_INT8_BUDGET if int8_budget is None else int8_budget
    tied = card.vocab * card.hidden if card.tied_embeddings else 0
    blocks = (1 - share) * card.layers * _layer_params(card)[0] / 64 if WEIGHT_BITS[precision]["layer"] < 8 else 0
    return (4 * (card.params + tied) + weight_bytes(card, precision)
            + int(2 * LPBQ_ENCODINGS_BYTES_PER_BLOCK * blocks) + 3 * 4 * ar * card.vocab)


def check_disk(folder: Path, stage: str, need: int) -> None:
    """Refuse a stage whose output would not fit on the disk it is written to, before it starts (a Qwen3-4B shape's
    quantize stage wrote for 75 minutes, then found the disk full)."""
    free = shutil.disk_usage(folder).free
    if need > free:
        raise UserError(f"The {stage} stage writes about {need / 1e9:.1f} GB (an estimate) to {folder}; that disk has "
                        f"{free / 1e9:.1f} GB free.",
                        "Free space on that disk, or move the project to a disk with more room, then run the stage "
                        "again.")
