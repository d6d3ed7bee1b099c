"""`fl-lightning report` counts each run once and only runs whose records are whole: a copied run
directory (or the same command run into a second folder) is one seed, not two; a run whose
metrics.csv is cut, empty, short, unparsable or says otherwise than its summary.json is named and
left out of every number. Real run directories (two tiny fits, made once), damaged as disks and
users damage them, and the report run as a user runs it."""

import csv
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_outcomes import TINY, env
from test_report import make_run, methods_with_curves, table_cells

HINT = "(a damaged run's fit command, run again with --ckpt_path last, writes its records again from its checkpoint)"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fl_lightning.cli", *args], env=env(), cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """Two seeds of one tiny FedAvg setting, 2 rounds each, as fit lays them out: <dir>/seed=<n>."""
    top = tmp_path_factory.mktemp("fitted")
    for seed in (0, 1):
        done = cli("fit", *TINY, "--trainer.max_epochs", "2", "--seed_everything", str(seed),
                   "--trainer.default_root_dir", str(top / f"seed={seed}"))
        assert done.returncode == 0, done.stderr[-3000:]
    return top


def runs_of(fitted: Path, tmp_path: Path) -> Path:
    top = tmp_path / "runs"
    for run in fitted.iterdir():
        shutil.copytree(run, top / run.name)
    return top


def figures(run: Path) -> dict[str, float]:
    """A run's final and best accuracy and its last-2 mean, in percent, read here independently of report."""
    summary = json.loads((run / "summary.json").read_text())
    with open(run / "metrics.csv", newline="") as f:
        accs = [float(r["global/test_acc"]) for r in csv.DictReader(f)]
    return {"final": 100 * summary["final_acc"], "best": 100 * summary["best_acc"],
            "last2": 100 * statistics.mean(accs[-2:])}


def cell(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}"


def csv_rows(path: Path) -> tuple[list[dict], list[dict]]:
    """The report CSV's table rows and its rows of runs left out (a `note`)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if not r["note"]], [r for r in rows if r["note"]]


@pytest.mark.parametrize("copy, how", [("seed=0-again", "copied"), ("a-copy", "copied"),
                                       ("seed=0-again", "the same command into another folder")])
def test_a_copied_run_is_one_seed_and_named(fitted, tmp_path, copy, how):
    """Three directories, two seeds: was `| FedAvg | ... | 3 |`, the copy's seed weighed twice in
    the mean and the std. Of the two copies the first by path counts, whichever was made first."""
    top = runs_of(fitted, tmp_path)
    shutil.copytree(top / "seed=0", top / copy)
    if how != "copied":  # what fit writes into the options that only say where a run is stored
        config = (top / copy / "config.yaml").read_text()
        (top / copy / "config.yaml").write_text(config.replace(str(fitted / "seed=0"), str(top / copy)))
    done = cli("report", str(top))
    assert done.returncode == 0, done.stderr
    seeds = [figures(top / "seed=0"), figures(top / "seed=1")]
    assert table_cells(done.stdout)[1:] == [["FedAvg", cell([s["final"] for s in seeds]),
                                             cell([s["best"] for s in seeds]), "2"]]
    counted, left_out = sorted(["seed=0", copy])
    assert f"- {left_out}: duplicate of {counted} (the same config.yaml and seeds), left out" in done.stdout
    table, notes = csv_rows(top / "report.csv")
    assert [(r["seeds"], r["runs"]) for r in table] == [("2", f"{counted} seed=1")]
    assert [(r["runs"], r["note"]) for r in notes] == [
        (left_out, f"duplicate of {counted} (the same config.yaml and seeds), left out")]


def cut_inside_the_last_accuracy(metrics: Path) -> str:
    text = metrics.read_text()
    header, *lines = text.splitlines()
    column = header.split(",").index("global/test_acc")
    cells = lines[-1].split(",")
    kept = ",".join(cells[:column] + [cells[column][:4]])  # 0.1582... -> 0.15
    metrics.write_text(text[:text.rindex(lines[-1])] + kept)
    return "metrics.csv's last line is cut short (it has no line end)"


def cut_at_the_end_then_a_line_end(metrics: Path) -> str:
    text = metrics.read_text()
    last = text.rstrip("\n").rsplit(",", 1)[1]
    metrics.write_text(text.rstrip("\n")[:-3] + "\n")  # the last number (train/loss) loses 3 digits
    return f"metrics.csv's last row has train/loss {float(last[:-3])!r}, summary.json's last round {float(last)!r}"


def emptied(metrics: Path) -> str:
    metrics.write_text("")
    return "metrics.csv is empty"


def missing(metrics: Path) -> str:
    metrics.unlink()
    return "metrics.csv is missing"


def without_its_last_round(metrics: Path) -> str:
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:-1]))
    return "metrics.csv is short: it holds 1 round, summary.json records 2 completed"


def a_word_for_a_number(metrics: Path) -> str:
    header, first, *rest = metrics.read_text().splitlines(keepends=True)
    column = header.split(",").index("global/test_acc")
    cells = first.split(",")
    cells[column] = "n/a"
    metrics.write_text("".join([header, ",".join(cells), *rest]))
    return "metrics.csv line 2: global/test_acc is 'n/a', not a number"


def an_edited_summary(metrics: Path) -> str:
    path = metrics.with_name("summary.json")
    summary = json.loads(path.read_text())
    acc = summary["final_acc"]
    path.write_text(json.dumps({**summary, "final_acc": 0.99}))
    return f"summary.json's final_acc is 0.99 (round 2), metrics.csv's global/test_acc gives {acc!r} (round 2)"


@pytest.mark.parametrize("damage", [cut_inside_the_last_accuracy, cut_at_the_end_then_a_line_end, emptied, missing,
                                    without_its_last_round, a_word_for_a_number, an_edited_summary])
def test_a_run_with_damaged_records_is_named_and_left_out_of_every_number(fitted, tmp_path, damage):
    """Was a number with rc 0 and no word, the damaged seed still counted: a cut last row gave
    another last-2 mean, an emptied file a cell of one seed labelled 2 seeds. Now the table, the
    seed count and the paper comparison are seed 0's alone, and seed 1 is named with the reason."""
    top = runs_of(fitted, tmp_path)
    reason = damage(top / "seed=1" / "metrics.csv")
    paper = tmp_path / "paper.yaml"
    paper.write_text(yaml.safe_dump({"paper": "P", "table": "T", "published": {"metric": "final_acc", "entries": [
        {"match": {"method": "FedAvg"}, "acc": 10.0}]}}))
    done = cli("report", str(top), "--metric", "last_k_mean", "--last-k", "2", "--compare", str(paper))
    assert done.returncode == 0, done.stderr
    ours = figures(fitted / "seed=0")
    header, *body = table_cells(done.stdout)
    assert header == ["method", "final acc", "best acc", "seeds", "last-2 mean acc"]
    assert body == [["FedAvg", f"{ours['final']:.2f} (n=1)", f"{ours['best']:.2f} (n=1)", "1",
                     f"{ours['last2']:.2f} (n=1)"]]
    notes = done.stdout.split("\n\n")[0].splitlines()[3:]
    assert notes == [f"- seed=1: damaged, left out: {reason}", HINT]
    assert f"| method=FedAvg | final_acc | {ours['final']:.2f} (n=1) | 10.00 | {ours['final'] - 10:+.2f} |" \
        in done.stdout
    table, left_out = csv_rows(top / "report.csv")
    assert [(r["seeds"], r["runs"]) for r in table] == [("1", "seed=0")]
    assert float(table[0]["last_k_mean_mean"]) == pytest.approx(ours["last2"], abs=1e-4)
    assert [(r["runs"], r["note"]) for r in left_out] == [("seed=1", f"damaged, left out: {reason}")]


def test_every_finished_run_damaged_is_one_line_and_exit_2(tmp_path):
    make_run(tmp_path / "t", "seed=0", {"seed_everything": 0}, final=0.4)
    (tmp_path / "t" / "seed=0" / "metrics.csv").write_text("")
    done = cli("report", str(tmp_path / "t"))
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: report {tmp_path / 't'}: the records of every finished run below it are "
                                  f"damaged (seed=0: metrics.csv is empty); a run's fit command again with "
                                  f"--ckpt_path last writes them again from its checkpoint")


def test_a_damaged_run_is_out_of_the_baseline_difference_and_the_curves(tmp_path):
    """FedSOL's seed 2 cut short: the paired interval is over seeds 0 and 1 (was n=3), and the
    curves (the PNG, the W&B plot) average two runs."""
    from scipy import stats

    from fl_lightning.report import build

    top = tmp_path / "t"
    methods_with_curves(top)
    text = (top / "FedSOL-2" / "metrics.csv").read_text()
    (top / "FedSOL-2" / "metrics.csv").write_text(text[:-3])
    done = cli("report", str(top), "--baseline", "FedAvg", "--curves")
    assert done.returncode == 0, done.stderr
    header, *body = table_cells(done.stdout)
    fedsol = next(r for r in body if r[0] == "FedSOL")
    # FedSOL 60, 70 against FedAvg 50, 65: differences 10 and 5 points
    half = stats.t.ppf(0.975, 1) * statistics.stdev([10, 5]) / 2**0.5
    assert fedsol[1:4] == ["65.00 ± 5.00", "65.00 ± 5.00", "2"]
    assert fedsol[-1] == (f"+7.50 [{7.5 - half:+.2f}, {7.5 + half:+.2f}] "
                          "(paired t, n=2: fewer than 3 seeds, not to be trusted)")
    assert "- FedSOL-2: damaged, left out: metrics.csv's last line is cut short (it has no line end)" in done.stdout
    assert len(build(top).curves["FedSOL"]) == 2


def test_a_cell_over_fewer_runs_than_the_row_says_so(tmp_path):
    """Two seeds, the personalised accuracy recorded by one: the cell is that one run's, and says
    n=1 beside the row's 2 seeds (it read as a mean over 2)."""
    m = "fl_lightning.methods.FedAvg"
    make_run(tmp_path / "t", "seed=0", {"model.class_path": m, "seed_everything": 0}, final=0.5,
             last={"personal/ft5_acc_mean": 0.85})
    make_run(tmp_path / "t", "seed=1", {"model.class_path": m, "seed_everything": 1}, final=0.7)
    done = cli("report", str(tmp_path / "t"))
    assert done.returncode == 0, done.stderr
    assert table_cells(done.stdout)[1:] == [["FedAvg", "60.00 ± 10.00", "60.00 ± 10.00", "2", "85.00 (n=1)"]]
