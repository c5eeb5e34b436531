"""The real default model (SmolLM2-135M-Instruct): the numbers the issue promises, end to end via the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from npustudio.cli import main

pytestmark = pytest.mark.real


def test_info_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "default", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    shape = (d["layers"], d["heads"], d["kv_heads"], d["head_dim"], d["hidden"], d["vocab"])
    assert shape == (30, 9, 3, 64, 576, 49152)
    assert d["architecture"] == "LlamaForCausalLM" and d["tied_embeddings"] and d["params"] == 134_515_008
    assert (d["bos_id"], d["eos_ids"], d["rope_theta"]) == (1, [2], 100000.0)
    assert "<|im_start|>" in d["chat_template"]
    w8 = d["fit"][0]
    assert w8["precision"] == "w8a16" and w8["kv_cache_bytes"] == 2 * 30 * 3 * 64 * 1024 and w8["parts"] == 1


RUN = ["--json", "--no-ask", "--verify-tokens", "0"]  # the simulator check and Genie's answer: the last test


def test_run_default_adapts_quantizes_exports_and_compiles(default_project: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    proj = default_project  # the GUI test may have run every stage here already, with the same options
    assert main(["run", "--project", str(proj), *RUN]) == 0
    s = json.loads(capsys.readouterr().out)
    eq = s["adapt"]
    assert eq["top1_agreement"] >= 0.999 and eq["max_abs_logit_diff"] <= 1e-3
    assert eq["positions"] == 1862 and eq["decode_steps"] == 4 * 16
    assert eq["ppl_fp"] == pytest.approx(14.659, abs=0.01)  # the reference measurement on this slice
    assert eq["graphs"] == ["prompt_ar128_cl1024_1_of_1", "token_ar1_cl1024_1_of_1"]
    rec = json.loads((proj / "npustudio.json").read_text())["stages"]["adapt"]
    names = [t["name"] for t in rec["result"]["graphs"][1]["inputs"]]
    assert names[:6] == ["input_ids", "attention_mask", "position_ids_cos", "position_ids_sin",
                         "past_key_0_in", "past_value_0_in"]
    assert names[-1] == "past_value_29_in"

    q = s["quantize"]  # w8a16 on the HTP v79 config: the target is a PPL ratio <= 1.01
    assert q["precision"] == "w8a16" and q["ppl_fp"] == pytest.approx(14.659, abs=0.01)
    assert q["ratio"] <= 1.01 and q["top1_agreement"] > 0.9
    files = {f["file"]: f["bytes"] for f in q["files"]}
    enc = proj / "stages" / "quantize" / "prompt_ar128_cl1024_1_of_1.encodings"
    assert files["prompt_ar128_cl1024_1_of_1.encodings"] == enc.stat().st_size
    assert files["weights.bin"] < 1.0e9  # weights stored once for both graphs and both ONNX forms

    assert main(["encodings", str(enc), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    weights = [r for r in rows if r["kind"] == "param" and r["role"] in ("q", "k", "v", "o", "gate", "up", "down")]
    assert len(weights) == 30 * (9 + 3 + 3 + 4) and {r["bitwidth"] for r in weights} == {8}
    assert {r["bitwidth"] for r in rows if r["role"] == "kv-cache"} == {8}
    assert {r["bitwidth"] for r in rows if r["kind"] == "activation" and r["role"] != "kv-cache"} == {16}

    c = s["compile"]  # every node of both graphs on the HTP, one binary per graph for the v79 target
    assert c["nodes_on_cpu"] == 0 and (c["dsp_arch"], c["soc_model"]) == ("v79", 69)
    assert c["optimize"] == "quick"  # no phone to deploy to: graphs finalized for the simulator check
    assert [b["graph"] for b in c["binaries"]] == eq["graphs"]
    assert all(1e8 < b["bytes"] < 3e8 and b["nodes_on_qnn"] > 10_000 for b in c["binaries"])
    assert s["bundle"]["validated"] and s["sample"] is None

    # unchanged inputs: the second run is a skip, not a recompute
    assert main(["run", "--project", str(proj), *RUN]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["stages"] == s["stages"] and again["quantize"]["ratio"] == q["ratio"]


def test_default_model_on_the_simulator_matches_the_quantsim_and_genie_answers_paris(default_project: Path) -> None:
    """The issue's must-show through the real libGenie on the HTP simulator (~4 min: ~60 s per AR-128 call)."""
    from npustudio.core import compile as compile_stage
    from npustudio.core.progress import State
    from npustudio.core.results import IOEncoding
    from npustudio.core.targets import find_soc

    stages = default_project / "stages"
    cfg = stages / "bundle" / "genie_config.json"
    if not cfg.is_file():  # run alone
        assert main(["run", "--project", str(default_project), *RUN]) == 0
    comp = json.loads((stages / "compile" / "compile.json").read_text())
    io = {k: IOEncoding(**v) for k, v in comp["io"].items()}
    v = compile_stage.verify_on_simulator(stages / "quantize", stages / "adapt", stages / "compile" / "prepared",
                                          stages / "compile", [g["graph"] for g in comp["graphs"]], io,
                                          find_soc(comp["target"]), compile_stage.CompileOptions(), State())
    # NLL within 0.02 of the quantsim (0.009 with oneDNN convs, 0.011 with plain ones, 0.0125 once in CI). Top-1
    # over 132 tokens moves in steps of 0.0076 (one near tie flipped by the simulator's fp16) and measured
    # 0.947-0.970 as the RoPE tables' rounding followed Genie's (floor) and their encoding its range, then 0.939 in
    # one CI run of unchanged code: 9 flips of 132 are allowed, a wrong position or scale flips most of them
    assert v["tokens"] == 132 and abs(v["nll_diff"]) <= 0.02 and v["top1_agreement"] >= 0.93
    assert v["kv_cache_max_diff_steps"] <= 16  # of 255 (measured 9: the simulator computes in fp16)

    prof = default_project / "p.json"
    cli = [sys.executable, "-m", "npustudio.cli"]
    res = subprocess.run([*cli, "genie-run", "-c", str(cfg), "-p", "What is the capital of France?", "--profile",
                          str(prof), "--max-tokens", "8"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    answer = res.stdout.split("[BEGIN]: ", 1)[1]
    assert "Paris" in answer and answer.rstrip().endswith("[END]")
    s = json.loads(subprocess.run([*cli, "profile", str(prof), "--json"], capture_output=True, text=True).stdout)
    assert s["summary"]["runner"] == "genie" and s["summary"]["generated_tokens"] >= 6 and s["summary"]["ttft_s"] > 0


def test_stop_while_genie_reads_a_long_prompt_ends_it_at_once(default_project: Path) -> None:
    """Window III: Stop while this computer's Genie read a prompt was ignored for minutes (Genie looks at an abort
    only between tokens). The window's runner (`run_apart`) ends the child instead: the turn comes back at once,
    aborted, with nothing made up, and no process is left."""
    import multiprocessing
    import threading
    import time

    from npustudio.core.genie import host

    cfg = default_project / "stages" / "bundle" / "genie_config.json"
    if not cfg.is_file():  # run alone
        assert main(["run", "--project", str(default_project), *RUN]) == 0
    prompt = "Tell me about the long history of Paris, its streets and its river. " * 25  # ~400 tokens: 4 AR-128 calls
    stop, reading = threading.Event(), threading.Event()
    got: list[str] = []
    box: dict[str, host.RunResult] = {}
    turn = threading.Thread(target=lambda: box.update(res=host.run_apart(cfg, prompt, got.append, stop=stop,
                                                                         on_query=reading.set)))
    turn.start()
    assert reading.wait(600)  # loaded: Genie starts on the prompt (~60 s per AR-128 call on the simulator)
    time.sleep(2)
    t0 = time.monotonic()
    stop.set()
    turn.join(timeout=120)
    waited = time.monotonic() - t0
    assert not turn.is_alive() and box["res"].status == "aborted" and got == [] and box["res"].text == ""
    assert waited < 10, f"Stop took {waited:.1f} s"  # the old runner waited for the whole prompt: minutes
    assert not multiprocessing.active_children()
