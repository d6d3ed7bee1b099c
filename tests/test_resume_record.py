"""A resumed run's record keeps its history: an option that changes what the rounds compute
(the federation's decisions, clipping, precision, seeds, the method's and the data's options)
cannot change on resume, so a run directory is one experiment and its config.yaml tells how every
round ran. Run length, devices, logging and analyses may change."""

import pytest
from test_cli import SMALL, run


@pytest.fixture(scope="module")
def one_round(tmp_path_factory):
    root = tmp_path_factory.mktemp("record") / "run"
    assert run(["fit", *SMALL, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root)]) == 0
    return root


@pytest.mark.parametrize("change, option, saved, requested", [
    (["--federation.on_divergence", "skip_client"], "federation.on_divergence", '"stop"', '"skip_client"'),
    (["--trainer.gradient_clip_val", "1.0"], "trainer.gradient_clip_val", "null", "1.0"),
    (["--trainer.precision", "64-true"], "trainer.precision", "null", '"64-true"'),
    (["--federation.eval_local_models", "false"], "federation.eval_local_models", "true", "false"),
    (["--federation.collapse_rounds", "3"], "federation.collapse_rounds", "5", "3"),
])
def test_a_resume_that_changes_results_is_refused_and_the_record_kept(one_round, capsys, change, option, saved,
                                                                      requested):
    config = (one_round / "config.yaml").read_bytes()
    capsys.readouterr()
    assert run(["fit", *SMALL, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(one_round),
                *change, "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"--{option} is {saved} in the run ({one_round / 'config.yaml'}), requested {requested}" in err[0], err
    assert "cannot change on resume" in err[0]
    assert (one_round / "config.yaml").read_bytes() == config
    assert not (one_round / "checkpoints" / "last.ckpt.tmp").exists()


def test_run_length_devices_and_logging_may_change(one_round, capsys):
    assert run(["fit", *SMALL, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(one_round),
                "--trainer.enable_progress_bar", "false", "--analysis.every_n_rounds", "0",
                "--data.num_workers", "0", "--ckpt_path", "last"]) == 0
    assert "max_epochs: 2" in (one_round / "config.yaml").read_text()


def test_a_run_from_before_the_engine_options_resumes_with_their_defaults(one_round, tmp_path):
    """A run whose config.yaml predates `federation.engine` (no engine key: it ran sequentially) or
    says `engine_group: 0` with the sequential engine (which never reads the group) resumes
    without either option given."""
    import shutil

    for edit in (lambda text: text.replace("  engine: sequential\n", "").replace("  engine_group: null\n", ""),
                 lambda text: text.replace("engine_group: null", "engine_group: 0")):
        root = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        shutil.copytree(one_round, root)
        config = root / "config.yaml"
        edited = edit(config.read_text())
        assert edited != config.read_text()
        config.write_text(edited)
        assert run(["fit", *SMALL, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root),
                    "--ckpt_path", "last"]) == 0


def test_the_group_of_clients_trained_together_cannot_change_on_resume_of_a_vectorised_run(tmp_path):
    """engine_group decides which clients' steps are stacked (float32 rounding differs): a
    vectorised run keeps its own; the rule that lets a sequential run ignore it does not apply."""
    from fl_lightning.checkpointing import check_resume_options
    from fl_lightning.errors import FLUserError

    saved = tmp_path / "config.yaml"
    saved.write_text("federation:\n  engine: vectorized\n  engine_group: 0\n")
    with pytest.raises(FLUserError, match=r"--federation.engine_group is 0 in the run .*requested null"):
        check_resume_options("last", saved, "federation:\n  engine: vectorized\n  engine_group: null\n")
    with pytest.raises(FLUserError, match=r"--federation.engine is \"vectorized\" in the run"):
        check_resume_options("last", saved, "federation:\n  engine: sequential\n  engine_group: 0\n")
    saved.write_text("federation:\n  engine: sequential\n  engine_group: 0\n")
    check_resume_options("last", saved, "federation:\n  engine: sequential\n  engine_group: 3\n")
