"""How a model is cut into parts a phone's HTP can load: one estimate, used by intake and by the compile stage.

QNN's HTP back-end refuses a graph whose estimated allocation exceeds 2,097,152 KB ("graph requires estimated
allocation of … KB, limit is 2097152 KB" -> "memory usage too large" -> error 1002), whatever the phone's RAM.
So a model is cut along the residual stream into parts `…_{i}_of_{n}`, each under that limit with a margin.

The estimate of one part's graph: its weights with 4-bit ones counted as 8-bit, plus a quarter (QNN's own
figure for a public Llama-2-7B prompt part, 8 decoder layers and the LM head at w4a16, was 2,347,229 KB: this
estimate gives ~2.5 GB for it, about 5 % above), plus every graph input and output (the KV cache entries the
part's layers read and write, the logits, the residual stream passed between parts) and twice the largest
activation (the attention scores or the MLP's inner projection). The same `PartModel` is built from the
architecture card before anything runs (`npustudio info`) and from the compiled graphs' real tensors (the
compile stage), so both count the same parts.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from .errors import UserError

HTP_GRAPH_LIMIT_KB = 2_097_152
MARGIN = 0.9  # of the limit: the estimate is ours, not QNN's
DEFAULT_MAX_PART_MB = int(HTP_GRAPH_LIMIT_KB * MARGIN / 1024)  # 1843 MiB
WEIGHT_FACTOR = 1.25
# Genie loads every context of a dialog into one HTP protection domain, a 32-bit address space: measured on the
# simulator, three ~0.9 GB contexts load and a fourth fails ("Failed to find available PD", error 1002)
PD_BUDGET_BYTES = 3 * 2**30
# a context binary's bytes per byte of the weights it holds (measured on SmolLM2-135M: the AR-128 graph's binary
# 219 MB over 191 MB of weights at w8a16, 161 MB over 139 MB at w4a16; the AR-1 graph's a little less)
CONTEXT_PER_WEIGHT = 1.16


class PartModel(BaseModel):
    """Bytes of a model's graph by where they go when it is cut (weights already scaled by WEIGHT_FACTOR)."""

    first: int = Field(description="only in the first part: the embedding table, the token ids")
    layers: list[int] = Field(description="each decoder layer: its weights and the KV entries it reads and writes")
    last: int = Field(description="only in the last part: the final norm, the LM head, the logits")
    each: int = Field(description="in every part: mask, RoPE tables, residual in/out, the largest activations")

    @property
    def total(self) -> int:
        return self.first + sum(self.layers) + self.last + self.each

    def estimate(self, r: range) -> int:
        """Bytes of the part holding layers `r`."""
        return ((self.first if r.start == 0 else 0) + sum(self.layers[k] for k in r)
                + (self.last if r.stop == len(self.layers) else 0) + self.each)


def weight_bytes(weights: float) -> int:
    """Weight bytes as the HTP's estimate counts them (4-bit already widened to 8 by the caller)."""
    return int(weights * WEIGHT_FACTOR)


def plan(model: PartModel, max_bytes: int, parts: int = 0) -> list[range]:
    """Contiguous layer ranges, as few as keep every part's estimate <= `max_bytes` (or exactly `parts`), each
    part as even as the layers allow. Refused when even one layer per part does not fit."""
    n_layers = len(model.layers)
    if parts > n_layers:
        raise UserError(f"{parts} parts were asked for, but the model has only {n_layers} layers to share "
                        "among them.", f"Use at most {n_layers} parts.")
    if parts:
        return _balanced(model, parts)
    for n in range(1, n_layers + 1):
        ranges = _balanced(model, n)
        if max(model.estimate(r) for r in ranges) <= max_bytes:
            return ranges
    worst = max(model.estimate(r) for r in _balanced(model, n_layers))
    raise UserError(f"Even with one decoder layer per part, a part needs about {worst / 2**20:,.0f} MiB on the "
                    f"HTP; the limit used is {max_bytes / 2**20:,.0f} MiB (the HTP refuses more than "
                    f"{HTP_GRAPH_LIMIT_KB // 1024:,} MiB per graph).",
                    "Use a shorter context length (--cl), a smaller prompt step (--ar), w4a16, or a smaller model.")


def _balanced(model: PartModel, n: int) -> list[range]:
    """`n` contiguous ranges minimising the largest part (binary search on that size, greedy packing)."""
    layers = len(model.layers)
    lo, hi = 0, model.total
    best = _pack(model, hi, n)
    while lo < hi:
        mid = (lo + hi) // 2
        got = _pack(model, mid, n)
        if got is None:
            lo = mid + 1
        else:
            hi, best = mid, got
    assert best is not None and len(best) == n and best[-1].stop == layers
    return best


def _pack(model: PartModel, cap: int, n: int) -> list[range] | None:
    """Greedy contiguous packing under `cap` into at most `n` parts, then split the largest runs until there are
    exactly `n` (a part holds at least one layer); None when it does not fit."""
    layers, ranges, start = len(model.layers), [], 0
    while start < layers:
        stop = start + 1
        if model.estimate(range(start, stop)) > cap:
            return None
        while stop < layers and model.estimate(range(start, stop + 1)) <= cap:
            stop += 1
        ranges.append(range(start, stop))
        start = stop
        if len(ranges) > n:
            return None
    while len(ranges) < n:  # fewer were enough: halve the longest until there are n
        k = max(range(len(ranges)), key=lambda i: len(ranges[i]))
        r = ranges[k]
        if len(r) < 2:
            return None
        mid = r.start + len(r) // 2
        ranges[k:k + 1] = [range(r.start, mid), range(mid, r.stop)]
    return ranges


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def kb(n: int) -> int:
    return math.ceil(n / 1024)
