"""How the views (the window and the CLI) write numbers for people: one wording for both."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.model_fit import FitEstimate
    from .core.results import AdapterKept


def format_value(v: Any) -> str:
    """A card value as people read it: counts with thousands separators, floats without float32 noise
    (an eps stored as 9.999999747e-06 reads 1e-05), everything else as is."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def human_number(x: float | None) -> str:
    """A measured figure to the precision that matters, three significant digits: 157.0962 → 157, 38.2117 → 38.2,
    0.81134 → 0.811, 12345.6 → 12,346; "—" for a figure the profile does not have."""
    if x is None:
        return "—"
    if not x or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def per_precision(sizes: dict[str, int]) -> str:
    """Byte counts keyed by precision, in one phrase: "22.7 GB at w8a16, 22.4 GB at w4a16"."""
    return ", ".join(f"{human_bytes(n)} at {p}" for p, n in sizes.items())


def kept_int8(groups: list[str], share: float) -> str:
    """What `--int8-budget` kept at 8 bits, in one line: the groups and their share of the decoder's linear weights."""
    return f"{', '.join(groups) or 'nothing'} ({share:.1%} of the decoder's linear weights)"


def adapter_kept(k: AdapterKept) -> str:
    """What quantization kept of a merged LoRA adapter, in one line (the CLI's and the Quantize page's)."""
    worst = "" if k.kept_min is None else f"{k.kept_min:.0%}"
    if k.flagged:
        return (f"{k.flagged} of {k.modules} modules have most of their update under half a quantization step "
                f"(the worst keeps {worst}): rounding can erase it (per module: encodings FILE --lora)")
    return f"all {k.modules} modules keep at least {worst} of their update at half a quantization step or more"


def four_bit_head_note(f: FitEstimate) -> str | None:
    """What `--lm-head-bits 4` would change at `f`'s precision, in one sentence (None where it does not apply)."""
    h = f.with_4bit_head
    if h is None:
        return None

    def ppl(r: float | None) -> str:
        return f"×{r:.3f}" if r else "not measured"

    return (f"{f.precision} with --lm-head-bits 4 (the LM head in 4-bit blocks too): bundle "
            f"{human_bytes(h.context_bytes_phone)} for a phone against {human_bytes(f.context_bytes_phone)}, "
            f"decode bound {h.decode_tok_s_bound:,.0f} tok/s against {f.decode_tok_s_bound:,.0f}; the default "
            f"model's perplexity {ppl(h.ppl_ratio_default_model)} against {ppl(f.ppl_ratio_default_model)}")
