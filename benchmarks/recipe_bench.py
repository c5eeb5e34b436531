"""Every weight-encoding recipe at w4a16 on the default model, printed as JSON: quality, 4-bit share, cost.

Each recipe runs the quantize stage in its own process (quantize_bench's child, so peaks do not mix) with the
w4a16 preset: every decoder linear is LPBQ int4 (blocks of 64), the LM head int8 (the bench passes an int8
budget of 0 where the stage's w4a16 default is 0.05); with `--int8-budget` the stage keeps the groups it
measures most sensitive int8 within that share (listed per row as `kept_int8`). Per recipe: the perplexity
ratio against FP measured in the same run, top-1 agreement, the share of the decoder's linear weights at 4 bits
(read back from the exported encodings), minutes and peak RSS; with `--seeds`, each recipe once per seed and
the mean, best and worst ratio over them (the best recipe is the one of the lowest mean). `--llama-1b` adds the
cost of one recipe on a random Llama-3.2-1B-shaped model (its quality means nothing: random weights).

    .venv/bin/python benchmarks/recipe_bench.py --json
    .venv/bin/python benchmarks/recipe_bench.py --recipes plain,adascale --llama-1b adascale --work /tmp/rb
    .venv/bin/python benchmarks/recipe_bench.py --recipes adascale --adascale-iterations 300 --calib-samples 16
    .venv/bin/python benchmarks/recipe_bench.py --recipes omniquant --omniquant-iterations 400
    .venv/bin/python benchmarks/recipe_bench.py --recipes plain,adascale --int8-budget 0.05
    .venv/bin/python benchmarks/recipe_bench.py --recipes adascale --int8-budget 0.05 --seeds 0,1,2

A recipe the model cannot take (SpinQuant on a hidden size with no Hadamard matrix) is listed as refused, with why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantize_bench

from npustudio.core.stage_options import RECIPE_NAMES, QuantizeOptions


def one_recipe(adapt_dir: str, recipe: str, options_json: str) -> None:
    """Child: one w4a16 quantize run with `recipe`, its figures as JSON on stdout, with the share of the decoder
    layers' linear weights (by count) the export encodes at 4 bits."""
    import torch

    from npustudio.core.errors import UserError
    from npustudio.core.graph import encodings, store
    from npustudio.core.graph.ops import Conv1x1
    from npustudio.core.progress import State
    from npustudio.core.quantize import QuantizeOptions, run

    torch.set_num_threads(2)
    model, _ = store.load(Path(adapt_dir))
    sizes = {f"{n}.weight": m.weight.numel() for n, m in model.named_modules()
             if isinstance(m, Conv1x1) and n.startswith("layers.")}
    del model
    with tempfile.TemporaryDirectory() as out:
        options = QuantizeOptions(precision="w4a16", recipe=recipe, **json.loads(options_json))
        try:
            r = run(Path(adapt_dir), options, Path(out), State())
        except UserError as e:  # a recipe this model cannot take (SpinQuant on a hidden size with no Hadamard matrix)
            print(json.dumps({"recipe": recipe, "refused": e.problem}))
            return
        enc = next(Path(out).glob("*.encodings"))
        bits = {row.name: row.bitwidth for row in encodings.read(enc, kinds=("param",)).rows}
    four = sum(n for name, n in sizes.items() if bits.get(name) == 4)
    print(json.dumps({"recipe": recipe, "ppl_fp": round(r.ppl_fp, 4), "ppl_quant": round(r.ppl_quant, 4),
                      "ratio": round(r.ratio, 4), "top1_agreement": round(r.top1_agreement, 4),
                      "int4_share": round(four / sum(sizes.values()), 4), "kept_int8": r.kept_int8,
                      "eval_tokens": r.eval_tokens,
                      "steps_s": r.steps, "minutes": round(sum(r.steps.values()) / 60, 2),
                      "peak_rss_mb": r.peak_rss_mb}))


def _child(args: list[str], script: str = __file__) -> dict:
    """A child process's last line as JSON, or its error."""
    p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default=",".join(RECIPE_NAMES))
    ap.add_argument("--llama-1b", default=None, metavar="RECIPE", help="also the cost of RECIPE on a random "
                                                                       "Llama-3.2-1B-shaped model")
    ap.add_argument("--adascale-iterations", type=int, default=QuantizeOptions.model_fields[
        "adascale_iterations"].default, help="AdaScale's steps per decoder layer (for recipes that run it)")
    ap.add_argument("--omniquant-iterations", type=int, default=QuantizeOptions.model_fields[
        "omniquant_iterations"].default, help="OmniQuant's steps per decoder layer (for recipes that run it)")
    ap.add_argument("--calib-samples", type=int, default=QuantizeOptions.model_fields["calib_samples"].default,
                    help="calibration sequences (what the recipes learn from)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: each recipe runs once per seed (the "
                    "spread of a recipe that draws at random, as AdaScale does)")
    ap.add_argument("--int8-budget", type=float, default=0.0, metavar="SHARE",
                    help="the share of the decoder's linear weights each recipe may keep int8 (measured choice)")
    ap.add_argument("--work", default=None, help="scratch folder (kept, so reruns skip the adapt step)")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        one_recipe(*a.child)
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="npustudio-recipes-"))
    src = quantize_bench.adapted_default(work)
    rows = []
    options = {"adascale_iterations": a.adascale_iterations, "omniquant_iterations": a.omniquant_iterations,
               "calib_samples": a.calib_samples, "int8_budget": a.int8_budget}
    seeds = [int(x) for x in a.seeds.split(",")]
    for recipe in a.recipes.split(","):
        for seed in seeds:
            own = {k: v for k, v in options.items()  # a recipe's step count only for the recipe that runs it
                   if not (k == "adascale_iterations" and "adascale" not in recipe)
                   and not (k == "omniquant_iterations" and recipe != "omniquant")}
            row = _child(["--child", str(src), recipe, json.dumps(own | {"seed": seed})])
            rows.append({"recipe": recipe, "seed": seed} | row)
            if not a.json:
                print(json.dumps(rows[-1]), file=sys.stderr)
            if "refused" in row:
                break
    out: dict = {"model": "SmolLM2-135M-Instruct (default)", "precision": "w4a16",
                 **options, "seeds": seeds, "results": rows}
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if "error" not in r and "refused" not in r:
            ratios.setdefault(r["recipe"], []).append(r["ratio"])
    if ratios:
        out["ratio_over_seeds"] = {k: {"mean": round(statistics.fmean(v), 4), "worst": max(v), "best": min(v)}
                                   for k, v in ratios.items()}
        out["best"] = min(ratios, key=lambda k: statistics.fmean(ratios[k]))
    if a.llama_1b:
        big = quantize_bench.llama_1b_shaped(work, src)
        variant = f"w4a16+{a.llama_1b}" if a.llama_1b != "plain" else "w4a16"
        one = _child(["--child", str(big), variant, "0", "0"], quantize_bench.__file__)
        out["llama_1b_shaped"] = {"recipe": a.llama_1b} | {k: one[k] for k in ("total_s", "peak_rss_mb", "steps_s",
                                                                               "error") if k in one}
    print(json.dumps(out, indent=2))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
