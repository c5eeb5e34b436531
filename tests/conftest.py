"""Shared fixtures: tiny random models saved as real HF folders (with a real tokenizer), a clean state."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import keyring
import pytest
from keyring.backend import KeyringBackend

if TYPE_CHECKING:
    from PySide6.QtWidgets import QTableWidget, QTableWidgetItem

    from npustudio.core.project import Done, Project, StageRecord
    from npustudio.core.stage_options import LoraAdapter
    from npustudio.core.stages import O, R, StageSpec

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

torch.set_num_threads(2)

pytest.register_assert_rewrite("tests.gui_helpers")  # the GUI tests' shared helpers assert as a test does

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _isolated_user_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never touch the developer's config, data, keyring or HF cache."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))  # crash logs
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    monkeypatch.delenv("HF_TOKEN", raising=False)


NPUSTUDIO = str(Path(sys.executable).parent / "npustudio")  # the console script pip installed


def npustudio(*args: str, timeout: float = 900, cwd: Path | None = None,
              input: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`npustudio ARGS` run as a user runs it: a process of the console script, `input` typed, its output captured;
    `env` added to this process's environment."""
    return subprocess.run([NPUSTUDIO, *args], input=input, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **env} if env else None)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers of `parser`'s subcommands, by name (argparse keeps them in its first subparsers action)."""
    assert parser._subparsers is not None, "the parser has no subcommands"
    action = parser._subparsers._group_actions[0]
    assert isinstance(action, argparse._SubParsersAction), action
    return action.choices


def wait_until(cond: Callable[[], object], timeout: float) -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def done(project: Project, spec: StageSpec[O, R]) -> Done[O, R]:
    """The finished record of stage `spec` in `project`, its options and result typed: the test fails naming the
    stage when the project has none."""
    rec = project.record(spec)
    assert rec is not None, f"the project has no finished {spec.name} stage"
    return rec


def raw_record(project: Project, name: str) -> StageRecord:
    """The record the manifest keeps for `name` (whatever its status; a stage a test made up too): the test fails
    naming it when there is none."""
    rec = project.load().stages.get(name)
    assert rec is not None, f"the project has no record of its {name} stage"
    return rec


def present(value: T | None, what: str) -> T:
    """`value`, which the test needs to be there: the test fails naming `what` when it is None."""
    assert value is not None, f"no {what}"
    return value


def item_at(table: QTableWidget, row: int, column: int) -> QTableWidgetItem:
    """The item in `table` at `row`, `column`: the test fails naming the cell when it is empty."""
    return present(table.item(row, column), f"item at row {row}, column {column}")


def running(marker: str) -> bool:
    """Whether a process of this computer has `marker` in its command line (a confined one's pid is its own)."""
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def make_tokenizer(folder: Path, vocab: int = 384) -> None:
    """A small byte-level BPE tokenizer trained on the stdlib corpus, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from npustudio.core.evaluate import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([load_corpus("default", "calib")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(folder))


TINY: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=1024, bos_token_id=1,
                  eos_token_id=2),
    # head_dim 64 like real models: the HTP's kernels want head dims of 32 or more
    "llama64": dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=1024, bos_token_id=1,
                    eos_token_id=2),
    "qwen2": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=1024,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, bos_token_id=1,
                  eos_token_id=2),
    "qwen3": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2),
}


ARCH = {"llama": "Llama", "llama64": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
        "granite": "Granite", "smollm3": "SmolLM3", "olmo2": "Olmo2"}


def make_tiny_model(folder: Path, family: str = "llama", seed: int = 0, **config: object) -> Path:
    """A tiny random `family` model (Mistral and Phi-3 take llama64's shapes); `config` overrides its config."""
    import transformers

    cfg = getattr(transformers, f"{ARCH[family]}Config")(**{**TINY.get(family, TINY["llama64"]), **config})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{ARCH[family]}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # random init is tiny; spread logits so top-1 is not a coin toss
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    make_tokenizer(folder)
    return folder


def bf16_copy(src: Path, dest: Path) -> Path:
    """`src` (a tiny model folder) saved again in bf16, as most checkpoints are shipped."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    # transformers wraps PreTrainedModel.to in functools.wraps, and typeshed's _Wrapped does not bind `self` as a
    # method does: mypy takes the dtype for the model
    model.to(torch.bfloat16).save_pretrained(dest)  # type: ignore[arg-type]
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dest / f.name)
    return dest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(root / f"tiny-{f}", f) for f in TINY}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def genie_pipeline(root: Path, model: Path, precision: str = "w8a16", embedding_lut: bool = True,
                   lora: tuple[LoraAdapter, ...] = ()) -> Project:
    """`model` (with the LoRA adapters `lora` merged) taken through adapt, quantize, compile and bundle at CL 128,
    AR-32, with small eval sizes."""
    from npustudio.core import pipeline
    from npustudio.core.adapt import AdaptOptions
    from npustudio.core.compile import CompileOptions
    from npustudio.core.genie.bundle import BundleOptions
    from npustudio.core.progress import State
    from npustudio.core.project import Project
    from npustudio.core.quantize import QuantizeOptions

    p = Project.open(root)
    pipeline.adapt(p, str(model), AdaptOptions(ar=32, cl=128, eval_chars=1500, window=128, decode_tokens=8,
                                               lora=lora), State())
    pipeline.quantize(p, QuantizeOptions(precision=precision, calib_samples=2, calib_len=64, calib_decode=4,
                                         eval_chars=1500, window=128, decode_tokens=8), State())
    pipeline.compile_graphs(p, CompileOptions(verify_tokens=64, embedding_lut=embedding_lut), State())
    pipeline.bundle(p, BundleOptions(), State())
    return p


@pytest.fixture(scope="session")
def genie_project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """A tiny Llama (head_dim 64, CL 128, AR-32) taken through adapt, quantize, compile and bundle once."""
    root = tmp_path_factory.mktemp("cg")
    return genie_pipeline(root / "p", make_tiny_model(root / "m", "llama64"))


@pytest.fixture(scope="session")
def genie_project_w4(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """`genie_project`'s model at w4a16 (int4 LPBQ blocks, LM head int8), taken to a bundle the same way."""
    root = tmp_path_factory.mktemp("cg4")
    return genie_pipeline(root / "p", make_tiny_model(root / "m", "llama64"), precision="w4a16")


class MemoryKeyring(KeyringBackend):
    priority = 1

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.store.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.store[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        self.store.pop((service, username), None)


@pytest.fixture
def memory_keyring() -> Iterator[MemoryKeyring]:
    """An in-memory keyring: tests never reach the developer's."""
    old = keyring.get_keyring()
    kr = MemoryKeyring()
    keyring.set_keyring(kr)
    yield kr
    keyring.set_keyring(old)




@pytest.fixture(scope="module")
def adb_server() -> Iterator[list[str]]:
    """A private adb server for the module on a free port: never the developer's (5037), nor another test run's."""
    mp = pytest.MonkeyPatch()
    from npustudio.core import device

    from .ray_head import free_port

    port = free_port()
    mp.setenv("ANDROID_ADB_SERVER_PORT", str(port))
    adb = [device.adb_path(), "-P", str(port)]
    subprocess.run([*adb, "start-server"], check=True, capture_output=True, timeout=60)
    yield adb
    subprocess.run([*adb, "kill-server"], capture_output=True, timeout=60)
    mp.undo()


@pytest.fixture(scope="session")
def default_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One project folder for the real default model per session: the GUI test walks the wizard through every
    stage into it, then the CLI test's `npustudio run` finds each stage current (same options) and checks the
    numbers; run alone, either test computes what it needs."""
    return tmp_path_factory.mktemp("default") / "proj"
