"""Draft-model decoding (Genie's `spd` dialog): a second, smaller compiled model in the bundle proposes tokens, the
target checks several in one call.

On the HTP a decode call is bound by reading the weights, so the target's AR-N call that checks K proposed tokens
costs about one AR-1 call, and every proposal it accepts is a token for free. With greedy sampling the answer is the
target's own (the target keeps a proposal only where it would have chosen it). What must hold for that, checked here
before anything is written: the same token ids for the same text and the same special tokens (the draft's ids go
straight into the target), a context at least as long, a target graph wide enough for K + 1 tokens, and graphs that
take token ids (Genie 1.21's speculative dialogs refuse the embedding lookup table: "embedding input type is not
supported by dialog").
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import layout, stages
from ..errors import UserError
from ..fsutil import link_or_copy, read_json
from ..graph.embedding_lut import INPUT as LUT_INPUT
from ..models import ArchCard
from ..results import CompileResult, GraphSpec
from ..stages import load_card, load_graphs

NO_LUT_FIX = "Compile it with --no-embedding-lut (`npustudio compile --project P --no-embedding-lut --force`)."


@dataclass
class Model:
    """One side of the pair: what its compile and adapt stages recorded."""

    project: Path
    compile_dir: Path
    adapt_dir: Path
    card: ArchCard
    comp: CompileResult
    graphs: list[GraphSpec]


def open_model(project: Path, what: str = "draft") -> Model:
    """A compiled project as one side of the pair; UserError when it has no compiled graphs."""
    project = Path(project).resolve()
    compile_dir, adapt_dir = layout.stage_dir(project, stages.COMPILE.name), layout.stage_dir(project,
                                                                                              stages.ADAPT.name)
    if not (compile_dir / layout.COMPILE_RESULT).is_file():
        raise UserError(f"The {what} project {project} has no compiled graphs.",
                        f"Take the {what} model through the compile stage first (`npustudio run MODEL --project "
                        f"{project} --no-embedding-lut`).")
    return Model(project, compile_dir, adapt_dir, load_card(adapt_dir), stages.COMPILE.load(compile_dir),
                 load_graphs(adapt_dir))


def check_pair(target: Model, draft: Model, draft_len: int) -> None:
    """UserError naming the first difference that would make the draft's proposals wrong for the target, or a
    form Genie's speculative dialog does not take."""
    for who, m in (("target", target), ("draft", draft)):
        if LUT_INPUT in m.comp.io:
            raise UserError(f"The {who}'s graphs take Genie's embedding lookup table, which Genie's speculative "
                            "dialogs refuse (\"embedding input type is not supported by dialog\").", NO_LUT_FIX)
    if draft.comp.backend != target.comp.backend:
        raise UserError(f"The draft was compiled by {draft.comp.backend}, the target by {target.comp.backend}.",
                        "Compile both the same way.")
    if draft.comp.target != target.comp.target:
        raise UserError(f"The draft was compiled for {draft.comp.target}, the target for {target.comp.target}.",
                        f"Compile the draft for {target.comp.target} (`--target {target.comp.target}`).")
    check_adapted(target.adapt_dir, draft, draft_len)


def check_adapted(target_adapt: Path, draft: Model, draft_len: int) -> None:
    """What can be checked once the target is adapted (before its hours of quantizing and compiling): the draft's
    graphs take token ids, the same tokens, a context as long, a target graph wide enough, a draft token graph."""
    if LUT_INPUT in draft.comp.io:
        raise UserError("The draft's graphs take Genie's embedding lookup table, which Genie's speculative dialogs "
                        "refuse (\"embedding input type is not supported by dialog\").", NO_LUT_FIX)
    target_card, target_graphs = load_card(target_adapt), load_graphs(target_adapt)
    _same_tokens(target_card, target_adapt, draft)
    t_cl, d_cl = target_graphs[0].cl, draft.graphs[0].cl
    if d_cl < t_cl:
        raise UserError(f"The draft's context ({d_cl} tokens) is shorter than the target's ({t_cl}): it could not "
                        "follow a long conversation.", f"Adapt the draft with --cl {t_cl} or more.")
    widest = max(g.ar for g in target_graphs)
    if widest < draft_len + 1:
        raise UserError(f"The target checks {draft_len} proposed tokens and the last accepted one in one call, which "
                        f"needs a graph of AR-{draft_len + 1} or wider; its widest is AR-{widest}.",
                        f"Use --draft-len {max(widest - 1, 1)} or less, or adapt the target with --ar "
                        f"{draft_len + 1} or more.")
    if not any(g.ar == 1 for g in draft.graphs):
        raise UserError("The draft has no AR-1 (token) graph to propose tokens one at a time.",
                        "Adapt and compile the draft again: its token graph is made by default.")


def _same_tokens(t: ArchCard, target_adapt: Path, draft: Model) -> None:
    d = draft.card
    if d.vocab != t.vocab:
        raise UserError(f"The draft's vocabulary has {d.vocab:,} tokens, the target's {t.vocab:,}: its token ids "
                        "would mean other words to the target.", "Pick a draft model of the target's family that "
                        "shares its tokenizer (e.g. a smaller model of the same series).")
    if (d.bos_id, list(d.eos_ids)) != (t.bos_id, list(t.eos_ids)):
        raise UserError(f"The draft's special tokens differ from the target's: BOS {d.bos_id} and EOS {d.eos_ids} "
                        f"against BOS {t.bos_id} and EOS {t.eos_ids}.",
                        "Pick a draft model that shares the target's tokenizer.")
    tt, dt = _tokenizer(target_adapt), _tokenizer(draft.adapt_dir)
    t_vocab, d_vocab = _ids(tt), _ids(dt)
    if t_vocab != d_vocab:
        only = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[0]
        where = "target" if only in t_vocab.items() else "draft"
        raise UserError(f"The draft's tokenizer maps text to other ids than the target's: {only[0]!r} is id {only[1]} "
                        f"only in the {where}'s.", "Pick a draft model that shares the target's tokenizer.")
    t_special = {(a.get("content"), a.get("id")) for a in tt.get("added_tokens", []) if a.get("special")}
    d_special = {(a.get("content"), a.get("id")) for a in dt.get("added_tokens", []) if a.get("special")}
    if t_special != d_special:
        diff = sorted(t_special ^ d_special, key=str)[0]
        raise UserError(f"The draft's special tokens differ from the target's: {diff[0]!r} (id {diff[1]}) is in one "
                        "tokenizer only.", "Pick a draft model that shares the target's tokenizer.")
    if tt.get("model", {}).get("merges") != dt.get("model", {}).get("merges"):
        raise UserError("The draft's tokenizer splits text differently from the target's (its merges differ), so "
                        "the same text would become other tokens.",
                        "Pick a draft model that shares the target's tokenizer.")


def _tokenizer(adapt_dir: Path) -> dict[str, Any]:
    data = read_json(adapt_dir / layout.TOKENIZER, "tokenizer", "Adapt the model again.")
    if not isinstance(data, dict):
        raise UserError(f"{adapt_dir / layout.TOKENIZER} is not a tokenizer.", "Adapt the model again.")
    return data


def _ids(tok: dict[str, Any]) -> dict[str, int]:
    """Every token's id: the model's vocabulary and the added tokens."""
    vocab = tok.get("model", {}).get("vocab", {})
    out = dict(vocab) if isinstance(vocab, dict) else {str(v[0]): i for i, v in enumerate(vocab)}  # unigram: a list
    out.update({a["content"]: a["id"] for a in tok.get("added_tokens", []) if "content" in a and "id" in a})
    return out


def link(draft: Model, out_dir: Path) -> list[str]:
    """The draft's context binaries into the bundle folder under their own names; returns them in load order."""
    shared = draft.comp.backend == "qairt" or draft.comp.weight_shared
    names: list[str] = []
    for g in draft.comp.graphs:
        name = f"{layout.DRAFT_PREFIX}{g.graph}.bin"
        if shared:
            part = re.search(r"_\d+_of_\d+$", g.graph)
            name = f"{layout.DRAFT_PREFIX}shared{part.group(0) if part else ''}.bin"
        if name not in names:
            link_or_copy(draft.compile_dir / g.context_bin, out_dir / name)
            names.append(name)
    return names


def describe(draft: Model, draft_len: int, bins: list[str]) -> dict[str, Any]:
    """What metadata.json says of the draft (no path of this computer: the project folder's name only)."""
    return {"model": draft.card.source, "project": draft.project.name, "draft_len": draft_len,
            "context_length": draft.graphs[0].cl, "graphs": [{"name": g.name, "ar": g.ar} for g in draft.graphs],
            "binaries": bins}


CHECK_TOKENS = 24  # greedy tokens compared between the target alone and the target with its draft
# asked beside the bundle's own question: a chat answer, code, a rewrite of given text, a list. One prompt was not
# enough: a draft that left the sample answer alone changed the rewrite's (the default model, measured)
CHECK_QUESTIONS = ("Write a Python function that adds two numbers.",
                   "Rewrite more politely: give me the report now.",
                   "List the days of the week.")


def check_prompts(tok: Any, question: str) -> list[str]:
    """The prompts the draft is checked on, in the model's chat template: the bundle's question, then the fixed
    set (a base model without a template is asked them as plain text)."""
    from .config import sample_prompt

    return [sample_prompt(tok, q) for q in dict.fromkeys((question, *CHECK_QUESTIONS))]


def check_lossless(bundle_dir: Path, config: dict[str, Any], prompts: list[str], tokens: int = CHECK_TOKENS,
                   stop: threading.Event | None = None) -> dict[str, Any]:
    """Run each prompt greedily through the draft-model dialog and through the target alone on the same binaries
    (the real libGenie on the HTP simulator, each dialog loaded once), and compare the answers. Lossless decoding
    must give the same text for every prompt; Genie's tokens per target call on the first (the sample question) is
    returned. UserError, with both answers, on the first prompt where they differ; `Cancelled` once `stop` is set
    (Genie's query aborted where it is)."""
    import copy

    from ..fsutil import atomic_write_json
    from . import host

    basic = copy.deepcopy(config)
    d = basic["dialog"]
    target = next(e for e in d["engine"] if e.get("role") == "target")
    d["type"], d["engine"] = "basic", {k: v for k, v in target.items() if k != "role"}
    d.pop("spd", None)
    for c in (basic, config):  # the comparison is only meaningful greedy
        c["dialog"]["sampler"] |= {"greedy": True, "top-k": 1}
    answers: dict[str, list[str]] = {}
    rates: list[float | None] = []
    for name, cfg in (("basic", basic), ("spd", config)):
        path = Path(bundle_dir) / f".check-{name}.json"  # beside the real config: the same file names reach the files
        try:
            atomic_write_json(path, cfg)
            results, profile = host.run_each(path, prompts, tokens, stop)
        finally:
            path.unlink(missing_ok=True)
        answers[name] = [r.text for r in results]
        if name == "spd":
            rates = _acceptances(profile)
    for i, (a, b) in enumerate(zip(answers["basic"], answers["spd"], strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            rate = rates[i] if i < len(rates) and rates[i] is not None else "?"
            which = "the sample question" if i == 0 else f"check question {i + 1} of {len(prompts)}"
            raise UserError(f"Genie's draft-model decoding changed the answer, which it must not do with greedy "
                            f"sampling: on {which} the target alone says {a[max(0, at - 20):at + 30]!r}, with its "
                            f"draft {b[max(0, at - 20):at + 30]!r} (they part at character {at}; {rate} tokens per "
                            f"target call).",
                            "Bundle without --draft. A draft with the target's own weights gives the same answers; "
                            "libGenie 1.21 on the HTP simulator was measured to change them whenever it rejects "
                            "a draft's tokens.")
    # the figure of the dialog's first query, the sample question: Genie's profile has no other
    return {"tokens_compared": tokens, "prompts": len(prompts), "same_answer": True,
            "tokens_per_target_call": rates[0] if rates else None}


def _acceptances(profile: str | None) -> list[float | None]:
    """Genie's own figure for each query of a profile: tokens per target call ("token-acceptance-rate"). libGenie
    1.21 gives it for a dialog's first query only (null after a reset, measured): later ones are None."""
    import json

    if not profile:
        return []
    return [None if ev["token-acceptance-rate"].get("value") is None
            else round(float(ev["token-acceptance-rate"]["value"]), 3)
            for comp in json.loads(profile).get("components", []) for ev in comp.get("events", [])
            if ev.get("type") == "GenieDialog_query" and isinstance(ev.get("token-acceptance-rate"), dict)]


def _acceptance(profile: str | None) -> float | None:
    """Genie's own figure for a one-query profile: tokens per target call (toks/iteration)."""
    rates = _acceptances(profile)
    return rates[0] if rates else None
