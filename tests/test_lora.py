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
    half = npustudio("adapt", str(model), "--project", str(project), "--lora", f"{adapter}=0.5", *SMALL, timeout=600)
    assert half.returncode == 0, half.stderr[-1500:]
    assert done(Project.open(project), stages.ADAPT).record.key != rec.record.key
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


def test_a_bundle_of_the_merged_model_answers_in_genie_as_our_runner_and_not_as_the_base(
        base: tuple[Path, Path], genie_project: Project, tmp_path: Path) -> None:
    """The fine-tuned model to a bundle: the real Genie answers token for token like our runner on the same
    binaries, and not like the bundle of the base model alone (the session's tiny project: the same base)."""
    from npustudio.core.stage_options import LoraAdapter
    from tests.conftest import genie_pipeline
    from tests.test_families import TOKENS, genie_run, htp_runner, prompt_text

    model, adapter = base
    project = genie_pipeline(tmp_path / "p", model, lora=(LoraAdapter(path=str(adapter)),))
    assert isinstance(project, Project)
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
