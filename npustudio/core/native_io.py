"""Native libraries (QNN, Genie) write to file descriptors 1 and 2 directly, past Python's sys.stdout.

One way to point such a descriptor elsewhere for a while: --json output, the streamed answer of
genie-run and the compile stage's tables stay free of their banners.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def fd_redirected(fd: int, target: int | None = None) -> Iterator[int]:
    """Point `fd` at `target` (None: /dev/null); yields a duplicate of the original for writing to it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(fd)
    if target is None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    else:
        os.dup2(target, fd)
    try:
        yield saved
    finally:
        ctypes.CDLL(None).fflush(None)  # native stdio buffers empty where fd points now, not after
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)
