"""Basic against draft-model (`spd`) decoding of one spd bundle, with the real libGenie on the HTP simulator, as JSON.

    .venv/bin/python benchmarks/decoding_bench.py --bundle PROJECT/stages/bundle --json
    .venv/bin/python benchmarks/decoding_bench.py --tiny --json   # builds a tiny target and draft first (~1 min)

The bundle must be an spd bundle (`npustudio bundle --draft D`): `basic` is its target engine alone on the same
binaries. For each prompt the bundle stage checks the draft on (its question, then code, a rewrite of given
text, a list), in the model's chat template, and each mode: the greedy
answer (the two must be equal: lossless), the target-graph calls (Genie's own "token-acceptance-rate", tokens per
target call; 1 for basic), and the phone's estimated decode rate: the roofline over the context binaries read per
token (weights; the KV cache is left out of both modes alike), where one spd iteration reads the target's checking
graph once and the draft's token graph K times, over the tokens it yields (a basic token reads the target's token
graph once). Figures are per prompt, then their means.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npustudio.core import layout
from npustudio.core.genie import decoding, draft, host
from npustudio.core.genie.meta import read_metadata

NAMES = ("chat", "code", "rewrite", "list")  # the bundle's own question, then draft.CHECK_QUESTIONS


def prompts(bundle: Path, question: str) -> dict[str, str]:
    """The prompts the bundle stage checks the draft on, in the model's chat template."""
    from npustudio.core.chat import chat_model

    return dict(zip(NAMES, draft.check_prompts(chat_model(bundle).tok, question), strict=True))


def run(bundle: Path, tokens: int) -> dict[str, Any]:
    meta = read_metadata(bundle)
    if meta.decoding != "spd" or not meta.draft:
        raise SystemExit(f"{bundle} is not a draft-model (spd) bundle: bundle it with --draft first")
    k = int(meta.draft["draft_len"])
    cfg = json.loads((bundle / layout.GENIE_CONFIG).read_text())
    basic = json.loads(json.dumps(cfg))
    d = basic["dialog"]
    d["type"], d["engine"] = "basic", {kk: v for kk, v in d["engine"][1].items() if kk != "role"}
    d.pop("spd")
    per_call = decoding.bytes_per_call(bundle)
    rows = []
    with tempfile.NamedTemporaryFile("w", dir=bundle, prefix=".bench-", suffix=".json", delete=False) as f:
        json.dump(basic, f)
    basic_path = Path(f.name)
    try:
        for name, prompt in prompts(bundle, meta.question).items():
            a = host.run(basic_path, prompt, lambda _s: None, max_tokens=tokens)
            b = host.run(bundle / layout.GENIE_CONFIG, prompt, lambda _s: None, max_tokens=tokens)
            per_token = draft._acceptance(b.profile) or 1.0
            rows.append({"prompt": name, "same_answer": a.text == b.text, "answer_chars": len(a.text),
                         "tokens_per_target_call": {"basic": 1.0, "spd": per_token},
                         "phone_decode_tok_s": decoding.phone_rates(bundle, meta.target, k, per_token)})
    finally:
        basic_path.unlink(missing_ok=True)
    mean = {m: round(sum(r["phone_decode_tok_s"][m] for r in rows) / len(rows), 1) for m in ("basic", "spd")}
    return {"bundle": str(bundle), "target": meta.model, "draft": meta.draft["model"], "draft_len": k,
            "soc": meta.target.soc, "bytes_per_call": per_call, "prompts": rows,
            "all_same_answer": all(r["same_answer"] for r in rows),
            "mean_tokens_per_target_call": round(sum(r["tokens_per_target_call"]["spd"] for r in rows) / len(rows), 3),
            "mean_phone_decode_tok_s": mean, "spd_over_basic": round(mean["spd"] / mean["basic"], 3)}


def _tiny(work: Path) -> Path:
    """A tiny target and a draft with its weights (no embedding table out of the graphs), bundled as spd."""
    from npustudio.core import pipeline
    from npustudio.core.genie.bundle import BundleOptions
    from npustudio.core.progress import State
    from npustudio.core.project import Project
    from tests.conftest import genie_pipeline, make_tiny_model

    model = make_tiny_model(work / "m", "llama64")
    target = genie_pipeline(work / "target", model, embedding_lut=False)
    genie_pipeline(work / "draft", model, embedding_lut=False)
    assert isinstance(target, Project)
    pipeline.bundle(target, BundleOptions(draft=str(work / "draft"), draft_len=4), State(), force=True)
    return target.stage_dir("bundle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, help="an spd bundle folder")
    ap.add_argument("--tiny", action="store_true", help="build a tiny target and draft first")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per answer")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = _tiny(Path(tmp)) if a.tiny else a.bundle
        if bundle is None:
            raise SystemExit("give --bundle or --tiny")
        out = run(Path(bundle), a.tokens)
    print(json.dumps(out, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
