"""The shipped configs mean what the papers say: every setting file's and method file's values
against the papers (../shared/papers, ../shared/reference/METHODS.md; the source of each value is
named beside it), every command of configs/README.md parses and names its run as the table says,
and a setting and its method files compose as documented. Most settings need real datasets, so
they are parsed (the CLI's own parser, `--print_config`), not trained, here.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from fl_lightning.config_files import run_name_from_configs
from fl_lightning.sweep import cli_parser

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
ROW = re.compile(r"^\| `(?P<old>[^`]+)` \| `fl-lightning fit (?P<args>[^`]+)` \| `(?P<run>[^`]+)` \|$")
EXPERIMENTS = [m.groupdict() for line in (CONFIGS / "README.md").read_text().splitlines() if (m := ROW.match(line))]
SETTINGS = sorted((CONFIGS / "settings").glob("*.yaml"))
METHODS = sorted((CONFIGS / "methods").rglob("*.yaml"))


def print_config(args: list[str]) -> dict:
    """`fl-lightning fit <args> --print_config`, parsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), \
            pytest.raises(SystemExit) as stop:
        cli_parser().parse_args(["fit", *args, "--print_config"])
    assert stop.value.code in (0, None), args
    return yaml.safe_load(out.getvalue())


def flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


# The local optimiser every paper of the FedSOL line uses (FedSOL Tables 7/8, FedCONST Sec. 4).
SGD = {"model.init_args.lr": 0.01, "model.init_args.momentum": 0.9, "model.init_args.weight_decay": 1e-5}
# Each setting's values by the paper (METHODS.md names the table or section).
SETTING_VALUES = {
    "fedsol_cifar10": {  # FedSOL: CIFAR-10, 100 clients x 0.1, 300 rounds, E 5, B 50, lr x0.99/round, LDA 0.1
        **SGD, "model.init_args.model": "fedavg_cnn", "model.init_args.lr_decay": 0.99,
        "model.init_args.server_lr": 1.0, "data.dataset": "cifar10", "data.num_clients": 100,
        "data.sample_ratio": 0.1, "data.local_epochs": 5, "data.batch_size": 50, "data.partition": "dirichlet",
        "data.alpha": 0.1, "data.min_size": 10, "trainer.max_epochs": 300},
    "mnist5k": {  # the demo (README): FedSOL's local setup on MNIST-5k, 50 clients x 0.2, 20 rounds
        **SGD, "model.init_args.model": "fedavg_cnn", "model.init_args.lr_decay": 0.99, "data.dataset": "mnist5k",
        "data.num_clients": 50, "data.sample_ratio": 0.2, "data.local_epochs": 5, "data.batch_size": 50,
        "data.partition": "dirichlet", "data.alpha": 0.1, "trainer.max_epochs": 20},
    "fedconst_crossdevice_cifar10": {  # FedCONST Sec. 4: 10% of 100 clients, Dirichlet 0.5 with 5 epochs
        **SGD, "model.init_args.model": "lenet5_nobias", "model.init_args.server_lr": 1.0,
        "model.init_args.constraint": "none", "data.dataset": "cifar10", "data.num_clients": 100,
        "data.sample_ratio": 0.1, "data.local_epochs": 5, "data.batch_size": 50, "data.partition": "dirichlet",
        "data.alpha": 0.5},
    "fedconst_crosssilo_cifar10": {  # FedCONST Sec. 4: 10 clients, all of them, Dirichlet 0.2 with 10 epochs
        **SGD, "model.init_args.model": "lenet5_nobias", "model.init_args.server_lr": 1.0, "data.dataset": "cifar10",
        "data.num_clients": 10, "data.sample_ratio": 1.0, "data.local_epochs": 10, "data.batch_size": 50,
        "data.partition": "dirichlet", "data.alpha": 0.2},
    "feddr_cifar10": {  # FedDr+ Sec. 4.1, App. C.4: VGG-11, 320 rounds, lr x0.1 at 160, 240, E 10, shards s = 2
        "model.init_args.model": "vgg11", "model.init_args.lr_milestones": [160, 240],
        "model.init_args.lr_milestone_gamma": 0.1, "data.dataset": "cifar10", "data.num_clients": 100,
        "data.sample_ratio": 0.1, "data.local_epochs": 10, "data.batch_size": 50, "data.partition": "shard",
        "data.shards_per_client": 2, "trainer.max_epochs": 320},
    "feddr_cifar100": {  # FedDr+ Sec. 3, App. C.4: MobileNet, E 3, shards s = 10, default lr 0.1
        "model.init_args.model": "mobilenet", "model.init_args.lr": 0.1, "model.init_args.lr_milestones": [160, 240],
        "model.init_args.lr_milestone_gamma": 0.1, "data.dataset": "cifar100", "data.num_clients": 100,
        "data.sample_ratio": 0.1, "data.local_epochs": 3, "data.batch_size": 50, "data.partition": "shard",
        "data.shards_per_client": 10, "trainer.max_epochs": 320},
}
# FedORGP Sec. 5: 20 clients, all of them, SGD lr 0.01, 1 epoch, batch 32, 100 rounds, HMG8, K 512,
# a 75/25 train/test split per client; pathological 2 (CIFAR-10) / 10 (CIFAR-100) classes per client;
# practical Dirichlet 0.05. (The HMG3 demo: the same on MNIST-5k for 5 rounds.)
FEDORGP = {"model.init_args.feature_dim": 512, "model.init_args.lr": 0.01, "model.init_args.momentum": 0.0,
           "model.init_args.weight_decay": 0.0, "data.num_clients": 20, "data.sample_ratio": 1.0,
           "data.local_epochs": 1, "data.batch_size": 32, "data.client_test_fraction": 0.25}
for dataset, classes in (("cifar10", 2), ("cifar100", 10)):
    SETTING_VALUES[f"fedorgp_{dataset}_pathological"] = {
        **FEDORGP, "model.init_args.model": "HMG8", "data.dataset": dataset, "data.partition": "pathological",
        "data.classes_per_client": classes, "trainer.max_epochs": 100}
    SETTING_VALUES[f"fedorgp_{dataset}_practical"] = {
        **FEDORGP, "model.init_args.model": "HMG8", "data.dataset": dataset, "data.partition": "dirichlet",
        "data.alpha": 0.05, "trainer.max_epochs": 100}
SETTING_VALUES["fedorgp_demo_mnist5k_hmg3"] = {
    **FEDORGP, "model.init_args.model": "HMG3", "data.dataset": "mnist5k", "data.partition": "pathological",
    "data.classes_per_client": 2}

# Each method file's values by its paper (the method's defaults in METHODS.md; FedDr+ Tables 8/9 for
# the grid-searched learning rates; FedCONST's baselines with its Table 1 hyperparameters).
METHOD_VALUES = {
    "fedsol/fedavg": {"class_path": "FedAvg"},
    "fedsol/fedsol": {"class_path": "FedSOL", "rho": 2.0, "adaptive": "layer", "perturb": "head", "temperature": 3.0,
                      "proximal": "kl", "strategy": "A1"},
    "fedsol/fedsol_l2": {"class_path": "FedSOL", "proximal": "l2", "mu": 1.0, "rho": 2.0},
    "fedsol/fedsol_ablation": {"class_path": "FedSOL", "rho": 2.0, "beta": 1.0},
    "fedsol/fedsol_projection": {"class_path": "ProximalProjection", "proximal": "kl", "temperature": 3.0,
                                 "scope": "all"},
    "fedsol/fedsol_moon": {"class_path": "FedSOLMOON", "rho": 2.0, "mu": 0.1, "tau": 0.5, "perturb": "all"},
    "fedsol/fedsol_feddyn": {"class_path": "FedSOLFedDyn", "rho": 2.0, "alpha": 0.1, "perturb": "all"},
    "fedsol/fedsol_scaffold": {"class_path": "FedSOLSCAFFOLD", "rho": 2.0, "perturb": "all"},
    "fedsol/fedprox": {"class_path": "FedProx", "mu": 1.0},
    "fedsol/scaffold": {"class_path": "SCAFFOLD", "momentum_correction": True},
    "fedsol/fednova": {"class_path": "FedNova"},
    "fedsol/feddyn": {"class_path": "FedDyn", "alpha": 0.1},
    "fedsol/moon": {"class_path": "MOON", "mu": 0.1, "tau": 0.5},
    "fedsol/fedntd": {"class_path": "FedNTD", "beta": 1.0, "tau": 1.0},
    "fedsol/fedsam": {"class_path": "FedSAM", "rho": 0.1},
    "fedsol/fedasam": {"class_path": "FedASAM", "rho": 1.0},
    "fedsol/fedexp": {"class_path": "FedExP", "eps": 1e-3},
    "fedconst/fedavg": {"class_path": "FedAvg", "constraint": "none"},
    "fedconst/const": {"constraint": "joint"},
    "fedconst/fedprox": {"class_path": "FedProx", "mu": 0.01},
    "fedconst/scaffold": {"class_path": "SCAFFOLD"},
    "fedconst/feddyn": {"class_path": "FedDyn", "alpha": 1.0},
    "fedconst/moon": {"class_path": "MOON", "mu": 0.01, "tau": 1.0},
    "fedconst/fedsam": {"class_path": "FedSAM", "rho": 1.0},
    "fedorgp/fedorgp": {"class_path": "FedORGP", "lambda_c": 100.0, "lambda_s": 1.0, "lambda_d": 10.0,
                        "orthogonality": True, "server_epochs": 1, "proto_lr": 0.01, "server_batch_size": 32,
                        "predict": "head"},
    "fedorgp/fedorgp_wo_or": {"class_path": "FedORGP", "orthogonality": False, "predict": "head"},
    "fedorgp/fedproto": {"class_path": "FedProto", "predict": "proto"},
    "fedorgp/fedtgp": {"class_path": "FedTGP", "server_epochs": 100, "margin_threshold": 100.0, "predict": "proto"},
    "fedorgp/lgfedavg": {"class_path": "LGFedAvg"},
    "fedorgp/fedgh": {"class_path": "FedGH"},
    "fedorgp/fml": {"class_path": "FML", "alpha": 0.5, "beta": 0.5},
    "fedorgp/fedkd": {"class_path": "FedKD"},
    "fedorgp/fedgen": {"class_path": "FedGen"},
}
for setting, lrs in (("feddr_cifar10", {"fedavg": 0.01, "feddr_plus": 0.35, "dotregression": 0.35, "fedbabu": 0.01,
                                        "spherefed": 0.55, "fedetf": 0.05, "fedgela": 0.01}),
                     ("feddr_cifar100", {"fedavg": 0.1, "feddr_plus": 5.0, "dotregression": 5.0, "fedbabu": 0.1,
                                         "spherefed": 6.5, "fedetf": 0.5, "fedgela": 0.1, "ditto": 0.1, "fedper": 0.1,
                                         "fedrep": 0.1, "knn_per": 0.1, "perfedavg": 0.1})):
    classes = {"fedavg": "FedAvg", "feddr_plus": "FedDrPlus", "dotregression": "DotRegression", "fedbabu": "FedBABU",
               "spherefed": "SphereFed", "fedetf": "FedETF", "fedgela": "FedGELA", "ditto": "Ditto", "fedper": "FedPer",
               "fedrep": "FedRep", "knn_per": "KNNPer", "perfedavg": "PerFedAvg"}
    for name, lr in lrs.items():
        METHOD_VALUES[f"{setting}/{name}"] = {"class_path": classes[name], "lr": lr}
METHOD_VALUES["feddr_cifar10/feddr_plus"]["beta"] = METHOD_VALUES["feddr_cifar100/feddr_plus"]["beta"] = 0.9


def method_key(path: Path) -> str:
    return str(path.relative_to(CONFIGS / "methods"))[: -len(".yaml")]


def test_every_config_file_has_its_papers_values_here():
    assert {p.stem for p in SETTINGS} == set(SETTING_VALUES)
    assert {method_key(p) for p in METHODS} == set(METHOD_VALUES)


@pytest.mark.parametrize("path", SETTINGS, ids=lambda p: p.stem)
def test_a_setting_has_its_papers_values(path):
    resolved = flat(print_config(["--config", str(path)]))
    for key, value in SETTING_VALUES[path.stem].items():
        assert resolved[key] == value, (path.stem, key)


@pytest.mark.parametrize("path", METHODS, ids=method_key)
def test_a_method_file_has_its_papers_values(path):
    expected = dict(METHOD_VALUES[method_key(path)])
    setting = next(s for s in SETTINGS if s.stem == _setting_of(path))
    resolved = print_config(["--config", str(setting), "--config", str(path)])["model"]
    if "class_path" in expected:
        assert resolved["class_path"] == f"fl_lightning.methods.{expected.pop('class_path')}"
    for key, value in expected.items():
        assert resolved["init_args"][key] == value, (method_key(path), key)


def _setting_of(path: Path) -> str:
    """The setting a method file is layered over in its header's command."""
    own = f"configs/{path.relative_to(CONFIGS)}"
    command = next(line for line in path.read_text().splitlines() if "fl-lightning fit" in line and own in line)
    return Path(re.findall(r"--config (\S+)", command)[0]).stem


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda e: e["old"])
def test_every_documented_command_parses_and_is_named_as_the_table_says(experiment):
    args = experiment["args"].split()
    files = args[1::2]
    assert args[::2] == ["--config"] * len(files)
    print_config([a for f in files for a in ("--config", str(REPO / f))])
    assert f"runs/{run_name_from_configs(files)}" == experiment["run"]


@pytest.mark.parametrize("path", SETTINGS, ids=lambda p: p.stem)
def test_a_setting_runs_on_its_own_with_its_baseline(path):
    resolved = print_config(["--config", str(path)])
    assert resolved["model"]["class_path"] in ("fl_lightning.methods.FedAvg", "fl_lightning.methods.LGFedAvg")
    assert resolved["trainer"]["max_epochs"] >= 1 and resolved["data"]["dataset"]
    assert resolved["trainer"]["default_root_dir"] is None  # named by the files it is layered with
    assert resolved["data"]["seed"] is None and resolved["data"]["partition_seed"] == 0


@pytest.mark.parametrize("path", METHODS, ids=lambda p: str(p.relative_to(CONFIGS / "methods")))
def test_method_file_sets_its_method_over_the_setting_in_its_header(path):
    """Every method file (also those only the paper tables use) layered as its header says."""
    own = f"configs/{path.relative_to(CONFIGS)}"
    command = next(line for line in path.read_text().splitlines() if "fl-lightning fit" in line and own in line)
    files = re.findall(r"--config (\S+)", command)
    assert files[-1] == own, "the header's command layers this file last"
    resolved = print_config([a for f in files for a in ("--config", str(REPO / f))])
    overlay = yaml.safe_load(path.read_text())["model"]
    if "class_path" in overlay:
        assert resolved["model"]["class_path"] == overlay["class_path"]
    for key, value in (overlay.get("init_args") or {}).items():
        assert resolved["model"]["init_args"][key] == value, key
    setting = yaml.safe_load((REPO / files[0]).read_text())
    for key, value in setting["data"].items():
        assert resolved["data"][key] == value, key  # the setting is untouched


# ---------------------------------------------------------------------------------------------
# What a composed run does with its name and seeds (the CLI, not only its printed config)

TINY = ["--data.dataset", "digits", "--model.init_args.model", "mlp", "--data.num_clients", "10",
        "--data.sample_ratio", "0.5", "--data.local_epochs", "1", "--data.min_size", "5",
        "--federation.local_eval_samples", "100", "--trainer.enable_progress_bar", "false"]
DEMO = ["--config", str(CONFIGS / "settings/mnist5k.yaml"), "--config", str(CONFIGS / "methods/fedsol/fedavg.yaml")]


def sampled_clients(args: list[str], rounds: int = 3) -> tuple[int, list[list[int]]]:
    """The clients the data module the CLI builds would train in the first rounds, and its seed."""
    from fl_lightning.lightning_cli import build_cli

    with contextlib.redirect_stderr(io.StringIO()):
        cli = build_cli([*DEMO, *TINY, "--trainer.logger", "false", *args], run=False)
    dm = cli.datamodule
    dm.setup("fit")
    return dm.hparams.seed, [[w.client for w in dm.plan_round(r).clients] for r in range(rounds)]


def test_client_sampling_follows_seed_everything_unless_data_seed_is_given():
    seed1, order1 = sampled_clients(["--seed_everything", "1"])
    seed2, order2 = sampled_clients(["--seed_everything", "2"])
    assert (seed1, seed2) == (1, 2)
    assert order1 != order2  # 252 possible 5-of-10 draws per round: equal by chance with p = 252^-3
    assert sampled_clients(["--seed_everything", "1"])[1] == order1  # and reproducible
    # An explicit data.seed wins over seed_everything: the same clients whatever the model's seed.
    fixed = [sampled_clients(["--seed_everything", s, "--data.seed", "7"]) for s in ("1", "2")]
    assert fixed[0] == fixed[1] and fixed[0][0] == 7
    assert fixed[0][1] != order1 and fixed[0][1] != order2


def test_seed_everything_true_draws_one_seed_for_both(tmp_path):
    from fl_lightning.lightning_cli import build_cli

    with contextlib.redirect_stderr(io.StringIO()):
        cli = build_cli([*DEMO, *TINY, "--trainer.logger", "false", "--seed_everything", "true"], run=False)
    assert isinstance(cli.config["seed_everything"], int)
    assert cli.datamodule.hparams.seed == cli.config["seed_everything"] == cli.config["data"]["seed"]


def test_composed_run_is_named_after_its_files_and_resumes_there(tmp_path, monkeypatch):
    from fl_lightning.cli import main
    from fl_lightning.loggers import offline_records

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = ["fit", *DEMO, *TINY, "--seed_everything", "3"]
    main([*args, "--trainer.max_epochs", "1"])
    run = tmp_path / "runs" / "mnist5k" / "fedavg"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["default_root_dir"] == "runs/mnist5k/fedavg"
    assert saved["trainer"]["logger"]["init_args"]["name"] == "mnist5k/fedavg"
    assert saved["data"]["seed"] == 3  # recorded as run: config.yaml alone repeats the run
    wandb_file = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))[-1]
    run_record = next(r.run for r in offline_records(wandb_file) if r.WhichOneof("record_type") == "run")
    assert run_record.display_name == "mnist5k/fedavg" and run_record.run_group == "mnist5k/fedavg"
    # `--ckpt_path last` finds the derived directory, and the checkpoint's data.seed matches.
    main([*args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    summary = yaml.safe_load((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["finished"]
    assert not (tmp_path / "runs" / "default").exists()


# ---------------------------------------------------------------------------------------------
# One-file entries and layering mistakes

ENTRIES = {"fedsol_cifar10": ("settings/fedsol_cifar10.yaml", "methods/fedsol/fedsol.yaml"),
           "fedconst_cifar10": ("settings/fedconst_crossdevice_cifar10.yaml", "methods/fedconst/fedavg.yaml",
                                "methods/fedconst/const.yaml"),
           "feddr_plus_cifar100": ("settings/feddr_cifar100.yaml", "methods/feddr_cifar100/feddr_plus.yaml"),
           "fedorgp_cifar10": ("settings/fedorgp_cifar10_pathological.yaml", "methods/fedorgp/fedorgp.yaml")}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_papers_one_file_entry_is_its_setting_and_method_layered(entry):
    from fl_lightning.config_files import layered_config_args

    args = layered_config_args(["--config", str(CONFIGS / f"{entry}.yaml")])
    files = args[1::2]
    assert [Path(f).resolve() for f in files] == [(CONFIGS / f).resolve() for f in ENTRIES[entry]]
    assert print_config(args) == print_config([a for f in ENTRIES[entry] for a in ("--config", str(CONFIGS / f))])
    setting, method = Path(ENTRIES[entry][0]).stem, "+".join(Path(f).stem for f in ENTRIES[entry][1:])
    assert run_name_from_configs(files) == f"{setting}/{method}"


def test_the_missions_command_runs_and_resumes_through_an_entry_file(tmp_path, monkeypatch):
    """`fit --config <entry>` (here an entry for the offline MNIST-5k demo) trains, is named after
    the files it layers, and resumes with the same command and --ckpt_path last."""
    from fl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    entry = tmp_path / "demo_entry.yaml"
    entry.write_text(yaml.safe_dump({"layer": [str(CONFIGS / "settings/mnist5k.yaml"),
                                               str(CONFIGS / "methods/fedsol/fedavg.yaml")]}))
    args = ["fit", "--config", str(entry), *TINY, "--trainer.logger", "false"]
    main([*args, "--trainer.max_epochs", "1"])
    run = tmp_path / "runs" / "mnist5k" / "fedavg"
    assert yaml.safe_load((run / "summary.json").read_text())["rounds_completed"] == 1
    main([*args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    assert yaml.safe_load((run / "summary.json").read_text())["rounds_completed"] == 2


def test_a_setting_alone_is_named_after_its_baseline_method(tmp_path):
    from fl_lightning.lightning_cli import build_cli

    with contextlib.redirect_stderr(io.StringIO()):
        cli = build_cli(["--config", str(CONFIGS / "settings/mnist5k.yaml"), *TINY, "--trainer.logger", "false"],
                        run=False)
    assert cli.config["trainer"]["default_root_dir"] == "runs/mnist5k/fedavg"  # not runs/mnist5k


@pytest.mark.parametrize("files,message", [
    (["methods/fedsol/fedsol.yaml", "methods/fedsol/scaffold.yaml"],
     r"two method files choose the method: .*fedsol\.yaml \(FedSOL\), .*scaffold\.yaml \(SCAFFOLD\); a run has one"),
    (["settings/mnist5k.yaml", "methods/fedsol/fedsol.yaml", "methods/fedsol/scaffold.yaml"],
     r"two method files choose the method"),
    (["methods/fedsol/fedsol.yaml", "settings/mnist5k.yaml"],
     r"--config .*fedsol\.yaml \(a method file\) comes before the setting .*mnist5k\.yaml, which would override it"),
    (["fedsol_cifar100.yaml"], r"--config .*fedsol_cifar100\.yaml: no such file$"),
    (["mnist5k.yaml"], r"--config .*mnist5k\.yaml: no such file; did you mean .*configs/settings/mnist5k\.yaml\?"),
    # a name of the former one-file configs (the README's method sections named them): the command now
    (["fedsol_l2_cifar10.yaml"], r"--config fedsol_l2_cifar10\.yaml: no such file; that experiment is now "
                                 r"`fl-lightning fit --config configs/settings/fedsol_cifar10\.yaml --config "
                                 r"configs/methods/fedsol/fedsol_l2\.yaml` \(configs/README\.md\)$"),
])
def test_a_wrong_layering_or_a_missing_file_is_one_line(files, message, capsys):
    from fl_lightning.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", *[a for f in files for a in ("--config", str(CONFIGS / f) if "/" in f else f)], *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and re.match(rf"error: {message}", err[0]), err


def test_a_missing_file_names_each_match_once(tmp_path, monkeypatch, capsys):
    """Seen through the working directory's configs/ and the package's (the same files when the
    working directory's is a link to them), each match is named once."""
    from fl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(CONFIGS)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "fedsol_cifar10.yaml", *TINY])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2
    assert line == ("error: --config fedsol_cifar10.yaml: no such file; did you mean configs/fedsol_cifar10.yaml "
                    "or configs/settings/fedsol_cifar10.yaml?")


def test_the_shipped_entry_trains_and_resumes_with_the_same_command(tmp_path, monkeypatch):
    """`fl-lightning fit --config configs/fedsol_cifar10.yaml` itself (on offline digits, the rest of
    the setting as shipped), then the same command with --ckpt_path last."""
    from fl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(CONFIGS)
    args = ["fit", "--config", "configs/fedsol_cifar10.yaml", *TINY, "--trainer.logger", "false",
            "--analysis.partition", "false"]
    main([*args, "--trainer.max_epochs", "1"])
    run = tmp_path / "runs" / "fedsol_cifar10" / "fedsol"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "fl_lightning.methods.FedSOL" and saved["model"]["init_args"]["rho"] == 2.0
    assert saved["data"]["alpha"] == 0.1 and saved["data"]["num_clients"] == 10  # the setting, then the options
    main([*args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    summary = yaml.safe_load((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["method"] == "FedSOL"
