"""NPU adaptation: the static Genie graphs reproduce the original model, with Genie's exact I/O."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from npustudio.core import layout, model_source, models, pipeline, stages
from npustudio.core.adapt import AdaptOptions
from npustudio.core.errors import UserError
from npustudio.core.graph import store
from npustudio.core.graph.decoder import io_names
from npustudio.core.graph.kv_cache import KVCacheRunner, TorchGraph
from npustudio.core.graph.ops import Conv1x1, MatMul, RMSNorm, Rope
from npustudio.core.progress import Cancelled, State
from npustudio.core.project import Project
from tests.conftest import done

FAST = AdaptOptions(ar=32, cl=128, eval_chars=2500, window=128, decode_tokens=16)


@pytest.fixture(scope="module")
def adapted(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Project]:
    out = {}
    for fam, folder in tiny_models.items():
        p = Project.open(tmp_path_factory.mktemp(f"proj-{fam}"))
        pipeline.adapt(p, str(folder), FAST, State())
        out[fam] = p
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_adapted_graphs_reproduce_the_original_logits(adapted: dict[str, Project], family: str) -> None:
    res = done(adapted[family], stages.ADAPT).result
    eq = res.equivalence
    assert eq.top1_agreement >= 0.999
    assert eq.max_abs_logit_diff <= 1e-3
    assert eq.decode_steps > 0 and eq.positions > 3 * FAST.ar  # both graphs were exercised
    assert res.ppl_adapted == pytest.approx(res.ppl_fp, rel=1e-5)


def test_the_eval_split_across_a_forked_copy_writes_what_one_process_writes(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model's second half of the equivalence windows runs in a forked copy of the stage: the same files
    (reference logits included) and the same figures, byte for byte, as one process doing every window."""
    from npustudio.core import evaluate, forked

    split: list[int] = []
    real = evaluate._Ahead.__init__

    def spy(self: evaluate._Ahead, ws: list[list[int]], *a: object) -> None:
        split.append(len(ws))
        real(self, ws, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(evaluate._Ahead, "__init__", spy)
    runs = {}
    for name in ("beside", "alone"):
        if name == "alone":
            monkeypatch.setattr(forked, "BESIDE_BYTES", 0)
        runs[name] = Project.open(tmp_path / name)
        pipeline.adapt(runs[name], str(tiny_llama), FAST, State())
    assert len(split) == 1 and split[0] > 2  # only the first run split its windows
    folders = {name: p.stage_dir("adapt") for name, p in runs.items()}
    made = sorted(f.relative_to(folders["alone"]) for f in folders["alone"].rglob("*") if f.is_file())
    assert made == sorted(f.relative_to(folders["beside"]) for f in folders["beside"].rglob("*") if f.is_file())
    assert layout.REFERENCE_LOGITS in {str(f) for f in made}
    assert [f for f in made if (folders["alone"] / f).read_bytes() != (folders["beside"] / f).read_bytes()] == []


def test_graph_io_is_exactly_what_genie_binds(adapted: dict[str, Project]) -> None:
    p = adapted["llama"]
    graphs = json.loads((p.stage_dir("adapt") / "graphs.json").read_text())
    assert [g["name"] for g in graphs] == ["prompt_ar32_cl128_1_of_1", "token_ar1_cl128_1_of_1"]
    kv, hd = 2, 16
    for g, n in zip(graphs, (32, 1), strict=True):
        ins = {t["name"]: (t["shape"], t["dtype"]) for t in g["inputs"]}
        outs = {t["name"]: t["shape"] for t in g["outputs"]}
        assert list(ins)[:4] == ["input_ids", "attention_mask", "position_ids_cos", "position_ids_sin"]
        assert ins["input_ids"] == ([1, n], "int32")
        assert ins["attention_mask"][0] == [1, 1, n, 128]
        assert ins["position_ids_cos"][0] == ins["position_ids_sin"][0] == [1, 1, n, hd // 2]
        for layer in range(2):
            assert ins[f"past_key_{layer}_in"][0] == [kv, 1, hd, 128 - n]
            assert ins[f"past_value_{layer}_in"][0] == [kv, 1, 128 - n, hd]
            assert outs[f"past_key_{layer}_out"] == [kv, 1, hd, n]
            assert outs[f"past_value_{layer}_out"] == [kv, 1, n, hd]
        assert outs["logits"] == [1, n, 384]
        assert list(outs) == io_names(2)[1]


def test_the_graph_really_has_those_shapes(adapted: dict[str, Project]) -> None:
    model, inv = store.load(adapted["qwen3"].stage_dir("adapt"))
    runner = KVCacheRunner(model.spec, 128, {32: TorchGraph(model)}, inv)
    out = TorchGraph(model)(runner.feeds([5, 6, 7], 32))
    assert out["logits"].shape == (1, 32, 384)
    assert out["past_key_1_out"].shape == (2, 1, 32, 32) and out["past_value_1_out"].shape == (2, 1, 32, 32)


def test_adapted_form_is_convs_and_visible_ops(adapted: dict[str, Project]) -> None:
    model, _ = store.load(adapted["llama"].stage_dir("adapt"))
    kinds = [type(m) for m in model.modules()]
    assert nn.Linear not in kinds
    per_layer = 4 + 2 + 2 + 1 + 3  # single-head q (4 heads), k and v (2 KV heads), o, gate/up/down
    assert kinds.count(Conv1x1) == 2 * per_layer + 1  # + LM head
    assert kinds.count(MatMul) == 2 * 2 and kinds.count(nn.Softmax) == 2 and kinds.count(Rope) == 2 * 2
    assert kinds.count(RMSNorm) == 2 * 2 + 1


def test_saved_model_reloads_with_identical_logits_and_tied_weights_stored_once(
        adapted: dict[str, Project], tiny_llama: Path) -> None:
    folder = adapted["llama"].stage_dir("adapt")
    with safe_open(str(folder / layout.DECODER_WEIGHTS), "pt") as f:
        names = set(f.keys())
    assert "embed.weight" in names and "lm_head.weight" not in names
    model, inv = store.load(folder)
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    lm = models.load(model_source.resolve_source(str(tiny_llama)))
    ids = list(range(3, 60))
    with torch.no_grad():
        ref = lm.model(input_ids=torch.tensor([ids])).logits[0]
    r = KVCacheRunner.over(model, 32, 128, inv)
    assert (r.logits(ids, decode_tokens=10) - ref).abs().max() < 1e-4
    for f in ("tokenizer.json", "graphs.json", "card.json", "equivalence.json"):
        assert (folder / f).is_file()


def test_greedy_generation_matches_transformers(adapted: dict[str, Project], tiny_models: dict[str, Path]) -> None:
    lm = models.load(model_source.resolve_source(str(tiny_models["qwen2"])))
    model, inv = store.load(adapted["qwen2"].stage_dir("adapt"))
    prompt = lm.tokenizer("def f(x):\n    return")["input_ids"]
    want = lm.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    r = KVCacheRunner.over(model, 32, 128, inv)
    assert r.generate(prompt, 12) == want


def test_second_run_is_skipped(adapted: dict[str, Project], tiny_models: dict[str, Path]) -> None:
    p = adapted["llama"]
    before = done(p, stages.ADAPT).record
    rec = pipeline.adapt(p, str(tiny_models["llama"]), FAST, State())
    assert rec.started == before.started  # not rerun


def test_rmsnorm_stays_finite_and_exact_in_fp16() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 576, 1, 8)
    x[0, 5, 0, :] = 23000.0  # the residual-stream outlier that overflows x² in fp16
    small = torch.randn(1, 576, 1, 8) * 1e-3  # ordinary tokens that underflow a constant pre-scale
    w = torch.rand(576) + 0.5
    norm = RMSNorm(w, 1e-5, dim=1)
    for inp in (x, small):
        ref = inp * torch.rsqrt(inp.pow(2).mean(1, keepdim=True) + 1e-5) * w.reshape(1, -1, 1, 1)
        got = norm.half()(inp.half()).float()
        assert torch.isfinite(got).all()
        assert ((got - ref).abs() / (ref.abs() + 1e-2)).max() < 1e-2
        norm.float()
    naive = x.half() * torch.rsqrt(x.half().pow(2).mean(1, keepdim=True) + 1e-5)
    assert not torch.isfinite(naive).all() or naive.abs().max() == 0  # what the rescaling avoids


def test_rmsnorm_of_the_attention_sink_token_survives_the_htp_simulator(tmp_path: Path) -> None:
    """The HTP divides by multiplying with the reciprocal: 1/23000 is subnormal in fp16 and was
    flushed to zero, so the sink token's norm (and every layer's K/V after it) came out 0."""
    from npustudio.core.graph import ort_qnn
    from npustudio.core.targets import find_soc

    torch.manual_seed(0)
    x = torch.randn(1, 576, 1, 8)
    x[0, 5, 0, 0] = 23000.0  # position 0: the sink's massive activation (SmolLM2 layer 11 gives ~2.3e4)
    w = torch.rand(576) + 0.5
    ref = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-5) * w.reshape(1, -1, 1, 1)
    torch.onnx.export(RMSNorm(w, 1e-5, dim=1), (x,), str(tmp_path / "norm.onnx"), input_names=["x"],
                      output_names=["y"], dynamo=False)
    c = ort_qnn.compile_graph(tmp_path / "norm.onnx", "norm_ctx", tmp_path, find_soc("SM8750"))
    assert not c.nodes_on_cpu
    got = ort_qnn.context_session(tmp_path / "norm_ctx.onnx", find_soc("SM8750")).run(["y"], {"x": x.numpy()})[0]
    err = np.abs(got - ref.numpy())
    assert err[..., 0].max() < 0.05 * ref[..., 0].abs().max()  # the sink token (|y| up to ~24·w)
    assert err.max() < 0.05


@pytest.mark.parametrize(("opts", "message"), [
    (AdaptOptions(ar=128, cl=128), "need 1 ≤ AR < CL"),
    (AdaptOptions(ar=1, cl=128), "two graphs of the same shape"),
    (AdaptOptions(ar=32, cl=4096), "exceeds what the model was trained for"),
])
def test_bad_options_are_refused_before_any_work(tiny_llama: Path, tmp_path: Path, opts: AdaptOptions,
                                                 message: str) -> None:
    p = Project.open(tmp_path / "p")
    with pytest.raises(UserError, match=message):
        pipeline.adapt(p, str(tiny_llama), opts, State())
    assert "adapt" not in p.load().stages and not p.stage_dir("adapt").exists()


def test_cancel_stops_the_stage_and_keeps_no_partial_output(tiny_llama: Path, tmp_path: Path) -> None:
    p = Project.open(tmp_path / "p")
    st = State()
    st.subscribe(lambda ev: st.cancel() if getattr(ev, "kind", "") == "ppl" else None)
    with pytest.raises(Cancelled):
        pipeline.adapt(p, str(tiny_llama), FAST, st)
    assert "adapt" not in p.load().stages and p.load().attempts["adapt"].status == "cancelled"
    assert not p.stage_dir("adapt").exists()
    assert pipeline.adapt(p, str(tiny_llama), FAST, State()).status == "done"  # reruns cleanly


def test_adapt_cli_json(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from npustudio.cli import main

    rc = main(["adapt", str(tiny_llama), "--project", str(tmp_path / "p"), "--ar", "32", "--cl", "128",
               "--decode-tokens", "8", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["top1_agreement"] >= 0.999 and data["max_abs_logit_diff"] <= 1e-3
    assert data["graphs"] == ["prompt_ar32_cl128_1_of_1", "token_ar1_cl128_1_of_1"]
    rc = main(["adapt", str(tmp_path / "nowhere"), "--project", str(tmp_path / "p2")])
    err = capsys.readouterr().err
    assert rc == 2 and "No model at" in err and "fix:" in err


def test_adapted_weights_read_back_exactly_and_a_cut_file_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from npustudio.core.graph.store import read_tensors

    t = {"w": torch.randn(3, 5).bfloat16(), "s": torch.tensor(3.0), "i": torch.arange(7, dtype=torch.int32),
         "big": torch.randn(64, 48)}
    save_file(t, str(tmp_path / "ok.safetensors"))
    back = read_tensors(tmp_path / "ok.safetensors")
    assert back.keys() == t.keys() and all(torch.equal(back[k], t[k]) and back[k].dtype == t[k].dtype for k in t)
    data = (tmp_path / "ok.safetensors").read_bytes()
    for cut in (data[:-10], data[:5], b"\xff" * 64):
        (tmp_path / "bad.safetensors").write_bytes(cut)
        with pytest.raises(UserError, match="not a complete safetensors file"):
            read_tensors(tmp_path / "bad.safetensors")


def test_a_bf16_checkpoint_is_adapted_in_16_bits_with_float32_arithmetic(tiny_models: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """A bf16 checkpoint's weights stay bf16 through the adapt stage (half the memory and the file a float32 copy
    takes), while every product is float32's: the adapted logits equal the float32-widened model's to float32
    rounding (bf16 arithmetic would be ~1e-2 off), and what is rescaled (Qwen3's q-norm gain, times 1/sqrt(32))
    is kept in float32, not rounded to bf16. The stages after it read float32."""
    from npustudio.core.evaluate import Reference, windows
    from tests.conftest import bf16_copy

    half = bf16_copy(tiny_models["qwen3"], tmp_path / "bf16")
    p = Project.open(tmp_path / "p")
    pipeline.adapt(p, str(half), FAST, State())
    folder = p.stage_dir("adapt")
    with safe_open(str(folder / layout.DECODER_WEIGHTS), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["layers.0.mlp.down.weight"] == dtypes["embed.weight"] == "BF16"
    assert dtypes["layers.0.attn.q_norm.weight"] == "F32"  # the softmax scale folded in
    assert json.loads((folder / layout.CARD).read_text())["stored_bits"] == 16

    wide = models.load(model_source.resolve_source(str(half))).model  # the checkpoint widened to float32 whole
    assert wide.dtype == torch.float32
    ref = Reference(folder)
    worst = 0.0
    for w in windows(ref.ids, FAST.window):
        with torch.no_grad():
            fp = wide(input_ids=torch.tensor([w])).logits[0]
        got = ref(w)
        worst = max(worst, float((got - fp).abs().max() / (fp.max() - fp.min())))
    assert worst < 1e-5, worst

    model, _ = store.load(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.blocks[0].mlp.down.weight[:, :, 0, 0], wide.model.layers[0].mlp.down_proj.weight)


def test_float32_weights_under_a_config_naming_bfloat16_load_unrounded(tiny_models: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """The dtype a model loads in is read from its safetensors, not its config: float32 tensors under a config that
    says bfloat16 (hand-edited, or saved by a tool that kept the training dtype) load as float32, every weight as
    stored, where transformers' `dtype="auto"` rounded them to bf16."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    source = model_source.resolve_source(str(folder))
    assert models.read_card(source).stored_bits == 32
    lm = models.load(source, keep_16bit=True)
    stored = load_file(str(next(folder.glob("*.safetensors"))))
    assert lm.model.dtype == torch.float32
    assert torch.equal(lm.model.model.layers[0].mlp.down_proj.weight, stored["model.layers.0.mlp.down_proj.weight"])
