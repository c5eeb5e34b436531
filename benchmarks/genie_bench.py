"""Speed of a bundle on this machine: the CPU preview and the real Genie on the HTP simulator, side by side.

Both answer the bundle's sample prompt greedily for --tokens tokens; figures come from the profiles they
write (Genie's own for the simulator). Prints JSON with TTFT, prompt and generation tok/s, and the
decode roofline of the target phone for comparison.
Usage: python benchmarks/genie_bench.py BUNDLE_DIR [--tokens 16] [--no-genie]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--no-genie", action="store_true", help="only the preview (Genie takes minutes per run)")
    a = ap.parse_args()

    from npustudio.core.genie import host, profile

    bundle = Path(a.bundle)
    prompt = (bundle / "sample_prompt.txt").read_text(encoding="utf-8")
    out: dict[str, object] = {"bundle": str(bundle), "tokens": a.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        for label, preview in (("preview_cpu", True), ("genie_htp_simulator", False)):
            if label.startswith("genie") and a.no_genie:
                continue
            prof = Path(tmp) / f"{label}.json"
            res = host.run(bundle / "genie_config.json", prompt, lambda _s: None, prof, max_tokens=a.tokens,
                             preview=preview)
            s = profile.summarize(profile.read(prof))
            out[label] = {"answer": res.text, "wall_s": res.seconds, "init_s": s.init_s, "ttft_s": s.ttft_s,
                          "prompt_tokens": s.prompt_tokens, "prompt_tok_s": s.prompt_tok_s,
                          "generated_tokens": s.generated_tokens, "generation_tok_s": s.generation_tok_s}
    out["phone_roofline"] = profile.bundle_roofline(bundle)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
