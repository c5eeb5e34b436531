"""Headless entry points for every stage. `npustudio` with no arguments opens the desktop app."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .core.errors import UserError
from .core.progress import Cancelled, Partial, State
from .core.progress import Progress as ProgressEvent

err = Console(stderr=True)
out = Console()


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@contextmanager
def live_state(quiet: bool = False) -> Iterator[State]:
    """A State drawn as a rich progress bar on stderr; perplexity points are printed as they arrive."""
    state = State()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err, transient=True, disable=quiet) as bar:
        task = bar.add_task("starting", total=1.0)

        def on(ev: ProgressEvent | Partial) -> None:
            if isinstance(ev, ProgressEvent):
                bar.update(task, completed=ev.fraction, description=ev.message[:60])
            elif ev.kind == "ppl" and not quiet:
                vals = ", ".join(f"{k} {v:.3f}" for k, v in ev.data.items()
                                 if k.endswith("_ppl") or k == "max_abs_logit_diff")
                err.print(f"  window {ev.data['window']}: {vals}")

        state.subscribe(on)
        yield state


@contextmanager
def _stdout_is_for(json_only: bool) -> Iterator[None]:
    """With --json, stdout carries only the JSON: anything a library prints goes to stderr."""
    if not json_only:
        yield
        return
    with redirect_stdout(sys.stderr):
        yield


def _card_table(card: dict[str, Any], fits: list[dict[str, Any]]) -> None:
    from .core.models import format_value, human_bytes

    t = Table(title=f"{card['source']}  —  {card['family']} ({card['architecture']})", show_header=False)
    for k in ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "params", "rope_theta",
              "rope_scaling", "tied_embeddings", "max_position", "bos_id", "eos_ids"):
        t.add_row(k, format_value(card[k]))
    t.add_row("chat template", "yes" if card.get("chat_template") else "no")
    out.print(t)
    f = Table(title=f"Fit at context {fits[0]['context_length']}")
    for col in ("precision", "weights", "KV cache (8-bit)", "parts (<4 GB)", "phone RAM", "fits phones with"):
        f.add_column(col)
    for e in fits:
        tier = f"≥ {e['min_phone_ram_gb']} GB" if e["min_phone_ram_gb"] else "none listed (too large)"
        f.add_row(e["precision"], human_bytes(e["weight_bytes"]), human_bytes(e["kv_cache_bytes"]), str(e["parts"]),
                  human_bytes(e["phone_ram_bytes"]), tier)
    out.print(f)


def cmd_info(a: argparse.Namespace) -> int:
    from .core import models

    with err.status(f"reading {a.model}"):
        source = models.download(models.resolve_source(a.model))
        card = models.read_card(source)
    fits = [f.model_dump() for f in models.fit_table(card, a.cl)]
    if a.json:
        _print_json(card.model_dump() | {"fit": fits})
    else:
        _card_table(card.model_dump(), fits)
    return 0


def _adapt_options(a: argparse.Namespace) -> Any:
    from .core.adapt import AdaptOptions

    return AdaptOptions(ar=a.ar, cl=a.cl, eval_corpus=a.eval_corpus, decode_tokens=a.decode_tokens)


def cmd_adapt(a: argparse.Namespace) -> int:
    from .core import pipeline
    from .core.project import Project

    project = Project.open(a.project)
    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        rec = pipeline.adapt(project, a.model, _adapt_options(a), st)
    res = rec.result
    summary = pipeline.adapt_summary(res) | {"project": str(project.root), "seconds": round(rec.seconds, 1)}
    if a.json:
        _print_json(summary)
    else:
        eq = res["equivalence"]
        out.print(f"Adapted into {project.root}")
        for g in res["graphs"]:
            out.print(f"  graph {g['name']}: {len(g['inputs'])} inputs, {len(g['outputs'])} outputs")
        out.print(f"Equivalence vs the original model over {eq['positions']} positions "
                  f"(AR-{eq['prefill_ar']} prefill + {eq['decode_steps']} AR-1 steps): "
                  f"top-1 agreement {eq['top1_agreement']:.4f}, max |logit diff| {eq['max_abs_logit_diff']:.2e}")
        out.print(f"Perplexity (fp32): original {res['ppl_fp']:.3f}, adapted {res['ppl_adapted']:.3f} "
                  f"over {res['eval_tokens']} tokens")
    return 0


def _quantize_options(a: argparse.Namespace) -> Any:
    from .core.quantize import QuantizeOptions
    from .core.quantize.presets import load_overrides

    return QuantizeOptions(precision=a.precision, target=a.target, seq_mse=a.seq_mse, calib_corpus=a.calib_corpus,
                           calib_samples=a.calib_samples, calib_len=a.calib_len,
                           overrides=load_overrides(a.overrides), eval_chars=a.eval_chars,
                           eval_corpus=getattr(a, "eval_corpus", "default"))


def _print_quantize(q: dict[str, Any]) -> None:
    from .core.models import human_bytes

    out.print(f"Quantized {q['precision']} for {q['target']}{' with SeqMSE' if q['seq_mse'] else ''}: "
              f"PPL {q['ppl_quant']:.3f} vs FP {q['ppl_fp']:.3f} (ratio {q['ratio']:.4f}), "
              f"top-1 agreement {q['top1_agreement']:.3f} over {q['eval_tokens']} tokens")
    t = Table(title=f"Exported to {q['folder']}")
    t.add_column("file")
    t.add_column("size", justify="right")
    for f in q["files"]:
        t.add_row(f["file"], human_bytes(f["bytes"]))
    out.print(t)
    out.print("  " + ", ".join(f"{k} {v:.1f} s" for k, v in q["steps"].items()))


def cmd_quantize(a: argparse.Namespace) -> int:
    from .core import pipeline
    from .core.project import Project

    project = Project.open(a.project, create=False)
    opts = _quantize_options(a)
    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        rec = pipeline.quantize(project, opts, st)
    q = pipeline.quantize_summary(rec.result, project.stage_dir("quantize"))
    q |= {"seconds": round(rec.seconds, 1), "peak_rss_mb": round(rec.peak_rss_mb)}
    if a.json:
        _print_json(q)
    else:
        _print_quantize(q)
    return 0


def cmd_encodings(a: argparse.Namespace) -> int:
    from .core.quantize import encodings

    table = encodings.read(a.file)
    if a.json:
        _print_json(table.model_dump())
        return 0
    rows = [r for r in table.rows if not a.flagged or r.flags]
    t = Table(title=f"{Path(a.file).name}  (schema {table.version}, {len(table.rows)} tensors)")
    t.add_column("tensor", overflow="fold", min_width=16)
    for col in ("layer", "role", "kind", "bits", "sym", "granularity", "scale min/med/max", "range", "flags"):
        t.add_column(col, overflow="fold")
    for r in rows:
        gran = r.granularity + (f" {r.block_size}" if r.block_size else "")
        t.add_row(r.name, "" if r.layer is None else str(r.layer), r.role, r.kind, str(r.bitwidth),
                  "y" if r.symmetric else "n", gran, f"{r.scale_min:.2e} / {r.scale_median:.2e} / {r.scale_max:.2e}",
                  f"[{r.range_min:.4g}, {r.range_max:.4g}]", "; ".join(r.flags))
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


def cmd_run(a: argparse.Namespace) -> int:
    from .core import pipeline

    project_dir = Path(a.project) if a.project else pipeline.default_project_dir()
    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        summary = pipeline.run_all(project_dir, a.model, _adapt_options(a), st, _quantize_options(a))
    if a.json:
        _print_json(summary)
        return 0
    ad = summary["adapt"]
    out.print(f"[bold]NPU Studio[/] — {summary['model']} → project {summary['project']}")
    for name, s in summary["stages"].items():
        out.print(f"  stage {name:<8} {s['seconds']:>7.1f} s  peak RSS {s['peak_rss_mb']} MB")
    out.print(f"  graphs: {', '.join(ad['graphs'])}")
    out.print(f"  equivalence: top-1 {ad['top1_agreement']:.4f}, max |Δlogit| {ad['max_abs_logit_diff']:.2e} "
              f"({ad['positions']} positions)")
    out.print(f"  FP perplexity: {ad['ppl_fp']:.3f} (adapted graphs: {ad['ppl_adapted']:.3f}) "
              f"over {ad['eval_tokens']} tokens")
    _print_quantize(summary["quantize"])
    return 0


def cmd_token(a: argparse.Namespace) -> int:
    from .core import secrets

    if a.action == "set":
        tok = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("Hugging Face token: ")
        if not tok:
            raise UserError("No token given.", "Paste the token from https://huggingface.co/settings/tokens.")
        try:
            secrets.set_hf_token(tok)
        except Exception as e:
            raise UserError(f"The system keyring refused the token ({e.__class__.__name__}).",
                            "Unlock or install a keyring (e.g. GNOME Keyring), or set HF_TOKEN for this "
                            "session only.") from e
        err.print("Token stored in the system keyring.")
    elif a.action == "delete":
        secrets.delete_hf_token()
        err.print("Token removed from the system keyring.")
    else:
        err.print("A Hugging Face token is set." if secrets.get_hf_token() else "No Hugging Face token is set.")
    return 0


def cmd_gui(a: argparse.Namespace) -> int:
    from .gui.app import main as gui_main

    return gui_main([])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npustudio", description=__doc__)
    sub = p.add_subparsers(dest="cmd")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.set_defaults(fn=fn)
        return s

    s = add("info", cmd_info, "architecture card and phone-fit estimate of a model")
    s.add_argument("model", help="default | HF folder | file.gguf | org/name")
    s.add_argument("--cl", type=int, default=1024, help="context length for the KV-cache estimate")
    s.add_argument("--json", action="store_true")

    def adapt_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--ar", type=int, default=128, help="prompt step size (AR-N graph)")
        s.add_argument("--cl", type=int, default=1024, help="context length")
        s.add_argument("--eval-corpus", default="default", help="default | text file | datasets:ID")
        s.add_argument("--decode-tokens", type=int, default=64, help="AR-1 steps per eval window")
        s.add_argument("--json", action="store_true")

    s = add("adapt", cmd_adapt, "adapt a model to Genie's static graphs and prove it equivalent")
    s.add_argument("model", nargs="?", default="default")
    s.add_argument("--project", required=True, help="project folder (created if new)")
    adapt_args(s)

    def quantize_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--precision", default="w8a16", choices=["w8a16", "w4a16"])
        s.add_argument("--target", default="SM8750", help="target SoC (SM8550, SM8650, SM8750, SM8850, SC8380XP)")
        s.add_argument("--seq-mse", action="store_true", help="search int4 weight encodings with SeqMSE (slow)")
        s.add_argument("--calib-corpus", default="default", help="default | text file | datasets:ID")
        s.add_argument("--calib-samples", type=int, default=4, help="calibration sequences")
        s.add_argument("--calib-len", type=int, default=256, help="tokens per calibration sequence")
        s.add_argument("--overrides", default=None, help="JSON file of per-module bitwidths (mixed precision)")
        s.add_argument("--eval-chars", type=int, default=None, help="evaluate on the first N characters only")

    s = add("quantize", cmd_quantize, "calibrate and quantize the adapted graphs with AIMET, then export them")
    s.add_argument("--project", required=True, help="project folder with an adapted model")
    quantize_args(s)
    s.add_argument("--json", action="store_true")

    s = add("encodings", cmd_encodings, "per-tensor table of an AIMET .encodings file")
    s.add_argument("file")
    s.add_argument("--flagged", action="store_true", help="only tensors with a flag")
    s.add_argument("--json", action="store_true")

    s = add("run", cmd_run, "the whole job on the embedded defaults")
    s.add_argument("--model", default="default")
    s.add_argument("--project", default=None, help="project folder (default: the per-user default project)")
    adapt_args(s)
    quantize_args(s)

    s = add("token", cmd_token, "store, check or delete the Hugging Face token (system keyring only)")
    s.add_argument("action", choices=["set", "delete", "status"])

    add("gui", cmd_gui, "open the desktop application")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not getattr(args, "fn", None):
        return cmd_gui(args)
    try:
        return args.fn(args)
    except UserError as e:
        err.print(f"[bold red]error:[/] {e.problem}")
        if e.fix:
            err.print(f"[bold]fix:[/] {e.fix}")
        return 2
    except (Cancelled, KeyboardInterrupt):
        err.print("stopped; the project keeps its last finished stages.")
        return 130


if __name__ == "__main__":
    sys.exit(main())
