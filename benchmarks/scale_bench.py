"""The whole pipeline on random models of real size, stage by stage: wall seconds and peak RSS as JSON.

Builds Hugging Face folders (bf16 safetensors, a tokenizer covering every id) with exactly the shapes of
Llama-3.2-1B, Qwen3-1.7B, Qwen3-4B, Phi-4-mini or Llama-3.1-8B, then runs each stage as its own `npustudio` command
(so each peak is that stage's alone): adapt -> quantize -> compile -> bundle, then Genie on the HTP simulator and
the CPU preview answer the same prompt greedily and their tokens are compared (contexts over one HTP protection
domain, a 1B model's, are bundled with --token-graphs-only: the simulator's Genie loads those). Along Genie's
answer, our own KV-cache runner on the same binaries must pick Genie's token at every step (else Genie and NPU
Studio drive the graphs differently: the run fails), and from the CPU's own cache before each answer step the
binaries must compute that position within ONE_STEP_FACTOR x the compile stage's measured tolerance of the CPU
graphs (else a position is wrong: the run fails); the CPU preview's own picks along Genie's path are reported.
Random weights: perplexities mean nothing here, cost does; their logits are flat (top-1/top-2 gaps of 0.004-0.08
logits at the Qwen3-1.7B width), so greedy answers part at the first near tie.

    .venv/bin/python benchmarks/scale_bench.py --model llama32-1b --precision w8a16 --json
    .venv/bin/python benchmarks/scale_bench.py --model qwen3-1.7b --precision w8a16,w4a16 --stage adapt,quantize
    .venv/bin/python benchmarks/scale_bench.py --model llama32-1b --stage compile --work /tmp/scale   # rerun one piece
    .venv/bin/python benchmarks/scale_bench.py --model qwen3-1.7b:4 --tokens 8   # the 1.7B widths, 4 layers
    .venv/bin/python benchmarks/scale_bench.py --model llama31-8b:8 --stage adapt,quantize   # 8B widths, 8 layers
    .venv/bin/python benchmarks/scale_bench.py --model llama32-1b --precision w4a16 --cl 4096   # a longer context
    .venv/bin/python benchmarks/scale_bench.py --model llama32-1b --precision w4a16 --lm-head-bits 4   # 4-bit head

A stage whose inputs are unchanged is skipped by the project (its figures are then the recorded ones: pass
--force to measure it again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS: dict[str, dict[str, Any]] = {
    "llama32-1b": {"class": ("LlamaConfig", "LlamaForCausalLM"), "config": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})},
    # issue 70's target: Llama-3.1-8B's shapes (untied head, llama3 RoPE); `llama31-8b:8` its widths at 8 layers
    "llama31-8b": {"class": ("LlamaConfig", "LlamaForCausalLM"), "config": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})},
    "qwen3-1.7b": {"class": ("Qwen3Config", "Qwen3ForCausalLM"), "config": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1_000_000.0)},
    "qwen3-4b": {"class": ("Qwen3Config", "Qwen3ForCausalLM"), "config": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1_000_000.0)},
    # Phi-4-mini-instruct's shapes: partial rotary 0.75 (rotary_dim 96), LongRoPE over 48 frequencies (its factors
    # here a made-up ramp: the short ones, all 1.0, are what a context <= 4096 uses)
    "phi4-mini": {"class": ("Phi3Config", "Phi3ForCausalLM"), "config": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=200064, tie_word_embeddings=True, rms_norm_eps=1e-5,
        partial_rotary_factor=0.75, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_theta=10000.0, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48,
                                          "long_factor": [1.0 + i / 8 for i in range(48)]},
        pad_token_id=199999, bos_token_id=199999, eos_token_id=199999)},
}
STAGES = ("adapt", "quantize", "compile", "bundle", "genie")
PROMPT = "The Python language reference describes"
GENIE_TOKENS = 16


def variant(name: str) -> tuple[str, int | None]:
    """`qwen3-1.7b:4` is qwen3-1.7b's shapes with 4 decoder layers: a defect that shows at real width is chased
    in minutes, not the hour the whole depth takes."""
    base, _, layers = name.partition(":")
    if base not in MODELS:
        raise SystemExit(f"unknown model {base!r}: use {', '.join(MODELS)}")
    return base, int(layers) if layers else None


def build_model(name: str, folder: Path) -> Path:
    """`name`'s random HF folder, built in a child process: a stage's peak RSS is read from its process's rusage,
    which on Linux starts from the high-water mark of the process that spawned it (the exec'd child inherits
    it): built here, the 7 GB of float weights of the build showed as every stage's peak."""
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--child-build", name, str(folder)], check=True, cwd=ROOT)
    return folder


def _build(name: str, folder: Path) -> Path:
    """A random-weight HF folder of `name`'s shapes, initialized as transformers initializes an untrained model.

    Scaled-up random weights (x4, tried first) make the network chaotic: w8a16 then moved the float model's
    top-1 token at 59% of 64 eval positions (max |logit diff| 10.9), and the fp16 arithmetic of the HTP parted Genie's
    answer from the fp32 preview at the first token. Trained models, like this initialization, are not chaotic."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    base, layers = variant(name)
    spec = MODELS[base]
    config = spec["config"] | ({"num_hidden_layers": layers} if layers else {})
    cfg = getattr(transformers, spec["class"][0])(**({"bos_token_id": 1, "eos_token_id": 2} | config))
    torch.manual_seed(0)
    # made in bf16 directly: a 4B model's float32 copy (16 GB) beside its bf16 one would not fit a 24 GB machine
    model = getattr(transformers, spec["class"][1])._from_config(cfg, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), max_shard_size="2GB")
    del model
    write_tokenizer(tmp, cfg.vocab_size)
    tmp.rename(folder)
    return folder


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE trained on the offline corpus, its vocabulary filled up to the model's with plain tokens
    (`<|fN|>`), so every id the model can produce decodes: Genie and the preview print the same text per id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from npustudio.core.evaluate import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([load_corpus("default", "calib") + load_corpus("default", "eval")], trainer)
    data = json.loads(tok.to_str())
    v = data["model"]["vocab"]
    i = 0
    while len(v) < vocab:
        v.setdefault(f"<|f{i}|>", len(v))
        i += 1
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.save_pretrained(str(folder))


def run_stage(cmd: list[str], log: Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One command in its own process: its JSON output, wall seconds and peak RSS (that process tree's)."""
    t0 = time.perf_counter()
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=cwd, env=env)
        out = proc.stdout.read() if proc.stdout else b""
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    row: dict[str, Any] = {"seconds": round(seconds, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024), "exit": code}
    if code:
        row["error"] = log.read_text(errors="replace").strip().splitlines()[-3:]
        return row
    try:
        row["result"] = json.loads(out)
    except ValueError:
        row["error"] = ["no JSON on stdout"]
    return row


def genie_vs_preview(bundle: str, tolerance: float | None, tokens: int = GENIE_TOKENS) -> dict[str, Any]:
    """Child process: the same prompt answered greedily by Genie (HTP simulator) and by the CPU preview, then
    both of our runners fed Genie's own tokens (teacher-forced) over the graphs Genie used (the prompt through the
    bundle's prompt graph, or one token at a time when it has none; each answer token through the token graph):
    - `runner_on_simulator`: our KV-cache runner on the same binaries on the simulator. Genie's token must be its
      top-1 at every step: anything else is Genie and our runner driving the graphs differently (a real defect).
    - `one_step_from_cpu_cache`: the same binaries run each answer step from the CPU runner's cache, so both
      sides compute that position from identical inputs; the largest |logit difference| must stay within
      ONE_STEP_FACTOR x `tolerance` (see `one_step`).
    - `teacher_forced`: the CPU preview (the prepared graphs in fp32) along Genie's path, its own cache; its
      margins, reported: each is within 2 x `simulator_vs_cpu_max_abs_logit_diff` whenever the simulator's top-1
      is Genie's token, so they judge nothing by themselves.
    `tolerance`: the compile stage's own |logit difference| (simulator vs CPU) over its verification text."""
    from npustudio.core.genie import host

    out: dict[str, Any] = {}
    pieces: list[str] = []
    t0 = time.perf_counter()
    r = host.run(Path(bundle) / "genie_config.json", PROMPT, pieces.append, max_tokens=tokens)
    out["genie"] = {"tokens": pieces, "seconds": round(time.perf_counter() - t0, 1), "status": r.status}
    # one preview (its graphs loaded once) answers and is then teacher-forced; built after Genie is done with the
    # simulator, so the two are never in memory together
    genie_pieces = pieces
    pieces = []
    t0 = time.perf_counter()
    pv = host.Preview(Path(bundle))
    _text, _event, aborted = pv.query(PROMPT, pieces.append, max_tokens=tokens)
    out["preview"] = {"tokens": pieces, "seconds": round(time.perf_counter() - t0, 1),
                      "status": "aborted" if aborted else "complete"}
    a, b = genie_pieces, pieces
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    prompt = [pv.bos] + pv.tok(PROMPT, add_special_tokens=False)["input_ids"]
    genie = token_ids(pv.tok, a)
    caches: list[Any] = []
    cpu = along(pv.runner, prompt, genie, caches)
    pv.runner.release()
    del pv
    t0 = time.perf_counter()
    runner = simulator_runner(Path(bundle))
    sim = along(runner, prompt, genie)
    sim_s = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    from_cpu = one_step(runner, caches, genie, cpu) | {"tolerance": tolerance,
                                                       "seconds": round(time.perf_counter() - t0, 1)}
    d = float((sim - cpu).abs().max()) if len(genie) else 0.0
    return out | {"agreeing_prefix": same, "compared": max(len(a), len(b)),
                  "runner_on_simulator": steps_along(sim, genie, None) | {"seconds": sim_s},
                  "simulator_vs_cpu_max_abs_logit_diff": round(d, 4),
                  "one_step_from_cpu_cache": from_cpu,
                  "teacher_forced": steps_along(cpu, genie, tolerance)}


def token_ids(tok: Any, pieces: list[str]) -> list[int]:
    """Genie hands out decoded text, one piece per token: a vocabulary entry, or plain text."""
    vocab = tok.get_vocab()
    ids: list[int] = []
    for piece in pieces:
        ids += [vocab[piece]] if piece in vocab else tok(piece, add_special_tokens=False)["input_ids"]
    return ids


def along(runner: Any, prompt: list[int], answer: list[int], caches: list[Any] | None = None) -> Any:
    """The logits that chose each token of `answer`, computed as Genie computes them: the prompt through the
    prompt graph (the token graph alone when the bundle has no prompt graph), then one token-graph step per
    answer token; `caches` receives the runner's cache before each of those steps."""
    import torch

    if not answer:
        return torch.zeros(0)
    runner.reset()
    rows = [runner.prefill(prompt)[-1]]
    for t in answer[:-1]:
        if caches is not None:
            caches.append(runner.snapshot())
        rows.append(runner.step([t], 1)[-1])
    return torch.stack(rows)


# The one-step bound, in multiples of the compile stage's tolerance. Measured on the Qwen3-1.7B shape (w8a16,
# tolerance 0.147): the simulator's one-step differences were 0.080-0.246 (at most 1.7 x), while the CPU graphs
# themselves stepped one position off (RoPE row, mask and cache slot shifted: the usual defect) part from their own
# logits by 1.28-1.95 (at least 8.7 x) at the same 15 positions.
ONE_STEP_FACTOR = 3


def one_step(runner: Any, caches: list[Any], answer: list[int], cpu: Any) -> dict[str, Any]:
    """Each answer step on `runner` (the simulator) from the CPU runner's own cache before it, so both compute
    that position from identical inputs: the largest |logit difference| at each position. Along their own caches
    the two part further at every step (each reads entries the other did not write); here nothing accumulates,
    so a step far off is a defect at that position (its RoPE row, mask, cache slot), not drift."""
    diffs = []
    for cache, t, row in zip(caches, answer[:-1], cpu[1:], strict=True):
        runner.resume(cache)
        diffs.append(round(float((runner.step([t], 1)[-1] - row).abs().max()), 4))
    return {"positions": [c.n_past for c in caches], "max_abs_logit_diff": diffs, "max": max(diffs, default=0.0)}


def simulator_runner(bundle: Path) -> Any:
    """Our KV-cache runner over the bundle's graphs as compiled (each graph the chain of its parts) on the x86
    HTP simulator: the binaries Genie ran, driven by our code."""
    import re

    import torch

    from npustudio.core import layout
    from npustudio.core.compile import split
    from npustudio.core.genie.meta import read_metadata
    from npustudio.core.graph import ort_qnn
    from npustudio.core.graph.kv_cache import KVCacheRunner
    from npustudio.core.graph.ort_graph import OrtGraph

    meta = read_metadata(bundle)
    comp = Path(meta.project_compile_dir or "")
    compiled = [g["graph"] for g in json.loads((comp / "compile.json").read_text())["graphs"]]

    def chain(whole: str) -> split.Chain:
        parts = sorted((p for p in compiled if re.sub(r"_\d+_of_\d+$", "_1_of_1", p) == whole),
                       key=lambda p: int(re.findall(r"_(\d+)_of_\d+$", p)[0]))
        return split.Chain([lambda p=p: OrtGraph(ort_qnn.context_session(comp / f"{p}.onnx", meta.target),
                                                 meta.io_encodings, comp / layout.PREPARED / layout.EMBEDDING_LUT)
                            for p in parts])

    return KVCacheRunner(meta.decoder, meta.context_length, {g.ar: chain(g.name) for g in meta.graphs},
                         torch.tensor(meta.rope_inv_freq))


def steps_along(logits: Any, genie: list[int], tolerance: float | None) -> dict[str, Any]:
    """Per step along Genie's answer: whether Genie's token is these logits' top-1, the margin of their top-1
    over Genie's token, and the gap between their own first and second choice (how close a tie it was);
    `agree_within_tolerance`: the share of steps where Genie's token is the top-1 or trails it by no more than
    `tolerance`."""
    steps = []
    for row, g in zip(logits, genie, strict=True):
        top2 = row.topk(2)
        steps.append({"top1": int(top2.indices[0]) == g, "margin": round(float(top2.values[0] - row[g]), 4),
                      "top1_top2_gap": round(float(top2.values[0] - top2.values[1]), 4)})
    agree = sum(s["top1"] for s in steps)
    out = {"top1_agreement": round(agree / max(1, len(steps)), 4), "steps": steps,
           "max_margin": max((s["margin"] for s in steps), default=0.0)}
    if tolerance is not None:
        tied = sum(s["top1"] or s["margin"] <= tolerance for s in steps)
        out |= {"tolerance": tolerance, "agree_within_tolerance": round(tied / max(1, len(steps)), 4)}
    return out


def disagreement(row: dict[str, Any]) -> str | None:
    """Why the Genie check fails the run: Genie's answer is not our runner's on the same binaries (a real defect:
    the two drive the graphs differently), or, from the CPU's own cache, the binaries compute an answer position
    more than ONE_STEP_FACTOR x the compile stage's measured tolerance from the CPU graphs (a defect at that
    position).
    The CPU preview's own preferences along Genie's path are reported, not judged: any margin it has is within
    the two runners' difference along that path once the simulator's top-1 is Genie's token."""
    sim, step = row.get("runner_on_simulator"), row.get("one_step_from_cpu_cache")
    if sim is None or step is None:
        return None
    if sim["top1_agreement"] < 1.0:
        return (f"Genie's token is not our runner's top-1 on the same binaries at "
                f"{sum(not s['top1'] for s in sim['steps'])} of {len(sim['steps'])} steps")
    tol = step["tolerance"]
    if tol is not None and step["max"] > ONE_STEP_FACTOR * tol:
        worst = step["max_abs_logit_diff"].index(step["max"])
        return (f"from the CPU's own cache, the simulator's logits at position {step['positions'][worst]} differ from "
                f"the CPU's by {step['max']}, more than {ONE_STEP_FACTOR} x the compile stage's measured {tol}")
    return None


def compile_summary(r: dict[str, Any]) -> dict[str, Any]:
    """Parts and binaries; `estimated_alloc_kb` is NPU Studio's estimate of each graph's HTP allocation (the
    simulator's compiler reports QNN's own figure only when a graph is over the limit: then `recut` says so)."""
    return {"parts": r["parts"], "htp_graph_limit_kb": r["htp_graph_limit_kb"], "recut": r["recut"],
            "binaries": [{"file": b["file"], "bytes": b["bytes"], "estimated_alloc_kb": b["estimated_alloc_kb"]}
                         for b in r["binaries"]],
            "nodes_on_cpu": r["nodes_on_cpu"], "simulator": r["verification"]}


def seed_adapted(work: Path, model: str, project: Path) -> None:
    """A new project of `model` starts from another precision's adapted model (hard links): adapt runs once."""
    from npustudio.core.project import Project

    donors = [d for d in work.glob(f"{model}-w*") if d != project and (d / "stages" / "adapt").is_dir()]
    if project.exists() or not donors:
        return
    src = Project(donors[0])
    m = src.load()
    m.stages = {k: v for k, v in m.stages.items() if k in ("model", "adapt")}
    m.attempts = {}
    for stage in m.stages:
        shutil.copytree(src.stage_dir(stage), project / "stages" / stage, copy_function=os.link)
    Project(project).save(m)


def compile_record(project: Path) -> dict[str, Any] | None:
    """The project's compile stage record (compile.json), when it has one."""
    comp = project / "stages" / "compile" / "compile.json"
    return json.loads(comp.read_text()) if comp.is_file() else None


def simulator_tolerance(project: Path) -> float | None:
    """The largest |logit difference| compile measured between the binaries on the simulator and the quantsim."""
    rec = compile_record(project) or {}
    return (rec.get("verification") or {}).get("max_abs_logit_diff")


def recorded(project: Path, stage: str, since: float) -> dict[str, Any] | None:
    """The project's record of `stage` when the command just run did not run it (its inputs and options were
    unchanged, or its output was seeded from another precision's project): the figures of the run that made it."""
    from npustudio.core import layout, stages
    from npustudio.core.project import Project

    done = Project(project).record(stages.spec(stage)) if (project / layout.MANIFEST).is_file() else None
    if done is None or done.record.started.timestamp() >= since:
        return None
    return {"seconds": round(done.record.seconds, 1), "peak_rss_mb": round(done.record.peak_rss_mb)}


def over_one_domain(project: Path) -> bool:
    """Whether the compiled contexts (one per graph and part) exceed what Genie loads into one protection domain."""
    from npustudio.core.genie.bundle import PD_BUDGET_BYTES

    rec = compile_record(project)
    if rec is None:
        return False
    graphs = rec["graphs"]
    return sum(g["bin_bytes"] for g in graphs) > PD_BUDGET_BYTES


def bench(model: str, precision: str, stages: list[str], work: Path, force: bool,
          tokens: int = GENIE_TOKENS, cl: int | None = None, lm_head_bits: int = 8) -> dict[str, Any]:
    npu = [sys.executable, "-m", "npustudio.cli"]
    name = model.replace(":", "-L")
    folder = build_model(model, work / "models" / name)
    if cl is not None:  # its own projects: the adapted graphs' KV cache is sized by the context
        name += f"-cl{cl}"
    variant = f"{name}-{precision}" + ("-head4" if lm_head_bits == 4 else "")  # its own project and log
    project = work / variant
    log = work / f"{variant}.log"
    seed_adapted(work, name, project)
    f = ["--force"] if force else []
    cmds = {
        "adapt": [*npu, "adapt", str(folder), "--project", str(project), "--json", *f,
                  *(["--cl", str(cl)] if cl is not None else [])],
        "quantize": [*npu, "quantize", "--project", str(project), "--precision", precision,
                     "--lm-head-bits", str(lm_head_bits), "--json", *f],
        "compile": [*npu, "compile", "--project", str(project), "--json", *f],
        "bundle": [*npu, "bundle", "--project", str(project), "--json", *f],
        "genie": [sys.executable, __file__, "--child-genie", str(project / "stages" / "bundle"),
                  "--tokens", str(tokens)],
    }
    rows: dict[str, Any] = {}
    for stage in [s for s in STAGES if s in stages]:
        if stage == "bundle" and over_one_domain(project):  # the simulator's Genie loads the AR-1 contexts only
            cmds[stage].append("--token-graphs-only")
        if stage == "genie" and (tol := simulator_tolerance(project)) is not None:
            cmds[stage] += ["--tolerance", str(tol)]
        since = time.time()
        row = run_stage(cmds[stage], log)
        if stage != "genie" and not row["exit"] and (rec := recorded(project, stage, since)):
            # skipped: the command only checked the stage; report the run that made its output
            row = rec | {"skipped": True, "check_seconds": row["seconds"], **{k: v for k, v in row.items()
                                                                             if k not in ("seconds", "peak_rss_mb")}}
        res = row.pop("result", None)
        if res is not None:
            row |= {"adapt": lambda r: {k: r[k] for k in ("top1_agreement", "max_abs_logit_diff", "positions")},
                    "quantize": lambda r: {"ratio": r["ratio"], "steps": r["steps"]},
                    "compile": compile_summary,
                    "bundle": lambda r: {k: r.get(k) for k in ("validated", "context_bytes", "notes")},
                    "genie": lambda r: r}[stage](res)
        if stage == "genie" and "error" not in row and (why := disagreement(row)):
            row["error"] = why
        rows[stage] = row
        if "error" in row:
            break
    pipeline = [s for s in ("adapt", "quantize", "compile", "bundle") if s in rows]
    return {"model": model, "precision": precision, "lm_head_bits": lm_head_bits, "cl": cl, "stages": rows,
            "pipeline_seconds": round(sum(rows[s]["seconds"] for s in pipeline), 1),
            "max_peak_rss_mb": max((r["peak_rss_mb"] for r in rows.values()), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama32-1b", help=f"{', '.join(MODELS)} or all (comma-separated); "
                    "NAME:LAYERS keeps NAME's widths with fewer decoder layers")
    ap.add_argument("--precision", default="w8a16", help="w8a16, w4a16 or both (comma-separated)")
    ap.add_argument("--stage", default=",".join(STAGES), help=f"stages to run: {', '.join(STAGES)}")
    ap.add_argument("--work", default=None, help="scratch folder (kept: models and finished stages are reused)")
    ap.add_argument("--force", action="store_true", help="rerun stages the project would skip")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    ap.add_argument("--tokens", type=int, default=GENIE_TOKENS,
                    help="answer tokens Genie and the preview compare (each costs a token-graph call per runner on "
                         "the simulator: ~70 s at the Qwen3-1.7B width)")
    ap.add_argument("--cl", type=int, default=None, help="context length (KV-cache entries; adapt's default "
                    "when left out)")
    ap.add_argument("--lm-head-bits", type=int, choices=(4, 8), default=8,
                    help="the quantize stage's --lm-head-bits (w4a16: 4 puts the LM head in LPBQ blocks too)")
    ap.add_argument("--child-genie", help=argparse.SUPPRESS)
    ap.add_argument("--tolerance", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-build", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_genie:
        print(json.dumps(genie_vs_preview(a.child_genie, a.tolerance, a.tokens)))
        return
    if a.child_build:
        _build(a.child_build[0], Path(a.child_build[1]))
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="npustudio-scale-"))
    models = list(MODELS) if a.model == "all" else a.model.split(",")
    results = [bench(m, p, a.stage.split(","), work, a.force, a.tokens, a.cl, a.lm_head_bits)
               for m in models for p in a.precision.split(",")]
    print(json.dumps({"work": str(work), "cpus": os.cpu_count(), "runs": results}, indent=None if a.json else 2))
    if any("error" in r for run in results for r in run["stages"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
