"""What a researcher does after a fit, as the README tells it: `analyze`, `validate` and `test` on
the run's own config.yaml and checkpoint leave every file of the fit as it was, write beside it,
log into W&B runs of their own in the fit's group, and speak of the checkpoint's round. Also the
start of a run as a user meets it on a terminal: typos refused, a failed start leaves nothing
behind, a progress bar under a pseudo-terminal, no library noise, and where the results are."""

import hashlib
import json
import os
import pty
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import REPO, SMALL, run
from test_outcomes import env

from fl_lightning.loggers import offline_records

# What Lightning prints on its own at a fit's start and end, which the header line replaces
LIGHTNING_NOISE = ("GPU available", "TPU available", "Total Flops", "Seed set to", "`Trainer.fit` stopped",
                   "Restoring states", "Restored all states")
ANALYSIS = ["--analysis.every_n_rounds", "2", "--analysis.samples", "200", "--analysis.surface_points", "3",
            "--analysis.max_hvps", "12", "--analysis.layer_hvps", "3", "--analysis.top_k", "2"]


def fit_files(root: Path) -> dict[str, str]:
    """Digest of every file the fit wrote (W&B's own files included), and where W&B's links point."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0] == "posthoc" or (len(rel.parts) > 1 and rel.parts[1].startswith("posthoc_")):
            continue  # what the post-run commands add beside the fit
        if path.is_symlink():
            out[str(rel)] = "-> " + os.readlink(path)
        elif path.is_file() and path.name != ".fl-lightning.lock":
            out[str(rel)] = hashlib.blake2b(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("after") / "runs" / "mnist5k" / "fedsol"
    assert run(["fit", *SMALL, *ANALYSIS, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root)]) == 0
    return root


def wandb_run_of(directory: Path):
    """The run record and history rows of the W&B offline run in `directory` (an offline-run-* folder)."""
    files = sorted(directory.glob("run-*.wandb"))
    assert files, f"no W&B run in {directory}"
    records = list(offline_records(files[-1]))
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return run_record, rows


def test_analyze_validate_and_test_on_the_runs_own_config_leave_the_fit_alone(fitted, capsys):
    before = fit_files(fitted)
    assert "config.yaml" in before and "analysis/round_002/analysis.json" in before
    config, ckpt = str(fitted / "config.yaml"), str(fitted / "checkpoints" / "last.ckpt")
    fit_run, _ = wandb_run_of(next((fitted / "wandb").glob("offline-run-*")))
    capsys.readouterr()
    for command in ("analyze", "validate", "test"):
        assert run([command, "--config", config, "--ckpt_path", ckpt]) == 0, command
        out = capsys.readouterr().out
        # the checkpoint's round (Lightning's epoch counter says round 1 when only evaluating)
        assert f"{command} of the round-2 checkpoint: global/test_acc" in out, out
        assert fit_files(fitted) == before, command  # config.yaml, metrics, analysis, W&B files, links
    fit_spectrum = json.loads((fitted / "analysis" / "round_002" / "analysis.json").read_text())["spectrum"]
    posthoc = json.loads((fitted / "analysis" / "posthoc_round_002" / "analysis.json").read_text())["spectrum"]
    for key in ("lambda_1", "lambda_2", "lambda_min", "subset_loss"):
        assert posthoc[key] == pytest.approx(fit_spectrum[key], rel=1e-5), key
    # each command is a W&B run of its own, in the fit's group, at the checkpoint's round
    runs = sorted((fitted / "posthoc" / "wandb").glob("offline-run-*"))
    assert len(runs) == 3
    seen = set()
    for path in runs:
        record, rows = wandb_run_of(path)
        seen.add(record.job_type)
        assert record.run_group == fit_run.run_group == "mnist5k/fedsol"
        assert record.display_name == f"mnist5k/fedsol/{record.job_type}"
        assert record.run_id != fit_run.run_id
        assert rows and all(row["round"] == 2 for row in rows), rows
        config = {item.key for item in record.config.update}
        assert not config & {"overwrite", "ckpt_path", "weights_only", "verbose"}, config  # the command's own
    assert seen == {"analyze", "validate", "test"}
    # the report of the parent directory, as the README lays runs out (runs/<setting>/<method>)
    from fl_lightning.cli import main as fl_lightning

    with pytest.raises(SystemExit) as stop:
        fl_lightning(["report", str(fitted.parent.parent)])
    table = capsys.readouterr().out
    assert stop.value.code == 0, table
    assert table.splitlines()[0].startswith("| method | final acc | best acc | seeds |")
    assert table.splitlines()[2].startswith("| FedSOL | ")
    assert fit_files(fitted) == before


def test_resuming_a_finished_run_says_it_finished_and_how_to_continue(tmp_path, capsys):
    """`--ckpt_path last` on a run that has run its rounds writes its records again and trains
    nothing; it used to say nothing of it."""
    root = tmp_path / "run"
    assert run(["fit", *SMALL, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root)]) == 0
    capsys.readouterr()
    assert run(["fit", "--config", str(root / "config.yaml"), "--ckpt_path", "last"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("fit FedSOL (mlp) on digits: ") and "1 round (resuming after round 1)" in lines[0]
    assert lines[1:-1] == ["nothing to train: the run finished at round 1 (trainer.max_epochs 1); to continue it, run "
                           "the same command with a larger --trainer.max_epochs (e.g. --trainer.max_epochs 2)"], lines
    assert lines[-1].startswith(f"run directory {root}: ")


def test_an_abbreviated_option_is_refused_with_the_full_name(tmp_path, capsys):
    code = run(["fit", *SMALL, "--data.num_client", "10", "--trainer.default_root_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: unknown option --data.num_client;") and "data.num_clients" in err[-1]
    assert not (tmp_path / "run").exists()


def test_a_failed_start_leaves_nothing_and_names_the_data_first(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = ["--data.dataset", "cifar10", "--data.root", str(tmp_path / "data"), "--model.init_args.model", "mlp"]
    code = run(["fit", *SMALL, *missing, "--trainer.default_root_dir", str(tmp_path / "new")])
    assert code == 2 and "cifar10" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists() and not (tmp_path / "data").exists()
    # a directory that holds a run: the data's problem is the one to fix first
    held = tmp_path / "held"
    held.mkdir()
    (held / "summary.json").write_text("{}")
    code = run(["fit", *SMALL, *missing, "--trainer.default_root_dir", str(held)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "cifar10" in line and "already holds a run" not in line
    assert sorted(p.name for p in held.iterdir()) == ["summary.json"]


def on_a_terminal(*args: str, interrupt_at: str | None = None) -> tuple[int, str]:
    """(exit code, output) of `fl-lightning <args>` under a pseudo-terminal that reports a 0 x 0
    size (as `script` and job runners give one); with `interrupt_at`, SIGINT once the output shows it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fl_lightning.cli", *args],
                            env={k: v for k, v in env().items() if k != "WANDB_SILENT"},
                            stdout=slave, stderr=slave, cwd=REPO)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
        if interrupt_at is not None and interrupt_at.encode() in out:
            proc.send_signal(signal.SIGINT)
            interrupt_at = None
    os.close(master)
    return proc.wait(timeout=300), out.decode(errors="replace")


def test_a_fit_on_a_terminal_shows_rounds_no_library_noise_and_where_the_results_are(tmp_path):
    root = tmp_path / "run"
    code, text = on_a_terminal("fit", *SMALL, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root))
    assert code == 0, text[-2000:]
    assert "Round 2/2: 100%" in text, text[-2000:]
    # each round's line starts a line of its own above the bar (it used to be written into the bar:
    # `...| 2/2 [00:00<00:00, 11.75it/s]round 1/2: global test acc ...`), and no second bar is drawn
    # for the round's evaluation
    for number in (1, 2):
        assert re.search(rf"(^|[\r\n])round {number}/2: global test acc", text), text[-2000:]
    assert "Validation" not in text
    # the bar is drawn with its round and total from its first frame (it used to be drawn as
    # `Training: | 0/?` and `Epoch 0:` first), and Lightning's start-up lines are one header line
    assert text.lstrip().startswith(f"fit FedSOL (mlp) on digits: 10 clients (dirichlet alpha 0.1), 2 per round, "
                                    f"2 rounds; cpu, precision 32-true, seed 0; run directory {root}\r\n"), text[:500]
    for noise in ("Tip:", "anonymous", "weights_only", "LeafSpec", "transfer_batch_to_device",
                  "LightningCLI's args", "Warning", "warn", "Epoch 0", "0/?", "Training:", *LIGHTNING_NOISE):
        assert noise not in text, noise
    last = [line for line in text.replace("\r", "\n").splitlines() if line.strip()][-1]
    assert last.startswith(f"run directory {root}: metrics.csv"), last
    assert "wandb sync " + str(root / "wandb" / "offline-run-") in last


def test_an_interrupted_fit_on_a_terminal_says_so_on_a_line_of_its_own(tmp_path):
    """Ctrl-C while the bar is drawn: the bar is cleared and the error line starts at the line's
    start (it was written into the bar: `...global/test_acc=0.100]error: interrupted ...`)."""
    root = tmp_path / "run"
    code, text = on_a_terminal("fit", *SMALL, "--trainer.max_epochs", "50", "--trainer.default_root_dir", str(root),
                               interrupt_at="Round 3/50:")
    assert code == 130, text[-2000:]
    assert re.search(r"[\r\n]error: interrupted by SIGINT in round \d+/50; \d+ completed round\(s\) are saved", text), \
        text[-2000:]
    assert "]error:" not in text


def test_the_wandb_run_has_one_history_row_per_round_and_its_clients_table_at_the_end(fitted):
    """Before: about three rows a round (validation metrics, media, epoch-end metrics), so media
    carried `_step` 15, 31, 47 rather than rounds, with Lightning's `epoch` and
    `trainer/global_step` in every row and a second x-axis definition."""
    files = sorted((fitted / "wandb").glob("offline-run-*/run-*.wandb"))
    records = list(offline_records(files[-1]))
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    assert [row["round"] for row in rows] == [0, 1, 2]  # the partition at fit start, then one row a round
    assert [row["_step"] for row in rows] == [0, 1, 2]
    assert not any(k in row for row in rows for k in ("epoch", "trainer/global_step"))
    for row in rows[1:]:
        assert "global/test_acc" in row and "train/loss" in row and "local/drift_mean" in row
        assert "analysis/client_global_dist_mean" not in row  # the same number: logged once
    assert "analysis/surface_loss/_type" in rows[2]  # media in their round's row
    # the run's last row holds the clients table of every round since the last table: here both
    assert "clients/table/_type" not in rows[1]
    assert rows[2]["clients/table/_type"] == "table-file" and rows[2]["clients/table/ncols"] == 8
    from fl_lightning.results import read_metrics

    table = json.loads((files[-1].parent / "files" / rows[2]["clients/table/path"]).read_text())
    assert table["columns"] == ["round", "client", "samples", "local_acc", "local_loss", "drift", "train_loss",
                                "skipped"]
    csv_rows = [[r[c] for c in table["columns"]] for r in read_metrics(fitted / "clients.csv")]
    assert len(csv_rows) == 4 and [[pytest.approx(v) for v in r] for r in table["data"]] == csv_rows
    definitions = [(r.metric.name, r.metric.glob_name, r.metric.step_metric) for r in records
                   if r.WhichOneof("record_type") == "metric"]
    assert definitions == [("round", "", ""), ("", "*", "round")]
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key for item in run_record.config.update}
    assert not config & {"overwrite", "ckpt_path", "weights_only"} and {"model", "data", "trainer"} <= config


def test_the_clients_table_goes_to_wandb_every_n_rounds_with_the_rounds_since_the_last(tmp_path, monkeypatch):
    """A W&B table is an artifact of its own (~3.5 ms); one a round was 2-3% of a small model's
    round. Every N rounds (10; 2 here) and in the last round's row, each with the clients of the
    rounds since the previous table: together, clients.csv."""
    import fl_lightning.results
    from fl_lightning.results import read_metrics

    monkeypatch.setattr(fl_lightning.results, "CLIENTS_TABLE_EVERY_N_ROUNDS", 2)
    root = tmp_path / "run"
    assert run(["fit", *SMALL, "--trainer.max_epochs", "5", "--trainer.default_root_dir", str(root)]) == 0
    run_dir = next((root / "wandb").glob("offline-run-*"))
    _, rows = wandb_run_of(run_dir)
    tables = {row["round"]: json.loads((run_dir / "files" / row["clients/table/path"]).read_text())
              for row in rows if "clients/table/path" in row}
    assert sorted(tables) == [2, 4, 5]
    csv_rows = read_metrics(root / "clients.csv")
    for last, rounds in ((2, {1, 2}), (4, {3, 4}), (5, {5})):
        columns = tables[last]["columns"]
        expected = [[r[c] for c in columns] for r in csv_rows if r["round"] in rounds]
        assert len(expected) == 2 * len(rounds)
        assert [[pytest.approx(v) for v in r] for r in tables[last]["data"]] == expected


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`fl-lightning <args>` as a user types it, in `cwd` (this checkout's code)."""
    return subprocess.run([sys.executable, "-m", "fl_lightning.cli", *args], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=600)


def test_the_readmes_post_run_commands_as_a_user_types_them(tmp_path):
    """The README's session, each command its own process in the user's working directory: fit
    (into runs/<setting>/<method>, a relative directory), analyze, validate and test with the
    run's own config.yaml, validate again from inside the run directory (whose config.yaml names
    the run relative to where the fit started), and `report runs`. The fit's files stay byte for
    byte as the fit left them, and nothing is nested inside the run."""
    settings, methods = REPO / "configs" / "settings", REPO / "configs" / "methods"
    fit = cli("fit", "--config", str(settings / "mnist5k.yaml"), "--config", str(methods / "fedsol" / "fedsol.yaml"),
              *SMALL[4:], *ANALYSIS, "--trainer.max_epochs", "2", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mnist5k" / "fedsol"
    first, *_, last = fit.stdout.strip().splitlines()
    assert first == ("fit FedSOL (mlp) on digits: 10 clients (dirichlet alpha 0.1), 2 per round, 2 rounds; cpu, "
                     "precision 32-true, seed 0; run directory runs/mnist5k/fedsol")
    assert last.startswith("run directory runs/mnist5k/fedsol: metrics.csv")
    for noise in LIGHTNING_NOISE:
        assert noise not in fit.stdout + fit.stderr, noise
    before = fit_files(run_dir)
    assert {"config.yaml", "metrics.csv", "analysis/round_002/analysis.json"} <= set(before)
    R = "runs/mnist5k/fedsol"
    for command in ("analyze", "validate", "test"):
        done = cli(command, "--config", f"{R}/config.yaml", "--ckpt_path", f"{R}/checkpoints/last.ckpt", cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr[-3000:])
        lines = done.stdout.strip().splitlines()
        assert lines[-1 if command != "analyze" else -2].startswith(f"{command} of the round-2 checkpoint: "
                                                                     "global/test_acc"), done.stdout
        # where the command's W&B run went, as a fit says it
        assert lines[-1].rpartition("; upload to W&B with: wandb sync ")[2].startswith(
            f"{R}/posthoc/wandb/offline-run-"), lines[-1]
        assert "round 1/2" not in done.stdout + done.stderr
        # the command's line says the result; Lightning's metrics table (full floats) only with --verbose true
        assert "metric" not in done.stdout and "DataLoader 0" not in done.stdout, done.stdout
        assert fit_files(run_dir) == before, command
        if command == "analyze":  # a line as each stage starts (a bar each on a terminal), then where it wrote
            assert lines[-1].startswith(f"analysis written to {R}/analysis/posthoc_round_002; "), lines[-1]
            stages = [line for line in done.stderr.splitlines() if line.startswith("analysis: ")]
            assert stages == ["analysis: Hessian top-2 eigenvalues, up to 12 Hessian-vector products",
                              "analysis: Hessian trace, 10 Hessian-vector products",
                              "analysis: Hessian lambda_1 of 2 layers, up to 6 Hessian-vector products",
                              "analysis: loss surface, hessian directions, 9 points"], done.stderr
    assert (run_dir / "analysis" / "posthoc_round_002" / "spectrum.png").exists()
    inside = cli("validate", "--config", "config.yaml", "--ckpt_path", "checkpoints/last.ckpt", cwd=run_dir)
    assert inside.returncode == 0, inside.stderr[-3000:]
    assert not (run_dir / "runs").exists()  # it used to make runs/mnist5k/fedsol/runs/mnist5k/fedsol/posthoc
    assert len(list((run_dir / "posthoc" / "wandb").glob("offline-run-*"))) == 4
    assert fit_files(run_dir) == before
    report = cli("report", "runs", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    header, _, row = report.stdout.splitlines()[:3]
    assert header.startswith("| method | final acc | best acc | seeds |") and row.startswith("| FedSOL | ")
    assert fit_files(run_dir) == before


def test_a_start_refused_after_the_directory_was_claimed_leaves_nothing(tmp_path, capsys):
    """A model-heterogeneous method's client models are built once the run directory is claimed;
    one that cannot take the data's images used to leave runs/<setting>/<method> with config.yaml,
    a summary.json saying "crashed" and a W&B run, so the corrected command was refused as "already
    holds a run"."""
    top = tmp_path / "runs"
    root = top / "mnist5k" / "fedproto"
    hetero = ["--model", "FedProto", "--data.client_test_fraction", "0.25", "--trainer.max_epochs", "1",
              "--trainer.default_root_dir", str(root)]
    code = run(["fit", *SMALL, *hetero, "--model.init_args.model", "mlp,cnn4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: model cnn4 cannot take 1x8x8 images"), err
    assert not top.exists()  # nor runs/mnist5k, which this start made
    assert run(["fit", *SMALL, *hetero, "--model.init_args.model", "mlp"]) == 0
    assert json.loads((root / "summary.json").read_text())["outcome"] == "finished"
    # a directory that was there before stays, without the run files this start wrote
    kept = tmp_path / "kept"
    kept.mkdir()
    code = run(["fit", *SMALL, *hetero[:-1], str(kept), "--model.init_args.model", "mlp,cnn4"])
    assert code == 2 and kept.is_dir() and not (kept / "config.yaml").exists() and not (kept / "summary.json").exists()
