"""Headless entry points for every stage. `npustudio` with no arguments opens the desktop app."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .core import layout, quiet
from .core.errors import UserError
from .core.parts import DEFAULT_MAX_PART_MB
from .core.progress import Cancelled, Partial, State
from .core.progress import Progress as ProgressEvent

if TYPE_CHECKING:
    from pydantic import BaseModel as Summary

    from .core.pipeline import CompileSummary, QuantizeSummary

# A log or a pipe gets whole lines: rich would wrap them mid-phrase at 80 columns where there is no terminal
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
out = Console(soft_wrap=not sys.stdout.isatty())

MAX_CONTEXT = 131072  # tokens: no phone holds a longer KV cache; larger values are typos (--cl 1e8)
MAX_PART_MB = 2048  # the HTP refuses a graph over 2 GiB


def _number_in(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a number in [lo, hi], else a plain message (exit 2)."""
    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (use {lo:g} to {hi:g})") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v:g} is out of range (use {lo:g} to {hi:g})")
        return v

    return parse


def _int_in(lo: int, hi: int, skip: range | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [lo, hi] (not in `skip`), else a plain message (exit 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (use {lo} to {hi})") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range (use {lo} to {hi})")
        if skip is not None and v in skip:
            raise argparse.ArgumentTypeError(f"{v} is reserved for Android emulators ({skip.start}-{skip.stop - 1}); "
                                             "pick another port, or 0 for any free one")
        return v

    parse.__name__ = "number"  # argparse names the type in its messages
    return parse


def _given(text: str) -> str:
    """An argparse type for paths and names: an empty one ('') is a mistake, not the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (give a path or a name)")
    return text


def _until_done(work: Callable[[], Any], stop: Any) -> Any:
    """`work()` in a thread while this one waits: Ctrl-C sets `stop` (Genie aborts and the run returns what it
    has) instead of being lost, as a KeyboardInterrupt raised inside Genie's ctypes callback is. Waits on an
    Event, not Thread.join: an interrupted join can report a live thread as finished (Python 3.11), and
    leaving while Genie still runs crashes the interpreter at exit."""
    import threading

    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="npustudio-generate", daemon=True).start()
    while not done.is_set():
        try:
            done.wait(0.1)
        except KeyboardInterrupt:
            if not stop.is_set():
                stop.set()
                err.print("\n[dim]stopping…[/]")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _print_json(obj: Any) -> None:
    """Strict JSON (a NaN or infinity, e.g. a flagged encoding, becomes null: jq and others reject NaN)."""
    sys.stdout.write(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n")


def _finite(obj: Any) -> Any:
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


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
    from .core.native_io import fd_redirected

    with fd_redirected(1, 2), redirect_stdout(sys.stderr):
        yield


def _card_table(card: dict[str, Any], fits: list[dict[str, Any]]) -> None:
    from .core.models import format_value, human_bytes

    t = Table(title=f"{card['source']}  —  {card['family']} ({card['architecture']})", show_header=False)
    for k in ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "params", "rope_theta",
              "rope_scaling", "tied_embeddings", "max_position", "activation", "qkv_bias", "o_bias", "mlp_bias",
              "qk_norm", "sliding_window", "bos_id", "eos_ids"):
        t.add_row(k, format_value(card.get(k)))
    t.add_row("chat template", "yes" if card.get("chat_template") else "no")
    out.print(t)
    f = Table(title=f"Fit at context {fits[0]['context_length']}")
    for col in ("precision", "weights", "KV cache (8-bit)", "HTP parts", "phone RAM", "fits phones with"):
        f.add_column(col)
    for e in fits:
        tier = f"≥ {e['min_phone_ram_gb']} GB" if e["min_phone_ram_gb"] else "none listed (too large)"
        cut = f"{e['parts']} (largest {e['largest_part_mb']:,.0f} MiB)" if e["parts"] else "none fits"
        f.add_row(e["precision"], human_bytes(e["weight_bytes"]), human_bytes(e["kv_cache_bytes"]), cut,
                  human_bytes(e["phone_ram_bytes"]), tier)
    out.print(f)
    for e in fits:
        if e["parts_problem"]:
            out.print(f"{e['precision']}: {e['parts_problem']}")


def cmd_info(a: argparse.Namespace) -> int:
    from .core import host_cost, models
    from .core.config_audit import check_context

    with err.status(f"reading {a.model}"):
        source = models.download(models.resolve_source(a.model))
        card = models.read_card(source)
    check_context(card, a.cl)
    fits = [f.model_dump() for f in models.fit_table(card, a.cl, a.ar, a.max_part_mb)]
    host = host_cost.estimate(card, gguf=bool(source.gguf_file))
    if a.json:
        _print_json(card.model_dump() | {"fit": fits, "host": host.model_dump()})
    else:
        _card_table(card.model_dump(), fits)
        _host_table(host)
    return 0


def _host_table(h: Any) -> None:
    from .core.models import human_bytes

    ram = human_bytes(h.machine_ram_bytes) if h.machine_ram_bytes else "unknown"
    t = Table(title=f"This computer ({h.cpus} CPUs, {ram} RAM): estimate per stage")
    for col in ("stage", "peak memory", "time"):
        t.add_column(col)
    for s in h.stages:
        t.add_row(s.stage, human_bytes(s.peak_ram_bytes), f"~{s.seconds / 60:.0f} min" if s.seconds >= 90
                  else f"~{s.seconds:.0f} s")
    out.print(t)
    out.print(("fits this computer's memory" if h.fits else "[bold red]needs more memory than this computer has[/]")
              + f" ({h.note})")


def _adapt_options(a: argparse.Namespace) -> Any:
    from .core.adapt import AdaptOptions

    return AdaptOptions(ar=a.ar, cl=a.cl, eval_corpus=a.eval_corpus, eval_tokens=a.eval_tokens,
                        decode_tokens=a.decode_tokens, device=a.device, accept_mismatch=a.accept_mismatch)


def cmd_adapt(a: argparse.Namespace) -> int:
    from .core import pipeline

    with pipeline.opened(a.project) as project, live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        rec = pipeline.adapt(project, a.model, _adapt_options(a), st, force=a.force)
    from .core.results import AdaptResult

    res = rec.result_as(AdaptResult)
    summary = pipeline.adapt_summary(res)
    if a.json:
        _print_json(summary.model_dump() | {"project": str(project.root), "seconds": round(rec.seconds, 1)})
    else:
        eq = res.equivalence
        out.print(f"Adapted into {project.root}")
        for g in res.graphs:
            out.print(f"  graph {g.name}: {len(g.inputs)} inputs, {len(g.outputs)} outputs")
        if summary.gate == "failed, accepted":
            out.print("[bold red]Equivalence gate FAILED; the mismatch was accepted (--accept-mismatch): this model "
                      "will not answer like the original.[/]")
        out.print(f"Equivalence vs the original model over {eq.positions} positions "
                  f"(AR-{eq.prefill_ar} prefill + {eq.decode_steps} AR-1 steps): "
                  f"top-1 agreement {eq.top1_agreement:.4f}, max |logit diff| {eq.max_abs_logit_diff:.2e}")
        out.print(f"Perplexity (fp32): original {res.ppl_fp:.3f}, adapted {res.ppl_adapted:.3f} "
                  f"over {res.eval_tokens} tokens")
    return 0


def _quantize_options(a: argparse.Namespace) -> Any:
    from .core.quantize import QuantizeOptions
    from .core.quantize.presets import load_overrides

    return QuantizeOptions(precision=a.precision, target=a.target, seq_mse=a.seq_mse, rotate=a.rotate,
                           calib_corpus=a.calib_corpus,
                           calib_samples=a.calib_samples, calib_len=a.calib_len,
                           overrides=load_overrides(a.overrides), eval_chars=a.eval_chars, device=a.device,
                           eval_corpus=getattr(a, "eval_corpus", None))


def _print_quantize(q: QuantizeSummary) -> None:
    from .core.models import human_bytes

    how = " with SeqMSE" * q.seq_mse + " (stream rotated)" * q.rotated
    out.print(f"Quantized {q.precision} for {q.target}{how}: "
              f"PPL {q.ppl_quant:.3f} vs FP {q.ppl_fp:.3f} (ratio {q.ratio:.4f}), "
              f"top-1 agreement {q.top1_agreement:.3f} over {q.eval_tokens} tokens")
    t = Table(title=f"Exported to {q.folder}")
    t.add_column("file")
    t.add_column("size", justify="right")
    for f in q.files:
        t.add_row(f["file"], human_bytes(f["bytes"]))
    out.print(t)
    out.print("  " + ", ".join(f"{k} {v:.1f} s" for k, v in q.steps.items()))


def cmd_quantize(a: argparse.Namespace) -> int:
    from .core import pipeline
    from .core.results import QuantizeResult

    opts = _quantize_options(a)
    return _stage_command(a, lambda p, st: pipeline.quantize(p, opts, st, force=a.force),
                          lambda rec, p: pipeline.quantize_summary(rec.result_as(QuantizeResult),
                                                                   p.stage_dir("quantize")),
                          _print_quantize)


def _stage_command(a: argparse.Namespace, run: Callable[[Any, State], Any],
                   summarize: Callable[[Any, Any], Summary], show: Callable[[Summary], None]) -> int:
    """A stage on an existing project (--project, --json): live progress, then its summary as JSON or tables."""
    from .core.project import Project

    project = Project.open(a.project, create=False)
    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        rec = run(project, st)
    summary = summarize(rec, project)
    if a.json:
        _print_json(summary.model_dump() | {"seconds": round(rec.seconds, 1), "peak_rss_mb": round(rec.peak_rss_mb)})
    else:
        show(summary)
    return 0


def cmd_encodings(a: argparse.Namespace) -> int:
    from .core.graph import encodings

    table = encodings.read(a.file, sqnr=a.sqnr)
    if a.json:
        _print_json(table.model_dump())
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


def cmd_run(a: argparse.Namespace) -> int:
    from .core import pipeline

    project_dir = Path(a.project) if a.project else pipeline.default_project_dir()
    def stream(s: str) -> None:  # the device's answer as it arrives (stderr keeps stdout for the summary)
        err.print(s, end="", markup=False, highlight=False)

    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        summary = pipeline.run_all(project_dir, a.model, _adapt_options(a), st, _quantize_options(a),
                                   _compile_options(a), ask=not a.no_ask, on_text=None if a.json else stream,
                                   force=a.force)
    if a.json:
        _print_json(summary.model_dump())
        return 0
    ad = summary.adapt
    out.print(f"[bold]NPU Studio[/] — {summary.model} → project {summary.project}")
    for name, s in summary.stages.items():
        out.print(f"  stage {name:<8} {s.seconds:>7.1f} s  peak RSS {s.peak_rss_mb} MB")
    out.print(f"  graphs: {', '.join(ad.graphs)}")
    out.print(f"  equivalence: top-1 {ad.top1_agreement:.4f}, max |Δlogit| {ad.max_abs_logit_diff:.2e} "
              f"({ad.positions} positions)")
    if ad.gate == "failed, accepted":
        out.print("  [bold red]equivalence gate FAILED, mismatch accepted: the model will not answer like the "
                  "original[/]")
    out.print(f"  FP perplexity: {ad.ppl_fp:.3f} (adapted graphs: {ad.ppl_adapted:.3f}) "
              f"over {ad.eval_tokens} tokens")
    _print_quantize(summary.quantize)
    _print_compile(summary.compile)
    out.print(f"  bundle: {summary.bundle.folder} (libGenie {summary.bundle.genie_api}: valid)")
    if summary.sample:
        sm = summary.sample
        where = f"{sm.device}{' (virtual device)' if sm.virtual else ''}"
        out.print(f"  deployed to {where}: {sm.deploy['bytes_sent']:,} B sent")
        cut = f" … (stopped after {sm.stopped_after_tokens} tokens)" if sm.stopped_after_tokens else ""
        out.print(f"  [bold]{sm.question}[/] → {sm.answer.strip()!r}{cut}")
        ps = sm.profile_summary
        if ps:
            from .core.models import human_number as n

            out.print(f"  Genie profile: init {n(ps.init_s)} s, TTFT {n(ps.ttft_s)} s, prompt "
                      f"{n(ps.prompt_tok_s)} tok/s, generation {n(ps.generation_tok_s)} tok/s  ({sm.profile})")
    return 0


def _compile_options(a: argparse.Namespace) -> Any:
    from .core.compile import CompileOptions

    return CompileOptions(backend=a.backend, target=getattr(a, "compile_target", None), verify_tokens=a.verify_tokens,
                          parts=a.parts, max_part_mb=a.max_part_mb, weight_sharing=a.weight_sharing)


def _print_compile(c: CompileSummary) -> None:
    from .core.models import human_bytes

    out.print(f"Compiled with {c.backend} for {c.target} ({c.dsp_arch}, soc_model {c.soc_model}): "
              f"{c.nodes_on_cpu} nodes on the CPU" + (f", split into {c.parts} parts" if c.parts > 1 else "")
              + (", weight-shared binaries (for a phone)" if c.weight_shared else ""))
    for b in c.binaries:
        out.print(f"  {b.file}: {human_bytes(b.bytes)}, {b.nodes_on_qnn} nodes on QNN, "
                  f"compiled in {b.compile_seconds:.1f} s")
    v = c.verification
    if "simulator" in v:
        out.print(f"  HTP simulator check: {v['simulator']}")
    if "nll_htp" in v:
        out.print(f"  on the HTP simulator over {v['tokens']} tokens: NLL {v['nll_htp']:.4f} vs quantsim (CPU) "
                  f"{v['nll_quantsim_cpu']:.4f} (Δ {v['nll_diff']:+.4f}), top-1 agreement {v['top1_agreement']:.3f}")


def cmd_compile(a: argparse.Namespace) -> int:
    from .core import pipeline
    from .core.results import CompileResult

    opts = _compile_options(a)
    return _stage_command(a, lambda p, st: pipeline.compile_graphs(p, opts, st, force=a.force),
                          lambda rec, _p: pipeline.compile_summary(rec.result_as(CompileResult)), _print_compile)


def cmd_bundle(a: argparse.Namespace) -> int:
    from .core import pipeline
    from .core.genie.bundle import BundleOptions
    from .core.genie.config import Sampler, check_prompt
    from .core.project import Project
    from .core.results import BundleResult

    project = Project.open(a.project, create=False)
    opts = BundleOptions(question=check_prompt(a.question), sampler=Sampler(greedy=not a.sample),
                         prompt_graphs=not a.token_graphs_only)
    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        rec = pipeline.bundle(project, opts, st, force=a.force)
    if a.json:
        _print_json(rec.result_as(BundleResult).model_dump())
    else:
        b = rec.result_as(BundleResult)
        out.print(f"Bundle {b.folder} (validated by libGenie {b.genie_api})")
        for f in b.files:
            out.print(f"  {f['file']:<40} {f['bytes']:>12,d} B")
        if b.runtime_missing:
            out.print("  phone runtime not included (set QNN_SDK_ROOT): " + ", ".join(b.runtime_missing))
        for note in b.notes:
            out.print(f"  [bold]note:[/] {escape(note)}")
    return 0


def cmd_genie_run(a: argparse.Namespace) -> int:
    """genie-t2t-run compatible: [PROMPT]/[BEGIN]: ... [END] on stdout, Genie's log on stderr."""
    import contextlib
    import ctypes
    import threading

    from .core.genie import host
    from .core.genie.config import check_prompt
    from .core.native_io import fd_redirected

    if a.prompt_file:
        try:
            prompt = Path(a.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"Cannot read the prompt file {a.prompt_file}: {e.strerror}.", "Check the path.") from e
        except UnicodeDecodeError as e:
            raise UserError(f"The prompt file {a.prompt_file} is not UTF-8 text (byte {e.start}).",
                            "Save it as UTF-8 text.") from e
    else:
        prompt = a.prompt or ""
    check_prompt(prompt)
    if a.profile:
        host.check_output_file(Path(a.profile), "--profile")
    if not a.raw:
        from .core.chat import as_chat_prompt

        prompt = as_chat_prompt(Path(a.config).parent, prompt)
    stop = threading.Event()
    # the answer alone on stdout: QNN's and Genie's native banners go to /dev/null (their log comes through
    # the logger callback), and so does their stderr outside --log verbose, while our messages keep stderr
    with contextlib.ExitStack() as stack:
        tokens_out = stack.enter_context(os.fdopen(os.dup(stack.enter_context(fd_redirected(1))), "w",
                                                   encoding="utf-8"))
        if a.log != "verbose":
            real_err = stack.enter_context(os.fdopen(os.dup(stack.enter_context(fd_redirected(2))), "w",
                                                     encoding="utf-8"))
            stack.callback(setattr, err, "file", err.file)
            err.file = real_err
        if a.preview:  # before [BEGIN]: over adb, stderr and stdout arrive as one stream
            err.print("[yellow]preview: the quantized graphs on the CPU, not Genie on the HTP[/]")
        tokens_out.write(f"[PROMPT]: {prompt}\n\n[BEGIN]: ")
        tokens_out.flush()

        def text(s: str) -> None:
            tokens_out.write(s)
            tokens_out.flush()

        try:
            res = _until_done(lambda: host.run(
                Path(a.config), prompt, text, Path(a.profile) if a.profile else None, log_level=a.log,
                on_log=lambda line: err.print(line, markup=False, highlight=False), stop=stop,
                max_tokens=a.max_tokens, preview=a.preview), stop)
        finally:
            ctypes.CDLL(None).fflush(None)  # native buffers to /dev/null before [END] ends the answer
            tokens_out.write("[END]\n")
            tokens_out.flush()
        if res.status == "aborted":
            err.print("aborted")
            return 130
        elif res.status == "context-full":
            err.print("Genie stopped: the prompt and the answer filled the model's context. Shorten the prompt.")
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .core.genie import profile

    prof = profile.read(Path(a.file))
    summary = profile.summarize(prof).model_dump()
    roof = profile.bundle_roofline(Path(a.bundle)) if a.bundle else None
    if a.json:
        _print_json({"summary": summary, "events": [e.model_dump() for e in prof.events], "roofline": roof})
        return 0
    from .core.models import human_number as n

    t = Table(title=f"{a.file}  ({summary['runner']})", show_header=False)
    for k, v in summary.items():
        t.add_row(k, "—" if v is None else n(v) if isinstance(v, float) else str(v))
    if roof:
        t.add_row("decode roofline (tok/s)", f"{n(roof['decode_tok_s_bound'])} at {n(roof['memory_gb_s'])} GB/s")
    out.print(t)
    return 0


def cmd_devices(a: argparse.Namespace) -> int:
    from .core import device

    devs = [d.model_dump() for d in device.devices()]
    if a.json:
        _print_json(devs)
        return 0
    if not devs:
        out.print("No device. Attach a phone with USB debugging on, or run `npustudio virtual-device`.")
        return 0
    t = Table(title=f"adb devices (server port {device.server_port()})")
    for col in ("serial", "state", "model", "SoC", "arch", "Android", "RAM", "free /data/local/tmp"):
        t.add_column(col)
    def gb(b: int | None) -> str:
        return f"{b / 1e9:.1f} GB" if b else "—"

    for d in devs:
        t.add_row(d["serial"] + ("  [virtual]" if d["virtual"] else ""), d["state"], d["model"],
                  f"{d['soc']} ({d['product']})" if d["soc"] else "", f"{d['dsp_arch']} / {d['soc_model']}",
                  d["android"], gb(d["ram_bytes"]), gb(d["free_bytes"]))
    out.print(t)
    return 0


def cmd_virtual_device(a: argparse.Namespace) -> int:
    import time

    from .core import device

    vd = device.start_virtual(Path(a.root) if a.root else None, a.port, a.soc, a.preview)
    kind = "preview runner" if a.preview else "real Genie on the HTP simulator"
    err.print(f"virtual device {vd.serial} ({a.soc}, {kind}) is connected; its /data/local/tmp is "
              f"{vd.root / 'data/local/tmp'}. Ctrl-C stops it.")
    sys.stdout.write(vd.serial + "\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        device.stop_virtual(vd)
    return 0


def cmd_deploy(a: argparse.Namespace) -> int:
    from .core import device, pipeline
    from .core.device import deploy
    from .core.genie.bundle import read_metadata

    read_metadata(Path(a.bundle))  # "not a bundle" before "no device"
    dev = device.pick(a.device)
    project = pipeline.project_of_bundle(Path(a.bundle))  # a project's bundle: the project records the deploy
    with live_state(quiet=a.json) as st, _stdout_is_for(a.json):
        res = pipeline.deploy(project, dev, st, force=a.force) if project else \
            deploy.deploy(Path(a.bundle), dev, st, force=a.force)
    if a.json:
        _print_json(res.model_dump())
    else:
        out.print(f"Deployed to {res.device}:{res.remote_dir}: {res.bytes_sent:,} B sent "
                  f"({res.rate_mb_s} MB/s), {res.bytes_skipped:,} B already there")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    import threading

    from .core import chat, device
    from .core.device import deploy
    from .core.genie.bundle import read_metadata

    bundle = Path(a.bundle) if a.bundle else _default_bundle()
    read_metadata(bundle)  # "not a bundle" before "no device"
    if a.desktop or a.preview:
        engine: Any = chat.DesktopEngine(bundle, preview=a.preview)
    else:
        dev = device.pick(a.device)
        with live_state() as st:
            deploy.deploy(bundle, dev, st)
        engine = chat.DeviceEngine(dev.serial, bundle)
    session = chat.ChatSession(bundle, engine, system=a.system)
    if a.new:
        session.clear()

    def ask(text: str) -> bool:
        """One turn; Ctrl-C stops the answer (kept in the history as stopped). False when it was stopped."""
        stop = threading.Event()
        turn = _until_done(lambda: session.send(text, lambda s: (sys.stdout.write(s), sys.stdout.flush()), stop),
                           stop)
        rate = f", {turn.generation_tok_s:.2f} tok/s" if turn.generation_tok_s else ""
        err.print(f"\n[dim]({engine.name}{rate}{', stopped' if turn.stopped else ''})[/]")
        return not turn.stopped

    if a.prompt:
        return 0 if ask(a.prompt) else 130
    err.print(f"chatting with {bundle} on {engine.name}; empty line or Ctrl-D ends, Ctrl-C stops an answer")
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        ask(line)


def _default_bundle() -> Path:
    from .core import pipeline
    from .core.project import Project

    b = Project(pipeline.default_project_dir()).stage_dir("bundle")
    if not (b / layout.GENIE_CONFIG).is_file():
        raise UserError("No bundle given and the default project has none.", "Pass --bundle DIR, or run "
                        "`npustudio run` first.")
    return b


def cmd_token(a: argparse.Namespace) -> int:
    from .core import secrets

    if a.action == "set":
        tok = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("Hugging Face token: ")
        if not tok:
            raise UserError("No token given.", "Paste the token from https://huggingface.co/settings/tokens.")
        secrets.set_hf_token(tok)
        err.print("Token stored in the system keyring.")
    elif a.action == "delete":
        secrets.delete_hf_token()
        err.print("Token removed from the system keyring.")
    else:
        err.print("A Hugging Face token is set." if secrets.get_hf_token() else "No Hugging Face token is set.")
        why = secrets.no_keyring()
        if why:
            err.print(f"(No usable system keyring: {why}; only HF_TOKEN can hold a token.)")
    return 0


def cmd_gui(a: argparse.Namespace) -> int:
    from .gui.app import main as gui_main

    return gui_main([a.project] if getattr(a, "project", None) else [])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npustudio", description=__doc__)
    sub = p.add_subparsers(dest="cmd")

    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.set_defaults(fn=fn)
        # also after the command; SUPPRESS keeps `npustudio --debug CMD` from being reset by the sub-parser
        s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback of an unexpected error")
        return s

    def force_arg(s: argparse.ArgumentParser,
                  help: str = "redo the stage even when its inputs and options are unchanged") -> None:
        s.add_argument("--force", action="store_true", help=help)

    s = add("info", cmd_info, "architecture card and phone-fit estimate of a model")
    s.add_argument("model", type=_given, help="default | HF folder | file.gguf | org/name")
    s.add_argument("--cl", type=_int_in(2, MAX_CONTEXT), default=1024, help="context length for the KV-cache estimate")
    s.add_argument("--ar", type=_int_in(1, 4096), default=128, help="prompt step size (AR-N graph), for the parts "
                   "estimate")
    s.add_argument("--max-part-mb", type=_number_in(0.001, MAX_PART_MB), default=DEFAULT_MAX_PART_MB,
                   help="largest estimated HTP allocation of one part, MiB (as compile's option)")
    s.add_argument("--json", action="store_true")

    def adapt_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--ar", type=_int_in(1, 4096), default=128, help="prompt step size (AR-N graph)")
        s.add_argument("--cl", type=_int_in(2, MAX_CONTEXT), default=1024, help="context length")
        s.add_argument("--eval-corpus", type=_given, default="default", help="default | text file | datasets:ID")
        s.add_argument("--eval-tokens", type=_int_in(2, 10_000_000), default=None,
                       help="tokens of the eval text scored (default: sized to the model, at least 256)")
        s.add_argument("--decode-tokens", type=_int_in(0, MAX_CONTEXT), default=64, help="AR-1 steps per eval window")
        s.add_argument("--accept-mismatch", action="store_true", help="keep adapted graphs that fail the "
                       "equivalence gate (recorded in the project; they will not answer like the original model)")
        s.add_argument("--json", action="store_true")

    def device_arg(s: argparse.ArgumentParser) -> None:
        s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="where the torch work runs (auto: the CUDA GPU when torch sees one)")

    s = add("adapt", cmd_adapt, "adapt a model to Genie's static graphs and prove it equivalent")
    s.add_argument("model", nargs="?", type=_given, default="default")
    s.add_argument("--project", type=_given, required=True, help="project folder (created if new)")
    adapt_args(s)
    device_arg(s)
    force_arg(s)

    def quantize_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--precision", default="w8a16", choices=["w8a16", "w4a16"])
        s.add_argument("--target", default="SM8750", help="target SoC (SM8550, SM8650, SM8750, SM8850, SC8380XP)")
        s.add_argument("--seq-mse", action="store_true", help="search int4 weight encodings with SeqMSE (slow)")
        s.add_argument("--rotate", action="store_true",
                       help="rotate the residual stream before quantizing (QuaRot-style; hurts models that come "
                            "from a 4-bit GGUF, such as the default)")
        s.add_argument("--calib-corpus", type=_given, default="default", help="default | text file | datasets:ID")
        s.add_argument("--calib-samples", type=_int_in(1, 100_000), default=4, help="calibration sequences")
        s.add_argument("--calib-len", type=_int_in(2, MAX_CONTEXT), default=256, help="tokens per calibration sequence")
        s.add_argument("--overrides", type=_given, default=None,
                       help="JSON file of per-module bitwidths (mixed precision)")
        s.add_argument("--eval-chars", type=_int_in(1, 2**31 - 1), default=None,
                       help="evaluate on the first N characters only")

    def compile_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--backend", default="ort-qnn", choices=["ort-qnn", "qairt"],
                       help="ort-qnn: embedded onnxruntime-qnn (HTP simulator); qairt: the SDK at QNN_SDK_ROOT")
        s.add_argument("--verify-tokens", type=_int_in(0, MAX_CONTEXT), default=128,
                       help="eval tokens run on the HTP simulator (0: skip)")
        s.add_argument("--parts", type=_int_in(0, 1024), default=0, help="split the model into N contexts `…_i_of_N` "
                       "(0: as many as keep each under --max-part-mb)")
        s.add_argument("--max-part-mb", type=_number_in(0.001, MAX_PART_MB), default=DEFAULT_MAX_PART_MB,
                       help="largest estimated HTP allocation of one part's graph, MiB (the HTP refuses graphs over "
                            "2 GiB: the default keeps a 10%% margin)")
        s.add_argument("--weight-sharing", action="store_true", help="one binary per part holding the prompt and "
                       "token graphs, weights once: for a phone (the simulator and the virtual device cannot load it)")

    s = add("quantize", cmd_quantize, "calibrate and quantize the adapted graphs with AIMET, then export them")
    s.add_argument("--project", type=_given, required=True, help="project folder with an adapted model")
    quantize_args(s)
    device_arg(s)
    force_arg(s)
    s.add_argument("--json", action="store_true")

    s = add("encodings", cmd_encodings, "per-tensor table of an AIMET .encodings file")
    s.add_argument("file", type=_given)
    s.add_argument("--flagged", action="store_true", help="only tensors with a flag")
    s.add_argument("--sqnr", action="store_true", help="each weight's quantization error (SQNR, dB) against the "
                                                       "float weights beside the file; the worst first")
    s.add_argument("--json", action="store_true")

    s = add("run", cmd_run, "the whole job on the embedded defaults")
    s.add_argument("--model", type=_given, default="default")
    s.add_argument("--project", type=_given, default=None,
                   help="project folder (default: the per-user default project)")
    adapt_args(s)
    quantize_args(s)
    compile_args(s)
    device_arg(s)
    force_arg(s, "redo every stage even when its inputs and options are unchanged")
    s.add_argument("--no-ask", action="store_true", help="stop at the verified bundle (skip the Genie question)")

    s = add("compile", cmd_compile, "compile the quantized graphs to QNN HTP context binaries and verify them")
    s.add_argument("--project", type=_given, required=True)
    compile_args(s)
    force_arg(s)
    s.add_argument("--json", action="store_true")

    s = add("bundle", cmd_bundle, "write the Genie bundle (config, binaries, tokenizer), validated by libGenie")
    s.add_argument("--project", type=_given, required=True)
    s.add_argument("--question", default="What is the capital of France?", help="the sample prompt's question")
    s.add_argument("--sample", action="store_true", help="sample (top-k/top-p) instead of greedy decoding")
    s.add_argument("--token-graphs-only", action="store_true",
                   help="leave the AR-N prompt graphs out: half the contexts (a model over ~3 GB of them loads on "
                        "the HTP simulator), the prompt read one token at a time")
    force_arg(s)
    s.add_argument("--json", action="store_true")

    s = add("genie-run", cmd_genie_run, "run a bundle with the real Genie on the HTP simulator "
            "(genie-t2t-run compatible)")
    s.add_argument("-c", "--config", type=_given, required=True, help=f"the bundle's {layout.GENIE_CONFIG}")
    s.add_argument("-p", "--prompt", default=None)
    s.add_argument("--prompt_file", type=_given, default=None, help="prompt text file (real newlines)")
    s.add_argument("--profile", type=_given, default=None, help="write Genie's profile JSON here")
    s.add_argument("--log", default="error", choices=["error", "warn", "info", "verbose"])
    s.add_argument("--max-tokens", type=_int_in(1, MAX_CONTEXT), default=None, help="stop after N generated tokens")
    s.add_argument("--preview", action="store_true", help="fast preview: the quantized graphs on the CPU, not Genie")
    s.add_argument("--raw", action="store_true", help="send the prompt exactly as given (genie-t2t-run's way); "
                   "by default a prompt that is not already in the model's chat template is put into it")

    s = add("profile", cmd_profile, "read a Genie profile JSON: init, TTFT, rates; roofline with --bundle")
    s.add_argument("file", type=_given)
    s.add_argument("--bundle", type=_given, default=None, help="the bundle folder, for a roofline estimate")
    s.add_argument("--json", action="store_true")

    s = add("devices", cmd_devices, "adb devices with SoC, NPU arch, Android, RAM and free space")
    s.add_argument("--json", action="store_true")

    s = add("virtual-device", cmd_virtual_device, "start a virtual phone the adb server connects to")
    s.add_argument("--port", type=_int_in(0, 65535, skip=range(5554, 5586)), default=0,
                   help="TCP port on 127.0.0.1 (not 5554-5585; 0 = any)")
    s.add_argument("--soc", default="SM8750", help="the SoC it reports (ro.soc.model)")
    s.add_argument("--preview", action="store_true", help="answer with the fast CPU preview instead of real Genie")
    s.add_argument("--root", type=_given, default=None, help="folder holding its file system")

    s = add("deploy", cmd_deploy, "push a bundle to a device (incremental, resumable)")
    s.add_argument("bundle", type=_given)
    s.add_argument("--device", default=None, help="serial (default: the only phone, else the only device)")
    s.add_argument("--force", action="store_true", help="push every file again")
    s.add_argument("--json", action="store_true")

    s = add("chat", cmd_chat, "chat with a bundle on a device or on this computer")
    s.add_argument("prompt", nargs="?", default=None, help="one question (omit for an interactive chat)")
    s.add_argument("--bundle", type=_given, default=None, help="bundle folder (default: the default project's)")
    s.add_argument("--device", default=None, help="adb serial")
    s.add_argument("--desktop", action="store_true", help="real Genie on this computer's HTP simulator")
    s.add_argument("--preview", action="store_true", help="the fast CPU preview on this computer")
    s.add_argument("--system", default=None, help="system prompt")
    s.add_argument("--new", action="store_true", help="start a new conversation (forget the saved history)")

    s = add("token", cmd_token, "store, check or delete the Hugging Face token (system keyring only)")
    s.add_argument("action", choices=["set", "delete", "status"])

    s = add("gui", cmd_gui, "open the desktop application")
    s.add_argument("--project", type=_given, default=None, help="project folder to open (default: the last one)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "debug", False):
        os.environ[quiet.DEBUG_ENV] = "1"
    quiet.libraries()
    if not getattr(args, "fn", None):
        return cmd_gui(args)
    try:
        return args.fn(args)
    except UserError as e:
        err.print(f"[bold red]error:[/] {escape(e.problem)}")
        if e.fix:
            err.print(f"[bold]fix:[/] {escape(e.fix)}")
        return 2
    except (Cancelled, KeyboardInterrupt):
        err.print("stopped; the project keeps its last finished stages.")
        return 130
    except Exception as e:  # a bug, or an input nothing checks yet: a short message; the traceback goes to a log
        return _unexpected(args, e, sys.argv[1:] if argv is None else argv)


def _unexpected(a: argparse.Namespace, e: BaseException, argv: list[str]) -> int:
    """Say what failed and where, write the traceback to a log file (the project's `logs/`, else the per-user log
    folder) and print it only with --debug. Exit 1: a UserError (exit 2) is what a handled bad input gives."""
    import traceback

    from .core.project import STAGE_NOTE

    tb = "".join(traceback.format_exception(e))
    stage = next((n.removeprefix(STAGE_NOTE) for n in getattr(e, "__notes__", []) if n.startswith(STAGE_NOTE)),
                 None)
    where = f"`npustudio {a.cmd}`" + (f" in the {stage} stage" if stage else "")
    first = (str(e).strip().splitlines() or [""])[0][:300]
    log = _write_log(a, argv, tb)
    err.print(f"[bold red]error:[/] {escape(where)} failed unexpectedly: {e.__class__.__name__}"
              + (f": {escape(first)}" if first else ""))
    err.print(f"The traceback is in {escape(str(log))}." if log else "The traceback could not be written to a log.")
    err.print("[bold]fix:[/] this is a bug in NPU Studio or an input it does not check yet: please report it with "
              "the log. A project keeps its last finished stages." + ("" if getattr(a, "debug", False) else
                                                                          " (--debug prints the traceback)"))
    if getattr(a, "debug", False):
        err.print(tb, markup=False, highlight=False)
    return 1


def _write_log(a: argparse.Namespace, argv: list[str], tb: str) -> Path | None:
    import platform
    import time

    import platformdirs

    from . import __version__
    from .core.fsutil import atomic_write_text, refuse_link

    folders = []
    project = getattr(a, "project", None)
    if project and (Path(project).expanduser() / layout.MANIFEST).is_file():
        folders.append(Path(project).expanduser() / "logs")
    folders.append(platformdirs.user_log_path("npustudio"))
    name = f"npustudio-{a.cmd}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    text = (f"npustudio {__version__}, Python {platform.python_version()}, {platform.platform()}\n"
            f"command: npustudio {' '.join(argv)}\n\n{tb}")
    for folder in folders:
        try:
            refuse_link(folder)
            atomic_write_text(folder / name, text)
            return folder / name
        except (OSError, UserError):
            continue
    return None


if __name__ == "__main__":
    sys.exit(main())
