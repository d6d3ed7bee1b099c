"""What `fl-lightning fit|validate|test|analyze` parses, and the config it completes before anything
is built from it.

- The parser: LightningCLI's (Trainer, `--model` any method class, `--data`) plus the federated
  callback (`--federation.*`), personalised evaluation (`--personalization.*`), the analyses
  (`--analysis.*`) and `--overwrite`; the data module's DataSpec is linked into the method. Only
  the invoked subcommand's parser is built, or one built before the process started is taken
  (a sweep worker's: `FLCLIParsing.prebuilt`).
- The config completed where the user left it unset: the run's directory and W&B name and group
  from its --config files (`name_run_from_configs`), `data.seed` from `seed_everything`
  (`follow_seed_everything`), and for validate/test/analyze of a run's checkpoint that run's own
  directory (`follow_the_checkpoints_run`).
- `--ckpt_path`: `last` found in the run directory, the file checked (damaged, foreign, another
  experiment's) before anything loads it.
- The checks the config alone decides, before any class is built or process launched.
- A parse error's one-line summary (fl_lightning/parse_errors.py reads jsonargparse's report).

The rest of the command, the run and its hooks, is FLCLI in fl_lightning/lightning_cli.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import docstring_parser
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from fl_lightning import compat
from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.checkpointing import (
    LAST,
    check_compatible,
    check_resume_options,
    completed_rounds,
    load_checkpoint_file,
    verify_client_state_files,
)
from fl_lightning.config_files import run_name_from_configs
from fl_lightning.data.datamodule import clients_per_round
from fl_lightning.errors import FLUserError
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FederatedMethod
from fl_lightning.parallel import check_process_count, client_strategy_name
from fl_lightning.personalization import PersonalizationCallback
from fl_lightning.rundir import RunDirectory
from fl_lightning.wandb_run import configure_wandb_logger

# what each of Lightning's subcommands does in a federated run (its help's first paragraph)
DESCRIPTIONS = {
    "fit": ("Trains a federated run: one epoch of Lightning's loop is one round (the sampled clients' local "
            "training, then the server's step), with the global model evaluated after every round. Results go "
            "to the run directory (--trainer.default_root_dir): metrics.csv, clients.csv, summary.json, "
            "checkpoints/last.ckpt and the analyses' pictures."),
    "validate": ("Evaluates a checkpoint's global model on the test set (the papers' protocol has no separate "
                 "validation split; model-heterogeneous methods: every client's own model on its own test split) "
                 "and prints its round and accuracy, leaving the run's files as they were."),
    "test": ("Evaluates a checkpoint's global model on the test set (model-heterogeneous methods: every client's "
             "own model on its own test split) and prints its round and accuracy, leaving the run's files as "
             "they were."),
}


class FLArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, minus the help of a method's `data_spec`: the CLI links it from the
    data module (`--data.dataset` and its options), so it is no option of the user's. Hidden from
    `--help` and `--model.help` alike (jsonargparse builds the latter with this parser class)."""

    def add_class_arguments(self, class_type, nested_key=None, *args, **kwargs):
        added = super().add_class_arguments(class_type, nested_key, *args, **kwargs)
        if isinstance(class_type, type) and issubclass(class_type, FederatedMethod):
            prefix = f"{nested_key}." if nested_key else ""
            hidden = {f"{prefix}data_spec", f"{prefix}data_spec.help"}
            for action in compat.parser_actions(self):
                if action.dest in hidden:
                    action.help = argparse.SUPPRESS
        return added


class FLCLIParsing(LightningCLI):
    """The parsing half of the CLI (FLCLI adds the run): the parser, the completed config, the
    `--ckpt_path` check, and the checks made before any class is instantiated."""

    SUBCOMMANDS = ("fit", "validate", "test", "analyze")
    # subcommand -> what `setup_parser` builds, built before this process started (a sweep worker
    # builds fit's before forking its runs: `prebuild_parser`); taken by the first CLI of the process
    prebuilt: dict[str, tuple] = {}
    checkpoint_rounds = 0  # rounds the --ckpt_path checkpoint holds

    # what `--ckpt_path` takes, in each subcommand's --help (Lightning's text describes its own
    # keywords, `hpc`, `registry`, `best`, which this CLI does not take)
    CKPT_PATH_HELP = {
        "fit": "`last` to continue this run from its last checkpoint (<trainer.default_root_dir>/checkpoints/"
               "last.ckpt), or a path to a .ckpt file of the same experiment",
        "validate": "the checkpoint to evaluate: `last` (the last checkpoint of the run in "
                    "trainer.default_root_dir) or a path to a .ckpt file",
        "analyze": "the checkpoint to analyse: `last` (the last checkpoint of the run in "
                   "trainer.default_root_dir) or a path to a .ckpt file",
    }
    CKPT_PATH_HELP["test"] = CKPT_PATH_HELP["validate"]
    # Lightning's text advises `false` for trusted files; this CLI reads every checkpoint as data
    WEIGHTS_ONLY_HELP = ("has no effect: every checkpoint is read as data only (torch's weights_only=True), and "
                         "a file that holds code or objects is refused")
    # --help's usage line: the groups rather than every one of their options, which the help lists
    USAGE = ("%(prog)s [-h] [-c CONFIG] [--print_config] [--model METHOD]\n"
             "       [--{model,data,federation,personalization,analysis,trainer}.OPTION VALUE ...]\n"
             "       [--ckpt_path last|FILE]")

    def __init__(self, *args, **kwargs):
        given = kwargs.get("args")
        given = sys.argv[1:] if given is None else given
        self._invoked = given[0] if given and isinstance(given[0], str) else None
        kwargs["parser_kwargs"] = self._parser_kwargs(kwargs.get("parser_kwargs") or {}, kwargs.get("trainer_class"))
        super().__init__(*args, **kwargs)

    def _parser_kwargs(self, given: dict, trainer_class) -> dict:
        """LightningCLI's `parser_kwargs` (one key per subcommand for that subcommand's parser):
        the command's name whichever way it was started, and for each subcommand its whole
        description (Lightning takes the first line of the Trainer method's docstring, which can
        end mid-sentence) and a short usage line."""
        kwargs = {"prog": "fl-lightning", **given}
        for name in self.subcommands():
            own = {"usage": self.USAGE + (" [--overwrite true]" if name == "fit" else "")}
            doc = docstring_parser.parse(getattr(trainer_class, name, None).__doc__ or "") if trainer_class else None
            if name in DESCRIPTIONS:  # Lightning's words for its own loops, not a federated run's
                own["description"] = DESCRIPTIONS[name]
            elif doc is not None and doc.short_description:
                own["description"] = " ".join(filter(None, (doc.short_description, doc.long_description)))
            kwargs[name] = {**own, **given.get(name, {})}
        return kwargs

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        built = self.prebuilt.pop(self._invoked, None) if add_subcommands else None
        if built is None:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        else:
            compat.set_cli_parser_parts(self, built)
        for name, parser in compat.cli_subcommand_parsers(self).items():
            if name != "fit":
                # Lightning's table of the metrics' full floats repeats the command's own result line
                parser.set_defaults(verbose=False)
            for action in compat.parser_actions(parser):
                if action.dest == "ckpt_path" and name in self.CKPT_PATH_HELP:
                    action.help = self.CKPT_PATH_HELP[name]
                elif action.dest == "weights_only":
                    action.help = self.WEIGHTS_ONLY_HELP
                elif action.dest == "verbose":
                    action.help = "also print Lightning's table of the evaluation's metrics"

    def subcommands(self) -> dict[str, set[str]]:
        """fit, validate, test and analyze (FLTrainer.analyze: the --analysis.* analyses of a
        checkpoint); Lightning's `predict` is left out, no method has a predict step. Only the
        invoked one's parser is built when it is known: each holds every Trainer, method and data
        option, and building all four took a third of the CLI's own start-up."""
        kept = {name: skip for name, skip in LightningCLI.subcommands().items() if name in self.SUBCOMMANDS}
        kept["analyze"] = {"model", "datamodule"}
        invoked = getattr(self, "_invoked", None)
        return {invoked: kept[invoked]} if invoked in kept else kept

    def add_core_arguments_to_parser(self, parser) -> None:
        """The option groups in the order `--help` lists them (the order they are added): the
        method, the data, the federated groups, and Lightning's Trainer last, its 45 options being
        mostly the generic ones a federated run leaves alone."""
        parser.add_lightning_class_args(self.model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self.datamodule_class, "data")
        parser.add_lightning_class_args(FederatedCallback, "federation")
        parser.add_lightning_class_args(PersonalizationCallback, "personalization")
        parser.add_lightning_class_args(AnalysisCallback, "analysis")
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"})

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.spec", "model.init_args.data_spec", apply_on="instantiate")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: replace the run already in trainer.default_root_dir (its config, checkpoints "
                                 "and results) instead of refusing to start")

    def subcommand_config(self):
        """The parsed config of the invoked subcommand (the whole config without one)."""
        return self.config.get(self.config.subcommand, self.config) if self.config.get("subcommand") else self.config

    def parse_arguments(self, parser, args) -> None:
        """The parsed config, completed before anything reads it (`--ckpt_path last` looks in the
        run directory, the checkpoint check compares data.seed): the run's name and directory from
        its --config files, and data.seed from seed_everything, each only where the user left it
        unset. (`--print_config` prints the config as given, before this.)"""
        super().parse_arguments(parser, args)
        cfg = self.subcommand_config()
        name_run_from_configs(cfg)
        follow_seed_everything(cfg)

    # An override of a LightningCLI internal (no public hook replaces it: Lightning's own would load
    # the checkpoint's hyperparameters over the requested ones); compat checks it still exists with
    # this signature, and tests/test_compat.py that LightningCLI still calls it after parsing.
    @compat.overrides_lightning_cli_internal
    def _parse_ckpt_path(self) -> None:
        """Lightning's version loads the file and replaces the requested hyperparameters with the
        checkpoint's. Here the file is checked first (one line for a damaged or foreign file), and
        a checkpoint must match the requested experiment instead of overriding it."""
        cfg = self.subcommand_config()
        ckpt = cfg.get("ckpt_path")
        if not ckpt:
            return
        root = Path(cfg["trainer"].get("default_root_dir") or "runs/default")
        if ckpt == "last":
            ckpt = cfg["ckpt_path"] = str(_last_checkpoint(root))
        elif not Path(ckpt).exists():
            raise FLUserError(f"--ckpt_path {ckpt}: no such file")
        state = load_checkpoint_file(ckpt)
        check_compatible(ckpt, state, cfg["model"], cfg["data"])
        verify_client_state_files(ckpt, state)
        self.checkpoint_rounds = completed_rounds(state)
        if self.config.get("subcommand") != "fit":
            follow_the_checkpoints_run(cfg, Path(ckpt))

    def before_instantiate_classes(self) -> None:
        cfg = self.subcommand_config()
        follow_seed_everything(cfg)  # seed_everything: true has been drawn by now (LightningCLI._set_seed)
        trainer = cfg["trainer"]
        if trainer.get("reload_dataloaders_every_n_epochs") != 1:
            raise FLUserError("--trainer.reload_dataloaders_every_n_epochs must be 1: every round samples new clients")
        root = trainer.get("default_root_dir") or "runs/default"
        trainer["default_root_dir"] = root
        self._run_root = Path(root)
        self._checkpoint_dir = Path(root) / "checkpoints"
        configure_wandb_logger(trainer.get("logger"), self.subcommand, root)
        self._check_strategy(cfg)
        self._overwrite = bool(cfg.get("overwrite"))
        cfg["overwrite"] = False  # not saved into config.yaml: re-running that file must not wipe this run
        if self.subcommand == "fit" and cfg.get("ckpt_path"):
            ckpt = Path(cfg["ckpt_path"])
            check_resume_options(ckpt, ckpt.parent.parent / "config.yaml",
                                 compat.cli_subcommand_parser(self, self.subcommand).dump(cfg, skip_none=False))

    @classmethod
    def _check_strategy(cls, cfg) -> None:
        trainer = cfg["trainer"]
        strategy = trainer.get("strategy")
        federation = cfg.get("federation") or {}
        if isinstance(strategy, str) and federation.get("parallel", "clients") == "clients":
            # DDP processes train different clients (parallel.py): Lightning's DDP minus the wrapper
            trainer["strategy"] = client_strategy_name(strategy) or strategy
            if trainer["strategy"].endswith("_clients"):
                cls._check_client_parallelism(cfg)
        elif isinstance(strategy, str) and client_strategy_name(strategy) and _heterogeneous(cfg):
            # checked here, once, rather than by every launched process (HeteroMethod.setup)
            raise FLUserError("model-heterogeneous methods split over processes by client, not by batch: "
                              "set --federation.parallel clients (or --trainer.devices 1)")

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


def _last_checkpoint(root: Path) -> Path:
    """`--ckpt_path last`: the round checkpoint of the run in `root`, or one line saying why there
    is none."""
    last = root / "checkpoints" / LAST
    if last.exists():
        return last
    if RunDirectory(root).holds_run():  # stopped (killed, interrupted) before its first round ended
        raise FLUserError(f"--ckpt_path last: no checkpoint at {last}: the run in {root} stopped before "
                          f"its first round was saved; start it again with --overwrite true instead of "
                          f"--ckpt_path last")
    raise FLUserError(f"--ckpt_path last: no checkpoint at {last}; run fit with the same "
                      f"trainer.default_root_dir first")


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


def method_names() -> list[str]:
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


def _option_names(cli) -> list[str]:
    """The options of the subcommand `cli` parses (fit's when it has none yet)."""
    parser = compat.cli_subcommand_parsers(cli).get(getattr(cli, "subcommand", None) or "fit")
    if parser is None:
        return []
    return [a.dest for a in compat.parser_actions(parser) if a.dest not in ("help", "config")]


def summarise_parse_error(text: str, args: list[str] | None, cli) -> str:
    """jsonargparse explains a bad value over a dozen lines; one line names the option, the value
    and what it accepts (fl_lightning/parse_errors.py), among the options `cli` (the CLI that
    parsed, or None) knows."""
    from fl_lightning import parse_errors

    args = sys.argv[1:] if args is None else args
    return parse_errors.summarise(text, args, _option_names(cli), _class_options, method_names())
