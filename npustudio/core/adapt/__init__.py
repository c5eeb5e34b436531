"""Adapt stage: a Hugging Face causal LM -> the static AR-N / AR-1 graphs Genie runs, proven equivalent.

Entry point: `run(model, options, out_dir, state) -> AdaptResult`. The proof runs the adapted graphs
through a host KV-cache runner (AR-N prefill chunks, then AR-1 steps, cache outside the graph, as
Genie does) over the eval text and compares every next-token logit with the original model.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from ..errors import UserError
from ..evaluate import DEFAULT_WINDOW, compare, hf_logits_fn, load_corpus, windows
from ..families import recipe_for
from ..fsutil import atomic_write_json
from ..models import LoadedModel
from ..progress import StateLike
from . import store
from .decoder import DecoderSpec, StaticDecoder, adapt_weights, graph_names, io_names, io_shapes, spec_from
from .runner import KVCacheRunner, TorchGraph

__all__ = ["AdaptOptions", "AdaptResult", "DecoderSpec", "KVCacheRunner", "StaticDecoder", "TorchGraph", "run"]


class AdaptOptions(BaseModel):
    ar: int = Field(128, description="tokens per prompt-processing step (AR-N graph)")
    cl: int = Field(1024, description="context length: KV-cache entries")
    eval_corpus: str = "default"
    eval_chars: int | None = None
    window: int = DEFAULT_WINDOW
    decode_tokens: int = Field(64, description="AR-1 steps at the end of each eval window")


class TensorSpec(BaseModel):
    name: str
    shape: list[int]
    dtype: str


class GraphSpec(BaseModel):
    name: str
    kind: str  # prompt | token
    ar: int
    cl: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class Equivalence(BaseModel):
    max_abs_logit_diff: float
    top1_agreement: float
    positions: int
    windows: int
    prefill_ar: int
    decode_steps: int


class AdaptResult(BaseModel):
    spec: DecoderSpec
    graphs: list[GraphSpec]
    equivalence: Equivalence
    ppl_fp: float  # the original model
    ppl_adapted: float
    eval_tokens: int
    per_window: list[dict[str, float]]


def validate(opts: AdaptOptions, card: Any) -> None:
    if opts.ar < 1 or opts.cl <= opts.ar:
        raise UserError(f"AR {opts.ar} and context length {opts.cl} do not fit: need 1 ≤ AR < CL.",
                        "Use e.g. --ar 128 --cl 1024 (AR is the prompt step, CL the context length).")
    if card.max_position and opts.cl > card.max_position:
        raise UserError(f"Context length {opts.cl} exceeds what the model was trained for "
                        f"({card.max_position}).", f"Use --cl {card.max_position} or less.")
    if card.head_dim % 2:
        raise UserError(f"Head dim {card.head_dim} is odd; rotary embeddings need an even head dim.",
                        "This model cannot run under Genie's RoPE.")
    if card.heads % card.kv_heads:
        raise UserError(f"{card.heads} attention heads are not a multiple of {card.kv_heads} KV heads.",
                        "This attention layout is not supported.")


def graph_specs(spec: DecoderSpec, ar: int, cl: int) -> list[GraphSpec]:
    names = graph_names(ar, cl)
    ins_order, outs_order = io_names(spec.layers)
    out = []
    for kind, n in (("prompt", ar), ("token", 1)):
        ins, outs = io_shapes(spec, n, cl)
        out.append(GraphSpec(
            name=names[kind][0], kind=kind, ar=n, cl=cl,
            inputs=[TensorSpec(name=k, shape=ins[k], dtype="int32" if k == "input_ids" else "float32")
                    for k in ins_order],
            outputs=[TensorSpec(name=k, shape=outs[k], dtype="float32") for k in outs_order]))
    return out


def adapt_model(lm: LoadedModel) -> tuple[StaticDecoder, torch.Tensor]:
    recipe = recipe_for(lm.card.model_type, lm.card.architecture)
    spec = spec_from(lm.card, lm.model)
    return adapt_weights(spec, recipe, lm.model), lm.model.model.rotary_emb.inv_freq.detach().clone()


def run(lm: LoadedModel, options: AdaptOptions, out_dir: Path, state: StateLike) -> AdaptResult:
    validate(options, lm.card)
    state.progress(0.02, "adapting weights to the static graph form")
    model, inv_freq = adapt_model(lm)
    state.check()

    runner = KVCacheRunner.over(model, options.ar, options.cl, inv_freq)
    window = min(options.window, options.cl)
    adapted = partial(runner.score, decode_tokens=options.decode_tokens)

    text = load_corpus(options.eval_corpus, "eval", options.eval_chars)
    ids = lm.tokenizer(text)["input_ids"]
    state.progress(0.05, f"proving equivalence over {len(ids)} tokens")
    cmp = compare(ids, hf_logits_fn(lm.model), adapted, window=window, state=state.sub(0.05, 0.9),
                  labels=("fp", "adapted"))
    decode = sum(min(options.decode_tokens, len(w) - 1) for w in windows(ids, window))
    state.progress(0.92, "saving the adapted model")
    store.save(model, inv_freq, out_dir)
    lm.tokenizer.save_pretrained(str(out_dir))
    res = AdaptResult(
        spec=model.spec, graphs=graph_specs(model.spec, options.ar, options.cl),
        equivalence=Equivalence(max_abs_logit_diff=cmp.max_abs_logit_diff, top1_agreement=cmp.top1_agreement,
                                positions=cmp.positions, windows=cmp.windows, prefill_ar=options.ar,
                                decode_steps=decode),
        ppl_fp=cmp.ref_ppl, ppl_adapted=cmp.test_ppl, eval_tokens=cmp.tokens, per_window=cmp.per_window)
    atomic_write_json(out_dir / "graphs.json", [g.model_dump() for g in res.graphs])
    atomic_write_json(out_dir / "card.json", lm.card.model_dump())
    atomic_write_json(out_dir / "equivalence.json", res.equivalence.model_dump())
    state.progress(1.0, "adapted")
    return res

