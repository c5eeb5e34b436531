"""Chat sessions over any runner: a phone or the virtual device (genie-t2t-run over adb), or the desktop
runner directly (real Genie on the HTP simulator, or the fast CPU preview).

Each turn renders the whole conversation with the model's chat template (system prompt + history, real
newlines, no BOS: Genie adds it) and sends it as one prompt, so any runner works the same; the oldest
turns are dropped when the conversation outgrows the context. Tokens stream to the caller; `stop` ends a
turn from any thread; tokens/s come from the runner's Genie profile. History is saved per project.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field

from . import layout
from .errors import UserError
from .fsutil import atomic_write_json

if TYPE_CHECKING:
    from .genie.bundle import BundleMeta

OnText = Callable[[str], None]


class Turn(BaseModel):
    user: str
    assistant: str
    runner: str
    stopped: bool = False
    generation_tok_s: float | None = None
    ttft_s: float | None = None
    at: float = Field(default_factory=time.time)


class Engine(Protocol):
    name: str

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None) -> tuple[str, bool, str | None]:
        """Answer `prompt` (already templated); returns (text, stopped, Genie profile JSON or None)."""
        ...


class DesktopEngine:
    """The bundle on this computer: real Genie on the HTP simulator, or the CPU preview (kept loaded)."""

    def __init__(self, bundle_dir: Path, preview: bool = False, max_tokens: int | None = None) -> None:
        self.bundle_dir, self.preview, self.max_tokens = Path(bundle_dir), preview, max_tokens
        self.name = "desktop preview (CPU)" if preview else "desktop Genie (HTP simulator)"
        self._preview: Any = None

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None) -> tuple[str, bool, str | None]:
        from .genie import host

        if self.preview:
            if self._preview is None:
                self._preview = host.Preview(self.bundle_dir)
            text, event, aborted = self._preview.query(prompt, on_text, stop, self.max_tokens)
            return text, aborted, self._preview.profile([event])
        res = host.run(self.bundle_dir / layout.GENIE_CONFIG, prompt, on_text, stop=stop, max_tokens=self.max_tokens)
        return res.text, res.status == "aborted", res.profile or None


class DeviceEngine:
    """The deployed bundle on an adb device (a phone, or the virtual device)."""

    def __init__(self, serial: str, bundle_dir: Path) -> None:
        from .device.deploy import remote_dir

        self.serial, self.remote = serial, remote_dir(Path(bundle_dir))
        self.name = f"device {serial}"

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None) -> tuple[str, bool, str | None]:
        from .device import remote_genie

        with tempfile.TemporaryDirectory() as tmp:
            prof = Path(tmp) / "profile.json"
            res = remote_genie.run(self.serial, self.remote, prompt, answer_stream(on_text), stop, prof)
            return res.text, res.status == "stopped", prof.read_text(encoding="utf-8") if res.profile_path else None


def answer_stream(on_text: OnText) -> OnText:
    """genie-t2t-run prints `[PROMPT]: …` first: pass on only what comes after `[BEGIN]: `, up to `[END]`."""
    buf, on, done = "", False, False

    def feed(s: str) -> None:
        nonlocal buf, on, done
        if done:
            return
        if not on:
            buf += s
            if "[BEGIN]: " not in buf:
                return
            on = True
            s = buf.split("[BEGIN]: ", 1)[1]
        if "[END]" in s:
            s = s.split("[END]", 1)[0]
            done = True
        if s:
            on_text(s)

    return feed


class ChatSession:
    def __init__(self, bundle_dir: Path, engine: Engine, system: str | None = None,
                 history_file: Path | None = None) -> None:
        self.bundle_dir, self.engine, self.system = Path(bundle_dir), engine, system
        from .genie.bundle import read_metadata

        self.meta = read_metadata(self.bundle_dir)
        self.tok = _template_tokenizer(self.bundle_dir, self.meta)
        self.history_file = history_file or default_history_file(self.bundle_dir)
        self.turns: list[Turn] = _load(self.history_file)
        self.last_profile: str | None = None  # Genie's profile JSON of the last turn, for the profile view

    def prompt_for(self, user: str) -> str:
        from .genie.config import chat_prompt

        turns = list(self.turns)
        cl = self.meta.context_length
        limit = cl - max(g.ar for g in self.meta.graphs) - min(64, cl // 8)  # room for the answer
        while True:
            history = [m for t in turns for m in ({"role": "user", "content": t.user},
                                                   {"role": "assistant", "content": t.assistant})]
            text = chat_prompt(self.tok, user, self.system, history)
            if len(self.tok(text, add_special_tokens=False)["input_ids"]) + 1 <= limit or not turns:
                break
            turns = turns[1:]  # the oldest turn goes first
        if len(self.tok(text, add_special_tokens=False)["input_ids"]) + 1 > limit:
            raise UserError("The message is too long for the model's context.", "Write a shorter message.")
        return text

    def send(self, user: str, on_text: OnText, stop: threading.Event | None = None) -> Turn:
        from .genie import profile
        from .genie.config import check_prompt

        if not user.strip():
            raise UserError("The message is empty.", "Type a question.")
        check_prompt(user)
        if self.system:
            check_prompt(self.system)

        text, stopped, prof = self.engine.ask(self.prompt_for(user), on_text, stop)
        self.last_profile = prof
        summary = profile.summarize(profile.parse(prof)).model_dump() if prof else {}
        turn = Turn(user=user, assistant=_clean(text, self.tok), runner=self.engine.name, stopped=stopped,
                    generation_tok_s=summary.get("generation_tok_s"), ttft_s=summary.get("ttft_s"))
        self.turns.append(turn)
        self.save()
        return turn

    def clear(self) -> None:
        self.turns = []
        self.save()

    def save(self) -> None:
        self.history_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.history_file, {"system": self.system, "turns": [t.model_dump() for t in self.turns]})


def default_history_file(bundle_dir: Path) -> Path:
    """`<project>/chat_history.json` for a project's bundle; else beside the bundle."""
    b = Path(bundle_dir).resolve()
    if b.parent.name == layout.STAGES_DIR:
        return b.parents[1] / layout.CHAT_HISTORY
    return b / layout.CHAT_HISTORY


def saved_turns(bundle_dir: Path) -> list[Turn]:
    """The saved conversation of a bundle's project (what a chat window shows on open)."""
    return _load(default_history_file(bundle_dir))


def clear_history(bundle_dir: Path) -> None:
    f = default_history_file(bundle_dir)
    if f.exists():
        atomic_write_json(f, {"system": None, "turns": []})


def _load(path: Path) -> list[Turn]:
    try:
        data = json.loads(path.read_text())
        return [Turn(**t) for t in data.get("turns", [])]
    except (OSError, ValueError, TypeError):
        return []


def as_chat_prompt(bundle_dir: Path, text: str) -> str:
    """`text` as one user turn in the bundle's chat template: an instruct model asked a bare question
    often answers with end-of-turn at once. Left as it is when it already holds one of the tokenizer's
    special tokens (a prompt written in the template, as genie-t2t-run takes it) or the model has no
    template (a base model, or a bundle made without NPU Studio's metadata.json)."""
    from .genie.bundle import read_metadata

    try:
        meta = read_metadata(Path(bundle_dir))
    except UserError:
        return text
    if not meta.chat_template:
        return text
    tok = _template_tokenizer(Path(bundle_dir), meta)
    if any(t.special and t.content in text for t in tok.added_tokens_decoder.values()):
        return text
    from .genie.config import chat_prompt

    return chat_prompt(tok, text)


def _template_tokenizer(bundle_dir: Path, meta: BundleMeta) -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle_dir / layout.TOKENIZER))
    if meta.bos_id is not None:
        tok.bos_token = tok.convert_ids_to_tokens(meta.bos_id)
    tok.eos_token = tok.convert_ids_to_tokens(meta.eos_ids[0])
    if not meta.chat_template:
        raise UserError("This model has no chat template.", "Use an instruct/chat model, or genie-run with a prompt.")
    tok.chat_template = meta.chat_template
    return tok


def _clean(text: str, tok: Any) -> str:
    """The answer without a trailing end-of-turn marker (Genie may print it before stopping)."""
    for marker in {tok.eos_token or "", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"} - {""}:
        text = text.split(marker, 1)[0]
    return text.strip()
