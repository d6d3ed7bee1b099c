"""Sweep workers that pay the start-up once: a process that has imported the CLI (Lightning,
torch, the methods: several seconds) and forks one child per run.

Each run is still a process of its own, exactly as `fl-lightning fit ...` started from a shell:
the child forks from a parent that has only imported modules and built `fit`'s parser (no tensor
op, no thread, no seed drawn), takes the run's arguments as its command line and runs the CLI's
`main`, writing to the run's log; its exit code is the run's. So a run's numbers are those of the
same command started on its own (tests/test_sweep.py checks bit identity), and a crash or kill of
one run ends that child only. A DDP run's further ranks are launched by Lightning as
`python -m fl_lightning.cli <args>`, as for any run, because the worker itself is started as
`python -m fl_lightning.cli _warm_worker`.

Protocol, one JSON object per line: the sweep writes {"args": [...], "log": path}; the worker
answers {"pid": child pid} when the run starts and {"exit": code} when it ends (a negative code is
the signal that killed it). End of input ends the worker.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import traceback

from fl_lightning import compat

COMMAND = "_warm_worker"


# What a run imports only once it runs (W&B's run start, the offline datasets' loaders, the
# analysis pictures): imported here too, so that no run pays them. None of them starts a thread or
# draws a number at import; what they own (W&B's temporary media directory) stays the worker's
# (see _run_child).
LATE_IMPORTS = ("wandb", "wandb.sdk.launch", "sklearn.datasets", "mlxtend.data", "matplotlib.pyplot")


def serve() -> None:
    """The worker's loop (runs in the warm process)."""
    import fl_lightning.lightning_cli as cli  # the start-up every run would otherwise pay

    for name in LATE_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with contextlib.suppress(ImportError):
        compat.list_installed_packages_once()  # W&B's package list, read here once for all runs
    cli.prebuild_parser()  # each forked run parses its own command with a copy of it

    # Ctrl-C reaches the whole foreground group: the runs handle it (clean stop, checkpoint kept);
    # the idle worker must outlive it so the sweep can collect their exit codes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(cli, request["args"], request["log"])
        _answer(pid=pid)
        _, status = os.waitpid(pid, 0)
        _answer(exit=os.waitstatus_to_exitcode(status))


def _answer(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _run_child(cli, args: list[str], log: str) -> None:
    """In the forked child: become `fl-lightning <args>` with output to `log`, then exit."""
    code = 1
    try:
        # What the worker created at import (W&B's media directory, removed by an atexit function
        # and a finalizer) is the worker's: the run's exit must clean up what the run created and
        # nothing under the next run. So the run starts with no exit function or finalizer of the
        # worker's, and its own finalizers still run at its exit.
        compat.forget_exit_handlers()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the request pipe is the worker's, not the run's
        os.close(devnull)
        sys.argv = [sys.argv[0], *args]
        cli.main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as a crashed process reports it
        traceback.print_exc()
        code = 1
    finally:
        compat.run_exit_handlers()  # what interpreter shutdown does for a process started on its own
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class WarmWorker:
    """The sweep's side: one warm process per sweep worker, started with the worker's environment
    (thread limits, GPU), restarted if it dies."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.started_runs = 0

    def launch(self) -> None:
        """Start the worker process (its imports take seconds; the caller can go on meanwhile)."""
        self._ensure()

    def _ensure(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "fl_lightning.cli", COMMAND], env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        return self.proc

    def start(self, args: list[str], log: str) -> int | None:
        """Starts the run; its pid, or None if the worker died before starting it."""
        proc = self._ensure()
        self.started_runs += 1
        try:
            proc.stdin.write(json.dumps({"args": args, "log": log}) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())["pid"]
        except (OSError, ValueError, KeyError):
            return None

    def wait(self) -> int:
        """The started run's exit code (1 if the worker itself died meanwhile)."""
        try:
            return int(json.loads(self.proc.stdout.readline())["exit"])
        except (OSError, ValueError, KeyError, TypeError):
            return 1

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if not self.started_runs:  # still importing, or idle: it holds nothing, so no waiting
                self.proc.kill()
                self.proc.wait()
                return
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
