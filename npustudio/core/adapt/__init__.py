"""Adapt stage: a Hugging Face causal LM -> the static AR-N / AR-1 graphs Genie runs, proven equivalent.

Entry point: `run(model, options, out_dir, state) -> AdaptResult`. The proof runs the adapted graphs
through a host KV-cache runner (AR-N prefill chunks, then AR-1 steps, cache outside the graph, as
Genie does) over the eval text and compares every next-token logit with the original model; the
equivalence gate fails the stage when they differ (unless the user accepts the mismatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import compute, forked, layout, lora
from ..config_audit import check_context
from ..errors import UserError
from ..evaluate import (
    EvalPlan,
    auto_eval_tokens,
    compare,
    eval_ids,
    hf_logits_fn,
    windows,
    write_reference,
)
from ..families import recipe_for
from ..fsutil import atomic_write_json
from ..graph import lora_inputs, store
from ..graph.decoder import (
    StaticDecoder,
    adapt_weights,
    graph_names,
    io_names,
    io_shapes,
    spec_from,
    weight_places,
)
from ..graph.half_weights import computing_in_fp32
from ..graph.kv_cache import KVCacheRunner, TorchGraph
from ..models import LoadedModel
from ..progress import StateLike
from ..results import AdaptResult, Equivalence, Gate, GraphSpec, TensorSpec
from ..shape import DecoderSpec
from ..stage_options import AdaptOptions

__all__ = ["AdaptOptions", "AdaptResult", "DecoderSpec", "Equivalence", "Gate", "GraphSpec", "KVCacheRunner",
           "StaticDecoder", "TensorSpec", "TorchGraph",
           "equivalence_gate", "eval_plan", "resolved", "run"]


MIN_TOP1 = 0.999
MAX_LOGIT_DIFF = 1e-3  # of the widest logit spread: fp32 reordering stays near 1e-6 of it, a dropped bias ~1e-1


def likely_causes(card: Any) -> list[str]:
    """The card's math-changing options that are switched on, most suspect first."""
    rs = card.rope_scaling or {}
    out = [f"rope_scaling {rs.get('rope_type')}" if rs else "",
           f"sliding_window {card.sliding_window}" if card.sliding_window else "",
           f"hidden_act {card.activation}" if card.activation != "silu" else "",
           "o_proj bias (attention_bias)" if card.o_bias else "", "MLP biases (mlp_bias)" if card.mlp_bias else "",
           "q/k/v biases" if card.qkv_bias else "",
           "q/k norm over the whole projection" if card.qk_norm_full else "q/k norm" if card.qk_norm else "",
           "post-norm blocks" if card.post_norms else "",
           "untied LM head" if not card.tied_embeddings else "",
           f"partial rotary ({card.rotary_dim} of {card.head_dim} head dims)" if card.rotary_dim else "",
           f"no RoPE in layers {card.nope_layers}" if card.nope_layers else "",
           f"attention_multiplier {card.attention_multiplier}" if card.attention_multiplier is not None else "",
           *(f"{k} {getattr(card, k)}" for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")
             if getattr(card, k) != 1.0)]
    return [c for c in out if c]


def equivalence_gate(eq: Equivalence, card: Any, accept_mismatch: bool) -> Gate:
    """Fail the stage when the adapted graphs do not compute what the original model computes."""
    limit = MAX_LOGIT_DIFF * max(eq.ref_logit_range, 1.0)
    passed = eq.top1_agreement >= MIN_TOP1 and eq.max_abs_logit_diff <= limit
    if not passed and not accept_mismatch:
        causes = likely_causes(card)
        cause = (f"The likely cause is one of the options this {card.family} model switches on: "
                 f"{', '.join(causes)}." if causes else
                 f"The model switches on no optional feature, so the likely cause is how the {card.family} "
                 "recipe reads its weights.")
        raise UserError(
            f"The adapted graphs do not compute what the original model computes: top-1 agreement "
            f"{eq.top1_agreement:.4f} (needs ≥ {MIN_TOP1}) and max |Δlogit| {eq.max_abs_logit_diff:.3g} (allowed "
            f"{limit:.3g}, {MAX_LOGIT_DIFF:g} of the logit range {eq.ref_logit_range:.3g}) over {eq.positions} "
            f"positions. {cause}",
            "Please report this with the model's config.json. To keep these graphs anyway (they will not answer "
            "like the original model), rerun with --accept-mismatch.")
    return Gate(passed=passed, accepted_mismatch=not passed, min_top1=MIN_TOP1, max_logit_diff=limit)


def validate(opts: AdaptOptions, card: Any) -> None:
    if opts.lora_switchable and not opts.lora:
        raise UserError("Switchable LoRA adapters were asked for, and no adapter was given.",
                        "Add --lora ADAPTER_DIR (repeatable), or leave --lora-switchable out.")
    if opts.ar == 1:  # two AR-1 graphs, which Genie loads as two parts of one model and runs wrongly
        raise UserError("AR 1 would make the prompt graph a second token graph: Genie takes two graphs of the same "
                        "shape for two parts of the model.",
                        "Keep an AR of 2 or more (e.g. --ar 8); to read prompts one token at a time, bundle with "
                        "--token-graphs-only, which leaves the prompt graph out.")
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
    check_context(card, opts.cl)


def eval_plan(options: AdaptOptions, card: Any) -> EvalPlan:
    """The proof's eval as the stage runs it: the token count sized to the model unless given, the window cut to the
    context."""
    return EvalPlan(corpus=options.eval_corpus, chars=options.eval_chars,
                    tokens=options.eval_tokens or auto_eval_tokens(card.params),
                    window=min(options.window, options.cl), decode_tokens=options.decode_tokens)


def resolved(options: AdaptOptions, card: Any) -> AdaptOptions:
    """`options` with the values the stage comes to (`eval_plan`) in place of its defaults: the stage key hashes
    these, so the same work asked for by any front end, with the value given or left to its default, has one key."""
    plan = eval_plan(options, card)
    return options.model_copy(update={"eval_tokens": plan.tokens, "window": plan.window})


def graph_specs(spec: DecoderSpec, ar: int, cl: int, slots: Sequence[lora_inputs.Slot] = ()) -> list[GraphSpec]:
    names = graph_names(ar, cl)
    extra = lora_inputs.shapes(list(slots)) if slots else {}
    ins_order, outs_order = io_names(spec.layers, list(extra))
    out = []
    for kind, n in (("prompt", ar), ("token", 1)):
        ins, outs = io_shapes(spec, n, cl)
        ins.update(extra)
        out.append(GraphSpec(
            name=names[kind][0], kind=kind, ar=n, cl=cl,
            inputs=[TensorSpec(name=k, shape=ins[k], dtype="int32" if k == "input_ids" else "float32")
                    for k in ins_order],
            outputs=[TensorSpec(name=k, shape=outs[k], dtype="float32") for k in outs_order]))
    return out


def adapt_model(lm: LoadedModel) -> tuple[StaticDecoder, torch.Tensor]:
    recipe = recipe_for(lm.card.model_type, lm.card.architecture)
    spec = spec_from(lm.card, lm.model)
    return adapt_weights(spec, recipe, lm.model), lm.model.model.rotary_emb.inv_freq.detach().cpu().clone()


@compute.plain_convolutions
def run(lm: LoadedModel, options: AdaptOptions, out_dir: Path, state: StateLike,
        switch: Sequence[lora.Switchable] = ()) -> AdaptResult:
    """`switch`: LoRA adapters kept apart from the weights as graph inputs (`graph.lora_inputs`); the graphs are
    then proven with none (the base) and with each."""
    validate(options, lm.card)
    device = compute.resolve(options.device)
    lm.model.to(device)  # the adapted model shares its weights, on the same device
    state.progress(0.02, "adapting weights to the static graph form")
    model, inv_freq = adapt_model(lm)
    slots: list[lora_inputs.Slot] = []
    if options.lora:  # what the inspector traces each adapter's update through
        places = weight_places(model.spec, recipe_for(lm.card.model_type, lm.card.architecture), lm.model, model)
        atomic_write_json(out_dir / layout.LORA_PLACES, {"adapters": [a.model_dump() for a in options.lora],
                                                         "places": {k: [p.model_dump() for p in v]
                                                                    for k, v in places.items()}})
        if switch:
            slots = lora_inputs.slots([s.adapter for s in switch], places)
            lora_inputs.attach(model, slots)
    state.check()

    runner = KVCacheRunner.over(model, options.ar, options.cl, inv_freq)
    values = {s.name: lora_inputs.values(slots, s.adapter, s.weight) for s in switch}
    if switch:
        runner.extra = lora_inputs.values(slots, None)
    plan = eval_plan(options, lm.card)
    ids = eval_ids(lm.tokenizer, plan)
    plan.tokens = len(ids)
    kept: list[torch.Tensor] = []  # the adapted model's logits: quantize's float reference, not recomputed there
    state.progress(0.05, f"proving equivalence over {len(ids)} tokens")
    # a small model's second half of the windows in a forked copy, each process on one thread (default model,
    # 2 cores: the stage 25.4 -> 23.0 s, the same bytes)
    share = 0.85 / (1 + len(switch))
    with computing_in_fp32(lm.model, model):  # a 16-bit checkpoint's weights stay 16-bit, the arithmetic fp32's
        cmp = compare(ids, hf_logits_fn(lm.model), partial(runner.score, decode_tokens=options.decode_tokens),
                      window=plan.window, state=state.sub(0.05, 0.05 + share), labels=("fp", "adapted"), kept=kept,
                      beside=forked.worth_forking(lm.model, device))
        with_adapter = {}
        for i, s in enumerate(switch):
            runner.extra = values[s.name]
            with lora.applied(lm.model, s.adapter, s.weight):
                with_adapter[s.name] = compare(
                    ids, hf_logits_fn(lm.model), partial(runner.score, decode_tokens=options.decode_tokens),
                    window=plan.window, state=state.sub(0.05 + share * (i + 1), 0.05 + share * (i + 2)),
                    labels=("fp", s.name), beside=forked.worth_forking(lm.model, device))
    decode = sum(min(options.decode_tokens, len(w) - 1) for w in windows(ids, plan.window))
    state.progress(0.92, "saving the adapted model")
    store.save(model, inv_freq, out_dir)
    if switch:
        lora_inputs.save(out_dir, slots, values)
    write_reference(out_dir, plan, ids, kept)
    kept.clear()
    lm.tokenizer.save_pretrained(str(out_dir))
    res = AdaptResult(
        spec=model.spec, graphs=graph_specs(model.spec, options.ar, options.cl, slots),
        equivalence=Equivalence(max_abs_logit_diff=cmp.max_abs_logit_diff, top1_agreement=cmp.top1_agreement,
                                positions=cmp.positions, windows=cmp.windows, prefill_ar=options.ar,
                                decode_steps=decode, ref_logit_range=cmp.ref_logit_range),
        ppl_fp=cmp.ref_ppl, ppl_adapted=cmp.test_ppl, eval_tokens=cmp.tokens, per_window=cmp.per_window,
        eval_plan=plan, device=device)
    res.gate = equivalence_gate(res.equivalence, lm.card, options.accept_mismatch)
    for name, c in with_adapter.items():
        res.lora_equivalence[name] = eq = Equivalence(
            max_abs_logit_diff=c.max_abs_logit_diff, top1_agreement=c.top1_agreement, positions=c.positions,
            windows=c.windows, prefill_ar=options.ar, decode_steps=decode, ref_logit_range=c.ref_logit_range)
        equivalence_gate(eq, lm.card, options.accept_mismatch)
    atomic_write_json(out_dir / layout.GRAPHS, [g.model_dump() for g in res.graphs])
    atomic_write_json(out_dir / layout.CARD, lm.card.model_dump())
    atomic_write_json(out_dir / layout.EQUIVALENCE, res.equivalence.model_dump())
    atomic_write_json(out_dir / layout.ADAPT_RESULT, res.model_dump())
    state.progress(1.0, "adapted")
    return res

