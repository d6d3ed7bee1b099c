"""The local runner (`fl-lightning sweep --local`): a sweep's runs on this machine, without W&B.

N worker threads take runs from one queue; each hands its run to a warm worker (fl_lightning/warm.py),
a process that has imported the CLI once and forks one process per run, so a run is still exactly
`fl-lightning fit ...` started on its own. Workers get a GPU each, or on CPU an equal share of the
cores. Each run is offline in `<root>/<sweep>/<run-name>/` and grouped in W&B by the sweep name.

A sweep is meant to be interrupted and started again. Whether a run still has to run is read from
its own directory (`run_state`: its recorded outcome, its checkpoint), never from the sweep's
bookkeeping: finished runs are skipped, runs with a checkpoint resume with `--ckpt_path last`, and
runs without one start over with `--overwrite true`. The bookkeeping (each run's command,
parameters, status, exit code, error line and log) lives in `<root>/<sweep>/.sweep/`, never inside
a run directory; `report` reads the same records to say why a run is missing from its table, and
the sweep reads them to find a run it recorded under another name than the one it would give it
now (`recorded_names`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.errors import FLUserError
from fl_lightning.outcome import Outcome, read_outcome
from fl_lightning.sweep.commands import PlannedRun
from fl_lightning.sweep.records import read_json, read_record
from fl_lightning.sweep.spec import Spec
from fl_lightning.warm import WarmWorker

# ---------------------------------------------------------------------------------------------
# Run state on disk


def run_state(run_dir: Path) -> str:
    """The run's final outcome (finished, diverged or failed: not run again; outcome.read_outcome,
    the one reader of outcomes), else resume (has a checkpoint), restart (used directory without a
    checkpoint) or new."""
    outcome = read_outcome(run_dir)
    if outcome is not None and outcome.final:
        return outcome.value
    if (run_dir / "checkpoints" / "last.ckpt").exists():
        return "resume"
    if run_dir.exists() and any(run_dir.iterdir()):
        return "restart"
    return "new"


# the states of a run that is over (not run again, counted by `report`): Outcome.final's, by name
FINAL_STATES = tuple(outcome.value for outcome in Outcome if outcome.final)


def error_line(log: Path) -> str:
    """The line that says why a run stopped: the CLI's `error:` line, else a traceback's last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("error:"):
            return line
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------
# Workers


def available_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def gpu_indices(text: str | None) -> list[str] | None:
    """The indices `--gpus` names, checked for their form only (which GPUs exist is `parse_gpus`'s)."""
    if text is None:
        return None
    ids = [t.strip() for t in text.split(",") if t.strip()]
    if not ids or not all(t.isdigit() for t in ids):
        raise FLUserError(f"--gpus {text!r}: give GPU indices separated by commas, e.g. --gpus 0,1")
    return ids


def parse_gpus(text: str | None, count: int) -> list[str] | None:
    ids = gpu_indices(text)
    if ids is None:
        return None
    absent = [t for t in ids if int(t) >= count]
    if absent:
        raise FLUserError(f"--gpus {text}: no GPU {', '.join(absent)} on this machine ({count} visible GPU"
                          f"{'' if count == 1 else 's'}{': 0..' + str(count - 1) if count else ''})")
    return ids


def worker_envs(workers: int, gpus: list[str] | None, cores: int) -> list[dict[str, str]]:
    """One environment per worker: a GPU each (round robin over `gpus`), or on CPU an equal share
    of the cores through the thread limits torch and BLAS read at start-up."""
    envs = []
    for i in range(workers):
        if gpus:
            envs.append({"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]})
        else:
            threads = str(max(1, cores // workers))
            envs.append({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads})
    return envs


def warm_workers(spec: Spec, envs: list[dict[str, str]], root: Path) -> list[WarmWorker]:
    """One warm worker per environment, started now: each imports the CLI in a process of its own
    while this one parses every command (which imports the CLI too), so the two waits overlap. Its
    runs leave the pictures other runs draw the same (the partition) in `.sweep/pictures/`."""
    from fl_lightning.analysis.plots import SHARED_PICTURES_ENV  # matplotlib: only once runs start
    common = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_RUN_GROUP": spec.name,
              SHARED_PICTURES_ENV: str((root / spec.name / ".sweep" / "pictures").absolute())}
    workers = [WarmWorker({**common, **env}) for env in envs]
    for worker in workers:
        worker.launch()
    return workers


# ---------------------------------------------------------------------------------------------
# The sweep


class LocalSweep:
    """The runs of one spec below `root`, run by `workers` (one thread each), or listed (`dry_run`)."""

    def __init__(self, spec: Spec, runs: list[PlannedRun], root: Path, workers: list[WarmWorker]):
        self.spec, self.runs, self.workers = spec, runs, workers
        self.sweep_dir = root / spec.name
        self.meta = self.sweep_dir / ".sweep"
        self.lock = threading.Lock()
        self.procs: dict[int, int] = {}  # worker -> pid of the run it is running
        self.stopping = False
        self.outcomes: dict[str, str] = {}

    def record_path(self, run: PlannedRun) -> Path:
        return self.meta / f"{run.name}.json"

    def write_record(self, run: PlannedRun, **fields) -> dict:
        path = self.record_path(run)
        record = read_record(path) or {}
        record.update(name=run.name, index=run.index, params=run.params, **fields)
        atomic_write_bytes(path, json.dumps(record, indent=1, default=str).encode())  # never half-written
        return record

    def command(self, run: PlannedRun) -> tuple[list[str], str]:
        state = run_state(self.sweep_dir / run.name)
        extra = {"resume": ["--ckpt_path=last"], "restart": ["--overwrite=true"]}.get(state, [])
        return [*run.args, *extra], state

    def dry_run(self) -> None:
        for run in self.runs:
            args, state = self.command(run)
            if state in FINAL_STATES:
                print(f"# {state}: {run.name}")
            else:
                print(shlex.join(["fl-lightning", *args]))

    def _say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)

    def _work(self, worker: int, todo: queue.Queue) -> None:
        warm = self.workers[worker]  # paid the imports once; each run is a process forked from it
        try:
            self._work_with(worker, todo, warm)
        finally:
            warm.close()

    def _work_with(self, worker: int, todo: queue.Queue, warm: WarmWorker) -> None:
        while not self.stopping:
            try:
                run = todo.get_nowait()
            except queue.Empty:
                return
            args, state = self.command(run)
            if state in FINAL_STATES:
                self.outcomes[run.name] = state
                continue
            log = self.meta / f"{run.name}.log"
            attempts = (read_record(self.record_path(run)) or {}).get("attempts", 0) + 1
            self.write_record(run, command=["fl-lightning", *args], status="running", attempts=attempts,
                              worker=worker, started=time.time(), exit_code=None, error=None)
            self._say(f"[worker {worker}] {'resume' if state == 'resume' else 'start'} {run.name}")
            began = time.time()
            with open(log, "a") as out:
                out.write(f"$ {shlex.join(['fl-lightning', *args])}\n")
            pid = warm.start(args, str(log))
            if pid is None:
                code = 1
            else:
                with self.lock:
                    self.procs[worker] = pid
                code = warm.wait()
                with self.lock:
                    self.procs.pop(worker, None)
            if self.stopping:
                return
            self.write_record(run, exit_code=code, ended=time.time())
            final = run_state(self.sweep_dir / run.name)
            if final in FINAL_STATES:
                summary = read_json(self.sweep_dir / run.name / "summary.json") or {}
                acc = summary.get("final_acc")
                detail = f", final acc {acc:.4f}" if isinstance(acc, (int, float)) else ""
                self.write_record(run, status=final, error=error_line(log) if final != "finished" else None)
                self._say(f"[worker {worker}] {final} {run.name} ({time.time() - began:.0f} s{detail})")
            else:
                line = (error_line(log) or f"exit code {code}") if code else "exited without a finished summary.json"
                self.write_record(run, status="crashed", error=line)
                self._say(f"[worker {worker}] FAILED {run.name} (exit {code}): {line}")
            self.outcomes[run.name] = final if final in FINAL_STATES else "crashed"

    def run(self) -> int:
        self.meta.mkdir(parents=True, exist_ok=True)
        (self.sweep_dir / ".sweep" / "spec.yaml").write_text(yaml.safe_dump(self.spec.config, sort_keys=False))
        todo: queue.Queue = queue.Queue()
        for run in self.runs:
            todo.put(run)
        already = sum(run_state(self.sweep_dir / r.name) in FINAL_STATES
                      for r in self.runs)
        print(f"sweep {self.spec.name}: {len(self.runs)} runs ({already} already done) on {len(self.workers)} "
              f"worker{'s' if len(self.workers) != 1 else ''} in {self.sweep_dir}", flush=True)
        began = time.time()
        threads = [threading.Thread(target=self._work, args=(i, todo), daemon=True) for i in range(len(self.workers))]
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=0.5)
        except KeyboardInterrupt:
            self._stop()
            done = sum(v in FINAL_STATES for v in self.outcomes.values())
            print(f"interrupted: {done} runs done; run the same command again to continue (finished runs are "
                  f"skipped, the others resume)", file=sys.stderr, flush=True)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        crashed = sorted(n for n, v in self.outcomes.items() if v == "crashed")
        counts = {s: sum(v == s for v in self.outcomes.values()) for s in (*FINAL_STATES, "crashed")}
        print(f"sweep {self.spec.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
              + f" in {time.time() - began:.0f} s", flush=True)
        for name in crashed:
            print(f"  failed run {name}: see {self.meta / (name + '.log')}", flush=True)
        return 1 if crashed else 0

    def _stop(self) -> None:
        """Stop the running fits (each checkpoints per round, so nothing finished is lost)."""
        self.stopping = True
        with self.lock:
            pids = list(self.procs.values())
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        for pid in filter(_alive, pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """A run forked by a warm worker (not this process's child: its worker reaps it at once)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
