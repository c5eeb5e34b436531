"""Fidelity and cost of the quantize stage, printed as JSON (one object per variant).

Fidelity: PPL(quant) / PPL(FP) over the default eval slice, FP measured side by side in the same run
(the baseline = 1.0). Cost: wall time per step and peak RSS of the stage, each variant in its own
process so peaks do not mix.

    .venv/bin/python benchmarks/quantize_bench.py                       # default model: w8a16, w4a16, w4a16+SeqMSE
    .venv/bin/python benchmarks/quantize_bench.py --variants w8a16 --llama-1b   # cost on a Llama-3.2-1B shape
    .venv/bin/python benchmarks/quantize_bench.py --variants w4a16/down8,w4a16@w4a16-mlp-gateup8+seqmse --no-export
    .venv/bin/python benchmarks/quantize_bench.py --variants w8a16 --in-process   # the path of a model over 1 GiB
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from npustudio.core.stage_options import RECIPE_NAMES

W4 = {"precision": "w4a16"}
VARIANTS: dict[str, dict] = {
    "w8a16": {"precision": "w8a16"}, "w4a16": W4, "w4a16+seqmse": W4 | {"recipe": "seqmse"},
    **{f"w4a16+{r}": W4 | {"recipe": r} for r in RECIPE_NAMES if r != "plain"},
    # mixed precision, one group of weights kept int8 (which group costs the most at int4?)
    "w4a16/attn8": W4 | {"overrides": {"weights": {"layers.*.attn.*": 8}}},
    "w4a16/qk8": W4 | {"overrides": {"weights": {"layers.*.attn.q.*": 8, "layers.*.attn.k.*": 8}}},
    "w4a16/vo8": W4 | {"overrides": {"weights": {"layers.*.attn.v.*": 8, "layers.*.attn.o": 8}}},
    "w4a16/gateup8": W4 | {"overrides": {"weights": {"layers.*.mlp.gate": 8, "layers.*.mlp.up": 8}}},
    "w4a16/down8": W4 | {"overrides": {"weights": {"layers.*.mlp.down": 8}}},
}
MIXED_DIR = Path(__file__).resolve().parents[1] / "resources" / "overrides"


def adapted_default(work: Path) -> Path:
    """The default model adapted once (AR-128, CL-1024) in a scratch project."""
    from npustudio.core import pipeline
    from npustudio.core.adapt import AdaptOptions
    from npustudio.core.progress import State
    from npustudio.core.project import Project

    p = Project.open(work / "default")
    pipeline.adapt(p, "default", AdaptOptions(decode_tokens=16), State())
    return p.stage_dir("adapt")


def llama_1b_shaped(work: Path, tokenizer_from: Path) -> Path:
    """Random weights with Llama-3.2-1B's shapes (16 layers, 2048 hidden, 32/8 heads, 8192 MLP, 128256 vocab)."""
    import shutil

    import torch

    from npustudio.core import layout
    from npustudio.core.adapt import AdaptOptions
    from npustudio.core.adapt import graph_specs as specs
    from npustudio.core.fsutil import atomic_write_json
    from npustudio.core.graph import store
    from npustudio.core.graph.decoder import StaticDecoder
    from npustudio.core.models import ArchCard
    from npustudio.core.shape import DecoderShape, DecoderSpec

    out = work / "llama1b"
    if (out / layout.CARD).is_file():
        return out  # built before: its weights are random with a fixed seed
    out.mkdir(parents=True, exist_ok=True)
    spec = DecoderSpec(family="llama", model_type="llama", layers=16, heads=32, kv_heads=8, head_dim=64,
                       hidden=2048, intermediate=8192, vocab=128256, rms_norm_eps=1e-5, tied_embeddings=True,
                       qkv_bias=False, qk_norm=False)
    torch.manual_seed(0)
    m = StaticDecoder(spec)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    store.save(m, inv, out)
    o = AdaptOptions()
    atomic_write_json(out / "graphs.json", [g.model_dump() for g in specs(spec, o.ar, o.cl)])
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_from / f, out / f)
    params = sum(p.numel() for n, p in m.named_parameters() if n != "lm_head.weight")  # the head is the table
    card = ArchCard(**spec.model_dump(include=set(DecoderShape.model_fields)), architecture="LlamaForCausalLM",
                    source="random Llama-3.2-1B shape", params=params,
                    rope_theta=500000.0, rope_scaling=None, max_position=131072, bos_id=None, eos_ids=[],
                    chat_template=None)
    atomic_write_json(out / layout.CARD, card.model_dump())  # last: the folder is whole
    return out


FLAGS = {r: {"recipe": r} for r in RECIPE_NAMES if r != "plain"}


def _variant(name: str) -> dict:
    """A named variant, or `w4a16@FILE[+RECIPE]`: a preset with a shipped override file
    (resources/overrides/FILE.json), optionally with a recipe."""
    if "@" in name:
        from npustudio.core.quantize.presets import load_overrides

        precision, rest = name.split("@", 1)
        file, *flags = rest.split("+")
        out = {"precision": precision, "overrides": load_overrides(MIXED_DIR / f"{file}.json")}
        for f in flags:
            out |= FLAGS[f]
        return out
    return VARIANTS[name]


def one(adapt_dir: str, variant: str, eval_chars: int | None, export: bool, in_process: bool = False) -> None:
    """Child process: one quantize run, its result as JSON on stdout. `in_process`: no forked copies beside the
    stage, as a model over 1 GiB of float weights runs it (the export after the eval, the model let go before the
    QDQ pass), so its memory is measured on the default model."""
    import torch

    from npustudio.core import forked
    from npustudio.core.progress import State
    from npustudio.core.quantize import QuantizeOptions, run

    if in_process:
        forked.worth_forking = lambda *_a: False  # type: ignore[assignment]

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as out:
        opts = QuantizeOptions(**_variant(variant), eval_chars=eval_chars, export=export)
        r = run(Path(adapt_dir), opts, Path(out), State())
        exported = sum(f["bytes"] for f in r.files)
    print(json.dumps({"variant": variant, "ppl_fp": round(r.ppl_fp, 4), "ppl_quant": round(r.ppl_quant, 4),
                      "ratio": round(r.ratio, 4), "top1_agreement": round(r.top1_agreement, 4),
                      "eval_tokens": r.eval_tokens, "steps_s": r.steps, "total_s": round(sum(r.steps.values()), 1),
                      "peak_rss_mb": r.peak_rss_mb, "step_peak_rss_mb": r.step_peak_rss_mb,
                      "exported_bytes": exported, "in_process": in_process}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="w8a16,w4a16,w4a16+seqmse")
    ap.add_argument("--llama-1b", action="store_true", help="cost on a random Llama-3.2-1B-shaped model")
    ap.add_argument("--eval-chars", type=int, default=None)
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--work", default=None, help="scratch folder (kept, so reruns skip the adapt step)")
    ap.add_argument("--in-process", action="store_true",
                    help="no forked copies beside the stage: the path (and the memory) of a model over 1 GiB")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        one(a.child[0], a.child[1], int(a.child[2]) or None, a.child[3] == "1", a.child[4] == "1")
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="npustudio-bench-"))
    src = adapted_default(work)
    target = llama_1b_shaped(work, src) if a.llama_1b else src
    results = []
    for v in a.variants.split(","):
        p = subprocess.run([sys.executable, __file__, "--child", str(target), v, str(a.eval_chars or 0),
                            "0" if a.no_export else "1", "1" if a.in_process else "0"], capture_output=True, text=True)
        if p.returncode:
            results.append({"variant": v, "error": p.stderr.strip().splitlines()[-1:]})
        else:
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(json.dumps({"model": "llama-3.2-1b-shaped (random)" if a.llama_1b else "SmolLM2-135M-Instruct (default)",
                      "ar": 128, "cl": 1024, "results": results}, indent=2))
    if any("error" in r for r in results):
        sys.exit(1)  # a failed variant (a full disk, say) must not read as a measurement


if __name__ == "__main__":
    main()
