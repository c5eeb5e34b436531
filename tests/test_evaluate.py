"""Perplexity and agreement numbers, corpora, and live per-window points."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from npustudio.core import evaluate
from npustudio.core.errors import UserError
from npustudio.core.progress import Partial, State


def test_uniform_model_has_perplexity_equal_to_its_vocab() -> None:
    res = evaluate.compare([i % 50 for i in range(100)], lambda ids: torch.zeros(len(ids), 50), window=30)
    assert res.ref_ppl == pytest.approx(50.0) and res.windows == 4 and res.tokens == 96


def test_comparison_reports_top1_and_max_diff_and_emits_a_point_per_window() -> None:
    torch.manual_seed(0)
    table = torch.randn(64, 64)
    ref = lambda ids: table[list(ids)]  # noqa: E731
    noisy = lambda ids: table[list(ids)] + 0.5 * (torch.arange(64) == 3)  # noqa: E731
    events: list[Partial] = []
    st = State()
    st.subscribe(lambda e: events.append(e) if isinstance(e, Partial) else None)
    res = evaluate.compare(list(range(64)) * 2, ref, noisy, window=50, state=st, labels=("fp", "q"))
    assert res.max_abs_logit_diff == pytest.approx(0.5)
    assert 0.9 < res.top1_agreement <= 1.0
    assert [e.data["window"] for e in events] == [0, 1, 2]
    assert {"fp_ppl", "q_ppl", "fp_ppl_running", "q_ppl_running", "max_abs_logit_diff"} <= set(events[-1].data)
    assert events[-1].data["fp_ppl_running"] == pytest.approx(res.ref_ppl)
    assert st.fraction == 1.0


def test_default_corpora_are_disjoint_stdlib_text() -> None:
    ev = evaluate.load_corpus("default", "eval")
    cal = evaluate.load_corpus("default", "calib")
    assert len(ev) == 8000 and len(cal) > 50_000
    assert set(evaluate.EVAL_TOPICS).isdisjoint(evaluate.CALIB_TOPICS)
    assert ev[:200] not in cal


def test_text_file_corpus_and_its_errors(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("héllo world " * 50, encoding="utf-8")
    assert evaluate.load_corpus(str(f), nchars=11) == "héllo world"
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        evaluate.load_corpus(str(tmp_path / "bin.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UserError, match="is empty"):
        evaluate.load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(UserError, match="No text file"):
        evaluate.load_corpus(str(tmp_path / "missing.txt"))


def test_datasets_corpus_from_a_local_dataset_folder(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    d.mkdir()
    rows = [{"text": f"row {i} of the corpus.", "n": i} for i in range(20)]
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = evaluate.load_corpus(f"datasets:{d}")
    assert text.startswith("row 0 of the corpus.\nrow 1") and "row 19" in text
    with pytest.raises(UserError, match="Could not load the dataset"):
        evaluate.load_corpus(f"datasets:{tmp_path / 'nothing-here'}")


def test_too_short_text_is_an_error() -> None:
    with pytest.raises(UserError, match="shorter than two tokens"):
        evaluate.compare([1], lambda ids: torch.zeros(len(ids), 4))
    assert math.isfinite(evaluate.compare([1, 2], lambda ids: torch.zeros(len(ids), 4)).ref_ppl)


def test_the_eval_is_sized_to_the_model() -> None:
    from npustudio.core.evaluate import MIN_EVAL_TOKENS, auto_eval_tokens

    assert auto_eval_tokens(134_515_008) >= 1862  # the default model keeps its whole eval slice
    assert auto_eval_tokens(1_235_814_400) == MIN_EVAL_TOKENS == 256  # a 1B model: 256 positions
    assert auto_eval_tokens(4_000_000_000) == 256
