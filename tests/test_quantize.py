"""The quantize stage on a tiny random model: presets, tied KV encodings, live points, export that runs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from pydantic import ValidationError

from npustudio.core import pipeline, stages
from npustudio.core.adapt import AdaptOptions
from npustudio.core.errors import UserError
from npustudio.core.graph import encodings
from npustudio.core.graph.exported import read_test_vectors
from npustudio.core.progress import Partial, State
from npustudio.core.project import Project
from npustudio.core.quantize import QuantizeOptions, adapt_graphs
from npustudio.core.quantize.presets import Overrides, load_overrides
from npustudio.core.stage_options import RECIPE_STEPS
from tests.conftest import done, npustudio

FAST = dict(calib_samples=2, calib_len=64, calib_decode=4, eval_chars=2500, window=128, decode_tokens=8)
PROMPT, TOKEN = "prompt_ar32_cl128_1_of_1", "token_ar1_cl128_1_of_1"


@pytest.fixture(scope="module")
def adapted_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("q")
    model = make_tiny_model(root / "m")
    p = Project.open(root / "p")
    pipeline.adapt(p, str(model), AdaptOptions(ar=32, cl=128, eval_chars=2500, window=128, decode_tokens=8), State())
    return p.root


@pytest.fixture(scope="module")
def w8(adapted_project: Path) -> tuple[Project, list[Partial]]:
    p = Project.open(adapted_project)
    st = State()
    pipeline.quantize(p, QuantizeOptions(precision="w8a16", **FAST), st)
    return p, [e for e in st.partials if e.kind == "ppl"]


def _table(p: Project, graph: str = PROMPT) -> encodings.EncodingsTable:
    return encodings.read(p.stage_dir("quantize") / f"{graph}.encodings")


def test_w8a16_keeps_perplexity_and_reports_it(w8: tuple[Project, list[Partial]]) -> None:
    p, _ = w8
    r = done(p, stages.QUANTIZE).result
    assert r.ratio == pytest.approx(1.0, abs=0.02)
    assert r.ppl_quant / r.ppl_fp == pytest.approx(r.ratio)
    assert r.top1_agreement > 0.9
    assert r.graphs == [PROMPT, TOKEN]


def test_the_float_model_is_evaluated_once_across_adapt_and_quantize(w8: tuple[Project, list[Partial]],
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from npustudio.core import quantize

    p, _ = w8
    adapt, quant = done(p, stages.ADAPT).result, done(p, stages.QUANTIZE).result
    assert quant.ppl_fp == adapt.ppl_adapted and quant.eval_tokens == adapt.eval_tokens
    # another eval than adapt's is computed here, from the float model, and the adapt stage's logits are not read
    read: list[Path] = []
    monkeypatch.setattr(quantize, "Reference", lambda folder: read.append(folder))
    opts = QuantizeOptions(precision="w8a16", **(FAST | {"eval_tokens": 200}), export=False)
    r = quantize.run(p.stage_dir("adapt"), opts, tmp_path, State())
    assert r.eval_tokens < quant.eval_tokens and not read and r.ppl_fp != quant.ppl_fp


def test_live_points_fp_first_then_quantized_for_every_window(w8: tuple[Project, list[Partial]]) -> None:
    _, points = w8
    fp = [e for e in points if "quant_ppl" not in e.data]
    q = [e for e in points if "quant_ppl" in e.data]
    assert len(fp) == len(q) > 1
    assert points.index(fp[-1]) < points.index(q[0])  # the FP line is drawn before quantized points arrive
    assert [e.data["window"] for e in q] == list(range(len(q)))
    assert all(e.data["fp_ppl"] == f.data["fp_ppl"] for e, f in zip(q, fp, strict=True))


def test_w8a16_encodings_match_the_preset(w8: tuple[Project, list[Partial]]) -> None:
    p, _ = w8
    t = _table(p)
    params = {r.name: r for r in t.rows if r.kind == "param"}
    convs = [r for r in params.values() if r.role in ("q", "k", "v", "o", "gate", "up", "down")]
    assert convs and all(r.bitwidth == 8 and r.symmetric and r.granularity == "channel" for r in convs)
    assert params["lm_head.weight"].bitwidth == 8 and params["lm_head.weight"].granularity == "channel"
    assert params["embed.weight"].bitwidth == 16
    assert not any(r.role == "norm" for r in params.values())  # norm gains stay float
    kv = [r for r in t.rows if r.role == "kv-cache"]
    assert kv and all(r.bitwidth == 8 for r in kv)
    acts = [r for r in t.rows if r.kind == "activation" and r.role != "kv-cache"]
    assert acts and all(r.bitwidth == 16 for r in acts)
    assert not any("attn_add" in r.name or "mlp_add" in r.name for r in t.rows)  # residual stream float


def test_kv_cache_in_and_out_share_one_encoding_in_both_graphs(w8: tuple[Project, list[Partial]]) -> None:
    p, _ = w8
    a, b = _table(p, PROMPT), _table(p, TOKEN)
    for layer in range(2):
        for kind in ("key", "value"):
            rows = [t.by_name(f"past_{kind}_{layer}_{d}") for t in (a, b) for d in ("in", "out")]
            enc = {(r.scale_min, r.offset, r.bitwidth) for r in rows}
            assert len(enc) == 1, enc


def test_qdq_onnx_reproduces_the_quantsim_and_float_onnx_loads(w8: tuple[Project, list[Partial]]) -> None:
    import onnxruntime as ort

    d = w8[0].stage_dir("quantize")
    for g in (PROMPT, TOKEN):
        tv = read_test_vectors(d / "test_vectors" / f"{g}.npz")
        for suffix, ref, tol in (("_qdq", "quant", 2e-3), ("", "fp", 0.5)):
            s = ort.InferenceSession(str(d / f"{g}{suffix}.onnx"), providers=["CPUExecutionProvider"])
            got = dict(zip([o.name for o in s.get_outputs()], s.run(None, tv["in"]), strict=True))
            assert np.abs(got["logits"] - tv[ref]["logits"]).max() < tol
            assert got["past_key_0_out"].shape == tv[ref]["past_key_0_out"].shape


def test_traced_weights_are_attached_from_memory_to_one_weights_file(tmp_path: Path) -> None:
    """The trace runs without its weights (they stay graph inputs); they are written from the tensors to
    NAME.onnx.data, or the weights file the stage shares between graphs, small ones inline, with the same values,
    and only the real inputs stay inputs."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch
    from onnx import helper, numpy_helper

    from npustudio.core.quantize import export

    g = torch.Generator().manual_seed(0)
    params = {"layers.0.w": torch.randn(32, 32, generator=g), "onnx::MatMul_7": torch.randn(32, 16, generator=g),
              "bias": torch.randn(16, generator=g).half(), "unused": torch.ones(3)}
    f32, f16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    ins = [helper.make_tensor_value_info("x", f32, [1, 32]), helper.make_tensor_value_info("layers.0.w", f32, [32, 32]),
           helper.make_tensor_value_info("onnx::MatMul_7", f32, [32, 16]),
           helper.make_tensor_value_info("bias", f16, [16])]
    nodes = [helper.make_node("MatMul", ["x", "layers.0.w"], ["h"]),
             helper.make_node("MatMul", ["h", "onnx::MatMul_7"], ["y0"]),
             helper.make_node("Cast", ["bias"], ["b32"], to=f32), helper.make_node("Add", ["y0", "b32"], ["y"])]
    out = [helper.make_tensor_value_info("y", f32, [1, 16])]
    path = tmp_path / "prompt.onnx"
    model = helper.make_model(helper.make_graph(nodes, "g", ins, out), opset_imports=[helper.make_opsetid("", 21)],
                              ir_version=10)  # what onnxruntime reads
    onnx.save(model, str(path))
    export.attach_weights(path, params)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["prompt.onnx", "prompt.onnx.data"]
    m = onnx.load(str(path))
    assert [i.name for i in m.graph.input] == ["x"]
    assert {t.name: numpy_helper.to_array(t).tolist() for t in m.graph.initializer} == \
        {k: v.numpy().tolist() for k, v in params.items() if k != "unused"}
    assert (tmp_path / "prompt.onnx.data").stat().st_size == (32 * 32 + 32 * 16) * 4  # the fp16 bias is inline
    x = np.ones((1, 32), np.float32)
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x @ params["layers.0.w"].numpy() @ params["onnx::MatMul_7"].numpy() + params["bias"].float().numpy()
    assert np.allclose(y, want, atol=1e-4)

    # two graphs written into one weights file (as the stage does): each weight stored once, 64-byte aligned
    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("prompt", "token"):
        onnx.save(model, str(shared / f"{name}.onnx"))
    with export.Blobs(shared / "weights.bin") as blobs:
        for name in ("prompt", "token"):
            export.attach_weights(shared / f"{name}.onnx", params, blobs=blobs)
    assert sorted(f.name for f in shared.iterdir()) == ["prompt.onnx", "token.onnx", "weights.bin"]
    assert (blobs.written, blobs.saved) == ((32 * 32 + 32 * 16) * 4,) * 2
    for name in ("prompt", "token"):
        m = onnx.load(str(shared / f"{name}.onnx"), load_external_data=False)
        at = [{e.key: e.value for e in t.external_data} for t in m.graph.initializer if t.external_data]
        assert [(a["location"], int(a["offset"]) % 64) for a in at] == [("weights.bin", 0)] * 2
        s = ort.InferenceSession(str(shared / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        assert np.allclose(s.run(None, {"x": x})[0], want, atol=1e-4)


def test_export_stores_weights_once_and_leaves_no_temp_files(w8: tuple[Project, list[Partial]]) -> None:
    import onnx

    d = w8[0].stage_dir("quantize")
    names = {f.name for f in d.rglob("*") if f.is_file()}
    assert not [n for n in names if n.endswith((".tmp", ".data")) or ".tmp." in n]
    assert {f"{PROMPT}.onnx", f"{PROMPT}.encodings", f"{PROMPT}_qdq.onnx", f"{TOKEN}.onnx", f"{TOKEN}.encodings",
            f"{TOKEN}_qdq.onnx", "weights.bin", "tokenizer.json", f"{PROMPT}.npz", f"{TOKEN}.npz"} <= names

    def refs(name: str) -> dict[str, tuple[str, str]]:
        m = onnx.load(str(d / name), load_external_data=False)
        out = {}
        for t in m.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                kv = {e.key: e.value for e in t.external_data}
                out[t.name] = (kv["offset"], kv["length"])
        return out

    a, b = refs(f"{PROMPT}.onnx"), refs(f"{TOKEN}.onnx")
    assert a and a == b  # both graphs point at the same bytes
    blobs = set(a.values()) | set(refs(f"{PROMPT}_qdq.onnx").values())
    unique = sum(int(n) for _, n in blobs)
    assert (d / "weights.bin").stat().st_size < unique + 64 * len(blobs) + 1
    rec = done(w8[0], stages.QUANTIZE)
    listed = {f["file"] for f in rec.result.files}
    assert "weights.bin" in listed and f"test_vectors/{PROMPT}.npz" in listed


def test_a_quantize_the_disk_cannot_hold_is_refused_before_it_starts(w8: tuple[Project, list[Partial]],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stage writes is estimated from the model (weights.bin: its float32 weights and the quantized ones)
    and held against the disk's free space before any work: the project keeps its last quantize output."""
    from npustudio.core import host_cost
    from npustudio.core.stages import load_card

    p = w8[0]
    weights = p.stage_dir("quantize") / "weights.bin"
    written = sum(f.stat().st_size for f in p.stage_dir("quantize").rglob("*") if f.is_file())
    stamp, rec = weights.stat().st_mtime_ns, p.record(stages.QUANTIZE)
    ar = adapt_graphs(p.stage_dir("adapt"))[0]
    need = host_cost.quantize_disk_bytes(load_card(p.stage_dir("adapt")), "w8a16", ar)
    # at least its weights file; at most all it wrote (a tiny model's graphs and encodings are large beside its
    # weights: the Qwen3-4B shape's 22.42 GB were estimated at 22.36)
    assert weights.stat().st_size <= need <= written
    monkeypatch.setattr(host_cost.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(2**40, 2**40, need - 1))
    with pytest.raises(UserError, match=r"The quantize stage writes about 0.0 GB \(an estimate\) to .* 0.0 GB free"):
        pipeline.quantize(p, QuantizeOptions(precision="w8a16", **FAST), State(), force=True)
    assert p.record(stages.QUANTIZE) == rec and weights.stat().st_mtime_ns == stamp


def test_work_beside_the_stage_writes_what_one_process_writes(w8: tuple[Project, list[Partial]], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model is calibrated half in a forked copy of the stage (its observed ranges merged back) and its
    graphs exported in forked copies while the stage evaluates; a large one does all of it in the stage's own
    process: the same files, byte for byte (encodings and test vectors included), and the same perplexity."""
    from npustudio.core import forked, quantize
    from npustudio.core.quantize import simulate

    p = w8[0]
    beside = done(p, stages.QUANTIZE).result
    assert "export_after_eval" in beside.steps  # the tiny model took the forked path
    merged: list[str] = []
    real_merge = simulate.merge_observed

    def merge_observed(o: dict[str, Any], path: str) -> None:
        merged.append(path)
        real_merge(o, path)

    monkeypatch.setattr(simulate, "merge_observed", merge_observed)
    (tmp_path / "forked").mkdir()
    (tmp_path / "alone").mkdir()
    quantize.run(p.stage_dir("adapt"), QuantizeOptions(precision="w8a16", **FAST), tmp_path / "forked", State())
    assert len(merged) == 1  # half of the calibration came from the forked copy
    monkeypatch.setattr(forked, "BESIDE_BYTES", 0)
    alone = quantize.run(p.stage_dir("adapt"), QuantizeOptions(precision="w8a16", **FAST), tmp_path / "alone",
                         State())
    assert len(merged) == 1 and "export_after_eval" not in alone.steps
    assert alone.ppl_quant == beside.ppl_quant
    for d in (p.stage_dir("quantize"), tmp_path / "forked"):
        made = sorted(f.relative_to(tmp_path / "alone") for f in (tmp_path / "alone").rglob("*") if f.is_file())
        assert made == sorted(f.relative_to(d) for f in d.rglob("*") if f.is_file())
        assert [f for f in made if f.name != "quantize.json"
                and (tmp_path / "alone" / f).read_bytes() != (d / f).read_bytes()] == []


def test_quantize_leaves_the_adapted_weights_untouched(w8: tuple[Project, list[Partial]]) -> None:
    """The stage maps the adapt stage's weights copy-on-write and folds them in place: the file must not change."""
    from npustudio.core.fsutil import sha256_file

    p = w8[0]
    rec = done(p, stages.ADAPT).record
    for f in rec.outputs:
        assert sha256_file(p.root / f.path) == f.sha256, f.path


def test_spinquant_keeps_the_float_model(w8: tuple[Project, list[Partial]]) -> None:
    """aimet's SpinQuant (R1 over the stream, R2 per head between v and o) leaves what the float model computes,
    the keys of the KV cache included, and changes the weights the quantizer sees."""
    import torch

    from npustudio.core.graph import store
    from npustudio.core.graph.kv_cache import TorchGraph
    from npustudio.core.graph.ops import Conv1x1
    from npustudio.core.quantize import spinquant

    p = w8[0]
    tv = read_test_vectors(p.stage_dir("quantize") / "test_vectors" / f"{PROMPT}.npz")
    feeds = {k: torch.from_numpy(v) for k, v in tv["in"].items()}
    model, _ = store.load(p.stage_dir("adapt"))
    before = TorchGraph(model)(feeds)
    attn = model.blocks[0].attn
    w_q, w_o = (m.weight.detach().clone() for m in (cast(Conv1x1, attn.q[0]), attn.o))
    spinquant.apply(model)
    after = TorchGraph(model)(feeds)
    for name in ("logits", "past_key_0_out"):  # R2 rotates each head's values, the o projection undoes it
        assert torch.allclose(after[name], before[name], atol=1e-4 * before[name].abs().max().item()), name
    assert not torch.allclose(cast(Conv1x1, model.blocks[0].attn.q[0]).weight, w_q)  # the weights did change
    assert not torch.allclose(model.blocks[0].attn.o.weight, w_o)
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()


@pytest.fixture(scope="module")
def adapted_families(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny models of other families, adapted when first asked for: qwen2 (q/k/v biases, one KV head for four
    query heads), olmo2 (post-norm blocks, attention biases)."""
    from tests.conftest import make_tiny_model

    made: dict[str, Path] = {}
    options = {"qwen2": {}, "olmo2": {"pad_token_id": 0, "attention_bias": True, "num_key_value_heads": 1}}

    def adapted(family: str) -> Path:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            p = Project.open(root / "p")
            model = make_tiny_model(root / "m", family, **options[family])
            pipeline.adapt(p, str(model), AdaptOptions(ar=32, cl=128, eval_chars=600, window=64, decode_tokens=0),
                           State())
            made[family] = p.root
        return made[family]
    return adapted


def test_a_layers_captured_inputs_come_from_the_layers_before_it_alone(adapted_project: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner captures a layer's inputs over two AR-N chunks (the second reads the first one's cache) computing
    the decoder only as far as that layer: the same inputs as a pass through the whole decoder, the later layers
    and the LM head not run, and the model whole again afterwards."""
    import torch
    from torch.utils._pytree import tree_leaves

    from npustudio.core.graph import store
    from npustudio.core.graph.kv_cache import KVCacheRunner
    from npustudio.core.quantize.layer_training import capture

    adapt_dir = Project.open(adapted_project).stage_dir("adapt")
    ar, cl, _ = adapt_graphs(adapt_dir)
    model, inv_freq = store.load(adapt_dir)
    assert len(model.layers) > 1
    prefill = lambda m, seq: KVCacheRunner.over(m, ar, cl, inv_freq).prefill(seq)  # noqa: E731
    ids = list(range(5, 5 + 2 * ar))
    logits = prefill(model, ids)
    whole = capture(model, list(model.layers), [ids], prefill)
    ran: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, a, name=name: ran.append(name))
             for name, m in (("last mlp", model.blocks[-1].mlp), ("first mlp", model.blocks[0].mlp))]
    head = type(model.lm_head).forward

    def computed_head(m: Any, x: Any) -> Any:  # every 1x1 convolution's forward: the head's is counted
        if m is model.lm_head:
            ran.append("head")
        return head(m, x)

    monkeypatch.setattr(type(model.lm_head), "forward", computed_head)
    first = capture(model, [model.layers[0]], [ids], prefill)[0]
    monkeypatch.undo()
    for h in hooks:
        h.remove()
    assert ran == ["first mlp", "first mlp"]  # one call a chunk, nothing after layer 0
    assert len(first) == 2 and first[1][0][3].abs().sum() > 0  # the second chunk reads a cached k
    got, want = tree_leaves(first), tree_leaves(whole[0])
    assert len(got) == len(want) and all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                                         for a, b in zip(got, want, strict=True))
    assert not any("forward" in vars(m) for m in model.modules()) and torch.equal(prefill(model, ids), logits)


@pytest.mark.parametrize(("family", "precision"), [("llama", "w4a16"), ("qwen2", "w8a16"), ("olmo2", "w4a16")])
def test_omniquant_channel_scales_leave_the_float_model_and_its_cache_consistent(
        family: str, precision: str, adapted_project: Path, adapted_families: Callable[[str], Path]) -> None:
    """OmniQuant's LET pairs on the adapted decoder (norms -> q/k/v and gate/up in a pre-norm block, each KV
    head's v and its bias -> the o channels of the query heads reading it (GQA), up -> down) change nothing the
    float layer computes, also for a second AR-N chunk reading the first one's cached v; folded, the model
    answers as before over two chunks, its weights rescaled."""
    import torch
    from aimet_torch.utils import remove_activation_quantizers, remove_all_quantizers

    from npustudio.core.graph import store
    from npustudio.core.graph.decoder import io_names
    from npustudio.core.graph.kv_cache import KVCacheRunner
    from npustudio.core.graph.ops import Conv1x1
    from npustudio.core.quantize import _vector_feeds, omniquant, simulate
    from npustudio.core.quantize.layer_training import capture
    from npustudio.core.quantize.presets import preset
    from npustudio.core.targets import find_soc

    root = adapted_project if family == "llama" else adapted_families(family)
    adapt_dir = Project.open(root).stage_dir("adapt")
    ar, cl, _ = adapt_graphs(adapt_dir)
    model, inv_freq = store.load(adapt_dir)
    assert model.spec.heads > model.spec.kv_heads  # GQA: o's channels gather the scales of the KV heads
    assert (family != "llama") == model.spec.qkv_bias and (family == "olmo2") == model.spec.post_norms
    torch.manual_seed(0)
    with torch.no_grad():
        for conv in (cast(Conv1x1, c) for layer in model.blocks for c in layer.attn.v):
            if conv.bias is not None:
                conv.bias.normal_()  # a random model's biases are zeros: these must be scaled like the weights
    ids = list(range(5, 5 + 2 * ar))  # two AR-N chunks
    feeds = _vector_feeds(KVCacheRunner.over(model, ar, cl, inv_freq), ids, ar)[0]
    sim = simulate.build(model, tuple(feeds[n] for n in io_names(model.spec.layers)[0]), preset(precision),
                         find_soc("SM8750"), Overrides())
    prefill = lambda m, seq: KVCacheRunner.over(m, ar, cl, inv_freq).prefill(seq)  # noqa: E731
    with torch.no_grad(), remove_all_quantizers(sim.model):
        before = prefill(sim.model, ids)
        calls = capture(sim.model, list(sim.model.layers), [ids], prefill)
    assert len(calls[0]) == 2 and calls[0][1][0][4].abs().sum() > 0  # the second call reads a cached v
    weight_omq: type[Any]  # aimet's quantizer classes, untyped
    weight_omq, gain_omq = omniquant._quantizer_classes()
    down = sim.model.layers[0].mlp.down.weight.detach().clone()
    torch.manual_seed(0)
    with torch.no_grad(), remove_activation_quantizers(sim.model):
        for i, layer in enumerate(sim.model.layers):
            params, fold = omniquant._install(layer, weight_omq, gain_omq)
            for s in params[:len(omniquant._let_pairs(layer))]:  # the LET scales (then each weight's range)
                s.uniform_(0.5, 2.0)
            for q in layer.modules():
                if isinstance(q, weight_omq):
                    q.run_qdq = False  # LET alone: what the float layer computes
            for args, kwargs in calls[i]:
                with remove_all_quantizers(layer):
                    plain = layer(*args, **kwargs)[0]
                let = layer(*args, **kwargs)[0]
                assert torch.allclose(let, plain, atol=1e-5 * plain.abs().max().item()), i
            fold()
        with remove_all_quantizers(sim.model):
            after = prefill(sim.model, ids)
    assert torch.allclose(after, before, atol=1e-4 * before.abs().max().item())
    assert not torch.allclose(sim.model.layers[0].mlp.down.weight, down)  # the scales went into the weights


def test_spinquant_refuses_what_it_cannot_rotate_before_any_work() -> None:
    """aimet builds Hadamard matrices of 2^n and 12/20/28·2^n only: SmolLM2-135M's hidden size 576 is neither, so
    the recipe is refused with the reason and the recipes that work."""
    from npustudio.core.quantize import validate
    from npustudio.core.shape import DecoderShape

    shape = DecoderShape(family="Llama", model_type="llama", layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576,
                         intermediate=1536, vocab=49152, rms_norm_eps=1e-5, tied_embeddings=True, qkv_bias=False,
                         qk_norm=False)
    validate(QuantizeOptions(recipe="adascale"), shape)
    with pytest.raises(UserError) as e:
        validate(QuantizeOptions(recipe="spinquant_adascale"), shape)
    assert "hidden size is 576" in e.value.problem and "adascale" in e.value.fix
    validate(QuantizeOptions(recipe="spinquant"), shape.model_copy(update={"hidden": 2048, "heads": 32}))
    with pytest.raises(UserError, match="post-norm"):
        validate(QuantizeOptions(recipe="spinquant"), shape.model_copy(update={"hidden": 2048, "post_norms": True}))


def test_test_vectors_are_plain_arrays(w8: tuple[Project, list[Partial]]) -> None:
    f = w8[0].stage_dir("quantize") / "test_vectors" / f"{TOKEN}.npz"
    with np.load(f, allow_pickle=False) as z:
        assert {"in/input_ids", "fp/logits", "quant/logits", "in/past_key_0_in"} <= set(z.files)
        assert z["in/input_ids"].shape == (1, 1)


@pytest.mark.parametrize("recipe", ["seqmse", "adascale", "omniquant", "spinquant_adascale"])
def test_w4a16_lpbq_head_int8_and_overrides(adapted_project: Path, tmp_path: Path, recipe: str) -> None:
    """Each recipe's weights still export as LPBQ (AdaScale learns plain blocks: they are grouped again)."""
    ov = tmp_path / "ov.json"
    ov.write_text(json.dumps({"weights": {"layers.1.mlp.*": 8}}))
    shutil.copytree(adapted_project, tmp_path / "p")
    p = Project.open(tmp_path / "p")
    st = State()
    steps = {"seqmse": {"seq_mse_candidates": 4}, "adascale": {"adascale_iterations": 4},  # each recipe's own
             "omniquant": {"omniquant_iterations": 4}, "spinquant_adascale": {"adascale_iterations": 4}}[recipe]
    pipeline.quantize(p, QuantizeOptions(precision="w4a16", overrides=load_overrides(ov), recipe=recipe, **steps,
                                         **FAST), st)
    r = done(p, stages.QUANTIZE).result
    assert r.recipe == recipe and r.rotated == ("spinquant" in recipe) and 0.8 < r.ratio < 1.3
    assert set(RECIPE_STEPS[recipe]) <= set(r.steps)
    assert any(f"quant+{recipe}_ppl" in e.data for e in st.partials if e.kind == "ppl")
    t = _table(p)
    params = {r.name: r for r in t.rows if r.kind == "param"}
    down0 = params["layers.0.mlp.down.weight"]  # 128 input channels: LPBQ blocks of 64
    assert (down0.bitwidth, down0.granularity, down0.block_size) == (4, "block", 64)
    raw = json.loads(next(p.stage_dir("quantize").glob(f"{PROMPT}.encodings")).read_text())
    assert {e["name"]: e["enc_type"] for e in raw["param_encodings"]}["layers.0.mlp.down.weight"] == "LPBQ"
    assert params["layers.0.attn.q.0.weight"].bitwidth == 4
    assert params["layers.1.mlp.down.weight"].bitwidth == 8  # the override file kept it 8-bit
    assert params["layers.1.mlp.gate.weight"].bitwidth == 8
    assert params["lm_head.weight"].bitwidth == 8
    assert all(r.bitwidth == 8 for r in t.rows if r.role == "kv-cache")
    # a mixed model (int4 LPBQ blocks beside the override's int8 layers) compiles with every node on the
    # HTP: the blocked layers as MatMuls, the int8 per-channel ones as convolutions
    from npustudio.core.compile import CompileOptions

    pipeline.compile_graphs(p, CompileOptions(verify_tokens=0), State())
    c = done(p, stages.COMPILE).result
    assert c.nodes_on_cpu == 0 and all(g.nodes_on_qnn > 100 for g in c.graphs)


def test_quantize_before_adapt_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no intact adapted model") as e:
        pipeline.quantize(Project.open(tmp_path / "empty"), QuantizeOptions(), State())
    assert "npustudio adapt" in e.value.fix


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    ('{"weights": {"layers.0.*": 3}}', "bitwidth 3"),
    ('{"weights": ["layers.0"]}', "wrong shape"),
])
def test_bad_override_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "ov.json"
    f.write_text(content)
    with pytest.raises(UserError, match=message):
        load_overrides(f)


def test_override_patterns_last_match_wins() -> None:
    ov = Overrides(weights={"layers.*": 8, "layers.1.*": 16})
    assert ov.weight_bits("layers.0.mlp.up", 4) == 8
    assert ov.weight_bits("layers.1.mlp.up", 4) == 16
    assert ov.weight_bits("lm_head", 4) == 4


def test_unknown_precision_and_target_are_refused(w8: tuple[Project, list[Partial]]) -> None:
    with pytest.raises(ValidationError, match="'w8a16' or 'w4a16'"):  # the options name what they accept
        QuantizeOptions(precision="w2a8", **FAST)
    with pytest.raises(UserError, match="Unknown target SoC") as e:
        pipeline.quantize(w8[0], QuantizeOptions(target="SM1234", **FAST), State())
    assert "SM8750" in e.value.fix
    assert done(w8[0], stages.QUANTIZE).result.precision == "w8a16"  # the good result is kept


def test_cancel_keeps_the_last_good_result(w8: tuple[Project, list[Partial]]) -> None:
    p = w8[0]
    before = p.record(stages.QUANTIZE)
    children = _child_processes()
    st = State()
    # the user stops during the evaluation, while the graphs are being exported beside it in forked processes
    st.subscribe(lambda e: st.cancel() if isinstance(e, Partial) and "quant_ppl" in e.data else None)
    from npustudio.core.progress import Cancelled

    with pytest.raises(Cancelled):
        pipeline.quantize(p, QuantizeOptions(precision="w8a16", calib_samples=1, **{
            k: v for k, v in FAST.items() if k != "calib_samples"}), st)
    assert p.record(stages.QUANTIZE) == before
    assert p.load().attempts["quantize"].status == "cancelled"
    assert not (p.root / "stages" / ".quantize.partial").exists()
    assert p.changed("quantize") == []
    assert _child_processes() <= children  # the exports were stopped with the stage


def _child_processes() -> set[int]:
    """This process's live children (Linux)."""
    import os

    out = set()
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields and int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(d.name))
    return out


def test_quantize_cli_json_lists_ratio_and_files(w8: tuple[Project, list[Partial]],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from npustudio.cli import main

    rc = main(["quantize", "--project", str(w8[0].root), "--precision", "w8a16", "--calib-samples", "2",
               "--calib-len", "64", "--eval-chars", "2500", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"ppl_fp", "ppl_quant", "ratio", "files"} <= out.keys()
    assert out["ratio"] == pytest.approx(out["ppl_quant"] / out["ppl_fp"])
    assert any(f["file"].endswith(".encodings") and f["bytes"] > 0 for f in out["files"])


def _aimet_two_exports(sim: Any, feeds: dict, name: str, out: Path) -> None:
    """What the stage did before: aimet's two public exporters, two traces."""
    import warnings

    import aimet_torch.onnx as aonnx

    from npustudio.core.graph.decoder import io_names
    from npustudio.core.quantize import export, simulate

    ins, outs = io_names(sim.model.spec.layers)
    kw = {"input_names": ins, "output_names": outs, "dynamo": False, "opset_version": 21}
    args = tuple(feeds[n] for n in ins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim.onnx.export(args, str(out / f"{name}.onnx"), encoding_version="1.0.0", **kw)
        aonnx.export(sim.model, args, str(out / f"{name}_qdq.onnx"), prequantize_constants=True, **kw)
    enc = out / f"{name}.encodings"
    data = json.loads(enc.read_text())
    export._add_input_encodings(data, simulate.input_quantizers(sim.model))
    enc.write_text(json.dumps(data))


def _graph(path: Path) -> tuple[list[tuple], list[list[bytes]], dict[str, bytes]]:
    import onnx

    m = onnx.load(str(path))
    nodes = [(n.op_type, tuple(n.input), tuple(n.output), n.SerializeToString()) for n in m.graph.node]
    io = [[v.SerializeToString() for v in vs] for vs in (m.graph.input, m.graph.output)]
    return nodes, io, {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}


@pytest.mark.parametrize("precision", ["w8a16", "w4a16"])
def test_folding_by_slabs_gives_aimets_folded_weights(w8: tuple[Project, list[Partial]], precision: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage observes each weight without aimet's pass-through copy and folds it a slab of rows at a time: the
    same tensors and encodings as aimet's compute_param_encodings and fold."""
    import torch

    from npustudio.core.graph import store
    from npustudio.core.graph.decoder import io_names
    from npustudio.core.quantize import simulate
    from npustudio.core.quantize.presets import preset
    from npustudio.core.targets import find_soc

    p = w8[0]
    tv = read_test_vectors(p.stage_dir("quantize") / "test_vectors" / f"{PROMPT}.npz")
    dummy = tuple(torch.from_numpy(tv["in"][n]) for n in io_names(2)[0])
    sims = []
    for _ in range(2):
        model, _ = store.load(p.stage_dir("adapt"))
        sims.append(simulate.build(model, dummy, preset(precision), find_soc("SM8750"), Overrides()))
    monkeypatch.setattr(simulate, "_SLAB", 1000)  # many slabs per weight, a partial last one
    simulate.fold(sims[0])
    from aimet_torch.nn import compute_param_encodings

    compute_param_encodings(sims[1].model)
    sims[1].fold_param_quantizers()
    ours, theirs = dict(sims[0].model.named_parameters()), dict(sims[1].model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert type(ours[name]) is type(t) and torch.equal(ours[name], t), name
        if getattr(t, "encoding", None) is not None:
            assert torch.equal(ours[name].encoding.scale, t.encoding.scale), name
            assert torch.equal(ours[name].encoding.offset, t.encoding.offset), name


@pytest.mark.parametrize("precision", ["w8a16", "w4a16"])
def test_one_trace_export_writes_what_aimets_two_exporters_write(w8: tuple[Project, list[Partial]],
                                                                 tmp_path: Path, precision: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage traces each graph once and writes both forms; they must equal aimet's own two exports."""
    import torch

    from npustudio.core.graph import store
    from npustudio.core.graph.decoder import io_names
    from npustudio.core.graph.kv_cache import TorchGraph
    from npustudio.core.quantize import export, simulate
    from npustudio.core.quantize.presets import preset
    from npustudio.core.targets import find_soc

    p = w8[0]
    tv = read_test_vectors(p.stage_dir("quantize") / "test_vectors" / f"{PROMPT}.npz")
    feeds = {k: torch.from_numpy(v) for k, v in tv["in"].items()}
    model, _ = store.load(p.stage_dir("adapt"))
    sim = simulate.build(model, tuple(feeds[n] for n in io_names(model.spec.layers)[0]), preset(precision),
                         find_soc("SM8750"), Overrides())
    simulate.fold(sim)
    sim.compute_encodings(lambda m, _a: TorchGraph(m)(feeds), None)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    calls = {"lean": 0, "aimet": 0}  # the slab-wise quantization must really run, not fall back to aimet's
    lean = export._lean_quantize_const

    def spy(aimets: Any, *args: Any, **kw: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            calls["aimet"] += 1
            return aimets(*a, **k)

        calls["lean"] += 1
        return lean(counted, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(export, "_lean_quantize_const", spy)
        export.export_graph(sim, feeds, PROMPT, one)
    assert calls["lean"] >= 2 * 4 + 2 * 3 and calls["aimet"] == 0  # every conv weight of both layers, at least
    _aimet_two_exports(sim, feeds, PROMPT, two)
    # a graph exported on its own keeps its weights in a side file (share_weights folds them into weights.bin)
    sides = [f"{PROMPT}.onnx.data", f"{PROMPT}_qdq.onnx.data"]
    assert sorted(f.name for f in one.iterdir()) == sorted([f.name for f in two.iterdir()] + sides)
    a, b = (json.loads((d / f"{PROMPT}.encodings").read_text()) for d in (one, two))
    assert a == b
    # the stage leaves aimet as it found it: an LPBQ weight stays LPBQ (int4 blocks under 8-bit per-channel scales)
    # in the 1.0.0 file the QAIRT SDK reads, not a plain 4-bit per-block encoding
    kinds = {e["enc_type"] for e in a["param_encodings"] if e["name"].endswith("down.weight")}
    assert kinds == ({"LPBQ"} if precision == "w4a16" else {"PER_CHANNEL"})
    for suffix in ("", "_qdq"):
        assert _graph(one / f"{PROMPT}{suffix}.onnx") == _graph(two / f"{PROMPT}{suffix}.onnx")


def test_shipped_override_files_load_and_every_pattern_names_a_module() -> None:
    import torch

    from npustudio.core.graph.decoder import StaticDecoder
    from npustudio.core.quantize.presets import check_overrides
    from npustudio.core.shape import DecoderSpec

    spec = DecoderSpec(family="llama", model_type="llama", layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64,
                       intermediate=128, vocab=100, rms_norm_eps=1e-5, tied_embeddings=True, qkv_bias=False,
                       qk_norm=False)
    with torch.device("meta"):
        model = StaticDecoder(spec)
    files = sorted((Path(__file__).parents[1] / "resources" / "overrides").glob("*.json"))
    assert files
    for f in files:
        check_overrides(load_overrides(f), model)  # raises, naming the pattern, when one matches nothing


def test_encodings_against_another_run_shows_what_a_recipe_changed(adapted_project: Path, tmp_path: Path) -> None:
    """`npustudio encodings AFTER --against BEFORE`, run as a user runs it: each tensor's SQNR in both runs."""
    files = {}
    for recipe in ("plain", "adascale"):
        shutil.copytree(adapted_project, tmp_path / recipe)
        p = Project.open(tmp_path / recipe)
        steps = {"adascale_iterations": 20} if recipe == "adascale" else {}
        pipeline.quantize(p, QuantizeOptions(precision="w4a16", recipe=recipe, **steps, **FAST), State())
        files[recipe] = next(p.stage_dir("quantize").glob(f"{PROMPT}.encodings"))
    cli = ("encodings", str(files["adascale"]), "--against", str(files["plain"]))
    res = npustudio(*cli, "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    down = rows["layers.0.mlp.down.weight"]
    assert down["change_db"] == pytest.approx(down["after_db"] - down["before_db"])
    # AdaScale moved the decoder layers' weight encodings and left the LM head's (outside every layer) as it was
    assert any(abs(r["change_db"]) > 0.01 for n, r in rows.items() if n.startswith("layers.") and n.endswith("weight")
               and r["change_db"] is not None)
    assert rows["lm_head.weight"]["change_db"] == 0
    res = npustudio(*cli)
    assert res.returncode == 0, res.stderr
    assert "the most damaged first" in res.stdout and "tensors gained" in res.stdout
    # another graph, or another model's run, is refused naming both, before any SQNR is computed
    token = next(f for f in files["plain"].parent.glob("*.encodings") if f.name != files["plain"].name)
    res = npustudio("encodings", str(files["adascale"]), "--against", str(token))
    assert res.returncode == 2 and "encode different graphs" in res.stderr, res.stderr
    shutil.copytree(tmp_path / "plain", tmp_path / "other")
    card = tmp_path / "other" / "stages" / "adapt" / "card.json"
    card.write_text(json.dumps(json.loads(card.read_text()) | {"layers": 7, "source": "another/model"}))
    other = tmp_path / "other" / "stages" / "quantize" / files["plain"].name
    res = npustudio("encodings", str(files["adascale"]), "--against", str(other))
    assert res.returncode == 2 and "quantized different models" in res.stderr and "another/model" in res.stderr


def test_a_recipes_encodings_are_the_same_for_the_same_seed(adapted_project: Path, tmp_path: Path) -> None:
    """AdaScale draws which elements of a layer's inputs come from the float model: a rerun with the same seed
    gives the same encodings, and `--seed` (run as a user runs it) another draw."""
    options = dict(precision="w4a16", recipe="adascale", adascale_iterations=6, int8_budget=0.0, calib_samples=2,
                   calib_len=64, eval_chars=2500)

    def encodings(name: str) -> dict:
        raw = json.loads(next(Project.open(tmp_path / name).stage_dir("quantize").glob(f"{PROMPT}.encodings"))
                         .read_text())
        return {e["name"]: e for e in raw["param_encodings"]}

    for name in ("first", "again", "other"):
        shutil.copytree(adapted_project, tmp_path / name)
    for name in ("first", "again"):
        pipeline.quantize(Project.open(tmp_path / name), QuantizeOptions(**options), State())
    res = npustudio("quantize", "--project", str(tmp_path / "other"), "--precision", "w4a16", "--recipe", "adascale",
                    "--adascale-iterations", "6", "--int8-budget", "0", "--calib-samples", "2", "--calib-len", "64",
                    "--eval-chars", "2500", "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert done(Project.open(tmp_path / "other"), stages.QUANTIZE).options.seed == 1
    first = encodings("first")
    assert encodings("again") == first
    other = encodings("other")
    assert other.keys() == first.keys() and other != first
    assert other["lm_head.weight"] == first["lm_head.weight"]  # AdaScale learns the layers' weights, not the head


def test_int8_budget_keeps_the_layer_four_bits_hurt_most(adapted_project: Path) -> None:
    """A layer whose weights have outliers loses most on the 4-bit grid (each outlier widens its block's scale, and
    the block's other weights round to zero) though they cost the float model nothing: the budget keeps that one
    int8, within the share, and leaves the float weights bit for bit as they were."""
    import torch

    from npustudio.core.graph import store
    from npustudio.core.graph.kv_cache import KVCacheRunner
    from npustudio.core.quantize import int8_budget
    from npustudio.core.quantize.presets import preset

    model, inv_freq = store.load(adapted_project / "stages" / "adapt")
    with torch.no_grad():  # gate and up read some channels through a zero norm gain, yet hold large weights there:
        layer = model.blocks[1]  # the float model ignores them, but they set their blocks' 4-bit scales
        layer.post_norm.weight[5::64] = 0
        for m in (layer.mlp.gate, layer.mlp.up):
            m.weight[:, 5::64] = 1000 * m.weight.abs().max()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    runner = KVCacheRunner.over(model, 32, 128, inv_freq)
    calib = [list(range(100, 164)), list(range(300, 364)), list(range(500, 564))]
    sizes = {g: sum(m.weight.numel() for m in mods) for g, mods in int8_budget.groups(model, lambda _n: False).items()}
    total = sum(sizes.values())
    budget = (sizes["layers.1.mlp"] + 1) / total  # room for that group and no other MLP
    c = int8_budget.choose(model, runner.score, calib, 32, preset("w4a16"), budget, Overrides(), State())
    assert c.kept == ["layers.1.mlp"] and max(c.kl, key=c.kl.__getitem__) == "layers.1.mlp"
    assert c.share <= budget
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # a probe replays the layers before its group's rather than running them: the same KL as the whole model gives
    ref = [torch.log_softmax(runner.score(s[:32]).float(), -1) for s in calib[:2]]
    for g in ("layers.1.attn", "layers.1.mlp"):
        with torch.no_grad():
            for m in int8_budget.groups(model, lambda _n: False)[g]:
                m.weight.copy_(int8_budget.on_grid(m.weight, preset("w4a16")))
        whole = sum(float(torch.nn.functional.kl_div(torch.log_softmax(runner.score(s[:32]).float(), -1), r,
                                                     log_target=True, reduction="batchmean"))
                    for s, r in zip(calib[:2], ref, strict=True)) / 2
        model.load_state_dict(before)
        assert c.kl[g] == pytest.approx(whole, abs=1e-6)
    assert not any("forward" in vars(layer) for layer in model.layers)
    # the user's own patterns come after the budget's: a file that says 4 bits for that group wins
    user = Overrides(weights={"layers.1.mlp.up": 4})
    ov = c.overrides(user)
    assert ov.weight_bits("layers.1.mlp.gate", 4) == 8 and ov.weight_bits("layers.1.mlp.up", 4) == 4
    less = int8_budget.choose(model, runner.score, calib, 32, preset("w4a16"), budget, user, State())
    assert less.kept == ["layers.1.mlp"] and less.share == pytest.approx(c.share * 2 / 3)  # gate and down: 2 of 3
    # what the user's overrides keep wide already counts against the budget and is not measured again
    wide = int8_budget.choose(model, runner.score, calib, 32, preset("w4a16"), budget,
                              Overrides(weights={"layers.1.mlp.*": 8}), State())
    assert "layers.1.mlp" not in wide.kl and not wide.kept and wide.share <= budget


def test_int8_budget_through_the_quantize_command(adapted_project: Path, tmp_path: Path) -> None:
    """`npustudio quantize --precision w4a16 --int8-budget` as a user runs it: the groups it reports are 8-bit in the
    exported encodings, every other decoder weight 4-bit, and the share it reports is what the encodings hold."""
    shutil.copytree(adapted_project, tmp_path / "p")
    res = npustudio("quantize", "--project", str(tmp_path / "p"), "--precision", "w4a16", "--int8-budget", "0.3",
                    "--calib-samples", "2", "--calib-len", "64", "--eval-chars", "2500", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    kept, share = out["kept_int8"], out["int8_share"]
    assert kept and 0 < share <= 0.3
    p = Project.open(tmp_path / "p")
    assert done(p, stages.QUANTIZE).result.kept_int8 == kept
    from npustudio.core.graph import store
    from npustudio.core.graph.ops import Conv1x1

    model, _ = store.load(p.stage_dir("adapt"))
    sizes = {f"{n}.weight": m.weight.numel() for n, m in model.named_modules()
             if isinstance(m, Conv1x1) and n.startswith("layers.")}
    weights = {r.name: r for r in _table(p).rows if r.name in sizes}
    assert weights.keys() == sizes.keys()
    wide = {n for n in weights if any(n.startswith(g + ".") for g in kept)}
    assert all(weights[n].bitwidth == (8 if n in wide else 4) for n in weights)
    assert sum(sizes[n] for n in wide) / sum(sizes.values()) == pytest.approx(share)


def test_w4a16_takes_the_default_int8_budget_unless_one_is_given(adapted_project: Path) -> None:
    """Left out, the budget is w4a16's default and none at w8a16; given, it is the user's (0 keeps every weight
    int4). The stage key hashes the budget it comes to, so `--int8-budget 0.05` at w4a16 is the same work as none."""
    from npustudio.core import quantize
    from npustudio.core.stage_options import DEFAULT_INT8_BUDGET

    adapt_dir = adapted_project / "stages" / "adapt"

    def budget(**kw: Any) -> float | None:
        return quantize.resolved(QuantizeOptions(**kw), adapt_dir).int8_budget

    assert DEFAULT_INT8_BUDGET > 0 and budget(precision="w4a16") == DEFAULT_INT8_BUDGET
    assert budget(precision="w4a16", int8_budget=DEFAULT_INT8_BUDGET) == DEFAULT_INT8_BUDGET
    assert budget(precision="w4a16", int8_budget=0) == 0.0 and budget(precision="w8a16") == 0.0
    assert budget(precision="w4a16", int8_budget=0.2) == 0.2


def test_int8_budget_measures_only_groups_that_fit(adapted_project: Path) -> None:
    """A group larger than the budget can never be kept int8, so it costs no probe: on the tiny model every group
    is over 5 % of its weights, and the default budget adds no model call to its quantize stage."""
    from npustudio.core.graph import store
    from npustudio.core.quantize import int8_budget
    from npustudio.core.quantize.presets import preset

    model, _ = store.load(adapted_project / "stages" / "adapt")
    sizes = {g: sum(m.weight.numel() for m in mods) for g, mods in int8_budget.groups(model, lambda _n: False).items()}
    calls: list[int] = []

    def logits(seq: Any) -> Any:
        calls.append(len(seq))
        raise AssertionError("no group fits: nothing to measure")

    from npustudio.core.stage_options import DEFAULT_INT8_BUDGET

    assert min(sizes.values()) / sum(sizes.values()) > DEFAULT_INT8_BUDGET
    small = min(sizes.values()) / sum(sizes.values()) * 0.9
    c = int8_budget.choose(model, logits, [list(range(100, 164))], 32, preset("w4a16"), small, Overrides(), State())
    assert not calls and not c.kept and not c.kl and c.share == 0.0


def test_the_int8_budget_probes_the_grid_the_quantsim_gives_each_weight(w8: tuple[Project, list[Partial]]) -> None:
    """The budget scores each group on the 4-bit weights the model will get: its probe's weights equal, value for
    value, what the w4a16 quantsim folds into the same float weights (LPBQ blocks where the input channels allow,
    one scale per output channel where they do not). A hand-rolled grid was up to a step off."""
    import torch

    from npustudio.core.graph import store
    from npustudio.core.graph.decoder import io_names
    from npustudio.core.graph.ops import Conv1x1
    from npustudio.core.quantize import int8_budget, simulate
    from npustudio.core.quantize.presets import preset
    from npustudio.core.targets import find_soc

    p = w8[0]
    tv = read_test_vectors(p.stage_dir("quantize") / "test_vectors" / f"{PROMPT}.npz")
    feeds = {k: torch.from_numpy(v) for k, v in tv["in"].items()}
    model, _ = store.load(p.stage_dir("adapt"))
    names = ("layers.0.mlp.down", "layers.1.attn.q.0")  # 128 input channels: LPBQ; 64: per channel
    with torch.no_grad():
        probed = {n: int8_budget.on_grid(cast(Conv1x1, model.get_submodule(n)).weight, preset("w4a16"))
                  for n in names}
    sim = simulate.build(model, tuple(feeds[n] for n in io_names(model.spec.layers)[0]), preset("w4a16"),
                         find_soc("SM8750"), Overrides())
    simulate.fold(sim)
    for n in names:
        folded = sim.model.get_submodule(n).weight.detach().as_subclass(torch.Tensor)
        assert torch.equal(probed[n], folded), n


def test_a_bf16_model_is_quantized_in_16_bits_and_codes_to_the_widened_models_files(
        tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 checkpoint's adapted weights stay bf16 until the fold, which packs them into int8 codes (one byte a
    weight, given back as float32 one module at a time while it computes), and the export traces stand-ins of no
    memory: a 4B model's quantize stage never holds it in float32. Every file it writes is, byte for byte, the
    file the same model widened to float32 at load gives (int8 budget probes, encodings, graphs, weights, test
    vectors)."""
    import torch

    from npustudio.core import quantize
    from npustudio.core.graph import store
    from npustudio.core.quantize import simulate
    from tests.conftest import bf16_copy

    half = bf16_copy(tiny_models["qwen3"], tmp_path / "bf16")
    p = Project.open(tmp_path / "p")
    pipeline.adapt(p, str(half), AdaptOptions(ar=32, cl=128, eval_chars=2500, window=128, decode_tokens=8), State())
    adapt_dir = p.stage_dir("adapt")
    options = QuantizeOptions(precision="w4a16", int8_budget=0.5, **FAST)

    held: list[set[torch.dtype]] = []
    fold = simulate.fold

    def seen_fold(sim: Any) -> None:
        fold(sim)
        held.append({t.dtype for t in sim.model.parameters()})

    monkeypatch.setattr(simulate, "fold", seen_fold)
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    res = quantize.run(adapt_dir, options, narrow, State())
    assert torch.int8 in held[0] and torch.bfloat16 in held[0]  # codes, and the bf16 norm gains
    assert res.kept_int8  # the budget's probes ran on the 16-bit model

    load = store.load
    monkeypatch.setattr(store, "load", lambda folder, widen=True: load(folder, widen=True))
    wide = tmp_path / "wide"
    wide.mkdir()
    ref = quantize.run(adapt_dir, options, wide, State())
    assert torch.int8 not in held[1] and torch.bfloat16 not in held[1]  # widened whole: float32 throughout
    assert (res.ratio, res.kept_int8) == (ref.ratio, ref.kept_int8)
    def written(folder: Path) -> list[Path]:
        return sorted(f.relative_to(folder) for f in folder.rglob("*") if f.is_file() and f.name != "quantize.json")

    files = written(wide)
    assert files == written(narrow)
    assert [f for f in files if (wide / f).read_bytes() != (narrow / f).read_bytes()] == []


def test_the_export_traces_stand_ins_and_writes_each_weights_real_values() -> None:
    """The export traces each weight matrix as a stand-in that takes no memory and writes its real float32 values
    (a 16-bit weight widened); a view that only adds or drops dims of 1 is the same values, and a tensor the
    exporter rearranged or computed from a stand-in is refused rather than written wrong."""
    import torch

    from npustudio.core.quantize import export

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(4, 3)
            self.w = torch.nn.Parameter(torch.randn(6, 5, 1, 1).bfloat16(), requires_grad=False)
            self.g = torch.nn.Parameter(torch.randn(5))

    m = Tiny()
    w, g, table = m.w, m.g, m.embed.weight
    with export._stand_ins(m) as real:
        s = m.w
        assert s.stride() == (0, 0, 0, 0) and s.untyped_storage().nbytes() == 4
        assert real(s).dtype == torch.float32 and torch.equal(real(s), w.float())
        assert torch.equal(real(s.view(6, 5)), w.float().view(6, 5))
        assert torch.equal(m.g, g) and torch.equal(m.embed.weight, table)  # small ones and the table: real values
        with pytest.raises(RuntimeError, match="rearranged"):
            real(s.view(6, 5).t())
        with pytest.raises(RuntimeError, match="folded"):
            real(s.contiguous() * 1)
    assert (m.w, m.g, m.embed.weight) == (w, g, table)
