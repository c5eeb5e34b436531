"""Decode speed on this CPU: the MNN model (MNN's runtime, as the chat runs it) against torch, side by side.

One run, the same greedy prompt for each: the MNN stage's model through the chat's engine (`chat.MnnEngine`: MNN's
prompt path, then one decode step a token; its answer, and exactly --tokens tokens past the end of turn) and through
MNN's `generate` (its own counters, to the end of turn); the float model in torch with a KV cache (Hugging Face
`generate`, exactly --tokens tokens); and, when the project has a current Genie bundle, its CPU preview (the
desktop chat's fast runner, to the end of turn). The MNN stage is made first when the
project has none at the default options (`npustudio compile --backend mnn` on the embedded default model).
Prints JSON: tok/s and TTFT per runner, and the ratios of MNN's forced run against torch's (same token count)
and the preview's.
Usage: python benchmarks/mnn_bench.py [--project DIR] [--tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", default=None, help="project folder (default: a fresh one in a temporary folder)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print only the JSON (else a summary line first, on stderr)")
    a = ap.parse_args()

    import torch

    from npustudio.core import chat, layout, models, pipeline, stages
    from npustudio.core.genie import host, profile
    from npustudio.core.progress import State
    from npustudio.core.stage_options import DEFAULT_QUESTION, MnnOptions

    tmp = tempfile.TemporaryDirectory(prefix="mnn-bench-")
    root = Path(a.project) if a.project else Path(tmp.name) / "p"
    with pipeline.opened(root) as project:
        t0 = time.perf_counter()  # the stage at the default options: kept when the project has it, else made
        pipeline.execute.mnn(project, MnnOptions(), State())
        made_s = round(time.perf_counter() - t0, 1)
        stage = project.stage_dir("mnn")
        bundle = project.stage_dir("bundle")
        has_bundle = pipeline.stage_status(project).get("bundle") == "done"
        model_ref = project.choices().model
    rec = stages.MNN.load(stage)
    out: dict[str, object] = {"project": str(root), "tokens": a.tokens, "cores": len(os.sched_getaffinity(0)),
                              "mnn": {"bits": rec.bits, "block": rec.block, "model_bytes": rec.model_bytes,
                                      "ppl_ratio": round(rec.ppl_ratio, 4), "stage_s": made_s}}

    session_model = chat.chat_model(stage)
    prompt = chat.ChatSession(stage, chat.MnnEngine(stage, max_tokens=a.tokens)).prompt_for(DEFAULT_QUESTION, [])
    engine = chat.MnnEngine(stage, max_tokens=a.tokens)
    engine.ask(prompt, lambda _s: None, None)  # loads the model; the second answer is the one timed
    t0 = time.perf_counter()
    text, _stopped, _ = engine.ask(prompt, lambda _s: None, None)
    wall = time.perf_counter() - t0
    pieces = len(session_model.tok(text, add_special_tokens=False)["input_ids"])
    out["mnn_chat"] = {"decode_tok_s": round(engine.figures["generation_tok_s"], 2),
                       "ttft_s": round(engine.figures["ttft_s"], 4), "wall_s": round(wall, 3), "tokens": pieces,
                       "answer": text}

    from npustudio.core.mnn.runtime import MnnModel

    ids = session_model.tok(prompt, add_special_tokens=False)["input_ids"]
    ids = ([rec.bos_id] if rec.bos_id is not None else []) + list(ids)
    mnn = MnnModel(stage / layout.MNN_MODEL)
    # the chat's path for exactly --tokens tokens, past the end of turn (as torch is held to below)
    forced = mnn.stream(ids, a.tokens, lambda _t: None)
    out["mnn_chat_forced"] = {"decode_tok_s": round(forced.decode_tok_s, 2), "ttft_s": round(forced.prefill_s, 4),
                              "tokens": forced.answer_tokens + 1}
    answer, t = mnn.answer(ids, a.tokens)
    out["mnn_generate"] = {"decode_tok_s": round(t.decode_tok_s, 2), "prefill_tok_s": round(t.prefill_tok_s, 1),
                           "tokens": len(answer)}
    del mnn

    lm = models.load(pipeline.resolve(model_ref))
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    x = torch.tensor([ids])
    with torch.inference_mode():
        lm.model.generate(x, max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        first = lm.model.generate(x, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen = lm.model.generate(x, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
        total = time.perf_counter() - t0
    n = gen.shape[1] - x.shape[1]
    torch_tok_s = (n - 1) / max(total - ttft, 1e-9)
    out["torch_float"] = {"decode_tok_s": round(torch_tok_s, 2), "ttft_s": round(ttft, 4), "tokens": int(n),
                          "dtype": str(next(lm.model.parameters()).dtype), "same_first_token":
                          int(first[0, -1]) == (answer[0] if answer else -1)}
    del lm
    mnn_tok_s = forced.decode_tok_s
    out["mnn_vs_torch_float"] = round(mnn_tok_s / torch_tok_s, 2)
    if has_bundle:
        with tempfile.TemporaryDirectory() as ptmp:
            prof = Path(ptmp) / "preview.json"
            host.run(bundle / layout.GENIE_CONFIG, prompt, lambda _s: None, prof, max_tokens=a.tokens, preview=True)
            s = profile.summarize(profile.read(prof))
        out["preview_cpu"] = {"decode_tok_s": s.generation_tok_s, "ttft_s": s.ttft_s,
                              "tokens": s.generated_tokens}
        if s.generation_tok_s:
            out["mnn_vs_preview"] = round(mnn_tok_s / s.generation_tok_s, 2)
    else:
        out["preview_cpu"] = "no current Genie bundle in the project (run `npustudio run --project P` first)"
    if not a.json:
        print(f"MNN {mnn_tok_s:.1f} tok/s against torch {torch_tok_s:.1f} (x{out['mnn_vs_torch_float']})"
              + (f" and the preview (x{out['mnn_vs_preview']})" if "mnn_vs_preview" in out else ""), file=sys.stderr)
    print(json.dumps(out, indent=2))
    tmp.cleanup()


if __name__ == "__main__":
    main()
