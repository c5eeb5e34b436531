"""w4a16 (int4 LPBQ weights) compiled by onnxruntime-qnn as MatMuls, checked on the HTP simulator and answering
in the real Genie; the same tiny Llama as tests/test_compile_genie.py, whose w8a16 project sets the yardstick."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from npustudio.core import layout
from npustudio.core.genie import bundle as bundle_stage
from npustudio.core.genie import host
from npustudio.core.graph import ort_qnn
from npustudio.core.graph.kv_cache import KVCacheRunner
from npustudio.core.graph.lpbq_matmul import LPBQ_WEIGHTS
from npustudio.core.graph.ort_graph import OrtGraph
from npustudio.core.project import Project
from npustudio.core.targets import find_soc

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def w4(genie_project_w4: Project) -> Project:
    return genie_project_w4


def test_every_block_quantized_layer_compiles_as_a_matmul_on_the_htp(w4: Project) -> None:
    r = w4.record("compile").result
    assert w4.record("quantize").result["precision"] == "w4a16"
    assert r["nodes_on_cpu"] == 0
    prep = w4.stage_dir("compile") / "prepared"
    assert (prep / LPBQ_WEIGHTS).stat().st_size > 0
    for g in r["graphs"]:
        model = onnx.load(str(prep / f"{g['graph']}.onnx"), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MatMul") >= 16  # 2 layers × (q 2 heads, k, v, o, gate, up, down) as LPBQ MatMuls
        assert ops.count("Conv") == 1  # only the int8 per-channel LM head stays a convolution
        blocked = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
                   and any(a.name == "block_size" for a in n.attribute)]
        assert blocked and all(onnx.helper.get_attribute_value(a) == 0
                               for n in blocked for a in n.attribute if a.name == "axis")  # [K, N], blocks along K
        assert g["nodes_on_qnn"] > 100


def test_w4a16_binaries_hold_fewer_weight_bytes_than_w8a16(w4: Project, genie_project: Project) -> None:
    w8 = {g["graph"]: g["bin_bytes"] for g in genie_project.record("compile").result["graphs"]}
    for g in w4.record("compile").result["graphs"]:
        assert g["bin_bytes"] < w8[g["graph"]], (g, w8)


def test_the_simulator_agrees_with_the_quantsim_as_closely_as_at_w8a16(w4: Project) -> None:
    v = w4.record("compile").result["verification"]
    assert v["tokens"] > 40 and v["decode_steps"] == 4
    assert abs(v["nll_diff"]) < 0.01  # the w8a16 test's tolerance
    assert v["kv_cache_max_diff_steps"] <= 2
    assert v["top1_agreement"] >= 0.95
    tv = v["vs_quantsim_test_vectors"]  # the prepared MatMul graphs on the CPU reproduce the quantsim's Conv graphs
    assert all(x == 1.0 for k, x in tv.items() if k.endswith("top1_agreement"))
    assert all(x < 0.05 for k, x in tv.items() if k.endswith("max_abs_logit_diff"))


def test_genie_answers_with_the_host_runners_greedy_tokens_on_the_same_binaries(w4: Project) -> None:
    from transformers import PreTrainedTokenizerFast

    bundle = w4.stage_dir("bundle")
    cfg = json.loads((bundle / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    genie = host.run(bundle / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=8)
    assert genie.runner.startswith("genie") and genie.text

    meta = bundle_stage.read_metadata(bundle)
    target = find_soc(w4.record("compile").result["target"])
    graphs = {g.ar: OrtGraph(ort_qnn.context_session(w4.stage_dir("compile") / f"{g.name}.onnx", target),
                             meta.io_encodings) for g in meta.graphs}
    runner = KVCacheRunner(meta.decoder, meta.context_length, graphs,  # type: ignore[arg-type]
                           torch.tensor(meta.rope_inv_freq))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / layout.TOKENIZER))
    ids = ([] if meta.bos_id is None else [meta.bos_id]) + tok(PROMPT, add_special_tokens=False)["input_ids"]
    out = runner.generate(ids, 8, eos=meta.eos_ids)
    out = [t for t in out if t not in meta.eos_ids]
    # this random model soon emits byte tokens that are no UTF-8, where Genie's text ends: compare up to there
    text = tok.decode(out, skip_special_tokens=False).split("\ufffd")[0]
    assert len(tok(text, add_special_tokens=False)["input_ids"]) >= 4
    assert genie.text == text
