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

The command is three modules besides this one, which wires them into `main`: cli_parsing.py (the
parser and the config completed before anything is built), run_lifecycle.py (signals, errors and
the multi-process protocol -> the exit code and its one line) and wandb_run.py (the command's W&B
run).
"""

from __future__ import annotations

import sys

from lightning.pytorch.callbacks import Checkpoint, ProgressBar
from lightning.pytorch.strategies import DDPStrategy

from fl_lightning import compat
from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.checkpointing import AtomicCheckpointIO, RoundCheckpoint
from fl_lightning.cli_parsing import FLArgumentParser, FLCLIParsing
from fl_lightning.config_files import layered_config_args
from fl_lightning.data.datamodule import FederatedDataModule, clients_per_round
from fl_lightning.federation import callback_of, federation_of
from fl_lightning.methods import FederatedMethod
from fl_lightning.outcome import EXIT_STOPPED, FLInterrupted
from fl_lightning.progress import RoundProgressBar
from fl_lightning.results import ResultsCallback
from fl_lightning.run_lifecycle import Ending, LostProcessWatchdog, RunLifecycle, one_line_error, set_active_cli
from fl_lightning.rundir import RunDirectory, is_first_process
from fl_lightning.trainer import FLTrainer
from fl_lightning.wandb_run import (
    continue_fit_wandb_run,
    describe_wandb_run,
    finish_wandb,
    log_as_checkpoint_round,
    sync_hint,
)

# `build_parser` and `one_line_error` check commands the way a run parses them (fl_lightning/sweep/)
__all__ = ["FLCLI", "TRAINER_DEFAULTS", "build_cli", "build_parser", "main", "one_line_error", "prebuild_parser"]


class FLCLI(FLCLIParsing):
    """The CLI of one run: FLCLIParsing's parser and config, plus the run itself: the callbacks
    every Trainer gets, the run directory claimed before a fit, the lines printed after it, and
    the run's exit code."""

    run_dir: RunDirectory | None = None
    round_checkpoint: RoundCheckpoint | None = None

    def __init__(self, *args, **kwargs):
        set_active_cli(self)  # the run's lines read its trainer and checkpoint, from here on
        super().__init__(*args, **kwargs)

    def before_fit(self) -> None:
        # Load and partition the data before the run starts, so a missing file or an impossible
        # partition fails in seconds, before the run directory is claimed or a logger run created.
        self.datamodule.setup("fit")
        resuming = self.subcommand == "fit" and (bool(self.subcommand_config().get("ckpt_path"))
                                                 or RunDirectory(self._run_root).requeued_by_slurm())
        if self.subcommand == "fit" and is_first_process():
            self.run_dir = RunDirectory(self._run_root)
            self.run_dir.prepare_fit(resuming=resuming, overwrite=self._overwrite)
            print(header_line(self), flush=True)
        if resuming:
            continue_fit_wandb_run(self.trainer.loggers, self._run_root)
        describe_wandb_run(self.trainer.loggers, self.config.get(self.subcommand, self.config))

    def _finished_line(self) -> str | None:
        """`fit --ckpt_path last` of a run that had already run its rounds: Lightning loads the
        checkpoint and ends at once (the run's records are written again), and without this line
        nothing said that nothing was trained, nor how to continue."""
        rounds, max_rounds = self.checkpoint_rounds, self.trainer.max_epochs
        if not self.subcommand_config().get("ckpt_path") or max_rounds is None or not 0 <= max_rounds <= rounds:
            return None
        return (f"nothing to train: the run finished at round {rounds} (trainer.max_epochs {max_rounds}); "
                f"to continue it, run the same command with a larger --trainer.max_epochs "
                f"(e.g. --trainer.max_epochs {2 * rounds})")

    def before_validate(self) -> None:
        self.before_fit()
        log_as_checkpoint_round(self.trainer.loggers, self.checkpoint_rounds)

    before_test = before_analyze = before_validate

    def after_fit(self) -> None:
        self._end_with(self._finished_line(), self._results_line())

    def _end_with(self, *lines: str | None) -> None:
        """Closes the W&B run and prints the command's last lines (rank 0), read before the run is
        closed (they say where the W&B run went)."""
        lines = tuple(line for line in lines if line) if self.trainer.is_global_zero else ()
        refused = finish_wandb(exit_code=self.exit_code())
        if refused is not None:
            raise refused  # the run's records are complete, its W&B run is not: lost, in one line
        for line in lines:
            print(line)

    def _results_line(self) -> str:
        """Where the fit's results are, and where its W&B run went."""
        return (f"run directory {self._run_root}: metrics.csv, clients.csv, summary.json, checkpoints/last.ckpt"
                f"{sync_hint()}")

    def after_validate(self) -> None:
        """One line that says which round the numbers are of (the checkpoint's, not Lightning's
        epoch counter, which starts at 0 when a checkpoint is only evaluated) and where the W&B run
        went; `analyze` ends with where its pictures went."""
        key = getattr(self.model, "accuracy_key", "global/test_acc")
        metrics = self.trainer.callback_metrics
        line = f"{self.subcommand} of the round-{self.checkpoint_rounds} checkpoint"
        if key in metrics:
            loss = metrics.get(key.replace("_acc", "_loss"))
            line += f": {key} {float(metrics[key]):.4f}" + (f", loss {float(loss):.4f}" if loss is not None else "")
        analysis = callback_of(self.trainer, AnalysisCallback)
        if self.subcommand == "analyze" and analysis is not None and analysis.written is not None:
            self._end_with(line, f"analysis written to {analysis.written}{sync_hint()}")
        else:
            self._end_with(line + sync_hint())

    after_test = after_analyze = after_validate

    def exit_code(self) -> int:
        """0, or 3 when a decision (divergence, collapse with on_collapse stop) stopped the run."""
        federation = federation_of(self.trainer) if getattr(self, "trainer", None) is not None else None
        return EXIT_STOPPED if federation is not None and federation.record.stopped else 0

    def stop_line(self) -> str | None:
        """The `error:` line of a run a decision stopped, else None."""
        federation = federation_of(self.trainer) if getattr(self, "trainer", None) is not None else None
        return federation.record.reason if federation is not None and federation.record.stopped else None

    def instantiate_trainer(self, **kwargs):
        # Added next to (not instead of) the user's trainer.callbacks, and only where the user has
        # neither their own nor switched the feature off.
        config = {**self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {}), **kwargs}
        given = config.get("callbacks") or []
        callbacks = []
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks.append(RoundProgressBar())
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, Checkpoint) for c in given):
            # One checkpoint per round, overwritten, so a stopped run resumes at its last round.
            self.round_checkpoint = RoundCheckpoint(self._checkpoint_dir)
            callbacks.append(self.round_checkpoint)
        callbacks.append(ResultsCallback(self._run_root))
        callbacks.append(LostProcessWatchdog())
        compat.add_persistent_callbacks(self, callbacks)
        if self.subcommand != "fit":
            self.save_config_callback = None  # config.yaml is the fit's: validate/test/analyze leave it alone
        trainer = super().instantiate_trainer(**kwargs)
        trainer.strategy.checkpoint_io = AtomicCheckpointIO(self.round_checkpoint)
        compat.drop_sigterm_notifier(trainer)  # SIGTERM is this CLI's (run_lifecycle), on every process
        federation = federation_of(trainer)
        if isinstance(trainer.strategy, DDPStrategy) and federation is not None:
            compat.set_collective_timeout(trainer.strategy, federation.collective_timeout)
        return trainer


TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,  # one epoch = one round with its own clients
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,  # the round sampler shards batches across ranks itself
    "logger": {"class_path": "fl_lightning.loggers.FLWandbLogger"},
    "log_every_n_steps": 1,
    # the header line says what the run is; Lightning's table of modules is behind
    # --trainer.enable_model_summary true
    "enable_model_summary": False,
}


def header_line(cli) -> str:
    """The fit's first line: what runs, on what, and where it is written."""
    trainer, data = cli.trainer, cli.datamodule.hparams
    method = type(cli.model).__name__
    architecture = (getattr(cli.model, "hparams", None) or {}).get("model")
    if isinstance(architecture, str):
        method += f" ({architecture})"
    partition = {"dirichlet": f"dirichlet alpha {data.alpha}", "shard": f"{data.shards_per_client} shards each",
                 "pathological": f"{data.classes_per_client} classes each"}.get(data.partition, data.partition)
    rounds = f"{trainer.max_epochs} round{'' if trainer.max_epochs == 1 else 's'}"
    if cli.checkpoint_rounds:
        rounds += f" (resuming after round {cli.checkpoint_rounds})"
    seed = cli.subcommand_config().get("seed_everything")
    return (f"fit {method} on {data.dataset}: {data.num_clients} clients ({partition}), "
            f"{clients_per_round(data.num_clients, data.sample_ratio)} per round, {rounds}; "
            f"{_device(trainer)}, precision {trainer.precision}"
            f"{f', seed {seed}' if seed is not None and seed is not False else ''}; run directory {cli._run_root}")


def _device(trainer) -> str:
    """`cpu`, `cuda:0`, or `2 x cuda` (`4 nodes x 2 cuda`) for a run over several processes."""
    kind = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
    devices, nodes = trainer.num_devices, trainer.num_nodes
    if devices * nodes == 1:
        return str(trainer.strategy.root_device)
    return f"{nodes} nodes x {devices} {kind}" if nodes > 1 else f"{devices} x {kind}"


class _ParserBuilt(BaseException):
    """Carries the parser out of FLCLI's construction (`build_parser`); not an Exception, so no
    handler on the way takes it for an error."""


class _ParserOnlyCLI:
    """Mixed into FLCLI by `build_parser`: stops construction as soon as the parser exists."""

    def parse_arguments(self, parser, args) -> None:
        raise _ParserBuilt(*compat.cli_parser_parts(self))


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
        parser_class=FLArgumentParser,
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
    lifecycle = RunLifecycle(in_process=args is not None)
    try:
        args = layered_config_args(list(args) if lifecycle.in_process else sys.argv[1:])
        if not lifecycle.in_process:
            sys.argv[1:] = args  # LightningCLI reads the command line itself (and warns if also given args)
        cli = build_cli(args if lifecycle.in_process else None)
        ending = Ending(cli.exit_code(), cli.stop_line())
    except FLInterrupted as err:
        ending = lifecycle.interrupted(err)
    except Exception as err:
        ending = lifecycle.failed(err, args)
        if ending is None:
            raise  # a bug: its traceback
    finally:
        lifecycle.release()
    lifecycle.end(ending)


if __name__ == "__main__":
    main()
