"""Malformed command lines and configs, tried the way users get them wrong: every one ends with
exit code 2 and one line on stderr that names the option and says what it accepts. Also: every
option a user can set has a one-line help, and only real methods are offered as methods."""

from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from fl_lightning import methods
from fl_lightning.cli import main
from fl_lightning.cli_parsing import method_names
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.personalization import PersonalizationCallback

REPO = Path(__file__).resolve().parents[1]
BASE = ["--config", str(REPO / "configs/settings/mnist5k.yaml"),
        "--config", str(REPO / "configs/methods/fedsol/fedsol.yaml"), "--data.dataset", "digits",
        "--model.init_args.model", "mlp", "--trainer.max_epochs", "1", "--trainer.logger", "false",
        "--data.num_clients", "4"]

CONFIG_FILES = {
    "empty.yaml": "",
    "list.yaml": "- trainer\n- model\n",
    "scalar.yaml": "just a sentence\n",
    "syntax.yaml": "model: [unclosed\n",
    "tabs.yaml": "trainer:\n\tmax_epochs: 1\n",
    "unknown_section.yaml": "traner:\n  max_epochs: 1\n",
    "typo_data.yaml": "data:\n  datset: digits\n",
}

# (arguments after BASE, or after "fit" when they start with --config FILE; what the line must contain)
MALFORMED = [
    # config files
    (["CONFIG", "empty.yaml"], ["empty.yaml is empty", "trainer, model, data"]),
    (["CONFIG", "list.yaml"], ["list.yaml holds a list", "mapping of sections"]),
    (["CONFIG", "scalar.yaml"], ["scalar.yaml holds a str", "mapping of sections"]),
    (["CONFIG", "syntax.yaml"], ["syntax.yaml is not valid YAML", "line 2"]),
    (["CONFIG", "tabs.yaml"], ["tabs.yaml is not valid YAML", "line 2"]),
    (["CONFIG", "unknown_section.yaml"], ["unknown option 'traner.max_epochs'", "did you mean 'trainer.max_epochs'"]),
    (["CONFIG", "typo_data.yaml"], ["unknown option 'data.datset'", "did you mean 'data.dataset'"]),
    (["CONFIG", "missing.yaml"], ["missing.yaml: no such file"]),
    # unknown options and subcommands
    (["--data.datset", "digits"], ["unknown option --data.datset; did you mean --data.dataset?"]),
    (["--trainer.max_epochz", "3"], ["--trainer.max_epochz; did you mean --trainer.max_epochs?"]),
    (["--model.init_args.rhoo", "1"], ["--model.init_args.rhoo: FedSOL has no option 'rhoo'; "
                                       "did you mean --model.init_args.rho?"]),
    (["--model.rhoo", "1"], ["--model.rhoo: FedSOL has no option 'rhoo'; did you mean --model.rho?"]),
    (["--model", "FedSOL", "--model.init_args.lam", "1"], ["--model.init_args.lam", "FedSOL's options: rho"]),
    # renamed options: the line names the new name
    (["--model", "FedTGP", "--model.init_args.server_lr", "0.1"],
     ["--model.init_args.server_lr: FedTGP's option is now proto_lr"]),
    (["--model", "FedGH", "--model.init_args.server_lr", "0.1"],
     ["--model.init_args.server_lr: FedGH's option is now head_lr"]),
    (["RAW"], ["no subcommand", "fit, validate, test, analyze, sweep, report"]),
    (["RAW", "fitt"], ["unknown subcommand 'fitt' (did you mean fit?)", "fit, validate, test"]),
    (["RAW", "fti"], ["unknown subcommand 'fti' (did you mean fit?)", "fit, validate, test"]),
    (["RAW", "reprot", "runs"], ["unknown subcommand 'reprot' (did you mean report?)"]),
    (["RAW", "predict"], ["unknown subcommand 'predict'", "fit, validate, test"]),
    (["--model", "FedFoo"], ["--model FedFoo: unknown method; choose one of:", "FedAvg", "FedSOL"]),
    (["--model", "HeteroMethod"], ["--model HeteroMethod: unknown method", "FedORGP"]),
    (["--model", "FederatedMethod"], ["--model FederatedMethod: unknown method", "FedAvg"]),
    (["--model", "KNNPerModel"], ["--model KNNPerModel: unknown method", "KNNPer"]),
    (["--model", "scaffold"], ["--model scaffold: unknown method; did you mean SCAFFOLD?"]),
    (["--model", "FedAvgg"], ["--model FedAvgg: unknown method; did you mean FedAvg?"]),
    (["--model.help", "fedsol"], ["--model.help fedsol: unknown method; did you mean FedSOL?"]),
    # wrong types
    (["--model.init_args.lr", "[1,2]"], ["--model.init_args.lr: got '[1, 2]'; expected a number"]),
    (["--model.lr", "abc"], ["--model.lr: got 'abc'; expected a number (FedSOL)"]),
    (["--model.init_args.lr", "abc"], ["model.init_args.lr", "'abc'", "expected a number"]),
    (["--model.init_args.lr_milestones", "abc"], ["model.init_args.lr_milestones", "list of integers"]),
    (["--trainer.max_epochs", "abc"], ["--trainer.max_epochs: got 'abc'; expected an integer"]),
    (["--trainer.precision", "banana"], ["trainer.precision", "'banana'", "bf16-mixed", "32-true", "64-true"]),
    (["--trainer.precision", "8"], ["trainer.precision", "'8'", "bf16-mixed"]),
    (["--data.num_clients", "2.5"], ["data.num_clients", "'2.5'", "an integer"]),
    (["--data.to_rgb", "maybe"], ["data.to_rgb", "'maybe'", "true or false"]),
    (["--seed_everything", "abc"], ["seed_everything", "'abc'", "an integer"]),
    (["--personalization.epochs", "abc"], ["personalization.epochs", "list of integers"]),
    # values outside a fixed set
    (["--data.partition", "foo"], ["data.partition", "'foo'", "iid, dirichlet, shard, pathological"]),
    (["--data.client_test", "foo"], ["data.client_test", "auto, split, partition, align"]),
    (["--model.init_args.strategy", "A9"], ["model.init_args.strategy", "A0, A1, A2, A3, A4, A5, A6"]),
    (["--model.init_args.adaptive", "foo"], ["model.init_args.adaptive", "layer, dim0, none"]),
    (["--model.init_args.perturb", "foo"], ["model.init_args.perturb", "head"]),
    (["--model.init_args.constraint", "both"], ["model.init_args.constraint", "none, joint, sequential"]),
    (["--federation.on_divergence", "foo"], ["federation.on_divergence", "stop, skip_client"]),
    (["--trainer.accelerator", "banana"], ["trainer", "accelerator", "cpu"]),
    (["--trainer.accelerator", "gpu"], ["no usable GPU", "use --trainer.accelerator cpu"]),
    # float16 autocast needs a GPU: on the CPU Lightning ran bf16-mixed under the name 16-mixed
    (["--trainer.precision", "16-mixed", "--trainer.accelerator", "cpu"],
     ["trainer.precision 16-mixed", "runs on a GPU only", "use --trainer.precision bf16-mixed"]),
    (["--trainer.precision", "16", "--trainer.accelerator", "cpu"], ["trainer.precision 16-mixed", "GPU only"]),
    (["--trainer.accelerator", "cuda"], ["no usable GPU", "use --trainer.accelerator cpu"]),
    (["--trainer.devices", "abc"], ["trainer", "devices", "int > 0"]),
    (["--trainer.max_epochs", "-5"], ["trainer", "max_epochs", "non-negative"]),
    # values the method or data module refuses
    (["--model", "FedDrPlus", "--model.init_args.beta", "2"], ["beta must be in [0, 1]", "2.0"]),
    (["--model.init_args.lr", "-1"], ["lr must be > 0"]),
    (["--model.init_args.momentum", "-1"], ["momentum and weight_decay must be >= 0"]),
    (["--model.init_args.weight_decay", "-1"], ["momentum and weight_decay must be >= 0"]),
    (["--model.init_args.lr_decay", "0"], ["lr_decay", "must be > 0"]),
    (["--model.init_args.lr_milestones", "[-1]"], ["lr_milestones are rounds >= 1"]),
    (["--model.init_args.rho", "-1"], ["rho must be >= 0"]),
    (["--model.init_args.beta", "-1"], ["beta and min_grad_norm must be >= 0"]),
    (["--model.init_args.temperature", "0"], ["temperature must be > 0"]),
    (["--model", "FedProx", "--model.init_args.mu", "-1"], ["mu must be >= 0"]),
    (["--model", "FedDyn", "--model.init_args.alpha", "0"], ["alpha must be > 0"]),
    (["--model", "MOON", "--model.init_args.tau", "0"], ["tau > 0"]),
    (["--model", "FedExP", "--model.init_args.eps", "0"], ["eps must be > 0"]),
    (["--model", "KNNPer", "--model.init_args.num_neighbors", "0"], ["num_neighbors must be >= 1"]),
    (["--data.num_clients", "0"], ["--data.num_clients must be >= 1, got 0"]),
    (["--data.sample_ratio", "2"], ["--data.sample_ratio must be in (0, 1]"]),
    (["--data.local_epochs", "0"], ["--data.local_epochs must be >= 1, got 0"]),
    (["--data.batch_size", "0"], ["--data.batch_size must be >= 1, got 0"]),
    (["--data.eval_batch_size", "0"], ["--data.eval_batch_size must be >= 1, got 0"]),
    (["--data.num_workers", "-1"], ["--data.num_workers must be >= 0, got -1"]),
    (["--data.min_size", "-1"], ["--data.min_size must be >= 0, got -1"]),
    (["--data.client_test_fraction", "1.5"], ["client_test_fraction must be in (0, 1)"]),
    (["--data.resize", "0"], ["resize must be a positive image size"]),
    (["--federation.local_eval_samples", "-1"], ["--federation.local_eval_samples must be >= 0"]),
    (["--federation.collapse_rounds", "-1"], ["--federation.collapse_rounds must be >= 0"]),
    # seeds numpy would refuse deep inside, and a model whose layers cannot take the data's images
    (["--data.seed", "-1"], ["--data.seed must be in 0 .. 2^32 - 1"]),
    (["--data.partition_seed", "-3"], ["--data.partition_seed must be in 0 .. 2^32 - 1"]),
    (["--model.init_args.model", "cnn4"], ["model cnn4 cannot take 1x8x8 images", "models that can: fedavg_cnn"]),
    (["--model", "FedProto", "--model.init_args.model", "mlp,cnn4", "--data.client_test_fraction", "0.25"],
     ["model cnn4 cannot take 1x8x8 images"]),
    # 375 samples per client in batches of 187 end in a batch of 1, which BatchNorm cannot train on
    # (a ValueError traceback in round 1)
    (["--model.init_args.model", "mlp_bn", "--data.partition", "iid", "--data.batch_size", "187"],
     ["a mini-batch of 1 sample reached a BatchNorm layer in training", "data.batch_size 187"]),
]


def _args(extra, tmp_path):
    if extra[:1] == ["RAW"]:
        return extra[1:]
    if extra[:1] == ["CONFIG"]:
        for name, text in CONFIG_FILES.items():
            (tmp_path / name).write_text(text)
        return ["fit", "--config", str(tmp_path / extra[1]), "--trainer.default_root_dir", str(tmp_path / "run")]
    return ["fit", *BASE, *extra, "--trainer.default_root_dir", str(tmp_path / "run")]


@pytest.mark.parametrize("extra, needles", MALFORMED, ids=[" ".join(e) for e, _ in MALFORMED])
def test_malformed_input_is_one_line_and_exit_2(extra, needles, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(_args(extra, tmp_path))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert stop.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _options(cls) -> dict[str, str]:
    """Each init option of `cls` as the CLI parser reads it, with its help text."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "x")
    return {a.dest[2:]: (a.help or "").strip() for a in parser._actions
            if a.dest.startswith("x.") and a.dest.count(".") == 1 and a.dest != "x.data_spec"}


HELPED = [getattr(methods, n) for n in method_names()] + [FederatedDataModule, FederatedCallback,
                                                           PersonalizationCallback]


@pytest.mark.parametrize("cls", HELPED, ids=[c.__name__ for c in HELPED])
def test_every_option_has_a_one_line_help(cls):
    options = _options(cls)
    assert options
    missing = [name for name, text in options.items() if not text]
    assert not missing, f"{cls.__name__}: no help for {missing}"
    # a docstring that opens with "Args:" shows an "Args::" heading instead of a description
    assert not (cls.__doc__ or "").lstrip().startswith("Args:"), cls.__name__


def test_only_concrete_methods_are_offered():
    names = method_names()
    assert {"FedAvg", "FedSOL", "FedORGP", "KNNPer", "SphereFed"} <= set(names)
    for base in ("FederatedMethod", "HeteroMethod", "KNNPerModel"):
        assert base not in names
    for hidden in ("PrototypeMethod", "SharedHeadMethod", "SharedModelMethod", "ProximalMethod",
                   "FrozenClassifierMethod", "PersonalHeadMethod"):
        assert hidden not in names
    with pytest.raises(TypeError, match="abstract"):
        methods.HeteroMethod()


def test_help_lists_methods_not_bases_and_no_predict(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    known = out[out.index("known") : out.index("Dataset, partition")]
    assert "fl_lightning.methods.FedAvg" in known and "fl_lightning.methods.FedORGP" in known
    for base in ("FederatedMethod,", "HeteroMethod", "PrototypeMethod", "SharedHeadMethod", "ProximalMethod"):
        assert base not in known
    main(["--help"])  # the command's own help: every subcommand, what the tool is
    out = capsys.readouterr().out
    assert "predict" not in out and "Lightning Trainer command line tool" not in out
    assert "{fit,validate,test,analyze,sweep,report}" in out and "Federated-learning research methods" in out


def test_an_unknown_subcommand_is_answered_without_importing_lightning():
    """`fl-lightning fti` answers before Lightning's import (which takes seconds)."""
    import subprocess
    import sys

    code = ("import sys\nfrom fl_lightning.cli import main\ntry:\n    main(['fti'])\nexcept SystemExit as stop:\n"
            "    print(stop.code, 'lightning' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.split() == ["2", "False", "False"], (done.stdout, done.stderr)
    assert done.stderr.strip() == ("error: unknown subcommand 'fti' (did you mean fit?); choose one of: fit, validate, "
                                   "test, analyze, sweep, report (fl-lightning --help)")


def _cli(*args: str):
    """The command as a user runs it: its own process (what reaches the terminal, and the exit code)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "fl_lightning.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


# the whole line each prints (Lightning's "Seed set to 0" may come before it)
EXACT = [
    (["--model", "fedsol"], "error: --model fedsol: unknown method; did you mean FedSOL? "
                            "(fl-lightning fit --help lists every method)"),
    (["--model", "FedSOLL"], "error: --model FedSOLL: unknown method; did you mean FedSOL? "
                             "(fl-lightning fit --help lists every method)"),
    (["--data.num_clients", "-5"], "error: --data.num_clients must be >= 1, got -5"),
    (["--data.num_client", "5"], "error: unknown option --data.num_client; did you mean --data.num_clients? "
                                 "(see fl-lightning fit --help)"),
]


@pytest.mark.parametrize("extra, line", EXACT, ids=[" ".join(e) for e, _ in EXACT])
def test_a_mistake_is_named_as_typed_in_one_line(extra, line, tmp_path):
    done = _cli("fit", *BASE, *extra, "--trainer.default_root_dir", str(tmp_path / "run"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1] == line and "Traceback" not in done.stderr, done.stderr
    assert [x for x in lines if x.startswith("error")] == [line]
    assert not (tmp_path / "run").exists()


def _first_option_line(text: str, prefix: str) -> int:
    lines = text.splitlines()
    return next(i for i, line in enumerate(lines) if line.startswith(f"  {prefix}"))


def test_fit_help_lists_the_federated_groups_before_the_trainer_and_our_ckpt_path():
    done = _cli("fit", "--help")
    out = done.stdout
    assert done.returncode == 0, done.stderr
    order = [_first_option_line(out, prefix) for prefix in
             ("--model", "--data.", "--federation.", "--personalization.", "--analysis.", "--trainer.")]
    assert order == sorted(order), order
    # the first group after the generic options is the method's
    groups = out.split("\n\n")
    first = next(i for i, g in enumerate(groups) if g.startswith("options:"))
    assert "--model.help" in groups[first + 1]
    ckpt = out[out.index("  --ckpt_path"):]
    ckpt = ckpt[: ckpt.index("  --", 4)]
    assert "`last` to continue this run from its last checkpoint" in ckpt
    for lightnings in ("hpc", "registry", "best"):
        assert lightnings not in ckpt, ckpt
    assert "--model.data_spec" not in out
    text = " ".join(out.split())
    # the description is a federated run's, not Lightning's loop's; group titles are whole phrases
    assert "Trains a federated run: one epoch of Lightning's loop is one round" in text
    assert "Runs the full optimization routine." not in text
    assert "Options of the method and of its clients' local training:" in text
    assert "step (manual:" not in text
    weights_only = " ".join(out[out.index("  --weights_only"):].split())
    assert "has no effect: every checkpoint is read as data only" in weights_only
    assert "use ``weights_only=False``" not in weights_only


def test_method_help_leaves_out_the_linked_data_spec():
    done = _cli("fit", "--model.help", "FedSOL")
    assert done.returncode == 0, done.stderr
    assert "--model.rho " in done.stdout and "data_spec" not in done.stdout


def test_analyze_help_has_its_whole_description():
    done = _cli("analyze", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "Written to `<run dir>/analysis/posthoc_round_XXX/`, beside (never over) what the fit wrote." in text
    assert "(needs --ckpt_path), written to:" not in text  # a group title cut mid-sentence
