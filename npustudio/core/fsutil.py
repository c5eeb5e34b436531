"""Atomic file writes and content hashes: a killed process never leaves a half-written file behind.

Nothing here writes through a symbolic link: a link planted where NPU Studio writes (a project's lock,
manifest, chat history...) could otherwise make it overwrite or truncate a file outside, so such a link
is refused with a clear error instead.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import io
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .errors import UserError


def refuse_link(path: Path) -> None:
    """A UserError when `path` is a symbolic link (dangling or not): we never write through one."""
    if Path(path).is_symlink():
        raise UserError(f"{path} is a symbolic link; NPU Studio never writes through links (it could change a "
                        f"file outside the project: {os.readlink(path)}).",
                        "Remove the link (or replace it with a plain file or folder), then try again.")


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` that refuses a symbolic link and anything but a regular file (a FIFO, a device)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise UserError(f"{path} is not a plain file.", "Remove it, then try again.") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path} is not a plain file.", "Remove it, then try again.")
    os.set_blocking(fd, True)
    return fd


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A binary file whose content replaces `path` (synced) only when the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_link(path)  # os.replace would only replace the link, but a link there is a sign of foul play
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL: no link
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Indented JSON, streamed to the file: `json.dumps` with an indent first lists every chunk it will join (one
    string per number), which cost 1.9 GB for a 1B model's 4-bit encodings (15 million block scales)."""
    with atomic_writer(path) as f:
        text = io.TextIOWrapper(f, encoding="utf-8", newline="\n")
        json.dump(obj, text, indent=2, sort_keys=False)
        text.write("\n")
        text.flush()
        text.detach()  # the writer, not the wrapper, closes the file


MiB = 2**20
JSON_LIMIT = 64 * MiB  # a JSON file NPU Studio reads (a config, a result, a profile) is far smaller


class TooLarge(Exception):
    """A file holds more than the bytes its reader takes."""


def read_at_most(path: Path, limit: int, follow: bool = True) -> bytes:
    """The bytes of `path`, or TooLarge when it holds more than `limit`: a user-named file may be a device
    (/dev/zero), a pipe that never ends or a file of gigabytes, and reading it whole would end in the OOM killer.
    A plain file is measured first; anything else is read `limit + 1` bytes deep at most. Without `follow`, a link
    or anything but a plain file is refused (`open_nofollow`): a file NPU Studio keeps for itself is never one."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if follow else open_nofollow(Path(path), os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise TooLarge(f"{path} holds {st.st_size:,} bytes, more than {limit:,}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{path} holds more than {limit:,} bytes")
    return data


def read_json(path: Path, what: str, fix: str, limit: int = JSON_LIMIT) -> Any:
    """A JSON file as Python data, or a UserError naming the file and what is wrong with it (unreadable,
    not UTF-8, not JSON, nested too deeply, larger than `limit` bytes), never a traceback."""
    path = Path(path)
    try:
        text = read_at_most(path, limit).decode("utf-8")
    except TooLarge as e:
        raise UserError(f"{path} is larger than {limit / MiB:g} MiB, more than any {what} is, so it was not "
                        "read.", fix) from e
    except FileNotFoundError as e:
        raise UserError(f"No {what} at {path}.", fix) from e
    except IsADirectoryError as e:
        raise UserError(f"{path} is a folder, not a {what}.", fix) from e
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not a {what}: it is not UTF-8 text (byte {e.start}).", fix) from e
    except OSError as e:
        raise UserError(f"Cannot read the {what} {path}: {e.strerror or e}.", fix) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}), so it is not a "
                        f"readable {what}.", fix) from e
    except RecursionError as e:
        raise UserError(f"{path} is not a readable {what}: its JSON is nested too deeply.", fix) from e


def check_keys(data: Any, valid: Iterable[str], path: Path, what: str, fix: str) -> None:
    """A user-written JSON object holds only `valid` keys: a typo (`weight` for `weights`) would otherwise be
    dropped without a word and its setting silently lost. The UserError names the file, the key and the closest
    valid one."""
    if not isinstance(data, dict):
        return
    valid = list(valid)
    for key in data:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise UserError(f"{path}: unknown key {key!r} in the {what} (valid keys: {', '.join(valid)}).",
                            hint + fix)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def link_or_copy(src: Path, dst: Path) -> None:
    """A later stage reading an earlier stage's big file: a hard link (no bytes copied), else a copy."""
    import shutil

    if dst.exists() or dst.is_symlink():  # a dangling link too: a copy would write through it
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
