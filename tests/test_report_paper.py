"""`fl-lightning report` as a paper's table: columns and legends carry only what varies between
rows, named, the constant settings in one line under the table; a one-seed cell says n=1, an
interval over fewer than 3 seeds says it is not to be trusted; a table mixing a sweep's runs
with a plain fit fills every cell the run has a value for and names the sweep's runs by their
setting; `--compare` matches a plain run by its resolved config; `--format latex` writes the
booktabs table with the best of each column in bold. Real runs where the user meets it (a local
sweep and a demo fit, made once), hand-made run directories where the numbers must be exact."""

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_outcomes import REPO, env
from test_report import make_run, methods_with_curves, report, table_cells

S, M = REPO / "configs" / "settings", REPO / "configs" / "methods" / "fedsol"
QUICK = ["--data.dataset=digits", "--model.init_args.model=mlp", "--data.min_size=5",
         "--trainer.enable_progress_bar=false", "--analysis.partition=false"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fl_lightning.cli", *args], env=env(), cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory) -> Path:
    """`<top>/runs` after `fl-lightning sweep my_sweep.yaml --local` (FedAvg and FedSOL, seeds 0
    and 1, three single-valued options; 2 rounds) and the demo fit `runs/mnist5k/fedsol` with the
    same options by hand (it evaluates the local models, as fit does unless told otherwise)."""
    top = tmp_path_factory.mktemp("user")
    spec = {"name": "my_sweep", "method": "grid", "parameters": {
        "config": {"values": [str(M / "fedavg.yaml"), str(M / "fedsol.yaml")]},
        "seed_everything": {"values": [0, 1]}, "trainer.max_epochs": {"value": 2},
        "data.num_clients": {"value": 10}, "data.local_epochs": {"value": 1}},
        "command": ["${env}", "fl-lightning", "fit", "--config", str(S / "mnist5k.yaml"), *QUICK,
                    "--federation.eval_local_models=false", "${args}"]}
    (top / "my_sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    done = cli("sweep", "my_sweep.yaml", "--local", "--workers", "1", cwd=top)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = cli("fit", "--config", str(S / "mnist5k.yaml"), "--config", str(M / "fedsol.yaml"), *QUICK,
               "--trainer.max_epochs=2", "--data.num_clients=10", "--data.local_epochs=1", cwd=top)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (top / "runs" / "mnist5k" / "fedsol" / "summary.json").is_file()
    return top / "runs"


def final(run: Path) -> float:
    return 100 * json.loads((run / "summary.json").read_text())["final_acc"]


def best(run: Path) -> float:
    return 100 * json.loads((run / "summary.json").read_text())["best_acc"]


def cell(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}"


def sweep_run(runs: Path, method: str, seed: int) -> Path:
    return runs / "my_sweep" / f"config={method},seed={seed}"  # only what varies names a sweep's run


def test_columns_and_legend_carry_what_varies_and_one_line_the_constants(user_runs):
    """Was `| method | config | max_epochs | num_clients | local_epochs | ...` (the config column
    repeating the method, a column per single-valued option) and the legend `FedAvg, fedavg, 2,
    10, 1`."""
    from fl_lightning.report import build

    done = cli("report", str(user_runs / "my_sweep"), cwd=user_runs.parent)
    assert done.returncode == 0, done.stderr
    header, *body = table_cells(done.stdout)
    assert header == ["method", "final acc", "best acc", "seeds"]
    fedavg = [final(sweep_run(user_runs, "fedavg", s)) for s in (0, 1)]
    assert body[0] == ["FedAvg", cell(fedavg), body[0][2], "2"] and body[1][0] == "FedSOL"
    assert done.stdout.splitlines()[4] == "All rows: max_epochs=2, num_clients=10, local_epochs=1"
    assert list(build(user_runs / "my_sweep").curves) == ["FedAvg", "FedSOL"]
    with open(user_runs / "my_sweep" / "report.csv", newline="") as f:  # the CSV keeps every parameter
        rows = list(csv.DictReader(f))
    assert [(r["config"], r["max_epochs"], r["num_clients"], r["local_epochs"]) for r in rows] == [
        ("fedavg", "2", "10", "1"), ("fedsol", "2", "10", "1")]


def test_a_mixed_table_fills_every_cell_and_names_the_setting(user_runs):
    """The sweep's runs beside the demo fit: was `| FedAvg | my_sweep | fedavg |  | ...` and
    `| FedSOL | mnist5k |  | True | ...` (blank where the run has a value, and the sweep's runs in
    a setting named after the sweep, though all five ran configs/settings/mnist5k.yaml)."""
    done = cli("report", str(user_runs), cwd=user_runs.parent)
    assert done.returncode == 0, done.stderr
    header, *body = table_cells(done.stdout)
    assert header == ["method", "eval_local_models", "final acc", "best acc", "seeds"]
    demo = final(user_runs / "mnist5k" / "fedsol")
    assert [r[:2] for r in body] == [["FedAvg", "False"], ["FedSOL", "False"], ["FedSOL", "True"]]
    assert body[2][2:] == [f"{demo:.2f} (n=1)", f"{best(user_runs / 'mnist5k' / 'fedsol'):.2f} (n=1)", "1"]
    assert "All rows: max_epochs=2, num_clients=10, local_epochs=1" in done.stdout


def test_compare_matches_a_plain_run_by_its_resolved_config(user_runs):
    """`report runs/mnist5k --compare configs/tables/demo_mnist5k.yaml` said `no finished run` for
    the FedSOL entry (`config: configs/methods/fedsol/fedsol.yaml`), though runs/mnist5k/fedsol is
    that method file over that setting, finished."""
    table = REPO / "configs" / "tables" / "demo_mnist5k.yaml"
    done = cli("report", str(user_runs / "mnist5k"), "--compare", str(table), cwd=user_runs.parent)
    assert done.returncode == 0, done.stderr
    demo = final(user_runs / "mnist5k" / "fedsol")
    compared = [line for line in done.stdout.split("Compared with")[1].splitlines() if line.startswith("| config=")]
    assert compared == [
        "| config=fedavg | final_acc | no finished run | 96.11 ± 0.19 | — |",
        "| config=fedprox | final_acc | no finished run | 96.05 ± 0.13 | — |",
        "| config=scaffold | final_acc | no finished run | 94.18 ± 0.32 | — |",
        f"| config=fedsol | final_acc | {demo:.2f} (n=1) | 97.44 ± 0.11 | {demo - 97.44:+.2f} |"]


def test_a_one_seed_cell_is_its_value_and_n1(tmp_path):
    """Was `50.00 ± 0.00`: a spread of zero that nothing measured."""
    m = "fl_lightning.methods."
    make_run(tmp_path / "t", "a-0", {"model.class_path": m + "FedAvg", "seed_everything": 0}, final=0.891, best=0.9)
    make_run(tmp_path / "t", "b-0", {"model.class_path": m + "FedSOL", "seed_everything": 0}, final=0.5)
    make_run(tmp_path / "t", "b-1", {"model.class_path": m + "FedSOL", "seed_everything": 1}, final=0.7)
    code, out, err = report(str(tmp_path / "t"))
    assert code == 0, err
    assert table_cells(out)[1:] == [["FedAvg", "89.10 (n=1)", "90.00 (n=1)", "1"],
                                    ["FedSOL", "60.00 ± 10.00", "60.00 ± 10.00", "2"]]


def test_an_interval_over_fewer_than_3_seeds_is_flagged(tmp_path):
    """FedProx against FedAvg over 2 seeds gave an interval of ± several points without a word."""
    methods_with_curves(tmp_path / "t")
    code, out, err = report(str(tmp_path / "t"), "--baseline", "FedAvg")
    assert code == 0, err
    cells = {r[0]: r[-1] for r in table_cells(out)[1:]}
    assert cells["FedProx"].endswith("(Welch t, n=2: fewer than 3 seeds, not to be trusted)")
    assert cells["FedSOL"].endswith("(paired t, n=3)")
    assert ("(an interval over fewer than 3 seeds estimates the spread from one or two values: neither its width "
            "nor its sign can be trusted; run 3 or more seeds)") in out.split("\n\n")[0]
    with open(tmp_path / "t" / "report.csv", newline="") as f:
        assert {r["model"]: r["diff_n"] for r in csv.DictReader(f)} == {"FedSOL": "3", "FedAvg": "", "FedProx": "2"}


def test_latex_is_the_papers_table(tmp_path):
    """`--format latex` did not exist: booktabs, mean $\\pm$ std, the best of each column in bold
    (per setting), escaped; the constants and the notes as comments; report.tex beside the CSV."""
    m = "fl_lightning.methods."
    for method, finals in {"FedAvg": (0.50, 0.70), "FedSOL": (0.60, 0.80)}.items():
        for seed, acc in enumerate(finals):
            make_run(tmp_path / "t", f"{method}-{seed}", {"model.class_path": m + method, "seed_everything": seed,
                                                          "data.local_epochs": 5}, final=acc, best=0.85)
    make_run(tmp_path / "t", "FedProx-0", {"model.class_path": m + "FedProx", "seed_everything": 0,
                                           "data.local_epochs": 5}, final=0.1, finished=False, status="running")
    code, out, err = report(str(tmp_path / "t"), "--format", "latex")
    assert code == 0, err
    expected = "\n".join([
        r"\begin{tabular}{lrrr}",
        r"\toprule",
        r"model & final acc & best acc & seeds \\",
        r"\midrule",
        r"FedAvg & 60.00 $\pm$ 10.00 & \textbf{85.00 $\pm$ 0.00} & 2 \\",
        r"FedSOL & \textbf{70.00 $\pm$ 10.00} & \textbf{85.00 $\pm$ 0.00} & 2 \\",
        r"\bottomrule",
        r"\end{tabular}",
        r"% All rows: local\_epochs=5",
    ])
    assert out.startswith(expected + "\n"), out
    assert "% - FedProx-0: unfinished\n" in out
    assert (tmp_path / "t" / "report.tex").read_text() == expected + "\n"
    assert (tmp_path / "t" / "report.csv").is_file()


def test_a_sweep_run_that_never_started_does_not_make_every_option_a_column(tmp_path):
    """A recorded sweep run without a directory (crashed at start-up) has no config.yaml: every
    option of a plain run beside it read as differing (`| X | digits | 0.1 | ... |`)."""
    d = tmp_path / "runs"
    config = {"seed_everything": 0, "data": {"dataset": "digits", "alpha": 0.1}}
    make_run(d / "mnist5k", "fedavg", {}, final=0.5, config=config, record=False)
    (d / "s" / ".sweep").mkdir(parents=True)
    (d / "s" / ".sweep" / "rho=1.json").write_text(json.dumps(
        {"name": "rho=1", "index": 0, "params": {"model.init_args.rho": 1.0}, "status": "crashed", "error": "boom"}))
    code, out, err = report(str(d))
    assert code == 0, err
    assert table_cells(out) == [["method", "final acc", "best acc", "seeds"], ["X", "50.00 (n=1)", "50.00 (n=1)", "1"]]
    assert "- s/rho=1: crashed: boom" in out
