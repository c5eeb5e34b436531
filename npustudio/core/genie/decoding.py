"""How the phone decodes a bundle: Genie's dialog types, which of them NPU Studio builds, and why the others are
refused.

Only modes whose greedy answer is proven the target's own ship: `basic` (one token per call) and `spd` (a draft
model proposes, the target checks; the bundle stage runs the sample both ways and refuses a draft that changes the
answer). The rest of libGenie 1.21's speculative dialogs are refused with what they lack, measured or read from
Genie's own sources, so that "faster decoding" never means a different answer or a process that aborts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from .. import layout
from ..errors import UserError
from ..targets import Soc, decode_tok_s_bound

Decoding = Literal["basic", "spd", "lade", "ssd-q1", "eaglet"]
BUILT: tuple[str, ...] = ("basic", "spd")

REFUSED: dict[str, tuple[str, str]] = {
    "lade": ("Lookahead decoding (`lade`) is not built: with libGenie 1.21 on the HTP simulator its greedy answer "
             "differed from basic decoding's from the 2nd token whenever ngram was 3 or more (its default), it went "
             "on past the token limit, and at the end of the context libGenie aborted the process (std::terminate). "
             "A bundle that may answer differently or crash the app is not offered.",
             "Use draft-model decoding: `--draft DRAFT_PROJECT` (a smaller compiled model with the same tokenizer)."),
    "ssd-q1": ("Self-speculative decoding (`ssd-q1`) needs artefacts Qualcomm trains for each model: forecast-token "
               "embeddings appended after the vocabulary (token ids from the vocabulary's size up) and a learned KV "
               "prefix that Genie restores from `forecast-prefix-name` before the first call. No public recipe "
               "produces them, so NPU Studio cannot make them for this model.",
               "Use draft-model decoding: `--draft DRAFT_PROJECT`; or deploy a model Qualcomm published with SSD "
               "assets (AI Hub's `*_ssd` models) with its own bundle."),
    "eaglet": ("Eaglet decoding (`eaglet`) needs a draft head trained on the target's hidden states (EAGLE-style), "
               "compiled with its own KV cache and branch layout as Genie expects; its training recipe and graph "
               "format are not public, so NPU Studio cannot make one.",
               "Use draft-model decoding: `--draft DRAFT_PROJECT` (a smaller compiled model with the same "
               "tokenizer)."),
}


def resolve(mode: str | None, draft: str | None) -> Literal["basic", "spd"]:
    """The dialog a bundle is built with: `mode` as asked (None: `spd` with a draft, else `basic`), refused when it
    cannot be built exactly or does not match the draft given."""
    if mode in REFUSED:
        raise UserError(*REFUSED[mode])
    if mode not in (None, *BUILT):
        raise UserError(f"Unknown decoding {mode!r}.", f"Choose one of: {', '.join((*BUILT, *REFUSED))}.")
    if mode == "spd" and not draft:
        raise UserError("Draft-model decoding (`spd`) needs a draft model.",
                        "Add --draft DRAFT_PROJECT: a compiled project of a smaller model with the same tokenizer.")
    if mode == "basic" and draft:
        raise UserError("A draft model was given with basic decoding, which never calls it.",
                        "Leave --draft out for basic decoding, or choose --decoding spd.")
    return "spd" if draft else "basic"


def bytes_per_call(bundle_dir: Path) -> dict[str, int]:
    """Bytes one call of each graph reads on a phone: its context binary (the weights dominate). With weight
    sharing one binary holds both graphs and one call reads its weights once."""
    size = {p.name: p.stat().st_size for p in Path(bundle_dir).glob("*.bin")}
    target = {k: v for k, v in size.items() if not k.startswith(layout.DRAFT_PREFIX)}
    drafted = {k[len(layout.DRAFT_PREFIX):]: v for k, v in size.items() if k.startswith(layout.DRAFT_PREFIX)}

    def of(files: dict[str, int], kind: str) -> int:
        return sum(v for k, v in files.items() if k.startswith((kind, "shared")))

    return {"target_token": of(target, "token_"), "target_check": of(target, "prompt_"),
            "draft_token": of(drafted, "token_")}


def phone_rates(bundle_dir: Path, soc: Soc, draft_len: int | None, tokens_per_call: float | None
                ) -> dict[str, float]:
    """The phone's decode rate per mode, the roofline over the bytes each token reads: a basic token reads the
    target's token graph once; one draft-model iteration reads the target's checking graph once and the draft's
    token graph `draft_len` times, over the `tokens_per_call` it yields (Genie's measured figure; absent: no spd
    rate). The KV cache is left out of both alike."""
    per = bytes_per_call(bundle_dir)
    rates = {"basic": decode_tok_s_bound(soc, per["target_token"])} if per["target_token"] else {}
    if draft_len and tokens_per_call and per["target_check"] and per["draft_token"]:
        spd = (per["target_check"] + draft_len * per["draft_token"]) / tokens_per_call
        rates["spd"] = decode_tok_s_bound(soc, spd)
    return rates
