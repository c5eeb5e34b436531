"""A deploy project: a folder with a typed manifest and one output folder per stage.

A stage runs in a scratch folder and is swapped in only when it finished, so a killed stage leaves
the previous good outputs and manifest untouched and simply reruns from its start next time.
A stage whose inputs and options are unchanged (same key) and whose outputs are intact is skipped.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from .errors import UserError
from .fsutil import atomic_write_text, sha256_file, sha256_json
from .progress import Cancelled, peak_rss_mb

MANIFEST = "npustudio.json"
SCHEMA_VERSION = 1


class FileRecord(BaseModel):
    path: str  # relative to the project folder
    bytes: int
    sha256: str


class StageRecord(BaseModel):
    name: str
    status: Literal["done", "failed", "cancelled"]
    key: str
    inputs: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    outputs: list[FileRecord] = Field(default_factory=list)
    result: dict[str, Any] = Field(default_factory=dict)
    started: datetime
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    error: str | None = None


class Manifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    stages: dict[str, StageRecord] = Field(default_factory=dict)
    # Failures and cancels are kept apart so they never replace the last good record.
    attempts: dict[str, StageRecord] = Field(default_factory=dict)
    # What the user picked before a stage ran (model, target, ...), so a reopened project shows it again.
    choices: dict[str, Any] = Field(default_factory=dict)


StageFn = Callable[[Path], dict[str, Any]]
"""Runs a stage into a scratch folder and returns its result record (JSON-able)."""


class Project:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()

    # ----- manifest -----
    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def stage_dir(self, name: str) -> Path:
        return self.root / "stages" / name

    @classmethod
    def open(cls, root: Path | str, create: bool = True) -> Project:
        p = cls(root)
        if p.root.exists() and not p.root.is_dir():
            raise UserError(f"{p.root} is a file, not a project folder.", "Choose a folder for the project.")
        if not p.manifest_path.exists():
            if not create:
                raise UserError(f"{p.root} is not an NPU Studio project (no {MANIFEST}).",
                                "Create it with `npustudio adapt MODEL --project DIR` or pick another folder.")
            if p.root.exists() and any(p.root.iterdir()):
                raise UserError(f"{p.root} is not empty and is not an NPU Studio project.",
                                "Pick an empty or new folder for the project, so no file of yours is touched.")
            p.root.mkdir(parents=True, exist_ok=True)
            p.save(Manifest())
        p.load()  # validates
        return p

    def load(self) -> Manifest:
        try:
            return Manifest.model_validate_json(self.manifest_path.read_text())
        except (ValidationError, ValueError) as e:
            raise UserError(f"The project manifest {self.manifest_path} is damaged: {e.__class__.__name__}.",
                            "Restore it from a backup or start a new project folder.") from e

    def save(self, manifest: Manifest) -> None:
        atomic_write_text(self.manifest_path, manifest.model_dump_json(indent=2) + "\n")

    def record(self, name: str) -> StageRecord | None:
        return self.load().stages.get(name)

    def choices(self) -> dict[str, Any]:
        return dict(self.load().choices)

    def choose(self, **values: Any) -> None:
        """Remember the user's picks (JSON values) in the manifest."""
        m = self.load()
        m.choices.update(values)
        self.save(m)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise UserError(f"Another NPU Studio process is working on {self.root}.",
                                "Wait for it to finish or stop it, then try again.") from e
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ----- stages -----
    def is_current(self, name: str, key: str) -> bool:
        rec = self.record(name)
        if rec is None or rec.status != "done" or rec.key != key:
            return False
        return not self.changed(name)

    def changed(self, name: str) -> list[str]:
        """A quick check (existence and size, no hashing) of a stage's outputs: the paths that differ."""
        rec = self.record(name)
        return [fr.path for fr in (rec.outputs if rec else [])
                if not (self.root / fr.path).is_file() or (self.root / fr.path).stat().st_size != fr.bytes]

    def verify(self, name: str) -> list[str]:
        """Re-hash a stage's outputs; returns the paths whose content changed or vanished."""
        rec = self.record(name)
        bad = []
        for fr in rec.outputs if rec else []:
            f = self.root / fr.path
            if not f.is_file() or sha256_file(f) != fr.sha256:
                bad.append(fr.path)
        return bad

    def run_stage(self, name: str, inputs: dict[str, Any], options: dict[str, Any], fn: StageFn,
                  force: bool = False) -> tuple[StageRecord, bool]:
        """Run `fn` unless an identical finished run exists. Returns (record, ran)."""
        key = sha256_json({"stage": name, "inputs": inputs, "options": options})
        with self._lock():
            self._recover(name)
            if not force and self.is_current(name, key):
                return self.record(name), False  # type: ignore[return-value]
            scratch = self.root / "stages" / f".{name}.partial"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            started = datetime.now(UTC)
            t0 = time.perf_counter()
            try:
                result = fn(scratch)
            except BaseException as e:
                status = "cancelled" if isinstance(e, Cancelled | KeyboardInterrupt) else "failed"
                shutil.rmtree(scratch, ignore_errors=True)
                m = self.load()
                m.attempts[name] = StageRecord(name=name, status=status, key=key, inputs=inputs,
                                               options=options, started=started,
                                               seconds=time.perf_counter() - t0, error=str(e))
                self.save(m)
                raise
            final = self.stage_dir(name)
            outputs = [
                FileRecord(path=str((final / f.relative_to(scratch)).relative_to(self.root)),
                           bytes=f.stat().st_size, sha256=sha256_file(f))
                for f in sorted(scratch.rglob("*")) if f.is_file()
            ]
            rec = StageRecord(name=name, status="done", key=key, inputs=inputs, options=options,
                              outputs=outputs, result=result, started=started,
                              seconds=time.perf_counter() - t0, peak_rss_mb=peak_rss_mb())
            self._swap_in(name, scratch)
            m = self.load()
            m.stages[name] = rec
            m.attempts.pop(name, None)
            self.save(m)
            return rec, True

    def _swap_in(self, name: str, scratch: Path) -> None:
        final, old = self.stage_dir(name), self.root / "stages" / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(scratch, final)
        shutil.rmtree(old, ignore_errors=True)

    def _recover(self, name: str) -> None:
        """Undo what a kill between the two renames of `_swap_in` left behind."""
        final, old = self.stage_dir(name), self.root / "stages" / f".{name}.old"
        if old.exists() and not final.exists():
            os.replace(old, final)
        shutil.rmtree(old, ignore_errors=True)
