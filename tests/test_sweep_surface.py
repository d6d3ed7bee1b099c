"""What a researcher sees of `fl-lightning sweep` before any run starts: the answers that need no
run (W&B offline, nothing left to run) come without importing Lightning, run directories are named
by what varies, and a sweep whose runs an earlier version named otherwise still skips and resumes
them."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fl_lightning import sweep
from fl_lightning.cli import main

REPO = Path(__file__).resolve().parents[1]
COMMAND = ["${env}", "fl-lightning", "fit", "--config", str(REPO / "configs/settings/mnist5k.yaml"),
           "--data.dataset=digits", "--model.init_args.model=mlp", "${args}"]
# The example: 2 methods x 2 seeds, three single-valued parameters.
TWO_BY_TWO = {
    "config": {"values": [str(REPO / "configs/methods/fedsol/fedavg.yaml"),
                          str(REPO / "configs/methods/fedsol/fedsol.yaml")]},
    "seed_everything": {"values": [0, 1]},
    "trainer.max_epochs": {"value": 3},
    "data.num_clients": {"values": [20]},
    "data.local_epochs": {"value": 1},
}
# The same runs as the sweep code before names left out single-valued parameters named them.
OLD_NAMES = [f"config={m},seed={s},max_epochs=3,num_clients=20,local_epochs=1"
             for m in ("fedavg", "fedsol") for s in (0, 1)]


def write_spec(path: Path, parameters: dict, method: str = "grid", **extra) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "method": method, "parameters": parameters,
                                    "command": COMMAND, **extra}, sort_keys=False))
    return path


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(args)
    return stop.value.code, out.getvalue(), err.getvalue()


def run_without_lightning(args: list[str], tmp_path: Path, **env) -> tuple[list[str], str, str]:
    """`main(args)` in a fresh interpreter: its exit code, whether it imported lightning and torch,
    then its stdout and stderr."""
    code = ("import sys\nfrom fl_lightning.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as stop:\n    print(stop.code, 'lightning' in sys.modules, 'torch' in sys.modules)")
    environ = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "NETRC")}
    environ.update(HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join([str(REPO), environ.get("PYTHONPATH", "")]),
                   **env)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=environ)
    lines = done.stdout.splitlines()
    return lines[-1].split() if lines else [], "\n".join(lines[:-1]), done.stderr


def record_as_made_by_the_old_sweep(sweep_dir: Path, name: str, index: int, params: dict, status: str,
                                    exit_code: int | None) -> None:
    """`.sweep/<name>.json` with the fields LocalSweep.write_record wrote."""
    (sweep_dir / ".sweep").mkdir(parents=True, exist_ok=True)
    command = ["fl-lightning", "fit", "--config", "x.yaml", f"--trainer.default_root_dir={sweep_dir / name}"]
    (sweep_dir / ".sweep" / f"{name}.json").write_text(json.dumps({
        "name": name, "index": index, "params": params, "command": command, "status": status, "attempts": 1,
        "worker": 0, "started": 1700000000.0, "exit_code": exit_code, "error": None, "ended": 1700000100.0},
        indent=1))


def finish(run_dir: Path, outcome: str = "finished") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"outcome": outcome, "finished": outcome != "diverged"}))


# ---------------------------------------------------------------------------------------------
# Answers that need no run


def test_a_wandb_sweep_while_offline_is_one_line_before_lightning_is_imported(tmp_path):
    status, out, err = run_without_lightning(["sweep", "configs/sweeps/fedsol_rho.yaml"], tmp_path,
                                             WANDB_MODE="offline")
    assert status == ["2", "False", "False"], (out, err)
    assert err == ("error: a W&B sweep needs W&B online (wandb login or WANDB_API_KEY, and WANDB_MODE not "
                   "offline); without it run the sweep here with --local\n")


def test_a_sweep_whose_runs_are_all_over_says_so_in_one_line_before_lightning_is_imported(tmp_path):
    spec = write_spec(tmp_path / "s.yaml", {"seed_everything": {"values": [0, 1, 2]}})
    root = tmp_path / "runs"
    for seed, outcome in enumerate(("finished", "diverged", "failed")):
        finish(root / "s" / f"seed={seed}", outcome)
    args = ["sweep", str(spec), "--local", "--root", str(root)]
    status, out, err = run_without_lightning(args, tmp_path)
    assert status == ["0", "False", "False"], (out, err)
    assert out == (f"sweep s: nothing left to run: all 3 runs are over (1 finished, 1 diverged, 1 failed) "
                   f"in {root / 's'}")
    assert err == "" and not (root / "s" / ".sweep").exists()  # no worker started, nothing recorded
    status, out, err = run_without_lightning([*args, "--dry-run"], tmp_path)
    assert status == ["0", "False", "False"], (out, err)
    assert out.splitlines() == ["# finished: seed=0", "# diverged: seed=1", "# failed: seed=2"]
    # One run left: its command is parsed and printed as before.
    (root / "s" / "seed=2" / "summary.json").write_text(json.dumps({"outcome": "running"}))
    code, out, _ = run_cli([*args, "--dry-run"])
    lines = out.splitlines()
    assert code == 0 and lines[:2] == ["# finished: seed=0", "# diverged: seed=1"]
    assert lines[2].startswith("fl-lightning fit --config") and "--overwrite=true" in lines[2]


# ---------------------------------------------------------------------------------------------
# Run names


def test_run_names_carry_only_the_parameters_that_vary(tmp_path):
    spec = sweep.load_spec(write_spec(tmp_path / "m.yaml", TWO_BY_TWO))
    runs = sweep.plan(spec, tmp_path / "runs", validate=False)
    assert [r.name for r in runs] == ["config=fedavg,seed=0", "config=fedavg,seed=1", "config=fedsol,seed=0",
                                      "config=fedsol,seed=1"]
    # the single-valued settings still reach every command
    assert all({"--trainer.max_epochs=3", "--data.num_clients=20", "--data.local_epochs=1"} <= set(r.args)
               for r in runs)
    assert runs[2].args[-1] == f"--trainer.default_root_dir={tmp_path / 'runs' / 'm' / 'config=fedsol,seed=0'}"
    # a random search: numbered, then its drawn values; keys told apart from every swept key
    spec = sweep.load_spec(write_spec(tmp_path / "r.yaml", {
        "data.alpha": {"distribution": "uniform", "min": 0.1, "max": 1.0},
        "model.init_args.alpha": {"value": 0.5}, "trainer.max_epochs": {"values": [2]}}, method="random", run_cap=2))
    draws = sweep.expand(spec)
    assert sweep.run_names(spec, draws) == [f"r{i:03d},data.alpha={d['data.alpha']:g}" for i, d in enumerate(draws)]
    # nothing varies: the one run is named by all its settings
    spec = sweep.load_spec(write_spec(tmp_path / "one.yaml", {"trainer.max_epochs": {"value": 2},
                                                              "seed_everything": {"values": [0]}}))
    assert sweep.run_names(spec, sweep.expand(spec)) == ["max_epochs=2,seed=0"]


def test_a_sweep_started_with_the_old_names_still_skips_and_resumes_its_runs(tmp_path, capsys):
    """A sweep directory as the sweep code wrote it when names carried every parameter: two runs
    finished, one with a checkpoint, one killed before its first round; the fourth never started."""
    spec = sweep.load_spec(write_spec(tmp_path / "m.yaml", TWO_BY_TWO))
    root = tmp_path / "runs"
    d = root / "m"
    params = sweep.expand(spec)
    finish(d / OLD_NAMES[0])
    record_as_made_by_the_old_sweep(d, OLD_NAMES[0], 0, params[0], "finished", 0)
    (d / OLD_NAMES[1] / "checkpoints").mkdir(parents=True)
    (d / OLD_NAMES[1] / "checkpoints" / "last.ckpt").write_bytes(b"x")
    record_as_made_by_the_old_sweep(d, OLD_NAMES[1], 1, params[1], "running", None)
    (d / OLD_NAMES[2]).mkdir()
    (d / OLD_NAMES[2] / "config.yaml").write_text("{}")
    record_as_made_by_the_old_sweep(d, OLD_NAMES[2], 2, params[2], "crashed", 1)

    runs = sweep.plan(spec, root, validate=False)
    assert [r.name for r in runs] == [*OLD_NAMES[:3], "config=fedsol,seed=1"]
    assert runs[1].args[-1] == f"--trainer.default_root_dir={d / OLD_NAMES[1]}"
    local = sweep.LocalSweep(spec, runs, root, workers=[])
    assert [local.command(r)[1] for r in runs] == ["finished", "resume", "restart", "new"]
    assert local.record_path(runs[1]) == d / ".sweep" / f"{OLD_NAMES[1]}.json"

    for name in OLD_NAMES[1:3]:
        finish(d / name)
    finish(d / "config=fedsol,seed=1")  # a run the new names started
    code, out, err = run_cli(["sweep", str(tmp_path / "m.yaml"), "--local", "--root", str(root)])
    assert (code, err) == (0, "")
    assert out == f"sweep m: nothing left to run: all 4 runs are over (4 finished) in {d}\n"


def test_a_recorded_name_is_kept_only_where_it_is_unambiguous():
    params = [{"a": 1}, {"a": 2}, {"a": 2}]
    new = ["a=1", "000,a=2", "001,a=2"]
    recorded = {sweep.canonical({"a": 1}): ["a=1,b=0"], sweep.canonical({"a": 2}): ["a=2,b=0"]}
    # a=2 is planned twice: which old run is which is unknown, so both start under their new names
    assert sweep.keep_recorded_names(new, params, recorded) == ["a=1,b=0", "000,a=2", "001,a=2"]
    # a run recorded under its new name keeps it, whatever else was recorded with its parameters
    recorded[sweep.canonical({"a": 1})].append("a=1")
    assert sweep.keep_recorded_names(new, params, recorded)[0] == "a=1"
