"""Compile -> bundle -> real Genie on the HTP simulator, on a tiny random Llama (head_dim 64, CL 128, AR-32)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from npustudio.core import layout, pipeline, results, stages
from npustudio.core.compile import CompileOptions
from npustudio.core.errors import UserError
from npustudio.core.genie import bundle as bundle_stage
from npustudio.core.genie import config as genie_config
from npustudio.core.genie import host, libgenie, profile
from npustudio.core.genie.meta import read_metadata
from npustudio.core.graph.exported import read_test_vectors
from npustudio.core.graph.ort_graph import OrtGraph, cpu_session
from npustudio.core.progress import State
from npustudio.core.project import Project
from tests.conftest import done, npustudio

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def project(genie_project: Project) -> Project:
    return genie_project


def test_every_node_lands_on_the_htp_and_the_binaries_are_written(project: Project) -> None:
    r = done(project, stages.COMPILE).result
    assert r.nodes_on_cpu == 0
    assert [g.graph for g in r.graphs] == ["prompt_ar32_cl128_1_of_1", "token_ar1_cl128_1_of_1"]
    for g in r.graphs:
        assert g.nodes_on_qnn > 100
        assert (project.stage_dir("compile") / g.context_bin).stat().st_size == g.bin_bytes > 100_000
    assert (r.target, r.dsp_arch, r.soc_model) == ("SM8750", "v79", 69)


def test_graph_io_is_quantized_as_genie_needs(project: Project) -> None:
    io = done(project, stages.COMPILE).result.io
    assert "input_ids" not in io  # the embedding table left the graphs: Genie looks the rows up on the CPU
    for name in ("inputs_embeds", "attention_mask", "position_ids_cos", "position_ids_sin", "logits"):
        assert io[name].dtype == "uint16", name
    for layer in range(2):
        for kind in ("key", "value"):
            assert io[f"past_{kind}_{layer}_in"].dtype == "uint8"
            assert io[f"past_{kind}_{layer}_in"] == io[f"past_{kind}_{layer}_out"]  # tied


def test_simulator_agrees_with_the_quantsim(project: Project) -> None:
    v = done(project, stages.COMPILE).result.verification
    assert v.tokens is not None and v.tokens > 40 and v.decode_steps == 4
    assert v.nll_diff is not None and abs(v.nll_diff) < 0.01
    # the prompt graph's cache, which the token graph reads on a phone, within 2 of 255 steps of the quantsim's (1)
    assert v.kv_cache_max_diff_steps is not None and v.kv_cache_max_diff_steps <= 2
    assert v.top1_agreement is not None and v.top1_agreement >= 0.95
    tv = v.vs_quantsim_test_vectors
    assert all(x == 1.0 for k, x in tv.items() if k.endswith("top1_agreement"))
    assert all(x < 0.05 for k, x in tv.items() if k.endswith("max_abs_logit_diff"))


def test_compile_cli_json_lists_binaries_and_nodes_on_cpu(project: Project, tmp_path: Path) -> None:
    # on a copy: the CLI's options are not the fixture's, so the stage runs again, and on the session's project
    # that left its bundle out of date for every later test that reads it as built
    copy = shutil.copytree(project.root, tmp_path / "p")
    res = npustudio("compile", "--project", str(copy), "--no-embedding-lut", "--json")
    assert res.returncode == 0, res.stderr
    c = json.loads(res.stdout)
    assert c["nodes_on_cpu"] == 0 and c["dsp_arch"] == "v79"
    assert all(b["bytes"] > 0 for b in c["binaries"])
    assert "nll_htp" in c["verification"]

    # the table in the graphs (as asked) against the session's project, whose graphs read Genie's lookup table:
    # each binary holds the 16-bit table (384 x 128) more (to QNN's 4 KiB alignment), and both forms compute the
    # same logits to the bit
    table = 384 * 128 * 2
    lut_form = {g.graph: g.bin_bytes for g in done(project, stages.COMPILE).result.graphs}
    for b in c["binaries"]:
        assert table - 8192 <= b["bytes"] - lut_form[b["graph"]] <= table + 8192, b
    io = done(Project.open(copy), stages.COMPILE).result.io
    assert io["input_ids"].dtype == "int32" and "inputs_embeds" not in io
    for g in lut_form:
        vectors = read_test_vectors(project.stage_dir("quantize") / layout.TEST_VECTORS / f"{g}.npz")["in"]
        feeds = {k: torch.from_numpy(v) for k, v in vectors.items()}
        logits = [OrtGraph(cpu_session(p.stage_dir("compile") / "prepared" / f"{g}.onnx"),
                           done(p, stages.COMPILE).result.io,
                           p.stage_dir("compile") / "prepared" / layout.EMBEDDING_LUT)(feeds)["logits"]
                  for p in (project, Project.open(copy))]
        assert torch.equal(*logits)


def test_bundle_holds_a_genie_config_libgenie_accepts(project: Project) -> None:
    b = project.stage_dir("bundle")
    names = {p.name for p in b.iterdir()}
    assert {layout.GENIE_CONFIG, layout.HTP_EXT_CONFIG, layout.TOKENIZER, layout.METADATA, layout.SAMPLE_PROMPT,
            "prompt_ar32_cl128_1_of_1.bin", "token_ar1_cl128_1_of_1.bin"} <= names
    cfg = json.loads((b / layout.GENIE_CONFIG).read_text())["dialog"]
    assert cfg["context"]["size"] == 128 and cfg["context"]["n-vocab"] == 384
    assert (cfg["context"]["bos-token"], cfg["context"]["eos-token"]) == (1, 2)
    assert cfg["engine"]["backend"]["QnnHtp"]["kv-dim"] == 64
    assert cfg["engine"]["model"]["positional-encoding"]["rope-dim"] == 32
    # the embedding table as Genie's lookup table: every token's 16-bit row, in the graph input's own encoding
    emb, io = cfg["embedding"], done(project, stages.COMPILE).result.io["inputs_embeds"]
    assert (emb["type"], emb["size"], emb["datatype"]) == ("lut", 128, "ufixed16")
    assert emb["quant-param"] == {"scale": io.scale, "offset": -io.zero_point}
    rec = done(project, stages.BUNDLE).result
    assert (b / emb["lut-path"]).stat().st_size == rec.embedding_lut_bytes == 384 * 128 * 2
    assert any("lookup table on the CPU" in n for n in rec.notes)
    absolute = genie_config.absolute(json.loads((b / layout.GENIE_CONFIG).read_text()), b)
    status, _ = libgenie.validate_config(json.dumps(absolute))
    assert status == 0
    ext = json.loads((b / layout.HTP_EXT_CONFIG).read_text())
    assert ext["devices"][0] == {**ext["devices"][0], "soc_model": 69, "dsp_arch": "v79"}
    prompt = (b / layout.SAMPLE_PROMPT).read_text()
    assert "\n" in prompt and "\\n" not in prompt and not prompt.startswith("<|im_start|>")  # Genie adds BOS
    assert prompt.rstrip().endswith("assistant")


def test_a_broken_config_shows_genies_own_message(tmp_path: Path) -> None:
    status, _ = libgenie.validate_config("{not json")
    assert status == -7  # JSON format error
    status, _ = libgenie.validate_config("{}")
    assert status == -8  # schema: no dialog
    with pytest.raises(UserError) as e:
        libgenie.Dialog(json.dumps({"dialog": {"version": 1, "type": "basic"}}))
    assert "status -8" in e.value.problem or "status -9" in e.value.problem or "status -4" in e.value.problem
    # a refusal without a message of Genie's never asks the user to follow that message
    silent = libgenie._fix(-8, [])
    assert "as Genie's message says" not in silent and "JSON schema error" in silent and "npustudio bundle" in silent


def test_genie_run_streams_begin_end_and_writes_its_profile(project: Project, tmp_path: Path) -> None:
    cfg = project.stage_dir("bundle") / layout.GENIE_CONFIG
    prof = tmp_path / "p.json"
    res = npustudio("genie-run", "-c", str(cfg), "-p", PROMPT, "--profile", str(prof), "--max-tokens", "6")
    assert res.returncode == 0, res.stderr
    templated = genie_config.as_chat_prompt(cfg.parent, PROMPT)  # a bare question goes in the chat template
    assert templated.startswith("user\n" + PROMPT) and templated.endswith("assistant\n")  # BOS is Genie's
    assert res.stdout.startswith(f"[PROMPT]: {templated}\n\n[BEGIN]: ")
    body = res.stdout.split("[BEGIN]: ", 1)[1]
    assert body.rstrip().endswith("[END]") and len(body) > len("[END]") + 1
    s = json.loads(npustudio("profile", str(prof), "--json", "--bundle", str(cfg.parent)).stdout)
    assert s["summary"]["runner"] == "genie"
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(cfg.parent / layout.TOKENIZER))
    n_prompt = 1 + len(tok(templated, add_special_tokens=False)["input_ids"])  # Genie prepends BOS
    assert s["summary"]["generated_tokens"] == 6 and s["summary"]["prompt_tokens"] == n_prompt
    assert s["summary"]["ttft_s"] > 0 and s["summary"]["generation_tok_s"] > 0
    assert s["roofline"]["decode_tok_s_bound"] > 0


def test_genie_run_keeps_a_templated_or_raw_prompt_as_given(project: Project) -> None:
    cfg = project.stage_dir("bundle") / layout.GENIE_CONFIG
    by_hand = f"user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"  # already holds a special token
    for args, sent in ((["-p", PROMPT, "--raw"], PROMPT), (["-p", by_hand], by_hand)):
        res = npustudio("genie-run", "-c", str(cfg), *args, "--preview", "--max-tokens", "2")
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"[PROMPT]: {sent}\n\n[BEGIN]: ")


def test_genie_and_the_cpu_preview_give_the_same_greedy_tokens(project: Project) -> None:
    cfg = project.stage_dir("bundle") / layout.GENIE_CONFIG
    real = host.run(cfg, PROMPT, lambda _s: None, max_tokens=8)
    fast = host.run(cfg, PROMPT, lambda _s: None, max_tokens=8, preview=True)
    assert real.runner.startswith("genie") and fast.runner.startswith("preview")
    assert real.text and real.text == fast.text


def test_the_preview_after_genie_in_one_new_process_answers(project: Project) -> None:
    """As a chat that switches from Genie to the CPU preview does: onnxruntime first loaded after libGenie's QNN
    libraries crashed the process (SIGSEGV) before the preview said a word."""
    script = ("import sys; from pathlib import Path; from npustudio.core.genie import host\n"
              "cfg = Path(sys.argv[1])\n"
              "for preview in (False, True):\n"
              "    r = host.run(cfg, sys.argv[2], lambda _s: None, max_tokens=4, preview=preview)\n"
              "    print(r.runner.split()[0], repr(r.text))\n")
    cfg = project.stage_dir("bundle") / layout.GENIE_CONFIG
    res = subprocess.run([sys.executable, "-c", script, str(cfg), PROMPT], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    (genie, g_text), (preview, p_text) = (line.split(" ", 1) for line in res.stdout.splitlines()[-2:])
    assert (genie, preview) == ("genie", "preview") and g_text == p_text != "''"


def test_speed_benchmark_reports_the_preview_and_the_phone_roofline(project: Project) -> None:
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "genie_bench.py"
    res = subprocess.run([sys.executable, str(bench), str(project.stage_dir("bundle")), "--tokens", "3", "--no-genie"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["preview_cpu"]["generated_tokens"] <= 3 and out["preview_cpu"]["ttft_s"] > 0
    assert "genie_htp_simulator" not in out and out["phone_roofline"]["decode_tok_s_bound"] > 0


@pytest.mark.parametrize("run", [host.run, host.run_apart], ids=["in-process", "apart"])
def test_stop_aborts_a_genie_query(project: Project, run: Any) -> None:
    """In this process, or in the child the window's chat uses: aborted there, with the text so far."""
    cfg = project.stage_dir("bundle") / layout.GENIE_CONFIG
    stop = threading.Event()
    seen: list[str] = []

    def on_text(s: str) -> None:
        seen.append(s)
        stop.set()  # the user presses stop once text appears

    res = run(cfg, PROMPT, on_text, stop=stop, max_tokens=100)
    assert res.status == "aborted"
    assert 1 <= len(seen) < 100 and res.text == "".join(seen)


def test_genie_apart_answers_as_in_process_streams_its_log_and_stops(project: Project) -> None:
    """The window's desktop chat runs Genie in a child process at a lower priority: the same greedy answer, its
    pieces and Genie's log arriving here as they come, and Genie's refusal the same UserError (its Stop:
    `test_stop_aborts_a_genie_query`)."""
    import os

    cfg = project.stage_dir("bundle") / layout.GENIE_CONFIG
    here = host.run(cfg, PROMPT, lambda _s: None, max_tokens=8)
    pieces: list[str] = []
    log: list[str] = []
    apart = host.run_apart(cfg, PROMPT, pieces.append, max_tokens=8, log_level="info", on_log=log.append)
    assert apart.status == "complete" and apart.text == here.text == "".join(pieces) != ""
    assert any("GenieDialog_create" in line for line in log) and apart.profile and "GenieDialog" not in apart.text
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the caller's own priority is untouched
    with pytest.raises(UserError, match="context holds"):
        host.run_apart(cfg, "word " * 400, lambda _s: None)


def test_ctrl_c_stops_a_desktop_chat_and_the_history_keeps_the_turn_as_stopped(project: Project,
                                                                               tmp_path: Path) -> None:
    """Ctrl-C while libGenie runs: it was raised inside Genie's ctypes callback and swallowed, the answer ran on
    and the history kept it as complete. Now the generation stops and the turn is recorded as stopped."""
    import shutil
    import signal

    bundle = tmp_path / "b"  # a copy: its chat history stays out of the shared project
    shutil.copytree(project.stage_dir("bundle"), bundle)
    # the tiny model answers PROMPT in ~16 tokens (~1.2 s): on a loaded machine it had ended before the signal
    # came (exit 0); this prompt runs it to the end of its context (~100 tokens)
    prompt = "Once upon a time"
    # Ctrl-C as a terminal delivers it: a run started in the background (`bash .ci/run &`) ignores SIGINT, and its
    # children inherit that, so the chat would never see the signal (exit 0)
    proc = subprocess.Popen([sys.executable, "-m", "npustudio.cli", "chat", "--desktop", "--bundle", str(bundle),
                             prompt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # the answer has begun: Genie's query runs, its token callback is live
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=300)
    assert first, err
    assert proc.returncode == 130, err
    assert "Exception ignored" not in err and "Traceback" not in err and "stopped" in err
    turns = json.loads((bundle / "chat_history.json").read_text())["turns"]
    assert [(t["user"], t["stopped"]) for t in turns] == [(prompt, True)]


def test_each_stage_reads_its_record_back_typed_and_names_a_damaged_one(project: Project, tmp_path: Path) -> None:
    """What a stage wrote into its folder is what the project recorded, read back as the stage's result model;
    the next stage reads it that way, so a damaged record is a message naming the file, not a KeyError."""
    from npustudio.core import compile as compile_stage

    specs: tuple[stages.StageSpec[Any, Any], ...] = (stages.MODEL, stages.ADAPT, stages.QUANTIZE, stages.COMPILE,
                                                     stages.BUNDLE)
    for spec in specs:
        assert spec.load(project.stage_dir(spec.name)) == done(project, spec).result, spec.name
    damaged = tmp_path / "quantize"
    damaged.mkdir()
    (damaged / layout.QUANTIZE_RESULT).write_text(json.dumps({"precision": "w8a16"}))
    with pytest.raises(UserError) as e:
        compile_stage.run(damaged, project.stage_dir("adapt"), CompileOptions(), tmp_path / "out", State())
    assert f"{layout.QUANTIZE_RESULT} is damaged" in e.value.problem
    assert "`npustudio quantize --project P --force`" in (e.value.fix or "")  # the stage's own command


def test_profile_reader_tolerates_missing_fields_and_names_bad_files(tmp_path: Path) -> None:
    minimal = {"components": [{"name": "dialog0", "events": [{"type": "GenieDialog_query", "duration": 5_000_000}]}]}
    s = profile.summarize(profile.parse(json.dumps(minimal)))
    assert s.queries == 1 and s.query_s == 5.0 and s.ttft_s is None and s.init_s is None
    for bad, words in (("[]", "no 'components'"), ("{", "not JSON"),
                       (json.dumps({"components": [{"events": [{"duration": 1}]}]}), "has no type")):
        with pytest.raises(UserError) as e:
            profile.parse(bad, "p.json")
        assert words in e.value.problem
    res = npustudio("profile", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "No Genie profile at" in res.stderr


def test_a_model_split_into_parts_answers_in_genie_like_the_whole(project: Project, tmp_path: Path) -> None:
    from npustudio.core import compile as compile_stage

    out, bundle = tmp_path / "c", tmp_path / "b"
    out.mkdir()
    bundle.mkdir()
    r = compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"),
                          CompileOptions(parts=2, verify_tokens=64), out, State())
    assert r.parts == 2 and r.nodes_on_cpu == 0
    assert [g.graph for g in r.graphs] == ["prompt_ar32_cl128_1_of_2", "token_ar1_cl128_1_of_2",
                                           "prompt_ar32_cl128_2_of_2", "token_ar1_cl128_2_of_2"]
    assert r.io["residual_0"].dtype == "float32"  # the residual stream passes between the parts as it is
    v = r.verification
    # the parts chained on the simulator
    assert v.nll_diff is not None and abs(v.nll_diff) < 0.01 and (v.top1_agreement or 0) >= 0.95
    for g in r.graphs:  # Genie orders the parts by the QNN graph name inside each binary
        assert (out / g.context_bin).read_bytes().count(g.graph[:-len("_1_of_2")].encode()) == 3
    bundle_stage.run(out, project.stage_dir("adapt"), bundle_stage.BundleOptions(), bundle, State())
    cfg = json.loads((bundle / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == [f"{g.graph}.bin" for g in r.graphs]
    whole = host.run(project.stage_dir("bundle") / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=8)
    split = host.run(bundle / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=8)
    assert split.runner.startswith("genie") and split.text == whole.text

    # without the prompt graphs (how a model over one protection domain loads on the simulator): half the
    # contexts, the prompt read token by token, and Genie still answers as the CPU preview of the same graphs
    tokens_only = tmp_path / "t"
    tokens_only.mkdir()
    res = bundle_stage.run(out, project.stage_dir("adapt"), bundle_stage.BundleOptions(prompt_graphs=False),
                           tokens_only, State())
    cfg = json.loads((tokens_only / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == ["token_ar1_cl128_1_of_2.bin",
                                                                      "token_ar1_cl128_2_of_2.bin"]
    assert [g.ar for g in read_metadata(tokens_only).graphs] == [1]
    assert res.context_bytes == r.graphs[1].bin_bytes + r.graphs[3].bin_bytes and "one token at a time" in res.notes[0]
    genie = host.run(tokens_only / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=8)
    preview = host.run(tokens_only / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=8, preview=True)
    assert genie.runner.startswith("genie") and genie.text and genie.text == preview.text

    # for a phone: one binary per part holding both graphs, their weights stored once
    shared_out, shared_bundle = tmp_path / "sc", tmp_path / "sb"
    shared_out.mkdir()
    shared_bundle.mkdir()
    s = compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"),
                          CompileOptions(parts=2, weight_sharing=True, verify_tokens=8), shared_out, State())
    assert s.weight_shared and "not run" in (s.verification.simulator or "")
    for i in (0, 2):
        prompt, token = s.graphs[i], s.graphs[i + 1]
        assert prompt.context_bin == token.context_bin and prompt.bin_bytes == token.bin_bytes
        assert prompt.bin_bytes < r.graphs[i].bin_bytes + r.graphs[i + 1].bin_bytes
        data = (shared_out / prompt.context_bin).read_bytes()
        assert all(g.graph.split("_cl128")[0].encode() in data for g in (prompt, token))  # both graphs, renamed
    bundle_stage.run(shared_out, project.stage_dir("adapt"), bundle_stage.BundleOptions(), shared_bundle, State())
    cfg = json.loads((shared_bundle / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == ["shared_1_of_2.bin", "shared_2_of_2.bin"]
    assert json.loads((shared_bundle / layout.HTP_EXT_CONFIG).read_text())["context"]["weight_sharing_enabled"]
    with pytest.raises(UserError, match="weight-shared, for a phone"):  # not a segfault in Genie
        host.run(shared_bundle / layout.GENIE_CONFIG, PROMPT, lambda _s: None, max_tokens=2)
    with pytest.raises(UserError, match="cannot be left out"):
        bundle_stage.run(shared_out, project.stage_dir("adapt"), bundle_stage.BundleOptions(prompt_graphs=False),
                         tmp_path / "t", State())


def test_parts_are_planned_under_the_htp_limit() -> None:
    from npustudio.core import parts

    m = parts.PartModel(first=5, layers=[3, 3, 3, 3], last=4, each=1)  # 22 in all
    ranges = parts.plan(m, 10)
    assert [list(r) for r in ranges] == [[0], [1, 2], [3]] and max(m.estimate(r) for r in ranges) <= 10
    assert [list(r) for r in parts.plan(m, 100)] == [[0, 1, 2, 3]]
    assert [list(r) for r in parts.plan(m, 100, parts=2)] == [[0, 1], [2, 3]]  # forced: as even as can be
    with pytest.raises(UserError, match="one decoder layer per part"):
        parts.plan(m, 8)
    with pytest.raises(UserError, match="only 4 layers"):
        parts.plan(m, 100, parts=5)


def test_info_counts_the_parts_compile_cuts_and_a_refused_cut_is_redone(project: Project, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from npustudio.core import compile as compile_stage
    from npustudio.core import model_fit
    from npustudio.core.graph import ort_qnn

    for d in ("a", "b", "b2", "c"):
        (tmp_path / d).mkdir()
    card = done(project, stages.MODEL).result.card
    limit = 0.5  # MiB: the tiny model's graph is about 0.7
    fit = model_fit.fit_table(card, 128, ar=32, max_part_mb=limit)[0]
    r = compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"),
                          CompileOptions(max_part_mb=limit, verify_tokens=0), tmp_path / "a", State())
    assert fit.parts == r.parts == 2 and not r.recut
    assert all(g.estimated_alloc_kb is not None and 0 < g.estimated_alloc_kb <= limit * 1024 for g in r.graphs)
    # QNN's own estimate says no to a cut: one more part, and the record says why; whether the graphs compile one
    # after the other in this process (a large model) or side by side, each in a process of its own (a small one)
    from npustudio.core.graph import compile_process

    refused: list[str] = []
    too_large = "QNN estimates 2347229 KB for it, over the HTP's limit"
    real, real_result = ort_qnn.compile_graph, compile_process.Running.result

    def refuse_whole(src: Path, graph: str, *a: object, **kw: object) -> results.Compiled:
        if graph == "prompt_ar32_cl128_1_of_1":  # the whole model's prompt graph: the largest activations
            refused.append(graph)
            raise ort_qnn.GraphTooLarge(graph, too_large)
        return real(src, graph, *a, **kw)  # type: ignore[arg-type]

    def refused_in_its_process(self: compile_process.Running, state: State) -> results.Compiled:
        c = real_result(self, state)
        if self.graph == "prompt_ar32_cl128_1_of_1":
            refused.append(self.graph)
            raise ort_qnn.GraphTooLarge(self.graph, too_large)
        return c

    monkeypatch.setattr(ort_qnn, "compile_graph", refuse_whole)
    monkeypatch.setattr(compile_process.Running, "result", refused_in_its_process)
    for folder, side_by_side_below in (("b", 0), ("b2", 2**62)):
        monkeypatch.setattr(compile_stage, "SIDE_BY_SIDE_BYTES", side_by_side_below)
        refused.clear()
        again = compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"),
                                  CompileOptions(verify_tokens=0), tmp_path / folder, State())
        assert refused == ["prompt_ar32_cl128_1_of_1"] and again.parts == 2
        assert "2347229 KB" in again.recut[0] and "cut into 2 parts" in again.recut[0]
        assert sorted(f.name for f in (tmp_path / folder).glob("*_1_of_1*")) == []  # the refused cut is gone
    with pytest.raises(UserError, match="only 2 layers"):
        compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"),
                          CompileOptions(parts=3, verify_tokens=0), tmp_path / "c", State())
    with pytest.raises(UserError, match="ort-qnn back-end only"):
        compile_stage.run(project.stage_dir("quantize"), project.stage_dir("adapt"),
                          CompileOptions(backend="qairt", parts=2), tmp_path, State())
    from npustudio.core.compile import split

    ctx = project.stage_dir("compile") / "prompt_ar32_cl128_1_of_1.onnx"  # a compiled one-part graph
    with pytest.raises(UserError, match="longer than onnxruntime-qnn's"):
        split.name_graph(ctx, "prompt_ar32_cl128_" + "x" * 80 + "_1_of_2")
    (tmp_path / "x.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(UserError, match=r"x\.onnx is not a readable ONNX file"):
        split.name_graph(tmp_path / "x.onnx", "prompt_ar32_cl128_1_of_2")


def test_compile_refuses_a_project_without_quantized_graphs(tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        pipeline.compile_graphs(Project.open(tmp_path / "empty"), CompileOptions(), State())
    assert "no intact quantized model" in e.value.problem and "npustudio quantize" in e.value.fix


def test_a_large_models_verification_opens_one_part_at_a_time(project: Project,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Past KEEP_SESSIONS_BYTES the sessions are opened per call and closed after it, and the graphs run one after
    the other in this process: the same figures as with every session kept open and the token graph's steps in a
    process beside (compared in one process: other tests recompile this project with other options)."""
    from npustudio.core import compile as compile_stage
    from npustudio.core.graph import ort_qnn
    from npustudio.core.results import IOEncoding
    from npustudio.core.targets import Soc, find_soc

    c = project.stage_dir("compile")
    comp = json.loads((c / "compile.json").read_text())
    io = {k: IOEncoding(**v) for k, v in comp["io"].items()}
    opened: list[str] = []
    real = ort_qnn.context_session

    def context_session(p: Path, t: Soc) -> Any:
        opened.append(p.name)
        return real(p, t)

    monkeypatch.setattr(ort_qnn, "context_session", context_session)

    def verify() -> dict[str, Any]:
        opened.clear()
        return compile_stage.verify_on_simulator(
            project.stage_dir("quantize"), project.stage_dir("adapt"), c / "prepared", c,
            [g["graph"] for g in comp["graphs"]], io, find_soc("SM8750"), CompileOptions(verify_tokens=64), State())

    monkeypatch.setattr(compile_stage, "KEEP_SESSIONS_BYTES", 2**62)
    kept = verify()
    # one session for the prompt graph, open for the whole run; the token graph's steps ran in a process of
    # their own beside it, from the quantsim's prompt cache, as the in-process path below runs them
    assert opened == ["prompt_ar32_cl128_1_of_1.onnx"]
    monkeypatch.setattr(compile_stage, "KEEP_SESSIONS_BYTES", 0)
    v = verify()
    assert (v["nll_htp"], v["nll_quantsim_cpu"], v["top1_agreement"], v["kv_cache_max_diff_steps"]) == (
        kept["nll_htp"], kept["nll_quantsim_cpu"], kept["top1_agreement"], kept["kv_cache_max_diff_steps"])
    chunks = -(-(v["tokens"] - v["decode_steps"]) // v["prefill_ar"])
    assert len(opened) == chunks + v["decode_steps"]  # a session per call: each prefill chunk, then each AR-1 step


def test_a_base_model_without_a_chat_template_gets_a_bundle_asking_the_plain_question(project: Project,
                                                                                      tmp_path: Path) -> None:
    """Base releases (Llama-3.2-1B's, for one) have no chat template: the bundle asks the question as text."""
    import shutil

    adapt = tmp_path / "adapt"
    shutil.copytree(project.stage_dir("adapt"), adapt)
    (adapt / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((adapt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (adapt / "tokenizer_config.json").write_text(json.dumps(config))
    card = json.loads((adapt / layout.CARD).read_text())
    (adapt / layout.CARD).write_text(json.dumps(card | {"chat_template": None}))  # as intake reads a base model
    out = tmp_path / "bundle"
    out.mkdir()
    res = bundle_stage.run(project.stage_dir("compile"), adapt, bundle_stage.BundleOptions(question="Paris is"),
                           out, State())
    assert res.validated
    assert (out / layout.SAMPLE_PROMPT).read_text() == "Paris is"
    assert genie_config.as_chat_prompt(out, "Paris is") == "Paris is"


def test_contexts_over_one_protection_domain_are_explained() -> None:
    """Genie's 'Failed to find available PD' (a 1B model's four w8a16 contexts, 3.6 GB) says what to change."""
    fix = libgenie._fix(-1, [" <E> Failed to find available PD for contextId 4 on deviceId 0 coreId 0with "
                             "context size estimate 910172672"])
    assert "--weight-sharing" in fix and "protection domain" in fix and "--token-graphs-only" in fix


def test_a_bundle_over_one_protection_domain_says_so_before_it_is_run(project: Project, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle_stage, "PD_BUDGET_BYTES", 1024)  # the tiny model's contexts stand in for a 1B's
    res = bundle_stage.run(project.stage_dir("compile"), project.stage_dir("adapt"), bundle_stage.BundleOptions(),
                           tmp_path, State())
    assert any("protection domain" in n and "--token-graphs-only" in n and "--weight-sharing" in n
               for n in res.notes)


def test_a_compile_in_its_own_process_brings_back_qnns_refusal_as_the_user_error(tmp_path: Path) -> None:
    """Graphs compile side by side in processes of their own: what goes wrong there reaches the user as it would
    in this process (the problem and its fix), and no file of the child's is left behind."""
    from npustudio.core.graph import compile_process
    from npustudio.core.targets import find_soc

    (tmp_path / "g.onnx").write_bytes(b"not an onnx graph")
    before = set(Path(tempfile.gettempdir()).glob("npustudio-*"))
    run = compile_process.Running(tmp_path / "g.onnx", "g", tmp_path, find_soc("SM8750"), "quick")
    with pytest.raises(UserError, match="QNN could not compile g") as e:
        run.result(State())
    assert "this version's quantize stage" in e.value.fix
    assert set(Path(tempfile.gettempdir()).glob("npustudio-*")) == before


def test_the_main_job_plans_precision_and_bundle_form_from_the_recorded_fit(project: Project,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`npustudio run` without --precision: the best quality whose bundle loads where the job deploys; with a
    protection domain the tiny model's contexts outgrow (standing in for a 1B on the simulator), w4a16 and, where
    even that is too large with the prompt graphs, the token graphs only; a precision the user gave is kept."""
    from npustudio.core import parts
    from npustudio.core.quantize import QuantizeOptions

    plan, q, c, b = pipeline.job_plan(project, QuantizeOptions(), CompileOptions(optimize="quick"))
    assert (plan.precision, q.precision, c.weight_sharing, b.prompt_graphs) == ("w8a16", "w8a16", False, True)
    fit = {f.precision: f for f in done(project, stages.MODEL).result.fit}
    between = (fit["w4a16"].context_bytes_simulator + fit["w8a16"].context_bytes_simulator) // 2
    monkeypatch.setattr(parts, "PD_BUDGET_BYTES", between)
    plan, q, c, b = pipeline.job_plan(project, QuantizeOptions(), CompileOptions(optimize="quick"))
    assert (plan.precision, b.prompt_graphs) == ("w4a16", True) and "protection domain" in plan.why
    monkeypatch.setattr(parts, "PD_BUDGET_BYTES", fit["w4a16"].context_bytes_phone + 1)
    plan, q, c, b = pipeline.job_plan(project, QuantizeOptions(precision="w8a16"), CompileOptions(optimize="quick"))
    assert (q.precision, b.prompt_graphs) == ("w8a16", False) and "one token at a time" in plan.why
    plan, q, c, b = pipeline.job_plan(project, QuantizeOptions(), CompileOptions(optimize="phone"))
    assert c.weight_sharing and b.prompt_graphs  # a phone loads weight-shared contexts, prompt graphs kept
    # from the command line too: `run` without --weight-sharing leaves it to the plan (the flag's default False
    # used to be taken as the user's word, so a phone job never got its shared weights)
    from npustudio.cli.args import compile_options
    from npustudio.cli.main import build_parser

    given = {flags: compile_options(build_parser().parse_args(["run", *flags]))
             for flags in ((), ("--no-weight-sharing",), ("--weight-sharing",))}
    assert pipeline.job_plan(project, QuantizeOptions(), given[()].model_copy(update={"optimize": "phone"})
                             )[2].weight_sharing
    assert not pipeline.job_plan(project, QuantizeOptions(), given[("--no-weight-sharing",)].model_copy(
        update={"optimize": "phone"}))[2].weight_sharing
    assert given[("--weight-sharing",)].weight_sharing
