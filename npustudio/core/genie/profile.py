"""Genie profile JSON (`--profile`) -> typed events, a summary, and a roofline beside the measured rates.

Tolerant of missing optional fields (older runtimes, aborted queries, the CPU preview's profile);
a file that is not a Genie profile gets a clear error naming what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import UserError
from ..targets import Soc


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


_FIELDS = {"init-time": "init_time_us", "num-prompt-tokens": "prompt_tokens", "prompt-processing-rate": "prompt_rate",
           "time-to-first-token": "ttft_us", "num-generated-tokens": "generated_tokens",
           "token-generation-rate": "generation_rate", "token-generation-time": "generation_time_us"}


def parse(text: str, source: str = "profile") -> Profile:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{source} is not JSON ({e}).", "Pass the file genie-t2t-run wrote with --profile.") from e
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
            for k, attr in (("start", "start_us"), ("stop", "stop_us"), ("duration", "duration_us")):
                row[attr] = _num(ev.get(k), int)
            for k, attr in _FIELDS.items():
                v = ev.get(k)
                row[attr] = _num(v.get("value") if isinstance(v, dict) else v, float if "rate" in k else int)
            events.append(Event(**row))
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    return Profile(runner=str(meta.get("runner", "genie")), events=events)


def read(path: Path) -> Profile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"Cannot read the profile {path}: {e.strerror}.", "Check the path.") from e
    return parse(text, str(path))


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
        total_s=_s(max(stops) - min(starts)) if starts and stops else None)


def roofline(target: Soc, weight_bytes: int, kv_bytes_per_token: int, context: int) -> dict[str, float]:
    """Upper bound on decode speed: every generated token reads all weights and the KV cache once."""
    per_token = weight_bytes + kv_bytes_per_token * context
    bw = target.memory_gb_s * 1e9
    return {"memory_gb_s": target.memory_gb_s, "bytes_per_token": per_token,
            "decode_tok_s_bound": round(bw / per_token, 1)}


def bundle_roofline(bundle: Path) -> dict[str, float]:
    """The decode roofline of a bundle: its target's bandwidth, its largest binary, its 8-bit KV cache."""
    from .bundle import METADATA

    try:
        meta = json.loads((Path(bundle) / METADATA).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{bundle} is not a bundle folder (no readable {METADATA}).",
                        "Pass the folder `npustudio bundle` wrote.") from e
    weights = max(f.stat().st_size for f in Path(bundle).glob("*.bin"))
    dec = meta["decoder"]
    kv = 2 * dec["layers"] * dec["kv_heads"] * dec["head_dim"]  # 8-bit K and V per token
    return roofline(Soc(**meta["target"]), weights, kv, meta["context_length"])


def _num(v: Any, kind: type) -> Any:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return kind(v)
    except (TypeError, ValueError):
        return None


def _s(us: int | None) -> float | None:
    return None if us is None else round(us / 1e6, 4)
