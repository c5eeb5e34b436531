"""The README's main job, timed: the default model to a verified bundle in a fresh project, as JSON.

Runs `npustudio run --no-ask --json` (model -> adapt + equivalence proof -> quantize + perplexity -> compile +
simulator check -> libGenie-validated bundle) in a fresh project and a fresh process, and reports the wall time to
the verified bundle, each stage's seconds and peak RSS, and the steps each stage timed itself. With `--baseline REV`
the same job of commit REV (a git worktree beside this checkout, run with this checkout's virtual environment) runs
in turn with this one, `--repeat` times each, alternating, so the ratio holds when the machine's speed drifts.

    .venv/bin/python benchmarks/run_bench.py --json
    .venv/bin/python benchmarks/run_bench.py --baseline HEAD~3 --repeat 2 --json
    .venv/bin/python benchmarks/run_bench.py --model /path/to/hf-folder --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from scale_bench import run_stage  # noqa: E402  (one way to time a command and read its peak RSS)


def job(code: Path, model: str, project: Path, log: Path) -> dict[str, Any]:
    """One `npustudio run --no-ask` of the package in `code`, in its own process: the wall time to the verified
    bundle, that process's peak RSS, and what the run recorded per stage and step."""
    env = os.environ | {"PYTHONPATH": str(code)}  # the package in `code` first, before the installed one
    cmd = [sys.executable, "-m", "npustudio.cli", "run", "--model", model, "--project", str(project), "--no-ask",
           "--json"]
    r = run_stage(cmd, log, cwd=code, env=env)
    row: dict[str, Any] = {"seconds_to_verified_bundle": r["seconds"], "peak_rss_mb": r["peak_rss_mb"],
                           "exit": r["exit"]}
    if "error" in r:
        return row | {"error": r["error"]}
    s = r["result"]
    row["stages"] = {name: f["seconds"] for name, f in s["stages"].items()}
    row["stage_peak_rss_mb"] = {name: f["peak_rss_mb"] for name, f in s["stages"].items()}
    row["steps"] = {"quantize": s["quantize"]["steps"], "compile": s["compile"]["steps"]}
    v = s["compile"]["verification"]
    row["checks"] = {"equivalence_gate": s["adapt"]["gate"], "ppl_fp": s["adapt"]["ppl_fp"],
                     "ppl_quant": s["quantize"]["ppl_quant"], "ratio": s["quantize"]["ratio"],
                     "nodes_on_cpu": s["compile"]["nodes_on_cpu"], "simulator_nll_diff": v.get("nll_diff"),
                     "simulator_top1": v.get("top1_agreement"), "bundle_validated": s["bundle"]["validated"]}
    return row


def worktree(rev: str, where: Path) -> Path:
    """A checkout of `rev` (the baseline's code; the virtual environment is this checkout's)."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return where


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if not r["exit"]]
    med = statistics.median(r["seconds_to_verified_bundle"] for r in ok) if ok else None
    return {"median_seconds_to_verified_bundle": med, "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="what `npustudio run --model` takes (default: the embedded one)")
    ap.add_argument("--baseline", default=None, help="a git revision to run side by side with this checkout")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each side (alternating with the baseline's)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temporary one, removed after)")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    a = ap.parse_args()
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="npustudio-run-"))
    work.mkdir(parents=True, exist_ok=True)
    sides = {"this": ROOT}
    try:
        if a.baseline:
            sides["baseline"] = worktree(a.baseline, work / "baseline-code")
        rows: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
        for i in range(a.repeat):
            for side, code in sides.items():
                project = work / f"{side}-{i}"
                shutil.rmtree(project, ignore_errors=True)
                rows[side].append(job(code, a.model, project, work / f"{side}.log"))
                shutil.rmtree(project, ignore_errors=True)  # a fresh project each time; ~1 GB each
                if not a.json:
                    print(side, i, json.dumps(rows[side][-1]), file=sys.stderr)
        result: dict[str, Any] = {"model": a.model, "cpus": os.cpu_count()} | {s: summary(r) for s, r in rows.items()}
        if a.baseline:
            result["baseline_rev"] = subprocess.run(["git", "rev-parse", "--short", a.baseline], cwd=ROOT,
                                                    capture_output=True, text=True).stdout.strip()
            pairs = [(t["seconds_to_verified_bundle"], b["seconds_to_verified_bundle"])
                     for t, b in zip(rows["this"], rows["baseline"], strict=True) if not (t["exit"] or b["exit"])]
            result["ratio_this_vs_baseline"] = [round(t / b, 3) for t, b in pairs]
        print(json.dumps(result, indent=None if a.json else 2))
    finally:
        if a.baseline:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / "baseline-code")], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    if any(r["exit"] for side in rows.values() for r in side):
        sys.exit(1)


if __name__ == "__main__":
    main()
