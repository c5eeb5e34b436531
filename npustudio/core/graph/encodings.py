"""Read AIMET `.encodings` files (schema 1.0.0 and the legacy 0.6.1 dict form) into a per-tensor table.

Each row says what a person tuning mixed precision needs: which layer and role the tensor belongs
to, its bitwidth and granularity, the spread of its scales and the range it can represent. Flags
point at the suspects: weights whose per-channel scales differ by orders of magnitude, activations
whose range is far wider than the same tensor's in the other layers.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..errors import UserError
from ..fsutil import read_json

SCALE_SPREAD_FLAG = 100.0  # max/min channel scale
RANGE_FLAG = 10.0  # activation range vs the median of the same tensor in the other layers

_ROLES = (  # first match wins; matched against module paths with '/' turned into '.'
    (r"past_(key|value)|k_cat|v_cat", "kv-cache"),
    (r"(^|\.)embed(\.|$)", "embedding"),
    (r"(^|\.)lm_head(\.|$)", "lm_head"),
    (r"attn\.q\.\d+", "q"), (r"attn\.k\.\d+", "k"), (r"attn\.v\.\d+", "v"), (r"attn\.o(\.|$)", "o"),
    (r"mlp\.gate", "gate"), (r"mlp\.up", "up"), (r"mlp\.down", "down"),
    (r"norm", "norm"),
)
_LAYER = re.compile(r"layers\.(\d+)|past_(?:key|value)_(\d+)")


class TensorRow(BaseModel):
    name: str
    layer: int | None
    role: str
    kind: str  # param | activation
    bitwidth: int
    symmetric: bool
    granularity: str  # tensor | channel | block
    block_size: int | None = None
    channels: int
    scale_min: float
    scale_median: float
    scale_max: float
    scale_spread: float
    offset: int
    range_min: float
    range_max: float
    flags: list[str] = []
    sqnr_db: float | None = Field(None, description="quantized vs float, dB (sqnr.annotated): a weight against "
                                                   "the adapted weights, an activation over a short eval")
    # per channel (or block) scales and offsets, for a detail plot; left out of the JSON table
    scales: list[float] = Field(default_factory=list, exclude=True, repr=False)
    offsets: list[int] = Field(default_factory=list, exclude=True, repr=False)


class LayerSummary(BaseModel):
    layer: int | None
    tensors: int
    params: int
    activations: int
    weight_bits: list[int]
    activation_bits: list[int]
    max_scale_spread: float
    flagged: int


class EncodingsTable(BaseModel):
    path: str
    version: str
    rows: list[TensorRow]
    layers: list[LayerSummary]
    excluded: list[str]

    def by_name(self, name: str) -> TensorRow:
        return next(r for r in self.rows if r.name == name)


# bytes: the w4a16 encodings of SmolLM2-135M are 29 MB (0.22 B a parameter), so this is one file of ~18 B parameters;
# a larger "encodings file" is not one, and parsed whole it would take several times its size in memory
ENCODINGS_LIMIT = 4 * 2**30


def read(path: str | Path, kinds: tuple[str, ...] = ("activation", "param")) -> EncodingsTable:
    """The table of `path` (its rows of `kinds`); `sqnr.annotated` adds each tensor's SQNR."""
    p = Path(path).expanduser()
    fix = "Pass an .encodings file written by the quantize stage (AIMET schema 1.0.0 or 0.6.1)."
    if not p.is_file():
        raise UserError(f"No encodings file at {p}.", fix)
    data = read_json(p, "encodings file", fix, limit=ENCODINGS_LIMIT)
    if not isinstance(data, dict) or not ({"activation_encodings", "param_encodings"} & data.keys()):
        raise UserError(f"{p.name} is JSON but not an encodings file (no activation_encodings/param_encodings).",
                        fix)
    version = str(data.get("version", "0.6.1"))
    rows: list[TensorRow] = []
    for kind, key in (("activation", "activation_encodings"), ("param", "param_encodings")):
        if kind not in kinds:
            continue
        section = data.get(key, [] if version.startswith("1.") else {})
        try:
            entries = list(_entries(section, version))
        except (TypeError, AttributeError, ValueError, OverflowError) as e:
            raise UserError(f"{p.name}: the {key} section is malformed ({e}).", fix) from e
        for name, enc in entries:
            try:
                rows.append(_row(str(name), kind, enc))
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError) as e:
                raise UserError(f"{p.name}: the encoding of {name!r} is malformed ({type(e).__name__}: {e}).",
                                fix) from e
    excluded = data.get("excluded_layers", []) or []
    if not isinstance(excluded, list):
        raise UserError(f"{p.name}: excluded_layers is {type(excluded).__name__} {str(excluded)[:40]}, not a list "
                        "of names.", fix)
    _kv_carriers(rows)
    _flag(rows)
    return EncodingsTable(path=str(p), version=version, rows=rows, layers=_summaries(rows),
                          excluded=[str(x) for x in excluded])


def _entries(section: Any, version: str) -> Any:
    if isinstance(section, list):  # 1.0.0: [{name, ...}]
        for e in section:
            if not isinstance(e, dict) or "name" not in e:
                raise ValueError(f"entry without a name: {str(e)[:80]}")
            yield e["name"], e
    elif isinstance(section, dict):  # 0.6.1: {name: [per-channel dicts]} (or one dict)
        for name, e in section.items():
            yield name, _legacy(e)
    else:
        raise ValueError(f"expected a list or an object, got {type(section).__name__}")


def _legacy(e: Any) -> dict[str, Any]:
    items = e if isinstance(e, list) else [e]
    if not items or not all(isinstance(x, dict) for x in items):
        raise ValueError("expected a list of encodings")
    sym = str(items[0].get("is_symmetric", "False")).lower() == "true"
    return {"bw": items[0]["bitwidth"], "is_sym": sym, "scale": [x["scale"] for x in items],
            "offset": [x["offset"] for x in items],
            "enc_type": "PER_CHANNEL" if len(items) > 1 else "PER_TENSOR",
            "dtype": str(items[0].get("dtype", "int")).upper()}


MAX_BITS = 32  # what any quantizer here can mean; a larger bitwidth is damage (2**bw would not even fit memory)
MAX_OFFSET = 2**32


def _number(v: Any) -> float:
    """A JSON number (NaN and infinities included: flagged later); anything else is malformed."""
    if isinstance(v, bool) or not isinstance(v, int | float):  # "8" is text, not a bitwidth: refused, not read
        raise TypeError(f"{v!r} is not a number")
    return float(v)


def _whole(v: Any) -> int | None:
    """A whole number, or None for NaN, infinities and fractions (flagged)."""
    x = _number(v) if not isinstance(v, int) else v
    if isinstance(x, int):
        return x
    return int(x) if math.isfinite(x) and x == int(x) else None


def _row(name: str, kind: str, e: dict[str, Any]) -> TensorRow:
    """One tensor's row. Values a quantizer cannot have (NaN or non-positive scales, bitwidths outside
    1-32, offsets beyond the bitwidth) are flagged, not fatal: the table is where a person finds them."""
    scales = [_number(s) for s in _listify(e["scale"])]
    offsets_in = [_whole(o) for o in _listify(e.get("offset") or 0)]
    channels = len(scales)
    if not scales:
        raise ValueError("no scale")
    flags: list[str] = []
    enc_type = str(e.get("enc_type", "PER_TENSOR")).upper()
    bw = _whole(e["bw"])
    block = e.get("block_size")
    if enc_type == "LPBQ":  # int4 blocks with 8-bit per-channel scales: the stored weights are compressed_bw
        bw = _whole(e.get("compressed_bw", bw))
        per_block = [_number(x) for x in e["per_block_int_scale"]]
        blocks = len(per_block) // len(scales)
        scales = [s * per_block[c * blocks + b] for c, s in enumerate(scales) for b in range(blocks)]
        offsets_in = [-(2 ** (bw - 1)) if bw is not None and 1 <= bw <= MAX_BITS else 0]
    gran = {"PER_TENSOR": "tensor", "PER_CHANNEL": "channel", "PER_BLOCK": "block", "LPBQ": "block"}.get(enc_type)
    if gran is None:
        raise ValueError(f"unknown enc_type {enc_type}")
    if bw is None or not 1 <= bw <= MAX_BITS:
        flags.append(f"bitwidth {e.get('compressed_bw', e['bw']) if enc_type == 'LPBQ' else e['bw']} is not a "
                     f"whole number from 1 to {MAX_BITS}")
    bad_scales = [s for s in scales if not (math.isfinite(s) and s > 0)]
    if bad_scales:
        flags.append(f"{len(bad_scales)} scale(s) NaN, infinite, zero or negative (e.g. {bad_scales[0]})")
    if any(o is None or abs(o) > MAX_OFFSET for o in offsets_in):
        flags.append("an offset is NaN, a fraction or out of range")
    good = [s for s in scales if math.isfinite(s) and s > 0]
    offsets = [o if o is not None and abs(o) <= MAX_OFFSET else 0 for o in offsets_in] or [0]
    nan = float("nan")
    lo_r = hi_r = nan
    if not flags:
        levels = 2 ** bw - 1  # type: ignore[operator]
        pairs = [(offsets[i % len(offsets)], sc) for i, sc in enumerate(scales)]
        lo_r, hi_r = min(o * sc for o, sc in pairs), max((o + levels) * sc for o, sc in pairs)
    flat = name.replace("/", ".")
    m = _LAYER.search(flat)
    role = next((r for pat, r in _ROLES if re.search(pat, flat)), "activation")
    return TensorRow(
        name=name, layer=int(m.group(1) or m.group(2)) if m else None, role=role, kind=kind,
        bitwidth=bw if bw is not None else 0, symmetric=bool(e.get("is_sym", False)), granularity=gran,
        block_size=int(block) if block is not None and gran == "block" else None,
        channels=channels,
        scale_min=min(good, default=nan), scale_median=statistics.median(good) if good else nan,
        scale_max=max(good, default=nan), scale_spread=max(good) / min(good) if good else nan,
        offset=int(statistics.median(offsets)), range_min=lo_r, range_max=hi_r, scales=scales, offsets=offsets,
        flags=flags)


def _listify(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def _kv_carriers(rows: list[TensorRow]) -> None:
    """Reshapes/transposes that carry a layer's KV-cache encoding unchanged are KV cache too (8-bit by design)."""
    kv = {(r.layer, r.bitwidth, r.scale_min, r.offset) for r in rows if r.role == "kv-cache"}
    for r in rows:
        if r.kind == "activation" and r.granularity == "tensor" and (r.layer, r.bitwidth, r.scale_min,
                                                                      r.offset) in kv:
            r.role = "kv-cache"


def _flag(rows: list[TensorRow]) -> None:
    by_key: dict[tuple[str, str], list[TensorRow]] = {}
    for r in rows:
        if r.kind == "param" and r.granularity != "tensor" and r.scale_spread > SCALE_SPREAD_FLAG:
            r.flags.append(f"scales differ ×{r.scale_spread:.0f} across channels")
        if r.kind == "activation" and r.layer is not None:
            key = (r.role, _LAYER.sub("layers.N", r.name.replace("/", ".")))
            by_key.setdefault(key, []).append(r)
    for group in by_key.values():
        if len(group) < 3:
            continue
        widths = [r.range_max - r.range_min for r in group]
        for i, (r, w) in enumerate(zip(group, widths, strict=True)):
            others = widths[:i] + widths[i + 1:]
            med = statistics.median(others)
            if med > 0 and w > RANGE_FLAG * med:
                r.flags.append(f"range ×{w / med:.0f} wider than in the other layers")


def _summaries(rows: list[TensorRow]) -> list[LayerSummary]:
    layers: dict[int | None, list[TensorRow]] = {}
    for r in rows:
        layers.setdefault(r.layer, []).append(r)
    out = []
    for layer in sorted(layers, key=lambda x: (x is None, x if x is not None else 0)):
        rs = layers[layer]
        out.append(LayerSummary(
            layer=layer, tensors=len(rs), params=sum(r.kind == "param" for r in rs),
            activations=sum(r.kind == "activation" for r in rs),
            weight_bits=sorted({r.bitwidth for r in rs if r.kind == "param"}),
            activation_bits=sorted({r.bitwidth for r in rs if r.kind == "activation"}),
            max_scale_spread=max((r.scale_spread for r in rs if r.kind == "param"), default=1.0),
            flagged=sum(bool(r.flags) for r in rs)))
    return out
