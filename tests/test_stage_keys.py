"""One key for one piece of work: whichever front end asks for a stage (`npustudio run`, the stage commands, the
window), the same settings give the same stage key, so a stage that is current is skipped, not redone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npustudio.core.progress import State
from npustudio.core.project import Project
from tests.conftest import done

# cheap sizes for a tiny model; the same given settings go to `run` and to each stage command
ADAPT = ["--ar", "32", "--cl", "128", "--eval-tokens", "64", "--decode-tokens", "4"]
QUANTIZE = ["--calib-samples", "2", "--calib-len", "64"]
# `run` compiles for the simulator itself when no phone is attached; `npustudio compile` is for a phone unless told
COMPILE = ["--verify-tokens", "0", "--optimize", "quick"]
STAGES = ("model", "adapt", "quantize", "compile", "bundle")


@pytest.fixture(scope="module")
def ran(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Project]:
    """A tiny model taken through `npustudio run` (no device: it stops at the validated bundle)."""
    from npustudio.cli import main

    model, proj = tiny_models["llama64"], tmp_path_factory.mktemp("keys") / "p"
    assert main(["run", "--model", str(model), "--project", str(proj), "--no-ask", "--json",
                 *ADAPT, *QUANTIZE, *COMPILE]) == 0
    return model, Project.open(proj, create=False)


def _records(p: Project) -> dict[str, tuple[str, str, str]]:
    """Each stage's key, start time and options as recorded: what a skipped stage leaves unchanged."""
    return {n: (r.key, r.started.isoformat(), json.dumps(r.options, sort_keys=True))
            for n, r in p.load().stages.items()}


def test_each_stage_command_after_run_on_the_same_settings_skips_its_stage(
        ran: tuple[Path, Project], capsys: pytest.CaptureFixture[str]) -> None:
    """`npustudio run` recorded the quantize stage's eval corpus as "default" and `npustudio quantize --project P`
    left it unset (the adapt stage's: the same eval), so the second redid quantize (2-5 min on the default model),
    then compile and bundle, for the same work. The window's Compile step (compile, then the default bundle) too."""
    from npustudio.cli import main
    from npustudio.core import pipeline
    from npustudio.core.compile import CompileOptions

    model, p = ran
    after_run = _records(p)
    assert set(after_run) == set(STAGES)
    for argv in (["adapt", str(model), *ADAPT], ["quantize", *QUANTIZE], ["compile", *COMPILE], ["bundle"]):
        assert main([*argv, "--project", str(p.root), "--json"]) == 0, capsys.readouterr().err
        capsys.readouterr()
        redone = [n for n, rec in _records(p).items() if rec != after_run[n]]
        assert redone == [], f"`npustudio {argv[0]}` redid {redone} after `npustudio run` on the same settings"
    pipeline.compile_and_bundle(p, CompileOptions(verify_tokens=0, optimize="quick"), State())
    assert _records(p) == after_run


def test_the_same_work_spelled_differently_has_one_key(ran: tuple[Path, Project]) -> None:
    """Each stage's options resolved to what the stage comes to: a default left unset and the value it comes to
    given are one key (and resolving twice changes nothing); another eval is another key."""
    from npustudio.core import adapt, compile, quantize, stages

    _, p = ran
    card = done(p, stages.MODEL).result.card
    adapt_dir, quant_dir = p.stage_dir("adapt"), p.stage_dir("quantize")

    def one_key(resolve, *spellings):  # type: ignore[no-untyped-def]
        keys = {json.dumps(resolve(o).model_dump(), sort_keys=True) for o in spellings}
        keys |= {json.dumps(resolve(resolve(o)).model_dump(), sort_keys=True) for o in spellings}
        assert len(keys) == 1, keys
        return keys.pop()

    A = adapt.AdaptOptions
    one_key(lambda o: adapt.resolved(o, card), A(ar=32, cl=128), A(ar=32, cl=128, window=128),
            A(ar=32, cl=128, eval_tokens=adapt.auto_eval_tokens(card.params)))
    Q = quantize.QuantizeOptions
    same = one_key(lambda o: quantize.resolved(o, adapt_dir), Q(), Q(eval_corpus="default"), Q(window=512),
                   Q(target="sm8750", eval_tokens=64, decode_tokens=4, window=128))
    assert json.loads(same) == json.loads(same) | {"eval_corpus": "default", "eval_chars": None, "eval_tokens": 64,
                                                    "window": 128, "decode_tokens": 4, "target": "SM8750"}
    assert quantize.resolved(Q(decode_tokens=8), adapt_dir).model_dump() != json.loads(same)
    one_key(lambda o: compile.resolved(o, quant_dir), compile.CompileOptions(),
            compile.CompileOptions(target="SM8750"))
