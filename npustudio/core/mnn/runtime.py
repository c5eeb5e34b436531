"""An MNN model folder run by MNN's own LLM runtime (`MNN.llm`) on this computer: what the stage's check, the
desktop chat and the virtual device's `llm_demo` use."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import layout
from ..errors import UserError


@dataclass
class Timings:
    """MNN's own figures of one answer (its context's microsecond counters)."""

    prompt_tokens: int
    answer_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.answer_tokens / self.decode_s if self.decode_s > 0 else 0.0


def threads() -> int:
    """MNN's CPU threads on this computer: its cores, at most 4 (the exported config's phone default)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


class MnnModel:
    """One loaded MNN model, greedy (the same answer every time, as the check needs)."""

    def __init__(self, folder: Path, greedy: bool = True) -> None:
        config = Path(folder) / layout.MNN_CONFIG
        if not config.is_file():
            raise UserError(f"{folder} holds no MNN model ({layout.MNN_CONFIG} is missing).",
                            "Make it with `npustudio compile --backend mnn --project P`.")
        from ..native_io import fd_redirected
        from .config_check import check

        check(config)  # MNN opens whatever its config names: only the model folder's own files
        with fd_redirected(1, 2):  # MNN says its CPU's features on stdout: the answer streams there
            import MNN.llm as mnn_llm

            self.llm = mnn_llm.create(str(config))
            self.llm.set_config({"thread_num": threads()} | ({"sampler_type": "greedy"} if greedy else {}))
            self.llm.load()
        from .llm_demo import loaded

        if not loaded(self.llm):
            raise UserError(f"MNN could not load the model in {folder} (a file of it is missing or damaged).",
                            "Export it again: `npustudio compile --backend mnn --project P --force`.")

    def decode_logits(self, ids: Sequence[int], check: Callable[[], None] = lambda: None) -> Any:
        """The logits after each of `ids`, fed one token at a time from an empty cache: the path a phone decodes
        by (MNN's prompt path quantizes activations over the whole block, so its logits depend on how the
        prompt was cut; the decode path's do not)."""
        import numpy as np
        import torch

        self.llm.reset()
        rows = []
        for t in ids:
            check()
            rows.append(torch.from_numpy(np.array(self.llm.forward([int(t)]).read(), dtype=np.float32).reshape(-1)))
        return torch.stack(rows)

    def answer(self, ids: Sequence[int], max_tokens: int) -> tuple[list[int], Timings]:
        """Greedy tokens after the prompt `ids`, through MNN's prompt and decode path, stopping at its end of
        turn; and MNN's timings of it."""
        self.llm.reset()
        # the binding's own call: MNN.llm's Python wrapper does not pass the token limit on (it would then only
        # read the prompt)
        out = [int(t) for t in self.llm._c_obj.generate([int(t) for t in ids], max_tokens)]
        # the answer's text is dropped before the context is read: the binding turns it into a str unchecked, and
        # an answer cut inside a UTF-8 sequence crashed the process there
        self.llm._c_obj.set_context({"generate_str": ""})
        ctx = self.llm._c_obj.get_context()
        return out, Timings(prompt_tokens=len(ids), answer_tokens=len(out), prefill_s=ctx["prefill_us"] / 1e6,
                            decode_s=ctx["decode_us"] / 1e6)

    def stream(self, ids: Sequence[int], max_tokens: int, on_token: Callable[[int], None],
               stop: threading.Event | None = None, eos: Collection[int] = ()) -> Timings:
        """Greedy tokens after the prompt `ids`, each handed to `on_token` as MNN makes it (its prompt path, then
        one decode step a token), until an end of turn (not handed on), `max_tokens` or `stop`; timed around MNN's
        own calls (its context's counters are kept by `generate` alone, which hands out no token before the end)."""
        self.llm.reset()
        t0 = time.perf_counter()
        token = self._top(self.llm.forward([int(t) for t in ids]))
        t1 = time.perf_counter()
        n = 0
        while token not in eos and not (stop is not None and stop.is_set()):
            on_token(token)
            n += 1
            if n >= max_tokens:
                break
            token = self._top(self.llm.forward([token]))
        return Timings(prompt_tokens=len(ids), answer_tokens=max(n - 1, 0), prefill_s=t1 - t0,
                       decode_s=time.perf_counter() - t1)

    @staticmethod
    def _top(logits: Any) -> int:
        import numpy as np

        return int(np.argmax(np.asarray(logits.read()).reshape(-1)))
