"""The stage commands: info, each stage (adapt, quantize, compile, bundle), run, and the encodings table."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from ..core import stages
from ..core.errors import UserError
from ..core.stage_options import BundleOptions, MnnOptions
from .args import (
    adapt_options,
    bundle_options,
    cluster_of,
    compile_options,
    decoding_options,
    mnn_options,
    quantize_options,
)
from .console import err, live_state, out, print_json, stdout_is_for
from .render import (
    card_table,
    host_table,
    lora_table,
    print_adapt,
    print_bundle,
    print_compile,
    print_mnn,
    print_quantize,
)


def cmd_info(a: argparse.Namespace) -> int:
    from ..core import pipeline

    with err.status(f"reading {a.model}"):
        source = pipeline.resolve(a.model)
        res = pipeline.describe(source, a.cl, a.ar, a.max_part_mb)
    from ..core.model_fit import plan

    fits = [f.model_dump() for f in res.fit]
    plans = {where: plan(res.fit, where).model_dump() for where in ("phone", "simulator")}
    adapters = pipeline.lora_report(source, res.card, tuple(a.lora)) if a.lora else []
    if a.json:
        print_json(res.card.model_dump() | {"fit": fits, "recommended": plans, "host": res.host.model_dump(),
                                            "lora": adapters})
    else:
        card_table(res.card.model_dump(), fits, plans)
        host_table(res.host)
        if adapters:
            lora_table(adapters)
    return 0


def cmd_stage(a: argparse.Namespace) -> int:
    """`npustudio adapt|quantize|compile|bundle --project P`: the stage by its declaration (skipped when its inputs
    and options are unchanged), live progress, then one envelope: its summary, the project, seconds and peak RSS
    (as JSON with --json, else as tables)."""
    from ..core import pipeline
    from ..core.project import Project

    spec = stages.spec(a.cmd)
    options = OPTIONS[spec.name](a)
    if isinstance(options, MnnOptions):  # `compile --backend mnn`: its own stage, made from the float model
        spec = stages.MNN
    # a stage made from the model makes the project; the later ones need it made
    creates = spec.requires == stages.MODEL.name
    with (pipeline.opened(a.project) if creates else contextlib.nullcontext(Project.open(a.project, create=False))
          ) as project, live_state(quiet=a.json) as st, stdout_is_for(a.json):
        cluster = cluster_of(a) if spec.remote else None
        rec = pipeline.run_stage(project, spec, options, st, force=a.force, cluster=cluster,
                                 model=getattr(a, "model", None))
    summary = pipeline.summary(rec, project)
    if a.json:
        print_json(summary.model_dump() | {"stage": spec.name, "project": str(project.root),
                                           "seconds": round(rec.record.seconds, 1),
                                           "peak_rss_mb": round(rec.record.peak_rss_mb)})
    else:
        SHOW[spec.name](summary, project.root)
    return 0


# per stage (keyed by its declaration's name): its options from the flags, and its summary as tables
OPTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {
    stages.ADAPT.name: adapt_options, stages.QUANTIZE.name: quantize_options,
    stages.COMPILE.name: lambda a: mnn_options(a) if a.backend == "mnn" else compile_options(a),
    stages.BUNDLE.name: bundle_options}
SHOW: dict[str, Callable[[Any, Path], None]] = {
    stages.ADAPT.name: print_adapt, stages.QUANTIZE.name: lambda s, _root: print_quantize(s),
    stages.COMPILE.name: lambda s, _root: print_compile(s), stages.BUNDLE.name: lambda s, _root: print_bundle(s),
    stages.MNN.name: lambda s, _root: print_mnn(s)}


def cmd_encodings(a: argparse.Namespace) -> int:
    from ..core.graph import encodings, sqnr

    if a.against:
        return _sqnr_changes(sqnr.changes(a.against, a.file), a)
    if a.lora:
        return _lora_effects(a)
    table = sqnr.annotated(a.file) if a.sqnr else encodings.read(a.file)
    if a.json:
        print_json(table.model_dump())
        return 0
    rows = [r for r in table.rows if not a.flagged or r.flags]
    if a.sqnr:  # the tensors that lose the most first
        rows.sort(key=lambda r: (r.sqnr_db is None, r.sqnr_db if r.sqnr_db is not None else 0.0))
    t = Table(title=f"{Path(a.file).name}  (schema {table.version}, {len(table.rows)} tensors)")
    t.add_column("tensor", overflow="fold", min_width=16)
    cols = ("layer", "role", "kind", "bits", "sym", "granularity", "scale min/med/max", "range")
    for col in (*cols, *(("SQNR dB",) if a.sqnr else ()), "flags"):
        t.add_column(col, overflow="fold")
    for r in rows:
        gran = r.granularity + (f" {r.block_size}" if r.block_size else "")
        db = ("—" if r.sqnr_db is None else f"{r.sqnr_db:.1f}",) if a.sqnr else ()
        t.add_row(r.name, "" if r.layer is None else str(r.layer), r.role, r.kind, str(r.bitwidth),
                  "y" if r.symmetric else "n", gran, f"{r.scale_min:.2e} / {r.scale_median:.2e} / {r.scale_max:.2e}",
                  f"[{r.range_min:.4g}, {r.range_max:.4g}]", *db, "; ".join(r.flags))
    out.print(t)
    s = Table(title="Per layer")
    for col in ("layer", "tensors", "weight bits", "activation bits", "max scale spread", "flagged"):
        s.add_column(col)
    for layer in table.layers:
        s.add_row("—" if layer.layer is None else str(layer.layer), str(layer.tensors),
                  ",".join(map(str, layer.weight_bits)), ",".join(map(str, layer.activation_bits)),
                  f"{layer.max_scale_spread:.1f}", str(layer.flagged))
    out.print(s)
    return 0


def _lora_effects(a: argparse.Namespace) -> int:
    from ..core.lora_effect import effects

    rows = effects(a.file)
    if a.json:
        print_json([r.model_dump() for r in rows])
        return 0
    if not rows:
        out.print(f"{Path(a.file).name}: its project merged no LoRA adapter.")
        return 0
    t = Table(title=f"LoRA adapters in {Path(a.file).name}: what quantization keeps of each update")
    for col in ("adapter", "module", "layer", "role", "rank", "scale", "A / B", "graph weights", "bits",
                "‖ΔW‖/‖W‖", "≥ ½ step", "flags"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.adapter, r.module, "" if r.layer is None else str(r.layer), r.role, str(r.rank), f"{r.scale:g}",
                  f"{tuple(r.a_shape)} / {tuple(r.b_shape)}", ", ".join(r.tensors),
                  "" if r.bitwidth is None else f"{r.bitwidth} ({r.granularity})",
                  "—" if r.update_ratio is None else f"{r.update_ratio:.2%}",
                  "—" if r.kept is None else f"{r.kept:.1%}", "; ".join(r.flags))
    out.print(t)
    return 0


def _sqnr_changes(changes: list[Any], a: argparse.Namespace) -> int:
    if a.json:
        print_json([c.model_dump() for c in changes])
        return 0
    t = Table(title=f"SQNR of {Path(a.file).name} against {Path(a.against).name} (dB; the most damaged first)")
    for col in ("tensor", "kind", "before", "after", "change"):
        t.add_column(col, overflow="fold")

    def db(x: float | None) -> str:
        return "—" if x is None else f"{x:.1f}"

    for c in changes:
        t.add_row(c.name, c.kind, db(c.before_db), db(c.after_db),
                  "—" if c.change_db is None else f"{c.change_db:+.1f}")
    out.print(t)
    moved = [c.change_db for c in changes if c.change_db is not None]
    if moved:
        out.print(f"{sum(x > 0 for x in moved)} tensors gained, {sum(x < 0 for x in moved)} lost; "
                  f"mean change {sum(moved) / len(moved):+.2f} dB")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from ..core import pipeline

    if a.backend == "mnn":
        raise UserError("`npustudio run` makes a Genie bundle for a Hexagon NPU; the MNN back-end is its own stage.",
                        "Run `npustudio compile --backend mnn --project P [--model M]`: it reads the model, exports "
                        "it to MNN and answers on this computer.")
    project_dir = Path(a.project) if a.project else pipeline.default_project_dir()

    def stream(s: str) -> None:  # the device's answer as it arrives (stderr keeps stdout for the summary)
        err.print(s, end="", markup=False, highlight=False)

    with live_state(quiet=a.json) as st, stdout_is_for(a.json):
        summary = pipeline.run_all(project_dir, a.model, adapt_options(a), st, quantize_options(a),
                                   compile_options(a), ask=not a.no_ask, on_text=None if a.json else stream,
                                   force=a.force, cluster=cluster_of(a),
                                   boptions=BundleOptions(**decoding_options(a)))
    if a.json:
        print_json(summary.model_dump())
        return 0
    ad = summary.adapt
    out.print(f"[bold]NPU Studio[/] — {summary.model} → project {summary.project}")
    for name, s in summary.stages.items():
        out.print(f"  stage {name:<8} {s.seconds:>7.1f} s  peak RSS {s.peak_rss_mb} MB")
    out.print(f"  graphs: {', '.join(ad.graphs)}")
    out.print(f"  equivalence: top-1 {ad.top1_agreement:.4f}, max |Δlogit| {ad.max_abs_logit_diff:.2e} "
              f"({ad.positions} positions)")
    for line in ad.switchable:
        out.print(f"  LoRA adapter kept switchable, {line}")
    if ad.gate == "failed, accepted":
        out.print("  [bold red]equivalence gate FAILED, mismatch accepted: the model will not answer like the "
                  "original[/]")
    out.print(f"  FP perplexity: {ad.ppl_fp:.3f} (adapted graphs: {ad.ppl_adapted:.3f}) "
              f"over {ad.eval_tokens} tokens")
    print_quantize(summary.quantize)
    print_compile(summary.compile)
    b = summary.bundle
    spd = f"; draft-model decoding, {b.draft_len} proposals per target call" if b.decoding == "spd" else ""
    out.print(f"  bundle: {b.folder} (libGenie {b.genie_api}: valid{spd})")
    if summary.sample:
        sm = summary.sample
        where = f"{sm.device}{' (virtual device)' if sm.virtual else ''}"
        out.print(f"  deployed to {where}: {sm.deploy['bytes_sent']:,} B sent")
        cut = f" … (stopped after {sm.stopped_after_tokens} tokens)" if sm.stopped_after_tokens else ""
        out.print(f"  [bold]{sm.question}[/] → {sm.answer.strip()!r}{cut}")
        ps = sm.profile_summary
        if ps:
            from ..display import human_number as n

            out.print(f"  Genie profile: init {n(ps.init_s)} s, TTFT {n(ps.ttft_s)} s, prompt "
                      f"{n(ps.prompt_tok_s)} tok/s, generation {n(ps.generation_tok_s)} tok/s"
                      + (f", {n(ps.tokens_per_call)} tokens per target call" if ps.tokens_per_call else "")
                      + f"  ({sm.profile})")
    return 0
