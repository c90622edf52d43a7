"""Crash-safe file replacement: a reader sees the old file or the complete new one, never half.

Write to a temporary file in the same directory, fsync it, rename it over the target (atomic
on POSIX within one file system), then fsync the directory so the rename itself survives a
crash. A process killed mid-write leaves the target untouched and a `.NAME.*.tmp` behind.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable


def write_atomic(path: str, chunks: Iterable[bytes],
                 check: Callable[[], None] | None = None) -> int:
    """Writes `chunks` to `path`; returns the bytes written.

    `check` runs after the last chunk and before the rename: raising there (a checksum that
    does not match, a stream that ended early) keeps the old file.
    """
    target = os.path.abspath(path)
    directory, name = os.path.split(target)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                # Chunks are large (a stream message); handing each to the OS keeps memory flat
                # and the temp file shows progress. The target changes only at the rename.
                out.flush()
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        if check is not None:
            check()
        os.replace(temp, target)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    _fsync_directory(directory)
    return size


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
