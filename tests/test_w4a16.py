"""w4a16 (int4 LPBQ weights) compiled by onnxruntime-qnn as MatMuls, checked on the HTP simulator and answering
in the real Genie; the same tiny Llama as tests/test_compile_genie.py, whose w8a16 project sets the yardstick."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
import onnx
import pytest
import torch

from npustudio.core import layout, stages
from npustudio.core.genie import host
from npustudio.core.genie.meta import read_metadata
from npustudio.core.graph import ort_qnn
from npustudio.core.graph.kv_cache import KVCacheRunner
from npustudio.core.graph.lpbq_matmul import LPBQ_WEIGHTS
from npustudio.core.graph.ort_graph import OrtGraph
from npustudio.core.project import Project
from npustudio.core.targets import find_soc
from tests.conftest import TINY, done

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def w4(genie_project_w4: Project) -> Project:
    return genie_project_w4


def test_every_block_quantized_layer_compiles_as_a_matmul_on_the_htp(w4: Project) -> None:
    r = done(w4, stages.COMPILE).result
    assert done(w4, stages.QUANTIZE).result.precision == "w4a16"
    assert r.nodes_on_cpu == 0
    prep = w4.stage_dir("compile") / "prepared"
    assert (prep / LPBQ_WEIGHTS).stat().st_size > 0
    for g in r.graphs:
        model = onnx.load(str(prep / f"{g.graph}.onnx"), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MatMul") >= 16  # 2 layers × (q 2 heads, k, v, o, gate, up, down) as LPBQ MatMuls
        assert ops.count("Conv") == 1  # only the int8 per-channel LM head stays a convolution
        blocked = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
                   and any(a.name == "block_size" for a in n.attribute)]
        assert blocked and all(onnx.helper.get_attribute_value(a) == 0
                               for n in blocked for a in n.attribute if a.name == "axis")  # [K, N], blocks along K
        assert g.nodes_on_qnn > 100


def test_w4a16_binaries_hold_fewer_weight_bytes_than_w8a16(w4: Project, genie_project: Project) -> None:
    w8 = {g.graph: g.bin_bytes for g in done(genie_project, stages.COMPILE).result.graphs}
    for g in done(w4, stages.COMPILE).result.graphs:
        assert g.bin_bytes < w8[g.graph], (g, w8)


def test_the_simulator_agrees_with_the_quantsim_as_closely_as_at_w8a16(w4: Project) -> None:
    v = done(w4, stages.COMPILE).result.verification
    assert v.tokens is not None and v.tokens > 40 and v.decode_steps == 4
    assert v.nll_diff is not None and abs(v.nll_diff) < 0.01  # the w8a16 test's tolerance
    assert v.kv_cache_max_diff_steps is not None and v.kv_cache_max_diff_steps <= 2
    assert v.top1_agreement is not None and v.top1_agreement >= 0.95
    tv = v.vs_quantsim_test_vectors  # the prepared MatMul graphs on the CPU reproduce the quantsim's Conv graphs
    assert all(x == 1.0 for k, x in tv.items() if k.endswith("top1_agreement"))
    assert all(x < 0.05 for k, x in tv.items() if k.endswith("max_abs_logit_diff"))


def test_genie_answers_with_the_host_runners_greedy_tokens_on_the_same_binaries(w4: Project) -> None:
    from transformers import PreTrainedTokenizerFast

    bundle = w4.stage_dir("bundle")
    cfg = json.loads((bundle / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    genie = host.run(bundle / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=8)
    assert genie.runner.startswith("genie") and genie.text

    meta = read_metadata(bundle)
    target = find_soc(done(w4, stages.COMPILE).result.target)
    graphs = {g.ar: OrtGraph(ort_qnn.context_session(w4.stage_dir("compile") / f"{g.name}.onnx", target),
                             meta.io_encodings, bundle / layout.EMBEDDING_LUT) for g in meta.graphs}
    runner = KVCacheRunner(meta.decoder, meta.context_length, graphs,  # type: ignore[arg-type]
                           torch.tensor(meta.rope_inv_freq))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / layout.TOKENIZER))
    ids = ([] if meta.bos_id is None else [meta.bos_id]) + tok(PROMPT, add_special_tokens=False)["input_ids"]
    out = runner.generate(ids, 8, eos=meta.eos_ids)
    out = [t for t in out if t not in meta.eos_ids]
    # this random model soon emits byte tokens that are no UTF-8, where Genie's text ends: compare up to there
    text = cast(str, tok.decode(out, skip_special_tokens=False)).split("\ufffd")[0]  # one sequence: one text
    assert len(tok(text, add_special_tokens=False)["input_ids"]) >= 4
    assert genie.text == text


def test_a_4bit_lm_head_compiles_in_lpbq_blocks_and_shrinks_the_binaries(w4: Project,
                                                                           tmp_path_factory: pytest.TempPathFactory
                                                                           ) -> None:
    """`--lm-head-bits 4`: the head joins the layers' LPBQ blocks, so no Conv is left, every node is still on QNN,
    the binaries shrink by about half the head's int8 bytes, and the simulator still agrees with the quantsim."""
    import shutil

    from npustudio.core import pipeline
    from npustudio.core.compile import CompileOptions
    from npustudio.core.graph import encodings as enc
    from npustudio.core.progress import State

    root = tmp_path_factory.mktemp("head4") / "p"
    shutil.copytree(w4.root, root)
    p = Project.open(root, create=False)
    o = done(w4, stages.QUANTIZE).options.model_copy(update={"lm_head_bits": 4})
    pipeline.quantize(p, o, State())
    q = done(p, stages.QUANTIZE).result
    assert q.lm_head_bits == 4
    table = enc.read(p.stage_dir("quantize") / f"{q.graphs[0]}.encodings", kinds=("param",))
    head = [r for r in table.rows if r.name == "lm_head.weight"]
    assert head and head[0].bitwidth == 4 and head[0].granularity == "block" and head[0].block_size == 64, head
    pipeline.compile_graphs(p, CompileOptions(verify_tokens=64), State())
    r = done(p, stages.COMPILE).result
    assert r.nodes_on_cpu == 0
    for g in r.graphs:
        model = onnx.load(str(p.stage_dir("compile") / "prepared" / f"{g.graph}.onnx"), load_external_data=False)
        assert [n.op_type for n in model.graph.node].count("Conv") == 0
    w8_head = {g.graph: g.bin_bytes for g in done(w4, stages.COMPILE).result.graphs}
    weights = TINY["llama64"]["vocab_size"] * TINY["llama64"]["hidden_size"]  # the head: int8 in `w4`, int4 here
    for g in r.graphs:
        # half the head's int8 bytes less its block scales, in the binary's 4 KiB pages: 20 KiB here
        assert w8_head[g.graph] - g.bin_bytes > 0.3 * weights, (g, w8_head)
    v = r.verification
    assert v.nll_diff is not None and abs(v.nll_diff) < 0.01, v
    assert v.top1_agreement is not None and v.top1_agreement >= 0.95, v


# -- the rewrite itself, on one layer -----------------------------------------------------------------------------
def _lpbq_conv_graph(folder: Path, k: int, n: int, t: int, seed: int = 0) -> Path:
    """One LPBQ 1x1 Conv exactly as aimet exports it (int4 [N, K, 1, 1] blocks of 64 along K under uint8 block
    scales and float channel scales), uint16 in and out as the prepared graphs have them."""
    from onnx import TensorProto, helper
    from onnx import numpy_helper as nh

    from npustudio.core.graph.lpbq_matmul import _pack4

    rng = np.random.default_rng(seed)
    nb = k // 64
    w_q = rng.integers(-8, 8, (n, k, 1, 1)).astype(np.int8)
    block = rng.integers(1, 17, (n, nb, 1, 1)).astype(np.uint8)
    ch = (rng.uniform(0.5, 1.5, n) * 1e-3).astype(np.float32)
    x_s, y_s = np.float32(2.0 / 65535), np.float32(0.05 * k / 65535)

    def int4(name: str, a: np.ndarray) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.INT4, list(a.shape), _pack4(a), raw=True)

    inits = [int4("w_q", w_q), int4("w_zp", np.zeros_like(block, np.int8)), nh.from_array(block, "w_block"),
             nh.from_array(ch, "w_ch"), nh.from_array(np.zeros(n, np.uint8), "w_ch_zp"),
             nh.from_array(np.array(x_s), "x_s"), nh.from_array(np.array(32768, np.uint16), "x_z"),
             nh.from_array(np.array(y_s), "y_s"), nh.from_array(np.array(32768, np.uint16), "y_z")]
    nodes = [helper.make_node("DequantizeLinear", ["w_block", "w_ch", "w_ch_zp"], ["w_scale"], axis=0, name="s"),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"], axis=1, block_size=64,
                              name="w"),
             helper.make_node("DequantizeLinear", ["x", "x_s", "x_z"], ["x_f"], name="x_dq"),
             helper.make_node("Conv", ["x_f", "w"], ["y_f"], kernel_shape=[1, 1], name="/layers.0/mlp/up/Conv"),
             helper.make_node("QuantizeLinear", ["y_f", "y_s", "y_z"], ["y"], name="y_q")]
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.UINT16, [1, k, 1, t])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT16, [1, n, 1, t])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = folder / "conv.onnx"
    onnx.save(model, str(path))
    return path


_SIMULATE = """
import sys, numpy as np
from pathlib import Path
from npustudio.core.graph import ort_qnn
from npustudio.core.targets import find_soc
folder = Path(sys.argv[1])
target = find_soc("SM8750")
ort_qnn.compile_graph(folder / "mm.onnx", "mm_ctx", folder, target)
x = np.load(folder / "x.npy")
y = ort_qnn.context_session(folder / "mm_ctx.onnx", target).run(["y"], {"x": x})[0]
np.save(folder / "y_htp.npy", y)
"""


@pytest.mark.parametrize("blocks", [2, 9])  # 9 (SmolLM2's 576 channels) crashed the simulator before it was padded
def test_an_lpbq_layer_as_matmul_gives_the_convs_integers_on_the_cpu_and_runs_on_the_simulator(
        tmp_path: Path, blocks: int) -> None:
    import subprocess
    import sys

    import onnxruntime as ort

    from npustudio.core.graph import lpbq_matmul

    k, n, t = 64 * blocks, 96, 8
    conv = _lpbq_conv_graph(tmp_path, k, n, t)
    model = onnx.load(str(conv))
    with lpbq_matmul.Store(tmp_path).open() as store:
        assert lpbq_matmul.rewrite(model.graph, tmp_path, store) == 1
    assert "Conv" not in [n.op_type for n in model.graph.node]
    onnx.save(model, str(tmp_path / "mm.onnx"))
    x = np.random.default_rng(1).integers(0, 65536, (1, k, 1, t)).astype(np.uint16)
    np.save(tmp_path / "x.npy", x)

    def cpu(path: Path) -> np.ndarray:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]

    y_conv, y_mm = cpu(conv), cpu(tmp_path / "mm.onnx")
    # the same integers but where float32 sums in another order (MatMul's kernel, not Conv's) land on the other
    # side of a rounding boundary: one step, rarely
    off = np.abs(y_mm.astype(np.int64) - y_conv.astype(np.int64))
    assert off.max() <= 1 and (off > 0).mean() < 0.01, (off.max(), (off > 0).mean())
    res = subprocess.run([sys.executable, "-c", _SIMULATE, str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"the simulator run ended with {res.returncode}: {res.stderr[-2000:]}"
    y_htp = np.load(tmp_path / "y_htp.npy")
    assert np.abs(y_htp.astype(np.int64) - y_conv.astype(np.int64)).max() <= 2  # LSBs of the 16-bit output


def test_a_prompt_graph_too_slow_for_the_simulator_is_left_out_of_the_check_and_said(w4: Project,
                                                                                       tmp_path: Path) -> None:
    """A large w4a16 model's 128-token graph would take ~half an hour per call on the x86 simulator: over the budget
    the check runs the token graph's steps from the quantsim's prompt cache alone, and the record says so."""
    from npustudio.core import compile as compile_stage
    from npustudio.core.compile import CompileOptions
    from npustudio.core.progress import State

    full = done(w4, stages.COMPILE).result.verification
    r = compile_stage.run(w4.stage_dir("quantize"), w4.stage_dir("adapt"),
                          CompileOptions(verify_tokens=64, prompt_check_budget_s=0), tmp_path, State())
    v = r.verification
    assert v.simulator and "not run on the simulator" in v.simulator and "--prompt-check-budget" in v.simulator
    assert v.tokens == v.decode_steps == 4 and v.kv_cache_max_diff_steps is None
    assert list(v.seconds_per_call_htp) == [1]  # the prompt graph never ran there
    assert v.nll_diff is not None and abs(v.nll_diff) < 0.05 and (v.top1_agreement or 0) >= 0.75
    assert (full.tokens or 0) > 40 and full.simulator is None  # the project's own compile ran the whole check
