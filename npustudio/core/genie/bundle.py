"""Bundle stage: everything genie-t2t-run needs, in one folder, validated by the real libGenie.

Entry point: `run(compile_dir, adapt_dir, options, out_dir, state) -> BundleResult`. The folder holds the
context binaries (hard links to the compile stage's, not copies), genie_config.json,
htp_backend_ext_config.json, tokenizer.json, metadata.json (I/O encodings, versions, what a host runner
needs), sample_prompt.txt in the model's chat template, and for a phone the QNN runtime files from
`QNN_SDK_ROOT` when it is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from .. import layout, stages
from ..errors import UserError
from ..fsutil import atomic_write_json, link_or_copy
from ..graph.embedding_lut import INPUT as LUT_INPUT
from ..progress import StateLike
from ..results import (
    BundleResult,
    CompileResult,
    GraphSpec,
)
from ..stage_options import DEFAULT_QUESTION as DEFAULT_QUESTION  # re-exported: declared with the options
from ..stage_options import BundleOptions
from ..stages import load_card, load_graphs
from ..targets import Soc, find_soc
from . import config as genie_config
from . import decoding, draft, geniex, host, libgenie
from .libgenie import PD_BUDGET_BYTES
from .meta import BundleMeta, GraphMeta

FORMAT = stages.BUNDLE.format  # bumped in core/stages.py when the output changes meaning


def runtime_libraries(target: Soc) -> list[tuple[str, str]]:
    """(SDK-relative source, file name) of what a phone needs beside the bundle for this arch."""
    v = target.dsp_arch.upper()
    return [("bin/aarch64-android/genie-t2t-run", "genie-t2t-run"),
            ("lib/aarch64-android/libGenie.so", "libGenie.so"),
            ("lib/aarch64-android/libQnnHtp.so", "libQnnHtp.so"),
            ("lib/aarch64-android/libQnnSystem.so", "libQnnSystem.so"),
            ("lib/aarch64-android/libQnnHtpPrepare.so", "libQnnHtpPrepare.so"),
            ("lib/aarch64-android/libQnnHtpNetRunExtensions.so", "libQnnHtpNetRunExtensions.so"),
            (f"lib/aarch64-android/libQnnHtp{v}Stub.so", f"libQnnHtp{v}Stub.so"),
            (f"lib/hexagon-{target.dsp_arch}/unsigned/libQnnHtp{v}Skel.so", f"libQnnHtp{v}Skel.so")]


def _link_binaries(comp: CompileResult, compile_dir: Path, out_dir: Path, kept: set[str], shared: bool
                   ) -> list[str]:
    """The kept graphs' context binaries linked into the bundle: one per graph (the simulator's layout; a phone
    takes it too), or with weight sharing one per part holding its prompt and token graphs."""
    bins: list[str] = []
    for g in comp.graphs:
        if _whole_graph(g.graph) not in kept:
            continue
        name = f"{g.graph}.bin"
        if shared:
            part = re.search(r"_\d+_of_\d+$", g.graph)
            name = f"shared{part.group(0) if part else ''}.bin"
        if name not in bins:
            link_or_copy(compile_dir / g.context_bin, out_dir / name)
            bins.append(name)
    return bins


def _link_draft(options: BundleOptions, target: draft.Model, out_dir: Path) -> tuple[draft.Model, list[str]]:
    """Genie's draft-model dialog: the draft's binaries beside the target's, checked as a pair first."""
    assert options.draft is not None
    if not options.prompt_graphs:
        raise UserError("Draft-model decoding checks the draft's tokens with the target's prompt graph: it cannot "
                        "be left out.", "Bundle with the prompt graphs (drop --token-graphs-only).")
    pair = draft.open_model(Path(options.draft))
    draft.check_pair(target, pair, options.draft_len)
    return pair, draft.link(pair, out_dir)


def _check_draft(options: BundleOptions, shared: bool, out_dir: Path, cfg: dict[str, Any], tok: Any,
                 state: StateLike) -> tuple[dict[str, Any] | None, list[str]]:
    """The draft's check on the HTP simulator (`draft.check_lossless`), and the note when it cannot run here."""
    if shared:  # weight-shared binaries are a phone's: the simulator cannot load them
        return None, ["The draft's effect on the answer was not checked on this computer: weight-shared binaries "
                      "load only on a phone."]
    state.progress(0.8, "checking that the draft leaves the answers unchanged (greedy, on the HTP simulator)")
    prompts, stop = draft.check_prompts(tok, options.question), state.stop_event
    # in a thread while this one waits: Ctrl-C (a KeyboardInterrupt lost inside Genie's callbacks) sets `stop`
    return host.until_done(lambda: draft.check_lossless(out_dir, cfg, prompts, stop=stop), stop), []


def run(compile_dir: Path, adapt_dir: Path, options: BundleOptions, out_dir: Path, state: StateLike) -> BundleResult:
    decoding.resolve(options.decoding, options.draft)
    comp = stages.COMPILE.load(compile_dir)
    card = load_card(adapt_dir)
    graphs = load_graphs(adapt_dir)
    target = find_soc(comp.target)
    cl = graphs[0].cl
    state.progress(0.1, "linking the context binaries")
    # one binary per graph (the simulator's layout; a phone takes it too), or with weight sharing one per
    # part holding the prompt and token graphs (a qairt build always shares)
    shared = comp.backend == "qairt" or comp.weight_shared
    kept = _kept_graphs(graphs, options.prompt_graphs, shared)
    bins = _link_binaries(comp, compile_dir, out_dir, kept, shared)
    shutil.copy2(adapt_dir / layout.TOKENIZER, out_dir / layout.TOKENIZER)
    embedding = None
    if LUT_INPUT in comp.io:  # the graphs start from the embedding table's rows: Genie looks them up on the CPU
        link_or_copy(compile_dir / layout.PREPARED / layout.EMBEDDING_LUT, out_dir / layout.EMBEDDING_LUT)
        embedding = genie_config.embedding_config(layout.EMBEDDING_LUT, card.hidden, comp.io[LUT_INPUT])

    target_model = draft.Model(compile_dir.parent.parent, compile_dir, adapt_dir, card, comp, graphs)
    pair, draft_bins = _link_draft(options, target_model, out_dir) if options.draft else (None, [])
    draft_meta = draft.describe(pair, options.draft_len, draft_bins) if pair else None
    cfg = genie_config.dialog_config(card.model_dump(), cl, bins, options.sampler, options.n_threads, htp_ext=True,
                                     embedding=embedding)
    adapters = _write_adapters(adapt_dir, out_dir)
    if adapters:
        if pair:
            raise UserError("A draft-model bundle cannot also switch LoRA adapters: the draft would still propose "
                            "the base model's tokens.", "Bundle without --draft, or merge the adapter.")
        cfg = genie_config.with_lora(cfg, adapters, layout.LORA_ALPHA)
    if pair:
        cfg = genie_config.speculative(cfg, genie_config.engine_config(pair.card.model_dump(), draft_bins,
                                                                       options.n_threads, htp_ext=True),
                                       options.draft_len)
    atomic_write_json(out_dir / layout.GENIE_CONFIG, cfg)
    atomic_write_json(out_dir / layout.HTP_EXT_CONFIG, genie_config.htp_ext_config(target, shared))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(adapt_dir), trust_remote_code=False)
    (out_dir / layout.SAMPLE_PROMPT).write_text(genie_config.sample_prompt(tok, options.question), encoding="utf-8")

    state.progress(0.4, "runtime files")
    copied, missing = _runtime(target, out_dir)
    from ..graph import store  # here, not at the top: reading a bundle's metadata (deploy, chat) needs no torch

    spec, inv_freq = store.load_spec(adapt_dir)
    meta = BundleMeta(
        model=card.source, family=card.family, target=target, context_length=cl,
        graphs=[GraphMeta(name=g.name, ar=g.ar, cl=g.cl) for g in graphs if g.name in kept],
        io_encodings=comp.io, backend=comp.backend, weight_shared=shared, optimize=comp.optimize,
        versions=_versions(), decoder=spec,
        rope_inv_freq=inv_freq.tolist(), eos_ids=card.eos_ids, bos_id=card.bos_id, question=options.question,
        chat_template=card.chat_template, runtime_files=copied, runtime_missing=missing,
        project_compile_dir=str(compile_dir.resolve()), decoding="spd" if draft_meta else "basic", draft=draft_meta,
        lora_adapters=adapters, lora_inputs=_lora_shapes(adapt_dir) if adapters else {})
    shown = [g.graph for g in comp.graphs if _whole_graph(g.graph) in kept]
    extra = geniex.metadata(card, comp, compile_dir, shown)
    if draft_meta:  # GenieX runs one engine: it would take the draft's binaries for the target's
        extra.pop("model_id", None)
    atomic_write_json(out_dir / layout.METADATA, meta.model_dump() | extra)

    state.progress(0.7, "validating genie_config.json with libGenie")
    status, log = libgenie.validate_config(json.dumps(genie_config.absolute(cfg, out_dir)))
    if status != 0:
        raise UserError(f"libGenie rejected the bundle's genie_config.json: status {libgenie.describe(status)}.\n"
                        + "\n".join(log[-10:]), "This is a bug in the bundle writer; please report it with the log.")
    spd_check, notes_extra = _check_draft(options, shared, out_dir, cfg, tok, state) if options.draft else (None, [])
    files = [{"file": p.name, "bytes": p.stat().st_size} for p in sorted(out_dir.iterdir()) if p.is_file()]
    context_bytes = sum((out_dir / b).stat().st_size for b in bins + (draft_meta["binaries"] if draft_meta else []))
    lut_bytes = (out_dir / layout.EMBEDDING_LUT).stat().st_size if embedding else 0
    state.progress(1.0, "bundle ready")
    res = BundleResult(folder=str(out_dir), target=target.soc, dsp_arch=target.dsp_arch, files=files,
                       genie_api=libgenie.api_version(), validated=True, runtime_files=copied,
                       runtime_missing=missing, context_bytes=context_bytes, embedding_lut_bytes=lut_bytes,
                       notes=_notes(context_bytes, shared, options.prompt_graphs, lut_bytes) + notes_extra
                       + [n for n in (geniex.note(card, bool(draft_meta)),) if n],
                       decoding="spd" if draft_meta else "basic", draft_len=options.draft_len if draft_meta else None,
                       spd_check=spd_check,
                       phone_decode_tok_s=decoding.phone_rates(out_dir, target, options.draft_len if draft_meta
                                                               else None,
                                                               (spd_check or {}).get("tokens_per_target_call")))
    atomic_write_json(out_dir / layout.BUNDLE_RESULT, res.model_dump())
    return res


def _write_adapters(adapt_dir: Path, out_dir: Path) -> list[str]:
    """Each switchable LoRA adapter as Genie reads it: `lora/NAME/INPUT.raw`, float32 in the graph's order of
    elements (written atomically, a folder at a time); their names, none when the adapters were merged."""
    from ..graph import lora_inputs

    adapters = lora_inputs.saved_values(adapt_dir)
    root = out_dir / layout.LORA_BUNDLE
    if root.exists():
        shutil.rmtree(root)
    for name, values in adapters.items():
        tmp = root / f".{name}.tmp"
        tmp.mkdir(parents=True)
        for tensor, v in values.items():
            if tensor != lora_inputs.ALPHA:
                v.float().contiguous().numpy().astype("<f4").tofile(tmp / f"{tensor}.raw")
        os.replace(tmp, root / name)
    return list(adapters)


def _lora_shapes(adapt_dir: Path) -> dict[str, list[int]]:
    from ..graph import lora_inputs

    return lora_inputs.shapes(lora_inputs.saved_slots(adapt_dir))


def _whole_graph(name: str) -> str:
    """The adapted graph a compiled part belongs to (`prompt_ar128_cl1024_2_of_3` → `prompt_ar128_cl1024_1_of_1`)."""
    return re.sub(r"_\d+_of_\d+$", "_1_of_1", name)


def _kept_graphs(graphs: list[GraphSpec], prompt_graphs: bool, shared: bool) -> set[str]:
    if prompt_graphs:
        return {g.name for g in graphs}
    if shared:
        raise UserError("A weight-shared build holds the prompt and token graphs in one binary per part: the prompt "
                        "graphs cannot be left out of it.",
                        "Bundle it with its prompt graphs, or compile without --weight-sharing.")
    token = {g.name for g in graphs if g.ar == 1}
    if not token:
        raise UserError("This model was adapted without an AR-1 (token) graph, so there is nothing to bundle "
                        "without the prompt graphs.", "Bundle it with its prompt graphs.")
    return token


def _notes(context_bytes: int, shared: bool, prompt_graphs: bool, lut_bytes: int) -> list[str]:
    notes = []
    if not prompt_graphs:
        notes.append("Prompt graphs left out: Genie reads each prompt one token at a time (slower first token).")
    if context_bytes > PD_BUDGET_BYTES and not shared:
        notes.append(f"The context binaries hold {context_bytes / 2**30:.1f} GiB, more than one HTP protection "
                     f"domain takes (about {PD_BUDGET_BYTES / 2**30:.0f} GiB): Genie will fail to load them "
                     "(error 1002). For a phone, compile with --weight-sharing; on the HTP simulator, bundle with "
                     "--token-graphs-only.")
    if lut_bytes:
        notes.append(f"The embedding table is Genie's lookup table on the CPU ({layout.EMBEDDING_LUT}, "
                     f"{lut_bytes / 1e6:,.1f} MB), not in the NPU contexts.")
    return notes


def _runtime(target: Soc, out_dir: Path) -> tuple[list[str], list[str]]:
    """Copy the phone runtime from QNN_SDK_ROOT when set; else list what a phone deploy will need."""
    sdk = os.environ.get("QNN_SDK_ROOT")
    libs = runtime_libraries(target)
    if not sdk:
        return [], [name for _, name in libs]
    copied, missing = [], []
    for rel, name in libs:
        src = Path(sdk) / rel
        if src.is_file():
            shutil.copy2(src, out_dir / name)
            copied.append(name)
        else:
            missing.append(name)
    return copied, missing


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("npustudio", "onnxruntime", "onnxruntime-qnn", "aimet-torch", "torch", "transformers"):
        try:
            out[pkg] = importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            pass
    out["genie_api"] = libgenie.api_version()
    out["qnn_sdk_build"] = "2.51.0 (onnxruntime-qnn)" if not os.environ.get("QNN_SDK_ROOT") else \
        os.environ["QNN_SDK_ROOT"]
    return out
