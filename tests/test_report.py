"""`fl-lightning report` on hand-made run directories: the hand-computed mean ± std over seeds, the
papers' Failed/Diverged marks, personalised columns, the CSV, and `--compare` with a paper table."""

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest
import yaml

from fl_lightning.cli import main


def make_run(sweep_dir: Path, name: str, params: dict, *, final=None, best=None, finished=True, diverged=False,
             failed=False, last=None, status="finished", error=None, config=None, record=True, curve=None) -> None:
    """A run directory as fit leaves one: metrics.csv (`curve`: the accuracy of rounds 1, 2, ...;
    by default 10 rounds, 3 if not finished, ending at `best`, then `final`), the summary.json
    those rows give, and a config.yaml holding the run's sweep parameters."""
    run = sweep_dir / name
    run.mkdir(parents=True)
    best = best if best is not None else final
    curve = curve or [0.0] * (8 if finished else 1) + [best, final]
    last = {"global/test_acc": final, **(last or {})}
    rows = [{"round": r, "global/test_acc": acc} for r, acc in enumerate(curve, start=1)]
    rows[-1].update(last)
    columns = ["round", *sorted({k for row in rows for k in row} - {"round"})]
    (run / "metrics.csv").write_text(",".join(columns) + "\n" + "".join(
        ",".join(repr(row[c]) if c in row else "" for c in columns) + "\n" for row in rows))
    best_round = max(range(len(curve)), key=lambda i: curve[i]) + 1
    summary = {"method": "X", "rounds_completed": len(curve), "max_rounds": 10, "finished": finished,
               "final_acc": final, "final_round": len(curve), "best_acc": curve[best_round - 1],
               "best_round": best_round, "wall_time_s": 1.0, "diverged": diverged, "failed": failed, "last": last}
    (run / "summary.json").write_text(json.dumps(summary))
    if config is None:  # what fit writes for these parameters (model.class_path: {model: {class_path: ...}})
        config = {"seed_everything": params.get("seed_everything", 0)}
        for key, value in params.items():
            *parents, leaf = key.split(".")
            node = config
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    if record:
        (sweep_dir / ".sweep").mkdir(exist_ok=True)
        (sweep_dir / ".sweep" / f"{name}.json").write_text(json.dumps(
            {"name": name, "index": len(list((sweep_dir / ".sweep").glob("*.json"))), "params": params,
             "status": status, "error": error, "exit_code": 3 if diverged else 0}))


def report(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(["report", *args])
    return stop.value.code, out.getvalue(), err.getvalue()


def rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows of the first table, by their first cell."""
    table = text.split("\n\n")[0]
    out = {}
    for line in table.splitlines()[2:]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


@pytest.fixture
def sweep_dir(tmp_path) -> Path:
    d = tmp_path / "runs" / "hand"
    m = "fl_lightning.methods."
    for seed, (final, best, ft) in enumerate([(0.50, 0.55, 0.8), (0.60, 0.65, 0.9), (0.70, 0.80, 1.0)]):
        make_run(d, f"FedAvg-{seed}", {"model.class_path": m + "FedAvg", "seed_everything": seed}, final=final,
                 best=best, last={"personal/ft5_acc_mean": ft, "personal/ft5_acc_std": 0.5})
    make_run(d, "SCAFFOLD-0", {"model.class_path": m + "SCAFFOLD", "seed_everything": 0}, final=0.40, best=0.45)
    make_run(d, "SCAFFOLD-1", {"model.class_path": m + "SCAFFOLD", "seed_everything": 1}, final=0.30, best=0.35,
             finished=False, diverged=True, status="diverged")
    for seed in (0, 1):
        make_run(d, f"FedNova-{seed}", {"model.class_path": m + "FedNova", "seed_everything": seed}, final=0.10,
                 best=0.31, failed=True)
    make_run(d, "FedSOL-0", {"model.class_path": m + "FedSOL", "seed_everything": 0}, final=0.2, finished=False,
             status="running")
    (d / ".sweep" / "FedSOL-1.json").write_text(json.dumps(
        {"name": "FedSOL-1", "index": 9, "params": {"model.class_path": m + "FedSOL", "seed_everything": 1},
         "status": "crashed", "exit_code": 1, "error": "RuntimeError: boom"}))
    return d


def test_mean_std_over_seeds_and_the_papers_marks(sweep_dir):
    code, out, _ = report(str(sweep_dir))
    assert code == 0
    table = rows(out)
    assert out.splitlines()[0] == "| model | final acc | best acc | seeds | personal/ft5 |"
    # final 50, 60, 70: mean 60, population std sqrt(200/3) = 8.165; best 55, 65, 80: 66.67 ± sqrt(316.67/3) = 10.27
    assert table["FedAvg"] == ["60.00 ± 8.16", "66.67 ± 10.27", "3", "90.00 ± 8.16"]
    # The diverged seed is out of the mean and marked.
    assert table["SCAFFOLD"][:3] == ["40.00 (n=1) (1/2 diverged)", "45.00 (n=1) (1/2 diverged)", "2"]
    # Collapsed to chance in every seed: the papers' "10.00 (Failed)".
    assert table["FedNova"][0] == "10.00 (Failed)" and table["FedNova"][2] == "2"
    assert "FedSOL" not in table  # no finished run
    assert "- FedSOL-0: unfinished" in out and "- FedSOL-1: crashed: RuntimeError: boom" in out
    with open(sweep_dir / "report.csv") as f:
        by_model = {r["model"]: r for r in csv.DictReader(f)}
    assert float(by_model["FedAvg"]["final_acc_mean"]) == pytest.approx(60.0)
    assert float(by_model["FedAvg"]["final_acc_std"]) == pytest.approx((200 / 3) ** 0.5, abs=1e-4)
    assert by_model["SCAFFOLD"]["diverged"] == "1" and by_model["FedNova"]["failed"] == "2"


def test_compare_prints_ours_next_to_the_paper_with_the_difference(sweep_dir, tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text(yaml.safe_dump({"paper": "P", "table": "Table 9", "sweep": {}, "published": {
        "metric": "final_acc", "entries": [
            {"match": {"model.class_path": "FedAvg"}, "acc": 62.0, "std": 1.0},
            {"match": {"model.class_path": "FedNova"}, "acc": 10.0, "failed": True},
            {"match": {"model.class_path": "FedAvg"}, "metric": "personal/ft5_acc_mean", "acc": 85.0},
            {"match": {"model.class_path": "FedDyn"}, "acc": 50.0},
        ]}}))
    code, out, _ = report(str(sweep_dir), "--compare", str(table))
    assert code == 0
    compared = out.split("Compared with P: Table 9:")[1]
    lines = [line for line in compared.splitlines() if line.startswith("| model=")]
    assert lines == [
        "| model=FedAvg | final_acc | 60.00 ± 8.16 | 62.00 ± 1.00 | -2.00 |",
        "| model=FedNova | final_acc | 10.00 (Failed) | 10.00 (Failed) | +0.00 |",
        "| model=FedAvg | personal/ft5_acc_mean | 90.00 ± 8.16 | 85.00 | +5.00 |",
        "| model=FedDyn | final_acc | no finished run | 50.00 | — |",
    ]


def test_runs_without_sweep_records_are_labelled_by_the_options_that_differ(tmp_path):
    d = tmp_path / "plain"
    for name, alpha, seed, acc in [("a", 0.1, 0, 0.2), ("b", 0.1, 1, 0.4), ("c", 0.5, 0, 0.9)]:
        config = {"seed_everything": seed, "data": {"alpha": alpha, "seed": 0, "dataset": "digits"},
                  "trainer": {"default_root_dir": str(d / name)}}
        make_run(d, name, {}, final=acc, config=config, record=False)
    code, out, _ = report(str(d))
    assert code == 0
    assert out.splitlines()[0].startswith("| method | alpha | final acc |")
    lines = [line for line in out.split("\n\n")[0].splitlines()[2:] if line.startswith("|")]
    table = {c[1]: c[2:] for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines)}  # by alpha
    assert all(line.startswith("| X |") for line in lines)
    assert table["0.1"][:3] == ["30.00 ± 10.00", "30.00 ± 10.00", "2"] and table["0.5"][2] == "1"


def test_no_finished_runs_is_one_line_and_exit_2(tmp_path):
    d = tmp_path / "empty"
    make_run(d, "x", {"seed_everything": 0}, final=0.3, finished=False, status="running")
    code, out, err = report(str(d))
    assert code == 2 and out == ""
    assert err.startswith("error: report ") and "no finished runs" in err and len(err.strip().splitlines()) == 1
    code, _, err = report(str(tmp_path / "nowhere"))
    assert code == 2 and "no such directory" in err


def readme_layout(top: Path) -> None:
    """runs/<setting>/<method> as fit lays them out, seeds as sweep sub-directories for one."""
    def config(setting, method, seed):
        return {"seed_everything": seed, "model": {"class_path": f"fl_lightning.methods.{method}"},
                "trainer": {"logger": {"init_args": {"group": f"{setting}/{method.lower()}"}}}}

    make_run(top / "mnist5k", "fedavg", {}, final=0.5, config=config("mnist5k", "FedAvg", 0), record=False)
    make_run(top / "mnist5k", "fedsol", {}, final=0.7, config=config("mnist5k", "FedSOL", 0), record=False)
    for seed, acc in ((0, 0.2), (1, 0.4)):
        make_run(top / "cifar10" / "fedavg", f"seed={seed}", {}, final=acc, config=config("cifar10", "FedAvg", seed),
                 record=False)
    for path, method in ((top / "mnist5k" / "fedavg", "FedAvg"), (top / "mnist5k" / "fedsol", "FedSOL"),
                         *((top / "cifar10" / "fedavg" / f"seed={s}", "FedAvg") for s in (0, 1))):
        summary = json.loads((path / "summary.json").read_text())
        (path / "summary.json").write_text(json.dumps({**summary, "method": method}))


def table_cells(out: str) -> list[list[str]]:
    lines = [line for line in out.split("\n\n")[0].splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines if not line.startswith("|---")]


def test_report_finds_runs_at_any_depth_with_method_and_setting_columns(tmp_path):
    readme_layout(tmp_path / "runs")
    code, out, _ = report(str(tmp_path / "runs"))
    assert code == 0, out
    header, *body = table_cells(out)
    assert header[:3] == ["method", "setting", "final acc"]
    assert sorted(tuple(r[:4]) for r in body) == [("FedAvg", "cifar10", "30.00 ± 10.00", "30.00 ± 10.00"),
                                                  ("FedAvg", "mnist5k", "50.00 (n=1)", "50.00 (n=1)"),
                                                  ("FedSOL", "mnist5k", "70.00 (n=1)", "70.00 (n=1)")]
    # one setting: no setting column, a method column still
    code, out, _ = report(str(tmp_path / "runs" / "mnist5k"))
    header, *body = table_cells(out)
    assert code == 0 and header[:2] == ["method", "final acc"] and len(body) == 2
    # a run directory itself
    code, out, _ = report(str(tmp_path / "runs" / "mnist5k" / "fedsol"))
    header, *body = table_cells(out)
    assert code == 0 and body == [["FedSOL", "70.00 (n=1)", "70.00 (n=1)", "1"]]


@pytest.mark.parametrize("damage", ["garbage", "wrong types", "empty"])
def test_a_damaged_sweep_record_counts_as_absent(sweep_dir, damage):
    record = sweep_dir / ".sweep" / "FedAvg-0.json"
    record.write_text({"garbage": "{not json", "empty": "",
                       "wrong types": json.dumps({"index": "first", "params": [1], "status": 3})}[damage])
    code, out, err = report(str(sweep_dir))
    assert code == 0 and "Traceback" not in err, err
    with open(sweep_dir / "report.csv") as f:  # the run directory still counts, labelled by its config
        assert "FedAvg-0" in " ".join(r["runs"] for r in csv.DictReader(f))


def test_a_read_only_directory_prints_the_table_and_one_line_about_the_csv(sweep_dir, monkeypatch):
    import fl_lightning.report as report_module

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(report_module, "atomic_write_bytes", refuse)
    code, out, err = report(str(sweep_dir))
    assert code == 1 and "| FedAvg |" in out
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: could not write ")
    assert "--csv" in err and "Traceback" not in err


def methods_with_curves(top: Path) -> None:
    """FedSOL and FedAvg on seeds 0-2 (the same seeds: paired), FedProx on seeds 3-4 (Welch);
    metrics.csv: 5 rounds whose last value is the final accuracy."""
    m = "fl_lightning.methods."
    table = {"FedSOL": {0: 0.60, 1: 0.70, 2: 0.80}, "FedAvg": {0: 0.50, 1: 0.65, 2: 0.70},
             "FedProx": {3: 0.55, 4: 0.75}}
    for method, finals in table.items():
        for seed, final in finals.items():
            name = f"{method}-{seed}"
            make_run(top, name, {"model.class_path": m + method, "seed_everything": seed}, final=final,
                     curve=[final - 0.05 * (5 - r) for r in range(1, 6)])  # rising to the final value
            summary = json.loads((top / name / "summary.json").read_text())
            (top / name / "summary.json").write_text(json.dumps({**summary, "accuracy": "global/test_acc"}))


def test_baseline_differences_with_paired_and_welch_intervals(tmp_path):
    from scipy import stats

    methods_with_curves(tmp_path / "t")
    code, out, err = report(str(tmp_path / "t"), "--baseline", "FedAvg")
    assert code == 0, err
    header, *body = table_cells(out)
    assert header[-1] == "final acc − FedAvg (95% CI)"
    cells = {r[0]: r[-1] for r in body}
    assert cells["FedAvg"] == "(baseline)"
    # paired over seeds 0-2: differences 10, 5, 10 points; mean 8.333, sd 2.8868, t(0.975, 2) = 4.3027
    half = 4.302652729911275 * (50 / 6) ** 0.5 / 3**0.5
    assert cells["FedSOL"] == f"+8.33 [{25 / 3 - half:+.2f}, {25 / 3 + half:+.2f}] (paired t, n=3)"
    # Welch: 55, 75 against 50, 65, 70
    va, vb = 200 / 2, (650 / 3) / 2 / 3  # var(ddof=1) / n
    df = (va + vb) ** 2 / (va**2 / 1 + vb**2 / 2)
    half = stats.t.ppf(0.975, df) * (va + vb) ** 0.5
    assert cells["FedProx"] == (f"+3.33 [{10 / 3 - half:+.2f}, {10 / 3 + half:+.2f}] "
                                "(Welch t, n=2: fewer than 3 seeds, not to be trusted)")


def test_last_k_mean_and_the_curves(tmp_path):
    methods_with_curves(tmp_path / "t")
    code, out, err = report(str(tmp_path / "t"), "--metric", "last_k_mean", "--last-k", "3", "--baseline",
                            "fedavg", "--curves")
    assert code == 0, err
    header, *body = table_cells(out)
    assert "last-3 mean acc" in header and header[-1] == "last-3 mean acc − fedavg (95% CI)"
    column = header.index("last-3 mean acc")
    # FedSOL's seeds: final - 0.05 on average over rounds 3-5 -> 55, 65, 75: 65.00 ± 8.16
    assert {r[0]: r[column] for r in body}["FedSOL"] == "65.00 ± 8.16"
    png = tmp_path / "t" / "curves.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--baseline", "FedNothing"], "--baseline FedNothing: no finished run of that method here; methods: "),
    (["--last-k", "0"], "--last-k must be >= 1"),
    (["--metric", "median"], "--metric"),
])
def test_bad_comparison_options_are_one_line(sweep_dir, args, message):
    code, out, err = report(str(sweep_dir), *args)
    assert code == 2 and out == "" and err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_methods_own_options_do_not_become_columns(tmp_path):
    """FedAvg, FedProx and FedSOL as fit writes their config.yaml (each method's own options only in
    its own file): the table and the curves are labelled by method, not by a column per option of
    every method (`| FedAvg | None | None | ... |`, and curves labelled "FedAvg None None ...")."""
    from fl_lightning.report import build

    own = {"FedAvg": {}, "FedProx": {"mu": 0.01}, "FedSOL": {"rho": 2.0, "temperature": 3.0}}
    for method, options in own.items():
        for seed in (0, 1):
            config = {"seed_everything": seed, "model": {"class_path": f"fl_lightning.methods.{method}",
                                                         "init_args": {"lr": 0.01, **options}}}
            make_run(tmp_path / "t", f"{method}-{seed}", {}, final=0.5, config=config, record=False)
    # one more FedSOL row whose rho differs: that option does tell two rows apart
    config = {"seed_everything": 0, "model": {"class_path": "fl_lightning.methods.FedSOL",
                                              "init_args": {"lr": 0.01, "rho": 1.0, "temperature": 3.0}}}
    make_run(tmp_path / "t", "FedSOL-rho1", {}, final=0.6, config=config, record=False)
    for summary in (tmp_path / "t").glob("*/summary.json"):  # as fit writes it
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "method": summary.parent.name.split("-")[0]}))
    table = build(tmp_path / "t")
    assert table.headers[:3] == ["method", "rho", "final acc"]
    assert sorted(tuple(r[:2]) for r in table.rows) == [("FedAvg", "None"), ("FedProx", "None"), ("FedSOL", "1"),
                                                         ("FedSOL", "2")]
    # the legend names what varies and leaves out what a method does not have (was "FedAvg, None", "FedSOL, 2")
    assert sorted(table.curves) == ["FedAvg", "FedProx", "FedSOL, rho=1", "FedSOL, rho=2"]


def test_curves_go_to_a_wandb_report_run_when_online(tmp_path, monkeypatch):
    """With W&B online, `report --curves` also logs a run of its own (job_type report) holding the
    learning curves as a native line plot (the mean over seeds per row), the PNG and the table.
    (Online is simulated: the run is written offline, as W&B then uploads it.)"""
    import fl_lightning.report as report_module
    from fl_lightning.loggers import offline_records

    methods_with_curves(tmp_path / "t")
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, out, err = report(str(tmp_path / "t"), "--curves")
    assert code == 0 and not (tmp_path / "t" / "wandb").exists()  # offline: the PNG only
    monkeypatch.setattr(report_module, "wandb_online", lambda: True)
    code, out, err = report(str(tmp_path / "t"), "--curves")
    assert code == 0, err
    files = sorted((tmp_path / "t").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = list(offline_records(files[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.job_type == "report" and run.display_name == "report/t"
    (row,) = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
              for r in records if r.WhichOneof("record_type") == "history"]
    assert json.loads(row["report/curves_table/_type"]) == "table-file"
    assert json.loads(row["report/curves_table/nrows"]) == 3 * 5  # three rows x five rounds
    assert json.loads(row["report/curves_png/_type"]) == "image-file"
    assert json.loads(row["report/table/nrows"]) == 3
    table = json.loads((files[0].parent / "files" / json.loads(row["report/curves_table/path"])).read_text())
    assert table["columns"] == ["step", "lineKey", "lineVal"]
    fedsol = [(x, y) for x, line, y in table["data"] if line == "FedSOL"]
    assert fedsol == [(r, pytest.approx(100 * (0.70 - 0.05 * (5 - r)))) for r in range(1, 6)]  # mean of 3 seeds


@pytest.mark.parametrize("text, message", [
    ("paper: x\npublished: {metric: final_acc, entries: [\n", r"not valid YAML at line 3 \("),
    ("- a\n- b\n", r"the file holds a list, not a mapping; expected a paper table with `published: "),
    ("published: {metric: final_acc, entries: [{match: {seed_everything: 0}, acc: ninety}]}\n",
     r"published entry 1: acc must be a number \(percent\) or null, got 'ninety'"),
    ("published: {entries: [{match: {seed_everything: 0}, acc: 50.0, std: [1]}]}\n",
     r"published entry 1: std must be a number \(percent\) or null, got \[1\]"),
    ("published: {entries: [7]}\n", r"published entry 1 must be a mapping"),
])
def test_a_malformed_compare_table_is_one_line(sweep_dir, tmp_path, text, message):
    """Bad YAML, a top-level list and a non-numeric `acc` were tracebacks (the last one after the
    table had been printed)."""
    import re

    table = tmp_path / "table.yaml"
    table.write_text(text)
    code, out, err = report(str(sweep_dir), "--compare", str(table))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"^error: --compare {re.escape(str(table))}: {message}", err), err


def test_a_record_with_a_non_integer_index_is_read_as_without_one(tmp_path):
    """`index: "first"` in one sweep record: sorting the runs compared it with the others' numbers."""
    d = tmp_path / "s"
    make_run(d, "seed=0", {"seed_everything": 0}, final=0.5)
    make_run(d, "seed=1", {"seed_everything": 1}, final=0.7)
    record = d / ".sweep" / "seed=1.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "index": "first"}))
    code, out, err = report(str(d))
    assert code == 0 and "Traceback" not in err, err
    assert "| X | 60.00 ± 10.00 | 60.00 ± 10.00 | 2 |" in out  # both runs, one row


def test_csv_into_a_missing_directory_creates_it_and_onto_a_directory_is_one_line(sweep_dir, tmp_path):
    """Both were tracebacks (open() of the path)."""
    target = tmp_path / "new" / "deeper" / "table.csv"
    code, out, err = report(str(sweep_dir), "--csv", str(target))
    assert code == 0 and target.is_file() and f"(CSV: {target})" in out, err
    code, out, err = report(str(sweep_dir), "--csv", str(tmp_path))
    assert code == 1 and "| FedAvg |" in out and "Traceback" not in err
    assert err.strip() == f"error: could not write {tmp_path} (Is a directory); the table above is complete; give " \
                          f"--csv <a writable path>"


def test_a_damaged_or_interrupted_run_is_named_with_what_to_do(sweep_dir):
    """A truncated summary.json and an interrupted run were both just "unfinished"."""
    (sweep_dir / "FedAvg-2" / "summary.json").write_text('{"method": "FedAvg", "outc')
    interrupted = json.loads((sweep_dir / "SCAFFOLD-0" / "summary.json").read_text())
    interrupted.update(outcome="interrupted", finished=False)
    (sweep_dir / "SCAFFOLD-0" / "summary.json").write_text(json.dumps(interrupted))
    code, out, err = report(str(sweep_dir))
    assert code == 0, err
    assert ("- FedAvg-2: unfinished (its summary.json cannot be read: the same fit command with --ckpt_path last "
            "writes it again)") in out
    assert "- SCAFFOLD-0: unfinished (interrupted: resume with --ckpt_path last)" in out
