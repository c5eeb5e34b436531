"""Push throughput to the virtual device: `npustudio deploy` vs the stock `adb push`, side by side.

Both go through the same private adb server and the same loopback link to one virtual device, one after the
other in each round. Prints JSON: MB/s of each (best of --repeat), their ratio (target ≥ 0.9), the ratio of
the medians and every run (a shared machine is noisy), and the time of an unchanged re-deploy (target ≤ 1 s).
What deploy imports is loaded before the first timed run (one-off seconds that are not the push's).
Usage: python benchmarks/push_bench.py [--mb 200] [--files 3] [--repeat 3]   (a 2 GB bundle: --mb 2000 --files 20)
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _random_file(path: Path, size: int) -> None:
    """Incompressible bytes, written 16 MiB at a time (a 2 GB bundle of 2 files must not sit in memory)."""
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * 1024 * 1024)
            f.write(os.urandom(n))
            left -= n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200, help="total bundle size")
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=5327, help="private adb server port")
    a = ap.parse_args()
    os.environ["ANDROID_ADB_SERVER_PORT"] = str(a.port)

    from npustudio.core import device
    from npustudio.core.device import deploy
    from npustudio.core.progress import State
    from npustudio.core.shape import DecoderSpec
    from npustudio.core.targets import find_soc

    work = Path(tempfile.mkdtemp(prefix="npustudio-push-"))
    adb = [device.adb_path(), "-P", str(a.port)]
    subprocess.run([*adb, "start-server"], check=True, capture_output=True)
    vd = device.start_virtual(work / "phone")
    try:
        bundle = work / "bundle"
        bundle.mkdir()
        for i in range(a.files):
            _random_file(bundle / f"part_{i}.bin", a.mb * 1024 * 1024 // a.files)
        spec = DecoderSpec(family="Llama", model_type="llama", layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64,
                           intermediate=128, vocab=384, rms_norm_eps=1e-5, tied_embeddings=True, qkv_bias=False,
                           qk_norm=False)
        (bundle / "metadata.json").write_text(json.dumps(  # what deploy's compatibility check reads
            {"target": find_soc("SM8750").model_dump(), "context_length": 1024, "graphs": [{"name": "g", "ar": 1}],
             "decoder": spec.model_dump(), "eos_ids": [2], "runtime_missing": []}))
        total = sum(p.stat().st_size for p in bundle.iterdir())
        dev = device.info(vd.serial)
        # what deploy imports (torch, through the bundle's metadata: ~3 s) is loaded before the clock runs;
        # the hash cache stays cold for the first run (deploy hashes while it sends)
        device.compatibility(dev, bundle)
        stock, ours = [], []
        for _ in range(a.repeat):
            shutil.rmtree(vd.root / "data/local/tmp", ignore_errors=True)
            (vd.root / "data/local/tmp").mkdir(parents=True)
            (vd.root / "data/local/tmp/stock").mkdir()  # stock adb wants an existing folder for several files
            t0 = time.perf_counter()
            subprocess.run([*adb, "-s", vd.serial, "push", *map(str, sorted(bundle.iterdir())),
                            "/data/local/tmp/stock/"], check=True, capture_output=True)
            stock.append(total / 1e6 / (time.perf_counter() - t0))
            shutil.rmtree(vd.root / "data/local/tmp", ignore_errors=True)
            (vd.root / "data/local/tmp").mkdir(parents=True)
            t0 = time.perf_counter()
            res = deploy.deploy(bundle, dev, State(), force=True)
            ours.append(res.bytes_sent / 1e6 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        again = deploy.deploy(bundle, dev, State())
        repush = time.perf_counter() - t0
        print(json.dumps({"bundle_mb": round(total / 1e6, 1), "files": a.files + 1,
                          "stock_adb_push_mb_s": round(max(stock), 1), "npustudio_deploy_mb_s": round(max(ours), 1),
                          "ratio_deploy_vs_stock": round(max(ours) / max(stock), 3),
                          "ratio_of_medians": round(statistics.median(ours) / statistics.median(stock), 3),
                          "stock_runs_mb_s": [round(x) for x in stock], "deploy_runs_mb_s": [round(x) for x in ours],
                          "unchanged_redeploy_s": round(repush, 3), "unchanged_redeploy_bytes_sent": again.bytes_sent,
                          "runs": a.repeat}, indent=2))
    finally:
        device.stop_virtual(vd)
        subprocess.run([*adb, "kill-server"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
