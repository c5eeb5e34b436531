"""Whether a model fits a phone, per precision, before anything runs: its weights (bits per weight from each
precision's declaration in core/stage_options.py), KV cache, HTP parts (core/parts.py), phone RAM and context
bytes; and the plan of the main job (the best quality whose bundle loads where the job deploys).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from . import parts
from .errors import UserError
from .models import ArchCard
from .stage_options import DEFAULT_INT8_BUDGET, MNN_BLOCK, PrecisionSpec
from .stage_options import PRECISIONS as PRECISION_SPECS

GiB = 1024**3
PHONE_RAM_TIERS_GB = (6, 8, 12, 16, 24)
TYPICAL_PHONE_RAM_GB = 8  # the window's fit colours when no phone is selected


class HeadVariant(BaseModel):
    """The same precision with `--lm-head-bits 4` (the LM head in the layers' 4-bit LPBQ blocks): what it saves."""

    context_bytes_phone: int
    decode_tok_s_bound: float
    ppl_ratio_default_model: float | None = None


class FitEstimate(BaseModel):
    precision: str
    context_length: int
    prompt_ar: int = 128
    weight_bytes: int
    kv_cache_bytes: int
    parts: int | None = Field(description="HTP graphs the model is cut into (None: no cut fits, see parts_problem)")
    largest_part_mb: float | None = None
    parts_problem: str | None = None
    phone_ram_bytes: int
    min_phone_ram_gb: int | None
    context_bytes_phone: int = Field(0, description="the bundle's context binaries for a phone (weight-shared: "
                                                    "each part's weights once)")
    context_bytes_simulator: int = Field(0, description="the same for the x86 simulator (one binary per graph: "
                                                        "each part's weights in the prompt and the token graph)")
    decode_tok_s_bound: float = Field(0.0, description="decode roofline on the default target (SM8750)")
    ppl_ratio_default_model: float | None = Field(None, description="quantized/float perplexity measured on the "
                                                                     "default model at this precision")
    mnn_bytes: int = Field(0, description="the MNN model for a phone's CPU or GPU (`compile --backend mnn`) at this "
                                          "weight width, MNN's default block, LM head 8-bit")
    with_4bit_head: HeadVariant | None = Field(None, description="with --lm-head-bits 4, where it applies")
    assumptions: str

    def decode_bound(self, soc_name: str) -> float:
        """The decode bound on `soc_name`, by the one definition every view uses: the bytes a generated token reads
        (the weights on the HTP, i.e. all but the embedding table, and the KV cache over the whole context) over
        the SoC's memory bandwidth. Stored for the default target; another SoC scales by its bandwidth."""
        from .targets import DEFAULT_SOC, find_soc

        return round(self.decode_tok_s_bound * find_soc(soc_name).memory_gb_s / find_soc(DEFAULT_SOC).memory_gb_s, 1)


LPBQ_SCALE_BITS = 4.0  # an LPBQ block's integer scale, shared by its weights


def _layer_bits(p: PrecisionSpec) -> float:
    """Bits per decoder-layer weight at `p`: LPBQ adds each weight's share of its block's scale, and the default int8
    budget keeps up to that share of the layers' weights 8-bit."""
    if p.block_size is None:
        return float(p.weight_bits)
    return (1 - DEFAULT_INT8_BUDGET) * (p.weight_bits + LPBQ_SCALE_BITS / p.block_size) + DEFAULT_INT8_BUDGET * 8.0


# bits per weight for the decoder layers, the LM head and the embedding table (Genie's lookup table on the CPU, in
# the 16-bit encoding of the first graph's input: not in the HTP contexts), from each precision's declaration
WEIGHT_BITS = {name: {"layer": _layer_bits(p), "lm_head": 8.0, "embed": 16.0} for name, p in PRECISION_SPECS.items()}


def _layer_params(card: ArchCard) -> tuple[int, int]:
    """(weights, output channels) of one decoder layer's convolutions."""
    d, hd = card.hidden, card.head_dim
    attn = d * card.heads * hd + 2 * d * card.kv_heads * hd + card.heads * hd * d
    return attn + 3 * d * card.intermediate, card.heads * hd + 2 * card.kv_heads * hd + 2 * d + 2 * card.intermediate


def part_model(card: ArchCard, precision: str, ar: int, cl: int) -> parts.PartModel:
    """The HTP estimate of the compiled graphs' pieces, from the card alone (see core/parts.py): what
    `npustudio info` counts parts by, the same way the compile stage counts them from the real tensors."""
    b = WEIGHT_BITS[precision]
    d, hd, kv = card.hidden, card.head_dim, card.kv_heads
    weights, channels = _layer_params(card)
    per_channel = 5 * channels  # float32 scale + 8-bit zero point per output channel
    block_scales = weights // 64 if b["layer"] < 8 else 0  # LPBQ: one 8-bit scale per block of 64
    qk_norms = (card.heads + kv) * hd if card.qk_norm_full else 2 * hd if card.qk_norm else 0  # OLMo 2: all heads
    norms = 2 * d * 4 + qk_norms * 4 + ((card.heads + 2 * kv) * hd * 4 if card.qkv_bias else 0)
    layer_w = parts.weight_bytes(weights + per_channel + block_scales + norms)  # 4-bit counted as 8-bit
    layer_io = 2 * kv * hd * (cl - ar) + 2 * kv * hd * ar  # 8-bit K and V read and written
    largest = 2 * max(card.heads * ar * cl, ar * card.intermediate, ar * d)  # 16-bit activations
    return parts.PartModel(
        first=2 * d * ar,  # the 16-bit embeddings in: the table itself is Genie's lookup table on the CPU
        layers=[layer_w + layer_io] * card.layers,
        last=parts.weight_bytes(card.vocab * d * b["lm_head"] / 8 + 5 * card.vocab + 4 * d) + 2 * ar * card.vocab,
        each=2 * ar * cl + 2 * ar * hd + 2 * 4 * d * ar + 2 * largest)


def linear_inputs(card: ArchCard) -> dict[str, int]:
    """Each kind of decoder linear layer's input size: what a quantization block must divide."""
    return {"hidden size": card.hidden, "intermediate size": card.intermediate,
            "attention output": card.heads * card.head_dim}


def largest_block(card: ArchCard, most: int) -> int:
    """The largest power of two up to `most` that divides every decoder linear layer's inputs."""
    b = 1 << (max(most, 1).bit_length() - 1)
    while b > 1 and any(v % b for v in linear_inputs(card).values()):
        b //= 2
    return b


def mnn_bytes(card: ArchCard, bits: int, block: int, lm_head_bits: int = 8) -> int:
    """The MNN model's size (`compile --backend mnn`): the decoder's linear weights at `bits` with a float32 scale
    and offset per block (per row for block 0), the LM head per row at `lm_head_bits`, an untied embedding as
    bfloat16, the norms float32. Within 1 % of the default model's export at 4 and 8 bits."""
    layer_params, channels = _layer_params(card)
    linear = card.layers * layer_params
    groups = linear // block if block else card.layers * channels
    head = card.vocab * card.hidden * lm_head_bits // 8 + 8 * card.vocab
    embed = 0 if card.tied_embeddings else 2 * card.vocab * card.hidden
    return linear * bits // 8 + 8 * groups + head + embed + 4 * card.hidden * (2 * card.layers + 1)


def weight_bytes(card: ArchCard, precision: str) -> int:
    """The model's weights at `precision`: the embedding table, the LM head and every layer, norms kept 16-bit."""
    b = WEIGHT_BITS[precision]
    layer_bytes = _layer_params(card)[0] * b["layer"] / 8 + 2 * card.hidden * 2
    return int(card.vocab * card.hidden * (b["embed"] + b["lm_head"]) / 8 + card.layers * layer_bytes)


def fit_estimate(card: ArchCard, precision: str, context_length: int, ar: int = 128,
                 max_part_mb: float = parts.DEFAULT_MAX_PART_MB) -> FitEstimate:
    b = WEIGHT_BITS[precision]
    weights = weight_bytes(card, precision)
    # the lookup table stays on the CPU, and decode reads one row of it
    on_htp = weights - int(card.vocab * card.hidden * b["embed"] / 8)
    kv = card.kv_bytes_per_token * context_length
    from .targets import DEFAULT_SOC, decode_tok_s_bound, find_soc

    spec, head4 = PRECISION_SPECS[precision], None
    if spec.block_size is not None:  # LPBQ blocks the head can join
        lpbq_bits = spec.weight_bits + LPBQ_SCALE_BITS / spec.block_size
        small = on_htp - int(card.vocab * card.hidden * (b["lm_head"] - lpbq_bits) / 8)
        head4 = HeadVariant(context_bytes_phone=int(small * parts.CONTEXT_PER_WEIGHT),
                            decode_tok_s_bound=decode_tok_s_bound(find_soc(DEFAULT_SOC), small + kv),
                            ppl_ratio_default_model=spec.ppl_ratio_4bit_head)
    ar = min(ar, max(1, context_length - 1))
    pm = part_model(card, precision, ar, context_length)
    problem: str | None = None
    try:
        ranges: list[range] | None = parts.plan(pm, int(max_part_mb * 2**20))
    except UserError as e:
        ranges, problem = None, e.problem
    from .targets import APP_RAM_SHARE, RUNTIME_RAM_BYTES, fits_phone_ram
    ram = int(weights * 1.1 + kv + RUNTIME_RAM_BYTES)  # +10 % I/O buffers, + the Genie/QNN runtime
    tier = next((g for g in PHONE_RAM_TIERS_GB if fits_phone_ram(ram, g * GiB)), None)
    return FitEstimate(
        precision=precision, context_length=context_length, prompt_ar=ar, weight_bytes=weights, kv_cache_bytes=kv,
        parts=len(ranges) if ranges else None, parts_problem=problem,
        largest_part_mb=parts.mib(max(pm.estimate(r) for r in ranges)) if ranges else None,
        phone_ram_bytes=ram, min_phone_ram_gb=tier,
        context_bytes_phone=int(on_htp * parts.CONTEXT_PER_WEIGHT),
        context_bytes_simulator=int(2 * on_htp * parts.CONTEXT_PER_WEIGHT),
        decode_tok_s_bound=decode_tok_s_bound(find_soc(DEFAULT_SOC), on_htp + kv),
        ppl_ratio_default_model=spec.ppl_ratio_default_model,
        mnn_bytes=mnn_bytes(card, spec.weight_bits, largest_block(card, MNN_BLOCK)), with_4bit_head=head4,
        assumptions=("weights at the preset's bitwidths (LM head 8-bit; the embedding table a 16-bit lookup table "
                     "on the CPU, outside the HTP contexts), 8-bit KV "
                     f"cache, each part's HTP graph under {max_part_mb:,.0f} MiB (the HTP refuses graphs over "
                     f"{parts.HTP_GRAPH_LIMIT_KB // 1024:,} MiB), an app may use about "
                     f"{APP_RAM_SHARE:.0%} of the phone's RAM"),
    )


def fit_table(card: ArchCard, context_length: int, ar: int = 128,
              max_part_mb: float = parts.DEFAULT_MAX_PART_MB) -> list[FitEstimate]:
    return [fit_estimate(card, p, context_length, ar, max_part_mb) for p in PRECISION_SPECS]


class Plan(BaseModel):
    """The precision and bundle form that make the model load where it is going, and why: what `npustudio run`
    chooses when no precision is given, says before the long stages and records."""

    precision: str
    prompt_graphs: bool = Field(description="the bundle keeps the AR-N prompt graphs (else the prompt is read one "
                                            "token at a time: half the contexts)")
    weight_sharing: bool = Field(description="one binary per part holding both graphs (a phone's form)")
    destination: Literal["phone", "simulator"]
    why: str


def plan(fit: list[FitEstimate], destination: Literal["phone", "simulator"], precision: str | None = None) -> Plan:
    """The first precision (best quality first: w8a16, then w4a16) whose parts fit the HTP's per-graph limit, a
    phone's RAM and, as `destination` loads them, one protection domain; `precision` when the user chose one.
    A phone's contexts are weight-shared when one binary per graph would be over one domain (otherwise they stay
    one per graph, the form the simulator can check); the x86 simulator cannot load shared ones, so there a model
    whose prompt and token graphs together are over one domain drops the prompt graphs."""
    budget, gib = parts.PD_BUDGET_BYTES, 2**30
    by = {f.precision: f for f in fit}

    def size(f: FitEstimate) -> int:
        return f.context_bytes_phone if destination == "phone" else f.context_bytes_simulator

    def problem(f: FitEstimate) -> str | None:
        if f.parts is None:
            return "no cut of it fits the HTP's per-graph limit"
        if f.min_phone_ram_gb is None:
            return "it needs more RAM than the phones listed have"
        if size(f) > budget:
            return (f"its contexts ({size(f) / gib:.1f} GiB) would not fit one HTP protection domain "
                    f"(~{budget / gib:.0f} GiB)")
        return None

    if precision is not None:
        chosen, why = by[precision], f"{precision}, as chosen"
    elif (fitting := [f for f in fit if problem(f) is None]):
        chosen = fitting[0]
        why = (f"{chosen.precision}: the best quality that loads on the {destination}" if chosen is fit[0] else
               f"{chosen.precision}: at {fit[0].precision} {problem(fit[0])}")
    else:  # none loads whole: the smallest, and the form below says what is left out
        chosen = fit[-1]
        why = f"{chosen.precision}, the smallest preset: even so {problem(chosen)}"
    whole = chosen.context_bytes_simulator <= budget  # one binary per graph loads: the form the simulator checks
    shared = destination == "phone" and not whole
    prompt = destination == "phone" or whole
    if not prompt:
        why += (f"; the prompt graphs are left out on the simulator (with them its contexts are "
                f"{chosen.context_bytes_simulator / gib:.1f} GiB): the prompt is read one token at a time")
    return Plan(precision=chosen.precision, prompt_graphs=prompt, weight_sharing=shared, destination=destination,
                why=why)

