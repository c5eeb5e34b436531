"""The MNN back-end: the project's float model exported by MNN's own exporter (`llmexport`), for MNN's LLM
runtime on a phone's CPU or GPU (phones without a Hexagon NPU) and on this computer.

Entry point: `run(source, card, options, out_dir, state) -> MnnResult`. The float model's reference (eval-text
logits, a greedy answer) is computed first and the float weights let go, then the exporter runs in a child
process, then MNN's runtime (`MNN.llm`) loads the result and is measured against that reference: perplexity over
the eval text fed one token at a time (a phone's decode path), top-1 agreement, and the greedy answer through
MNN's own prompt path. A model far off the float one fails the stage with the figures (`max_ppl_ratio`).
"""

from __future__ import annotations

import gc
import math
import tempfile
from pathlib import Path

from .. import evaluate, layout, model_fit, model_source, models, stages
from ..errors import UserError
from ..fsutil import atomic_write_json
from ..progress import StateLike
from ..results import EvalPlan, MnnResult
from ..stage_options import MNN_BLOCK, MnnOptions
from . import export as exporter
from .runtime import MnnModel, threads

FORMAT = stages.MNN.format
# the model types MNN's exporter maps and this back-end has proven against the float model (tests/test_mnn.py);
# the exporter maps an unknown type as a Llama, which would silently drop another family's options
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

__all__ = ["MnnOptions", "MnnResult", "resolved", "run", "validate"]


def validate(options: MnnOptions, card: models.ArchCard) -> None:
    """Refuse, before any work, a model or a block the export would not do exactly."""
    if card.model_type not in FAMILIES:
        raise UserError(f"The MNN back-end does not take {card.architecture} models (model type "
                        f"{card.model_type!r}) yet: MNN's exporter would treat it as a Llama.",
                        f"Use `--backend ort-qnn`; the MNN back-end takes {', '.join(FAMILIES)} models.")
    if options.block:
        odd = {k: v for k, v in model_fit.linear_inputs(card).items() if v % options.block}
        if odd:
            fits = model_fit.largest_block(card, options.block)
            raise UserError(f"A block of {options.block} weights does not divide the model's "
                            + ", ".join(f"{k} ({v})" for k, v in odd.items())
                            + " (MNN's exporter would quietly use smaller blocks).",
                            f"Use `--mnn-block {fits}` (or 0: one scale per output channel).")


def resolved(options: MnnOptions, card: models.ArchCard) -> MnnOptions:
    """The options with the block made explicit (what the record keys and shows)."""
    validate(options, card)
    if options.block is None:
        options = options.model_copy(update={"block": model_fit.largest_block(card, MNN_BLOCK)})
    return options


def run(source: model_source.ModelSource, card: models.ArchCard, options: MnnOptions, out_dir: Path,
        state: StateLike, final_dir: Path | None = None, context_length: int | None = None) -> MnnResult:
    """Export the float model to MNN into `out_dir/model` and measure it against the float model. `final_dir`:
    where the stage's folder will be once it is done (the record names the model folder there);
    `context_length`: the tokens a chat with it keeps (default: what the model was trained for)."""
    options = resolved(options, card)
    assert options.block is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".float-") as tmp:
        float_dir = Path(tmp)
        state.progress(0.0, "loading the float model")
        lm = models.load(source)
        if source.gguf_file:
            exporter.write_float_folder(lm.model, lm.tokenizer, float_dir)
        else:
            exporter.link_float_folder(Path(str(source.path)), float_dir)
        plan = EvalPlan(corpus=options.eval_corpus, window=options.window,
                                 tokens=options.eval_tokens or evaluate.auto_eval_tokens(card.params))
        ids = evaluate.eval_ids(lm.tokenizer, plan)
        ws = evaluate.windows(ids, plan.window)
        ref_fn = evaluate.hf_logits_fn(lm.model)
        sub = state.sub(0.05, 0.15)
        reference = []
        for i, w in enumerate(ws):
            reference.append(ref_fn(w))
            sub.progress((i + 1) / len(ws), f"float model: window {i + 1}/{len(ws)}")
        lm.tokenizer.save_pretrained(str(out_dir))  # the chat renders its prompts with it (core/chat.py)
        prompt = prompt_ids(lm.tokenizer, options.question)
        answer_fp = _greedy(lm.model, prompt, options.answer_tokens, card.eos_ids)
        tokenizer = lm.tokenizer
        del lm, ref_fn
        gc.collect()
        folder = exporter.export(float_dir, out_dir / layout.MNN_MODEL, options.bits, options.block,
                                 options.lm_head_bits, state.sub(0.15, 0.7), options.method)
        exporter.write_sampler(folder, options.sampler)
    state.progress(0.7, "loading the MNN model")
    mnn = MnnModel(folder)
    it = iter(reference)
    sub = state.sub(0.72, 0.95)
    cmp = evaluate.compare(ids, lambda _w: next(it), lambda w: mnn.decode_logits(w, sub.check), plan.window,
                           sub, labels=("fp", "mnn"))
    state.progress(0.95, "MNN's greedy answer")
    answer_mnn, timings = mnn.answer(prompt, options.answer_tokens)
    same = next((i for i, (a, b) in enumerate(zip(answer_fp, answer_mnn, strict=False)) if a != b),
                min(len(answer_fp), len(answer_mnn)))
    files = exporter.model_files(folder)
    res = MnnResult(
        folder=str((final_dir or out_dir) / layout.MNN_MODEL), files=files,
        model_bytes=sum(f["bytes"] for f in files if f["file"].startswith(("llm.mnn", "embeddings"))),
        bits=options.bits, block=options.block, lm_head_bits=options.lm_head_bits, method=options.method,
        exporter=exporter.versions(),
        eval=plan, fp_ppl=cmp.ref_ppl, mnn_ppl=cmp.test_ppl, ppl_ratio=cmp.test_ppl / cmp.ref_ppl,
        top1_agreement=cmp.top1_agreement, max_abs_logit_diff=cmp.max_abs_logit_diff, prompt_tokens=len(prompt),
        answer_fp=answer_fp, answer_mnn=answer_mnn,
        answer_text=tokenizer.decode(answer_mnn, skip_special_tokens=True), agreeing_prefix=same,
        prefill_tok_s=timings.prefill_tok_s, decode_tok_s=timings.decode_tok_s, threads=threads(),
        context_length=context_length or card.max_position, chat_template=card.chat_template, bos_id=card.bos_id,
        eos_ids=card.eos_ids,
        notes=[f"perplexity over {cmp.tokens} tokens fed one at a time (MNN's decode path); the answer through "
               "MNN's prompt path, whose int8 activation blocks make its logits depend on how a prompt is cut"])
    atomic_write_json(out_dir / layout.MNN_RESULT, res.model_dump())
    if not math.isfinite(res.ppl_ratio) or res.ppl_ratio > options.max_ppl_ratio:
        raise UserError(f"The MNN model is far off the float model: perplexity {res.mnn_ppl:.3f} against "
                        f"{res.fp_ppl:.3f} (x{res.ppl_ratio:.3f}, over the x{options.max_ppl_ratio} allowed), "
                        f"top-1 agreement {res.top1_agreement:.3f}.",
                        "Use more bits (`--mnn-bits 8`), smaller blocks (`--mnn-block 32`) or an 8-bit LM head "
                        "(`--mnn-lm-head-bits 8`); or allow it with `--max-ppl-ratio`.")
    return res


def prompt_ids(tokenizer: object, question: str) -> list[int]:
    """The question in the model's chat template (plain text when it has none), as the chat sends it."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],  # type: ignore[attr-defined]
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(question)["input_ids"])  # type: ignore[operator]


def _greedy(model: object, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """The float model's greedy tokens, stopping at an end of turn as MNN's runtime does."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,  # type: ignore[attr-defined]
                             eos_token_id=eos or None, pad_token_id=(eos or [0])[0])
    return [int(t) for t in out[0, len(prompt):]]  # with its stop token, as MNN's answer has it
