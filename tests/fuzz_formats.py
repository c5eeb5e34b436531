"""Every file format NPU Studio reads, each with a valid seed and the product's own reader, and the mutations fed to
them: what tests/test_fuzz.py runs briefly and benchmarks/fuzz_bench.py for as long as it is given.

An input may be accepted or refused with a UserError (a message and a fix for the person). Anything else is a
finding: another exception (a traceback for the user), a reader still busy after `DEADLINE_S` (a hang), or a file
written outside the input's scratch folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import struct
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npustudio.core.errors import UserError

DEADLINE_S = 10.0  # one input's reading: a hang past it is a finding


@dataclass
class Format:
    name: str
    file: str  # where the mutated bytes go, relative to the scratch folder
    read: Callable[[Path], Any]  # the product's reader, given the scratch folder
    is_json: bool = True


@dataclass
class Outcome:
    tried: int = 0
    refused: int = 0  # a UserError: the person is told what is wrong
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    writes_outside: list[str] = field(default_factory=list)


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def alarm(_sig: int, _frame: Any) -> None:
        raise Hang(f"still reading after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def formats(seeds: Path) -> list[Format]:
    """The readers, over a seed folder made by `make_seeds` (each format's file at its place)."""
    from npustudio.core import chat, model_source, models, project, settings
    from npustudio.core.genie import config as genie_config
    from npustudio.core.genie import meta, profile
    from npustudio.core.graph import encodings
    from npustudio.core.mnn import config_check
    from npustudio.core.quantize import presets

    def card(d: Path) -> Any:
        return models.read_card(model_source.resolve_source(str(d / "model")))

    def genie(d: Path) -> Any:
        return genie_config.absolute(genie_config.read(d / "bundle" / "genie_config.json"), d / "bundle")

    return [
        Format("config.json", "model/config.json", card),
        Format("tokenizer.json", "model/tokenizer.json", card),
        Format("safetensors header", "model/model.safetensors", card, is_json=False),
        Format("GGUF", "model.gguf", lambda d: models.read_card(model_source.resolve_source(str(d / "model.gguf"))),
               is_json=False),
        Format(".encodings", "quantize/graph.encodings", lambda d: encodings.read(d / "quantize" / "graph.encodings")),
        Format("genie_config.json", "bundle/genie_config.json", genie),
        Format("metadata.json", "bundle/metadata.json", lambda d: meta.read_metadata(d / "bundle")),
        Format("MNN config.json", "mnn/config.json", lambda d: config_check.check(d / "mnn" / "config.json")),
        Format("chat history", "chat_history.json", lambda d: chat.ChatHistory.load(d / "chat_history.json")),
        Format("settings", "settings.json", lambda d: settings.load(d / "settings.json")),
        Format("override file", "overrides.json", lambda d: presets.load_overrides(d / "overrides.json")),
        Format("Genie profile", "profile.json", lambda d: profile.read(d / "profile.json")),
        Format("project manifest", "project/npustudio.json",
               lambda d: project.Project.open(d / "project", create=False).load()),
    ]


def make_seeds(folder: Path, bundle_project: Path, model: Path) -> Path:
    """A folder with one valid file of each format: from a real tiny project and its model (`model`: a Hugging
    Face folder), and the rest written as NPU Studio writes them."""
    from npustudio.core import layout
    from npustudio.core.chat import ChatHistory
    from npustudio.core.settings import Settings

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model, folder / "model")
    bundle = Path(bundle_project) / "stages" / "bundle"
    shutil.copytree(bundle, folder / "bundle", ignore=shutil.ignore_patterns("*.bin", "*.dat"))
    quant = next((Path(bundle_project) / "stages" / "quantize").glob("*.encodings"))
    (folder / "quantize").mkdir()
    shutil.copy2(quant, folder / "quantize" / "graph.encodings")
    (folder / "mnn").mkdir()
    (folder / "mnn" / "llm_config.json").write_text(json.dumps({"hidden_size": 64, "layer_nums": 2}))
    (folder / "mnn" / "config.json").write_text(json.dumps({
        "llm_model": "llm.mnn", "llm_weight": "llm.mnn.weight", "tokenizer_file": "tokenizer.txt",
        "llm_config": "llm_config.json", "backend_type": "cpu", "thread_num": 2, "precision": "low",
        "memory": "low", "sampler_type": "greedy"}))
    history = ChatHistory.load(folder / "chat_history.json")
    history.current.turns = []
    history.save()
    (folder / "settings.json").write_text(Settings().model_dump_json())
    (folder / "overrides.json").write_text(json.dumps({"weights": {"layers.0.mlp.down": 8}, "activations": {}}))
    from npustudio.core.genie import host  # a real Genie profile: the bundle asked one question

    host.run(bundle / layout.GENIE_CONFIG, "Hello", lambda _s: None, max_tokens=4,
             profile_path=folder / "profile.json")
    shutil.copytree(bundle_project, folder / "project", ignore=shutil.ignore_patterns("stages", "runs", "logs"))
    _gguf(folder / "model.gguf")
    assert (folder / "project" / layout.MANIFEST).is_file()
    return folder


def _gguf(path: Path) -> None:
    """A small GGUF (a Llama's header and one tensor) written with the gguf library."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("llama.context_length", 128), ("llama.embedding_length", 64), ("llama.block_count", 1),
                 ("llama.feed_forward_length", 128), ("llama.attention.head_count", 2),
                 ("llama.attention.head_count_kv", 1)):
        w.add_uint32(k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- mutations
ODD_VALUES: list[Any] = [None, True, 0, -1, 2**63, -(2**63), 1e308, float("nan"), "", "\0", "../../etc/passwd",
                         "/etc/passwd", "x" * 70000, [], {}, [[[[[[[[[[]]]]]]]]]], {"a": {"b": {"c": {}}}}, "é" * 10]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    how = rng.randrange(5)
    if how == 0 and b:  # flip bytes, mostly early (headers)
        for _ in range(rng.randint(1, 8)):
            i = min(int(rng.expovariate(1 / 64)), len(b) - 1)
            b[i] = rng.randrange(256)
    elif how == 1:  # cut
        b = b[:rng.randrange(len(b) + 1)]
    elif how == 2:  # a length or count field made huge
        i = rng.randrange(max(1, min(len(b), 256)))
        b[i:i + 8] = struct.pack("<Q", rng.choice([2**63 - 1, 2**32, 10**12, 0]))
    elif how == 3:  # random bytes in the middle
        i = rng.randrange(len(b) + 1)
        b[i:i] = os.urandom(rng.randint(1, 64))
    else:  # a chunk repeated
        i = rng.randrange(len(b) + 1)
        b[i:i] = b[i:i + rng.randint(1, 256)] * rng.randint(2, 50)
    return bytes(b)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:50]):
            yield from _paths(v, (*at, i))


def mutate_json(data: bytes, rng: random.Random) -> bytes:
    """A valid document with one of its values changed, a key removed or added; now and then broken bytes."""
    if rng.random() < 0.15:
        return mutate_bytes(data, rng)
    doc = json.loads(data)
    at = rng.choice(list(_paths(doc)))
    if not at:
        doc = rng.choice(ODD_VALUES)
    else:
        parent = doc
        for k in at[:-1]:
            parent = parent[k]
        how = rng.randrange(4)
        if how == 0 and isinstance(parent, dict):
            del parent[at[-1]]
        elif how == 1 and isinstance(parent, dict):
            parent[rng.choice(["extra", "", "\0", "__proto__"])] = rng.choice(ODD_VALUES)
        else:
            parent[at[-1]] = rng.choice(ODD_VALUES)
    return json.dumps(doc, allow_nan=True).encode()


# ---------------------------------------------------------------- running
def _listing(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*")}


def run(seeds: Path, work: Path, n: int | None = None, seconds: float | None = None, seed: int = 0,
        only: list[str] | None = None) -> dict[str, Outcome]:
    """Each format's reader on `n` mutated inputs (or round-robin for `seconds`), in a copy of the seeds under
    `work`; what happened per format."""
    rng = random.Random(seed)
    scratch = work / "scratch"
    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(seeds, scratch)
    outside = work / "outside"  # a sibling a reader must never write into
    outside.mkdir(exist_ok=True)
    before = _listing(outside)
    chosen = [f for f in formats(scratch) if only is None or f.name in only]
    out = {f.name: Outcome() for f in chosen}
    end = time.monotonic() + seconds if seconds is not None else None
    i = 0
    while (n is not None and i < n * len(chosen)) or (end is not None and time.monotonic() < end):
        f = chosen[i % len(chosen)]
        i += 1
        original = (seeds / f.file).read_bytes()
        data = (mutate_json if f.is_json else mutate_bytes)(original, rng)
        target = scratch / f.file
        target.write_bytes(data)
        o = out[f.name]
        o.tried += 1
        try:
            with deadline(DEADLINE_S):
                f.read(scratch)
        except UserError:
            o.refused += 1
        except Hang:
            o.hangs.append(data[:200].decode("utf-8", "replace"))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a finding: a traceback where the person should read a message (a Rust
            # library's panic too: pyo3 raises it as a BaseException, past a reader's `except Exception`)
            where = traceback.extract_tb(e.__traceback__)[-1]
            o.crashes.append(f"{type(e).__name__}: {str(e)[:160]} at {Path(where.filename).name}:{where.lineno} "
                             f"for {data[:120]!r}")
        finally:
            target.write_bytes(original)
        if _listing(outside) != before:
            o.writes_outside.append(f.name)
            before = _listing(outside)
    return out


def adb_wire(port: int, rng: random.Random, tries: int) -> tuple[int, list[str]]:
    """Mutated adb packets to a virtual device's port: each connection may be dropped, but the device must go on
    accepting connections. Returns (tried, findings)."""
    findings = []
    cnxn = struct.pack("<6I", 0x4E584E43, 0x01000001, 256 * 1024, 22, 0, 0xB1A7B1BC) + b"host::features=shell_v2\0"
    for _ in range(tries):
        packet = mutate_bytes(cnxn, rng)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(packet)
                s.settimeout(1)
                try:
                    s.recv(4096)
                except (TimeoutError, OSError):
                    pass
        except OSError as e:
            findings.append(f"the device stopped accepting connections: {e}")
            break
    return tries, findings
