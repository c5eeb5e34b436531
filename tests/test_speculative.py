"""Draft-model decoding (Genie's `spd` dialog): a second compiled model in the bundle proposes tokens, the target
checks them; with greedy sampling the answer must be the target's own, proven with the real libGenie on the HTP
simulator, and a draft the target cannot use is refused before anything is written."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from npustudio.core import layout, stages
from npustudio.core.errors import UserError
from npustudio.core.genie import draft, host
from npustudio.core.project import Project
from tests.conftest import done, genie_pipeline, make_tiny_model, make_tokenizer, npustudio, raw_record

PROMPTS = ["Hello, tell me a story about the sea.", "def add(a, b):", "List three colours:"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Project, Project]:
    """A tiny target and a draft with its very weights, each compiled on its own, both taking token ids (no
    embedding lookup table: Genie's speculative dialogs refuse it)."""
    root = tmp_path_factory.mktemp("spd")
    model = make_tiny_model(root / "m", "llama64")
    target = genie_pipeline(root / "target", model, embedding_lut=False)
    same = genie_pipeline(root / "draft", model, embedding_lut=False)
    return target, same


def _answers(config: Path, prompts: list[str]) -> list[host.RunResult]:
    return [host.run(config, p, lambda _s: None, max_tokens=20) for p in prompts]


def _basic_beside(bundle: Path) -> Path:
    """The bundle's target engine alone, as a basic dialog on the same binaries (a config beside the real one)."""
    cfg = json.loads((bundle / layout.GENIE_CONFIG).read_text())
    d = cfg["dialog"]
    target = next(e for e in d["engine"] if e["role"] == "target")
    d["type"], d["engine"] = "basic", {k: v for k, v in target.items() if k != "role"}
    del d["spd"]
    path = bundle / "basic_check.json"
    path.write_text(json.dumps(cfg))
    return path


def test_a_draft_model_bundle_answers_as_the_target_alone(pair: tuple[Project, Project]) -> None:
    """`npustudio bundle --draft D --draft-len 3`, as a process: an spd dialog over both models' binaries, validated
    by libGenie, whose greedy answers equal the target's alone on the same binaries for several prompts, with more
    than one token per target call (Genie's own profile)."""
    target, same = pair
    res = npustudio("bundle", "--project", str(target.root), "--draft", str(same.root), "--draft-len", "3", "--json",
                    timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["validated"] and out["decoding"] == "spd" and out["draft_len"] == 3
    assert out["spd_check"]["same_answer"] and out["spd_check"]["tokens_per_target_call"] > 1
    assert out["spd_check"]["prompts"] == 1 + len(draft.CHECK_QUESTIONS)  # not the sample question alone
    bundle = target.stage_dir("bundle")
    cfg = json.loads((bundle / layout.GENIE_CONFIG).read_text())["dialog"]
    assert cfg["type"] == "spd" and cfg["spd"] == {"version": 1, "draft-len": 3}
    assert [e["role"] for e in cfg["engine"]] == ["draft", "target"]
    assert all(b.startswith(layout.DRAFT_PREFIX) and (bundle / b).is_file() for b in cfg["engine"][0]["model"]["binary"]
               ["ctx-bins"])
    meta = json.loads((bundle / layout.METADATA).read_text())
    assert meta["decoding"] == "spd" and meta["draft"]["project"] == "draft" and "/" not in meta["draft"]["project"]
    fast = _answers(bundle / layout.GENIE_CONFIG, PROMPTS)
    try:
        alone = _answers(_basic_beside(bundle), PROMPTS)
    finally:
        (bundle / "basic_check.json").unlink()
    assert [a.text for a in fast] == [a.text for a in alone] and all(a.text for a in alone)
    rates = [draft._acceptance(a.profile) for a in fast]
    assert all(r is not None and r > 1 for r in rates), rates
    again = npustudio("bundle", "--project", str(target.root), "--draft", str(same.root), "--draft-len", "3",
                      timeout=300)
    assert again.returncode == 0 and "tokens per target call" in again.stdout  # what a person reads
    chat = npustudio("chat", "--desktop", "--bundle", str(bundle), "--new", PROMPTS[0], timeout=600)
    assert chat.returncode == 0 and "tokens per target call" in chat.stderr, chat.stderr[-1500:]


def test_ctrl_c_during_the_draft_check_stops_the_bundle_stage_at_once(pair: tuple[Project, Project]) -> None:
    """The bundle's draft check runs eight Genie queries on the simulator; Ctrl-C raised inside Genie's callback was
    lost and the check ran on to its end. Now Ctrl-C aborts the query under way: the command says it stopped, and
    the project keeps its last bundle with no half-written one or check config beside it."""
    import signal
    import subprocess

    from tests.conftest import NPUSTUDIO, wait_until

    target, same = pair
    stages_dir = target.root / layout.STAGES_DIR
    # Ctrl-C as a terminal delivers it: a suite started in the background (`bash .ci/run &`) ignores SIGINT, and
    # its children would inherit that
    proc = subprocess.Popen([NPUSTUDIO, "bundle", "--project", str(target.root), "--draft", str(same.root),
                             "--draft-len", "2", "--force"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until(lambda: any(stages_dir.rglob(".check-*.json")) or proc.poll() is not None, timeout=600)
        assert proc.poll() is None, proc.communicate()[1][-1500:]
        time.sleep(1.0)  # Genie's query under way
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)  # the whole check takes minutes: it was not waited for
    finally:
        proc.kill()
    assert proc.returncode == 130 and "stopped; the project keeps its last finished stages" in err, err[-1500:]
    assert not list(stages_dir.rglob(".check-*.json")) and not layout.scratch_dir(target.root, "bundle").exists()
    rec = raw_record(target, "bundle")
    assert rec.status == "done" and (target.stage_dir("bundle") / layout.GENIE_CONFIG).is_file()


def test_a_draft_the_target_cannot_use_is_refused_naming_why(pair: tuple[Project, Project], genie_project: Project,
                                                             tmp_path: Path) -> None:
    """Refused before anything is written, each naming the difference: the project itself, a draft whose graphs
    take the embedding lookup table, more proposals than the target's widest graph checks, a folder that is no
    project."""
    target, same = pair
    before = (target.stage_dir("bundle") / layout.BUNDLE_RESULT).read_bytes()
    cases = [(str(target.root), "3", "is this project itself"),
             (str(genie_project.root), "3", "take Genie's embedding lookup table"),
             (str(same.root), "32", "needs a graph of AR-33 or wider; its widest is AR-32"),
             (str(tmp_path), "3", "is not an NPU Studio project")]
    for folder, k, said in cases:
        res = npustudio("bundle", "--project", str(target.root), "--draft", folder, "--draft-len", k, timeout=300)
        assert res.returncode == 2 and said in res.stderr, (folder, res.stderr[-1500:])
    assert (target.stage_dir("bundle") / layout.BUNDLE_RESULT).read_bytes() == before  # the last good bundle stays


def test_a_draft_with_another_tokenizer_or_context_is_refused(pair: tuple[Project, Project], tmp_path: Path) -> None:
    """The draft's token ids go straight into the target: another vocabulary, id mapping, special tokens or merges
    is refused naming it, and so is a shorter context."""
    target, same = pair
    t, d = draft.open_model(target.root, "target"), draft.open_model(same.root)
    draft.check_pair(t, d, 3)  # the same model: nothing to refuse

    def with_tokenizer(change: Any) -> draft.Model:
        adapt = tmp_path / f"adapt{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d.adapt_dir, adapt)
        tok = json.loads((adapt / layout.TOKENIZER).read_text())
        change(tok)
        (adapt / layout.TOKENIZER).write_text(json.dumps(tok))
        return dataclasses.replace(d, adapt_dir=adapt)

    def swap_ids(tok: dict[str, Any]) -> None:
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[300:302]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    def other_special(tok: dict[str, Any]) -> None:
        tok["added_tokens"][0]["special"] = False

    def other_merges(tok: dict[str, Any]) -> None:
        tok["model"]["merges"] = tok["model"]["merges"][:-1]

    wider = d.card.model_copy(update={"vocab": d.card.vocab + 64})
    cases = [(dataclasses.replace(d, card=wider), "vocabulary has 448"),
             (dataclasses.replace(d, card=d.card.model_copy(update={"eos_ids": [0]})), "special tokens differ"),
             (with_tokenizer(swap_ids), "maps text to other ids"),
             (with_tokenizer(other_special), "special tokens differ"),
             (with_tokenizer(other_merges), "merges differ"),
             (dataclasses.replace(d, graphs=[g.model_copy(update={"cl": 64}) for g in d.graphs]),
              "context (64 tokens) is shorter than the target's (128)")]
    for model, said in cases:
        with pytest.raises(UserError) as e:
            draft.check_pair(t, model, 3)
        assert said in e.value.problem, (said, e.value.problem)


def test_a_draft_that_changes_the_answer_is_refused(tmp_path: Path) -> None:
    """With the libGenie we ship, on the HTP simulator, a draft with other weights was measured to change the greedy
    answer (it must not): a target with a 2,048-token vocabulary and a one-layer random draft part after 21
    characters of the sample answer, where the target alone ends. The bundle stage compares the two on the sample
    question and refuses such a bundle, quoting both answers; the project keeps its basic bundle."""
    def compiled(name: str, seed: int, layers: int) -> Project:
        model = make_tiny_model(tmp_path / f"m{name}", "llama64", seed=seed, vocab_size=2048, num_hidden_layers=layers)
        make_tokenizer(model, vocab=2048)
        return genie_pipeline(tmp_path / name, model, embedding_lut=False)

    target, other = compiled("target", 0, 2), compiled("draft", 1, 1)
    before = (target.stage_dir("bundle") / layout.GENIE_CONFIG).read_bytes()
    res = npustudio("bundle", "--project", str(target.root), "--draft", str(other.root), "--draft-len", "4",
                    timeout=900)
    assert res.returncode == 2, res.stdout[-1000:]
    assert "draft-model decoding changed the answer" in res.stderr and "the target alone says" in res.stderr
    assert (target.stage_dir("bundle") / layout.GENIE_CONFIG).read_bytes() == before


def test_decoding_modes_that_cannot_be_built_exactly_are_refused_before_any_stage(pair: tuple[Project, Project],
                                                                                   tmp_path: Path) -> None:
    """`--decoding lade|ssd-q1|eaglet` says what each lacks; `spd` without a draft and `basic` with one are
    contradictions; `run` refuses before its first stage (nothing is made) and `bundle` keeps the last good bundle.
    Asking `--decoding spd` with the draft names the same work as leaving it implied: nothing is redone."""
    target, same = pair
    before = (target.stage_dir("bundle") / layout.BUNDLE_RESULT).read_bytes()
    cases = [(["--decoding", "lade"], "Lookahead decoding (`lade`) is not built"),
             (["--decoding", "ssd-q1"], "forecast-token embeddings"),
             (["--decoding", "eaglet"], "draft head trained on the target's hidden states"),
             (["--decoding", "spd"], "needs a draft model"),
             (["--decoding", "basic", "--draft", str(same.root)], "basic decoding, which never calls it")]
    for flags, said in cases:
        res = npustudio("bundle", "--project", str(target.root), *flags, timeout=300)
        assert res.returncode == 2 and said in res.stderr and "fix:" in res.stderr, (flags, res.stderr[-1500:])
        fresh = tmp_path / "fresh"
        res = npustudio("run", "--project", str(fresh), "--no-ask", *flags, timeout=300)
        assert res.returncode == 2 and said in res.stderr, (flags, res.stderr[-1500:])
        assert not (fresh / "stages").exists()
    assert (target.stage_dir("bundle") / layout.BUNDLE_RESULT).read_bytes() == before
    implied = npustudio("bundle", "--project", str(target.root), "--draft", str(same.root), "--json", timeout=600)
    assert implied.returncode == 0, implied.stderr[-1500:]
    rec = done(Project.open(target.root, create=False), stages.BUNDLE).record
    spd = npustudio("bundle", "--project", str(target.root), "--draft", str(same.root), "--decoding", "spd",
                    "--json", timeout=600)
    assert spd.returncode == 0 and json.loads(spd.stdout)["decoding"] == "spd", spd.stderr[-1500:]
    rates = json.loads(spd.stdout)["phone_decode_tok_s"]  # a same-size draft costs more than it saves
    assert set(rates) == {"basic", "spd"} and 0 < rates["spd"] < rates["basic"], rates
    again = done(Project.open(target.root, create=False), stages.BUNDLE).record
    assert (again.key, again.started) == (rec.key, rec.started)


def test_run_with_a_draft_makes_a_draft_model_bundle_that_answers_on_the_virtual_device(
        pair: tuple[Project, Project], tmp_path: Path) -> None:
    """`npustudio run MODEL --draft D` as a user types it: the target is compiled to take token ids (Genie's
    speculative dialogs refuse the lookup table) without being told, the bundle is draft-model decoding, and the
    answer on the virtual device comes from Genie's two-engine dialog, more than one token per target call."""
    _target, same = pair
    model = same.root.parent / "m"
    res = npustudio("run", "--model", str(model), "--project", str(tmp_path / "p"), "--cl", "128", "--ar", "8",
                    "--draft", str(same.root), "--draft-len", "3", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "draft-model decoding, 3 proposals per target call" in res.stdout, res.stdout[-2000:]
    assert "tokens per target call" in res.stdout, res.stdout[-2000:]
    cfg = json.loads((layout.stage_dir(tmp_path / "p", "bundle") / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["type"] == "spd" and cfg["dialog"]["spd"]["draft-len"] == 3


def test_the_compile_page_bundles_with_a_draft_chosen_there(qtbot: Any, pair: tuple[Project, Project],
                                                             tmp_path: Path) -> None:
    """In the window: a draft project chosen on the Compile page turns the lookup table off (Genie's speculative
    dialogs refuse it), Compile and bundle makes a draft-model bundle, the results say how it decodes and the
    phone's rate per mode, and the reopened project shows the draft it was bundled with."""
    from npustudio.gui.app import MainWindow
    from npustudio.gui.widgets import cells

    target, same = pair
    root = tmp_path / "target"
    shutil.copytree(target.root, root)
    w = MainWindow(root, watch_devices=False)
    qtbot.addWidget(w)
    w.show()
    w.go("Compile")
    page = w.compile_page
    page.set_draft(None)  # the shared target may carry an earlier test's draft: start from none
    assert page.draft.text() == "" and not page.draft_len.isEnabled() and page.lut.isEnabled()
    page.set_draft(str(same.root))
    page.draft_len.setValue(3)
    assert not page.lut.isEnabled() and not page.lut.isChecked() and page.draft_len.isEnabled()
    with qtbot.waitSignal(page.strip.finished, timeout=600_000) as blocker:
        page.strip.run.click()
    assert blocker.args == [True], page.strip.status.text()
    rows = dict(cells(page.results))
    expected = "draft model, 3 proposals per target call; greedy answers unchanged on 4 prompts"
    assert rows["Decoding"].startswith(expected), rows
    assert "basic" in rows["Phone decode estimate"] and "spd" in rows["Phone decode estimate"]
    cfg = json.loads((root / "stages" / "bundle" / layout.GENIE_CONFIG).read_text())
    assert cfg["dialog"]["type"] == "spd" and cfg["dialog"]["spd"]["draft-len"] == 3
    w.close()
    again = MainWindow(root, watch_devices=False)
    qtbot.addWidget(again)
    page = again.compile_page
    page.refresh()
    assert Path(page.draft.text()) == same.root.resolve() and page.draft_len.value() == 3
