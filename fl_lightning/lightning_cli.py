"""`fl-lightning fit|validate|test|analyze`: LightningCLI with the federated pieces wired in (the
command itself, with `sweep` and `report`, is cli.py).

- `--model` takes any method class (`FedSOL`, `FedAvg`, ...; see fl_lightning.methods) and the
  data module's DataSpec (classes, channels, image size) is linked into it.
- The federated callback is always present and configurable as `--federation.*`; personalised
  evaluation (fine-tune per client, local-only baseline) as `--personalization.*` (off by default);
  analyses (divergence every round; Hessian spectrum and loss surface every n rounds, off by
  default) as `--analysis.*`, and on a saved checkpoint with `fl-lightning analyze`.
- Every completed round is checkpointed, atomically, to
  `<trainer.default_root_dir>/checkpoints/last.ckpt` (fl_lightning/checkpointing.py), so
  `--ckpt_path last` resumes the run configured in the same directory; a checkpoint of another
  experiment, or a damaged file, is refused before anything loads it.
- Configs compose: `--config configs/settings/<setting>.yaml --config configs/methods/<paper>/<method>.yaml`
  (configs/README.md). `trainer.default_root_dir` and the W&B logger's `name`, where the config
  leaves them unset, come from the --config files: `runs/<setting>/<method>` and
  `<setting>/<method>` (config_files.py, which also expands one-file entries and refuses a wrong
  layering). `data.seed: null` (client sampling and
  local shuffling) follows `seed_everything`, so a seed sweep varies what the papers' reference
  code varies between runs; the partition stays fixed by `data.partition_seed`.
- One fit per run directory (fl_lightning/rundir.py): a second fit into a used directory is
  refused unless it resumes (`--ckpt_path last`) or overwrites (`--overwrite true`).
- SIGTERM (a preempted job) and Ctrl-C abandon the current round and exit with 128 + the signal's
  number and one line saying how to resume; the last completed round's checkpoint is kept. A
  second signal while the first is being handled changes nothing; a signal after the run's end
  changes nothing either.
- The exit code follows the run's outcome (outcome.py): 0 every round ran, 3 stopped by a
  divergence or collapse, 4 a process of the run died or the disk refused a write (resumable),
  2 bad input (unknown names, impossible partitions, missing or damaged files), each with one
  `error:` line printed once (by rank 0 of a multi-process run).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback, Checkpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy

from fl_lightning import compat
from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.checkpointing import (
    LAST,
    AtomicCheckpointIO,
    RoundCheckpoint,
    check_compatible,
    check_resume_options,
    completed_rounds,
    load_checkpoint_file,
    verify_client_state_files,
)
from fl_lightning.config_files import layered_config_args, run_name_from_configs
from fl_lightning.data.datamodule import FederatedDataModule, clients_per_round
from fl_lightning.errors import FLUserError
from fl_lightning.federation import FederatedCallback, federation_of
from fl_lightning.loggers import FLWandbLogger, describe_wandb_run
from fl_lightning.methods import FederatedMethod
from fl_lightning.outcome import (
    DISK_ERRNOS,
    EXIT_LOST,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    REPORTED_ELSEWHERE,
    FLInterrupted,
    describe_refusal,
    disk_refused,
    lost_peer,
)
from fl_lightning.parallel import check_process_count, client_strategy_name, lost_processes, reported_elsewhere
from fl_lightning.personalization import PersonalizationCallback
from fl_lightning.progress import RoundProgressBar
from fl_lightning.results import ResultsCallback
from fl_lightning.rundir import RunDirectory, is_first_process
from fl_lightning.trainer import FLTrainer


def _raise_interrupted(signum, frame) -> None:
    # the first signal ends the run; later ones (an impatient Ctrl-C Ctrl-C, a scheduler's TERM
    # then INT) must not cut the clean-up short: they are ignored from here on
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    raise FLInterrupted(signum)


class FLCLI(LightningCLI):
    active: FLCLI | None = None  # the CLI of the current main() call, for the interrupted message
    run_dir: RunDirectory | None = None
    checkpoint_rounds = 0  # rounds the --ckpt_path checkpoint holds
    round_checkpoint: RoundCheckpoint | None = None

    def __init__(self, *args, **kwargs):
        FLCLI.active = self
        given = kwargs.get("args")
        given = sys.argv[1:] if given is None else given
        self._invoked = given[0] if given and isinstance(given[0], str) else None
        super().__init__(*args, **kwargs)

    SUBCOMMANDS = ("fit", "validate", "test", "analyze")
    # subcommand -> what `setup_parser` builds, built before this process started (a sweep worker
    # builds fit's before forking its runs: `prebuild_parser`); taken by the first CLI of the process
    prebuilt: dict[str, tuple] = {}

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        built = FLCLI.prebuilt.pop(self._invoked, None) if add_subcommands else None
        if built is None:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        else:
            self.parser, self._subcommand_method_arguments, self._subcommand_parsers = built

    def subcommands(self) -> dict[str, set[str]]:
        """fit, validate, test and analyze (FLTrainer.analyze: the --analysis.* analyses of a
        checkpoint); Lightning's `predict` is left out, no method has a predict step. Only the
        invoked one's parser is built when it is known: each holds every Trainer, method and data
        option, and building all four took a third of the CLI's own start-up."""
        kept = {name: skip for name, skip in LightningCLI.subcommands().items() if name in self.SUBCOMMANDS}
        kept["analyze"] = {"model", "datamodule"}
        invoked = getattr(self, "_invoked", None)
        return {invoked: kept[invoked]} if invoked in kept else kept

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(FederatedCallback, "federation")
        parser.add_lightning_class_args(PersonalizationCallback, "personalization")
        parser.add_lightning_class_args(AnalysisCallback, "analysis")
        parser.link_arguments("data.spec", "model.init_args.data_spec", apply_on="instantiate")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: replace the run already in trainer.default_root_dir (its config, checkpoints "
                                 "and results) instead of refusing to start")

    def _subcommand_config(self):
        return self.config.get(self.config.subcommand, self.config) if self.config.get("subcommand") else self.config

    def parse_arguments(self, parser, args) -> None:
        """The parsed config, completed before anything reads it (`--ckpt_path last` looks in the
        run directory, the checkpoint check compares data.seed): the run's name and directory from
        its --config files, and data.seed from seed_everything, each only where the user left it
        unset. (`--print_config` prints the config as given, before this.)"""
        super().parse_arguments(parser, args)
        cfg = self._subcommand_config()
        name_run_from_configs(cfg)
        follow_seed_everything(cfg)

    def _parse_ckpt_path(self) -> None:
        """Lightning's version loads the file and replaces the requested hyperparameters with the
        checkpoint's. Here the file is checked first (one line for a damaged or foreign file), and
        a checkpoint must match the requested experiment instead of overriding it."""
        cfg = self._subcommand_config()
        ckpt = cfg.get("ckpt_path")
        if not ckpt:
            return
        root = Path(cfg["trainer"].get("default_root_dir") or "runs/default")
        if ckpt == "last":
            last = root / "checkpoints" / LAST
            if not last.exists():
                if RunDirectory(root).holds_run():  # stopped (killed, interrupted) before its first round ended
                    raise FLUserError(f"--ckpt_path last: no checkpoint at {last}: the run in {root} stopped before "
                                      f"its first round was saved; start it again with --overwrite true instead of "
                                      f"--ckpt_path last")
                raise FLUserError(f"--ckpt_path last: no checkpoint at {last}; run fit with the same "
                                  f"trainer.default_root_dir first")
            ckpt = cfg["ckpt_path"] = str(last)
        elif not Path(ckpt).exists():
            raise FLUserError(f"--ckpt_path {ckpt}: no such file")
        state = load_checkpoint_file(ckpt)
        check_compatible(ckpt, state, cfg["model"], cfg["data"])
        verify_client_state_files(ckpt, state)
        self.checkpoint_rounds = completed_rounds(state)
        if self.config.get("subcommand") != "fit":
            follow_the_checkpoints_run(cfg, Path(ckpt))

    def before_instantiate_classes(self) -> None:
        cfg = self._subcommand_config()
        follow_seed_everything(cfg)  # seed_everything: true has been drawn by now (LightningCLI._set_seed)
        trainer = cfg["trainer"]
        if trainer.get("reload_dataloaders_every_n_epochs") != 1:
            raise FLUserError("trainer.reload_dataloaders_every_n_epochs must be 1: every round samples new clients")
        root = trainer.get("default_root_dir") or "runs/default"
        trainer["default_root_dir"] = root
        self._run_root = Path(root)
        self._checkpoint_dir = Path(root) / "checkpoints"
        logger = trainer.get("logger")
        init = getattr(logger, "init_args", None)
        if init is not None and "save_dir" in init and init.save_dir is None:
            init.save_dir = root
        if init is not None and self.subcommand != "fit":
            post_run_wandb_run(init, self.subcommand, root)
        strategy = trainer.get("strategy")
        federation = cfg.get("federation") or {}
        if isinstance(strategy, str) and federation.get("parallel", "clients") == "clients":
            # DDP processes train different clients (parallel.py): Lightning's DDP minus the wrapper
            trainer["strategy"] = client_strategy_name(strategy) or strategy
            if trainer["strategy"].endswith("_clients"):
                self._check_client_parallelism(cfg)
        elif isinstance(strategy, str) and client_strategy_name(strategy) and _heterogeneous(cfg):
            # checked here, once, rather than by every launched process (HeteroMethod.setup)
            raise FLUserError("model-heterogeneous methods split over processes by client, not by batch: "
                              "set --federation.parallel clients (or --trainer.devices 1)")
        self._overwrite = bool(cfg.get("overwrite"))
        cfg["overwrite"] = False  # not saved into config.yaml: re-running that file must not wipe this run
        if self.subcommand == "fit" and cfg.get("ckpt_path"):
            ckpt = Path(cfg["ckpt_path"])
            check_resume_options(ckpt, ckpt.parent.parent / "config.yaml",
                                 self._parser(self.subcommand).dump(cfg, skip_none=False))

    @staticmethod
    def _check_client_parallelism(cfg) -> None:
        """The federated callback checks again in every process; this fails before any launch
        where the configuration alone tells (FederatedCallback._check_parallel)."""
        trainer, data = cfg["trainer"], cfg["data"]
        devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
        if isinstance(devices, str) and devices.isdigit():
            devices = int(devices)
        if not isinstance(devices, int) or devices < 1:
            return  # "auto", a list of ids: the callback checks once the processes exist
        check_process_count(devices * nodes, clients_per_round(data["num_clients"], data["sample_ratio"]))

    def before_fit(self) -> None:
        # Load and partition the data before the run starts, so a missing file or an impossible
        # partition fails in seconds, before the run directory is claimed or a logger run created.
        self.datamodule.setup("fit")
        if self.subcommand == "fit" and is_first_process():
            self.run_dir = RunDirectory(self._run_root)
            self.run_dir.prepare_fit(resuming=bool(self._subcommand_config().get("ckpt_path")),
                                     overwrite=self._overwrite)
        describe_wandb_run(self.trainer.loggers, self.config.get(self.subcommand, self.config))

    def before_validate(self) -> None:
        self.before_fit()
        for logger in self.trainer.loggers:
            if isinstance(logger, FLWandbLogger):
                logger.checkpoint_round = self.checkpoint_rounds

    before_test = before_analyze = before_validate

    def after_fit(self) -> None:
        where = self._results_line() if self.subcommand == "fit" and self.trainer.is_global_zero else None
        refused = finish_wandb(exit_code=self.exit_code())
        if refused is not None:
            raise refused  # the run's records are complete, its W&B run is not: lost, in one line
        if where:
            print(where)

    def _results_line(self) -> str:
        """Where the fit's results are, and how to upload an offline W&B run."""
        line = f"run directory {self._run_root}: metrics.csv, clients.csv, summary.json, checkpoints/last.ckpt"
        wandb = sys.modules.get("wandb")
        run = wandb.run if wandb is not None else None
        if run is not None and run.settings.mode in ("offline", "dryrun"):
            line += f"; upload to W&B with: wandb sync {Path(run.dir).parent}"
        return line

    def after_validate(self) -> None:
        """One line that says which round the numbers are of (the checkpoint's, not Lightning's
        epoch counter, which starts at 0 when a checkpoint is only evaluated)."""
        key = getattr(self.model, "accuracy_key", "global/test_acc")
        metrics = self.trainer.callback_metrics
        if key in metrics and self.trainer.is_global_zero:
            loss = metrics.get(key.replace("_acc", "_loss"))
            rounds = self.checkpoint_rounds
            line = f"{self.subcommand} of the round-{rounds} checkpoint: {key} {float(metrics[key]):.4f}"
            print(line + (f", loss {float(loss):.4f}" if loss is not None else ""))
        self.after_fit()

    after_test = after_analyze = after_validate

    def exit_code(self) -> int:
        """0, or 3 when a decision (divergence, collapse with on_collapse stop) stopped the run."""
        federation = federation_of(self.trainer) if getattr(self, "trainer", None) is not None else None
        return EXIT_STOPPED if federation is not None and federation.record.stopped else 0

    def stop_line(self) -> str | None:
        """The `error:` line of a run a decision stopped, else None."""
        federation = federation_of(self.trainer) if getattr(self, "trainer", None) is not None else None
        return federation.record.reason if federation is not None and federation.record.stopped else None

    def _instantiate_trainer(self, config: dict, callbacks: list):
        # Added next to (not instead of) the user's trainer.callbacks, and only where the user has
        # neither their own nor switched the feature off.
        given = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks.append(RoundProgressBar())
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, Checkpoint) for c in given):
            # One checkpoint per round, overwritten, so a stopped run resumes at its last round.
            self.round_checkpoint = RoundCheckpoint(self._checkpoint_dir)
            callbacks.append(self.round_checkpoint)
        callbacks.append(ResultsCallback(self._run_root))
        callbacks.append(LostProcessWatchdog())
        if self.subcommand != "fit":
            self.save_config_callback = None  # config.yaml is the fit's: validate/test/analyze leave it alone
        trainer = super()._instantiate_trainer(config, callbacks)
        trainer.strategy.checkpoint_io = AtomicCheckpointIO(self.round_checkpoint)
        compat.drop_sigterm_notifier(trainer)  # SIGTERM is this CLI's (_raise_interrupted), on every process
        federation = federation_of(trainer)
        if isinstance(trainer.strategy, DDPStrategy) and federation is not None:
            compat.set_collective_timeout(trainer.strategy, federation.collective_timeout)
        return trainer


class LostProcessWatchdog(Callback):
    """On rank 0 of a run whose other processes Lightning's launcher started here: if one of them
    dies (kill -9, out of memory, a crash), the run ends as lost with one line naming it, instead of
    rank 0 waiting in its next collective (gloo notices a dead peer within seconds and this only
    adds the name; NCCL would wait for the collective timeout)."""

    POLL_SECONDS, GRACE_SECONDS = 0.5, 10.0

    def __init__(self):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.is_global_zero and compat.launched_processes(trainer) and self._thread is None:
            compat.disarm_child_process_observer()  # this watchdog decides when a dead process ends the run
            self._thread = threading.Thread(target=self._watch, args=(trainer, pl_module), daemon=True)
            self._thread.start()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop.set()

    def _watch(self, trainer, pl_module) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            if lost_processes(trainer, wait=0):
                # the main thread usually hears of it from its collective first and ends the run
                # itself; if it is still running after the grace period, it is stuck there
                if self._stop.wait(self.GRACE_SECONDS):
                    return
                line = _lost_line()
                results = next((c for c in trainer.callbacks if isinstance(c, ResultsCallback)), None)
                if results is not None:
                    with contextlib.suppress(Exception):
                        results.record_lost(trainer, pl_module, line)
                elsewhere = reported_elsewhere(trainer, wait=0)  # that process printed the line itself
                if elsewhere is None:
                    print(f"error: {line}", file=sys.stderr, flush=True)
                for _, proc in compat.launched_processes(trainer):
                    with contextlib.suppress(OSError):
                        proc.kill()
                os._exit(EXIT_LOST if elsewhere is None else elsewhere)


TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,  # one epoch = one round with its own clients
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,  # the round sampler shards batches across ranks itself
    "logger": {"class_path": "fl_lightning.loggers.FLWandbLogger"},
    "log_every_n_steps": 1,
}


def name_run_from_configs(cfg) -> None:
    """Fill `trainer.default_root_dir` (runs/<name>) and the W&B logger's `name` from the --config
    files, each only if the config leaves it unset: a setting and a method file compose into a run
    of their own, while an explicit name or directory (a sweep's, a saved config.yaml's) wins."""
    model = cfg.get("model")
    method = str(getattr(model, "class_path", "") or "").rpartition(".")[2] or None
    name = run_name_from_configs(cfg.get("config"), method)
    if name is None:
        return
    trainer = cfg["trainer"]
    if not trainer.get("default_root_dir"):
        trainer["default_root_dir"] = f"runs/{name}"
    init = getattr(trainer.get("logger"), "init_args", None)
    if init is not None and "name" in init and not init.name:
        init.name = name
    if init is not None and "group" in init and not init.group:
        # recorded in config.yaml, so a resume or a post-run command from that file (whose own
        # name says nothing of the experiment) lands in the same W&B group
        init.group = name


def follow_the_checkpoints_run(cfg, ckpt: Path) -> None:
    """validate, test and analyze of `<run dir>/checkpoints/<file>` with that run's own config.yaml
    write beside that run (W&B runs under `<run dir>/posthoc/`, `analysis/posthoc_round_XXX/`)
    wherever the command is started: config.yaml names the run's directory relative to where the
    fit was started (`runs/<setting>/<method>`), which from anywhere else (the run's own directory,
    say) would be a new directory nested somewhere. A directory the user chose instead is kept."""
    run_dir = ckpt.parent.parent
    trainer = cfg["trainer"]
    configured = trainer.get("default_root_dir")
    if ckpt.parent.name != "checkpoints" or not configured or Path(configured).resolve() == run_dir.resolve():
        return
    try:
        import yaml

        recorded = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("trainer", {})
    except (OSError, yaml.YAMLError, AttributeError):
        return
    if not isinstance(recorded, dict) or recorded.get("default_root_dir") != configured:
        return  # not the directory that run's config names: the user's choice
    init = getattr(trainer.get("logger"), "init_args", None)
    if init is not None and "save_dir" in init and init.save_dir and Path(init.save_dir) == Path(configured):
        init.save_dir = str(run_dir)  # the fit's W&B directory is its run directory
    trainer["default_root_dir"] = str(run_dir)


def post_run_wandb_run(init, command: str, root: str) -> None:
    """validate, test and analyze log into a W&B run of their own: job_type the command, in the
    fit's group, named `<fit's name>/<command>`, and kept under `<run dir>/posthoc/` so that the
    fit's W&B files and its `latest-run` link stay as the fit left them. Never the fit's id: an
    offline run cannot be resumed from another process, and a reused id would overwrite it."""
    if "save_dir" in init and (init.save_dir is None or Path(init.save_dir) == Path(root)):
        init.save_dir = str(Path(root) / "posthoc")
    for key in ("id", "version"):
        if key in init:
            init[key] = None
    if "job_type" in init and not init.job_type:
        init.job_type = command
    if "group" in init and not init.group and init.get("name"):
        init.group = init.name
    if init.get("name"):
        init.name = f"{init.name}/{command}"


def _heterogeneous(cfg) -> bool:
    """The configured method gives each client its own model (HeteroMethod)."""
    from fl_lightning.methods.hetero.base import HeteroMethod

    path = getattr(cfg.get("model"), "class_path", None)
    try:
        return bool(path) and issubclass(compat.import_object(path), HeteroMethod)
    except (ImportError, AttributeError, TypeError):
        return False


def follow_seed_everything(cfg) -> None:
    """`data.seed: null` (client sampling and local shuffling) takes the run's seed_everything, so
    runs that differ by seed sample different clients, as in FL-bench; the partition stays
    `data.partition_seed`'s. With seed_everything false (no seeding) it is 0, the data module's
    default."""
    data = cfg.get("data")
    if data is None or data.get("seed") is not None:
        return
    seed = cfg.get("seed_everything")
    if seed is True:  # drawn later by LightningCLI._set_seed; before_instantiate_classes comes back
        return
    data["seed"] = 0 if seed is False or seed is None else int(seed)


def finish_wandb(exit_code: int) -> OSError | None:
    """Close the W&B run so its summary and history are complete on disk (offline runs are then
    ready for `wandb sync`); a diverged or failed run is closed with a non-zero exit code.

    Returns the disk's refusal when W&B could not write its files (a full disk: its log file's
    last flush fails inside finish()), naming the W&B run's directory, instead of raising it:
    a run that an error already ended keeps that error as its outcome and its one line, and only
    a run that ended well makes the refusal its outcome (`after_fit`)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or wandb.run is None:
        return None
    where, refused = str(Path(wandb.run.dir).parent), None
    for close in (lambda: wandb.finish(exit_code=exit_code),
                  # finish() can return before W&B's core process has written the run's last block
                  # (a small offline run's file is then just its header); teardown waits for it, so
                  # the run's files are complete when the command returns (for `wandb sync`, sweeps,
                  # tests). After a refused finish it still stops W&B's service.
                  wandb.teardown):
        try:
            close()
        except OSError as err:
            if err.errno not in DISK_ERRNOS:
                raise
            # a new error, not W&B's: its chain (a log file's flush, failing again on close)
            # names no file, and the first error of a chain is the one a line reports
            refused = refused or OSError(err.errno, err.strerror, err.filename or where)
    return refused


def _method_names() -> list[str]:
    """The methods a user can pick: concrete FederatedMethod subclasses exported by the package
    (abstract bases such as HeteroMethod, and helpers such as KNNPerModel, are not methods)."""
    import inspect

    from fl_lightning import methods

    return sorted(n for n in methods.__all__
                  if inspect.isclass(cls := getattr(methods, n)) and issubclass(cls, FederatedMethod)
                  and not inspect.isabstract(cls))


def _class_options(class_path: str) -> list[str]:
    """A class's init options as the CLI reads them (for a did-you-mean)."""
    from jsonargparse import ArgumentParser

    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(compat.import_object(class_path), "x")
    except Exception:  # noqa: BLE001 - only a hint for an error message
        return []
    return [a.dest[2:] for a in compat.parser_actions(parser)
            if a.dest.startswith("x.") and a.dest.count(".") == 1 and a.dest != "x.data_spec"]


def _option_names() -> list[str]:
    cli = FLCLI.active
    parsers = getattr(cli, "_subcommand_parsers", None) or {}
    parser = parsers.get(getattr(cli, "subcommand", None) or "fit")
    if parser is None:
        return []
    return [a.dest for a in compat.parser_actions(parser) if a.dest not in ("help", "config")]


def _summarise_parse_error(text: str, args: list[str] | None = None) -> str:
    """jsonargparse explains a bad value over a dozen lines; one line names the option, the value
    and what it accepts (fl_lightning/parse_errors.py)."""
    from fl_lightning import parse_errors

    args = sys.argv[1:] if args is None else args
    return parse_errors.summarise(text, args, _option_names(), _class_options, _method_names())


def _raised_by_trainer_init(err: BaseException) -> bool:
    """An error from Lightning's Trainer constructor is a bad trainer.* option (an unknown
    accelerator, devices 'abc', ...): Lightning validates its arguments there."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "__init__" and code.co_filename.endswith(os.path.join("pytorch", "trainer", "trainer.py")):
            return True
        tb = tb.tb_next
    return False


def one_line_error(err: BaseException, args: list[str] | None = None) -> tuple[str, int] | None:
    """The one line (and exit code) for an error the user caused or the environment did (a lost
    process, a disk that refuses writes), or None for a real bug. Errors raised while jsonargparse
    instantiates a class arrive wrapped, so walk the chain."""
    seen = err
    while seen is not None:
        if isinstance(seen, FLUserError):
            return str(seen), EXIT_USER_ERROR
        seen = seen.__cause__ or seen.__context__
    if lost_peer(err):
        return _lost_line(), EXIT_LOST
    refused = disk_refused(err)
    if refused is not None:
        return (f"the disk refused a write ({describe_refusal(refused)}){_saved_rounds()}; make room "
                f"(or make the run directory writable) and run the same command{_resume_hint()}"), EXIT_LOST
    if isinstance(err, ValueError) and "Expected more than 1 value per channel when training" in str(err):
        data = getattr(getattr(FLCLI.active, "datamodule", None), "hparams", None)
        size = f" (its size is 1 more than a multiple of data.batch_size {data.batch_size})" if data else ""
        return (f"a mini-batch of 1 sample reached a BatchNorm layer in training (batch norm needs at least 2 "
                f"samples): a client's data ends in a 1-sample batch{size}; choose another --data.batch_size, or a "
                f"model without BatchNorm"), EXIT_USER_ERROR
    if type(err).__name__ == "ArgumentError":  # jsonargparse's parse errors (exit_on_error=False)
        return _summarise_parse_error(str(err), args), EXIT_USER_ERROR
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(err, (ValueError, TypeError, MisconfigurationException)) and _raised_by_trainer_init(err):
        text = " ".join(str(err).split())
        if "No supported gpu backend found" in text or "can not run on your system since the accelerator" in text:
            return ("trainer.accelerator: this machine has no usable GPU (torch.cuda.is_available() is "
                    "False); use --trainer.accelerator cpu (or auto, which picks a GPU where there is one)"), \
                EXIT_USER_ERROR
        return f"trainer: {text}", EXIT_USER_ERROR
    return None


def _trainer():
    cli = FLCLI.active
    return getattr(cli, "trainer", None) if cli is not None else None


def _saved_checkpoint() -> tuple[int, Path] | None:
    """(completed rounds, file) of this run's round checkpoint: the rounds this process saved, or,
    before it saved any (a resume that failed before its first round), the ones `--ckpt_path last`
    holds; None without one (a new run, or one being overwritten)."""
    cli = FLCLI.active
    checkpoint = getattr(cli, "round_checkpoint", None) if cli is not None else None
    if checkpoint is None or not checkpoint.last_path.exists():
        return None
    if checkpoint.rounds_saved:
        return checkpoint.rounds_saved, checkpoint.last_path
    with contextlib.suppress(Exception):
        resumed = cli._subcommand_config().get("ckpt_path")
        if resumed and Path(resumed).resolve() == checkpoint.last_path.resolve() and cli.checkpoint_rounds:
            return cli.checkpoint_rounds, checkpoint.last_path
    return None


def _saved_rounds() -> str:
    """"; N completed round(s) are saved in <file>" when the run has a round checkpoint."""
    saved = _saved_checkpoint()
    return f"; {saved[0]} completed round(s) are saved in {saved[1]}" if saved else "; no completed round was saved"


def _resume_hint() -> str:
    return " with --ckpt_path last" if _saved_checkpoint() else ""


def _lost_line() -> str:
    trainer = _trainer()
    where = f" in round {trainer.current_epoch + 1}/{trainer.max_epochs}" if trainer is not None else ""
    lost = lost_processes(trainer) if trainer is not None else []
    if not lost and _parent_gone():  # a process Lightning's launcher started outlived rank 0, its parent
        lost = [f"rank 0 (pid {_INITIAL_PARENT}) is gone (killed, or ended without stopping this process)"]
    who = ", ".join(lost) if lost else "another process of the run stopped responding"
    return f"lost process: {who}{where}{_saved_rounds()}; run the same command{_resume_hint()} to resume"


def _interrupted_line(err: FLInterrupted) -> str:
    trainer = _trainer()
    where = f" in round {trainer.current_epoch + 1}/{trainer.max_epochs}" if trainer is not None else ""
    if _resume_hint():
        return f"interrupted by {err}{where}{_saved_rounds()}: resume with the same command and --ckpt_path last"
    return (f"interrupted by {err}{where}; no completed round was saved, so there is nothing to resume: start the "
            f"run again")


class _ParserBuilt(BaseException):
    """Carries the parser out of FLCLI's construction (`build_parser`); not an Exception, so no
    handler on the way takes it for an error."""


class _ParserOnlyCLI:
    """Mixed into FLCLI by `build_parser`: stops construction as soon as the parser exists."""

    def parse_arguments(self, parser, args) -> None:
        raise _ParserBuilt(parser, self._subcommand_method_arguments, self._subcommand_parsers)


def _build_parser_parts() -> tuple:
    cli_class = type("FLCLIParser", (_ParserOnlyCLI, FLCLI), {})
    try:
        build_cli(["fit"], cli_class=cli_class)
    except _ParserBuilt as built:
        return built.args
    raise RuntimeError("the CLI did not reach argument parsing")


def build_parser():
    """The CLI's own argument parser of `fit` (every option, as `fl-lightning fit` parses them),
    without parsing anything or building a Trainer: for checking commands before they run
    (`fl-lightning sweep` parses every command of a sweep, each a fit, with it)."""
    return _build_parser_parts()[0]


def prebuild_parser() -> None:
    """Builds the parser of `fit` now, for the next `fit` of this process (and of the processes
    forked from it): a sweep worker calls it before forking its runs, which then do not build it
    (~0.1 s each). A parser built once and parsing once is what each run would have built."""
    FLCLI.prebuilt["fit"] = _build_parser_parts()


def build_cli(args: list[str] | None, run: bool = True, cli_class: type[FLCLI] | None = None) -> FLCLI:
    """The fl-lightning CLI on `args`; with run=False, parsed and instantiated without a subcommand
    (for inspecting what a config builds)."""
    return (cli_class or FLCLI)(
        FederatedMethod,
        FederatedDataModule,
        trainer_class=FLTrainer,
        subclass_mode_model=True,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={"default_env": False, "exit_on_error": False, "allow_abbrev": False},
        run=run,
        args=args,
    )


def main(args: list[str] | None = None) -> None:
    """fit, validate, test or analyze `args` (default: the command line), ending in the run's exit
    code with at most one `error:` line."""
    os.environ.setdefault("WANDB_SILENT", "true")
    # A log file the disk refuses (W&B's debug.log on a full disk) would print a traceback for
    # every message logged to it, thousands in a run; the refusal is said once, as the run's
    # outcome, by the run's own writes or W&B's finish (logging's own switch for applications).
    raise_logging_errors, logging.raiseExceptions = logging.raiseExceptions, False
    compat.quiet_library_notices()
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    FLCLI.active = None
    first = is_first_process()  # rank 0 says what happened; the other ranks exit with the same code
    in_process = args is not None
    own_error = False  # a process other than rank 0 failed on its own and says so itself
    if not in_process:
        # registered first, so it runs last: from there on the interpreter tears itself down (its
        # final garbage collection takes seconds) with Python's signal handlers gone
        atexit.register(_block_signals_at_finalization)
    try:
        args = layered_config_args(list(args) if in_process else sys.argv[1:])
        if not in_process:
            sys.argv[1:] = args  # LightningCLI reads the command line itself (and warns if also given args)
        cli = build_cli(args if in_process else None)
        code, line = cli.exit_code(), cli.stop_line()
    except FLInterrupted as err:
        _stop_launched_processes()
        code, line = _after_interrupt(err)
    except Exception as err:
        if not first and lost_peer(err):
            # A rank 0 killed mid-run closes its sockets before the kernel hands this process to a
            # new parent, so the lost collective can be seen before rank 0 looks gone: without
            # this wait the line (which must name rank 0 when it died) was left unsaid.
            _parent_gone(wait=_PARENT_EXIT_SECONDS)
        reported = one_line_error(err, args)
        if reported is not None and reported[1] == EXIT_LOST and first and lost_peer(err):
            trainer = _trainer()
            elsewhere = None if trainer is None else reported_elsewhere(trainer, wait=_REPORT_GRACE_SECONDS + 2)
            # the summary's reason is the line (which names the process), not gloo's words
            _record_lost(reported[0] if elsewhere is None else _lost_line())
            if elsewhere is not None:  # that process printed the line (a damaged file, a full disk)
                reported = (None, elsewhere)
        _stop_launched_processes()
        finish_wandb(exit_code=reported[1] if reported else 1)
        if reported is None:
            raise
        code, line = reported[1], reported[0]
        if code == EXIT_USER_ERROR:
            _abandon_failed_start()
        if not first and not _parent_gone():
            if lost_peer(err):
                line = None  # rank 0 names the lost process
            elif line and _launched_by_rank_0():
                # its own error, which rank 0 only sees as a vanished peer: this process says it
                # (after a moment in which rank 0, failing alike, would have stopped it) and tells
                # rank 0 by its exit code that it did
                time.sleep(_REPORT_GRACE_SECONDS)
                code += REPORTED_ELSEWHERE
                own_error = True
    finally:
        if FLCLI.active is not None and FLCLI.active.run_dir is not None:
            FLCLI.active.run_dir.unlock()
        if in_process:  # called in-process (tests, sweeps): leave the caller's handlers as they were
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            logging.raiseExceptions = raise_logging_errors
    unsaid = [f"error: {line}"] if line and (first or _parent_gone() or own_error) else []
    if not in_process:
        _end_on_signal(code, unsaid)
    while unsaid:
        print(unsaid.pop(), file=sys.stderr, flush=True)
    if code:
        sys.exit(code)


def _abandon_failed_start() -> None:
    """Bad input found after the fit claimed its run directory (a client model that cannot take the
    data's images is built in setup, say) and before any round was saved: the directory is left as
    if the command had never run, so the corrected command is not refused as "already holds a run"."""
    cli = FLCLI.active
    if cli is None or cli.run_dir is None or cli.subcommand != "fit":
        return
    checkpoint = cli.round_checkpoint
    if checkpoint is None or checkpoint.last_path.exists():
        return  # a round was saved (or is being resumed): the run stays
    cli.run_dir.abandon()


def _end_on_signal(code: int, unsaid: list[str]) -> None:
    """The run has ended: a signal from here on (while the process exits: W&B's, torch's exit
    functions) changes nothing; it ends the process at once, with the run's exit code and its
    line if that is not printed yet."""

    def handler(signum, frame) -> None:
        while unsaid:
            print(unsaid.pop(), file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)


def _block_signals_at_finalization() -> None:
    """The last exit function of an `fl-lightning` process: the outcome is decided, printed and on
    disk, and the exit code set; SIGTERM or SIGINT during the interpreter's teardown would otherwise
    take the default action and turn a finished run's exit code 0 into death by the signal."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def _stop_launched_processes() -> None:
    """Rank 0 of a run that an error or a signal ends: the processes Lightning's launcher started
    from it would only learn of it from their next collective (a lost peer) and report it as a
    second line, so they are stopped (SIGKILL: they hold nothing the run still needs, the round
    checkpoint and the records are rank 0's) before rank 0 reports and exits."""
    trainer = _trainer()
    if trainer is None:
        return
    for _, proc in compat.launched_processes(trainer):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def _record_lost(line: str) -> None:
    trainer = _trainer()
    results = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, ResultsCallback)), None)
    if results is not None and trainer.lightning_module is not None:
        with contextlib.suppress(Exception):
            results.record_lost(trainer, trainer.lightning_module, line)


def _after_interrupt(err: FLInterrupted) -> tuple[int, str | None]:
    """A signal: the run's own exit code if it had already ended (a signal after completion
    changes nothing), else 128 + the signal's number."""
    cli, trainer = FLCLI.active, _trainer()
    federation = federation_of(trainer) if trainer is not None else None
    if federation is not None and federation.record.outcome.final and cli is not None:
        finish_wandb(exit_code=cli.exit_code())
        return cli.exit_code(), cli.stop_line()
    finish_wandb(exit_code=128 + err.signum)
    return 128 + err.signum, _interrupted_line(err)


_INITIAL_PARENT = os.getppid()
_REPORT_GRACE_SECONDS = 3.0
_PARENT_EXIT_SECONDS = 2.0  # a killed process's exit, from its sockets closing to its children reparented


def _launched_by_rank_0() -> bool:
    """This process is one Lightning's launcher started from rank 0 on this machine (ranks 1.. of
    `--trainer.strategy ddp`; not a process of torchrun or srun, whose agents start every rank)."""
    return (not is_first_process() and int(os.environ.get("LOCAL_RANK", "0") or 0) > 0
            and not any(name in os.environ for name in ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_LOCALID")))


def _parent_gone(wait: float = 0.0) -> bool:
    """For a process Lightning's launcher started (ranks > 0 on one machine): rank 0, its parent,
    has died, so nobody else will say what happened. With `wait`, up to that many seconds for a
    dying parent's exit to complete (this process is reparented only then)."""
    if is_first_process():
        return False
    deadline = time.monotonic() + wait
    while os.getppid() == _INITIAL_PARENT:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


if __name__ == "__main__":
    main()
