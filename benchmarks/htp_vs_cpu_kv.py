"""Where the compiled prompt graph departs from the quantsim: per-layer KV-cache output differences.

Runs one AR-N step over the start of the eval text through a project's compiled prompt graph on the HTP
simulator and through the same prepared graph on the CPU (which reproduces the quantsim), then prints
JSON: per layer, the max and mean difference of past_key/past_value outputs in quantized steps, the
worst position, and the top-1 agreement of the logits.  Usage: python benchmarks/htp_vs_cpu_kv.py PROJECT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import numpy as np
    from transformers import AutoTokenizer

    from npustudio.core import layout
    from npustudio.core.evaluate import load_corpus
    from npustudio.core.graph import embedding_lut, ort_qnn, store
    from npustudio.core.graph.kv_cache import KVCacheRunner
    from npustudio.core.graph.ort_graph import cpu_session, quantize
    from npustudio.core.results import IOEncoding
    from npustudio.core.targets import find_soc

    stages = Path(sys.argv[1]) / "stages"
    comp = json.loads((stages / "compile" / "compile.json").read_text())
    graph = comp["graphs"][0]["graph"]
    io = {k: IOEncoding(**v) for k, v in comp["io"].items()}
    spec, inv_freq = store.load_spec(stages / "adapt")
    specs = json.loads((stages / "quantize" / "graphs.json").read_text())
    ar, cl = specs[0]["ar"], specs[0]["cl"]
    tok = AutoTokenizer.from_pretrained(str(stages / "quantize"), trust_remote_code=False)
    ids = tok(load_corpus("default", "eval"))["input_ids"][:ar]
    feeds = KVCacheRunner(spec, cl, {ar: None}, inv_freq).feeds(ids, ar)  # type: ignore[dict-item]
    q = {n: quantize(t.numpy(), io[n]) for n, t in feeds.items() if n in io}
    if embedding_lut.INPUT in io:  # the graphs start from the embedding table's rows, as Genie feeds them
        lut = stages / "compile" / layout.PREPARED / layout.EMBEDDING_LUT
        rows = embedding_lut.load(lut, io[embedding_lut.INPUT], spec.hidden)
        q[embedding_lut.INPUT] = rows[feeds["input_ids"].numpy()]
    outs, secs = {}, {}
    target = find_soc(comp["target"])
    for label, sess in (("cpu", cpu_session(stages / "compile" / "prepared" / f"{graph}.onnx")),
                        ("htp", ort_qnn.context_session(stages / "compile" / f"{graph}.onnx", target))):
        names = [o.name for o in sess.get_outputs()]
        t0 = time.perf_counter()
        outs[label] = dict(zip(names, sess.run(names, q), strict=True))
        secs[label] = round(time.perf_counter() - t0, 2)
    layers = []
    for layer in range(spec.layers):
        row: dict[str, object] = {"layer": layer}
        for kind, pos_axis in (("key", 3), ("value", 2)):
            n = f"past_{kind}_{layer}_out"
            d = np.abs(outs["cpu"][n].astype(np.int32) - outs["htp"][n].astype(np.int32))
            per_pos = d.max(axis=tuple(i for i in range(d.ndim) if i != pos_axis))
            row[kind] = {"max_steps": int(d.max()), "mean_steps": round(float(d.mean()), 3),
                         "worst_position": int(per_pos.argmax()),
                         "max_steps_without_position_0": int(per_pos[1:].max())}
        layers.append(row)
    a, b = outs["cpu"]["logits"][0], outs["htp"]["logits"][0]
    print(json.dumps({"graph": graph, "tokens": len(ids), "seconds": secs,
                      "logits_top1_agreement": round(float((a.argmax(-1) == b.argmax(-1)).mean()), 4),
                      "layers": layers}, indent=1))


if __name__ == "__main__":
    main()
