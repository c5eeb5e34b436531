"""The MNN back-end (`npustudio compile --backend mnn`), run as a user runs it: MNN's own exporter and runtime on
the project's float model, measured against it; refused up front where it would not be exact."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from npustudio.core import layout, pipeline, stages
from npustudio.core.progress import State
from npustudio.core.project import Project
from tests.conftest import make_tiny_model, npustudio


def mnn_json(*args: str, cwd: Path | None = None) -> dict:
    r = npustudio("compile", "--backend", "mnn", *args, "--json", cwd=cwd)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _teacher_forced(model_dir: Path, stage: Path, answer: list[int]) -> tuple[int, float, float]:
    """The float model's greedy answer fed to both models a token at a time (the decode path): the steps where
    MNN's top-1 is the float model's, the float model's largest margin over MNN's pick where it is not, and the
    largest logit difference along the path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from npustudio.core.mnn import prompt_ids
    from npustudio.core.mnn.runtime import MnnModel
    from npustudio.core.stage_options import DEFAULT_QUESTION

    prompt = prompt_ids(AutoTokenizer.from_pretrained(str(stage)), DEFAULT_QUESTION)
    ids = prompt + answer[:-1]
    with torch.inference_mode():
        fp = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()(torch.tensor([ids])).logits[0].float()
    mnn = MnnModel(stage / layout.MNN_MODEL).decode_logits(ids)
    steps = range(len(prompt) - 1, len(ids))
    agree, worst = 0, 0.0
    for i in steps:
        a, b = int(fp[i].argmax()), int(mnn[i].argmax())
        agree += a == b
        worst = max(worst, float(fp[i, a] - fp[i, b]))
    return agree, worst, float((fp[list(steps)] - mnn[list(steps)]).abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_8_bit_mnn_model_follows_the_float_model_token_for_token(family: str, tiny_models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """8-bit weights, one scale per row: MNN's runtime gives the float model's next token almost everywhere (a wrong
    graph, such as a missed q/k norm, would not); the stage is recorded, skipped when asked again, and made stale
    by another model."""
    proj = tmp_path / "p"
    r = mnn_json("--project", str(proj), "--model", str(tiny_models[family]), "--mnn-bits", "8", "--mnn-block", "0",
                 cwd=tmp_path)
    assert not list(tmp_path.glob(".*.log"))  # MNN's converter logs into its working folder: not the user's
    assert (r["bits"], r["block"], r["lm_head_bits"]) == (8, 0, 8)
    assert r["top1_agreement"] >= 0.9, r
    assert r["max_abs_logit_diff"] < 0.5
    assert 0.98 < r["ppl_ratio"] < 1.02
    assert r["answer_mnn"] and r["answer_mnn"][:3] == r["answer_fp"][:3]
    # token for token along the float model's 16-token answer: MNN picks the float model's token, or one the float
    # model itself puts within the logit error measured along the path (a tie a wrong graph would not make)
    agree, worst_margin, max_diff = _teacher_forced(tiny_models[family], proj / layout.STAGES_DIR / "mnn",
                                                    r["answer_fp"])
    assert agree >= 12 and worst_margin <= 2 * max_diff, (agree, worst_margin, max_diff)
    folder = Path(r["folder"])
    assert folder == proj / layout.STAGES_DIR / "mnn" / layout.MNN_MODEL
    assert {"config.json", "llm.mnn", "llm.mnn.weight", "llm_config.json"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "onnx").exists() and not list(folder.parent.glob(".*.log"))
    project = Project.open(proj, create=False)
    assert pipeline.stage_status(project)["mnn"] == "done"
    again = mnn_json("--project", str(proj), "--model", str(tiny_models[family]), "--mnn-bits", "8",
                     "--mnn-block", "0")
    assert again["seconds"] == r["seconds"]  # the same inputs and options: the recorded stage, not a new run
    if family == "llama":  # chatting with it through MNN's runtime, as `npustudio chat --mnn` does
        chat = npustudio("chat", "--mnn", "--bundle", str(folder.parent), "What is the capital of France?",
                         timeout=300)
        assert chat.returncode == 0, chat.stderr[-1500:]
        assert chat.stdout.strip() and "(MNN on this computer (CPU), " in chat.stderr and "tok/s" in chat.stderr
        assert "device supports" not in chat.stdout  # MNN's banner stays off the answer's stream
        history = json.loads((proj / layout.CHAT_HISTORY).read_text())
        assert history["turns"][-1]["runner"] == "MNN on this computer (CPU)"
    other = make_tiny_model(tmp_path / "other", family, seed=1)
    pipeline.intake(project, str(other), 1024, State())
    assert pipeline.stage_status(project)["mnn"] == "stale"
    assert "model" in pipeline.stale_reasons(project)["mnn"]


def test_the_default_model_at_4_bits_answers_as_the_float_model_and_a_bad_export_is_refused(tmp_path: Path) -> None:
    """The real default model: 4-bit HQQ blocks and an 8-bit LM head keep its answer's first sentence; the plain
    min-max blocks, held to the perplexity HQQ reaches, fail the stage with the figures, and the good MNN model
    already made is kept."""
    proj = tmp_path / "p"
    r = mnn_json("--project", str(proj))
    assert (r["bits"], r["block"], r["method"]) == (4, 64, "hqq")  # 128 does not divide SmolLM2-135M's 576
    assert 1.0 < r["ppl_ratio"] < 1.25 and r["top1_agreement"] > 0.7, r
    assert abs(r["fp_ppl"] - 14.659) < 0.01  # the float model's, as the adapt stage measures it
    assert r["answer_text"].startswith("The capital of France is Paris") and r["agreeing_prefix"] >= 6
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    info = npustudio("info", "default", "--json", timeout=300)  # the fit table's MNN column, before any export
    fit = {f["precision"]: f for f in json.loads(info.stdout)["fit"]}
    assert abs(fit["w4a16"]["mnn_bytes"] / r["model_bytes"] - 1) < 0.02, (fit["w4a16"]["mnn_bytes"], r["model_bytes"])
    weights = Path(r["folder"]) / "llm.mnn.weight"
    before = weights.stat().st_size
    # the plain min-max blocks, held to what HQQ's reach: they do not (x1.290 measured), and the stage fails
    bad = npustudio("compile", "--backend", "mnn", "--project", str(proj), "--mnn-method", "plain",
                    "--max-ppl-ratio", "1.25")
    assert bad.returncode == 2
    assert "far off the float model" in bad.stderr and "over the x1.25 allowed" in bad.stderr, bad.stderr[-800:]
    assert "--mnn-bits 8" in bad.stderr
    project = Project.open(proj, create=False)
    rec = project.record(stages.MNN)
    assert rec is not None and rec.options.method == "hqq" and weights.stat().st_size == before


def test_what_the_mnn_back_end_would_not_do_exactly_is_refused_before_any_work(tiny_models: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    tiny = str(tiny_models["llama"])
    cases = [
        (["compile", "--backend", "mnn", "--mnn-block", "48"], "does not divide the model's hidden size (64)",
         "--mnn-block 32"),
        (["compile", "--backend", "mnn", "--parts", "2"], "--parts do not apply to the MNN back-end", ""),
        (["compile", "--mnn-bits", "8"], "--mnn-bits apply to `--backend mnn` only", ""),
        (["compile", "--model", tiny], "--model applies to `--backend mnn` only", ""),
        (["run", "--backend", "mnn", "--model", tiny], "the MNN back-end is its own stage", "compile --backend mnn"),
    ]
    for i, (args, says, fix) in enumerate(cases):
        proj = tmp_path / f"p{i}"
        extra = ["--model", tiny] if args[0] == "compile" and "--model" not in args and "mnn" in args else []
        r = npustudio(*args, *extra, "--project", str(proj), timeout=300)
        assert r.returncode == 2, (args, r.stderr[-800:])
        assert says in r.stderr and fix in r.stderr, (args, r.stderr[-800:])
        assert not (proj / layout.STAGES_DIR / "mnn").exists()
    phi3 = make_tiny_model(tmp_path / "phi3", "phi3", pad_token_id=0, max_position_embeddings=512)
    r = npustudio("compile", "--backend", "mnn", "--model", str(phi3), "--project", str(tmp_path / "phi"),
                  timeout=300)
    assert r.returncode == 2 and "model type 'phi3'" in r.stderr and "--backend ort-qnn" in r.stderr


def test_the_exporter_is_given_no_code_and_no_pickle(tmp_path: Path) -> None:
    """MNN's exporter loads with trust_remote_code=True: the folder it reads holds the model's config, safetensors
    and tokenizer only, and no `auto_map` naming code elsewhere."""
    from npustudio.core.mnn import export

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "x--m.Model"}}))
    (src / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["t.T", None]}}))
    for name in ("model.safetensors", "tokenizer.json", "modeling_x.py", "pytorch_model.bin", "evil.pkl"):
        (src / name).write_bytes(b"x")
    export.link_float_folder(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert json.loads((dst / "config.json").read_text()) == {"model_type": "llama"}
    assert "auto_map" not in json.loads((dst / "tokenizer_config.json").read_text())
    assert (dst / "model.safetensors").resolve() == (src / "model.safetensors").resolve()  # linked, not copied


def _arm64_elf(path: Path, needed: list[str], machine: int = 183) -> Path:
    """A minimal ELF64 file for `machine` (183: AArch64) whose dynamic section names `needed`, as an MNN Android
    build's llm_demo and libraries do (no arm64 build can be made or downloaded here)."""
    dynstr, offsets = b"\0", []
    for lib in needed:
        offsets.append(len(dynstr))
        dynstr += lib.encode() + b"\0"
    dynamic = b"".join(struct.pack("<qQ", 1, o) for o in offsets) + struct.pack("<qQ", 0, 0)  # DT_NEEDED, DT_NULL
    shstr = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    body = bytearray(64)
    places = []
    for blob in (dynstr, dynamic, shstr):
        body += b"\0" * (-len(body) % 8)
        places.append((len(body), len(blob)))
        body += blob
    body += b"\0" * (-len(body) % 8)
    shoff = len(body)
    sections = [(0, 0, 0, 0, 0, 0), (1, 3, *places[0], 0, 0), (9, 6, *places[1], 1, 16), (18, 3, *places[2], 0, 0)]
    for name, kind, off, size, link, entsize in sections:
        body += struct.pack("<IIQQQQIIQQ", name, kind, 0, 0, off, size, link, 0, 1, entsize)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    body[:64] = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, machine, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 4, 3)
    path.write_bytes(bytes(body))
    path.chmod(0o755)
    return path


def test_a_runtime_library_named_outside_the_runtime_folder_is_never_pushed(tmp_path: Path) -> None:
    """llm_demo's DT_NEEDED names a library by a path that leaves MNN_ANDROID_ROOT (or a link in it points out):
    refused naming it, instead of pushing a file of this computer from outside the runtime folder."""
    from npustudio.core.errors import UserError
    from npustudio.core.mnn import android

    secret = tmp_path / "outside_rt" / "libsecret.so"
    secret.parent.mkdir()
    _arm64_elf(secret, ["libc.so"])
    runtime = tmp_path / "rt"
    runtime.mkdir()
    _arm64_elf(runtime / "libMNN.so", ["libc.so"])
    _arm64_elf(runtime / "llm_demo", ["libMNN.so", "../outside_rt/libsecret.so"])
    with pytest.raises(UserError, match=r"names '../outside_rt/libsecret.so' as a library it needs"):
        android.runtime_files(runtime)
    _arm64_elf(runtime / "llm_demo", ["libMNN.so", "libsecret.so"])
    (runtime / "libsecret.so").symlink_to(secret)
    with pytest.raises(UserError, match="not a file of that folder"):
        android.runtime_files(runtime)
    (runtime / "libsecret.so").unlink()
    _arm64_elf(runtime / "libsecret.so", ["libc.so"])
    assert {p.name for p in android.runtime_files(runtime)} == {"llm_demo", "libMNN.so", "libsecret.so"}


def test_the_mnn_model_answers_on_a_device_through_llm_demo(tiny_models: dict[str, Path], adb_server: list[str],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`npustudio deploy P/stages/mnn` then `npustudio chat --mnn --device S "…"`, as processes: a phone is refused
    without MNN's Android runtime, and a runtime missing a library or built for another CPU is refused naming
    what is wrong, before any byte moves; with a whole one, the model and llm_demo with its libraries go to
    `<project>-mnn`, and llm_demo (MNN's runtime on the virtual device) streams the greedy answer the stage
    recorded."""
    from npustudio.core import device
    from npustudio.core.device.virtual import VirtualDevice

    proj = tmp_path / "p"
    r = mnn_json("--project", str(proj), "--model", str(tiny_models["llama"]), "--mnn-bits", "8", "--mnn-block", "0")
    stage = proj / layout.STAGES_DIR / "mnn"
    assert json.loads((stage / layout.MNN_MODEL / "config.json").read_text())["sampler_type"] == "greedy"
    phone = VirtualDevice(tmp_path / "phone", props={"ro.npustudio.virtual": "0"}).start()  # as a phone shows
    try:
        assert "connected" in str(device.client().connect(phone.serial, timeout=15))
        remote = phone.root / "data/local/tmp/npustudio" / "p-mnn"
        monkeypatch.delenv("MNN_ANDROID_ROOT", raising=False)
        no_runtime = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert no_runtime.returncode == 2 and "needs MNN's Android runtime" in no_runtime.stderr
        assert "MNN_ANDROID_ROOT" in no_runtime.stderr and not remote.exists()
        runtime = tmp_path / "build_64"
        runtime.mkdir()
        _arm64_elf(runtime / "llm_demo", ["libllm.so", "libMNN.so", "libc.so", "liblog.so"])
        _arm64_elf(runtime / "libllm.so", ["libMNN.so", "libc++_shared.so"])
        _arm64_elf(runtime / "libMNN.so", ["libc.so", "libm.so"])
        monkeypatch.setenv("MNN_ANDROID_ROOT", str(runtime))
        short = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert short.returncode == 2 and "needs libc++_shared.so, which the folder does not have" in short.stderr
        assert not remote.exists()
        _arm64_elf(runtime / "libc++_shared.so", ["libc.so"])
        (runtime / "libMNN.so").write_bytes(Path("/bin/ls").read_bytes())  # this computer's CPU, not a phone's
        wrong = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert wrong.returncode == 2 and "not a phone's arm64-v8a CPU" in wrong.stderr and not remote.exists()
        monkeypatch.delenv("MNN_ANDROID_ROOT")  # the same folder from Settings > MNN Android runtime: the CLI reads it
        settings_file = Path(os.environ["XDG_CONFIG_HOME"]) / "npustudio" / "settings.json"
        settings_file.parent.mkdir(parents=True, exist_ok=True)
        settings_file.write_text(json.dumps({"mnn_android_root": str(runtime)}))
        wrong = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert wrong.returncode == 2 and "not a phone's arm64-v8a CPU" in wrong.stderr and not remote.exists()
        settings_file.write_text(json.dumps({"mnn_android_root": str(runtime) + "\u0000x"}))
        nul = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert nul.returncode == 2 and str(settings_file) in nul.stderr and "mnn_android_root" in nul.stderr
        assert "NUL byte" in nul.stderr and "unexpectedly" not in nul.stderr
        settings_file.unlink()
        monkeypatch.setenv("MNN_ANDROID_ROOT", str(runtime))
        _arm64_elf(runtime / "libMNN.so", ["libc.so", "libm.so"])
        secret = tmp_path / "secret.txt"
        secret.write_text("not for the phone")
        (stage / layout.MNN_MODEL / "tokenizer.extra").symlink_to(secret)  # only the model's own files move
        linked = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert linked.returncode == 2 and "tokenizer.extra in the MNN model" in linked.stderr
        assert "is a link" in linked.stderr and not remote.exists()
        (stage / layout.MNN_MODEL / "tokenizer.extra").unlink()
        weight = stage / layout.MNN_MODEL / "llm.mnn.weight"  # checked against the stage's record, as a bundle is
        weight.rename(tmp_path / "w")
        missing = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert missing.returncode == 2 and "incomplete: llm.mnn.weight is missing" in missing.stderr
        (tmp_path / "w").rename(weight)
        config = stage / layout.MNN_MODEL / layout.MNN_CONFIG
        original = config.read_bytes()
        edited = json.loads(original) | {"tokenizer_file": "../../../../../../../../etc/passwd"}
        config.write_text(json.dumps(edited))
        changed = npustudio("deploy", str(stage), "--device", phone.serial, timeout=120)
        assert changed.returncode == 2 and "config.json in the MNN model" in changed.stderr
        assert "changed since the stage made it" in changed.stderr and not remote.exists()
        config.write_bytes(original)
        pushed = npustudio("deploy", str(stage), "--device", phone.serial, "--json", timeout=300)
        assert pushed.returncode == 0, pushed.stderr[-1500:]
        sent = {f["file"] for f in json.loads(pushed.stdout)["files"]}
        assert {"llm_demo", "libllm.so", "libMNN.so", "libc++_shared.so", "config.json", "llm.mnn",
                "llm.mnn.weight", "llm_config.json"} <= sent
        assert "export_args.json" not in sent  # the exporter's record holds this computer's paths
        assert json.loads(pushed.stdout)["remote_dir"] == "/data/local/tmp/npustudio/p-mnn"
        question = "What is the capital of France?"
        chat = npustudio("chat", "--mnn", "--device", phone.serial, "--bundle", str(stage), question, timeout=300)
        assert chat.returncode == 0, chat.stderr[-1500:]
        assert f"(MNN llm_demo on device {phone.serial}, " in chat.stderr and "tok/s" in chat.stderr
        assert chat.stdout.strip().startswith(r["answer_text"].strip()), (chat.stdout[:300], r["answer_text"])
        assert "prompt file is" not in chat.stdout and "####" not in chat.stdout  # the answer alone
        two_lines = npustudio("chat", "--mnn", "--device", phone.serial, "--bundle", str(stage),
                              "first line\nsecond line", timeout=120)  # a chat of its own: not refused for history
        assert two_lines.returncode == 2 and "one prompt per line" in two_lines.stderr
        talk = npustudio("chat", "--mnn", "--device", phone.serial, "--bundle", str(stage), input="hello\n",
                         timeout=120)
        assert talk.returncode == 2 and "answers one question on its own" in talk.stderr
    finally:
        device.client().disconnect(phone.serial)
        phone.stop()


def test_llm_demo_output_is_read_as_it_streams_and_its_failures_are_explained() -> None:
    """The phone's llm_demo prints its log, the answer, then its figures between rules of '#': fed a character at a
    time, only the answer reaches the chat (nothing of the rule, even cut in the middle); a phone's linker or
    loader failure is explained with its fix."""
    from npustudio.core.device import remote_mnn

    output = ("config path is config.json\nThe device supports: i8sdot:1, fp16:1\nprompt file is prompt.txt\n"
              "Paris is the capital.\n# not a rule\n\n#################################\nprompt tokens num = 31\n"
              "decode tokens num = 7\nprefill time = 0.10 s\n decode time = 0.50 s\n sample time = 0.00 s\n"
              "prefill speed = 310.00 tok/s\n decode speed = 14.00 tok/s\n##################################\n")
    pieces: list[str] = []
    reader = remote_mnn.Reader(pieces.append)
    for ch in output:
        reader.feed(ch)
    out = reader.close()
    assert out.answer == "Paris is the capital.\n# not a rule" and "".join(pieces).startswith(out.answer)
    assert "#" * 10 not in "".join(pieces)
    assert out.figures is not None and (out.figures.prompt_tokens, out.figures.answer_tokens) == (31, 7)
    assert abs(out.figures.decode_tok_s - 14.0) < 1e-6 and remote_mnn.explain(output) is None
    linker = 'CANNOT LINK EXECUTABLE "./llm_demo": library "libllm.so" not found: needed by main executable\n'
    err = remote_mnn.explain(linker)
    assert err is not None and "library llm_demo needs is missing" in err.problem and "MNN_ANDROID_ROOT" in err.fix
    err = remote_mnn.explain("config path is config.json\nLLM init error\n")
    assert err is not None and "could not load the model" in err.problem
    with pytest.raises(Exception, match="one prompt per line"):
        remote_mnn.check_prompt("a\nb")
