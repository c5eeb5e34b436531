"""Perplexity, top-1 agreement and logits difference over a text, window by window.

Windows are non-overlapping; each window's numbers are emitted as a partial result as soon as it is
done, so a chart can draw them live. Corpora: the offline default (Python's own Language Reference,
`pydoc_data.topics`, shipped with CPython), a text file, or a `datasets` id.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from . import forked, layout
from .errors import UserError
from .progress import State, StateLike
from .results import EvalPlan
from .stage_options import DEFAULT_DECODE as DEFAULT_DECODE  # re-exported: the options' defaults, declared there
from .stage_options import DEFAULT_WINDOW as DEFAULT_WINDOW

# The eval and calibration slices are disjoint sets of topics (the eval slice is the one the
# reference measurements used: 8000 chars -> 1862 SmolLM2 tokens, FP32 PPL 14.659).
EVAL_TOPICS = ("naming", "exceptions", "execmodel", "bltin-type-objects", "truth", "types", "typesseq",
               "typesmapping")
CALIB_TOPICS = ("compound", "function", "class", "import", "raise", "with", "lambda", "yield")
DEFAULT_EVAL_CHARS = 8000
# Parameters x tokens of one float evaluation: the default model keeps its whole eval slice (1862 tokens), a
# 1B-class model is evaluated on MIN_EVAL_TOKENS (its AR-1 steps alone read 5 GB of weights each).
EVAL_BUDGET = 3e11
MIN_EVAL_TOKENS = 256

LogitsFn = Callable[[Sequence[int]], torch.Tensor]
"""Token ids of one window -> next-token logits for each position, (len, vocab)."""


def _topics(keys: Sequence[str], nchars: int | None) -> str:
    import pydoc_data.topics as t

    text = "\n\n".join(t.topics[k] for k in keys if k in t.topics)
    return text[:nchars] if nchars else text


def load_corpus(spec: str = "default", purpose: str = "eval", nchars: int | None = None) -> str:
    """`default`, a path to a UTF-8 text file, or `datasets:ID[:CONFIG][@SPLIT]` (local folders work too)."""
    if spec == "default":
        keys = EVAL_TOPICS if purpose == "eval" else CALIB_TOPICS
        return _topics(keys, nchars if nchars is not None else (DEFAULT_EVAL_CHARS if purpose == "eval" else None))
    if spec.startswith("datasets:"):
        return _load_dataset_text(spec.removeprefix("datasets:"), nchars)
    p = Path(spec).expanduser()
    if not p.is_file():
        raise UserError(f"No text file at {p}.",
                        "Pass `default`, a UTF-8 text file, or datasets:ID for a Hugging Face dataset.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{p} is not UTF-8 text (byte {e.start} cannot be decoded).",
                        "Save the file as UTF-8 plain text.") from e
    if not text.strip():
        raise UserError(f"{p} is empty.", "Use a text with at least a few hundred words.")
    return text[:nchars] if nchars else text


def _load_dataset_text(ident: str, nchars: int | None) -> str:
    split = "train"
    if "@" in ident:
        ident, split = ident.rsplit("@", 1)
    name, _, config = ident.partition(":")
    try:
        import datasets
    except ImportError as e:
        raise UserError("Reading a datasets id needs the `datasets` package.", "pip install datasets") from e
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:
        raise UserError(f"Could not load the dataset {name}{':' + config if config else ''} "
                        f"(split {split}): {str(e).splitlines()[0][:200]}",
                        "Check the id, config and split; offline, pass a local dataset folder or a text file.") from e
    col = "text" if "text" in ds.column_names else next(
        (c for c in ds.column_names if str(ds.features[c].dtype) == "string"), None)
    if col is None:
        raise UserError(f"The dataset {name} has no text column (columns: {', '.join(ds.column_names)}).",
                        "Use a dataset with a `text` column, or a text file.")
    parts: list[str] = []
    size = 0
    for row in ds:
        s = row[col] or ""
        parts.append(s)
        size += len(s) + 1
        if nchars and size >= nchars:
            break
    text = "\n".join(parts)
    return text[:nchars] if nchars else text


def auto_eval_tokens(params: int) -> int:
    """Eval tokens sized to the model: all of the default slice for small models, >= 256 for large ones."""
    return max(MIN_EVAL_TOKENS, int(EVAL_BUDGET / max(params, 1)))


def eval_ids(tokenizer: Any, plan: EvalPlan) -> list[int]:
    ids = list(tokenizer(load_corpus(plan.corpus, "eval", plan.chars))["input_ids"])
    return ids[: plan.tokens]


def windows(ids: Sequence[int], size: int) -> list[list[int]]:
    out = [list(ids[i:i + size]) for i in range(0, len(ids), size)]
    return [w for w in out if len(w) > 1]


@dataclass
class Comparison:
    """Numbers of one evaluation; `test_*` only when a second model was compared with the reference."""

    tokens: int = 0
    windows: int = 0
    ref_nll: float = 0.0
    test_nll: float = 0.0
    top1_agree: int = 0
    positions: int = 0
    max_abs_logit_diff: float = 0.0
    ref_logit_range: float = 0.0  # the widest spread (max - min) of the reference's logits at one position
    per_window: list[dict[str, float]] = field(default_factory=list)

    @property
    def ref_ppl(self) -> float:
        return math.exp(self.ref_nll / max(self.tokens, 1))

    @property
    def test_ppl(self) -> float:
        return math.exp(self.test_nll / max(self.tokens, 1))

    @property
    def top1_agreement(self) -> float:
        return self.top1_agree / max(self.positions, 1)

    def add(self, i: int, w: list[int], lr: torch.Tensor, lt: torch.Tensor | None, labels: tuple[str, str]
            ) -> dict[str, float]:
        """Window `i` (its tokens `w`, the reference's logits `lr` and the test's `lt`); returns its row."""
        self.ref_logit_range = max(self.ref_logit_range, float((lr.amax(-1) - lr.amin(-1)).max()))
        nr = nll(lr, w)
        self.ref_nll += nr
        self.tokens += len(w) - 1
        self.windows += 1
        row = {"window": i, "tokens": len(w) - 1, f"{labels[0]}_ppl": math.exp(nr / (len(w) - 1))}
        if lt is not None:
            nt = nll(lt, w)
            self.test_nll += nt
            # a position where either side has a NaN or infinite logit disagrees: argmax picks a NaN as the top
            # token, so two NaN rows would "agree" and a NaN model would pass the gate
            finite = torch.cat([torch.isfinite(lr[a:a + _ROWS]).all(-1) & torch.isfinite(lt[a:a + _ROWS]).all(-1)
                                for a in range(0, len(lr), _ROWS)])
            self.top1_agree += int(((lr.argmax(-1) == lt.argmax(-1)) & finite).sum())
            self.positions += len(w)
            d = max_abs_diff(lr, lt)
            self.max_abs_logit_diff = max(self.max_abs_logit_diff, d)
            row.update({f"{labels[1]}_ppl": math.exp(nt / (len(w) - 1)), "max_abs_logit_diff": d})
        self.per_window.append(row)
        return row


_ROWS = 16  # logit rows done at once: a 128k vocabulary in float64 is 1 MB a row


def nll(logits: torch.Tensor, ids: Sequence[int]) -> float:
    """Summed negative log-likelihood of `ids[1:]`, in float64 a few rows at a time (the whole window in float64
    was 0.5 GB at the quantize stage's peak on a 1B model)."""
    tgt = torch.tensor(list(ids[1:]))
    rows = logits[:-1]
    picked = [torch.log_softmax(rows[a:a + _ROWS].double(), -1).gather(1, tgt[a:a + _ROWS, None])
              for a in range(0, len(rows), _ROWS)]
    return float(-torch.cat(picked).sum())


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| without a full-size temporary; inf where either side is not finite (a NaN compares as nothing,
    so max() would skip it and a NaN model would show a difference of 0)."""
    worst = 0.0
    for i in range(0, len(a), _ROWS):
        d = float((a[i:i + _ROWS] - b[i:i + _ROWS]).abs().max())
        if not math.isfinite(d):
            return math.inf
        worst = max(worst, d)
    return worst


def compare(ids: Sequence[int], ref: LogitsFn, test: LogitsFn | None = None, window: int = DEFAULT_WINDOW,
            state: StateLike | None = None, labels: tuple[str, str] = ("fp", "test"),
            kept: list[torch.Tensor] | None = None, beside: bool = False) -> Comparison:
    """Perplexity of `ref` (and `test`), and how closely `test` follows `ref`, over non-overlapping windows.
    `kept` receives `test`'s logits of each window, in order. `beside`: the second half of the windows runs in a
    forked copy of this process while this one does the first, each on one thread (`ref` and `test` must then
    compute the same in a copy: no state of their own that the windows change)."""
    res = Comparison()
    ws = windows(ids, window)
    if not ws:
        raise UserError("The evaluation text is shorter than two tokens.", "Use a longer text.")
    ahead = _Ahead(ws, ref, test) if beside and len(ws) > 1 else None
    try:
        with forked.one_thread() if ahead else contextlib.nullcontext():
            for i, w in enumerate(ws):
                lr, lt = ahead.logits(i, state) if ahead and i >= ahead.first else \
                    (ref(w), test(w) if test is not None else None)
                row = res.add(i, w, lr, lt, labels)
                if kept is not None and lt is not None:
                    kept.append(lt)
                if state is not None:
                    state.partial("ppl", **row, **{f"{labels[0]}_ppl_running": res.ref_ppl},
                                  **({f"{labels[1]}_ppl_running": res.test_ppl} if lt is not None else {}))
                    state.progress((i + 1) / len(ws), f"window {i + 1}/{len(ws)}")
    finally:
        if ahead:
            ahead.stop()
    return res


class _Ahead:
    """The logits of the second half of an evaluation's windows, computed in a forked copy of this process."""

    def __init__(self, ws: list[list[int]], ref: LogitsFn, test: LogitsFn | None) -> None:
        self.first = (len(ws) + 1) // 2
        self._dir = tempfile.TemporaryDirectory(prefix="npustudio-eval-")
        self._file = Path(self._dir.name) / "logits.safetensors"
        self._child = forked.Forked(partial(_logits_of, ws[self.first:], ref, test, self._file),
                                    "the evaluation's second half")
        self._seen: dict[str, torch.Tensor] | None = None

    def logits(self, i: int, state: StateLike | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Window `i`'s reference and test logits (the first call waits for the copy)."""
        if self._seen is None:
            self._child.result(state or State())
            from safetensors.torch import load_file

            self._seen = load_file(self._file)
        j = i - self.first
        return self._seen.pop(f"ref.{j}"), self._seen.pop(f"test.{j}", None)

    def stop(self) -> None:
        self._child.stop()
        self._dir.cleanup()


def _logits_of(ws: list[list[int]], ref: LogitsFn, test: LogitsFn | None, path: Path) -> None:
    from safetensors.torch import save_file

    out = {}
    for j, w in enumerate(ws):
        out[f"ref.{j}"] = ref(w).contiguous()
        if test is not None:
            out[f"test.{j}"] = test(w).contiguous()
    save_file(out, str(path))


def hf_logits_fn(model: object) -> LogitsFn:
    """Logits of a transformers causal LM over a window (no cache)."""

    device = next(model.parameters()).device  # type: ignore[attr-defined]

    @torch.inference_mode()
    def fn(ids: Sequence[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([list(ids)], device=device)).logits[0].float().cpu()  # type: ignore[operator]

    return fn




def write_reference(folder: Path, plan: EvalPlan, ids: Sequence[int], logits: Sequence[torch.Tensor]) -> None:
    """The float model's logits over `plan`'s windows (in order), for a later stage to compare with instead of
    evaluating the float model again."""
    from .fsutil import atomic_write_json
    from .graph.store import write_tensors

    write_tensors(folder / layout.REFERENCE_LOGITS, {"ids": torch.tensor(list(ids), dtype=torch.int32),
                                              "logits": torch.cat([t.float() for t in logits])})
    atomic_write_json(folder / layout.EVAL_PLAN, plan.model_dump())


def read_plan(folder: Path) -> EvalPlan | None:
    import json

    try:
        return EvalPlan.model_validate(json.loads((folder / layout.EVAL_PLAN).read_text()))
    except (OSError, ValueError):
        return None


class Reference:
    """Logits written by `write_reference`, read one window at a time (the file can hold hundreds of MB)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(folder / layout.REFERENCE_LOGITS), framework="pt")
        self.ids = self._file.get_tensor("ids").tolist()
        self._logits = self._file.get_slice("logits")
        self._pos = 0

    def __call__(self, window: Sequence[int]) -> torch.Tensor:
        """The next window's logits (`compare` asks for the windows in order)."""
        start, self._pos = self._pos, self._pos + len(window)
        if self.ids[start:self._pos] != list(window):
            raise ValueError("the reference logits were written for other tokens")
        return self._logits[start:self._pos]
