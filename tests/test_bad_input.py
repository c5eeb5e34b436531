"""Bad input, as a user or an attacker would give it: every case ends in a plain message (exit 2 with the
problem named), never a Python traceback, and no file outside the scratch project changes.

Run in-process through `npustudio.cli.main` (fast); the tiny model fixtures stand in for real models.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from npustudio.cli import main
from npustudio.core.errors import UserError
from npustudio.core.project import Project
from npustudio.core.shape import DecoderSpec
from tests.conftest import npustudio, raw_record

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # a template reaching for Python internals


# ----------------------------------------------------------------- helpers
def _flat(text: str) -> str:
    return "".join(text.split())  # rich wraps long lines (and folds long paths) on stderr


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`npustudio ARGS` in-process: (exit code, stdout + stderr)."""
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse refusing an option
        rc = int(e.code or 0)
    c = capsys.readouterr()
    return rc, c.out + c.err


def refused(res: tuple[int, str], *words: str) -> str:
    """Exit 2, the problem named (every word present), no traceback."""
    rc, text = res
    assert rc == 2, text
    assert "Traceback" not in text, text
    for w in words:
        assert _flat(w) in _flat(text), f"{w!r} not in:\n{text}"
    return text


def _state(roots: tuple[Path, ...], allowed: Path | None) -> dict[str, tuple[Any, ...]]:
    seen: dict[str, tuple[Any, ...]] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                p = Path(folder) / name
                if allowed is not None and (p == allowed or allowed in p.parents):
                    continue
                st_ = p.lstat()
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st_.st_mode) else ""
                seen[str(p)] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns, digest)
    return seen


@contextmanager
def nothing_changes(*roots: Path, allowed: Path | None = None) -> Iterator[None]:
    """No file or folder under `roots` (the test's inputs, the user's config/data/log folders, the model)
    is created, changed or removed, except under `allowed` (the scratch project)."""
    home = Path(os.environ["XDG_CONFIG_HOME"]).parent
    everything = (*roots, home)
    before = _state(everything, allowed)
    yield
    assert _state(everything, allowed) == before


@pytest.fixture
def model_copy(tiny_llama: Path, tmp_path: Path) -> Any:
    """A copy of the tiny model with its config.json changed: `model_copy(**changes)` (None removes a key)."""
    def make(name: str = "m", raw: str | None = None, **changes: Any) -> Path:
        d = tmp_path / name
        shutil.copytree(tiny_llama, d)
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            cfg.pop(k) if v is None else cfg.__setitem__(k, v)
        (d / "config.json").write_text(raw if raw is not None else json.dumps(cfg))
        return d

    return make


TINY_SPEC = DecoderSpec(family="Llama", model_type="llama", layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64,
                        intermediate=128, vocab=384, rms_norm_eps=1e-5, tied_embeddings=True, qkv_bias=False,
                        qk_norm=False)


def fake_bundle(folder: Path, tiny_llama: Path, template: str = TEMPLATE) -> Path:
    """A bundle folder with what chat and genie-run read before any runner starts."""
    from npustudio.core.targets import find_soc

    folder.mkdir(parents=True)
    shutil.copy(tiny_llama / "tokenizer.json", folder / "tokenizer.json")
    (folder / "metadata.json").write_text(json.dumps({
        "target": find_soc("SM8750").model_dump(), "context_length": 128, "graphs": [{"name": "prompt", "ar": 32}],
        "decoder": TINY_SPEC.model_dump(), "bos_id": 1, "eos_ids": [2], "chat_template": template,
        "question": "Hi?"}))
    return folder


def adapted_project(root: Path) -> Project:
    """A project whose adapt stage holds a tiny adapted decoder, its graphs' shapes and its card (written directly:
    no equivalence run): what the quantize stage reads of it before its options are checked."""
    import torch

    from npustudio.core import layout
    from npustudio.core.adapt import graph_specs
    from npustudio.core.fsutil import atomic_write_json
    from npustudio.core.graph import store
    from npustudio.core.graph.decoder import StaticDecoder
    from npustudio.core.models import ArchCard
    from npustudio.core.results import AdaptResult, Equivalence

    spec = TINY_SPEC
    card = ArchCard(**spec.model_dump(exclude={"rope_attention_scaling"}), architecture="LlamaForCausalLM",
                    source="tiny", params=100_000, rope_theta=10000.0, rope_scaling=None, max_position=1024, bos_id=1,
                    eos_ids=[2], chat_template=None)

    def write(out: Path) -> dict:
        store.save(StaticDecoder(spec), torch.ones(8), out)
        atomic_write_json(out / layout.GRAPHS, [g.model_dump() for g in graph_specs(spec, 32, 128)])
        atomic_write_json(out / layout.CARD, card.model_dump())
        proof = Equivalence(max_abs_logit_diff=0.0, top1_agreement=1.0, positions=0, windows=0, prefill_ar=32,
                            decode_steps=0)  # a record the adapt stage's model reads (no equivalence ran)
        return AdaptResult(spec=spec, graphs=graph_specs(spec, 32, 128), equivalence=proof, ppl_fp=1.0,
                           ppl_adapted=1.0, eval_tokens=0, per_window=[]).model_dump()

    p = Project.open(root)
    p.run_stage("adapt", {"model": {"spec": "tiny"}}, {}, write)
    return p


# ----------------------------------------------------------------- models at intake
@pytest.mark.parametrize(("changes", "words"), [
    ({"num_hidden_layers": 10**6}, ["num_hidden_layers is 1000000"]),
    ({"hidden_size": 0}, ["hidden_size is 0"]),
    ({"num_hidden_layers": -2}, ["num_hidden_layers is -2"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads (4) is not a multiple of num_key_value_heads (3)"]),
    ({"num_hidden_layers": "two"}, ["num_hidden_layers", "expected int"]),
])
def test_impossible_sizes_are_refused_before_anything_is_built(model_copy: Any, tmp_path: Path, capsys: Any,
                                                               changes: dict[str, Any], words: list[str]) -> None:
    m = model_copy(**changes)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "info", str(m)), *words)


@pytest.mark.parametrize(("changes", "words"), [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, ["rope_parameters.rope_theta is nan"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, ["rope_parameters.rope_theta is 0"]),
    ({"rope_parameters": None, "rope_theta": float("inf")}, ["rope_theta is inf", "finite number above 0"]),
    ({"rms_norm_eps": -1e-6}, ["rms_norm_eps is -1e-06"]),
    ({"num_attention_heads": 0}, ["num_attention_heads is 0"]),  # transformers divided by it: ZeroDivisionError
    ({"eos_token_id": 9999}, ["eos_token_id is 9999", "from 0 to 383"]),
    ({"bos_token_id": -1}, ["bos_token_id is -1"]),
])
def test_impossible_numbers_are_refused_naming_the_field(model_copy: Any, tmp_path: Path, capsys: Any,
                                                         changes: dict[str, Any], words: list[str]) -> None:
    m = model_copy(**changes)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "info", str(m)), "config.json", *words)


def test_the_equivalence_numbers_count_non_finite_logits_as_disagreement() -> None:
    """NaN logits on both sides "agreed" (argmax takes a NaN as the top) with a difference of 0 (max() skips a NaN):
    a NaN model passed adapt's gate with agreement 1.0."""
    import torch

    from npustudio.core.evaluate import Comparison

    ids = list(range(40))  # more rows than the evaluation handles at once
    good = torch.randn(40, 384)
    for bad in (torch.full((40, 384), float("nan")), good.clone().index_fill_(0, torch.tensor([37]), float("inf"))):
        c = Comparison()
        c.add(0, ids, bad if bad.isnan().all() else good, bad, ("fp", "adapted"))
        assert c.max_abs_logit_diff == float("inf")
        assert c.top1_agreement == (0.0 if bad.isnan().all() else 39 / 40)


@pytest.mark.parametrize(("raw", "words"), [
    ('{"model_type": "llama", ', ["config.json is not valid JSON"]),
    ("[]", ["holds a JSON list, not a model configuration"]),
    ("[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    ("{}", ["model type transformers does not know"]),
])
def test_damaged_config_json_is_named(model_copy: Any, tmp_path: Path, capsys: Any, raw: str,
                                      words: list[str]) -> None:
    m = model_copy(raw=raw)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "info", str(m)), *words)


def test_a_model_that_brings_its_own_code_is_refused_without_asking(model_copy: Any, tiny_llama: Path, tmp_path: Path,
                                                                      capsys: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "code_ran"
    m = model_copy(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (m / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    asked: list[str] = []

    def typing_y(prompt: str = "") -> str:  # a user typing y
        asked.append(prompt)
        return "y"

    monkeypatch.setattr("builtins.input", typing_y)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "info", str(m)), "names the model's own Python code", "configuration_evil.EvilConfig")
    assert asked == [] and not marker.exists()
    shutil.copy(tiny_llama / "config.json", m / "config.json")
    tc = json.loads((m / "tokenizer_config.json").read_text())
    (m / "tokenizer_config.json").write_text(json.dumps(tc | {"auto_map": {"AutoTokenizer": ["tok_evil.T", None]}}))
    refused(cli(capsys, "info", str(m)), "tokenizer_config.json names the model's own Python code")
    assert asked == [] and not marker.exists()


def test_transformers_never_gets_to_run_remote_code() -> None:
    """Every transformers loader in the package is called with trust_remote_code=False."""
    import ast

    root = Path(__file__).parent.parent
    calls = []
    for f in [*(root / "npustudio").rglob("*.py"), *(root / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                trusted = next((k.value for k in node.keywords if k.arg == "trust_remote_code"), None)
                calls.append((f.name, node.lineno, isinstance(trusted, ast.Constant) and trusted.value is False))
    assert len(calls) >= 8
    assert [c for c in calls if not c[2]] == []


def test_a_chat_template_the_sandbox_stops_is_refused_at_intake(tiny_llama: Path, tmp_path: Path,
                                                               capsys: Any) -> None:
    m = tmp_path / "evil"
    shutil.copytree(tiny_llama, m)
    (m / "chat_template.jinja").write_text(ESCAPE)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "info", str(m)), "chat template", "stopped by the sandbox", "__class__")


@pytest.mark.parametrize("spec", ["org/..", "org/a--b", "org/-name"])
def test_hub_ids_against_the_hubs_rules(spec: str, capsys: Any) -> None:
    refused(cli(capsys, "info", spec), f"'{spec}' is not a valid hub id")


def test_a_hub_that_never_answers_gives_up_with_a_message(tmp_path: Path, capsys: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fake_hub import SilentHub

    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    with SilentHub() as hub, nothing_changes(tmp_path):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        refused(cli(capsys, "info", "acme/never"), f"The hub at {hub.url} did not answer acme/never within 1 s",
                "HF_HUB_DOWNLOAD_TIMEOUT")


@pytest.mark.parametrize("mode", ["trickle-headers", "trickle-body"])
def test_a_hub_that_trickles_a_byte_at_a_time_gives_up_with_a_message(mode: str, tmp_path: Path, capsys: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The read timeout is per silence: a byte every 0.5 s never trips it; the overall deadline does (6 s per
    request with a 1 s read timeout; huggingface_hub makes a best-effort request of its own first)."""
    import time

    from tests.fake_hub import RawHub

    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    with RawHub(mode, every_s=0.5, limit_s=40) as hub, nothing_changes(tmp_path):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        t0 = time.monotonic()
        res = cli(capsys, "info", "acme/slow")
        took = time.monotonic() - t0
    refused(res, f"The hub at {hub.url} sent acme/slow too slowly", "where a request may take 6 s",
            "HF_HUB_DOWNLOAD_TIMEOUT")
    assert took < 35, took  # the fake hub gives up after 40 s: the old client waited for it


def test_the_hub_deadline_is_a_minimum_rate_for_a_large_file() -> None:
    """A download that keeps above MIN_RATE goes on past the fixed part of the deadline; a trickle stops there."""
    import time

    from npustudio.core import hub

    class Inner:
        def __init__(self, chunk: int) -> None:
            self.chunk = chunk

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            pass

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            time.sleep(0.05)
            return b"x" * self.chunk

    read_s = 0.1  # the fixed part: PER_SILENCE * 0.1 = 0.6 s
    fast = hub._DeadlineStream(Inner(hub.MIN_RATE // 10))  # twice MIN_RATE
    fast.write(b"GET")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        fast.read(hub.MIN_RATE, read_s)
    slow = hub._DeadlineStream(Inner(1))
    slow.write(b"GET")
    t0 = time.monotonic()
    with pytest.raises(hub.TooSlow):
        for _ in range(100):  # 5 s of trickle at most
            slow.read(hub.MIN_RATE, read_s)
    assert 0.5 < time.monotonic() - t0 < 1.5
    slow.write(b"GET")  # the next request on the connection has a deadline of its own
    slow.read(hub.MIN_RATE, read_s)


@pytest.mark.parametrize("endpoint", ["not-a-url", "ftp://mirror.example", "http://", "http://mirror:port"])
def test_an_hf_endpoint_that_is_not_a_url_is_named(endpoint: str, capsys: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    refused(cli(capsys, "info", "acme/tiny"), f"HF_ENDPOINT is set to '{endpoint}', which is not the URL of a hub",
            "http(s)://HOST[:PORT]")


def test_a_hub_that_answers_garbage_or_broken_json_is_named(tiny_llama: Path, tmp_path: Path, capsys: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fake_hub import FakeHub, RawHub

    with RawHub("garbage") as hub, nothing_changes(tmp_path):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        refused(cli(capsys, "info", "acme/tiny"), f"The hub at {hub.url} did not answer acme/tiny as a hub does",
                "RemoteProtocolError", "Check that HF_ENDPOINT is a Hugging Face hub or mirror")
    with FakeHub({"acme/tiny": tiny_llama}, broken=("acme/tiny",)) as hub, nothing_changes(tmp_path):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        refused(cli(capsys, "info", "acme/tiny"), f"The hub at {hub.url} answered acme/tiny with broken JSON",
                "Check that HF_ENDPOINT is a Hugging Face hub or mirror")


def test_the_token_stays_off_plain_http_to_another_machine(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from npustudio.core import hub

    for url, sent, warned in (("https://huggingface.co", True, False), ("http://127.0.0.1:8080", True, True),
                              ("http://10.1.2.3", False, True), ("http://mirror.example", False, True)):
        monkeypatch.setenv("HF_ENDPOINT", url)
        caplog.clear()
        assert (hub.token_for("hf_secret") == "hf_secret") is sent, url
        assert ("plain http" in caplog.text) is warned, url
        assert "hf_secret" not in caplog.text
    monkeypatch.setenv(hub.ALLOW_HTTP_TOKEN, "1")  # the user's explicit choice, still warned
    caplog.clear()
    assert hub.token_for("hf_secret") == "hf_secret" and "unencrypted" in caplog.text


# ----------------------------------------------------------------- options
@pytest.mark.parametrize("args", [
    ["info", "default", "--cl", "-5"], ["info", "default", "--cl", "1e8"], ["info", "default", "--cl", "100000000"],
    ["adapt", "default", "--project", "P", "--ar", "0"],
    ["adapt", "default", "--project", "P", "--decode-tokens", "-1"],
    ["compile", "--project", "P", "--parts", "-1"], ["compile", "--project", "P", "--max-part-mb", "0"],
    ["compile", "--project", "P", "--max-part-mb", "5000"], ["compile", "--project", "P", "--verify-tokens", "x"],
    ["quantize", "--project", "P", "--calib-samples", "0"], ["quantize", "--project", "P", "--calib-len", "1"],
    ["virtual-device", "--port", "70000"], ["virtual-device", "--port", "5555"], ["virtual-device", "--port", "-1"],
    ["genie-run", "-c", "c.json", "-p", "hi", "--max-tokens", "0"], ["profile", "p.json", "--bundle", ""],
    ["deploy", ""], ["adapt", "default", "--project", ""],
])
def test_option_ranges_are_checked_at_the_parser(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch,
                                                 args: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    with nothing_changes(tmp_path):
        text = refused(cli(capsys, *args))
    flag = next((a for a in reversed(args) if a.startswith("-")), None)
    assert "error: argument" in text and (flag is None or flag in text), text


@pytest.mark.parametrize("port", ["abc", "0", "70000"])
def test_a_bad_adb_server_port_in_the_environment(capsys: Any, monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", port)
    refused(cli(capsys, "devices"), f"ANDROID_ADB_SERVER_PORT is '{port}', not a TCP port number")


@given(st.text(max_size=12))
@settings(max_examples=150, deadline=None)
def test_a_number_option_takes_any_text_without_a_traceback(text: str) -> None:
    import argparse

    from npustudio.cli.args import int_in as _int_in

    parse = _int_in(0, 65535, skip=range(5554, 5586))
    try:
        v = parse(text)
    except argparse.ArgumentTypeError as e:
        assert str(e)
    else:
        assert 0 <= v <= 65535 and v not in range(5554, 5586)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8265", "https://head.example:6379", "ray://host:10001/x"])
def test_a_url_given_as_cluster_address_is_named_as_one(capsys: Any, tmp_path: Path, url: str) -> None:
    """http://HOST:PORT passed the HOST:PORT check with "http" as part of the host, and Ray reported a DNS
    failure for it."""
    rc, text = cli(capsys, "adapt", "--project", str(tmp_path / "p"), "--cluster", url)
    assert rc == 2 and "is a URL" in text and "HOST:PORT" in text, text
    assert not (tmp_path / "p").exists()


# ----------------------------------------------------------------- projects
def test_projects_on_unusable_file_systems(tiny_llama: Path, tmp_path: Path, capsys: Any) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    places = [afile / "proj", Path("/proc/npustudio-no-such-fs/proj")]
    if os.geteuid() != 0:  # root writes anywhere: read-only by permissions only binds other users
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        places.append(ro / "proj")
    for place in places:
        with nothing_changes(tmp_path):
            refused(cli(capsys, "adapt", str(tiny_llama), "--project", str(place)), "cannot use the project folder",
                    "mounted and writable")


def test_a_lock_link_leaves_its_target_untouched(tiny_llama: Path, tmp_path: Path, capsys: Any) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    proj = Project.open(tmp_path / "proj")
    (proj.root / ".lock").unlink(missing_ok=True)
    (proj.root / ".lock").symlink_to(victim)
    with nothing_changes(tmp_path, allowed=proj.root):
        refused(cli(capsys, "adapt", str(tiny_llama), "--project", str(proj.root)), ".lock is a symbolic link",
                "Remove the link")
    assert victim.read_text() == "precious"


def test_links_where_settings_and_chat_history_are_written_leave_their_targets_untouched(
        tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from npustudio.core import chat, settings

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    settings.path().parent.mkdir(parents=True, exist_ok=True)
    settings.path().symlink_to(victim)
    settings.save(settings.Settings(default_precision="w4a16"))
    assert "Settings not saved" in caplog.text and "symbolic link" in caplog.text
    bundle = fake_bundle(tmp_path / "b", tiny_llama)
    (bundle / "chat_history.json").symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link"):
        chat.clear_history(bundle)
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("command", ["adapt", "run"])
def test_a_failed_first_command_leaves_no_project_folder(tmp_path: Path, capsys: Any, command: str) -> None:
    new = tmp_path / "new-project"
    args = ["adapt", str(tmp_path / "no-model"), "--project", str(new)] if command == "adapt" else \
        ["run", "--model", str(tmp_path / "no-model"), "--project", str(new), "--no-ask"]
    with nothing_changes(tmp_path):
        refused(cli(capsys, *args), "No model at")
    assert not new.exists()


@pytest.mark.parametrize("command", ["adapt", "run"])
@pytest.mark.parametrize(("options", "words"), [
    (["--ar", "64", "--cl", "32"], ["AR 64 and context length 32 do not fit"]),
    (["--cl", "100000"], ["exceeds what the model was trained for (1024)"]),
])
def test_options_refused_after_the_model_was_read_leave_no_project_folder(
        tiny_llama: Path, tmp_path: Path, capsys: Any, command: str, options: list[str], words: list[str]) -> None:
    """The model stage had finished (it reads the config) when adapt refused the options: the new folder stayed,
    holding only that record. A folder that was empty before is emptied again, and a project with a stage that ran
    is kept."""
    new, empty = tmp_path / "new-project", tmp_path / "empty"
    empty.mkdir()
    for folder in (new, empty):
        args = ["adapt", str(tiny_llama), "--project", str(folder)] if command == "adapt" else \
            ["run", "--model", str(tiny_llama), "--project", str(folder), "--no-ask"]
        with nothing_changes(tmp_path, allowed=empty if folder == empty else None):  # its mtime changes
            refused(cli(capsys, *args, *options), *words)
    assert not new.exists() and list(empty.iterdir()) == []


def test_a_refused_command_keeps_a_project_folder_that_holds_more_than_it_made(tmp_path: Path) -> None:
    """Only what the command made is undone: a file of the user's in the folder, a stage that ran, or another
    process holding the project keep it."""
    from npustudio.core.pipeline import INTAKE

    def made(name: str) -> Project:
        p = Project.open(tmp_path / name)
        p.run_stage(INTAKE, {}, {}, lambda out: {})
        return p

    p = made("mine")
    (p.root / "notes.txt").write_text("mine")
    assert not p.remove_if_unused(existed=False, cheap=(INTAKE,)) and (p.root / "notes.txt").exists()
    p = made("ran")
    with pytest.raises(UserError):
        p.run_stage("adapt", {}, {}, lambda out: (_ for _ in ()).throw(UserError("no")))
    assert not p.remove_if_unused(existed=False, cheap=(INTAKE,)) and p.load().attempts
    p = made("busy")
    p.run_stage("hold", {}, {}, lambda out: {"removed": Project(p.root).remove_if_unused(False, (INTAKE, "hold"))})
    assert raw_record(p, "hold").result == {"removed": False}
    p = made("ours")
    assert p.remove_if_unused(existed=False, cheap=(INTAKE,)) and not p.root.exists()


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_WRONLY | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


def test_a_killed_stages_partial_folder_is_removed_when_the_project_is_next_opened(tmp_path: Path,
                                                                                  capsys: Any) -> None:
    """A killed stage's `.quantize.partial` (gigabytes for a real model) stayed until quantize ran again. Any command
    opening the project removes it, except while another process holds the project: its stage may be writing it."""

    p = Project.open(tmp_path / "proj")
    partial = p.root / "stages/.quantize.partial"
    (partial / "sub").mkdir(parents=True)
    (partial / "sub/weights.bin").write_bytes(b"x" * 1000)
    old = p.root / "stages/.adapt.old"  # a kill between the swap's renames: maybe the only copy, for run_stage
    old.mkdir()
    with subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(p.root)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        refused(cli(capsys, "quantize", "--project", str(p.root)), "npustudio adapt")
        assert (partial / "sub/weights.bin").exists()  # a live process's
        holder.communicate("")
    refused(cli(capsys, "quantize", "--project", str(p.root)), "npustudio adapt")  # any command opening it
    assert not partial.exists() and old.is_dir()


def test_an_edited_output_is_named_and_its_stage_rerun_is_asked_for(tmp_path: Path, capsys: Any) -> None:
    p = adapted_project(tmp_path / "proj")
    w = p.root / "stages/adapt/decoder.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF  # edited in place, same size
    w.write_bytes(bytes(data))
    with nothing_changes(tmp_path, allowed=p.root):
        refused(cli(capsys, "quantize", "--project", str(p.root)), "was changed after the adapt stage wrote it",
                "stages/adapt/decoder.safetensors", f"npustudio adapt tiny --project {p.root}")


# ----------------------------------------------------------------- quantize overrides
def test_an_override_pattern_that_matches_nothing_names_the_closest_modules(tmp_path: Path, capsys: Any) -> None:
    p = adapted_project(tmp_path / "proj")
    ov = tmp_path / "ov.json"
    for table, words in (({"weights": {"layers.*.mlp.gaet": 8}}, ["'layers.*.mlp.gaet' (weights)",
                                                                  "'layers.1.mlp.gate'"]),
                         ({"activations": {"layers.0.mlp.dwn": 16}}, ["(activations)", "'layers.0.mlp.down'"])):
        ov.write_text(json.dumps(table))
        with nothing_changes(tmp_path, allowed=p.root):
            refused(cli(capsys, "quantize", "--project", str(p.root), "--overrides", str(ov)), "matches no module",
                    *words)
    ov.write_text('{"weights":' * 50_000 + "{}" + "}" * 50_000)
    refused(cli(capsys, "quantize", "--project", str(p.root), "--overrides", str(ov)), "nested too deeply")


def test_an_override_file_with_an_unknown_key_names_the_closest_one(tmp_path: Path, capsys: Any) -> None:
    """`weight` for `weights` was dropped without a word: the run went on at the preset's widths."""
    p = adapted_project(tmp_path / "proj")
    ov = tmp_path / "ov.json"
    for table, words in (({"weight": {"layers.0.mlp.down": 8}}, ["unknown key 'weight'", "Did you mean 'weights'"]),
                         ({"weights": {}, "activation": {"layers.0.mlp.down": 16}},
                          ["unknown key 'activation'", "Did you mean 'activations'"]),
                         ({"bits": 8}, ["unknown key 'bits'", "valid keys: weights, activations"])):
        ov.write_text(json.dumps(table))
        with nothing_changes(tmp_path, allowed=p.root):
            refused(cli(capsys, "quantize", "--project", str(p.root), "--overrides", str(ov)), str(ov), *words)


# ----------------------------------------------------------------- encodings files
def _encodings(tmp_path: Path, acts: list[dict[str, Any]], **extra: Any) -> Path:
    f = tmp_path / "m.encodings"
    f.write_text(json.dumps({"version": "1.0.0", "activation_encodings": acts, "param_encodings": []} | extra))
    return f


def _act(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "bw": 16, "is_sym": False, "scale": [0.01], "offset": [-32768], "enc_type": "PER_TENSOR"} | kw


def test_absurd_encodings_values_are_flagged_not_a_crash(tmp_path: Path, capsys: Any) -> None:
    f = _encodings(tmp_path, [_act("huge", bw=10**5), _act("enormous", bw=10**10), _act("neg", bw=-4),
                              _act("nan", scale=[float("nan")]), _act("negscale", scale=[-0.5]),
                              _act("inf", scale=[float("inf")]), _act("off", offset=[1e30]), _act("fine")])
    with nothing_changes(tmp_path):
        rc, text = cli(capsys, "encodings", str(f), "--json")
    assert rc == 0 and "Traceback" not in text
    rows = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))["rows"]
    flags = {r["name"]: r["flags"] for r in rows}
    assert flags.pop("fine") == []
    assert all(flags.values()), flags
    assert "bitwidth 100000" in flags["huge"][0] and "scale" in flags["nan"][0] and "offset" in flags["off"][0]
    rc, text = cli(capsys, "encodings", str(f), "--flagged")
    assert rc == 0 and "enormous" in text and "fine" not in text


@pytest.mark.parametrize(("content", "words"), [
    (None, ["excluded_layers is int 5, not a list"]),
    ('{"a":' * 50_000 + "1" + "}" * 50_000, ["nested too deeply"]),
    ("\xff\xfe garbage", ["not UTF-8"]),
])
def test_malformed_encodings_structure_is_a_message(tmp_path: Path, capsys: Any, content: str | None,
                                                    words: list[str]) -> None:
    f = _encodings(tmp_path, [_act("x")], excluded_layers=5)
    if content is not None:
        f.write_bytes(content.encode("latin-1"))
    with nothing_changes(tmp_path):
        refused(cli(capsys, "encodings", str(f)), *words)


def test_an_encodings_file_larger_than_any_is_refused_unread(tmp_path: Path, capsys: Any) -> None:
    """Parsed whole, a JSON file takes several times its size in memory: past what a model writes, it is refused."""
    huge = tmp_path / "huge.encodings"
    with open(huge, "wb") as f:  # sparse: nothing is written, nothing should be read
        f.truncate(4 * 2**30 + 1)
    refused(cli(capsys, "encodings", str(huge)), "huge.encodings is larger than 4096 MiB", "encodings file")


@given(bw=st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=3)),
       scale=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers()), max_size=3),
       offset=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers()), max_size=3))
@example(bw="1", scale=[1.0], offset=[])  # a bitwidth written as text was read as the number 1
@example(bw=1.0, scale=[1.0], offset=[])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_encoding_values_read_or_refuse_cleanly(tmp_path: Path, bw: Any, scale: list[Any],
                                                    offset: list[Any]) -> None:
    from npustudio.core.graph import encodings

    f = _encodings(tmp_path, [{"name": "t", "bw": bw, "scale": scale, "offset": offset, "enc_type": "PER_CHANNEL"}])
    try:
        row = encodings.read(f).rows[0]
    except UserError:
        return
    whole = isinstance(bw, int) or (isinstance(bw, float) and bw.is_integer())  # 8.0 is the bitwidth 8
    sane = whole and 1 <= bw <= 32 and all(isinstance(s, int | float) and 0 < s < float("inf")
                                                             for s in scale)
    assert bool(row.flags) or sane


# ----------------------------------------------------------------- profiles and bundles
@pytest.mark.parametrize(("content", "words"), [
    (bytes(range(256)) * 3, ["not UTF-8"]),
    (b"Infinity", ["no 'components' list"]),
    (b'{"components": [{"events": [{"type": "GenieDialog_query", "time-to-first-token": {"value": Infinity}}]}]}',
     ["time-to-first-token is inf, not a finite number"]),
    (b'{"components": [{"events": [{"type": "q", "start": NaN}]}]}', ["start is nan"]),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, ["nested too deeply"]),
])
def test_bad_profiles_are_named(tmp_path: Path, capsys: Any, content: bytes, words: list[str]) -> None:
    f = tmp_path / "p.json"
    f.write_bytes(content)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "profile", str(f)), *words)


@given(st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["components", "events", "type", "start", "stop", "duration", "name",
                                         "init-time", "time-to-first-token", "value", "metadata", "runner"]),
                        inner, max_size=4), max_leaves=12))
@settings(max_examples=300, deadline=None)
def test_any_json_is_a_profile_or_a_message(data: Any) -> None:
    from npustudio.core.genie import profile

    try:
        profile.summarize(profile.from_data(data))
    except UserError as e:
        assert e.problem and e.fix


def test_a_profile_roofline_needs_a_whole_bundle(tiny_llama: Path, tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"components": [{"events": [{"type": "GenieDialog_query", "duration": 5}]}]}))
    empty = tmp_path / "empty"
    empty.mkdir()
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "metadata.json").write_text("[]")
    no_bins = fake_bundle(tmp_path / "nobins", tiny_llama)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "profile", str(f), "--bundle", str(empty)), "is not an NPU Studio bundle",
                "has no metadata.json")
        refused(cli(capsys, "profile", str(f), "--bundle", str(listed)), "metadata.json is damaged",
                "holds a JSON list")
        refused(cli(capsys, "profile", str(f), "--bundle", str(no_bins)), "holds no context binary")


def test_deploy_and_chat_say_not_a_bundle_before_looking_for_a_device(tmp_path: Path, capsys: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", "1")  # no adb server there: a device lookup would say so
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8")
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "metadata.json").write_text("[]")
    with nothing_changes(tmp_path):
        refused(cli(capsys, "deploy", str(folder)), "is not an NPU Studio bundle")
        refused(cli(capsys, "deploy", str(listed)), "metadata.json is damaged")
        refused(cli(capsys, "chat", "--bundle", str(listed), "hello"), "metadata.json is damaged")
        refused(cli(capsys, "chat", "--bundle", str(folder / "cat.jpg"), "hello"), "not a bundle folder")


def test_a_failed_device_run_is_a_failure_not_an_empty_answer(tiny_llama: Path, tmp_path: Path, capsys: Any,
                                                              adb_server: list[str]) -> None:
    """The device's genie-t2t-run failing (the virtual device's runner on a config Genie refuses; a phone's that
    stops mid-answer without [END]) is exit 2 with the device's own words, and no turn is saved as an answer."""
    from npustudio.core import device
    from npustudio.core.device.phone_shell import Call
    from npustudio.core.device.virtual import VirtualDevice

    bundle = fake_bundle(tmp_path / "b", tiny_llama)
    (bundle / "genie_config.json").write_text("{}")
    vd = VirtualDevice(tmp_path / "phone").start()

    def fails_mid_answer(call: Call) -> int:
        call.write("[PROMPT]: hello\n\n[BEGIN]: Par")
        call.write("\nGenieDialog_query failed: GENIE_STATUS_ERROR_QUERY_FAILED\nFailed to query\n")
        return 1

    try:
        assert "connected" in str(device.client().connect(vd.serial, timeout=15))
        chat = ("chat", "--bundle", str(bundle), "--device", vd.serial, "hello")
        refused(cli(capsys, *chat), "genie-t2t-run failed on the device", "has no 'dialog' section")
        vd.programs["genie-t2t-run"] = fails_mid_answer
        refused(cli(capsys, *chat), "genie-t2t-run failed on the device", "Failed to query")
    finally:
        device.client().disconnect(vd.serial)
        vd.stop()
    assert not (bundle / "chat_history.json").exists()


# ----------------------------------------------------------------- prompts
def test_prompts_with_nul_or_invalid_utf8_are_refused(tiny_llama: Path, tmp_path: Path, capsys: Any) -> None:
    bundle = fake_bundle(tmp_path / "b", tiny_llama)
    cfg = str(bundle / "genie_config.json")
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"What is\xff\xfe the capital?")
    nul = tmp_path / "nul.txt"
    nul.write_text("What is\x00 the capital?")
    with nothing_changes(tmp_path):
        refused(cli(capsys, "genie-run", "-c", cfg, "-p", "What is\x00 the capital?"), "NUL character at position 7")
        refused(cli(capsys, "genie-run", "-c", cfg, "--prompt_file", str(nul)), "NUL character")
        refused(cli(capsys, "genie-run", "-c", cfg, "--prompt_file", str(binary)), "is not UTF-8 text (byte 7)")
        refused(cli(capsys, "genie-run", "-c", cfg, "-p", "bad \udcff argv"), "not valid UTF-8")  # as argv decodes it
        refused(cli(capsys, "chat", "--bundle", str(bundle), "--preview", "a\x00b"), "NUL character")
        refused(cli(capsys, "chat", "--bundle", str(bundle), "--preview", "--system", "be\x00 nice", "hi"),
                "NUL character")
    p = adapted_project(tmp_path / "proj")
    with nothing_changes(tmp_path, allowed=p.root):
        refused(cli(capsys, "bundle", "--project", str(p.root), "--question", "Why\x00?"), "NUL character")


def test_a_prompt_is_read_at_most_1_mib_deep(tiny_llama: Path, tmp_path: Path, capsys: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt file (or a chat's piped input) larger than any context is refused without being read whole: from
    /dev/zero it would be read until the out-of-memory killer ends the run."""
    bundle = fake_bundle(tmp_path / "b", tiny_llama)
    cfg = str(bundle / "genie_config.json")
    big = tmp_path / "big.txt"
    big.write_text("a" * (2**20 + 1))
    with nothing_changes(tmp_path):
        refused(cli(capsys, "genie-run", "-c", cfg, "--prompt_file", str(big)), "big.txt is larger than 1 MiB",
                "no model's context")
        refused(cli(capsys, "genie-run", "-c", cfg, "--prompt_file", "/dev/zero"), "/dev/zero gave more than 1 MiB",
                "not a plain file")
        monkeypatch.setattr(sys, "stdin", io.StringIO("b" * (2**20 + 1)))  # a pipe with no newline in sight
        refused(cli(capsys, "chat", "--bundle", str(bundle), "--preview"), "longer than 1 MiB")


def test_genie_run_refuses_a_profile_path_that_is_a_folder_before_running(tiny_llama: Path, tmp_path: Path,
                                                                         capsys: Any) -> None:
    bundle = fake_bundle(tmp_path / "b", tiny_llama)
    (tmp_path / "profile.json").mkdir()
    with nothing_changes(tmp_path):
        refused(cli(capsys, "genie-run", "-c", str(bundle / "genie_config.json"), "-p", "hi", "--profile",
                    str(tmp_path / "profile.json")), "--profile", "is a folder")
        refused(cli(capsys, "genie-run", "-c", str(bundle / "genie_config.json"), "-p", "hi", "--profile",
                    str(tmp_path / "nowhere" / "p.json")), "does not exist")


def test_a_chat_template_the_sandbox_stops_is_a_message(tiny_llama: Path, tmp_path: Path, capsys: Any) -> None:
    bundle = fake_bundle(tmp_path / "b", tiny_llama, template=ESCAPE)
    with nothing_changes(tmp_path):
        refused(cli(capsys, "genie-run", "-c", str(bundle / "genie_config.json"), "-p", "hi"),
                "chat template cannot be used: SecurityError", "stopped by the sandbox", "--raw")
        refused(cli(capsys, "chat", "--bundle", str(bundle), "--preview", "hi"), "SecurityError")


@pytest.mark.parametrize(("content", "why"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was an uncaught RecursionError at every chat
    ('{"turns": []' + " " * (16 * 2**20) + "}", "larger than 16 MiB"),  # valid, but parsed whole it grew 60-fold
])
def test_a_chat_history_too_deep_or_too_large_is_set_aside_and_a_new_one_started(tmp_path: Path, content: str,
                                                                                  why: str) -> None:
    from npustudio.core import chat

    f = tmp_path / "chat_history.json"
    f.write_text(content)
    hist = chat.ChatHistory.load(f)
    assert hist.current.turns == [] and not f.exists()
    assert hist.set_aside is not None and hist.set_aside.read_text() == content
    assert why in (hist.notice() or "") and hist.set_aside.name in (hist.notice() or "")
    hist.current.turns.append(chat.Turn(user="New", assistant="A", runner="x"))
    hist.save()
    assert chat.ChatHistory.load(f).current.turns[0].user == "New"  # the next chat works again
    f.write_text(content)  # set aside again in the same second: the first one is kept
    again = chat.ChatHistory.load(f)
    assert again.set_aside is not None and again.set_aside != hist.set_aside and hist.set_aside.exists()


# ----------------------------------------------------------------- the settings file
@pytest.mark.parametrize(("content", "words"), [
    ('{"default_precison": "w4a16"}', ["unknown key 'default_precison'", "Did you mean 'default_precision'?"]),
    ('{"default_precision": "w3a7"}', ["default_precision is 'w3a7'", "use one of: w8a16, w4a16"]),
    ('{"default_target": "SM1234"}', ["default_target is 'SM1234'", "SM8750"]),
    ('{"virtual_preview": "sometimes"}', ["virtual_preview is 'sometimes'"]),
    ('{"recent_projects": ', ["is not valid JSON"]),
    ("[]", ["holds a JSON list"]),
    (" " * (2 * 2**20) + "{}", ["larger than 1 MiB"]),
])
def test_a_settings_file_the_cli_cannot_use_stops_it_naming_the_file_and_key(tmp_path: Path, capsys: Any,
                                                                              content: str, words: list[str]) -> None:
    """It fell back to the defaults without a word: with `default_precison` mistyped, every command ran at w8a16
    though the user had set w4a16, and a precision no preset has failed in quantize, far from its cause."""
    from npustudio.core import settings

    f = settings.path()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(content)
    with nothing_changes(tmp_path):  # the user's config folder included: the file is left for them to correct
        refused(cli(capsys, "encodings", str(tmp_path / "none.encodings")), str(f), *words,
                "Correct it, or delete it: the window writes a new one")


def test_the_settings_accept_the_precisions_the_cli_offers() -> None:
    """The settings check the precisions' declaration (a helper may not import the stage): every preset the stage
    takes is accepted, anything else refused naming them."""
    from pydantic import ValidationError

    from npustudio.core.quantize.presets import PRESETS
    from npustudio.core.settings import Settings

    assert [Settings(default_precision=p).default_precision for p in PRESETS] == list(PRESETS)
    with pytest.raises(ValidationError, match="w8a16, w4a16"):
        Settings(default_precision="w2a16")


# ----------------------------------------------------------------- token and keyring
def test_a_keyring_that_stores_nothing_is_said_to_be_none(tmp_path: Path, capsys: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import keyring
    from keyring.backends import fail, null

    old = keyring.get_keyring()
    try:
        for backend in (null.Keyring(), fail.Keyring()):
            keyring.set_keyring(backend)
            monkeypatch.setattr(sys, "stdin", io.StringIO("hf_abc\n"))
            with nothing_changes(tmp_path):
                refused(cli(capsys, "token", "set"), "no usable system keyring", backend.__class__.__module__)
            rc, text = cli(capsys, "token", "status")
            assert rc == 0 and "No Hugging Face token is set" in text and "No usable system keyring" in text
            text = refused(cli(capsys, "token", "delete"), "no usable system keyring", "nothing was removed")
            assert "Token removed" not in text  # the null keyring's silent "delete" was reported as done
    finally:
        keyring.set_keyring(old)


# ----------------------------------------------------------------- the safety net
def test_an_unexpected_error_is_a_short_message_with_a_log(tiny_llama: Path, tmp_path: Path, capsys: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from npustudio.core import models

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("disk controller on fire")

    monkeypatch.setattr(models, "load", broken)
    proj = tmp_path / "proj"
    rc, text = cli(capsys, "adapt", str(tiny_llama), "--project", str(proj), "--ar", "32", "--cl", "128")
    assert rc == 1 and "Traceback" not in text
    assert _flat("`npustudio adapt` in the adapt stage failed unexpectedly: RuntimeError: disk controller on fire") \
        in _flat(text)
    logs = list((proj / "logs").glob("npustudio-adapt-*.log"))
    assert len(logs) == 1 and _flat(str(logs[0])) in _flat(text)
    log = logs[0].read_text()
    assert "Traceback" in log and "disk controller on fire" in log and "command: npustudio adapt" in log
    rc, text = cli(capsys, "--debug", "adapt", str(tiny_llama), "--project", str(proj), "--ar", "32", "--cl", "128")
    assert rc == 1 and "Traceback" in text and "in broken" in text
    rc, text = cli(capsys, "encodings", str(tmp_path), "--debug")  # a folder: a message, exit 2, not the net
    assert rc == 2 and "No encodings file" in text


def test_a_recipe_the_model_cannot_take_is_refused_before_any_stage_runs(tmp_path: Path) -> None:
    """`npustudio run --recipe spinquant` as a user runs it, on the default model: SpinQuant needs a Hadamard matrix
    of the hidden size and SmolLM2-135M's is 576, which aimet cannot build. Exit 2 with the reason and the choices
    that work, before the adapt stage spends minutes; `npustudio info` lists the recipe as not for this model."""
    res = npustudio("run", "--project", str(tmp_path / "p"), "--recipe", "spinquant_adascale", "--no-ask")
    assert res.returncode == 2, res.stderr
    assert _flat("this model's hidden size is 576") in _flat(res.stderr)
    assert "adascale" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "p" / "stages" / "adapt").exists()
    # an int8 budget widens 4-bit weights: at w8a16 there are none, so it is refused rather than ignored
    res = npustudio("run", "--project", str(tmp_path / "p"), "--precision", "w8a16", "--int8-budget", "0.05",
                    "--no-ask")
    assert res.returncode == 2 and "--precision w4a16" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "p" / "stages" / "adapt").exists()
    # a 4-bit LM head goes in LPBQ blocks, which w8a16 has none of: refused, not made per-channel int4
    res = npustudio("run", "--project", str(tmp_path / "p"), "--precision", "w8a16", "--lm-head-bits", "4",
                    "--no-ask")
    assert res.returncode == 2 and "--lm-head-bits" in res.stderr and "--precision w4a16" in res.stderr, res.stderr
    assert not (tmp_path / "p" / "stages" / "adapt").exists()
    # a recipe's step count for another recipe changes nothing but the record (it redid the stage): refused
    res = npustudio("run", "--project", str(tmp_path / "p"), "--recipe", "plain", "--omniquant-iterations", "5",
                    "--no-ask")
    assert res.returncode == 2 and "--omniquant-iterations sets a step of the omniquant recipe" in res.stderr
    assert "--recipe omniquant" in res.stderr and not (tmp_path / "p" / "stages" / "adapt").exists(), res.stderr
    info = npustudio("info", "default")
    assert info.returncode == 0, info.stderr
    assert "not for this model: spinquant (" in info.stdout
    assert "at w4a16 the int8 budget (--int8-budget, default 5%) measures which weights to keep int8: +~" in info.stdout
    # what the 4-bit head would save and cost, beside the table
    assert _flat("w4a16 with --lm-head-bits 4 (the LM head in 4-bit blocks too): bundle") in _flat(info.stdout)
    assert _flat("perplexity ×1.421 against ×1.213") in _flat(info.stdout)


def test_a_fix_that_names_a_log_option_names_a_command_that_has_it() -> None:
    """Reliability IV: a failing runner's fix said "Run with `--log verbose`", which `chat` does not accept; the fix
    now gives the whole command, and that command takes the option."""
    from npustudio.core.genie import libgenie
    from tests.conftest import npustudio

    fix = libgenie._fix(-1, ["something Genie said"])
    assert "`npustudio genie-run -c BUNDLE/genie_config.json -p hi --log verbose`" in fix
    assert "--log {error,warn,info,verbose}" in npustudio("genie-run", "--help").stdout
    assert "--log" not in npustudio("chat", "--help").stdout  # why the fix cannot say "chat --log"


def test_a_tokenizer_that_panics_the_rust_library_is_refused_with_a_message(
        capsys: pytest.CaptureFixture[str], tiny_llama: Path, tmp_path: Path) -> None:
    """A tokenizer.json whose continuing_subword_prefix is longer than its merged tokens makes the `tokenizers`
    library panic; pyo3 raises that as a BaseException, past an `except Exception` (found by the fuzz suite). `info`
    refuses it as a damaged tokenizer, with exit 2 and no traceback."""
    m = tmp_path / "m"
    shutil.copytree(tiny_llama, m)
    tok = json.loads((m / "tokenizer.json").read_text())
    tok["model"]["continuing_subword_prefix"] = "x" * 16
    (m / "tokenizer.json").write_text(json.dumps(tok))
    refused(cli(capsys, "info", str(m)), "The tokenizer in", "cannot be loaded (PanicException",
            "Copy tokenizer.json")
