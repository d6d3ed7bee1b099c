"""The shipped configs: settings and method files compose into every experiment the former
single-file configs defined, with the same resolved config.

Each row of configs/README.md's table names a former config and its command now. Its
`--print_config` must equal the former file's (the files are kept verbatim in
tests/data/experiment_configs/; tests/data/make_experiment_configs.py wrote them from git), both
parsed now by the CLI's own parser in this process, so an option added to the code later changes
both alike; the only differences allowed are those of `expected_differences`. Most configs need
real datasets, so they are parsed, not trained, here.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from fl_lightning.lightning_cli import run_name_from_configs
from fl_lightning.sweep import cli_parser

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
FORMER = REPO / "tests" / "data" / "experiment_configs"
ROW = re.compile(r"^\| `(?P<old>[^`]+)` \| `fl-lightning fit (?P<args>[^`]+)` \| `(?P<run>[^`]+)` \|$")
EXPERIMENTS = [m.groupdict() for line in (CONFIGS / "README.md").read_text().splitlines() if (m := ROW.match(line))]
SETTINGS = sorted((CONFIGS / "settings").glob("*.yaml"))
METHODS = sorted((CONFIGS / "methods").rglob("*.yaml"))
# Files whose old single config drifted from the FedSOL CIFAR-10 setting they now share.
FEDSOL_APPENDIX = {"fedsol_ablation_cifar10", "fedsol_l2_cifar10", "fedsol_projection_cifar10"}


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


def differences(old: dict, new: dict) -> dict:
    a, b = flat(old), flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def former_files(name: str) -> list[Path]:
    """`fedorgp/fml_cifar10_pathological+demo_mnist5k_hmg3`: that file with the overlay after it."""
    first, *overlays = name.split("+")
    folder = FORMER / Path(first).parent
    return [FORMER / f"{first}.yaml", *(folder / f"{o}.yaml" for o in overlays)]


def expected_differences(old_name: str, old: dict) -> dict:
    """The run's directory and W&B name are no longer written in the files: they come from the
    --config file names when the run starts (null in --print_config). data.seed is null = the
    run's seed_everything, which is 0 here, as every old file set both."""
    expected = {
        "trainer.default_root_dir": (old["trainer"]["default_root_dir"], None),
        "trainer.logger.init_args.name": (old["trainer"]["logger"]["init_args"]["name"], None),
        "data.seed": (0, None),
    }
    assert old["seed_everything"] == 0
    if old_name in FEDSOL_APPENDIX:  # now the FedSOL CIFAR-10 setting's (configs/README.md)
        expected["data.root"] = (None, "data")
        expected["federation.local_eval_samples"] = (1000, 2000)
    return expected


def test_every_former_config_has_a_command():
    former = {str(p.relative_to(FORMER))[: -len(".yaml")] for p in FORMER.rglob("*.yaml")}
    overlays = {n for n in former if Path(n).name.startswith("demo_")}
    assert len(former) == 79 and overlays == {"fedorgp/demo_mnist5k_hmg3"}
    documented = [e["old"] for e in EXPERIMENTS]
    assert len(documented) == len(set(documented)) == 87
    assert former - overlays <= set(documented)  # every former experiment file on its own
    assert all(f.exists() for name in documented for f in former_files(name))


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda e: e["old"])
def test_composed_config_equals_the_former_single_file(experiment):
    old = print_config([a for f in former_files(experiment["old"]) for a in ("--config", str(f))])
    args = experiment["args"].split()
    files = args[1::2]
    assert args[::2] == ["--config"] * len(files)
    new = print_config([a for f in files for a in ("--config", str(REPO / f))])
    assert differences(old, new) == expected_differences(experiment["old"], old)
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
