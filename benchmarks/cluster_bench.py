"""Quantize + compile here and through a Ray head on this computer, side by side: the cluster's overhead and its
transfer rate, as JSON.

    .venv/bin/python benchmarks/cluster_bench.py --json
    .venv/bin/python benchmarks/cluster_bench.py --model default --json   # the real default model (slower)

The head listens on 127.0.0.1 only. Both runs start from the same adapted project: quantize must give
byte-identical files, compile the same simulator check (QNN writes other bytes into a context binary on every
compile, here too); `transfer_mb_s` is the bytes sent and brought back over the seconds they took.

Two overheads (the cluster's wall time over the local one; goal <= 1.3 on the tiny model):
`overhead_ratio` times the commands a person types, each in a fresh process (`npustudio quantize`, then
`npustudio compile`, with and without --cluster): both sides load torch and AIMET once, here or on the worker.
`overhead_ratio_in_process` times the stage calls in this process, where the local side finds those libraries
already loaded and the worker does not: the worker's start (~7 s on 2 cores) counts against the cluster alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npustudio.core import pipeline, stages
from npustudio.core.adapt import AdaptOptions
from npustudio.core.cluster import Cluster
from npustudio.core.compile import CompileOptions
from npustudio.core.progress import Partial, State
from npustudio.core.project import Project
from npustudio.core.quantize import QuantizeOptions
from tests.conftest import make_tiny_model
from tests.ray_head import loopback_head

SMALL = {"tiny": (AdaptOptions(ar=32, cl=128, eval_chars=1500, window=128, decode_tokens=8),
                  QuantizeOptions(precision="w8a16", calib_samples=2, calib_len=64, calib_decode=4, eval_chars=1500,
                                  window=128, decode_tokens=8),
                  CompileOptions(verify_tokens=64)),
         "default": (AdaptOptions(), QuantizeOptions(), CompileOptions())}


def run_stages(p: Project, q: QuantizeOptions, c: CompileOptions, cluster: Cluster | None) -> dict[str, Any]:
    moved: list[dict[str, Any]] = []
    st = State()
    st.subscribe(lambda e: moved.append(e.data) if isinstance(e, Partial) and e.kind == "transfer" else None)
    t0 = time.perf_counter()
    pipeline.quantize(p, q, st, force=True, cluster=cluster)
    t1 = time.perf_counter()
    pipeline.compile_graphs(p, c, st, force=True, cluster=cluster)
    t2 = time.perf_counter()
    qd, cd = p.record(stages.QUANTIZE), p.record(stages.COMPILE)
    assert qd is not None and cd is not None
    files = {f.path: f.sha256 for f in qd.record.outputs if not f.path.endswith("quantize.json")}  # timings differ
    checked = ("nll_quantsim_cpu", "nll_htp", "top1_agreement", "max_abs_logit_diff")
    return {"quantize_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "seconds": round(t2 - t0, 2),
            "moved": moved, "files": files, "ratio": qd.result.ratio,
            "verification": {k: getattr(cd.result.verification, k) for k in checked}}


CLI_QUANTIZE = ["--precision", "w8a16", "--calib-samples", "2", "--calib-len", "64", "--eval-chars", "1500"]


def cli_seconds(project: Path, model: str, address: str | None) -> dict[str, float]:
    """`npustudio quantize` then `npustudio compile` on `project`, each a fresh process, as a person runs them."""
    extra = ["--cluster", address] if address else []
    steps = {"quantize": CLI_QUANTIZE if model == "tiny" else [],
             "compile": ["--verify-tokens", "64"] if model == "tiny" else []}
    out: dict[str, float] = {}
    for stage, opts in steps.items():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "npustudio.cli", stage, "--project", str(project), "--force", *opts,
                        *extra, "--json"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[f"{stage}_s"] = round(time.perf_counter() - t0, 2)
    out["seconds"] = round(sum(out.values()), 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(SMALL), default="tiny")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    a = ap.parse_args()
    adapt, q, c = SMALL[a.model]
    with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp:
        root = Path(tmp)
        model = "default" if a.model == "default" else str(make_tiny_model(root / "m", "llama64"))
        base = Project.open(root / "base")
        pipeline.adapt(base, model, adapt, State())
        here, there = (Project.open(shutil.copytree(base.root, root / n), create=False) for n in ("here", "there"))
        local = run_stages(here, q, c, None)
        cli_local = cli_seconds(here.root, a.model, None)
        t0 = time.perf_counter()
        with loopback_head(cpus=os.cpu_count() or 2, temp_dir=root / "ray") as address:
            head_s = time.perf_counter() - t0
            remote = run_stages(there, q, c, Cluster(address))
            import ray

            ray.shutdown()
            cli_remote = cli_seconds(there.root, a.model, address)
    sent = sum(m["sent_bytes"] + m["received_bytes"] for m in remote["moved"])
    secs = sum(m["sent_s"] + m["received_s"] for m in remote["moved"]) or float("nan")
    out = {
        "model": a.model, "cpus": os.cpu_count(),
        "local": {k: local[k] for k in ("quantize_s", "compile_s", "seconds", "ratio")},
        "ray": {k: remote[k] for k in ("quantize_s", "compile_s", "seconds", "ratio")}
        | {"head_start_s": round(head_s, 2)},
        "cli": {"local": cli_local, "ray": cli_remote},
        "overhead_ratio": round(cli_remote["seconds"] / cli_local["seconds"], 3),
        "overhead_ratio_in_process": round(remote["seconds"] / local["seconds"], 3),
        "transfer_mb": round(sent / 2**20, 1), "transfer_mb_s": round(sent / 2**20 / secs, 1),
        # QNN writes other bytes into a context binary on every compile: compile is compared by its simulator check
        "quantize_files_identical": remote["files"] == local["files"],  # paths are relative to each project
        "compile_verification_equal": remote["verification"] == local["verification"],
    }
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
