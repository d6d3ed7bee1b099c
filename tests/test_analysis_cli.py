"""`--analysis.*` and `fl-lightning analyze` end to end: files under the run directory, W&B panels
(round as x-axis, resolved config, group and tags), the same numbers from a checkpoint, and bad
input as one line with exit code 2."""

import json
from pathlib import Path

import pytest
import torch
from test_cli import REPO, run

from fl_lightning.loggers import offline_records

SMALL = ["--config", str(REPO / "configs/settings/mnist5k.yaml"),
         "--config", str(REPO / "configs/methods/fedsol/fedsol.yaml"), "--data.dataset", "digits",
         "--model.init_args.model", "mlp", "--data.num_clients", "10", "--data.local_epochs", "1",
         "--data.min_size", "5", "--federation.local_eval_samples", "200"]
ANALYSIS = ["--analysis.every_n_rounds", "2", "--analysis.samples", "300", "--analysis.surface_points", "5",
            "--analysis.heatmap_every_n_rounds", "1", "--analysis.max_hvps", "20", "--analysis.layer_hvps", "5"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis") / "run"
    assert run(["fit", *SMALL, *ANALYSIS, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root)]) == 0
    return root


def records(root: Path):
    files = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {root}"
    return list(offline_records(files[-1]))


def test_fit_writes_analysis_files(fitted):
    out = fitted / "analysis"
    assert json.loads((out / "partition.json").read_text())["counts"]
    assert (out / "round_001" / "classwise_local.png").exists()  # heatmap every round
    assert not (out / "round_001" / "surface_loss.png").exists()  # spectrum only every 2 rounds
    result = json.loads((out / "round_002" / "analysis.json").read_text())
    spectrum = result["spectrum"]
    assert spectrum["lambda_1"] >= spectrum["lambda_5"] > 0 and spectrum["lambda_min"] <= spectrum["lambda_5"]
    assert spectrum["lambda_1_over_lambda_5"] == pytest.approx(spectrum["lambda_1"] / spectrum["lambda_5"])
    assert spectrum["lanczos_hvps"] <= 20
    assert spectrum["spectrum_seconds"] > 0 and spectrum["surface_seconds"] > 0
    surface = result["surface"]
    assert len(surface["loss"]) == 5 and surface["loss"][2][2] == pytest.approx(spectrum["subset_loss"])
    for name in ("surface_loss.png", "surface_acc.png", "classwise_local.png", "spectrum.png"):
        assert (out / "round_002" / name).stat().st_size > 1000
    assert (out / "spectrum_history.png").stat().st_size > 1000  # lambda_1 and lambda_1/lambda_k over rounds


def test_wandb_run_is_a_dashboard(fitted):
    recs = records(fitted)
    run_record = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    assert run_record.run_group == "mnist5k/fedsol"
    assert set(run_record.tags) == {"FedSOL", "digits", "dirichlet"}
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["method"] == "FedSOL"
    assert config["model"]["init_args"]["rho"] == 2.0 and config["data"]["dataset"] == "digits"
    assert config["federation"]["local_eval_samples"] == 200 and config["trainer"]["max_epochs"] == 2
    assert config["analysis"]["every_n_rounds"] == 2

    def keys(d):
        for k, v in d.items():
            yield k
            if isinstance(v, dict):
                yield from keys(v)

    assert not [k for k in keys({k: v for k, v in config.items() if k != "_wandb"}) if k.startswith("_")]
    metrics = [r.metric for r in recs if r.WhichOneof("record_type") == "metric"]
    assert metrics[-1].glob_name == "*" and metrics[-1].step_metric == "round"
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]
    assert all("round" in row for row in rows)
    by_round = {}
    for row in rows:
        by_round.setdefault(row["round"], {}).update(row)
    assert sorted(by_round) == [0, 1, 2]  # 0: the partition at fit start
    def has(r, prefix):  # media (images, tables, histograms) are logged as nested keys
        return any(k == prefix or k.startswith(prefix + "/") for k in by_round[r])

    assert by_round[2]["analysis/lambda_1"] > 0 and has(2, "analysis/surface_table") and has(2, "analysis/surface_loss")
    assert "global/test_acc" in by_round[1] and "analysis/client_global_dist_max" in by_round[1]
    assert has(1, "analysis/local_acc_hist") and has(0, "analysis/partition") and has(0, "analysis/partition_counts")


def test_analyze_a_checkpoint_gives_the_same_numbers(fitted, tmp_path):
    fit_numbers = json.loads((fitted / "analysis" / "round_002" / "analysis.json").read_text())["spectrum"]
    root = tmp_path / "again"
    code = run(["analyze", *SMALL, *ANALYSIS, "--trainer.default_root_dir", str(root),
                "--ckpt_path", str(fitted / "checkpoints" / "last.ckpt")])
    assert code == 0
    assert not (root / "analysis" / "round_002").exists()  # a post-hoc analysis has its own folder
    again = json.loads((root / "analysis" / "posthoc_round_002" / "analysis.json").read_text())["spectrum"]
    for key in ("lambda_1", "lambda_5", "lambda_min", "trace", "subset_loss"):
        assert again[key] == pytest.approx(fit_numbers[key], rel=1e-5), key
    assert (root / "analysis" / "posthoc_round_002" / "surface_loss.png").exists()


@pytest.mark.parametrize("extra, message", [
    (["fit", "--analysis.surface", "sideways"], "analysis.surface"),
    (["fit", "--analysis.hvp", "sideways"], "analysis.hvp"),
    (["fit", "--analysis.top_k", "1"], "analysis.surface hessian needs top_k >= 2"),
    (["fit", "--analysis.every_n_rounds", "1", "--analysis.top_k", "100000", "--analysis.max_hvps", "100000"],
     "analysis.top_k = 100000 but the model has only"),
    (["analyze", "--model.init_args.model", "fedavg_cnn"], "the checkpoint is of a different experiment"),
    (["analyze", "--plain-state-dict"], "not a Lightning checkpoint"),
    (["analyze", "--no-ckpt"], "analyze needs --ckpt_path"),
])
def test_bad_analysis_input_is_one_line_and_exit_2(fitted, tmp_path, capsys, extra, message):
    command, *extra = extra
    args = [command, *SMALL, "--trainer.max_epochs", "1", "--trainer.logger", "false",
            "--trainer.default_root_dir", str(tmp_path)]
    if command == "analyze":
        ckpt = fitted / "checkpoints" / "last.ckpt"
        if extra == ["--plain-state-dict"]:  # torch.save of weights, not a Lightning checkpoint
            ckpt = tmp_path / "weights.pt"
            torch.save({"w": torch.zeros(2)}, ckpt)
        if extra != ["--no-ckpt"]:
            args += ["--ckpt_path", str(ckpt)]
        extra = [e for e in extra if not e.startswith("--plain") and not e.startswith("--no-ckpt")]
    code = run(args + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("error: ") and message in err[-1], err[-1]
    assert not any("Traceback" in line for line in err)


def assert_metrics_csv_equals_wandb_history(root: Path, rounds: int) -> list[dict]:
    """Every metrics.csv row holds exactly the scalars W&B received for that round, equal values."""
    from fl_lightning.results import read_metrics

    by_round: dict = {}
    for r in records(root):
        if r.WhichOneof("record_type") == "history":
            # scalars only: media (images, tables, histograms) arrive as nested keys
            row = {i.key or i.nested_key[0]: json.loads(i.value_json) for i in r.history.item
                   if i.key or len(i.nested_key) == 1}
            by_round.setdefault(row["round"], {}).update(row)
    csv_rows = read_metrics(root / "metrics.csv")
    assert [r["round"] for r in csv_rows] == list(range(1, rounds + 1))
    for row in csv_rows:
        logged = by_round[row["round"]]
        scalars = {k for k, v in logged.items() if isinstance(v, int | float) and not k.startswith("_")
                   and k not in ("round", "epoch", "trainer/global_step")}
        assert {k for k in row if k != "round"} == scalars, row["round"]
        for key, value in row.items():
            assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    return csv_rows


def test_metrics_csv_rows_equal_the_wandb_history_and_summary(fitted):
    from fl_lightning.results import read_summary

    recs = records(fitted)
    csv_rows = assert_metrics_csv_equals_wandb_history(fitted, rounds=2)
    # the analysis's own cost, in the round it ran (every 2 rounds here)
    assert "perf/analysis_seconds" not in csv_rows[0] and csv_rows[1]["perf/analysis_seconds"] > 0
    summary = read_summary(fitted)
    accuracy = [r["global/test_acc"] for r in csv_rows]
    assert summary["best_round"] == 1 + max(range(len(accuracy)), key=accuracy.__getitem__)
    assert summary["best_acc"] == max(accuracy) and summary["final_acc"] == accuracy[-1]
    wandb_summary = {}
    for r in recs:
        if r.WhichOneof("record_type") == "summary":
            wandb_summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    for key in ("final_acc", "final_round", "best_acc", "best_round", "rounds_completed", "finished"):
        assert wandb_summary[key] == summary[key], key


def test_metrics_csv_rows_hold_only_their_rounds_values(tmp_path):
    """A statistic logged only on some rounds (the class-wise heatmap's, every 2nd round here) is in
    those rounds' rows only. Lightning keeps every key ever logged in `trainer.callback_metrics`, so
    rows built from it used to repeat round 2's values in round 3's row: W&B never got them there,
    and a run resumed after round 2 did not write them, so a killed-and-resumed run's metrics.csv
    differed from an uninterrupted one's."""
    root = tmp_path / "run"
    assert run(["fit", *SMALL, "--analysis.heatmap_every_n_rounds", "2", "--trainer.max_epochs", "4",
                "--trainer.default_root_dir", str(root)]) == 0
    rows = assert_metrics_csv_equals_wandb_history(root, rounds=4)
    heatmap_rounds = [r["round"] for r in rows if "analysis/local_class_acc_mean" in r]
    assert heatmap_rounds == [2, 4]


def test_each_rounds_heatmap_file_is_its_numbers_drawn_on_one_colour_scale(fitted):
    """The class-wise heatmap PNG a fit writes each round is analysis.json's numbers drawn as a new
    figure draws them, on the 0-1 scale of an accuracy (round 2 redraws round 1's figure)."""
    import numpy as np
    from PIL import Image

    from fl_lightning.analysis import plots

    for round_no in (1, 2):
        folder = fitted / "analysis" / f"round_{round_no:03d}"
        numbers = json.loads((folder / "analysis.json").read_text())["classwise_local"]
        expected = plots.heatmap_image(np.array(numbers["acc"], dtype=np.float64),
                                       f"FedSOL, mnist5k, round {round_no}: local models' class-wise accuracy",
                                       "class", "client id", annotate=False, quantity="accuracy",
                                       row_labels=numbers["clients"], log_scale=False, limits=(0.0, 1.0))
        written = np.asarray(Image.open(folder / "classwise_local.png").convert("RGB"))
        np.testing.assert_array_equal(written, expected)


def test_the_heatmap_shows_the_federations_evaluation_of_each_local_model(fitted):
    """The class-wise heatmap's rows are the per-class counts of the same evaluation that gives
    clients.csv's local_acc (on the same 200-digit subset), not a second evaluation: each row's
    class accuracies, weighted by the subset's class counts, are that client's local_acc."""
    import csv

    from fl_lightning.data.datamodule import FederatedDataModule

    dm = FederatedDataModule(dataset="digits", num_clients=10, min_size=5)
    dm.setup()
    labels = torch.cat([y for _, y in dm.global_test_subset_loader(200)])
    counts = torch.bincount(labels, minlength=10).double()
    rows = list(csv.DictReader((fitted / "clients.csv").open()))
    for round_no in (1, 2):
        heatmap = json.loads((fitted / "analysis" / f"round_{round_no:03d}" / "analysis.json").read_text())
        classwise = heatmap["classwise_local"]
        local_acc = {int(r["client"]): float(r["local_acc"]) for r in rows if int(r["round"]) == round_no}
        assert sorted(classwise["clients"]) == sorted(local_acc)
        for client, per_class in zip(classwise["clients"], classwise["acc"], strict=True):
            per_class = torch.tensor(per_class, dtype=torch.float64)
            weighted = float((per_class.nan_to_num() * counts).sum() / counts.sum())
            assert weighted == pytest.approx(local_acc[client], abs=1e-9)


def test_the_partition_drawn_while_round_1_starts_is_in_its_file_and_in_round_0s_row(fitted):
    """The partition picture is drawn in the background while the first round runs: its file is
    still written, and W&B still gets it, the same picture, in round 0's row, sent before round 1's."""
    import numpy as np
    from PIL import Image

    picture = np.asarray(Image.open(fitted / "analysis" / "partition.png").convert("RGB"))
    assert picture.shape[0] >= 240 and len(np.unique(picture.reshape(-1, 3), axis=0)) > 20  # a heatmap, not blank
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records(fitted) if r.WhichOneof("record_type") == "history"]
    assert [row["round"] for row in rows] == [0, 1, 2]  # the partition's row first, each round once
    assert rows[0]["analysis/partition/_type"] == "image-file" and "analysis/partition_counts/_type" in rows[0]
    media = next(fitted.glob("wandb/offline-run-*/files")) / rows[0]["analysis/partition/path"]
    assert np.array_equal(np.asarray(Image.open(media).convert("RGB")), picture)
