"""Tables and lines people read: a model's card and fit, the host estimate, each stage's summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from ..core.progress import about_duration
from ..core.stage_options import DEFAULT_INT8_BUDGET
from .console import out

if TYPE_CHECKING:
    from pathlib import Path

    from ..core.pipeline import AdaptSummary, BundleSummary, CompileSummary, QuantizeSummary
    from ..core.results import MnnResult


def lora_table(adapters: list[dict[str, Any]]) -> None:
    """The LoRA adapters `info --lora` read: merged into the model before adaptation (no bytes of their own on the
    phone)."""
    from ..display import human_bytes

    t = Table(title="LoRA adapters (merged into the weights before adaptation)")
    for col in ("adapter", "weight", "trained on", "rank", "alpha", "modules", "size"):
        t.add_column(col, overflow="fold")
    for ad in adapters:
        t.add_row(ad["adapter"], f"{ad['weight']:g}", ad["base"] or "(not said)", str(ad["rank"]), f"{ad['alpha']:g}",
                  str(ad["modules"]), human_bytes(ad["bytes"]))
    out.print(t)


def card_table(card: dict[str, Any], fits: list[dict[str, Any]], plans: dict[str, dict[str, Any]] | None = None
               ) -> None:
    from ..display import format_value, human_bytes

    t = Table(title=f"{card['source']}  —  {card['family']} ({card['architecture']})", show_header=False)
    for k in ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "params", "rope_theta",
              "rope_scaling", "tied_embeddings", "max_position", "activation", "qkv_bias", "o_bias", "mlp_bias",
              "qk_norm", "sliding_window", "bos_id", "eos_ids"):
        t.add_row(k, format_value(card.get(k)))
    t.add_row("chat template", "yes" if card.get("chat_template") else "no")
    out.print(t)
    from ..core.targets import DEFAULT_SOC

    f = Table(title=f"Fit at context {fits[0]['context_length']}")
    for col in ("precision", "weights", "KV cache (8-bit)", "HTP parts", "bundle: phone / simulator", "phone RAM",
                "fits phones with", f"decode bound ({DEFAULT_SOC})", "PPL cost (default model)", "MNN model"):
        f.add_column(col)
    for e in fits:
        tier = f"≥ {e['min_phone_ram_gb']} GB" if e["min_phone_ram_gb"] else "none listed (too large)"
        cut = f"{e['parts']} (largest {e['largest_part_mb']:,.0f} MiB)" if e["parts"] else "none fits"
        ratio = e.get("ppl_ratio_default_model")
        f.add_row(e["precision"], human_bytes(e["weight_bytes"]), human_bytes(e["kv_cache_bytes"]), cut,
                  f"{human_bytes(e['context_bytes_phone'])} / {human_bytes(e['context_bytes_simulator'])}",
                  human_bytes(e["phone_ram_bytes"]), tier, f"{e['decode_tok_s_bound']:,.0f} tok/s",
                  f"×{ratio:.3f}" if ratio else "—", human_bytes(e.get("mnn_bytes", 0)))
    out.print(f)
    for e in fits:
        if e["parts_problem"]:
            out.print(f"{e['precision']}: {e['parts_problem']}")
    from ..core.model_fit import FitEstimate
    from ..display import four_bit_head_note

    for e in fits:
        if note := four_bit_head_note(FitEstimate.model_validate(e)):
            out.print(note)
    if plans:
        for where, pl in plans.items():
            out.print(f"recommended for {where}: [bold]{pl['precision']}[/] — {escape(pl['why'])}")


def host_table(h: Any) -> None:
    from ..display import human_bytes, per_precision

    ram = human_bytes(h.machine_ram_bytes) if h.machine_ram_bytes else "unknown"
    t = Table(title=f"This computer ({h.cpus} CPUs, {ram} RAM): estimate per stage")
    for col in ("stage", "peak memory", "time"):
        t.add_column(col)
    for s in h.stages:
        t.add_row(s.stage, human_bytes(s.peak_ram_bytes), about_duration(s.seconds))
    out.print(t)
    if h.recipes:
        taken = [r for r in h.recipes if not r.refused]
        out.print("quantize recipes (--recipe), added to the quantize stage: "
                  + ", ".join(f"{r.recipe} " + (f"+{about_duration(r.seconds)}" if r.seconds else "nothing")
                              + (f" +{human_bytes(r.ram_bytes)}" if r.ram_bytes else "") for r in taken))
        for r in h.recipes:
            if r.refused:
                out.print(f"not for this model: {r.recipe} ({r.refused})", markup=False)
    if h.int8_budget_seconds:
        out.print(f"at w4a16 the int8 budget (--int8-budget, default {DEFAULT_INT8_BUDGET:.0%}) measures which "
                  f"weights to keep int8: +{about_duration(h.int8_budget_seconds)}")
    if h.quantize_disk_bytes:
        out.print(f"the quantize stage writes to disk about {per_precision(h.quantize_disk_bytes)}"
                  " (mostly its weights file: the float32 weights and the quantized ones)")
    out.print(("fits this computer's memory" if h.fits else "[bold red]needs more memory than this computer has[/]")
              + f" ({h.note})")


def print_quantize(q: QuantizeSummary) -> None:
    from ..display import adapter_kept, human_bytes, kept_int8

    how = (f" with the {q.recipe} recipe" * (q.recipe != "plain") + " (stream rotated)" * q.rotated
           + f", {q.lm_head}" * bool(q.lm_head))
    out.print(f"Quantized {q.precision} for {q.target}{how}: "
              f"PPL {q.ppl_quant:.3f} vs FP {q.ppl_fp:.3f} (ratio {q.ratio:.4f}), "
              f"top-1 agreement {q.top1_agreement:.3f} over {q.eval_tokens} tokens")
    if q.int8_share is not None:
        out.print(f"Kept int8 by --int8-budget: {kept_int8(q.kept_int8, q.int8_share)}")
    for k in q.lora_kept:
        out.print(f"{'[yellow]' if k.flagged else ''}LoRA adapter {escape(k.adapter)}: "
                  f"{escape(adapter_kept(k))}{'[/]' if k.flagged else ''}")
    t = Table(title=f"Exported to {q.folder}")
    t.add_column("file")
    t.add_column("size", justify="right")
    for f in q.files:
        t.add_row(f["file"], human_bytes(f["bytes"]))
    out.print(t)
    out.print("  " + ", ".join(f"{k} {v:.1f} s" for k, v in q.steps.items()))


def print_compile(c: CompileSummary) -> None:
    from ..display import human_bytes

    out.print(f"Compiled with {c.backend} for {c.target} ({c.dsp_arch}, soc_model {c.soc_model}): "
              f"{c.nodes_on_cpu} nodes on the CPU" + (f", split into {c.parts} parts" if c.parts > 1 else "")
              + (", weight-shared binaries (for a phone)" if c.weight_shared else ""))
    if c.optimize == "quick":
        out.print("  graphs finalized quickly, for the simulator: compile with --optimize phone before deploying "
                  "to a phone")
    for b in c.binaries:
        out.print(f"  {b.file}: {human_bytes(b.bytes)}, {b.nodes_on_qnn} nodes on QNN, "
                  f"compiled in {b.compile_seconds:.1f} s")
    v = c.verification
    if v.simulator:
        out.print(f"  HTP simulator check: {v.simulator}")
    if v.nll_htp is not None:
        out.print(f"  on the HTP simulator over {v.tokens} tokens: NLL {v.nll_htp:.4f} vs quantsim (CPU) "
                  f"{v.nll_quantsim_cpu:.4f} (Δ {v.nll_diff:+.4f}), top-1 agreement {v.top1_agreement:.3f}")
    if v.kv_cache_max_diff_steps is not None:
        out.print(f"  the prompt graph's KV cache on the HTP simulator: within {v.kv_cache_max_diff_steps:g} "
                  "quantization steps of the quantsim's")


def print_adapt(ad: AdaptSummary, root: Path) -> None:
    out.print(f"Adapted into {root}: graphs {', '.join(ad.graphs)}")
    if ad.lora:
        out.print(f"LoRA adapters merged first: {', '.join(ad.lora)} (the gate compares with the model and them)")
    if ad.switchable:
        out.print("LoRA adapters kept switchable (graph inputs; the base model answers without one), each against "
                  f"the model computing with it: {'; '.join(ad.switchable)}")
    if ad.gate == "failed, accepted":
        out.print("[bold red]Equivalence gate FAILED; the mismatch was accepted (--accept-mismatch): this model "
                  "will not answer like the original.[/]")
    out.print(f"Equivalence vs the original model over {ad.positions} positions "
              f"(AR-{ad.prefill_ar} prefill + {ad.decode_steps} AR-1 steps): "
              f"top-1 agreement {ad.top1_agreement:.4f}, max |logit diff| {ad.max_abs_logit_diff:.2e}")
    out.print(f"Perplexity (fp32): original {ad.ppl_fp:.3f}, adapted {ad.ppl_adapted:.3f} over {ad.eval_tokens} tokens")


def print_mnn(r: MnnResult) -> None:
    from ..display import human_bytes

    out.print(f"MNN model {r.folder} ({human_bytes(r.model_bytes)}; {r.bits}-bit weights in blocks of "
              f"{r.block or 'a row'}{' (HQQ)' if r.method == 'hqq' else ''}, LM head {r.lm_head_bits}-bit; "
              f"{r.exporter})")
    out.print(f"  perplexity {r.mnn_ppl:.3f} against the float model's {r.fp_ppl:.3f} (x{r.ppl_ratio:.4f}), "
              f"top-1 agreement {r.top1_agreement:.4f} over {r.eval.tokens} tokens")
    out.print(f"  greedy answer: {r.agreeing_prefix} of {len(r.answer_fp)} tokens as the float model's; "
              f"prompt {r.prefill_tok_s:.1f} tok/s, decode {r.decode_tok_s:.1f} tok/s on {r.threads} threads")
    out.print(f"  [bold]answer:[/] {escape(r.answer_text)}")
    for note in r.notes:
        out.print(f"  [bold]note:[/] {escape(note)}")


def print_bundle(b: BundleSummary) -> None:
    out.print(f"Bundle {b.folder} (validated by libGenie {b.genie_api})")
    for f in b.files:
        out.print(f"  {f['file']:<40} {f['bytes']:>12,d} B")
    if b.runtime_missing:
        out.print("  phone runtime not included (set QNN_SDK_ROOT): " + ", ".join(b.runtime_missing))
    if b.decoding == "spd":
        check = b.spd_check or {}
        rate = check.get("tokens_per_target_call")
        out.print(f"  decoding: draft model proposes {b.draft_len} tokens per target call"
                  + (f"; greedy answers unchanged on {check.get('prompts', 1)} prompts of {check['tokens_compared']} "
                     f"tokens, {rate} tokens per target call (Genie's profile)" if check else ""))
    if b.phone_decode_tok_s:
        rates = ", ".join(f"{mode} {rate:,.0f} tok/s" for mode, rate in b.phone_decode_tok_s.items())
        out.print(f"  phone decode estimate ({b.target}, memory-bound): {rates}")
    for note in b.notes:
        out.print(f"  [bold]note:[/] {escape(note)}")
