"""The library internals fl-lightning depends on, each behind one function here, so that an
upgrade of Lightning, jsonargparse, W&B's Lightning logger or argparse breaks in one place (each has
a test in tests/test_compat.py that fails if the internal changes)."""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from typing import Any

# Lightning 2.6's own pytree helper calls an API torch >= 2.9 deprecates.
LIGHTNING_PYTREE_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def skip_next_validation(trainer) -> None:
    """Lightning runs validation at the end of every training epoch, also one that
    `trainer.should_stop` ends early; a round that stopped before its server step has no new model
    to evaluate. (`_TrainingEpochLoop._skip_next_val`, read once at the epoch's last batch.)"""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_skip_next_val"):
        raise RuntimeError("Lightning's training epoch loop has no _skip_next_val any more: "
                           "update fl_lightning/compat.py")
    loop._skip_next_val = True


def keep_validation_data(trainer) -> None:
    """The round's validation reuses the validation DataLoader (the global test set, the same every
    round), where `reload_dataloaders_every_n_epochs=1` (for the training data: every round has its
    own clients) would rebuild it every round. Called at a round's start: the validation loop
    reloads when `current_epoch - _last_val_dl_reload_epoch >= 1`, and loads the first time
    whatever the value (`_EvaluationLoop._should_reload_val_dl`, `setup_data`)."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    if not hasattr(loop, "_last_val_dl_reload_epoch"):
        raise RuntimeError("Lightning's evaluation loop has no _last_val_dl_reload_epoch any more: "
                           "update fl_lightning/compat.py")
    loop._last_val_dl_reload_epoch = trainer.current_epoch


def progress_bar_metrics(trainer) -> dict:
    """The values the progress bar shows, for values published without `self.log`: Lightning
    keeps them across epochs in `_LoggerConnector._progress_bar_metrics` (what
    `trainer.progress_bar_metrics` returns, updated from `self.log`'s values)."""
    connector = trainer._logger_connector
    if not isinstance(getattr(connector, "_progress_bar_metrics", None), dict):
        raise RuntimeError("Lightning's logger connector has no _progress_bar_metrics dict any more: "
                           "update fl_lightning/compat.py")
    return connector._progress_bar_metrics


def launched_processes(trainer) -> list[tuple[int, object]]:
    """(global rank, subprocess.Popen) of the processes Lightning's launcher started from this one
    (ranks 1.. of `--trainer.strategy ddp` on this machine; none under torchrun or SLURM, whose
    agents watch their processes themselves). (`_SubprocessScriptLauncher.procs`.)"""
    launcher = getattr(trainer.strategy, "launcher", None)
    procs = getattr(launcher, "procs", None)
    if not procs:
        return []
    base = trainer.node_rank * trainer.num_devices
    return [(base + local_rank, proc) for local_rank, proc in enumerate(procs, start=1)]


def drop_sigterm_notifier(trainer) -> None:
    """Lightning answers SIGTERM (`_SignalConnector._sigterm_notifier_fn`, registered when a fit,
    validate or test starts) by sending SIGTERM to the processes its launcher started and then
    broadcasting a flag from rank 0, inside the signal handler: a collective the other processes
    are not in (they wait in the round's gather), so both wait for the collective timeout (30
    minutes). The CLI handles the signal itself (run_lifecycle.py: the run ends with exit 143, and
    rank 0 stops the processes it started), so Lightning's notifier does nothing here."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "_sigterm_notifier_fn"):
        raise RuntimeError("Lightning's trainer has no _signal_connector._sigterm_notifier_fn any more: "
                           "update fl_lightning/compat.py")
    connector._sigterm_notifier_fn = lambda signum, frame: None


def disarm_child_process_observer() -> None:
    """Lightning's launcher watches the processes it started (`_ChildProcessObserver`, a thread of
    rank 0) and, as soon as one has exited with a non-zero code, SIGKILLs every process, rank 0
    included: a process that ended the way the run decided (exit 3 after a divergence, 130 after
    Ctrl-C) would cut rank 0 short before it records the outcome and prints its line. The CLI's
    own watchdog (run_lifecycle.LostProcessWatchdog) takes over: it ends the run only when a
    process died and rank 0 has not ended it itself within a grace period."""
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            if not hasattr(thread, "_terminate_all"):
                raise RuntimeError("Lightning's _ChildProcessObserver has no _terminate_all any more: "
                                   "update fl_lightning/compat.py")
            thread._terminate_all = lambda: None


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_at_exit() -> None:
    """Destroys the default process group when the interpreter exits, before it finalizes (once
    per process, however often called). Lightning does this for NCCL only; a gloo group left to
    the interpreter's teardown can have its worker threads destroyed while still joinable, which
    aborts the process ("terminate called without an active exception", exit code -6) after a
    run that finished: 8 of 30 two-process exits of a script of 200 all_reduces on a loaded
    machine here, 0 of 30 with the group destroyed first."""
    import atexit

    atexit.unregister(_destroy_process_group)  # registered once, also in a process that cleared atexit
    atexit.register(_destroy_process_group)


def set_collective_timeout(strategy, seconds: float) -> None:
    """The timeout of the process group a DDP strategy creates (`DDPStrategy._timeout`, read when
    the group is initialised)."""
    import datetime

    if not hasattr(strategy, "_timeout"):
        raise RuntimeError("Lightning's DDPStrategy has no _timeout any more: update fl_lightning/compat.py")
    strategy._timeout = datetime.timedelta(seconds=seconds)


def sync_module_states(module) -> None:
    """Broadcasts rank 0's parameters and buffers to every process (Lightning's
    `_sync_module_states`, what DistributedDataParallel does when it wraps a module)."""
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(module)


def skip_per_batch_sigterm_broadcast(trainer) -> None:
    """Lightning's training loop broadcasts a SIGTERM flag from rank 0 before every batch
    (`_TrainingEpochLoop._broadcast_sigterm_tensor`), a collective that pairs up the processes'
    batches; with clients in parallel a batch is a client and processes train different numbers."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        raise RuntimeError("Lightning's training epoch loop has no _broadcast_sigterm_tensor any more: "
                           "update fl_lightning/compat.py")
    loop._broadcast_sigterm_tensor = lambda: None


def count_manual_optimizer_steps(trainer, steps: int) -> None:
    """Local steps taken without Lightning's optimizer wrapper still count as Lightning's optimizer
    steps (`trainer.global_step`, which loggers and `max_steps` read), `steps` at a time."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    for tracker in (progress.total, progress.current):
        tracker.ready += steps
        tracker.completed += steps


def _profiling() -> bool:
    import torch

    return torch.autograd.profiler._is_profiler_enabled


def release_gradients(optimizer) -> None:
    """`optimizer.zero_grad(set_to_none=True)` without its profiler annotation (torch wraps it in
    `record_function`, two operator dispatches, a noticeable share of a small model's local
    step), unless a torch profiler is recording."""
    if _profiling():
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def step_optimizer(optimizer) -> None:
    """`optimizer.step()` without the profiler annotation torch wraps every optimizer's step in
    (`Optimizer.profile_hook_step`: `record_function`) when it would do nothing
    else: no step hook registered (on this optimizer or globally) and no torch profiler recording.
    The step itself (`SGD.step` under its own grad-mode wrapper) is the same call. An LR
    scheduler tells a step from none by `_opt_called`, which its wrapper of `optimizer.step` sets."""
    from torch.optim import optimizer as torch_optimizer

    hooked = type(optimizer).step
    if (_profiling() or not getattr(hooked, "hooked", False) or optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks):
        optimizer.step()
        return
    hooked.__wrapped__(optimizer)
    optimizer._opt_called = True


def loss_scaler(trainer) -> Any:
    """The GradScaler of the Trainer's precision plugin (`MixedPrecision.scaler`: 16-mixed on a
    GPU, or a plugin given one), else None. Lightning scales, unscales and steps through it inside
    `manual_backward` and `LightningOptimizer.step`; steps past those use it directly."""
    plugin = getattr(trainer, "precision_plugin", None) if trainer is not None else None
    return getattr(plugin, "scaler", None)


def overrides_lightning_cli_internal(method):
    """Marks a LightningCLI subclass's override of one of LightningCLI's internal methods (a name
    starting with `_`, outside its documented hooks), kept because no public hook can replace it:
    fails at import, naming this file, when LightningCLI no longer has a method of that name with
    the same parameters (tests/test_compat.py checks that LightningCLI still calls it where the
    override expects)."""
    from lightning.pytorch.cli import LightningCLI

    theirs = getattr(LightningCLI, method.__name__, None)
    if not callable(theirs) or list(inspect.signature(theirs).parameters) != list(inspect.signature(method).parameters):
        raise RuntimeError(f"LightningCLI has no {method.__name__}{inspect.signature(method)} any more: "
                           f"update fl_lightning/compat.py")
    return method


def cli_parser_parts(cli) -> tuple:
    """What `LightningCLI.setup_parser` builds with subcommands: the main parser, each subcommand's
    Trainer-method arguments (`_subcommand_method_arguments`, read when the subcommand runs) and
    each subcommand's parser (`_subcommand_parsers`)."""
    return cli.parser, cli._subcommand_method_arguments, cli._subcommand_parsers


def set_cli_parser_parts(cli, parts: tuple) -> None:
    """Hands a LightningCLI the parts `cli_parser_parts` took from another (built earlier) in place
    of building them in its `setup_parser`."""
    cli.parser, cli._subcommand_method_arguments, cli._subcommand_parsers = parts


def cli_subcommand_parsers(cli) -> dict:
    """subcommand -> its parser, of a LightningCLI (`_subcommand_parsers`); empty before its
    `setup_parser` ran (or for None)."""
    return getattr(cli, "_subcommand_parsers", None) or {}


def cli_subcommand_parser(cli, subcommand: str | None):
    """The parser of one subcommand of a LightningCLI (its main parser for None), as
    `LightningCLI._parser` picks it."""
    return cli.parser if subcommand is None else cli._subcommand_parsers[subcommand]


def add_persistent_callbacks(cli, callbacks: list) -> None:
    """Callbacks every Trainer this LightningCLI builds gets, not configurable (its documented
    `trainer_defaults["callbacks"]`, here set once the config is known). Lightning appends them
    after the user's `trainer.callbacks` and the callbacks of the CLI's own options
    (`--federation.*`: `LightningCLI._instantiate_trainer`), the order the results callback
    needs (it reads the round callback's report in the same hooks)."""
    cli.trainer_defaults = {**cli.trainer_defaults, "callbacks": list(callbacks)}


def import_object(path: str) -> Any:
    """The class or function a dotted path names, as jsonargparse resolves `class_path`."""
    from jsonargparse._util import import_object as resolve

    return resolve(path)


def parser_actions(parser) -> list:
    """The options an argparse (or jsonargparse) parser knows (`ArgumentParser._actions`)."""
    return list(parser._actions)


def wandb_init_kwargs(logger) -> dict:
    """The keyword arguments Lightning's WandbLogger will pass to `wandb.init` when it creates the
    run (`WandbLogger._wandb_init`): config, group and tags are set there before the run exists."""
    return logger._wandb_init


def wandb_offline(logger) -> bool:
    """Whether Lightning's WandbLogger was asked to log offline (`WandbLogger._offline`)."""
    return bool(logger._offline)


def set_wandb_run(logger, run) -> None:
    """Hands Lightning's WandbLogger a W&B run created outside it (`WandbLogger._experiment`)."""
    logger._experiment = run


def wandb_run_created(logger) -> bool:
    """Whether Lightning's WandbLogger has created its W&B run yet (`WandbLogger._experiment`)."""
    return logger._experiment is not None


def skip_unstaged_wandb_launch_inputs() -> None:
    """`wandb.init` applies inputs staged for a W&B Launch job (`Run._detect_and_apply_job_inputs`),
    importing `wandb.sdk.launch` to look for them: about 0.3-1 s of every run's start-up (most of
    `wandb.init` offline). Inputs can only have been staged through that module, so where it is
    not imported yet there is nothing to apply and the import is skipped; a Launch job, which
    imports it, keeps W&B's behaviour."""
    import sys

    from wandb.sdk.wandb_run import Run

    apply = Run.__dict__.get("_detect_and_apply_job_inputs")
    if apply is None:
        raise RuntimeError("W&B's Run has no _detect_and_apply_job_inputs any more: update fl_lightning/compat.py")
    if getattr(apply, "_fl_lightning_skips_unstaged", False):
        return

    def apply_if_staged(run) -> None:
        if "wandb.sdk.launch.inputs.internal" in sys.modules:
            apply(run)

    apply_if_staged._fl_lightning_skips_unstaged = True
    Run._detect_and_apply_job_inputs = apply_if_staged


WANDB_SERVICE_POLL_S = 0.01


def poll_wandb_service_often() -> None:
    """`wandb.init` starts W&B's service process and waits for the file it writes its address to,
    looking once, then every 0.2 s (`service_port_file._SLEEP`, a module global W&B itself
    replaces in its tests): the service is ready well before the first look again, so every run's
    start would wait for nothing. Looking every WANDB_SERVICE_POLL_S instead (a file check each
    time) takes that wait off every run, and W&B's timeout and its error when the service dies are
    unchanged."""
    import time

    from wandb.sdk.lib.service import service_port_file

    sleep = getattr(service_port_file, "_SLEEP", None)
    if sleep is None:
        raise RuntimeError("W&B's service_port_file has no _SLEEP any more: update fl_lightning/compat.py")
    if getattr(sleep, "_fl_lightning_polls_often", False):
        return

    def sleep_briefly(seconds: float) -> None:
        time.sleep(min(seconds, WANDB_SERVICE_POLL_S))

    sleep_briefly._fl_lightning_polls_often = True
    service_port_file._SLEEP = sleep_briefly


def list_installed_packages_once() -> None:
    """`wandb.init` records the installed packages (the run's requirements.txt) by reading the
    metadata of every installed distribution (`wandb.util.working_set`, called at each run's
    start). A sweep worker calls this once after its imports, before it
    forks its runs: they execute the modules the worker imported, so the list read then is the
    record of what they run, and each run reuses it."""
    import wandb.util

    working_set = getattr(wandb.util, "working_set", None)
    if working_set is None:
        raise RuntimeError("W&B has no wandb.util.working_set any more: update fl_lightning/compat.py")
    if getattr(working_set, "_fl_lightning_listed_once", False):
        return
    packages = tuple(working_set())

    def listed_once():
        return iter(packages)

    listed_once._fl_lightning_listed_once = True
    wandb.util.working_set = listed_once


class _DropLightningInfo(logging.Filter):
    """Drops the info lines Lightning itself logs through its rank-zero logger (device availability,
    `Trainer.fit` stopped, checkpoint restored, hosted-service tips): the CLI's header line says
    what a researcher needs of them. fl-lightning's own lines go through the same logger
    (`rank_zero_info`), so the logger's level cannot be raised; they are told apart by where they
    were logged from: `rank_zero_info` logs with the stack level of its caller, so a record's
    pathname is the module that called it. Warnings and errors always pass."""

    def __init__(self):
        super().__init__()
        import lightning

        self.lightning_dir = os.path.dirname(os.path.abspath(lightning.__file__)) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(self.lightning_dir)


# the loggers behind rank_zero_info: Lightning's and Fabric's (the last imported of the two is used)
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def quiet_library_notices() -> None:
    """Silence Lightning's own info lines (see _DropLightningInfo), its `Seed set to N` (the header
    line gives the seed) and its pytree helper's torch deprecation warning (a Lightning matter,
    printed once per run at the first batch; nothing a user of fl-lightning can act on), nothing else."""
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningInfo) for f in logger.filters):
            logger.addFilter(_DropLightningInfo())
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=LIGHTNING_PYTREE_DEPRECATION,
                            module="lightning.pytorch.utilities._pytree")


# ---- internals used by the methods, the state containers, the analysis callback and the warm worker


def attached_trainer(module) -> Any:
    """The Trainer a LightningModule is attached to, or None when it is not (a method built and
    used outside a fit: tests, `analyze`). Lightning's public `module.trainer` raises in that case;
    `LightningModule._trainer` is what it reads."""
    return module._trainer


def callback_state_key(callback, **kwargs) -> str:
    """A callback's `state_key` that tells instances apart by `kwargs`, as Lightning's own callbacks
    make theirs (`Callback._generate_state_key`: the class name and the arguments). Checkpoints
    store the callback's state under this key, so its form must stay what they were written with."""
    return callback._generate_state_key(**kwargs)


def overrides_module_internal(method):
    """Marks an `nn.Module` subclass's override of one of `nn.Module`'s internal methods (a name
    starting with `_`), kept because no public hook replaces it: `_apply`, through which every
    device and dtype conversion (`.to`, `.double`, `.cuda`, ...) goes, is where a module learns that
    its tensors were replaced. Fails at import, naming this file, when `nn.Module` no longer has a
    method of that name with the same parameters (tests/test_compat.py checks the conversions still
    go through it)."""
    import inspect

    from torch import nn

    theirs = getattr(nn.Module, method.__name__, None)
    if not callable(theirs) or list(inspect.signature(theirs).parameters) != list(inspect.signature(method).parameters):
        raise RuntimeError(f"torch's nn.Module has no {method.__name__}{inspect.signature(method)} any more: "
                           f"update fl_lightning/compat.py")
    return method


def is_batch_norm(module) -> bool:
    """Whether `module` is a batch-normalisation layer of torch, of any dimension, lazy or synced
    (`torch.nn.modules.batchnorm._BatchNorm`, their common base; instance, layer and group norms
    are not)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm)


def forget_exit_handlers() -> None:
    """In a forked child: drops every exit function (`atexit`) and finalizer (`weakref.finalize`)
    inherited from the parent, which would otherwise run at the child's exit on what the parent
    owns; the child's own, registered afterwards, still run at its exit (`run_exit_handlers`).
    (`atexit._clear`, `weakref.finalize._registry`, `_registered_with_atexit`, `_exitfunc`:
    CPython's, stable since 3.4.)"""
    import atexit
    import weakref

    atexit._clear()
    for finalizer in list(weakref.finalize._registry):
        finalizer.detach()
    if weakref.finalize._registered_with_atexit:  # CPython registers its finalizers' exit function once
        atexit.register(weakref.finalize._exitfunc)


def run_exit_handlers() -> None:
    """Runs the exit functions (`atexit`) now, what interpreter shutdown does, for a process that
    ends with `os._exit` (a forked child) (`atexit._run_exitfuncs`)."""
    import atexit

    atexit._run_exitfuncs()
