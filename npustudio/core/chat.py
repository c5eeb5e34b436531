"""Chat sessions over any runner: a phone or the virtual device (genie-t2t-run over adb), or the desktop
runner directly (real Genie on the HTP simulator, or the fast CPU preview), or the MNN back-end's model on this
computer (MNN's own runtime).

Each turn renders the whole conversation with the model's chat template (system prompt + history, real
newlines, no BOS: Genie adds it) and sends it as one prompt, so any runner works the same; the oldest
turns are dropped when the conversation outgrows the context. Tokens stream to the caller; `stop` ends a
turn from any thread; tokens/s come from the runner's Genie profile. A project keeps several chats (its
`chat_history.json`, `ChatHistory`); the last answer can be asked for again, the last message edited.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from . import layout, stages
from .errors import UserError
from .fsutil import MiB, TooLarge, atomic_write_json, read_at_most
from .genie.adapters import Choice

OnText = Callable[[str], None]


class Turn(BaseModel):
    user: str
    assistant: str
    runner: str
    stopped: bool = False
    generation_tok_s: float | None = None
    tokens_per_call: float | None = None  # draft-model decoding: tokens each target call yielded (Genie's profile)
    ttft_s: float | None = None
    # seconds from sending to the first words, as the person waited: the runner's start, the model's load and the
    # prompt (Genie's TTFT counts from its own prompt step only)
    wait_s: float | None = None
    at: float = Field(default_factory=time.time)


class Chat(BaseModel):
    """One conversation of a project: what the history list shows and what a prompt is made from."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    name: str | None = None  # given by a person (`ChatHistory.rename`); else the title is the first question
    system: str | None = None
    turns: list[Turn] = Field(default_factory=list)
    created: float = Field(default_factory=time.time)

    @property
    def title(self) -> str:
        """The name given to it, else the first question, cut to a list entry's length ("New chat" while there is
        none)."""
        if self.name:
            return self.name
        if not self.turns:
            return "New chat"
        first = " ".join(self.turns[0].user.split())
        return first if len(first) <= 40 else first[:39] + "…"


class ChatHistory:
    """Every chat of a project in one file. The chat on screen keeps the file's original shape at its top level
    (`system`, `turns`), so a history written before chats could be several reads as one chat, and a reader
    that knows only that shape still finds the current conversation; the others are under `others`."""

    LIMIT = 16 * MiB  # thousands of long turns; parsed whole, a 315 MB history took 20 GB (about 60 bytes a byte)

    def __init__(self, path: Path, chats: list[Chat], current: str, set_aside: Path | None = None,
                 why: str = "") -> None:
        self.path, self.chats, self.current_id = Path(path), chats, current
        self.set_aside = set_aside  # where an unreadable history file was moved, so the next save loses nothing
        self.why = why  # what was wrong with it, for `notice`

    @classmethod
    def load(cls, path: Path) -> ChatHistory:
        """The saved chats; a missing file is one empty chat. An unreadable one (damaged, hand-edited, nested too
        deeply, larger than `LIMIT`, not a plain file) is one empty chat too, its file moved aside first
        (`set_aside`): the next save must not overwrite it, and the next chat must not fail on it again."""
        path = Path(path)
        if not path.exists() and not path.is_symlink():
            return cls._empty(path)
        why = "it is damaged"
        try:
            data = json.loads(read_at_most(path, cls.LIMIT, follow=False))  # no link, no FIFO: not ours
            top = Chat(**{k: data[k] for k in ("id", "name", "system", "turns", "created") if k in data})
            if "id" not in data:  # written before chats had ids: the same one at every read, so it can be picked
                top.id = "first"
                top.created = top.turns[0].at if top.turns else top.created
            others = [Chat(**c) for c in data.get("others", [])]
        except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError, UserError,
                TooLarge) as e:
            if isinstance(e, TooLarge):
                why = f"it is larger than {cls.LIMIT // MiB} MiB"
            elif isinstance(e, RecursionError):
                why = "it is nested too deeply"
            elif isinstance(e, UserError):
                why = "it is not a plain file"
            aside = path.with_name(f"{path.stem}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
            n = 1
            while aside.exists() or aside.is_symlink():  # never over an earlier one
                n += 1
                aside = aside.with_name(f"{path.stem}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}-{n}{path.suffix}")
            try:
                path.replace(aside)
            except OSError:  # cannot move it (read-only folder): nothing will be saved over it either
                aside = path
            return cls._empty(path, aside, why)
        return cls(path, [top, *others], top.id)

    def notice(self) -> str | None:
        """What a view says about a history file that could not be read (None: nothing to say)."""
        if self.set_aside is None:
            return None
        if self.set_aside == self.path:
            return (f"The chat history {self.path} could not be read ({self.why}); it is left as it is and nothing "
                    "is saved.")
        return (f"The chat history could not be read ({self.why}): it was kept as {self.set_aside.name}, "
                "and a new one was started.")

    @classmethod
    def _empty(cls, path: Path, set_aside: Path | None = None, why: str = "") -> ChatHistory:
        chat = Chat()
        return cls(path, [chat], chat.id, set_aside, why)

    @property
    def current(self) -> Chat:
        return next(c for c in self.chats if c.id == self.current_id)

    def listed(self) -> list[Chat]:
        """Newest first, as a chat list shows them."""
        return sorted(self.chats, key=lambda c: c.created, reverse=True)

    def new(self) -> Chat:
        """A new empty chat becomes current; an empty current chat is reused rather than piled up."""
        if self.current.turns:
            chat = Chat(system=self.current.system)
            self.chats.append(chat)
            self.current_id = chat.id
        return self.current

    def pick(self, chat_id: str) -> Chat:
        if not any(c.id == chat_id for c in self.chats):
            raise UserError("That chat is no longer in this project's history.", "Pick another one.")
        self.current_id = chat_id
        return self.current

    def rename(self, chat_id: str, name: str) -> Chat:
        """Give a chat a name of its own for the list (an empty name: back to its first question)."""
        chat = self._find(chat_id)
        name = " ".join(name.split())
        if len(name) > 80:
            raise UserError("That name is too long for the chat list.", "Use at most 80 characters.")
        chat.name = name or None
        return chat

    def delete(self, chat_id: str) -> Chat:
        """Forget a chat. When it was the current one, the newest other chat becomes current (a new empty one when
        none is left); returns the current chat."""
        self._find(chat_id)
        self.chats = [c for c in self.chats if c.id != chat_id]
        if not self.chats:
            self.chats.append(Chat())
        if self.current_id == chat_id:
            self.current_id = self.listed()[0].id
        return self.current

    def _find(self, chat_id: str) -> Chat:
        chat = next((c for c in self.chats if c.id == chat_id), None)
        if chat is None:
            raise UserError("That chat is no longer in this project's history.", "Pick another one.")
        return chat

    def save(self) -> None:
        if self.set_aside == self.path:
            raise UserError(f"{self.path} could not be read nor moved aside: saving would overwrite it.",
                            "Move or repair that file, then ask again.")
        cur = self.current
        others = [c.model_dump() for c in self.chats if c.id != cur.id and c.turns]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {"system": cur.system, "turns": [t.model_dump() for t in cur.turns],
                                      "id": cur.id, "name": cur.name, "created": cur.created, "others": others})


class Engine(Protocol):
    name: str
    figures: dict[str, float]  # the last answer's figures when the runner gives no Genie profile (MNN)
    # True: `ask` takes the user's message alone, and the runner applies the chat template itself and keeps no
    # conversation (MNN's llm_demo on a device)
    one_question: bool
    # True: `ask` stops after `max_tokens` generated tokens itself (a phone's genie-t2t-run has no such flag)
    exact_max_tokens: bool

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None, on_log: OnText | None = None,
            log_level: str = "error", max_tokens: int | None = None) -> tuple[str, bool, str | None]:
        """Answer `prompt` (already templated); returns (text, stopped, Genie profile JSON or None). Genie's own
        log lines at `log_level` (error, warn, info, verbose) go to `on_log`, never into the answer; `max_tokens`
        caps the answer where `exact_max_tokens` says the runner can."""
        ...


class DesktopEngine:
    """The bundle on this computer: real Genie on the HTP simulator, or the CPU preview (kept loaded)."""

    def __init__(self, bundle_dir: Path, preview: bool = False, max_tokens: int | None = None,
                 apart: bool = False, lora: Choice | None = None) -> None:
        """`apart`: real Genie runs in a child process at a lower CPU priority (`host.run_apart`), for a caller
        whose own thread must stay responsive (the window). `lora`: the bundle's switchable adapter to answer
        with."""
        self.bundle_dir, self.preview, self.max_tokens, self.apart = Path(bundle_dir), preview, max_tokens, apart
        self.lora = lora
        self.name = "desktop preview on the CPU" if preview else "desktop Genie on the HTP simulator"  # shown in ( )
        self.figures: dict[str, float] = {}
        self.one_question = False
        self.exact_max_tokens = True
        self._preview: Any = None

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None, on_log: OnText | None = None,
            log_level: str = "error", max_tokens: int | None = None) -> tuple[str, bool, str | None]:
        from .genie import host

        if self.preview:  # not Genie: it has no log of its own
            if self._preview is None:
                self._preview = host.Preview(self.bundle_dir, self.lora)
            text, event, aborted = self._preview.query(prompt, on_text, stop, max_tokens or self.max_tokens)
            return text, aborted, self._preview.profile([event])
        res = (host.run_apart if self.apart else host.run)(self.bundle_dir / layout.GENIE_CONFIG, prompt, on_text,
                                                           stop=stop, max_tokens=max_tokens or self.max_tokens,
                                                           log_level=log_level, on_log=on_log, lora=self.lora)
        return res.text, res.status == "aborted", res.profile or None


class DeviceEngine:
    """The deployed bundle on an adb device (a phone, or the virtual device)."""

    def __init__(self, serial: str, bundle_dir: Path, virtual: bool = False, lora: Choice | None = None) -> None:
        from .device.deploy import remote_dir
        from .genie import adapters
        from .genie.meta import read_metadata

        self.serial, self.remote = serial, remote_dir(Path(bundle_dir))
        self.lora_flag = adapters.t2t_flag(read_metadata(Path(bundle_dir)), lora or adapters.Choice())
        self.name = f"device {serial}"
        self.figures: dict[str, float] = {}
        self.one_question = False
        self.exact_max_tokens = virtual  # the virtual device's genie-t2t-run takes --max-tokens; a phone's does not

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None, on_log: OnText | None = None,
            log_level: str = "error", max_tokens: int | None = None) -> tuple[str, bool, str | None]:
        from .device import remote_genie
        from .genie import t2t

        reader = t2t.Reader(on_text, on_log, prompt)  # genie-t2t-run's output: the answer apart from the log
        with tempfile.TemporaryDirectory() as tmp:
            prof = Path(tmp) / "profile.json"
            try:
                res = remote_genie.run(self.serial, self.remote, prompt, reader.feed, stop, prof, log=log_level,
                                       max_tokens=max_tokens if self.exact_max_tokens else None,
                                       extra=self.lora_flag)
            finally:
                reader.close()
            return res.text, res.status == "stopped", prof.read_text(encoding="utf-8") if res.profile_path else None


class MnnEngine:
    """The MNN back-end's model on this computer, run by MNN's own runtime (greedy; kept loaded)."""

    def __init__(self, stage_dir: Path, max_tokens: int | None = None) -> None:
        self.stage_dir, self.max_tokens = Path(stage_dir), max_tokens
        self.record = stages.MNN.load(self.stage_dir)
        self.name = "MNN on this computer (CPU)"
        self.figures: dict[str, float] = {}
        self.one_question = False
        self.exact_max_tokens = True
        self._model: Any = None
        self._tok: Any = None

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None, on_log: OnText | None = None,
            log_level: str = "error", max_tokens: int | None = None) -> tuple[str, bool, str | None]:
        from transformers import PreTrainedTokenizerFast

        from .genie.host import TextPieces
        from .mnn.runtime import MnnModel

        if self._model is None:
            self._model = MnnModel(self.stage_dir / layout.MNN_MODEL)
            self._tok = PreTrainedTokenizerFast(tokenizer_file=str(self.stage_dir / layout.TOKENIZER))
        ids = ([self.record.bos_id] if self.record.bos_id is not None else []) + self._tok(
            prompt, add_special_tokens=False)["input_ids"]
        room = self.record.context_length - len(ids)
        if room <= 0:  # as the CPU preview says it
            raise UserError(f"The prompt ({len(ids)} tokens) does not fit the context ({self.record.context_length}).",
                            "Shorten the prompt or the history.")
        pieces = TextPieces(self._tok, on_text)
        t = self._model.stream(ids, min(room, max_tokens or self.max_tokens or room), pieces.add, stop,
                               set(self.record.eos_ids))
        self.figures = {"ttft_s": t.prefill_s, "generation_tok_s": t.decode_tok_s}
        return pieces.text(), stop is not None and stop.is_set(), None


class MnnDeviceEngine:
    """The MNN stage's model deployed on an adb device, run by MNN's llm_demo there (`device.remote_mnn`): it
    applies the chat template itself and answers one question at a time, so a chat with it has no history."""

    def __init__(self, serial: str, stage_dir: Path, remote_dir: str, max_tokens: int | None = None) -> None:
        self.serial, self.stage_dir, self.remote, self.max_tokens = serial, Path(stage_dir), remote_dir, max_tokens
        self.record = stages.MNN.load(self.stage_dir)
        self.name = f"MNN llm_demo on device {serial}"
        self.figures: dict[str, float] = {}
        self.one_question = True
        self.exact_max_tokens = True
        self._tok: Any = None  # the model's tokenizer with its chat template, read on the first question

    def ask(self, prompt: str, on_text: OnText, stop: threading.Event | None, on_log: OnText | None = None,
            log_level: str = "error", max_tokens: int | None = None) -> tuple[str, bool, str | None]:
        from .device import remote_mnn
        from .genie.config import chat_prompt

        if self._tok is None:
            self._tok = chat_model(self.stage_dir).tok
        tok = self._tok  # the prompt llm_demo will render, counted to size the answer
        used = len(tok(chat_prompt(tok, prompt, None, []), add_special_tokens=False)["input_ids"]) + 1
        room = self.record.context_length - used
        if room <= 0:
            raise UserError(f"The message ({used} tokens) does not fit the context ({self.record.context_length}).",
                            "Write a shorter message.")
        reader = remote_mnn.Reader(on_text)  # llm_demo's output: the answer apart from its log and figures
        try:
            res = remote_mnn.run(self.serial, self.remote, prompt, reader.feed,
                                 min(room, max_tokens or self.max_tokens or room), stop)
        finally:
            reader.close()
        self.figures = {"ttft_s": res.prefill_s, "generation_tok_s": res.decode_tok_s}
        return res.text, res.status == "stopped", None


class ChatModel(BaseModel):
    """What a chat needs of the model it talks to: how to render prompts, and how many tokens it keeps."""

    model_config = {"arbitrary_types_allowed": True}
    tok: Any
    limit: int  # prompt tokens, leaving room for the answer


def chat_model(folder: Path) -> ChatModel:
    """A Genie bundle's or the MNN stage folder's tokenizer with the model's chat template, and its prompt limit."""
    from .genie.config import template_tokenizer
    from .genie.meta import read_metadata

    if (folder / layout.MNN_RESULT).is_file():
        r = stages.MNN.load(folder)
        return ChatModel(tok=template_tokenizer(folder, r.bos_id, r.eos_ids, r.chat_template),
                         limit=r.context_length - min(64, r.context_length // 8))
    meta = read_metadata(folder)
    cl = meta.context_length
    return ChatModel(tok=template_tokenizer(folder, meta.bos_id, meta.eos_ids, meta.chat_template),
                     limit=cl - max(g.ar for g in meta.graphs) - min(64, cl // 8))  # room for the answer


class ChatSession:
    def __init__(self, bundle_dir: Path, engine: Engine, system: str | None = None,
                 history_file: Path | None = None) -> None:
        """A chat over `bundle_dir`: a Genie bundle, or the MNN stage's folder."""
        self.bundle_dir, self.engine, self.system = Path(bundle_dir), engine, system
        model = chat_model(self.bundle_dir)
        self.tok, self.limit = model.tok, model.limit
        self.history_file = history_file or default_history_file(self.bundle_dir)
        self.history = ChatHistory.load(self.history_file)
        self.last_profile: str | None = None  # Genie's profile JSON of the last turn, for the profile view

    @property
    def turns(self) -> list[Turn]:
        """The current chat's turns."""
        return self.history.current.turns

    @turns.setter
    def turns(self, turns: list[Turn]) -> None:
        self.history.current.turns = turns

    def reload(self) -> None:
        """Read the chats back from the file (another view picked or started a chat there)."""
        self.history = ChatHistory.load(self.history_file)

    def prompt_for(self, user: str, before: list[Turn] | None = None) -> str:
        """`user`'s message after the chat so far (or after `before`), the oldest turns dropped to fit."""
        from .genie.config import chat_prompt

        turns = list(self.turns if before is None else before)
        limit = self.limit
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

    def send(self, user: str, on_text: OnText, stop: threading.Event | None = None,
             replace_last: bool = False, on_log: OnText | None = None, log_level: str = "error") -> Turn:
        """One turn. With `replace_last`, `user` is asked in place of the last message: its answer replaces the
        last turn (kept as it was should the new answer fail). Genie's log lines at `log_level` go to `on_log`."""
        from .genie import profile
        from .genie.config import check_prompt

        if not user.strip():
            raise UserError("The message is empty.", "Type a question.")
        if replace_last and not self.turns:
            raise UserError("This chat has no message to replace yet.", "Send a message first.")
        check_prompt(user)
        if self.system:
            check_prompt(self.system)

        before = self.turns[:-1] if replace_last else self.turns
        if self.engine.one_question and (before or self.system):
            raise UserError(f"{self.engine.name} answers one question on its own: it keeps no conversation and "
                            "takes no system prompt.", "Start a new chat for each question, or chat with the "
                            "model on this computer.")
        prompt = user if self.engine.one_question else self.prompt_for(user, before)
        t0, first = time.monotonic(), list[float]()

        def shown(piece: str) -> None:
            if not first and piece:
                first.append(time.monotonic() - t0)
            on_text(piece)

        text, stopped, prof = self.engine.ask(prompt, shown, stop, on_log, log_level)
        self.last_profile = prof
        summary = profile.summarize(profile.parse(prof)).model_dump() if prof else self.engine.figures
        turn = Turn(user=user, assistant=clean_answer(text, self.tok), runner=self.engine.name, stopped=stopped,
                    generation_tok_s=summary.get("generation_tok_s"), ttft_s=summary.get("ttft_s"),
                    tokens_per_call=summary.get("tokens_per_call"), wait_s=first[0] if first else None)
        self.turns = [*before, turn]
        self.save()
        return turn

    def regenerate(self, on_text: OnText, stop: threading.Event | None = None, on_log: OnText | None = None,
                   log_level: str = "error") -> Turn:
        """The last message asked again; the new answer takes the old one's place."""
        if not self.turns:
            raise UserError("There is no answer to regenerate yet.", "Send a message first.")
        return self.send(self.turns[-1].user, on_text, stop, True, on_log, log_level)

    def clear(self) -> None:
        """Start a new chat (the earlier ones stay in the history)."""
        self.history.new()
        self.save()

    def save(self) -> None:
        self.history.current.system = self.system
        self.history.save()


def default_history_file(bundle_dir: Path) -> Path:
    """`<project>/chat_history.json` for a project's bundle; else beside the bundle."""
    b = Path(bundle_dir).resolve()
    if b.parent.name == layout.STAGES_DIR:
        return b.parents[1] / layout.CHAT_HISTORY
    return b / layout.CHAT_HISTORY


def history(bundle_dir: Path) -> ChatHistory:
    """Every saved chat of a bundle's project."""
    return ChatHistory.load(default_history_file(bundle_dir))


def mnn_samples_greedily(stage_dir: Path) -> bool:
    """Whether the MNN stage's model answers greedily on a device (its config.json, as llm_demo reads it)."""
    try:
        config = json.loads((Path(stage_dir) / layout.MNN_MODEL / layout.MNN_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("sampler_type") == "greedy"


def samples_greedily(bundle_dir: Path, preview: bool = False) -> bool:
    """Whether the answers pick the likeliest token every time (the CPU preview always does; Genie when its config
    says greedy, or top-k 1): asked the same messages again, the model gives the same answer, so regenerating one
    brings nothing new. An unreadable config: False (nothing is claimed)."""
    if preview:
        return True
    try:
        sampler = json.loads(read_at_most(Path(bundle_dir) / layout.GENIE_CONFIG, MiB))["dialog"]["sampler"]
        return bool(sampler.get("greedy")) or sampler.get("top-k") == 1
    except (OSError, ValueError, TypeError, KeyError, AttributeError, UserError, TooLarge):
        return False


def clear_history(bundle_dir: Path) -> None:
    """Forget every chat of a bundle's project."""
    f = default_history_file(bundle_dir)
    if f.exists():
        atomic_write_json(f, {"system": None, "turns": []})


def clean_answer(text: str, tok: Any) -> str:
    """The answer without a trailing end-of-turn marker (Genie may print it before stopping)."""
    for marker in {tok.eos_token or "", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"} - {""}:
        text = text.split(marker, 1)[0]
    return text.strip()
