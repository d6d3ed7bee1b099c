"""`fl-lightning`: LightningCLI with the federated pieces wired in.

- `--model` takes any method class (`FedSOL`, `FedAvg`, ...; see fl_lightning.methods) and the
  data module's DataSpec (classes, channels, image size) is linked into it.
- The federated callback is always present and configurable as `--federation.*`; personalised
  evaluation (fine-tune per client, local-only baseline) as `--personalization.*` (off by default).
- Every round is checkpointed to `<trainer.default_root_dir>/checkpoints/last.ckpt`, so
  `--ckpt_path last` resumes the run configured in the same directory.
- User errors (unknown names, impossible partitions, missing files) print one line, exit 2.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI

from fl_lightning import report, sweep
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.errors import FLUserError
from fl_lightning.federation import FederatedCallback, FLDivergedError
from fl_lightning.methods import FederatedMethod
from fl_lightning.personalization import PersonalizationCallback
from fl_lightning.progress import RoundProgressBar


class FLCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(FederatedCallback, "federation")
        parser.add_lightning_class_args(PersonalizationCallback, "personalization")
        parser.link_arguments("data.spec", "model.init_args.data_spec", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        trainer = cfg["trainer"]
        if trainer.get("reload_dataloaders_every_n_epochs") != 1:
            raise FLUserError("trainer.reload_dataloaders_every_n_epochs must be 1: every round samples new clients")
        root = trainer.get("default_root_dir") or "runs/default"
        trainer["default_root_dir"] = root
        self._checkpoint_dir = Path(root) / "checkpoints"
        logger = trainer.get("logger")
        init = getattr(logger, "init_args", None)
        if init is not None and "save_dir" in init and init.save_dir is None:
            init.save_dir = root
        ckpt = cfg.get("ckpt_path")
        if ckpt == "last":
            last = self._checkpoint_dir / "last.ckpt"
            if not last.exists():
                raise FLUserError(f"--ckpt_path last: no checkpoint at {last}; run fit with the same "
                                  f"trainer.default_root_dir first")
            cfg["ckpt_path"] = str(last)
        elif ckpt and not Path(ckpt).exists():
            raise FLUserError(f"--ckpt_path {ckpt}: no such file")

    def before_fit(self) -> None:
        # Load and partition the data before the run starts, so a missing file or an impossible
        # partition fails in seconds, before a logger run is created.
        self.datamodule.setup("fit")

    before_validate = before_test = before_fit

    def after_fit(self) -> None:
        finish_wandb(exit_code=0)

    after_validate = after_test = after_fit

    def _instantiate_trainer(self, config: dict, callbacks: list):
        # Added next to (not instead of) the user's trainer.callbacks, and only where the user has
        # neither their own nor switched the feature off.
        given = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks.append(RoundProgressBar())
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in given):
            # One checkpoint per round, overwritten, so a stopped run resumes at its last round.
            callbacks.append(ModelCheckpoint(dirpath=self._checkpoint_dir, save_last=True, save_top_k=0,
                                             every_n_epochs=1, enable_version_counter=False))
        return super()._instantiate_trainer(config, callbacks)


TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,  # one epoch = one round with its own clients
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,  # the round sampler shards batches across ranks itself
    "logger": {"class_path": "fl_lightning.loggers.FLWandbLogger"},
    "log_every_n_steps": 1,
}


def finish_wandb(exit_code: int) -> None:
    """Close the W&B run so its summary and history are complete on disk (offline runs are then
    ready for `wandb sync`); a diverged or failed run is closed with a non-zero exit code."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=exit_code)


def _summarise_parse_error(text: str) -> str:
    """jsonargparse explains a bad value over a dozen lines; keep what the user needs."""
    key = re.match(r'Parser key "([^"]+)"', text)
    where = key.group(1) if key else "arguments"
    missing = re.search(r"Expected a dot import path string: (\S+)", text)
    if missing and where == "model":
        from fl_lightning import methods

        names = ", ".join(n for n in sorted(methods.__all__) if n != "FederatedMethod")
        return f"unknown method '{missing.group(1)}'; choose one of: {names} (or a full class path)"
    problem = re.search(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)", text)
    if problem:
        return f"{where}: {problem.group(2).strip()} by {problem.group(1)}"
    expected = re.search(r"Expected a <class '(\w+)'>", text)
    given = re.search(r"Given value: (.+)", text)
    if expected and given:
        return f"{where}: expected {expected.group(1)}, got '{given.group(1).strip()}'"
    lines = [line.strip(" -") for line in text.splitlines() if line.strip(" -")]
    return " ".join(lines[:2])


def _one_line(err: BaseException) -> tuple[str, int] | None:
    """The one line (and exit code) for an error the user caused, or None for a real bug.
    Errors raised while jsonargparse instantiates a class arrive wrapped, so walk the chain."""
    seen = err
    while seen is not None:
        if isinstance(seen, FLUserError):
            return str(seen), 2
        if isinstance(seen, FLDivergedError):
            return str(seen), 3
        seen = seen.__cause__ or seen.__context__
    if type(err).__name__ == "ArgumentError":  # jsonargparse's parse errors (exit_on_error=False)
        return _summarise_parse_error(str(err)), 2
    return None


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("WANDB_SILENT", "true")
    args = sys.argv[1:] if args is None else list(args)
    if args[:1] in (["sweep"], ["report"]):  # not LightningCLI subcommands: fl_lightning/sweep.py, report.py
        sys.exit(_run_tool(args))
    args = sweep.agent_run_dir_args(args)
    try:
        FLCLI(
            FederatedMethod,
            FederatedDataModule,
            subclass_mode_model=True,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={"default_env": False, "exit_on_error": False},
            args=args,
        )
    except Exception as err:
        reported = _one_line(err)
        finish_wandb(exit_code=1)
        if reported is None:
            raise
        print(f"error: {reported[0]}", file=sys.stderr)
        sys.exit(reported[1])


def _run_tool(args: list[str]) -> int:
    tool = sweep if args[0] == "sweep" else report
    try:
        return tool.main(args[1:])
    except FLUserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    main()
