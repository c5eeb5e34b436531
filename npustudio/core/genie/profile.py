"""Genie profile JSON (`--profile`) -> typed events, a summary, and a roofline beside the measured rates.

Tolerant of missing optional fields (older runtimes, aborted queries, the CPU preview's profile);
a file that is not a Genie profile gets a clear error naming what is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import UserError
from ..fsutil import read_json
from ..targets import Soc, decode_tok_s_bound


class Event(BaseModel):
    type: str
    component: str
    start_us: int | None = None
    stop_us: int | None = None
    duration_us: int | None = None
    init_time_us: int | None = None
    prompt_tokens: int | None = None
    prompt_rate: float | None = None  # tokens/s
    ttft_us: int | None = None
    generated_tokens: int | None = None
    generation_rate: float | None = None  # tokens/s
    generation_time_us: int | None = None
    tokens_per_call: float | None = None  # speculative dialogs: tokens each target call yields ("acceptance rate")


class Profile(BaseModel):
    runner: str  # "genie" or what the file's metadata says (e.g. "preview (CPU)")
    events: list[Event]


class Summary(BaseModel):
    runner: str
    init_s: float | None
    queries: int
    ttft_s: float | None
    prompt_tokens: int | None
    prompt_tok_s: float | None
    generated_tokens: int | None
    generation_tok_s: float | None
    query_s: float | None
    total_s: float | None
    tokens_per_call: float | None = None  # a speculative dialog's tokens per target-graph call (Genie's profile)


_FIELDS = {"init-time": "init_time_us", "num-prompt-tokens": "prompt_tokens", "prompt-processing-rate": "prompt_rate",
           "time-to-first-token": "ttft_us", "num-generated-tokens": "generated_tokens",
           "token-generation-rate": "generation_rate", "token-generation-time": "generation_time_us",
           "token-acceptance-rate": "tokens_per_call"}


_FLOATS = {"prompt_rate", "generation_rate", "tokens_per_call"}  # (num-generated-tokens holds "rate" too: a count)


def parse(text: str, source: str = "profile") -> Profile:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UserError(f"{source} is not JSON ({str(e)[:80] or 'nested too deeply'}).",
                        "Pass the file genie-t2t-run wrote with --profile.") from e
    return from_data(data, source)


def from_data(data: Any, source: str = "profile") -> Profile:
    """A profile from JSON data already read."""
    if not isinstance(data, dict) or not isinstance(data.get("components"), list):
        raise UserError(f"{source} is not a Genie profile: it has no 'components' list.",
                        "Pass the file genie-t2t-run wrote with --profile.")
    events = []
    for ci, comp in enumerate(data["components"]):
        if not isinstance(comp, dict) or not isinstance(comp.get("events", []), list):
            raise UserError(f"{source}: component {ci} is malformed.", "The file is damaged; run again.")
        for ei, ev in enumerate(comp.get("events", [])):
            if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
                raise UserError(f"{source}: event {ei} of component {ci} has no type.", "The file is damaged.")
            row: dict[str, Any] = {"type": ev["type"], "component": str(comp.get("name", ci))}
            fields: list[tuple[str, str, Any, type[int] | type[float]]] = [
                (k, attr, ev.get(k), int)
                for k, attr in (("start", "start_us"), ("stop", "stop_us"), ("duration", "duration_us"))]
            fields += [(k, attr, v.get("value") if isinstance(v := ev.get(k), dict) else v,
                        float if attr in _FLOATS else int) for k, attr in _FIELDS.items()]
            for k, attr, v, kind in fields:
                try:
                    row[attr] = _num(v, kind)
                except ValueError as e:
                    why = "not a finite number" if "finite" in str(e) else "out of a 64-bit counter's range"
                    raise UserError(f"{source}: in event {ei} of component {ci}, {k} is {v}, {why}.",
                                    "The file is damaged: run Genie again with --profile.") from e
            events.append(Event(**row))
    meta = data.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    return Profile(runner=str(meta.get("runner", "genie")), events=events)


def read(path: Path) -> Profile:
    data = read_json(Path(path), "Genie profile", "Pass the file genie-t2t-run wrote with --profile.")
    return from_data(data, str(path))


def summarize(p: Profile) -> Summary:
    creates = [e for e in p.events if e.type == "GenieDialog_create"]
    queries = [e for e in p.events if e.type == "GenieDialog_query"]
    last = queries[-1] if queries else None
    starts = [e.start_us for e in p.events if e.start_us is not None]
    stops = [e.stop_us for e in p.events if e.stop_us is not None]
    init = creates[0].init_time_us or creates[0].duration_us if creates else None
    return Summary(
        runner=p.runner, init_s=_s(init), queries=len(queries),
        ttft_s=_s(last.ttft_us) if last else None, prompt_tokens=last.prompt_tokens if last else None,
        prompt_tok_s=last.prompt_rate if last else None, generated_tokens=last.generated_tokens if last else None,
        generation_tok_s=last.generation_rate if last else None, query_s=_s(last.duration_us) if last else None,
        total_s=_s(max(stops) - min(starts)) if starts and stops else None,
        tokens_per_call=last.tokens_per_call if last else None)


def roofline(target: Soc, weight_bytes: int, kv_bytes_per_token: int, context: int) -> dict[str, float]:
    """Upper bound on decode speed: every generated token reads all weights and the KV cache once."""
    per_token = weight_bytes + kv_bytes_per_token * context
    return {"memory_gb_s": target.memory_gb_s, "bytes_per_token": per_token,
            "decode_tok_s_bound": decode_tok_s_bound(target, per_token)}


def bundle_roofline(bundle: Path, target: Soc | None = None) -> dict[str, float]:
    """The decode roofline of a bundle on `target` (default: the one it was built for): what one generated token
    reads (`decode_bytes`) and its 8-bit KV cache over the bundle's context. The Target page and the profiles
    both show this figure for a built bundle."""
    from .meta import read_metadata

    meta = read_metadata(Path(bundle))
    return roofline(target or meta.target, decode_bytes(Path(bundle)), meta.decoder.kv_bytes_per_token,
                    meta.context_length)


def decode_bytes(bundle: Path) -> int:
    """The context binaries one generated token goes through: every part of the token graph (AR-1), or with
    weight sharing every part's one binary. (The largest binary alone undercounted a model cut in parts, and
    the prompt graph's binaries are not run while generating.)"""
    bins = {f.name: f.stat().st_size for f in Path(bundle).glob("*.bin") if f.is_file()}
    if not bins:
        raise UserError(f"{bundle} holds no context binary (*.bin), so it has no decode roofline.",
                        "Pass a whole bundle folder (`npustudio bundle` writes one), or leave out --bundle.")
    token = [n for n in bins if n.startswith("token_")] or [n for n in bins if n.startswith("shared")] or list(bins)
    return sum(bins[n] for n in token)


def _num(v: Any, kind: type) -> Any:
    """A number of the profile, None for a field that is missing or not a number; NaN and infinities (Genie
    never writes them: the file is damaged) raise ValueError."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        x = kind(v)
    except (TypeError, ValueError, OverflowError):
        if isinstance(v, float):  # int(inf), int(nan)
            raise ValueError(f"{v} is not a finite number") from None
        return None
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError(f"{v} is not a finite number")
    if isinstance(x, int) and not -(2**63) <= x < 2**63:  # Genie's counters are 64-bit
        raise ValueError(f"{v} is out of a 64-bit counter's range")
    return x


def _s(us: int | None) -> float | None:
    return None if us is None else round(us / 1e6, 4)
