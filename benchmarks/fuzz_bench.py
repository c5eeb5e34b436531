"""The fuzz suite for as long as it is given, as JSON: mutated inputs of every file format NPU Studio reads (a tiny
real project's files as seeds, tests/fuzz_formats.py) and of the virtual device's adb wire protocol.

    .venv/bin/python benchmarks/fuzz_bench.py --seconds 300 --json

Per format: inputs tried, refused with a message (UserError), and the findings: crashes (another exception: a
traceback for the user), hangs (still reading after 10 s) and writes outside the input's folder; each should be 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120, help="time for the file formats (the adb wire: 1/10 more)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from npustudio.core.device.virtual import VirtualDevice
    from tests import fuzz_formats
    from tests.conftest import genie_pipeline, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "m", "llama64")
        project = genie_pipeline(work / "p", model)
        seeds = fuzz_formats.make_seeds(work / "seeds", project.root, model)  # type: ignore[union-attr]
        t0 = time.monotonic()
        out = fuzz_formats.run(seeds, work, seconds=a.seconds, seed=a.seed)
        files_s = time.monotonic() - t0
        vd = VirtualDevice(work / "phone").start()
        try:
            t1, tried, findings = time.monotonic(), 0, []
            rng = random.Random(a.seed)
            while time.monotonic() - t1 < a.seconds / 10 and not findings:
                n, found = fuzz_formats.adb_wire(vd.port, rng, 20)
                tried, findings = tried + n, findings + found
        finally:
            vd.stop()
    formats = {name: {"tried": o.tried, "refused_with_a_message": o.refused, "crashes": len(o.crashes),
                      "hangs": len(o.hangs), "writes_outside": len(o.writes_outside),
                      "examples": (o.crashes + o.hangs)[:3]} for name, o in out.items()}
    result = {"seconds": round(files_s, 1), "seed": a.seed, "formats": formats,
              "adb_wire": {"connections_tried": tried, "findings": findings},
              "inputs_tried": sum(f["tried"] for f in formats.values()) + tried,
              "findings": sum(f["crashes"] + f["hangs"] + f["writes_outside"] for f in formats.values())
              + len(findings)}
    print(json.dumps(result, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
