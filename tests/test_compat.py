"""Every library internal fl-lightning relies on (fl_lightning/compat.py), checked to still be
there and to still do what the project needs: an upgrade of Lightning, jsonargparse or W&B that
changes one of them fails here, in one place."""

from __future__ import annotations

import datetime
import inspect

import lightning as L
import pytest
import torch
from fl_test_utils import fit, one_client_module, toy_data

from fl_lightning import compat
from fl_lightning.methods import FedAvg


def test_skip_next_validation_skips_the_validation_of_that_epoch_only():
    class SkipRoundOne(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.current_epoch == 0:
                compat.skip_next_validation(trainer)

    class CountingFedAvg(FedAvg):
        def validation_step(self, batch, batch_idx):
            self.validated.append(self.current_epoch)
            return super().validation_step(batch, batch_idx)

    x, y = toy_data(n=12)
    dm = one_client_module(x, y)
    method = CountingFedAvg(model="mlp", data_spec=dm.spec)
    method.validated = []
    fit(method, dm, rounds=2, callbacks=[SkipRoundOne()])
    assert method.validated and set(method.validated) == {1}


def test_counted_manual_steps_are_lightnings_global_step():
    """One client, one epoch of 3 batches: 3 direct local steps, all counted."""
    x, y = toy_data(n=12)
    dm = one_client_module(x, y, batch_size=4)
    trainer = fit(FedAvg(model="mlp", data_spec=dm.spec), dm, rounds=2)
    assert trainer.global_step == 6


def test_the_per_batch_sigterm_broadcast_is_a_loop_attribute_called_every_batch():
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    compat.skip_per_batch_sigterm_broadcast(trainer)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None


def test_the_collective_timeout_is_what_ddp_initialises_its_process_group_with():
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy()
    compat.set_collective_timeout(strategy, 90)
    assert strategy._timeout == datetime.timedelta(seconds=90)
    assert '"timeout": self._timeout' in inspect.getsource(DDPStrategy.setup_distributed)


def test_launched_processes_are_the_subprocess_launchers_procs():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=3, num_nodes=1)
    assert launcher.procs == []  # filled with subprocess.Popen objects, one per rank 1..n-1
    assert "self.procs.append(new_process)" in inspect.getsource(_SubprocessScriptLauncher._call_children_scripts)
    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    assert compat.launched_processes(trainer) == []  # one process: none
    strategy = DDPStrategy()
    strategy._launcher = launcher
    launcher.procs = ["p1", "p2"]

    class Fake:
        node_rank, num_devices = 0, 3

    Fake.strategy = strategy
    assert compat.launched_processes(Fake) == [(1, "p1"), (2, "p2")]


def test_sync_module_states_broadcasts_rank_0s_tensors(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = torch.nn.Linear(2, 2)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        compat.sync_module_states(module)
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    finally:
        dist.destroy_process_group()


def test_import_object_and_parser_actions():
    assert compat.import_object("fl_lightning.methods.FedAvg") is FedAvg
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--x", type=int)
    assert "x" in [a.dest for a in compat.parser_actions(parser)]


def test_wandb_init_kwargs_reach_the_run_and_the_run_is_created_lazily(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    from fl_lightning.loggers import FLWandbLogger

    logger = FLWandbLogger(offline=True, save_dir=str(tmp_path), name="compat")
    assert not compat.wandb_run_created(logger)
    compat.wandb_init_kwargs(logger)["group"] = "g"
    run = logger.experiment  # started in the background; a use of it waits for the start
    try:
        assert run.group == "g"
        assert compat.wandb_run_created(logger)
    finally:
        import wandb

        wandb.finish()


def test_quiet_library_notices_drop_lightnings_own_info_lines_and_its_pytree_deprecation_only(caplog, monkeypatch):
    """Lightning's info lines (`GPU available: ...`, `Seed set to 0`) are told from fl-lightning's,
    which go through the same rank-zero logger, by the module that logged them: rank_zero_info
    logs with its caller's stack level (the internal this relies on)."""
    import logging
    import warnings

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.utilities._pytree import _tree_flatten
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    with warnings.catch_warnings(record=True) as caught:  # still needed: Lightning still warns
        warnings.simplefilter("always")
        _tree_flatten({"a": [1, 2]})
    assert any("LeafSpec" in str(w.message) for w in caught)

    def logged() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            rank_zero_info("round 1/2: global test acc 0.5")
            seed_everything(0)
            Trainer(logger=False, enable_checkpointing=False, accelerator="cpu")
        return [r.getMessage() for r in caplog.records]

    # as before any CLI run of this process quietened them
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    seed_logger = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_logger.level
    seed_logger.setLevel(logging.NOTSET)
    try:
        assert {"Seed set to 0", "GPU available: False, used: False"} <= set(logged())  # Lightning still says them
        compat.quiet_library_notices()
        assert logged() == ["round 1/2: global test acc 0.5"]
    finally:
        seed_logger.setLevel(level)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.quiet_library_notices()
        warnings.warn("something else", UserWarning, stacklevel=1)
        _tree_flatten({"a": [1, 2]})
    assert [str(w.message) for w in caught] == ["something else"]


def test_loss_scaler_is_the_precision_plugins_grad_scaler():
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")
    trainer = L.Trainer(plugins=[MixedPrecision("16-mixed", device="cpu", scaler=scaler)], accelerator="cpu",
                        logger=False, enable_checkpointing=False)
    assert compat.loss_scaler(trainer) is scaler
    assert compat.loss_scaler(L.Trainer(precision="bf16-mixed", accelerator="cpu", logger=False)) is None
    assert compat.loss_scaler(None) is None


def test_lightnings_sigterm_notifier_is_the_connectors_attribute_and_dropped():
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    source = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "[self._sigterm_notifier_fn]" in source  # read from the instance when handlers are registered
    assert "dist.broadcast" in inspect.getsource(_SignalConnector._sigterm_notifier_fn)
    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    compat.drop_sigterm_notifier(trainer)
    assert trainer._signal_connector._sigterm_notifier_fn(15, None) is None


def test_lightnings_child_process_observer_no_longer_kills_every_process(monkeypatch):
    import subprocess
    import sys
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    assert "self._terminate_all()" in inspect.getsource(_ChildProcessObserver._run)
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait()
    observer = _ChildProcessObserver(main_pid=-1, child_processes=[child], sleep_period=0)
    observer._terminate_all = lambda: pytest.fail("the observer would SIGKILL every process, rank 0 included")
    real = threading.enumerate
    monkeypatch.setattr(threading, "enumerate", lambda: [*real(), observer])  # found as Lightning's thread
    compat.disarm_child_process_observer()
    assert observer._run() is True  # a process exited non-zero: seen, nobody killed


WANDB_LAUNCH_CHECK = r"""
import os, sys
from fl_lightning.loggers import FLWandbLogger
logger = FLWandbLogger(offline=True, save_dir=sys.argv[1], name="launch")
logger.started_run()
print("launch imported by init:", "wandb.sdk.launch" in sys.modules)
from wandb.sdk.launch.inputs.internal import StagedLaunchInputs
from wandb.sdk.wandb_run import Run
applied = []
StagedLaunchInputs.apply = lambda self, run: applied.append(run)
Run._detect_and_apply_job_inputs(logger.started_run())
print("staged inputs applied:", len(applied))
import wandb
wandb.finish()
"""


def test_wandb_init_skips_launch_inputs_only_where_none_can_be_staged(tmp_path):
    """A run that is not a W&B Launch job does not import wandb.sdk.launch (0.3-1 s of start-up);
    once that module is imported (a Launch job staging inputs) they are applied as W&B does."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WANDB_LAUNCH_CHECK, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "offline"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "launch imported by init: False" in done.stdout
    assert "staged inputs applied: 1" in done.stdout


WANDB_PACKAGES_CHECK = r"""
import importlib.metadata, pathlib, sys
import wandb.util
from fl_lightning import compat
from fl_lightning.loggers import FLWandbLogger
read = sorted(f"{p.key}=={p.version}" for p in wandb.util.working_set())
compat.list_installed_packages_once()
calls = []
real = importlib.metadata.distributions
importlib.metadata.distributions = lambda *a, **k: calls.append(1) or real(*a, **k)
logger = FLWandbLogger(offline=True, save_dir=sys.argv[1], name="packages")
logger.started_run()
import wandb
wandb.finish()
listed = sorted(pathlib.Path(sys.argv[1]).glob("wandb/offline-run-*/files/requirements.txt"))[0].read_text().split()
print("metadata read at init:", len(calls))
print("requirements as read before:", sorted(listed) == read, len(read))
"""


def test_a_sweep_workers_package_list_is_read_once_and_is_what_wandb_records(tmp_path):
    """The warm sweep worker reads W&B's list of installed packages once (about 0.09 s of each
    run's start); a run's requirements.txt is still the full list, and W&B reads it through
    wandb.util.working_set at each init (the internal the patch replaces)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WANDB_PACKAGES_CHECK, str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "WANDB_MODE": "offline"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "metadata read at init: 0" in done.stdout
    assert "requirements as read before: True" in done.stdout


def test_wandb_looks_for_its_started_service_every_10_ms_not_every_200(tmp_path, monkeypatch):
    """W&B's start waits for its service's address file; the service writes it ~30 ms after it
    starts, and W&B looked only every 0.2 s. Same search, same answer, shorter waits."""
    import time

    from wandb.sdk.lib.service import service_port_file

    monkeypatch.setattr(service_port_file, "_SLEEP", service_port_file._SLEEP)  # W&B's own, back after
    compat.poll_wandb_service_often()
    compat.poll_wandb_service_often()  # twice: still one replacement
    address = tmp_path / "port"
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        if len(waits) == 3:  # the service is up after the third wait
            address.write_text("sock=41234\nEOF\n")

    monkeypatch.setattr(time, "sleep", sleep)

    class Running:
        def poll(self):
            return None

    token = service_port_file.poll_for_token(address, Running(), timeout=30)
    assert waits == [compat.WANDB_SERVICE_POLL_S] * 3 == [0.01] * 3
    assert type(token).__name__ == "TCPServiceToken" and token._port == 41234  # what the file said


def _sgd_run(step, release, hook=None):
    """Three momentum + weight-decay SGD steps on a fixed problem, through `step`/`release`, with
    an optional step pre-hook; the final weights, and whether an LR scheduler saw a step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    if hook is not None:
        opt.register_step_pre_hook(hook)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    for _ in range(3):
        release(opt)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step(opt)
    assert all(p.grad is not None for p in model.parameters())
    release(opt)
    assert all(p.grad is None for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()], getattr(opt, "_opt_called", False), sched


def test_steps_without_torchs_profiler_annotation_are_torchs_steps(recwarn):
    """`compat.step_optimizer` / `release_gradients` are `opt.step()` / `opt.zero_grad()` bit for
    bit (momentum and weight decay over 3 steps), tell the LR scheduler a step was taken (no
    'lr_scheduler.step() before optimizer.step()' warning), and still run a registered step hook."""
    reference, called, sched = _sgd_run(lambda o: o.step(), lambda o: o.zero_grad(set_to_none=True))
    fast, fast_called, fast_sched = _sgd_run(compat.step_optimizer, compat.release_gradients)
    assert called and fast_called
    assert all(torch.equal(a, b) for a, b in zip(reference, fast, strict=True))
    fast_sched.step()
    assert not [w for w in recwarn if "optimizer.step()" in str(w.message)]
    calls = []
    hooked, _, _ = _sgd_run(compat.step_optimizer, compat.release_gradients, hook=lambda *a: calls.append(1))
    assert len(calls) == 3 and all(torch.equal(a, b) for a, b in zip(reference, hooked, strict=True))
    # the internals relied on: the class's step is torch's profiling wrapper around SGD.step
    assert torch.optim.SGD.step.hooked and torch.optim.SGD.step.__wrapped__.__name__ == "step"


def _annotations(monkeypatch) -> list[str]:
    entered: list[str] = []
    enter = torch.autograd.profiler.record_function.__enter__

    def counting_enter(self):
        entered.append(self.name)
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", counting_enter)
    return entered


def test_a_fits_local_steps_pay_no_profiler_annotation_unless_a_profiler_records(monkeypatch):
    """torch annotates every `zero_grad` and `step` with `record_function` (two operator dispatches,
    ~30 us of a ~0.5 ms small-model step); a fit's direct local steps skip them, and keep them
    while a torch profiler records (its trace still names every step)."""
    entered = _annotations(monkeypatch)
    x, y = toy_data(n=12)
    dm = one_client_module(x, y, batch_size=4)
    fit(FedAvg(model="mlp", data_spec=dm.spec), dm, rounds=1)
    assert not [name for name in entered if name.startswith("Optimizer.")]

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        compat.release_gradients(opt)
        compat.step_optimizer(opt)
    assert "Optimizer.zero_grad#SGD.zero_grad" in entered and "Optimizer.step#SGD.step" in entered


def test_lightning_cli_still_calls_the_internal_fl_lightning_overrides_between_parsing_and_instantiation():
    """FLCLI overrides LightningCLI._parse_ckpt_path (Lightning's would load the checkpoint's
    hyperparameters over the requested ones): it must still be called right after parsing, before
    anything is instantiated, and the marker must refuse an override LightningCLI no longer has."""
    from lightning.pytorch.cli import LightningCLI

    from fl_lightning.cli_parsing import FLCLIParsing

    source = inspect.getsource(LightningCLI.__init__)
    calls = [source.index(call) for call in ("self.parse_arguments(", "self._parse_ckpt_path()",
                                             "self.before_instantiate_classes()")]
    assert calls == sorted(calls)
    assert FLCLIParsing._parse_ckpt_path is not LightningCLI._parse_ckpt_path

    def _parse_ckpt_path(self):
        pass

    def _parse_ckpt_path_with(self, path):
        pass

    def _no_such_internal(self):
        pass

    assert compat.overrides_lightning_cli_internal(_parse_ckpt_path) is _parse_ckpt_path
    _parse_ckpt_path_with.__name__ = "_parse_ckpt_path"
    for changed in (_parse_ckpt_path_with, _no_such_internal):
        with pytest.raises(RuntimeError, match="update fl_lightning/compat.py"):
            compat.overrides_lightning_cli_internal(changed)


class _PartsBuilt(BaseException):
    pass


def test_a_lightning_cli_runs_a_subcommand_with_parser_parts_another_built(tmp_path):
    """What `setup_parser` builds (the parser, each subcommand's parser and Trainer-method
    arguments) taken from one LightningCLI and handed to another (a sweep worker's prebuilt
    parser): the second parses and runs fit with them, building none of its own."""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Probe(LightningCLI):
        def parse_arguments(self, parser, args):
            raise _PartsBuilt(self, compat.cli_parser_parts(self))

    with pytest.raises(_PartsBuilt) as built:
        Probe(BoringModel, args=["fit"])
    probe, parts = built.value.args
    parser, method_arguments, parsers = parts
    assert parser is probe.parser and set(parsers) == {"fit", "validate", "test", "predict"}
    assert "ckpt_path" in method_arguments["fit"]
    assert compat.cli_subcommand_parsers(probe) is parsers and compat.cli_subcommand_parsers(None) == {}
    assert compat.cli_subcommand_parser(probe, "fit") is parsers["fit"] is probe._parser("fit")
    assert compat.cli_subcommand_parser(probe, None) is parser is probe._parser(None)

    class Reuse(LightningCLI):
        def setup_parser(self, add_subcommands, main_kwargs, subparser_kwargs):
            compat.set_cli_parser_parts(self, parts)

    cli = Reuse(BoringModel, args=["fit", "--trainer.fast_dev_run", "1", "--trainer.logger", "false",
                                   "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary",
                                   "false", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.parser is parser and cli.trainer.state.finished and cli.trainer.global_step == 1


class _Configured(L.Callback):
    pass


class _Persistent(L.Callback):
    pass


def test_persistent_callbacks_come_after_the_users_and_the_cli_options_callbacks():
    """The CLI's own callbacks (round checkpoint, results, watchdog) go into every Trainer after
    the user's trainer.callbacks and the callbacks of the CLI's options (the results callback
    reads the round callback's report in the same hooks)."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    defaults = {"logger": False}

    class CLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(_Configured, "configured")

        def instantiate_trainer(self, **kwargs):
            compat.add_persistent_callbacks(self, [_Persistent()])
            return super().instantiate_trainer(**kwargs)

    cli = CLI(BoringModel, run=False, trainer_defaults=defaults,
              args=["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",
                    "--trainer.enable_progress_bar=false"])
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert kinds.index(LearningRateMonitor) < kinds.index(_Configured) < kinds.index(_Persistent)
    assert defaults == {"logger": False}  # the defaults given stay as they were, for the next CLI
def test_attached_trainer_is_the_fits_trainer_and_none_outside_a_fit():
    """Lightning's public `module.trainer` raises outside a fit, which is why the methods ask
    compat; inside the fit both are the same Trainer."""
    x, y = toy_data(n=12)
    dm = one_client_module(x, y)
    method = FedAvg(model="mlp", data_spec=dm.spec)
    assert compat.attached_trainer(method) is None
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        method.trainer  # noqa: B018 - the property is what is tested
    seen = []

    class Look(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            seen.append(compat.attached_trainer(pl_module) is trainer is pl_module.trainer)

    fit(method, dm, rounds=1, callbacks=[Look()])
    assert seen and all(seen)


class KeyedCallback(L.Callback):
    pass


def test_a_callbacks_state_key_is_its_class_name_and_arguments():
    """The key a checkpoint stores the analysis callback's state under: a change of its form
    would leave resumed runs without their analysis tables."""
    key = compat.callback_state_key(KeyedCallback(), surface="none", every_n_rounds=5)
    assert key == "KeyedCallback{'surface': 'none', 'every_n_rounds': 5}"


def test_module_internal_overrides_see_every_conversion_and_are_checked_at_import():
    class Watched(torch.nn.Linear):
        @compat.overrides_module_internal
        def _apply(self, fn, recurse=True):
            self.applied = getattr(self, "applied", 0) + 1
            return super()._apply(fn, recurse)

    module = Watched(2, 2)
    conversions = [lambda m: m.double(), lambda m: m.float(), lambda m: m.to(torch.float64), lambda m: m.to("cpu"),
                   lambda m: m.type(torch.float32), lambda m: m.bfloat16(), lambda m: m.half()]
    for i, convert in enumerate(conversions, start=1):
        convert(module)
        assert module.applied == i
    assert module.weight.dtype == torch.float16
    with pytest.raises(RuntimeError, match="update fl_lightning/compat.py"):
        compat.overrides_module_internal(lambda self, fn: None)  # a name nn.Module lacks

    def _apply(self, fn, recurse=True, extra=None):
        return self

    with pytest.raises(RuntimeError, match=r"_apply\(self, fn, recurse=True, extra=None\)"):
        compat.overrides_module_internal(_apply)  # not nn.Module's parameters


def test_batch_norm_is_every_batch_norm_layer_of_torch_and_no_other_norm():
    from torch import nn

    kinds = [getattr(nn, name) for name in dir(nn) if "BatchNorm" in name]
    assert {k.__name__ for k in kinds} >= {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                                           "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"}
    assert all(compat.is_batch_norm(k(4) if "Lazy" not in k.__name__ else k()) for k in kinds)
    others = [nn.InstanceNorm1d(4), nn.InstanceNorm2d(4, affine=True), nn.LayerNorm(4), nn.GroupNorm(2, 4),
              nn.LocalResponseNorm(2), nn.Linear(2, 2)]
    assert not any(compat.is_batch_norm(m) for m in others)


EXIT_HANDLERS_CHECK = r"""
import atexit, os, sys, weakref
from fl_lightning import compat
parent = os.getpid()

def say(label):
    os.write(1, f"{label} in {'parent' if os.getpid() == parent else 'child'}\n".encode())

class Owned:
    pass

atexit.register(say, "parent exit function")
owned = Owned()
weakref.finalize(owned, say, "parent finalizer")
pid = os.fork()
if pid == 0:
    compat.forget_exit_handlers()
    atexit.register(say, "child exit function")
    mine = Owned()
    weakref.finalize(mine, say, "child finalizer")
    compat.run_exit_handlers()
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_forgets_the_parents_exit_handlers_and_runs_its_own():
    """What the warm sweep worker's runs rely on: a run's exit cleans up what the run made, never
    what the worker made (W&B's media directory), and the worker's still run at its own exit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXIT_HANDLERS_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.splitlines()) == ["child exit function in child", "child finalizer in child",
                                                "parent exit function in parent", "parent finalizer in parent"]


def test_the_validation_data_is_loaded_once_a_fit_not_once_a_round(monkeypatch):
    """`reload_dataloaders_every_n_epochs=1` (every round has its own clients) would rebuild the
    global test set's loader every round; the round callback keeps it (3 rounds: one load)."""
    from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop

    assert "_last_val_dl_reload_epoch" in inspect.getsource(_EvaluationLoop._should_reload_val_dl.fget)

    def loads(keep: bool) -> int:
        if not keep:
            monkeypatch.setattr(compat, "keep_validation_data", lambda trainer: None)
        x, y = toy_data(n=12)
        dm = one_client_module(x, y)
        calls = []
        real = dm.val_dataloader
        dm.val_dataloader = lambda: calls.append(1) or real()
        fit(FedAvg(model="mlp", data_spec=dm.spec), dm, rounds=3)
        return len(calls)

    assert loads(keep=True) == 1
    assert loads(keep=False) == 3  # what Lightning does on its own


def test_progress_bar_metrics_are_the_dict_lightning_shows():
    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    compat.progress_bar_metrics(trainer)["round_acc"] = 0.5
    assert trainer.progress_bar_metrics["round_acc"] == 0.5


def test_a_wandb_run_made_outside_lightnings_logger_is_its_run(tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    assert compat.wandb_offline(WandbLogger(offline=True, save_dir=str(tmp_path)))
    logger = WandbLogger(offline=False, save_dir=str(tmp_path))
    assert not compat.wandb_offline(logger) and not compat.wandb_run_created(logger)
    run = object()
    compat.set_wandb_run(logger, run)
    assert compat.wandb_run_created(logger) and logger.experiment is run  # no second run made


PROCESS_GROUP_CHECK = r"""
import atexit, sys
import torch.distributed as dist
from fl_lightning import compat
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs last
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
compat.destroy_process_group_at_exit()
compat.destroy_process_group_at_exit()  # once however often called
print("registered")
"""


def test_the_process_group_is_destroyed_when_the_interpreter_exits(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PROCESS_GROUP_CHECK, str(tmp_path / "rendezvous")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["registered", "initialized at exit: False"]
