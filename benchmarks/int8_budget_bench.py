"""What `--int8-budget`'s measurement costs, replaying the layers before each probed group against running the whole
model for every probe (the baseline), side by side in one process on one adapted model; printed as JSON.

Each probe puts one layer's attention or MLP weights on the 4-bit grid and runs the float model over the first
calibration sequences. The layers before that layer are unchanged, so what they return is replayed from the
reference calls: the same KL divergences (checked here), about half the model's work.

    .venv/bin/python benchmarks/int8_budget_bench.py                   # the default model (adapted in a scratch folder)
    .venv/bin/python benchmarks/int8_budget_bench.py --adapted P/stages/adapt --repeat 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


@contextlib.contextmanager
def whole_model() -> Iterator[None]:
    """The baseline: no layer replayed, every probe runs the whole model."""
    from npustudio.core.quantize import int8_budget

    kept = int8_budget.replaying

    @contextlib.contextmanager
    def nothing(_layers: Any, _outputs: Any) -> Iterator[None]:
        yield

    int8_budget.replaying = nothing  # type: ignore[assignment]
    try:
        yield
    finally:
        int8_budget.replaying = kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapted", default=None, help="an adapt stage's folder (default: the default model, adapted "
                    "in a scratch folder)")
    ap.add_argument("--budget", type=float, default=None, help="the share (default: w4a16's default)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each, alternating")
    a = ap.parse_args()

    import torch

    from npustudio.core.graph import store
    from npustudio.core.graph.kv_cache import KVCacheRunner
    from npustudio.core.progress import State
    from npustudio.core.quantize import QuantizeOptions, adapt_graphs, calibration, int8_budget
    from npustudio.core.quantize.presets import Overrides, int8_budget_of, preset

    if a.adapted:
        adapt_dir = Path(a.adapted)
    else:
        from quantize_bench import adapted_default

        adapt_dir = adapted_default(Path(tempfile.mkdtemp(prefix="npustudio-budget-")))
    options = QuantizeOptions(precision="w4a16", int8_budget=a.budget)
    budget = int8_budget_of(options.precision, options.int8_budget)
    model, inv_freq = store.load(adapt_dir)
    ar, cl, _ = adapt_graphs(adapt_dir)
    calib = calibration(adapt_dir, options)
    score = partial(KVCacheRunner.over(model, ar, cl, inv_freq).score, decode_tokens=0)

    def one() -> tuple[float, int8_budget.Choice]:
        t0 = time.perf_counter()
        c = int8_budget.choose(model, score, calib, ar, preset("w4a16"), budget, Overrides(), State())
        return time.perf_counter() - t0, c

    rows: dict[str, list[float]] = {"replayed": [], "whole_model": []}
    choices: dict[str, int8_budget.Choice] = {}
    with torch.no_grad():
        for _ in range(a.repeat):
            s, choices["replayed"] = one()
            rows["replayed"].append(round(s, 1))
            with whole_model():
                s, choices["whole_model"] = one()
            rows["whole_model"].append(round(s, 1))
    same = choices["replayed"].kl == choices["whole_model"].kl and \
        choices["replayed"].kept == choices["whole_model"].kept
    print(json.dumps({"adapted": str(adapt_dir), "cpus": os.cpu_count(), "budget": budget,
                      "layers": model.spec.layers, "groups_probed": len(choices["replayed"].kl),
                      "seconds": rows, "ratio": round(min(rows["replayed"]) / min(rows["whole_model"]), 3),
                      "kept_int8": choices["replayed"].kept, "same_choice_and_kl": same}))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
