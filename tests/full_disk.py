"""The fl-lightning CLI on a full disk, met as a user meets it: every writer in the process is
refused, not only the project's atomic writes (tests/killswitch.py's DiskFault), but also PIL's
pictures and W&B's log files, media and tables. Run as
`python -c "import full_disk; full_disk.run_cli()" <CLI arguments>` with PYTHONPATH=tests:
FULL_DISK=<directory> fills the disk under that directory from the start; the callback `FillsUp`
fills it when the run has ended (its last round, records and checkpoint written).

A full disk lets a file be opened, and refuses its bytes: a file created, appended to or grown
there is opened on /dev/full, whose every write, flush and close fails with the kernel's own
ENOSPC. A file rewritten in place (mode "w" on a file that exists) goes on working, as on a real
full disk a rewrite reuses the blocks its truncation frees. The `open` is replaced when this module
is imported, before anything else opens a file, so that `logging.FileHandler`, which keeps the
`open` it found when logging was imported, gets it too. (W&B's core service, a process of its
own, writes unhindered.)"""

import builtins
import io
import os
import runpy
import sys

_real_open = builtins.open
_full: str | None = None  # the directory whose disk is full


def fill(directory: str | os.PathLike) -> None:
    """From now on the disk under `directory` is full: for the files opened from now on, and for
    those this process has open for writing there (W&B's log file), whose descriptors now write to
    /dev/full."""
    global _full
    _full = os.path.realpath(directory)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                flags = int(next(line.split()[1] for line in _real_open(f"/proc/self/fdinfo/{fd}")
                                 if line.startswith("flags:")), 8)
            except (OSError, StopIteration):
                continue  # the descriptor that listed the folder, closed by now
            if _on_the_full_disk(target) and flags & (os.O_WRONLY | os.O_APPEND):
                os.dup2(full, fd)
    finally:
        os.close(full)


def _on_the_full_disk(file) -> bool:
    if _full is None or isinstance(file, int):
        return False
    path = os.path.realpath(os.fsdecode(file))
    return path == _full or path.startswith(_full + os.sep)


def _open(file, mode="r", *args, **kwargs):
    if _on_the_full_disk(file) and (any(m in mode for m in "ax+") or "w" in mode and not os.path.exists(file)):
        _real_open(file, "ab").close()  # the file is created (empty), as on a real full disk
        return _real_open("/dev/full", mode.replace("x", "w").replace("a", "w"), *args, **kwargs)
    return _real_open(file, mode, *args, **kwargs)


builtins.open = io.open = _open

import lightning as L  # noqa: E402 - after `open` is replaced: logging, which Lightning imports, keeps it


class FillsUp(L.Callback):
    """The disk under `directory` fills once the run has ended, before its loggers and W&B close."""

    def __init__(self, directory: str):
        self.directory = directory

    def teardown(self, trainer, pl_module, stage) -> None:
        fill(self.directory)


def run_cli() -> None:
    if os.environ.get("FULL_DISK"):
        fill(os.environ["FULL_DISK"])
    sys.argv[0] = "fl-lightning"
    runpy.run_module("fl_lightning.cli", run_name="__main__", alter_sys=True)
