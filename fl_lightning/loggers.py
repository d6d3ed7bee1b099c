"""W&B logging that never blocks on the network: offline unless the user is logged in, and whose
runs work as dashboards: every per-round metric is plotted against the round, the config is the
complete resolved CLI config, runs are grouped by experiment (`<setting>/<method>`, from the config
files' names) and tagged by method, dataset and partition."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from fl_lightning import compat
from fl_lightning.config_files import run_name_from_configs
from fl_lightning.outcome import uninterrupted
from fl_lightning.wandb_online import wandb_logged_in


class FLWandbLogger(WandbLogger):
    """WandbLogger whose `offline` defaults to "not logged in" (or WANDB_MODE); upload an offline
    run later with `wandb sync <dir>`."""

    def __init__(self, offline: bool | None = None, project: str = "fl-lightning", save_dir: str | None = None,
                 **kwargs):
        # The CLI sets save_dir to the run's trainer.default_root_dir, so each run keeps its config,
        # checkpoints and W&B files together.
        save_dir = save_dir or "runs"
        if offline is None:
            mode = os.environ.get("WANDB_MODE", "")
            offline = mode in ("offline", "dryrun", "disabled") or not wandb_logged_in()
        super().__init__(offline=offline, project=project, save_dir=save_dir, **kwargs)
        if compat.wandb_init_kwargs(self).get("anonymous") is None:
            # Lightning passes anonymous=None, which W&B (>= 0.19) warns about at every start
            compat.wandb_init_kwargs(self).pop("anonymous", None)
        self._resolved_config: dict[str, Any] | None = None
        self._row: dict[str, Any] = {}  # the current round's W&B history row, sent when the round ends
        # validate/test/analyze of a checkpoint: the round it holds (Lightning's epoch is 0 there)
        self.checkpoint_round: int | None = None
        # a resumed fit: the first step its W&B run does not hold yet (the parts before logged the rest)
        self.first_step = 0
        self._starting: Future | None = None  # the W&B run's start, in a thread of its own (start_run)

    def describe_run(self, config: Mapping[str, Any], group: str | None, tags: list[str]) -> None:
        """The run's W&B config, group and tags; called by the CLI before the run is created (W&B
        takes group and tags only at creation). The user's own group/tags win."""
        self._resolved_config = without_internal_keys(dict(config))
        init = compat.wandb_init_kwargs(self)
        init["config"] = self._resolved_config
        if group and not init.get("group"):
            init["group"] = group
        init["tags"] = list(dict.fromkeys([*(init.get("tags") or []), *tags]))

    @property
    def experiment(self):
        """The W&B run. Lightning asks for it while it sets the fit up, only so that it is created:
        it is then started in a thread of its own (`start_run`) and a `StartingRun` stands for it,
        so the first round does not wait for W&B; what uses the run waits for its start."""
        if compat.wandb_run_created(self) or rank_zero_only.rank != 0:
            return super().experiment
        self.start_run()
        return self.started_run() if self._starting.done() else StartingRun(self)

    def start_run(self) -> None:
        """Starts the W&B run (rank 0, once): what the rest of the fit relies on at once is done here
        (W&B's directories kept writable, before the first table is staged; the offline mode),
        `wandb.init` in a thread of its own, whose error `started_run` raises where the run is used.
        Created here rather than by Lightning, whose WandbLogger would make its own
        `trainer/global_step` the x-axis of every metric; here it is the round (1-based). Created
        on first use, not at construction: a start that fails leaves no directory."""
        if self._starting is not None or compat.wandb_run_created(self) or rank_zero_only.rank != 0:
            return
        compat.skip_unstaged_wandb_launch_inputs()
        compat.poll_wandb_service_often()
        Path(self.save_dir).mkdir(parents=True, exist_ok=True)
        moved = keep_wandb_dirs_writable(self.save_dir)
        if moved:
            rank_zero_info(moved)
        if compat.wandb_offline(self):
            os.environ["WANDB_MODE"] = "offline"
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-lightning-wandb")
        self._starting = worker.submit(_init_run, dict(compat.wandb_init_kwargs(self)))
        worker.shutdown(wait=False)
        _STARTING.add(self._starting)

    def started_run(self):
        """The W&B run once started: waits for its start, and raises what stopped it."""
        if not compat.wandb_run_created(self) and rank_zero_only.rank == 0:
            self.start_run()
            compat.set_wandb_run(self, self._starting.result())
        return super().experiment

    @property
    def version(self) -> str | None:
        """The W&B run's id (Lightning's, e.g. a ModelCheckpoint's folder): once a start is under way,
        the started run's, as when the run was created before the fit's first round."""
        if self._starting is not None:
            self.started_run()
        return super().version

    def _start_failed(self) -> bool:
        """The W&B run's start (waited for) raised an error."""
        return self._starting is not None and self._starting.exception() is not None

    def __getstate__(self):
        if self._starting is not None:
            self.started_run()
        state = super().__getstate__()
        state.pop("_starting", None)  # the run's id and name are in the state: a copy does not start it again
        return state

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Everything of a round goes into one W&B history row (metrics, media, tables), sent when
        the next round's first value arrives or the run ends. Lightning's `epoch` (0-based, one
        epoch is one round) becomes `round`; its step counter is not logged."""
        metrics = dict(metrics)
        epoch = metrics.pop("epoch", None)
        if self.checkpoint_round is not None:
            metrics["round"] = float(self.checkpoint_round)
        elif "round" not in metrics and epoch is not None:
            metrics["round"] = float(epoch) + 1
        self.add_to_round(metrics)

    def add_to_round(self, values: Mapping[str, Any]) -> None:
        """Adds `values` (scalars, wandb media, or futures of them) to the row of their `round`."""
        if self._row and values.get("round", self._row.get("round")) != self._row.get("round"):
            self.flush_round()
        self._row.update(values)

    def filling_round(self) -> bool:
        """A round's history row holds values not sent yet."""
        return bool(self._row)

    def flush_round(self) -> None:
        """Sends the round's row at W&B step = its round, so that `_step` is the round in every part
        of a resumed run too (W&B's own counter would start again at 0 in a resumed offline part).
        W&B commits a row once a later step arrives or the run ends, so values of the same round
        sent after it still join it. A round below `first_step` or the W&B run's step is one the run
        holds already: a fit stopped after logging a round and before its checkpoint trains that
        round again on resume (the same numbers), and online W&B resumes at the step after it (it
        would refuse the row with a warning); offline, both parts would hold the step."""
        if self._row:
            row, self._row = self._row, {}
            # a value still being made in the background (a future) is waited for: the row keeps its place
            row = {k: v.result() if isinstance(v, Future) else v for k, v in row.items()}
            step = row.get("round")
            run = self.started_run()
            with uninterrupted():
                if step is None:
                    run.log(row)
                elif int(step) >= max(self.first_step, getattr(run, "step", 0) or 0):
                    run.log(row, step=int(step))

    def finalize(self, status: str) -> None:
        if status != "success" and self._start_failed():
            return  # the run has its own error already; W&B's start failing is not the one to report
        self.flush_round()
        if status == "success":
            self.started_run()  # a run that sent no row yet still ends with its W&B start's error
        super().finalize(status)

    def log_hyperparams(self, params) -> None:
        # With the CLI's resolved config in place, the module's and data module's hyperparameters
        # (a subset of it, plus internal keys such as `_instantiator`) would only duplicate it.
        if self._resolved_config is None:
            super().log_hyperparams(without_internal_keys(dict(params)))


class StartingRun:
    """Stands for a W&B run while it starts in the background (`FLWandbLogger.experiment`): any use
    of it waits for the start, and is then the run's own."""

    def __init__(self, logger: FLWandbLogger):
        self._logger = logger

    def __getattr__(self, name: str):
        return getattr(self._logger.started_run(), name)


_STARTING: set[Future] = set()  # the W&B runs' starts not known to be over (wait_for_wandb_starts)


def _init_run(init: dict[str, Any]):
    """The W&B run of `wandb.init(**init)` (the process's run, when one is open), its metrics
    plotted against the round."""
    import wandb

    run = wandb.run if wandb.run is not None else wandb.init(**init)
    if getattr(run, "define_metric", None) is not None:
        run.define_metric("round")
        run.define_metric("*", step_metric="round", step_sync=True)
    return run


def wait_for_wandb_starts() -> None:
    """Waits for every W&B run's start still under way, so that the run it opened is the one closed
    (`wandb.run`) and no start outlives the command. Their errors stay with their loggers, which
    raise them where the run is used: a command that an error already ended keeps that error."""
    wait(list(_STARTING))
    _STARTING.clear()


# W&B's directories outside the run's own: the staging folder of the tables it logs (WANDB_DATA_DIR)
# and its cache, which holds its service's log files (WANDB_CACHE_DIR). Both default to the user's
# home (~/.local/share/wandb and ~/.cache/wandb, or where XDG_DATA_HOME and XDG_CACHE_HOME say).
WANDB_HOME_DIRS = {"WANDB_DATA_DIR": ("data", "staging files"), "WANDB_CACHE_DIR": ("cache", "cache")}
_moved: dict[str, str] = {}  # the variables set by keep_wandb_dirs_writable, not by the user


def keep_wandb_dirs_writable(save_dir: str | Path) -> str | None:
    """Where the home directory cannot hold W&B's directories (a HOME that is a file, read-only or
    another user's, an XDG_* directory alike), they move into the run's `wandb/` folder
    (`wandb/data`, `wandb/cache`), so that the run goes on, as it does without its matplotlib and
    dataset caches; left there, W&B's staging would fail the run at its first table. A directory the
    user set (WANDB_DATA_DIR, WANDB_CACHE_DIR) is left to W&B, as is one that can be written.
    Returns the line that says what moved, or None."""
    from wandb import env as wandb_env

    defaults = {"WANDB_DATA_DIR": wandb_env.get_data_dir, "WANDB_CACHE_DIR": wandb_env.get_cache_dir}
    moved, refusals = {}, []
    for variable, (folder, what) in WANDB_HOME_DIRS.items():
        given = os.environ.get(variable)
        if given and _moved.get(variable) != given:
            continue  # the user's choice
        os.environ.pop(variable, None)  # set for an earlier run of this process: this run decides anew
        _moved.pop(variable, None)
        default = Path(defaults[variable]())
        refused = _cannot_write(default)
        if refused is None:
            continue
        os.environ[variable] = _moved[variable] = str((Path(save_dir) / "wandb" / folder).absolute())
        moved[variable] = what
        refusals.append(f"{default}: {refused}")
    if not moved:
        return None
    return (f"W&B cannot write in the home directory ({'; '.join(refusals)}): this run keeps W&B's "
            f"{' and '.join(moved.values())} in {' and '.join(os.environ[v] for v in moved)} (set "
            f"{' and '.join(moved)} to choose)")


def _cannot_write(directory: Path) -> str | None:
    """Why `directory` cannot be created or written in, or None when it can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return err.strerror or str(err)
    return None if os.access(directory, os.W_OK | os.X_OK) else "no write permission"


def describe_wandb_run(loggers, config) -> None:
    """Hands the resolved CLI config (a jsonargparse Namespace), a group (the experiment its config
    files name, `<setting>/<method>`, so its seeds and variants group together) and tags (method,
    dataset, partition) to every FLWandbLogger."""
    targets = [lg for lg in loggers if isinstance(lg, FLWandbLogger)]
    if not targets:
        return
    resolved = config.clone().as_dict()
    files = resolved.pop("config", None) or []
    model = resolved.get("model") or {}
    method = str(model.get("class_path", "")).rpartition(".")[2] if isinstance(model, Mapping) else ""
    data = resolved.get("data") or {}
    group = run_name_from_configs(files, method)
    tags = [t for t in (method, data.get("dataset"), data.get("partition")) if t]
    for logger in targets:
        logger.describe_run({"method": method, **resolved}, group, [str(t) for t in tags])


def update_wandb_summary(loggers, summary: Mapping[str, Any]) -> None:
    """The W&B run summary holds summary.json's outcome (final/best accuracy and their rounds,
    rounds completed, wall time, diverged/failed), so dashboards can sort and filter runs by it."""
    values = {k: v for k, v in summary.items() if k != "last" and v is not None}
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            with uninterrupted():
                logger.experiment.summary.update(values)


# How the command was run (which checkpoint, replace the directory, unpickling, validate/test's
# printed table), not what the run computes: not part of the W&B run's config.
COMMAND_KEYS = ("overwrite", "ckpt_path", "weights_only", "verbose")


def without_internal_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without keys starting with "_" (jsonargparse/Lightning internals), recursively,
    and without the command's own options (COMMAND_KEYS) at its top level."""
    return {k: without_internal_keys(v) if isinstance(v, Mapping) else v
            for k, v in config.items() if not str(k).startswith("_") and k not in COMMAND_KEYS}


class IncompleteRunFile(ValueError):
    """The .wandb file has no exit record yet: W&B has not finished writing it."""


def offline_records(run_file: str | Path, require_complete: bool = True):
    """Every `wandb_internal_pb2.Record` of an offline W&B run file (`run-<id>.wandb`), in order
    (history rows, the run record with its config, group and tags, metric definitions, ...), read
    without a W&B server (wandb ships no reader for these files).

    The file is a LevelDB-style record log (7-byte ':W&B' header, 32 KiB blocks of records with a
    crc32/length/type header, types FULL/FIRST/MIDDLE/LAST) of protobufs. W&B's core process writes
    it in whole blocks, and `wandb.finish()` can return before the last block reaches the disk (a
    small run's file is then only the 7-byte header); so a run counts as readable only once its
    `exit` record is there (`IncompleteRunFile` otherwise), which `finish_wandb` in the CLI waits
    for. A record whose checksum does not match is an error, never skipped silently.
    """
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    block, pos, pending, complete = 32768, 7, b"", False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block if pos % block else 0
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            break  # the tail of a file still being written
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"{run_file}: damaged record at byte {pos} (checksum mismatch)")
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        complete = complete or record.WhichOneof("record_type") == "exit"
        yield record
    if require_complete and not complete:
        raise IncompleteRunFile(f"{run_file}: no exit record; W&B has not finished writing this run "
                                f"(or it was killed)")


def read_offline_history(run_file: str | Path, require_complete: bool = True) -> list[dict]:
    """The metric rows of an offline W&B run (see `offline_records`)."""
    import json

    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in offline_records(run_file, require_complete)
            if record.WhichOneof("record_type") == "history"]
