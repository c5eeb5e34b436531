"""A deploy project: a folder with a typed manifest and one output folder per stage.

A stage runs in a scratch folder and is swapped in only when it finished, so a killed stage leaves
the previous good outputs and manifest untouched and simply reruns from its start next time.
A stage whose inputs and options are unchanged (same key) and whose outputs are intact is skipped.
"Intact" means the same content (sha256) as recorded; the hash is only recomputed when a file's size or
mtime differ from the record, so an unchanged multi-GB output costs a stat, not a re-read. Nothing is
written through a symbolic link planted in the project folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_serializer,
    field_validator,
)

from . import layout
from .errors import UserError
from .fsutil import atomic_write_text, open_nofollow, refuse_link, sha256_file, sha256_json
from .progress import Cancelled, peak_rss_mb
from .stage_options import AdaptOptions, LoraAdapter, QuantizeOptions, _known_soc, default
from .stages import O, R, StageSpec

SCHEMA_VERSION = 1
STAGE_NOTE = "NPU Studio stage: "  # added to an unexpected exception, so the CLI can say where it happened
# (device, inode, size, mtime_ns) -> sha256, for this process: a file hard-linked into a later stage (compile's
# copy of the quantize weights, the bundle's binaries) is hashed once, and a stage's outputs once as it ends
_hashes: dict[tuple[int, int, int, int], str] = {}


class FileRecord(BaseModel):
    path: str  # relative to the project folder
    bytes: int
    sha256: str
    mtime_ns: int | None = None  # when the stage wrote it: same size and mtime => same content, no re-hash


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
    peak_rss_mb: float = 0.0  # this process's: a cluster run's own peak is in its result
    error: str | None = None
    ran_on: str | None = None  # None: this computer


@dataclass(frozen=True)
class Done(Generic[O, R]):
    """A finished stage's record with the options it ran with and its result, read as its declaration types them
    (`StageSpec.options`, `StageSpec.result`): a field an older record lacks reads as the model's default."""

    record: StageRecord
    options: O
    result: R

    @classmethod
    def of(cls, spec: StageSpec[O, R], record: StageRecord) -> Done[O, R]:
        """`record` read as `spec` types it; a damaged record is a UserError that says how to redo the stage."""
        try:
            return cls(record, spec.options.model_validate(record.options), spec.result.model_validate(record.result))
        except ValidationError as e:
            first = e.errors()[0]
            raise UserError(f"The project's record of its {spec.name} stage is damaged "
                            f"({'.'.join(map(str, first['loc']))}: {first['msg']}).",
                            f"Redo the stage: `npustudio {spec.command} --project P --force`.") from e


class Deployed(BaseModel):
    """The project's bundle as it was last put on a device (`pipeline.deploy`)."""

    device: str  # the device's serial
    remote_dir: str
    bundle: str  # the bundle stage's key: a newer bundle makes the deploy stale
    at: float | None = None  # time.time() of the deploy


class Choices(BaseModel):
    """What the user picked before a stage ran, so a reopened project shows it again. Stored as a JSON object
    holding only the picks made (an unpicked field reads as its default and is not written), so a project file
    reads as it did before; a key this version does not know is kept as it is, for the version that wrote it."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"  # a model spec (core/model_source.py); "default": the embedded model
    cl: int = default(AdaptOptions, "cl")
    target: str | None = None  # a SoC of core/targets.py; None: not picked yet (the Target step is to do)
    deployed: Deployed | None = None
    lora: tuple[LoraAdapter, ...] = ()  # LoRA adapters merged into the model before adaptation (core/lora.py)
    lora_switchable: bool = False  # ... or kept apart, as graph inputs: one bundle answers with any of them

    check_target = field_validator("target")(_known_soc)  # as the stage options check theirs

    @property
    def target_soc(self) -> str:
        """The picked target, else the quantize stage's default one."""
        return self.target or default(QuantizeOptions, "target")

    def chosen(self, name: str) -> bool:
        """Whether the user picked `name` (a field's default is no pick)."""
        return name in self.model_fields_set and getattr(self, name, None) is not None


class Manifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    stages: dict[str, StageRecord] = Field(default_factory=dict)
    # Failures and cancels are kept apart so they never replace the last good record.
    attempts: dict[str, StageRecord] = Field(default_factory=dict)
    # What the user picked before a stage ran (model, target, ...), so a reopened project shows it again.
    choices: Choices = Field(default_factory=Choices)

    @field_validator("choices", mode="wrap")
    @classmethod
    def _keep_the_valid_picks(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Choices:
        """A pick this version refuses (a SoC since dropped from the table, a value of another type) is dropped
        rather than making the whole project unreadable: it is a convenience, picked again in a click."""
        picks = v
        while True:
            try:
                return handler(picks)
            except (UserError, ValidationError) as e:
                if not isinstance(picks, dict):
                    raise
                # a UserError: the SoC table's refusal of the target, the one check that raises one
                bad = {"target"} if isinstance(e, UserError) else {err["loc"][0] for err in e.errors() if err["loc"]}
                if not bad & picks.keys():
                    raise
                picks = {k: x for k, x in picks.items() if k not in bad}

    @field_serializer("choices")
    def _only_the_picks(self, c: Choices) -> dict[str, Any]:
        return c.model_dump(mode="json", exclude_unset=True)


StageFn = Callable[[Path], dict[str, Any]]
"""Runs a stage into a scratch folder and returns its result record (JSON-able)."""


class Project:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()

    # ----- manifest -----
    @property
    def manifest_path(self) -> Path:
        return self.root / layout.MANIFEST

    def stage_dir(self, name: str) -> Path:
        return layout.stage_dir(self.root, name)

    @classmethod
    def open(cls, root: Path | str, create: bool = True) -> Project:
        p = cls(root)
        try:
            p._open(create)
        except OSError as e:
            raise _disk_error(p.root, e) from e
        return p

    def _open(self, create: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"{self.root} is a file, not a project folder.", "Choose a folder for the project.")
        refuse_link(self.manifest_path)
        if not self.manifest_path.exists():
            if not create:
                raise UserError(f"{self.root} is not an NPU Studio project (no {layout.MANIFEST}).",
                                "Create it with `npustudio adapt MODEL --project DIR` or pick another folder.")
            if self.root.exists() and any(self.root.iterdir()):
                raise UserError(f"{self.root} is not empty and is not an NPU Studio project.",
                                "Pick an empty or new folder for the project, so no file of yours is touched.")
            self.root.mkdir(parents=True, exist_ok=True)
            self.save(Manifest())
        self.load()  # validates
        self._remove_stale_scratch()

    def _remove_stale_scratch(self) -> None:
        """Remove what killed stages left (`stages/.X.partial`, often gigabytes), which stayed until that stage ran
        again. Only while this process can take the project lock: a stage that is running holds it the whole time
        its scratch folder exists, so its folder is never touched. Best effort: a project that cannot be locked
        (read-only, busy) is opened as it is."""
        stages = self.root / layout.STAGES_DIR
        try:
            if stages.is_symlink() or not any(_is_scratch(d) for d in stages.iterdir()):
                return
            with self._lock():
                for d in stages.iterdir():
                    if _is_scratch(d):
                        shutil.rmtree(d) if d.is_dir() and not d.is_symlink() else d.unlink()
        except (OSError, UserError):
            return

    def load(self) -> Manifest:
        try:
            return Manifest.model_validate_json(self.manifest_path.read_text())
        except (ValidationError, ValueError) as e:
            raise UserError(f"The project manifest {self.manifest_path} is damaged: {e.__class__.__name__}.",
                            "Restore it from a backup or start a new project folder.") from e
        except OSError as e:
            raise _disk_error(self.root, e) from e

    def save(self, manifest: Manifest) -> None:
        try:
            atomic_write_text(self.manifest_path, manifest.model_dump_json(indent=2) + "\n")
        except OSError as e:
            raise _disk_error(self.root, e) from e

    def record(self, spec: StageSpec[O, R]) -> Done[O, R] | None:
        """The stage's finished record, typed (None when it has not finished)."""
        rec = self._record(spec.name)
        return Done.of(spec, rec) if rec is not None and rec.status == "done" else None

    def _record(self, name: str) -> StageRecord | None:
        return self.load().stages.get(name)

    def rerun_options(self, spec: StageSpec[O, R], **shown: Any) -> O:
        """The options a view reruns the stage with: the values it shows, and for every option it does not show
        the value the stage last ran with (`quantize --seed 1` from the command line stays 1 when the window reruns
        it), else the default. A value the options refuse is a UserError that names it."""
        rec = self._record(spec.name)
        try:
            return spec.options.model_validate({**(rec.options if rec is not None else {}), **shown})
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"]))
            raise UserError(f"The {spec.name} option {where} is not valid: {err['msg']}.",
                            "Change it on the page, or rerun the stage from the command line with a valid value."
                            ) from e

    def choices(self) -> Choices:
        return self.load().choices

    def choose(self, **values: Any) -> None:
        """Remember the user's picks (fields of `Choices`) in the manifest; a value it refuses (an unknown SoC)
        is a UserError, and nothing is written."""
        unknown = set(values) - set(Choices.model_fields)
        if unknown:
            raise TypeError(f"not a project choice: {', '.join(sorted(unknown))}")
        m = self.load()
        try:
            m.choices = Choices.model_validate({**m.choices.model_dump(exclude_unset=True), **values})
        except ValidationError as e:
            raise UserError(f"Not a valid project choice: {e.errors()[0]['msg']} ({', '.join(values)}).",
                            "Pick another value.") from e
        self.save(m)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """One process per project. The lock file is never truncated and never followed if it is a link."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = open_nofollow(self.root / layout.LOCK, os.O_WRONLY | os.O_CREAT)
        except OSError as e:
            raise _disk_error(self.root, e) from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise UserError(f"Another NPU Studio process is working on {self.root}.",
                                "Wait for it to finish or stop it, then try again.") from e
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def remove_if_unused(self, existed: bool, cheap: Collection[str] = ()) -> bool:
        """Undo the making of this project by a command that was refused before it did any work, so a typo in a
        model name or an option leaves no folder behind. Only when no stage but the `cheap` ones (redone in
        seconds: reading the model's config) ran, finished or not, and the folder holds nothing but what a project
        makes (`layout.PROJECT_ENTRIES`); under the lock, so a project another process works on stays. The caller
        says the folder is its own: a folder that `existed` (empty, as `open` requires) is emptied, a new one
        removed. True when done; anything in the way leaves it as it is (the command's own error matters more)."""
        try:
            with self._lock():
                m = self.load()
                if (set(m.stages) | set(m.attempts)) - set(cheap):
                    return False
                entries = list(self.root.iterdir())
                if any(e.name not in layout.PROJECT_ENTRIES for e in entries):
                    return False
                for e in entries:
                    shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
            if not existed:
                self.root.rmdir()
            return True
        except (OSError, UserError):
            return False

    # ----- stages -----
    def is_current(self, name: str, key: str) -> bool:
        rec = self._record(name)
        if rec is None or rec.status != "done" or rec.key != key:
            return False
        return not self.changed(name)

    def changed(self, name: str) -> list[str]:
        """The outputs of a stage whose content differs from its record (edited, replaced by a link, gone).

        The one notion of "intact" for skipping a stage and for requiring it: content hashes, recomputed
        only for a file whose size or mtime differs from the record."""
        rec = self._record(name)
        return [fr.path for fr in (rec.outputs if rec else []) if not self._intact(fr)]

    def _intact(self, fr: FileRecord) -> bool:
        f = self.root / fr.path
        try:
            st = os.lstat(f)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != fr.bytes:
            return False
        if fr.mtime_ns is not None and st.st_mtime_ns == fr.mtime_ns:
            return True
        return _content_hash(f, st) == fr.sha256

    def _remember_mtimes(self, name: str) -> None:
        """After a check found every output intact: record the mtimes of those that were re-hashed (touched, or
        recorded before mtimes were), so the next check is a stat again. Called under the project lock."""
        m = self.load()
        dirty = False
        for fr in m.stages[name].outputs:
            mtime = os.lstat(self.root / fr.path).st_mtime_ns
            if fr.mtime_ns != mtime:
                fr.mtime_ns, dirty = mtime, True
        if dirty:
            self.save(m)

    def run_stage(self, name: str, inputs: dict[str, Any], options: dict[str, Any], fn: StageFn,
                  force: bool = False, ran_on: str | None = None) -> tuple[StageRecord, bool]:
        """Run `fn` unless an identical finished run exists (wherever it ran: `ran_on` names a cluster, the
        same files are made). Returns (record, ran)."""
        key = sha256_json({"stage": name, "inputs": inputs, "options": options})
        with self._lock():
            scratch = layout.scratch_dir(self.root, name)
            for d in (scratch.parent, scratch, self.stage_dir(name), layout.old_dir(self.root, name)):
                refuse_link(d)
            self._recover(name)
            if not force and self.is_current(name, key):
                self._remember_mtimes(name)
                return self.load().stages[name], False
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                scratch.mkdir(parents=True)
            except OSError as e:
                raise _disk_error(self.root, e) from e
            started = datetime.now(UTC)
            t0 = time.perf_counter()
            try:
                result = fn(scratch)
            except BaseException as e:
                status = "cancelled" if isinstance(e, Cancelled | KeyboardInterrupt) else "failed"
                if not isinstance(e, UserError | Cancelled | KeyboardInterrupt):
                    e.add_note(STAGE_NOTE + name)
                shutil.rmtree(scratch, ignore_errors=True)
                m = self.load()
                m.attempts[name] = StageRecord(name=name, status=status, key=key, inputs=inputs,
                                               options=options, started=started,
                                               seconds=time.perf_counter() - t0, error=str(e))
                self.save(m)
                if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                    raise _disk_full(self.root, name, e) from e
                raise
            final = self.stage_dir(name)
            outputs = [
                FileRecord(path=str((final / f.relative_to(scratch)).relative_to(self.root)),
                           bytes=st.st_size, sha256=_content_hash(f, st), mtime_ns=st.st_mtime_ns)
                for f, st in ((f, f.stat()) for f in sorted(scratch.rglob("*")) if f.is_file())
            ]
            rec = StageRecord(name=name, status="done", key=key, inputs=inputs, options=options,
                              outputs=outputs, result=result, started=started,
                              seconds=time.perf_counter() - t0, peak_rss_mb=peak_rss_mb(), ran_on=ran_on)
            self._swap_in(name, scratch)
            m = self.load()
            m.stages[name] = rec
            m.attempts.pop(name, None)
            self.save(m)
            return rec, True

    def _swap_in(self, name: str, scratch: Path) -> None:
        final, old = self.stage_dir(name), layout.old_dir(self.root, name)
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(scratch, final)
        shutil.rmtree(old, ignore_errors=True)

    def _recover(self, name: str) -> None:
        """Undo what a kill between the two renames of `_swap_in` left behind."""
        final, old = self.stage_dir(name), layout.old_dir(self.root, name)
        if old.exists() and not final.exists():
            os.replace(old, final)
        shutil.rmtree(old, ignore_errors=True)


def _is_scratch(path: Path) -> bool:
    """A stage's scratch folder (`layout.scratch_dir`) by its name."""
    return path.name.startswith(".") and path.name.endswith(layout.SCRATCH_SUFFIX)


def _disk_full(root: Path, stage: str, e: OSError) -> UserError:
    """A stage that filled the disk: its half-written output is already gone; say how much is free now."""
    free = shutil.disk_usage(root).free / 1e9
    return UserError(f"The disk holding {root} filled up while the {stage} stage wrote its output "
                     f"({e.filename or 'a file'}); {free:.1f} GB are free now that its partial output is removed.",
                     f"Free space on that disk (a stage's new output sits beside its previous one until it is "
                     f"complete), then run the {stage} stage again. The project keeps its last finished stages.")


def _disk_error(root: Path, e: OSError) -> UserError:
    """The project folder cannot be created, read or written (read-only or missing file system, no rights)."""
    where = e.filename or root
    return UserError(f"NPU Studio cannot use the project folder {root}: {e.strerror or e} ({where}).",
                     "Pick a project folder on a disk that is mounted and writable (--project DIR), or free "
                     "space / fix the permissions there.")


def _content_hash(f: Path, st: os.stat_result) -> str:
    """`f`'s sha256, from the cache while its inode, size and mtime (`st`) are those it was hashed at."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _hashes:
        _hashes[key] = sha256_file(f)
    return _hashes[key]
