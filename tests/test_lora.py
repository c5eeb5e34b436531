"""LoRA adapters merged into the model before adaptation (`--lora DIR[=WEIGHT]`): the adapted graphs compute what
PEFT's own model computes, the project records the adapters, and an adapter that cannot be merged exactly is refused
before any stage, naming why."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from npustudio.core import layout, stages
from npustudio.core.graph import store
from npustudio.core.graph.kv_cache import KVCacheRunner
from npustudio.core.project import Project
from tests.conftest import done, make_tiny_model, npustudio

SMALL = ("--ar", "8", "--cl", "64", "--eval-tokens", "48", "--decode-tokens", "4")
IDS = list(range(3, 43))


def _adapter(model_dir: Path, out: Path, seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
             rank: int = 4) -> Path:
    """A LoRA adapter made by PEFT itself over `model_dir`, with random (not zero) B so that it changes the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                           init_lora_weights=False))
    peft.save_pretrained(str(out))
    return out


def _peft_logits(model_dir: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=torch.tensor([IDS])).logits[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "m", "llama64")
    return model, _adapter(model, root / "adapter", seed=1)


def test_a_merged_adapter_makes_the_graphs_compute_what_peft_computes(base: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """`npustudio adapt MODEL --lora DIR`, as a process: the adapted graphs agree with PEFT's model (unmerged, as it
    runs in training) and not with the base; the record names the adapter by folder and content, so the same command
    redoes nothing, and another weight or a changed adapter redoes the stage."""
    model, adapter = base
    project = tmp_path / "p"
    res = npustudio("adapt", str(model), "--project", str(project), "--lora", str(adapter), *SMALL, "--json",
                    timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["top1_agreement"] == 1.0  # the gate: graphs against base + adapter
    graphs, inv = store.load(Project.open(project).stage_dir("adapt"))
    ours = KVCacheRunner.over(graphs, 8, 64, inv).score(IDS)
    peft = _peft_logits(model, adapter)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)(input_ids=torch.tensor([IDS]))
    agree = (ours.argmax(-1) == peft.argmax(-1)).float().mean().item()
    assert agree >= 0.999 and (ours - peft).abs().max() < 1e-3
    assert (plain.logits[0] - peft).abs().max() > 100 * (ours - peft).abs().max()  # the adapter mattered
    rec = done(Project.open(project), stages.ADAPT)
    (kept,) = rec.options.lora
    assert kept.path == str(adapter.resolve()) and kept.weight == 1.0 and kept.sha256
    assert Project.open(project).choices().lora == (kept,)  # the window's Model page shows what the CLI merged
    again = npustudio("adapt", str(model), "--project", str(project), "--lora", str(adapter), *SMALL, timeout=600)
    assert again.returncode == 0 and done(Project.open(project), stages.ADAPT).record.key == rec.record.key
    weak = npustudio("adapt", str(model), "--project", str(project), "--lora", f"{adapter}=0.001", *SMALL, timeout=600)
    assert weak.returncode == 0, weak.stderr[-1500:]
    assert done(Project.open(project), stages.ADAPT).record.key != rec.record.key
    # item 4: so weak an update is under half of int8's step nearly everywhere; the inspector's table says so
    q = npustudio("quantize", "--project", str(project), "--calib-samples", "2", "--calib-len", "64", "--eval-chars",
                  "1500", timeout=600)
    assert q.returncode == 0, q.stderr[-1500:]
    assert "LoRA adapter adapter: 6 of 6 modules have most of their update under half a quantization step" in q.stdout
    enc = next(Project.open(project).stage_dir("quantize").glob("token_*.encodings"))
    shown = npustudio("encodings", str(enc), "--lora", "--json", timeout=300)
    assert shown.returncode == 0, shown.stderr[-1500:]
    rows = json.loads(shown.stdout)
    assert len(rows) == 6 and all(r["scale"] == pytest.approx(0.002) for r in rows)
    assert all(r["kept"] < 0.05 and "rounding can erase it" in r["flags"][0] for r in rows)
    mnn = npustudio("compile", "--project", str(project), "--backend", "mnn", timeout=300)
    assert mnn.returncode == 2 and "LoRA adapters merged" in mnn.stderr, mnn.stderr[-1500:]


def _edited(src: Path, dest: Path, config: dict[str, object] | None = None,
            tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the adapter in `src` with `config` keys replaced and its tensors replaced by `tensors`."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else load_file(str(src / "adapter_model.safetensors")),
              str(dest / "adapter_model.safetensors"))
    return dest


def test_an_adapter_that_cannot_be_merged_exactly_is_refused_before_any_stage(base: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:
    """Each refused by `info --lora` (no stage runs) or, when only the weights tell, at the start of adapt, with
    exit 2 and what is wrong: a pickled adapter is never loaded."""
    from safetensors.torch import load_file

    model, adapter = base
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    first = next(iter(weights))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    huge = _edited(adapter, tmp_path / "huge")
    os.truncate(huge / "adapter_model.safetensors", 2 * 2**30)  # sparse: 2 GB for a model of a few MB
    cases = [
        (pickled, "a pickle"),
        (_edited(adapter, tmp_path / "other", {"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}),
         "was trained on meta-llama/Llama-3.2-1B"),
        (_edited(adapter, tmp_path / "rank0", {"r": 0}), "rank 0"),
        (_edited(adapter, tmp_path / "nan", tensors=weights | {first: torch.full_like(weights[first], float("nan"))}),
         "NaN"),
        (_edited(adapter, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        (huge, "more than the whole base model"),
        (tmp_path / "nowhere", "is not a folder"),
    ]
    for folder, said in cases:
        res = npustudio("info", str(model), "--lora", str(folder), timeout=300)
        assert res.returncode == 2 and said in res.stderr, (folder.name, res.stderr[-1500:])
    assert not Path("/tmp/pwned").exists()
    renamed = {k.replace("q_proj", "qkv_proj"): v for k, v in weights.items()}
    wider = make_tiny_model(tmp_path / "wider", "llama64", hidden_size=256)
    by_weights = [(_edited(adapter, tmp_path / "missing", tensors=renamed), "which this model does not have"),
                  (_adapter(wider, tmp_path / "wide_adapter", seed=2), "trained for another model")]
    for folder, said in by_weights:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": str(model)}))
        project = tmp_path / f"p_{folder.name}"
        res = npustudio("adapt", str(model), "--project", str(project), "--lora", str(folder), *SMALL, timeout=600)
        assert res.returncode == 2 and said in res.stderr, (folder.name, res.stderr[-1500:])
        assert not (project / layout.STAGES_DIR / "adapt").exists()
    listed = npustudio("info", str(model), "--lora", f"{adapter}=0.5", "--json", timeout=300)
    assert listed.returncode == 0, listed.stderr[-1500:]
    (shown,) = json.loads(listed.stdout)["lora"]
    assert shown["rank"] == 4 and shown["alpha"] == 8 and shown["modules"] == 6 and shown["weight"] == 0.5


@pytest.fixture(scope="module")
def merged_project(base: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Project:
    """The tiny model with the adapter merged, taken to a bundle."""
    from npustudio.core.stage_options import LoraAdapter
    from tests.conftest import genie_pipeline

    model, adapter = base
    return genie_pipeline(tmp_path_factory.mktemp("merged") / "p", model, lora=(LoraAdapter(path=str(adapter)),))


def test_a_bundle_of_the_merged_model_answers_in_genie_as_our_runner_and_not_as_the_base(
        base: tuple[Path, Path], merged_project: Project, genie_project: Project) -> None:
    """The fine-tuned model to a bundle: the real Genie answers token for token like our runner on the same
    binaries, and not like the bundle of the base model alone (the session's tiny project: the same base)."""
    from tests.test_families import TOKENS, genie_run, htp_runner, prompt_text

    project = merged_project
    from transformers import PreTrainedTokenizerFast

    bundle = project.stage_dir("bundle")
    prompt_ids, tokens, _ = genie_run(bundle, prompt_text(), TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / layout.TOKENIZER))
    ids = [1] + tok(prompt_text(), add_special_tokens=False)["input_ids"]  # Genie prepends BOS (1)
    assert prompt_ids[:len(ids)] == ids
    assert len(tokens) >= 12 and tokens == htp_runner(project).generate(ids, TOKENS)[:len(tokens)]
    _, plain, _ = genie_run(genie_project.stage_dir("bundle"), prompt_text(), TOKENS)
    assert plain != tokens


def test_the_model_page_picks_checks_and_removes_adapters_that_adapt_then_merges(
        qtbot: Any, base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Add LoRA adapter… on the Model page: a good adapter is listed and the Adapt page runs with it; a bad one is
    refused there and then with what is wrong (not minutes later in adapt); Remove adapters takes them away."""
    from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox

    from npustudio.gui.app import MainWindow
    from npustudio.gui.pages.model import NO_ADAPTER

    model, adapter = base
    w = MainWindow(tmp_path / "p", watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    page = w.model_page
    page.set_spec(str(model))
    assert page.adapters.text() == NO_ADAPTER and not page.clear_adapters.isEnabled()
    picked = [str(adapter)]
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *_a, **_k: picked[0])
    page.add_adapter.click()
    assert page.adapters.text() == "adapter" and page.clear_adapters.isEnabled()
    assert w.project is not None
    (chosen,) = w.project.choices().lora
    assert chosen.path == str(adapter.resolve()) and chosen.sha256
    assert w.adapt_page.options().lora == (chosen,)
    picked[0] = str(_edited(adapter, tmp_path / "rank0", {"r": 0}))
    page.add_adapter.click()
    box = next(b for b in QApplication.topLevelWidgets() if isinstance(b, QMessageBox) and b.isVisible())
    assert "rank 0" in box.text()
    box.close()
    assert w.project.choices().lora == (chosen,) and page.adapters.text() == "adapter"
    page.clear_adapters.click()
    assert w.project.choices().lora == () and page.adapters.text() == NO_ADAPTER
    assert w.adapt_page.options().lora == ()


def test_the_inspector_traces_each_adapter_module_to_its_graph_weights_and_encodings(
        qtbot: Any, base: tuple[Path, Path], merged_project: Project, genie_project: Project) -> None:
    """Item 4: `encodings --lora` (a process) and the inspector's LoRA adapters… dialog list each adapted module with
    its rank, scale and A/B shapes, the graph weights holding it and their encoding; the rows it names are exactly
    where PEFT's merged weight is in the adapted graphs (q split into heads with the softmax scale folded in), and
    an adapter at full strength is kept by int8 (most entries above half a step). A row selects its weight."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from npustudio.core.graph import encodings
    from npustudio.gui.app import MainWindow
    from npustudio.gui.inspector import Inspector
    from npustudio.gui.widgets import cells

    model, adapter = base
    enc = next(merged_project.stage_dir("quantize").glob("prompt_*.encodings"))
    res = npustudio("encodings", str(enc), "--lora", "--json", timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    rows = json.loads(res.stdout)
    assert sorted(r["module"].rsplit(".", 1)[-1] for r in rows) == ["down_proj"] * 2 + ["q_proj"] * 2 + ["v_proj"] * 2
    assert all(r["rank"] == 4 and r["scale"] == 2.0 and r["bitwidth"] == 8 for r in rows)
    assert all(r["kept"] > 0.9 and not r["flags"] and 0 < r["update_ratio"] < 10 for r in rows)
    q0 = next(r for r in rows if r["module"] == "model.layers.0.self_attn.q_proj")
    assert q0["tensors"] == ["layers.0.attn.q.0.weight", "layers.0.attn.q.1.weight"] and q0["role"] == "q"
    assert q0["a_shape"] == [4, 128] and q0["b_shape"] == [128, 4]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    merged = dict(PeftModel.from_pretrained(hf, str(adapter)).merge_and_unload().named_parameters())
    graph = load_file(str(merged_project.stage_dir("adapt") / "decoder.safetensors"))
    places = json.loads((merged_project.stage_dir("adapt") / layout.LORA_PLACES).read_text())["places"]
    for r in rows:
        for p in places[r["module"] + ".weight"]:
            want = merged[r["module"] + ".weight"][p["rows"][0]:p["rows"][1]] * p["factor"]
            assert torch.allclose(graph[p["tensor"]].reshape(want.shape), want, atol=1e-6), p
    (kept,) = done(merged_project, stages.QUANTIZE).result.lora_kept  # the stage says it, the Quantize page shows it
    assert kept.adapter == "adapter" and kept.modules == 6 and kept.flagged == 0 and kept.kept_min is not None
    assert kept.kept_min == min(r["kept"] for r in rows)
    w = MainWindow(merged_project.root, watch_devices=False)
    qtbot.addWidget(w)
    shown = dict((r[0], r[1]) for r in cells(w.quantize_page.results))
    assert shown["LoRA adapter adapter"].startswith("all 6 modules keep at least 9")
    ins = Inspector()
    qtbot.addWidget(ins)
    ins.load(encodings.read(enc))
    assert not ins.adapters.isHidden()
    ins.adapters.click()
    qtbot.waitUntil(lambda: ins.adapters_dialog is not None, timeout=60_000)
    dialog = ins.adapters_dialog
    assert dialog is not None and dialog.table.rowCount() == 6 and "1 adapter(s) (adapter)" in dialog.summary.text()
    row = next(i for i, r in enumerate(dialog.rows) if r.module == "model.layers.1.mlp.down_proj")
    dialog.table.setCurrentCell(row, 0)
    chosen = ins.selected()
    assert chosen is not None and chosen.name == "layers.1.mlp.down.weight" and chosen.bitwidth == 8
    ins.load(encodings.read(next(genie_project.stage_dir("quantize").glob("prompt_*.encodings"))))
    assert ins.adapters.isHidden()  # the base model's project: no adapter merged, no button


def test_a_merged_bundle_has_no_adapter_to_switch_and_says_how_to_build_one(merged_project: Project) -> None:
    """`chat --lora NAME` / `serve --lora NAME` on a bundle whose adapter was merged: exit 2 before any runner
    starts, saying there is nothing to switch and how to build a bundle that switches."""
    bundle = merged_project.stage_dir("bundle")
    for cmd in (("chat", "--desktop", "hello"), ("serve", "--desktop")):
        res = npustudio(*cmd, "--bundle", str(bundle), "--lora", "math", timeout=120)
        assert res.returncode == 2, res.stderr[-1500:]
        assert "no switchable LoRA adapter 'math'" in res.stderr and "--lora-switchable" in res.stderr


def test_the_places_of_fused_weights_are_the_rows_each_graph_weight_took(tmp_path: Path) -> None:
    """Phi-3 fuses q/k/v and gate/up in one Linear each: `weight_places` finds, by memory, which rows of the fused
    weight each head and each MLP weight took, and the factor folded in (the graph weight is exactly those rows times
    it), so an adapter on qkv_proj is traced to its q, k and v heads."""
    from npustudio.core import models
    from npustudio.core.families import recipe_for
    from npustudio.core.graph.decoder import adapt_weights, spec_from, weight_places
    from npustudio.core.pipeline import resolve

    lm = models.load(resolve(str(make_tiny_model(tmp_path / "phi", "phi3", pad_token_id=0,
                                                 max_position_embeddings=512))), keep_16bit=True)
    recipe = recipe_for(lm.card.model_type, lm.card.architecture)
    spec = spec_from(lm.card, lm.model)
    decoder = adapt_weights(spec, recipe, lm.model)
    places = weight_places(spec, recipe, lm.model, decoder)
    hf, graph = dict(lm.model.named_parameters()), dict(decoder.named_parameters())
    qkv = places["model.layers.1.self_attn.qkv_proj.weight"]
    assert [p.tensor for p in qkv] == [f"layers.1.attn.{f}.{h}.weight" for f, n in (("q", 2), ("k", 1), ("v", 1))
                                       for h in range(n)]
    assert qkv[0].rows == (0, 64) and qkv[-1].rows == (192, 256) and qkv[0].factor == pytest.approx(64**-0.5)
    assert [p.tensor for p in places["model.layers.0.mlp.gate_up_proj.weight"]] == ["layers.0.mlp.gate.weight",
                                                                                   "layers.0.mlp.up.weight"]
    for name, where in places.items():
        for p in where:
            want = hf[name][p.rows[0]:p.rows[1]] * p.factor
            assert torch.allclose(graph[p.tensor].reshape(want.shape), want, atol=1e-6), (name, p)


# -- switchable adapters: graph inputs Genie fills (lora-version 1) -----------------------------------------------
def test_adapters_as_graph_inputs_compute_what_peft_computes_with_each_and_with_none(base: tuple[Path, Path],
                                                                                      tmp_path: Path) -> None:
    """Two adapters of different ranks and modules kept apart from the weights: the static graphs fed one's inputs
    compute what PEFT's model computes with it, fed zeros what the base computes; a slot takes the largest rank."""
    from transformers import AutoModelForCausalLM

    from npustudio.core import lora, models
    from npustudio.core.families import recipe_for
    from npustudio.core.graph import lora_inputs
    from npustudio.core.graph.decoder import adapt_weights, spec_from, weight_places
    from npustudio.core.pipeline import resolve

    model, a1 = base
    a2 = _adapter(model, tmp_path / "a2", seed=2, targets=("q_proj", "o_proj", "gate_proj", "up_proj"), rank=2)
    lm = models.load(resolve(str(model)))
    recipe = recipe_for(lm.card.model_type, lm.card.architecture)
    spec = spec_from(lm.card, lm.model)
    decoder = adapt_weights(spec, recipe, lm.model)
    read = [lora.read(a1), lora.read(a2)]
    slots = lora_inputs.slots(read, weight_places(spec, recipe, lm.model, decoder))
    assert {s.module.rsplit(".", 1)[1]: s.rank for s in slots if ".layers.0." in s.module} == {
        "q_proj": 4, "v_proj": 4, "down_proj": 4, "o_proj": 2, "gate_proj": 2, "up_proj": 2}
    lora_inputs.attach(decoder, slots)
    inv = lm.model.model.rotary_emb.inv_freq
    plain = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = plain(input_ids=torch.tensor([IDS])).logits[0]
    for adapter, path in ((None, None), (read[0], a1), (read[1], a2)):
        runner = KVCacheRunner.over(decoder, 8, 64, inv)
        runner.extra = lora_inputs.values(slots, adapter)
        ours = runner.score(IDS)
        ref = _peft_logits(model, path) if path else base_logits
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() == 1.0 and (ours - ref).abs().max() < 1e-4
        assert path is None or (base_logits - ref).abs().max() > 100 * (ours - ref).abs().max()


def _turns(bundle: Path, prompt: str, steps: list[str], n: int) -> tuple[list[list[int]], dict[str, Any]]:
    """The real libGenie over `bundle` in ONE dialog: each step `+NAME` applies an adapter, `=S` sets the strength,
    `?` asks `prompt` for `n` greedy tokens (then resets). The tokens of each answer, read back from Genie's tensor
    dump (which stops after about 20 graph calls: keep the prompt to one chunk and `n` small), and its profile."""
    import shutil

    import numpy as np

    from npustudio.core.genie import config as genie_config
    from npustudio.core.genie import libgenie

    dump = bundle.parent / "genie_lora_dump"
    shutil.rmtree(dump, ignore_errors=True)
    cfg = genie_config.absolute(genie_config.read(bundle / layout.GENIE_CONFIG), bundle)
    cfg["dialog"]["debug"] = {"path": str(dump), "dump-tensors": True}
    dialog = libgenie.Dialog(json.dumps(cfg))
    try:
        dialog.set_max_tokens(n + 1)  # each generated token but the last is fed back, and so dumped
        for step in steps:
            if step.startswith("+"):
                dialog.apply_lora(step[1:])
            elif step.startswith("="):
                dialog.set_lora_strength(layout.LORA_ALPHA, float(step[1:]))
            else:
                assert dialog.query(prompt, lambda _s, _c: None) == 0
                dialog.reset()
        profile = json.loads(dialog.profile_json() or "{}")
    finally:
        dialog.close()
        dialog.free_profile()
    width = cfg["dialog"]["embedding"]["size"]
    table = np.fromfile(bundle / cfg["dialog"]["embedding"]["lut-path"], dtype=np.uint16).reshape(-1, width)
    token_of = {row.tobytes(): t for t, row in reversed(list(enumerate(table)))}
    turns: list[list[int]] = []
    for f in sorted(dump.rglob("*_in_inputs_embeds*"), key=lambda f: f.name):
        rows = [token_of[r.tobytes()] for r in np.fromfile(f, dtype=np.uint16).reshape(-1, width)]
        if len(rows) > 1 and (not turns or turns[-1]):  # a prompt chunk after generated tokens: the next answer
            turns.append([])
        elif len(rows) == 1:
            turns[-1].append(rows[0])
    return turns, profile


@pytest.fixture(scope="module")
def switchable_project(base: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Project, Path]:
    """`npustudio run --lora A --lora B=0.5 --lora-switchable`, as a process: the tiny model with two adapters
    kept switchable, to a bundle."""
    model, a1 = base
    root = tmp_path_factory.mktemp("switch")
    a2 = _adapter(model, root / "b2", seed=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), rank=2)
    res = npustudio("run", "--model", str(model), "--project", str(root / "p"), "--lora", str(a1), "--lora",
                    f"{a2}=0.5", "--lora-switchable", "--precision", "w8a16", *SMALL, "--calib-samples", "2",
                    "--calib-len", "64", "--eval-chars", "1500", "--no-ask", timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "LoRA adapter kept switchable, adapter: top-1 1.0000" in res.stdout
    assert "LoRA adapter kept switchable, b2: top-1 1.0000" in res.stdout and "keep at least" not in res.stdout
    return Project.open(root / "p"), a2


def test_one_bundle_switches_adapters_in_genie_as_our_runner_answers_with_each(
        switchable_project: tuple[Project, Path]) -> None:
    """One dialog of the real libGenie on the simulator: adapter A, then B, then none (strength 0) answer token for
    token as our runner on the same binaries fed that adapter's files; A's answer is not the base's; Genie's
    profile times each switch. The adapt stage proved the graphs with each adapter and with none."""
    from transformers import PreTrainedTokenizerFast

    from npustudio.core.genie import adapters
    from npustudio.core.genie.meta import read_metadata
    from tests.test_families import htp_runner

    project, _ = switchable_project
    adapted = done(project, stages.ADAPT).result
    assert set(adapted.lora_equivalence) == {"adapter", "b2"}
    assert all(e.top1_agreement == 1.0 for e in adapted.lora_equivalence.values())
    bundle = project.stage_dir("bundle")
    meta = read_metadata(bundle)
    assert meta.lora_adapters == ["adapter", "b2"] and layout.LORA_ALPHA in meta.lora_inputs
    n, prompt = 5, "the cat sat"
    turns, profile = _turns(bundle, prompt, ["+adapter", "=1", "?", "+b2", "=1", "?", "=0", "?"], n)
    runner = htp_runner(project)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / layout.TOKENIZER))
    ids = [1] + tok(prompt, add_special_tokens=False)["input_ids"]  # Genie prepends BOS (1)
    assert len(ids) <= 8  # one AR-8 chunk a query: the dump holds three queries
    ours = []
    for choice in (adapters.Choice(name="adapter"), adapters.Choice(name="b2"), adapters.Choice()):
        runner.reset()
        runner.extra = adapters.feeds(bundle, meta, choice)
        ours.append(runner.generate(ids, n)[:n])
    assert turns == ours
    assert turns[0] != turns[2] and turns[1] != turns[2]
    switches = [e for c in profile["components"] for e in c["events"] if e["type"] == "GenieDialog_applyLora"]
    assert len(switches) == 2 and all(e["lora-adapter-switching-time"]["value"] > 0 for e in switches)


def test_chat_answers_with_the_chosen_adapter_and_refuses_one_the_bundle_lacks(
        switchable_project: tuple[Project, Path], adb_server: list[str], tmp_path: Path) -> None:
    """`chat --lora NAME` and `genie-run -l NAME,lora_alpha,S` as processes: an adapter of the bundle answers, one
    it lacks or a malformed -l is refused naming what there is. On a device through the real adb server: deploy
    sends the adapters' folders too, and the device's genie-t2t-run answers with the adapter `-l` names, as the CPU
    preview here does with it."""
    from npustudio.core import device
    from npustudio.core.device import deploy
    from npustudio.core.device.virtual import VirtualDevice

    project, _ = switchable_project
    bundle = project.stage_dir("bundle")
    ok = npustudio("chat", "--preview", "--bundle", str(bundle), "--lora", "b2", "hello", timeout=300)
    assert ok.returncode == 0, ok.stderr[-1500:]
    missing = npustudio("chat", "--preview", "--bundle", str(bundle), "--lora", "math", "hello", timeout=300)
    assert missing.returncode == 2 and "no LoRA adapter 'math'; it has adapter, b2" in missing.stderr
    run = npustudio("genie-run", "-c", str(bundle / layout.GENIE_CONFIG), "-p", "hi", "--max-tokens", "4",
                    "-l", "b2,lora_alpha,0.5", timeout=300)
    assert run.returncode == 0 and "[BEGIN]" in run.stdout, run.stderr[-1500:]
    bad = npustudio("genie-run", "-c", str(bundle / layout.GENIE_CONFIG), "-p", "hi", "-l", "b2,alpha", timeout=120)
    assert bad.returncode == 2 and "NAME,lora_alpha,STRENGTH" in bad.stderr
    vd = VirtualDevice(tmp_path / "phone", preview=True).start()
    try:
        assert "connected" in str(device.client().connect(vd.serial, timeout=15))
        there = npustudio("chat", "--device", vd.serial, "--bundle", str(bundle), "--lora", "b2", "hello",
                          timeout=600)
        assert there.returncode == 0, there.stderr[-1500:]
        remote = vd.host_path(deploy.remote_dir(bundle))
        for raw in (bundle / layout.LORA_BUNDLE).rglob("*.raw"):
            assert (remote / raw.relative_to(bundle)).read_bytes() == raw.read_bytes()
        assert there.stdout.strip() == ok.stdout.strip()  # the device's preview with b2, as this computer's
    finally:
        device.client().disconnect(vd.serial)
        vd.stop()


def test_switchable_adapters_need_adapters_with_distinct_plain_names(base: tuple[Path, Path], tmp_path: Path) -> None:
    """Refused before any stage: --lora-switchable without --lora, and two adapters whose folders share a name (the
    bundle and the chat name an adapter by its folder)."""
    model, adapter = base
    alone = npustudio("adapt", str(model), "--project", str(tmp_path / "p"), "--lora-switchable", *SMALL, timeout=300)
    assert alone.returncode == 2 and "no adapter was given" in alone.stderr
    (tmp_path / "other").mkdir()
    twin = _edited(adapter, tmp_path / "other" / "adapter")
    res = npustudio("adapt", str(model), "--project", str(tmp_path / "p"), "--lora", str(adapter), "--lora",
                    str(twin), "--lora-switchable", *SMALL, timeout=300)
    assert res.returncode == 2 and "'adapter' names two of them" in res.stderr


def test_the_chat_panel_picks_the_bundles_adapter_and_the_model_page_keeps_them_switchable(
        qtbot: Any, switchable_project: tuple[Project, Path], tmp_path: Path) -> None:
    """The window over a project built with switchable adapters (from the CLI): the Model page shows them kept
    switchable; the chat panel lists the base model and each adapter, and answers with the one picked, as the CPU
    preview does with that adapter's files."""
    import shutil

    from npustudio.core import chat
    from npustudio.core.genie import adapters, host
    from npustudio.gui.app import MainWindow

    project, _ = switchable_project
    root = tmp_path / "proj"  # a copy: the shared project keeps no chat
    shutil.copytree(project.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    assert w.model_page.switchable.isChecked() and w.model_page.switchable.isEnabled()
    assert w.adapt_page.options().lora_switchable
    c = w.chat
    c.runner.setCurrentIndex(c.runner.findData("preview"))
    assert c.adapter.isVisible()
    assert [c.adapter.itemText(i) for i in range(c.adapter.count())] == [
        "Base model (no LoRA adapter)", "LoRA adapter: adapter", "LoRA adapter: b2"]
    bundle = root / "stages" / "bundle"
    said = {}
    for name in (None, "b2"):
        c.adapter.setCurrentIndex(c.adapter.findData(name))
        c.new_btn.click()
        with qtbot.waitSignal(c.answered, timeout=120_000) as got:
            c.ask("Hello")
        session = c.session
        assert session is not None and isinstance(session.engine, chat.DesktopEngine)
        assert session.engine.lora == adapters.Choice(name=name)
        raw = host.Preview(bundle, adapters.Choice(name=name)).query(session.prompt_for("Hello", []), lambda _s: None)
        said[name] = got.args[0].assistant
        assert said[name] == chat.clean_answer(raw[0], session.tok)
    assert said[None] != said["b2"]
    w.close()


def test_a_switched_adapter_answers_as_the_bundle_with_it_merged_within_quantization(
        switchable_project: tuple[Project, Path], merged_project: Project) -> None:
    """The same adapter, switched on in the switchable bundle and merged in another: on the HTP simulator over the
    eval text, the two agree on the next token nearly everywhere and score it the same within the quantization's
    noise, while the base model agrees with neither."""
    from transformers import PreTrainedTokenizerFast

    from npustudio.core.evaluate import load_corpus
    from npustudio.core.genie import adapters
    from npustudio.core.genie.meta import read_metadata
    from tests.test_families import htp_runner

    project, _ = switchable_project
    bundle = project.stage_dir("bundle")
    meta = read_metadata(bundle)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / layout.TOKENIZER))
    ids = tok(load_corpus("default", "eval"))["input_ids"][:56]
    switched = htp_runner(project)
    logits = {}
    for name in ("adapter", None):
        switched.reset()
        switched.extra = adapters.feeds(bundle, meta, adapters.Choice(name=name))
        logits[name] = switched.score(ids)
    merged = htp_runner(merged_project).score(ids)
    target = torch.tensor(ids[1:])

    def nll(x: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(x[:-1], target))

    def top1(x: torch.Tensor) -> float:
        return float((x.argmax(-1) == merged.argmax(-1)).float().mean())

    assert top1(logits["adapter"]) >= 0.9 and abs(nll(logits["adapter"]) - nll(merged)) < 0.02
    assert top1(logits[None]) < 0.5 and abs(nll(logits[None]) - nll(merged)) > 0.2
