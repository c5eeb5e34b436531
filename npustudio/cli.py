"""Headless entry points for every stage. `npustudio` with no arguments opens the desktop app."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def _summary(rec_result: dict[str, Any]) -> dict[str, Any]:
    eq = rec_result["equivalence"]
    return {"top1_agreement": eq["top1_agreement"], "max_abs_logit_diff": eq["max_abs_logit_diff"],
            "positions": eq["positions"], "decode_steps": eq["decode_steps"], "ppl_fp": rec_result["ppl_fp"],
            "ppl_adapted": rec_result["ppl_adapted"], "eval_tokens": rec_result["eval_tokens"]}


def cmd_adapt(a: argparse.Namespace) -> int:
    from .core import pipeline
    from .core.project import Project

    project = Project.open(a.project)
    with live_state(quiet=a.json) as st:
        rec = pipeline.adapt(project, a.model, _adapt_options(a), st)
    res = rec.result
    summary = _summary(res) | {"project": str(project.root), "seconds": round(rec.seconds, 1),
                               "graphs": res["graphs"]}
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


def cmd_run(a: argparse.Namespace) -> int:
    from .core import pipeline

    project_dir = Path(a.project) if a.project else pipeline.default_project_dir()
    with live_state(quiet=a.json) as st:
        summary = pipeline.run_all(project_dir, a.model, _adapt_options(a), st)
    if a.json:
        _print_json(summary)
        return 0
    eq = summary["equivalence"]
    out.print(f"[bold]NPU Studio[/] — {summary['model']} → project {summary['project']}")
    for name, s in summary["stages"].items():
        out.print(f"  stage {name:<6} {s['seconds']:>7.1f} s  peak RSS {s['peak_rss_mb']} MB")
    out.print(f"  graphs: {', '.join(summary['graphs'])}")
    out.print(f"  equivalence: top-1 {eq['top1_agreement']:.4f}, max |Δlogit| {eq['max_abs_logit_diff']:.2e} "
              f"({eq['positions']} positions)")
    out.print(f"  FP perplexity: {summary['ppl_fp']:.3f} (adapted graphs: {summary['ppl_adapted']:.3f}) "
              f"over {summary['eval_tokens']} tokens")
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

    s = add("run", cmd_run, "the whole job on the embedded defaults")
    s.add_argument("--model", default="default")
    s.add_argument("--project", default=None, help="project folder (default: the per-user default project)")
    adapt_args(s)

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
