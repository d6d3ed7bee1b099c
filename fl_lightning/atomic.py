"""Atomic file writes: a reader, or a process killed mid-write, sees either a file's old content or
all of its new content, never a part. Every file the project writes inside a run directory (round
checkpoints, client-state files, metrics.csv, summary.json, the analyses' JSON files and pictures,
sweep records, the data cache) goes through `atomic_write_bytes`; the temporaries it leaves behind
when killed carry `TEMP_MARK` and are removed by `remove_stray_temporaries` on the next start.
(clients.csv is appended to and forced to disk instead, and cut back atomically on resume.)"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TEMP_MARK = ".partial-"


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write `data` to `path` so that a reader (or a process killed mid-write) sees either the old
    content or all of the new one: temp file in the same directory, fsync, rename, fsync the dir.

    `durable=False` leaves out the two fsyncs (each a wait on the disk, long on a shared one): the
    write is still atomic for readers and for a killed process, but a crash of the machine itself
    may lose it. For files rebuilt from the (durable) round checkpoint when a run resumes."""
    path = Path(path)
    temp = path.with_name(f"{TEMP_MARK}{os.getpid()}-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as err:
        # a full disk keeps no half-written temporary (it would hold the space a resume needs),
        # nor does a signal; and the error names the file being written (f.write's does not)
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename in (None, str(temp)):
            err.filename = str(path)
        raise
    if not durable:
        return
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself must reach the disk before we call the round saved
    finally:
        os.close(fd)


def remove_stray_temporaries(directory: str | Path) -> list[Path]:
    """Temporary files left by a process killed mid-write; safe to delete only while holding the
    run directory's lock (rundir.py), when no other process can be writing them."""
    directory = Path(directory)
    stray = sorted(directory.glob(f"{TEMP_MARK}*")) if directory.is_dir() else []
    for path in stray:
        path.unlink(missing_ok=True)
    return stray
