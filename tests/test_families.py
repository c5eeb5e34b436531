"""Model families and their config options: each supported option proven through the real libGenie on a tiny model
whose option is active within the context, every other one refused at intake; the equivalence gate.

One tiny pipeline per family, options that can coexist combined in it (CL 128, AR-32, RoPE scalings with an
original context of 64 so positions past it occur in the prompt):
  Llama   attention_bias (q/k/v/o) + mlp_bias + gelu_pytorch_tanh + linear RoPE
  Qwen3   attention_bias (q/k/v/o) + q/k norm + gelu (erf) + dynamic RoPE
  Mistral sliding window = CL + yarn RoPE
  Phi-3   fused qkv/gate_up + longrope (context = original_max_position_embeddings)
  Phi-4-mini-like  Phi-3 + partial_rotary_factor 0.75 (RoPE over 48 of 64 head dims, Genie's rope-dim 24) + longrope
  Granite embedding/attention/residual multipliers and logits_scaling, folded into the weights (tied table)
  SmolLM3 no_rope_layers [1, 0] (layer 1 NoPE: q/k not rotated) + attention_bias + its rope_theta 2e6
  OLMo 2  post-norm blocks + q/k RMSNorm over the whole projection + attention_bias (q/k/v/o)
Genie's token proof: its greedy tokens equal those of the host KV-cache runner over the same compiled binaries on
the HTP simulator, whose RoPE tables come from our stored frequencies (Genie computes its own from the config), and
the cos/sin tables Genie built equal ours to the uint16 step.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from npustudio.core import layout, model_source, models, pipeline, stages
from npustudio.core.adapt import AdaptOptions
from npustudio.core.config_audit import check_context, support_table
from npustudio.core.errors import UserError
from npustudio.core.evaluate import load_corpus
from npustudio.core.genie import config as genie_config
from npustudio.core.genie import libgenie
from npustudio.core.graph import ops
from npustudio.core.graph.kv_cache import KVCacheRunner, rope_tables
from npustudio.core.progress import State
from npustudio.core.project import Project
from npustudio.core.results import AdaptResult
from tests.conftest import done, genie_pipeline, item_at, make_tiny_model, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 16
SHORT = [round(1 + i * 0.05, 3) for i in range(32)]  # longrope factors per rotary frequency (head_dim 64)
LONG = [round(1 + i * 0.3, 3) for i in range(32)]
# Granite 3.x's constants are 12, 1/64 (its head_dim), 0.22 and 8; here off the tiny model's 1/sqrt(64) too
GRANITE: dict[str, Any] = dict(embedding_multiplier=12.0, attention_multiplier=0.03, residual_multiplier=0.22,
                               logits_scaling=8.0)


def rope(kind: str, **params: Any) -> dict[str, Any]:
    return {"rope_type": kind, "rope_theta": 10000.0, **params}


def _project(tmp_path_factory: pytest.TempPathFactory, family: str, **config: Any) -> Project:
    root = tmp_path_factory.mktemp(family)
    return genie_pipeline(root / "p", make_tiny_model(root / "m", family, **config))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return _project(tmp_path_factory, "llama64", attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh",
                    rope_parameters=rope("linear", factor=2.0))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Project:
    # head_dim 128, as Qwen3, Qwen2.5-1.5B and Llama-3.2-3B have: Genie's cos/sin tables and its KV cache at that width
    return _project(tmp_path_factory, "qwen3", head_dim=128, attention_bias=True, hidden_act="gelu",
                    max_position_embeddings=128, rope_parameters=rope("dynamic", factor=4.0))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return _project(tmp_path_factory, "mistral", head_dim=64, sliding_window=128,
                    rope_parameters=rope("yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=1.2,
                                         beta_fast=16.0, beta_slow=2.0))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return _project(tmp_path_factory, "phi3", pad_token_id=0, max_position_embeddings=512,
                    original_max_position_embeddings=128,
                    rope_parameters=rope("longrope", short_factor=SHORT, long_factor=LONG))


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory: pytest.TempPathFactory) -> Project:
    # Phi-4-mini's partial rotary factor and longrope: 48 of each head's 64 dims rotated, 24 factors per list
    return _project(tmp_path_factory, "phi3", pad_token_id=0, max_position_embeddings=512,
                    original_max_position_embeddings=128, partial_rotary_factor=0.75,
                    rope_parameters=rope("longrope", short_factor=SHORT[:24], long_factor=LONG[:24]))


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return _project(tmp_path_factory, "granite", **GRANITE)


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory: pytest.TempPathFactory) -> Project:
    # transformers' own rule (a NoPE layer every `no_rope_layer_interval`) gives no_rope_layers [1, 0]
    return _project(tmp_path_factory, "smollm3", pad_token_id=0, no_rope_layer_interval=2, attention_bias=True)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return _project(tmp_path_factory, "olmo2", pad_token_id=0, attention_bias=True)


def prompt_text() -> str:
    return load_corpus("default", "eval")[:150]  # 84 tokens: positions past 64 in the prompt itself


def genie_run(bundle: Path, prompt: str, n: int, encoding: dict[str, Any] | None = None
              ) -> tuple[list[int], list[int], dict[str, np.ndarray]]:
    """The real libGenie's prompt ids (BOS first), its first `n` greedy tokens and the uint16 cos/sin tables it
    built, read back from its tensor dump (`debug.dump-tensors`: its API returns only text). `encoding` replaces
    the config's positional-encoding block."""
    dump = bundle.parent / f"genie_dump_{n}"
    shutil.rmtree(dump, ignore_errors=True)
    cfg = genie_config.absolute(genie_config.read(bundle / layout.GENIE_CONFIG), bundle)
    if encoding is not None:
        cfg["dialog"]["engine"]["model"]["positional-encoding"] = encoding
    cfg["dialog"]["debug"] = {"path": str(dump), "dump-tensors": True}
    dialog = libgenie.Dialog(json.dumps(cfg))
    try:
        dialog.set_max_tokens(n + 1)  # each generated token but the last is fed back, and so dumped
        dialog.query(prompt, lambda _s, _c: None)
    finally:
        dialog.close()
        dialog.free_profile()
    # the graph calls in order (000_…, 001_…), each fed its tokens' rows of the embedding table: read back as ids
    fed = sorted(dump.rglob("*_in_inputs_embeds*"), key=lambda f: f.name)
    width = cfg["dialog"]["embedding"]["size"]
    table = np.fromfile(bundle / cfg["dialog"]["embedding"]["lut-path"], dtype=np.uint16).reshape(-1, width)
    token_of = {row.tobytes(): t for t, row in reversed(list(enumerate(table)))}
    steps = [[token_of[r.tobytes()] for r in np.fromfile(f, dtype=np.uint16).reshape(-1, width)] for f in fed]
    prompt_ids = [t for s in steps if len(s) > 1 for t in s]  # the AR-32 chunks, padded
    tables = {k: np.fromfile(next(dump.rglob(f"position_ids_{k}.u16.dat")), dtype=np.uint16) for k in ("cos", "sin")}
    shutil.rmtree(dump)
    return prompt_ids, [s[0] for s in steps if len(s) == 1], tables


def htp_runner(project: Project) -> KVCacheRunner:
    """The host KV-cache runner over the project's compiled binaries on the HTP simulator (our RoPE tables)."""
    from npustudio.core.genie.meta import read_metadata
    from npustudio.core.graph import ort_qnn
    from npustudio.core.graph.ort_graph import OrtGraph

    meta = read_metadata(project.stage_dir("bundle"))
    compiled = project.stage_dir("compile")
    graphs = {g.ar: OrtGraph(ort_qnn.context_session(compiled / f"{g.name}.onnx", meta.target), meta.io_encodings,
                             compiled / "prepared" / layout.EMBEDDING_LUT) for g in meta.graphs}
    return KVCacheRunner(meta.decoder, meta.context_length, graphs,  # type: ignore[arg-type]
                         torch.tensor(meta.rope_inv_freq))


def check_geniex_metadata(project: Project) -> None:
    """metadata.json names each compiled graph of the bundle for GenieX, with the graph's inputs and outputs and
    the KV cache in GenieX's order; a model_id whose prefix is GenieX's pipeline where it has one, none else."""
    from npustudio.core.genie import geniex

    bundle = project.stage_dir("bundle")
    meta = json.loads((bundle / layout.METADATA).read_text())
    card = done(project, stages.MODEL).result.card
    names = {g.graph for g in done(project, stages.COMPILE).result.graphs}
    assert set(meta["model_files"]) == names
    for name, io in meta["model_files"].items():
        assert re.fullmatch(r"(?:[a-zA-Z]+_)?ar\d+_cl\d+_\d+_of_\d+", name)
        key, value = io["inputs"]["past_key_0_in"]["shape"], io["inputs"]["past_value_0_in"]["shape"]
        assert key[0] == value[0] == card.kv_heads and key[1] == value[1] == 1
        assert key[2] == value[3] == card.head_dim
        assert next(iter(io["inputs"])) in ("input_ids", "inputs_embeds")
    prefix = geniex.PIPELINES.get(card.model_type)
    assert (meta.get("model_id") or "").startswith(prefix) if prefix else "model_id" not in meta


def prove_in_genie(project: Project, scaling: dict[str, Any] | None) -> None:
    """Adapt passed the gate, w8a16 kept the perplexity, every node is on the HTP, the bundle carries `scaling`,
    and the real Genie computes our RoPE tables and answers token for token like our runner on the same binaries."""
    a = done(project, stages.ADAPT).result
    assert a.gate is not None and a.gate.passed and not a.gate.accepted_mismatch
    assert a.equivalence.top1_agreement >= 0.999
    assert done(project, stages.QUANTIZE).result.ratio < 1.05
    assert done(project, stages.COMPILE).result.nodes_on_cpu == 0
    bundle = project.stage_dir("bundle")
    engine = json.loads((bundle / layout.GENIE_CONFIG).read_text())["dialog"]["engine"]
    encoding = engine["model"]["positional-encoding"]
    got = encoding.get("rope-scaling")
    want = None if scaling is None else {k: pytest.approx(v) if isinstance(v, float) else v for k, v in scaling.items()}
    assert got == want
    check_geniex_metadata(project)

    from transformers import PreTrainedTokenizerFast

    from npustudio.core.graph.ort_graph import quantize

    prompt_ids, tokens, tables = genie_run(bundle, prompt_text(), TOKENS)
    runner = htp_runner(project)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / layout.TOKENIZER))
    ids = [1] + tok(prompt_text(), add_special_tokens=False)["input_ids"]  # Genie prepends BOS (1)
    assert prompt_ids[:len(ids)] == ids and 64 < len(ids) and len(ids) + TOKENS < runner.cl
    cos, sin = rope_tables(runner.inv_freq, range(runner.cl), runner.spec.rope_attention_scaling)
    for name, ours in (("cos", cos), ("sin", sin)):
        enc = runner.graphs[1].io[f"position_ids_{name}"]  # type: ignore[attr-defined]
        mine = quantize(ours[0, 0].numpy(), enc, floor=True).reshape(-1).astype(np.int64)
        diff = np.abs(tables[name].astype(np.int64) - mine)
        assert diff.max() <= 1 and (diff == 0).mean() > 0.99, name  # equal to the step (float64 vs our float32)
    expected = runner.generate(ids, TOKENS)
    assert len(tokens) >= 12 and tokens == expected[:len(tokens)]
    if scaling is not None:  # the proof can fail: Genie with plain RoPE answers differently
        plain = {k: v for k, v in encoding.items() if k != "rope-scaling"}
        assert genie_run(bundle, prompt_text(), TOKENS, plain)[1] != tokens


def test_llama_biases_tanh_gelu_and_linear_rope_run_in_genie_as_adapted(llama: Project) -> None:
    spec = json.loads((llama.stage_dir("adapt") / "decoder.json").read_text())
    assert (spec["qkv_bias"], spec["o_bias"], spec["mlp_bias"], spec["activation"]) == (True, True, True, "gelu_tanh")
    prove_in_genie(llama, {"rope-type": "linear", "factor": 2.0})


def test_qwen3_biases_erf_gelu_and_dynamic_rope_run_in_genie_as_adapted(qwen3: Project) -> None:
    card = done(qwen3, stages.MODEL).result.card
    assert (card.o_bias, card.qk_norm, card.activation) == (True, True, "gelu")
    assert card.rope_scaling is not None
    assert card.rope_scaling["rope_type"] == "dynamic"  # unscaled up to max_position_embeddings = CL
    prove_in_genie(qwen3, None)


def test_qwen3_read_one_token_at_a_time_answers_as_our_runner_over_the_token_graph(qwen3: Project,
                                                                                  tmp_path: Path) -> None:
    """A bundle without its prompt graphs (`--token-graphs-only`: how a 1.7B model's contexts fit one protection
    domain) makes Genie read the prompt through the AR-1 graph, one token at a time: its answer is our runner's
    over that graph alone, token for token, at head_dim 128 as Qwen3's."""
    from transformers import PreTrainedTokenizerFast

    from npustudio.core.genie import bundle as bundle_stage

    folder = tmp_path / "bundle"
    folder.mkdir()
    res = bundle_stage.run(qwen3.stage_dir("compile"), qwen3.stage_dir("adapt"),
                           bundle_stage.BundleOptions(prompt_graphs=False), folder, State())
    assert any("one token at a time" in n for n in res.notes)
    assert [f.name for f in folder.glob("*.bin")] == ["token_ar1_cl128_1_of_1.bin"]
    cfg = genie_config.absolute(genie_config.read(folder / layout.GENIE_CONFIG), folder)
    dialog = libgenie.Dialog(json.dumps(cfg))
    pieces: list[str] = []
    try:
        dialog.set_max_tokens(TOKENS)
        dialog.query(prompt_text(), lambda s, _c: pieces.append(s))
    finally:
        dialog.close()
        dialog.free_profile()
    both = htp_runner(qwen3)
    runner = KVCacheRunner(both.spec, both.cl, {1: both.graphs[1]}, both.inv_freq)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / layout.TOKENIZER))
    ids = [1] + tok(prompt_text(), add_special_tokens=False)["input_ids"]  # Genie prepends BOS (1)
    assert "".join(pieces) == tok.decode(runner.generate(ids, TOKENS))


def test_mistral_window_and_yarn_rope_run_in_genie_as_adapted(mistral: Project) -> None:
    card = done(mistral, stages.MODEL).result.card
    assert (card.family, card.sliding_window) == ("Mistral", 128)
    # Genie scales its tables by attn-factor · (1 + 0.1·ln 4); transformers by attention_factor 1.2
    prove_in_genie(mistral, {"rope-type": "yarnrope", "factor": 4.0, "original-max-position-embeddings": 64,
                             "dim": 64, "extrapolation-factor": 1.0, "attn-factor": 1.2 / (1 + 0.1 * math.log(4)),
                             "beta-fast": 16.0, "beta-slow": 2.0})


def test_phi3_fused_weights_and_longrope_run_in_genie_as_adapted(phi3: Project) -> None:
    card = done(phi3, stages.MODEL).result.card
    assert card.family == "Phi-3" and card.rope_scaling is not None
    assert card.rope_scaling["attention_factor"] > 1.1  # the tables exceed ±1
    prove_in_genie(phi3, {"rope-type": "longrope", "factor": 4.0, "original-max-position-embeddings": 128,
                          "short-factor": SHORT, "long-factor": LONG})


def test_phi4_mini_partial_rotary_and_longrope_run_in_genie_as_adapted(phi4_mini: Project) -> None:
    """Genie's `rope-dim` is the number of rotary frequencies: 24 for RoPE over the first 48 dims of each head. The
    tables it builds from it (24 wide, theta^(-i/24)) equal transformers' partial tables (theta^(-2i/48))."""
    card = done(phi4_mini, stages.MODEL).result.card
    assert (card.family, card.head_dim, card.rotary_dim) == ("Phi-3", 64, 48)
    spec = json.loads((phi4_mini.stage_dir("adapt") / "decoder.json").read_text())
    assert spec["rotary_dim"] == 48
    enc = json.loads((phi4_mini.stage_dir("bundle") / layout.GENIE_CONFIG).read_text())
    assert enc["dialog"]["engine"]["model"]["positional-encoding"]["rope-dim"] == 24
    prove_in_genie(phi4_mini, {"rope-type": "longrope", "factor": 4.0, "original-max-position-embeddings": 128,
                               "short-factor": SHORT[:24], "long-factor": LONG[:24]})


def test_partial_rotary_passes_the_gate_only_rotating_the_first_dims(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's split is proven by the gate: rotating the last 48 dims of each head instead fails it."""
    model = make_tiny_model(tmp_path / "m", "phi3", pad_token_id=0, partial_rotary_factor=0.75)
    opts = AdaptOptions(ar=32, cl=128, eval_chars=800, window=128, decode_tokens=4)
    good = pipeline.adapt(Project.open(tmp_path / "p"), str(model), opts, State())
    assert good.result["spec"]["rotary_dim"] == 48 and good.result["equivalence"]["top1_agreement"] == 1.0

    def last_dims(self: ops.Rope, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        rest, rot = torch.split(x, [x.shape[self.dim] - 48, 48], dim=self.dim)
        return torch.cat([rest, self.rotate(rot, cos2, sin2)], dim=self.dim)

    monkeypatch.setattr(ops.Rope, "forward", last_dims)
    with pytest.raises(UserError) as e:
        pipeline.adapt(Project.open(tmp_path / "q"), str(model), opts, State())
    assert "partial rotary (48 of 64 head dims)" in e.value.problem


def test_granite_multipliers_run_in_genie_as_adapted(granite: Project) -> None:
    """The four constants live in the weights (Genie's config is Llama's): the real Genie answers like our runner."""
    card = done(granite, stages.MODEL).result.card
    assert card.family == "Granite" and card.tied_embeddings
    assert {k: getattr(card, k) for k in GRANITE} == GRANITE
    prove_in_genie(granite, None)


@pytest.mark.parametrize("tied", [True, False])
def test_granite_adapts_exactly_and_fails_the_gate_without_any_one_fold(tmp_path: Path, tied: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate proves each fold: the graphs equal transformers' Granite logits, and with any one constant left
    out (the card saying 1.0, or 1/sqrt(head_dim) for the attention scale) they do not."""
    from npustudio.core import config_audit

    model = make_tiny_model(tmp_path / "m", "granite", tie_word_embeddings=tied, attention_bias=True,
                            mlp_bias=True, **GRANITE)
    opts = AdaptOptions(ar=32, cl=128, eval_chars=800, window=128, decode_tokens=4)
    good = pipeline.adapt(Project.open(tmp_path / "p"), str(model), opts, State())
    assert good.result["gate"]["passed"] and good.result["equivalence"]["top1_agreement"] == 1.0
    folds = config_audit._multipliers
    for i, key in enumerate(GRANITE):
        neutral = None if key == "attention_multiplier" else 1.0
        monkeypatch.setattr(config_audit, "_multipliers",
                            lambda config, recipe, key=key, neutral=neutral: {**folds(config, recipe), key: neutral})
        with pytest.raises(UserError) as e:
            pipeline.adapt(Project.open(tmp_path / f"p{i}"), str(model), opts, State())
        assert "do not compute what the original model computes" in e.value.problem, key


def test_smollm3_nope_layers_run_in_genie_as_adapted(smollm3: Project) -> None:
    """Layer 1 is NoPE: its q/k are not rotated while Genie feeds the same cos/sin inputs (its config is Llama's,
    with SmolLM3's rope_theta); the real Genie answers like our runner on the same binaries."""
    card = done(smollm3, stages.MODEL).result.card
    assert (card.family, card.nope_layers, card.o_bias) == ("SmolLM3", [1], True)
    spec = json.loads((smollm3.stage_dir("adapt") / "decoder.json").read_text())
    assert spec["nope_layers"] == [1]
    enc = json.loads((smollm3.stage_dir("bundle") / layout.GENIE_CONFIG).read_text())
    assert enc["dialog"]["engine"]["model"]["positional-encoding"]["rope-theta"] == 2_000_000.0
    prove_in_genie(smollm3, None)


def test_smollm3_fails_the_gate_when_its_nope_layers_are_rotated(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate proves the NoPE layers: with them rotated like the others (the card listing none) it fails."""
    from npustudio.core import config_audit

    model = make_tiny_model(tmp_path / "m", "smollm3", pad_token_id=0, num_hidden_layers=4)  # layer 3 NoPE
    opts = AdaptOptions(ar=32, cl=128, eval_chars=800, window=128, decode_tokens=4)
    good = pipeline.adapt(Project.open(tmp_path / "p"), str(model), opts, State())
    assert good.result["spec"]["nope_layers"] == [3] and good.result["equivalence"]["top1_agreement"] == 1.0
    monkeypatch.setattr(config_audit, "_nope_layers", lambda config, recipe: [])
    with pytest.raises(UserError) as e:
        pipeline.adapt(Project.open(tmp_path / "q"), str(model), opts, State())
    assert "do not compute what the original model computes" in e.value.problem


def test_olmo2_post_norms_and_whole_projection_qk_norm_run_in_genie_as_adapted(olmo2: Project) -> None:
    """No norm before the attention or the MLP, their outputs normed before each residual add, and q/k normed over
    all heads at once: built by the graphs (Genie's config is Llama's); the real Genie answers like our runner."""
    card = done(olmo2, stages.MODEL).result.card
    assert (card.family, card.post_norms, card.qk_norm, card.qk_norm_full) == ("OLMo 2", True, True, True)
    spec = json.loads((olmo2.stage_dir("adapt") / "decoder.json").read_text())
    assert (spec["post_norms"], spec["qk_norm_full"], spec["o_bias"]) == (True, True, True)
    prove_in_genie(olmo2, None)


def test_olmo2_fails_the_gate_with_pre_norms_or_per_head_qk_norms(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate proves both changes: the same weights with the block norms placed before the attention and the MLP
    (as Llama's), or with the q/k norm taken per head, do not compute what transformers' OLMo 2 computes."""
    from npustudio.core.graph import decoder

    # 4 heads of 64 over hidden 128: the q/k projections (256 wide) hold several heads
    model = make_tiny_model(tmp_path / "m", "olmo2", pad_token_id=0, num_attention_heads=4, num_key_value_heads=4,
                            head_dim=64)
    opts = AdaptOptions(ar=32, cl=128, eval_chars=800, window=128, decode_tokens=4)
    good = pipeline.adapt(Project.open(tmp_path / "p"), str(model), opts, State())
    assert good.result["spec"]["post_norms"] and good.result["equivalence"]["top1_agreement"] == 1.0

    def pre_norms(self: decoder.Layer, h: torch.Tensor, rope: tuple[torch.Tensor, ...], mask: torch.Tensor,
                  past_k: torch.Tensor, past_v: torch.Tensor, lin: decoder.Linear = decoder.plain
                  ) -> tuple[torch.Tensor, ...]:
        assert self.mlp_norm is not None
        a, k, v = self.attn(self.post_norm(h), rope, mask, past_k, past_v, lin)
        h = self.attn_add(h, a)
        return self.mlp_add(h, self.mlp(self.mlp_norm(h), lin)), k, v

    whole = ops.RMSNorm.forward

    def per_head(self: ops.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if self.dim != 1 or x.shape[1] == 128:  # the stream's norms (hidden 128) stay; q/k (256): per 64-wide head
            return whole(self, x)
        heads = x.shape[1] // 64
        y = x.reshape(heads, 64, 1, -1).transpose(0, 1)
        w = self.weight.reshape(heads, 64).t().reshape(-1)
        out = whole(type(self)(w.new_ones(64), self.eps, dim=0), y).transpose(0, 1).reshape(x.shape)
        return out * self.weight.reshape(1, -1, 1, 1)

    for i, (cls, name, fn) in enumerate(((decoder.Layer, "forward", pre_norms), (ops.RMSNorm, "forward", per_head))):
        with monkeypatch.context() as mp:
            mp.setattr(cls, name, fn)
            with pytest.raises(UserError) as e:
                pipeline.adapt(Project.open(tmp_path / f"q{i}"), str(model), opts, State())
        assert "do not compute what the original model computes" in e.value.problem, name


# ---------------------------------------------------------------- refused at intake
@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model folder; intake reads only config.json and the tokenizer, so any config can sit beside it."""
    return make_tiny_model(tmp_path_factory.mktemp("w") / "m", "llama")


def folder_with(weights: Path, dest: Path, arch: str, **config: Any) -> Path:
    import transformers

    shutil.copytree(weights, dest)
    getattr(transformers, f"{arch}Config")(**config).save_pretrained(dest)
    return dest


@pytest.mark.parametrize(("arch", "config", "named"), [
    ("Llama", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("Llama", {"rope_parameters": rope("proportional")}, "rope_type='proportional'"),
    ("Llama", {"rope_parameters": rope("yarn", factor=4.0, original_max_position_embeddings=64, truncate=False)},
     "truncate=False"),
    ("Llama", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("Llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ("Llama", {"rope_parameters": rope("default", partial_rotary_factor=0.5)}, "partial_rotary_factor=0.5"),
    ("Granite", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("Phi3", {"partial_rotary_factor": 0.3, "pad_token_id": 0, "hidden_size": 128, "num_attention_heads": 2},
     "partial_rotary_factor=0.3"),  # 19 of 64 dims: an odd number cannot be rotated in halves
    ("Llama", {"embedding_multiplier": 12.0}, "embedding_multiplier=12.0"),
    ("Granite", {"logits_scaling": 0.0}, "logits_scaling=0.0"),
    ("Llama", {"no_rope_layers": [1, 0]}, "no_rope_layers=[1, 0]"),
    ("SmolLM3", {"pad_token_id": 0, "num_hidden_layers": 2, "no_rope_layers": [0, 0]}, "no_rope_layers=[0, 0]"),
    ("SmolLM3", {"pad_token_id": 0, "num_hidden_layers": 2, "no_rope_layers": [1, 2]}, "no_rope_layers=[1, 2]"),
    ("Mistral", {"attention_bias": True}, "attention_bias=True"),
    ("Qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, "sliding_window=64"),
    ("Phi3", {"pad_token_id": 0, "hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 512,
              "original_max_position_embeddings": 64,
              "rope_parameters": rope("longrope", short_factor=[1.0] * 32, long_factor=[2.0] * 32)},
     "rope_type='longrope'"),
])
def test_an_unsupported_option_is_refused_at_intake_naming_it(weights: Path, tmp_path: Path, arch: str,
                                                               config: dict[str, Any], named: str) -> None:
    src = model_source.resolve_source(str(folder_with(weights, tmp_path / "m", arch, **config)))
    with pytest.raises(UserError) as e:
        check_context(models.read_card(src), 128)
    assert named in e.value.problem and e.value.fix


def test_info_refuses_a_window_narrower_than_the_context_and_accepts_it_within(weights: Path, tmp_path: Path) -> None:
    d = folder_with(weights, tmp_path / "m", "Mistral", sliding_window=64, head_dim=16)
    run = [sys.executable, "-m", "npustudio.cli", "info", str(d), "--json"]
    res = subprocess.run([*run, "--cl", "128"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "sliding_window=64" in res.stderr and "--cl 64" in res.stderr
    res = subprocess.run([*run, "--cl", "64"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["sliding_window"] == 64


def test_gemma3_is_refused_at_intake_for_its_two_rope_bases(tmp_path: Path) -> None:
    """Gemma 3 rotates its sliding and its full layers with two RoPE bases, which Genie's one positional encoding
    cannot feed: `npustudio info` exits 2 saying so, and names the families that do run."""
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                        max_position_embeddings=512, sliding_window=128)
    folder = tmp_path / "gemma3"
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(str(folder))
    make_tokenizer(folder)
    res = subprocess.run([sys.executable, "-m", "npustudio.cli", "info", str(folder)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Gemma 3 models" in res.stderr and "rope_local_base_freq" in res.stderr and "one base" in res.stderr
    assert "Llama-3.2-1B" in res.stderr and "Traceback" not in res.stderr


def test_the_documented_table_is_rendered_from_the_recipes() -> None:
    table = support_table()
    assert table.startswith("| option | Granite | Llama | Mistral | OLMo 2 | Phi-3 | Qwen2 | Qwen3 | SmolLM3 | how |")
    assert table in (ROOT / "docs" / "pipeline.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------- the equivalence gate
def test_a_diverging_adaptation_fails_the_stage_and_keeps_the_last_good_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_tiny_model(tmp_path / "m", "llama", hidden_act="gelu_pytorch_tanh")
    project = Project.open(tmp_path / "p")
    opts = AdaptOptions(ar=32, cl=128, eval_chars=800, window=128, decode_tokens=4)
    good = pipeline.adapt(project, str(model), opts, State())
    assert good.result["gate"]["passed"]
    files = {f.path: f.sha256 for f in good.outputs}

    monkeypatch.setitem(ops.ACTIVATIONS, "gelu_tanh", ops.SiLU)  # a wrong activation: the graphs diverge
    with pytest.raises(UserError) as e:
        pipeline.adapt(project, str(model), opts.model_copy(update={"ar": 16}), State())
    assert "top-1 agreement" in e.value.problem and "hidden_act gelu_tanh" in e.value.problem
    assert "--accept-mismatch" in e.value.fix
    kept = done(project, stages.ADAPT).record
    assert kept.key == good.key and not project.changed("adapt")  # the good stage is intact
    assert {f.path: f.sha256 for f in kept.outputs} == files
    assert project.load().attempts["adapt"].status == "failed"

    accepted = pipeline.adapt(project, str(model), opts.model_copy(update={"ar": 16, "accept_mismatch": True}),
                              State())
    assert accepted.result["gate"] == {**accepted.result["gate"], "passed": False, "accepted_mismatch": True}
    assert pipeline.adapt_summary(AdaptResult.model_validate(accepted.result)).gate == "failed, accepted"


def test_the_adapt_page_shows_an_accepted_mismatch_in_red(qtbot: Any, tmp_path: Path) -> None:
    from npustudio.core.settings import Settings
    from npustudio.gui.pages.adapt import AdaptPage
    from npustudio.gui.widgets import BAD, cells
    from npustudio.gui.window import StudioWindow

    class Window:  # what a page needs of the main window
        project = Project.open(tmp_path / "p")
        settings = Settings()

    page = AdaptPage(cast(StudioWindow, Window()))
    qtbot.addWidget(page)
    from npustudio.core.results import Equivalence, Gate, GraphSpec

    from .test_bad_input import TINY_SPEC

    result = AdaptResult(
        spec=TINY_SPEC, graphs=[GraphSpec(name="prompt_ar32_cl128_1_of_1", kind="prompt", ar=32, cl=128, inputs=[],
                                          outputs=[])],
        equivalence=Equivalence(top1_agreement=0.68, max_abs_logit_diff=4.6, positions=800, windows=2, prefill_ar=32,
                                decode_steps=28),
        gate=Gate(passed=False, accepted_mismatch=True, min_top1=0.999, max_logit_diff=0.01), ppl_fp=9.0,
        ppl_adapted=30.0, eval_tokens=800, per_window=[])
    page.show_result(result)
    assert cells(page.results)[0] == ["Equivalence gate", "failed, accepted"]
    assert item_at(page.results, 0, 0).background().color() == BAD
    assert "WITHOUT equivalence" in page.strip.status.text() and "#b00020" in page.strip.status.styleSheet()
    assert not page.options().accept_mismatch
    page.accept_mismatch.setChecked(True)
    assert page.options().accept_mismatch
