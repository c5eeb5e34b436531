"""Cost of the adapt stage on a model (default: the embedded SmolLM2-135M), printed as JSON.

Each step's wall time and the process's peak RSS after it; the adapted graphs' evaluation is also given as a
ratio against the original transformers model evaluating the same windows side by side (baseline = 1.0).

    .venv/bin/python benchmarks/adapt_cost.py [MODEL] [--ar 128] [--cl 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from npustudio.core import model_source, models
from npustudio.core.adapt import adapt_model
from npustudio.core.evaluate import compare, hf_logits_fn, load_corpus
from npustudio.core.graph import store
from npustudio.core.graph.kv_cache import KVCacheRunner
from npustudio.core.progress import peak_rss_mb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--ar", type=int, default=128)
    ap.add_argument("--cl", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(2)
    steps: dict[str, dict[str, float]] = {}

    def mark(name: str, t0: float) -> float:
        steps[name] = {"seconds": round(time.perf_counter() - t0, 2), "peak_rss_mb": round(peak_rss_mb())}
        return time.perf_counter()

    t = time.perf_counter()
    lm = models.load(model_source.download(model_source.resolve_source(a.model)))
    t = mark("load", t)
    model, inv = adapt_model(lm)
    t = mark("adapt_weights", t)
    ids = lm.tokenizer(load_corpus("default"))["input_ids"]
    window = min(512, a.cl)
    base = compare(ids, hf_logits_fn(lm.model), window=window)
    t = mark("baseline_hf_eval", t)
    runner = KVCacheRunner.over(model, a.ar, a.cl, inv)
    res = compare(ids, partial(runner.score, decode_tokens=a.decode_tokens), window=window)
    t = mark("adapted_eval", t)
    with tempfile.TemporaryDirectory() as d:
        files = store.save(model, inv, Path(d))
        size = sum(f.stat().st_size for f in files)
    mark("save", t)
    json.dump({
        "model": lm.card.source, "ar": a.ar, "cl": a.cl, "eval_tokens": res.tokens,
        "steps": steps,
        "adapted_eval_vs_hf_eval_time": round(
            steps["adapted_eval"]["seconds"] / steps["baseline_hf_eval"]["seconds"], 2),
        "ppl_hf": round(base.ref_ppl, 4), "ppl_adapted": round(res.ref_ppl, 4),
        "saved_bytes": size, "params": lm.card.params,
        "saved_bytes_per_param": round(size / lm.card.params, 3),
    }, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
